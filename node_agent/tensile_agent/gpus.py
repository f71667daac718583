"""The node's GPUs: inventory and live used memory / utilization from NVML, or a simulated inventory.

Without an NVIDIA driver `nvmlInit` raises `NVMLError_LibraryNotFound`: the agent then has no GPUs and
says why (in /v1/gpus, /healthz, /metrics and the TensileNode), it does not crash. `--simulate-gpu
NAME:MEMORY` gives GPUs that exist only in the agent, marked `simulated` wherever they show.

A GPU's compute capability (what sizes its processes' cuBLAS workspaces, tensile.cublas_workspaces) is NVML's; where
NVML cannot say, or the GPU is simulated, its preset's; unknown (0) where no preset names it.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from dataclasses import dataclass
from typing import Any

from tensile.devices import context_for, parse_bytes, preset_for
from tensile.errors import TensileUserError

log = logging.getLogger("tensile_agent.gpus")
DEFAULT_HEADROOM = 0.05  # share of device memory admission leaves free
DEFAULT_BANDWIDTH = 25e9


@dataclass(slots=True)
class GpuInfo:
    uuid: str
    index: int
    name: str
    memory_bytes: int
    capacity_bytes: int  # for admission: memory less the headroom (contexts are per job, below)
    context_bytes: int  # per job: what its process holds outside the caching allocator (tensile.devices)
    bandwidth: float  # host link, bytes/s per direction
    simulated: bool
    compute_capability_major: int  # 0: unknown

    def to_dict(self) -> dict:
        return {"uuid": self.uuid, "index": self.index, "name": self.name, "memory_bytes": self.memory_bytes,
                "capacity_bytes": self.capacity_bytes, "context_bytes": self.context_bytes,
                "host_link_bandwidth": self.bandwidth, "simulated": self.simulated,
                "compute_capability_major": self.compute_capability_major}


def _make(uuid: str, index: int, name: str, memory: int, simulated: bool, headroom: float,
          context_bytes: int | None, compute_capability_major: int | None = None) -> GpuInfo:
    """`compute_capability_major`: NVML's, None where it is not known (then the preset's, else 0)."""
    spec = preset_for(name)
    context = context_bytes if context_bytes is not None else context_for(name)
    if compute_capability_major is None:
        compute_capability_major = spec.compute_capability_major if spec else 0
    return GpuInfo(uuid=uuid, index=index, name=spec.name if spec and simulated else name, memory_bytes=memory,
                   capacity_bytes=int(memory * (1.0 - headroom)), context_bytes=context,
                   bandwidth=spec.host_link_bandwidth if spec else DEFAULT_BANDWIDTH, simulated=simulated,
                   compute_capability_major=compute_capability_major)


def simulated_gpus(specs: list[str], node: str | None = None, headroom: float = DEFAULT_HEADROOM,
                   context_bytes: int | None = None) -> list[GpuInfo]:
    """From `NAME:MEMORY` strings (NAME a preset such as a6000/h100 or any name; MEMORY e.g. 48GiB).
    Uuids carry the node's name so that two agents' simulated GPUs never collide."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", node or socket.gethostname())[:60] or "node"
    gpus = []
    for index, text in enumerate(specs):
        name, sep, memory = text.rpartition(":")
        if not sep or not name:
            raise TensileUserError(f"--simulate-gpu '{text}': give NAME:MEMORY, e.g. a6000:48GiB")
        memory_bytes = parse_bytes(memory, f"--simulate-gpu '{text}'")
        if memory_bytes <= 0:  # a6000:0 gave a GPU with no room for any job
            raise TensileUserError(f"--simulate-gpu '{text}': the memory must be positive, e.g. a6000:48GiB")
        gpus.append(_make(f"SIM-{host}-{index}", index, name, memory_bytes, True, headroom, context_bytes))
    return gpus


class Inventory:
    """The GPUs of this node and their live figures."""

    def __init__(self, gpus: list[GpuInfo], reason: str | None, nvml: object | None = None,
                 handles: dict[str, object] | None = None) -> None:
        self.gpus = {g.uuid: g for g in gpus}
        self.reason = reason  # why there are no (real) GPUs
        self._nvml = nvml
        self._handles = handles or {}
        self._lock = threading.Lock()

    @property
    def simulated(self) -> bool:
        return any(g.simulated for g in self.gpus.values())

    @classmethod
    def discover(cls, simulate: list[str] | None = None, node: str | None = None, headroom: float = DEFAULT_HEADROOM,
                 context_bytes: int | None = None) -> Inventory:
        if simulate:
            return cls(simulated_gpus(simulate, node, headroom, context_bytes), "simulated GPUs (--simulate-gpu)")
        try:
            import pynvml
        except ImportError:
            return cls([], "nvidia-ml-py (pynvml) is not installed")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            return cls([], "NVML library not found: no NVIDIA driver on this node, so no GPUs")
        except pynvml.NVMLError as exc:
            return cls([], f"NVML failed to start: {exc}")
        gpus, handles = [], {}
        try:
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                name = _text(pynvml.nvmlDeviceGetName(handle))
                memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
                major = _compute_capability_major(pynvml, handle, uuid)
                gpus.append(_make(uuid, index, name, memory, False, headroom, context_bytes, major))
                handles[uuid] = handle
        except pynvml.NVMLError as exc:
            return cls(gpus, f"NVML failed listing GPUs: {exc}", pynvml, handles)
        return cls(gpus, None if gpus else "NVML found no GPUs", pynvml, handles)

    def find(self, ref: str | None) -> GpuInfo | None:
        """By uuid or index; None (no reference) is the only GPU of a one-GPU node."""
        if ref is None:
            return next(iter(self.gpus.values())) if len(self.gpus) == 1 else None
        if ref in self.gpus:
            return self.gpus[ref]
        if ref.isdigit():
            return next((g for g in self.gpus.values() if g.index == int(ref)), None)
        return None

    def live(self, uuid: str) -> tuple[int | None, float | None]:
        """(used bytes, utilization 0..1) from NVML; (None, None) for a simulated GPU or on error."""
        handle = self._handles.get(uuid)
        if handle is None or self._nvml is None:
            return None, None
        nvml = self._nvml
        try:
            with self._lock:
                used = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)  # type: ignore[attr-defined]
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0  # type: ignore[attr-defined]
            return used, float(util)
        except Exception as exc:  # noqa: BLE001 - a flaky reading must not break a scrape
            log.debug("NVML reading of %s failed: %s", uuid, exc)
            return None, None


def _compute_capability_major(nvml: Any, handle: object, uuid: str) -> int | None:
    """NVML's compute capability major of the GPU; None where NVML cannot say (the GPU is listed all the same)."""
    try:
        major, _minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    except nvml.NVMLError as exc:
        log.warning("NVML gives no compute capability for GPU %s (%s): its preset's is taken, if one names it",
                    uuid, exc)
        return None
    return int(major)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
