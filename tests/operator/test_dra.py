"""`dra` mode against the emulator: each admitted job's ResourceClaim and its pod, placement from ResourceSlices and
everyone's allocated claims, a claim the scheduler cannot allocate, a cluster that cannot take claims at all, and a
GPU its driver withdraws from its ResourceSlice while jobs are booked on it."""

from __future__ import annotations

import asyncio

import kubernetes_validate
import pytest
from tests.support.dra_objects import DRIVER, POLICY, claim_pod, device_class, foreign_claim, gpu_slice
from tests.support.kube_emulator import DEVICE_CLASSES, RESOURCE_CLAIMS, RESOURCE_SLICES
from tests.support.operator_harness import Cluster, cluster, fake_kubelet, phase, pod_env, start_operator, trainingjob
from tests.support.operator_scenarios import running

from tensile.admission import GIB, MIB, admitted_bytes, parse_quantity
from tensile.cublas_workspaces import SMALL_WORKSPACE_BYTES
from tensile.devices import DEFAULT_CONTEXT_BYTES, PRESETS
from tensile_operator import timing
from tensile_operator.app import OperatorApp
from tensile_operator.claims import GpuAccess
from tensile_operator.dra_inventory import DraInventory
from tensile_operator.placement import Gpu

pytestmark = pytest.mark.cluster
KUBERNETES = ("1.36.0", "1.37.0")


def strictly_valid(obj: dict) -> None:
    for version in KUBERNETES:
        kubernetes_validate.validate(obj, version, strict=True)


async def dra_cluster(c: Cluster, gpus: dict[str, list[tuple[str, float]]], with_class: bool = True,
                      memory: bool = True, compute_capability: str | None = None) -> None:
    for node, devices in gpus.items():
        await c.create(RESOURCE_SLICES, gpu_slice(node, devices, memory=memory, compute_capability=compute_capability))
    if with_class:
        await c.create(DEVICE_CLASSES, device_class())


def claim_of(c: Cluster, job: dict) -> dict:
    placement = job["status"]["placement"]
    return c.emu.get(RESOURCE_CLAIMS, job["metadata"]["namespace"], placement["claim"])


