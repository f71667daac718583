"""`tensile calibrate`'s work: measure probe steps on the local device, fit the prior, train, save.

Three things are learned from the same measurements: the roofline figures (a large matmul, a large
copy, a tiny op), the host time between ops per phase (bare iteration time minus the sum of its
op times, regressed on op counts), and per family an MLP for log(measured / roofline).
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from tensile.errors import TensileUserError
from tensile.latency.device import cpu_key, cpu_name, gpu_utilization
from tensile.latency.families import FAMILIES, base_name, family_of, features
from tensile.latency.online import op_key
from tensile.latency.measure import StepTiming, in_fresh_process, measure_roofline, measure_step
from tensile.latency.mlp import FamilyEnsemble, FamilyMLP
from tensile.latency.prior import Roofline, compute_seconds, iteration_bytes, preceding_bytes, size_class, view_key
from tensile.latency.probes import Probe, build_step, make_grid
from tensile.latency.store import LatencyModel, default_model_dir, save_model, slug
from tensile.latency.train import ENSEMBLE_MEMBERS, fit_ensemble
from tensile.workload import PHASES

MIN_SAMPLES = 8  # a family with fewer measured ops keeps the prior
MIN_VIEW_CONTEXT = 5  # view samples of one name after ops of one size class before they get their own price
MIN_WHOLE_MODELS = 4  # the phase fit uses whole-model iterations when at least this many were measured


@dataclass(slots=True)
class Measured:
    probe: Probe
    timing: StepTiming


def local_device(device: str) -> tuple[str, str, str]:
    """(torch device type, file key, display name) of the device this process can measure."""
    if device == "cpu":
        return "cpu", cpu_key(), cpu_name()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise TensileUserError("--device cuda: no CUDA device is visible to PyTorch here; calibrate on the GPU "
                                   "machine, or use --device cpu")
        name = torch.cuda.get_device_name(0)
        return "cuda", slug(name), name
    raise TensileUserError(f"--device must be cpu or cuda (was '{device}')")


def torch_device(device_type: str) -> torch.device:
    """The device of that type this process measures on: the first visible GPU (the one `local_device` names), or the
    CPU (`torch.device("cpu", 0)` is no device tensors report)."""
    return torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")


def measure_probe(probe: Probe, device_type: str, timed: int = 5, plain: int = 2) -> Measured:
    """One probe's iteration measured op by op (torch.OutOfMemoryError if it does not fit the device)."""
    step = build_step(probe, device_type)
    utilization = (gpu_utilization() or 0.0) if device_type == "cuda" else 0.0
    # a zoo model's iteration is seconds long and repeats its blocks: 2 timed iterations suffice;
    # a probe's ops take microseconds, where 5 repeats (robust_seconds) beat the machine's noise
    n_timed = min(timed, 2) if probe.kind == "zoo" else timed
    return Measured(probe, measure_step(step, device_type, n_timed, plain, utilization=utilization))


def _measure_as_job(probe: Probe, device_type: str, timed: int, plain: int, threads: int) -> Measured:
    """measure_probe in a process of its own (see measure_probes)."""
    torch.set_num_threads(threads)
    return measure_probe(probe, device_type, timed, plain)


def measure_probes(probes: Iterable[Probe], device_type: str, *, timed: int = 5, plain: int = 2,
                   budget_s: float | None = None, on_probe: Callable[[Probe], object] | None = None) -> list[Measured]:
    """Measure each probe's iteration op by op; stop early (keeping what is measured) past budget_s
    seconds of measuring (the caller's time in on_probe is its own).

    A zoo model is measured in a fresh process, as a job runs it: glibc's heap in a new process still
    returns freed memory to the kernel and faults it back in (ResNet-50 at batch 2: 13-200 MB a step, up to
    10% of its time), which a process that has run bigger models before no longer does.
    """
    measuring = 0.0  # the budget's: time spent measuring probes, not the caller's in on_probe
    results = []
    for probe in probes:
        if budget_s is not None and measuring > budget_s:
            break
        began = time.perf_counter()
        try:
            if probe.kind == "zoo":
                results.append(in_fresh_process(_measure_as_job, probe, device_type, timed, plain, torch.get_num_threads()))
            else:
                results.append(measure_probe(probe, device_type, timed, plain))
        except torch.OutOfMemoryError:  # a probe too large for this device: skip it, keep calibrating
            if device_type == "cuda":
                torch.cuda.empty_cache()
        measuring += time.perf_counter() - began
        if on_probe is not None:
            on_probe(probe)
    return results


