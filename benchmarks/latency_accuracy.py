"""Latency-model accuracy: per op family on held-out shapes, and whole training iterations of the zoo.

1. Calibrates the local device (or loads its model file with --reuse). The default calibration grid
   includes the zoo models themselves at batch sizes 1 and 3 (ZOO_CALIBRATION_BATCHES).
2. Measures a held-out probe grid (another seed; any op whose name+shapes+params also occurs in the
   training grid is dropped) and reports, per op family, the median and 90th-percentile absolute
   percentage error of the op's own time, for the calibrated model and for the roofline prior alone.
   The grid is measured in --passes whole passes and each op's truth is its median over them
   (`label_spread_percent` says how far one pass lies from that median). When this script calibrates,
   the passes are timed between calibration's own probes, spread over them (`HeldOutAlongside`; never
   trained on), so the truth and the training labels come from the same minutes of the machine; one more
   pass after calibration (`families_after_calibration`) shows what the machine's drift since adds. With
   --reuse the passes run after calibration. `drift_since_calibration` compares the ops calibration
   measured (the zoo's parameter-shaped ones) with the same ops timed now.
   The same report (one pass) for the zoo models measured op by op at the evaluation batch (2; again only ops
   whose key calibration never saw: the optimizer's ops, whose shapes do not depend on the batch, drop out).
3. For each zoo model at the evaluation batch (2, never a calibration batch), traces the iteration on
   meta and predicts its time; then trains the model as a user's job runs it, in a fresh process of its
   own: warm-ups until glibc's heap stops trimming (at most MAX_WARMUPS), then the robust time of --repeats
   plain iterations, per phase too, with the pages each faulted in and its system time; in --passes rounds
   over the models, the median round counting. `seen_share` is
   the part of the prediction from ops whose key was measured in calibration (parameter-shaped ops).

Targets on this CPU: median error <= 15% per family, whole iteration within 10%.
Writes benchmarks/results/latency_<device>.json.

Run: .venv/bin/python benchmarks/latency_accuracy.py [--device cpu] [--threads 1] [--passes 3] [--reuse --model-dir DIR]
`--quick` calibrates on the quick grid (`tensile calibrate --quick`) and holds out another quick grid: a smoke run's
setting (seconds instead of ten minutes), whose rough model's figures mean nothing.
On a shared, busy CPU use --threads 1 (the default here): with two OpenMP threads and other
processes on the cores, a parallel region waits for a descheduled thread and single ops take
milliseconds instead of microseconds, so timings then measure the neighbours, not the op.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from bench_results import results_dir
from tensile.forecast import trace_workload
from tensile.latency import assign_latencies, iteration_seconds, predict_seconds
from tensile.latency.calibrate import calibrate, family_samples, local_device, measure_probes
from tensile.latency.device import resolve_target
from tensile.latency.families import FAMILIES, family_of
from tensile.latency.measure import (in_fresh_process, load_average, outliers, repeat_until_settled, robust_seconds, time_plain_iteration,
                                     uses_cpu_clock)
from tensile.latency.online import op_key
from tensile.latency.predict import find_model
from tensile.latency.probes import ZOO_CALIBRATION_BATCHES, ZOO_MODELS, build_step, make_grid, zoo_probes
from tensile.latency.prior import fresh_output_bytes
from tensile.tracer import trace_step

# Evaluation batch sizes: calibration trains each zoo model at ZOO_CALIBRATION_BATCHES (1 and 3), never at
# these, so every activation-shaped op here (and every forward / backward op whose shape carries the batch)
# is a shape the model was not trained on. Parameter-shaped ops (the optimizer's, some weight gradients)
# do not depend on the batch and were seen; `seen_share` reports how much predicted time they are.
BATCHES = {name: 2 for name in ZOO_MODELS}
assert not set(BATCHES.values()) & set(ZOO_CALIBRATION_BATCHES), "evaluation batches must be held out"
RESULTS = results_dir()
MIN_WARMUPS, MAX_WARMUPS = 2, 6  # a job's first iterations allocate optimizer state and grow glibc's heap


def grids(quick: bool) -> tuple[str, str]:
    """The calibration grid and the held-out one (seed 1 of its own grid): the quick grid's small shapes for both with
    --quick, so that their ops' keys differ as the default grid's and the held-out grid's do."""
    return ("quick", "quick") if quick else ("default", "holdout")


