"""A discrete-event simulation of one GPU running several training jobs under memory scheduling policies.

What it models (TENSILE paper, section V-A): each job's compute stream runs its ops in order, slowed while other jobs
compute at the same time (processor sharing with a configurable overlap); one host-to-device and one
device-to-host copy channel per GPU, shared by all jobs, each moving one tensor at a time in request
order; the plan's events fired after their trigger op plus delay; and a *passive stall* whenever an
op's input is not on the device in time (it waits for a late swap-in, or fetches the tensor itself).
A budget guard (Capuchin's passive mode) evicts least recently used tensors when an allocation would
exceed the job's budget.

Memory is counted the way the allocator sees it: an op's outputs when it starts, PyTorch's frees when
it ends, a swap-in's memory when its copy starts, a swap-out's when its copy ends. Measurements are
taken from the second iteration on (steady state: cross-iteration swaps are in effect).
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tensile.devices import DeviceSpec
from tensile.plan import Event, Plan
from tensile.timeline import Slot, build_slots, slot_of, transfer_seconds
from tensile.workload import Workload

DEAD, PRESENT, OUT_FLIGHT, HOST, IN_FLIGHT, RELEASED = range(6)
HOLDS_MEMORY = (PRESENT, OUT_FLIGHT, IN_FLIGHT)


@dataclass(slots=True)
class SimJob:
    """One job as the simulator runs it. `on_iteration_end(job, iteration, stalls)` may return a new plan
    (applied from the next iteration: plan updates, Capuchin's feedback); `stalls` maps slot -> seconds waited."""

    name: str
    workload: Workload
    plan: Plan | None = None
    budget_bytes: int | None = None
    barriers: dict[int, list[int]] = field(default_factory=dict)  # op -> tensors whose swap-out must end first
    on_iteration_end: Callable[[SimJob, int, dict[int, float]], Plan | None] | None = None


@dataclass(slots=True)
class JobResult:
    name: str
    iteration_seconds: list[float]
    peak_bytes: int  # steady state (iterations after the first)
    stall_seconds: float = 0.0
    recompute_seconds: float = 0.0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    passive_swap_ins: int = 0

    @property
    def steady_iteration_seconds(self) -> float:
        steady = self.iteration_seconds[1:] or self.iteration_seconds
        return sum(steady) / len(steady)


@dataclass(slots=True)
class SimResult:
    jobs: dict[str, JobResult]
    timeline: list[tuple[float, str, int]]  # (time, job, bytes in use by that job) after each change


class _Transfer:
    __slots__ = ("job", "root", "direction", "size", "passive")

    def __init__(self, job: _JobRun, root: int, direction: str, size: int, passive: bool) -> None:
        self.job, self.root, self.direction, self.size, self.passive = job, root, direction, size, passive


class _JobRun:
    """Mutable state of one job in the simulation."""

    def __init__(self, spec: SimJob) -> None:
        self.spec = spec
        self.name = spec.name
        self.ops = spec.workload.ops
        self.slots: dict[int, Slot] = build_slots(spec.workload)
        self.root_of = slot_of(self.slots)
        self.tensors = spec.workload.tensors
        self.state = dict.fromkeys(self.slots, DEAD)
        self.queued: dict[int, str] = {}  # root -> direction of a transfer waiting for its channel
        self.working_set: set[int] = set()  # slots the next op needs: the budget guard never evicts them
        self.want_in: set[int] = set()  # swap-ins asked for while the swap-out was still under way
        self.last_use: dict[int, float] = {}
        self.used = 0
        self.iteration = 0
        self.k = 0  # next op
        self.tasks: deque[tuple[str, int, float]] = deque()  # ("op"/"recompute", index, work seconds)
        self.current: tuple[str, int, float] | None = None
        self.remaining = 0.0
        self.waiting_since: float | None = None
        self.wait_root: int | None = None
        self.stalls: dict[int, float] = {}
        self.chain_inputs: dict[int, list[int]] = {}  # root -> inputs of the chain its recompute replays
        self.iteration_started = 0.0
        self.iteration_ends: list[float] = []
        self.peaks: list[int] = [0]
        self.plan = spec.plan
        self.by_trigger, self.next_by_trigger = _index(spec.plan)
        self.result = JobResult(spec.name, [], 0)
        self.frees: dict[int, list[int]] = {}  # op -> slots PyTorch frees after it (by their last name)
        for slot in self.slots.values():
            freed = self.tensors[slot.names[-1]].freed_after
            if freed is not None:
                self.frees.setdefault(freed, []).append(slot.names[-1])
        for root, slot in self.slots.items():
            if spec.workload.tensors[root].created_by < 0:
                self.state[root] = PRESENT
                self.used += slot.size
        self.peaks[0] = self.used

    def holds(self, root: int) -> bool:
        return self.state[root] in HOLDS_MEMORY


def _index(plan: Plan | None) -> tuple[dict[int, list[Event]], dict[int, list[Event]]]:
    by_trigger: dict[int, list[Event]] = {}
    next_by_trigger: dict[int, list[Event]] = {}
    for event in plan.events if plan else ():
        (next_by_trigger if event.next_iteration else by_trigger).setdefault(event.trigger, []).append(event)
    return by_trigger, next_by_trigger


class Simulator:
    """Run `jobs` together on `device` until each has finished `iterations` iterations."""

    def __init__(self, jobs: list[SimJob], device: DeviceSpec, overlap: float = 0.1, iterations: int = 3) -> None:
        self.device = device
        self.overlap = overlap
        self.iterations = max(2, iterations)
        self.jobs = [_JobRun(j) for j in jobs]
        self.now = 0.0
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.channels: dict[str, deque[_Transfer]] = {"d2h": deque(), "h2d": deque()}
        self.busy: dict[str, _Transfer | None] = {"d2h": None, "h2d": None}
        self.timeline: list[tuple[float, str, int]] = []

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> SimResult:
        for job in self.jobs:
            self._advance(job)
        while not all(len(j.iteration_ends) >= self.iterations for j in self.jobs):
            computing = [j for j in self.jobs if j.current is not None]
            rate = (1.0 + self.overlap * (len(computing) - 1)) / len(computing) if computing else 1.0
            next_compute = min((j.remaining / rate for j in computing), default=float("inf"))
            next_timed = self.heap[0][0] - self.now if self.heap else float("inf")
            step = min(next_compute, next_timed)
            if step == float("inf"):
                stuck = [f"{j.name} at op {j.k} (waiting for tensor {j.wait_root})" for j in self.jobs]
                raise RuntimeError(f"simulation deadlocked: {'; '.join(stuck)}")
            self.now += step
            for job in computing:
                job.remaining -= step * rate
            for job in computing:
                if job.remaining <= 1e-15:
                    self._finish_task(job)
            while self.heap and self.heap[0][0] <= self.now + 1e-15:
                _, _, callback = heapq.heappop(self.heap)
                callback()
            for job in self.jobs:
                if job.current is None:
                    self._advance(job)
        return self._results()

    def _at(self, delay: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self.heap, (self.now + delay, next(self.seq), callback))

    # -- memory -------------------------------------------------------------------------------
    def _change(self, job: _JobRun, delta: int) -> None:
        job.used += delta
        job.peaks[-1] = max(job.peaks[-1], job.used)
        self.timeline.append((self.now, job.name, job.used))

    def _allocate(self, job: _JobRun, root: int, state: int) -> None:
        job.state[root] = state
        self._change(job, job.slots[root].size)

    def _free(self, job: _JobRun, root: int, state: int) -> None:
        if job.holds(root):
            self._change(job, -job.slots[root].size)
        job.state[root] = state

    def _room(self, job: _JobRun, size: int, protected: set[int]) -> bool:
        """Budget guard: evict least recently used slots until `size` more bytes fit; False if it must wait."""
        budget = job.spec.budget_bytes
        if budget is None or job.used + size <= budget:
            return True
        pending = sum(job.slots[r].size for r, d in job.queued.items() if d == "d2h")
        pending += sum(job.slots[r].size for r, s in job.state.items() if s == OUT_FLIGHT)
        need = job.used + size - budget - pending
        protected = protected | job.working_set
        victims = sorted(
            (r for r, s in job.state.items() if s == PRESENT and r not in protected and r not in job.queued),
            key=lambda r: job.last_use.get(r, -1.0),
        )
        for root in victims:
            if need <= 0:
                break
            self._request(job, root, "d2h", passive=True)
            need -= job.slots[root].size
        # nothing left to evict: the allocation goes through over budget (the guard cannot do better)
        return need > 0 and not victims and not pending

    # -- transfers ----------------------------------------------------------------------------
    def _request(self, job: _JobRun, root: int, direction: str, passive: bool = False) -> None:
        transfer = _Transfer(job, root, direction, job.slots[root].size, passive)
        job.queued[root] = direction
        if passive:
            self.channels[direction].appendleft(transfer)
        else:
            self.channels[direction].append(transfer)
        self._serve(direction)

    def _serve(self, direction: str) -> None:
        queue = self.channels[direction]
        while self.busy[direction] is None and queue:
            transfer = queue.popleft()
            job, root = transfer.job, transfer.root
            job.queued.pop(root, None)
            if direction == "d2h":
                if job.state[root] != PRESENT:
                    continue
                job.state[root] = OUT_FLIGHT
                job.result.swap_out_bytes += transfer.size
            else:
                if job.state[root] != HOST:
                    continue
                if not self._room(job, transfer.size, {root}):
                    queue.appendleft(transfer)  # waits for evictions; served again when a copy ends
                    job.queued[root] = direction
                    return
                self._allocate(job, root, IN_FLIGHT)
                job.result.swap_in_bytes += transfer.size
            self.busy[direction] = transfer
            self._at(transfer_seconds(transfer.size, self.device.host_link_bandwidth), functools.partial(self._transfer_done, direction))

    def _transfer_done(self, direction: str) -> None:
        transfer = self.busy[direction]
        assert transfer is not None, f"no {direction} copy in flight"
        self.busy[direction] = None
        job, root = transfer.job, transfer.root
        if direction == "d2h" and job.state[root] == OUT_FLIGHT:
            self._free(job, root, HOST)
            if root in job.want_in:
                job.want_in.discard(root)
                self._request(job, root, "h2d")
        elif direction == "h2d" and job.state[root] == IN_FLIGHT:
            job.state[root] = PRESENT
        self._serve("d2h")
        self._serve("h2d")

    # -- compute ------------------------------------------------------------------------------
    def _advance(self, job: _JobRun) -> None:
        """Start the job's next compute task if everything it needs is on the device."""
        if not job.tasks:
            job.tasks.append(("op", job.k, job.ops[job.k].latency))
        kind, index, work = job.tasks[0]
        if kind == "op":
            blocker = self._blocker(job, index)
        else:
            blocker = self._recompute_blocker(job, index)
        if blocker is not None:
            if job.waiting_since is None:
                job.waiting_since = self.now
            job.wait_root = blocker
            return
        if job.waiting_since is not None:
            waited = self.now - job.waiting_since
            job.result.stall_seconds += waited
            if job.wait_root is not None:
                job.stalls[job.wait_root] = job.stalls.get(job.wait_root, 0.0) + waited
            job.waiting_since = None
            job.wait_root = None
        job.tasks.popleft()
        if kind == "op":
            op = job.ops[index]
            for t in op.outputs:
                root = job.root_of[t]
                if root == t:
                    self._allocate(job, root, PRESENT)
                elif not job.holds(root):  # an update written while its old memory is away
                    self._allocate(job, root, PRESENT)
            for t in (*op.inputs, *op.outputs):
                job.last_use[job.root_of[t]] = self.now
        else:
            self._allocate(job, index, PRESENT)
            job.result.recompute_seconds += work
        job.current = (kind, index, work)
        job.remaining = work
        if work <= 0.0:
            self._finish_task(job)
            self._advance(job)

    def _blocker(self, job: _JobRun, k: int) -> int | None:
        """A slot op k needs that is not usable yet (and the action that brings it), or None."""
        op = job.ops[k]
        for t in job.spec.barriers.get(k, ()):
            root = job.root_of[t]
            if root in job.queued or job.state[root] == OUT_FLIGHT:
                return root
        needed = [job.root_of[t] for t in (*op.inputs, *op.writes)]
        needed += [job.root_of[t] for t in op.outputs if job.root_of[t] != t]
        job.working_set = set(needed)
        for root in needed:
            state = job.state[root]
            if state in (PRESENT, OUT_FLIGHT):
                continue
            if state == IN_FLIGHT or job.queued.get(root) == "h2d":
                return root
            if state == HOST:
                self._request(job, root, "h2d", passive=True)
                job.result.passive_swap_ins += 1
                return root
            if state == RELEASED:
                job.tasks.appendleft(self._recompute_task(job, root, k))
                return root
            raise RuntimeError(f"job {job.name}: op {k} ({op.name}) needs tensor {root}, which was never created")
        size = sum(job.slots[job.root_of[t]].size for t in op.outputs if job.root_of[t] == t or not job.holds(job.root_of[t]))
        if size and not self._room(job, size, set(needed)):
            return needed[0] if needed else -1
        return None

    def _recompute_blocker(self, job: _JobRun, root: int) -> int | None:
        inputs = job.chain_inputs[root]
        for t in inputs:
            r = job.root_of[t]
            if job.state[r] not in (PRESENT, OUT_FLIGHT):
                if job.state[r] == HOST and r not in job.queued:
                    self._request(job, r, "h2d", passive=True)
                    job.result.passive_swap_ins += 1
                elif job.state[r] == RELEASED:
                    job.tasks.appendleft(self._recompute_task(job, r, job.k))
                return r
        if not self._room(job, job.slots[root].size, {job.root_of[t] for t in inputs}):
            return root
        return None

    @staticmethod
    def _recompute_task(job: _JobRun, root: int, before: int) -> tuple[str, int, float]:
        """Replay the slot's chain (creator, then its in-place rewrites before op `before`)."""
        slot = job.slots[root]
        chain = slot.chain(before)
        own = set(slot.names)
        job.chain_inputs[root] = [t for k in chain for t in job.ops[k].inputs if t not in own]
        return ("recompute", root, sum(job.ops[k].latency for k in chain))

    def _finish_task(self, job: _JobRun) -> None:
        assert job.current is not None, f"{job.name} has no task running"
        kind, index, _ = job.current
        job.current = None
        job.remaining = 0.0
        if kind == "recompute":
            return
        for t in job.frees.get(index, ()):
            self._free(job, job.root_of[t], DEAD)
        self._fire(job, index)
        job.k += 1
        if job.k == len(job.ops):
            self._end_iteration(job)

    def _fire(self, job: _JobRun, index: int) -> None:
        events = list(job.by_trigger.get(index, ()))
        if job.iteration > 0:
            events += job.next_by_trigger.get(index, ())
        for event in events:
            if event.delay > 0:
                self._at(event.delay, functools.partial(self._apply, job, event))
            else:
                self._apply(job, event)

    def _apply(self, job: _JobRun, event: Event) -> None:
        root = job.root_of[event.tensor]
        state = job.state[root]
        if event.kind == "swap_out":
            if state == PRESENT and root not in job.queued:
                self._request(job, root, "d2h")
        elif event.kind == "swap_in":
            if state == HOST and root not in job.queued:
                self._request(job, root, "h2d")
            elif state == OUT_FLIGHT or job.queued.get(root) == "d2h":
                job.want_in.add(root)  # back in as soon as its swap-out ends
        elif event.kind == "release":
            if state == PRESENT:
                self._free(job, root, RELEASED)
        elif event.kind == "recompute":
            if state == RELEASED:
                job.tasks.append(self._recompute_task(job, root, event.trigger + 1))

    def _end_iteration(self, job: _JobRun) -> None:
        """Non-persistent tensors go; persistent slots keep their place (or their host copy)."""
        for root, slot in job.slots.items():
            if not slot.persistent and job.state[root] != DEAD:
                self._free(job, root, DEAD)
        job.iteration_ends.append(self.now)
        job.result.iteration_seconds.append(self.now - job.iteration_started)
        job.iteration_started = self.now
        callback = job.spec.on_iteration_end
        stalls, job.stalls = job.stalls, {}
        if callback is not None:
            new_plan = callback(job.spec, job.iteration, stalls)
            if new_plan is not None:
                job.plan = new_plan
                job.by_trigger, job.next_by_trigger = _index(new_plan)
        job.iteration += 1
        job.k = 0
        job.peaks.append(job.used)

    def _results(self) -> SimResult:
        results = {}
        for job in self.jobs:
            result = job.result
            result.iteration_seconds = result.iteration_seconds[: self.iterations]
            result.peak_bytes = max(job.peaks[1 : self.iterations]) if len(job.peaks) > 1 else job.peaks[0]
            results[job.name] = result
        return SimResult(results, self.timeline)


def simulate(jobs: list[SimJob], device: DeviceSpec, overlap: float = 0.1, iterations: int = 3) -> SimResult:
    """Run the jobs together on one simulated GPU; see the module docstring for what is modelled."""
    return Simulator(jobs, device, overlap, iterations).run()
