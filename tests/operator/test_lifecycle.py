"""A job's life through the API server's trouble, operator restarts, spec edits and a name used again."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import pytest

import tensile_operator.timing as timing
from tests.support.operator_harness import (GIB, cluster, gpu_held_by_big, phase, pod_env, simulated_gpu,
                                            start_operator, trainingjob)
from tensile_operator.app import OperatorApp
from tensile_operator.forecasting import Forecaster
from tensile_operator.kube import KubeError, NotFound
from tensile.trainingjob_spec import parse_spec
from tensile_operator.placement import Booking, Gpu
from tensile_operator.pods import build_pod
from tensile_operator.statuses import job_key

TJP = "/apis/tensile.dev/v1alpha1/namespaces/default/trainingjobs/"


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "RETRY_DELAYS", (0.01, 0.01, 0.01), raising=False)


class Api:
    """The API server for the operator's unit tests: status writes, pods and Events; `failures[call]` are raised by the next calls."""

    def __init__(self) -> None:
        self.statuses: list[tuple[str, dict]] = []
        self.pods: dict[str, dict] = {}
        self.jobs: list[dict] = []
        self.failures: dict[str, list[KubeError]] = defaultdict(list)
        self.events: list[dict] = []

    def _answer(self, call: str) -> None:
        if self.failures[call]:
            raise self.failures[call].pop(0)

    async def patch_job_status(self, namespace: str, name: str, status: dict, resource_version: str | None = None) -> dict:
        self._answer("patch")
        self.statuses.append((name, status))
        return {}

    async def get_job(self, namespace: str, name: str) -> dict:
        raise NotFound(404, "not found")

    async def create_pod(self, namespace: str, pod: dict) -> dict:
        self._answer("create")
        self.pods[pod["metadata"]["name"]] = pod
        return pod

    async def find_pod(self, namespace: str, name: str) -> dict | None:
        return self.pods.get(name)

    async def list_trainingjobs(self) -> list[dict]:
        return self.jobs

    async def list_pods(self, selector: str) -> list[dict]:
        return list(self.pods.values())

    async def create_event(self, namespace: str, event: dict) -> dict:
        self.events.append(event)
        return event


def job(name: str, uid: str, status: dict | None = None) -> dict:
    body = trainingjob(name, None, profile="p", memoryBudget="1Gi")
    body["metadata"] |= {"namespace": "default", "uid": uid}
    return body | {"status": status or {}}


def pod_of(body: dict, pod_phase: str) -> dict:
    return build_pod(body, "node-a", "GPU-a0", None, GIB, None, None) | {"status": {"phase": pod_phase}}


def app_with(api: Api) -> OperatorApp:
    app = OperatorApp(kube=api)  # type: ignore[arg-type]
    app.capacity.ready.set()
    return app


def app_holding(*bodies: dict) -> tuple[Api, OperatorApp]:
    """An app that knows the jobs `bodies` and has booked each a GiB of GPU-a0."""
    api = Api()
    app = app_with(api)
    for body in bodies:
        app.statuses.remember(body)
        app.capacity.ledger.book(Booking(job_key(body), "GPU-a0", "node-a", GIB))
    return api, app


def ends(api: Api, name: str) -> list[tuple[str, str]]:
    """(phase, Finished reason) of each end written for the job."""
    return [(s["phase"], {c["type"]: c["reason"] for c in s["conditions"]}["Finished"])
            for n, s in api.statuses if n == name and s.get("phase") in ("Succeeded", "Failed")]


def test_a_late_event_of_an_earlier_jobs_pod_does_not_end_its_successor_of_the_same_name() -> None:
    """Deleted and created again under its name, a job's new incarnation was ended (and its GPU freed while its pod
    ran) by the old pod's late DELETED event: pods were matched to their job by the owner's name, not its uid."""
    api = Api()
    app = app_with(api)
    new = job("x", "u-new", {"phase": "Admitted"})
    app.statuses.remember(new)
    app.capacity.ledger.book(Booking("default/x", "GPU-a0", "node-a", GIB))

    async def scenario() -> None:
        await app.follower.pod_changed(pod_of(job("x", "u-old"), "Succeeded"), deleted=True)
        await app.follower.pod_changed(pod_of(job("x", "u-old"), "Running"), deleted=True)
        assert "default/x" in app.capacity.ledger.bookings and not api.statuses
        await app.follower.pod_changed(pod_of(new, "Succeeded"))  # its own pod still ends it
        assert ends(api, "x") == [("Succeeded", "Completed")] and not app.capacity.ledger.bookings

    asyncio.run(scenario())


