"""Fixtures of the hook's tests (tensile_hook)."""

from __future__ import annotations

import pytest
import torch

from tensile_hook.settings import HookSettings


@pytest.fixture
def planless():  # type: ignore[no-untyped-def]
    """The hook on the CPU device with no plan to apply: its registry, mover and guard driven by hand."""
    from tensile_hook import activate, deactivate

    yield activate(HookSettings(job="job"), planner=lambda workload, budget: None, device=torch.device("cpu"))
    deactivate()
