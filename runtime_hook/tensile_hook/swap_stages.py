"""The stages of a plan's activation swaps on the native path, across iterations: learnt in a dispatch-path
iteration under the plan (`native_align.SwapLearner`), aligned at its step, carried in native iterations
(`native_swaps.SwapCarrier`), and learnt again after native iterations leave the learnt module calls. All at steps
and iteration starts, outside any op."""

from __future__ import annotations

import logging

from tensile.knobs import memory_text
from tensile_hook.active_plan import ActivePlan
from tensile_hook.native_align import SwapLearner
from tensile_hook.native_host import NativeHost
from tensile_hook.native_map import NativeMap
from tensile_hook.native_swaps import SwapCarrier
from tensile_hook.settings import native_plans
from tensile_hook.storages import StorageSlot

log = logging.getLogger("tensile.hook")
MAX_ABORTS = 2  # native iterations of a plan in a row that leave the learnt module calls: it stays on the dispatch path


class NativeSwaps:
    """The executor's side of the native swaps: which learner or carrier is on, and when."""

    def __init__(self, host: NativeHost) -> None:
        self.host = host
        self.learner: SwapLearner | None = None  # aligning a plan's swaps in this dispatch-path iteration
        self.carrier: SwapCarrier | None = None  # its module hooks installed, for native iterations
        self.carrying: SwapCarrier | None = None  # carrying this native iteration's swaps
        # between a step and its `prepare`: the carrier whose hooks are still on, kept for the next iteration if
        # that carries the same plan (removing and putting back four global hooks cost ~25 µs a step)
        self.idle: SwapCarrier | None = None

    def at_step(self) -> bool:
        """This iteration's native swaps end (True if it left the learnt module calls: the plan is
        aligned again), or the learning iteration aligns the plan's swaps."""
        state = self.host.state
        carrying = self.carrying  # kept until it ends: a stand-down meanwhile still brings its tensors back
        diverged = carrying is not None and carrying.end()  # timed with the whole step hook
        self.carrying = None
        if self.carrier is not None:
            self.idle, self.carrier = self.carrier, None  # its hooks stay on until `prepare`
            planned = state.active
            native = planned.native if planned is not None else None
            if diverged and planned is not None and native is not None:
                native.carrier = None
                native.aborted += 1
                if native.aborted >= MAX_ABORTS:
                    state.say(f"{native.aborted} native iterations left the learnt module calls: "
                              "the plan's iterations run on the dispatch path")
                    planned.native = None
            elif carrying is not None and native is not None:
                native.aborted = 0  # in a row: a short last batch each epoch costs one iteration each time
        learner, self.learner = self.learner, None
        if learner is not None:
            learner.remove()
            active = state.active
            if (not state.disabled and active is not None and state.stats.mode == "planned"
                    and state.iteration == learner.iteration and self.needs_alignment(active)
                    and (native := active.native) is not None):
                self._align(learner, active, native)
        return diverged

    def _align(self, learner: SwapLearner, active: ActivePlan, native: NativeMap) -> None:
        """Swaps that do not align keep the plan on the dispatch path (exact), unless the settings prefer
        native plans (CUDA by default): then they stay on the device and the native path carries the rest,
        if the job's memory budget still holds with all their bytes left on the device (the plan's scheduled
        peak counted them as freed; the native path's peak is not measured on the CPU device)."""
        state = self.host.state
        alignment, unmapped = learner.align(active, native.swaps, state.keys, native.recomputes)
        why = [f"learning failed ({learner.failed})"] if alignment is None else [
            f"swap of tensor {tensor}: {reason}" for tensor, reason in unmapped.items()]
        said = (f"{len(why)} swaps of plan version {active.plan.version} do not align with module calls "
                f"(e.g. {'; '.join(why[:3])})")
        if alignment is None or (unmapped and not native_plans(state.settings, state.device_type)):
            state.say(f"{said}: its iterations run on the dispatch path")
            active.native = None
            return
        if unmapped:
            kept = sum(active.workload.tensors[tensor].size for tensor in unmapped)
            if state.budget is not None and (state.report.scheduled_peak_bytes or 0) + kept > state.budget:
                state.say(f"{said}: the {memory_text(kept)} they would leave on the device could take the job over its "
                          "memory budget, so its iterations run on the dispatch path, guarded")
                active.native = None
                return
            state.say(f"{said}: they stay on the device; the native path carries the other "
                      f"{len(native.swaps) - len(unmapped)}")
        native.carrier = SwapCarrier(self.host, alignment)

    def prepare(self, native: NativeMap | None, matched: bool, prepared: ActivePlan | None) -> None:
        """After the step chose the next path: the carrier's hooks for a native iteration, or a
        learner for a dispatch-path one whose plan (`prepared`, or the plan still to come after the matched
        iteration) has swaps to align."""
        carrier = native.carrier if native is not None else None
        self.drop_idle(keep=carrier)
        if carrier is not None:
            self.carrier = carrier
            carrier.install()
        elif native is None and matched and self.needs_alignment(prepared):
            self.learner = SwapLearner(self.host)

    def drop_idle(self, keep: SwapCarrier | None = None) -> None:
        """The hooks of the carrier the step left on go, unless it carries the next iteration too (`keep`)."""
        if self.idle is not None and self.idle is not keep:
            self.idle.remove()
        self.idle = None

    def starts_next(self) -> bool:
        """The carrier's global pre-hook is on for the next native iteration: it starts that iteration itself
        (`SwapCarrier._pre`), so `Paths` needs no global pre-hook of its own."""
        return self.carrier is not None and bool(self.carrier.handles)

    def needs_alignment(self, plan: ActivePlan | None) -> bool:
        state = self.host.state
        if plan is None:
            return state.iteration == state.match_at
        native = plan.mapped(state.say)
        return native is not None and bool(native.swaps) and native.carrier is None

    def begin(self, active: ActivePlan | None, native: bool, learn: bool = True) -> None:
        """An iteration starts: a native one carries its plan's swaps if that plan's carrier is
        installed; a learner whose iteration has no swaps to align after all (the plan matched at
        this start has none, or it runs on shapes the plan was not made for: `learn` False) goes."""
        if native and self.carrier is not None and active is not None and active.native is not None \
                and active.native.carrier is self.carrier:
            self.carrying = self.carrier
            self.carrying.begin()
        if self.learner is not None and (native or not learn or not self.needs_alignment(active)):
            self.learner.remove()
            self.learner = None

    def stop(self) -> None:
        """The hook stands down: nothing more is swapped, and this iteration's tensors come back
        (`Residency` restores the registry's)."""
        self.drop_idle()  # a stand-down within the step, between `at_step` and `prepare`
        if self.carrying is not None:
            try:
                self.carrying.halt()
            except Exception:  # noqa: BLE001 - standing down must not raise into the user's code
                log.exception("tensile: could not restore a tensor")

    def carried_by(self) -> dict[str, int] | None:
        """The module calls and autograd nodes the native path carries the plan at (None without a carrier): the hook's
        time grows with them, and the in-process planner's plan, made from measured latencies, differs from run to run
        (the same 18 swaps of ResNet-50 at 22 acting boundaries in one run, 26 in another)."""
        carrier = self.carrier or self.idle or self.carrying
        if carrier is None:
            return None
        actions = [action for action in carrier.actions if action is not None]
        hooks = [hook for action in actions for hook in (*action.hooks, *action.deferred)]
        return {"boundaries": len(carrier.expected), "acting_boundaries": len(actions),
                "roots": sum(action.root is not None for action in actions), "node_hooks": len(hooks),
                "node_hook_path_steps": sum(len(hook.path) for hook in hooks)}

    def slots(self) -> list[StorageSlot | None]:
        """The slots of what this native iteration swaps (outside the registry)."""
        return self.carrying.slots if self.carrying is not None else []

    def restore(self) -> None:
        """Every tensor the native iteration swapped out back now (before a read outside the
        dispatcher, or when the hook stands down)."""
        if self.carrying is not None:
            self.carrying.restore()

    def remove(self) -> None:
        for hooks in (self.learner, self.carrier, self.idle):
            if hooks is not None:
                hooks.remove()
        self.learner = self.carrier = self.carrying = self.idle = None
