"""vDNN-conv (Rhu et al.): offload the input feature map of every forward convolution, prefetch statically.

Layer granularity: the offload starts with the convolution that reads the map, and the next layer
waits until it has finished (vDNN synchronises at layer ends to free the memory). In backward, when a
convolution's gradient work starts, the map of the convolution before it is prefetched.
"""

from __future__ import annotations

from tensile.plan import Event, Plan
from tensile.simulator import SimJob
from tensile.timeline import build_slots, slot_of
from tensile.workload import Workload


def vdnn_job(name: str, workload: Workload) -> SimJob:
    """A simulator job that runs `workload` under vDNN-conv."""
    slots = build_slots(workload)
    root_of = slot_of(slots)
    ops = workload.ops
    first_backward = next((op.index for op in ops if op.phase != "forward"), len(ops))
    maps: list[tuple[int, int, int]] = []  # (root, last forward access, first later access)
    seen: set[int] = set()
    for op in ops[:first_backward]:
        if "convolution" not in op.name or not op.inputs:
            continue
        root = root_of[op.inputs[0]]
        slot = slots[root]
        if root in seen or slot.persistent and workload.tensors[root].role != "input":
            continue
        seen.add(root)
        forward = [a for a in slot.accesses if a < first_backward]
        later = [a for a in slot.accesses if a >= first_backward]
        if forward and later:
            maps.append((root, forward[-1], later[0]))
    events: list[Event] = []
    barriers: dict[int, list[int]] = {}
    for i, (root, last_forward, back) in enumerate(maps):
        events.append(Event(name, "swap_out", root, max(last_forward - 1, 0)))
        barriers.setdefault(last_forward + 1, []).append(root)
        # prefetch when the backward of the next convolution in forward order starts
        start = maps[i + 1][2] if i + 1 < len(maps) else first_backward
        events.append(Event(name, "swap_in", root_of[root], max(min(start, back) - 1, 0)))
    return SimJob(name, workload, Plan(name, 1, workload.signature, events), barriers=barriers)
