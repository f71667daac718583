"""Every live device storage the hook has seen: residency, host copy, bytes on the device.

One weak reference with a callback per storage for its whole life (not one per iteration), so a
long training run does not accumulate watchers (a plain callback: about 1 µs a storage, where
`weakref.finalize` took 16 µs). Device bytes count resident storages only; the hook's own
host buffers are never counted. The native path's activation swaps use slots of their own, outside
the registry (`counted=False`): they live for one iteration and their owner brings them back.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

Tensor = torch.Tensor  # one global lookup on hot paths, not two


@dataclass(eq=False, slots=True)  # slots: one is made per swapped activation per native iteration
class StorageSlot:
    """One device storage as the hook tracks it: where its bytes are and how they come back (the planner's
    `tensile.timeline.Slot` is another thing: one plan tensor's allocation over the iteration)."""

    key: int
    ref: weakref.ref
    nbytes: int
    resident: bool = True
    host: torch.UntypedStorage | None = None  # its bytes on the host while swapped out (the mover's)
    recipe: Any = None  # how to recompute it when it was released
    pending: Any = None  # an in-flight transfer (CUDA event) to wait for before use
    passive: bool = False  # evicted by the budget guard rather than by the plan
    counted: bool = True  # in the registry (its device bytes and LRU order); False: a native swap's own
    pinned: bool = False  # its storage cannot be resized (from numpy): never swapped again

    def storage(self) -> torch.UntypedStorage | None:
        return self.ref()


class StorageRegistry:
    def __init__(self, on_free: Callable[[int], None] | None = None) -> None:
        self.slots: dict[int, StorageSlot] = {}
        self.device_bytes = 0
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident keys, least recently used first
        self.on_free = on_free
        self.release_host: Callable[[torch.UntypedStorage], None] | None = None

    def watch(self, storage: torch.UntypedStorage) -> StorageSlot:
        key = id(storage)
        slot = self.slots.get(key)
        if slot is None:
            # the slot keeps the reference alive, so its callback runs when the storage dies
            slot = StorageSlot(key, weakref.ref(storage, partial(self._freed, key)), storage.nbytes())
            self.slots[key] = slot
            self.device_bytes += slot.nbytes
            self.lru[key] = None
        return slot

    def _freed(self, key: int, _ref: Any = None) -> None:
        slot = self.slots.pop(key, None)
        if slot is None:
            return
        if slot.resident:
            self.device_bytes -= slot.nbytes
        self.lru.pop(key, None)
        if slot.host is not None and self.release_host is not None:
            self.release_host(slot.host)
        slot.host = slot.recipe = None
        if self.on_free is not None:
            self.on_free(key)

    def touch(self, slot: StorageSlot) -> None:
        if slot.resident:
            self.lru.move_to_end(slot.key)

    def mark_absent(self, slot: StorageSlot) -> None:
        if slot.resident:
            slot.resident = False
            if slot.counted:
                self.device_bytes -= slot.nbytes
                self.lru.pop(slot.key, None)

    def mark_resident(self, slot: StorageSlot) -> None:
        if not slot.resident:
            slot.resident = True
            if slot.counted:
                self.device_bytes += slot.nbytes
                self.lru[slot.key] = None

    def absent(self) -> list[StorageSlot]:
        return [slot for slot in self.slots.values() if not slot.resident]


def tensors_in(values: Any) -> list[torch.Tensor]:
    """Tensors among an op's (or a module call's) arguments or results: plain, or in lists
    (foreach ops), tuples or dicts, in order; several times cheaper than a general pytree walk."""
    found = []
    stack = [values]
    while stack:
        value = stack.pop()
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
    return found


def map_leaves(values: Any, leaf: Callable[[Any], Any]) -> Any:
    """`values` rebuilt with each value that is not a list, tuple or dict replaced by `leaf(value)`: a recipe's
    arguments with a tensor substituted, turned into a template, or a template bound to this iteration's tensors."""
    if isinstance(values, (list, tuple)):
        return type(values)(map_leaves(v, leaf) for v in values)
    if isinstance(values, dict):
        return {k: map_leaves(v, leaf) for k, v in values.items()}
    return leaf(values)


def tensor_paths(values: Any) -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """`tensors_in`'s tensors in the same order, each with its index path into `values`: a native
    boundary indexes straight to the one tensor it takes instead of collecting them all."""
    found = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), values)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, Tensor):
            found.append((path, value))
        elif isinstance(value, (list, tuple)):
            stack.extend(((*path, i), item) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            stack.extend(((*path, key), item) for key, item in reversed(list(value.items())))
    return found