def test_an_admitted_job_gets_a_claim_of_its_admitted_size_and_a_pod_that_names_it(tmp_path, forecaster):
    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, {"node-a": [("GPU-a0", 8)]}, compute_capability="8.6.0")
            op = await start_operator(forecaster, access=GpuAccess())
            kubelet = asyncio.create_task(fake_kubelet(c, lambda pod: 30, bound_only=True))
            try:
                await c.apply(trainingjob("vgg", "vgg16", 1))
                await c.wait(lambda: phase(c.job("vgg")) == "Running", 60, "vgg running")
                job = c.job("vgg")
                claim = claim_of(c, job)
                forecast = forecaster.by_signature(job["status"]["forecast"]["signature"],
                                                   op.app.capacity.booking("default/vgg").forecast.scope)
                # the slack with the cuBLAS workspaces of the compute capability its driver publishes (8.6: 8 MiB)
                slack = forecast.allocator_slack_bytes[SMALL_WORKSPACE_BYTES]
                size = admitted_bytes(forecast.vanilla_peak_bytes, slack, DEFAULT_CONTEXT_BYTES, POLICY)
                assert job["status"]["placement"]["claimBytes"] == size
                exactly = claim["spec"]["devices"]["requests"][0]["exactly"]
                assert exactly["deviceClassName"] == DRIVER
                assert parse_quantity(exactly["capacity"]["requests"]["memory"]) == size
                expression = f'device.attributes["{DRIVER}"].uuid == "GPU-a0"'
                assert exactly["selectors"] == [{"cel": {"expression": expression}}]
                assert claim["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
                [pod] = c.pods()
                assert pod["spec"]["resourceClaims"] == [
                    {"name": "tensile-gpu", "resourceClaimName": claim["metadata"]["name"]}]
                assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": "tensile-gpu"}]
                assert pod["spec"]["nodeName"] == "node-a"  # bound by the scheduler, where the claim was allocated
                assert not {"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"} & set(pod_env(pod))
                consumed = claim["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["memory"]
                assert parse_quantity(consumed) == size
                for obj in (claim, pod):
                    strictly_valid({k: v for k, v in obj.items() if k != "status"})
                await c.delete("vgg")
                await c.wait(lambda: c.job("vgg") is None, 30, "vgg deleted")
                assert c.emu.items(RESOURCE_CLAIMS) == []
            finally:
                kubelet.cancel()
                await op.stop()

    asyncio.run(scenario())


def test_a_gpus_compute_capability_is_its_drivers_else_its_agents_else_unknown():
    """NVIDIA's driver publishes `cudaComputeCapability` as a version: its major number sizes the cuBLAS workspaces a
    job there is booked with. Without it, the GPU's agent's figure; a malformed one, or none at all, is unknown (the
    largest workspaces are booked), never a failed inventory."""
    inventory = DraInventory(None, GpuAccess())  # type: ignore[arg-type]  # no API calls: slices given directly
    published = {"9.0.0": "GPU-h", "8.6": "GPU-a", "nine": "GPU-x", "": "GPU-y"}
    for version, uuid in published.items():
        slice_ = gpu_slice(f"node-{uuid}", [(uuid, 8)], compute_capability=version)
        inventory.slice_changed(slice_, slice_["metadata"]["name"])
    for node, uuid in (("node-agent", "GPU-agent"), ("node-none", "GPU-none")):
        slice_ = gpu_slice(node, [(uuid, 8)])
        inventory.slice_changed(slice_, slice_["metadata"]["name"])
    agents = {"node-agent": [Gpu("node-agent", "GPU-agent", "g", 8 * GIB, 8 * GIB, compute_capability_major=8)],
              "node-h": [Gpu("node-h", "GPU-h", "g", 8 * GIB, 8 * GIB, compute_capability_major=8)]}
    majors = {gpu.uuid: gpu.compute_capability_major for gpu in inventory.gpus(agents)}
    assert majors == {"GPU-h": 9, "GPU-a": 8, "GPU-x": 0, "GPU-y": 0, "GPU-agent": 8, "GPU-none": 0}


def test_a_gpu_without_an_agent_is_booked_its_presets_context_else_the_default():
    """An H100's processes hold 700 MiB beside their allocators (its preset): booked the 600 MiB default, each could
    hold 100 MiB more than its claim, the pod's TENSILE_CONTEXT_BYTES overriding the hook's own look-up."""
    inventory = DraInventory(None, GpuAccess())  # type: ignore[arg-type]  # no API calls: slices given directly
    for node, name in (("node-h", "NVIDIA H100 80GB HBM3"), ("node-s", "Simulated GPU")):
        slice_ = gpu_slice(node, [(f"GPU-{node}", 8)], product_name=name)
        inventory.slice_changed(slice_, slice_["metadata"]["name"])
    contexts = {gpu.uuid: gpu.context_bytes for gpu in inventory.gpus({})}
    assert contexts == {"GPU-node-h": PRESETS["h100"].context_bytes, "GPU-node-s": DEFAULT_CONTEXT_BYTES}


def condition_of(job: dict | None, type_: str) -> dict:
    return next((x for x in ((job or {}).get("status") or {}).get("conditions") or [] if x["type"] == type_), {})


def admitted(job: dict | None) -> dict:
    return condition_of(job, "Admitted")


def event_reasons(c: Cluster, name: str) -> set[str]:
    return {e.get("reason") for e in c.emu.items("v1/events") if (e.get("involvedObject") or {}).get("name") == name}


def test_placement_goes_around_other_workloads_claims(tmp_path, forecaster):
    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, {"node-a": [("GPU-a0", 8)], "node-b": [("GPU-b0", 8)]})
            # another workload holds 6 GiB of GPU-a0
            await c.create(RESOURCE_CLAIMS, foreign_claim("inference", 6 * GIB, "GPU-a0"))
            await c.create("v1/pods", claim_pod("inference", "inference"))
            op = await start_operator(forecaster, access=GpuAccess())
            try:
                await c.apply(trainingjob("big", None, profile="p", memoryBudget="3Gi"))
                await c.wait(lambda: phase(c.job("big")) == "Admitted", 20, "big admitted")
                assert c.job("big")["status"]["placement"]["gpu"] == "GPU-b0"
                await c.apply(trainingjob("small", None, profile="p", memoryBudget="1Gi"))
                await c.wait(lambda: phase(c.job("small")) == "Admitted", 20, "small admitted")
                # best fit: the 1 GiB job (+ context, rounded: 1792 MiB) fits in the 2 GiB GPU-a0 leaves
                assert c.job("small")["status"]["placement"]["gpu"] == "GPU-a0"
                assert c.emu.device_overcommits() == []
            finally:
                await op.stop()

    asyncio.run(scenario())


def test_a_claim_the_scheduler_cannot_allocate_places_the_job_again(tmp_path, forecaster):
    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, {"node-a": [("GPU-a0", 8)]})
            op = await start_operator(forecaster, access=GpuAccess())
            kubelet = asyncio.create_task(fake_kubelet(c, lambda pod: 0.5, bound_only=True))
            try:
                c.emu.refuse("v1/pods", 503)  # the job's pod is held back after its claim is made
                await c.apply(trainingjob("late", None, profile="p", memoryBudget="3Gi"))
                await c.wait(lambda: c.emu.items(RESOURCE_CLAIMS), 20, "the job's claim")
                # meanwhile another workload's claim takes 6 GiB of the GPU (the scheduler allocates it first)
                from tests.support.dra_allocator import Allocator

                other = await c.create(RESOURCE_CLAIMS, foreign_claim("grab", 6 * GIB, "GPU-a0"))
                allocation = Allocator(c.emu.items(RESOURCE_SLICES), c.emu.items(DEVICE_CLASSES),
                                       c.emu.items(RESOURCE_CLAIMS)).allocate(other)
                await c.request("PATCH", "/apis/resource.k8s.io/v1/namespaces/other/resourceclaims/grab/status",
                                {"status": {"allocation": allocation}})
                c.emu.refuse("v1/pods", None)
                await c.wait(lambda: "ClaimUnallocatable" in event_reasons(c, "late"), 20,
                             "the unallocatable claim noticed")
                await c.wait(lambda: phase(c.job("late")) == "Queued" and admitted(c.job("late"))["reason"] == "Queued",
                             20, "late queued again")
                assert not [p for p in c.pods() if p["metadata"]["namespace"] == "default"]  # no pod without its claim
                assert c.emu.items(RESOURCE_CLAIMS) == [c.emu.get(RESOURCE_CLAIMS, "other", "grab")]
                # the other workload's claim goes: the job is placed and runs
                await c.request("DELETE", "/apis/resource.k8s.io/v1/namespaces/other/resourceclaims/grab")
                await c.wait(lambda: phase(c.job("late")) == "Succeeded", 30, "late succeeded")
            finally:
                kubelet.cancel()
                await op.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(("slices", "with_class", "reason", "fix"), [
    ({"node-a": [("GPU-a0", 8)]}, False, "DeviceClassNotFound", "gpuAccess.deviceClass"),
    ({"node-a": [("GPU-a0", 8)]}, True, "NoMemoryCapacity", "consumable shares"),
    ({"node-a": [("GPU-a0", 8)], "node-b": [("GPU-b0", 16)]}, True, "NoGpuLargeEnough", "lower spec.memoryBudget"),
])
def test_a_cluster_or_job_that_cannot_be_served_is_said_on_the_job(tmp_path, forecaster, monkeypatch, slices,
                                                                    with_class, reason, fix):
    from tensile_operator import timing

    monkeypatch.setattr(timing, "CLAIMS_SECONDS", 0.2)

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, slices, with_class, memory=reason != "NoMemoryCapacity")
            op = await start_operator(forecaster, access=GpuAccess())
            try:
                await c.apply(trainingjob("job", None, profile="p", memoryBudget="20Gi" if reason == "NoGpuLargeEnough"
                                          else "1Gi"))
                await c.wait(lambda: admitted(c.job("job")).get("reason") == reason, 20, reason)
                assert phase(c.job("job")) == "Queued"
                assert fix in admitted(c.job("job"))["message"]
                await c.wait(lambda: reason in event_reasons(c, "job"), 10, f"a {reason} event")
                if reason == "DeviceClassNotFound":  # the driver is installed: the job is placed
                    await c.create(DEVICE_CLASSES, device_class())
                    await c.wait(lambda: phase(c.job("job")) == "Admitted", 20, "admitted once the class exists")
            finally:
                await op.stop()

    asyncio.run(scenario())


