"""The operator and a real node agent together: Kopf against the kube emulator, the agent served by uvicorn
on 127.0.0.1 and publishing its own TensileNode there. The test plays the runtime hook (AgentClient, with
the token and address the operator put in the pod's environment) and the kubelet."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading

import pytest
from tests.support.agent_harness import ThreadedAgent, agent_jobs
from tests.support.operator_harness import OPERATOR_ACCOUNT, Cluster, cluster, phase, pod_env, start_operator
from tests.support.operator_harness import trainingjob

from tensile.agent_client import AgentClient
from tensile_agent.auth import TokenReviewer
from tensile_operator.forecasting import Forecaster
from tensile_operator.pods import pod_name
from tensile.plan import native_plan_events
from tensile.workload import Workload

pytestmark = pytest.mark.cluster
MIB = 2**20


@contextlib.asynccontextmanager
async def agent_and_operator(tmp_path, forecaster: Forecaster):  # type: ignore[no-untyped-def]
    """The emulated cluster, a real agent publishing node-a's TensileNode there, and the operator once it has (stopped
    at the end, also if the test did)."""
    async with cluster(tmp_path) as c:
        agent = ThreadedAgent(["a6000:8GiB"], cluster_api=c.custom_objects_api(), node="node-a",
                              authenticator=c.agent_authenticator())
        await asyncio.to_thread(agent.__enter__)
        op = None
        try:
            await c.wait(lambda: ((c.node("node-a") or {}).get("status") or {}).get("gpus"), 30, "the agent's TensileNode")
            assert c.node("node-a")["status"]["agentAddress"] == agent.url
            op = await start_operator(forecaster)
            yield c, agent, op
        finally:
            if op is not None:
                await op.stop()
            await asyncio.to_thread(agent.__exit__, None, None, None)


@pytest.fixture
def forecaster():  # type: ignore[no-untyped-def]
    """A forecast cache of each test's own, not the module's (conftest): these tests store and read profiles, which
    one cache would carry from test to test."""
    cache = Forecaster()
    yield cache
    cache.close()


def test_knobs_reach_the_agent_and_release_unregisters(tmp_path, forecaster, tiny_workload):
    workload = tiny_workload()

    async def hook_for(c, name: str) -> AgentClient:  # type: ignore[no-untyped-def]
        """Register the job as its hook would, from what the operator put in the pod."""
        pod = pod_name("default", name, c.job(name)["metadata"]["uid"])
        await c.wait(lambda: c.emu.get("v1/pods", "default", pod), 30, f"{name}'s pod")
        env = pod_env(c.emu.get("v1/pods", "default", pod)) | {"TENSILE_TOKEN_FILE": c.pod_token_file(c.emu.get("v1/pods", "default", pod))}
        hook = AgentClient.from_env(env, max_backoff=0.2)
        registered = await asyncio.to_thread(hook.register, workload=workload,
                                             memory_budget_bytes=int(env["TENSILE_MEMORY_BUDGET"]),
                                             activations_only=native_plan_events(env["TENSILE_PLAN_EVENTS"], workload.device))
        assert registered is not None and registered.gpu == env["TENSILE_GPU"]
        assert (await asyncio.to_thread(hook.wait_for_plan, 30)).status == "planned"
        return hook

    async def scenario() -> None:
        async with agent_and_operator(tmp_path, forecaster) as (c, agent, _):
            # 1. a job without a profile yet: admitted by its budget, registered by its hook
            await c.apply(trainingjob("first", None, profile="tiny-mlp", memoryBudget="256Mi"))
            hook = await hook_for(c, "first")
            assert pod_env(c.pods()[0])["TENSILE_AGENT"] == agent.url
            before = agent_jobs(agent.url)["default/first"]
            assert before["memory_budget_bytes"] == 256 * MIB

            # 2. annotations change the running job: the agent re-plans it under the new knobs
            await c.annotate("first", {"tensile.dev/memory-budget": "6Mi", "tensile.dev/max-swap-rate": "0.5"})
            await c.wait(lambda: agent_jobs(agent.url)["default/first"]["plan_version"] > before["plan_version"], 30,
                         "a new plan for the new knobs")
            after = agent_jobs(agent.url)["default/first"]
            assert after["memory_budget_bytes"] == 6 * MIB and after["max_swap_rate"] == 0.5
            plan, changed = await asyncio.to_thread(hook.poll)
            assert changed and hook.plan_version == after["plan_version"]
            def knobs_applied() -> dict:  # written once the agent answered: a moment after it re-planned
                return {x["type"]: x for x in c.job("first")["status"]["conditions"]}.get("KnobsApplied", {})

            await c.wait(lambda: knobs_applied().get("status") == "True", 30, "KnobsApplied")

            # 3. completion: the live workload becomes the profile, and the job leaves the agent
            pod = c.pods()[0]
            await c.set_pod_status(pod, {"phase": "Succeeded", "containerStatuses": [
                {"name": "train", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]})
            await c.wait(lambda: "default/first" not in agent_jobs(agent.url), 30, "unregistered on completion")
            assert phase(c.job("first")) == "Succeeded"
            assert forecaster.profiles.get("default", "tiny-mlp").signature == workload.signature

            # 4. the next job of that profile is forecast from it, and the operator registers it with the agent with
            #    that forecast before its hook runs: planned before its first iteration (TENSILE's cold start). Its
            #    hook finds the workload by the pod's TENSILE_SIGNATURE, and its own registration is the same one
            await c.apply(trainingjob("second", None, profile="tiny-mlp", memoryBudget="256Mi"))
            await c.wait(lambda: agent_jobs(agent.url).get("default/second", {}).get("plan_version", 0) >= 1, 30,
                         "the operator's registration of the forecast, planned")
            registered = agent_jobs(agent.url)["default/second"]
            assert (registered["signature"], registered["status"]) == (workload.signature, "planned"), registered
            pod = pod_name("default", "second", c.job("second")["metadata"]["uid"])
            await c.wait(lambda: c.emu.get("v1/pods", "default", pod), 30, "second's pod")
            env = pod_env(c.emu.get("v1/pods", "default", pod))
            env["TENSILE_TOKEN_FILE"] = c.pod_token_file(c.emu.get("v1/pods", "default", pod))  # the kubelet's projection
            fetched = await asyncio.to_thread(AgentClient.from_env(env).workload)
            assert env["TENSILE_SIGNATURE"] == fetched.signature == workload.signature
            await hook_for(c, "second")
            assert agent_jobs(agent.url)["default/second"]["plan_version"] == registered["plan_version"]  # not re-planned
            assert c.job("second")["status"]["forecast"]["source"] == "profile"
            await c.delete("second")
            await c.wait(lambda: "default/second" not in agent_jobs(agent.url) and c.job("second") is None, 30,
                         "unregistered on deletion")

    asyncio.run(scenario())


def test_knobs_changed_before_the_hook_registers_reach_the_agent_once_it_has(tmp_path, forecaster, tiny_workload):
    """A job's annotations can change while its pod starts, before its hook registers: the agent answers 404.
    Said as "no agent reachable" and never sent again, the knobs would miss the hook, which would register with its
    pod's environment and run under the old knobs."""
    workload = tiny_workload()

    async def scenario() -> None:
        async with agent_and_operator(tmp_path, forecaster) as (c, agent, _):
            await c.apply(trainingjob("early", None, profile="tiny-mlp", memoryBudget="256Mi"))
            await c.wait(lambda: c.pods(), 30, "the job's pod")
            await c.annotate("early", {"tensile.dev/max-swap-rate": "0.25"})

            def knobs_applied() -> dict:
                return {x["type"]: x for x in (c.job("early").get("status") or {}).get("conditions", [])}.get("KnobsApplied", {})

            await c.wait(lambda: knobs_applied().get("reason") == "WaitingForHook", 30, "the knobs waiting for the hook")
            await admitted_hook(c, "early", workload)
            await c.wait(lambda: agent_jobs(agent.url)["default/early"]["max_swap_rate"] == 0.25, 30, "the knobs sent again")
            await c.wait(lambda: knobs_applied().get("reason") == "Forwarded", 30, "the condition updated")

    asyncio.run(scenario())


