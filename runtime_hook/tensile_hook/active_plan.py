"""A plan indexed for the hook's hot paths: the dispatch path looks its events up by trigger op and binds plan tensor
ids to live storages by position; the native path asks, once per plan, where its events go on native hooks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from tensile.plan import Event, Plan
from tensile.workload import Workload
from tensile_hook.native_map import NativeMap, map_plan

FREED_SOON_OPS = 8  # a release this close to PyTorch's own free of the tensor is left to PyTorch


class ActivePlan:
    """A plan indexed for the hot path: events by trigger op, recompute targets, and for each op
    the plan tensors first seen there (so live storages can be bound to plan ids by position)."""

    def __init__(self, plan: Plan, workload: Workload) -> None:
        self.plan = plan
        self.workload = workload
        self.guard_said = False  # the report said why its iterations stay guarded on the dispatch path
        self.names = [op.name for op in workload.ops]
        self.by_trigger: dict[int, list[Event]] = defaultdict(list)
        self.next_by_trigger: dict[int, list[Event]] = defaultdict(list)
        for event in plan.events:
            (self.next_by_trigger if event.next_iteration else self.by_trigger)[event.trigger].append(event)
        self.recompute = {e.tensor for e in plan.events if e.kind == "recompute"}
        # releases PyTorch itself does within a few ops: no need to act (or to copy, for safety)
        self.freed_soon = {
            e.tensor for e in plan.events
            if e.kind == "release" and e.tensor in workload.tensors
            and (freed := workload.tensors[e.tensor].freed_after) is not None and freed - e.trigger <= FREED_SOON_OPS
        }
        needed = {e.tensor for e in plan.events}
        needed |= {reused for t in needed
                   if t in workload.tensors and (reused := workload.tensors[t].reuses) is not None}
        self.capture: dict[int, list[tuple[int, str, int]]] = defaultdict(list)  # op -> (tensor, where, position)
        seen: set[int] = set()
        for op in workload.ops:
            new_outputs = [t for t in op.outputs if workload.tensors[t].reuses is None]
            for where, tensors in (("in", op.inputs), ("out", new_outputs)):
                for position, tensor in enumerate(tensors):
                    if tensor in needed and tensor not in seen:
                        seen.add(tensor)
                        self.capture[op.index].append((tensor, where, position))
            for tensor in op.outputs:
                reused = workload.tensors[tensor].reuses
                if tensor in needed and tensor not in seen and reused is not None:
                    seen.add(tensor)
                    self.capture[op.index].append((tensor, "reuse", reused))
        self.native: NativeMap | None = None  # where its events go on native hooks, once mapped
        self.native_checked = False

    def mapped(self, say: Callable[[str], None]) -> NativeMap | None:
        """Where its events go on native hooks, mapped once; None (said once) where some do not map."""
        if not self.native_checked:
            self.native_checked = True
            native = map_plan(self.plan, self.workload, self.freed_soon)
            if native.unmapped:
                say(f"{len(native.unmapped)} events of plan version {self.plan.version} do not map onto native hooks "
                    f"(e.g. {'; '.join(native.unmapped[:3])}): its iterations run on the dispatch path")
            else:
                self.native = native
        return self.native