def booking_problems(c: Cluster, capacity: dict[str, int], foreign: dict[str, int] | None = None) -> list[str]:
    """Devices over capacity (the emulated scheduler's sums), GPUs whose placed jobs' claims (and the `foreign` bytes
    other workloads hold of them) add up to more than they have, and jobs with more than one pod or claim."""
    problems = list(c.emu.device_overcommits())
    held: dict[str, int] = dict(foreign or {})
    for job in c.jobs():
        status = job.get("status") or {}
        if status.get("phase") in ("Admitted", "Running") and status.get("placement"):
            gpu = status["placement"]["gpu"]
            held[gpu] = held.get(gpu, 0) + status["placement"]["claimBytes"]
    problems.extend(f"{gpu}: {n} booked" for gpu, n in held.items() if n > capacity[gpu])
    for kind, objects in (("pods", c.pods()), ("claims", c.emu.items(RESOURCE_CLAIMS))):
        owners = [o["metadata"]["ownerReferences"][0]["uid"] for o in objects
                  if o["metadata"]["namespace"] == "default"]
        problems.extend(f"{uid}: {owners.count(uid)} {kind}" for uid in set(owners) if owners.count(uid) > 1)
    return problems


async def watch_bookings(c: Cluster, capacity: dict[str, int], problems: list[str],
                         foreign: dict[str, int] | None = None) -> None:
    """`booking_problems` gathered into `problems` at every moment, until cancelled."""
    while True:
        problems.extend(booking_problems(c, capacity, foreign))
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_sixty_jobs_beside_other_workloads_with_a_restart_never_overfill_a_gpu(tmp_path, forecaster, monkeypatch):
    """60 TrainingJobs of mixed sizes on 2 nodes x 2 GPUs of 8 GiB, other workloads' claims holding part of two GPUs,
    and the operator restarted mid-way: at no moment is a device's claimed memory over its capacity (the emulated
    scheduler's sums) nor do the placements the statuses hold add up to more than a GPU has, nor has a job two pods or
    claims; in the end every job has Succeeded, but for the two larger than any GPU, Queued saying so."""
    from tensile_operator import timing

    monkeypatch.setattr(timing, "CLAIMS_SECONDS", 0.5)
    sizes = ["1Gi", "1536Mi", "2Gi", "3Gi", "512Mi"]
    names = [f"job-{i:02d}" for i in range(60)]
    too_large = {"job-17", "job-44"}
    capacity = dict.fromkeys(("GPU-a0", "GPU-a1", "GPU-b0", "GPU-b1"), 8 * GIB)
    foreign = {"GPU-a0": 2 * GIB, "GPU-b1": 1 * GIB}
    problems: list[str] = []

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, {"node-a": [("GPU-a0", 8), ("GPU-a1", 8)], "node-b": [("GPU-b0", 8), ("GPU-b1", 8)]})
            for gpu, size in foreign.items():
                await c.create(RESOURCE_CLAIMS, foreign_claim(f"serve-{gpu.lower()}", size, gpu))
                await c.create("v1/pods", claim_pod(f"serve-{gpu.lower()}", f"serve-{gpu.lower()}"))
            kubelet = asyncio.create_task(fake_kubelet(
                c, lambda pod: 3600 if pod["metadata"]["namespace"] == "other" else 0.3, bound_only=True))
            watcher = asyncio.create_task(watch_bookings(c, capacity, problems, foreign))
            op = await start_operator(forecaster, access=GpuAccess())
            try:
                for i, name in enumerate(names):
                    budget = "10Gi" if name in too_large else sizes[i % len(sizes)]
                    await c.apply(trainingjob(name, None, profile="p", memoryBudget=budget))
                await c.wait(lambda: sum(phase(j) == "Succeeded" for j in c.jobs()) >= 20, 60, "20 jobs done")
                await op.stop()
                op = await start_operator(forecaster, access=GpuAccess())
                await c.wait(lambda: sum(phase(j) == "Succeeded" for j in c.jobs()) == 58, 90, "58 jobs done")
                await c.wait(lambda: all(admitted(c.job(n)).get("reason") == "NoGpuLargeEnough" for n in too_large), 20,
                             "the two too large said so")
                assert {phase(c.job(n)) for n in too_large} == {"Queued"}
                problems.extend(booking_problems(c, capacity, foreign))
                assert problems == []
                pods = [p for p in c.pods() if p["metadata"]["namespace"] == "default"]
                assert len(pods) == 58 and len({p["metadata"]["name"] for p in pods}) == 58  # one pod per job run
                # no finished job's claim holds memory (one whose deletion a restart cut short is deallocated, and goes
                # with its TrainingJob)
                assert not [cl for cl in c.emu.items(RESOURCE_CLAIMS) if cl["metadata"]["namespace"] == "default"
                            and (cl.get("status") or {}).get("allocation")]
            finally:
                watcher.cancel()
                kubelet.cancel()
                await op.stop()

    asyncio.run(scenario())


