"""Op latencies for a whole workload: the calibrated model where one exists, the prior otherwise."""

from __future__ import annotations

import math
import os
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tensile.latency.device import gpu_utilization, resolve_target
from tensile.latency.families import base_name, family_of, features
from tensile.latency.online import op_key
from tensile.latency.prior import (Roofline, compute_seconds, gap_seconds, iteration_bytes, preceding_bytes, prior_seconds,
                                   view_key)
from tensile.latency.store import LatencyModel, load_model, model_path
from tensile.workload import Op, Workload


class UncalibratedWarning(UserWarning):
    """No calibrated latency model for the device: latencies come from the roofline prior."""


class QuickCalibrationWarning(UserWarning):
    """The device's model was fitted on the `--quick` grid, made for tests: its latencies are calibrated, but
    roughly, and a forecast that says "calibrated" must not be read as the default grid's accuracy."""


_CACHE: dict[tuple[str, int, int], LatencyModel] = {}


def find_model(device: str, model_dir: str | os.PathLike | None = None) -> tuple[LatencyModel | None, Path, Roofline]:
    """(calibrated model or None, the file it is or would be in, the fallback prior's roofline)."""
    target = resolve_target(device, model_dir)
    path = model_path(target.key, model_dir)
    if not path.exists():
        return None, path, target.prior
    stat = path.stat()
    cache_key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if cache_key not in _CACHE:
        _CACHE[cache_key] = load_model(path, expect_key=target.key)
    return _CACHE[cache_key], path, target.prior


def predict_seconds(ops: Sequence[Op], model: LatencyModel | None, prior: Roofline | None = None,
                    utilization: float = 0.0, include_gaps: bool = True,
                    preceding: Sequence[float] | None = None, iteration: Sequence[float] | None = None) -> np.ndarray:
    """Latency of each op in seconds; ops of one family are predicted together (one MLP pass).

    `ops` are one iteration, in the order they run (each op's features include the bytes the one before
    moved and the bytes the whole iteration moves) unless `preceding` and `iteration` give those bytes per
    op. `include_gaps=False` leaves out the host time between ops: the op's own time, as measured alone.
    """
    if model is None:
        if prior is None:
            raise ValueError("need a calibrated model or a prior roofline")
        roofline = prior if include_gaps else prior.alone()
        return np.array([prior_seconds(op, roofline) for op in ops], dtype=np.float64)
    roofline = model.roofline
    if not include_gaps:  # the op alone: no host gaps, no in-iteration scale
        roofline = roofline.alone()
    before = preceding_bytes(ops) if preceding is None else preceding
    whole = [iteration_bytes(ops)] * len(ops) if iteration is None else iteration
    out = np.empty(len(ops), dtype=np.float64)
    by_family: dict[str, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        family = family_of(op)
        measured = model.measured_ops.get(op_key(op)) if model.measured_ops and family != "view" else None
        if family == "view" and model.view_seconds is not None:
            price = model.view_ops.get(view_key(op, before[i]))
            if price is None:
                price = model.view_ops.get(base_name(op.name), model.view_seconds)
            out[i] = price + gap_seconds(op, roofline)
        elif measured is not None:
            out[i] = measured * (roofline.scales.get(op.phase, 1.0) if include_gaps else 1.0) + gap_seconds(op, roofline)
        elif family in model.families:
            by_family[family].append(i)
        else:
            out[i] = prior_seconds(op, roofline)
    for family, indices in by_family.items():
        mlp = model.families[family]
        x = np.array([features(ops[i], family, utilization, before[i], whole[i]) for i in indices], dtype=np.float64)
        base = np.array([compute_seconds(ops[i], roofline, family) for i in indices])
        gaps = np.array([gap_seconds(ops[i], roofline) for i in indices])
        scales = np.array([roofline.scales.get(ops[i].phase, 1.0) for i in indices]) if include_gaps else 1.0
        out[indices] = base * np.exp(mlp.log_correction(x)) * scales + gaps
    return out


def assign_latencies(workload: Workload, device: str = "cpu", model_dir: str | os.PathLike | None = None,
                     utilization: float | None = None, warn: bool = True) -> str:
    """Fill op.latency (seconds) for every op; return "calibrated" or "prior" (which one was used).

    `device`: "cpu", "cuda" or a GPU preset name. Without a model file for it, the roofline prior is
    used and an UncalibratedWarning says how to calibrate; a model of the quick grid is used with a
    QuickCalibrationWarning; a damaged file raises TensileUserError. `warn=False` for a caller that would warn on
    every job: the node agent (its job's latency_source says the source) and the operator's forecasts.
    `utilization` (0..1) defaults to the GPU's current NVML reading, 0 on a CPU or without NVML.
    """
    model, path, prior = find_model(device, model_dir)
    if warn and model is None:
        warnings.warn(
            f"no calibrated latency model for device '{device}' ({path} does not exist): op latencies come "
            f"from the roofline prior. Run `tensile calibrate --device {'cuda' if device != 'cpu' else 'cpu'}` "
            f"on that device to calibrate",
            UncalibratedWarning,
            stacklevel=2,
        )
    elif warn and model is not None and model.meta.get("grid") == "quick":
        warnings.warn(
            f"the latency model {path} was calibrated on the quick grid (`tensile calibrate --quick`, made for tests): "
            f"its op latencies are rough. Run `tensile calibrate --device {model.kind}` for the default grid",
            QuickCalibrationWarning,
            stacklevel=2,
        )
    if utilization is None:
        utilization = (gpu_utilization() or 0.0) if model is not None and model.kind == "cuda" else 0.0
    seconds = predict_seconds(workload.ops, model, prior, utilization)
    for op, value in zip(workload.ops, seconds):
        op.latency = float(value) if math.isfinite(value) else 0.0
    return "prior" if model is None else "calibrated"


def iteration_seconds(workload: Workload) -> float:
    """Predicted (or corrected) time of one training iteration: the sum of its op latencies."""
    return float(sum(op.latency for op in workload.ops))


def predict_iteration_seconds(workload: Workload, device: str = "cpu",
                              model_dir: str | os.PathLike | None = None) -> tuple[float, str]:
    """Assign latencies, then return (iteration seconds, "calibrated" | "prior") for forecast output."""
    source = assign_latencies(workload, device, model_dir)
    return iteration_seconds(workload), source
