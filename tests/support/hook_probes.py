"""Hands on the hook's machinery that tests drive directly: a storage swapped out by hand, the ops it replays."""

from __future__ import annotations

import pytest
import torch


def swapped_out(executor, tensor: torch.Tensor):  # type: ignore[no-untyped-def]
    """The tensor's storage watched and swapped out, as inside the hook's dispatch (where its own copies
    pass no mode)."""
    from torch.utils._python_dispatch import _disable_current_modes

    slot = executor.residency.registry.watch(tensor.untyped_storage())
    with _disable_current_modes():
        assert executor.residency.swap_out(slot)
    return slot


def replayed_ops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the ops the hook replays from now on, as they replay."""
    from tensile_hook import recipes

    replayed: list[str] = []
    original = recipes.Step.replay

    def replay(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        replayed.append(str(self.func))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(recipes.Step, "replay", replay)
    return replayed
