"""PNG plots for the CLI: where a picture says more than a table."""

from __future__ import annotations

from pathlib import Path

from tensile.peak import PeakResult
from tensile.workload import Workload

MIB = 1024**2
PHASE_COLOURS = {"forward": "#dbeafe", "backward": "#fde68a", "optimizer": "#d1fae5"}


def phase_spans(workload: Workload) -> list[tuple[str, int, int]]:
    """Runs of consecutive ops in one phase: (phase, first op, last op)."""
    spans: list[tuple[str, int, int]] = []
    for op in workload.ops:
        if spans and spans[-1][0] == op.phase:
            spans[-1] = (op.phase, spans[-1][1], op.index)
        else:
            spans.append((op.phase, op.index, op.index))
    return spans


def plot_timeline(workload: Workload, curves: dict[str, PeakResult], path: str | Path, title: str) -> Path:
    """Memory in use per op, one curve per analysis (vanilla, scheduled...), phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    labelled: set[str] = set()
    for phase, first, last in phase_spans(workload):
        ax.axvspan(first, last + 1, color=PHASE_COLOURS[phase], alpha=0.6, lw=0, label=None if phase in labelled else phase)
        labelled.add(phase)
    for label, result in curves.items():
        ax.plot(range(len(result.op_memory)), [b / MIB for b in result.op_memory], lw=1.2, label=f"{label} (peak {result.peak_bytes / MIB:,.0f} MiB)")
        if result.peak_op >= 0:
            ax.plot([result.peak_op], [result.peak_bytes / MIB], "v", color="black", ms=6)
    ax.set_xlabel("op index in the iteration")
    ax.set_ylabel("device memory in use (MiB)")
    ax.set_title(title)
    ax.set_xlim(0, max(1, len(workload.ops)))
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
