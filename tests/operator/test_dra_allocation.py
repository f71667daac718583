"""The emulator's DRA allocation (tests.support.dra_allocator, played by the emulator for pods with claims), checked
against the documented rules of consumable capacity before any operator test leans on it."""

from __future__ import annotations

import asyncio

import kmock
import pytest
from tests.support.dra_allocator import Allocator, Unallocatable, consumption, selected, devices_of
from tests.support.dra_objects import DRIVER, claim_pod, device_class, foreign_claim, gpu_slice
from tests.support.kube_emulator import DEVICE_CLASSES, RESOURCE_CLAIMS, RESOURCE_SLICES, KubeEmulator

from tensile.admission import GIB, MIB, parse_quantity

SLICES = [gpu_slice("node-a", [("GPU-a0", 4), ("GPU-a1", 4)]), gpu_slice("node-b", [("GPU-b0", 8)])]


def allocated(claim: dict, allocation: dict) -> dict:
    return claim | {"status": {"allocation": allocation}}


def test_a_claim_consumes_its_request_rounded_up_by_the_policy_and_lands_on_its_node() -> None:
    allocation = Allocator(SLICES, [device_class()], []).allocate(foreign_claim("c", 300 * MIB, "GPU-a1"))
    [result] = allocation["devices"]["results"]
    assert (result["driver"], result["pool"], result["device"], result["request"]) == (DRIVER, "node-a", "gpu-1", "gpu")
    assert result["consumedCapacity"] == {"memory": "512Mi"}  # 300 MiB, in steps of 256 MiB
    assert result["shareID"]
    assert allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["node-a"]


def test_a_claim_without_an_amount_consumes_the_default() -> None:
    allocation = Allocator(SLICES, [device_class()], []).allocate(foreign_claim("c", None, "GPU-b0"))
    assert allocation["devices"]["results"][0]["consumedCapacity"] == {"memory": "256Mi"}


def test_the_consumed_sum_per_device_never_exceeds_its_capacity() -> None:
    claims: list[dict] = []
    for i in range(3):
        claim = foreign_claim(f"c{i}", int(1.5 * GIB), "GPU-a0")
        try:
            claims.append(allocated(claim, Allocator(SLICES, [device_class()], claims).allocate(claim)))
        except Unallocatable as exc:
            assert i == 2 and "lack the requested capacity" in str(exc)
    assert len(claims) == 2
    assert consumption(claims)[DRIVER, "node-a", "gpu-0"] == {"memory": 3 * GIB}
    exact = foreign_claim("fill", GIB, "GPU-a0")  # exactly what is left
    claims.append(allocated(exact, Allocator(SLICES, [device_class()], claims).allocate(exact)))
    with pytest.raises(Unallocatable):
        Allocator(SLICES, [device_class()], claims).allocate(foreign_claim("more", 1, "GPU-a0"))


def test_without_a_selector_the_first_device_with_room_is_taken() -> None:
    big = foreign_claim("big", 4 * GIB)
    claims = [allocated(big, Allocator(SLICES, [device_class()], []).allocate(big))]
    allocation = Allocator(SLICES, [device_class()], claims).allocate(foreign_claim("next", GIB))
    assert allocation["devices"]["results"][0]["device"] == "gpu-1"


def test_only_the_newest_generation_of_a_pool_is_allocated_from() -> None:
    """A driver that changes a pool bumps its generation; a slice of an older generation may linger until the driver
    deletes it, and its devices are not to be used."""
    older = gpu_slice("node-a", [("GPU-a0", 4), ("GPU-a1", 4)])
    newer = gpu_slice("node-a", [("GPU-a1", 4)])
    newer["metadata"]["name"] += "-2"
    newer["spec"]["pool"]["generation"] = 2
    assert [d.attribute(DRIVER, "uuid") for d in devices_of([older, newer])] == ["GPU-a1"]
    with pytest.raises(Unallocatable):
        Allocator([older, newer], [device_class()], []).allocate(foreign_claim("c", GIB, "GPU-a0"))


