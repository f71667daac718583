"""Shared fixtures: traces are cached for the whole test session (tracing costs ~0.5-2 s each)."""

from __future__ import annotations

import functools

import pytest

from tensile.forecast import trace_workload
from tensile.workload import Workload


@functools.lru_cache(maxsize=None)
def _cached_trace(model: str, batch_size: int, device: str, optimizer: str, live: bool) -> Workload:
    return trace_workload(model, batch_size, optimizer=optimizer, device=device, live=live)


@pytest.fixture(scope="session")
def traced():
    """traced(model, batch_size, device="cuda", optimizer="adam", live=False) -> Workload, cached per session.

    Callers must not mutate the returned workload (copy it first)."""

    def get(model: str, batch_size: int, device: str = "cuda", optimizer: str = "adam", live: bool = False) -> Workload:
        return _cached_trace(model, batch_size, device, optimizer, live)

    return get
