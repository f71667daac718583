"""Real training loops, not just forward/backward/step: validation passes, a smaller last batch,
gradient clipping with an LR schedule, checkpoints, EMA copies, logging, activation checkpointing,
two models, a data-dependent branch, an auxiliary loss on some steps, a skipped step, a gradient
penalty, a step that runs a closure, DistributedDataParallel. Each loop trains twice from the same seed,
plain and under a plan that moves tensors (on the dispatch path, on the native path, and under the
in-process planner with a budget): everything the loop produces must be bit-identical, and the
report must show that the plan really ran where the test meant it to."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tensile_hook import activate, deactivate
from tensile_hook.plan_source import local_planner
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings
from tests.support.bit_identity import assert_identical
from tests.support.hook_reports import moved, paths_and_modes
from tests.support.loops import (EPOCHS, Loop, Net, Results, batches, final, forward_backward, losses_loop, net, sgd)
from tests.support.plans import aggressive_plan, pooled_swaps
from tests.support.training import state_of

pytestmark = pytest.mark.usefixtures("deterministic")
STEPS = 8  # 0-1 recorded, 2 planned on the dispatch path (aligns the native swaps), 3-7 native where they can be


# dispatch: aggressive_plan swaps, releases and recomputes every activation and swaps parameters and
# optimizer state across iterations (it runs on the dispatch path); native: pooled_swaps, carried
# natively from iteration 3; budget: the in-process planner, for 60% of the vanilla peak
PATHS = ("dispatch", "native", "budget")


def run_hooked(loop: Loop, path: str, plan_events: str = "auto") -> tuple[Results, HookReport]:
    """`plan_events="native"`: swaps that do not align stay on the device and the others run natively,
    as on CUDA by default (on the CPU device such a plan runs on the dispatch path)."""
    if path == "budget":
        planner, budget = local_planner(HookSettings(job="job"), torch.device("cpu")), 0.6
    else:
        planner, budget = (aggressive_plan if path == "dispatch" else pooled_swaps), None
    executor = activate(HookSettings(job="job", memory_budget=budget, plan_events=plan_events), planner=planner,
                        device=torch.device("cpu"))
    try:
        return loop(), executor.report
    finally:
        deactivate()


def assert_planned(report: HookReport, path: str, at_least: int = 2) -> None:
    """At least `at_least` iterations ran under the plan on the intended path and moved tensors. Under
    a budget, iterations in any mode count: the in-process planner plans from measured op latencies
    (its plans vary from run to run), and the budget guard evicts in guarded iterations too."""
    on_path = "native" if path == "native" else "dispatch"
    planned = [it for it in report.iterations if moved(it) and it.path == on_path and (
        it.mode == "planned" or path == "budget")]
    assert len(planned) >= at_least, (paths_and_modes(report), report.messages)
    if path == "native":
        assert all(it.events["swap_out"] > 0 and it.swap_in_bytes == it.swap_out_bytes for it in planned)
    if path == "dispatch":
        assert any(it.events["recompute"] > 0 for it in planned) and all(it.events["swap_out"] > 0 for it in planned)


def check(loop: Loop, path: str, at_least: int = 2, plan_events: str = "auto") -> HookReport:
    """Plain, then hooked: identical results, no stand-down, and the plan ran on the path."""
    plain = loop()
    hooked, report = run_hooked(loop, path, plan_events)
    assert_identical(plain, hooked)
    assert report.stood_down is None, report.stood_down
    assert_planned(report, path, at_least)
    return report


def check_in_child(loop: str, path: str) -> None:
    """`check(loop, path)` in a child process (`loop`: an expression in this module): a read of a
    swapped-out storage can crash the process (a segmentation fault), and one that reads freed memory
    is only reproducible from a fresh process's allocator state."""
    run_in_child(f"t.check(eval({loop!r}, vars(t)), {path!r})")


def run_in_child(call: str) -> None:
    """`call` (an expression on this module as `t`) in a fresh process, deterministic algorithms on."""
    code = f"import torch, tests.hook.test_training_loops as t; torch.use_deterministic_algorithms(True); {call}"
    child = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, f"exit status {child.returncode}: {child.stderr[-1500:]}"


def native_fell_back(report: HookReport) -> bool:
    """A native iteration left the learnt module calls and brought its tensors back."""
    return any(it.path == "native" and it.mode == "diverged" for it in report.iterations) and any(
        "left the learnt module calls" in m for m in report.messages)


# -- 1. validation between steps ------------------------------------------------------------------

def validation_loop(after: int, context: Callable[[], Any]) -> Loop:
    """A validation pass (eval mode, under `context`) after every step whose number is `after`
    modulo 2: after odd steps the recorded iteration 1 holds it, after even ones it does not."""

    def loop() -> Results:
        model = net()
        optimizer = sgd(model)
        data, held_out = batches([4] * STEPS), batches([8], seed=1)[0]
        logged = []
        for step, batch in enumerate(data):
            optimizer.zero_grad(set_to_none=True)
            forward_backward(model, batch)
            optimizer.step()
            if step % 2 == after:
                model.eval()
                with context():
                    logged.append(model(held_out[0]).detach().clone())
                model.train()
        return {"validation": logged, "state": final(model, optimizer)}

    return loop


VALIDATIONS = {
    "no_grad after odd steps": (1, torch.no_grad),
    "no_grad after even steps": (0, torch.no_grad),
    "inference_mode": (1, torch.inference_mode),
}


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("validation", list(VALIDATIONS))
def test_a_validation_pass_between_steps(validation: str, path: str) -> None:
    """Evaluation between steps runs module calls and ops after the optimizer step, with the
    parameters swapped out across iterations: it belongs to no iteration's forward and must not
    start one, nor count as the native path's module calls."""
    check(validation_loop(*VALIDATIONS[validation]), path)


@pytest.mark.parametrize("path", ("dispatch", "native"))
def test_a_validation_pass_that_forgot_no_grad(path: str) -> None:
    """Without `no_grad` the evaluation forward runs with grad enabled on parameters that require
    grad: every other iteration starts at it. The plan may stop fitting; training must not change."""
    loop = validation_loop(1, torch.enable_grad)
    plain = loop()
    hooked, report = run_hooked(loop, path)
    assert_identical(plain, hooked)
    assert report.stood_down is None


