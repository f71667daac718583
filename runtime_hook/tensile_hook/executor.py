"""The paper's Executor inside the user's process: a dispatch mode that sees every aten op, for
the iterations that need it, and native hooks for the others.

Its parts, each a module of its own, share where the run stands (`run_state.py`):
- `dispatch.py`: the dispatch path, a TorchDispatchMode that checks each op's inputs before use, runs it,
  records the iteration the plan is matched against, and fires the plan's events at their trigger ops;
- `residency.py`: where each storage is, the events applied (swap out/in, release, recompute), the check
  before use and the budget guard;
- `plan_book.py`: where plans come from (a file, the node agent, the local planner, per shape set the last
  made for it) and which one applies next;
- `iterations.py`: iterations delimited by optimizer step hooks, closed into the report, matched against the
  plan's signature;
- `paths.py`: each iteration's path, chosen at the step: the dispatch path, or the native path, which leaves
  the mode, starts iterations at the first module forward after a step and carries activation swaps on
  module and node hooks (`native_swaps.py`, through this class as its `NativeHost`).
Anything that goes wrong inside the hook makes it stand down: every tensor comes back to the device and
training goes on without Tensile.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from tensile.plan import Plan
from tensile.workload import Workload
from tensile_hook.dispatch import DispatchPath, Unsupported
from tensile_hook.iterations import IterationListener, Iterations
from tensile_hook.latency_samples import OpSampler
from tensile_hook.paths import Paths
from tensile_hook.plan_book import PlanBook, Planner
from tensile_hook.report import HookReport
from tensile_hook.residency import Residency
from tensile_hook.run_state import RunState
from tensile_hook.settings import HookSettings
from tensile_hook.swap_stages import NativeSwaps

log = logging.getLogger("tensile.hook")


class PlanExecutor:
    """The executor's parts wired together, and what the rest of the hook calls on it: activation, the optimizer's
    step hooks, reads outside the dispatcher, a fork, the stand-down, the end."""

    def __init__(
        self,
        settings: HookSettings,
        device: torch.device,
        plan: Plan | None = None,
        plan_workload: Workload | None = None,
        planner: Planner | None = None,
        listener: IterationListener | None = None,
    ) -> None:
        self.report = HookReport(job=settings.job, device=str(device))
        self.state = state = RunState(settings, device, self.report)
        self.swaps = NativeSwaps(self)  # activation swaps on the native path: aligned, then carried
        self.residency = Residency(state, self.swaps, self._storage_freed)
        self.plans = PlanBook(state, planner)
        # op latencies for the node agent's drift rule, only where a link to one listens
        sampler = OpSampler(state.device_type, settings.latency_sample_every if settings.agent_url and listener else 0)
        self.dispatch = DispatchPath(state, self.residency, self.swaps, sampler, self._begin_iteration, self.stand_down)
        self.paths = Paths(state, self.plans, self.residency, self.swaps, sampler, self.dispatch, self._begin_iteration,
                           self.stand_down)
        self.iterations = Iterations(state, self.plans, self.residency, self.paths, self.dispatch, self.swaps, sampler,
                                     listener, self.stand_down)
        if plan is not None and plan_workload is not None:
            self.plans.offer(plan, plan_workload, "file")

    def _begin_iteration(self) -> None:
        self.iterations.begin()

    def _storage_freed(self, key: int) -> None:
        self.dispatch.storage_freed(key)

    @property
    def disabled(self) -> bool:
        """Stood down (or in a forked child): training goes on without Tensile."""
        return self.state.disabled

    @property
    def live(self) -> Workload | None:
        """The live iteration the plans in force were matched against."""
        return self.plans.live

    @property
    def observe_native(self) -> bool:
        """Native iterations observed by the dispatch mode (their CPU peak measured): for tests and audits."""
        return self.paths.observe_native

    @observe_native.setter
    def observe_native(self, observe: bool) -> None:
        self.paths.observe_native = observe

    # -- activation and the optimizer's steps -------------------------------------------------
    def __enter__(self) -> PlanExecutor:
        self.paths.push()
        return self

    def __exit__(self, *exc: Any) -> None:
        """Deactivation: off the stack (if on it) and every native hook removed."""
        self.paths.remove()

    def step_pre_hook(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        return self.iterations.step_pre_hook(optimizer, args, kwargs)

    def step_post_hook(self, *args: Any) -> None:
        self.iterations.step_post_hook(*args)

    def ended_by(self, kind: str) -> None:
        """The script ends with an uncaught exception of this type: the report says so rather than that no step was
        seen."""
        self.state.ended_by = kind

    def finish(self) -> None:
        """At exit: close the last iteration and write the report."""
        self.iterations.finish()

    # -- the native path's host ---------------------------------------------------------------
    def start_at_module(self, module: torch.nn.Module, args: Any) -> None:
        self.paths.start_at_module(module, args)

    def stand_down(self, exc: BaseException) -> None:
        """Tensile's own failure: bring everything back and let training go on without it."""
        state = self.state
        if state.disabled:
            return
        state.disabled = True
        self.swaps.stop()
        if isinstance(exc, Unsupported):
            reason = str(exc)
            log.warning("tensile: %s; the hook stands down and training continues without Tensile", reason)
        else:
            reason = f"{type(exc).__name__}: {exc}"
            log.exception("tensile: the hook failed and stands down; training continues without Tensile")
        state.report.stood_down = reason
        state.stats.mode = "stood_down"
        self.residency.restore_each()
        state.active = None
        self.plans.forget_plans()

    # -- reads outside the dispatcher, and forks ----------------------------------------------
    @contextlib.contextmanager
    def reading_outside(self, saving: bool = False) -> Iterator[None]:
        """A read outside the dispatcher runs (torch.save, a deepcopy, pickling for another process): the
        ops it makes are only watched (`DispatchPath.only_watching`), nothing is evicted or fired. Saving, on the
        dispatch path after a step, starts the next iteration, as its first detach of a parameter did before
        its ops were only watched: code after the last step (a final state_dict) is no part of the last
        iteration. (A deepcopy, a share or a numpy() never started one: they stay out of it.)"""
        state = self.state
        if saving and state.in_mode and state.start_due():
            try:
                self.iterations.begin()
            except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
                self.stand_down(exc)
        with self.dispatch.only_watching():
            yield

    def bring_back(self, storage: torch.UntypedStorage, pin: bool) -> None:
        """A storage about to be read outside the dispatcher: back now, pinned where it stays read so."""
        self.residency.bring_back(storage, pin)

    def restore_all(self) -> None:
        """Before anything reads storages outside the dispatcher (state_dict, torch.save)."""
        self.residency.restore_all()

    def leave_in_forked_child(self) -> None:
        """A forked process (a DataLoader worker) inherits this executor, its mode on the stack and what it
        had swapped out, but trains nothing: on the CPU device what is absent comes back (the worker may read
        a dataset the guard evicted; on CUDA the child cannot touch the device), then the hook is off there.
        It never writes the job's report or reports to the agent."""
        state = self.state
        self.iterations.go_quiet()
        if state.device_type == "cpu" and not state.disabled:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # OpenMP's threads did not survive the fork: a parallel copy would hang
            try:
                self.residency.restore_absent()
            except Exception:  # noqa: BLE001 - the child must start regardless
                log.exception("tensile: could not restore a tensor in a forked process")
            finally:
                torch.set_num_threads(threads)
        state.disabled = True
