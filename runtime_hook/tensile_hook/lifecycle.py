"""Switching the hook on and off in this process: `activate`, `deactivate`, `activate_from_env`.

Apart from the package's `__init__` so that importing `tensile_hook` (the init container's
`python -m tensile_hook.install`, which only copies files) does not load torch.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict
from types import TracebackType

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from tensile.plan import Plan
from tensile_hook.executor import PlanExecutor
from tensile_hook.iterations import IterationListener
from tensile_hook.memory_cap import MemoryCap
from tensile_hook.outside_reads import guard_outside_reads
from tensile_hook.plan_book import Planner
from tensile_hook.settings import HookSettings
from tensile_hook.termination import default_sigterm, exit_on_sigterm
from tensile.workload import Workload

log = logging.getLogger("tensile.hook")
# the oldest PyTorch the whole suite passes with (2.10.0; and 2.11.0, the GPU image's). Under 2.9.1
# a training under a budget crashed pickling a checkpoint (torch.save of the model object), and the native path never
# engaged
OLDEST_TORCH = (2, 10)
_active: PlanExecutor | None = None
_undo: list[Callable[[], None]] = []


def _forked_child() -> None:
    """A process forked from a hooked one (a DataLoader worker) trains nothing of its own."""
    if _active is not None:
        _active.leave_in_forked_child()
    default_sigterm()  # its end is its parent's business, as before the hook


os.register_at_fork(after_in_child=_forked_child)


def activate(
    settings: HookSettings,
    plan: Plan | None = None,
    plan_workload: Workload | None = None,
    planner: Planner | None = None,
    device: torch.device | None = None,
    listener: IterationListener | None = None,
) -> PlanExecutor:
    """Install the executor for this thread's PyTorch calls, with optimizer step hooks for iterations."""
    global _active
    if _active is not None:
        raise RuntimeError("the Tensile hook is already active in this process")
    if device is None:
        device = _default_device()
    executor = PlanExecutor(settings, device, plan, plan_workload, planner, listener)
    pre = register_optimizer_step_pre_hook(executor.step_pre_hook)
    post = register_optimizer_step_post_hook(executor.step_post_hook)
    _undo.extend([pre.remove, post.remove])
    _undo.extend(guard_outside_reads(executor))
    _undo.append(_note_uncaught(executor))
    executor.__enter__()
    atexit.register(executor.finish)
    _active = executor
    return executor


def _note_uncaught(executor: PlanExecutor) -> Callable[[], None]:
    """Tell the executor of an exception that ends the script (Python calls sys.excepthook before the exit handlers
    that write the report), the script's own hook still called; the undo puts the previous hook back."""
    previous = sys.excepthook

    def note(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        executor.ended_by(kind.__name__)
        previous(kind, value, traceback)

    sys.excepthook = note

    def undo() -> None:
        if sys.excepthook is note:
            sys.excepthook = previous

    return undo


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


def activate_from_env(memory_cap: MemoryCap | None = None) -> PlanExecutor:
    """What sitecustomize calls: settings, plan and planner from TENSILE_* variables; with
    TENSILE_AGENT the node agent plans (the local planner is the fallback while it cannot). `memory_cap`: the cap
    sitecustomize set on the process's CUDA memory, for the report and the agent."""
    from tensile_hook.plan_source import agent_link, load_plan_files, local_planner

    check_torch(str(torch.__version__))
    settings = HookSettings.from_env()
    plan, workload = load_plan_files(settings)
    device = _default_device()
    planner = local_planner(settings, device)
    link = agent_link(settings, planner, memory_cap)
    if link is None:
        executor = activate(settings, plan, workload, planner, device)
    else:
        # registered before activate()'s own handler: atexit runs it after the executor's last report
        atexit.register(link.close)
        _undo.append(lambda: atexit.unregister(link.close))
        try:
            executor = activate(settings, plan, workload, link.planner, device, link.listener)
        except Exception:
            link.close()
            raise
        _undo.insert(0, link.close)  # deactivate(): after the executor's finish, before the rest is undone
    if exit_on_sigterm():
        _undo.append(default_sigterm)
    executor.report.memory_cap = asdict(memory_cap) if memory_cap is not None else None
    return executor


class UnsupportedPyTorch(RuntimeError):
    """The training's PyTorch is older than any the hook was checked with: it stays off (sitecustomize says so)."""


def check_torch(version: str) -> None:
    """Refuse a PyTorch older than OLDEST_TORCH, by its release alone: a build of a release (`2.11.0+cu130`) or a
    pre-release of it (`2.11.0a0+git...`, as NVIDIA's images number theirs) counts as that release."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) < OLDEST_TORCH:
        oldest = ".".join(map(str, OLDEST_TORCH))
        raise UnsupportedPyTorch(f"PyTorch {version} is older than {oldest}, the oldest the hook is checked with; "
                                 f"train with PyTorch {oldest} or newer to have Tensile schedule its memory")


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
