"""The GPUs as Kubernetes knows them in `dra` mode: devices from ResourceSlices, what claims consume of them.

Read fresh (three LISTs) before each scheduling pass and every RESYNC_SECONDS, the ResourceSlices also as their
watch delivers them (a GPU its driver withdraws is noticed at once, not at the next pass): a device's UUID, node,
memory capacity, request policy and compute capability (NVIDIA's `cudaComputeCapability`) from the ResourceSlices
of the drivers the configured DeviceClass selects; the memory every allocated ResourceClaim consumes on it
(`status.allocation.devices.results[].consumedCapacity`), Tensile's and everyone else's; and the agents' view from
the TensileNodes (their address, per-process context, host-link bandwidth and compute capability, the jobs they
host).
What makes the cluster unable to take any claim is said as a `problem` for every waiting job: a DeviceClass that does
not exist, or GPUs that publish no memory capacity.
"""

from __future__ import annotations

from collections.abc import Mapping

from tensile.admission import RequestPolicy, parse_quantity
from tensile.devices import context_for
from tensile_operator.claims import GpuAccess, claim_owner
from tensile_operator.kube import Kube
from tensile_operator.placement import Gpu


class DraInventory:
    """The last read of ResourceSlices, ResourceClaims and the DeviceClass."""

    def __init__(self, kube: Kube, access: GpuAccess) -> None:
        self.kube = kube
        self.access = access
        self.slices: dict[str, dict] = {}  # name -> slice: the LIST's order, a slice new to the watch after them
        self._current: list[dict] = []  # each pool's newest generation of `slices` (`_select`)
        self.claims: list[dict] = []
        self.class_found = True
        self._published: frozenset[tuple[str, str]] = frozenset()  # (node, UUID) of every device the slices publish
        self._watched = 0  # slice changes the watch delivered: a LIST in flight meanwhile may predate them

    async def refresh(self) -> None:
        self.class_found = await self.kube.find_deviceclass(self.access.device_class) is not None
        watched = self._watched
        slices = await self.kube.list_resourceslices()
        if watched == self._watched:  # else the watch's slices are kept: they are newer than the LIST may be
            self.slices = {s["metadata"]["name"]: s for s in slices}
            self._select()
        self.claims = await self.kube.list_resourceclaims()

    def slice_changed(self, body: dict | None, name: str) -> None:
        """A ResourceSlice as its watch delivers it (None: deleted); one seen before keeps its place."""
        self._watched += 1
        if body is None:
            self.slices.pop(name, None)
        else:
            self.slices[name] = body
        self._select()

    def _select(self) -> None:
        """Of the slices, the ones a consumer uses: each pool's newest generation (its driver bumps the
        generation in every slice of the pool it changes, and the older slices may linger until it deletes them).
        A device counts as published by the newest generation; while that generation is incomplete (fewer slices than
        its `resourceSliceCount`: the driver is still writing them), by the newest complete one instead, so that a
        device on its way from one slice to another is not said gone, nor one gone said back."""
        generations: dict[tuple[str, str], dict[int, list[dict]]] = {}
        for slice_ in self.slices.values():
            generations.setdefault(_pool(slice_), {}).setdefault(_generation(slice_), []).append(slice_)
        current: list[dict] = []
        publishing: list[dict] = []
        for by_generation in generations.values():
            newest = by_generation[max(by_generation)]
            current += newest
            complete = [g for g, written in by_generation.items() if _complete(written)]
            publishing += by_generation[max(complete)] if complete else newest
        self._current = current
        self._published = frozenset(self._identity(s, d) for s, d in self._devices(publishing))

    def _identity(self, slice_: dict, device: dict) -> tuple[str, str]:
        """(node, UUID): how a booking names the GPU a device is."""
        return slice_["spec"].get("nodeName", ""), str(_attribute(device, self.access.attribute_domain, "uuid"))

    def publishes(self, node: str, uuid: str) -> bool:
        """Whether a ResourceSlice publishes the GPU: a device of `node` with that UUID (as `gpus` names them)."""
        return (node, uuid) in self._published

    def problem(self) -> tuple[str, str] | None:
        """(condition reason, message) when no claim of the configured class can be allocated at all."""
        name = self.access.device_class
        if not self.class_found:
            return "DeviceClassNotFound", (
                f"DeviceClass {name} does not exist: install a DRA driver that provides it (e.g. NVIDIA's, "
                "gpu.nvidia.com), or set the chart's gpuAccess.deviceClass to one that exists")
        devices = self._devices()
        if devices and not any("memory" in (d.get("capacity") or {}) for _, d in devices):
            return "NoMemoryCapacity", (
                f"the {len(devices)} GPU(s) of DeviceClass {name} publish no memory capacity: enable the driver's "
                "consumable shares in memory mode (allowMultipleAllocations with a memory capacity), or use the "
                "chart's gpuAccess.mode=legacy")
        return None

    def _devices(self, slices: list[dict] | None = None) -> list[tuple[dict, dict]]:
        """(slice, device) of every device with a UUID in the configured attribute domain, in `slices` (by default
        each pool's newest generation)."""
        return [(s, d) for s in (self._current if slices is None else slices) for d in s["spec"].get("devices") or []
                if _attribute(d, self.access.attribute_domain, "uuid")]

    def gpus(self, agents: Mapping[str, list[Gpu]]) -> list[Gpu]:
        """Every shared GPU with a memory capacity, with what claims consume of it and its agent's view of it. Its
        compute capability (what sizes the cuBLAS workspaces its jobs are booked with) is its driver's
        `cudaComputeCapability` attribute, else its agent's figure, else unknown."""
        consumed = self._consumed()
        by_uuid = {g.uuid: g for gpus in agents.values() for g in gpus}
        result = []
        for slice_, device in self._devices():
            memory = (device.get("capacity") or {}).get("memory")
            if memory is None or not device.get("allowMultipleAllocations"):
                continue
            node, uuid = self._identity(slice_, device)
            agent = by_uuid.get(uuid)
            size = parse_quantity(memory["value"])
            key = (*_pool(slice_), device["name"])
            major = _major(_attribute(device, self.access.attribute_domain, "cudaComputeCapability"))
            name = str(_attribute(device, self.access.attribute_domain, "productName") or "")
            result.append(Gpu(
                node=node, uuid=uuid, name=name, memory_bytes=size, capacity_bytes=size,
                context_bytes=agent.context_bytes if agent and agent.context_bytes else context_for(name),
                simulated=agent.simulated if agent else False,
                **({"bandwidth": agent.bandwidth} if agent else {}),
                agent=agent.agent if agent else None, hosted=agent.hosted if agent else (),
                policy=RequestPolicy.from_capacity(memory), claimed=tuple(consumed.get(key, ())),
                compute_capability_major=major or (agent.compute_capability_major if agent else 0)))
        return result

    def _consumed(self) -> dict[tuple[str, str, str], list[tuple[str, int]]]:
        """Per device: (owning job or "", memory consumed) of each allocated claim."""
        consumed: dict[tuple[str, str, str], list[tuple[str, int]]] = {}
        for claim in self.claims:
            allocation = (claim.get("status") or {}).get("allocation") or {}
            for result in (allocation.get("devices") or {}).get("results") or []:
                memory = (result.get("consumedCapacity") or {}).get("memory")
                if memory is not None:
                    consumed.setdefault((result["driver"], result["pool"], result["device"]), []).append(
                        (claim_owner(claim), parse_quantity(memory)))
        return consumed


def _pool(slice_: Mapping) -> tuple[str, str]:
    """(driver, pool name): a pool is its driver's."""
    return slice_["spec"]["driver"], slice_["spec"]["pool"]["name"]


def _generation(slice_: Mapping) -> int:
    return int(slice_["spec"]["pool"].get("generation", 0))


def _complete(written: list[dict]) -> bool:
    """Whether a pool's generation has all its slices (as many as they say it has)."""
    return len(written) >= max(int(s["spec"]["pool"].get("resourceSliceCount", 1)) for s in written)


def _attribute(device: Mapping, domain: str, name: str) -> object:
    """A device attribute's value, by qualified name or (in the driver's own domain) its plain name."""
    attributes = device.get("attributes") or {}
    entry = attributes.get(f"{domain}/{name}") or attributes.get(name)
    return next(iter(entry.values())) if entry else None


def _major(version: object) -> int:
    """The major number of a `cudaComputeCapability` attribute (a version, "9.0.0"); 0 where it is absent or malformed
    (unknown: its jobs are booked with the largest cuBLAS workspaces)."""
    major = version.split(".", 1)[0].strip() if isinstance(version, str) else ""
    return int(major) if major.isdecimal() else 0