def training_keys(device_type: str, grid: str = "default") -> set[str]:
    """Keys of every op the training grid contains (traced on meta: no measuring needed)."""
    keys: set[str] = set()
    for probe in make_grid(grid, seed=0, device_type=device_type):
        step = build_step(probe, "meta")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            workload = trace_step(step, model_name=probe.kind, batch_size=1, target_device=device_type)
        keys.update(op_key(op) for op in workload.ops)
    return keys


def percent_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return np.abs(predicted - measured) / measured * 100.0


def family_accuracy(model, prior, measured: list, seen: set[str]) -> dict:  # type: ignore[no-untyped-def]
    """Per family, errors of the op's own time on ops whose key calibration never measured."""
    rows = {}
    for family, (ops, seconds, _, preceding, iteration) in sorted(family_samples(measured).items()):
        keep = [i for i, op in enumerate(ops) if op_key(op) not in seen]
        if not keep:
            continue
        held = [ops[i] for i in keep]
        truth = np.array([seconds[i] for i in keep])
        predicted = predict_seconds(held, model, utilization=0.0, include_gaps=False,
                                    preceding=[preceding[i] for i in keep], iteration=[iteration[i] for i in keep])
        calibrated = percent_errors(predicted, truth)
        roofline = percent_errors(predict_seconds(held, None, prior, include_gaps=False), truth)
        rows[family] = {
            "ops": len(held), "dropped_as_seen_in_training": len(ops) - len(held),
            "median_ape": float(np.median(calibrated)), "p90_ape": float(np.percentile(calibrated, 90)),
            "prior_median_ape": float(np.median(roofline)), "prior_p90_ape": float(np.percentile(roofline, 90)),
            "measured_seconds_total": float(truth.sum()), "predicted_seconds_total": float(predicted.sum()),
        }
    return rows


def measure_grid(probes: list, device_type: str, console: Console, label: str) -> list:
    started = time.perf_counter()
    measured = measure_probes(probes, device_type)
    loads = [m.timing.load_average for m in measured]
    console.print(f"{label}: {len(measured)} probe steps measured in {time.perf_counter() - started:.0f} s "
                  f"(load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f})")
    return measured


def drift_since_calibration(model, measured: list) -> dict:  # type: ignore[no-untyped-def]
    """The same ops timed now against calibration's median for them (`measured_ops`: the zoo's parameter-shaped
    ops, which the zoo models at the evaluation batch run again, in fresh processes and the same harness):
    below 1 when this machine runs faster than while it calibrated, which every prediction then carries."""
    ratios: dict[str, list[float]] = defaultdict(list)
    for m in measured:
        for op, seconds in zip(m.timing.ops, m.timing.seconds):
            then = model.measured_ops.get(op_key(op))
            if then and seconds > 0:
                ratios[family_of(op) or "other"].append(seconds / then)
    every = [r for values in ratios.values() for r in values]
    return {"ops": len(every), "median_ratio": float(np.median(every)) if every else None,
            "by_family": {f: {"ops": len(v), "median_ratio": float(np.median(v))} for f, v in sorted(ratios.items())}}


def measure_passes(probes: list, device_type: str, console: Console, label: str, passes: int) -> list[list]:
    """The grid measured `passes` times, one whole pass after another (with --reuse): two passes over the same
    probes a minute apart, one of them in a slow minute, differed by a median of 3-23% per family on this
    shared machine, so one pass is a noisy truth to score a prediction against."""
    return [measure_grid(probes, device_type, console, f"{label}, pass {i + 1} of {passes}") for i in range(passes)]


def _agreeing(passes: list[list]) -> list[list]:
    """Per probe of the first pass, its measurement in every pass that timed the same op sequence."""
    by_probe = [{id(m.probe): m for m in measured} for measured in passes]
    groups = []
    for first in passes[0]:
        names = [op.name for op in first.timing.ops]
        groups.append([m for found in by_probe if (m := found.get(id(first.probe))) is not None
                       and [op.name for op in m.timing.ops] == names])
    return groups


