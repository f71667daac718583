"""A placed job whose node or GPU goes away: placed again when its pod has not started (its pod is pinned by
`nodeName` and would never run), said and left alone when it has (Tensile never stops training by its own decision);
live, and when it went while no operator ran. Kopf runs against the emulator, as in test_operator_events.py; the
test plays the kubelet (pods stay Pending until it says otherwise). Every job is admitted by its budget: ~6 s."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from operator_harness import GIB, TN, Cluster, cluster, phase, pod_env, simulated_gpu, start_operator, trainingjob
from test_operator_events import conditions, events_of, reasons, restarted, running
from tensile.operator.admission import Admission
from tensile.operator.forecasting import Forecaster
from tensile.operator.kube import Conflict
from tensile.operator.placement import Booking, Gpu

# a container the kubelet is still creating (its image pulled, say): the pod has not started
CREATING = {"phase": "Pending", "containerStatuses": [{"name": "train", "state": {"waiting": {"reason": "ContainerCreating"}}}]}


@pytest.fixture(scope="module")
def forecaster():  # type: ignore[no-untyped-def]
    f = Forecaster()
    yield f
    f.close()


def job(name: str, budget: str) -> dict:
    return trainingjob(name, None, profile="p", memoryBudget=budget)


def pod(c: Cluster, name: str) -> dict | None:
    return c.emu.get("v1/pods", "default", f"{name}-tensile")


def placed_on(c: Cluster, name: str) -> tuple[str, str] | None:
    """(node, GPU) of the job's placement once it is admitted."""
    status = (c.job(name) or {}).get("status") or {}
    placement = status.get("placement") or {}
    return (placement["node"], placement["gpu"]) if status.get("phase") == "Admitted" and placement else None


async def placed(c: Cluster, name: str, budget: str, status: dict | None = None) -> dict:
    """Job `name` applied and its pod made; the test's kubelet gives the pod `status` (none: not seen by a kubelet)."""
    await c.apply(job(name, budget))
    made = await c.wait(lambda: pod(c, name), 20, f"{name}'s pod")
    assert isinstance(made, dict)
    if status is not None:
        await c.set_pod_status(made, status)
    return pod(c, name) or made


async def remove_node(c: Cluster, node: str) -> None:
    await c.request("DELETE", f"/apis/tensile.dev/v1alpha1/tensilenodes/{node}", status_ok=(200, 202))


async def said(c: Cluster, name: str, type_: str, reason: str, event: str) -> dict:
    """The job's `type_` condition once it has `reason` and its Event `event` is posted (Events are posted off the
    status writes: either may land first)."""
    await c.wait(lambda: conditions(c, name).get(type_, {}).get("reason") == reason, 10, f"{name}: {type_} {reason}")
    await c.wait(lambda: event in reasons(c, name), 10, f"{name}'s {event} Event")
    return conditions(c, name)[type_]


def left_alone(c: Cluster, name: str, before: dict) -> None:
    """The job's pod is the one it had, not being deleted, and the job is still placed where it was."""
    now = pod(c, name)
    assert now is not None and now["metadata"]["uid"] == before["metadata"]["uid"], now
    assert not now["metadata"].get("deletionTimestamp")
    assert (c.job(name) or {})["status"]["placement"]["node"] == before["spec"]["nodeName"]