# -- 2. batch sizes ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_the_last_batch_of_an_epoch_is_smaller(path: str) -> None:
    """The same ops on other shapes for one step in four."""
    report = check(losses_loop(EPOCHS), path)
    if path == "native":  # each short batch runs under a plan of its own on the dispatch path, not native
        assert not native_fell_back(report) and {it.path for it in report.iterations[3::4]} == {"dispatch"}, \
            paths_and_modes(report)


@pytest.mark.slow
def test_the_native_path_comes_back_after_every_epochs_short_batch() -> None:
    """Every epoch ends with a short batch: each costs one native iteration, not the native path."""
    _, report = run_hooked(losses_loop(EPOCHS), "native")
    last_epoch = report.iterations[12:15]
    assert all(it.path == "native" or it.iteration == 12 for it in last_epoch), paths_and_modes(report)


@pytest.mark.slow
@pytest.mark.parametrize("path", ("dispatch", "native"))
def test_the_batch_size_changes_every_step(path: str) -> None:
    """A batch size of its own at every step (dynamic batching): the first shape sets are planned for
    (shapes.MAX_SHAPE_SETS), the others run under the plan in force on the dispatch path; no iteration
    runs native on shapes its plan was not made for."""
    loop = losses_loop([6, 7, 8, 4, 8, 5, 6, 8, 7, 4])
    plain = loop()
    hooked, report = run_hooked(loop, path)
    assert_identical(plain, hooked)
    assert report.stood_down is None
    if path == "dispatch":
        assert_planned(report, path)
    else:
        assert all(it.path == "dispatch" for it in report.iterations), paths_and_modes(report)


# -- 3. gradient clipping and an LR schedule ----------------------------------------------------------

def clipped_loop() -> Results:
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    norms, rates = [], []
    for batch in batches([4] * STEPS):
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model, batch)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5))
        optimizer.step()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
    return {"norms": norms, "rates": rates, "state": final(model, optimizer)}


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_gradient_clipping_and_a_step_lr_schedule(path: str) -> None:
    """clip_grad_norm_ writes every gradient in place between backward and the step (foreach ops on
    tensors the plan may move), and the scheduler changes the learning rate at every step."""
    check(clipped_loop, path)


# -- 4. checkpoints --------------------------------------------------------------------------------

Save = Callable[[nn.Module, torch.optim.Optimizer], dict]  # what goes into a checkpoint
Resume = Callable[[dict], Results]  # a checkpoint read back: what it holds, as results


def load(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "opt": optimizer.state_dict()}


def resume_from_state_dicts(checkpoint_: dict) -> Results:
    """Training resumed from the checkpoint: a new model and optimizer, both loaded."""
    model = net()
    optimizer = sgd(model)
    model.load_state_dict(checkpoint_["model"])
    optimizer.load_state_dict(checkpoint_["opt"])
    return {"loaded": checkpoint_, "resumed": final(model, optimizer)}


def checkpointing_loop(save: Save = state_dicts, resume: Resume = resume_from_state_dicts) -> Loop:
    """torch.save of `save`'s dict every 2 steps into a BytesIO; every checkpoint read back after
    training and resumed from."""

    def loop() -> Results:
        model = net()
        optimizer = sgd(model)
        saved: list[bytes] = []
        for step, batch in enumerate(batches([4] * STEPS)):
            optimizer.zero_grad(set_to_none=True)
            forward_backward(model, batch)
            optimizer.step()
            if step % 2 == 1:
                buffer = io.BytesIO()
                torch.save({"step": step, **save(model, optimizer)}, buffer)
                saved.append(buffer.getvalue())
        return {"checkpoints": [resume(load(blob)) for blob in saved], "state": final(model, optimizer)}

    return loop


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_checkpoints_saved_mid_training_are_bit_identical(path: str) -> None:
    """state_dict() reads storages outside the dispatcher: everything the plan moved must be back."""
    check(checkpointing_loop(), path)