class HeldOutAlongside:
    """Measures the held-out grid's passes between calibration's probes, spread evenly over them, so the held-out
    truth comes from the same minutes of a shared machine as the labels the model learns from: its speed drifts
    by 5-10% over ten minutes (run L8: every family's predicted / measured total but the views' 1.06-1.19 on
    the grid timed after calibration; its training probes re-timed then ran 2-9% faster than calibration had
    timed them), which is the machine's, not the model's."""

    def __init__(self, probes: list, passes: int, device_type: str, calibration_probes: int) -> None:
        self.queue = [(i, probe) for i in range(passes) for probe in probes]
        self.passes: list[list] = [[] for _ in range(passes)]
        self.device_type = device_type
        self.calibration_probes = calibration_probes
        self.after = 0  # calibration probes measured so far
        self.done = 0  # held-out measurements made so far

    def __call__(self, _probe: object) -> None:
        self.after += 1
        self._measure_until(round(self.after * len(self.queue) / self.calibration_probes))

    def finish(self) -> list[list]:
        """The passes, completed where calibration stopped early (its time budget)."""
        self._measure_until(len(self.queue))
        return self.passes

    def _measure_until(self, due: int) -> None:
        while self.done < min(due, len(self.queue)):
            index, probe = self.queue[self.done]
            self.passes[index].extend(measure_probes([probe], self.device_type))
            self.done += 1


def median_of_passes(groups: list[list]) -> list:
    """One measurement per probe (`_agreeing` groups): each op's median over the passes that agree with the first."""
    return [replace(group[0], timing=replace(group[0].timing, seconds=[float(np.median(values)) for values in
                                                                      zip(*(m.timing.seconds for m in group))]))
            for group in groups]


def label_spread(groups: list[list]) -> dict[str, float]:
    """Per family, the median distance (%) of one pass's op time from the median of the passes (`_agreeing`
    groups): how far the machine's own noise moves the truth."""
    spread: dict[str, list[float]] = defaultdict(list)
    for group in groups:
        if len(group) < 2:
            continue
        for i, op in enumerate(group[0].timing.ops):
            family = family_of(op)
            values = np.array([m.timing.seconds[i] for m in group])
            middle = float(np.median(values))
            if family is not None and middle > 0:
                spread[family].extend(np.abs(values - middle) / middle * 100.0)
    return {family: float(np.median(values)) for family, values in sorted(spread.items())}


def load_summary(measured: list) -> dict:
    loads = [m.timing.load_average for m in measured]
    return {"min": min(loads), "median": float(np.median(loads)), "max": max(loads)} if loads else {}


def family_breakdown(workload, measured) -> dict:  # type: ignore[no-untyped-def]
    """Where an iteration's prediction goes, against the same iteration measured op by op: per family the
    sum of predicted latencies (own time x phase scale + host gap) and of measured in-iteration op times,
    and per phase the bare iteration's time left over after its ops (the host gap actually paid)."""
    predicted: dict[str, float] = defaultdict(float)
    for op in workload.ops:
        predicted[family_of(op) or "other"] += op.latency
    timed: dict[str, float] = defaultdict(float)
    for op, seconds in zip(measured.timing.ops, measured.timing.seconds):
        timed[family_of(op) or "other"] += seconds
    gaps = {}
    for phase, total in measured.timing.phase_seconds.items():
        in_phase = [s for op, s in zip(measured.timing.ops, measured.timing.seconds) if op.phase == phase]
        gaps[phase] = {"bare_seconds": total, "ops_seconds": float(sum(in_phase)), "ops": len(in_phase),
                       "gap_per_op_us": (total - sum(in_phase)) / max(len(in_phase), 1) * 1e6}
    return {"families": {f: {"predicted_seconds": predicted.get(f, 0.0), "measured_op_seconds": timed.get(f, 0.0)}
                         for f in sorted(set(predicted) | set(timed))},
            "phases_measured_op_by_op": gaps}


