"""A placed job whose node or GPU goes away: placed again when its pod has not started (its pod is pinned by
`nodeName` and would never run), said and left alone when it has (Tensile never stops training by its own decision);
live, and when it went while no operator ran. Kopf runs against the emulator, as in test_events.py; the
test plays the kubelet (pods stay Pending until it says otherwise). Every job is admitted by its budget: ~6 s."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

import tensile_operator.timing as timing
from tests.support.operator_harness import (GIB, TN, Cluster, RunningOperator, cluster, phase, pod_env, simulated_gpu,
                                            start_operator, trainingjob)
from tests.support.operator_scenarios import conditions, events_of, reasons, restarted, running
from tensile_operator.app import OperatorApp
from tensile_operator.forecasting import Forecaster
from tensile_operator.kube import Conflict, KubeError
from tensile_operator.placement import Booking, Gpu
from tensile_operator.pods import build_pod

# a container the kubelet is still creating (its image pulled, say): the pod has not started
CREATING = {"phase": "Pending", "containerStatuses": [{"name": "train", "state": {"waiting": {"reason": "ContainerCreating"}}}]}


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The API server's trouble retried at once, and a failed look at a job whose GPU went looked at again soon."""
    monkeypatch.setattr(timing, "RETRY_DELAYS", (0.01, 0.01, 0.01))
    monkeypatch.setattr(timing, "RESYNC_SECONDS", 0.5)


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


async def two_nodes(c: Cluster, forecaster: Forecaster) -> RunningOperator:
    """node-a with a 4 GiB GPU (best fit places jobs there first) and node-b with an 8 GiB one, and the operator."""
    await c.publish_node("node-a", [simulated_gpu("GPU-a0", 4)])
    await c.publish_node("node-b", [simulated_gpu("GPU-b0", 8)])
    return await start_operator(forecaster)


def left_alone(c: Cluster, name: str, before: dict) -> None:
    """The job's pod is the one it had, not being deleted, and the job is still placed where it was."""
    now = pod(c, name)
    assert now is not None and now["metadata"]["uid"] == before["metadata"]["uid"], now
    assert not now["metadata"].get("deletionTimestamp")
    assert (c.job(name) or {})["status"]["placement"]["node"] == before["spec"]["nodeName"]


@pytest.mark.cluster
def test_a_job_whose_pod_had_not_started_is_placed_again_when_its_tensilenode_goes(tmp_path: Path, forecaster: Forecaster) -> None:
    """TensileNode node-a removed with three jobs booked there. `wait`, whose pod was still being created, waited for
    good on a pod pinned to node-a while node-b had room: its pod is deleted and it is placed on node-b (a new pod
    there), with one `Requeued` Event naming node-a. `run` (running) and `init` (Pending, but its init container
    started) keep their pods and their bookings and say `NodeAvailable=False`, `TensileNodeRemoved`, as before."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            op = await two_nodes(c, forecaster)
            try:
                # best fit puts each on node-a (least room left)
                await placed(c, "run", "1Gi")
                run = await running(c, "run")
                init = await placed(c, "init", "1Gi", {"phase": "Pending", "initContainerStatuses": [
                    {"name": "tensile-hook", "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]})
                wait = await placed(c, "wait", "2Gi", CREATING)
                assert {placed_on(c, n) for n in ("init", "wait")} == {("node-a", "GPU-a0")}
                c.emu.unreachable.add("node-a")  # drained and gone: a graceful deletion of its pods is never confirmed
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
                    assert f"default/{name}" in op.app.capacity.ledger.bookings and "Requeued" not in reasons(c, name)
                await asyncio.sleep(0.3)  # the old pod's late events end nothing
                assert phase(c.job("wait")) == "Admitted"
                assert op.app.capacity.ledger.bookings["default/wait"].node == "node-b"
            finally:
                await op.stop()

    asyncio.run(scenario())


@pytest.mark.cluster
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
                assert "default/moved" not in op.app.capacity.ledger.bookings
                holder = pod(c, "holder")
                assert holder is not None
                await c.set_pod_status(holder, {"phase": "Succeeded"})
                await c.wait(lambda: placed_on(c, "moved") == ("node-b", "GPU-b0"), 10, "moved placed where room freed")
                await asyncio.sleep(0.3)
                assert phase(c.job("after")) == "Queued"
            finally:
                await op.stop()

    asyncio.run(scenario())


@pytest.mark.cluster
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


@pytest.mark.cluster
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


@pytest.mark.cluster
def test_a_job_not_placed_again_for_the_api_servers_trouble_is_looked_at_again(tmp_path: Path, forecaster: Forecaster,
                                                                              quick_retries: None) -> None:
    """node-a goes while the API server refuses pod deletions (500): `wait`'s unstarted pod is not deleted, after the
    call's retries. The job is looked at again periodically, and once deletions go through it is placed on node-b. It
    was left booked on node-a for good: a removed TensileNode sends no further event."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            op = await two_nodes(c, forecaster)
            try:
                wait = await placed(c, "wait", "2Gi", CREATING)
                assert placed_on(c, "wait") == ("node-a", "GPU-a0")
                c.emu.unreachable.add("node-a")
                c.emu.refuse("v1/pods", 500, "delete")
                await remove_node(c, "node-a")
                tries = 1 + len(timing.RETRY_DELAYS)
                await c.wait(lambda: len(c.emu.refusals) >= 2 * tries, 10, "the deletion refused, then looked at again")
                assert placed_on(c, "wait") == ("node-a", "GPU-a0") and (pod(c, "wait") or {})["metadata"] == wait["metadata"]
                c.emu.refuse("v1/pods", None, "delete")
                await c.wait(lambda: placed_on(c, "wait") == ("node-b", "GPU-b0"), 10, "wait placed on node-b")
                await c.wait(lambda: (p := pod(c, "wait")) and p["spec"]["nodeName"] == "node-b", 10, "wait's new pod")
                assert reasons(c, "wait").count("Requeued") == 1
            finally:
                await op.stop()

    asyncio.run(scenario())


