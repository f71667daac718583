"""The native path: after the matched iteration an event-free plan leaves the dispatch mode, trains
bit-identically, and comes back to the dispatch mode when a plan needs it (unmappable events, a newer
plan from the agent, a budget to guard)."""

from __future__ import annotations

import pytest
import torch

from tests.support import tracing_models
from tensile.plan import Event, Plan
from tensile_hook import activate, deactivate
from tensile_hook.executor import PlanExecutor
from tensile_hook.settings import HookSettings
from tensile.workload import Workload
from tests.support.bit_identity import assert_identical
from tests.support.plans import aggressive_plan
from tests.support.training import STEPS, fit, fit_model, state_of, train

pytestmark = pytest.mark.usefixtures("deterministic")


def empty_plan(workload: Workload, budget: int | None = None) -> Plan:
    return Plan("job", 1, workload.signature, [])


def one_swap(workload: Workload, budget: int | None = None) -> Plan:
    """The aggressive plan's first cross-iteration swap of an updated parameter or optimizer state
    only: events the native path cannot carry (activation swaps: tests/hook/test_native_swaps.py)."""
    events = aggressive_plan(workload).events
    back = next(e for e in events if e.kind == "swap_in" and e.next_iteration)
    out = next(e for e in events if e.kind == "swap_out" and e.tensor == back.tensor)
    return Plan("job", 1, workload.signature, [out, back])


def test_an_empty_plan_leaves_the_dispatch_mode_and_trains_identically():
    plain, _ = train(tracing_models.views, 4)
    hooked, report = train(tracing_models.views, 4, planner=empty_plan)
    assert_identical(plain, hooked)
    paths = [it.path for it in report.iterations]
    assert paths[:3] == ["dispatch"] * 3 and paths[3:] == ["native"] * (STEPS - 3), paths
    native = [it for it in report.iterations if it.path == "native"]
    assert all(it.peak_source == "planned" and it.peak_bytes == report.vanilla_peak_bytes for it in native)
    assert all(it.mode == "planned" and it.seconds > 0 for it in native)


def test_an_observed_native_iteration_measures_its_peak():
    executor = activate(HookSettings(job="job"), planner=empty_plan, device=torch.device("cpu"))
    executor.observe_native = True
    try:
        fit_model(tracing_models.views, 4)
    finally:
        deactivate()
    native = [it for it in executor.report.iterations if it.path == "native"]
    assert native and all(it.peak_source == "measured" for it in native)
    # the parameters and optimizer state alone are resident: a real measurement, never above vanilla
    assert all(0 < it.peak_bytes <= executor.report.vanilla_peak_bytes for it in native)


def test_a_plan_with_an_unmappable_event_stays_on_the_dispatch_path():
    plain, _ = train(tracing_models.tied, 4)
    hooked, report = train(tracing_models.tied, 4, planner=one_swap)
    assert_identical(plain, hooked)
    assert any("do not map onto native hooks" in m and "swap_out of tensor" in m for m in report.messages)
    planned = [it for it in report.iterations if it.mode == "planned"]
    assert planned and all(it.path == "dispatch" and it.events["swap_out"] == 1 for it in planned)


def newer_plan_once(executor: PlanExecutor):  # type: ignore[no-untyped-def]
    """A listener that, after the first native iteration, offers the aggressive plan as version 2 (the
    agent re-planning while the hook runs natively)."""
    offered: list[Plan] = []

    def listener(stats, report):  # type: ignore[no-untyped-def]
        if stats.path == "native" and executor.live is not None and not offered:
            offered.append(aggressive_plan(executor.live))
            offered[0].version = 2
            return offered[0]
        return None

    return listener


def test_a_newer_plan_with_events_brings_the_dispatch_mode_back():
    """The agent re-plans while the hook runs natively: the next iteration enters the dispatch mode
    again and applies the new plan's events; training stays bit-identical."""
    executor = activate(HookSettings(job="job"), planner=empty_plan, device=torch.device("cpu"))
    executor.iterations.listener = newer_plan_once(executor)
    try:
        hooked = fit(tracing_models.views, 4, STEPS + 2)
    finally:
        deactivate()
    iterations = executor.report.iterations
    assert [it.path for it in iterations[3:5]] == ["native", "dispatch"], [it.path for it in iterations]
    assert iterations[4].plan_version == 2 and iterations[4].events["swap_out"] > 0
    assert_identical(fit(tracing_models.views, 4, STEPS + 2), hooked)


