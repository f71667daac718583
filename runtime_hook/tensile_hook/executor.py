"""The paper's Executor inside the user's process: a dispatch mode that sees every aten op, for
the iterations that need it, and native hooks for the others.

On the dispatch path (the recorded iteration, the first one under a plan, plans with events the
native hooks cannot carry, budget guarding), per op it (1) checks that every input is resident and fetches it if not (a stall: a late or wrong
plan costs time, never correctness), (2) runs the op, (3) records it with the tracer's Recorder so
live tensors map positionally onto the plan's tensor ids, and (4) fires the plan's events whose
trigger is this op. Iterations are delimited by optimizer step hooks. Anything that goes wrong
inside the hook makes it stand down: every tensor comes back to the device and training goes on
without Tensile.

On the native path (`native_map.py` says which plans may take it) the hook leaves the dispatch
mode at an optimizer step: iterations start at the first module forward after a step (a global
module forward pre-hook) and no op passes through Python; activation swaps, aligned with module
calls and autograd nodes in the first dispatch-path iteration under the plan, are carried by
module and node hooks (`native_swaps.py`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import partial
from time import perf_counter
from typing import Any, Protocol

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode

from tensile.cuda_ops import traced_name
from tensile.knobs import budget_bytes
from tensile.latency.measure import CudaOpTimer
from tensile.peak import analyze_vanilla
from tensile.plan import Event, Plan
from tensile_hook.compiled import COMPILE_SKIPPED, dynamo_frames
from tensile_hook.latency_samples import OpSampler, OpSamples
from tensile_hook.movers import CpuMover, CudaMover
from tensile_hook.native_map import NativeMap, map_plan
from tensile_hook.native_swaps import NativeSwaps
from tensile_hook.recipes import DeviceRandom, Recipe, RecipeBook
from tensile_hook.report import HookReport, IterationStats, ReportWriter
from tensile_hook.settings import HookSettings, native_plans
from tensile_hook.shapes import MAX_SHAPE_SETS, ShapeKey, ShapeSet, describe, shape_key
from tensile_hook.storages import Slot, StorageRegistry
from tensile_hook.storages import tensors_in as _tensors
from tensile_hook.termination import raise_if_terminated
from tensile.tracer import Recorder, classify_roles, written_values
from tensile.workload import Workload

log = logging.getLogger("tensile.hook")
MIN_EVICT_BYTES = 4096  # smaller storages are not worth a transfer
# nor is an overshoot smaller than that worth an eviction: the forecast a budget comes from can miss a few
# bytes (a CPU forecast leaves out Adam's 4-byte step counters; mlp-wide, admitted at its forecast exactly, ran
# 24 bytes over at one op and evicted a storage every iteration, stalling on it later)
BUDGET_TOLERANCE_BYTES = MIN_EVICT_BYTES
MAX_DIVERGED = 3  # iterations in a row that leave the plan before it is made again
FREED_SOON_OPS = 8  # a release this close to PyTorch's own free of the tensor is left to PyTorch
BRING_BACK = ("swap_in", "recompute")  # events that allocate: they fire at the next op's entry
Planner = Callable[[Workload, "int | None"], "Plan | None"]


class IterationListener(Protocol):
    """Called after every iteration with its figures and the run's report, and for a sampling iteration (only with a
    node agent: `latency_samples.py`) its op latencies; returns a newer plan for the same workload (the agent
    re-planned: drift, knobs, a neighbour came or went) or None."""

    def __call__(self, stats: IterationStats, report: HookReport, samples: OpSamples | None = None) -> Plan | None: ...


def reads_only(func: Any) -> bool:
    """An op that returns no tensor and writes none: a read (`loss.item()`'s _local_scalar_dense, `torch.equal`,
    `bool(t)`'s is_nonzero, `_assert_async`) that neither allocates nor frees device memory. A script runs such reads in
    some steps only (logging every tenth): they are no ops of the plan's iteration, never the start of a forward pass."""
    schema = func._schema
    return (not any("Tensor" in str(value.type) for value in schema.returns)
            and not any(argument.alias_info is not None and argument.alias_info.is_write for argument in schema.arguments))


OTHER_THREAD = ("optimizer steps ran, but no op of their iterations on the thread the hook watches (the one that started "
                "it): training in another thread is not carried; nothing was planned")


def _plan_named(plan: Plan, source: str) -> str:
    """A plan as the hook's messages name it: a file by what it is, a planner's by its version."""
    return "the plan file" if source == "file" else f"plan version {plan.version}"


class Unsupported(Exception):
    """What the job does that the hook cannot carry (not a failure of Tensile's): it stands down saying so,
    without a traceback, and training goes on without it."""


class _OpFailed(Exception):
    """The user's op raised: re-raise its error as it is."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _LiveRecorder(Recorder):
    """The tracer's Recorder, with storages watched once for their whole life by the registry."""

    def __init__(self, device_type: str, registry: StorageRegistry) -> None:
        super().__init__(device_type, device_type)
        self.registry = registry

    def _watch(self, storage: torch.UntypedStorage) -> None:
        self.registry.watch(storage)


class ActivePlan:
    """A plan indexed for the hot path: events by trigger op, recompute targets, and for each op
    the plan tensors first seen there (so live storages can be bound to plan ids by position)."""

    def __init__(self, plan: Plan, workload: Workload) -> None:
        self.plan = plan
        self.workload = workload
        self.guard_said = False  # the report said why its iterations stay guarded on the dispatch path
        self.names = [op.name for op in workload.ops]
        self.by_trigger: dict[int, list[Event]] = defaultdict(list)
        self.next_by_trigger: dict[int, list[Event]] = defaultdict(list)
        for event in plan.events:
            (self.next_by_trigger if event.next_iteration else self.by_trigger)[event.trigger].append(event)
        self.recompute = {e.tensor for e in plan.events if e.kind == "recompute"}
        # releases PyTorch itself does within a few ops: no need to act (or to copy, for safety)
        self.freed_soon = {
            e.tensor for e in plan.events
            if e.kind == "release" and e.tensor in workload.tensors
            and (freed := workload.tensors[e.tensor].freed_after) is not None and freed - e.trigger <= FREED_SOON_OPS
        }
        needed = {e.tensor for e in plan.events}
        needed |= {reused for t in needed if t in workload.tensors and (reused := workload.tensors[t].reuses) is not None}
        self.capture: dict[int, list[tuple[int, str, int]]] = defaultdict(list)  # op -> (tensor, where, position)
        seen: set[int] = set()
        for op in workload.ops:
            new_outputs = [t for t in op.outputs if workload.tensors[t].reuses is None]
            for where, tensors in (("in", op.inputs), ("out", new_outputs)):
                for position, tensor in enumerate(tensors):
                    if tensor in needed and tensor not in seen:
                        seen.add(tensor)
                        self.capture[op.index].append((tensor, where, position))
            for tensor in op.outputs:
                reused = workload.tensors[tensor].reuses
                if tensor in needed and tensor not in seen and reused is not None:
                    seen.add(tensor)
                    self.capture[op.index].append((tensor, "reuse", reused))
        self.native: NativeMap | None = None  # where its events go on native hooks, once mapped
        self.native_checked = False


class PlanExecutor(TorchDispatchMode):
    def __init__(
        self,
        settings: HookSettings,
        device: torch.device,
        plan: Plan | None = None,
        plan_workload: Workload | None = None,
        planner: Planner | None = None,
        listener: IterationListener | None = None,
    ) -> None:
        super().__init__()
        self.listener = listener
        self.settings = settings
        self.device = device
        # read at every step and iteration start: torch.device's `type` makes its str anew in C++ on each read (18 µs
        # on the caches a step's optimizer leaves, where the interpreter's own steps cost under 1 µs)
        self.device_type: str = device.type
        self.registry = StorageRegistry(on_free=self._storage_freed)
        self.mover = CudaMover(device) if self.device_type == "cuda" else CpuMover()
        self.registry.release_host = self.mover.release_host
        self.recorder = _LiveRecorder(self.device_type, self.registry)
        self.op_timer = CudaOpTimer() if self.device_type == "cuda" else None  # the recorded ops' kernel times
        # op latencies for the node agent's drift rule, only where a link to one listens
        self.sampler = OpSampler(self.device_type, settings.latency_sample_every if settings.agent_url and listener else 0)
        self.planner = planner
        self.report = HookReport(job=settings.job, device=str(device))
        self.said: set[str] = set()  # messages said so far (`_say`)
        # this iteration's divergence (op, what ran, what the plan expected), said at its step: an iteration that
        # never reaches one is the script's code after its last step (an evaluation), said quietly at exit
        self.divergence: tuple[int, str, str] | None = None
        self.report_writer = ReportWriter(settings.report_path, settings.report_interval) if settings.report_path else None
        self.iteration = 0
        self.stats = IterationStats(0)
        self.tracked_peak = 0  # on CUDA, the tracked storages' peak in this iteration (`_measure_workspace`)
        # swap-ins and recomputes triggered by op k, fired at op k + 1's entry: the forecast (peak.absent_ranges)
        # allocates them after op k's inputs that nothing reads later are freed; fired right after op k,
        # while those inputs were still alive, a plan carried out exactly measured above its forecast
        self.deferred: list[Event] = []
        self.iteration_started = time.perf_counter()
        self.in_step = 0
        self.step_done = False
        self.disabled = False
        self.active: ActivePlan | None = None  # the plan applied in this iteration
        self.ready: ActivePlan | None = None  # a plan matched and waiting for the next iteration
        self.previous_planned = False
        self.keys: dict[int, int] = {}  # plan tensor id -> id(storage), positional each iteration
        self.random = DeviceRandom(device)
        self.recipes = RecipeBook(self.random)  # this iteration's, by id(storage)
        # a budget in bytes (what the job was admitted with) holds from the first op; a fraction waits
        # for the vanilla peak
        self.budget: int | None = budget_bytes(settings.memory_budget, 0) if (settings.memory_budget or 0) > 1 else None
        self.report.memory_budget_bytes = self.budget
        self.plan_budget: int | None = None  # a plan's budget that the job takes: the agent's (the operator lowered it), a file's
        self.vanilla_peak: int | None = None
        self.candidate: ActivePlan | None = None  # offered, not yet matched against a live iteration
        self.op_index = 0  # position in the iteration (fast path)
        self.names: dict[Any, str] = {}  # op -> its name as a workload has it, cached: str(op) is costly per call
        self.reads: dict[Any, bool] = {}  # op -> whether it only reads (`reads_only`), cached
        self.reads_by_name: dict[str, bool] = {}  # the same by a plan op's name
        self.match_at = 1  # the iteration whose recording is matched against the plan (0 is a warm-up)
        self.diverged_in_a_row = 0
        self.in_mode = False  # pushed on the dispatch mode stack
        self.path = "dispatch"  # this iteration's path
        self.next_path = "dispatch"  # decided at the optimizer step for the next iteration ...
        self.prepared: ActivePlan | None = None  # ... under this plan
        self.module_hook: Any = None  # the global module forward pre-hook, on the native path
        self.live: Workload | None = None  # the matched iteration
        # shape sets (shapes.py): each matched one's iteration, vanilla peak and plan; the one the plan in force is for;
        # this iteration's shapes, taken at its first module call (from the step: `_want_key`), and the hook that takes
        # them where `module_hook` is off; whether they are not the prepared plan's, and whether no plan is theirs
        self.shape_sets: dict[ShapeKey, ShapeSet] = {}
        self.shape_key: ShapeKey | None = None
        self.entry_key: ShapeKey | None = None
        self.key_wanted = False
        self.shape_hook: Any = None
        self.reshaped = False
        self.off_shape = False
        self.swaps = NativeSwaps(self)  # activation swaps on the native path: aligned, then carried
        # On the CPU device a native iteration's peak is only known when observed by the dispatch
        # mode (every op's outputs watched, nothing else done): tests and audits turn this on.
        self.observe_native = False
        self.outside_reads = 0  # reads outside the dispatcher under way (`reading_outside`)
        self.dynamo_frames: int | None = dynamo_frames()  # compiled code seen before the hook: none of its doing
        if plan is not None and plan_workload is not None:
            self._offer(plan, plan_workload, "file")

    # -- plan lifecycle -----------------------------------------------------------------------
    def _offer(self, plan: Plan, workload: Workload, source: str) -> None:
        """A plan to apply once the live iterations are known to match its workload."""
        self.candidate = ActivePlan(plan, workload)
        self.report.plan_version = plan.version
        self.report.plan_source = source
        if plan.forecast is not None:
            self.report.scheduled_peak_bytes = plan.forecast.scheduled_peak_bytes
            self._set_vanilla(plan.forecast.vanilla_peak_bytes)
        self._take_budget(plan, source)

    def _take_budget(self, plan: Plan, source: str) -> None:
        """A plan's budget becomes the job's: the agent's (the operator lowered it), a file's unless the job has one."""
        budget = plan.memory_budget_bytes
        if budget is None or budget == self.budget:
            return
        if source == "agent":
            self._say(f"plan version {plan.version} holds the job to a memory budget of {budget} bytes, not {self.budget}: "
                      "the node agent's (a TrainingJob's budget annotation changes it)", logging.INFO)
        elif self.settings.memory_budget is None:
            self._say(f"{_plan_named(plan, source)} holds the job to the memory budget it was made for, {budget} bytes", logging.INFO)
        else:  # the user's own budget stands; the plan may then not keep to it, and the guard evicts what it must
            self._say(f"{_plan_named(plan, source)} was made for a memory budget of {budget} bytes; the job keeps its own, "
                      f"{self.budget} (TENSILE_MEMORY_BUDGET, --memory-budget)", logging.INFO)
            return
        self.plan_budget = self.budget = self.report.memory_budget_bytes = budget

    def _set_vanilla(self, vanilla_peak: int) -> None:
        """The vanilla peak of the shapes that run now. A fractional budget is made bytes on the first one only: a job
        whose batch grows later keeps the memory it started with (as one admitted with bytes does)."""
        self.vanilla_peak = self.report.vanilla_peak_bytes = vanilla_peak
        if self.budget is None:
            self.budget = self.report.memory_budget_bytes = budget_bytes(self.settings.memory_budget, vanilla_peak)

    def _say(self, message: str, level: int = logging.WARNING) -> None:
        """Said once, with the iteration it was first said in; a repeat is only counted (a GAN's other step
        diverging every second iteration said the same warning, and added it to the report, each time)."""
        report = self.report
        if message in self.said:
            report.repeated[message] = report.repeated.get(message, 0) + 1
            log.debug("tensile: (again) %s", message)
            return
        self.said.add(message)
        log.log(level, "tensile: %s", message)
        report.messages.append(f"iteration {self.iteration}: {message}")

    def _match(self, live: Workload) -> None:
        """After a steady iteration, or one on new shapes: compare signatures; on a mismatch (or new shapes), plan
        from the live workload. The plan is kept for these shapes; the guard's slack is the largest of all shapes'."""
        self.report.live_signature = live.signature
        self.live = live
        slack = max((sum(live.tensors[t].size for t in {*op.inputs, *op.outputs}) for op in live.ops), default=0)
        self.report.guard_slack_bytes = max(slack + BUDGET_TOLERANCE_BYTES, self.report.guard_slack_bytes or 0)
        if self.vanilla_peak is None or self.shape_sets:  # a plan file's forecast gives the first shapes' one
            self._set_vanilla(analyze_vanilla(live).peak_bytes)
        elif self.candidate is None or self.candidate.plan.signature != live.signature:
            self._forget_forecast(live)  # that forecast was another workload's
        if self.device_type == "cuda":
            self._measure_workspace()
        self._plan_for(live)
        if self.shape_key is not None:
            self.shape_sets[self.shape_key] = ShapeSet(live, self.vanilla_peak or 0, self.ready)

    def _forget_forecast(self, live: Workload) -> None:
        """The vanilla peak is the live workload's, and so is a budget given as a share of it (made bytes on the
        forecast of a plan for another workload; a budget the job took from a plan stays, as the plan's own)."""
        fraction = self.settings.memory_budget
        shared = fraction is not None and fraction <= 1 and self.plan_budget is None
        if shared:
            self.budget = None  # made bytes again by `_set_vanilla`
        self._set_vanilla(analyze_vanilla(live).peak_bytes)
        if shared:
            self._say(f"the memory budget is now {self.budget} bytes: {fraction:g} of this workload's vanilla peak, not of "
                      "the one the plan forecast", logging.INFO)

    def _measure_workspace(self) -> None:
        """What the CUDA allocator held at the recorded iteration's peak beyond the tensors the hook tracks (and the
        forecast counts): cuBLAS's and cuDNN's workspaces, its rounding (on an H100 the paper's five models' allocator
        peaks stood 92-127 MB above their forecasts at batch 16). No plan moves it, and the operator books it per job
        outside the budget (`placement.py`'s context_bytes), so measured peaks are held to the budget plus it: held to
        the budget alone, ResNet-50's aligned iteration measured 101 MB over a budget its plan kept, and every one
        after ran on the dispatch path, 3.7x slower.
        The newest shapes' figure counts (a workspace follows the shapes)."""
        self.report.workspace_bytes = max(0, self.stats.peak_bytes - self.tracked_peak)

    def _plan_for(self, live: Workload) -> None:
        candidate = self.candidate
        if candidate is not None:
            match = candidate.plan.signature == live.signature
            self.report.signature_match = match
            if match:
                self.ready = candidate
                return
            self._say("the plan was made for another workload (signature mismatch); planning from the live iteration")
        if self.planner is None:
            self._say("no plan and no planner: running guarded by the memory budget only")
            return
        if not live.ops:  # the planner has nothing to plan (two training threads crashed it on an empty workload)
            self._say(OTHER_THREAD)
            return
        plan = self.planner(live, self.budget)
        if plan is None:
            self._say("the planner returned no plan: running guarded")
            return
        if plan.signature != live.signature:  # its events name another workload's tensors
            self._say(f"the planner's plan version {plan.version} was made for another workload: running guarded")
            return
        self._offer(plan, live, "local")
        self.ready = self.candidate

    # -- iterations ---------------------------------------------------------------------------
    def step_pre_hook(self, _optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A step given a closure runs the training's forward and backward itself, inside the step (LBFGS's
        `step(closure)`, PyTorch Lightning's every step): the closure is handed on wrapped, so that what it runs counts
        as outside the step, where an iteration starts and the native path acts. Inside the step, the first iteration
        never ended: the whole run went through the dispatch mode, nothing planned, and the report said nothing."""
        self.in_step += 1
        positional = len(args) > 1  # args[0] is the optimizer
        closure = args[1] if positional else kwargs.get("closure")
        if not callable(closure) or self.disabled:  # a third-party step's other argument is handed on as it was
            return None
        wrapped = partial(self._outside_step, closure)
        return ((args[0], wrapped, *args[2:]), kwargs) if positional else (args, {**kwargs, "closure": wrapped})

    def _outside_step(self, closure: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.in_step -= 1
        try:
            return closure(*args, **kwargs)
        finally:
            self.in_step += 1

    def step_post_hook(self, *_: Any) -> None:
        """Timed as a whole: the restores here subtract their copies from `hook_seconds` (see `_swap_out`)."""
        started = time.perf_counter()
        self.in_step = max(0, self.in_step - 1)
        self.step_done = True
        try:
            if self.divergence is not None:
                self._say_divergence(stepped=True)
            self._at_step()
        except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
            self._stand_down(exc)
        self.stats.hook_seconds += time.perf_counter() - started
        raise_if_terminated()  # a SIGTERM whose SystemExit a callback swallowed ends the training here

    # -- paths --------------------------------------------------------------------------------
    def _at_step(self) -> None:
        """Choose the next iteration's path here, outside any op and outside the user's forward:
        the dispatch mode can be left or pushed, and the native swaps' hooks put on, safely."""
        diverged = self.swaps.at_step()
        self._say_if_compile_skipped()
        if self.disabled:
            self.swaps.drop_idle()
            self._leave_mode()
            return
        self.prepared = self.ready
        native = self._native_map(self.prepared) if self.match_at <= self.iteration and not diverged else None
        if native is not None and self.sampler.due(self.iteration + 1) and _get_current_dispatch_mode() in (None, self):
            native = None  # a sampling iteration (latency_samples.py): on the dispatch path, which times every op
        self.next_path = "dispatch" if native is None else "native"
        # the native swaps' hooks first: where the carrier's pre-hook starts the next iteration, no other is put on
        self.swaps.prepare(native, self.match_at <= self.iteration)
        if native is not None and not self.observe_native:
            self._leave_mode()
        elif native is None and not self._enter_mode():
            # back on the stack now (when it can be), not at the next module call: the dispatch
            # iteration then starts at its first op on a parameter, as the recorded one did. Where
            # another mode holds the stack, a module call starts it, without a plan (_choose_path)
            self._watch_for_start()
        self._want_key()

    def _say_if_compile_skipped(self) -> None:
        """Code TorchDynamo first met in an iteration under the dispatch mode is skipped for the rest of the process:
        said once. Code it first met in a native iteration, the mode off, compiled as it does without Tensile: nothing
        is said (saying it ran eagerly would be false), and the count moves on."""
        if self.dynamo_frames is None:
            return
        frames = dynamo_frames()
        if frames > self.dynamo_frames and self.in_mode:
            self.dynamo_frames = None  # said once
            self._say(COMPILE_SKIPPED)
        else:
            self.dynamo_frames = frames

    def _native_map(self, plan: ActivePlan | None) -> NativeMap | None:
        """The plan on native hook points, or None where the next iteration needs the dispatch mode:
        the first iteration under a plan (exact, measured, aligning its swaps), an event that does
        not map, a budget the plan (or, without one, the vanilla peak) does not keep."""
        native = self._mapped(plan) if plan is not None else NativeMap([])
        if self.live is None or self.stats.mode in ("recording", "stood_down") or plan is not self.active:
            return None
        if self.budget is not None:
            expected = self.report.scheduled_peak_bytes if plan is not None else self.vanilla_peak
            last = self._measured_so_far()
            forecast_over = expected is None or expected > self.budget
            # an iteration on shapes without a plan of their own (past MAX_SHAPE_SETS) says nothing of the plan's
            measured_over = (last is not None and not self.off_shape
                             and last.peak_bytes > self.budget + (self.report.workspace_bytes or 0) + BUDGET_TOLERANCE_BYTES)
            if forecast_over or measured_over:
                if plan is not None and not plan.guard_said:  # said once per plan
                    plan.guard_said = True
                    self._say(self._guarded(plan, expected, None if forecast_over else last))
                return None
        if native is None or (native.swaps and native.carrier is None):
            return None
        return native

    def _measured_so_far(self) -> IterationStats | None:
        """This iteration, whose ops have all run at its step, if its peak is measured (the dispatch path, an
        observed native iteration, CUDA): the next iteration's path follows it, not the one before it (a
        recorded iteration's vanilla peak over the budget cost ResNet-50 one more dispatch iteration a plan)."""
        stats = self.stats
        if self.device_type == "cuda":
            stats.peak_bytes = max(stats.peak_bytes, torch.cuda.max_memory_allocated(self.device))
        return stats if stats.peak_source == "measured" else None

    def _guarded(self, plan: ActivePlan, expected: int | None, measured: IterationStats | None) -> str:
        """Why a plan's iterations run on the dispatch path, guarded by the budget, whatever its events:
        an iteration under it `measured` above the budget, else its forecast (none, or above the budget)."""
        if measured is not None:
            why = f"ran iteration {measured.iteration} at a measured peak of {measured.peak_bytes} bytes"
            if self.report.workspace_bytes:
                why += f" ({self.report.workspace_bytes} of them the CUDA allocator's beyond the tensors: workspaces)"
        elif expected is None:
            why = "comes without a forecast of its scheduled peak"
        else:
            why = f"forecasts a scheduled peak of {expected} bytes"
        said = (f"plan version {plan.plan.version} {why}, against a memory budget of {self.budget} bytes: its "
                "iterations run on the dispatch path, where the budget guard swaps out what the plan leaves on the device")
        if measured is None and expected is not None and native_plans(self.settings, self.device_type):
            said += (" (its events are native events only, as TENSILE_PLAN_EVENTS=native, or auto on CUDA, asks: "
                     "with all, the plan may swap parameters and optimizer state too)")
        return said

    def _mapped(self, plan: ActivePlan) -> NativeMap | None:
        if not plan.native_checked:
            plan.native_checked = True
            native = map_plan(plan.plan, plan.workload, plan.freed_soon)
            if native.unmapped:
                self._say(f"{len(native.unmapped)} events of plan version {plan.plan.version} do not map onto native hooks "
                          f"(e.g. {'; '.join(native.unmapped[:3])}): its iterations run on the dispatch path")
            else:
                plan.native = native
        return plan.native

    def _leave_mode(self) -> None:
        """Off the dispatch mode stack (only from its top): every absent tensor comes back first,
        since no op will be checked before use any more. The next iteration's start is then seen by
        the global module pre-hook."""
        if self.in_mode:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            if _get_current_dispatch_mode() is not self:
                return  # another mode sits above: stay, the dispatch path keeps working
            self._restore_absent()
            super().__exit__(None, None, None)
            self.in_mode = False
        self._watch_for_start()

    def _watch_for_start(self) -> None:
        """Off the dispatch mode, the next iteration's start is the first module call after the step: seen by the
        native swaps' carrier where its hooks are on for it, else by a global pre-hook of the executor's own."""
        if self.module_hook is None and not self.disabled and not self._carrier_starts():
            self.module_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._module_pre_hook)

    def _carrier_starts(self) -> bool:
        """The next iteration is native and the native swaps' carrier, its hooks on, starts it at its first module call."""
        return self.next_path == "native" and self.swaps.starts_next()

    def _unhook_modules(self) -> None:
        """The global module pre-hook off: any global module hook sends every module call through
        PyTorch's slow path (0.5-1 ms an iteration on a model of 202 tiny module calls)."""
        if self.module_hook is not None:
            self.module_hook.remove()
            self.module_hook = None

    def _enter_mode(self) -> bool:
        """Back on the stack, only when it is empty: pushed above a user's mode it would be popped by theirs."""
        if self.in_mode:
            return True
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not None:
            return False
        super().__enter__()
        self.in_mode = True
        self._unhook_modules()
        return True

    def _module_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        """On the native path: the first module forward after the step(s) starts the next iteration;
        the hook then goes until the next step (which puts it back), so the iteration's module calls
        keep PyTorch's fast path."""
        if self._start_due():
            started = time.perf_counter()
            try:
                if self.key_wanted:
                    self._take_key(args)
                if self._other_shapes(self.entry_key) and self._enter_mode():
                    # on the dispatch path now, the iteration starts at its first op on a parameter, as a recorded one
                    # did (from here, ops on the input before it would shift the plan's op indices)
                    self.next_path = "dispatch"
                else:
                    self._unhook_modules()
                    self._begin_iteration()
            except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
                self._stand_down(exc)
            self.stats.hook_seconds += time.perf_counter() - started

    def _want_key(self) -> None:
        """At a step: the next iteration's shapes are taken at its first module call, by the pre-hook that starts it
        where that is on (the native path), else by a hook of their own, gone after that call."""
        self.key_wanted, self.entry_key = True, None
        if self.module_hook is None and self.shape_hook is None and not self._carrier_starts():
            self.shape_hook = register_module_forward_pre_hook(self._shape_hook)

    def _shape_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self._start_due():
            started = time.perf_counter()
            try:
                self._take_key(args)
            except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
                self._stand_down(exc)
            self.stats.hook_seconds += time.perf_counter() - started

    def _take_key(self, args: Any) -> None:
        self.entry_key = shape_key(args, self.device_type)
        self._drop_key_hook()

    def _drop_key_hook(self) -> None:
        self.key_wanted = False
        if self.shape_hook is not None:
            self.shape_hook.remove()
            self.shape_hook = None

    def _other_shapes(self, key: ShapeKey | None) -> bool:
        """Shapes other than those the plan in force was made for (unknown ones compare with nothing)."""
        return key is not None and self.shape_key is not None and key != self.shape_key and not self.disabled

    def __enter__(self) -> PlanExecutor:
        self.in_mode = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        """Deactivation: off the stack (if on it) and every native hook removed."""
        self._unhook_modules()
        self._drop_key_hook()
        self.swaps.remove()
        if self.in_mode:
            self.in_mode = False
            super().__exit__(*exc)

    def _apply_deferred(self) -> None:
        deferred, self.deferred = self.deferred, []
        for event in deferred:
            self._apply(event)

    def _finish_iteration(self) -> None:
        if self.deferred and not self.disabled:  # triggered by the iteration's last op
            with _disable_current_modes():  # also called from a module hook, where the mode may be on the stack
                self._apply_deferred()
        self.mover.settle()
        stats = self.stats
        stats.seconds = time.perf_counter() - self.iteration_started
        # on CUDA after the iteration's time: its synchronisation is no part of it; where none is sampled (most
        # iterations, every one without an agent) not even the call, whose lists are made anew
        samples = self.sampler.end() if self.sampler.begun else None
        stats.ops = len(self.recorder.ops) if self.iteration == self.match_at else self.op_index
        if self.device_type == "cuda":
            stats.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            stats.reserved_bytes = torch.cuda.max_memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            if stats.peak_source == "planned":  # nothing watched the storages: the forecast, marked as such
                stats.peak_bytes = (self.report.scheduled_peak_bytes if self.active else None) or self.vanilla_peak or 0
            stats.reserved_bytes = stats.peak_bytes  # no caching allocator on the CPU (IterationStats.reserved_bytes)
        self.report.add(stats)
        if not self.disabled and self.iteration == self.match_at:
            if self.op_timer is not None:
                for op, seconds in zip(self.recorder.ops, self.op_timer.seconds()):
                    op.latency = seconds
            self.recorder.stop()
            classify_roles(self.recorder)
            live = Workload(self.settings.job, 0, self.device_type, self.recorder.tensors, self.recorder.ops)
            self._match(live)
        if self.listener is not None and not self.disabled:
            # only a link to an agent gets samples (`sampler`): a listener of two arguments is called with two
            self._take_newer(self.listener(stats, self.report) if samples is None else self.listener(stats, self.report, samples))

    def _write_report(self, now: bool = False) -> None:
        """The --report file, when due (its writer spaces the writes out) or `now` (at the end)."""
        if self.report_writer is not None and (now or self.report_writer.due()):
            self.report_writer.write(self.report)

    def _take_newer(self, plan: Plan | None) -> None:
        """A re-plan of the workload already matched applies from the next iteration, unmatched again; so
        does a first plan to a job that runs guarded since it matched (no planner had a plan then). One for
        shapes that ran before and do not now (the agent plans the shapes uploaded last, which may have been
        left since, or are being recorded anew) is kept for them."""
        current = self.ready or self.candidate
        if plan is None or (current is not None and plan.version == current.plan.version):
            return
        for key, shapes in self.shape_sets.items():
            if key != self.shape_key and shapes.live.signature == plan.signature:
                shapes.plan = ActivePlan(plan, shapes.live)
                self._take_budget(plan, "agent")
                return
        if current is not None:
            signature, workload = current.plan.signature, current.workload
        elif self.live is not None and self.iteration >= self.match_at:
            signature, workload = self.live.signature, self.live
        else:
            return  # not matched yet: the link hands the plan again when the match asks for it
        if plan.signature != signature:
            self._say(f"plan version {plan.version} is for another workload: ignored")
            return
        self._offer(plan, workload, "agent")
        self.ready = self.candidate

    def _begin_iteration(self) -> None:
        self._finish_iteration()
        self._write_report()
        self.previous_planned = self.active is not None
        self.diverged_in_a_row = self.diverged_in_a_row + 1 if self.stats.mode == "diverged" else 0
        if self.diverged_in_a_row >= MAX_DIVERGED:
            self._say(f"{MAX_DIVERGED} iterations in a row diverged from the plan: planning again from the next one")
            self.ready = self.candidate = None
            self.match_at = self.iteration + 1
            self.diverged_in_a_row = 0
        self.iteration += 1
        self.step_done = False
        self.recipes.clear()
        self.op_index = 0
        key = self.entry_key
        if self.key_wanted:  # an op started it before any module call took its shapes (a hook on only while wanted)
            key = None
            self._drop_key_hook()
        self._follow_shapes(key)
        if self.iteration == self.match_at:
            self.recorder = _LiveRecorder(self.device_type, self.registry)
        self.active = None if self.disabled else self.ready
        mode = "planned" if self.active else ("recording" if self.iteration <= self.match_at else "guarded")
        self.stats = IterationStats(self.iteration, mode, self.active.plan.version if self.active else None)
        self.tracked_peak = self.registry.device_bytes
        self._choose_path()
        if (self.path == "dispatch" and self.live is not None and self.iteration > self.match_at and not self.off_shape
                and not self.disabled and self.sampler.due(self.iteration)):
            self.sampler.begin(self.iteration, self.live)
        learn = not (self.off_shape or self.iteration == self.match_at)  # aligning a plan on its own shapes only
        self.swaps.begin(self.active, self.path == "native", learn)
        self.iteration_started = time.perf_counter()

    def _follow_shapes(self, key: ShapeKey | None) -> None:
        """An iteration on shapes other than the plan's (a larger batch, an epoch's last batch, bf16 autocast from
        now on) is, as at a signature mismatch, recorded on the dispatch path, under the budget guard, and planned
        from, said once; shapes seen before take back the plan made for them, on the dispatch path for that
        iteration (the step prepared the other plan's native hooks); past MAX_SHAPE_SETS, shapes without a plan
        run under the plan in force on the dispatch path, guarded, without re-planning."""
        self.reshaped = self.off_shape = False
        if self.iteration == self.match_at:  # recorded (iteration 1, a re-plan): the plan made from it is for these
            self.shape_key = key if key is not None else self.shape_key
            return
        if not self._other_shapes(key):
            return
        assert key is not None and self.shape_key is not None
        self.reshaped = True
        known = self.shape_sets.get(key)
        if known is None and len(self.shape_sets) >= MAX_SHAPE_SETS:
            self.off_shape = True
            self._say(f"the batch's shapes changed again, past the {MAX_SHAPE_SETS} shape sets planned for: iterations "
                      "on shapes without a plan of their own run under the plan in force on the dispatch path, where "
                      "the budget guard keeps the memory budget", logging.INFO)
            return
        self.previous_planned = False  # another workload: its cross-iteration events are not the last iteration's
        self.keys.clear()
        if self.shape_key in self.shape_sets:
            self.shape_sets[self.shape_key].plan = self.ready  # the agent may have sent a newer one meanwhile
        if known is None:
            self._say(f"the batch's shapes changed at iteration {self.iteration} ({describe(self.shape_key)} -> "
                      f"{describe(key)}); planning again", logging.INFO)
            self.match_at, self.ready, self.candidate = self.iteration, None, None
        else:
            log.debug("tensile: iteration %d is back on shapes planned for: %s", self.iteration, describe(key))
            self._resume(known)
        self.shape_key = key

    def _resume(self, shapes: ShapeSet) -> None:
        """The plan made for shapes seen before, and the figures that go with it."""
        self.live, self.ready, self.candidate = shapes.live, shapes.plan, shapes.plan
        self._set_vanilla(shapes.vanilla_peak)
        self.report.live_signature = shapes.live.signature
        if shapes.plan is not None:
            forecast = shapes.plan.plan.forecast
            self.report.plan_version = shapes.plan.plan.version
            self.report.scheduled_peak_bytes = forecast.scheduled_peak_bytes if forecast is not None else None

    def _choose_path(self) -> None:
        """What the step decided, unless the plan changed since (a newer one from the agent) or the
        hook stood down: then this iteration runs on the dispatch path, where it can."""
        native = self.next_path == "native" and self.active is self.prepared and not self.disabled and not self.reshaped
        if not native and not self._enter_mode():
            if self.active is not None:
                self._say("another dispatch mode is active: this iteration's plan is not applied")
            self.active = None
            native = True
        self.path = self.stats.path = "native" if native else "dispatch"
        if native and not self.in_mode and self.device_type != "cuda":  # CUDA's allocator measures every iteration
            self.stats.peak_source = "planned"

    def finish(self) -> None:
        """At exit: close the last iteration and write the report."""
        self._say_divergence(stepped=False)
        if self.step_done:
            self._finish_iteration()
            self.step_done = False
        # a launcher (a script that starts the training as a process of its own, `accelerate launch`): its empty
        # report ("no optimizer step was seen", 0 iterations) replaced the training's at exit
        if not self.report.iterations and self.report_writer is not None and self.report_writer.written_elsewhere():
            log.info("tensile: this process ran no iteration; the report another process of the run wrote is kept")
            return
        if not self.disabled:
            self._say_nothing_carried()
        self._write_report(now=True)

    def _say_nothing_carried(self) -> None:
        """Training the hook could not follow ends with a report that says so, not with an empty one whose zero
        peak reads as measured (`0 iterations ... peak 0.0 MiB` and no word, for SGD written out by hand)."""
        iterations = self.report.iterations
        if not iterations:
            self._say("no optimizer step was seen: Tensile finds training iterations by torch.optim steps (a loop that "
                      "updates parameters by hand has none, and processes torch.multiprocessing.spawn starts run without "
                      "the hook), so nothing was planned or measured")
        elif not any(it.ops for it in iterations):
            self._say(OTHER_THREAD)

    # -- the hot path -------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.disabled or func.namespace == "profiler":
            return func(*args, **kwargs)
        started = time.perf_counter()
        try:
            leaves = _tensors((args, kwargs))
            if self.outside_reads:
                return self._dispatch_observed(func, args, kwargs, leaves)
            if self.step_done and self._starts_iteration(func, leaves):
                self._begin_iteration()
            if self.path == "native":
                return self._dispatch_observed(func, args, kwargs, leaves)
            if self.iteration == self.match_at:
                return self._dispatch_recording(func, args, kwargs, leaves, started)
            return self._dispatch_fast(func, args, kwargs, leaves, started)
        except _OpFailed as failure:
            raise failure.error from None
        except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
            self._stand_down(exc)
            self.stats.hook_seconds += time.perf_counter() - started  # its restores' copies were subtracted
            if any(t.numel() and not t.untyped_storage().nbytes() for t in _tensors((args, kwargs))):
                raise exc  # an input the stand-down could not bring back (out of memory): never run on 0 bytes
            return func(*args, **kwargs)

    def _dispatch_observed(self, func: Any, args: tuple, kwargs: dict, leaves: list[Any]) -> Any:
        """A native iteration under observation: its storages are watched for the CPU peak, nothing else
        (inputs are checked only because an out-of-memory retry in `_run` may have evicted some)."""
        self._ensure_resident(leaves)
        out = self._run(func, args, kwargs)
        device_type = self.device_type
        slots = self.registry.slots
        for value in _tensors(out):
            if value.device.type == device_type and id(storage := value.untyped_storage()) not in slots:
                self.registry.watch(storage)
        if device_type != "cuda" and self.registry.device_bytes > self.stats.peak_bytes:
            self.stats.peak_bytes = self.registry.device_bytes
        return out

    def _dispatch_read(self, func: Any, args: tuple, kwargs: dict, leaves: list[Any], started: float) -> Any:
        """A read (`reads_only`) the plan's iteration did not make here: its inputs checked before use, then run,
        outside the plan's op stream. A script logging `loss.item()` every tenth step made that step diverge from the
        plan at the read."""
        keys = [id(v.untyped_storage()) for v in leaves if v.device.type == self.device_type]
        self._ensure_keys_resident(keys)
        before_op = time.perf_counter()
        out = self._run(func, args, kwargs)
        after_op = time.perf_counter()
        self._after_accounting(set(keys))  # a fetch may have brought a storage back
        self.stats.hook_seconds += (before_op - started) + (time.perf_counter() - after_op)
        return out

    def _dispatch_recording(self, func: Any, args: tuple, kwargs: dict, leaves: list[Any], started: float) -> Any:
        """The iteration the plan is matched against: recorded in full with the tracer's Recorder."""
        self._ensure_resident(leaves)
        timer = self.op_timer
        kernel_started = timer.start() if timer is not None else None
        before_op = time.perf_counter()
        out = self._run(func, args, kwargs)
        after_op = time.perf_counter()
        if timer is not None:
            timer.stop(kernel_started)
        try:
            self.recorder.phase = self._phase()
            op = self.recorder.record(func, args, kwargs, out)
            op.latency = after_op - before_op  # on CUDA the kernel's time replaces it at the iteration's end
            self._after_accounting({self.recorder._key_of[t] for t in op.inputs + op.outputs})
        except Exception as exc:  # noqa: BLE001 - the op ran: keep its result, stand down
            self._stand_down(exc)
        self.stats.hook_seconds += (before_op - started) + (time.perf_counter() - after_op)
        return out

    def _dispatch_fast(self, func: Any, args: tuple, kwargs: dict, leaves: list[Any], started: float) -> Any:
        """Every other iteration: check inputs, run, watch new storages, fire this op's events."""
        index = self.op_index
        active = self.active
        name = self._name(func)
        if active is not None and index < len(active.names) and active.names[index] != name:
            if self._reads_only(func):
                return self._dispatch_read(func, args, kwargs, leaves, started)
            index = self._skip_reads(active, index, name)
        self.op_index = index + 1
        if active is not None and index >= len(active.names):
            active = None  # after the plan's last op (a script logging loss.item()): nothing left to fire
        elif active is not None and active.names[index] != name:
            self._diverge(index, func, active.names[index])
            active = None
        if self.deferred:
            self._apply_deferred()
        device_type = self.device_type
        arg_keys = list(dict.fromkeys(id(v.untyped_storage()) for v in leaves if v.device.type == device_type))
        self._ensure_keys_resident(arg_keys)
        if self.swaps.learner is not None and active is not None:
            self.swaps.learner.on_op(index)
        written: list[int] = []
        if self.recipes:
            written = [id(t.untyped_storage()) for t in _tensors(written_values(func, args, kwargs))]
            self._recompute_before_write(written)
        wants_rng = (active is not None and index in active.capture and active.recompute) or any(k in self.recipes for k in written)
        rng = self.random.state() if wants_rng else None
        sampler = self.sampler
        sampled = sampler.start(index, name) if sampler.on else None
        before_op = time.perf_counter()
        out = self._run(func, args, kwargs)
        after_op = time.perf_counter()
        if sampled is not None:
            sampler.stop(index, sampled, after_op - before_op)
        try:
            self._after_fast(active, index, arg_keys, written, func, args, kwargs, out, rng)
        except Exception as exc:  # noqa: BLE001 - the op ran: keep its result, stand down
            self._stand_down(exc)
        self.stats.hook_seconds += (before_op - started) + (time.perf_counter() - after_op)
        return out

    def _after_fast(self, active: ActivePlan | None, index: int, arg_keys: list[int], written: list[int], func: Any,
                    args: tuple, kwargs: dict, out: Any, rng: torch.Tensor | None) -> None:
        device_type = self.device_type
        new_keys = []
        for value in _tensors(out):
            if value.device.type == device_type:
                if value.layout != torch.strided:  # no storage of its own to watch or move (sparse gradients)
                    raise Unsupported(f"{self._name(func)} made a tensor of layout {value.layout}: Tensile schedules "
                                      "strided tensors only")
                storage = value.untyped_storage()
                if id(storage) not in self.registry.slots:
                    self.registry.watch(storage)
                    new_keys.append(id(storage))
        if written:
            self.recipes.update(written, func, args, kwargs, rng)
        if active is not None:
            self._bind(active, index, arg_keys, new_keys, func, args, kwargs, out, rng)
            self._fire(active, index)
        self._after_accounting({*arg_keys, *new_keys})

    def _fire(self, active: ActivePlan, index: int) -> None:
        """The events op `index` triggers: those that bring a tensor back at the next op's entry, the others now."""
        events = active.by_trigger.get(index, [])
        if self.previous_planned:
            events = events + active.next_by_trigger.get(index, [])
        for event in events:
            if event.kind in BRING_BACK:
                self.deferred.append(event)
            else:
                self._apply(event)

    def _skip_reads(self, active: ActivePlan, index: int, name: str) -> int:
        """The plan's ops from `index` on that are reads this iteration does not make (the recorded iteration logged,
        this one does not), up to the op named `name`: each fires its events where it stood, and the op's index in
        the plan is returned; `index` where no such run of reads leads to it (a divergence)."""
        names = active.names
        ahead = index
        while ahead < len(names) and names[ahead] != name and self._read_named(names[ahead]):
            ahead += 1
        if ahead == index or ahead == len(names) or names[ahead] != name:
            return index
        for skipped in range(index, ahead):
            if self.deferred:
                self._apply_deferred()
            self._fire(active, skipped)
        return ahead

    def _name(self, func: Any) -> str:
        name = self.names.get(func)
        if name is None:
            name = self.names[func] = traced_name(func)
        return name

    def _after_accounting(self, protected: set[int]) -> None:
        if self.budget is not None and self.registry.device_bytes > self.budget + BUDGET_TOLERANCE_BYTES:
            self._evict(self.registry.device_bytes - self.budget, protected)
        device_bytes = self.registry.device_bytes
        if self.device_type == "cuda":  # the allocator measures the peak; this one tells its workspaces apart
            if device_bytes > self.tracked_peak:
                self.tracked_peak = device_bytes
        elif device_bytes > self.stats.peak_bytes:
            self.stats.peak_bytes = device_bytes

    def _bind(self, active: ActivePlan, index: int, arg_keys: list[int], new_keys: list[int], func: Any,
              args: tuple, kwargs: dict, out: Any, rng: torch.Tensor | None) -> None:
        """Plan tensor ids first seen at this op get their live storages, by position."""
        for tensor, where, position in active.capture.get(index, ()):
            if where == "reuse":
                key = self.keys.get(position)
            else:
                keys = arg_keys if where == "in" else new_keys
                key = keys[position] if position < len(keys) else None
            if key is None:
                continue
            self.keys[tensor] = key
            if tensor in active.recompute and where == "out":
                self.recipes.keep(key, func, args, kwargs, out, rng)

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run the op; on CUDA an out-of-memory error evicts passively (never the op's own inputs, which
        the retry reads) and retries.

        The op's own errors are the user's: they pass through untouched, not as a hook failure."""
        for attempt in range(3):
            try:
                return func(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                if attempt == 2:
                    raise _OpFailed(exc) from None
                self._say("out of memory: evicting passively and retrying the op")
                self.stats.out_of_memory_retries += 1
                own = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
                self._evict(self.registry.device_bytes // 2, protected=own)
            except Exception as exc:
                raise _OpFailed(exc) from None
        raise AssertionError("unreachable")

    def _starts_iteration(self, func: Any, leaves: list[Any]) -> bool:
        """After the step(s): the first forward op on a leaf that requires grad (a parameter, or an
        input the user marked) starts the next one.

        Not simply "the first op after a step": a GradScaler and several optimizers run ops between
        and after the steps, and scripts log `loss.item()` after them; those stay with the iteration
        they belong to. (A parameter copied out with `detach()` does start one: after the last step
        that ends the plan's iteration cleanly, and a detach inside a forward is rare.)
        """
        return self._start_due() and not self._reads_only(func) and any(v.requires_grad and v.is_leaf for v in leaves)

    def _reads_only(self, func: Any) -> bool:
        reads = self.reads.get(func)
        if reads is None:
            reads = self.reads[func] = reads_only(func)
        return reads

    def _read_named(self, name: str) -> bool:
        """Whether the plan's op of this name (`aten._local_scalar_dense.default`) only reads."""
        reads = self.reads_by_name.get(name)
        if reads is None:
            namespace, op, overload = (name.split(".") + ["", ""])[:3]
            func = getattr(getattr(getattr(torch.ops, namespace, None), op, None), overload, None)
            reads = self.reads_by_name[name] = func is not None and reads_only(func)
        return reads

    def _start_due(self) -> bool:
        """After the step(s), outside any step and backward, with grad enabled: a training forward may start."""
        return self.step_done and self.in_step == 0 and torch.is_grad_enabled() and torch._C._current_autograd_node() is None

    def _phase(self) -> str:
        if self.in_step:
            return "optimizer"
        return "backward" if torch._C._current_autograd_node() is not None else "forward"

    def _diverge(self, index: int, func: Any, expected: str) -> None:
        """The rest of this iteration runs guarded; the plan is tried again at the next one. At its first
        op this is most often the script's code after its last step (an evaluation, reading the weights
        out): said quietly, not as a fault of the plan. Later, it is said at the iteration's step (or, where
        none comes, at exit: code after the last step that began as a training forward does)."""
        if index == 0:
            self._say(f"what runs after the step does not start as a planned iteration does (its first op is {func}, "
                      f"the plan's is {expected}): it runs guarded, outside the plan", logging.INFO)
        else:
            self.divergence = (index, str(func), expected)
        self.active = None
        self.stats.mode = "diverged"

    def _say_divergence(self, stepped: bool) -> None:
        if self.divergence is None:
            return
        index, func, expected = self.divergence
        self.divergence = None
        if stepped:
            self._say(f"the iteration diverged from the plan (op {index} is {func}, the plan expected {expected}); "
                      "the rest of it ran guarded")
        else:
            self._say(f"what ran after the last step followed the plan for {index} ops, then left it (op {index} is {func}, "
                      f"the plan expected {expected}): code after training, not a training step; it ran guarded",
                      logging.INFO)

    def _ensure_resident(self, leaves: list[Any]) -> list[int]:
        """The leaves on the device resident; their storages' keys, for a caller that looks for them elsewhere too."""
        device_type = self.device_type
        keys = [id(v.untyped_storage()) for v in leaves if v.device.type == device_type]
        self._ensure_keys_resident(keys)
        return keys

    def _ensure_keys_resident(self, keys: list[int]) -> None:
        slots = self.registry.slots
        for key in keys:
            slot = slots.get(key)
            if slot is not None:
                try:
                    self._ensure_slot_resident(slot)
                except torch.OutOfMemoryError:  # no room to bring it back: make some, as _run does for an op
                    self._say("out of memory bringing a tensor back: evicting passively and retrying")
                    self.stats.out_of_memory_retries += 1
                    self._evict(slot.nbytes, protected=set(keys))
                    self._ensure_slot_resident(slot)
                self.registry.touch(slot)

    def _ensure_slot_resident(self, slot: Slot) -> None:
        """Check before use (the paper's Executor): a missing input is fetched now, as a stall."""
        if not slot.resident:
            started = time.perf_counter()
            self._fetch(slot)
            self.stats.stall_seconds += time.perf_counter() - started
        if slot.pending is not None:  # on CUDA: the op waits for the copy, on the stream, not the host
            self.mover.wait(slot)

    # -- events -------------------------------------------------------------------------------
    def _recompute_before_write(self, written: list[int]) -> None:
        """A released tensor whose input is about to change in place is regenerated first."""
        for key in written:
            for dependent in self.recipes.readers_of(key):
                slot = self.registry.slots.get(dependent)
                if slot is not None and slot.recipe is not None and dependent != key:
                    self._fetch(slot)

    def _apply(self, event: Event) -> None:
        """Fire one event. A release without a recipe keeps a host copy: if the plan is wrong and
        the tensor is read again, it comes back instead of being lost."""
        active = self.active  # releases fire inline, under the plan (deferred events bring back)
        if event.kind == "release" and active is not None and event.tensor in active.freed_soon and event.tensor not in active.recompute:
            return
        key = self.keys.get(event.tensor)
        slot = self.registry.slots.get(key) if key is not None else None
        if slot is None:
            return  # already freed by PyTorch, or never seen: nothing to do
        if event.kind in ("swap_out", "release"):
            if not slot.resident or slot.nbytes == 0 or slot.pinned:
                return
            recipe = self.recipes.get(slot.key) if event.kind == "release" else None
            if recipe is not None:
                storage = slot.storage()
                if storage is None:
                    return
                storage.resize_(0)
                slot.recipe = recipe
                self.registry.mark_absent(slot)
            elif not self._swap_out(slot):
                return
        elif not slot.resident:  # swap_in or recompute: bring it back ahead of its use
            self._fetch(slot)
        else:
            return
        self.stats.events[event.kind] += 1

    # A swap-out and a fetch time the mover's call (its copy) as transfer time, not the hook's own, inline: on the
    # native path they run right after kernels, on caches those emptied, where a helper's call costs 3-5 µs. The
    # bookkeeping stays after the copy: a copy that passes through the dispatch mode (a caller outside its
    # `__torch_dispatch__`) must find its storage resident, or the check before use fetches it back.
    def _swap_out(self, slot: Slot) -> bool:
        storage = slot.ref()
        if storage is None or slot.pinned:
            return False
        stats = self.stats
        started = perf_counter()
        try:
            try:
                self.mover.swap_out(slot, storage)
            finally:
                spent = perf_counter() - started
                stats.transfer_seconds += spent
                stats.hook_seconds -= spent
        except RuntimeError:  # e.g. a storage that is not resizable (from numpy): leave it alone
            self.mover.drop_host(slot)
            slot.pinned = True
            return False
        self.registry.mark_absent(slot)  # a native swap's own slot is swapped out by its carrier (`SwapCarrier._act`)
        stats.swap_out_bytes += slot.nbytes
        return True

    def _fetch(self, slot: Slot) -> None:
        storage = slot.ref()
        if storage is None:  # died while away: nothing comes back, its host buffer goes (back to the pool on CUDA)
            self.mover.drop_host(slot)
            slot.recipe = None  # nor do its recipe's inputs stay referenced
            return
        if slot.recipe is not None:
            self._recompute(slot, storage)
        else:
            stats = self.stats
            started = perf_counter()
            try:
                self.mover.swap_in(slot, storage)
            finally:
                spent = perf_counter() - started
                stats.transfer_seconds += spent
                stats.hook_seconds -= spent
            stats.swap_in_bytes += slot.nbytes
        slot.passive = False
        if slot.counted:
            self.registry.mark_resident(slot)
        else:
            slot.resident = True

    def _recompute(self, slot: Slot, storage: torch.UntypedStorage) -> None:
        """Replay the recipe with the random states it first ran with: dropout draws the same numbers."""
        recipe: Recipe = slot.recipe
        inputs = recipe.inputs(own_key=slot.key)
        keys = self._ensure_resident(inputs)
        if own := self.swaps.slots():  # a native iteration's, outside the registry: its inputs among them come back
            for swapped in own:
                if swapped is not None and swapped.key in keys:
                    self._ensure_slot_resident(swapped)
        stats = self.stats
        started = perf_counter()  # the replay's ops are the recompute's cost, not the hook's logic: timed apart, as copies are
        try:
            result = _tensors(recipe.producer.replay(self.random))[recipe.position]
            for step in recipe.then:
                step.replay(self.random, slot.key, result)
            storage.resize_(slot.nbytes)
            storage.copy_(result.untyped_storage())
        finally:
            spent = perf_counter() - started
            stats.recompute_seconds += spent
            stats.hook_seconds -= spent
        slot.recipe = None
        self.recipes.pop(slot.key)  # its inputs need not outlive this
        stats.recompute_bytes += slot.nbytes

    # -- budget guard -------------------------------------------------------------------------
    def _evict(self, need: int, protected: set[int]) -> None:
        """Capuchin's passive mode: swap out the least recently used tensors until `need` bytes are free."""
        freed = 0
        for key in list(self.registry.lru):
            if freed >= need:
                break
            slot = self.registry.slots.get(key)
            if slot is None or key in protected or slot.nbytes < MIN_EVICT_BYTES or slot.pinned:
                continue
            if self._swap_out(slot):
                slot.passive = True
                freed += slot.nbytes
                self.stats.passive_evictions += 1

    # -- failure ------------------------------------------------------------------------------
    def _stand_down(self, exc: BaseException) -> None:
        """Tensile's own failure: bring everything back and let training go on without it."""
        if self.disabled:
            return
        self.disabled = True
        self.swaps.stop()
        self.deferred = []  # everything absent comes back below
        if isinstance(exc, Unsupported):
            reason = str(exc)
            log.warning("tensile: %s; the hook stands down and training continues without Tensile", reason)
        else:
            reason = f"{type(exc).__name__}: {exc}"
            log.exception("tensile: the hook failed and stands down; training continues without Tensile")
        self.report.stood_down = reason
        self.stats.mode = "stood_down"
        with _disable_current_modes():
            for slot in self.registry.absent():
                try:
                    self._fetch(slot)
                except Exception:  # noqa: BLE001 - keep restoring the others
                    log.exception("tensile: could not restore a tensor")
        self.mover.settle()
        self.active = self.ready = None

    @contextlib.contextmanager
    def reading_outside(self, saving: bool = False) -> Iterator[None]:
        """A read outside the dispatcher runs (torch.save, a deepcopy, pickling for another process): the
        ops it makes are only watched (`_dispatch_observed`), nothing is evicted or fired. Saving, on the
        dispatch path after a step, starts the next iteration, as its first detach of a parameter did before
        its ops were only watched: code after the last step (a final state_dict) is no part of the last
        iteration. (A deepcopy, a share or a numpy() never started one: they stay out of it.)"""
        if saving and self.in_mode and self._start_due():
            try:
                self._begin_iteration()
            except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
                self._stand_down(exc)
        self.outside_reads += 1
        try:
            yield
        finally:
            self.outside_reads -= 1

    def bring_back(self, storage: torch.UntypedStorage, pin: bool) -> None:
        """A storage about to be read outside the dispatcher: back now; pinned when it stays read so (shared
        with another process, aliased by a numpy array): a resize would free what the other side reads."""
        started = time.perf_counter()
        key = id(storage)
        if any(slot is not None and slot.key == key for slot in self.swaps.slots()):
            self.swaps.restore()  # a native iteration's own swap: back with the others, as at a divergence
        slot = self.registry.slots.get(key)
        if slot is not None:
            if not slot.resident:
                with _disable_current_modes():
                    self._fetch(slot)
                self.mover.settle()
            slot.pinned = slot.pinned or pin
        self.stats.hook_seconds += time.perf_counter() - started

    def leave_in_forked_child(self) -> None:
        """A forked process (a DataLoader worker) inherits this executor, its mode on the stack and what it
        had swapped out, but trains nothing: on the CPU device what is absent comes back (the worker may read
        a dataset the guard evicted; on CUDA the child cannot touch the device), then the hook is off there.
        It never writes the job's report or reports to the agent."""
        self.report_writer = None
        self.listener = None
        if self.device_type == "cpu" and not self.disabled:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # OpenMP's threads did not survive the fork: a parallel copy would hang
            try:
                self._restore_absent()
            except Exception:  # noqa: BLE001 - the child must start regardless
                log.exception("tensile: could not restore a tensor in a forked process")
            finally:
                torch.set_num_threads(threads)
        self.disabled = True

    def restore_all(self) -> None:
        """Before anything reads storages outside the dispatcher (state_dict, torch.save); called
        outside the hook's timed sections, so timed here."""
        started = time.perf_counter()
        self._restore_absent()
        self.stats.hook_seconds += time.perf_counter() - started

    def _restore_absent(self) -> None:
        self.swaps.restore()  # the native iteration's own slots, outside the registry
        with _disable_current_modes():
            for slot in self.registry.absent():
                self._fetch(slot)
        self.mover.settle()

    def _storage_freed(self, key: int) -> None:
        self.recipes.pop(key)
        if self.iteration == self.match_at:
            self.recorder._on_free(key)
