"""Which path each iteration takes: the dispatch path (the mode on the stack, every op seen) or the native path
(`native_map.py` says which plans may take it; module and node hooks carry its swaps, `native_swaps.py`).

The path is chosen at the optimizer step, outside any op and outside the user's forward, where the mode can be
left or pushed and the native swaps' hooks put on safely. Off the mode, iterations start at the first module
forward after a step (a global module forward pre-hook, or the native swaps' carrier's), which also takes the
iteration's shapes (`shapes.py`); on the mode, at the first forward op on a parameter (`DispatchPath`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from tensile.knobs import memory_text
from tensile_hook.active_plan import ActivePlan
from tensile_hook.compiled import COMPILE_SKIPPED, dynamo_frames
from tensile_hook.latency_samples import OpSampler
from tensile_hook.native_map import NativeMap
from tensile_hook.plan_book import PlanBook
from tensile_hook.report import IterationStats
from tensile_hook.residency import BUDGET_TOLERANCE_BYTES, Residency
from tensile_hook.run_state import RunState
from tensile_hook.settings import native_plans
from tensile_hook.shapes import ShapeKey, shape_key
from tensile_hook.swap_stages import NativeSwaps


class Paths:
    """The path of each iteration, the dispatch mode pushed and popped for it, and the module hooks that see an
    iteration start off the mode (`begin`, called there)."""

    def __init__(self, state: RunState, plans: PlanBook, residency: Residency, swaps: NativeSwaps, sampler: OpSampler,
                 mode: TorchDispatchMode, begin: Callable[[], None],
                 stand_down: Callable[[BaseException], None]) -> None:
        self.state = state
        self.plans = plans
        self.residency = residency
        self.swaps = swaps
        self.sampler = sampler
        self.mode = mode
        self.begin = begin
        self.stand_down = stand_down
        self.prepared: ActivePlan | None = None  # the plan the step prepared the next iteration's path for
        self.module_hook: Any = None  # the global module forward pre-hook, on the native path
        # the next iteration's shapes, taken at its first module call (from the step: `_want_key`), and the hook that
        # takes them where `module_hook` is off
        self.key_wanted = False
        self.entry_key: ShapeKey | None = None
        self.shape_hook: Any = None
        # On the CPU device a native iteration's peak is only known when observed by the dispatch
        # mode (every op's outputs watched, nothing else done): tests and audits turn this on.
        self.observe_native = False
        self.dynamo_frames: int | None = dynamo_frames()  # compiled code seen before the hook: none of its doing

    # -- at the step --------------------------------------------------------------------------
    def at_step(self, off_shape: bool) -> None:
        """Choose the next iteration's path here, outside any op and outside the user's forward:
        the dispatch mode can be left or pushed, and the native swaps' hooks put on, safely. `off_shape`: this
        iteration ran on shapes without a plan of their own."""
        state = self.state
        diverged = self.swaps.at_step()
        self._say_if_compile_skipped()
        if state.disabled:
            self.swaps.drop_idle()
            self._leave_mode()
            return
        self.prepared = self.plans.ready
        matched = state.match_at <= state.iteration
        native = self._native_map(self.prepared, off_shape) if matched and not diverged else None
        sampling = native is not None and self.sampler.due(state.iteration + 1)
        if sampling and _get_current_dispatch_mode() in (None, self.mode):
            native = None  # a sampling iteration (latency_samples.py): on the dispatch path, which times every op
        state.next_path = "dispatch" if native is None else "native"
        # the native swaps' hooks first: where the carrier's pre-hook starts the next iteration, no other is put on
        self.swaps.prepare(native, matched, self.prepared)
        if native is not None and not self.observe_native:
            self._leave_mode()
        elif native is None and not self._enter_mode():
            # back on the stack now (when it can be), not at the next module call: the dispatch
            # iteration then starts at its first op on a parameter, as the recorded one did. Where
            # another mode holds the stack, a module call starts it, without a plan (`choose`)
            self._watch_for_start()
        self._want_key()

    def _say_if_compile_skipped(self) -> None:
        """Code TorchDynamo first met in an iteration under the dispatch mode is skipped for the rest of the process:
        said once. Code it first met in a native iteration, the mode off, compiled as it does without Tensile: nothing
        is said (saying it ran eagerly would be false), and the count moves on."""
        if self.dynamo_frames is None:
            return
        frames = dynamo_frames()
        if frames > self.dynamo_frames and self.state.in_mode:
            self.dynamo_frames = None  # said once
            self.state.say(COMPILE_SKIPPED)
        else:
            self.dynamo_frames = frames

    def _native_map(self, plan: ActivePlan | None, off_shape: bool) -> NativeMap | None:
        """The plan on native hook points, or None where the next iteration needs the dispatch mode:
        the first iteration under a plan (exact, measured, aligning its swaps), an event that does
        not map, a budget the plan (or, without one, the vanilla peak) does not keep."""
        state = self.state
        native = plan.mapped(state.say) if plan is not None else NativeMap([])
        if self.plans.live is None or state.stats.mode in ("recording", "stood_down") or plan is not state.active:
            return None
        if state.budget is not None:
            report = state.report
            expected = report.scheduled_peak_bytes if plan is not None else self.plans.vanilla_peak
            last = self._measured_so_far()
            forecast_over = expected is None or expected > state.budget
            # an iteration on shapes without a plan of their own (past MAX_SHAPE_SETS) says nothing of the plan's
            allowed = state.budget + (report.workspace_bytes or 0) + BUDGET_TOLERANCE_BYTES
            measured_over = last is not None and not off_shape and last.peak_bytes > allowed
            if forecast_over or measured_over:
                if plan is not None and not plan.guard_said:  # said once per plan
                    plan.guard_said = True
                    state.say(self._guarded(plan, expected, None if forecast_over else last))
                return None
        if native is None or (native.swaps and native.carrier is None):
            return None
        return native

    def _measured_so_far(self) -> IterationStats | None:
        """This iteration, whose ops have all run at its step, if its peak is measured (the dispatch path, an
        observed native iteration, CUDA): the next iteration's path follows it, not the one before it (a
        recorded iteration's vanilla peak over the budget cost ResNet-50 one more dispatch iteration a plan)."""
        state = self.state
        stats = state.stats
        if state.device_type == "cuda":
            stats.peak_bytes = max(stats.peak_bytes, torch.cuda.max_memory_allocated(state.device))
        return stats if stats.peak_source == "measured" else None

    def _guarded(self, plan: ActivePlan, expected: int | None, measured: IterationStats | None) -> str:
        """Why a plan's iterations run on the dispatch path, guarded by the budget, whatever its events:
        an iteration under it `measured` above the budget, else its forecast (none, or above the budget)."""
        state = self.state
        workspace = state.report.workspace_bytes
        if measured is not None:
            why = f"ran iteration {measured.iteration} at a measured peak of {memory_text(measured.peak_bytes)}"
            if workspace:
                why += f" ({memory_text(workspace)} of it the CUDA allocator's beyond the tensors: workspaces)"
        elif expected is None:
            why = "comes without a forecast of its scheduled peak"
        else:
            why = f"forecasts a scheduled peak of {memory_text(expected)}"
        said = (f"plan version {plan.plan.version} {why}, against a memory budget of {memory_text(state.budget or 0)}: its "
                "iterations run on the dispatch path, where the budget guard swaps out what the plan leaves on the "
                "device")
        if measured is None and expected is not None and native_plans(state.settings, state.device_type):
            said += (" (its events are native events only, as TENSILE_PLAN_EVENTS=native, or auto on CUDA, asks: "
                     "with all, the plan may swap parameters and optimizer state too)")
        return said

    # -- at an iteration's start --------------------------------------------------------------
    def choose(self, reshaped: bool) -> None:
        """What the step decided, unless the plan changed since (a newer one from the agent), the iteration runs on
        other shapes (`reshaped`) or the hook stood down: then this iteration runs on the dispatch path, where it
        can."""
        state = self.state
        native = state.next_path == "native" and state.active is self.prepared and not state.disabled and not reshaped
        if not native and not self._enter_mode():
            if state.active is not None:
                state.say("another dispatch mode is active: this iteration's plan is not applied")
            state.active = None
            native = True
        state.path = state.stats.path = "native" if native else "dispatch"
        if native and not state.in_mode and state.device_type != "cuda":  # CUDA's allocator measures every iteration
            state.stats.peak_source = "planned"

    def entry_shapes(self) -> ShapeKey | None:
        """The shapes of the iteration that starts now, as its first module call took them; None where an op started
        it before any module call did (the hook that takes them goes: it is on only while they are wanted)."""
        if self.key_wanted:
            self._drop_key_hook()
            return None
        return self.entry_key

    # -- the mode on and off the stack --------------------------------------------------------
    def push(self) -> None:
        """Activation: on the stack from the start (the recorded iterations need it)."""
        self.state.in_mode = True
        self.mode.__enter__()

    def remove(self) -> None:
        """Deactivation: off the stack (if on it) and every native hook removed."""
        self._unhook_modules()
        self._drop_key_hook()
        self.swaps.remove()
        if self.state.in_mode:
            self.state.in_mode = False
            self.mode.__exit__(None, None, None)

    def _leave_mode(self) -> None:
        """Off the dispatch mode stack (only from its top): every absent tensor comes back first,
        since no op will be checked before use any more. The next iteration's start is then seen by
        the global module pre-hook."""
        state = self.state
        if state.in_mode:
            if _get_current_dispatch_mode() is not self.mode:
                return  # another mode sits above: stay, the dispatch path keeps working
            self.residency.restore_absent()
            self.mode.__exit__(None, None, None)
            state.in_mode = False
        self._watch_for_start()

    def _enter_mode(self) -> bool:
        """Back on the stack, only when it is empty: pushed above a user's mode it would be popped by theirs."""
        state = self.state
        if state.in_mode:
            return True
        if _get_current_dispatch_mode() is not None:
            return False
        self.mode.__enter__()
        state.in_mode = True
        self._unhook_modules()
        return True

    # -- module hooks off the mode ------------------------------------------------------------
    def _watch_for_start(self) -> None:
        """Off the dispatch mode, the next iteration's start is the first module call after the step: seen by the
        native swaps' carrier where its hooks are on for it, else by a global pre-hook of this class's own."""
        if self.module_hook is None and not self.state.disabled and not self._carrier_starts():
            self.module_hook = register_module_forward_pre_hook(self.start_at_module)

    def _carrier_starts(self) -> bool:
        """The next iteration is native and the native swaps' carrier, its hooks on, starts it at its first module
        call."""
        return self.state.next_path == "native" and self.swaps.starts_next()

    def _unhook_modules(self) -> None:
        """The global module pre-hook off: any global module hook sends every module call through
        PyTorch's slow path (0.5-1 ms an iteration on a model of 202 tiny module calls)."""
        if self.module_hook is not None:
            self.module_hook.remove()
            self.module_hook = None

    def start_at_module(self, module: torch.nn.Module, args: Any) -> None:
        """On the native path: the first module forward after the step(s) starts the next iteration;
        the hook then goes until the next step (which puts it back), so the iteration's module calls
        keep PyTorch's fast path."""
        state = self.state
        if state.start_due():
            started = time.perf_counter()
            try:
                if self.key_wanted:
                    self._take_key(args)
                if self.plans.other_shapes(self.entry_key) and self._enter_mode():
                    # on the dispatch path now, the iteration starts at its first op on a parameter, as a recorded one
                    # did (from here, ops on the input before it would shift the plan's op indices)
                    state.next_path = "dispatch"
                else:
                    self._unhook_modules()
                    self.begin()
            except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
                self.stand_down(exc)
            state.stats.hook_seconds += time.perf_counter() - started

    def _want_key(self) -> None:
        """At a step: the next iteration's shapes are taken at its first module call, by the pre-hook that starts it
        where that is on (the native path), else by a hook of their own, gone after that call."""
        self.key_wanted, self.entry_key = True, None
        if self.module_hook is None and self.shape_hook is None and not self._carrier_starts():
            self.shape_hook = register_module_forward_pre_hook(self._shape_hook)

    def _shape_hook(self, module: torch.nn.Module, args: Any) -> None:
        state = self.state
        if state.start_due():
            started = time.perf_counter()
            try:
                self._take_key(args)
            except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
                self.stand_down(exc)
            state.stats.hook_seconds += time.perf_counter() - started

    def _take_key(self, args: Any) -> None:
        self.entry_key = shape_key(args, self.state.device_type)
        self._drop_key_hook()

    def _drop_key_hook(self) -> None:
        self.key_wanted = False
        if self.shape_hook is not None:
            self.shape_hook.remove()
            self.shape_hook = None
