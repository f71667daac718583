"""The Tensile runtime hook: carries TENSILE plans out inside an unmodified PyTorch process.

Switched on by `sitecustomize` when TENSILE_JOB is set (`tensile run`, or the operator's pod), or by
calling `activate()`. It never imports FastAPI, Kopf or kubernetes: it runs in the user's image.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from tensile.plan import Plan
from tensile.runtime_hook.executor import PlanExecutor, Planner
from tensile.runtime_hook.settings import HookSettings

log = logging.getLogger("tensile.hook")
_active: PlanExecutor | None = None
_undo: list[Callable[[], None]] = []


def _patch_state_dict(executor: PlanExecutor) -> None:
    """state_dict() and torch.save read storages outside the dispatcher: bring everything back first."""
    for owner in (torch.nn.Module, torch.optim.Optimizer):
        original = owner.state_dict

        def state_dict(self, *args, __original=original, **kwargs):  # type: ignore[no-untyped-def]
            if not executor.disabled:
                executor.restore_all()
            return __original(self, *args, **kwargs)

        owner.state_dict = state_dict  # type: ignore[method-assign]
        _undo.append(lambda owner=owner, original=original: setattr(owner, "state_dict", original))


def activate(
    settings: HookSettings,
    plan: Plan | None = None,
    plan_workload=None,  # type: ignore[no-untyped-def]
    planner: Planner | None = None,
    device: torch.device | None = None,
) -> PlanExecutor:
    """Install the executor for this thread's PyTorch calls, with optimizer step hooks for iterations."""
    global _active
    if _active is not None:
        raise RuntimeError("the Tensile hook is already active in this process")
    if device is None:
        device = _default_device()
    executor = PlanExecutor(settings, device, plan, plan_workload, planner)
    pre = register_optimizer_step_pre_hook(executor.step_pre_hook)
    post = register_optimizer_step_post_hook(executor.step_post_hook)
    _undo.extend([pre.remove, post.remove])
    _patch_state_dict(executor)
    executor.__enter__()
    atexit.register(executor.finish)
    _active = executor
    return executor


def deactivate() -> None:
    """Leave the process as it was (tests run several hooked trainings in one process)."""
    global _active
    if _active is None:
        return
    executor, _active = _active, None
    executor.restore_all()
    executor.__exit__(None, None, None)
    executor.finish()
    atexit.unregister(executor.finish)
    while _undo:
        _undo.pop()()


def activate_from_env() -> PlanExecutor:
    """What sitecustomize calls: settings, plan and planner from TENSILE_* variables."""
    from tensile.runtime_hook.plan_source import load_plan_files, local_planner

    settings = HookSettings.from_env()
    plan, workload = load_plan_files(settings)
    device = _default_device()
    return activate(settings, plan, workload, local_planner(settings, device), device)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
