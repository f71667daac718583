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
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from tensile.errors import TensileUserError
from tensile.peak import analyze_plan, analyze_vanilla
from tensile.plan import Event, Forecast, Plan, memory_saving_rate
from tensile.recompute import Recompute, chain_inputs, msps, natively_replayable, recompute_option
from tensile.swap_scheduling import Channel, Transfer, gap_at, place_swap
from tensile.timeline import Timeline, build_slots, slot_of, transfer_seconds
from tensile.workload import Workload

EPS = 1e-12
MIN_SWAP_BYTES = 1024**2  # smaller tensors are not worth a transfer and an event
MAX_ROUNDS = 100_000


@dataclass(slots=True)
class JobToPlan:
    """One job of the GPU: its name, its workload (op latencies filled in), its max swapping rate,
    whether it may recompute (a user who wants no replayed ops turns it off for their job alone) and
    its own memory budget (what it was admitted with: its plan must keep it, whatever room its
    neighbours leave on the GPU)."""

    name: str
    workload: Workload
    max_swap_rate: float = 1.0  # share of all the GPU's swaps this job may hold (1.0: no limit)
    recompute: bool = True
    budget_bytes: int | None = None
    # swap only tensors made within the iteration (parameters, optimizer state and the batch stay) and recompute
    # only what a convolution or a batch norm made, released in the forward: the plans the hook's native path
    # carries without seeing every op (`natively_replayable`)
    activations_only: bool = False


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
    limits: tuple[str, ...] = ()  # what the jobs' plans were kept to (`plan_limits`): "cannot fit" says so

    @property
    def msr(self) -> float:
        return memory_saving_rate(self.vanilla_peak_bytes, self.scheduled_peak_bytes)

    def forecast_of(self, job: str) -> Forecast:
        """The forecast of `job`'s plan (the planner gives every plan it makes one)."""
        forecast = self.plans[job].forecast
        assert forecast is not None, f"plan of {job} has no forecast"
        return forecast

    @property
    def message(self) -> str:
        """A sentence for users: fits, or cannot fit with the lowest reachable peak."""
        mib = 1024**2
        if self.budget_bytes is None:
            return f"lowest reachable peak {self.scheduled_peak_bytes / mib:,.1f} MiB"
        if self.fits:
            return f"fits: peak {self.scheduled_peak_bytes / mib:,.1f} MiB within the budget of {self.budget_bytes / mib:,.1f} MiB"
        events = (f"every swap and recomputation its plans may use ({', '.join(self.limits)})" if self.limits
                  else "every legal swap and recomputation")
        return (
            f"cannot fit: the lowest reachable peak is {self.scheduled_peak_bytes / mib:,.1f} MiB, "
            f"above the budget of {self.budget_bytes / mib:,.1f} MiB, even with {events}"
        )


