"""The complete TENSILE planner (Algorithm 3) over all jobs of one GPU at once.

Activity analysis first (release every tensor after its last access), then rounds: find each job's
memory peak, take the largest tensor on the device at a peak across all jobs (honouring each job's
max swapping rate) and swap it across the gap around that peak (Algorithm 2). When no swap can be
placed any more and the GPU's peak (the sum of the jobs' peaks, as the paper defines it) is still
above the memory available, recompute by MSPS. Each job's plan is a list of events plus the forecast
its replay through Algorithm 1 gives.

Rounds are incremental: a job's memory per op is one array that a swap lowers over the ops it
covers, so a round costs one array update and one argmax instead of a new sweep of every job.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from tensile.errors import TensileUserError
from tensile.peak import analyze_plan, analyze_vanilla
from tensile.plan import Event, Forecast, Plan
from tensile.recompute import Recompute, recompute_option
from tensile.swap_scheduling import Channel, Transfer, gap_at, place_swap
from tensile.timeline import Timeline, build_slots, slot_of, transfer_seconds
from tensile.workload import Workload

MIN_SWAP_BYTES = 1024**2  # smaller tensors are not worth a transfer and an event
MAX_ROUNDS = 100_000


@dataclass(slots=True)
class JobSpec:
    """One job of the GPU: its name, its workload (op latencies filled in) and its max swapping rate."""

    name: str
    workload: Workload
    max_swap_rate: float = 1.0  # share of all the GPU's swaps this job may hold (1.0: no limit)


@dataclass(slots=True)
class GpuPlan:
    """The planner's answer for one GPU."""

    plans: dict[str, Plan]
    vanilla_peak_bytes: int  # sum of the jobs' vanilla peaks
    scheduled_peak_bytes: int  # sum of the jobs' scheduled peaks
    budget_bytes: int | None
    fits: bool
    transfers: list[Transfer] = field(default_factory=list)
    rounds: int = 0
    seconds: float = 0.0

    @property
    def msr(self) -> float:
        if not self.vanilla_peak_bytes:
            return 0.0
        return (self.vanilla_peak_bytes - self.scheduled_peak_bytes) / self.vanilla_peak_bytes

    @property
    def message(self) -> str:
        """A sentence for users: fits, or cannot fit with the lowest reachable peak."""
        mib = 1024**2
        if self.budget_bytes is None:
            return f"lowest reachable peak {self.scheduled_peak_bytes / mib:,.1f} MiB"
        if self.fits:
            return f"fits: peak {self.scheduled_peak_bytes / mib:,.1f} MiB within the budget of {self.budget_bytes / mib:,.1f} MiB"
        return (
            f"cannot fit: the lowest reachable peak is {self.scheduled_peak_bytes / mib:,.1f} MiB, "
            f"above the budget of {self.budget_bytes / mib:,.1f} MiB, even with every legal swap and recomputation"
        )