class TokenReviewsAway:
    """The API server's TokenReviews, unanswered while `away` is set (the agent then refuses every call, 503)."""

    def __init__(self, api: object) -> None:
        self.api = api
        self.away = threading.Event()
        self.refused = 0

    def create_token_review(self, body: dict) -> object:
        if self.away.is_set():
            self.refused += 1
            raise ConnectionError("the API server does not answer")
        return self.api.create_token_review(body)  # type: ignore[attr-defined]


def restarted(c: Cluster, agent: ThreadedAgent, authenticator: TokenReviewer | None = None) -> ThreadedAgent:
    """`agent` stopped and node-a's agent started again at its address: a new process, a new epoch, no admissions."""
    agent.__exit__(None, None, None)
    return ThreadedAgent(["a6000:8GiB"], cluster_api=c.custom_objects_api(), node="node-a",
                         authenticator=authenticator or c.agent_authenticator(), port=agent.port).__enter__()


async def admitted_hook(c: Cluster, name: str, workload: Workload) -> AgentClient:
    """The job's hook, registered with the agent from what the operator put in its pod and with the pod's credential."""
    await c.wait(lambda: c.pods(), 30, f"{name}'s pod")
    env = pod_env(c.pods()[0]) | {"TENSILE_TOKEN_FILE": c.pod_token_file(c.pods()[0])}
    hook = AgentClient.from_env(env, max_backoff=0.2)
    assert await asyncio.to_thread(hook.register, workload=workload) is not None
    return hook


