"""Memory under the real planner: the measured peak matches the scheduled-peak forecast, never
exceeds the vanilla peak, and a 0.6 budget holds, on ResNet-50 and BERT-base (CPU device)."""

from __future__ import annotations

import pytest
import torch

from tensile.job_forecast import make_forecast
from tensile_hook import activate, deactivate
from tensile_hook.plan_source import local_planner
from tensile_hook.report import HookReport, IterationStats
from tensile_hook.settings import HookSettings
from tensile.zoo import build_zoo_parts
from tests.support.bit_identity import assert_identical
from tests.support.training import fit, train
from tests.support.training import import_example as _import_example

pytestmark = pytest.mark.usefixtures("deterministic")

CASES = {"resnet50": (4, None), "bert_base": (1, (32,))}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(CASES))
def test_budget_0_6_holds_and_the_forecast_is_what_runs(model):
    batch_size, input_shape = CASES[model]

    def build(batch: int):
        net, data, loss_fn, _ = build_zoo_parts(model, batch, device="cpu", input_shape=input_shape)
        return net, data, loss_fn, lambda params: torch.optim.Adam(params, lr=1e-3)

    planner = local_planner(HookSettings(job="job"), torch.device("cpu"))
    plain, _ = train(build, batch_size)
    hooked, report = train(build, batch_size, planner=planner, budget=0.6)
    assert_identical(plain, hooked)
    assert report.stood_down is None and report.plan_source == "local"
    steady = [it for it in report.iterations if it.mode == "planned"][1:]  # the first planned one starts from an unplanned state
    assert len(steady) >= 2
    for it in steady:
        assert it.peak_bytes <= report.vanilla_peak_bytes
        # never above the forecast the job was admitted by (5% tolerance); on the CPU device copies
        # are synchronous, so memory leaves sooner than the planner's transfer model says and the
        # measured peak can sit below the forecast (BERT-base: 1,014 vs 1,103 MiB)
        assert it.peak_bytes <= report.scheduled_peak_bytes * 1.05
        assert it.peak_bytes >= report.scheduled_peak_bytes * 0.85
        assert it.peak_bytes <= 0.6 * report.vanilla_peak_bytes + report.guard_slack_bytes
        assert it.swap_out_bytes > 0


def _native_plans_observed(model, batch, loss_fn, make_optimizer) -> tuple[HookReport, list[IterationStats]]:  # type: ignore[no-untyped-def]
    """Five steps under CUDA's default plans (native events only) from the in-process planner, the native path
    observed (its CPU peak measured): the report and its planned native iterations."""
    settings = HookSettings(job="job", plan_events="native")
    optimizer = make_optimizer(model.parameters())
    executor = activate(settings, planner=local_planner(settings, torch.device("cpu")), device=torch.device("cpu"))
    executor.observe_native = True
    try:
        for _ in range(5):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()
    finally:
        deactivate()
    report = executor.report
    return report, [it for it in report.iterations if it.path == "native" and it.mode == "planned"]


@pytest.mark.slow
def test_with_native_plans_the_forecast_is_what_the_native_path_measures():
    """CUDA's default plans (native events only), carried natively and measured there (observe_native):
    the peak the job is admitted by is what its native iterations reach. These plans used to swap gradients
    too, made in backward, which the native path cannot carry: this ResNet-50 was forecast at 345 MB and
    measured 428 MB natively, 16 of its 37 swaps dropped; now 424 MB against 428 MB, every swap carried."""
    report, native = _native_plans_observed(*build_zoo_parts("resnet50", 2, device="cpu", input_shape=(3, 128, 128)))
    assert len(native) >= 2 and not any("do not align" in m for m in report.messages), report.messages
    for it in native:
        assert it.peak_source == "measured" and it.events["swap_out"] > 0
        assert report.scheduled_peak_bytes * 0.95 <= it.peak_bytes <= report.scheduled_peak_bytes * 1.05


def test_a_native_plan_counts_no_release_pytorch_does_not_make_there():
    """A foreach AdamW's optimizer phase is the tiny MLP's peak: its gradients live until the next zero_grad,
    which the native path leaves to PyTorch. Native plans released them after their last read in the forecast
    (6,488,508 bytes) while the native iterations reached 8,020,448; now a native plan has no releases and its
    forecast is what the native path measures."""

    def build(batch: int):  # type: ignore[no-untyped-def]
        model, data, loss_fn, _ = _import_example("tiny_mlp")(batch)
        return model, data, loss_fn, lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True)

    report, native = _native_plans_observed(*build(32))
    assert native and all(it.peak_source == "measured" for it in native), report.iterations
    assert all(it.peak_bytes <= report.scheduled_peak_bytes * 1.05 for it in native), \
        ([it.peak_bytes for it in native], report.scheduled_peak_bytes)


@pytest.mark.slow
def test_a_plan_carried_out_exactly_never_measures_above_its_forecast():
    """`tensile forecast --memory-budget 0.8` on the tiny MLP's workload, then training under that plan: the
    forecast allocates a swap-in (or a recompute) after its trigger op's inputs that nothing reads later are freed,
    and the hook now fires it at the next op's entry. Fired right after its trigger op, while such a 1 MiB input
    was alive, every planned iteration measured 6,978,232 bytes against the 6,582,944 forecast (+6%)."""
    build, seen = _import_example("tiny_mlp"), []
    train(build, 64, planner=lambda live, budget: seen.append(live))
    plan = make_forecast(seen[0], "cpu", 0.8).plan
    assert {"swap_in", "swap_out"} <= {e.kind for e in plan.events} and plan.forecast is not None
    plain, _ = train(build, 64)
    hooked, report = train(build, 64, planner=lambda live, budget: plan)
    assert_identical(plain, hooked)
    planned = [it for it in report.iterations if it.mode == "planned"]
    assert planned and all(it.events["swap_in"] > 0 for it in planned)
    assert all(it.peak_bytes <= plan.forecast.scheduled_peak_bytes for it in planned), \
        ([it.peak_bytes for it in planned], plan.forecast.scheduled_peak_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("own_budget", [None, 0.9])
def test_a_plan_file_holds_the_job_to_its_budget_unless_the_job_has_its_own(own_budget):
    """`tensile forecast --memory-budget 0.8 --save-plan` wrote no budget, so `tensile run --plan` ran the plan with
    the budget guard off. The plan's budget now applies; a budget the user gave stands."""
    build, seen = _import_example("tiny_mlp"), []
    train(build, 64, planner=lambda live, budget: seen.append(live))
    plan = make_forecast(seen[0], "cpu", 0.8).plan
    assert plan.memory_budget_bytes is not None and plan.forecast is not None
    executor = activate(HookSettings(job="job", memory_budget=own_budget), plan, seen[0], device=torch.device("cpu"))
    try:
        hooked = fit(build, 64)
    finally:
        deactivate()
    report = executor.report
    assert report.plan_source == "file" and report.signature_match
    assert_identical(train(build, 64)[0], hooked)
    vanilla = plan.forecast.vanilla_peak_bytes
    if own_budget is None:
        assert report.memory_budget_bytes == plan.memory_budget_bytes
        assert any("holds the job to the memory budget it was made for" in m for m in report.messages), report.messages
    else:
        assert report.memory_budget_bytes == int(own_budget * vanilla)
        assert any("the job keeps its own" in m for m in report.messages), report.messages