class JobState:
    """One job during planning: its slots, its memory per op, and the events chosen so far."""

    def __init__(self, spec: JobSpec, slowdown: float, min_swap_bytes: int) -> None:
        workload = spec.workload
        self.spec = spec
        self.workload = workload
        self.n = len(workload.ops)
        self.timeline = Timeline([op.latency for op in workload.ops], slowdown)
        self.slots = build_slots(workload)
        self.root_of = slot_of(self.slots)
        self.writers: dict[int, list[int]] = {}
        for op in workload.ops:
            for t in op.writes:
                self.writers.setdefault(t, []).append(op.index)
        self.absent: dict[int, list[tuple[int, int]]] = {}
        self.pins: dict[int, list[int]] = {}
        self.arriving: dict[int, set[int]] = {}
        self.used_gaps: set[tuple[int, int]] = set()
        self.failed: set[tuple[int, int, int]] = set()
        self.events: list[Event] = []
        self.swaps = 0
        self.recompute_seconds = 0.0
        diff = np.zeros(self.n + 1, dtype=np.int64)
        for slot in self.slots.values():
            diff[slot.first] += slot.size
            diff[slot.last + 1] -= slot.size
        self.mem = np.cumsum(diff[:-1])
        self._activity_analysis()
        self.order = sorted(
            (s.root for s in self.slots.values() if s.size >= min_swap_bytes and s.accesses),
            key=lambda r: (-self.slots[r].size, r),
        )
        self._candidates: Iterator[tuple[int, tuple[int, int, int]]] | None = None
        self._pending: tuple[int, tuple[int, int, int]] | None = None

    def _activity_analysis(self) -> None:
        """Release every non-persistent tensor right after its last access (the paper's first step)."""
        for slot in self.slots.values():
            if slot.persistent or not slot.accesses:
                continue
            last_access = slot.accesses[-1]
            if last_access < slot.last:
                self.add_absent(slot.root, last_access + 1, slot.last)
                self.events.append(Event(self.spec.name, "release", slot.name_at(last_access), last_access))

    @property
    def peak(self) -> tuple[int, int]:
        """(peak bytes, peak op)."""
        p = int(self.mem.argmax())
        return int(self.mem[p]), p

    def present(self, root: int, k: int) -> bool:
        slot = self.slots[root]
        if not slot.first <= k <= slot.last:
            return False
        return not any(lo <= k <= hi for lo, hi in self.absent.get(root, ()))

    def usable(self, root: int, k: int) -> bool:
        """On the device with its data for op k (not still arriving by a swap-in)."""
        return self.present(root, k) and k not in self.arriving.get(root, ())

    def pinned(self, root: int, lo: int, hi: int) -> bool:
        return any(lo <= k <= hi for k in self.pins.get(root, ()))

    def add_absent(self, root: int, k1: int, k2: int) -> None:
        """The slot is off the device for unrolled ops k1..k2 (folded into one iteration)."""
        n = self.n
        k2 = min(k2, k1 + n - 1, 2 * n - 1)
        pieces = []
        if k1 < n:
            pieces.append((k1, min(k2, n - 1)))
        if k2 >= n:
            pieces.append((max(k1, n) - n, k2 - n))
        for lo, hi in pieces:
            if lo <= hi:
                self.mem[lo : hi + 1] -= self.slots[root].size
                self.absent.setdefault(root, []).append((lo, hi))
        self._candidates = None
        self._pending = None

    def next_swap_candidate(self) -> tuple[int, tuple[int, int, int]] | None:
        """The largest slot on the device at the peak with a free gap around it (cached until memory changes)."""
        if self._pending is None:
            if self._candidates is None:
                self._candidates = self._swap_candidates()
            self._pending = next(self._candidates, None)
        return self._pending

    def reject(self, root: int, gap: tuple[int, int, int]) -> None:
        self.failed.add((root, gap[0], gap[2]))
        self._pending = None

    def _swap_candidates(self) -> Iterator[tuple[int, tuple[int, int, int]]]:
        _, p = self.peak
        for root in self.order:
            if not self.present(root, p):
                continue
            slot = self.slots[root]
            cyclic = slot.persistent and self.workload.tensors[root].role != "input"
            gap = gap_at(slot, p, self.n, cyclic)
            if gap is None or (root, gap[0]) in self.used_gaps or (root, gap[0], gap[2]) in self.failed:
                continue
            yield root, gap

    def add_swap(self, root: int, gap: tuple[int, int, int], out: float, back: float, bandwidth: float) -> None:
        slot = self.slots[root]
        duration = transfer_seconds(slot.size, bandwidth)
        self.used_gaps.add((root, gap[0]))
        for kind, start in (("swap_out", out), ("swap_in", back)):
            trigger, delay, next_iteration = self.timeline.trigger_of(start)
            self.events.append(Event(self.spec.name, kind, slot.name_at(trigger), trigger, delay, next_iteration))
        k1, k2 = self.timeline.absent_ops(out + duration, back)
        self.add_absent(root, k1, k2)
        # ops that overlap the swap-in: the memory is there, the data is not yet
        lo, hi = k2 + 1, self.timeline.first_op_from(back + duration) - 1
        for k in range(lo, hi + 1):
            self.arriving.setdefault(root, set()).add(k % self.n)
        self.swaps += 1

    def best_recompute(self) -> Recompute | None:
        _, p = self.peak
        best: Recompute | None = None
        for root, slot in self.slots.items():
            if slot.recomputable_by is None or not self.present(root, p):
                continue
            option = recompute_option(self.workload, slot, p, self.usable, self.pinned, self.root_of, self.writers)
            if option is not None and (best is None or option.msps > best.msps):
                best = option
        return best

    def add_recompute(self, choice: Recompute) -> None:
        slot = self.slots[choice.slot]
        self.add_absent(choice.slot, choice.after + 1, choice.before - 1)
        self.events.append(Event(self.spec.name, "release", slot.name_at(choice.after), choice.after))
        self.events.append(Event(self.spec.name, "recompute", slot.name_at(choice.before - 1), choice.before - 1))
        for tensor in self.workload.ops[slot.recomputable_by].inputs:
            self.pins.setdefault(self.root_of[tensor], []).extend((choice.before - 1, choice.before))
        self.recompute_seconds += choice.seconds


def co_run_slowdown(jobs: int, overlap: float) -> float:
    """How much longer an op takes while `jobs` jobs compute on the GPU together.

    `overlap` in [0, 1]: 0 is pure time slicing (each job at 1/jobs of the speed), 1 is perfect
    overlap (no slowdown). Throughput of the GPU is 1 + overlap * (jobs - 1) single-job rates."""
    if jobs <= 1:
        return 1.0
    return jobs / (1.0 + overlap * (jobs - 1))


