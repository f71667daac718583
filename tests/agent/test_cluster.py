"""The node agent's cluster publishing (node_agent/tensile_agent/cluster.py) against the kube emulator: a real agent on
127.0.0.1 whose kubernetes client points at the emulator writes its TensileNode and the TrainingJobs'
observed figures; outside a cluster publishing is off and the agent serves as usual."""

from __future__ import annotations

import asyncio
import sys
import time

import jsonschema
import pytest
import yaml
from tests.support.agent_harness import ROOT, ThreadedAgent, get
from tests.support.fake_nvml import FakeGpu
from tests.support.operator_harness import cluster, trainingjob

from tensile.agent_client import AgentClient
from tensile.agent_contract import Measurements
from tensile.devices import GIB
from tensile.local.jobs import strict_schema
from tensile_agent.cluster import in_cluster, observed_status, tensilenode_status
from tensile_operator.placement import gpus_from_tensilenode


def test_agent_publishes_its_node_and_the_jobs_observations(tmp_path, tiny_workload):
    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await c.apply(trainingjob("placed", None, profile="p", memoryBudget="64Mi"))
            agent = ThreadedAgent(["a6000:8GiB", "a6000:8GiB"], cluster_api=c.custom_objects_api(), node="node-a")
            await asyncio.to_thread(agent.__enter__)
            try:
                # created when missing, then its status: the inventory and where to reach the agent
                await c.wait(lambda: ((c.node("node-a") or {}).get("status") or {}).get("gpus"), 30, "the TensileNode")
                node = c.node("node-a")
                assert node["spec"]["nodeName"] == "node-a" and node["status"]["agentAddress"] == agent.url
                gpus = gpus_from_tensilenode(node)  # what the operator reads from it
                assert [g.uuid for g in gpus] == list(agent.agent.inventory.gpus) and all(g.simulated for g in gpus)
                assert all(g.agent == agent.url and 0 < g.capacity_bytes <= g.memory_bytes == 8 * 2**30 for g in gpus)

                # two jobs: one a TrainingJob placed by an operator, one not (`tensile run --agent`: 404, ignored)
                clients = {}
                for name in ("placed", "local"):
                    client = AgentClient(agent.url, f"default/{name}", gpu=gpus[0].uuid, max_backoff=0.2)
                    assert await asyncio.to_thread(client.register, workload=tiny_workload()) is not None
                    plan = await asyncio.to_thread(client.wait_for_plan, 30)
                    await asyncio.to_thread(client.post_measurements, Measurements(
                        plan_version=plan.version, iterations=5, peak_bytes=3_000_000 + len(name),
                        reserved_peak_bytes=4_000_000, iteration_seconds=0.25, stall_seconds=0.01,
                        out_of_memory_retries=2, signature_match=True))
                    clients[name] = client

                def committed() -> dict:
                    status = c.node("node-a")["status"]["gpus"][0]
                    return status if {j["job"] for j in status["jobs"]} == {"default/placed", "default/local"} else {}

                await c.wait(committed, 30, "the committed forecasts of both jobs")
                gpu = committed()
                assert gpu["committed"]["scheduledPeakBytes"] == sum(j["scheduledPeakBytes"] for j in gpu["jobs"]) > 0
                assert all(j["observedPeakBytes"] >= 3_000_000 and j["planVersion"] >= 1 for j in gpu["jobs"])
                # what each job's process holds, for an operator that does not book it: its reserved forecast (made in
                # the planning thread after the round) and the reserved peak its hook observed
                await c.wait(lambda: all("forecastReservedPeakBytes" in j for j in committed().get("jobs", [None])),
                             30, "the jobs' reserved forecasts")
                gpu = committed()
                for job in gpu["jobs"]:
                    made = agent.agent.state.jobs[job["job"]].reserved_forecast
                    assert made is not None and job["forecastReservedPeakBytes"] == made.reserved_peak_bytes > 0
                    assert dict(gpus_from_tensilenode(c.node("node-a"))[0].hosted)[job["job"]] == max(
                        job["scheduledPeakBytes"], job["forecastReservedPeakBytes"], 4_000_000)
                await c.wait(lambda: (c.job("placed").get("status") or {}).get("observed"), 30, "the observed figures")
                observed = c.job("placed")["status"]["observed"]
                assert observed["peakBytes"] == 3_000_006 and observed["iterations"] == 5
                assert observed["iterationSeconds"] == pytest.approx(0.25) and observed["signatureMatch"] is True
                assert (observed["reservedPeakBytes"], observed["outOfMemoryRetries"]) == (4_000_000, 2)
                assert c.job("local") is None  # a 404 is not an error: nothing is created for it
                _, jobs = get(agent.url, "/v1/jobs")
                assert len(jobs["jobs"]) == 2  # type: ignore[index]

                # a job leaves: the node says so at the next write; nothing failed on the way
                await asyncio.to_thread(clients["local"].unregister)
                await c.wait(lambda: [j["job"] for j in c.node("node-a")["status"]["gpus"][0]["jobs"]] == ["default/placed"],
                             30, "the node without the job that left")
                assert agent.agent.publisher.errors == 0 and agent.agent.publisher.writes >= 2
            finally:
                agent.__exit__(None, None, None)

    asyncio.run(scenario())