def test_a_pod_creation_the_api_servers_trouble_refuses_is_retried(quick_retries: None) -> None:
    """A 5xx or 429 at pod creation was only logged: the job stayed Admitted without a pod, its GPU booked for good.
    It is made again (PodRunning=False, PodCreateFailed meanwhile); a 4xx, or trouble that lasts, fails the job
    and frees its GPU."""
    api = Api()
    app = app_with(api)

    async def start(name: str, *failures: KubeError) -> None:
        body = job(name, f"u-{name}")
        booking = Booking(f"default/{name}", "GPU-a0", "node-a", GIB)
        app.capacity.ledger.book(booking)
        api.failures["create"] = list(failures)
        await app.pods.start_pod(body, booking)

    async def scenario() -> None:
        await start("once", KubeError(503, "etcdserver: leader changed"))
        assert "once-tensile" in api.pods and "default/once" in app.capacity.ledger.bookings
        noted = [c for n, s in api.statuses if n == "once" for c in s.get("conditions", []) if c["type"] == "PodRunning"]
        assert noted[0]["reason"] == "PodCreateFailed" and "leader changed" in noted[0]["message"]
        await start("forbidden", KubeError(403, 'pods "forbidden-tensile" is forbidden: exceeded quota'))
        assert ends(api, "forbidden") == [("Failed", "PodRejected")]
        assert "default/forbidden" not in app.capacity.ledger.bookings
        await start("down", *[KubeError(503, "unavailable")] * 4)
        assert ends(api, "down") == [("Failed", "PodCreateFailed")]
        assert "default/down" not in app.capacity.ledger.bookings
        assert "forbidden-tensile" not in api.pods and "down-tensile" not in api.pods

    asyncio.run(scenario())


def test_an_end_the_api_servers_trouble_refuses_is_written_again(quick_retries: None) -> None:
    """Written once, a 503 on a job's end left it Running for good while its room was released; the next rebuild
    booked it again from that status, a reservation nobody held."""
    api = Api()
    app = app_with(api)
    app.capacity.ledger.book(Booking("default/x", "GPU-a0", "node-a", GIB))
    api.failures["patch"] = [KubeError(503, "the server is currently unable to handle the request")]
    asyncio.run(app.completion.finish("default", "x", "Succeeded", "Completed", "done"))
    assert ends(api, "x") == [("Succeeded", "Completed")] and not app.capacity.ledger.bookings


def test_a_rebuild_ends_a_job_whose_pod_ended_or_went_unseen_instead_of_booking_it() -> None:
    """A status still showing a job placed whose pod has ended, or is gone after it ran (its end was not seen,
    or not written), was booked again by every rebuild. The job is ended; one that never had a pod stays booked."""
    api = Api()
    app = OperatorApp(kube=api)  # type: ignore[arg-type]
    placed = {"phase": "Running", "podName": "-", "placement": {"gpu": "GPU-a0", "node": "node-a"},
              "forecast": {"source": "budget", "reservedBytes": GIB}}
    done, gone, starting = job("done", "u1", placed), job("gone", "u2", placed), job("starting", "u3", placed | {"phase": "Admitted"})
    del starting["status"]["podName"]
    api.jobs = [done, gone, starting]
    api.pods = {"done-tensile": pod_of(done, "Succeeded"), "gone-tensile": pod_of(job("gone", "u-earlier"), "Running")}

    async def scenario() -> None:
        await app.completion.rebuild_ledger()
        await asyncio.gather(*app.background.tasks)

    asyncio.run(scenario())
    assert set(app.capacity.ledger.bookings) == {"default/starting"}
    assert ends(api, "done") == [("Succeeded", "Completed")] and ends(api, "gone") == [("Failed", "PodDeleted")]
    assert "while the operator was down" in dict(api.statuses)["gone"]["message"]