def whole_objects(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What older scripts save: the optimizer and the model pickled whole, not their state dicts."""
    return {"optimizer": optimizer, "model": model}


def resume_whole_objects(checkpoint_: dict) -> Results:
    return final(checkpoint_["model"], checkpoint_["optimizer"])


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_checkpoints_of_the_whole_model_and_optimizer(path: str) -> None:
    """torch.save of the objects, not of state_dict(): pickling reads each storage's bytes with no op
    the hook sees (the optimizer's state first: plain tensors the plan swapped out after the step). In a
    child process: pickling a storage at 0 bytes crashed the process before torch.save brought
    everything back."""
    check_in_child("checkpointing_loop(whole_objects, resume_whole_objects)", path)


# -- 5. EMA copies ------------------------------------------------------------------------------------

def ema_loop(update: str) -> Loop:
    """An EMA of the model, made before training and made again after step 3, updated after every
    step: a deepcopy updated with `_foreach_lerp_` or a per-parameter loop, or torch's own
    AveragedModel. Parameters only, as diffusers' EMAModel and AveragedModel (use_buffers=False)
    do: the buffers stay as the copy took them."""

    def make(model: nn.Module) -> nn.Module:
        if update == "AveragedModel":
            return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        return copy.deepcopy(model).requires_grad_(False)

    def loop() -> Results:
        model = net()
        optimizer = sgd(model)
        ema = make(model)
        firsts = []
        for step, batch in enumerate(batches([4] * STEPS)):
            optimizer.zero_grad(set_to_none=True)
            forward_backward(model, batch)
            optimizer.step()
            if step == 3:
                firsts.append(final(ema))
                ema = make(model)
            if update == "AveragedModel":
                ema.update_parameters(model)
                continue
            with torch.no_grad():
                if update == "foreach":
                    torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.1)
                else:
                    for shadow, param in zip(ema.parameters(), model.parameters()):
                        shadow.mul_(0.9).add_(param.detach(), alpha=0.1)
        return {"first_ema": firsts, "ema": final(ema), "state": final(model, optimizer)}

    return loop


@pytest.mark.slow
@pytest.mark.parametrize("path", ("dispatch", "native"))
@pytest.mark.parametrize("update", ["foreach", "loop", "AveragedModel"])
def test_an_ema_copy_made_and_remade_mid_training(update: str, path: str) -> None:
    """deepcopy() of a model whose parameters the plan swapped out after the step, and EMA updates
    that read them between steps. (AveragedModel's update detaches the parameters with grad enabled:
    each iteration starts there, and its first update, a copy, differs from the later ones: the plan
    is made again once, fewer iterations run native.)"""
    check(ema_loop(update), path, at_least=1 if update == "AveragedModel" else 2)


@pytest.mark.slow
def test_an_ema_copy_made_under_a_memory_budget() -> None:
    """The buffer (read once per forward) is the least recently used tensor when the step ends."""
    check_in_child("ema_loop('foreach')", "budget")


def shadow_loop() -> Results:
    """diffusers' EMAModel: shadow parameters as a plain list of tensors (not a module) updated in
    place after every step; its state_dict() is that list, saved with torch.save."""
    model = net()
    optimizer = sgd(model)
    shadow = [p.detach().clone() for p in model.parameters()]
    saved: list[bytes] = []
    for step, batch in enumerate(batches([4] * STEPS)):
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model, batch)
        optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(shadow, list(model.parameters()), 0.1)
        if step % 2 == 1:
            buffer = io.BytesIO()
            torch.save({"shadow_params": shadow, "decay": 0.9}, buffer)
            saved.append(buffer.getvalue())
    return {"saved": [load(blob) for blob in saved], "shadow": [s.clone() for s in shadow],
            "state": final(model, optimizer)}


@pytest.mark.parametrize("path", PATHS)
def test_ema_shadow_tensors_saved_with_torch_save(path: str) -> None:
    """Tensors of the user's own, written in place between steps and saved without state_dict()."""
    check(shadow_loop, path)


# -- 6. logging, zero_grad(set_to_none=False) --------------------------------------------------------

def logging_loop() -> Results:
    """Gradients zeroed in place (kept across steps); the loss, the accuracy from the logits and the
    gradient norm read after backward and before the step."""
    model = net()
    optimizer = sgd(model)
    logged = []
    for batch in batches([4] * STEPS):
        optimizer.zero_grad(set_to_none=False)
        loss, logits = forward_backward(model, batch)
        accuracy = (logits.argmax(1) == batch[1]).float().mean().item()
        grad_norm = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm().item()
        logged.append((loss.item(), accuracy, grad_norm, logits.detach().clone()))
        optimizer.step()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return {"logged": logged, "grads": grads, "state": final(model, optimizer)}


@pytest.mark.parametrize("path", PATHS)
def test_logging_after_backward_with_gradients_zeroed_in_place(path: str) -> None:
    """Gradients that live across iterations, written by zero_() and accumulated into; logits read
    after backward (a tensor the plan may have swapped, released or recomputed)."""
    check(logging_loop, path)


def gradient_hooks_loop(kind: str) -> Loop:
    """Per-layer gradient norms logged from backward: a module's full backward hook, its full backward
    pre-hook, or a hook on the gradient of the block's input that a forward pre-hook registers."""

    def loop() -> Results:
        norms: list[float] = []
        model = net()

        def log_norm(grad: torch.Tensor) -> None:
            norms.append(grad.norm().item())

        if kind == "backward hook":
            model.block.register_full_backward_hook(lambda module, grad_in, grad_out: log_norm(grad_out[0]))
        elif kind == "backward pre-hook":
            model.block.register_full_backward_pre_hook(lambda module, grad_out: log_norm(grad_out[0]))
        else:
            def watch_input(module: nn.Module, args: tuple) -> None:
                args[0].register_hook(log_norm)

            model.block.register_forward_pre_hook(watch_input)
        results = losses_loop([4] * STEPS, make=lambda: model)()
        return {**results, "norms": norms}

    return loop


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["backward hook", "backward pre-hook", "tensor hook"])
@pytest.mark.parametrize("path", PATHS)
def test_gradient_norms_logged_from_backward_hooks(kind: str, path: str) -> None:
    """The same norms and training; natively with native plans (the forward pre-hook keeps the block's
    input on the device, as any tensor a user's forward hook sees)."""
    check(gradient_hooks_loop(kind), path, plan_events="native" if path == "native" else "auto")


@pytest.mark.slow
def test_reading_the_weights_out_after_the_last_step_is_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Code after the last step (the loop's final read of the state) does not start as a training
    iteration does: the report says so, logged at INFO, not as a plan that failed."""
    with caplog.at_level(logging.INFO, logger="tensile.hook"):
        report = check(logging_loop, "dispatch")
    after = [m for m in report.messages if "does not start as a planned iteration" in m]
    assert after and after[-1].startswith(f"iteration {STEPS}:"), report.messages
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warned if "does not start as a planned iteration" in m or "(op 0 is" in m], warned
    assert any("does not start as a planned iteration" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def evaluation_with_grad_after_training() -> Results:
    """After the last step the script evaluates with grad still on (no `no_grad`): a forward as the plan's
    begins, then softmax where the plan has the training loss; no backward, no step."""
    model = net()
    optimizer = sgd(model)
    for batch in batches([4] * STEPS):
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model, batch)
        optimizer.step()
    probabilities = model(batches([4], seed=1)[0][0]).softmax(1).detach()
    return {"probabilities": probabilities, "state": final(model, optimizer)}


@pytest.mark.parametrize("path", ["dispatch", "budget"])
def test_an_evaluation_after_the_last_step_that_begins_as_a_forward_is_no_warning(
        path: str, caplog: pytest.LogCaptureFixture) -> None:
    """It follows the plan for the forward's ops, then leaves it, and never reaches a step: code after
    training, said at INFO at exit, not warned about as an iteration that diverged from the plan."""
    with caplog.at_level(logging.INFO, logger="tensile.hook"):
        report = check(evaluation_with_grad_after_training, path)
    after = [m for m in report.messages if "code after training" in m]
    assert after and after[-1].startswith(f"iteration {STEPS}:"), report.messages
    assert not [m for m in report.messages if "diverged from the plan" in m], report.messages
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warned if "diverged" in m or "code after training" in m], warned


def activation_logging_loop() -> Results:
    """A forward hook keeps the stem's output for logging; every third step (not step 1, the
    recorded one) the loop reads it between forward and backward, as activation statistics
    (TensorBoard histograms, a feature norm printed) are read every N steps."""
    model = net()
    optimizer = sgd(model)
    kept: dict[str, torch.Tensor] = {}
    model.stem.register_forward_hook(lambda module, args, out: kept.__setitem__("stem", out))
    logged = []
    for step, batch in enumerate(batches([4] * STEPS)):
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch[0])
        loss = F.cross_entropy(logits, batch[1])
        if step % 3 == 0:
            logged.append(kept["stem"].detach().abs().mean().item())
        loss.backward()
        optimizer.step()
    return {"logged": logged, "state": final(model, optimizer)}


@pytest.mark.slow
def test_an_activation_read_between_forward_and_backward_every_few_steps_on_the_dispatch_path() -> None:
    """The read is code between forward and backward that the recorded iteration did not run, on a
    tensor the plan swaps: the dispatch path checks it before use."""
    check_in_child("activation_logging_loop", "dispatch")


def kept_activation_stays_on_the_device() -> None:
    """The native path cannot see the read (no module call, no autograd node: before, it ran on the
    swapped-out storage, a segmentation fault): a tensor a user's forward hook sees is not swapped
    natively, and the report says why; the plan runs where it can check it."""
    plain = activation_logging_loop()
    hooked, report = run_hooked(activation_logging_loop, "native")
    assert_identical(plain, hooked)
    assert report.stood_down is None
    assert any("a forward hook of the user's (its module's, or a global one) sees it" in m for m in report.messages), report.messages
    assert any(it.mode == "planned" and moved(it) for it in report.iterations)


@pytest.mark.slow
def test_an_activation_a_forward_hook_keeps_is_not_swapped_natively() -> None:
    run_in_child("t.kept_activation_stays_on_the_device()")


class KeepingNet(Net):
    """Net whose forward lets the script hold the stem's output: as a module attribute, a view of it
    as one, or returned beside the logits."""

    def __init__(self, keep: str) -> None:
        super().__init__()
        self.keep = keep

    def forward(self, x: torch.Tensor) -> Any:
        y = self.stem(x)
        if self.keep != "returned":
            self.features = y if self.keep == "attribute" else y.flatten(1)
        logits = self.rest(y)
        return (logits, y) if self.keep == "returned" else logits


def kept_reference_loop(keep: str) -> Loop:
    """Every third step (not step 2, where the plan's swaps are aligned) the loop reads the features
    the model let it hold, between forward and backward."""

    def loop() -> Results:
        torch.manual_seed(1234)
        model = KeepingNet(keep)
        optimizer = sgd(model)
        logged = []
        for step, batch in enumerate(batches([4] * STEPS)):
            optimizer.zero_grad(set_to_none=True)
            if keep == "returned":  # unpacked at once: only this frame's locals hold the features
                logits, features = model(batch[0])
            else:
                logits, features = model(batch[0]), model.features
            loss = F.cross_entropy(logits, batch[1])
            if step % 3 == 0:
                logged.append(features.detach().abs().mean().item())
            loss.backward()
            optimizer.step()
        return {"logged": logged, "state": final(model, optimizer)}

    return loop


def held_activation_stays_on_the_device(keep: str) -> None:
    """Before, the native path swapped the held features out and the read ran on 0 bytes (a
    segmentation fault): held when backward starts, they stay on the device, the report says why,
    and the native path carries the plan's other swaps."""
    loop = kept_reference_loop(keep)
    plain = loop()
    hooked, report = run_hooked(loop, "native", plan_events="native")
    assert_identical(plain, hooked)
    assert report.stood_down is None
    assert any("the script holds it when backward starts" in m for m in report.messages), report.messages
    assert_planned(report, "native")


@pytest.mark.slow
@pytest.mark.parametrize("keep", ["attribute", "view", "returned"])
def test_an_activation_the_script_holds_is_not_swapped_natively(keep: str) -> None:
    run_in_child(f"t.held_activation_stays_on_the_device({keep!r})")


LATE = 4  # the step a forward hook is added at: after the plan's swaps were aligned (step 2)


def late_hook_loop(kind: str) -> Loop:
    """A forward hook keeps the stem's output and the loop reads it between forward and backward. Added at
    step LATE: on the stem for that step only ("once"), on the stem from then on ("kept"), as a global
    module hook from then on ("global"); or a global hook from the start that keeps it every third step,
    not in step 2 ("global_logging")."""

    def loop() -> Results:
        torch.manual_seed(1234)
        model = net()
        optimizer = sgd(model)
        kept: dict[str, torch.Tensor] = {}
        step = 0

        def keep(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            if module is model.stem and (kind != "global_logging" or step % 3 == 0):
                kept["stem"] = out

        handle = None
        logged = []
        try:
            for step, batch in enumerate(batches([4] * STEPS)):
                optimizer.zero_grad(set_to_none=True)
                if step == (0 if kind == "global_logging" else LATE):
                    handle = (model.stem.register_forward_hook(keep) if kind in ("once", "kept")
                              else torch.nn.modules.module.register_module_forward_hook(keep))
                loss = F.cross_entropy(model(batch[0]), batch[1])
                if "stem" in kept:
                    logged.append(kept.pop("stem").detach().abs().mean().item())
                if kind == "once" and handle is not None:
                    handle.remove()
                    handle = None
                loss.backward()
                optimizer.step()
        finally:
            if handle is not None:
                handle.remove()
        return {"logged": logged, "state": final(model, optimizer)}

    return loop


def late_hook_is_seen(kind: str) -> None:
    """Before, the native path had swapped the kept output out and the read ran on 0 bytes (a segmentation
    fault). A forward hook the aligned iteration did not have ends the native iteration at its module's
    call (a global one at the iteration's start) with every tensor back, and the plan is aligned again, with
    the hook, on the dispatch path. What a global hook sees when the swaps are aligned is not swapped natively."""
    loop = late_hook_loop(kind)
    plain = loop()
    hooked, report = run_hooked(loop, "native", plan_events="native")
    assert_identical(plain, hooked)
    assert report.stood_down is None
    if kind == "global_logging":
        assert any("or a global one) sees it and may keep it" in m for m in report.messages), report.messages
        return
    assert any(m.startswith(f"iteration {LATE}:") and "hook was added" in m for m in report.messages), report.messages
    assert report.iterations[LATE].mode == "diverged" and not moved(report.iterations[LATE])
    if kind == "once":  # aligned again without it: native again
        assert [it.path for it in report.iterations[LATE + 2:]] == ["native"] * (STEPS - LATE - 2)
        assert all(moved(it) for it in report.iterations[LATE + 2:])


class SometimesKeepingNet(Net):
    """Net whose forward, in the steps its `keeping` flag is set, lets the script hold the stem's output:
    as a module attribute, a detached alias of it as one (another tensor on its storage; a view that autograd
    records changes the number of nodes, and the native iteration ends at once), or in a dict the model owns."""

    def __init__(self, keep: str) -> None:
        super().__init__()
        self.keep, self.keeping, self.kept = keep, False, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        if self.keeping:
            if self.keep == "dict":
                self.kept["features"] = y
            else:
                self.features = y if self.keep == "attribute" else y.detach()
        return self.rest(y)


# the steps that keep: later native ones; the first native one (step 3, after the swaps are aligned in step 2,
# whose references it is compared with) and the next
SOMETIMES = {"later": (5, 8), "first": (3, 4, 8)}


def sometimes_kept_loop(keep: str, steps: tuple[int, ...]) -> Loop:
    def loop() -> Results:
        torch.manual_seed(1234)
        model = SometimesKeepingNet(keep)
        optimizer = sgd(model)
        logged = []
        for step, batch in enumerate(batches([4] * 10)):
            model.keeping = step in steps
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(batch[0]), batch[1])
            if model.keeping:
                features = model.kept.pop("features") if keep == "dict" else model.__dict__.pop("features")
                logged.append(features.abs().mean().item())
            loss.backward()
            optimizer.step()
        return {"logged": logged, "state": final(model, optimizer)}

    return loop


def sometimes_kept_comes_back(keep: str, when: str) -> None:
    """Before, the native path had swapped the features out in the steps that keep them and the read ran on
    0 bytes (a segmentation fault): neither the aligned iteration nor held.py saw the reference. Counted at
    the model's exit, the references to the features are more than in the iterations before (the aligned one
    counted too, for the first native one): they come back, and the report says so."""
    steps = SOMETIMES[when]
    loop = sometimes_kept_loop(keep, steps)
    plain = loop()
    hooked, report = run_hooked(loop, "native", plan_events="native")
    assert_identical(plain, hooked)
    assert report.stood_down is None
    named = [m for m in report.messages if "the script holds a reference to its tensor that earlier iterations" in m]
    assert len(named) == 1 and named[0].startswith(f"iteration {steps[0]}:"), report.messages
    assert [it.path for it in report.iterations[3:]] == ["native"] * 7
    assert all(it.mode == "planned" and it.swap_in_bytes == it.swap_out_bytes > 0 for it in report.iterations[3:])


class Flat(Net):
    """Net whose loop calls its parts one by one (its `rest` is no module): each module call is top-level."""


FLAT_LOOP = """
torch.manual_seed(1234)
model = Flat()
optimizer = sgd(model)
for batch in batches([4] * 8):
    optimizer.zero_grad(set_to_none=True)
    x = model.stem(batch[0])
    x = model.rest(x)
    F.cross_entropy(x, batch[1]).backward()
    optimizer.step()
"""


def flat_loop(where: str) -> Loop:
    """FLAT_LOOP at the top level of a script (its variables are the module's globals) or in a function."""
    indented = FLAT_LOOP.replace("\n", "\n    ")
    source = FLAT_LOOP if where == "script" else f"def train():{indented}return model, optimizer\nmodel, optimizer = train()\n"

    def loop() -> Results:
        scope = {"torch": torch, "Flat": Flat, "sgd": sgd, "batches": batches, "F": F}
        exec(compile(source, "train.py", "exec"), scope)
        return {"state": final(scope["model"], scope["optimizer"])}

    return loop


@pytest.mark.slow
@pytest.mark.parametrize("where", ["script", "function"])
def test_a_loop_of_top_level_module_calls_swaps_natively_from_its_first_native_iteration(where: str) -> None:
    """`x = model.stem(x); x = model.rest(x)`: at each top-level exit the loop's `x` and PyTorch's module
    call still hold that call's input and output. The aligned iteration counts those references as the
    native ones do, so the first native iteration finds no more than it (no tensor kept on the device)."""
    loop = flat_loop(where)
    plain = loop()
    hooked, report = run_hooked(loop, "native", plan_events="native")
    assert_identical(plain, hooked)
    assert not [m for m in report.messages if "holds a reference" in m], report.messages
    native = [it for it in report.iterations if it.path == "native"]
    assert len(native) >= 4 and all(it.swap_out_bytes == native[0].swap_out_bytes > 0 for it in native)
    assert native[0].swap_out_bytes == max(it.swap_out_bytes for it in report.iterations)


@pytest.mark.slow
@pytest.mark.parametrize("when", list(SOMETIMES))
@pytest.mark.parametrize("keep", ["attribute", "detached", "dict"])
def test_an_activation_the_script_holds_only_in_some_steps_comes_back(keep: str, when: str) -> None:
    run_in_child(f"t.sometimes_kept_comes_back({keep!r}, {when!r})")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["once", "kept", "global", "global_logging"])
def test_a_forward_hook_the_native_path_did_not_align_with_is_seen(kind: str) -> None:
    run_in_child(f"t.late_hook_is_seen({kind!r})")


# -- 7. activation checkpointing ----------------------------------------------------------------------

checkpointed_loop = losses_loop([4] * STEPS, make=lambda: net(checkpointed=True))


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_non_reentrant_activation_checkpointing_inside_the_forward(path: str) -> None:
    """The block's forward runs again inside backward (module calls and ops under an autograd node,
    batch norm's running statistics updated twice, as without Tensile); its input is what the
    native plan moves."""
    check(checkpointed_loop, path)


reentrant_loop = losses_loop([4] * STEPS, make=lambda: net(checkpointed="reentrant"))


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_reentrant_activation_checkpointing_inside_the_forward(path: str) -> None:
    """`use_reentrant=True` (older Hugging Face models' default): the recomputation runs a nested
    backward inside the checkpoint's node, made after the block's module calls, so a swap it reads
    cannot be anchored natively: with native plans (CUDA's default) it stays on the device and the
    native path carries the other."""
    report = check(reentrant_loop, path, plan_events="native" if path == "native" else "auto")
    if path == "native":
        assert any("a node reading it is made after the last module call" in m for m in report.messages), report.messages


# -- 8. two models, data-dependent control flow --------------------------------------------------------

class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 192))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z).view(-1, 3, 8, 8)


