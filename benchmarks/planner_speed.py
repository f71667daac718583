"""Planner speed: one global plan for four co-located ResNet-50 (batch 16) under 1 s on one core, and
plan time against the total number of tensor accesses for 1-8 jobs with a fitted growth exponent.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/planner_speed.py [--max-jobs 8] [--repeats 3]
Writes benchmarks/results/planner_speed.json and .md. `--max-jobs 2 --repeats 1` is a smoke run's setting: the series
stop at two jobs (only the models they use are traced), each plan timed once.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench_results import results_dir  # noqa: E402
from tensile.devices import device_preset  # noqa: E402
from tensile.forecast import trace_workload  # noqa: E402
from tensile.latency import assign_latencies  # noqa: E402
from tensile.planner import JobToPlan, co_run_slowdown, plan_gpu  # noqa: E402

MIX = ("resnet50", "vgg16", "inception_v3", "densenet121", "inception_v4")
RESULTS = results_dir()


def accesses(workload) -> int:
    return sum(len(op.inputs) + len(op.outputs) for op in workload.ops)


def best_time(jobs: list[JobToPlan], bandwidth: float, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = plan_gpu(jobs, bandwidth, slowdown=co_run_slowdown(len(jobs), 0.1))
        times.append(time.perf_counter() - started)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-jobs", type=int, default=8,
                        help="the largest number of jobs in each series (at least 2)")
    parser.add_argument("--repeats", type=int, default=3, help="plans timed per point (the best counts)")
    args = parser.parse_args()
    if args.max_jobs < 2:
        parser.error("--max-jobs must be at least 2: the growth exponent is fitted to the series")
    console = Console()
    bandwidth = device_preset("a6000").host_link_bandwidth
    workloads = {}
    for model in MIX[:args.max_jobs]:  # resnet50 first: the four copies below are of it
        workload = trace_workload(model, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assign_latencies(workload, "a6000")
        workloads[model] = workload
    resnet = workloads["resnet50"]
    four, plan4 = best_time([JobToPlan(f"resnet50#{i}", resnet) for i in range(4)], bandwidth, args.repeats)
    rows = []
    for series in ("resnet50 copies", "mixed models"):
        for n in range(1, args.max_jobs + 1):
            models = ["resnet50"] * n if series == "resnet50 copies" else [MIX[i % len(MIX)] for i in range(n)]
            jobs = [JobToPlan(f"{m}#{i}", workloads[m]) for i, m in enumerate(models)]
            seconds, result = best_time(jobs, bandwidth, args.repeats)
            rows.append({"series": series, "jobs": n, "accesses": sum(accesses(workloads[m]) for m in models),
                         "seconds": seconds, "rounds": result.rounds, "msr": result.msr})
    fits = {}
    for series in ("resnet50 copies", "mixed models"):
        xs = np.log([r["accesses"] for r in rows if r["series"] == series])
        ys = np.log([r["seconds"] for r in rows if r["series"] == series])
        fits[series] = float(np.polyfit(xs, ys, 1)[0])
    out = {"four_resnet50_b16_seconds": four, "four_resnet50_rounds": plan4.rounds, "four_resnet50_msr": plan4.msr,
           "rows": rows, "growth_exponent": fits, "threads": os.environ["OMP_NUM_THREADS"]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planner_speed.json").write_text(json.dumps(out, indent=1))
    md = ["# Planner speed", "",
          f"One global plan for 4 x ResNet-50 batch 16 (A6000 preset, no budget: lowest peak): **{four:.3f} s** "
          f"(best of {args.repeats}, one thread), {plan4.rounds} rounds, GPU MSR {plan4.msr:.3f}. "
          "Target: under 1 s.", "",
          "| series | jobs | tensor accesses | plan seconds | rounds | MSR |", "|---|---|---|---|---|---|"]
    md += [f"| {r['series']} | {r['jobs']} | {r['accesses']:,} | {r['seconds']:.3f} | {r['rounds']} | {r['msr']:.3f} |" for r in rows]
    md += ["", "Fitted growth exponent of plan time against total accesses (log-log least squares): "
           + ", ".join(f"{s}: {e:.2f}" for s, e in fits.items()), ""]
    (RESULTS / "planner_speed.md").write_text("\n".join(md))
    table = Table(title=f"4 x ResNet-50 b16: {four:.3f} s")
    for c in ("series", "jobs", "accesses", "seconds", "rounds", "MSR"):
        table.add_column(c)
    for r in rows:
        table.add_row(r["series"], str(r["jobs"]), f"{r['accesses']:,}", f"{r['seconds']:.3f}", str(r["rounds"]), f"{r['msr']:.3f}")
    console.print(table)
    console.print(f"growth exponents: {fits}")


if __name__ == "__main__":
    main()