@pytest.mark.slow
def test_knobs_that_would_need_more_than_the_claim_are_refused(tmp_path, forecaster):
    """ResNet-50 (batch 16) admitted on a GPU its vanilla peak does not fit: planned down, its claim is smaller than
    its vanilla size. Annotations that swap less and recompute nothing would need more than the claim: refused with
    the reason, and its agent is not told (its hook keeps it within its claim)."""
    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, {"node-a": [("GPU-a0", 1.75)]})
            op = await start_operator(forecaster, access=GpuAccess())
            try:
                await c.apply(trainingjob("resnet", "resnet50", 16))
                await c.wait(lambda: phase(c.job("resnet")) == "Admitted", 60, "resnet admitted")
                status = c.job("resnet")["status"]
                assert status["forecast"]["scheduledPeakBytes"] < status["forecast"]["vanillaPeakBytes"]
                await c.annotate("resnet", {"tensile.dev/max-swap-rate": "0.01", "tensile.dev/recompute": "false"})
                knobs = lambda: next((k for k in c.job("resnet")["status"].get("conditions") or []  # noqa: E731
                                      if k["type"] == "KnobsApplied"), {})
                await c.wait(lambda: knobs().get("reason") == "ClaimTooSmall", 30, "the knobs refused")
                assert "delete and create the TrainingJob again" in knobs()["message"]
                assert "knobs" not in c.job("resnet")["status"]
            finally:
                await op.stop()

    asyncio.run(scenario())


