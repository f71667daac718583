"""`tensile simulate`: co-located training jobs on one simulated GPU under vanilla, vDNN, Capuchin and TENSILE."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tensile.commands import CANNOT_FIT, PLAN_EXIT_STATUSES
from tensile.compare import POLICIES, Comparison, compare
from tensile.devices import PRESETS, device_preset
from tensile.errors import TensileUserError
from tensile.latency import assign_latencies
from tensile.knobs import MAX_SWAP_RATE, MEMORY_BUDGET, KnobError, budget_bytes
from tensile.planner import JobToPlan
from tensile.trace_choices import is_user_model
from tensile.workload import Workload

MIB = 1024**2
GPU_TOTAL = "GPU total"  # the curve of the jobs' sum in the memory plots


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("simulate", help="simulate co-located jobs on one GPU under each policy", description=__doc__,
                                   epilog=PLAN_EXIT_STATUSES)
    parser.add_argument("--job", action="append", required=True, metavar="MODEL[:BATCH]", help="a job (repeat for more); batch defaults to 16")
    parser.add_argument("--gpu", default="a6000", choices=sorted(k for k in PRESETS if k != "cpu"))
    parser.add_argument("--policy", default=",".join(POLICIES), help=f"comma-separated, from {','.join(POLICIES)}")
    parser.add_argument(MAX_SWAP_RATE.option, action="append", default=[], metavar="J=R",
                        help="job name or 1-based index J may hold share R of the GPU's swaps")
    parser.add_argument(MEMORY_BUDGET.option,
                        help="plan TENSILE for this GPU budget: bytes (12GiB) or a fraction of the vanilla peak")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--iterations", type=int, default=3, help="iterations per job (the first is not measured)")
    parser.add_argument("--overlap", type=float, default=0.1, help="compute overlap of co-running jobs, 0 (time slicing) to 1")
    parser.add_argument("--plot", metavar="DIR", help="write memory timelines and metrics as PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.set_defaults(run=run)


def _parse_jobs(texts: list[str]) -> list[tuple[str, str, int]]:
    """(name, model, batch) per --job; repeated jobs get #2, #3..."""
    jobs = []
    counts: dict[str, int] = {}
    for text in texts:
        model, sep, batch = text.rpartition(":")
        if not sep or (is_user_model(text) and not is_user_model(model)):  # no batch, or FILE.py:FUNC alone
            model, batch = text, "16"
        if not (batch.isascii() and batch.isdigit()) or int(batch) < 1:
            raise TensileUserError(f"--job '{text}': the batch '{batch}' must be a positive integer (MODEL[:BATCH], e.g. resnet50:16)")
        base = f"{model}:{batch}"
        counts[base] = counts.get(base, 0) + 1
        jobs.append((base if counts[base] == 1 else f"{base}#{counts[base]}", model, int(batch)))
    return jobs


def _swap_rates(texts: list[str], names: list[str]) -> dict[str, float]:
    rates = {}
    for text in texts:
        key, sep, value = text.partition("=")
        try:  # the knob's own rule, as `tensile run` and the hook read a rate
            rate = MAX_SWAP_RATE.parse(value, MAX_SWAP_RATE.option) if sep else None
        except KnobError:
            rate = None
        if rate is None:
            raise TensileUserError(f"{MAX_SWAP_RATE.option} '{text}': expected J=R with R in (0, 1]")
        if key.isdigit() and 1 <= int(key) <= len(names):
            key = names[int(key) - 1]
        if key not in names:
            raise TensileUserError(f"{MAX_SWAP_RATE.option} '{text}': no job '{key}'; jobs are {', '.join(names)}")
        rates[key] = rate
    return rates


