"""Which plan events the native path can carry without the dispatch mode.

Today that is a release PyTorch makes itself: a tensor created and freed within the iteration
is freed by PyTorch after its last use, so leaving it to PyTorch is correct (the cost: its bytes
live until PyTorch's own free, a few ops for most). Every other event (swap-out, swap-in,
recompute, the release before a recompute, cross-iteration swaps of parameters and optimizer
state) needs an op-level trigger and a check before use, so a plan holding one runs on the
dispatch path, which carries every event exactly. An event-free plan (no budget pressure) and
the planner's activity-analysis releases are what the native path runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensile.plan import Plan
from tensile.workload import Workload


@dataclass
class NativeMap:
    """A plan checked for the native path; `unmapped` names the events that keep it off."""

    unmapped: list[str]


def map_plan(plan: Plan, workload: Workload, freed_soon: set[int]) -> NativeMap:
    recompute = {e.tensor for e in plan.events if e.kind == "recompute"}
    unmapped = []
    for event in plan.events:
        if event.kind == "release" and event.tensor not in recompute and (
                event.tensor in freed_soon or _freed_by_pytorch(workload, event.tensor)):
            continue
        info = workload.tensors.get(event.tensor)
        phase = workload.ops[event.trigger].phase if 0 <= event.trigger < len(workload.ops) else "?"
        unmapped.append(f"{event.kind} of tensor {event.tensor} ({info.role if info else '?'}, {phase}"
                        f"{', next iteration' if event.next_iteration else ''})")
    return NativeMap(unmapped)


def _freed_by_pytorch(workload: Workload, tensor: int) -> bool:
    info = workload.tensors.get(tensor)
    return info is not None and info.created_by >= 0 and info.freed_after is not None
