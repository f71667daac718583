"""`tensile forecast`: trace a model's iteration (or load a saved one) and forecast its memory peak."""

from __future__ import annotations

import argparse
import json
import os
import time

from rich.console import Console
from rich.table import Table

from tensile.commands import CANNOT_FIT, PLAN_EXIT_STATUSES, output_file
from tensile.devices import PRESETS, device_preset
from tensile.console import print_note
from tensile.errors import TensileUserError
from tensile.trace_choices import DEFAULT_BATCH_SIZE, DEVICES, DTYPE_NAMES, OPTIMIZER_NAMES
from tensile.knobs import MEMORY_BUDGET, PLAN_EVENTS
from tensile.plan import PLAN_EVENTS as PLAN_EVENT_CHOICES
from tensile.workload import ROLES, Workload
from tensile.workload_io import load_workload, save_workload

MIB = 1024**2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("forecast", help="forecast a training job's memory peak", description=__doc__,
                                   epilog=PLAN_EXIT_STATUSES)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="zoo model name (resnet50, bert_base, ...) or FILE.py:FUNC")
    source.add_argument("--workload", help="a workload saved with --save")
    parser.add_argument("--batch-size", type=int, help=f"default {DEFAULT_BATCH_SIZE}")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_NAMES), default=None, help="default: adam (zoo) or the model's own make_optimizer")
    parser.add_argument("--foreach", choices=("auto", "on", "off"),
                        help="optimizer kernels, for a FILE.py:FUNC model's own optimizer too; "
                             "auto: what --device defaults to (foreach on cuda, per-parameter loops on cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="bfloat16/float16: autocast mixed precision (default float32)")
    parser.add_argument("--device", choices=DEVICES, help="the device the forecast is for (default cuda; a saved --workload keeps its own)")
    parser.add_argument("--micro-batches", type=int, help="gradient accumulation steps per optimizer step (default 1)")
    parser.add_argument("--live", action="store_true", help="trace a real CPU iteration instead of the meta device")
    parser.add_argument("--gpu", choices=sorted(PRESETS), help="device preset for latencies and PCIe (default: a6000 for cuda, cpu for cpu)")
    parser.add_argument(PLAN_EVENTS.option, choices=PLAN_EVENT_CHOICES, default="auto",
                        help=f"which events the plan may use, as the hook's {PLAN_EVENTS.variable}: auto keeps CUDA "
                             "plans to "
                             "native events (activation swaps, recomputes of convolutions and batch norms: what the hook carries without seeing every op), all events on the CPU")
    parser.add_argument(MEMORY_BUDGET.option, help="plan for this budget: bytes (12GiB) or a fraction of the vanilla "
                                                   "peak (0.6); default: the lowest peak")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="forecast reserved memory for PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (default: "
                             "the caching allocator's default segments)")
    parser.add_argument("--save-plan", metavar="PLAN.json", help="save the TENSILE plan (events: kind, tensor, trigger op, delay)")
    parser.add_argument("--save", metavar="WORKLOAD.json", help="save the traced workload (.gz compresses)")
    parser.add_argument("--plot", metavar="TIMELINE.png", help="write the memory timeline")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def _load(args: argparse.Namespace) -> Workload:
    from tensile.forecast import optimizer_for, trace_workload  # torch: once there is something to trace

    if args.workload:
        return load_workload(args.workload)
    optimizer = optimizer_for(args.model, args.optimizer)
    foreach = {"auto": None, "on": True, "off": False}[args.foreach or "auto"]
    return trace_workload(
        args.model, DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size, optimizer, args.dtype or "float32", args.device or "cuda",
        args.live, foreach, args.micro_batches or 1,
    )