@pytest.mark.slow
@pytest.mark.cluster
def test_a_job_whose_pod_went_while_no_operator_ran_is_not_run_again(tmp_path: Path) -> None:
    """On resume every placed, booked job got its pod made: a job whose pod was deleted, or ended and was cleaned
    up, while the operator was down trained again. It ends `PodDeleted` (result unknown) and frees its GPU."""
    f = Forecaster()

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await c.publish_node("node-a", [simulated_gpu("GPU-a0", 8)])
            op = await start_operator(f)
            try:
                for name in ("killed", "done"):
                    await c.apply(trainingjob(name, None, profile="p", memoryBudget="2Gi"))
                    await c.wait(lambda: c.emu.get("v1/pods", "default", f"{name}-tensile"), 20, f"{name}'s pod")
                    await c.set_pod_status(c.emu.get("v1/pods", "default", f"{name}-tensile"), {"phase": "Running"})
                    await c.wait(lambda: phase(c.job(name)) == "Running", 10, f"{name} running")
                await op.stop()
                await c.set_pod_status(c.emu.get("v1/pods", "default", "done-tensile"), {"phase": "Succeeded"})
                for name in ("killed", "done"):
                    await c.request("DELETE", f"/api/v1/namespaces/default/pods/{name}-tensile", status_ok=(200, 202))
                op = await start_operator(f)
                await c.wait(lambda: phase(c.job("killed")) == phase(c.job("done")) == "Failed", 10, "both ended")
                for name in ("killed", "done"):
                    status = c.job(name)["status"]
                    assert {x["type"]: x["reason"] for x in status["conditions"]}["Finished"] == "PodDeleted"
                    assert "while the operator was down" in status["message"]
                assert not c.pods() and not op.app.capacity.ledger.bookings
            finally:
                await op.stop()

    asyncio.run(scenario())
    f.close()


@pytest.mark.cluster
def test_a_queued_jobs_spec_edit_is_forecast_and_a_placed_jobs_is_said_to_be_fixed(tmp_path: Path, forecaster: Forecaster) -> None:
    """A queued job's spec edited and then a knob annotated: the pod was made from the edited spec (its command,
    batch 2) but placed by the forecast of the old one (batch 1). The edit is forecast (as a restarted operator
    forecasts it) and the pod runs what was forecast; a placed job's edit is not taken, and `SpecApplied` says so."""

    async def scenario() -> None:
        async with gpu_held_by_big(tmp_path, forecaster) as (c, app):
            await c.apply(trainingjob("q", "vgg16", 1))
            await c.wait(lambda: phase(c.job("q")) == "Queued", 60, "q queued")
            command = ["python", "train.py", "--batch", "2"]
            await c.request("PATCH", TJP + "q", {"spec": {"workload": {"batchSize": 2}, "template": {"spec": {"containers": [
                {"name": "train", "image": "example", "command": command}]}}}})
            await c.annotate("q", {"tensile.dev/max-swap-rate": "0.5"})
            await c.wait(lambda: ((c.job("q") or {}).get("status") or {}).get("knobs") is None and any(
                x["type"] == "KnobsApplied" for x in c.job("q")["status"].get("conditions", [])), 60, "the knob taken")
            edited = parse_spec(c.job("q")["spec"])
            expected = await forecaster.forecast(edited.workload, edited.scope)
            assert expected is not None
            await c.wait(lambda: c.job("q")["status"].get("forecast", {}).get("signature") == expected.signature, 60,
                         "q forecast by its edited spec")
            await c.delete("big")
            pod = await c.wait(lambda: c.emu.get("v1/pods", "default", "q-tensile"), 30, "q's pod")
            assert isinstance(pod, dict)
            assert pod["spec"]["containers"][0]["command"] == command
            assert pod_env(pod)["TENSILE_SIGNATURE"] == expected.signature == c.job("q")["status"]["forecast"]["signature"]
            assert pod_env(pod)["TENSILE_MAX_SWAP_RATE"] == "0.5"
            conditions = {x["type"]: x for x in c.job("q")["status"]["conditions"]}
            assert (conditions["SpecApplied"]["status"], conditions["SpecApplied"]["reason"]) == ("True", "ForecastAgain")
            await c.request("PATCH", TJP + "q", {"spec": {"workload": {"batchSize": 4}}})
            await c.wait(lambda: {x["type"]: x["reason"] for x in c.job("q")["status"]["conditions"]}["SpecApplied"]
                         == "FixedAtAdmission", 10, "the placed job's edit said to be not taken")
            assert "delete and create the TrainingJob again" in {
                x["type"]: x["message"] for x in c.job("q")["status"]["conditions"]}["SpecApplied"]
            assert app.capacity.ledger.bookings["default/q"].forecast is not None
            assert app.capacity.ledger.bookings["default/q"].forecast.signature == expected.signature

    asyncio.run(scenario())


