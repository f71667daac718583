"""PNG plots for the CLI: where a picture says more than a table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensile.peak import PeakResult
from tensile.workload import Workload

MIB = 1024**2
PHASE_COLOURS = {"forward": "#dbeafe", "backward": "#fde68a", "optimizer": "#d1fae5"}
# an iteration's mode in the hook's report (`IterationStats.mode`)
MODE_COLOURS = {"recording": "#888888", "planned": "#55a868", "guarded": "#dd8452", "diverged": "#c44e52",
                "stood_down": "#8172b3"}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), imported when a plot is asked for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# the paper's metrics as a reader meets them in a plot: expanded, with which way is better (docs/concepts.md)
METRIC_TITLES = {"msr": "MSR: memory saving ratio\n(higher is better)",
                 "eor": "EOR: extra overhead ratio\n(time with / without; lower is better)",
                 "cbr": "CBR: cost-benefit ratio\n(MSR / EOR; higher is better)"}


def save_figure(fig: Any, path: str | Path) -> Path:
    """A finished figure written as PNG (its folder made) and closed; legends placed outside the axes are kept in."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def legend_outside(ax: Any) -> None:
    """The legend right of the axes, where it never covers a curve."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def limit_line(ax: Any, nbytes: int | None, label: str, style: str = "--") -> None:
    """A horizontal line at a memory limit (the GPU's capacity, a budget), in MiB, labelled for the legend."""
    if nbytes:
        ax.axhline(nbytes / MIB, ls=style, color="#c44e52" if style == "-" else "black", lw=1.2, label=label)


def phase_spans(workload: Workload) -> list[tuple[str, int, int]]:
    """Runs of consecutive ops in one phase: (phase, first op, last op)."""
    spans: list[tuple[str, int, int]] = []
    for op in workload.ops:
        if spans and spans[-1][0] == op.phase:
            spans[-1] = (op.phase, spans[-1][1], op.index)
        else:
            spans.append((op.phase, op.index, op.index))
    return spans


def plot_timeline(workload: Workload, curves: dict[str, PeakResult], path: str | Path, title: str,
                  budget_bytes: int | None = None) -> Path:
    """Memory in use per op, one curve per analysis (vanilla, scheduled...), phases shaded, the budget planned for."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(11, 4.5))
    labelled: set[str] = set()
    for phase, first, last in phase_spans(workload):
        ax.axvspan(first, last + 1, color=PHASE_COLOURS[phase], alpha=0.6, lw=0, label=None if phase in labelled else phase)
        labelled.add(phase)
    for label, result in curves.items():
        ax.plot(range(len(result.op_memory)), [b / MIB for b in result.op_memory], lw=1.2, label=f"{label} (peak {result.peak_bytes / MIB:,.0f} MiB)")
        if result.peak_op >= 0:
            ax.plot([result.peak_op], [result.peak_bytes / MIB], "v", color="black", ms=6)
    limit_line(ax, budget_bytes, f"memory budget ({budget_bytes / MIB:,.0f} MiB)" if budget_bytes else "")
    ax.set_xlabel("op index in the iteration")
    ax.set_ylabel("device memory in use (MiB)")
    ax.set_title(title)
    ax.set_xlim(0, max(1, len(workload.ops)))
    ax.set_ylim(bottom=0)
    legend_outside(ax)
    return save_figure(fig, path)


def plot_iterations(report: dict, path: str | Path, title: str) -> Path:
    """A hooked run's iterations from its report: the peak measured in each (coloured by mode) against the forecast
    of the plan in force, the vanilla peak and the budget in force; below, each one's time, stalls and hook time."""
    plt = pyplot()

    iterations = report["iterations"]
    xs = [it["iteration"] for it in iterations]
    fig, (memory, seconds) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=(2, 1))
    memory.plot(xs, [it["peak_bytes"] / MIB for it in iterations], color="#4c72b0", lw=1, zorder=1)
    for mode, colour in MODE_COLOURS.items():
        shown = [(it["iteration"], it["peak_bytes"] / MIB) for it in iterations if it["mode"] == mode]
        if shown:
            memory.scatter(*zip(*shown), color=colour, s=18, zorder=2, label=f"measured, {mode}")
    for field, label, style in (("scheduled_peak_bytes", "plan's forecast (scheduled peak)", "-"),
                                ("memory_budget_bytes", "memory budget", "--")):
        values = [None if it.get(field) is None else it[field] / MIB for it in iterations]
        if any(v is not None for v in values):
            memory.step(xs, [float("nan") if v is None else v for v in values], where="mid", ls=style, color="black",
                        lw=1, label=label)
    if report.get("vanilla_peak_bytes"):
        memory.axhline(report["vanilla_peak_bytes"] / MIB, ls=":", color="#888888", label="vanilla peak")
    memory.set_ylabel("memory peak (MiB)")
    memory.set_ylim(bottom=0)
    legend_outside(memory)
    memory.set_title(title, fontsize="medium")
    for field, label in (("seconds", "iteration"), ("stall_seconds", "stalls"), ("hook_seconds", "inside the hook"),
                         ("recompute_seconds", "recomputing")):
        seconds.plot(xs, [it[field] * 1e3 for it in iterations], lw=1, marker=".", label=label)
    seconds.set_yscale("symlog", linthresh=0.01)  # log above 0.01 ms, linear to 0: most iterations stall for 0
    seconds.set_ylabel("ms per iteration (lower is better)")
    seconds.set_xlabel("iteration")
    legend_outside(seconds)
    return save_figure(fig, path)