@pytest.mark.cluster
def test_a_job_deleted_with_its_unstarted_pod_on_a_node_that_is_gone_is_deleted(tmp_path: Path, forecaster: Forecaster) -> None:
    """While no operator ran, node-a was drained and removed (its kubelet gone, its TensileNode deleted) and `wait`, its
    pod still being created there, was deleted. Its deletion deletes that pod with no grace period and ends: with the
    default one, the deletion was never confirmed (no kubelet), and the finalizer kept the job for good."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            op = await two_nodes(c, forecaster)
            try:
                await placed(c, "wait", "2Gi", CREATING)
                assert placed_on(c, "wait") == ("node-a", "GPU-a0")
                await op.stop()
                c.emu.unreachable.add("node-a")
                await remove_node(c, "node-a")
                await c.delete("wait")
                op = await start_operator(forecaster)
                await c.wait(lambda: c.job("wait") is None, 10, "wait deleted")
                assert pod(c, "wait") is None and not op.app.capacity.ledger.bookings
            finally:
                await op.stop()

    asyncio.run(scenario())


def test_the_emulator_honours_delete_options(tmp_path: Path) -> None:
    """What the operator's deletions rely on, as the API server does it: preconditions (uid, resourceVersion: 409 when
    they no longer hold), and a pod on a node whose kubelet is gone kept terminating by a graceful deletion, removed
    by one with no grace period."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            body = unit_pod(unit_job())
            body["metadata"] = {k: v for k, v in body["metadata"].items() if k not in ("uid", "resourceVersion")}
            made = await c.request("POST", "/api/v1/namespaces/default/pods", body)
            url = f"/api/v1/namespaces/default/pods/{made['metadata']['name']}"
            c.emu.unreachable.add("node-a")
            for wrong in ({"uid": "another"}, {"resourceVersion": "1"}):
                await c.request("DELETE", url, {"preconditions": wrong}, status_ok=(409,))
            await c.request("DELETE", url, {"gracePeriodSeconds": 30}, status_ok=(200,))
            terminating = pod(c, "j")
            assert terminating is not None and terminating["metadata"]["deletionGracePeriodSeconds"] == 30
            assert terminating["metadata"]["deletionTimestamp"]
            await c.request("DELETE", url, {"gracePeriodSeconds": 0, "preconditions": {
                "uid": made["metadata"]["uid"], "resourceVersion": terminating["metadata"]["resourceVersion"]}})
            assert pod(c, "j") is None

    asyncio.run(scenario())


