"""Where the hook's plans come from and which one applies next: a plan file, the node agent's plans, the local
planner (from the live iteration, when a plan was made for another workload or none came), and per shape set the
plan last made for those shapes. A plan is offered, matched against the live iteration's signature, and only then
ready; its memory budget (the agent's, a file's) may become the job's."""

from __future__ import annotations

import logging
from collections.abc import Callable

from tensile.peak import analyze_vanilla
from tensile.plan import Plan
from tensile.workload import Workload
from tensile_hook.active_plan import ActivePlan
from tensile_hook.residency import BUDGET_TOLERANCE_BYTES
from tensile_hook.run_state import RunState
from tensile.knobs import budget_bytes, memory_text
from tensile_hook.shapes import MAX_SHAPE_SETS, ShapeKey, ShapeSet, describe

log = logging.getLogger("tensile.hook")
Planner = Callable[[Workload, "int | None"], "Plan | None"]
OTHER_THREAD = ("optimizer steps ran, but no op of their iterations on the thread the hook watches (the one that "
                "started it): training in another thread is not carried; nothing was planned")


def _plan_named(plan: Plan, source: str) -> str:
    """A plan as the hook's messages name it: a file by what it is, a planner's by its version."""
    return "the plan file" if source == "file" else f"plan version {plan.version}"


