"""A node agent in a cluster's mode, attacked as a pod of another namespace would, on 127.0.0.1: its credentials are
service-account tokens verified with TokenReview against the Kubernetes emulator. Every attack is refused with 401,
403, 422 or 429, never a 5xx, and the victim's plan and budget stay as they were."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.agent_harness import ThreadedAgent, call
from tests.support.operator_harness import Cluster, cluster
from tensile.agent_client import AgentClient, credential_file
from tensile.workload_io import workload_to_dict
from tensile_agent.auth import RegistrationLimits, TokenReviewer

OPERATOR = "system:serviceaccount:tensile-system:tensile-operator"
VICTIM_TOKEN = "v" * 32  # the job token the operator derived for the victim
REFUSED = {401, 403, 422, 429}


@contextlib.asynccontextmanager
async def guarded_agent(tmp: Path, **config) -> AsyncIterator[tuple[Cluster, ThreadedAgent, str]]:  # type: ignore[no-untyped-def]
    """The emulator, an agent that verifies tokens with it, and the operator's token."""
    async with cluster(tmp) as c:
        reviewer = TokenReviewer({OPERATOR}, api=c.authentication_api())
        agent = ThreadedAgent(["a6000:8GiB"], authenticator=reviewer, **config)
        await asyncio.to_thread(agent.__enter__)
        try:
            yield c, agent, c.emu.issue_token("tensile-system", "tensile-operator")
        finally:
            await asyncio.to_thread(agent.__exit__, None, None, None)


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _admit(agent: ThreadedAgent, operator: str, namespace: str, job: str, pod: str, token: str,
           budget: int = 2**30) -> int:
    gpu = next(iter(agent.agent.inventory.gpus))
    status, _ = call(agent.url, "POST", "/v1/admissions", {"job": job, "namespace": namespace, "gpu": gpu, "pod": pod,
                                                           "token": token, "memory_budget_bytes": budget},
                     headers=_bearer(operator))
    return status


def _registration(namespace: str, job: str, workload: dict, **fields) -> dict:  # type: ignore[no-untyped-def]
    return {"job": job, "namespace": namespace, "workload": workload} | fields


def _victims_plan(agent: ThreadedAgent) -> tuple[int, int | None, list]:
    status, body = call(agent.url, "GET", "/v1/jobs/team-a/victim/plan", token=VICTIM_TOKEN)
    assert status == 200, body
    plan = body["plan"]  # type: ignore[index]
    return body["version"], plan["memory_budget_bytes"], plan["events"]  # type: ignore[index]