class Api:
    """The API server for unit tests of a re-placement: job `j`, its pod (`pod`; the deletion's preconditions are
    checked against it, and its DELETED event is told to the operator, as its watch tells it), status writes.
    `starts`: the kubelet starts the pod just after the operator read it (a deletion as it was read is refused: 409);
    `failures[call]`: raised by each such call; `hold(call, when)`: such calls matching `when` wait until released."""

    def __init__(self, body: dict, pod: dict | None, starts: bool = False) -> None:
        self.job, self.pod, self.starts = body, pod, starts
        self.app: OperatorApp | None = None  # the operator its pods' DELETED events are told to
        self.deletions: list[dict | None] = []
        self.statuses: list[dict] = []
        self.failures: dict[str, Exception] = {}
        self.gets = 0
        self._holds: dict[str, tuple[Callable[[dict], bool], asyncio.Event, asyncio.Event]] = {}

    def hold(self, call: str, when: Callable[[dict], bool]) -> tuple[asyncio.Event, asyncio.Event]:
        """(set once such a call waits, set it to let the call go on)."""
        reached, release = asyncio.Event(), asyncio.Event()
        self._holds[call] = (when, reached, release)
        return reached, release

    async def _answer(self, call: str, body: dict) -> None:
        if call in self._holds and self._holds[call][0](body):
            _, reached, release = self._holds.pop(call)
            reached.set()
            await release.wait()
        if call in self.failures:
            raise self.failures[call]

    async def get_job(self, namespace: str, name: str) -> dict:
        self.gets += 1
        return self.job

    async def find_pod(self, namespace: str, name: str) -> dict | None:
        return self.pod

    async def create_pod(self, namespace: str, pod: dict) -> dict:
        await self._answer("create", pod)
        if self.pod is not None:
            raise Conflict(409, "already exists")
        self.pod = pod | {"metadata": pod["metadata"] | {"uid": "p2", "resourceVersion": "5"}, "status": {"phase": "Pending"}}
        return self.pod

    async def delete_pod(self, namespace: str, name: str, options: dict | None = None) -> None:
        self.deletions.append(options)
        await self._answer("delete", options or {})
        if self.pod is None:
            return
        wanted = (options or {}).get("preconditions") or {}
        if self.starts:  # started meanwhile: the API server refuses a deletion whose preconditions no longer hold
            self.pod = self.pod | {"metadata": self.pod["metadata"] | {"resourceVersion": "2"}, "status": {"phase": "Running"}}
        if any(self.pod["metadata"].get(k) != v for k, v in wanted.items()):
            raise Conflict(409, "Precondition failed")
        gone, self.pod = self.pod, None
        assert self.app is not None
        asyncio.get_running_loop().create_task(self.app.follower.pod_changed(gone, deleted=True))

    async def patch_job_status(self, namespace: str, name: str, status: dict, resource_version: str | None = None) -> dict:
        await self._answer("patch", status)
        self.statuses.append(status)
        return {}

    async def create_event(self, namespace: str, event: dict) -> dict:
        return event

    def conditions(self) -> dict[str, str]:
        """Each condition type written, by its last reason."""
        return {c["type"]: c["reason"] for s in self.statuses for c in s.get("conditions", [])}


def unit_job(status: dict | None = None) -> dict:
    body = job("j", "1Gi") | {"status": status or {"phase": "Admitted"}}
    body["metadata"] |= {"namespace": "default", "uid": "u1", "creationTimestamp": "2026-01-01T00:00:00Z"}
    return body


def unit_pod(body: dict, status: dict | None = None) -> dict:
    """The job's pod on node-a GPU-a0 as the API server holds it (uid p1, resourceVersion 1), its container being
    created unless `status` says."""
    made = build_pod(body, "node-a", "GPU-a0", None, GIB, None, None)
    return made | {"metadata": made["metadata"] | {"uid": "p1", "resourceVersion": "1"}, "status": status or CREATING}


@asynccontextmanager
async def placed_on_a(forecaster: Forecaster, pod_status: dict | None = CREATING, starts: bool = False,
                      gpus: tuple[str, ...] = (),
                      agents: Agents | None = None) -> AsyncIterator[tuple[OperatorApp, Api, Booking]]:
    """Job j booked on node-a GPU-a0, its pod made there with `pod_status` (None: no pod), node-b GPU-b0 with room;
    node-a lists `gpus` (none: its TensileNode is gone); `agents`: the node agents as the operator reaches them. Its
    background tasks are awaited and its Events closed at the end, and no pod stays marked as deleted to place its job
    again."""
    body = unit_job()
    api = Api(body, unit_pod(body, status=pod_status) if pod_status else None, starts)
    app = api.app = OperatorApp(forecaster, kube=api, agents=agents)  # type: ignore[arg-type]
    app.capacity.ready.set()
    app.capacity.inventory = {"node-b": [Gpu("node-b", "GPU-b0", "Simulated GPU", 8 * GIB, 8 * GIB, simulated=True)]}
    if gpus:
        app.capacity.inventory["node-a"] = [Gpu("node-a", g, "Simulated GPU", 8 * GIB, 8 * GIB, agent="http://agent-a",
                                                simulated=True) for g in gpus]
    booking = Booking("default/j", "GPU-a0", "node-a", GIB)
    app.capacity.ledger.book(booking)
    try:
        yield app, api, booking
        await settled(app)
        assert not app.pods.deleting, app.pods.deleting
    finally:
        await app.events.close()