def test_the_tensilenode_publishes_a_reserved_forecast_only_for_the_current_plan(tiny_workload, monkeypatch):
    """The operator books a hosted job by its reserved forecast: a forecast of an earlier plan version (the model
    failed on the new plan) is published as none, as the job's view and the metrics say it, not the old figure."""
    from tensile import agent_client
    from tensile_agent import allocator_forecast

    with ThreadedAgent(["a6000:8GiB"]) as agent:
        client = AgentClient(agent.url, "default/placed", max_backoff=0.2)
        assert client.register(workload=tiny_workload()) is not None and client.wait_for_plan(30).status == "planned"
        agent.idle()
        (job,) = tensilenode_status(agent.agent.state, agent.url)["gpus"][0]["jobs"]
        assert job["forecastReservedPeakBytes"] > 0 and job["planVersion"] == 1

        def fails(*args: object, **kwargs: object) -> tuple[int, int]:
            raise RuntimeError("a workload the model cannot replay")

        monkeypatch.setattr(allocator_forecast, "scheduled_reserved_peak", fails)
        budget = job["vanillaPeakBytes"] // 2  # a plan of its own: a new version
        agent_client.update_knobs(agent.url, "default/placed", client.token, {"memoryBudgetBytes": budget})
        agent.idle()
        (job,) = tensilenode_status(agent.agent.state, agent.url)["gpus"][0]["jobs"]
        assert job["planVersion"] == 2 and "forecastReservedPeakBytes" not in job, job