@pytest.mark.slow
def test_attacks_on_registration_are_refused_and_leave_the_victim_alone(tmp_path, tiny_workload):
    workload = workload_to_dict(tiny_workload())

    async def scenario() -> None:
        async with guarded_agent(tmp_path) as (c, agent, operator):
            # the victim: admitted by the operator, registered by its pod with the pod's projected token (a file)
            assert await asyncio.to_thread(_admit, agent, operator, "team-a", "victim", "victim-tensile", VICTIM_TOKEN) == 200
            token_file = tmp_path / "token"
            token_file.write_text(c.emu.issue_token("team-a", "default", pod="victim-tensile"))
            victim = AgentClient(agent.url, "team-a/victim", credential=credential_file(str(token_file)), max_backoff=0.2)
            registered = await asyncio.to_thread(victim.register, workload=tiny_workload(), memory_budget_bytes=2**30)
            assert registered is not None and registered.token == VICTIM_TOKEN  # the operator's, never in the pod spec
            assert (await asyncio.to_thread(victim.wait_for_plan, 30)).status == "planned"
            await asyncio.to_thread(agent.idle)
            before = await asyncio.to_thread(_victims_plan, agent)

            stranger = c.emu.issue_token("team-b", "default", pod="attacker-tensile")  # a pod never admitted
            squat = _registration("team-a", "victim", workload, memory_budget_bytes=2**62)
            attacks = {
                "no credential": ({}, _registration("team-b", "attacker", workload, memory_budget_bytes=2**62)),
                "a forged token": (_bearer("forged." + "x" * 40), _registration("team-b", "attacker", workload)),
                "an expired token": (_bearer(c.emu.issue_token("team-b", "default", pod="attacker-tensile", seconds=-1)),
                                     _registration("team-b", "attacker", workload)),
                "a token of another audience": (_bearer(c.emu.issue_token("team-b", "default", pod="attacker-tensile",
                                                                          audience="https://kubernetes.default.svc")),
                                                _registration("team-b", "attacker", workload)),
                "a token bound to no pod": (_bearer(c.emu.issue_token("team-b", "default")),
                                            _registration("team-b", "attacker", workload)),
                "a never-admitted pod": (_bearer(stranger), _registration("team-b", "attacker", workload)),
                "the victim's name from another pod": (_bearer(stranger), squat),
                "the victim's name with its job token": (_bearer(stranger), squat | {"token": VICTIM_TOKEN}),
                "the victim's pod token for another job": (_bearer(token_file.read_text()),
                                                           _registration("team-a", "other", workload)),
                "the victim's name in a pod's own namespace": (_bearer(c.emu.issue_token("team-a", "default", pod="x")),
                                                              squat),
                "an oversized budget": (_bearer(stranger), _registration("team-b", "a", workload,
                                                                         memory_budget_bytes=2**62 + 1)),
                "an oversized plan version": (_bearer(stranger), _registration("team-b", "a", workload,
                                                                               last_plan_version=2**70)),
                "a pod admitting itself": (_bearer(stranger), None),
            }
            answers = {}
            for name, (headers, body) in attacks.items():
                if body is None:
                    status, answer = await asyncio.to_thread(
                        call, agent.url, "POST", "/v1/admissions", {"job": "attacker", "namespace": "team-b",
                                                                    "gpu": "0", "pod": "attacker-tensile",
                                                                    "token": "a" * 32}, None, headers)
                else:
                    status, answer = await asyncio.to_thread(call, agent.url, "POST", "/v1/jobs", body, None, headers)
                assert status in REFUSED, (name, status, answer)
                answers[name] = status
            unproved = ("no credential", "a forged token", "an expired token", "a token of another audience")
            oversized = ("an oversized budget", "an oversized plan version")  # refused by the body's checks first
            assert answers == {name: 401 if name in unproved else 422 if name in oversized else 403 for name in attacks}
            # a job admitted with a budget cannot register with more, nor its hook raise it with the job's token
            assert await asyncio.to_thread(_admit, agent, operator, "team-b", "greedy", "greedy-tensile", "g" * 32) == 200
            greedy = _bearer(c.emu.issue_token("team-b", "default", pod="greedy-tensile"))
            status, answer = await asyncio.to_thread(call, agent.url, "POST", "/v1/jobs", _registration(
                "team-b", "greedy", workload, memory_budget_bytes=2**62), None, greedy)
            assert status == 403 and "more than job team-b/greedy was admitted with" in answer["detail"], answer  # type: ignore[index]
            status, answer = await asyncio.to_thread(call, agent.url, "PATCH", "/v1/jobs/team-a/victim/knobs",
                                                     {"memory_budget_bytes": 2**40}, VICTIM_TOKEN,
                                                     _bearer(token_file.read_text()))
            assert status == 403, answer
            # the victim's own token changes nothing for a caller that is not its pod either
            status, _ = await asyncio.to_thread(call, agent.url, "POST", "/v1/jobs", squat, VICTIM_TOKEN, {})
            assert status == 401

            # 1,000 registrations from one client, each under a name of its own: every one refused, none a 5xx
            statuses: set[int] = set()
            for i in range(1000):
                status, _ = await asyncio.to_thread(call, agent.url, "POST", "/v1/jobs",
                                                    _registration("team-b", f"flood-{i}", {"ops": []}), None,
                                                    _bearer(stranger))
                statuses.add(status)
            assert statuses <= REFUSED, statuses
            assert c.emu.token_reviews < 50  # a credential is reviewed once, not at every call

            await asyncio.to_thread(agent.idle)
            assert list(agent.agent.state.jobs) == ["team-a/victim"]
            assert await asyncio.to_thread(_victims_plan, agent) == before
            assert agent.agent.state.jobs["team-a/victim"].memory_budget_bytes == 2**30

    asyncio.run(scenario())


def test_registrations_are_capped_per_namespace_and_per_gpu_with_the_reason(tmp_path, tiny_workload):
    """1,500 registrations made planning fail for every job of the GPU; now a namespace holds at most
    --max-jobs-per-namespace of a GPU's jobs and the GPU at most --max-jobs-per-gpu: past them, 429 says which."""
    workload = workload_to_dict(tiny_workload())

    async def scenario() -> None:
        async with guarded_agent(tmp_path, registrations=RegistrationLimits(per_gpu=5, per_namespace=3)) as (c, agent, op):
            def register(namespace: str, job: str) -> tuple[int, dict]:
                assert _admit(agent, op, namespace, job, f"{job}-tensile", job + "-" + "t" * 30) == 200
                pod = c.emu.issue_token(namespace, "default", pod=f"{job}-tensile")
                return call(agent.url, "POST", "/v1/jobs", _registration(namespace, job, workload), None,  # type: ignore[return-value]
                            _bearer(pod))

            for i in range(3):
                assert (await asyncio.to_thread(register, "team-b", f"b{i}"))[0] == 201
            status, body = await asyncio.to_thread(register, "team-b", "b3")
            assert status == 429 and "namespace team-b has 3 jobs registered on GPU" in body["detail"], body
            for i in range(2):
                assert (await asyncio.to_thread(register, "team-c", f"c{i}"))[0] == 201
            status, body = await asyncio.to_thread(register, "team-d", "d0")
            assert status == 429 and "has 5 jobs registered, the most this agent takes" in body["detail"], body

    asyncio.run(scenario())