class JobState:
    """One job during planning: its slots, its memory per op, and the events chosen so far."""

    def __init__(self, job: JobToPlan, slowdown: float, min_swap_bytes: int) -> None:
        workload = job.workload
        self.job = job
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
        self.outs: dict[int, list[tuple[float, float]]] = {}  # root -> its swap-out copies (base timeline)
        self.cuts: list[float] = []  # where recomputations are inserted (base timeline)
        self.extra_after: dict[int, float] = {}  # op -> recomputation seconds (unscaled) run after it
        self.slowdown = slowdown
        self.swaps = 0
        self.recompute_seconds = 0.0
        diff = np.zeros(self.n + 1, dtype=np.int64)
        for slot in self.slots.values():
            diff[slot.first] += slot.size
            diff[slot.last + 1] -= slot.size
        self.mem = np.cumsum(diff[:-1])
        self._peak: tuple[int, int] | None = None  # (bytes, op) of mem; add_absent, its only writer, clears it
        self._activity_analysis()
        self.order = sorted(
            (s.root for s in self.slots.values() if s.size >= min_swap_bytes and s.accesses),
            key=lambda r: (-self.slots[r].size, r),
        )
        self._candidates: Iterator[tuple[int, tuple[int, int, int]]] | None = None
        self._pending: tuple[int, tuple[int, int, int]] | None = None
        self.recompute_order = sorted(
            (
                (msps(s.size, workload.ops[s.recomputable_by].latency), s.root)
                for s in self.slots.values()
                if s.recomputable_by is not None and not s.persistent and s.size >= min_swap_bytes
            ),
            reverse=True,
        )
        self._best: Recompute | None | Literal[False] = False  # False: not searched since memory last changed

    def _activity_analysis(self) -> None:
        """Release every non-persistent tensor right after its last access (the paper's first step). Not for a
        job whose hook keeps to its native path: that path leaves every release to PyTorch, whose own frees the
        vanilla lifetimes already hold (a foreach optimizer's gradients live until the next zero_grad, not to
        their last read: counted as released there, VGG-16's CUDA forecast at batch 1 was 2,168.9 MiB, its peak
        without those releases the vanilla 2,639.5 MiB; by analysis, not measured on a GPU)."""
        if self.job.activations_only:
            return
        for slot in self.slots.values():
            if slot.persistent or not slot.accesses:
                continue
            last_access = slot.accesses[-1]
            if last_access < slot.last:
                self.add_absent(slot.root, last_access + 1, slot.last)
                self.events.append(Event(self.job.name, "release", slot.name_at(last_access), last_access))

    @property
    def peak(self) -> tuple[int, int]:
        """(peak bytes, peak op): read several times a round (the GPU's total, the candidates, a swap's
        gain), computed once per change of memory."""
        if self._peak is None:
            p = int(self.mem.argmax())
            self._peak = int(self.mem[p]), p
        return self._peak

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

    def first_pin(self, root: int, lo: int, hi: int) -> int | None:
        """The first op in lo..hi where a planned replay reads the slot, or None."""
        return min((k for k in self.pins.get(root, ()) if lo <= k <= hi), default=None)

    def add_absent(self, root: int, k1: int, k2: int) -> None:
        """The slot is off the device for unrolled ops k1..k2 (folded into one iteration)."""
        n = self.n
        k2 = min(k2, k1 + n - 1, 2 * n - 1)
        pieces = []
        if k1 < n:
            pieces.append((k1, min(k2, n - 1)))
        if k2 >= n:
            pieces.append((max(k1, n) - n, k2 - n))
        ranges = self.absent.setdefault(root, [])
        for lo, hi in pieces:
            for a, b in _uncovered(lo, hi, ranges):  # a range may overlap one planned before: charge once
                self.mem[a : b + 1] -= self.slots[root].size
            if lo <= hi:
                ranges.append((lo, hi))
        self._candidates = None
        self._pending = None
        self._best = False
        self._peak = None

    def next_swap_candidate(self) -> tuple[int, tuple[int, int, int]] | None:
        """The largest slot on the device at the peak with a free gap around it (cached until memory changes)."""
        if self._pending is None:
            if self._candidates is None:
                self._candidates = self._swap_candidates()
            self._pending = next(self._candidates, None)
        return self._pending

    def crosses_step(self, root: int, gap: tuple[int, int, int]) -> bool:
        """An updated parameter or optimizer state swapped out in the optimizer phase and back in the
        next iteration (the paper's cross-iteration swap)."""
        return gap[1] >= self.n and self.workload.tensors[root].role in ("param", "optimizer_state")

    def reject(self, root: int, gap: tuple[int, int, int]) -> None:
        self.failed.add((root, gap[0], gap[2]))
        self._pending = None

    def _swap_candidates(self) -> Iterator[tuple[int, tuple[int, int, int]]]:
        _, p = self.peak
        for root in self.order:
            if not self.present(root, p):
                continue
            slot = self.slots[root]
            if slot.persistent and self.job.activations_only:
                continue
            cyclic = slot.persistent and self.workload.tensors[root].role != "input"
            gap = gap_at(slot, p, self.n, cyclic)
            if gap is None or (root, gap[0]) in self.used_gaps or (root, gap[0], gap[2]) in self.failed:
                continue
            if self.job.activations_only and self.workload.ops[gap[0]].phase != "forward":
                continue  # the native path swaps out at module calls, after a forward use: not a gradient's
            if self._pinned_in_gap(root, gap):  # a planned replay reads it there: it must stay
                continue
            yield root, gap

    def _pinned_in_gap(self, root: int, gap: tuple[int, int, int]) -> bool:
        before, after, _ = gap
        n = self.n
        if after < n:
            return self.pinned(root, before + 1, after - 1)
        return self.pinned(root, before + 1, n - 1) or self.pinned(root, 0, after - n - 1)

    def add_swap(self, root: int, gap: tuple[int, int, int], out: float, back: float, bandwidth: float) -> None:
        slot = self.slots[root]
        duration = transfer_seconds(slot.size, bandwidth)
        self.used_gaps.add((root, gap[0]))
        for kind, start in (("swap_out", out), ("swap_in", back)):
            trigger, delay, next_iteration = self.timeline.trigger_of(start)
            self.events.append(Event(self.job.name, kind, slot.name_at(trigger), trigger, delay, next_iteration))
        k1, k2 = self.timeline.absent_ops(out + duration, back)
        self.add_absent(root, k1, k2)
        # ops that overlap the swap-in: the memory is there, the data is not yet
        lo, hi = k2 + 1, self.timeline.first_op_from(back + duration) - 1
        for k in range(lo, hi + 1):
            self.arriving.setdefault(root, set()).add(k % self.n)
        self.swaps += 1
        self.outs.setdefault(root, []).append((out, out + duration))

    def _inside(self, k: int, lo: float, hi: float) -> bool:
        """Op k (in one iteration) starts within [lo, hi) of the unrolled axis."""
        t = self.timeline.start(k)
        period = self.timeline.period
        return any(lo - EPS <= t + q * period < hi for q in (-1, 0, 1, 2))

    def cut_is_safe(self, choice: Recompute) -> bool:
        """A recomputation moves the ops after it later, so a swap-out copy that spans its insertion
        point frees its tensor up to the replay's length earlier, relative to those ops. That is
        harmless (more memory saved, and no access lies in a swap's gap) unless a planned replay
        reads the tensor there: refuse such a recomputation, for its own inputs and for earlier ones."""
        x = self.timeline.start(choice.before)
        period = self.timeline.period
        cuts = [*self.cuts, x]
        needs = [self.root_of[t] for _, t in chain_inputs(self.workload, self.slots[choice.slot], choice.chain)]
        for root in needs:  # its inputs: no copy spanning any cut may free them at before-1 or before
            for a, b in self.outs.get(root, ()):
                for c in cuts:
                    if any(a < c + q * period < b for q in (-1, 0, 1, 2)):
                        if any(self._inside(k, c + q * period, b) for k in (choice.before - 1, choice.before) for q in (-1, 0, 1, 2)):
                            return False
        for root, copies in self.outs.items():  # earlier replays' inputs: the new cut must not free them
            pins = self.pins.get(root)
            if not pins:
                continue
            for a, b in copies:
                for q in (-1, 0, 1, 2):
                    c = x + q * period
                    if a < c < b and any(self._inside(k, c, b) for k in pins):
                        return False
        return True

    def best_recompute(self) -> Recompute | None:
        """The legal recomputation with the highest MSPS at this job's peak (cached until memory changes).

        Candidates are visited by an upper bound of their MSPS (the creator alone, the shortest
        chain), so the search stops as soon as no later one can beat the best found."""
        if self._best is not False:
            return self._best
        _, p = self.peak
        best: Recompute | None = None
        for bound, root in self.recompute_order:
            if best is not None and bound <= best.msps:
                break
            if not self.present(root, p):
                continue
            option = recompute_option(self.workload, self.slots[root], p, self.usable, self.first_pin, self.root_of, self.writers)
            if option is not None and self.job.activations_only and not natively_replayable(self.workload, option):
                continue
            if option is not None and (best is None or option.msps > best.msps) and self.cut_is_safe(option):
                best = option
        self._best = best
        return best

    def add_recompute(self, choice: Recompute) -> None:
        slot = self.slots[choice.slot]
        self.add_absent(choice.slot, choice.after + 1, choice.before - 1)
        self.events.append(Event(self.job.name, "release", slot.name_at(choice.after), choice.after))
        self.events.append(Event(self.job.name, "recompute", slot.name_at(choice.before - 1), choice.before - 1))
        for _, tensor in chain_inputs(self.workload, slot, choice.chain):
            self.pins.setdefault(self.root_of[tensor], []).extend((choice.before - 1, choice.before))
        self.recompute_seconds += choice.seconds
        self.cuts.append(self.timeline.start(choice.before))
        self.extra_after[choice.before - 1] = self.extra_after.get(choice.before - 1, 0.0) + choice.seconds

    def final_events(self, slowdown: float) -> list[Event]:
        """The events, where a copy fired by the op a recomputation follows waits for the replay too."""
        events = []
        for e in self.events:
            extra = self.extra_after.get(e.trigger, 0.0)
            if extra and e.kind in ("swap_out", "swap_in"):
                e = replace(e, delay=e.delay + extra * slowdown)
            events.append(e)
        return events


