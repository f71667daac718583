"""Capuchin (Peng et al., ASPLOS'20) as the TENSILE paper reproduced it, in the same simulator.

- The first iteration runs in passive mode: whenever an allocation would exceed the budget, the least
  recently used tensors are swapped out synchronously and swapped back in when accessed.
- From that measured iteration it plans for the budget: tensors with a gap between two accesses in
  the same iteration are candidates (no cross-iteration scheduling); ranked by free time (the gap
  minus a swap-out and a swap-in), each is swapped when the swap hides behind compute, and otherwise
  swapped or recomputed, whichever costs less (recomputation ranked by MSPS), until the footprint
  fits the budget.
- The swap-in of each tensor is triggered by the access that lies one transfer time before its use
  (the *in-trigger*); transfers of other tensors are not taken into account, so they may queue.
- Feedback: when a swap-in arrived late, its in-trigger moves earlier by the time the job waited.
- Passive mode stays on as the guard for whatever the plan misses.
"""

from __future__ import annotations

import numpy as np

from tensile.plan import Event, Plan
from tensile.simulator import SimJob
from tensile.recompute import chain_inputs
from tensile.timeline import Timeline, build_slots, chain_latency, slot_of, transfer_seconds
from tensile.workload import Workload


class CapuchinPolicy:
    """Plan and feedback state of one job under Capuchin."""

    def __init__(self, name: str, workload: Workload, budget_bytes: int, bandwidth: float, min_bytes: int = 1024**2) -> None:
        self.name = name
        self.workload = workload
        self.budget = budget_bytes
        self.bandwidth = bandwidth
        self.min_bytes = min_bytes
        self.slots = build_slots(workload)
        self.root_of = slot_of(self.slots)
        self.timeline = Timeline([op.latency for op in workload.ops])
        self.lead: dict[int, float] = {}  # root -> seconds a swap-in starts before it is needed
        self.swaps: list[tuple[int, int, int]] = []  # (root, after, before)
        self.recomputes: list[tuple[int, int, int]] = []
        self.version = 0

    def job(self) -> SimJob:
        """The job as the simulator runs it: passive first iteration, then the plan, with feedback."""
        return SimJob(self.name, self.workload, None, self.budget, on_iteration_end=self.after_iteration)

    def after_iteration(self, job: SimJob, iteration: int, stalls: dict[int, float]) -> Plan | None:
        if iteration == 0:
            self._select()
        else:
            late = {root: wait for root, wait in stalls.items() if any(root == s[0] for s in self.swaps)}
            if not late:
                return None
            for root, wait in late.items():
                self.lead[root] = self.lead.get(root, 0.0) + wait
        return self._plan()

    def _select(self) -> None:
        """Choose swaps and recomputations until the per-op footprint fits the budget."""
        workload, tl = self.workload, self.timeline
        n = len(workload.ops)
        diff = np.zeros(n + 1, dtype=np.int64)
        for slot in self.slots.values():
            diff[slot.first] += slot.size
            diff[slot.last + 1] -= slot.size
        mem = np.cumsum(diff[:-1])
        candidates = []
        for root, slot in self.slots.items():
            if slot.size < self.min_bytes:
                continue
            acc = slot.accesses
            for after, before in zip(acc, acc[1:]):
                if before - after < 2:
                    continue
                swap_time = transfer_seconds(slot.size, self.bandwidth)
                free_time = tl.start(before) - tl.end(after) - 2 * swap_time
                candidates.append((free_time, root, after, before))
        candidates.sort(key=lambda c: -c[0])
        used: set[int] = set()
        for free_time, root, after, before in candidates:
            if mem.max() <= self.budget:
                break
            slot = self.slots[root]
            if root in used or not (mem[after + 1 : before] > self.budget).any():
                continue
            recompute_cost = None
            if slot.recomputable_by is not None:
                chain = slot.chain(before)  # creator and in-place rewrites, as the hook replays them
                inputs = [t for k, t in chain_inputs(workload, slot, chain)]
                alive = all(self.slots[self.root_of[t]].first <= before <= self.slots[self.root_of[t]].last for t in inputs)
                if alive:
                    recompute_cost = chain_latency(workload, chain)
            swap_cost = max(0.0, -free_time)
            if recompute_cost is not None and swap_cost > 0 and recompute_cost < swap_cost:
                self.recomputes.append((root, after, before))
            else:
                self.swaps.append((root, after, before))
            used.add(root)
            mem[after + 1 : before] -= slot.size

    def _plan(self) -> Plan:
        tl, name, events = self.timeline, self.name, []
        for root, after, before in self.swaps:
            slot = self.slots[root]
            events.append(Event(name, "swap_out", slot.name_at(after), after))
            need = tl.start(before) - transfer_seconds(slot.size, self.bandwidth) - self.lead.get(root, 0.0)
            trigger = max(after, min(tl.last_op_until(max(need, 0.0)), before - 1))
            events.append(Event(name, "swap_in", slot.name_at(trigger), trigger))
        for root, after, before in self.recomputes:
            slot = self.slots[root]
            events.append(Event(name, "release", slot.name_at(after), after))
            events.append(Event(name, "recompute", slot.name_at(before - 1), before - 1))
        self.version += 1
        return Plan(name, self.version, self.workload.signature, events)

