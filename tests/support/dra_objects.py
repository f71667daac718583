"""resource.k8s.io/v1 objects as a DRA GPU driver and other workloads write them, for tests: a node's ResourceSlice
of GPUs shared by memory (as NVIDIA's driver publishes them with consumable shares), the driver's DeviceClass, and
claims of workloads that are not Tensile's."""

from __future__ import annotations

from tensile.admission import GIB, RequestPolicy, quantity

DRIVER = "gpu.nvidia.com"
MIB = 1024**2
# what the tests' devices accept: at least 256 MiB, in steps of 256 MiB
POLICY = RequestPolicy(default=256 * MIB, minimum=256 * MIB, step=256 * MIB)


def gpu_slice(node: str, gpus: list[tuple[str, float]], policy: RequestPolicy | None = POLICY,
              memory: bool = True, driver: str = DRIVER, compute_capability: str | None = None,
              product_name: str = "Simulated GPU") -> dict:
    """The ResourceSlice of `node`: one multi-allocatable device per (uuid, GiB) named `product_name`, with a
    `memory` capacity (left out with `memory=False`: a driver that shares GPUs by time only) and, where given, a
    `cudaComputeCapability` (a version, "9.0.0", as NVIDIA's driver publishes it)."""
    devices = []
    for index, (uuid, gib) in enumerate(gpus):
        device: dict = {"name": f"gpu-{index}", "allowMultipleAllocations": True, "attributes": {
            "type": {"string": "gpu"}, "uuid": {"string": uuid}, "index": {"int": index},
            "productName": {"string": product_name}}}
        if compute_capability is not None:
            device["attributes"]["cudaComputeCapability"] = {"version": compute_capability}
        if memory:
            device["capacity"] = {"memory": (policy or RequestPolicy()).to_capacity(int(gib * GIB))}
        devices.append(device)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-{driver}"},
            "spec": {"driver": driver, "nodeName": node, "devices": devices,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}}}


def device_class(name: str = DRIVER, driver: str = DRIVER) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}, "spec": {
        "selectors": [{"cel": {"expression": f'device.driver == "{driver}" && '
                                             f'device.attributes["{driver}"].type == "gpu"'}}]}}


def foreign_claim(name: str, memory: int | None, uuid: str | None = None, class_name: str = DRIVER,
                  namespace: str = "other") -> dict:
    """A claim of some other workload: `memory` bytes (None: no amount, so the policy's default) of one GPU (the one
    with `uuid`, if given)."""
    exactly: dict = {"deviceClassName": class_name}
    if uuid:
        exactly["selectors"] = [{"cel": {"expression": f'device.attributes["{DRIVER}"].uuid == "{uuid}"'}}]
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": quantity(memory)}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}


def claim_pod(name: str, claim: str, namespace: str = "other") -> dict:
    """A pod of that workload using the claim."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": {
        "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        "containers": [{"name": "main", "image": "example", "resources": {"claims": [{"name": "gpu"}]}}]}}
