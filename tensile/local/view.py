"""What the local runner shows: a live table of forecast and observed peaks, what ran at once against what sharing by
declared memory would have run, and a plot at the end."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tensile.local.runner import JobRun
from tensile.plots import legend_outside, pyplot, save_figure

MIB = 2**20
PHASE_STYLE = {"Running": "green", "Succeeded": "bold green", "Failed": "bold red", "Queued": "yellow"}


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def job_view(runs: list[JobRun], title: str) -> Group:
    """The jobs' table, then each job's note on a line of its own: a note is a sentence (why a job waits,
    failed, or was admitted by its budget), which a table column at a terminal's 80 characters would cut
    into a few letters a line."""
    table = Table(title=title)
    table.caption = ("peaks in MiB: forecast vanilla and scheduled; observed by the hook in every iteration "
                     "(the first ones run unplanned) and under plan (compare with sched.)")
    # what the processes held, where it is more than their tensors (CUDA's caching allocator); the CPU device has no
    # caching allocator, so there it is the observed peak again, and an 80-column terminal has no room for a copy
    reserved = any(run.observed_reserved_peak not in (None, run.observed_peak) for run in runs)
    if reserved:
        table.caption += "; reserved: what the process held (the CUDA allocator's segments)"
    columns = ("job", "phase", "vanilla", "sched.", "observed", "under\nplan") + (("reserved",) if reserved else ())
    for column in (*columns, "iter", "stalls s"):
        table.add_column(column, justify="left" if column in ("job", "phase") else "right", no_wrap=True)
    for run in runs:
        style = PHASE_STYLE.get(run.phase, "")
        held = (_mib(run.observed_reserved_peak),) if reserved else ()
        table.add_row(run.name, f"[{style}]{run.phase}[/]" if style else run.phase, _mib(run.vanilla_peak),
                      _mib(run.scheduled_peak), _mib(run.observed_peak), _mib(run.observed_planned_peak), *held,
                      str(run.iterations), f"{run.stall_seconds:.3f}")
    notes = [Text.assemble((f"{run.name}: ", "bold"), "; ".join(said)) for run in runs if (said := _notes(run))]
    return Group(table, *notes)


def _notes(run: JobRun) -> list[str]:
    """What to say of a job under the table: its message, and the out-of-memory errors (its cap, a full device) the
    hook turned into evictions and retries, so that a job that met its limit and went on is seen to have."""
    said = [run.message] if run.message else []
    if run.out_of_memory_retries:
        count = run.out_of_memory_retries
        said.append(f"{count} out-of-memory error{'s' if count > 1 else ''} the hook evicted for and retried; the job "
                    "went on")
    return said


def declared_at_once(runs: list[JobRun], capacity: int, context: int) -> int:
    """The most of these jobs that fit on the GPU together if each reserved its vanilla peak (what sharing by declared
    memory needs, e.g. a fixed memory share per job): the smallest first, the fairest count for that policy."""
    needs = sorted((run.vanilla_peak or run.demand or 0) + context for run in runs if run.phase != "Failed")
    fitting, used = 0, 0
    for need in needs:
        if used + need > capacity:
            break
        used, fitting = used + need, fitting + 1
    return fitting


def sharing_summary(runs: list[JobRun], capacity: int, context: int, most_at_once: int) -> Text:
    """What Tensile ran at once against what sharing by declared memory (vanilla peaks) would have: the point of it."""
    ran = [run for run in runs if run.phase != "Failed" or run.iterations]
    scheduled = sum(run.demand or 0 for run in ran) + context * len(ran)
    vanilla = sum(run.vanilla_peak or run.demand or 0 for run in ran) + context * len(ran)
    return Text.assemble(
        ("Tensile ran ", ""), (f"{most_at_once} of {len(runs)} jobs at once", "bold green"),
        f" in {capacity / MIB:,.1f} MiB: their scheduled peaks need {scheduled / MIB:,.1f} MiB together. Sharing by "
        f"declared memory (each job reserving its vanilla peak, {vanilla / MIB:,.1f} MiB together) fits ",
        (f"{declared_at_once(runs, capacity, context)} at once", "bold yellow"), ".")


def plot_peaks(runs: list[JobRun], path: str | Path, title: str, capacity: int) -> Path:
    """Above, each job's iteration peaks over time, stacked, against the GPU's capacity and the jobs' vanilla peaks
    together (what they would hold without Tensile); below, grouped bars per job: forecast vanilla, forecast
    scheduled, observed peak and observed under plan (MiB)."""
    plt = pyplot()

    figure_width = max(8.0, 1.8 * len(runs) + 2)
    fig, (over_time, bars) = plt.subplots(2, 1, figsize=(figure_width, 8), height_ratios=(3, 2))
    _stacked_memory(over_time, runs, capacity)
    # the GPU line is long: wrapped to the figure's width
    over_time.set_title(textwrap.fill(title, int(figure_width * 10)), fontsize="medium")
    _peak_bars(bars, runs)
    return save_figure(fig, path)


def _stacked_memory(ax: Any, runs: list[JobRun], capacity: int) -> None:
    """Each job's iteration peaks (from its report) as a band over the time it ran, the bands stacked: the GPU's
    memory in use at most, by job; time 0 is when the first job started."""
    edges = sorted({t for run in runs for start, end, _ in run.iteration_spans for t in (start, end)})
    if not edges:
        ax.text(0.5, 0.5, "no iteration was reported", ha="center", va="center", transform=ax.transAxes)
        return
    opened = min((run.started for run in runs if run.started is not None), default=edges[0])
    times = [t - opened for t in edges]
    below = [0.0] * len(edges)
    for run in runs:
        if not run.iteration_spans:
            continue
        height = [_peak_at(run.iteration_spans, t) / MIB for t in edges]
        above = [b + h for b, h in zip(below, height)]
        ax.fill_between(times, below, above, step="post", alpha=0.8, lw=0, label=run.name)
        below = above
    ax.axhline(capacity / MIB, color="#c44e52", lw=1.5, label=f"GPU capacity for jobs ({capacity / MIB:,.1f} MiB)")
    vanilla = sum(run.vanilla_peak or 0 for run in runs if run.iteration_spans)
    if vanilla:
        ax.axhline(vanilla / MIB, color="black", ls="--", lw=1,
                   label=f"their vanilla peaks together ({vanilla / MIB:,.1f} MiB)")
    ax.set_ylim(0, max(capacity, vanilla, max(below) * MIB) / MIB * 1.1)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since the first job started")
    ax.set_ylabel("memory in use at most (MiB)")
    legend_outside(ax)


def _peak_at(spans: list[tuple[float, float, int]], t: float) -> int:
    return next((peak for start, end, peak in spans if start <= t < end), 0)


def _peak_bars(ax: Any, runs: list[JobRun]) -> None:
    series = (("forecast vanilla", "vanilla_peak", "#bbbbbb"), ("forecast scheduled", "scheduled_peak", "#4c72b0"),
              ("observed", "observed_peak", "#dd8452"), ("observed under plan", "observed_planned_peak", "#55a868"))
    width = 0.8 / len(series)
    for i, (label, attr, color) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(runs))]
        ax.bar(xs, [(getattr(r, attr) or 0) / MIB for r in runs], width, label=label, color=color)
    for j, run in enumerate(runs):  # a job that failed before any figure: say so where its bars would be
        if not any(getattr(run, attr) for _, attr, _ in series):
            ax.text(j, 0, f"{run.phase}: no figures", ha="center", va="bottom", fontsize="small", color="#888888")
    highest = max(((getattr(r, attr) or 0) / MIB for r in runs for _, attr, _ in series), default=0.0)
    ax.set_ylim(0, highest * 1.15 or 1.0)  # from 0 even with no figure at all
    ax.set_xticks(range(len(runs)), [r.name for r in runs])
    ax.set_ylabel("memory peak per job (MiB)")
    legend_outside(ax)