def fit_phases(measured: list[Measured]) -> tuple[dict[str, float], dict[str, float]]:
    """(gaps, scales): per phase, bare phase time T = scale * (sum of its ops' measured times) + gap * ops.

    The gap is the host time between ops (Python, autograd, the optimizer's loop); the scale absorbs
    what timing ops one by one adds or hides. Whole models' iterations (the zoo probes) are what a job
    runs, so they are fitted when calibration has them: a small probe's bare phase is mostly per-step
    host cost (bare / ops time 1.07-1.5, median by phase) where a zoo model's is 0.93-1.08, and fitted
    on the probes that became a scale of 1.04-1.17 that made every zoo prediction 7-25% high.
    Least squares weighted by 1 / T^2, since timing noise grows with the phase's length: many cheap ops
    decide the gap, long phases the scale, and one noisy big op cannot swamp a gap of microseconds.
    The gap is never negative and the scale stays in [0.5, 2].
    """
    whole = [m for m in measured if m.probe.kind == "zoo"]
    measured = whole if len(whole) >= MIN_WHOLE_MODELS else measured
    gaps, scales = {}, {}
    for phase in PHASES:
        rows = []
        for m in measured:
            in_phase = [s for op, s in zip(m.timing.ops, m.timing.seconds) if op.phase == phase]
            total = m.timing.phase_seconds.get(phase)
            if in_phase and total:
                rows.append((total, sum(in_phase), float(len(in_phase))))
        if not rows:
            gaps[phase], scales[phase] = 0.0, 1.0
            continue
        t, s, c = (np.array(v) for v in zip(*rows))
        w = 1.0 / t**2
        a = np.array([[np.sum(w * s * s), np.sum(w * s * c)], [np.sum(w * s * c), np.sum(w * c * c)]])
        b = np.array([np.sum(w * s * t), np.sum(w * c * t)])
        try:
            scale, gap = np.linalg.solve(a, b)
        except np.linalg.LinAlgError:
            scale, gap = 1.0, -1.0
        if not (np.isfinite(scale) and np.isfinite(gap)) or gap < 0 or not 0.5 <= scale <= 2.0:
            scale = 1.0  # keep the op times as measured; fit the gap alone
            gap = max(float(np.sum(w * c * (t - s)) / np.sum(w * c * c)), 0.0)
        gaps[phase], scales[phase] = float(gap), float(scale)
    return gaps, scales


# ops, seconds, utilizations, the preceding op's bytes, the bytes of the iteration each op ran in
Samples = tuple[list, list[float], list[float], list[float], list[float]]


def family_samples(measured: list[Measured]) -> dict[str, Samples]:
    """family -> (ops, measured seconds, utilizations, bytes the op before moved, bytes its iteration
    moved), from every op of every measured iteration."""
    samples: dict[str, Samples] = defaultdict(lambda: ([], [], [], [], []))
    for m in measured:
        whole = iteration_bytes(m.timing.ops)
        for op, seconds, before in zip(m.timing.ops, m.timing.seconds, preceding_bytes(m.timing.ops)):
            family = family_of(op)
            if family is not None and seconds > 0:
                ops, values, utils, preceding, iteration = samples[family]
                ops.append(op)
                values.append(seconds)
                utils.append(m.timing.utilization)
                preceding.append(before)
                iteration.append(whole)
    return dict(samples)


def deduplicated(ops: list, seconds: list[float], utils: list[float], preceding: list[float],
                 iteration: list[float]) -> Samples:
    """One sample per distinct op (family, name, shapes, params) and size class (a factor of 4 in bytes) of
    the op before it and of its iteration: the median of its timings.

    A zoo model repeats its blocks (BERT's twelve layers, the optimizer's per-parameter loop over equal
    shapes); their median is a less noisy target, and the MLP does not weight a shape by how often it repeats.
    """
    groups: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        groups[(op_key(op), size_class(preceding[i]), size_class(iteration[i]))].append(i)
    keep = [members[0] for members in groups.values()]
    return ([ops[i] for i in keep], [float(np.median([seconds[j] for j in members])) for members in groups.values()],
            [float(np.mean([utils[j] for j in members])) for members in groups.values()],
            [float(np.median([preceding[j] for j in members])) for members in groups.values()],
            [float(np.median([iteration[j] for j in members])) for members in groups.values()])


