"""GPU memory peak analysis (TENSILE Algorithm 1) over a workload's memory changes.

Without a plan, memory is freed when PyTorch frees it (the tracer records that), so the vanilla
peak is what the caching allocator sees. A plan contributes further changes (releases, swaps,
recomputes) on the same axis; the sweep below is shared by both. Under a plan, memory is charged per
op: a tensor counts for an op unless it is off the device for the whole of that op.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tensile.plan import Event
from tensile.timeline import Slot, Timeline, build_slots, chain_latency, slot_of, transfer_seconds
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
    for tensor in workload.tensors.values():
        if tensor.freed_after is not None:
            changes.append(Change(tensor.freed_after + 0.5, FREE, tensor.id, tensor.freed_after))
    return changes


def effective_changes(workload: Workload, changes: Iterable[Change],
                      alive: set[int]) -> Iterator[tuple[Change, int | None]]:
    """The changes that move memory, in time order, with `alive` (tensor ids) kept up to date as they come.

    A change for a tensor already in the state it asks for moves nothing and is left out. Each change comes with the
    tensor whose memory it takes over, else None: an updated tensor (one that `reuses` another's memory) allocated
    while its predecessor is resident takes that memory over, so neither allocates nor frees anything; allocated
    while the predecessor is away (swapped out), it needs memory of its own."""
    tensors = workload.tensors
    for change in sorted(changes, key=lambda c: (c.time, c.kind)):
        if change.kind == ALLOC:
            if change.tensor in alive:
                continue
            alive.add(change.tensor)
            predecessor = tensors[change.tensor].reuses
            if predecessor is not None and predecessor in alive:
                alive.discard(predecessor)  # the hand-over: same memory, new name
                yield change, predecessor
            else:
                yield change, None
        elif change.tensor in alive:
            alive.discard(change.tensor)
            yield change, None


def sweep(
    workload: Workload,
    changes: Iterable[Change],
    initial: Iterable[int] | None = None,
    op_starts: list[float] | None = None,
) -> PeakResult:
    """Walk the changes in time order and keep the highest footprint (Algorithm 1, lines 2-34).

    `op_starts` places ops on the time axis (default: op k starts at time k)."""
    tensors = workload.tensors
    alive: set[int] = set(workload.resident if initial is None else initial)
    used = sum(tensors[t].size for t in alive)
    peak, peak_op, peak_time, peak_alive = used, -1, -1.0, set(alive)
    timeline: list[tuple[float, int]] = [(-1.0, used)]
    starts = op_starts if op_starts is not None else [float(k) for k in range(len(workload.ops))]
    op_memory = [0] * len(workload.ops)
    next_op = 0
    for change, taken_over in effective_changes(workload, changes, alive):
        while next_op < len(starts) and starts[next_op] < change.time:
            op_memory[next_op] = used
            next_op += 1
        if change.kind == FREE:
            used -= tensors[change.tensor].size
        elif taken_over is None:
            used += tensors[change.tensor].size
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


def plan_timeline(workload: Workload, events: Iterable[Event], slowdown: float = 1.0, slots: dict[int, Slot] | None = None) -> Timeline:
    """The iteration's op times once the plan's recomputations run on the compute stream.

    A recomputation fired after op k replays its tensor's chain (creator and in-place rewrites
    before op k + 1) between op k and op k + 1."""
    slots = slots if slots is not None else build_slots(workload)
    root_of = slot_of(slots)
    extra: dict[int, float] = {}
    for event in events:
        if event.kind == "recompute":
            chain = slots[root_of[event.tensor]].chain(event.trigger + 1)
            extra[event.trigger] = extra.get(event.trigger, 0.0) + chain_latency(workload, chain)
    return Timeline([op.latency for op in workload.ops], slowdown, extra)


def absent_ranges(
    events: Iterable[Event], bandwidth: float, timeline: Timeline, slots: dict[int, Slot]
) -> dict[int, list[tuple[int, int]]]:
    """Per slot root, the op ranges (folded into one iteration) the plan keeps it off the device.

    A release frees the tensor after its trigger op until a recompute before a later op brings it
    back (or for good: activity analysis). A swap-out frees it when its copy ends; the next swap-in
    of the slot, in cyclic order, brings it back when its copy starts. Ops count per whole op."""
    n = timeline.n
    root_of = slot_of(slots)
    per_slot: dict[int, list[Event]] = {}
    for event in events:
        per_slot.setdefault(root_of[event.tensor], []).append(event)
    result: dict[int, list[tuple[int, int]]] = {}
    for root, slot_events in per_slot.items():
        slot = slots[root]
        ranges: list[tuple[int, int]] = []
        releases = sorted(e.trigger for e in slot_events if e.kind == "release")
        recomputes = sorted(e.trigger for e in slot_events if e.kind == "recompute")
        for a in releases:
            later = [r for r in recomputes if r > a]
            ranges.append((a + 1, later[0] if later else slot.last))
        duration = transfer_seconds(slot.size, bandwidth)

        def at(e: Event) -> float:
            return timeline.end(e.trigger + (n if e.next_iteration else 0)) + e.delay

        outs = sorted(at(e) for e in slot_events if e.kind == "swap_out")
        ins = sorted(at(e) for e in slot_events if e.kind == "swap_in")
        for gone in outs:
            gone += duration
            later_ins = [t for t in ins if t >= gone] or [t + timeline.period for t in ins if t + timeline.period >= gone]
            if later_ins:
                k1, k2 = timeline.absent_ops(gone, later_ins[0])
            else:
                k1, k2 = timeline.first_op_from(gone), slot.last
            ranges.append((k1, k2))
        folded = []
        for lo, hi in ranges:
            hi = min(hi, 2 * n - 1)
            if lo > hi:
                continue
            if lo < n:
                folded.append((lo, min(hi, n - 1)))
            if hi >= n:
                folded.append((max(lo, n) - n, hi - n))
        result[root] = folded
    return result


def presence_pieces(slot: Slot, absent: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Maximal op runs within [slot.first, slot.last] where the slot is on the device."""
    gone = sorted(absent)
    pieces: list[tuple[int, int]] = []
    k = slot.first
    for lo, hi in gone:
        if hi < k:
            continue
        if lo > k:
            pieces.append((k, min(lo - 1, slot.last)))
        k = max(k, hi + 1)
        if k > slot.last:
            break
    if k <= slot.last:
        pieces.append((k, slot.last))
    return [p for p in pieces if p[0] <= p[1]]