def _load(jobs: list[tuple[str, str, int]], gpu: str, optimizer: str, console: Console) -> tuple[dict[tuple[str, int], Workload], str]:
    from tensile.forecast import trace_workload  # torch: once there is something to trace, not for --help

    traced: dict[tuple[str, int], Workload] = {}
    source = ""
    for _, model, batch in jobs:
        if (model, batch) in traced:
            continue
        with console.status(f"tracing {model} batch {batch}..."):
            workload = trace_workload(model, batch, optimizer=optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            source = assign_latencies(workload, gpu)
        traced[(model, batch)] = workload
    return traced, source


def _tables(comparison: Comparison, gpu: str) -> list[Table]:
    tables = []
    for policy in dict.fromkeys(r["policy"] for r in comparison.rows):
        table = Table(title=f"{policy} on {gpu}")
        for column in ("job", "vanilla peak", "peak", "MSR", "EOR", "CBR"):
            table.add_column(column, justify="left" if column == "job" else "right")
        for row in (r for r in comparison.rows if r["policy"] == policy):
            table.add_row(
                "GPU (sum)" if row["job"] == "*" else row["job"],
                f"{row['vanilla_peak_bytes'] / MIB:,.0f} MiB",
                f"{row['peak_bytes'] / MIB:,.0f} MiB",
                f"{row['msr']:.3f}",
                f"{row['eor']:.3f}",
                f"{row['cbr']:.3f}",
                style="bold" if row["job"] == "*" else None,
            )
        tables.append(table)
    return tables


def _plot(comparison: Comparison, directory: str, capacity: int, budget: int | None) -> list[Path]:
    """Per policy, each job's memory and the GPU's total over time against what the jobs may use (`capacity`: the
    GPU's memory less a context per job) and the budget, on one scale for every policy; then the paper's metrics."""
    from tensile.plots import METRIC_TITLES, legend_outside, limit_line, pyplot, save_figure

    plt = pyplot()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    curves = {policy: _memory_curves(result.timeline) for policy, result in comparison.simulations.items()}
    highest = max([(budget or 0) / MIB] + [max(ys, default=0.0) for per_job in curves.values() for _, ys in per_job.values()])
    # the capacity where it is in reach of the curves; a GPU many times larger than the jobs is said in the title instead
    shown_capacity = capacity if capacity / MIB <= 2 * highest else None
    highest = max(highest, (shown_capacity or 0) / MIB)
    paths = []
    for policy, per_job in curves.items():
        fig, ax = plt.subplots(figsize=(11, 4.5))
        # each job's first iteration starts with all its tensors on the device (the plan's swaps across iterations
        # begin after it): the peaks in the table and the budget hold from the second on
        warm_up_ms = max(job.iteration_seconds[0] for job in comparison.simulations[policy].jobs.values()) * 1e3
        ax.axvspan(0, warm_up_ms, color="#eeeeee", zorder=0, label="first iterations: not measured (warm-up)")
        for job, (xs, ys) in per_job.items():
            ax.step(xs, ys, where="post", lw=2.0 if job == GPU_TOTAL else 1.0,
                    color="black" if job == GPU_TOTAL else None, label=job)
        limit_line(ax, shown_capacity, f"GPU memory for the jobs ({capacity / MIB:,.0f} MiB)", style="-")
        limit_line(ax, budget, f"memory budget ({(budget or 0) / MIB:,.0f} MiB)")
        ax.set_ylim(0, highest * 1.05)  # one scale for every policy: their plots compare at a glance
        ax.set_xlabel("time (ms)")
        ax.set_ylabel("device memory in use (MiB)")
        off_scale = "" if shown_capacity else f" (of {capacity / MIB:,.0f} MiB for the jobs)"
        ax.set_title(f"{policy}: memory per job and on the GPU{off_scale}")
        legend_outside(ax)
        paths.append(save_figure(fig, out / f"memory_{policy}.png"))
    totals = [r for r in comparison.rows if r["job"] == "*"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, metric in zip(axes, ("msr", "eor", "cbr")):
        ax.bar([r["policy"] for r in totals], [r[metric] for r in totals], color="#4b8bbe")
        ax.set_title(METRIC_TITLES[metric], fontsize="medium")
    paths.append(save_figure(fig, out / "metrics.png"))
    return paths



def _memory_curves(timeline: list[tuple[float, str, int]]) -> dict[str, tuple[list[float], list[float]]]:
    """(ms, MiB) steps per job from the simulator's timeline, and the GPU's total: the jobs' sum at each change."""
    curves: dict[str, tuple[list[float], list[float]]] = {}
    used: dict[str, int] = {}
    for t, job, nbytes in timeline:
        used[job] = nbytes
        for name, value in ((job, nbytes), (GPU_TOTAL, sum(used.values()))):
            xs, ys = curves.setdefault(name, ([], []))
            xs.append(t * 1e3)
            ys.append(value / MIB)
    return curves


def simulation_summary(comparison: Comparison, gpu: str, latencies: str, plots: list[Path]) -> dict:
    """What --json prints: the rows, and whether TENSILE's joint plan fits (what the text's last lines say; `fits`,
    `message` and `budget_bytes` are null when no policy planned, e.g. --policy vanilla,vdnn)."""
    plan = comparison.gpu_plan
    return {
        "gpu": gpu,
        "latencies": latencies,
        "rows": comparison.rows,
        "plan_seconds": comparison.plan_seconds,
        "fits": plan.fits if plan is not None else None,
        "message": plan.message if plan is not None else None,
        "budget_bytes": plan.budget_bytes if plan is not None else None,
        "scheduled_peak_bytes": plan.scheduled_peak_bytes if plan is not None else None,
        "plots": [str(path) for path in plots],
    }


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=args.json)
    policies = tuple(p.strip() for p in args.policy.split(",") if p.strip())
    if args.iterations < 2:
        raise TensileUserError("--iterations must be at least 2 (the first iteration is not measured)")
    if not 0.0 <= args.overlap <= 1.0:
        raise TensileUserError("--overlap must be between 0 and 1")
    device = device_preset(args.gpu)
    jobs = _parse_jobs(args.job)
    names = [name for name, _, _ in jobs]
    rates = _swap_rates(args.max_swap_rate, names)
    budget_value = MEMORY_BUDGET.from_option(args.memory_budget) if args.memory_budget else None
    traced, source = _load(jobs, args.gpu, args.optimizer, console)
    specs = [JobToPlan(name, traced[(model, batch)], rates.get(name, 1.0)) for name, model, batch in jobs]
    budget = None
    if budget_value is not None:  # as `tensile forecast` and `tensile run` take budgets
        from tensile.peak import analyze_vanilla

        budget = budget_bytes(budget_value, sum(analyze_vanilla(s.workload).peak_bytes for s in specs))
    with console.status("simulating...") as status:
        comparison = compare(specs, device, policies, args.overlap, args.iterations, budget, progress=lambda text: status.update(text + "..."))
    plots = _plot(comparison, args.plot, device.memory_bytes - len(specs) * device.context_bytes, budget) if args.plot else []
    fits = comparison.gpu_plan is None or comparison.gpu_plan.fits
    if args.json:
        print(json.dumps(simulation_summary(comparison, args.gpu, source, plots)))
        return 0 if fits else CANNOT_FIT
    for table in _tables(comparison, device.name):
        console.print(table)
    if comparison.gpu_plan is not None:
        console.print(f"TENSILE planned in {comparison.plan_seconds:.3f} s: {comparison.gpu_plan.message}")
    console.print(f"op latencies: {source}")
    for path in plots:
        console.print(f"plot written to {path}")
    return 0 if fits else CANNOT_FIT