def gan_loop() -> Results:
    """A GAN: the discriminator's step, then the generator's, each with its own optimizer. Every
    optimizer step ends an iteration, so iterations alternate between two kinds."""
    torch.manual_seed(1234)
    generator, discriminator = Generator(), Net()
    g_optimizer = torch.optim.Adam(generator.parameters(), lr=1e-3)
    d_optimizer = sgd(discriminator)
    noise = torch.Generator().manual_seed(2)
    losses = []
    for real, _ in batches([4] * STEPS):
        z = torch.randn(4, 16, generator=noise)
        real_label, fake_label = torch.ones(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
        d_optimizer.zero_grad(set_to_none=True)
        fake = generator(z).detach()
        d_loss = F.cross_entropy(discriminator(real), real_label) + F.cross_entropy(discriminator(fake), fake_label)
        d_loss.backward()
        d_optimizer.step()
        g_optimizer.zero_grad(set_to_none=True)
        g_loss = F.cross_entropy(discriminator(generator(z)), real_label)
        g_loss.backward()
        g_optimizer.step()
        losses.append((d_loss.item(), g_loss.item()))
    return {"losses": losses, "g": final(generator, g_optimizer), "d": final(discriminator, d_optimizer)}


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_two_models_with_two_optimizers(path: str) -> None:
    """The native path learns one kind of iteration and meets the other: it must fall back. The other kind
    reaches the generator's exit with more references to one of its tensors than the learnt kind before it
    leaves the learnt calls: that is not the script holding the tensor, and no swap is named for it."""
    report = check(gan_loop, path, at_least=0 if path == "native" else 1)
    said = [message.split(": ", 1)[1] for message in report.messages]
    # each message once, its repeats counted: the other kind diverged every second iteration and said so each time
    assert len(said) == len(set(said)) and set(report.repeated) <= set(said), (said, report.repeated)
    if path != "native":
        return
    assert native_fell_back(report), paths_and_modes(report)
    assert not [m for m in report.messages if "holds a reference" in m], report.messages


def detour_every_third_step(model: Net, step: int) -> None:
    """The forward runs an extra module at every third step (a python `if` on the step)."""
    model.detour = step % 3 == 0


branching_loop = losses_loop([4] * 10, before_step=detour_every_third_step)


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_a_forward_that_branches_on_the_step(path: str) -> None:
    """The dispatch path diverges at the extra module's op, the native one at its module call."""
    report = check(branching_loop, path, at_least=1)
    if path == "native":
        assert native_fell_back(report), paths_and_modes(report)


def freeze_the_stem_at_step_4(model: Net, step: int) -> None:
    """Fine-tuning's usual move: the first layers stop training (no gradients, fewer autograd nodes)."""
    if step == 4:
        model.stem.requires_grad_(False)


freezing_loop = losses_loop([4] * 10, before_step=freeze_the_stem_at_step_4)


@pytest.mark.parametrize("path", PATHS)
def test_layers_frozen_mid_training(path: str) -> None:
    """The iterations after the freeze leave the plan (natively: the stem's output has no autograd node
    to anchor on), the plan is made again for the new iteration, and it runs on the path again."""
    report = check(freezing_loop, path, at_least=1)
    assert any("planning again" in m for m in report.messages), report.messages
    if path == "budget":  # the in-process planner's second plan is version 2, in the report and its iterations
        assert report.plan_version == 2 and report.iterations[-1].plan_version == 2, [
            (it.iteration, it.mode, it.plan_version) for it in report.iterations]
    if path == "native":
        assert native_fell_back(report) and report.iterations[-1].path == "native", paths_and_modes(report)


class AuxNet(Net):
    """Net with an auxiliary head (deep supervision) on the stem's output, after the block: called at
    every forward, its loss added only at some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.aux_conv = nn.Conv2d(8, 2, 1)
        self.aux = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        y = self.stem(x)
        z = self.block(y) + y
        aux = self.aux(self.aux_conv(y).flatten(1))
        h = self.pool(z).flatten(1)
        return self.head(h + h @ self.mix), aux


def auxiliary_loop() -> Results:
    """The auxiliary head's loss joins the loss at every third step (not in the recorded or the
    learning iteration): the forward is the same, backward runs the auxiliary nodes only then."""
    torch.manual_seed(1234)
    model = AuxNet()
    optimizer = sgd(model)
    for step, (x, y) in enumerate(batches([4] * STEPS)):
        optimizer.zero_grad(set_to_none=True)
        logits, aux = model(x)
        loss = F.cross_entropy(logits, y)
        if step % 3 == 0:
            loss = loss + 0.3 * F.cross_entropy(aux, y)
        loss.backward()
        optimizer.step()
    return {"state": final(model, optimizer)}


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_an_auxiliary_loss_added_every_few_steps(path: str) -> None:
    """Same module calls, another backward: a node the learnt backward never ran reads a tensor the
    plan swaps (in a child process on the native path: a read of a freed storage can crash it)."""
    if path == "native":
        check_in_child("auxiliary_loop", path)
    else:
        check(auxiliary_loop, path)


def skipping_loop() -> Results:
    """Batch 4 holds an infinite input: its loss is not finite, and the loop skips that step after
    the forward (no backward, no optimizer step), as scripts guard against bad batches."""
    model = net()
    optimizer = sgd(model)
    data = batches([4] * STEPS)
    data[4][0][0, 0, 0, 0] = float("inf")
    losses = []
    for batch in data:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(batch[0]), batch[1])
        losses.append(loss.detach())
        if not torch.isfinite(loss):
            continue
        loss.backward()
        optimizer.step()
    return {"losses": losses, "state": final(model, optimizer)}


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_a_step_skipped_after_a_non_finite_loss(path: str) -> None:
    """Two forwards within one iteration: the skipped one's graph dies with its swapped tensors."""
    check(skipping_loop, path)