def plan_changes(workload: Workload, slots: dict[int, Slot], absent: dict[int, list[tuple[int, int]]]) -> tuple[list[Change], list[int]]:
    """Memory changes (op-index axis, as vanilla_changes) and the initial residents under a plan."""
    n = len(workload.ops)
    changes: list[Change] = []
    initial: list[int] = []
    for root, slot in slots.items():
        resident = workload.tensors[root].created_by < 0
        end_freed = workload.tensors[slot.names[-1]].freed_after is not None
        for p1, p2 in presence_pieces(slot, absent.get(root, [])):
            if p1 == 0 and resident:
                initial.append(root)
            else:
                changes.append(Change(p1, ALLOC, slot.name_at(p1), p1))
            if slot.successor is not None and p1 < slot.handover <= p2:
                changes.append(Change(slot.handover, ALLOC, slot.successor, slot.handover))
            if p2 < n - 1 or end_freed:
                changes.append(Change(p2 + 0.5, FREE, slot.name_at(p2), p2))
    return changes, initial


def scheduled_changes(workload: Workload, events: Iterable[Event], bandwidth: float,
                      slowdown: float = 1.0) -> tuple[list[Change], list[int]]:
    """One iteration's memory changes under a plan and the tensors resident at its start: what Algorithm 1 and the
    allocator model (tensile.allocator) replay."""
    events = list(events)
    slots = build_slots(workload)
    timeline = plan_timeline(workload, events, slowdown, slots)
    return plan_changes(workload, slots, absent_ranges(events, bandwidth, timeline, slots))


def analyze_plan(workload: Workload, events: Iterable[Event], bandwidth: float, slowdown: float = 1.0) -> PeakResult:
    """Algorithm 1 over a plan: the scheduled peak a forecast states (replaying a plan reproduces it)."""
    changes, initial = scheduled_changes(workload, events, bandwidth, slowdown)
    return sweep(workload, changes, initial)
