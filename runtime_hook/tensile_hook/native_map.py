"""Which plan events the native path can carry without the dispatch mode.

- A release PyTorch makes itself: a tensor created and freed within the iteration is freed by
  PyTorch after its last use, so leaving it to PyTorch is correct (the cost: its bytes live until
  PyTorch's own free, a few ops for most).
- A release of a tensor PyTorch keeps (the loss a script holds) smaller than 4 KiB, up to 64 KiB
  in all: left alone, what the plan misses is bounded by that (the budget guard does not evict
  storages that small either).
- A swap of an activation (a tensor made within the iteration, swapped out once and back at most
  once, within the iteration): carried by module hooks and autograd node pre-hooks once a
  dispatch-path iteration has aligned it with them (`native_swaps.py`), which may still find it
  cannot (the report then names why).

- A release and recompute of an activation (released once after its last forward use, recomputed
  once before backward reads it, within the iteration): carried as a swap whose copies are replaced,
  out by freeing the storage and back by replaying the ops that made it, their inputs read from the
  autograd nodes that saved them (`native_recipes.py`); aligned as swaps are.

Every other event (a release of a tensor PyTorch keeps, cross-iteration swaps of parameters and
optimizer state) needs an op-level trigger and a check before use, so a plan holding one runs on the
dispatch path, which carries every event exactly.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from tensile.plan import Event, Plan
from tensile.workload import Workload

SMALL_RELEASE = 4096  # bytes: a release of a tensor this small that PyTorch keeps is left alone ...
SMALL_RELEASES = 65536  # ... up to this many bytes in all


@dataclass
class NativeMap:
    """A plan checked for the native path; `unmapped` names the events that keep it off."""

    unmapped: list[str]
    swaps: list[tuple[Event, Event | None]] = field(default_factory=list)  # (swap-out, swap-in) to align
    recomputes: set[int] = field(default_factory=set)  # plan tensors whose "swap" is a release and a recompute
    carrier: Any = None  # the SwapCarrier once aligned: needed before a plan with swaps goes native
    aborted: int = 0  # native iterations in a row that left the learnt module calls


def map_plan(plan: Plan, workload: Workload, freed_soon: set[int]) -> NativeMap:
    recompute = {e.tensor for e in plan.events if e.kind == "recompute"}
    by_tensor: dict[tuple[str, int], list[Event]] = defaultdict(list)
    for event in plan.events:
        by_tensor[event.kind, event.tensor].append(event)
    unmapped = []
    swaps: list[tuple[Event, Event | None]] = []
    recomputed = set()
    left_alone = 0
    for event in plan.events:
        if _recomputable(workload, event.tensor, by_tensor):
            if event.kind == "release":
                swaps.append((event, by_tensor["recompute", event.tensor][0]))
                recomputed.add(event.tensor)
            continue
        if event.kind == "release" and event.tensor not in recompute and (
                event.tensor in freed_soon or _freed_by_pytorch(workload, event.tensor)):
            continue
        size = workload.tensors[event.tensor].size if event.tensor in workload.tensors else SMALL_RELEASE
        if event.kind == "release" and event.tensor not in recompute and size < SMALL_RELEASE and left_alone + size <= SMALL_RELEASES:
            left_alone += size
            continue
        if _swappable(workload, event, by_tensor, recompute):
            if event.kind == "swap_out":
                back = by_tensor["swap_in", event.tensor]
                swaps.append((event, back[0] if back else None))
            continue
        info = workload.tensors.get(event.tensor)
        phase = workload.ops[event.trigger].phase if 0 <= event.trigger < len(workload.ops) else "?"
        unmapped.append(f"{event.kind} of tensor {event.tensor} ({info.role if info else '?'}, {phase}"
                        f"{', next iteration' if event.next_iteration else ''})")
    return NativeMap(unmapped, swaps, recomputed)


def _swappable(workload: Workload, event: Event, by_tensor: dict, recompute: set[int]) -> bool:
    """A swap of an activation (made within the iteration, not an updated parameter or optimizer
    state), out once and back at most once after it, both within the iteration."""
    if event.kind not in ("swap_out", "swap_in") or event.tensor in recompute:
        return False
    info = workload.tensors.get(event.tensor)
    outs, backs = by_tensor["swap_out", event.tensor], by_tensor["swap_in", event.tensor]
    return (info is not None and info.created_by >= 0 and info.reuses is None and len(outs) == 1 and len(backs) <= 1
            and not any(e.next_iteration for e in outs + backs) and all(back.trigger >= outs[0].trigger for back in backs))


def _recomputable(workload: Workload, tensor: int, by_tensor: dict) -> bool:
    """A release and recompute of an activation (made within the iteration), one of each, the recompute after the
    release, both within the iteration."""
    info = workload.tensors.get(tensor)
    releases, recomputes = by_tensor["release", tensor], by_tensor["recompute", tensor]
    return (info is not None and info.role == "activation" and info.created_by >= 0 and info.reuses is None
            and len(releases) == 1 and len(recomputes) == 1 and not by_tensor["swap_out", tensor]
            and not any(e.next_iteration for e in releases + recomputes) and recomputes[0].trigger >= releases[0].trigger)


def _freed_by_pytorch(workload: Workload, tensor: int) -> bool:
    info = workload.tensors.get(tensor)
    return info is not None and info.created_by >= 0 and info.freed_after is not None
