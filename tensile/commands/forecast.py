"""`tensile forecast`: trace a model's iteration (or load a saved one) and forecast its memory peak."""

from __future__ import annotations

import argparse
import json
import time
import warnings

from rich.console import Console
from rich.table import Table

from tensile.commands import option_value, output_file
from tensile.devices import PRESETS, device_preset
from tensile.errors import TensileUserError
from tensile.forecast import DEFAULT_BATCH_SIZE, DEVICES, DTYPES, OPTIMIZERS, optimizer_for, trace_workload
from tensile.latency import QuickCalibrationWarning, UncalibratedWarning, assign_latencies, iteration_seconds
from tensile.peak import PeakResult, analyze_plan, analyze_vanilla
from tensile.plan import PLAN_EVENTS, Plan, native_plan_events
from tensile.planner import GpuPlan, plan_job
from tensile_hook.settings import budget_bytes, parse_budget
from tensile.workload import ROLES, Workload
from tensile.workload_io import load_workload, save_workload

MIB = 1024**2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("forecast", help="forecast a training job's memory peak", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="zoo model name (resnet50, bert_base, ...) or FILE.py:FUNC")
    source.add_argument("--workload", help="a workload saved with --save")
    parser.add_argument("--batch-size", type=int, help=f"default {DEFAULT_BATCH_SIZE}")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=None, help="default: adam (zoo) or the model's own make_optimizer")
    parser.add_argument("--foreach", choices=("auto", "on", "off"),
                        help="optimizer kernels, for a FILE.py:FUNC model's own optimizer too; "
                             "auto: what --device defaults to (foreach on cuda, per-parameter loops on cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="bfloat16/float16: autocast mixed precision (default float32)")
    parser.add_argument("--device", choices=DEVICES, help="the device the forecast is for (default cuda; a saved --workload keeps its own)")
    parser.add_argument("--micro-batches", type=int, help="gradient accumulation steps per optimizer step (default 1)")
    parser.add_argument("--live", action="store_true", help="trace a real CPU iteration instead of the meta device")
    parser.add_argument("--gpu", choices=sorted(PRESETS), help="device preset for latencies and PCIe (default: a6000 for cuda, cpu for cpu)")
    parser.add_argument("--plan-events", choices=PLAN_EVENTS, default="auto",
                        help="which events the plan may use, as the hook's TENSILE_PLAN_EVENTS: auto keeps CUDA plans to "
                             "native events (activation swaps, recomputes of convolutions and batch norms: what the hook carries without seeing every op), all events on the CPU")
    parser.add_argument("--memory-budget", help="plan for this budget: bytes (12GiB) or a fraction of the vanilla peak (0.6); default: the lowest peak")
    parser.add_argument("--save-plan", metavar="PLAN.json", help="save the TENSILE plan (events: kind, tensor, trigger op, delay)")
    parser.add_argument("--save", metavar="WORKLOAD.json", help="save the traced workload (.gz compresses)")
    parser.add_argument("--plot", metavar="TIMELINE.png", help="write the memory timeline")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def _load(args: argparse.Namespace) -> Workload:
    if args.workload:
        return load_workload(args.workload)
    optimizer = optimizer_for(args.model, args.optimizer)
    foreach = {"auto": None, "on": True, "off": False}[args.foreach or "auto"]
    return trace_workload(
        args.model, DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size, optimizer, args.dtype or "float32", args.device or "cuda",
        args.live, foreach, args.micro_batches or 1,
    )


def forecast_summary(workload: Workload, vanilla: PeakResult, latency_source: str, gpu_plan: GpuPlan, plan: Plan,
                     activations_only: bool = False) -> dict:
    """The forecast as one JSON-able object (the keys other tools rely on)."""
    peak_op = workload.ops[vanilla.peak_op] if vanilla.peak_op >= 0 else None
    assert plan.forecast is not None
    return {
        "model": workload.model,
        "batch_size": workload.batch_size,
        "device": workload.device,
        "optimizer": workload.meta.get("optimizer"),
        "dtype": workload.meta.get("dtype"),
        "signature": workload.signature,
        "ops": len(workload.ops),
        "tensors": len(workload.tensors),
        "flops": workload.total_flops,
        "vanilla_peak_bytes": vanilla.peak_bytes,
        "peak_op_index": vanilla.peak_op,
        "peak_op": peak_op.name if peak_op else None,
        "peak_phase": vanilla.peak_phase,
        "bytes_by_role": vanilla.bytes_by_role,
        "latency_source": latency_source,
        "predicted_iteration_seconds": iteration_seconds(workload),
        "scheduled_peak_bytes": plan.forecast.scheduled_peak_bytes,
        "msr": plan.forecast.msr,
        "predicted_eor": plan.forecast.predicted_eor,
        "memory_budget_bytes": gpu_plan.budget_bytes,
        "fits": gpu_plan.fits,
        "plan_message": gpu_plan.message,
        "plan_events": len(plan.events),
        "activations_only": activations_only,
        "plan_seconds": gpu_plan.seconds,
    }


def _table(summary: dict) -> Table:
    table = Table(title=f"Forecast: {summary['model']} batch {summary['batch_size']} on {summary['device']}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("vanilla peak", f"{summary['vanilla_peak_bytes'] / MIB:,.1f} MiB")
    for role in ROLES:
        table.add_row(f"  {role}", f"{summary['bytes_by_role'][role] / MIB:,.1f} MiB")
    table.add_row("peak at", f"op {summary['peak_op_index']} ({summary['peak_op']}, {summary['peak_phase']})")
    table.add_row("scheduled peak (TENSILE)", f"{summary['scheduled_peak_bytes'] / MIB:,.1f} MiB")
    table.add_row("MSR / predicted EOR", f"{summary['msr']:.3f} / {summary['predicted_eor']:.3f}")
    kept = " (native events only: --plan-events)" if summary["activations_only"] else ""
    table.add_row("plan", f"{summary['plan_events']:,} events{kept}; {summary['plan_message']}")
    table.add_row("predicted iteration", f"{summary['predicted_iteration_seconds'] * 1e3:,.1f} ms ({summary['latency_source']} latencies)")
    table.add_row("ops", f"{summary['ops']:,}")
    table.add_row("FLOPs per iteration", f"{summary['flops'] / 1e9:,.1f} GFLOP")
    table.add_row("optimizer / dtype", f"{summary['optimizer']} / {summary['dtype']}")
    table.add_row("signature", summary["signature"])
    return table


def _preset(args: argparse.Namespace, workload: Workload) -> str:
    return args.gpu or ("a6000" if workload.device == "cuda" else "cpu")


def make_forecast(workload: Workload, preset: str, memory_budget: str | None = None, plan_events: str = "auto",
                  recompute: bool = True, max_swap_rate: float = 1.0) -> tuple[dict, Plan, PeakResult]:
    """Latencies, vanilla peak analysis and the TENSILE plan for one traced workload, with the events
    the hook would plan with on the workload's device (and the job's max swapping rate: alone on its GPU,
    the strictest the agent's joint plan can hold it to)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UncalibratedWarning)
        warnings.simplefilter("always", QuickCalibrationWarning)
        latency_source = assign_latencies(workload, device=preset if workload.device == "cuda" else "cpu")
    for warning in caught:
        Console(stderr=True).print(f"[yellow]note:[/] {warning.message}", highlight=False)
    vanilla = analyze_vanilla(workload)
    budget = None
    if memory_budget:  # parsed as `tensile run` and the hook parse it: the three take the same budgets
        budget = budget_bytes(option_value(parse_budget, memory_budget, "--memory-budget"), vanilla.peak_bytes)
    activations_only = native_plan_events(plan_events, workload.device)
    gpu_plan = plan_job(workload, device_preset(preset).host_link_bandwidth, budget, activations_only=activations_only,
                        recompute=recompute, max_swap_rate=max_swap_rate)
    plan = gpu_plan.plans["job"]
    plan.memory_budget_bytes = budget  # a saved plan holds the hook to the budget it was made for (`tensile run --plan`)
    return forecast_summary(workload, vanilla, latency_source, gpu_plan, plan, activations_only), plan, vanilla


def _check(args: argparse.Namespace) -> None:
    """Bad options refused before tracing, and output folders made, so that nothing fails after the work."""
    tracing = [option for option, value in (("--batch-size", args.batch_size), ("--optimizer", args.optimizer),
               ("--foreach", args.foreach), ("--dtype", args.dtype), ("--micro-batches", args.micro_batches),
               ("--live", args.live or None), ("--device", args.device)) if value is not None]
    if args.workload and tracing:
        raise TensileUserError(f"{', '.join(tracing)}: how to trace --model; a saved --workload keeps what it was traced "
                               "with (its batch size, optimizer, dtype and device): trace again with --model to change them")
    if args.micro_batches is not None and args.micro_batches < 1:
        raise TensileUserError(f"--micro-batches must be a positive integer (was {args.micro_batches}): "
                               "the gradient accumulation steps per optimizer step")
    if args.memory_budget:
        option_value(parse_budget, args.memory_budget, "--memory-budget")
    for path, option in ((args.save, "--save"), (args.save_plan, "--save-plan"), (args.plot, "--plot")):
        if path:
            output_file(path, option)


def run(args: argparse.Namespace) -> int:
    _check(args)
    console = Console(stderr=args.json)
    started = time.perf_counter()
    with console.status("tracing one training iteration..."):
        workload = _load(args)
    preset = _preset(args, workload)
    with console.status("planning swaps and recomputations..."):
        summary, plan, vanilla = make_forecast(workload, preset, args.memory_budget, args.plan_events)
    summary["gpu"] = preset
    summary["seconds"] = round(time.perf_counter() - started, 3)
    if args.save:
        save_workload(workload, args.save)
    if args.save_plan:
        with open(args.save_plan, "w") as handle:
            json.dump(plan.to_dict(), handle, indent=1)
    if args.plot:
        from tensile.plots import plot_timeline

        scheduled = analyze_plan(workload, plan.events, device_preset(preset).host_link_bandwidth)
        plot_timeline(
            workload, {"vanilla": vanilla, "TENSILE": scheduled}, args.plot,
            f"{workload.model} batch {workload.batch_size} on {preset}: memory per op",
        )
    if args.json:
        print(json.dumps(summary))
    else:
        console.print(_table(summary))
        for path, what in ((args.save, "workload"), (args.save_plan, "plan"), (args.plot, "timeline plot")):
            if path:
                console.print(f"{what} written to {path}")
    return 0