def status_validator(crd: str, *path: str) -> jsonschema.Draft4Validator:
    """The CRD's schema of .status (then `path` into it), unknown fields refused: an API server prunes the
    status fields its CRD does not declare, so a field the agent writes must be declared to be kept."""
    (version,) = yaml.safe_load((ROOT / "crds" / f"{crd}.tensile.dev.yaml").read_text())["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    for name in path:
        schema = schema["properties"][name]
    return jsonschema.Draft4Validator(strict_schema(schema))


def published(workload, posts: list[dict]) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    """The TensileNode's job entry and the TrainingJob's observed figures once a job posted each iteration of `posts`
    (as the hook's report has them) in a post of its own; both checked against their CRD, unknown fields refused."""
    with ThreadedAgent(["a6000:8GiB"]) as agent:
        client = AgentClient(agent.url, "default/placed", max_backoff=0.2)
        assert client.register(workload=workload) is not None and client.wait_for_plan(30).status == "planned"
        for figures in posts:
            assert client.post_measurements(Measurements.from_iterations([figures])).accepted
        node = tensilenode_status(agent.agent.state, agent.url)
        observed = observed_status(agent.agent.state.jobs["default/placed"])
    status_validator("tensilenodes").validate(node)
    status_validator("trainingjobs", "observed").validate(observed)
    (job,) = node["gpus"][0]["jobs"]
    return job, observed


def test_the_statuses_carry_the_peak_under_plan_in_fields_the_crds_declare(tiny_workload):
    """The TensileNode's jobs and the TrainingJob's observed figures give the peak measured under a plan
    (observedPlannedPeakBytes, plannedPeakBytes) beside the peak of every iteration."""
    job, observed = published(tiny_workload(), [{"mode": "recording", "peak_bytes": 9_000_000},
                                                {"mode": "planned", "peak_bytes": 6_000_000}])
    assert (job["observedPeakBytes"], job["observedPlannedPeakBytes"]) == (9_000_000, 6_000_000)
    assert (observed["peakBytes"], observed["plannedPeakBytes"]) == (9_000_000, 6_000_000)


def test_the_statuses_carry_the_reserved_peak_and_the_out_of_memory_retries_in_fields_the_crds_declare(tiny_workload):
    """What the process held (on CUDA max_memory_reserved) beside its tensors' peak, on the TensileNode's job entry
    and the TrainingJob's observed figures, and the out-of-memory errors the hook's guard retried, totalled."""
    job, observed = published(tiny_workload(), [
        {"mode": "planned", "peak_bytes": 9_000_000, "reserved_bytes": 12_000_000, "out_of_memory_retries": 2},
        {"mode": "planned", "peak_bytes": 9_000_000, "reserved_bytes": 10_000_000, "out_of_memory_retries": 1}])
    assert job["observedReservedPeakBytes"] == 12_000_000
    assert (observed["reservedPeakBytes"], observed["outOfMemoryRetries"]) == (12_000_000, 3)


def test_the_tensilenode_carries_each_gpus_compute_capability_in_a_field_the_crd_declares(nvml_gpus):
    """NVML's compute capability of a GPU no preset names, which the operator's reader takes the GPU beside."""
    nvml_gpus(FakeGpu("NVIDIA L40S", 48 * GIB, (8, 9)))
    with ThreadedAgent(simulate=[]) as agent:
        node = tensilenode_status(agent.agent.state, agent.url)
    status_validator("tensilenodes").validate(node)
    (gpu,) = node["gpus"]
    assert (gpu["name"], gpu["computeCapabilityMajor"], gpu["simulated"]) == ("NVIDIA L40S", 8, False)
    (seen,) = gpus_from_tensilenode({"metadata": {"name": "node-a"}, "status": node})
    assert (seen.uuid, seen.memory_bytes) == (gpu["uuid"], 48 * GIB)

def test_the_printed_columns_name_fields_the_trainingjob_status_declares():
    """`kubectl get tj` reads its byte columns from .status; a column whose path the schema does not declare stays
    empty."""
    (version,) = yaml.safe_load((ROOT / "crds" / "trainingjobs.tensile.dev.yaml").read_text())["spec"]["versions"]
    observed = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["observed"]["properties"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Reserved"] == ".status.observed.reservedPeakBytes" and "reservedPeakBytes" in observed


def test_outside_a_cluster_publishing_is_off(monkeypatch, tiny_workload):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert not in_cluster("node-a")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    assert not in_cluster(None) and in_cluster("node-a")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with ThreadedAgent(["a6000:8GiB"], node="node-a") as agent:
        assert agent.agent.publisher is None
        client = AgentClient(agent.url, "default/x", max_backoff=0.2)
        assert client.register(workload=tiny_workload()) is not None and client.wait_for_plan(30).status == "planned"


def test_a_cluster_api_that_fails_never_stops_the_agent(monkeypatch, tiny_workload):
    """In a pod whose API server is away (here: in-cluster settings without a service port), writes fail,
    are counted and retried; the agent keeps serving its hooks."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with ThreadedAgent(["a6000:8GiB"], node="node-a", auth="none") as agent:  # its credentials: tests/agent/test_attacks.py
        publisher = agent.agent.publisher
        assert publisher is not None
        client = AgentClient(agent.url, "default/x", max_backoff=0.2)
        assert client.register(workload=tiny_workload()) is not None and client.wait_for_plan(30).status == "planned"
        for _ in range(100):
            if publisher.errors:
                break
            time.sleep(0.05)
        assert publisher.errors >= 1 and publisher.writes == 0
        assert get(agent.url, "/healthz")[0] == 200


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))


class _OneJobRefused:
    """The emulator's client, except that every status patch of TrainingJob `refused` fails (as a webhook or a quota
    would refuse it)."""

    def __init__(self, api, refused: str) -> None:  # type: ignore[no-untyped-def]
        self._api, self._refused = api, refused
        self.refusals = 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._api, name)

    def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body):  # type: ignore[no-untyped-def]
        from kubernetes.client.exceptions import ApiException

        if name == self._refused:
            self.refusals += 1
            raise ApiException(status=500, reason="refused")
        return self._api.patch_namespaced_custom_object_status(group, version, namespace, plural, name, body)


@pytest.mark.slow
def test_one_jobs_failing_status_patch_does_not_stop_the_others(tmp_path, tiny_workload):
    """A status patch that failed for one job stopped the whole write: no later job of the node was published (nor,
    while it kept failing, ever again). Each job's patch now fails on its own and is tried again later."""
    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            for name in ("first", "second"):
                await c.apply(trainingjob(name, None, profile="p", memoryBudget="64Mi"))
            api = _OneJobRefused(c.custom_objects_api(), "first")
            agent = ThreadedAgent(["a6000:8GiB"], cluster_api=api, node="node-a")
            await asyncio.to_thread(agent.__enter__)
            try:
                for name in ("first", "second"):  # in this order: the refused job's patch comes first
                    client = AgentClient(agent.url, f"default/{name}", max_backoff=0.2)
                    assert await asyncio.to_thread(client.register, workload=tiny_workload()) is not None
                    plan = await asyncio.to_thread(client.wait_for_plan, 30)
                    await asyncio.to_thread(client.post_measurements, Measurements(
                        plan_version=plan.version, iterations=3, peak_bytes=4_000_000, iteration_seconds=0.1,
                        stall_seconds=0.0, signature_match=True))
                await c.wait(lambda: (c.job("second").get("status") or {}).get("observed"), 30, "the second job's figures")
                await c.wait(lambda: api.refusals >= 2, 30, "the refused patch tried again")
                assert "observed" not in (c.job("first").get("status") or {})
                assert agent.agent.publisher.errors >= 1
            finally:
                agent.__exit__(None, None, None)

    asyncio.run(scenario())