def _table(summary: dict) -> Table:
    table = Table(title=f"Forecast: {summary['model']} batch {summary['batch_size']} on {summary['device']}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("vanilla peak", f"{summary['vanilla_peak_bytes'] / MIB:,.1f} MiB")
    for role in ROLES:
        table.add_row(f"  {role}", f"{summary['bytes_by_role'][role] / MIB:,.1f} MiB")
    table.add_row("peak at", f"op {summary['peak_op_index']} ({summary['peak_op']}, {summary['peak_phase']})")
    table.add_row("scheduled peak (TENSILE)", f"{summary['scheduled_peak_bytes'] / MIB:,.1f} MiB")
    table.add_row("allocated / reserved", _held(summary["allocated_peak_bytes"], summary["reserved_peak_bytes"]))
    table.add_row("  scheduled", _held(summary["scheduled_allocated_peak_bytes"],
                                       summary["scheduled_reserved_peak_bytes"]))
    if summary["cublas_workspace_bytes"]:
        table.add_row("  of which cuBLAS workspaces", f"{summary['cublas_workspace_bytes'] / MIB:,.1f} MiB")
    if summary["expandable_segments"]:
        table.add_row("reserved for", "expandable_segments:True")
    table.add_row("MSR / predicted EOR", f"{summary['msr']:.3f} / {summary['predicted_eor']:.3f}")
    kept = " (native events only: --plan-events)" if summary["activations_only"] else ""
    table.add_row("plan", f"{summary['plan_events']:,} events{kept}; {summary['plan_message']}")
    table.add_row("predicted iteration", f"{summary['predicted_iteration_seconds'] * 1e3:,.1f} ms ({summary['latency_source']} latencies)")
    table.add_row("ops", f"{summary['ops']:,}")
    table.add_row("FLOPs per iteration", f"{summary['flops'] / 1e9:,.1f} GFLOP")
    table.add_row("optimizer / dtype", f"{summary['optimizer']} / {summary['dtype']}")
    table.add_row("signature", summary["signature"])
    return table


def _held(allocated: int, reserved: int) -> str:
    """A peak as torch.cuda.max_memory_allocated would report it (the tensors, cuBLAS's workspaces, blocks handed out
    whole) and as the caching allocator reserves it (what a neighbour on the GPU feels)."""
    return f"{allocated / MIB:,.1f} MiB allocated, {reserved / MIB:,.1f} MiB reserved"


def _preset(args: argparse.Namespace, workload: Workload) -> str:
    return args.gpu or ("a6000" if workload.device == "cuda" else "cpu")


def _check(args: argparse.Namespace) -> float | None:
    """Bad options refused before tracing, and output folders made, so that nothing fails after the work; the
    memory budget read."""
    tracing = [option for option, value in (("--batch-size", args.batch_size), ("--optimizer", args.optimizer),
               ("--foreach", args.foreach), ("--dtype", args.dtype), ("--micro-batches", args.micro_batches),
               ("--live", args.live or None), ("--device", args.device)) if value is not None]
    if args.workload and tracing:
        raise TensileUserError(f"{', '.join(tracing)}: how to trace --model; a saved --workload keeps what it was traced "
                               "with (its batch size, optimizer, dtype and device): trace again with --model to change them")
    if args.micro_batches is not None and args.micro_batches < 1:
        raise TensileUserError(f"--micro-batches must be a positive integer (was {args.micro_batches}): "
                               "the gradient accumulation steps per optimizer step")
    budget = MEMORY_BUDGET.from_option(args.memory_budget) if args.memory_budget else None
    for path, option in ((args.save, "--save"), (args.save_plan, "--save-plan"), (args.plot, "--plot")):
        if path:
            output_file(path, option)
    return budget


def run(args: argparse.Namespace) -> int:
    from tensile.job_forecast import make_forecast  # numpy and the planner: not for --help
    from tensile.peak import analyze_plan

    budget = _check(args)
    console = Console(stderr=args.json)
    started = time.perf_counter()
    with console.status("tracing one training iteration..."):
        workload = _load(args)
    preset = _preset(args, workload)
    with console.status("planning swaps and recomputations..."):
        forecast = make_forecast(workload, preset, budget, args.plan_events,
                                 expandable_segments=args.expandable_segments, environ=os.environ)
    for note in forecast.notes:
        print_note(note)
    summary, plan = forecast.summary, forecast.plan
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
            workload, {"vanilla": forecast.vanilla, "TENSILE": scheduled}, args.plot,
            f"{workload.model} batch {workload.batch_size} on {preset}: memory per op",
            budget_bytes=summary["memory_budget_bytes"],
        )
    if args.json:
        print(json.dumps(summary))
    else:
        console.print(_table(summary))
        for path, what in ((args.save, "workload"), (args.save_plan, "plan"), (args.plot, "timeline plot")):
            if path:
                console.print(f"{what} written to {path}")
    return 0 if summary["fits"] else CANNOT_FIT
