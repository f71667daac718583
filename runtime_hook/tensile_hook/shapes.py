"""What an iteration's shapes are, cheaply: the native path sees no op, so a batch that grows mid-run (a
curriculum, bf16 autocast halfway, an epoch's smaller last batch) would run under the plan made for the old
shapes. The shapes and dtypes of the tensors given to the iteration's first module call, with the autocast
dtype in force, stand in for the workload's signature: one tuple compare per iteration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tensile.workload import Workload
from tensile_hook.active_plan import ActivePlan
from tensile_hook.storages import tensors_in

ShapeKey = tuple[Any, ...]  # ((shape, dtype) per tensor argument, ..., autocast dtype or None)
MAX_SHAPE_SETS = 4  # shape sets planned for; iterations on others run under the current plan, guarded


def shape_key(args: tuple, device_type: str) -> ShapeKey | None:
    """None where the call is given no tensor (a model called with keyword arguments only): nothing to compare."""
    tensors = tensors_in(args)
    if not tensors:
        return None
    key: list[Any] = [(t.shape, t.dtype) for t in tensors]
    # any autocast on at all first: one call, where the device's own takes parsing its name (most jobs use none)
    on = torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(device_type)
    key.append(torch.get_autocast_dtype(device_type) if on else None)
    return tuple(key)


def describe(key: ShapeKey) -> str:
    """For the report: `[8, 3, 32, 32] float32, bfloat16 autocast`."""
    *tensors, autocast = key
    said = ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in tensors)
    return said if autocast is None else f"{said}, {str(autocast).removeprefix('torch.')} autocast"


@dataclass
class ShapeSet:
    """One shape set's recorded iteration, its vanilla peak and the plan made for it (None: it runs guarded)."""

    live: Workload
    vanilla_peak: int
    plan: ActivePlan | None
