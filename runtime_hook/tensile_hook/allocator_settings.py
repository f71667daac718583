"""What decides this process's CUDA caching allocator, as the hook tells its node agent at registration: the agent
forecasts what the process reserves under its plan with them (tensile.allocator), beside what the hook observes."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tensile.allocator import expandable_segments_on
from tensile.cublas_workspaces import cublas_workspace_bytes


def allocator_settings(device_type: str, environ: Mapping[str, str], device: int | None) -> tuple[bool, int | None]:
    """(whether the process runs with expandable segments, the size of one cuBLAS workspace) for a job on
    `device_type` whose process runs with `environ`. The workspace is sized by the compute capability of CUDA device
    `device`, the one the job trains on (`training_device`); the CPU device has none. None where CUDA cannot say:
    the agent then assumes its GPU's."""
    expandable = expandable_segments_on(environ)
    if device_type != "cuda" or not torch.cuda.is_available():
        return expandable, 0
    try:
        major, _ = torch.cuda.get_device_capability(device)
    except RuntimeError:  # a CUDA error here must not keep the job from registering
        return expandable, None
    return expandable, cublas_workspace_bytes(major, environ)


def training_device() -> int | None:
    """The CUDA device the calling thread works on, called from the training thread: CUDA's current device is per
    thread, and in any other (the agent link's own) it is device 0 whatever the training set. None where CUDA is not
    in use (asking would start it, in a job that trains on the CPU)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None