def test_a_job_whose_pod_had_not_started_is_placed_again_when_its_tensilenode_goes(tmp_path: Path, forecaster: Forecaster) -> None:
    """TensileNode node-a removed with three jobs booked there. `wait`, whose pod was still being created, waited for
    good on a pod pinned to node-a while node-b had room: its pod is deleted and it is placed on node-b (a new pod
    there), with one `Requeued` Event naming node-a. `run` (running) and `init` (Pending, but its init container
    started) keep their pods and their bookings and say `NodeAvailable=False`, `TensileNodeRemoved`, as before."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await c.publish_node("node-a", [simulated_gpu("GPU-a0", 4)])
            await c.publish_node("node-b", [simulated_gpu("GPU-b0", 8)])
            op = await start_operator(forecaster)
            try:
                # best fit puts each on node-a (least room left)
                await placed(c, "run", "1Gi")
                run = await running(c, "run")
                init = await placed(c, "init", "1Gi", {"phase": "Pending", "initContainerStatuses": [
                    {"name": "tensile-hook", "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]})
                wait = await placed(c, "wait", "2Gi", CREATING)
                assert {placed_on(c, n) for n in ("init", "wait")} == {("node-a", "GPU-a0")}
                await remove_node(c, "node-a")
                await c.wait(lambda: placed_on(c, "wait") == ("node-b", "GPU-b0"), 10, "wait placed on node-b")
                new = await c.wait(lambda: (p := pod(c, "wait")) and p["metadata"]["uid"] != wait["metadata"]["uid"] and p,
                                   10, "wait's new pod")
                assert isinstance(new, dict)
                assert new["spec"]["nodeName"] == "node-b" and pod_env(new)["TENSILE_GPU"] == "GPU-b0"
                await c.wait(lambda: reasons(c, "wait").count("PodCreated") == 2, 10, "wait's new pod said")
                assert reasons(c, "wait") == ["NoProfile", "Placed", "PodCreated", "Requeued", "Placed", "PodCreated"]
                [requeued] = [e for e in events_of(c, "wait") if e["reason"] == "Requeued"]
                assert requeued["type"] == "Normal" and "TensileNode node-a was removed" in requeued["message"]
                now = conditions(c, "wait")
                assert now["Admitted"]["reason"] == "Placed" and "NodeAvailable" not in now, now
                for name, before in (("run", run), ("init", init)):
                    gone = await said(c, name, "NodeAvailable", "TensileNodeRemoved", "TensileNodeRemoved")
                    assert gone["status"] == "False" and "node-a" in gone["message"]
                    left_alone(c, name, before)
                    assert f"default/{name}" in op.app.ledger.bookings and "Requeued" not in reasons(c, name)
                await asyncio.sleep(0.3)  # the old pod's late events end nothing
                assert phase(c.job("wait")) == "Admitted" and op.app.ledger.bookings["default/wait"].node == "node-b"
            finally:
                await op.stop()

    asyncio.run(scenario())


def test_a_job_placed_again_waits_as_any_queued_job_in_its_place_by_creation(tmp_path: Path, forecaster: Forecaster) -> None:
    """`moved`, placed on node-a before `after` was created, is put back in the queue when node-a goes while its pod
    has not started, and waits there as any queued job does (phase Queued, its shortfall, no pod). When room frees on
    node-b it is placed before `after` (created later, waiting longer in this queue, and first by name)."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await c.publish_node("node-b", [simulated_gpu("GPU-b0", 4)])
            op = await start_operator(forecaster)
            try:
                await placed(c, "holder", "3Gi")
                await running(c, "holder")
                await c.publish_node("node-a", [simulated_gpu("GPU-a0", 4)])
                await placed(c, "moved", "3Gi", CREATING)
                assert placed_on(c, "moved") == ("node-a", "GPU-a0")
                await asyncio.sleep(1.1)  # creation is in whole seconds: `after` is created after `moved`
                await c.apply(job("after", "2Gi"))
                await said(c, "after", "Admitted", "Queued", "Queued")
                await remove_node(c, "node-a")
                await said(c, "moved", "Admitted", "Queued", "Queued")
                status = (c.job("moved") or {})["status"]
                assert status["phase"] == "Queued" and "placement" not in status and "reservedBytes" not in status["forecast"]
                assert status["queue"]["shortfallBytes"] > 0 and pod(c, "moved") is None
                assert reasons(c, "moved")[-2:] == ["Requeued", "Queued"]
                assert "default/moved" not in op.app.ledger.bookings
                holder = pod(c, "holder")
                assert holder is not None
                await c.set_pod_status(holder, {"phase": "Succeeded"})
                await c.wait(lambda: placed_on(c, "moved") == ("node-b", "GPU-b0"), 10, "moved placed where room freed")
                await asyncio.sleep(0.3)
                assert phase(c.job("after")) == "Queued"
            finally:
                await op.stop()

    asyncio.run(scenario())