@pytest.mark.cluster
def test_a_queued_jobs_spec_edit_is_taken_without_a_restart_as_with_one(tmp_path: Path, forecaster: Forecaster) -> None:
    """A queued job's budget edited down to fit: a restarted operator admitted it by the edit, a running one never
    read it (the job stayed queued)."""

    async def scenario() -> None:
        async with gpu_held_by_big(tmp_path, forecaster) as (c, _):
            await c.apply(trainingjob("q", None, profile="p", memoryBudget="2Gi"))
            await c.wait(lambda: phase(c.job("q")) == "Queued", 20, "q queued")
            await c.request("PATCH", TJP + "q", {"spec": {"memoryBudget": "512Mi"}})
            await c.wait(lambda: phase(c.job("q")) == "Admitted", 10, "q placed by its edited budget")
            assert c.job("q")["status"]["forecast"]["reservedBytes"] == 512 * 1024**2

    asyncio.run(scenario())


def queued_job(name: str, created: str, budget: str, status: dict | None = None) -> dict:
    """A budget-admitted job created at `created` (the API server's whole seconds)."""
    body = job(name, f"u-{name}", status)
    body["metadata"]["creationTimestamp"] = created
    body["spec"]["memoryBudget"] = budget
    return body


def queue_writes(api: Api, name: str) -> list[dict]:
    return [s["queue"] for n, s in api.statuses if n == name and s.get("queue")]


