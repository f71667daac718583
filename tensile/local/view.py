"""What the local runner shows: a live table of forecast and observed peaks, and a plot at the end."""

from __future__ import annotations

import textwrap
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tensile.local.runner import JobRun
from tensile.plots import pyplot, save_figure

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
    notes = [Text.assemble((f"{run.name}: ", "bold"), run.message) for run in runs if run.message]
    return Group(table, *notes)


def plot_peaks(runs: list[JobRun], path: str | Path, title: str) -> Path:
    """Grouped bars per job: forecast vanilla, forecast scheduled, observed peak and observed under plan (MiB)."""
    plt = pyplot()

    series = (("forecast vanilla", "vanilla_peak", "#bbbbbb"), ("forecast scheduled", "scheduled_peak", "#4c72b0"),
              ("observed", "observed_peak", "#dd8452"), ("observed under plan", "observed_planned_peak", "#55a868"))
    width = 0.8 / len(series)
    figure_width = max(4.0, 1.8 * len(runs) + 2)
    fig, ax = plt.subplots(figsize=(figure_width, 4))
    for i, (label, attr, color) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(runs))]
        ax.bar(xs, [(getattr(r, attr) or 0) / MIB for r in runs], width, label=label, color=color)
    for j, run in enumerate(runs):  # a job that failed before any figure: say so where its bars would be
        if not any(getattr(run, attr) for _, attr, _ in series):
            ax.text(j, 0, f"{run.phase}: no figures", ha="center", va="bottom", fontsize="small", color="#888888")
    highest = max(((getattr(r, attr) or 0) / MIB for r in runs for _, attr, _ in series), default=0.0)
    ax.set_ylim(0, highest * 1.15 or 1.0)  # from 0 even with no figure at all (it was centred on 0)
    ax.set_xticks(range(len(runs)), [r.name for r in runs])
    ax.set_ylabel("memory peak (MiB)")
    # the GPU and agent line is long: wrapped to the figure's width (at 60 characters a one-job chart cut it)
    ax.set_title(textwrap.fill(title, int(figure_width * 10)), fontsize="medium")
    ax.legend()
    return save_figure(fig, path)