async def registered_again(hook: AgentClient, agent: ThreadedAgent, job: str) -> None:
    """The hook's next calls register it again with the restarted agent (each refused, 403 not_admitted, until the
    operator admits the job there)."""
    deadline = asyncio.get_running_loop().time() + 30
    while not (hook.registrations == 2 and job in agent_jobs(agent.url)):
        assert asyncio.get_running_loop().time() < deadline, f"not registered again: {hook.last_error}"
        await asyncio.to_thread(hook.poll)
        await asyncio.sleep(0.05)
    assert hook.last_error is None


def test_a_restarted_agent_has_its_jobs_admitted_again(tmp_path, forecaster, tiny_workload, caplog):
    """The agent keeps the operator's admissions in memory only: restarted, it refused the pods' registrations (403
    `not_admitted`) for good. Its new epoch in its TensileNode has the operator admit its jobs again (a re-admission
    that fails is made again at the TensileNode's next event), and the job's hook, registering again with its pod's
    credential, is taken."""
    workload = tiny_workload()

    async def scenario() -> None:
        async with agent_and_operator(tmp_path, forecaster) as (c, agent, _):
            await c.apply(trainingjob("steady", None, profile="tiny-mlp", memoryBudget="256Mi"))
            hook = await admitted_hook(c, "steady", workload)
            epoch = c.node("node-a")["status"]["agentEpoch"]

            # restarted while the API server does not answer its TokenReviews: the operator's admission is refused
            reviews = TokenReviewsAway(c.authentication_api())
            reviews.away.set()
            agent = await asyncio.to_thread(restarted, c, agent, TokenReviewer({OPERATOR_ACCOUNT}, api=reviews))
            try:
                await c.wait(lambda: c.node("node-a")["status"]["agentEpoch"] != epoch, 30, "the new epoch published")
                await c.wait(lambda: "admitting default/steady again failed" in caplog.text, 30, "the failure logged")
                assert reviews.refused and "default/steady" not in agent_jobs(agent.url)

                reviews.away.clear()  # answered again: the TensileNode's next event admits the job again
                await c.request("PATCH", "/apis/tensile.dev/v1alpha1/tensilenodes/node-a",
                                {"metadata": {"labels": {"example.com/touched": "yes"}}})
                await registered_again(hook, agent, "default/steady")
            finally:
                await asyncio.to_thread(agent.__exit__, None, None, None)

    asyncio.run(scenario())


def test_an_agent_restarted_while_the_operator_was_down_has_its_jobs_admitted_again(tmp_path, forecaster, tiny_workload):
    """A restarted operator does not make a running job's pod again (nor admit it then): the first epoch it sees of
    each agent has that agent's jobs admitted again, in case it restarted meanwhile."""
    workload = tiny_workload()

    async def scenario() -> None:
        async with agent_and_operator(tmp_path, forecaster) as (c, agent, op):
            await c.apply(trainingjob("steady", None, profile="tiny-mlp", memoryBudget="256Mi"))
            hook = await admitted_hook(c, "steady", workload)
            await c.set_pod_status(c.pods()[0], {"phase": "Running"})
            await c.wait(lambda: c.job("steady")["status"].get("podName"), 30, "the job running")
            epoch = c.node("node-a")["status"]["agentEpoch"]

            await op.stop()
            agent = await asyncio.to_thread(restarted, c, agent)
            try:
                await c.wait(lambda: c.node("node-a")["status"]["agentEpoch"] != epoch, 30, "the new epoch published")
                op = await start_operator(forecaster)
                try:
                    await registered_again(hook, agent, "default/steady")
                finally:
                    await op.stop()
            finally:
                await asyncio.to_thread(agent.__exit__, None, None, None)

    asyncio.run(scenario())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
