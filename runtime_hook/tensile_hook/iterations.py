"""Where iterations begin and end. Optimizer step hooks close one; the next starts at the first forward op on a
parameter after them (the dispatch path) or at the first module call (off the mode). At an iteration's end its
figures join the report, the recorded iteration is matched against the plan's signature (`PlanBook.match`), and
a listener (the node agent's link) may hand a newer plan. Iterations that keep leaving the plan, or run on new
shapes, are recorded and planned again."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch

from tensile.plan import Plan
from tensile_hook.dispatch import DispatchPath
from tensile_hook.latency_samples import OpSampler, OpSamples
from tensile_hook.paths import Paths
from tensile_hook.plan_book import OTHER_THREAD, PlanBook
from tensile_hook.report import HookReport, IterationStats, ReportWriter
from tensile_hook.residency import Residency
from tensile_hook.run_state import RunState
from tensile_hook.shapes import MAX_SHAPE_SETS, ShapeKey
from tensile_hook.swap_stages import NativeSwaps
from tensile_hook.termination import raise_if_terminated

log = logging.getLogger("tensile.hook")
MAX_DIVERGED = 3  # iterations in a row that leave the plan before it is made again


class IterationListener(Protocol):
    """Called after every iteration with its figures and the run's report, and for a sampling iteration (only with a
    node agent: `latency_samples.py`) its op latencies; returns a newer plan for the same workload (the agent
    re-planned: drift, knobs, a neighbour came or went) or None."""

    def __call__(self, stats: IterationStats, report: HookReport, samples: OpSamples | None = None) -> Plan | None: ...


class Iterations:
    """The optimizer's step hooks, each iteration's start and end, and the report they fill."""

    def __init__(self, state: RunState, plans: PlanBook, residency: Residency, paths: Paths, dispatch: DispatchPath,
                 swaps: NativeSwaps, sampler: OpSampler, listener: IterationListener | None,
                 stand_down: Callable[[BaseException], None]) -> None:
        self.state = state
        self.plans = plans
        self.residency = residency
        self.paths = paths
        self.dispatch = dispatch
        self.swaps = swaps
        self.sampler = sampler
        self.listener = listener
        self.stand_down = stand_down
        settings = state.settings
        self.report_writer = (ReportWriter(settings.report_path, settings.report_interval) if settings.report_path
                              else None)
        self.iteration_started = time.perf_counter()
        self.diverged_in_a_row = 0
        # this iteration's shapes: not the prepared plan's, and whether no plan is theirs (`_follow_shapes`)
        self.reshaped = False
        self.off_shape = False

    # -- the optimizer's step -----------------------------------------------------------------
    def step_pre_hook(self, _optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A step given a closure runs the training's forward and backward itself, inside the step (LBFGS's
        `step(closure)`, PyTorch Lightning's every step): the closure is handed on wrapped, so that what it runs counts
        as outside the step, where an iteration starts and the native path acts. Inside the step, the first iteration
        never ended: the whole run went through the dispatch mode, nothing planned, and the report said nothing."""
        state = self.state
        state.in_step += 1
        positional = len(args) > 1  # args[0] is the optimizer
        closure = args[1] if positional else kwargs.get("closure")
        if not callable(closure) or state.disabled:  # a third-party step's other argument is handed on as it was
            return None
        wrapped = partial(self._outside_step, closure)
        return ((args[0], wrapped, *args[2:]), kwargs) if positional else (args, {**kwargs, "closure": wrapped})

    def _outside_step(self, closure: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        state = self.state
        state.in_step -= 1
        try:
            return closure(*args, **kwargs)
        finally:
            state.in_step += 1

    def step_post_hook(self, *_: Any) -> None:
        """Timed as a whole: the restores here subtract their copies from `hook_seconds` (see `Residency`)."""
        started = time.perf_counter()
        state = self.state
        state.in_step = max(0, state.in_step - 1)
        state.step_done = True
        try:
            if self.dispatch.divergence is not None:
                self.dispatch.say_divergence(stepped=True)
            self.paths.at_step(self.off_shape)
        except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
            self.stand_down(exc)
        state.stats.hook_seconds += time.perf_counter() - started
        raise_if_terminated()  # a SIGTERM whose SystemExit a callback swallowed ends the training here

    # -- an iteration's start and end ---------------------------------------------------------
    def begin(self) -> None:
        """The last iteration ends and the next starts: its plan, its figures, its path."""
        state, plans = self.state, self.plans
        self._finish()
        self._write_report()
        state.previous_planned = state.active is not None
        self.diverged_in_a_row = self.diverged_in_a_row + 1 if state.stats.mode == "diverged" else 0
        if self.diverged_in_a_row >= MAX_DIVERGED:
            state.say(f"{MAX_DIVERGED} iterations in a row diverged from the plan: planning again from the next one")
            plans.forget_plans()
            state.match_at = state.iteration + 1
            self.diverged_in_a_row = 0
        state.iteration += 1
        state.step_done = False
        state.op_index = 0
        self.residency.begin_iteration()
        self._follow_shapes(self.paths.entry_shapes())
        if state.iteration == state.match_at:
            self.dispatch.start_recording()
        state.active = None if state.disabled else plans.ready
        active = state.active
        mode = "planned" if active else ("recording" if state.iteration <= state.match_at else "guarded")
        state.stats = IterationStats(state.iteration, mode, active.plan.version if active else None)
        self.paths.choose(self.reshaped)
        if (state.path == "dispatch" and plans.live is not None and state.iteration > state.match_at
                and not self.off_shape and not state.disabled and self.sampler.due(state.iteration)):
            self.sampler.begin(state.iteration, plans.live)
        learn = not (self.off_shape or state.iteration == state.match_at)  # aligning a plan on its own shapes only
        self.swaps.begin(state.active, state.path == "native", learn)
        self.iteration_started = time.perf_counter()

    def _follow_shapes(self, key: ShapeKey | None) -> None:
        """An iteration on shapes other than the plan's (a larger batch, an epoch's last batch, bf16 autocast from
        now on) is, as at a signature mismatch, recorded on the dispatch path, under the budget guard, and planned
        from, said once; shapes seen before take back the plan made for them, on the dispatch path for that
        iteration (the step prepared the other plan's native hooks); past MAX_SHAPE_SETS, shapes without a plan
        run under the plan in force on the dispatch path, guarded, without re-planning."""
        state, plans = self.state, self.plans
        self.reshaped = self.off_shape = False
        if state.iteration == state.match_at:  # recorded (iteration 1, a re-plan): the plan made from it is for these
            plans.recorded_shapes(key)
            return
        if key is None or not plans.other_shapes(key):
            return
        self.reshaped = True
        if not plans.can_follow(key):
            self.off_shape = True
            state.say(f"the batch's shapes changed again, past the {MAX_SHAPE_SETS} shape sets planned for: iterations "
                      "on shapes without a plan of their own run under the plan in force on the dispatch path, where "
                      "the budget guard keeps the memory budget", logging.INFO)
            return
        state.previous_planned = False  # another workload: its cross-iteration events are not the last iteration's
        state.keys.clear()
        if not plans.switch_shapes(key):
            state.match_at = state.iteration

    def _finish(self) -> None:
        """The iteration's figures into the report; the recorded one matched against the plan; a newer plan taken."""
        state = self.state
        self.residency.end_iteration()
        stats = state.stats
        stats.seconds = time.perf_counter() - self.iteration_started
        # on CUDA after the iteration's time: its synchronisation is no part of it; where none is sampled (most
        # iterations, every one without an agent) not even the call, whose lists are made anew
        samples = self.sampler.end() if self.sampler.begun else None
        recorded = state.iteration == state.match_at
        stats.ops = self.dispatch.ops_recorded() if recorded else state.op_index
        if state.device_type == "cuda":
            stats.peak_bytes = torch.cuda.max_memory_allocated(state.device)
            stats.reserved_bytes = torch.cuda.max_memory_reserved(state.device)
            torch.cuda.reset_peak_memory_stats(state.device)
        else:
            if stats.peak_source == "planned":  # nothing watched the storages: the forecast, marked as such
                forecast = state.report.scheduled_peak_bytes if state.active else None
                stats.peak_bytes = forecast or self.plans.vanilla_peak or 0
            stats.reserved_bytes = stats.peak_bytes  # no caching allocator on the CPU (IterationStats.reserved_bytes)
        state.report.add(stats)
        if not state.disabled and recorded:
            live = self.dispatch.recorded()
            if state.device_type == "cuda":
                self._measure_workspace()
            self.plans.match(live)
        if self.listener is not None and not state.disabled:
            # only a link to an agent gets samples (`sampler`): a listener of two arguments is called with two
            report = state.report
            newer = self.listener(stats, report) if samples is None else self.listener(stats, report, samples)
            self.plans.take_newer(newer)

    def _measure_workspace(self) -> None:
        """What the CUDA allocator held at the recorded iteration's peak beyond the tensors the hook tracks (and the
        forecast counts): cuBLAS's and cuDNN's workspaces, its rounding (on an H100 the paper's five models' allocator
        peaks stood 92-127 MB above their forecasts at batch 16). No plan moves it, and the operator books it per job
        outside the budget (`placement.py`'s context_bytes), so measured peaks are held to the budget plus it: held to
        the budget alone, ResNet-50's aligned iteration measured 101 MB over a budget its plan kept, and every one
        after ran on the dispatch path, 3.7x slower.
        The newest shapes' figure counts (a workspace follows the shapes)."""
        state = self.state
        state.report.workspace_bytes = max(0, state.stats.peak_bytes - self.residency.tracked_peak)

    def _write_report(self, now: bool = False) -> None:
        """The --report file, when due (its writer spaces the writes out) or `now` (at the end)."""
        if self.report_writer is not None and (now or self.report_writer.due()):
            self.report_writer.write(self.state.report)

    def go_quiet(self) -> None:
        """A forked process (a DataLoader worker) never writes the job's report or reports to the agent."""
        self.report_writer = None
        self.listener = None

    def finish(self) -> None:
        """At exit: close the last iteration and write the report."""
        state = self.state
        self.dispatch.say_divergence(stepped=False)
        if state.step_done:
            self._finish()
            state.step_done = False
        # a launcher (a script that starts the training as a process of its own, `accelerate launch`): its empty
        # report ("no optimizer step was seen", 0 iterations) replaced the training's at exit
        if not state.report.iterations and self.report_writer is not None and self.report_writer.written_elsewhere():
            log.info("tensile: this process ran no iteration; the report another process of the run wrote is kept")
            return
        if not state.disabled:
            self._say_nothing_carried()
        self._write_report(now=True)

    def _say_nothing_carried(self) -> None:
        """Training the hook could not follow ends with a report that says so, not with an empty one whose zero
        peak reads as measured (`0 iterations ... peak 0.0 MiB` and no word, for SGD written out by hand)."""
        iterations = self.state.report.iterations
        if not iterations and self.state.ended_by:  # the script's own error, said above it: no word of the hook's
            self.state.say(f"the script ended with {self.state.ended_by} before its first optimizer step (its traceback "
                           "is above): nothing was planned or measured")
        elif not iterations:
            self.state.say("no optimizer step was seen: Tensile finds training iterations by torch.optim steps (a loop "
                           "that updates parameters by hand has none, and processes torch.multiprocessing.spawn starts "
                           "run without the hook), so nothing was planned or measured")
        elif not any(it.ops for it in iterations):
            self.state.say(OTHER_THREAD)