def test_the_queue_is_fifo_by_creation_and_says_since_when_a_job_waits() -> None:
    """The queue was ordered by when a job's forecast and `Queued` write ended: jobs created in order were placed out
    of it, and a restarted operator (whose forecasts finish in another order) gave freed room to a later job. And
    `queue.since` was reset by every new shortfall and by a restart. A later small job still passes a blocked big one."""
    api = Api()
    app = app_with(api)
    app.capacity.inventory = {"node-a": [Gpu("node-a", "GPU-a0", "Simulated GPU", 4 * GIB, 4 * GIB, simulated=True)]}
    app.capacity.ledger.book(Booking("default/holder", "GPU-a0", "node-a", 3 * GIB))
    first_waited = "2020-01-01T00:00:00Z"
    big = queued_job("big", "2020-01-01T00:00:00Z", "2Gi", {"phase": "Queued", "queue": {"since": first_waited}})
    early, late = queued_job("early", "2020-01-01T00:00:05Z", "1Gi"), queued_job("late", "2020-01-01T00:00:05Z", "1Gi")
    later = queued_job("a-later", "2020-01-01T00:00:06Z", "1Gi")

    async def scenario() -> None:
        for body in (later, late, big, early):  # admitted (forecasts ended) in another order than created
            await app.intake.admit(body)
        app.capacity.rebuilt_at = asyncio.get_running_loop().time()
        scheduler = asyncio.create_task(app.scheduler.run())
        try:
            async def settled(*placed: str) -> None:
                """The scheduler's passes have ended (a pass still running could give room freed later to a job
                it passed), and they placed `placed`."""
                await asyncio.wait_for(app.queue.idle(), 10)
                booked = all(f"default/{n}" in app.capacity.ledger.bookings for n in placed)
                assert booked, f"{placed} not placed: {list(app.capacity.ledger.bookings)}"

            await settled("early")  # 1 GiB free: the first created that fits (ties by name: early before late)
            assert set(app.queue.pending) == {"default/big", "default/late", "default/a-later"}
            app.completion.release("default/holder")
            app.capacity.ledger.book(Booking("default/other", "GPU-a0", "node-a", 3 * GIB // 2))
            app.queue.poke()
            await settled("late")  # 1.5 GiB free: big (2 GiB, created first) is passed by the next that fits
            assert set(app.queue.pending) == {"default/big", "default/a-later"}
        finally:
            scheduler.cancel()
            await asyncio.gather(scheduler, return_exceptions=True)
        waits = queue_writes(api, "big")
        assert len(waits) == 2 and waits[0]["shortfallBytes"] != waits[1]["shortfallBytes"]
        assert {w["since"] for w in waits} == {first_waited}  # kept across a restart and a new shortfall
        assert len({w["since"] for w in queue_writes(api, "a-later")}) == 1

    asyncio.run(scenario())


def test_a_pod_kubernetes_cannot_start_is_said_and_an_evicted_one_ends_its_job_evicted() -> None:
    """A pod Pending in ImagePullBackOff (or CreateContainerConfigError) left its job `Admitted`, "placed on ...", with
    no `PodRunning` condition while it held its GPU; an evicted pod ended its job `PodFailed` with no word of why."""
    stuck, evicted = job("stuck", "u1", {"phase": "Admitted"}), job("ev", "u2", {"phase": "Running"})
    api, app = app_holding(stuck, evicted)
    waiting = pod_of(stuck, "Pending")
    waiting["status"]["containerStatuses"] = [{"name": "train", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "exmaple"'}}}]

    async def scenario() -> None:
        await app.follower.pod_changed(pod_of(stuck, "Pending"))  # starting as it should: nothing to say
        assert not api.statuses
        for _ in range(2):  # said once, not at each of the pod's events
            await app.follower.pod_changed(waiting)
        [(_, status)] = api.statuses
        said = {c["type"]: c for c in status["conditions"]}["PodRunning"]
        assert (said["status"], said["reason"]) == ("False", "ImagePullBackOff")
        assert '"exmaple"' in said["message"] and '"exmaple"' in status["message"] and "phase" not in status
        assert "default/stuck" in app.capacity.ledger.bookings  # not ended: Kubernetes may still pull it
        gone = pod_of(evicted, "Failed")
        gone["status"] |= {"reason": "Evicted", "message": "The node was low on resource: memory."}
        await app.follower.pod_changed(gone)
        assert ends(api, "ev") == [("Failed", "Evicted")] and "default/ev" not in app.capacity.ledger.bookings
        assert "low on resource: memory" in dict(api.statuses)["ev"]["message"]

    asyncio.run(scenario())


def test_a_training_that_ran_out_of_cuda_memory_ends_its_job_out_of_memory_with_its_cap() -> None:
    """A failed pod ended its job `PodFailed`, "container train exited with 1 (Error)", with no word of why: the pods
    keep their log's tail on failure (FallbackToLogsOnError), and the job's end reads its last line. PyTorch's
    out-of-memory error there ends the job `OutOfMemory`, naming the memory its process may hold."""
    capped, crashed = job("capped", "u1", {"phase": "Running"}), job("crashed", "u2", {"phase": "Running"})
    api, app = app_holding(capped, crashed)
    log_tail = {
        "capped": "Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to "
                  "allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB\n",
        "crashed": "Traceback (most recent call last):\n  ...\nFileNotFoundError: no dataset at /data/train\n\n"}
    pods = {}
    for body in (capped, crashed):
        pod = build_pod(body, "node-a", "GPU-a0", None, GIB, None, None, memory_cap=GIB + 512 * 2**20)
        assert {c["terminationMessagePolicy"] for c in pod["spec"]["containers"]} == {"FallbackToLogsOnError"}
        pods[body["metadata"]["name"]] = pod | {"status": {"phase": "Failed", "containerStatuses": [{
            "name": "train", "state": {"terminated": {"exitCode": 1, "reason": "Error",
                                                      "message": log_tail[body["metadata"]["name"]]}}}]}}

    async def scenario() -> None:
        for pod in pods.values():
            await app.follower.pod_changed(pod)
        assert ends(api, "capped") == [("Failed", "OutOfMemory")] and ends(api, "crashed") == [("Failed", "PodFailed")]
        said = dict(api.statuses)
        assert said["capped"]["message"].startswith("container train exited with 1 (Error): torch.OutOfMemoryError: "
                                                    "CUDA out of memory. Tried to allocate 20.00 MiB")
        assert "may hold 1,536 MiB (TENSILE_MEMORY_CAP, what it was admitted with)" in said["capped"]["message"]
        assert said["crashed"]["message"] == ("container train exited with 1 (Error): FileNotFoundError: no dataset "
                                              "at /data/train")

    asyncio.run(scenario())


def test_a_container_that_says_how_it_ends_keeps_its_own_termination_message_policy() -> None:
    body = job("own", "u1")
    body["spec"]["template"]["spec"]["containers"][0]["terminationMessagePolicy"] = "File"
    pod = build_pod(body, "node-a", "GPU-a0", None, GIB, None, None)
    assert pod["spec"]["containers"][0]["terminationMessagePolicy"] == "File"