async def spin() -> None:
    """The event loop runs what it can (tasks waiting on nothing but their turn)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def settled(app: OperatorApp) -> None:
    """Every task the operator started has ended."""
    await spin()
    await asyncio.gather(*app.background.tasks)


def test_only_an_unstarted_pod_is_deleted_and_only_as_it_was_read(forecaster: Forecaster) -> None:
    """The pod is deleted with no grace period (a kubelet of a node that is gone never confirms a graceful deletion)
    and with preconditions on its uid and resourceVersion: one that started after it was read (409) is read again
    and left to run, its job said, not placed again."""
    for starts in (False, True):
        async def scenario() -> None:
            async with placed_on_a(forecaster, starts=starts) as (app, api, booking):
                await app.replacement.check_node("node-a")
                await settled(app)
            assert api.deletions[0] == {"gracePeriodSeconds": 0, "preconditions": {"uid": "p1", "resourceVersion": "1"}}
            if starts:
                assert len(api.deletions) == 1 and api.pod is not None and api.conditions() == {"NodeAvailable": "TensileNodeRemoved"}
                assert "default/j" in app.capacity.ledger.bookings and "default/j" not in app.queue.pending
            else:
                assert api.conditions()["Admitted"] == "TensileNodeRemoved" and "default/j" in app.queue.pending
                assert api.statuses[0]["placement"] is None and "default/j" not in app.capacity.ledger.bookings

        asyncio.run(scenario())


def test_a_failed_deletion_is_retried_and_leaves_no_mark_on_the_pod(forecaster: Forecaster, quick_retries: None) -> None:
    """The API server refuses the unstarted pod's deletion (500): the call is retried, and once it fails for good the pod
    is not left marked as deleted by the operator. The mark stayed, so the pod's later deletion by someone else (the
    garbage collector, kubectl) was taken for the operator's own, not the job's end: it stayed Admitted, booked, with
    no pod."""

    async def scenario() -> None:
        async with placed_on_a(forecaster) as (app, api, booking):
            api.failures["delete"] = KubeError(500, "etcd is unhappy")
            pod = api.pod
            assert pod is not None
            await app.replacement.check_node("node-a")
            await settled(app)
            assert len(api.deletions) == 1 + len(timing.RETRY_DELAYS) and "default/j" in app.capacity.ledger.bookings
            assert not app.pods.deleting and not app.replacement.checking
            await app.follower.pod_changed(pod, deleted=True)  # kubectl delete pod
            assert api.statuses[-1]["phase"] == "Failed" and api.conditions()["Finished"] == "PodDeleted"
            assert "default/j" not in app.capacity.ledger.bookings

    asyncio.run(scenario())


@pytest.mark.parametrize("held", ["queued again", "admitted again"])
def test_a_job_deleted_while_it_is_placed_again_is_not_admitted_again(forecaster: Forecaster, held: str) -> None:
    """The job is deleted while its re-placement writes that it is queued again (a write retried for up to a minute
    through the API server's trouble), or while it goes through admission again: its deletion ends it (Failed,
    Deleted, once the re-placement is done) and it is not queued. It was: the stale body was admitted after the
    deletion had ended, and the deleted job was placed, its pod made, its GPU booked for good."""
    when: Callable[[dict], bool] = ((lambda s: "placement" in s and s["placement"] is None) if held == "queued again"
                                    else (lambda s: s.get("message") == "waiting for placement"))

    async def scenario() -> None:
        async with placed_on_a(forecaster) as (app, api, booking):
            reached, release = api.hold("patch", when)
            await app.replacement.check_node("node-a")
            await reached.wait()
            body = unit_job() | {"metadata": unit_job()["metadata"] | {"deletionTimestamp": "2026-01-01T00:00:01Z"}}
            deletion = asyncio.create_task(app.follower.deleted(body))
            await spin()
            release.set()
            await asyncio.wait_for(deletion, 5)
            await settled(app)
            assert "default/j" not in app.queue.pending and "default/j" not in app.capacity.ledger.bookings
            if held == "queued again":  # still booked when the deletion was seen: its end is written
                assert api.statuses[-1]["phase"] == "Failed" and api.conditions()["Finished"] == "Deleted"

    asyncio.run(scenario())


@pytest.mark.parametrize("started", [False, True])
def test_a_pod_of_the_jobs_earlier_placement_is_made_anew_where_the_job_is_booked(forecaster: Forecaster, started: bool) -> None:
    """Creating the job's pod for its new booking (node-b GPU-b0) finds its pod of an earlier placement, pinned to
    node-a GPU-a0 (a resumed creation that landed after the job was placed again). Not started, it is deleted (no grace
    period, as it was read) and made anew on node-b; it was followed, and the job waited for good on a node that is
    gone. Started, it is left alone, as ever."""

    async def scenario() -> None:
        async with placed_on_a(forecaster, pod_status={"phase": "Running"} if started else CREATING) as (app, api, booking):
            moved = Booking("default/j", "GPU-b0", "node-b", GIB)
            await app.pods.ensure_pod(unit_job(), moved)
            assert api.pod is not None
            if started:
                assert not api.deletions and api.pod["spec"]["nodeName"] == "node-a"
            else:
                assert api.deletions == [{"gracePeriodSeconds": 0, "preconditions": {"uid": "p1", "resourceVersion": "1"}}]
                assert api.pod["spec"]["nodeName"] == "node-b" and pod_env(api.pod)["TENSILE_GPU"] == "GPU-b0"
                # its old pod's end ends nothing
                assert "default/j" in app.capacity.ledger.bookings and not api.conditions()

    asyncio.run(scenario())


def test_a_pod_made_on_resume_is_waited_for_before_its_job_is_placed_again(forecaster: Forecaster) -> None:
    """A placed job with no pod is resumed (its pod made) and its TensileNode goes while the creation is under way:
    the job is looked at once the pod is made (and deletes it), as for a placement's creation. The resume's creation
    was not tracked, so the job was queued again with no pod found, and the pod landed after, pinned to node-a."""

    async def scenario() -> None:
        async with placed_on_a(forecaster, pod_status=None, gpus=("GPU-a0",)) as (app, api, booking):
            reached, release = api.hold("create", lambda pod: True)
            body = unit_job({"phase": "Admitted", "placement": {"node": "node-a", "gpu": "GPU-a0"}})
            await asyncio.wait_for(app.intake.admit(body), 5)  # the resume handler does not wait for the creation
            await reached.wait()
            app.capacity.set_node(None, "node-a")
            await app.replacement.check_node("node-a")
            await spin()
            assert not api.statuses and "default/j" in app.replacement.checking  # waits for the creation
            release.set()
            await settled(app)
            assert api.pod is None and len(api.deletions) == 1 and "default/j" in app.queue.pending

    asyncio.run(scenario())


def test_a_job_being_deleted_is_not_looked_at_again_at_each_heartbeat(forecaster: Forecaster) -> None:
    """A job whose GPU its TensileNode stopped listing, being deleted: its TensileNode's heartbeats (each an update)
    read the job again each time; its deletion has it."""

    async def scenario() -> None:
        async with placed_on_a(forecaster, gpus=("GPU-a1",)) as (app, api, booking):
            app.completion.deletion_started("default/j")  # `deleted` is under way
            for _ in range(3):
                await app.replacement.check_node("node-a")
            await settled(app)
            assert api.gets == 0 and not api.statuses and not app.replacement.checking
            app.completion.deletion_ended("default/j")

    asyncio.run(scenario())


class Agents:
    """Node agents as the operator reaches them: who was told a job left."""

    def __init__(self) -> None:
        self.unregistered: list[tuple[str | None, str]] = []

    async def unregister(self, agent: str | None, job: str, token: str) -> None:
        self.unregistered.append((agent, job))

    async def live_workload(self, agent: str | None, job: str, token: str) -> None:
        return None


def test_the_agent_of_a_gpu_no_longer_listed_is_told_its_job_left(forecaster: Forecaster) -> None:
    """Its GPU unlisted (GPURemoved), the job's booking is released: the agent of its node, which still runs and holds
    the forecast the operator registered for the job, is told. It was looked up by the GPU, gone, so none was."""

    async def scenario() -> None:
        agents = Agents()
        async with placed_on_a(forecaster, gpus=("GPU-a1",), agents=agents) as (app, api, booking):
            await app.replacement.check_node("node-a")
            await settled(app)
            assert "default/j" in app.queue.pending and agents.unregistered == [("http://agent-a", "default/j")]

    asyncio.run(scenario())