class FailingOn(nn.Module):
    """Passes its input on, or raises as an allocation that ran out of memory would when `failing`."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.failing:
            raise torch.OutOfMemoryError("out of memory (raised by the test)")
        return x


def out_of_memory_loop(where: str) -> Loop:
    """Steps 4 and 5 run out of memory, in the block's forward or after backward, and the loop catches
    the error, drops the gradients and goes on with the next batch, as scripts that skip a batch too
    large for the device do: the failed steps' graphs die with their swapped tensors mid-iteration."""

    def loop() -> Results:
        model = net()
        failing = FailingOn()
        model.block = nn.Sequential(model.block, failing)
        optimizer = sgd(model)
        losses, skipped = [], 0
        for step, batch in enumerate(batches([4] * 10)):
            failing.failing = where == "forward" and step in (4, 5)
            try:
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(batch[0]), batch[1])
                loss.backward()
                if where == "backward" and step in (4, 5):
                    raise torch.OutOfMemoryError("out of memory (raised by the test)")
                optimizer.step()
                losses.append(loss.detach())
            except torch.OutOfMemoryError:
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
        return {"losses": losses, "skipped": skipped, "state": final(model, optimizer)}

    return loop


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("path", PATHS)
def test_steps_skipped_after_running_out_of_memory(where: str, path: str) -> None:
    report = check(out_of_memory_loop(where), path)
    assert any(it.mode == "diverged" for it in report.iterations), paths_and_modes(report)


