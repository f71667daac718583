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
                size = admitted_bytes(forecast.vanilla_peak_bytes, forecast.allocator_slack_bytes, DEFAULT_CONTEXT_BYTES,
                                      POLICY)
                assert job["status"]["placement"]["claimBytes"] == size
                exactly = claim["spec"]["devices"]["requests"][0]["exactly"]
                assert exactly["deviceClassName"] == DRIVER
                assert parse_quantity(exactly["capacity"]["requests"]["memory"]) == size
                assert exactly["selectors"] == [{"cel": {"expression": f'device.attributes["{DRIVER}"].uuid == "GPU-a0"'}}]
                assert claim["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
                [pod] = c.pods()
                assert pod["spec"]["resourceClaims"] == [{"name": "tensile-gpu", "resourceClaimName": claim["metadata"]["name"]}]
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