# ---- a GPU its driver withdraws from its ResourceSlice ------------------------------------------------------------

SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"


async def republish(c: Cluster, node: str, gpus: list[tuple[str, float]],
                    without: frozenset[str] = frozenset()) -> None:
    """The driver publishes node's slice again with its GPUs but those in `without` (a device went unhealthy, or came
    back); each device keeps its name, as a driver names a device by the GPU it is."""
    name = gpu_slice(node, [])["metadata"]["name"]
    spec = gpu_slice(node, gpus)["spec"]
    spec["devices"] = [d for d in spec["devices"] if d["attributes"]["uuid"]["string"] not in without]
    spec["pool"]["generation"] = c.emu.get(RESOURCE_SLICES, None, name)["spec"]["pool"]["generation"] + 1
    await c.request("PATCH", f"{SLICES_PATH}/{name}", {"spec": spec})


def events_named(c: Cluster, name: str, reason: str) -> list[dict]:
    return [e for e in c.emu.items("v1/events")
            if (e.get("involvedObject") or {}).get("name") == name and e.get("reason") == reason]


def test_a_job_not_running_on_a_gpu_its_slice_no_longer_publishes_is_placed_on_another_and_runs(tmp_path, forecaster):
    """node-a is drained: its driver deletes its ResourceSlice while `wait`'s pod, bound there with its claim allocated,
    has not started. Its pod and claim are deleted and it is placed on node-b's GPU (a Normal `Requeued` Event naming
    the GPU), where its new pod runs to the end; no device is ever over capacity and no job has two pods or claims."""
    capacity = {"GPU-a0": 4 * GIB, "GPU-b0": 8 * GIB}
    problems: list[str] = []

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, {"node-a": [("GPU-a0", 4)], "node-b": [("GPU-b0", 8)]})
            op = await start_operator(forecaster, access=GpuAccess())
            watcher = asyncio.create_task(watch_bookings(c, capacity, problems))
            kubelet = None
            try:
                await c.apply(trainingjob("wait", None, profile="p", memoryBudget="3Gi"))
                await c.wait(lambda: c.pods() and c.pods()[0]["spec"].get("nodeName"), 20, "wait's pod bound")
                [first] = c.pods()
                assert first["spec"]["nodeName"] == "node-a"  # best fit: the smaller GPU
                assert claim_of(c, c.job("wait"))["status"]["allocation"]
                await c.request("DELETE", f"{SLICES_PATH}/{gpu_slice('node-a', [])['metadata']['name']}")
                await c.wait(lambda: (c.job("wait")["status"].get("placement") or {}).get("gpu") == "GPU-b0", 20,
                             "wait placed on GPU-b0")
                await c.wait(lambda: events_named(c, "wait", "Requeued"), 10, "wait's Requeued Event")
                [requeued] = events_named(c, "wait", "Requeued")
                assert requeued["type"] == "Normal" and "GPU-a0" in requeued["message"], requeued
                assert "no ResourceSlice publishes" in requeued["message"]
                new = await c.wait(lambda: [p for p in c.pods() if p["metadata"]["uid"] != first["metadata"]["uid"]
                                            and p["spec"].get("nodeName")], 20, "wait's new pod bound")
                assert isinstance(new, list) and new[0]["spec"]["nodeName"] == "node-b" and len(c.pods()) == 1
                claim = claim_of(c, c.job("wait"))
                assert 'uuid == "GPU-b0"' in claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"][
                    "expression"]
                for obj in (claim, new[0], requeued):
                    strictly_valid({k: v for k, v in obj.items() if k != "status"})
                kubelet = asyncio.create_task(fake_kubelet(c, lambda pod: 0.3, bound_only=True))
                await c.wait(lambda: phase(c.job("wait")) == "Succeeded", 20, "wait succeeded")
                assert problems == []
            finally:
                watcher.cancel()
                if kubelet is not None:
                    kubelet.cancel()
                await op.stop()

    asyncio.run(scenario())


