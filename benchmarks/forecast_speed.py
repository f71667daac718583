"""Forecast speed: the whole forecast of ResNet-50 at batch 16 — trace, latencies, peak analysis and
TENSILE plan — (target < 3 s, not counting interpreter and torch start-up), against a bare
meta-device trace of the same step that only records op names (target: at most 1.6x), measured
side by side in one run.

Run: .venv/bin/python benchmarks/forecast_speed.py [--repeats 5]   (writes benchmarks/results/forecast_speed.json;
`--repeats 1` for a smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode

from bench_results import results_dir
from tensile.job_forecast import make_forecast
from tensile.forecast import trace_workload
from tensile.tracer import TrainingStep
from tensile.zoo import build_zoo_parts

MODEL, BATCH = "resnet50", 16
RESULTS = results_dir() / "forecast_speed.json"


class _OpNames(TorchDispatchMode):
    """The bare minimum a tracer must do: see every op."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def bare_trace() -> int:
    """Build on meta, warm-up step, then record one step's op names: what any meta tracer pays."""
    model, batch, loss_fn, _ = build_zoo_parts(MODEL, BATCH, device="meta")
    optimizer = torch.optim.Adam(model.parameters(), foreach=True)
    step = TrainingStep(model, batch, loss_fn, [optimizer])
    step.run()
    step.zero_grad()
    recorder = _OpNames()
    with recorder:
        step.run()
    return len(recorder.names)


def full_forecast() -> int:
    """What `tensile forecast` does: trace, latencies, vanilla peak, TENSILE plan, summary."""
    summary = make_forecast(trace_workload(MODEL, BATCH, device="cuda"), "a6000").summary
    return summary["vanilla_peak_bytes"]


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each (their median counts)")
    args = parser.parse_args()
    bare_trace(), full_forecast()  # imports and first-call caches out of the way
    bare, full = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        bare.append(timed(bare_trace))
        full.append(timed(full_forecast))
    bare_median, full_median = statistics.median(bare), statistics.median(full)
    result = {
        "model": MODEL,
        "batch_size": BATCH,
        "bare_trace_seconds_median": bare_median,
        "forecast_seconds_median": full_median,
        "ratio": full_median / bare_median,
        "target_forecast_seconds": 3.0,
        "target_ratio": 1.6,
        "bare_trace_seconds": bare,
        "forecast_seconds": full,
    }
    table = Table(title=f"{MODEL} batch {BATCH}: forecast vs bare meta trace (median of {args.repeats})")
    for column in ("bare trace s", "forecast s (trace, latencies, plan)", "ratio", "targets"):
        table.add_column(column, justify="right")
    table.add_row(f"{bare_median:.3f}", f"{full_median:.3f}", f"{full_median / bare_median:.2f}x", "< 3 s, <= 1.6x")
    Console().print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