def test_a_gpu_its_tensilenode_stops_listing_is_said_or_its_job_placed_again(tmp_path: Path, forecaster: Forecaster) -> None:
    """node-a's agent publishes again without GPU-a0 (failed, MIG reconfigured): nothing was said. The running job there
    says `NodeAvailable=False`, `GPURemoved` (a Warning Event) and keeps its pod; the job whose pod had not started is
    placed on GPU-a1 of the same node. Listed again, GPU-a0 is said back (`GPUPublished`) once, heartbeats say nothing."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            gpus = [simulated_gpu("GPU-a0", 4), simulated_gpu("GPU-a1", 8)]
            await c.publish_node("node-a", gpus)
            op = await start_operator(forecaster)
            try:
                await placed(c, "run", "1Gi")
                run = await running(c, "run")
                wait = await placed(c, "wait", "2Gi", CREATING)
                assert placed_on(c, "wait") == ("node-a", "GPU-a0")
                await c.publish_node("node-a", gpus[1:])
                gone = await said(c, "run", "NodeAvailable", "GPURemoved", "GPURemoved")
                assert gone["status"] == "False" and "GPU-a0" in gone["message"]
                [event] = [e for e in events_of(c, "run") if e["reason"] == "GPURemoved"]
                assert event["type"] == "Warning" and "GPU-a0" in event["message"]
                left_alone(c, "run", run)
                await c.wait(lambda: placed_on(c, "wait") == ("node-a", "GPU-a1"), 10, "wait placed on GPU-a1")
                new = await c.wait(lambda: (p := pod(c, "wait")) and p["metadata"]["uid"] != wait["metadata"]["uid"] and p,
                                   10, "wait's new pod")
                assert isinstance(new, dict) and pod_env(new)["TENSILE_GPU"] == "GPU-a1"
                await c.wait(lambda: "Requeued" in reasons(c, "wait"), 10, "wait's Requeued Event")
                [requeued] = [e for e in events_of(c, "wait") if e["reason"] == "Requeued"]
                assert "GPU GPU-a0 is no longer listed by TensileNode node-a" in requeued["message"]
                await c.publish_node("node-a", gpus)
                assert (await said(c, "run", "NodeAvailable", "GPUPublished", "GPUPublished"))["status"] == "True"
                await c.publish_node("node-a", gpus)  # a heartbeat: nothing new
                await asyncio.sleep(0.3)
                assert reasons(c, "run")[-2:] == ["GPURemoved", "GPUPublished"]
                assert reasons(c, "run").count("GPUPublished") == 1 and reasons(c, "wait").count("Requeued") == 1
            finally:
                await op.stop()

    asyncio.run(scenario())


def test_a_node_or_gpu_gone_while_no_operator_ran_is_handled_at_start(tmp_path: Path, forecaster: Forecaster) -> None:
    """While no operator ran, TensileNode node-a was removed and node-b stopped listing GPU-b0. At start-up, the jobs
    whose pods had not started are placed on GPU-b1: `wait-a`, whose pod was also deleted meanwhile (a placed job with
    no pod got a new one pinned to node-a on resume), and `wait-b`, whose Pending pod is deleted. The running jobs are
    said (`TensileNodeRemoved`, `GPURemoved`) and keep their pods; a further restart says nothing again."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await c.publish_node("node-a", [simulated_gpu("GPU-a0", 3)])
            b1 = simulated_gpu("GPU-b1", 16)
            await c.publish_node("node-b", [simulated_gpu("GPU-b0", 5), b1])
            op = await start_operator(forecaster)
            try:
                pods = {}
                for name, budget in (("run-a", "1Gi"), ("wait-a", "2Gi"), ("run-b", "1Gi"), ("wait-b", "2Gi")):
                    pods[name] = await placed(c, name, budget, CREATING)
                    if name.startswith("run"):
                        pods[name] = await running(c, name)
                assert [placed_on(c, n) for n in ("wait-a", "wait-b")] == [("node-a", "GPU-a0"), ("node-b", "GPU-b0")]
                await op.stop()
                await c.request("DELETE", "/api/v1/namespaces/default/pods/wait-a-tensile", status_ok=(200, 202))
                await remove_node(c, "node-a")
                await c.publish_node("node-b", [b1])
                assert c.emu.get(TN, None, "node-a") is None
                op = await start_operator(forecaster)
                for name in ("wait-a", "wait-b"):
                    await c.wait(lambda: placed_on(c, name) == ("node-b", "GPU-b1"), 10, f"{name} placed on GPU-b1")
                    new = await c.wait(lambda: (p := pod(c, name)) and p["metadata"]["uid"] != pods[name]["metadata"]["uid"]
                                       and p, 10, f"{name}'s new pod")
                    assert isinstance(new, dict) and new["spec"]["nodeName"] == "node-b"
                for name, reason in (("run-a", "TensileNodeRemoved"), ("run-b", "GPURemoved")):
                    assert (await said(c, name, "NodeAvailable", reason, reason))["status"] == "False"
                    assert conditions(c, name)["PodRunning"]["status"] == "True"
                    left_alone(c, name, pods[name])
                await c.wait(lambda: all("Requeued" in reasons(c, n) for n in ("wait-a", "wait-b")), 10, "Requeued Events")
                op = await restarted(c, op, forecaster, "run-a", "run-b", "wait-a", "wait-b")
                assert [reasons(c, n).count(r) for n, r in (("run-a", "TensileNodeRemoved"), ("run-b", "GPURemoved"),
                                                             ("wait-a", "Requeued"), ("wait-b", "Requeued"))] == [1, 1, 1, 1]
                assert {placed_on(c, n) for n in ("wait-a", "wait-b")} == {("node-b", "GPU-b1")}
            finally:
                await op.stop()

    asyncio.run(scenario())


