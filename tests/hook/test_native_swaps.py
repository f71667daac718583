"""Activation swaps carried on the native path (module hooks and autograd node pre-hooks, no
dispatch mode): bit-identical training, a forward that leaves the learnt module calls falls back,
and the measured peak stays below vanilla."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.support import tracing_models
from tensile.knobs import memory_text
from tensile.devices import PRESETS
from tensile.peak import analyze_plan, analyze_vanilla
from tensile.plan import Event, Forecast, Plan
from tensile_hook import activate, deactivate
from tensile_hook.settings import HookSettings
from tensile.workload import Workload
from tests.support.bit_identity import assert_identical
from tests.support.native_training import (STEPS, Blocks, blocks, hooked, image_classifier,
                                           out_of_memory_in_a_native_backward)
from tests.support.plans import feature_swaps, first_uses
from tests.support.training import fit

pytestmark = pytest.mark.usefixtures("deterministic")


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_activation_swaps_are_carried_natively_and_train_bit_identically(micro_batches):
    plain = fit(blocks, 4, STEPS, micro_batches)
    state, report = hooked(blocks, feature_swaps, micro_batches=micro_batches)
    assert_identical(plain, state)
    assert report.stood_down is None and not any("align" in m or "map" in m for m in report.messages), report.messages
    iterations = report.iterations
    assert [it.path for it in iterations[:3]] == ["dispatch"] * 3
    swaps = iterations[2].events["swap_out"]
    # conv, batch norm / ReLU, add outputs and max pooling's indices (taken from its autograd node:
    # a swap that could not be taken would keep the plan on the dispatch path)
    assert swaps >= 5 * micro_batches, iterations[2].events
    native = iterations[3:STEPS]
    for it in native:
        assert it.path == "native" and it.mode == "planned", (it.path, it.mode)
        assert it.events["swap_out"] == swaps and it.events["swap_in"] == swaps, it.events
        assert it.swap_out_bytes == it.swap_in_bytes == iterations[2].swap_out_bytes
        assert it.stall_seconds == 0.0  # every tensor was back before its node ran
    # accounting sanity only: this model has nothing absent at the step that leaves the dispatch mode, so
    # the negative hook_seconds that ResNet-50 showed there (restores never timed) is not reproduced here
    assert all(it.hook_seconds >= 0 for it in iterations), [it.hook_seconds for it in iterations]


def test_the_native_path_says_which_module_calls_and_nodes_carry_the_plan():
    """`carried_by` (the overhead benchmark's rows): the hook's time grows with the boundaries and node hooks a plan
    is carried at, and plans made from measured latencies differ between runs, so each run says what it measured."""
    executor = activate(HookSettings(job="job"), planner=feature_swaps, device=torch.device("cpu"))
    try:
        fit(blocks, 4, STEPS)
        carried = executor.swaps.carried_by()
    finally:
        deactivate()
    assert carried is not None, executor.report.messages
    assert 0 < carried["roots"] <= carried["acting_boundaries"] < carried["boundaries"], carried
    assert set(carried) == {"boundaries", "acting_boundaries", "roots", "node_hooks", "node_hook_path_steps"}, carried
    assert carried["node_hooks"] >= carried["roots"], carried
    assert executor.swaps.carried_by() is None  # nothing is carried once the hook is off


def test_a_forward_that_takes_another_branch_falls_back_and_stays_bit_identical():
    """Forward call 5 (iteration 4, native) runs an extra module after the swap-outs: every
    tensor comes back, iteration 5 aligns again on the dispatch path, iteration 6 is native."""
    plain = fit(lambda n: blocks(n, frozenset({5})), 4, STEPS)
    state, report = hooked(lambda n: blocks(n, frozenset({5})), feature_swaps)
    assert_identical(plain, state)
    iterations = report.iterations
    assert [(it.path, it.mode) for it in iterations[3:STEPS]] == [
        ("native", "planned"), ("native", "diverged"), ("dispatch", "planned"), ("native", "planned")]
    assert iterations[4].events["swap_out"] > 0  # it had swapped out before it left the learnt calls
    assert iterations[4].events["swap_in"] == 0 and iterations[4].swap_in_bytes == iterations[4].swap_out_bytes
    assert any("iteration 4: the native iteration left the learnt module calls" in m for m in report.messages), report.messages
    assert report.stood_down is None


def test_a_dispatch_iteration_after_a_native_one_starts_at_its_first_op_on_a_parameter():
    """The forward starts with `x * 2` inside the model's own call: the recording put that op in
    the previous iteration (an iteration starts at its first op on a parameter), so the dispatch
    iteration after a native one must start there too, not at the first module call."""
    build = lambda n: blocks(n, frozenset({5}), prologue=True)  # noqa: E731
    plain = fit(build, 4, STEPS)
    state, report = hooked(build, feature_swaps)
    assert_identical(plain, state)
    iterations = report.iterations
    assert [(it.path, it.mode) for it in iterations[3:STEPS]] == [
        ("native", "planned"), ("native", "diverged"), ("dispatch", "planned"), ("native", "planned")], report.messages
    assert iterations[5].ops == iterations[2].ops and iterations[5].events == iterations[2].events
    assert not any("diverged from the plan" in m or "does not start as a planned iteration" in m
                   for m in report.messages), report.messages


def test_the_measured_native_peak_is_below_vanilla():
    plain = fit(blocks, 4, STEPS)
    state, report = hooked(blocks, feature_swaps, observe=True)
    assert_identical(plain, state)
    native = [it for it in report.iterations if it.path == "native"]
    assert len(native) == STEPS - 3
    assert all(it.peak_source == "measured" and it.events["swap_out"] > 0 for it in native)
    assert all(it.peak_bytes < report.vanilla_peak_bytes for it in native), (
        [it.peak_bytes for it in native], report.vanilla_peak_bytes)


def every_activation(workload: Workload, budget: int | None = None) -> Plan:
    uses = first_uses(workload)
    events = []
    for tensor in workload.tensors.values():
        backward = [i for i in uses.get(tensor.id, []) if workload.ops[i].phase == "backward"]
        if tensor.role == "activation" and tensor.created_by >= 0 and backward:
            last = max([tensor.created_by, *(i for i in uses[tensor.id] if workload.ops[i].phase == "forward")])
            events += [Event("job", "swap_out", tensor.id, last), Event("job", "swap_in", tensor.id, backward[0] - 1)]
    return Plan("job", 1, workload.signature, events)


def test_a_swap_after_the_last_module_call_keeps_the_plan_on_the_dispatch_path():
    """tracing_models.views reads some activations last after its last module call (the loss):
    no module boundary can trigger their swap-out, so the plan runs on the dispatch path (exact)
    and says why. (Its transposed and sliced tensors, no module's inputs or outputs, are taken
    from the autograd nodes that saved them.)"""
    plain = fit(tracing_models.views, 4, STEPS)
    state, report = hooked(tracing_models.views, every_activation)
    assert_identical(plain, state)
    assert any("do not align with module calls" in m and "no module call after its last forward use" in m for m in report.messages)
    planned = [it for it in report.iterations if it.mode == "planned"]
    assert len(planned) == STEPS - 2 and all(it.path == "dispatch" and it.events["swap_out"] > 0 for it in planned)


def test_with_native_plans_swaps_that_do_not_align_stay_on_the_device_and_the_rest_run_natively():
    """TENSILE_PLAN_EVENTS=native (CUDA's default): the same plan, its unaligned swaps dropped rather than
    every op going through the dispatch mode."""
    plain = fit(tracing_models.views, 4, STEPS)
    state, report = hooked(tracing_models.views, every_activation, settings=HookSettings(job="job", plan_events="native"))
    assert_identical(plain, state)
    assert any("they stay on the device; the native path carries the other" in m for m in report.messages), report.messages
    native = [it for it in report.iterations[3:] if it.mode == "planned"]
    assert len(native) == STEPS - 3 and all(it.path == "native" and it.events["swap_out"] > 0 for it in native)


def with_forecast(workload: Workload, plan: Plan) -> Plan:
    """The plan with the forecast a planner gives: the scheduled peak that counts every swap."""
    scheduled = analyze_plan(workload, plan.events, PRESETS["cpu"].host_link_bandwidth).peak_bytes
    plan.forecast = Forecast(analyze_vanilla(workload).peak_bytes, scheduled)
    return plan


def forecast_first(build=tracing_models.views, make: Callable[[Workload], Plan] = every_activation,  # type: ignore[no-untyped-def]
                   ) -> tuple[list[Forecast], Callable[[Workload, int | None], Plan]]:
    """A planner of `make`'s plan with its forecast that notes each forecast it makes, and its first
    forecast, made for the live workload of `build` before the test's run."""
    peaks: list[Forecast] = []

    def planner(workload: Workload, budget: int | None) -> Plan:
        plan = with_forecast(workload, make(workload))
        peaks.append(plan.forecast)
        return plan

    hooked(build, planner, steps=3)
    return peaks, planner


@pytest.mark.parametrize("room", [False, True])
def test_with_native_plans_and_a_budget_the_swaps_left_on_the_device_must_fit_it(room: bool):
    """The swaps that do not align stay on the device, but the scheduled peak counted their bytes as
    freed: under a budget that holds only with them (the scheduled peak itself), the plan runs on the
    dispatch path, guarded, and says why; with room for them (ten times the vanilla peak), natively."""
    plain = fit(tracing_models.views, 4, STEPS)
    peaks, planner = forecast_first()
    budget = 10 * peaks[0].vanilla_peak_bytes if room else peaks[0].scheduled_peak_bytes
    state, report = hooked(tracing_models.views, planner,
                           settings=HookSettings(job="job", plan_events="native", memory_budget=float(budget)))
    assert_identical(plain, state)
    assert peaks[-1] == peaks[0]
    over = any("could take the job over its memory budget" in m for m in report.messages)
    native = [it for it in report.iterations if it.path == "native" and it.events["swap_out"] > 0]
    assert (over, bool(native)) == (not room, room), report.messages


@pytest.mark.parametrize("events", ["native", "all"])
def test_a_plan_whose_forecast_the_budget_does_not_hold_says_why_it_runs_guarded(events: str):
    """A budget under the plan's own scheduled peak: every planned iteration runs on the dispatch path, the
    guard evicting, and the report says so once, with both figures (silent before); with activation swaps
    only, it names the setting that would let the plan swap parameters and optimizer state too."""
    plain = fit(tracing_models.views, 4, STEPS)
    peaks, planner = forecast_first()
    budget = peaks[0].scheduled_peak_bytes - 4096
    state, report = hooked(tracing_models.views, planner,
                           settings=HookSettings(job="job", plan_events=events, memory_budget=float(budget)))
    assert_identical(plain, state)
    said = [m for m in report.messages if "against a memory budget" in m]
    assert said == [f"iteration 2: plan version 1 forecasts a scheduled peak of {memory_text(peaks[0].scheduled_peak_bytes)}, "
                    f"against a memory budget of {memory_text(budget)}: its iterations run on the dispatch path, where the "
                    "budget guard swaps out what the plan leaves on the device"
                    + (" (its events are native events only, as TENSILE_PLAN_EVENTS=native, or auto on CUDA, asks: "
                       "with all, the plan may swap parameters and optimizer state too)" if events == "native" else "")], report.messages
    assert all(it.path == "dispatch" for it in report.iterations)


def test_a_plan_whose_iterations_the_budget_does_not_hold_says_why_it_runs_guarded():
    """A plan that forecasts far less than its iterations need (no events, a 1-byte scheduled peak): its
    first iteration, guarded, measures above the budget (the ops' own tensors), so the later ones stay on
    the dispatch path too, and the report says why once, with that iteration's figure."""
    def planner(workload: Workload, budget: int | None) -> Plan:
        return Plan("job", 1, workload.signature, [], forecast=Forecast(analyze_vanilla(workload).peak_bytes, 1))

    plain = fit(tracing_models.views, 4, STEPS)
    state, report = hooked(tracing_models.views, planner, settings=HookSettings(job="job", memory_budget=0.3))
    assert_identical(plain, state)
    first = report.iterations[2]
    assert first.mode == "planned" and first.peak_bytes > report.memory_budget_bytes
    said = [m for m in report.messages if "against a memory budget" in m]
    assert said == [f"iteration 2: plan version 1 ran iteration 2 at a measured peak of {memory_text(first.peak_bytes)}, against "
                    f"a memory budget of {memory_text(report.memory_budget_bytes)}: its iterations run on the dispatch path, "
                    "where the budget guard swaps out what the plan leaves on the device"], report.messages
    assert all(it.path == "dispatch" for it in report.iterations)


def small_storages(batch_size: int) -> tuple:
    """Twelve Linear(16, 16) + tanh layers at batch 48: every storage under 4 KiB, activations of 3 KiB
    that the plan swaps and the budget guard does not (MIN_EVICT_BYTES)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(layer for _ in range(12) for layer in (nn.Linear(16, 16), nn.Tanh())), nn.Linear(16, 10))
    batch = (torch.randn(48, 16), torch.randint(0, 10, (48,)))

    def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    return model, batch, loss_fn, lambda p: torch.optim.SGD(p, lr=0.1)


def test_under_a_budget_the_plan_runs_natively_from_the_iteration_after_its_first_when_that_one_keeps_the_budget():
    """The recorded iterations measure the vanilla peak, above the budget (the guard finds nothing big
    enough to evict); the first planned one, on the dispatch path, measures under it: the next is native.
    (The path followed the iteration before the step's own, so the recorded one's peak kept the second
    planned iteration on the dispatch path too.)"""
    plain = fit(small_storages, 4, STEPS)
    peaks, planner = forecast_first(small_storages, feature_swaps)
    budget = (peaks[0].scheduled_peak_bytes + peaks[0].vanilla_peak_bytes) // 2
    state, report = hooked(small_storages, planner, settings=HookSettings(job="job", memory_budget=float(budget)))
    assert_identical(plain, state)
    iterations = report.iterations
    assert iterations[1].peak_bytes > budget >= iterations[2].peak_bytes, [it.peak_bytes for it in iterations]
    assert [it.path for it in iterations] == ["dispatch"] * 3 + ["native"] * (STEPS - 3), report.messages
    assert not any("against a memory budget" in m for m in report.messages), report.messages


class Shortcut(nn.Module):
    """A residual block as torchvision's Bottleneck runs it: the main path's modules, then the
    shortcut's conv on the block's input. The shortcut's exit is newer than the main path's autograd
    nodes without being behind them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.shortcut = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        main = self.bn2(self.conv2(self.bn1(self.conv1(x))))
        return self.fc((main + self.shortcut(x)).flatten(1))


def shortcut(batch_size: int) -> tuple:
    return image_classifier(Shortcut, batch_size)


def stem_output_swap(workload: Workload, budget: int | None = None) -> Plan:
    """The block's input alone: out after the shortcut's conv reads it, back before backward; the main
    path's first conv reads it in backward too."""
    stem = next(op for op in workload.ops if op.name == "aten.convolution.default")
    tensor = stem.outputs[0]
    uses = first_uses(workload)[tensor]
    backward = [i for i in uses if workload.ops[i].phase == "backward"]
    last_forward = max(i for i in uses if workload.ops[i].phase == "forward")
    return Plan("job", 1, workload.signature, [Event("job", "swap_out", tensor, last_forward),
                                                Event("job", "swap_in", tensor, backward[0] - 1)])


@pytest.mark.slow
def test_a_node_of_the_main_path_is_hooked_from_a_boundary_it_is_behind():
    """The main path's first conv reads the swapped input in backward: its node is hooked from a
    boundary whose root it is behind, not from the shortcut's exit (newer, but a walk back from it
    never meets the main path)."""
    plain = fit(shortcut, 4, STEPS)
    state, report = hooked(shortcut, stem_output_swap)
    assert_identical(plain, state)
    assert not any("left the learnt" in m or "align" in m for m in report.messages), report.messages
    native = [it for it in report.iterations[3:] if it.mode == "planned"]
    assert len(native) == STEPS - 3 and all(it.path == "native" and it.events["swap_out"] == 1 for it in native)


def test_a_tensor_still_absent_when_its_node_runs_is_fetched_there():
    """Check before use on the native path: a plan that swaps out and never back (a missing or
    late swap-in) costs a stall at the first node that reads the tensor, never correctness."""
    def no_swap_ins(workload: Workload, budget: int | None = None) -> Plan:
        plan = feature_swaps(workload)
        plan.events = [e for e in plan.events if e.kind == "swap_out"]
        return plan

    plain = fit(blocks, 4, STEPS)
    state, report = hooked(blocks, no_swap_ins)
    assert_identical(plain, state)
    native = report.iterations[3:STEPS]
    assert all(it.path == "native" and it.mode == "planned" for it in native)
    assert all(it.events["swap_in"] == 0 and it.swap_in_bytes == it.swap_out_bytes > 0 for it in native)
    assert all(it.stall_seconds > 0 for it in native)


@pytest.mark.slow
def test_a_storage_the_mover_refuses_on_the_native_path_stays_on_the_device(monkeypatch):
    """A storage that cannot be resized (from numpy) is refused by the mover: on the native path the carrier calls
    the mover itself, and such a tensor stays where it is, without standing the hook down or counting a swap."""
    from tensile_hook.movers import CpuMover

    def refusing(self, slot, storage):  # type: ignore[no-untyped-def]
        raise RuntimeError("the storage is not resizable")

    plain = fit(blocks, 4, STEPS)
    monkeypatch.setattr(CpuMover, "swap_out", refusing)
    state, report = hooked(blocks, feature_swaps)
    assert_identical(plain, state)
    assert report.stood_down is None, report.stood_down
    native = [it for it in report.iterations if it.path == "native"]
    assert native and all(it.mode == "planned" for it in native), [(it.path, it.mode) for it in report.iterations]
    assert all(it.events["swap_out"] == it.swap_out_bytes == it.swap_in_bytes == 0 for it in native), \
        [(it.events, it.swap_out_bytes) for it in native]


def test_a_hook_failure_in_a_native_backward_brings_every_swapped_tensor_back(monkeypatch):
    """The native swaps' slots live outside the storage registry: when the hook stands down in
    the middle of a native backward (here its first node pre-hook of iteration 4 fails), the
    tensors that iteration swapped out must still come back before autograd reads them."""
    from tensile_hook.executor import PlanExecutor
    from tensile_hook.movers import CpuMover

    executors: list[PlanExecutor] = []
    init, swap_in = PlanExecutor.__init__, CpuMover.swap_in

    def made(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        executors.append(self)

    def failing(self, slot, storage):  # type: ignore[no-untyped-def]
        executor = executors[-1]
        if executor.state.iteration == 4 and not executor.disabled and torch._C._current_autograd_node() is not None:
            assert any(slot is not None and not slot.resident for slot in executor.swaps.slots())  # something to restore
            raise RuntimeError("injected hook failure")
        swap_in(self, slot, storage)

    monkeypatch.setattr(PlanExecutor, "__init__", made)
    monkeypatch.setattr(CpuMover, "swap_in", failing)
    plain = fit(blocks, 4, STEPS)
    state, report = hooked(blocks, feature_swaps)
    assert_identical(plain, state)
    assert report.stood_down == "RuntimeError: injected hook failure"
    assert [it.path for it in report.iterations[3:5]] == ["native", "native"]
    assert report.iterations[4].events["swap_out"] > 0


def carriers_of(monkeypatch) -> list:  # type: ignore[no-untyped-def]
    """Every SwapCarrier made while the test runs (one per aligned plan)."""
    from tensile_hook.native_swaps import SwapCarrier

    made = []
    init = SwapCarrier.__init__

    def spying(self, *args):  # type: ignore[no-untyped-def]
        init(self, *args)
        made.append(self)

    monkeypatch.setattr(SwapCarrier, "__init__", spying)
    return made


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_node_hooks_wait_for_the_top_level_call_to_return_and_anchor_on_acting_boundaries(monkeypatch, micro_batches):
    """Hooking each node where it is found runs right after large kernels, at ten times the cost:
    the readers' and swap-ins' nodes are hooked in one go where the model's call returns (once per
    forward), found from the roots of boundaries that act anyway, so no boundary acts only to
    anchor them. Only a node whose saved tensor is taken from it (max pooling's indices) is hooked
    at once, before its tensor goes out."""
    from tensile_hook.native_swaps import SwapCarrier

    made = carriers_of(monkeypatch)
    hooked_at = []
    hook_nodes = SwapCarrier._hook_nodes

    def spying(self, roots):  # type: ignore[no-untyped-def]
        hooked_at.extend([self.index - 1] * len(roots))
        hook_nodes(self, roots)

    monkeypatch.setattr(SwapCarrier, "_hook_nodes", spying)
    plain = fit(blocks, 4, STEPS, micro_batches)
    state, report = hooked(blocks, feature_swaps, micro_batches=micro_batches)
    assert_identical(plain, state)
    assert [it.path for it in report.iterations[3:STEPS]] == ["native"] * (STEPS - 3)
    [carrier] = made
    actions = {i: a for i, a in enumerate(carrier.actions) if a is not None}
    flushes = [i for i, a in actions.items() if a.flush]
    model_exits = [i for i, code in enumerate(carrier.expected) if code == carrier.expected[0] - 1]  # the first entry's exit
    assert flushes == model_exits and len(flushes) == micro_batches
    assert all(a.take or a.swap_out or a.flush for a in actions.values()), "a boundary acts only to anchor node hooks"
    eager = [h for a in actions.values() for h in a.hooks]
    assert eager and all(h.take and not h.fetch for h in eager)
    assert sum(len(a.deferred) for a in actions.values()) >= 5 * micro_batches
    taking = {i for i, a in actions.items() if a.hooks}
    per_iteration = len(hooked_at) // (STEPS - 3)
    assert all(i in taking or i in flushes for i in hooked_at[:per_iteration]), (hooked_at[:per_iteration], flushes)


@pytest.mark.parametrize("spoiled", [False, True])
def test_native_iterations_find_their_node_hooks_along_the_learnt_paths_and_walk_where_one_no_longer_holds(
        monkeypatch, spoiled):
    """The learning iteration's walks give each node hook its index path from its root: native iterations follow
    it (a few steps) from the first on, with no walk of their own. A path that leads elsewhere (here spoiled on
    purpose, as another graph would) is walked again once, and that walk's path is followed from then on."""
    from tensile_hook.native_swaps import SwapCarrier

    walks = []
    walk, init = SwapCarrier._walk, SwapCarrier.__init__

    def counting(self, *args):  # type: ignore[no-untyped-def]
        walks.append(self.state.iteration)
        return walk(self, *args)

    def spoiling(self, *args):  # type: ignore[no-untyped-def]
        init(self, *args)
        if spoiled:  # every non-empty path one step longer: it ends at a node of another sequence number
            self.paths = {key: [((*path, 0) if path else path, hook, holder) for path, hook, holder in found]
                          for key, found in self.paths.items()}

    monkeypatch.setattr(SwapCarrier, "_walk", counting)
    monkeypatch.setattr(SwapCarrier, "__init__", spoiling)
    plain = fit(blocks, 4, STEPS)
    state, report = hooked(blocks, feature_swaps)
    assert_identical(plain, state)
    native = [it.iteration for it in report.iterations if it.path == "native"]
    assert len(native) == STEPS - 3 and all(it.mode == "planned" for it in report.iterations[3:STEPS])
    if spoiled:
        assert walks and set(walks) == {native[0]}, (walks, native)
    else:
        assert walks == []


class TrainStep(nn.Module):
    """A training-step module: its forward runs the loss's backward itself, so its call returns
    only after backward: no node hook may wait for that return."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Blocks()

    def forward(self, batch: tuple) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.model(batch[0]), batch[1])
        loss.backward()
        return loss.detach().requires_grad_()


def train_step(batch_size: int) -> tuple:
    model, batch, _, make_optimizer = blocks(batch_size)
    torch.manual_seed(0)
    return TrainStep(), batch, lambda model, batch: model(batch), make_optimizer


@pytest.mark.slow
def test_a_backward_inside_the_top_level_call_hooks_the_nodes_where_they_are_found(monkeypatch):
    made = carriers_of(monkeypatch)
    plain = fit(train_step, 4, STEPS)
    state, report = hooked(train_step, feature_swaps)
    assert_identical(plain, state)
    native = report.iterations[3:STEPS]
    assert all(it.path == "native" and it.mode == "planned" and it.events["swap_out"] >= 5 for it in native), (
        [(it.path, it.mode, it.events) for it in native], report.messages)
    assert all(it.events["swap_in"] == it.events["swap_out"] and it.stall_seconds == 0.0 for it in native)
    [carrier] = made
    actions = [a for a in carrier.actions if a is not None]
    assert not any(a.flush or a.deferred for a in actions) and sum(len(a.hooks) for a in actions) >= 5


def test_tensor_paths_find_what_tensors_in_finds_and_lead_back_to_it():
    """The learner records index paths (`tensor_paths`) and the executor collects tensors (`tensors_in`, on
    the per-op path, without paths): the two walks must agree on the tensors and their order."""
    from tensile_hook.storages import tensor_paths, tensors_in

    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    values = ((a, [b, 3, {"x": c, "y": None}]), {"out": (d,)}, "text")
    found = tensor_paths(values)
    assert [t for _, t in found] == tensors_in(values) == [a, b, c, d]
    for path, tensor in found:
        value = values
        for key in path:
            value = value[key]
        assert value is tensor


def test_a_node_whose_input_cannot_come_back_raises_instead_of_reading_a_freed_storage():
    """Out of memory bringing a swapped activation back in a native backward, even in the stand-down:
    the node must not run on a storage at 0 bytes (a segmentation fault on the CPU device, an illegal
    memory access on CUDA). `backward()` raises the out-of-memory error, as it would without Tensile,
    and the tensors come back once there is room."""
    report = out_of_memory_in_a_native_backward(torch.device("cpu"))
    assert report.stood_down and "OutOfMemoryError" in report.stood_down
    assert report.iterations[3].path == "native"


class _GoneNode:
    """A Python autograd Function's node (DDP's output) as PyTorch 2.11 leaves it once a backward freed its graph and
    its output died: every attribute refused. PyTorch 2.13 still answers, so the suite makes one."""

    def __getattr__(self, name: str) -> None:
        raise RuntimeError(f"Attribute '{name}' is invalid for this instance of _C._FunctionBase. Accessing this "
                           "attribute directly on an instance of autograd.Function is a legacy access pattern")


def test_a_learnt_root_whose_graph_is_gone_is_passed_over() -> None:
    """On PyTorch 2.11 the learning iteration's walks after backward met DDP's output node so, and the hook stood down
    (the DDP loop of test_training_loops). The other roots are still walked: a node that saved a swapped tensor
    and did not run (an auxiliary loss's) is found behind them."""
    from types import SimpleNamespace

    from tensile_hook.native_align import Boundary, SwapLearner, nodes_behind

    weight, activation = torch.randn(4, requires_grad=True), torch.randn(4)
    product = (weight * 2) * activation  # the second MulBackward0 saves the activation; no backward runs it
    node, key = product.grad_fn, id(activation.untyped_storage())
    learner = SwapLearner(SimpleNamespace(state=SimpleNamespace(iteration=0)))  # type: ignore[arg-type]
    learner.remove()  # its global module hooks: only its walks are wanted here
    learner.boundaries = [Boundary(False, 1, 0, [], [], [], (0, 10**6), _GoneNode()),
                          Boundary(False, 2, 1, [], [], [], (0, node._sequence_nr()), node)]
    assert learner._unexecuted_readers({key}) == {key: {node._sequence_nr()}}
    assert list(nodes_behind(_GoneNode(), 0)) == []
    walked = [(number, path) for _, number, path in nodes_behind(node, 0)]
    assert walked == [(node._sequence_nr(), ()), (node.next_functions[0][0]._sequence_nr(), (0,))]
