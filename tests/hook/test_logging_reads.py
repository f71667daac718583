"""Reads a script makes in some steps only (`loss.item()` logging, `torch.equal`, `if flag:`) make no device tensor and
write none: the dispatch path lets one the plan does not have run outside its op stream, and passes over the plan's
own where an iteration does not make them (the recorded iteration logged), firing their events. Before, logging every
tenth step made that step diverge from the plan at the read (`op 151 is aten._local_scalar_dense.default, the plan
expected aten.randn.generator`)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tensile_hook import activate, deactivate
from tensile_hook.dispatch import reads_only
from tensile_hook.plan_source import local_planner
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings
from tests.support.bit_identity import assert_identical
from tests.support.training import state_of

pytestmark = pytest.mark.usefixtures("deterministic")

STEPS = 8
CPU = torch.device("cpu")


def test_reads_are_the_ops_that_return_no_tensor_and_write_none():
    aten = torch.ops.aten
    assert all(reads_only(op) for op in (aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default))
    assert not any(reads_only(op) for op in (aten.sum.default, aten.add_.Tensor, aten._foreach_add_.Scalar,
                                             aten.randn.generator, aten.detach.default))


def _loop(parity: int) -> tuple[dict, list]:
    """An MLP whose batches come after the step (so the next batch's ops end the plan's iteration), logging after
    every other step: the loss, a comparison of weights, a flag read with `if`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    keep_going = torch.ones((), dtype=torch.bool)
    logged: list = []
    x, y = torch.randn(32, 16, generator=generator), torch.randint(0, 4, (32,), generator=generator)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step % 2 == parity:
            logged += [loss.item(), torch.equal(model[0].weight, model[0].weight)]
            if keep_going:
                logged.append(step)
        x, y = torch.randn(32, 16, generator=generator), torch.randint(0, 4, (32,), generator=generator)
    return state_of(model, [optimizer]), logged


@pytest.mark.parametrize("parity", [0, 1], ids=["reads-outside-the-recorded-iteration", "reads-in-the-recorded-iteration"])
def test_a_loop_logging_every_other_step_stays_planned(parity, caplog):
    plain = _loop(parity)
    settings = HookSettings(job="job", memory_budget=0.6)
    executor = activate(settings, planner=local_planner(settings, CPU), device=CPU)
    try:
        with caplog.at_level(logging.INFO, logger="tensile.hook"):
            hooked = _loop(parity)
    finally:
        deactivate()
    report: HookReport = executor.report
    assert_identical(plain[0], hooked[0])
    assert plain[1] == hooked[1]
    assert report.stood_down is None, report.stood_down
    modes = [it.mode for it in report.iterations]
    assert modes[2:] == ["planned"] * (STEPS - 2), (modes, report.messages)
    assert {it.path for it in report.iterations[2:]} == {"dispatch"}  # where the op stream is followed
    assert not any("diverged" in m or "left it" in m for m in report.messages), report.messages
    assert "diverged" not in caplog.text
    assert executor.live is not None  # the recorded iteration keeps its reads: a forecast traced with them matches
    assert any(op.name == "aten._local_scalar_dense.default" for op in executor.live.ops) == (parity == 1)