def plan_gpu(
    jobs: list[JobSpec],
    bandwidth: float,
    budget_bytes: int | None = None,
    capacity_bytes: int | None = None,
    slowdown: float = 1.0,
    min_swap_bytes: int = MIN_SWAP_BYTES,
    allow_recompute: bool = True,
    stop_after_rounds: int = 100,
    stop_gain: float = 0.0005,
) -> GpuPlan:
    """Plan all jobs of one GPU together.

    With `budget_bytes` the planner stops once the GPU's peak fits it (fewer events, less risk);
    without, it swaps as much as it can and recomputes only if the peak exceeds `capacity_bytes`
    (the paper's Free_GPU_Memory). `slowdown` stretches op latencies for co-running jobs. Past
    `stop_after_rounds` rounds, planning ends when three rounds in a row gained less than
    `stop_gain` of the peak (the paper's stopping rule)."""
    started = time.perf_counter()
    if not jobs:
        raise TensileUserError("no jobs to plan")
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise TensileUserError(f"job names must be unique: {', '.join(names)}")
    for job in jobs:
        if not 0.0 < job.max_swap_rate <= 1.0:
            raise TensileUserError(f"max swapping rate of job {job.name} must be in (0, 1], was {job.max_swap_rate}")
    states = [JobState(spec, slowdown, min_swap_bytes) for spec in jobs]
    target = budget_bytes
    d2h, h2d = Channel(), Channel()
    transfers: list[Transfer] = []
    history: list[int] = []
    rounds = 0

    def total_peak() -> int:
        return sum(s.peak[0] for s in states)

    while rounds < MAX_ROUNDS:  # Algorithm 2 rounds
        if target is not None and total_peak() <= target:
            break
        total_swaps = sum(s.swaps for s in states)
        options = []
        for state in states:
            if state.swaps >= state.spec.max_swap_rate * (total_swaps + 1):
                continue
            candidate = state.next_swap_candidate()
            if candidate is not None:
                options.append((state.slots[candidate[0]].size, state, candidate))
        if not options:
            break
        rounds += 1
        _, state, (root, gap) = max(options, key=lambda o: o[0])
        placed = place_swap(state.timeline, gap, state.slots[root].size, bandwidth, d2h, h2d)
        if placed is None:
            state.reject(root, gap)
            continue
        out, back = placed
        duration = transfer_seconds(state.slots[root].size, bandwidth)
        d2h.book(out, duration, state.timeline.period)
        h2d.book(back, duration, state.timeline.period)
        transfers.append(Transfer(state.spec.name, root, "d2h", out, out + duration))
        transfers.append(Transfer(state.spec.name, root, "h2d", back, back + duration))
        state.add_swap(root, gap, out, back, bandwidth)
        history.append(total_peak())
        if len(history) > max(stop_after_rounds, 3) and history[-4] - history[-1] < stop_gain * history[-4]:
            break

    limit = budget_bytes if budget_bytes is not None else capacity_bytes
    while allow_recompute and limit is not None and total_peak() > limit and rounds < MAX_ROUNDS:
        rounds += 1
        choices = [(c, s) for s in states if (c := s.best_recompute()) is not None]
        if not choices:
            break
        choice, state = max(choices, key=lambda cs: cs[0].msps)
        state.add_recompute(choice)

    plans: dict[str, Plan] = {}
    vanilla_total = scheduled_total = 0
    for state in states:
        workload = state.workload
        vanilla = analyze_vanilla(workload)
        scheduled = analyze_plan(workload, state.events, bandwidth, slowdown)
        forecast = Forecast(
            vanilla_peak_bytes=vanilla.peak_bytes,
            scheduled_peak_bytes=scheduled.peak_bytes,
            predicted_iteration_seconds=state.timeline.period,
            predicted_extra_seconds=state.recompute_seconds * slowdown,
        )
        events = sorted(state.events, key=lambda e: (e.next_iteration, e.trigger, e.delay, e.kind, e.tensor))
        plans[state.spec.name] = Plan(state.spec.name, 1, workload.signature, events, forecast)
        vanilla_total += vanilla.peak_bytes
        scheduled_total += scheduled.peak_bytes
    fits = limit is None or scheduled_total <= limit
    return GpuPlan(plans, vanilla_total, scheduled_total, limit, fits, transfers, rounds, time.perf_counter() - started)


def plan_job(workload: Workload, bandwidth: float, budget_bytes: int | None = None, name: str = "job", **options) -> GpuPlan:
    """One job alone on its GPU (what `tensile forecast` needs)."""
    return plan_gpu([JobSpec(name, workload)], bandwidth, budget_bytes, **options)


def resolve_budget(text: str, vanilla_peak_bytes: int) -> int:
    """A budget given as bytes ("12000000000", "12GiB", "800MB") or as a fraction of the vanilla peak ("0.6")."""
    value = text.strip()
    units = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "b": 1}
    lowered = value.lower()
    try:
        for unit, factor in units.items():
            if lowered.endswith(unit):
                return int(float(lowered[: -len(unit)]) * factor)
        number = float(lowered)
    except ValueError:
        raise TensileUserError(f"--memory-budget '{text}': give bytes (e.g. 12GiB) or a fraction of the vanilla peak (e.g. 0.6)") from None
    if 0 < number <= 1:
        return int(number * vanilla_peak_bytes)
    if number > 1:
        return int(number)
    raise TensileUserError(f"--memory-budget '{text}' must be positive")
