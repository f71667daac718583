"""How a training pod gets its GPU: through Dynamic Resource Allocation (`dra`, the default) or, on clusters without
it, by node name and environment variables (`legacy`).

In `dra` mode each admitted job gets a ResourceClaim (resource.k8s.io/v1) in its namespace, owned by its TrainingJob:
one device of the configured DeviceClass, pinned by a CEL selector to the GPU placement chose (its UUID attribute),
requesting the admitted size as `capacity.requests.memory` (consumable capacity, KEP-5075). The pod references it and
the scheduler puts the pod where the claim is allocated, keeping every device's consumed memory within its capacity,
for Tensile's claims and everyone else's alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from tensile.admission import quantity
from tensile_operator import API_VERSION, timing
from tensile_operator.kube import Conflict, Kube, retried
from tensile_operator.placement import Booking
from tensile_operator.pods import JOB_LABEL, job_label, pod_name

DRA, LEGACY = "dra", "legacy"
DEFAULT_DEVICE_CLASS = "gpu.nvidia.com"  # NVIDIA's DRA driver: its DeviceClass and its attributes' domain
CLAIM_REQUEST = "gpu"  # the claim's request, and the pod's name for the claim


@dataclass(frozen=True)
class GpuAccess:
    """The GPU access mode, the DeviceClass the claims name, and the domain of the devices' `uuid` attribute."""

    mode: str = DRA
    device_class: str = DEFAULT_DEVICE_CLASS
    attribute_domain: str = DEFAULT_DEVICE_CLASS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> GpuAccess:
        """The chart's `gpuAccess` values: TENSILE_GPU_ACCESS, TENSILE_DEVICE_CLASS, TENSILE_DEVICE_ATTRIBUTE_DOMAIN."""
        mode = environ.get("TENSILE_GPU_ACCESS", DRA)
        if mode not in (DRA, LEGACY):
            raise ValueError(f"TENSILE_GPU_ACCESS is '{mode}': write '{DRA}' or '{LEGACY}'")
        device_class = environ.get("TENSILE_DEVICE_CLASS") or DEFAULT_DEVICE_CLASS
        return cls(mode, device_class, environ.get("TENSILE_DEVICE_ATTRIBUTE_DOMAIN") or DEFAULT_DEVICE_CLASS)

    @property
    def dra(self) -> bool:
        return self.mode == DRA

    def selector(self, gpu_uuid: str) -> str:
        """The CEL expression that holds for the one GPU with that UUID."""
        return f'device.attributes["{self.attribute_domain}"].uuid == "{gpu_uuid}"'


def claim_name(namespace: str, name: str, uid: str) -> str:
    """The job's claim: named as its pod (another resource: no clash), so a restarted operator finds it."""
    return pod_name(namespace, name, uid)


def build_claim(body: Mapping, gpu_uuid: str, memory_bytes: int, access: GpuAccess) -> dict:
    """The ResourceClaim of the TrainingJob `body` admitted with `memory_bytes` on the GPU `gpu_uuid`."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": claim_name(namespace, name, uid),
            "namespace": namespace,
            "labels": {JOB_LABEL: job_label(namespace, name, uid)},
            "annotations": {"tensile.dev/gpu": gpu_uuid},
            "ownerReferences": [{"apiVersion": API_VERSION, "kind": "TrainingJob", "name": name, "uid": uid,
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {"devices": {"requests": [{"name": CLAIM_REQUEST, "exactly": {
            "deviceClassName": access.device_class,
            "allocationMode": "ExactCount",
            "count": 1,
            "selectors": [{"cel": {"expression": access.selector(gpu_uuid)}}],
            "capacity": {"requests": {"memory": quantity(memory_bytes)}},
        }}]}},
    }


def claim_owner(claim: Mapping) -> str:
    """namespace/name of the TrainingJob that owns a claim ("" for anyone else's)."""
    meta = claim.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "TrainingJob" and ref.get("controller") and ref.get("apiVersion") == API_VERSION:
            return f"{meta.get('namespace', '')}/{ref.get('name', '')}"
    return ""


class JobClaims:
    """Makes each placed job's claim before its pod, and deletes it once the job no longer holds its GPU (ended, or
    placed again: a claim's request cannot change, so another placement gets a new claim)."""

    def __init__(self, kube: Kube, access: GpuAccess) -> None:
        self.kube = kube
        self.access = access

    async def ensure(self, body: Mapping, booking: Booking) -> str:
        """The job's claim as its booking says, made unless it exists so (one left by an earlier placement of the
        job is replaced); its name."""
        assert booking.claim_bytes is not None
        claim = build_claim(body, booking.gpu, booking.claim_bytes, self.access)
        namespace, name = claim["metadata"]["namespace"], claim["metadata"]["name"]
        for _ in range(3):
            try:
                await retried(lambda: self.kube.create_resourceclaim(namespace, claim), timing.RETRY_DELAYS)
                return name
            except Conflict:
                existing = await self.kube.find_resourceclaim(namespace, name)
                if existing is not None and existing.get("spec") == claim["spec"] \
                        and claim_owner(existing) == booking.job:
                    return name
                await self.kube.delete_resourceclaim(namespace, name)
        raise RuntimeError(f"{booking.job}: ResourceClaim {name} could not be made")

    async def delete(self, booking: Booking) -> None:
        if booking.claim:
            namespace = booking.job.split("/", 1)[0]
            await retried(lambda: self.kube.delete_resourceclaim(namespace, booking.claim), timing.RETRY_DELAYS)
