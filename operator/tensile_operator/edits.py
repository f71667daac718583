"""A TrainingJob edited after its creation: its knob annotations, its spec, or tensile.dev/* names that are no knob.

A placed job's knobs go to its node agent (sent again until its hook has registered); a queued job is placed by them,
and admitted again by an edited spec. A placed job keeps the spec its pod was made from, and its status says so.
"""

from __future__ import annotations

import asyncio

from tensile import trainingjob_spec as model
from tensile_operator.agent import FORWARDED, UNREGISTERED, NodeAgentClient
from tensile_operator.capacity import CapacityLedger
from tensile_operator.claim_fit import knobs_outgrow_claim
from tensile_operator.intake import JobIntake
from tensile_operator.pods import JobTokens
from tensile_operator.queueing import JobQueue, Pending
from tensile_operator.statuses import JobStatuses, condition, job_key
from tensile_operator.tasks import Background
from tensile_operator.validation import unreachable_budget

KNOBS_RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0, 15.0) + (30.0,) * 18  # seconds: about ten minutes for a pod to start


def knobs_condition(outcome: str) -> dict:
    if outcome == FORWARDED:
        return condition("KnobsApplied", True, "Forwarded", "forwarded to the node agent")
    if outcome == UNREGISTERED:
        return condition("KnobsApplied", False, "WaitingForHook", "the job's hook has not registered with its node "
                         "agent yet (its pod is starting): sent again until it has")
    return condition("KnobsApplied", False, "NoAgent", "recorded; no agent reachable to forward to")


