"""End to end on one machine: the operator (Kopf) against the kube emulator, two node agents (uvicorn on
127.0.0.1, simulated GPUs) each publishing its own TensileNode, and a test kubelet that runs each pod's
containers as local processes with the pod's environment. Two TrainingJobs go from creation to a finished
CPU training run (examples/train_mlp.py) under the hook, which plans through the agent of its node."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from tests.support.agent_harness import ThreadedAgent, agent_jobs
from tests.support.operator_harness import cluster, phase, pod_env, process_kubelet, start_operator, trainingjob

from tensile_operator.forecasting import Forecaster
from tensile_operator.pods import pod_name

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
NODES = ("node-a", "node-b")
JOBS = ("mlp-one", "mlp-two")


@pytest.mark.slow
def test_two_agents_two_jobs_train_under_their_agents_plans(tmp_path):
    logs: dict[str, str] = {}
    seen: dict[str, set[str]] = {node: set() for node in NODES}  # node -> jobs its agent ever hosted
    counted_twice: list[tuple[str, int]] = []  # (job, bytes) the operator counted as external while booked
    hosted_and_booked: set[str] = set()
    running: list = []  # the operator, once started
    forecaster = Forecaster()

    async def scenario() -> dict[str, dict]:
        async with cluster(tmp_path) as c:
            agents = {node: ThreadedAgent(["a6000:4GiB"], cluster_api=c.custom_objects_api(), node=node,
                                          authenticator=c.agent_authenticator()) for node in NODES}
            for agent in agents.values():
                await asyncio.to_thread(agent.__enter__)
            kubelet = asyncio.create_task(process_kubelet(c, tmp_path / "volumes", ROOT, logs))

            async def watch_agents() -> None:
                while True:
                    for node, agent in agents.items():
                        seen[node] |= set(await asyncio.to_thread(agent_jobs, agent.url))
                    for app in running:  # a placed job the agent lists is not external capacity
                        bookings = dict(app.capacity.ledger.bookings)
                        for gpu in [g for gpus in app.capacity.inventory.copy().values() for g in gpus]:
                            for job, peak in gpu.hosted:
                                if job in bookings:
                                    hosted_and_booked.add(job)
                                    if app.capacity.ledger.external(gpu):
                                        counted_twice.append((job, app.capacity.ledger.external(gpu)))
                    await asyncio.sleep(0.1)

            watcher = asyncio.create_task(watch_agents())
            op = None
            try:
                await c.wait(lambda: all(((c.node(n) or {}).get("status") or {}).get("gpus") for n in NODES), 30,
                             "both agents' TensileNodes")
                gpu = c.node("node-a")["status"]["gpus"][0]
                # more than half a GPU each: the two jobs cannot share one, so each node gets one
                budget_mib = (gpu["capacityBytes"] - gpu["contextBytesPerJob"]) // MIB - 64
                op = await start_operator(forecaster)
                running.append(op.app)
                for name in JOBS:
                    manifest = trainingjob(name, None, profile="tiny-mlp", memoryBudget=f"{budget_mib}Mi", command=[
                        "python", "examples/train_mlp.py", "--steps", "16", "--batch-size", "8", "--pause", "0.2"])
                    manifest["spec"]["template"]["spec"]["containers"][0]["env"] = [
                        {"name": "TENSILE_REPORT", "value": str(tmp_path / f"{name}.json")}]
                    await c.apply(manifest)
                await c.wait(lambda: all(phase(c.job(n)) in ("Succeeded", "Failed") for n in JOBS), 120, "both runs to finish")
                jobs = {n: c.job(n) for n in JOBS}
                assert all(phase(j) == "Succeeded" for j in jobs.values()), ({n: j["status"] for n, j in jobs.items()}, logs)
                # the agent's observed figures reached each TrainingJob's status
                await c.wait(lambda: all((c.job(n)["status"].get("observed") or {}).get("iterations") for n in JOBS), 30,
                             "status.observed from the agents")
                # completion released the GPUs and left no job registered anywhere
                await c.wait(lambda: not op.app.capacity.ledger.bookings, 30, "the GPUs released")  # by the handler after the phase
                await c.wait(lambda: all(not agent_jobs(a.url) for a in agents.values()), 30, "the agents without jobs")
                await c.wait(lambda: all(not g.get("jobs") for n in NODES for g in c.node(n)["status"]["gpus"]), 30,
                             "TensileNodes without jobs")
                pods = {p["metadata"]["name"]: p for p in c.pods()}
                return {n: c.job(n) | {"env": pod_env(pods[pod_name("default", n, c.job(n)["metadata"]["uid"])]),
                                       "agent": agents[c.job(n)["status"]["placement"]["node"]].url}
                        for n in JOBS}
            finally:
                watcher.cancel()
                kubelet.cancel()
                await asyncio.gather(watcher, kubelet, return_exceptions=True)
                if op is not None:
                    await op.stop()
                for agent in agents.values():
                    agent.__exit__(None, None, None)

    try:
        jobs = asyncio.run(scenario())
        # the first runs' live workload is the profile the next jobs of that name are forecast from
        profile = forecaster.profiles.get("default", "tiny-mlp")
    finally:
        forecaster.close()
    assert profile is not None and profile.ops, "the live workload was not stored as profile tiny-mlp"
    assert {j["status"]["placement"]["node"] for j in jobs.values()} == set(NODES)
    assert hosted_and_booked == {f"default/{n}" for n in JOBS} and not counted_twice, (hosted_and_booked, counted_twice)
    for name, job in jobs.items():
        node = job["status"]["placement"]["node"]
        key = f"default/{name}"
        # the pod was sent to its node's agent, and the job registered there and nowhere else
        assert job["env"]["TENSILE_AGENT"] == job["agent"] and job["env"]["TENSILE_GPU"] == job["status"]["placement"]["gpu"]
        assert key in seen[node] and all(key not in jobs_ for other, jobs_ in seen.items() if other != node)
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["plan_source"] == "agent", (report["messages"], logs[pod_name("default", name, job["metadata"]["uid"])][-2000:])
        assert report["plan_version"] >= 1 and len(report["iterations"]) == 16
        assert any(it["mode"] == "planned" for it in report["iterations"]), report["iterations"][:3]
        observed = job["status"]["observed"]
        assert observed["iterations"] >= 1 and observed["peakBytes"] > 0 and observed["planVersion"] >= 1
        assert "tensile hook installed" in logs[pod_name("default", name, job["metadata"]["uid"])]
        assert report["live_signature"] == profile.signature  # the profile is what the hooks traced live


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
