"""A mapping that keeps its most recently used entries: the caches of long-lived services (the operator's
forecasts and joint plans, the agent's workloads by signature) must not grow with every distinct job
a cluster ever runs."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """At most `capacity` entries; reading or writing one makes it the newest, and the oldest goes.

    Each method is one or two C-level OrderedDict operations, so a reader on one thread and a writer on
    another (the operator's event loop and its forecast worker) at worst see an entry just evicted as
    missing."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an LRU cache holds at least one entry (capacity was {capacity})")
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        try:
            value = self._items[key]
            self._items.move_to_end(key)
        except KeyError:
            return None
        return value

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            try:
                self._items.popitem(last=False)
            except KeyError:
                break

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
