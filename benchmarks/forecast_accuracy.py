"""Forecast accuracy: the meta-device forecast of the vanilla peak against (a) the peak of live
device bytes around a real CPU iteration of the same model, two ways: the CPU allocator's own
allocation events (torch.profiler, profile_memory) on top of the resident bytes, and the live trace
of real CPU storages; and (b) PyTorch's MemTracker on the same step. Prints a table and writes
benchmarks/results/forecast_accuracy.json. The allocator figure includes kernel workspaces that
no tensor owns (oneDNN convolution buffers), so it sits slightly above the storage-level figures.

Target: within 2% of both for every zoo model.  Run: .venv/bin/python benchmarks/forecast_accuracy.py [--models M,...]
(`--models`: some of the zoo models only, e.g. one for a smoke run.)
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from rich.console import Console
from rich.table import Table

from bench_results import results_dir
from tensile.crosscheck import memtracker_peak
from tensile.forecast import trace_workload
from tensile.peak import analyze_vanilla
from tensile.tracer import TrainingStep
from tensile.zoo import build_zoo_parts

BATCHES = {"vgg16": 2, "inception_v3": 2, "inception_v4": 2, "resnet50": 4, "densenet121": 4, "bert_base": 2, "gpt2": 2}
MIB = 1024**2
RESULTS = results_dir() / "forecast_accuracy.json"


def memtracker_peak_of(model_name: str, batch_size: int) -> int:
    """MemTracker's peak for the same steady-state step, on meta."""
    model, batch, loss_fn, _ = build_zoo_parts(model_name, batch_size, device="meta")
    return memtracker_peak(TrainingStep(model, batch, loss_fn, [torch.optim.Adam(model.parameters())]))


def allocator_peak(model_name: str, batch_size: int) -> int:
    """Peak CPU allocator bytes during one real steady-state iteration (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    model, batch, loss_fn, _ = build_zoo_parts(model_name, batch_size, device="cpu")
    optimizer = torch.optim.Adam(model.parameters())
    step = TrainingStep(model, batch, loss_fn, [optimizer])
    step.run()
    step.zero_grad()
    resident = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers(), *batch)}
    for state in optimizer.state.values():
        resident.update({id(v.untyped_storage()): v.untyped_storage().nbytes() for v in state.values()})
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step.run()
    in_use = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"):
        in_use += nbytes
        peak = max(peak, in_use)
    return sum(resident.values()) + peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(BATCHES), help="comma-separated zoo models (default: all)")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    if unknown := sorted(set(models) - set(BATCHES)):
        parser.error(f"unknown models {unknown}; known: {', '.join(BATCHES)}")
    console = Console(width=140)
    rows = []
    for name in models:
        batch_size = BATCHES[name]
        started = time.perf_counter()
        forecast = analyze_vanilla(trace_workload(name, batch_size, device="cpu")).peak_bytes
        forecast_seconds = time.perf_counter() - started
        started = time.perf_counter()
        live_workload = trace_workload(name, batch_size, device="cpu", live=True)
        live = analyze_vanilla(live_workload).peak_bytes
        live_seconds = time.perf_counter() - started
        tracked = memtracker_peak_of(name, batch_size)
        allocator = allocator_peak(name, batch_size)
        rows.append(
            {
                "model": name,
                "batch_size": batch_size,
                "forecast_peak_bytes": forecast,
                "live_cpu_peak_bytes": live,
                "memtracker_peak_bytes": tracked,
                "cpu_allocator_peak_bytes": allocator,
                "error_vs_allocator": (forecast - allocator) / allocator,
                "error_vs_live": (forecast - live) / live,
                "error_vs_memtracker": (forecast - tracked) / tracked,
                "forecast_seconds": round(forecast_seconds, 2),
                "live_seconds": round(live_seconds, 2),
            }
        )
        console.print(f"{name}: forecast {forecast / MIB:,.1f} MiB, live {live / MIB:,.1f}, allocator {allocator / MIB:,.1f}, MemTracker {tracked / MIB:,.1f}")
    table = Table(title="Forecast vanilla peak vs live CPU iteration and MemTracker (target: within 2%)")
    for column in ("model", "batch", "forecast MiB", "CPU allocator MiB", "live trace MiB", "MemTracker MiB",
                   "vs allocator", "vs live trace", "vs MemTracker"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["model"], str(row["batch_size"]), f"{row['forecast_peak_bytes'] / MIB:,.1f}",
            f"{row['cpu_allocator_peak_bytes'] / MIB:,.1f}", f"{row['live_cpu_peak_bytes'] / MIB:,.1f}",
            f"{row['memtracker_peak_bytes'] / MIB:,.1f}", f"{row['error_vs_allocator']:+.2%}",
            f"{row['error_vs_live']:+.3%}", f"{row['error_vs_memtracker']:+.3%}",
        )
    console.print(table)
    worst = max(max(abs(r["error_vs_live"]), abs(r["error_vs_memtracker"]), abs(r["error_vs_allocator"])) for r in rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "device": f"cpu ({platform.processor() or platform.machine()})",
                "torch": torch.__version__,
                "target_relative_error": 0.02,
                "worst_relative_error": worst,
                "rows": rows,
            },
            indent=2,
        )
    )
    console.print(f"worst relative error {worst:.3%}; written to {RESULTS}")


if __name__ == "__main__":
    main()