def amp_loop(init_scale: float) -> Loop:
    """bf16 autocast with a GradScaler, the usual mixed-precision loop; from a scale of 2**127 the
    first steps overflow and the scaler skips them (no optimizer step: two forwards in one iteration)."""

    def loop() -> Results:
        model = net()
        optimizer = sgd(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        losses = []
        for batch in batches([4] * 10):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(batch[0]), batch[1])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.detach())
        return {"losses": losses, "state": final(model, optimizer), "scale": scaler.get_scale()}

    return loop


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_mixed_precision_with_a_grad_scaler(path: str) -> None:
    check(amp_loop(2.0**16), path)


@pytest.mark.slow
def test_mixed_precision_steps_the_scaler_skips_leave_the_native_path_safely() -> None:
    """A skipped step joins two forwards in one iteration: the native iteration leaves the learnt module
    calls, brings its tensors back and falls back, bit-identical."""
    loop = amp_loop(2.0**127)
    plain = loop()
    hooked, report = run_hooked(loop, "native")
    assert_identical(plain, hooked)
    assert report.stood_down is None and native_fell_back(report), paths_and_modes(report)


def backward_calls_loop(call: str) -> Loop:
    """Other ways to run backward: two losses through one graph (`retain_graph=True`, then a second
    backward), `backward(inputs=...)` for some layers only, and `torch.autograd.grad` whose gradients the
    loop assigns itself."""

    def loop() -> Results:
        model = net()
        optimizer = sgd(model)
        losses = []
        for x, y in batches([4] * STEPS):
            optimizer.zero_grad(set_to_none=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            if call == "retain_graph":
                loss.backward(retain_graph=True)
                logits.pow(2).mean().backward()
            elif call == "inputs":
                loss.backward(inputs=[*model.head.parameters(), *model.block.parameters()])
            else:
                params = list(model.parameters())
                for param, grad in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
                    param.grad = grad
            optimizer.step()
            losses.append(loss.detach())
        return {"losses": losses, "state": final(model, optimizer)}

    return loop


@pytest.mark.slow
@pytest.mark.parametrize("call", ["retain_graph", "inputs", "autograd.grad"])
@pytest.mark.parametrize("path", PATHS)
def test_backward_run_other_ways(call: str, path: str) -> None:
    check(backward_calls_loop(call), path)



def closure_loop(optimizer_of: Callable[[nn.Module], torch.optim.Optimizer] = sgd, keyword: bool = True) -> Loop:
    """The optimizer's step runs the forward and backward from a closure: PyTorch Lightning gives every step one
    (`step(closure=...)`), LBFGS needs one (`step(closure)`, evaluated several times a step)."""

    def loop() -> Results:
        model = net()
        optimizer = optimizer_of(model)
        losses = []
        for x, y in batches([4] * STEPS):
            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss

            loss = optimizer.step(closure=closure) if keyword else optimizer.step(closure)
            losses.append(loss.detach())
        return {"losses": losses, "state": final(model, optimizer)}

    return loop


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_a_step_that_runs_a_closure(path: str) -> None:
    """What the closure runs counts as outside the step, where iterations start and the native path acts. Inside
    it, the first iteration never ended: every op of the run went through the dispatch mode, nothing was planned,
    and the report, of one iteration, said nothing."""
    report = check(closure_loop(keyword=path != "native"), path)
    assert len(report.iterations) == STEPS, paths_and_modes(report)


def ddp_loop(accumulate: int) -> Loop:
    """The model wrapped in DistributedDataParallel (one process, gloo): its reducer's hooks on the gradients
    and its buckets, and gradient accumulation over `accumulate` batches under `no_sync()` (the reducer
    sits out all but the last backward of each step). `extra`, run on some steps only elsewhere, is unused here."""

    def loop() -> Results:
        model = nn.parallel.DistributedDataParallel(net(), find_unused_parameters=True)
        optimizer = sgd(model)
        losses = []
        for i, batch in enumerate(batches([4] * (STEPS * accumulate))):
            last = (i + 1) % accumulate == 0
            with contextlib.nullcontext() if last else model.no_sync():
                loss, _ = forward_backward(model, batch)
            if last:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return {"losses": losses, "state": final(model.module, optimizer)}

    return loop


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_distributed_data_parallel_with_gradient_accumulation(path: str, tmp_path: Path) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        check(ddp_loop(accumulate=2), path)
    finally:
        torch.distributed.destroy_process_group()


class ScaledSGD(torch.optim.SGD):
    """A third-party step whose argument is no closure: `step(0.5)` halves the learning rate for that step."""

    def step(self, scale: float = 1.0) -> None:  # type: ignore[override]
        for group in self.param_groups:
            group["lr"] *= scale
        super().step()
        for group in self.param_groups:
            group["lr"] /= scale


@pytest.mark.slow
def test_a_steps_argument_that_is_no_closure_is_handed_on_as_it_was() -> None:
    def halved() -> Results:
        model = net()
        optimizer = ScaledSGD(model.parameters(), lr=0.1)
        for batch in batches([4] * STEPS):
            optimizer.zero_grad(set_to_none=True)
            forward_backward(model, batch)
            optimizer.step(0.5)
        return {"state": final(model, optimizer)}

    check(halved, "dispatch")


@pytest.mark.slow
def test_lbfgs_steps_are_iterations_of_several_evaluations() -> None:
    """Each LBFGS step evaluates the closure up to `max_iter` times and runs ops of its own that grow with its
    history: its iterations diverge from their plans and are planned again, which costs time, never correctness.
    Before, its one iteration was never planned."""
    loop = closure_loop(lambda model: torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3), keyword=False)
    plain = loop()
    hooked, report = run_hooked(loop, "budget")
    assert_identical(plain, hooked)
    assert report.stood_down is None and len(report.iterations) == STEPS, paths_and_modes(report)
    assert report.plan_source == "local", report.messages