def test_a_running_job_on_a_gpu_its_slice_no_longer_publishes_keeps_running_and_says_so(tmp_path, forecaster):
    """GPU-a0 goes unhealthy: node-a's driver publishes its slice without it while `run` trains there. `run` keeps its
    pod, its allocated claim and its booking, and says `NodeAvailable=False`, `GPUUnpublished` with a Warning Event,
    both naming the GPU; the GPU is not free room meanwhile (a job that fits only there waits). Published again, the
    condition clears (`GPUPublished`) and the waiting job is placed there beside `run`, never over its capacity."""
    capacity = {"GPU-a0": 8 * GIB, "GPU-a1": 8 * GIB}
    problems: list[str] = []

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            gpus = [("GPU-a0", 8), ("GPU-a1", 8)]
            await dra_cluster(c, {"node-a": gpus})
            op = await start_operator(forecaster, access=GpuAccess())
            watcher = asyncio.create_task(watch_bookings(c, capacity, problems))
            try:
                await c.apply(trainingjob("run", None, profile="p", memoryBudget="3Gi"))
                pod = await running(c, "run")
                assert c.job("run")["status"]["placement"]["gpu"] == "GPU-a0"
                await republish(c, "node-a", gpus, without=frozenset({"GPU-a0"}))
                await c.wait(lambda: condition_of(c.job("run"), "NodeAvailable").get("reason") == "GPUUnpublished", 10,
                             "run: NodeAvailable GPUUnpublished")
                said = condition_of(c.job("run"), "NodeAvailable")
                assert said["status"] == "False" and "GPU-a0" in said["message"], said
                assert "no ResourceSlice publishes" in said["message"]
                await c.wait(lambda: events_named(c, "run", "GPUUnpublished"), 10, "run's GPUUnpublished Event")
                [event] = events_named(c, "run", "GPUUnpublished")
                assert event["type"] == "Warning" and "GPU-a0" in event["message"]
                strictly_valid(event)
                # left to run: its pod, its claim (still allocated) and its placement
                [now] = c.pods()
                assert now["metadata"]["uid"] == pod["metadata"]["uid"] and not now["metadata"].get("deletionTimestamp")
                assert phase(c.job("run")) == "Running" and c.job("run")["status"]["placement"]["gpu"] == "GPU-a0"
                assert claim_of(c, c.job("run"))["status"]["allocation"]
                # GPU-a0's room is nobody's: `fill` takes most of GPU-a1, and `more` fits only on GPU-a0
                await c.apply(trainingjob("fill", None, profile="p", memoryBudget="6Gi"))
                await c.wait(lambda: phase(c.job("fill")) == "Admitted", 20, "fill admitted")
                assert c.job("fill")["status"]["placement"]["gpu"] == "GPU-a1"
                await c.apply(trainingjob("more", None, profile="p", memoryBudget="3Gi"))
                await c.wait(lambda: admitted(c.job("more")).get("reason") == "Queued", 20, "more queued")
                await asyncio.sleep(0.5)
                assert phase(c.job("more")) == "Queued"
                # published again: said, and its room beside `run` is taken
                await republish(c, "node-a", gpus)
                await c.wait(lambda: condition_of(c.job("run"), "NodeAvailable").get("status") == "True", 10,
                             "run: NodeAvailable True")
                assert condition_of(c.job("run"), "NodeAvailable")["reason"] == "GPUPublished"
                await c.wait(lambda: events_named(c, "run", "GPUPublished"), 10, "run's GPUPublished Event")
                await c.wait(lambda: phase(c.job("more")) == "Admitted", 20, "more admitted")
                assert c.job("more")["status"]["placement"]["gpu"] == "GPU-a0"
                await republish(c, "node-a", gpus)  # the driver's next update: nothing new
                await asyncio.sleep(0.3)
                assert len(events_named(c, "run", "GPUUnpublished")) == len(events_named(c, "run", "GPUPublished")) == 1
                assert phase(c.job("run")) == "Running" and c.pods()[0]["metadata"]["uid"] == pod["metadata"]["uid"]
                assert problems == []
            finally:
                watcher.cancel()
                await op.stop()

    asyncio.run(scenario())