class PlanBook:
    """The plans offered, the one ready for the next iteration, and the figures they bring (vanilla peak, budget)."""

    def __init__(self, state: RunState, planner: Planner | None) -> None:
        self.state = state
        self.planner = planner
        self.candidate: ActivePlan | None = None  # offered, not yet matched against a live iteration
        self.ready: ActivePlan | None = None  # a plan matched and waiting for the next iteration
        # a plan's budget that the job takes: the agent's (the operator lowered it), a file's
        self.plan_budget: int | None = None
        self.vanilla_peak: int | None = None
        self.live: Workload | None = None  # the matched iteration
        # shape sets (shapes.py): each matched one's iteration, vanilla peak and plan; the one the plan in force is for
        self.shape_sets: dict[ShapeKey, ShapeSet] = {}
        self.shape_key: ShapeKey | None = None

    def offer(self, plan: Plan, workload: Workload, source: str) -> None:
        """A plan to apply once the live iterations are known to match its workload."""
        self.candidate = ActivePlan(plan, workload)
        report = self.state.report
        report.plan_version = plan.version
        report.plan_source = source
        if plan.forecast is not None:
            report.scheduled_peak_bytes = plan.forecast.scheduled_peak_bytes
            self.set_vanilla(plan.forecast.vanilla_peak_bytes)
        self._take_budget(plan, source)

    def _take_budget(self, plan: Plan, source: str) -> None:
        """A plan's budget becomes the job's: the agent's (the operator lowered it), a file's unless the job has one."""
        state = self.state
        budget = plan.memory_budget_bytes
        if budget is None or budget == state.budget:
            return
        if source == "agent":
            state.say(f"plan version {plan.version} holds the job to a memory budget of {memory_text(budget)}, not "
                      f"{memory_text(state.budget or 0)}: the node agent's (a TrainingJob's budget annotation changes it)", logging.INFO)
        elif state.settings.memory_budget is None:
            state.say(f"{_plan_named(plan, source)} holds the job to the memory budget it was made for, {memory_text(budget)}",
                      logging.INFO)
        else:  # the user's own budget stands; the plan may then not keep to it, and the guard evicts what it must
            state.say(f"{_plan_named(plan, source)} was made for a memory budget of {memory_text(budget)}; the job keeps its "
                      f"own, {memory_text(state.budget or 0)} (TENSILE_MEMORY_BUDGET, --memory-budget)", logging.INFO)
            return
        self.plan_budget = state.budget = state.report.memory_budget_bytes = budget

    def set_vanilla(self, vanilla_peak: int) -> None:
        """The vanilla peak of the shapes that run now. A fractional budget is made bytes on the first one only: a job
        whose batch grows later keeps the memory it started with (as one admitted with bytes does)."""
        state = self.state
        self.vanilla_peak = state.report.vanilla_peak_bytes = vanilla_peak
        if state.budget is None:
            state.budget = state.report.memory_budget_bytes = budget_bytes(state.settings.memory_budget, vanilla_peak)

    def match(self, live: Workload) -> None:
        """After a steady iteration, or one on new shapes: compare signatures; on a mismatch (or new shapes), plan
        from the live workload. The plan is kept for these shapes; the guard's slack is the largest of all shapes'."""
        report = self.state.report
        report.live_signature = live.signature
        self.live = live
        slack = max((sum(live.tensors[t].size for t in {*op.inputs, *op.outputs}) for op in live.ops), default=0)
        report.guard_slack_bytes = max(slack + BUDGET_TOLERANCE_BYTES, report.guard_slack_bytes or 0)
        if self.vanilla_peak is None or self.shape_sets:  # a plan file's forecast gives the first shapes' one
            self.set_vanilla(analyze_vanilla(live).peak_bytes)
        elif self.candidate is None or self.candidate.plan.signature != live.signature:
            self._forget_forecast(live)  # that forecast was another workload's
        self._plan_for(live)
        if self.shape_key is not None:
            self.shape_sets[self.shape_key] = ShapeSet(live, self.vanilla_peak or 0, self.ready)

    def _forget_forecast(self, live: Workload) -> None:
        """The vanilla peak is the live workload's, and so is a budget given as a share of it (made bytes on the
        forecast of a plan for another workload; a budget the job took from a plan stays, as the plan's own)."""
        state = self.state
        fraction = state.settings.memory_budget
        shared = fraction is not None and fraction <= 1 and self.plan_budget is None
        if shared:
            state.budget = None  # made bytes again by `set_vanilla`
        self.set_vanilla(analyze_vanilla(live).peak_bytes)
        if shared:
            state.say(f"the memory budget is now {memory_text(state.budget or 0)}: {fraction:g} of this workload's vanilla peak, "
                      "not of the one the plan forecast", logging.INFO)

    def _plan_for(self, live: Workload) -> None:
        state = self.state
        candidate = self.candidate
        if candidate is not None:
            match = candidate.plan.signature == live.signature
            state.report.signature_match = match
            if match:
                self.ready = candidate
                return
            state.say("the plan was made for another workload (signature mismatch); planning from the live iteration")
        if self.planner is None:
            state.say("no plan and no planner: running guarded by the memory budget only")
            return
        if not live.ops:  # the planner has nothing to plan (two training threads crashed it on an empty workload)
            state.say(OTHER_THREAD)
            return
        plan = self.planner(live, state.budget)
        if plan is None:
            state.say("the planner returned no plan: running guarded")
            return
        if plan.signature != live.signature:  # its events name another workload's tensors
            state.say(f"the planner's plan version {plan.version} was made for another workload: running guarded")
            return
        self.offer(plan, live, "local")
        self.ready = self.candidate

    def take_newer(self, plan: Plan | None) -> None:
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
        elif self.live is not None and self.state.iteration >= self.state.match_at:
            signature, workload = self.live.signature, self.live
        else:
            return  # not matched yet: the link hands the plan again when the match asks for it
        if plan.signature != signature:
            self.state.say(f"plan version {plan.version} is for another workload: ignored")
            return
        self.offer(plan, workload, "agent")
        self.ready = self.candidate

    # -- shape sets ---------------------------------------------------------------------------
    def recorded_shapes(self, key: ShapeKey | None) -> None:
        """The recorded iteration ran on these shapes (unknown ones leave the last known): its plan is theirs."""
        if key is not None:
            self.shape_key = key

    def other_shapes(self, key: ShapeKey | None) -> bool:
        """Shapes other than those the plan in force was made for (unknown ones compare with nothing)."""
        return key is not None and self.shape_key is not None and key != self.shape_key and not self.state.disabled

    def can_follow(self, key: ShapeKey) -> bool:
        """Shapes seen before, or room for a plan of their own (MAX_SHAPE_SETS)."""
        return key in self.shape_sets or len(self.shape_sets) < MAX_SHAPE_SETS

    def switch_shapes(self, key: ShapeKey) -> bool:
        """The batch's shapes changed: the shapes left keep the plan ready for them (the agent may have sent a newer
        one meanwhile); shapes seen before take back the plan made for them (True), new ones have none yet (False:
        the next plan is made from their recorded iteration)."""
        assert self.shape_key is not None  # shapes other than the plan's (`other_shapes`)
        if self.shape_key in self.shape_sets:
            self.shape_sets[self.shape_key].plan = self.ready
        known = self.shape_sets.get(key)
        if known is None:
            self.state.say(f"the batch's shapes changed at iteration {self.state.iteration} "
                           f"({describe(self.shape_key)} -> {describe(key)}); planning again", logging.INFO)
            self.forget_plans()
        else:
            log.debug("tensile: iteration %d is back on shapes planned for: %s", self.state.iteration, describe(key))
            self._resume(known)
        self.shape_key = key
        return known is not None

    def forget_plans(self) -> None:
        """Nothing planned so far applies any more (iterations kept leaving it, new shapes, a stand-down)."""
        self.ready = self.candidate = None

    def _resume(self, shapes: ShapeSet) -> None:
        """The plan made for shapes seen before, and the figures that go with it."""
        self.live, self.ready, self.candidate = shapes.live, shapes.plan, shapes.plan
        self.set_vanilla(shapes.vanilla_peak)
        report = self.state.report
        report.live_signature = shapes.live.signature
        if shapes.plan is not None:
            forecast = shapes.plan.plan.forecast
            report.plan_version = shapes.plan.plan.version
            report.scheduled_peak_bytes = forecast.scheduled_peak_bytes if forecast is not None else None