def two_views_loop() -> Results:
    """Two forwards of one model per step (a consistency loss between a batch and its mirror image, as
    in semi-supervised and contrastive training): every activation of both is alive in one backward."""
    model = net()
    optimizer = sgd(model)
    losses = []
    for x, y in batches([4] * STEPS):
        optimizer.zero_grad(set_to_none=True)
        logits, mirrored = model(x), model(x.flip(-1))
        loss = F.cross_entropy(logits, y) + F.mse_loss(logits.softmax(1), mirrored.softmax(1))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": losses, "state": final(model, optimizer)}


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_two_forwards_per_step(path: str) -> None:
    check(two_views_loop, path)


def penalty_loop() -> Results:
    """A gradient penalty (WGAN-GP, R1): torch.autograd.grad with create_graph=True through the model,
    then backward through both: activations read in two backward passes."""
    model = net()
    optimizer = sgd(model)
    for x, y in batches([4] * STEPS):
        optimizer.zero_grad(set_to_none=True)
        x = x.requires_grad_()
        loss = F.cross_entropy(model(x), y)
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + grad.pow(2).sum()).backward()
        optimizer.step()
    return {"state": final(model, optimizer)}


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_a_gradient_penalty_through_a_double_backward(path: str) -> None:
    """The second backward's nodes are made by the first backward, after the last module call: no
    module boundary can hook them, so the native plan stays on the dispatch path and says why."""
    if path != "native":
        check(penalty_loop, path)
        return
    plain = penalty_loop()
    hooked, report = run_hooked(penalty_loop, path)
    assert_identical(plain, hooked)
    assert report.stood_down is None
    planned = [it for it in report.iterations if it.mode == "planned" and moved(it)]
    assert len(planned) >= 2 and all(it.path == "dispatch" for it in report.iterations), paths_and_modes(report)
    assert any("do not align with module calls" in m and "made after the last module call" in m
               for m in report.messages), report.messages


