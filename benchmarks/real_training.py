"""Real training, vanilla against TENSILE, on this machine's device: the paper's Table III models.

For each model (batch 16 by default), three runs of --steps iterations in this process, from the same
seed and batch: vanilla, under the runtime hook with the in-process planner (no memory budget and the
default max swapping rate: the paper's single-job setting), and vanilla again. Every iteration is timed
between synchronisations and its peak read from `torch.cuda.max_memory_allocated()` reset per
iteration (on the CPU device: the hook's storage tracker; vanilla CPU peaks are not measured).

- MSR = 1 - TENSILE's steady peak / vanilla's peak; EOR = TENSILE's steady iteration time / vanilla's
  (the median over both vanilla runs). Steady = the iterations after the plan was aligned (the hook
  records iterations 0-1, aligns in 2, runs natively from 3). Targets: MSR at least Table III's, EOR at
  most 1.15.
- The hook's own cost: a fourth run under an empty plan (native from iteration 3, no event):
  `empty_plan_ratio` is its iteration time over vanilla's; `transfer_seconds_per_iteration` is the
  time the planned run spent enqueueing copies (on CUDA) or copying (on the CPU device).
- Correctness: parameters, buffers and optimizer state after the last step compared bit for bit with
  the first vanilla run (deterministic algorithms on in every run; `vanilla_repeatable` says whether the
  two vanilla runs agree, without which a difference proves nothing).

Run: python benchmarks/real_training.py [--models vgg16,...] [--batch-size 16] [--steps 10]
     -> benchmarks/results/real_training_<device>.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from bench_results import results_dir
from hook_overhead import empty_plan, timed_step
from paper_tables import MODELS as PAPER_MODELS
from paper_tables import PAPER_TABLE_III
from tensile.allocator import reserved_peak
from tensile.cublas_workspaces import cublas_workspaces
from tensile.latency.calibrate import local_device, torch_device
from tensile.plan import PLAN_EVENTS
from tensile_hook import activate, deactivate
from tensile_hook.allocator_settings import allocator_settings
from tensile_hook.plan_book import Planner
from tensile_hook.plan_source import host_link_bandwidth, local_planner
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings
from tensile.workload import Workload
from tensile.zoo import build_zoo_parts

TARGET_EOR = 1.15
FORECAST_TARGET = 0.03  # forecast allocated and reserved peaks within 3% of measured
MIB = 1 << 20
FIRST_STEADY = 3  # iterations 0-1 recorded and matched, 2 aligned on the dispatch path
RESULTS = results_dir()


def run(model_name: str, batch_size: int, steps: int, device: torch.device, settings: HookSettings | None = None,
        planner: Planner | None = None) -> dict:
    """One training run (under the hook with `settings` and the in-process planner, or `planner`; else
    vanilla): per-iteration seconds and peaks, the final state, the hook's report."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    executor = None
    if settings is not None:
        executor = activate(settings, planner=planner or local_planner(settings, device), device=device)
    try:
        model, batch, loss_fn, make_optimizer = build_zoo_parts(model_name, batch_size, device=device.type)
        optimizer = make_optimizer(model.parameters())
        seconds, peaks, reserved = [], [], []
        for _ in range(steps):
            if device.type == "cuda":  # the allocator's figures change as ops are queued, not as they run
                torch.cuda.reset_peak_memory_stats(device)
            seconds.append(timed_step(model, batch, loss_fn, optimizer, device))
            peaks.append(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
            reserved.append(torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None)
        report: HookReport | None = executor.report if executor else None
        # what the planner planned against: the recorded iteration's op latencies, summed
        recorded = sum(op.latency for op in executor.live.ops) if executor and executor.live else None
        live = executor.live if executor else None
    finally:
        if executor is not None:
            deactivate()  # brings every tensor back before the state is read
    state = {f"model.{k}": v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    for j, per_param in enumerate(optimizer.state.values()):
        state.update({f"opt.{j}.{k}": v.to("cpu", copy=True) for k, v in per_param.items() if isinstance(v, torch.Tensor)})
    del model, batch, optimizer
    return {"seconds": seconds, "peaks": peaks, "reserved": reserved, "state": state, "report": report,
            "recorded_seconds": recorded, "live": live}


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def compare(model_name: str, batch_size: int, steps: int, device: torch.device, plan_events: str, link_share: float) -> dict:
    first = run(model_name, batch_size, steps, device)
    settings = HookSettings(job=model_name, plan_events=plan_events, link_share=link_share)
    tensile = run(model_name, batch_size, steps, device, settings)
    empty = run(model_name, batch_size, steps, device, settings, planner=empty_plan)  # the hook's own cost, no event
    second = run(model_name, batch_size, steps, device)
    report: HookReport = tensile["report"]
    planned = [it for it in report.iterations[FIRST_STEADY:steps] if it.mode == "planned"]
    vanilla_seconds = statistics.median(first["seconds"][FIRST_STEADY:] + second["seconds"][FIRST_STEADY:])
    tensile_seconds = statistics.median(tensile["seconds"][FIRST_STEADY:])
    if device.type == "cuda":
        vanilla_peak = max(first["peaks"][FIRST_STEADY:])
        tensile_peak = max(tensile["peaks"][FIRST_STEADY:])
        vanilla_reserved, tensile_reserved = max(first["reserved"]), max(tensile["reserved"])
    else:  # the hook's tracker of live storages is the CPU device's only peak: the vanilla one is its forecast
        vanilla_peak = report.vanilla_peak_bytes or 0
        tensile_peak = max((it.peak_bytes for it in planned), default=0)
        vanilla_reserved, tensile_reserved = vanilla_peak, tensile_peak  # no caching allocator on the CPU
    forecast = allocator_forecast(tensile["live"], device, report)
    row = {
        "model": model_name,
        "batch_size": batch_size,
        "plan_events": plan_events,
        "link_share": link_share,
        "vanilla_peak_bytes": vanilla_peak,
        "tensile_peak_bytes": tensile_peak,
        "scheduled_peak_bytes": report.scheduled_peak_bytes,
        "forecast_vanilla_peak_bytes": report.vanilla_peak_bytes,
        # what the process held (the caching allocator's segments) against the allocator model's forecast, and what
        # the allocator held beyond the recorded tensors at the recorded iteration (library workspaces, rounding)
        "vanilla_reserved_peak_bytes": vanilla_reserved,
        "tensile_reserved_peak_bytes": tensile_reserved,
        "forecast_vanilla_allocated_peak_bytes": forecast.allocated_peak_bytes,
        "forecast_vanilla_reserved_peak_bytes": forecast.reserved_peak_bytes,
        "forecast_cublas_workspace_bytes": forecast.cublas_workspace_bytes,
        "allocated_forecast_error": forecast.allocated_peak_bytes / vanilla_peak - 1 if vanilla_peak else None,
        "reserved_forecast_error": forecast.reserved_peak_bytes / vanilla_reserved - 1 if vanilla_reserved else None,
        "workspace_bytes": report.workspace_bytes,
        "msr": 1 - tensile_peak / vanilla_peak if vanilla_peak else None,
        "paper_msr": PAPER_TABLE_III[model_name]["tensile"][0] if model_name in PAPER_TABLE_III else None,
        "vanilla_seconds": vanilla_seconds,
        "tensile_seconds": tensile_seconds,
        "eor": tensile_seconds / vanilla_seconds,
        "empty_plan_ratio": statistics.median(empty["seconds"][FIRST_STEADY:]) / vanilla_seconds,
        # the recorded iteration's op latencies, summed, over vanilla's iteration: near 1 (at most, on a device the
        # host keeps fed) where the planner's latencies are kernels' times; above 1 where they time the host
        "recorded_over_vanilla": tensile["recorded_seconds"] / vanilla_seconds if tensile["recorded_seconds"] else None,
        "vanilla_seconds_per_run": [statistics.median(r["seconds"][FIRST_STEADY:]) for r in (first, second)],
        "planned_iterations": len(planned),
        "paths": sorted({it.path for it in planned}),
        "hook_seconds_per_iteration": statistics.median([it.hook_seconds for it in planned]) if planned else None,
        "stall_seconds_per_iteration": statistics.median([it.stall_seconds for it in planned]) if planned else None,
        "transfer_seconds_per_iteration": statistics.median([it.transfer_seconds for it in planned]) if planned else None,
        "swap_out_bytes_per_iteration": planned[-1].swap_out_bytes if planned else 0,
        "recompute_bytes_per_iteration": planned[-1].recompute_bytes if planned else 0,
        "events_per_iteration": planned[-1].events if planned else {},
        "bit_identical": identical(first["state"], tensile["state"]),
        "vanilla_repeatable": identical(first["state"], second["state"]),
        "iterations": {"vanilla_seconds": first["seconds"], "tensile_seconds": tensile["seconds"],
                       "vanilla_peaks": first["peaks"], "tensile_peaks": tensile["peaks"],
                       "tensile_modes": [f"{it.mode}/{it.path}" for it in report.iterations]},
        "messages": report.messages,
    }
    return row


@dataclass(frozen=True)
class AllocatorForecast:
    allocated_peak_bytes: int  # torch.cuda.max_memory_allocated, as the allocator model forecasts it
    reserved_peak_bytes: int  # torch.cuda.max_memory_reserved, likewise
    cublas_workspace_bytes: int


def allocator_forecast(live: Workload | None, device: torch.device, report: HookReport) -> AllocatorForecast:
    """The allocator model over the recorded iteration (tensile.allocator), at the allocator settings this process runs
    with and with the cuBLAS workspaces this GPU and environment give (tensile.cublas_workspaces). The CPU device has
    neither: its forecast is the tensors' peak."""
    if live is None or device.type != "cuda":
        peak = report.vanilla_peak_bytes or 0
        return AllocatorForecast(peak, peak, 0)
    expandable, size = allocator_settings(device.type, os.environ)  # what the hook tells its agent
    workspaces = cublas_workspaces(live, size or 0)
    peaks = reserved_peak(live, expandable_segments=expandable, workspaces=workspaces)
    return AllocatorForecast(peaks.allocated_peak_bytes, peaks.reserved_peak_bytes, sum(workspaces.values()))


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(PAPER_MODELS))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--plan-events", default="auto", choices=PLAN_EVENTS,
                        help="the hook's TENSILE_PLAN_EVENTS: auto keeps CUDA plans to what the native path carries")
    parser.add_argument("--link-share", type=float, default=1.0, help="the hook's TENSILE_LINK_SHARE")
    args = parser.parse_args()
    if args.steps <= FIRST_STEADY:
        parser.error(f"--steps must be more than {FIRST_STEADY}: the hook records and aligns first")
    device_type, device_key, device_name = local_device(args.device)
    device = torch_device(device_type)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    console = Console()
    rows = []
    suffix = ("" if args.plan_events == "auto" else f"_{args.plan_events}") + ("" if args.link_share == 1.0 else f"_link{args.link_share:g}")
    out = RESULTS / f"real_training_{device_key}{suffix}.json"
    for name in args.models.split(","):
        try:
            row = compare(name, args.batch_size, args.steps, device, args.plan_events, args.link_share)
        except Exception as exc:  # noqa: BLE001 - one model's failure is a row of its own, not the end of the run
            row = {"model": name, "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        console.print(json.dumps({k: v for k, v in row.items() if k not in ("iterations",)}, default=str))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"device": device_name, "torch": torch.__version__, "host": platform.node(),
                                   "host_link_bytes_per_second": host_link_bandwidth(device),
                                   "cpu_count": os.cpu_count(), "steps": args.steps,
                                   "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                                   "targets": {"msr": "at least the paper's Table III", "eor": TARGET_EOR,
                                               "forecast_error": FORECAST_TARGET},
                                   "rows": rows}, indent=2, default=str))
    table = Table(title=f"Real training on {device_name}, batch {args.batch_size}: vanilla against TENSILE")
    for column in ("model", "vanilla peak MB", "TENSILE peak MB", "MSR", "paper MSR", "EOR", "stall ms/iter", "recorded / vanilla",
                   "hook ms/iter", "bit-identical"):
        table.add_column(column, justify="right")
    for row in rows:
        if "error" in row:
            table.add_row(row["model"], row["error"][:60], *[""] * 8)
            continue
        table.add_row(row["model"], f"{row['vanilla_peak_bytes'] / 1e6:.0f}", f"{row['tensile_peak_bytes'] / 1e6:.0f}",
                      f"{row['msr']:.3f}" if row["msr"] is not None else "-", f"{row['paper_msr'] or float('nan'):.3f}",
                      f"{row['eor']:.3f}",
                      f"{row['stall_seconds_per_iteration'] * 1e3:.2f}" if row["stall_seconds_per_iteration"] is not None else "-",
                      f"{row['recorded_over_vanilla']:.2f}" if row["recorded_over_vanilla"] is not None else "-",
                      f"{row['hook_seconds_per_iteration'] * 1e3:.2f}" if row["hook_seconds_per_iteration"] is not None else "-",
                      f"{row['bit_identical']} (vanilla repeatable: {row['vanilla_repeatable']})")
    console.print(table)
    forecasts = Table(
        title=f"Forecast against measured on {device_name} (MiB; the target: within {FORECAST_TARGET:.0%})")
    for column in ("model", "allocated", "forecast", "error", "reserved", "forecast", "error", "cuBLAS workspaces",
                   "hook's workspace"):
        forecasts.add_column(column, justify="right")
    for row in rows:
        if "error" not in row:
            forecasts.add_row(
                row["model"], f"{row['vanilla_peak_bytes'] / MIB:,.1f}",
                f"{row['forecast_vanilla_allocated_peak_bytes'] / MIB:,.1f}", _error(row["allocated_forecast_error"]),
                f"{row['vanilla_reserved_peak_bytes'] / MIB:,.1f}",
                f"{row['forecast_vanilla_reserved_peak_bytes'] / MIB:,.1f}", _error(row["reserved_forecast_error"]),
                f"{row['forecast_cublas_workspace_bytes'] / MIB:,.1f}",
                "-" if row["workspace_bytes"] is None else f"{row['workspace_bytes'] / MIB:,.1f}")
    console.print(forecasts)
    console.print(f"written {out}")


if __name__ == "__main__":
    main()
