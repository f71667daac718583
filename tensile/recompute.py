"""Recomputation selection (TENSILE IV-D): release a tensor after one access, replay its op before the next.

Only where swapping is spent. A recomputation is legal only when every input of the replayed op is
on the device, unchanged, just before the access that needs the tensor, and stays so: the replay
must not need a swap-in or another replay of its own (that would undo the swap plan). Among the
legal ones, the highest MSPS (memory saving per second of recomputation, Capuchin's metric) wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tensile.timeline import Slot
from tensile.workload import Workload

MIN_SECONDS = 1e-9


@dataclass(frozen=True, slots=True)
class Recompute:
    slot: int
    after: int  # release after this access
    before: int  # replay just before this access
    seconds: float  # replay latency (unscaled)
    msps: float


def msps(size: int, seconds: float) -> float:
    """Memory saving per second of recomputation."""
    return size / max(seconds, MIN_SECONDS)


def recompute_option(
    workload: Workload,
    slot: Slot,
    p: int,
    present: Callable[[int, int], bool],
    pinned: Callable[[int, int, int], bool],
    root_of: dict[int, int],
    writers: dict[int, list[int]],
) -> Recompute | None:
    """The recomputation of `slot` that frees it at op p, if one is legal.

    `present(root, op)`: the slot is on the device with its data for op; `pinned(root, lo, hi)`: some planned
    replay needs the slot between ops lo and hi, so it may not go away there."""
    creator = slot.recomputable_by
    if creator is None or slot.persistent:
        return None
    acc = slot.accesses
    i = next((j for j, a in enumerate(acc) if a > p), None)
    if i is None or i == 0 or acc[i - 1] == p:
        return None
    after, before = acc[i - 1], acc[i]
    if pinned(slot.root, after + 1, before - 1):
        return None
    op = workload.ops[creator]
    for tensor in op.inputs:
        root = root_of[tensor]
        if root == slot.root or not (present(root, before - 1) and present(root, before)):
            return None
        if any(creator < w < before for w in writers.get(tensor, ())):
            return None
    return Recompute(slot.root, after, before, op.latency, msps(slot.size, op.latency))
