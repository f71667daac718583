"""What a release + recompute costs the hook, on each path, measured side by side in one run.

ResNet-50 (batch from --batch-size, 4 by default) trains under three plans from the hook's in-process planner, with
the host link counted at a share so small that no swap pays (`TENSILE_LINK_SHARE`): every event is a release and
its recompute.

1. an empty plan: the native path's own cost with nothing to carry (the baseline);
2. native events only (`TENSILE_PLAN_EVENTS=native`): convolutions' and batch norms' outputs released after their
   last forward read, their recipes bound to the inputs autograd saved (`native_recipes.py`), replayed before
   backward reads them, on the native path;
3. every event kind (`all`): the planner also recomputes other ops' outputs, which only the dispatch path carries.

Per row, the medians of the steady iterations (the native ones where the plan reaches that path): `hook_seconds`
(the hook's own logic), `recompute_seconds` (the replays: the forward's ops run again, outside `hook_seconds`),
events and bytes recomputed, and the plan's own forecast of the extra time (`predicted_extra_seconds`, from the
recorded iteration's op latencies). Per event: the hook's logic above the empty plan's, and the replay.

Run: .venv/bin/python benchmarks/recompute_cost.py [--batch-size N] [--steps N] [--device cuda]
  -> benchmarks/results/recompute_cost.json (CPU), recompute_cost_<gpu>.json (CUDA)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
from rich.console import Console
from rich.table import Table

from bench_results import results_dir
from hook_overhead import empty_plan, timed_iterations
from tensile.latency.calibrate import local_device, torch_device
from tensile.latency.measure import HostLoad
from tensile.plan import Plan
from tensile_hook.plan_book import Planner
from tensile_hook.plan_source import local_planner
from tensile_hook.settings import HookSettings
from tensile.workload import Workload
from tensile.zoo import build_zoo_parts

RESULTS = results_dir() / "recompute_cost.json"
NO_LINK = 1e-9  # a share of the host link at which no swap hides behind compute: the planner recomputes instead


def recomputing(plan_events: str, device: torch.device, forecasts: list[Plan]) -> Planner:
    """The in-process planner with (almost) no host link, keeping each plan it makes for its forecast."""
    planner = local_planner(HookSettings(job="bench", plan_events=plan_events, link_share=NO_LINK), device)

    def plan(workload: Workload, budget: int | None) -> Plan | None:
        made = planner(workload, budget)
        if made is not None:
            forecasts.append(made)
        return made

    return plan


def measure(label: str, planner: Planner, forecasts: list[Plan], batch_size: int, steps: int, device: torch.device) -> dict:
    report = timed_iterations(build_zoo_parts("resnet50", batch_size, device=device.type), steps, planner=planner,
                              device=device).report
    planned = [it for it in report.iterations if it.mode == "planned"]
    steady = [it for it in planned if it.path == "native"] or planned

    def median(field: str) -> float | None:
        return statistics.median(getattr(it, field) for it in steady) if steady else None

    last = steady[-1] if steady else None
    forecast = forecasts[-1].forecast if forecasts and forecasts[-1].forecast is not None else None
    return {
        "case": label,
        "paths": sorted({it.path for it in planned}),
        "steady_path": steady[-1].path if steady else None,
        "steady_iterations": len(steady),
        "seconds": median("seconds"),
        "hook_seconds": median("hook_seconds"),
        "recompute_seconds": median("recompute_seconds"),
        "transfer_seconds": median("transfer_seconds"),
        "stall_seconds": median("stall_seconds"),
        "ops": median("ops"),
        "hook_seconds_per_op": statistics.median(per_op) if (per_op := [it.hook_seconds / it.ops for it in steady if it.ops]) else None,
        "events_per_iteration": last.events if last else None,
        "recompute_bytes_per_iteration": last.recompute_bytes if last else None,
        "predicted_extra_seconds": forecast.predicted_extra_seconds if forecast else None,
        "vanilla_peak_bytes": report.vanilla_peak_bytes,
        "scheduled_peak_bytes": report.scheduled_peak_bytes,
        "messages": report.messages,
    }


def per_event(row: dict, baseline: dict) -> None:
    """The row's cost per recompute: the replay, and where both ran natively the hook's logic above the baseline's (on
    the dispatch path the hook's time is mostly its cost per op, which every op pays: `hook_seconds_per_op`)."""
    recomputes = (row["events_per_iteration"] or {}).get("recompute", 0)
    if not recomputes:
        return
    row["replay_seconds_per_recompute"] = row["recompute_seconds"] / recomputes
    if row["steady_path"] == baseline["steady_path"] == "native":
        row["hook_seconds_per_recompute"] = (row["hook_seconds"] - baseline["hook_seconds"]) / recomputes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="iterations per plan (0-1 recorded, 2 aligns, then native)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    device_type, device_key, device_name = local_device(args.device)
    device = torch_device(device_type)
    console = Console(width=160)
    host_load = HostLoad()
    baseline = measure("empty plan", empty_plan, [], args.batch_size, args.steps, device)
    rows = [baseline]
    for label, events in (("native recomputes", "native"), ("recomputes of every kind", "all")):
        forecasts: list[Plan] = []
        row = measure(label, recomputing(events, device, forecasts), forecasts, args.batch_size, args.steps, device)
        per_event(row, baseline)
        rows.append(row)
    table = Table(title=f"Release + recompute, ResNet-50 batch {args.batch_size} ({device_name}): medians per iteration")
    for column in ("plan", "path", "iteration ms", "hook ms", "replays ms", "forecast extra ms", "recomputes",
                   "hook µs / recompute", "replay µs / recompute", "hook µs / op"):
        table.add_column(column, justify="right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.2f}"

    def us(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e6:.0f}"

    for row in rows:
        table.add_row(row["case"], row["steady_path"] or "-", ms(row["seconds"]), ms(row["hook_seconds"]),
                      ms(row["recompute_seconds"]), ms(row["predicted_extra_seconds"]),
                      str((row["events_per_iteration"] or {}).get("recompute", 0)),
                      us(row.get("hook_seconds_per_recompute")), us(row.get("replay_seconds_per_recompute")),
                      us(row["hook_seconds_per_op"]))
    console.print(table)
    load = host_load.around()
    console.print(HostLoad.said(load))
    out = RESULTS if device_type == "cpu" else RESULTS.with_name(f"recompute_cost_{device_key}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device_name, "device_key": device_key, "machine": platform.machine(),
                               "torch": torch.__version__, "batch_size": args.batch_size, "load_average_1min": load,
                               "rows": rows}, indent=2))
    console.print(f"written {out}")


if __name__ == "__main__":
    main()
