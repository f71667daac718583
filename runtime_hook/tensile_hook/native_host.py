"""What the native path (`native_align.py`, `native_swaps.py`) needs of the executor, and nothing more: the run's
state, the registry's storages and the calls that move them, a stand-down, and the start of an iteration at a
module call. The executor's parts implement it (`executor.py`); the native path never sees them otherwise."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tensile_hook.movers import Mover
from tensile_hook.recipes import RecipeBook
from tensile_hook.run_state import RunState
from tensile_hook.storages import StorageRegistry, StorageSlot


class SlotMoves(Protocol):
    """The registry's storages and the calls that move them (`residency.Residency`)."""

    registry: StorageRegistry
    mover: Mover
    recipes: RecipeBook

    def swap_out(self, slot: StorageSlot) -> bool:
        """Out to the host; False where it stays (a storage that cannot be resized)."""

    def fetch(self, slot: StorageSlot) -> None:
        """Back from the host, or recomputed."""

    def ensure_slot_resident(self, slot: StorageSlot) -> None:
        """Back before use (a stall), and on CUDA its copy waited for."""


class NativeHost(Protocol):
    """The executor, as the native path sees it."""

    @property
    def state(self) -> RunState: ...

    @property
    def residency(self) -> SlotMoves: ...

    def stand_down(self, exc: BaseException) -> None:
        """Tensile's own failure: everything back, training goes on without it."""

    def start_at_module(self, module: torch.nn.Module, args: Any) -> None:
        """The first module call after the step(s) starts the next iteration."""