def sparse_embedding_loop() -> Results:
    """nn.Embedding(sparse=True) with SparseAdam, a dense head with Adam: the embedding's gradient is a sparse tensor."""
    torch.manual_seed(1234)
    embedding, head = nn.Embedding(500, 16, sparse=True), nn.Linear(16, 10)
    sparse, dense = torch.optim.SparseAdam(embedding.parameters()), torch.optim.Adam(head.parameters())
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        x, y = torch.randint(0, 500, (8, 4), generator=generator), torch.randint(0, 10, (8,), generator=generator)
        for optimizer in (sparse, dense):
            optimizer.zero_grad()
        F.cross_entropy(head(embedding(x).mean(1)), y).backward()
        for optimizer in (sparse, dense):
            optimizer.step()
    return {"embedding": state_of(embedding, [sparse]), "head": final(head, dense)}


def test_sparse_gradients_stand_the_hook_down_saying_why(caplog: pytest.LogCaptureFixture) -> None:
    """It stood down with a NotImplementedError traceback ("Cannot access storage of SparseTensorImpl") as if it
    had failed; sparse tensors are what it does not schedule, and it says so in one line."""
    plain = sparse_embedding_loop()
    with caplog.at_level(logging.WARNING, logger="tensile.hook"):
        hooked, report = run_hooked(sparse_embedding_loop, "budget")
    assert_identical(plain, hooked)
    assert report.stood_down is not None and "layout torch.sparse_coo: Tensile schedules strided tensors only" in report.stood_down
    assert not any(record.exc_info for record in caplog.records), "a traceback for what is no failure"


def by_hand_loop() -> Results:
    """SGD written out: no torch.optim optimizer, so no step for the hook to find iterations by."""
    model = net()
    for x, y in batches([4] * 4):
        model.zero_grad(set_to_none=True)
        forward_backward(model, (x, y))
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.grad is not None:  # the detour's conv has none
                    parameter -= 0.1 * parameter.grad
    return {"state": final(model)}


@pytest.mark.slow
def test_a_loop_without_an_optimizer_step_is_said_not_planned() -> None:
    """It ran to the end with an empty report, no message, `0 iterations ... peak 0.0 MiB`, as if measured."""
    plain = by_hand_loop()
    hooked, report = run_hooked(by_hand_loop, "budget")
    assert_identical(plain, hooked)
    assert report.iterations == [] and report.stood_down is None
    assert any("no optimizer step was seen" in m for m in report.messages), report.messages


def test_training_in_another_thread_is_said_not_planned() -> None:
    """Optimizer step hooks are global, the dispatch mode is the starting thread's: the steps came with no op, and
    two training threads crashed the planner on an empty workload (the hook stood down with its traceback)."""
    import threading

    results: list[Results] = []
    plain = losses_loop([4] * 4)()
    executor = activate(HookSettings(job="job", memory_budget=0.6), planner=local_planner(HookSettings(job="job"), torch.device("cpu")),
                        device=torch.device("cpu"))
    try:
        worker = threading.Thread(target=lambda: results.append(losses_loop([4] * 4)()))
        worker.start()
        worker.join()
    finally:
        deactivate()
    assert_identical(plain, results[0])
    report = executor.report
    assert report.stood_down is None, report.stood_down
    assert any("training in another thread is not carried" in m for m in report.messages), report.messages