class JobEdits:
    """Takes a job's edits as its state allows: placed, queued, or ended (only its annotations' condition)."""

    def __init__(self, capacity: CapacityLedger, queue: JobQueue, statuses: JobStatuses, intake: JobIntake,
                 agents: NodeAgentClient, tokens: JobTokens, background: Background) -> None:
        self.capacity = capacity
        self.queue = queue
        self.statuses = statuses
        self.intake = intake
        self.agents = agents
        self.tokens = tokens
        self.background = background
        self._knob_retries: dict[str, asyncio.Task] = {}  # key -> the task sending knobs until the hook registers

    async def knobs_changed(self, body: dict) -> None:
        meta = body["metadata"]
        key = job_key(body)
        noted = self.intake.annotation_conditions(key, meta.get("annotations"))
        booking = self.capacity.booking(key)
        pending = self.queue.pending.get(key) if booking is None else None
        # a queued job's knobs apply to the spec it was forecast with (an edited spec is forecast by `spec_changed`):
        # taken from the edited spec here, the job was placed by the old forecast and its pod made from the new spec
        spec_body = pending.body if pending is not None else body
        try:
            spec = model.parse_spec(spec_body.get("spec") or {}, meta.get("annotations"))
        except model.SpecError as exc:
            await self.statuses.write(meta["namespace"], meta["name"], {},
                                      condition("KnobsApplied", False, "InvalidAnnotation", str(exc)), *noted)
            return
        if booking is None:
            await self._queued_knobs_changed(body, pending, spec, noted)
            return  # not placed yet: its pod starts with the knobs in its environment
        # a knob forwarded before that neither annotation nor spec sets now goes back to its default: the agent
        # reads a missing knob as unchanged, so an annotation removed from a job whose spec has no value held for good
        forwarded_before = (body.get("status") or {}).get("knobs") or {}
        gpu = self.capacity.gpu_of(booking)
        outgrown = await asyncio.to_thread(knobs_outgrow_claim, booking, gpu, spec.max_swap_rate, spec.recompute) \
            if (spec.max_swap_rate, spec.recompute) != (booking.max_swap_rate, booking.recompute) else None
        if outgrown is not None:  # its hook keeps to the knobs it has (the agent is not told)
            await self.statuses.write(meta["namespace"], meta["name"], {},
                                      condition("KnobsApplied", False, "ClaimTooSmall", outgrown), *noted)
            return
        knobs: dict = {"recompute": spec.recompute}
        if spec.max_swap_rate is not None or "maxSwapRate" in forwarded_before:
            knobs["maxSwapRate"] = spec.max_swap_rate or 1.0  # 1.0: no cap, as the planner reads none
        if spec.memory_budget is not None or "memoryBudgetBytes" in forwarded_before:  # the job's reservation
            knobs["memoryBudgetBytes"] = min(spec.memory_budget or booking.reserved_bytes, booking.reserved_bytes)
        booking.recompute = spec.recompute
        booking.max_swap_rate = spec.max_swap_rate
        booking.budget_bytes = spec.memory_budget
        agent, token = gpu.agent if gpu else None, self.tokens.issue(body)
        outcome = await self.agents.update_knobs(agent, key, token, knobs)
        if outcome == UNREGISTERED:
            self._knobs_retry(meta["namespace"], meta["name"], agent, token, knobs)
        conditions = [knobs_condition(outcome)]
        if spec.plan_events != booking.plan_events:  # the pod's TENSILE_PLAN_EVENTS is set when it is created
            conditions.append(condition(
                "PlanEventsApplied", False, "FixedAtAdmission",
                f"planEvents is now {spec.plan_events}, but the pod runs with {booking.plan_events} (its hook and its "
                "forecast were set up with it when it was placed): delete and create the TrainingJob again to change "
                "it"))
        await self.statuses.write(meta["namespace"], meta["name"], {"knobs": knobs}, *conditions, *noted)

    async def _queued_knobs_changed(self, body: dict, pending: Pending | None, spec: model.JobSpec,
                                    noted: list[dict]) -> None:
        """Valid knobs on a job not placed. Queued, it is placed (and its pod made) by them, checked as admission checks
        a new job's: a budget below the lowest peak its plans reach fails it (taken as it was, such a budget placed the
        job at once, over-committing the GPU), and `KnobsApplied` says they were taken (an earlier `InvalidAnnotation`
        stayed after the fix). Not queued (ended): only the annotations' condition."""
        meta = body["metadata"]
        namespace, name, key = meta["namespace"], meta["name"], job_key(body)
        if pending is None:
            if noted:
                await self.statuses.write(namespace, name, {}, *noted)
            return
        taken = condition("KnobsApplied", True, "AtPlacement", "recorded while the job is queued: it is placed, and "
                                                               "its pod started, with these knobs")
        if spec.scope != pending.spec.scope:  # admission again (it writes the annotations' condition too)
            await self._forecast_again(pending, pending.body | {"metadata": meta})
            if key in self.queue.pending:  # queued again (else failed: the budget is out of its new plans' reach)
                await self.statuses.write(namespace, name, {}, taken)
            return
        problem = unreachable_budget(spec, pending.forecast)
        if problem is not None:
            del self.queue.pending[key]  # before any await: a commit under way for it books nothing
            self.queue.poke()
            refused = condition("KnobsApplied", False, "BudgetUnreachable", str(problem))
            await self.intake.fail_unreachable(namespace, name, problem, refused, *noted)
            return
        # placed by the knobs as they are now: parsed once, at admission, a budget lowered to fit beside the
        # running jobs left the job queued by the old one
        pending.spec = spec
        self.queue.poke()
        await self.statuses.write(namespace, name, {}, taken, *noted)

    async def spec_changed(self, body: dict) -> None:
        """A spec edited after creation. A queued job is admitted again by it (forecast by the edited spec, keeping
        its place in the queue), as a restarted operator admits it: before, the edit was ignored until a restart,
        or half taken by a knob annotation (the pod made from the edited spec, placed by the old forecast). A placed
        job keeps the spec its pod was made from, and `SpecApplied` says so (nothing did)."""
        meta = body["metadata"]
        namespace, name, key = meta["namespace"], meta["name"], job_key(body)
        pending = self.queue.pending.get(key)
        if self.capacity.booked(key):
            await self.statuses.write(namespace, name, {}, condition(
                "SpecApplied", False, "FixedAtAdmission",
                f"spec edited (generation {meta.get('generation')}) after the job was placed: its pod runs the spec it "
                "was placed with; delete and create the TrainingJob again to run the edited spec (tensile.dev/* "
                "annotations change a placed job's knobs)"))
        elif pending is not None:
            await self._forecast_again(pending, body)
            # queued again (else failed: the edited spec is invalid or its budget out of reach)
            if key in self.queue.pending:
                await self.statuses.write(namespace, name, {}, condition(
                    "SpecApplied", True, "ForecastAgain", f"spec edited (generation {meta.get('generation')}) while "
                    "queued: forecast again, and placed and run by the edited spec"))

    async def _forecast_again(self, pending: Pending, body: dict) -> None:
        """A queued job whose plan scope changed (`plan-events`, `recompute`): its forecast counted on the peak
        of plans made with the old events, which its hook's plans may not reach. It is admitted again (forecast
        by the new scope, or failed if its budget is now out of reach) and keeps its place in the queue (its creation)
        and when it first waited; a commit already under way for it sees it left the queue and books nothing."""
        del self.queue.pending[pending.key]
        await self.intake.admit(body)
        again = self.queue.pending.get(pending.key)
        if again is not None:
            again.since = pending.since or again.since
            again.head_since = pending.head_since or again.head_since

    async def annotations_changed(self, body: dict) -> None:
        """Only tensile.dev/* annotations that are no knob changed: the job's `UnknownAnnotations` condition says so."""
        meta = body["metadata"]
        noted = self.intake.annotation_conditions(job_key(body), meta.get("annotations"))
        if noted:
            await self.statuses.write(meta["namespace"], meta["name"], {}, *noted)

    # ---- knobs sent again -----------------------------------------------------------------------
    def _knobs_retry(self, namespace: str, name: str, agent: str | None, token: str, knobs: dict) -> None:
        """Knobs the agent could not take because the job's hook has not registered yet (404): they were marked as
        sent to no reachable agent and never sent again, so the hook registered with the knobs of its pod's
        environment. One retry task per job; a newer change replaces it."""
        key = f"{namespace}/{name}"
        self.cancel_retry(key)
        self._knob_retries[key] = self.background.spawn(self._send_knobs_again(namespace, name, agent, token, knobs))

    def cancel_retry(self, key: str) -> None:
        """The job's knobs no longer sent again (a newer change replaces them, or its next pod starts with them)."""
        retry = self._knob_retries.pop(key, None)
        if retry is not None:
            retry.cancel()

    async def _send_knobs_again(self, namespace: str, name: str, agent: str | None, token: str, knobs: dict) -> None:
        key = f"{namespace}/{name}"
        try:
            for delay in KNOBS_RETRY_DELAYS:
                await asyncio.sleep(delay)
                if not self.capacity.booked(key):
                    return  # ended or deleted
                outcome = await self.agents.update_knobs(agent, key, token, knobs)
                if outcome != UNREGISTERED:
                    await self.statuses.write(namespace, name, {}, knobs_condition(outcome))
                    return
        finally:
            if self._knob_retries.get(key) is asyncio.current_task():
                del self._knob_retries[key]