def _faulted() -> tuple[float, float]:
    """(MB of pages faulted in, system CPU seconds) of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt * resource.getpagesize() / 2**20, usage.ru_stime


def measure_job(model_name: str, batch: int, repeats: int, threads: int, device_type: str) -> dict:
    """A zoo model trained as a user's job runs it: in a process of its own (run this in a fresh one), warm-ups
    until the allocator settles, then robust plain iterations (timed as calibration times them: host_clock;
    re-measured while fewer than two agree; outliers reported); with the pages each faulted in and its
    system time."""
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    probe = zoo_probes((batch,), (model_name,))[0]
    step = build_step(probe, device_type)
    runs: list[tuple[float, dict[str, float], float, float]] = []

    def once() -> float:
        mb, sys_s = _faulted()
        total, phases = time_plain_iteration(step, device_type)
        mb_after, sys_after = _faulted()
        runs.append((total, phases, mb_after - mb, sys_after - sys_s))
        return total

    for _ in range(MIN_WARMUPS):
        once()
    # settled: the last warm-up faulted in no more pages than the quietest one (glibc's heap stops trimming)
    while len(runs) < MAX_WARMUPS and runs[-1][2] > 1.1 * min(r[2] for r in runs) + 16:
        once()
    warmups = len(runs)
    runs.clear()
    totals = repeat_until_settled(once, repeats)
    phases = {phase: robust_seconds([run[phase] for _, run, _, _ in runs]) for phase in runs[0][1]}
    return {"seconds": robust_seconds(totals), "runs": totals, "outlier_runs": outliers(totals), "phases": phases,
            "warmups": warmups, "faulted_mb": [r[2] for r in runs], "system_seconds": [r[3] for r in runs],
            "clock": "cpu" if uses_cpu_clock(device_type) else "wall", "load_average": load_average()}


def measure_jobs(models: list[str], repeats: int, threads: int, console: Console, passes: int, device_type: str) -> dict:
    """measure_job for each model, each in a fresh process (one process's history, heap fragmentation and
    trimmed arenas, must not leak into another model's iteration time), in `passes` rounds over the models:
    the measured time is the median of the rounds, so a slow minute of the shared machine moves one round."""
    rounds: dict[str, list[dict]] = defaultdict(list)
    for i in range(passes):
        for name in models:
            real = in_fresh_process(measure_job, name, BATCHES[name], repeats, threads, device_type)
            rounds[name].append(real)
            console.print(f"{name} b{BATCHES[name]} (pass {i + 1} of {passes}): measured {real['seconds']:.3f} s after "
                          f"{real['warmups']} warm-ups (faulted {np.median(real['faulted_mb']):.0f} MB, system "
                          f"{np.median(real['system_seconds']):.3f} s per iteration; load {real['load_average']})")
    return {name: {"seconds": float(np.median([r["seconds"] for r in runs])), "pass_seconds": [r["seconds"] for r in runs],
                   "phases": {phase: float(np.median([r["phases"][phase] for r in runs])) for phase in runs[0]["phases"]},
                   "clock": runs[0]["clock"],
                   **{key: [r[key] for r in runs] for key in ("runs", "outlier_runs", "warmups", "faulted_mb", "system_seconds",
                                                               "load_average")}}
            for name, runs in rounds.items()}


def zoo_accuracy(device: str, model_dir: str, prior, jobs: dict, console: Console,  # type: ignore[no-untyped-def]
                 seen: set[str], op_by_op: dict) -> dict:
    """Predicted against measured whole iterations (measure_jobs: one after another, so they share the
    machine's load of the moment)."""
    rows = {}
    for name, real in jobs.items():
        batch = BATCHES[name]
        # as `measure_job` trains it (a zoo probe's per-parameter loops), with the device's ops (on CUDA cuDNN's
        # batch norm and the fused dropout, `tensile.cuda_ops`)
        workload = trace_workload(name, batch, device=device, foreach=False)
        source = assign_latencies(workload, device, model_dir)
        predicted = iteration_seconds(workload)
        seen_seconds = sum(op.latency for op in workload.ops if op_key(op) in seen)
        by_phase = defaultdict(float)
        for op in workload.ops:
            by_phase[op.phase] += op.latency
        prior_total = float(predict_seconds(workload.ops, None, prior).sum())
        error = (predicted - real["seconds"]) / real["seconds"] * 100.0
        rows[name] = {
            "batch_size": batch, "ops": len(workload.ops), "latency_source": source,
            "predicted_seconds": predicted, "measured_seconds": real["seconds"],
            "measured_pass_seconds": real["pass_seconds"], "measured_runs": real["runs"],
            "error_percent": error, "prior_seconds": prior_total,
            "prior_error_percent": (prior_total - real["seconds"]) / real["seconds"] * 100.0,
            "predicted_phases": dict(by_phase), "measured_phases": real["phases"],
            "seen_share": seen_seconds / predicted if predicted > 0 else 0.0, "clock": real["clock"],
            "outlier_runs": real["outlier_runs"], "load_average": real["load_average"], "warmups": real["warmups"],
            "faulted_mb_per_pass": real["faulted_mb"], "system_seconds_per_pass": real["system_seconds"],
            "predicted_fresh_page_mb": sum(fresh_output_bytes(op) for op in workload.ops) / 2**20,
        }
        if name in op_by_op:
            rows[name]["breakdown"] = family_breakdown(workload, op_by_op[name])
        console.print(f"{name} b{batch}: predicted {predicted:.3f} s, measured {real['seconds']:.3f} s ({error:+.1f}%)")
    return rows



def family_table(title: str, rows: dict[str, dict]) -> Table:
    """Median and p90 absolute percentage error per op family, against the prior's."""
    table = Table(title=title)
    for column in ("family", "ops", "median APE", "p90 APE", "prior median APE"):
        table.add_column(column, justify="right" if column != "family" else "left")
    for family in (*FAMILIES, "view"):
        if family in rows:
            r = rows[family]
            table.add_row(family, str(r["ops"]), f"{r['median_ape']:.1f}%", f"{r['p90_ape']:.1f}%", f"{r['prior_median_ape']:.1f}%")
    return table

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for calibration and measurement")
    parser.add_argument("--model-dir", default=None, help="where the model file is (default: a fresh temporary dir)")
    parser.add_argument("--reuse", action="store_true", help="load the model file in --model-dir instead of calibrating")
    parser.add_argument("--models", default=",".join(BATCHES), help="comma-separated zoo models")
    parser.add_argument("--repeats", type=int, default=3, help="measured iterations per zoo model (after 2 warm-ups)")
    parser.add_argument("--passes", type=int, default=3,
                        help="measure the held-out grid and the zoo iterations this many times, one pass after another; "
                             "the truth is each one's median over the passes")
    parser.add_argument("--calibration-budget", type=float, default=480.0, metavar="SECONDS",
                        help="calibration's time budget (tensile calibrate --budget)")
    parser.add_argument("--skip-families", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="calibrate on the quick grid and hold out another quick grid "
                             "(a smoke run: figures mean nothing)")
    parser.add_argument("--skip-zoo-ops", action="store_true", help="skip the op-level errors on the zoo models")
    parser.add_argument("--out", type=Path, default=None,
                        help="result file (default: benchmarks/results/latency_<device>.json)")
    args = parser.parse_args()
    console = Console()
    warnings.simplefilter("ignore", UserWarning)
    torch.set_num_threads(args.threads)
    device_type, key, name = local_device(args.device)
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="tensile-latency-")
    if args.passes < 1:
        raise SystemExit("--passes must be at least 1")
    calibration_grid, held_out_name = grids(args.quick)
    held_out_grid = [] if args.skip_families else make_grid(held_out_name, seed=1, device_type=device_type)
    alongside = None
    if args.reuse:
        model, path, _ = find_model(args.device, model_dir)
        if model is None:
            raise SystemExit(f"--reuse: no model file at {path}")
    else:
        alongside = HeldOutAlongside(held_out_grid, args.passes, device_type,
                                     len(make_grid(calibration_grid, seed=0, device_type=device_type)))
        model, path = calibrate(args.device, quick=args.quick, model_dir=model_dir, progress=console.is_terminal,
                                threads=args.threads, alongside=alongside, budget_s=args.calibration_budget)
        torch.set_num_threads(args.threads)
    console.print(f"model {path} ({os.path.getsize(path) / 1024:.0f} KiB), calibration "
                  f"{model.meta.get('calibration_seconds', '?')} s, {model.meta.get('probes')} probes")
    prior = resolve_target(args.device, model_dir).prior
    seen = training_keys(device_type, calibration_grid)
    models = [m for m in args.models.split(",") if m]
    after: list = []  # one pass after calibration, when the passes ran alongside it: the machine's drift since
    if not held_out_grid:
        held_out_passes = []
    elif alongside is not None:
        held_out_passes = alongside.finish()
        after = measure_grid(held_out_grid, device_type, console, "held-out grid after calibration (one pass)")
    else:
        held_out_passes = measure_passes(held_out_grid, device_type, console, "held-out grid", args.passes)
    groups = _agreeing(held_out_passes) if held_out_passes else []
    held_out = median_of_passes(groups)
    families = family_accuracy(model, prior, held_out, seen) if held_out else {}
    families_after = family_accuracy(model, prior, after, seen) if after else {}
    zoo_measured = [] if args.skip_families or args.skip_zoo_ops else measure_grid(
        zoo_probes(tuple(sorted(set(BATCHES.values()))), tuple(models)), device_type, console,
        "zoo models op by op at the evaluation batch (each in its own process, as calibration measures them)")
    zoo_ops = family_accuracy(model, prior, zoo_measured, seen) if zoo_measured else {}
    drift = drift_since_calibration(model, zoo_measured) if zoo_measured else {}
    if drift.get("median_ratio"):
        console.print(f"the {drift['ops']} zoo ops calibration also timed run {drift['median_ratio']:.2f}x their calibration "
                      "time now (below 1: the machine is faster than while it calibrated)")
    op_by_op = {m.probe.params["model"]: m for m in zoo_measured}
    zoo = zoo_accuracy(args.device, model_dir, prior, measure_jobs(models, args.repeats, args.threads, console, args.passes, device_type),
                       console, seen, op_by_op)

    timing = "measured alongside calibration" if alongside is not None else "measured after calibration"
    console.print(family_table(f"Op latency on held-out shapes ({name}, {args.threads} thread(s), {timing})", families))
    if families_after:
        console.print(family_table("The same, one pass measured after calibration", families_after))
    if zoo_ops:
        console.print(family_table(
            f"Op latency of the zoo models at batch {sorted(set(BATCHES.values()))} (held-out keys only)", zoo_ops))
    table = Table(title="Whole training iteration (Adam)")
    for column in ("model", "batch", "predicted s", "measured s", "error", "prior error", "seen share"):
        table.add_column(column, justify="right" if column != "model" else "left")
    for model_name, r in zoo.items():
        table.add_row(model_name, str(r["batch_size"]), f"{r['predicted_seconds']:.3f}", f"{r['measured_seconds']:.3f}",
                      f"{r['error_percent']:+.1f}%", f"{r['prior_error_percent']:+.1f}%", f"{r['seen_share']:.0%}")
    console.print(table)

    result = {
        "device": name, "device_key": key, "kind": device_type, "threads": args.threads, "torch": torch.__version__,
        "host": platform.node(), "cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg(),
        "load_average_during": {"held_out_grid": load_summary([m for measured in held_out_passes for m in measured]),
                                "zoo_op_by_op": load_summary(zoo_measured),
                                "zoo_iterations": [r["load_average"] for r in zoo.values()]},
        "clock": "process CPU time (1 torch thread)" if uses_cpu_clock(device_type) else "wall",
        "model_file_bytes": os.path.getsize(path), "calibration": model.meta,
        "roofline": model.roofline.to_dict(), "passes": args.passes,
        "held_out_timing": "alongside calibration" if alongside is not None else "after calibration",
        "families_after_calibration": families_after,
        "label_spread_percent": label_spread(groups) if len(held_out_passes) > 1 else {},
        "drift_since_calibration": drift,
        "families": families, "zoo_ops": zoo_ops, "zoo": zoo,
        "evaluation_batches": BATCHES, "calibration_zoo_batches": list(ZOO_CALIBRATION_BATCHES),
        "targets": {"family_median_ape_percent": 15.0, "iteration_error_percent": 10.0},
        "families_within_target": sorted(f for f, r in families.items() if r["median_ape"] <= 15.0),
        "models_within_target": sorted(m for m, r in zoo.items() if abs(r["error_percent"]) <= 10.0),
    }
    out = args.out or RESULTS / f"latency_{device_type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
