"""GPU memory peak analysis (TENSILE Algorithm 1) over a workload's memory changes.

Without a plan, memory is freed when PyTorch frees it (the tracer records that), so the vanilla
peak is what the caching allocator sees. A plan contributes further changes (releases, swaps,
recomputes) on the same axis; the sweep below is shared by both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tensile.workload import ROLES, Workload

# Order of changes that share one instant: allocations first, so a peak is never missed.
ALLOC, FREE = 0, 1


@dataclass(frozen=True, slots=True)
class Change:
    """Memory of `tensor` appears (ALLOC) or goes (FREE) at `time`, during op `op`."""

    time: float
    kind: int
    tensor: int
    op: int


@dataclass(slots=True)
class PeakResult:
    peak_bytes: int
    peak_op: int  # index of the op during which the peak occurs (-1: at iteration start)
    peak_phase: str
    peak_time: float
    alive_at_peak: list[int]  # the MPT of the paper: tensors resident at the peak
    bytes_by_role: dict[str, int]
    timeline: list[tuple[float, int]]  # (time, bytes in use) after every change
    op_memory: list[int]  # highest bytes in use while each op runs


def vanilla_changes(workload: Workload) -> list[Change]:
    """Each op allocates its outputs when it runs; PyTorch frees a storage after the op it recorded."""
    changes: list[Change] = []
    for op in workload.ops:
        for t in op.outputs:
            changes.append(Change(op.index, ALLOC, t, op.index))
    for t in workload.tensors.values():
        if t.freed_after is not None:
            changes.append(Change(t.freed_after + 0.5, FREE, t.id, t.freed_after))
    return changes


def sweep(
    workload: Workload,
    changes: Iterable[Change],
    initial: Iterable[int] | None = None,
    op_starts: list[float] | None = None,
) -> PeakResult:
    """Walk the changes in time order and keep the highest footprint (Algorithm 1, lines 2-34).

    `op_starts` places ops on the time axis (default: op k starts at time k). An updated tensor
    (one that `reuses` another's memory) allocates nothing, and its predecessor frees nothing when
    it hands the memory over.
    """
    tensors = workload.tensors
    handed_over = set(workload.successor_of())
    alive: set[int] = set(workload.resident if initial is None else initial)
    used = sum(tensors[t].size for t in alive)
    peak, peak_op, peak_time, peak_alive = used, -1, -1.0, set(alive)
    timeline: list[tuple[float, int]] = [(-1.0, used)]
    starts = op_starts if op_starts is not None else [float(k) for k in range(len(workload.ops))]
    op_memory = [0] * len(workload.ops)
    next_op = 0
    for change in sorted(changes, key=lambda c: (c.time, c.kind)):
        while next_op < len(starts) and starts[next_op] < change.time:
            op_memory[next_op] = used
            next_op += 1
        tensor = tensors[change.tensor]
        if change.kind == ALLOC:
            if change.tensor in alive:
                continue
            alive.add(change.tensor)
            if tensor.reuses is None:
                used += tensor.size
        else:
            if change.tensor not in alive:
                continue
            alive.discard(change.tensor)
            if change.tensor not in handed_over:
                used -= tensor.size
        timeline.append((change.time, used))
        if used > peak:
            peak, peak_op, peak_time, peak_alive = used, change.op, change.time, set(alive)
    for k in range(next_op, len(starts)):
        op_memory[k] = used
    by_role = dict.fromkeys(ROLES, 0)
    for t in peak_alive:
        if tensors[t].reuses is None or tensors[t].reuses not in peak_alive:
            by_role[tensors[t].role] += tensors[t].size
    phase = workload.ops[peak_op].phase if peak_op >= 0 else "start"
    return PeakResult(peak, peak_op, phase, peak_time, sorted(peak_alive), by_role, timeline, op_memory)


def analyze_vanilla(workload: Workload) -> PeakResult:
    """The vanilla forecast: the peak of one iteration without any scheduling."""
    return sweep(workload, vanilla_changes(workload))
