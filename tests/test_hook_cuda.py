"""The hook on a real GPU (skipped where PyTorch sees none: CI has none; a lent GPU machine runs it): what the
CPU device cannot show, the CUDA allocator's own bytes beside the tensors a plan moves."""

from __future__ import annotations

import pytest
import torch

from tensile.runtime_hook import activate, deactivate
from tensile.runtime_hook.plan_source import local_planner
from tensile.runtime_hook.report import HookReport
from tensile.runtime_hook.settings import HookSettings
from tensile.zoo import build_zoo_parts
from test_hook_correctness import assert_identical, state_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS = 7  # recorded 0-1, aligned 2, native from 3


@pytest.fixture(autouse=True)
def deterministic():  # type: ignore[no-untyped-def]
    torch.use_deterministic_algorithms(True, warn_only=True)  # cuBLAS wants CUBLAS_WORKSPACE_CONFIG for the strict kind
    torch.backends.cudnn.benchmark = False
    yield
    torch.use_deterministic_algorithms(False)


def _train(budget: float | None) -> tuple[dict, HookReport | None]:
    device = torch.device("cuda", 0)
    executor = None
    if budget is not None:
        settings = HookSettings(job="job", memory_budget=budget)
        executor = activate(settings, planner=local_planner(settings, device), device=device)
    try:
        torch.manual_seed(1234)
        model, batch, loss_fn, make_optimizer = build_zoo_parts("resnet50", 8, device="cuda")
        optimizer = make_optimizer(model.parameters())
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()
        report = executor.report if executor else None
    finally:
        if executor is not None:
            deactivate()
    return state_of(model, [optimizer]), report


def test_a_budgeted_job_runs_natively_with_the_libraries_workspaces_booked_outside_its_budget():
    """The allocator's peak holds cuDNN's and cuBLAS's workspaces, which no plan moves (about 100 MB for ResNet-50 on
    an H100): held to the budget alone, a plan that kept it ran on the dispatch path ever after, 3.7x slower."""
    plain, _ = _train(None)
    hooked, report = _train(0.6)
    assert report is not None and report.stood_down is None
    assert_identical(plain, hooked)
    assert report.workspace_bytes and report.workspace_bytes > 0, report.workspace_bytes
    steady = report.iterations[3:]
    assert [it.path for it in steady] == ["native"] * len(steady), report.messages
    assert report.memory_budget_bytes and report.guard_slack_bytes
    for it in steady:
        assert it.peak_bytes <= report.memory_budget_bytes + report.workspace_bytes + report.guard_slack_bytes
        assert it.swap_out_bytes > 0
