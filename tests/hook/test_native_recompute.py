"""Releases and recomputes carried on the native path: an activation freed after its last forward use and
regenerated before backward reads it, from the inputs autograd saved behind it, with no dispatch mode;
training stays bit-identical and the measured peak falls."""

from __future__ import annotations

import sys
import time

import pytest
import torch
from torch import nn

from tensile_hook import native_swaps, residency
from tensile_hook.native_recipes import learn
from tensile_hook.recipes import Recipe, Step
from tensile_hook.settings import HookSettings
from tests.support.bit_identity import assert_identical
from tests.support.native_training import (STEPS, assert_blocks_recomputed_natively, blocks, hooked, image_classifier,
                                           noisy)
from tests.support.plans import every_recompute, feature_recomputes
from tests.support.training import fit

pytestmark = pytest.mark.usefixtures("deterministic")


@pytest.mark.slow
def test_recomputes_are_carried_natively_and_train_bit_identically():
    plain = fit(blocks, 4, STEPS)
    state, report = hooked(blocks, feature_recomputes)
    assert_identical(plain, state)
    assert not any("align" in m or "map" in m for m in report.messages), report.messages
    assert_blocks_recomputed_natively(report)


@pytest.mark.slow
def test_the_replays_time_is_the_recomputes_not_the_hooks_own(monkeypatch):
    """`recompute_seconds` holds the recomputes' replays (the forward's ops run again), apart from `hook_seconds`, the
    hook's own logic, on both paths: each replay made to last 1,000 s longer lands in the first, not in the second.
    (The one check of a new recipe, a replay compared byte for byte where its op first runs under a plan, is the
    hook's.) The hook's clocks are moved on rather than slept on, so a loaded host cannot make its own logic look
    as long as the replays: an earlier version slept 0.2 s a replay, and the aligning iteration's logic, 0.1 s on a
    quiet host, took 0.55 s under a loaded test run."""
    slow, replays, skipped = 1000.0, [], [0.0]
    replay, real = Step.replay, time.perf_counter

    def clock() -> float:
        return real() + skipped[0]

    def slowed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if sys._getframe(1).f_code.co_name == "_recompute":
            replays.append(self.func)
            skipped[0] += slow
        return replay(self, *args, **kwargs)

    monkeypatch.setattr(Step, "replay", slowed)
    for module in (residency, native_swaps):
        monkeypatch.setattr(module, "perf_counter", clock)
    monkeypatch.setattr(time, "perf_counter", clock)  # the executor's other timers read `time.perf_counter()`
    _, report = hooked(blocks, feature_recomputes)
    assert_blocks_recomputed_natively(report)
    iterations = report.iterations
    assert [it.recompute_seconds for it in iterations[:2]] == [0.0, 0.0]  # recorded: nothing released
    each = len(replays) / len(iterations[2:])  # conv1, bn1 and its ReLU, conv2: the same every iteration
    assert each == 4, replays
    for it in iterations[2:]:
        assert it.recompute_bytes and it.recompute_seconds >= each * slow, (it.path, it.recompute_seconds)
        assert it.seconds >= each * slow, (it.path, it.seconds)  # the iteration's own clock saw them too
        # the aligning iteration's own logic takes ~0.1 s here, a native one's < 1 ms; counted, the replays add 4,000 s
        assert 0 <= it.hook_seconds < slow, (it.path, it.hook_seconds)


@pytest.mark.slow
def test_recomputes_and_swaps_together_lower_the_measured_peak():
    """A recompute reads a tensor the same iteration swapped out (batch norm's input, a convolution's output):
    it comes back first. Measured (an observed native iteration), the peak stays below both plans' parts."""
    plain = fit(blocks, 4, STEPS)
    both = lambda workload, budget=None: feature_recomputes(workload, budget, swap_the_rest=True)  # noqa: E731
    state, report = hooked(blocks, both, observe=True)
    assert_identical(plain, state)
    native = [it for it in report.iterations if it.path == "native"]
    assert len(native) == STEPS - 3, [(it.path, it.mode) for it in report.iterations]
    for it in native:
        assert it.peak_source == "measured" and it.events["release"] == 3 and it.events["swap_out"] > 0, it.events
        assert it.peak_bytes < report.vanilla_peak_bytes, (it.peak_bytes, report.vanilla_peak_bytes)


def test_a_divergence_mid_iteration_recomputes_what_was_released():
    """Forward call 5 (iteration 4) takes another branch after the releases: the abort brings every tensor back, a
    released one by its replay, from the inputs bound at its release."""
    build = lambda n: blocks(n, frozenset({5}))  # noqa: E731
    plain = fit(build, 4, STEPS)
    state, report = hooked(build, feature_recomputes)
    assert_identical(plain, state)
    assert [(it.path, it.mode) for it in report.iterations[3:]] == [
        ("native", "planned"), ("native", "diverged"), ("dispatch", "planned"), ("native", "planned")]
    assert report.iterations[4].events["release"] == 3 and report.iterations[4].recompute_bytes > 0


def test_dropout_trains_bit_identically_with_its_output_recomputed_natively():
    """On the CPU device dropout is a multiplication by a noise tensor that `bernoulli_` filled: its output is
    replayed from the saved noise, and the noise, no module's value, stays on the device (native plans preferred,
    as on CUDA by default), named in the report."""
    plain = fit(noisy, 4, STEPS)
    state, report = hooked(noisy, every_recompute, settings=HookSettings(job="job", plan_events="native"))
    assert_identical(plain, state)
    assert any("1 swaps of plan version 1 do not align" in m and "they stay on the device" in m for m in report.messages), \
        report.messages
    for it in report.iterations[3:]:
        assert (it.path, it.mode) == ("native", "planned") and it.events["release"] == 2, (it.path, it.mode, it.events)


def test_a_recipe_that_draws_random_numbers_is_not_replayed_natively():
    """CUDA's dropout is one op that draws from the generator (`native_dropout`): a native iteration cannot set the
    state it drew from, so its output is not recomputed there."""
    x = torch.randn(4, 8, requires_grad=True)
    out, _ = torch.ops.aten.native_dropout.default(x, 0.5, True)
    step = Step(torch.ops.aten.native_dropout.default, (x, 0.5, True), {}, torch.get_rng_state(), True)
    recipe = Recipe(step, 0, (tuple(out.shape), out.stride(), out.storage_offset()))
    assert "random op" in learn(recipe, out.grad_fn, id(out.untyped_storage()))


class WrittenLater(nn.Module):
    """A batch norm's output written in place by a functional ReLU, then read by a functional convolution: no
    module call holds it after the write."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.weight = nn.Parameter(torch.randn(8, 8, 3, 3) * 0.1)
        self.fc = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        y.relu_()
        return self.fc(nn.functional.conv2d(y, self.weight, padding=1).flatten(1))


def written_later(batch_size: int) -> tuple:
    return image_classifier(WrittenLater, batch_size)


def test_a_tensor_written_in_place_after_its_last_module_call_is_not_recomputed_natively():
    """Taken at the batch norm's exit, the ReLU after it would be missing from a recipe learnt there: that recompute
    stays on the device (native plans preferred), the convolution's is carried."""
    plain = fit(written_later, 4, STEPS)
    state, report = hooked(written_later, every_recompute, settings=HookSettings(job="job", plan_events="native"))
    assert_identical(plain, state)
    assert any("an op wrote it in place after the module call that takes it" in m for m in report.messages), report.messages
    for it in report.iterations[3:]:
        assert (it.path, it.mode) == ("native", "planned") and it.events["release"] == 1, (it.path, it.mode, it.events)