def test_a_slice_deleted_while_no_operator_ran_is_noticed_at_start(tmp_path, forecaster):
    """node-a's ResourceSlice is deleted while no operator runs (no watch event will ever tell of it): at start-up the
    running job there says `GPUUnpublished` and keeps its pod, and the job whose pod had not started is placed on
    node-b."""
    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, {"node-a": [("GPU-a0", 4)], "node-b": [("GPU-b0", 8)]})
            op = await start_operator(forecaster, access=GpuAccess())
            try:
                await c.apply(trainingjob("run", None, profile="p", memoryBudget="1Gi"))
                pod = await running(c, "run")
                await c.apply(trainingjob("wait", None, profile="p", memoryBudget="1Gi"))
                await c.wait(lambda: len([p for p in c.pods() if p["spec"].get("nodeName")]) == 2, 20, "wait's pod")
                assert {j["status"]["placement"]["gpu"] for j in c.jobs()} == {"GPU-a0"}
                await op.stop()
                await c.request("DELETE", f"{SLICES_PATH}/{gpu_slice('node-a', [])['metadata']['name']}")
                op = await start_operator(forecaster, access=GpuAccess())
                await c.wait(lambda: condition_of(c.job("run"), "NodeAvailable").get("reason") == "GPUUnpublished", 10,
                             "run: NodeAvailable GPUUnpublished")
                await c.wait(lambda: (c.job("wait")["status"].get("placement") or {}).get("gpu") == "GPU-b0", 20,
                             "wait placed on GPU-b0")
                assert [p["metadata"]["uid"] for p in c.pods() if p["metadata"]["name"] == pod["metadata"]["name"]] \
                    == [pod["metadata"]["uid"]]
                assert phase(c.job("run")) == "Running"
                assert booking_problems(c, {"GPU-a0": 4 * GIB, "GPU-b0": 8 * GIB}) == []
            finally:
                await op.stop()

    asyncio.run(scenario())


def test_a_slice_deletion_its_watch_missed_is_noticed_at_the_next_resync(tmp_path, forecaster, monkeypatch):
    """A watch that reconnects lists the slices again but says nothing of one deleted meanwhile, and with no job waiting
    no scheduling pass reads them: the operator reads them every RESYNC_SECONDS, and the running job on the withdrawn
    GPU says `GPUUnpublished` and keeps its pod."""
    monkeypatch.setattr(timing, "RESYNC_SECONDS", 0.5)
    missed: list[str] = []

    async def unseen(self: OperatorApp, body: dict, deleted: bool) -> None:  # the event lost with the watch
        missed.append(body["metadata"]["name"])

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, {"node-a": [("GPU-a0", 4)]})
            op = await start_operator(forecaster, access=GpuAccess())
            try:
                await c.apply(trainingjob("run", None, profile="p", memoryBudget="1Gi"))
                pod = await running(c, "run")
                monkeypatch.setattr(OperatorApp, "slice_changed", unseen)
                name = gpu_slice("node-a", [])["metadata"]["name"]
                await c.request("DELETE", f"{SLICES_PATH}/{name}")
                await c.wait(lambda: name in missed, 10, "the deletion's event, dropped")
                await c.wait(lambda: condition_of(c.job("run"), "NodeAvailable").get("reason") == "GPUUnpublished", 10,
                             "run: NodeAvailable GPUUnpublished")
                assert phase(c.job("run")) == "Running"
                assert [p["metadata"]["uid"] for p in c.pods()] == [pod["metadata"]["uid"]]
            finally:
                await op.stop()

    asyncio.run(scenario())