class Api:
    """The API server for a unit test of the deletion: the job, its pod, and a kubelet that starts the pod just
    after the operator read it (so the deletion's preconditions no longer hold: 409)."""

    def __init__(self, job: dict, pod: dict, starts: bool) -> None:
        self.job, self.pod, self.starts = job, pod, starts
        self.deletions: list[dict | None] = []
        self.statuses: list[dict] = []

    async def get_job(self, namespace: str, name: str) -> dict:
        return self.job

    async def find_pod(self, namespace: str, name: str) -> dict | None:
        return self.pod

    async def delete_pod(self, namespace: str, name: str, options: dict | None = None) -> None:
        self.deletions.append(options)
        if self.starts:  # started meanwhile: the API server refuses a deletion whose preconditions no longer hold
            self.pod = self.pod | {"metadata": self.pod["metadata"] | {"resourceVersion": "2"}, "status": {"phase": "Running"}}
            raise Conflict(409, "Precondition failed: ResourceVersion in precondition: 1, in object meta: 2")
        self.pod = None

    async def patch_job_status(self, namespace: str, name: str, status: dict, resource_version: str | None = None) -> dict:
        self.statuses.append(status)
        return {}

    async def create_event(self, namespace: str, event: dict) -> dict:
        return event


def test_only_an_unstarted_pod_is_deleted_and_only_as_it_was_read() -> None:
    """The pod is deleted with no grace period (a kubelet of a node that is gone never confirms a graceful deletion)
    and with preconditions on its uid and resourceVersion: one that started after it was read (409) is read again
    and left to run, its job said, not placed again."""
    for starts in (False, True):
        body = job("j", "1Gi") | {"status": {"phase": "Admitted"}}
        body["metadata"] |= {"namespace": "default", "uid": "u1", "creationTimestamp": "2026-01-01T00:00:00Z"}
        app = Admission()
        app.ready.set()
        app.inventory = {"node-b": [Gpu("node-b", "GPU-b0", "Simulated GPU", 8 * GIB, 8 * GIB, simulated=True)]}
        pod_body = {"metadata": {"name": "j-tensile", "namespace": "default", "uid": "p1", "resourceVersion": "1",
                                 "ownerReferences": [{"kind": "TrainingJob", "name": "j", "uid": "u1", "controller": True}]},
                    "spec": {"nodeName": "node-a"}, "status": CREATING}
        api = Api(body, pod_body, starts)
        app.kube = api  # type: ignore[assignment]
        booking = Booking("default/j", "GPU-a0", "node-a", GIB)
        app.ledger.book(booking)
        gone = app._gone(booking)
        assert gone is not None

        async def scenario() -> None:
            await app._booked_gpu_gone(booking, gone)

        asyncio.run(scenario())
        assert api.deletions[0] == {"gracePeriodSeconds": 0, "preconditions": {"uid": "p1", "resourceVersion": "1"}}
        said = {c["type"]: c["reason"] for s in api.statuses for c in s.get("conditions", [])}
        if starts:
            assert len(api.deletions) == 1 and api.pod is not None and said == {"NodeAvailable": "TensileNodeRemoved"}
            assert "default/j" in app.ledger.bookings and "default/j" not in app.pending
        else:
            assert said["Admitted"] == "TensileNodeRemoved" and "default/j" in app.pending
            assert api.statuses[0]["placement"] is None and "default/j" not in app.ledger.bookings