def test_a_missing_class_or_a_device_without_the_capacity_is_refused() -> None:
    with pytest.raises(Unallocatable, match='DeviceClass "gpu.nvidia.com" not found'):
        Allocator(SLICES, [], []).allocate(foreign_claim("c", GIB))
    no_memory = [gpu_slice("node-c", [("GPU-c0", 8)], memory=False)]
    with pytest.raises(Unallocatable, match="lack the requested capacity"):
        Allocator(no_memory, [device_class()], []).allocate(foreign_claim("c", GIB))


def test_a_device_not_shared_is_allocated_to_one_claim_at_a_time() -> None:
    whole = gpu_slice("node-d", [("GPU-d0", 8)], memory=False)
    whole["spec"]["devices"][0]["allowMultipleAllocations"] = False
    first = foreign_claim("one", None)
    claims = [allocated(first, Allocator([whole], [device_class()], []).allocate(first))]
    assert "consumedCapacity" not in claims[0]["status"]["allocation"]["devices"]["results"][0]
    with pytest.raises(Unallocatable):
        Allocator([whole], [device_class()], claims).allocate(foreign_claim("two", None))


def test_cel_selectors_compare_the_driver_and_qualified_attributes() -> None:
    [device] = devices_of([gpu_slice("n", [("GPU-x", 1)])])
    assert selected(f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].uuid == "GPU-x"', device)
    assert not selected(f'device.attributes["{DRIVER}"].uuid == "GPU-y"', device)
    assert selected(f'device.attributes["{DRIVER}"].index == 0', device)


async def _emulated() -> None:
    async with KubeEmulator() as emu, kmock.Server(emu):
        await create(emu, RESOURCE_SLICES, SLICES[0])
        await create(emu, DEVICE_CLASSES, device_class())
        for i in range(3):
            await create(emu, RESOURCE_CLAIMS, foreign_claim(f"c{i}", int(1.5 * GIB), "GPU-a0"))
            await create(emu, "v1/pods", claim_pod(f"p{i}", f"c{i}"))
        pods = {p["metadata"]["name"]: p for p in emu.items("v1/pods")}
        assert pods["p0"]["spec"]["nodeName"] == pods["p1"]["spec"]["nodeName"] == "node-a"
        waiting = pods["p2"]
        assert "nodeName" not in waiting["spec"]
        assert waiting["status"]["conditions"][0]["reason"] == "Unschedulable"
        claim = emu.get(RESOURCE_CLAIMS, "other", "c0")
        p0 = {"resource": "pods", "name": "p0", "uid": pods["p0"]["metadata"]["uid"]}
        assert claim["status"]["reservedFor"] == [p0]
        assert parse_quantity(claim["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["memory"]) == \
            int(1.5 * GIB)
        # p0 finishes: its claim is deallocated and the waiting pod is bound
        async with emu.request("PATCH", "/api/v1/namespaces/other/pods/p0/status",
                               json={"status": {"phase": "Succeeded"}},
                               headers={"Content-Type": "application/merge-patch+json"}) as r:
            assert r.status == 200
        assert "allocation" not in (emu.get(RESOURCE_CLAIMS, "other", "c0").get("status") or {})
        assert emu.get("v1/pods", "other", "p2")["spec"]["nodeName"] == "node-a"
        assert emu.device_overcommits() == []


async def create(emu: KubeEmulator, plural_key: str, body: dict) -> None:
    group_version, plural = plural_key.rsplit("/", 1)
    namespace = (body["metadata"].get("namespace"))
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    async with emu.request("POST", path, json=body) as r:
        assert r.status in (200, 201), await r.text()


def test_the_emulator_binds_pods_to_their_claims_devices_and_frees_them_when_they_end() -> None:
    asyncio.run(_emulated())