def training_arrays(ops: list, seconds: list[float], utils: list[float], preceding: list[float],
                    iteration: list[float], family: str, roofline: Roofline) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([features(op, family, u, b, w) for op, u, b, w in zip(ops, utils, preceding, iteration)],
                 dtype=np.float64)
    base = np.array([compute_seconds(op, roofline, family) for op in ops])
    return x, np.log(np.asarray(seconds)) - np.log(base)


def fit_model(measured: list[Measured], roofline: Roofline, key: str, name: str, kind: str, meta: dict,
              steps: int = 1500, on_family: Callable[[str], object] | None = None, seed: int = 0,
              members: int | None = None) -> LatencyModel:
    """Gaps, the view-op costs and an MLP ensemble per family with enough samples (`seed` and `members`: the
    ensembles' seeds and size, `train.ensemble_size` by default; varied by benchmarks/latency_fit_variance.py)."""
    gaps, scales = fit_phases(measured) if kind == "cpu" else ({}, {})
    roofline = replace(roofline, gaps=gaps, scales=scales)
    samples = family_samples(measured)
    counts = {f: len(s[0]) for f, s in samples.items()}
    view = samples.pop("view", None)
    view_seconds = float(np.median(view[1])) if view else None
    view_ops = view_table(view[0], view[1], view[3]) if view else {}
    measured_ops: dict[str, float] = {}  # the median per op key, whatever ran before it
    for ops, seconds, *_ in samples.values():
        zeros = [0.0] * len(ops)
        unique, medians, *_ = deduplicated(ops, seconds, zeros, zeros, zeros)
        measured_ops.update((op_key(op), value) for op, value in zip(unique, medians))
    families: dict[str, FamilyEnsemble | FamilyMLP] = {}
    for family in FAMILIES:
        if family in samples and len(samples[family][0]) >= MIN_SAMPLES:
            x, y = training_arrays(*deduplicated(*samples[family]), family, roofline)
            families[family] = fit_ensemble(x, y, members=members, steps=steps,
                                            seed=FAMILIES.index(family) + len(FAMILIES) * seed)
        if on_family is not None:
            on_family(family)
    loads = [m.timing.load_average for m in measured]
    meta = {**meta, "samples": counts, "clock": measured[0].timing.clock if measured else "wall",
            "load_average": {"min": min(loads), "median": float(np.median(loads)), "max": max(loads)} if loads else {}}
    return LatencyModel(key, name, kind, roofline, families, view_seconds, meta, view_ops, measured_ops)


def view_table(ops: list, seconds: list[float], preceding: list[float] | None = None) -> dict[str, float]:
    """Median cost per view op name (`view` and `as_strided` differ, one constant for all misses both) and,
    where at least MIN_VIEW_CONTEXT samples have it, per name and size class of the op before it
    (key `name@class`): a view right after a big op finds its metadata out of the caches (a `detach`
    7.1 us after a big op, 2.7 us after a small one). On held-out grids, fitted on a separate
    training grid: median error 10.9 / 10.1% by name, 7.1 / 5.8% by name and class."""
    by_name: dict[str, list[float]] = defaultdict(list)
    by_context: dict[str, list[float]] = defaultdict(list)
    for i, (op, value) in enumerate(zip(ops, seconds)):
        by_name[base_name(op.name)].append(value)
        if preceding is not None:
            by_context[view_key(op, preceding[i])].append(value)
    table = {name: float(np.median(values)) for name, values in sorted(by_name.items())}
    table.update((key, float(np.median(values))) for key, values in sorted(by_context.items()) if len(values) >= MIN_VIEW_CONTEXT)
    return table