def test_a_budget_the_plan_does_not_keep_stays_guarded_on_the_dispatch_path():
    plain, _ = train(tracing_models.views, 8)
    hooked, report = train(tracing_models.views, 8, planner=empty_plan, budget=0.5)
    assert_identical(plain, hooked)
    assert all(it.path == "dispatch" for it in report.iterations)
    assert all(it.passive_evictions > 0 for it in report.iterations[3:])
    said = [m for m in report.messages if "against a memory budget" in m]
    assert len(said) == 1 and "comes without a forecast of its scheduled peak" in said[0], report.messages


def test_an_event_that_maps_is_a_release_pytorch_makes_itself():
    from tensile_hook.native_map import map_plan

    workload = tracing_models_workload()
    temp = next(t for t in workload.tensors.values() if t.created_by >= 0 and t.freed_after is not None)
    plan = Plan("job", 1, workload.signature, [Event("job", "release", temp.id, temp.created_by)])
    assert map_plan(plan, workload, set()).unmapped == []
    plan.events.append(Event("job", "recompute", temp.id, temp.freed_after))
    assert len(map_plan(plan, workload, set()).unmapped) == 2


def tracing_models_workload() -> Workload:
    from tensile.forecast import trace_workload

    return trace_workload("examples/tiny_mlp.py:build", 8, optimizer=None, device="cpu", live=True)


class _ModuleHooksSeen(torch.nn.Module):
    """Wraps a model; each call notes how many global module forward pre-hooks are installed."""

    def __init__(self, inner: torch.nn.Module, seen: list[int]) -> None:
        super().__init__()
        self.inner, self.seen = inner, seen

    def forward(self, *args):  # type: ignore[no-untyped-def]
        self.seen.append(len(torch.nn.modules.module._global_forward_pre_hooks))
        return self.inner(*args)


def test_a_native_iteration_runs_its_module_calls_without_global_hooks():
    """The global pre-hook that sees a native iteration start goes once it has: any global module hook
    sends every module call through PyTorch's slow path (0.5-1 ms an iteration on 202 tiny module calls)."""
    seen: list[int] = []

    def build(batch_size: int):  # type: ignore[no-untyped-def]
        model, batch, loss_fn, make_optimizer = tracing_models.views(batch_size)
        return _ModuleHooksSeen(model, seen), batch, loss_fn, make_optimizer

    plain, _ = train(build, 4)
    seen.clear()
    hooked, report = train(build, 4, planner=empty_plan)
    assert_identical(plain, hooked)
    native = [it.iteration for it in report.iterations if it.path == "native"]
    assert len(native) == STEPS - 3 and len(seen) == STEPS
    # the wrapper's call is each iteration's first module call: the start hook is gone before it runs
    assert seen[native[0]:] == [0] * len(native), seen
    assert not torch.nn.modules.module._global_forward_pre_hooks  # and none is left after deactivation


def test_iterations_go_on_being_counted_while_a_users_dispatch_mode_holds_the_stack():
    """The hook cannot push its mode above another: a newer plan that needs the dispatch path is then not
    applied, and the iterations after it start at a module call (the global pre-hook comes back at the step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    steps = STEPS + 2
    executor = activate(HookSettings(job="job"), planner=empty_plan, device=torch.device("cpu"))
    executor.iterations.listener = newer_plan_once(executor)
    user_mode = Passthrough()
    try:
        torch.manual_seed(1234)
        model, batch, loss_fn, make_optimizer = tracing_models.views(4)
        optimizer = make_optimizer(model.parameters())
        for step in range(steps):
            if step == 4:  # after a native iteration, with the hook's mode off the stack
                user_mode.__enter__()
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()
        user_mode.__exit__(None, None, None)
        hooked = state_of(model, [optimizer])
    finally:
        deactivate()
    iterations = executor.report.iterations
    assert [it.iteration for it in iterations] == list(range(steps)), [it.iteration for it in iterations]
    assert any("another dispatch mode is active" in m for m in executor.report.messages)
    assert all(it.events["swap_out"] == 0 for it in iterations[4:])  # the newer plan was never applied
    assert_identical(fit(tracing_models.views, 4, steps), hooked)


def test_only_global_hooks_of_other_packages_count_as_foreign():
    """The native path stands aside while someone else's global module hook sees every call; its own do not count (a
    prefix test that still named the package's earlier import path counted them, and no native swap ran)."""
    from tensile_hook.native_align import foreign_global_hooks
    from tensile_hook.shapes import ShapeSet

    before = foreign_global_hooks()
    shapes = ShapeSet.__new__(ShapeSet)  # any bound method of a tensile_hook class stands for the hook's own
    own = torch.nn.modules.module.register_module_forward_pre_hook(shapes.__repr__)  # type: ignore[arg-type]
    users = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        assert foreign_global_hooks() == before + 1
    finally:
        own.remove()
        users.remove()
    assert foreign_global_hooks() == before
