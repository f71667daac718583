"""A batch whose shapes change mid-run: a curriculum that doubles it, bf16 autocast from some step on, an epoch's
smaller last batch. The hook sees the change at the iteration's first module call, records that iteration and plans
from it, as at a signature mismatch, so the memory budget holds at the new shapes (before, the native path ran the
old shapes' plan on them, over the budget); it keeps a plan per shape set, so shapes that come back are not planned
again. Training stays bit-identical to the run without Tensile. Native iterations are observed (`observe_native`):
their CPU peak is measured, not taken from the plan's forecast."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tensile.agent_client import AgentClient
from tensile.plan import Plan
from tensile_hook import activate, deactivate
from tensile_hook.agent_link import AgentLink
from tensile_hook.iterations import IterationListener
from tensile_hook.plan_book import Planner
from tensile_hook.plan_source import local_planner
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings
from tensile.workload import Workload
from tests.support.agent_harness import agent_job as _job
from tests.support.bit_identity import assert_identical
from tests.support.hook_reports import moved, paths_and_modes
from tests.support.linked_hook import agent_settings as _agent_settings
from tests.support.loops import EPOCHS, Loop, Results, batches, final, losses_loop, sgd
from tests.support.plans import pooled_swaps

pytestmark = pytest.mark.usefixtures("deterministic")

CPU = torch.device("cpu")
DOUBLED = [16] * 4 + [32] * 4  # the batch doubles at step 4: iteration 4


def hooked(loop: Loop, settings: HookSettings, planner: Planner,
           listener: IterationListener | None = None) -> tuple[Results, HookReport]:
    """`loop` under the hook, its native iterations observed."""
    executor = activate(settings, planner=planner, device=CPU, listener=listener)
    executor.observe_native = True
    try:
        return loop(), executor.report
    finally:
        deactivate()


def planned_again(report: HookReport, at: int, change: str) -> None:
    """Every iteration from `at` on measured under the budget plus the guard's slack; iteration `at` recorded on the
    new shapes, said once, and the iterations after it run under the plan made from it (the in-process planner's
    version 2)."""
    assert report.memory_budget_bytes is not None and report.guard_slack_bytes is not None
    limit = report.memory_budget_bytes + report.guard_slack_bytes
    over = [(it.iteration, it.path, it.peak_bytes) for it in report.iterations[at:] if it.peak_bytes > limit]
    assert not over and all(it.peak_source == "measured" for it in report.iterations), (over, limit)
    said = [m for m in report.messages if "shapes changed" in m]
    expected = f"iteration {at}: the batch's shapes changed at iteration {at} ({change}); planning again"
    assert said == [expected], report.messages
    assert report.iterations[at].mode == "recording", paths_and_modes(report)
    after = report.iterations[at + 1:]
    assert after and all(it.mode == "planned" and it.plan_version == 2 for it in after), paths_and_modes(report)


def deep_cnn() -> nn.Module:
    """Six 16-channel convolutions: activations outweigh the parameters, and one op's inputs and outputs (the guard's
    slack) are a third of the peak, not most of it."""
    torch.manual_seed(1234)
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()]
    for _ in range(5):
        layers += [nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def shaped_loop(sizes: Sequence[int], autocast_from: int | None = None) -> Loop:
    """`deep_cnn` trained on batches of these sizes, each made at its step as a DataLoader makes it (all made before,
    they held the CPU device's measured peak above the plan's), the forward under bf16 autocast from step
    `autocast_from` on."""

    def loop() -> Results:
        model = deep_cnn()
        optimizer = sgd(model)
        losses = []
        for step, size in enumerate(sizes):
            x, y = batches([size], seed=step)[0]
            optimizer.zero_grad(set_to_none=True)
            bf16 = autocast_from is not None and step >= autocast_from
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return {"losses": losses, "state": final(model, optimizer)}

    return loop


def trained_and_planned_again(loop, budget: float, change: str) -> None:  # type: ignore[no-untyped-def]
    """The loop under the in-process planner, native plans, for `budget` of the vanilla peak: bit-identical to the
    plain run, never stood down, and planned again at iteration 4 for the shapes `change` says."""
    plain = loop()
    settings = HookSettings(job="job", memory_budget=budget, plan_events="native")
    result, report = hooked(loop, settings, local_planner(settings, CPU))
    assert_identical(plain, result)
    assert report.stood_down is None, report.stood_down
    planned_again(report, 4, change)


@pytest.mark.slow
def test_a_batch_doubled_mid_run_is_planned_again_within_the_budget() -> None:
    """CUDA's default plans (activation swaps, native), for a budget of the vanilla peak: the plan for batch 16 has
    no event. At batch 32 it ran native every other iteration, 1.17 MB against a budget of 0.64 MB and a slack of
    0.22 MB (unobserved, the report gave the forecast for batch 16 and said nothing). Now iteration 4 is recorded
    under the budget guard and planned from, for the budget the job started with (a fraction, made bytes once)."""
    trained_and_planned_again(shaped_loop(DOUBLED), 1.0, "[16, 3, 8, 8] float32 -> [32, 3, 8, 8] float32")


@pytest.mark.slow
def test_bf16_autocast_from_a_step_on_is_planned_again() -> None:
    """The input keeps its shape and dtype; the autocast dtype in force tells the workload changed. Before, the fp32
    plan's ops left the iterations from the first op cast to bf16: three ran diverged, guarded, before the next was
    recorded, and the fractional budget was made bytes again on the smaller bf16 peak (0.32 MB, not 0.51)."""
    trained_and_planned_again(shaped_loop([16] * 8, autocast_from=4), 0.8,
                              "[16, 3, 8, 8] float32 -> [16, 3, 8, 8] float32, bfloat16 autocast")


@pytest.mark.slow
def test_a_smaller_last_batch_each_epoch_is_planned_once() -> None:
    """Four epochs of batches 8, 8, 8, 5: each shape set is planned once. An epoch's short batch runs under its own
    plan, on the dispatch path (the step before it prepared the other plan's native hooks), and so does the full
    batch after it; the next iteration is native again. Before, every short batch ran native under the full
    batches' plan and fell back."""
    planned: list[str] = []

    def planner(live: Workload, budget: int | None) -> Plan:
        planned.append(live.signature)
        return pooled_swaps(live, budget)

    loop = losses_loop(EPOCHS)
    plain = loop()
    result, report = hooked(loop, HookSettings(job="job"), planner)
    assert_identical(plain, result)
    assert report.stood_down is None, report.stood_down
    assert len(planned) == len(set(planned)) == 2, paths_and_modes(report)
    assert sum("shapes changed" in m for m in report.messages) == 1, report.messages
    assert not any("left the learnt module calls" in m for m in report.messages), report.messages
    last_epoch = report.iterations[12:16]
    assert [it.path for it in last_epoch] == ["dispatch", "native", "native", "dispatch"], paths_and_modes(report)
    assert all(it.mode == "planned" and moved(it) for it in last_epoch), paths_and_modes(report)


def test_new_shapes_are_uploaded_to_the_agent_and_its_plan_for_them_applies(agent_server: Callable[..., Any]) -> None:
    """Through the node agent, the workload recorded on the new shapes is uploaded as at a signature mismatch: the
    agent plans that one, and its plan runs the iterations after it. The first match, not compared with any
    forecast, is no signature mismatch for the agent."""
    agent = agent_server()
    settings = _agent_settings(agent.url, "ns/doubled", agent_wait=30.0)
    client = AgentClient(agent.url, settings.job, max_backoff=0.2)
    link = AgentLink(settings, client, local_planner(settings, CPU)).start()
    at_agent: list[dict | None] = []
    doubled = losses_loop(DOUBLED)

    def loop() -> Results:
        results = doubled()
        at_agent.append(_job(agent.url, "doubled"))
        return results

    plain = doubled()
    try:
        result, report = hooked(loop, settings, link.planner, link.listener)
    finally:
        link.close()
    assert_identical(plain, result)
    job = at_agent[0]
    assert job is not None and job["signature"] == report.live_signature, (job, report.messages)
    assert report.plan_source == "agent" and report.signature_match is None, report.messages
    assert report.iterations[4].mode == "recording" and report.iterations[-1].plan_version == job["plan_version"] > 1