def slice_of_generation(node: str, gpus: list[tuple[str, float]], generation: int, part: int = 0,
                        count: int = 1) -> dict:
    """Slice `part` of `count` of node's pool at `generation`, named apart from the first generation's slice (a driver
    writes a new generation's slices before it deletes the old ones); each device named by its GPU, as a driver does."""
    made = gpu_slice(node, gpus)
    made["metadata"]["name"] += f"-g{generation}-{part}"
    made["spec"]["pool"] |= {"generation": generation, "resourceSliceCount": count}
    for device, (uuid, _) in zip(made["spec"]["devices"], gpus):
        device["name"] = uuid.lower()
    return made


def test_a_gpu_only_an_older_generation_of_its_pool_lists_is_gone(tmp_path, forecaster):
    """node-a's driver writes its pool's generation 2 without GPU-a0 and has not yet deleted generation 1's slice,
    which still lists it: the running job there says `GPUUnpublished` (a consumer uses each pool's newest generation
    only), and a new job is placed on GPU-a1. Generation 3 comes in two slices; while only the one with GPU-a0 is
    written, the pool is incomplete and GPU-a0 is not said back (the newest complete generation, 2, lacks it); once
    both are, it is published again. A half-written
    generation 4 without it says nothing either: the newest complete generation, 3, lists it."""
    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, {"node-a": [("GPU-a0", 4), ("GPU-a1", 4)]})
            op = await start_operator(forecaster, access=GpuAccess())
            try:
                await c.apply(trainingjob("run", None, profile="p", memoryBudget="1Gi"))
                pod = await running(c, "run")
                assert c.job("run")["status"]["placement"]["gpu"] == "GPU-a0"
                await c.create(RESOURCE_SLICES, slice_of_generation("node-a", [("GPU-a1", 4)], 2))
                await c.wait(lambda: condition_of(c.job("run"), "NodeAvailable").get("reason") == "GPUUnpublished", 10,
                             "run: NodeAvailable GPUUnpublished")
                assert phase(c.job("run")) == "Running"
                assert [p["metadata"]["uid"] for p in c.pods()] == [pod["metadata"]["uid"]]
                # best fit would take GPU-a0, beside `run`; only generation 1 lists it, so it is no room
                await c.apply(trainingjob("more", None, profile="p", memoryBudget="1Gi"))
                await c.wait(lambda: ((c.job("more") or {}).get("status") or {}).get("placement"), 20, "more placed")
                assert c.job("more")["status"]["placement"]["gpu"] == "GPU-a1"
                # generation 3, half written: its first slice lists GPU-a0, but the pool is incomplete
                await c.create(RESOURCE_SLICES, slice_of_generation("node-a", [("GPU-a0", 4)], 3, 0, 2))
                await asyncio.sleep(0.5)
                assert condition_of(c.job("run"), "NodeAvailable")["reason"] == "GPUUnpublished"
                await c.create(RESOURCE_SLICES, slice_of_generation("node-a", [("GPU-a1", 4)], 3, 1, 2))
                await c.wait(lambda: condition_of(c.job("run"), "NodeAvailable").get("reason") == "GPUPublished", 10,
                             "run: NodeAvailable GPUPublished")
                # generation 4, half written, its first slice without GPU-a0: complete generation 3 still says
                await c.create(RESOURCE_SLICES, slice_of_generation("node-a", [("GPU-a1", 4)], 4, 0, 2))
                await asyncio.sleep(0.5)
                assert condition_of(c.job("run"), "NodeAvailable")["reason"] == "GPUPublished"
                assert len(events_named(c, "run", "GPUUnpublished")) == 1
            finally:
                await op.stop()

    asyncio.run(scenario())
