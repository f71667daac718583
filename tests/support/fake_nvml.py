"""A stand-in for pynvml (nvidia-ml-py) that answers the NVML calls the node agent makes for GPUs a test describes:
discovery of GPUs no preset names, and of NVML's failures, on a machine without an NVIDIA driver."""

from __future__ import annotations

import types
from dataclasses import dataclass


class NVMLError(Exception):
    """pynvml's base error."""


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's name
    """No NVIDIA driver."""


@dataclass(frozen=True)
class FakeGpu:
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None  # None: NVML's call for it fails (e.g. "Not Supported")


def fake_pynvml(gpus: list[FakeGpu]) -> types.ModuleType:
    """A module to put in sys.modules as `pynvml`: handles are the GPUs' indices, uuids GPU-FAKE-<index>."""
    module = types.ModuleType("pynvml")

    def capability(handle: int) -> tuple[int, int]:
        found = gpus[handle].compute_capability
        if found is None:
            raise NVMLError("Not Supported")
        return found

    module.__dict__.update(
        NVMLError=NVMLError,
        NVMLError_LibraryNotFound=NVMLError_LibraryNotFound,
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetUUID=lambda handle: f"GPU-FAKE-{handle}".encode(),
        nvmlDeviceGetName=lambda handle: gpus[handle].name.encode(),
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(total=gpus[handle].memory_bytes, used=0),
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=0),
        nvmlDeviceGetCudaComputeCapability=capability,
    )
    return module