def _uncovered(lo: int, hi: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [lo, hi] that none of `ranges` covers."""
    parts = [(lo, hi)]
    for a, b in ranges:
        parts = [piece for x, y in parts for piece in ((x, min(y, a - 1)), (max(x, b + 1), y)) if piece[0] <= piece[1]]
        if not parts:
            break
    return parts


def co_run_slowdown(jobs: int, overlap: float) -> float:
    """How much longer an op takes while `jobs` jobs compute on the GPU together.

    `overlap` in [0, 1]: 0 is pure time slicing (each job at 1/jobs of the speed), 1 is perfect
    overlap (no slowdown). Throughput of the GPU is 1 + overlap * (jobs - 1) single-job rates."""
    if jobs <= 1:
        return 1.0
    return jobs / (1.0 + overlap * (jobs - 1))


def plan_limits(jobs: list[JobToPlan]) -> tuple[str, ...]:
    """What keeps the jobs' plans from every legal event: a lower peak may be reachable without it."""
    limits = []
    if any(j.activations_only for j in jobs):
        limits.append("native events only: --plan-events, TENSILE_PLAN_EVENTS")
    if any(not j.recompute for j in jobs):
        limits.append("no recomputation")
    if any(j.max_swap_rate < 1 for j in jobs):
        limits.append("a max swap rate below 1")
    return tuple(limits)


def plan_gpu(
    jobs: list[JobToPlan],
    bandwidth: float,
    budget_bytes: int | None = None,
    capacity_bytes: int | None = None,
    slowdown: float = 1.0,
    min_swap_bytes: int = MIN_SWAP_BYTES,
    stop_after_rounds: int = 100,
    stop_gain: float = 0.0005,
) -> GpuPlan:
    """Plan all jobs of one GPU together.

    With `budget_bytes` the planner stops once the GPU's peak fits it and each job's peak fits the
    job's own budget (fewer events, less risk);
    without, it plans for the lowest peak it can reach: swaps first, then recomputations by MSPS
    until none is legal at any job's peak. `capacity_bytes` (the paper's Free_GPU_Memory) then only
    decides `fits`. `slowdown` stretches op latencies for co-running jobs. Swapping pauses, past
    `stop_after_rounds` swap rounds, when the last three together lowered the peaks of the jobs they
    swapped in by less than `stop_gain` (the paper's stopping rule, on each job's own peak: with many
    jobs a swap lowers the GPU's sum by a share of one job's); a recomputation moves the peak and
    resumes it."""
    started = time.perf_counter()
    if not jobs:
        raise TensileUserError("no jobs to plan")
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise TensileUserError(f"job names must be unique: {', '.join(names)}")
    for job in jobs:
        if not 0.0 < job.max_swap_rate <= 1.0:
            raise TensileUserError(f"max swapping rate of job {job.name} must be in (0, 1], was {job.max_swap_rate}")
    states = [JobState(job, slowdown, min_swap_bytes) for job in jobs]
    target = budget_bytes
    d2h, h2d = Channel(), Channel()
    transfers: list[Transfer] = []
    gains: list[float] = []  # per placed swap: how much it lowered its own job's peak (relative)
    rounds = 0
    swaps_spent = False

    def total_peak() -> int:
        return sum(s.peak[0] for s in states)

    def pressing() -> list[JobState]:
        """The jobs a round works on: all of them while the GPU is above its budget (or has none),
        else only those above their own budget."""
        if target is None or total_peak() > target:
            return states
        return [s for s in states if s.job.budget_bytes is not None and s.peak[0] > s.job.budget_bytes]

    def swap_round(candidates: list[JobState]) -> bool | None:
        """One Algorithm 2 round: True placed, False rejected, None when no job has a candidate left."""
        total_swaps = sum(s.swaps for s in states)
        options = []
        for state in candidates:
            candidate = state.next_swap_candidate()
            if candidate is None:
                continue
            # the max swapping rate holds for every tensor but an updated parameter or optimizer state
            # swapped across the iteration boundary (Algorithm 2, lines 26-28: scheduled without the check)
            if state.swaps >= state.job.max_swap_rate * (total_swaps + 1) and not state.crosses_step(*candidate):
                continue
            options.append((state.slots[candidate[0]].size, state, candidate))
        if not options:
            return None
        _, state, (root, gap) = max(options, key=lambda o: o[0])
        placed = place_swap(state.timeline, gap, state.slots[root].size, bandwidth, d2h, h2d)
        if placed is None:
            state.reject(root, gap)
            return False
        out, back = placed
        duration = transfer_seconds(state.slots[root].size, bandwidth)
        d2h.book(out, duration, state.timeline.period)
        h2d.book(back, duration, state.timeline.period)
        transfers.append(Transfer(state.job.name, root, "d2h", out, out + duration))
        transfers.append(Transfer(state.job.name, root, "h2d", back, back + duration))
        before = state.peak[0]
        state.add_swap(root, gap, out, back, bandwidth)
        gains.append((before - state.peak[0]) / before if before else 0.0)
        return True

    # Algorithm 3: swap while swaps lower the peak; when they are spent and the peak is still above the
    # budget (or, without a budget, for the lowest peak), recompute the best MSPS at a job's peak. A
    # recomputation moves the peak, so swapping is tried again at the new one before the next recompute.
    while rounds < MAX_ROUNDS:
        candidates = pressing()
        if not candidates:
            break
        rounds += 1
        if not swaps_spent:
            placed = swap_round(candidates)
            if placed is None:
                swaps_spent = True
            elif placed and len(gains) > max(stop_after_rounds, 3) and sum(gains[-3:]) < stop_gain:
                swaps_spent = True
            continue
        choices = [(c, s) for s in candidates if s.job.recompute and (c := s.best_recompute()) is not None]
        if not choices:
            break
        choice, state = max(choices, key=lambda cs: cs[0].msps)
        state.add_recompute(choice)
        swaps_spent = False
        gains.clear()

    limit = budget_bytes if budget_bytes is not None else capacity_bytes
    plans: dict[str, Plan] = {}
    vanilla_total = scheduled_total = 0
    for state in states:
        workload = state.workload
        vanilla = analyze_vanilla(workload)
        state.events = state.final_events(slowdown)
        scheduled = analyze_plan(workload, state.events, bandwidth, slowdown)
        forecast = Forecast(
            vanilla_peak_bytes=vanilla.peak_bytes,
            scheduled_peak_bytes=scheduled.peak_bytes,
            predicted_iteration_seconds=state.timeline.period,
            predicted_extra_seconds=state.recompute_seconds * slowdown,
        )
        events = sorted(state.events, key=lambda e: (e.next_iteration, e.trigger, e.delay, e.kind, e.tensor))
        plans[state.job.name] = Plan(state.job.name, 1, workload.signature, events, forecast)
        vanilla_total += vanilla.peak_bytes
        scheduled_total += scheduled.peak_bytes
    fits = limit is None or scheduled_total <= limit
    return GpuPlan(plans, vanilla_total, scheduled_total, limit, fits, transfers, rounds, time.perf_counter() - started,
                   plan_limits(jobs))


def plan_job(workload: Workload, bandwidth: float, budget_bytes: int | None = None, name: str = "job",
             activations_only: bool = False, recompute: bool = True, max_swap_rate: float = 1.0, **options: Any) -> GpuPlan:
    """One job alone on its GPU (what `tensile forecast` and the hook's in-process planner need)."""
    job = JobToPlan(name, workload, max_swap_rate, recompute=recompute, activations_only=activations_only)
    return plan_gpu([job], bandwidth, budget_bytes, **options)
