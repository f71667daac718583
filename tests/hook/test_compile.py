"""torch.compile under the hook: TorchDynamo does not compile while a dispatch mode is on the stack, and
then skips that code for the rest of the process, so a compiled model trains eagerly under Tensile. The
training must stay correct and the report must say so: a user who compiled for speed is told why it is gone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensile_hook import activate, deactivate
from tensile_hook.settings import HookSettings
from tests.support.bit_identity import assert_identical
from tests.support.native_training import blocks
from tests.support.plans import feature_swaps
from tests.support.training import fit

pytestmark = pytest.mark.usefixtures("deterministic")


def compiled_blocks(batch_size: int) -> tuple:
    """The native-swaps test model behind `torch.compile` (the eager backend: no C compiler needed, and eager
    numerics, so a run that did compile and one that did not agree bit for bit)."""
    model, batch, loss_fn, make_optimizer = blocks(batch_size)
    compiled = torch.compile(model, backend="eager")

    def compiled_loss(_model: nn.Module, batch: tuple) -> torch.Tensor:
        return loss_fn(compiled, batch)

    return model, batch, compiled_loss, make_optimizer


@pytest.mark.slow
def test_a_compiled_model_trains_eagerly_under_the_hook_and_the_report_says_so():
    import torch._dynamo

    torch._dynamo.reset()
    plain = fit(compiled_blocks, 4, 6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile without Tensile
    torch._dynamo.reset()
    executor = activate(HookSettings(job="job"), planner=feature_swaps, device=torch.device("cpu"))
    try:
        hooked = fit(compiled_blocks, 4, 6)
    finally:
        deactivate()
        torch._dynamo.reset()
    assert_identical(plain, hooked)
    report = executor.report
    assert any(it.mode == "planned" and it.swap_out_bytes > 0 for it in report.iterations)
    said = [m for m in report.messages if "torch.compile" in m]
    assert len(said) == 1 and "eager" in said[0]


def test_a_model_that_is_not_compiled_hears_nothing_of_torch_compile():
    executor = activate(HookSettings(job="job"), planner=feature_swaps, device=torch.device("cpu"))
    try:
        fit(blocks, 4, 4)
    finally:
        deactivate()
    assert not any("torch.compile" in m for m in executor.report.messages)


def test_code_compiled_in_native_iterations_compiles_and_hears_nothing():
    """A validation function compiled and first called after step 5, in native iterations, where the dispatch mode
    is off: TorchDynamo compiles it as without Tensile, and the report does not say it ran eagerly."""
    import torch._dynamo

    torch._dynamo.reset()
    executor = activate(HookSettings(job="job"), planner=feature_swaps, device=torch.device("cpu"))
    try:
        torch.manual_seed(1234)
        model, batch, loss_fn, make_optimizer = blocks(4)
        optimizer = make_optimizer(model.parameters())
        evaluate = torch.compile(lambda x: model(x).argmax(1), backend="eager")
        for step in range(8):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()
            if step >= 5:
                with torch.no_grad():
                    evaluate(batch[0])
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        deactivate()
        torch._dynamo.reset()
    report = executor.report
    assert [it.path for it in report.iterations[5:]] == ["native"] * 3, [it.path for it in report.iterations]
    assert compiled > 0
    assert not any("torch.compile" in m for m in report.messages), report.messages