def calibrate(device: str = "cpu", quick: bool = False, model_dir: str | os.PathLike | None = None,
              progress: bool = True, budget_s: float | None = 480.0, threads: int | None = None,
              alongside: Callable[[Probe], None] | None = None) -> tuple[LatencyModel, Path]:
    """Measure the grid on the local device, train, save; returns the model and its file.

    `threads` sets torch's CPU threads for the measurements (default: as jobs get them); on an
    oversubscribed CPU, 1 thread avoids OpenMP barrier stalls that make timings meaningless.
    `alongside` runs after each probe, outside calibration's clock and budget: a benchmark measures its
    held-out probes there, in the same minutes of a shared machine as the probes the model learns from.
    `quick` (a tiny grid, far worse than the prior) needs an explicit `model_dir`, so that it never replaces
    the default model that every forecast, plan and agent reads.
    """
    if quick and model_dir is None:
        raise TensileUserError(
            f"--quick needs --out DIR: a quick model (tiny grid, for tests and smoke checks) predicts far worse than "
            f"the uncalibrated prior, and by default it would replace the model every forecast, plan and agent reads "
            f"({default_model_dir()}). Add --out DIR, or drop --quick for a full calibration"
        )
    device_type, key, name = local_device(device)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise TensileUserError(f"--threads must be at least 1 (was {threads})")
        torch.set_num_threads(threads)
    try:
        return _calibrate(device_type, key, name, quick, model_dir, progress, budget_s, alongside)
    finally:
        torch.set_num_threads(previous_threads)


def _calibrate(device_type: str, key: str, name: str, quick: bool, model_dir: str | os.PathLike | None,
               progress: bool, budget_s: float | None,
               alongside: Callable[[Probe], None] | None) -> tuple[LatencyModel, Path]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    started = time.perf_counter()
    aside = 0.0

    def measured_one(probe: Probe) -> None:
        nonlocal aside
        bar.update(task, advance=1)
        if alongside is not None:
            began = time.perf_counter()
            alongside(probe)
            aside += time.perf_counter() - began

    probes = make_grid("quick" if quick else "default", seed=0, device_type=device_type)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress, transient=False) as bar:
        task = bar.add_task("roofline", total=1)
        roofline = measure_roofline(device_type, quick=quick)
        bar.update(task, advance=1)
        task = bar.add_task(f"measuring {len(probes)} probe steps on {name}", total=len(probes))
        measured = measure_probes(probes, device_type, timed=2 if quick else 5, plain=1 if quick else 2,
                                  budget_s=budget_s, on_probe=measured_one)
        task = bar.add_task("training family models", total=len(FAMILIES))
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "grid": "quick" if quick else "default",
                "probes": len(measured), "probes_planned": len(probes), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        # the quick grid's families are all small: nine members each would triple a smoke check's fit for a rough model
        model = fit_model(measured, roofline, key, name, device_type, meta, steps=300 if quick else 1500,
                          members=ENSEMBLE_MEMBERS if quick else None, on_family=lambda _: bar.update(task, advance=1))
    model.meta["calibration_seconds"] = round(time.perf_counter() - started - aside, 1)
    return model, save_model(model, model_dir)


def describe(model: LatencyModel) -> list[tuple[str, str]]:
    """Rows for the command's summary table."""
    r = model.roofline
    rows = [("device", f"{model.device_name} ({model.device_key})"),
            ("matmul rate", f"{r.flops_per_second / 1e9:,.1f} GFLOP/s"),
            ("copy bandwidth", f"{r.bytes_per_second / 1e9:,.1f} GB/s"),
            ("per-op floor", f"{r.op_overhead * 1e6:,.1f} us"),
            ("fresh-page rate", f"{r.fault_bytes_per_second / 1e9:,.1f} GB/s" if r.fault_bytes_per_second else "none"),
            ("host gap per op", ", ".join(f"{k} {v * 1e6:,.1f} us" for k, v in r.gaps.items()) or "hidden (GPU)"),
            ("in-iteration scale", ", ".join(f"{k} x{v:.2f}" for k, v in r.scales.items()) or "none")]
    samples = model.meta.get("samples", {})
    for family in FAMILIES:
        status = "MLP" if family in model.families else "prior"
        rows.append((f"  {family}", f"{status}, {samples.get(family, 0)} measured ops"))
    if model.view_seconds is not None and math.isfinite(model.view_seconds):
        rows.append(("  view ops", f"{model.view_seconds * 1e6:,.1f} us median, {len(model.view_ops)} op names "
                                   f"priced ({samples.get('view', 0)} measured)"))
    load = model.meta.get("load_average") or {}
    clock = {"cpu": "process CPU time (descheduled time not counted)"}.get(model.meta.get("clock", ""), "wall time")
    rows.append(("timing", f"{clock}; load average {load.get('min', 0):.1f}-{load.get('max', 0):.1f} while measuring"))
    return rows
