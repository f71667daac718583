"""`dra` mode against the emulator: each admitted job's ResourceClaim and its pod, placement from ResourceSlices and
everyone's allocated claims, a claim the scheduler cannot allocate, and a cluster that cannot take claims at all."""

from __future__ import annotations

import asyncio

import kubernetes_validate
import pytest
from tests.support.dra_objects import DRIVER, POLICY, claim_pod, device_class, foreign_claim, gpu_slice
from tests.support.kube_emulator import DEVICE_CLASSES, RESOURCE_CLAIMS, RESOURCE_SLICES
from tests.support.operator_harness import Cluster, cluster, fake_kubelet, phase, pod_env, start_operator, trainingjob

from tensile.admission import GIB, MIB, admitted_bytes, parse_quantity
from tensile_operator.claims import GpuAccess
from tensile_operator.dra_inventory import DEFAULT_CONTEXT_BYTES

pytestmark = pytest.mark.cluster
KUBERNETES = ("1.36.0", "1.37.0")


def strictly_valid(obj: dict) -> None:
    for version in KUBERNETES:
        kubernetes_validate.validate(obj, version, strict=True)


async def dra_cluster(c: Cluster, gpus: dict[str, list[tuple[str, float]]], with_class: bool = True,
                      memory: bool = True) -> None:
    for node, devices in gpus.items():
        await c.create(RESOURCE_SLICES, gpu_slice(node, devices, memory=memory))
    if with_class:
        await c.create(DEVICE_CLASSES, device_class())


def claim_of(c: Cluster, job: dict) -> dict:
    placement = job["status"]["placement"]
    return c.emu.get(RESOURCE_CLAIMS, job["metadata"]["namespace"], placement["claim"])


def test_an_admitted_job_gets_a_claim_of_its_admitted_size_and_a_pod_that_names_it(tmp_path, forecaster):
    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, {"node-a": [("GPU-a0", 8)]})
            op = await start_operator(forecaster, access=GpuAccess())
            kubelet = asyncio.create_task(fake_kubelet(c, lambda pod: 30, bound_only=True))
            try:
                await c.apply(trainingjob("vgg", "vgg16", 1))
                await c.wait(lambda: phase(c.job("vgg")) == "Running", 60, "vgg running")
                job = c.job("vgg")
                claim = claim_of(c, job)
                forecast = forecaster.by_signature(job["status"]["forecast"]["signature"],
                                                   op.app.capacity.booking("default/vgg").forecast.scope)
                size = admitted_bytes(forecast.vanilla_peak_bytes, forecast.allocator_slack_bytes,
                                      DEFAULT_CONTEXT_BYTES, POLICY)
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


def admitted(job: dict | None) -> dict:
    return next((c for c in ((job or {}).get("status") or {}).get("conditions") or [] if c["type"] == "Admitted"), {})


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


@pytest.mark.slow
def test_sixty_jobs_beside_other_workloads_with_a_restart_never_overfill_a_gpu(tmp_path, forecaster, monkeypatch):
    """60 TrainingJobs of mixed sizes on 2 nodes x 2 GPUs of 8 GiB, other workloads' claims holding part of two GPUs,
    and the operator restarted mid-way: at no moment is a device's claimed memory over its capacity (the emulated
    scheduler's sums) nor do the placements the statuses hold add up to more than a GPU has; in the end every job has
    Succeeded, but for the two larger than any GPU, Queued saying so."""
    from tensile_operator import timing

    monkeypatch.setattr(timing, "CLAIMS_SECONDS", 0.5)
    sizes = ["1Gi", "1536Mi", "2Gi", "3Gi", "512Mi"]
    names = [f"job-{i:02d}" for i in range(60)]
    too_large = {"job-17", "job-44"}
    capacity = 8 * GIB
    foreign = {"GPU-a0": 2 * GIB, "GPU-b1": 1 * GIB}
    problems: list[str] = []

    def check(c: Cluster) -> None:
        problems.extend(c.emu.device_overcommits())
        held: dict[str, int] = dict(foreign)
        for job in c.jobs():
            status = job.get("status") or {}
            if status.get("phase") in ("Admitted", "Running") and status.get("placement"):
                gpu = status["placement"]["gpu"]
                held[gpu] = held.get(gpu, 0) + status["placement"]["claimBytes"]
        problems.extend(f"{gpu}: {n} booked" for gpu, n in held.items() if n > capacity)

    async def watch(c: Cluster) -> None:
        while True:
            check(c)
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await dra_cluster(c, {"node-a": [("GPU-a0", 8), ("GPU-a1", 8)], "node-b": [("GPU-b0", 8), ("GPU-b1", 8)]})
            for gpu, size in foreign.items():
                await c.create(RESOURCE_CLAIMS, foreign_claim(f"serve-{gpu.lower()}", size, gpu))
                await c.create("v1/pods", claim_pod(f"serve-{gpu.lower()}", f"serve-{gpu.lower()}"))
            kubelet = asyncio.create_task(fake_kubelet(
                c, lambda pod: 3600 if pod["metadata"]["namespace"] == "other" else 0.3, bound_only=True))
            watcher = asyncio.create_task(watch(c))
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
                check(c)
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
