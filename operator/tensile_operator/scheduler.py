"""The scheduler: one task that places queued jobs, one at a time, in the queue's order, so two jobs can never take the
same memory. A job is placed on the GPU the joint-plan fit test chooses, or told how it waits; its placement is booked
and written to its status before its pod is made."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from tensile.agent_contract import utc_timestamp
from tensile.knobs import memory_text
from tensile_operator import timing
from tensile_operator.capacity import CapacityLedger
from tensile_operator.claim_fit import choose_claimed, too_large_for_claims
from tensile_operator.claims import claim_name
from tensile_operator.completion import JobCompletion
from tensile_operator.kube import Kube
from tensile_operator.metrics import OperatorMetrics
from tensile_operator.placement import (Booking, Candidate, Decision, Gpu, JointPlanner, choose, fit_unchanged,
                                        matching, too_large)
from tensile_operator.pod_creation import PodLauncher
from tensile_operator.queueing import JobQueue, Pending, Priorities, Priority, QueueConfig, Walk, missing_class_message
from tensile_operator.statuses import JobStatuses, condition

log = logging.getLogger("tensile_operator")


def queue_status(**fields: object) -> dict:
    """`status.queue` with every field it may hold: one left None is removed by the merge patch (left out, the
    API server would keep what an earlier write said, such as a hold that has ended)."""
    return dict.fromkeys(("reason", "shortfallBytes", "since", "priority", "priorityClassName", "headSince", "holding",
                          "waitingBehind")) | fields


class Scheduler:
    """Passes over the queue, each woken by the queue's poke. The ledger is kept in memory between passes (only this
    task books, releases are immediate) and checked against the statuses every RESYNC_SECONDS: a LIST of every
    TrainingJob before each pass cost O(all jobs) per admission."""

    def __init__(self, kube: Kube, capacity: CapacityLedger, queue: JobQueue, statuses: JobStatuses, pods: PodLauncher,
                 completion: JobCompletion, planner: JointPlanner, queueing: QueueConfig,
                 metrics: OperatorMetrics) -> None:
        self.kube = kube
        self.capacity = capacity
        self.queue = queue
        self.statuses = statuses
        self.pods = pods
        self.completion = completion
        self.planner = planner
        self.queueing = queueing
        self.metrics = metrics
        self.priorities = Priorities()
        self.admitted_at: dict[str, float] = {}  # key -> loop time the placement was written (benchmarks)
        self.task: asyncio.Task | None = None
        self._hold_timer: asyncio.TimerHandle | None = None  # wakes the scheduler when a head's wait bound ends
        # held while a placement is written: stopping waits for it, so no status write of this operator
        # lands after a successor has listed the statuses (its in-memory ledger would miss the booking)
        self._committing = asyncio.Lock()

    # ---- priorities -----------------------------------------------------------------------------
    async def load_priority_classes(self) -> None:
        """Every PriorityClass, listed once at start-up so the first pass orders by them (a job naming a class the
        watch had not delivered yet would be said to name none); Kopf's watch keeps them after
        (`priority_class_changed`)."""
        for body in await self.kube.list_priorityclasses():
            self.priorities.changed(body["metadata"]["name"], body)

    def priority_class_changed(self, body: dict | None, name: str) -> None:
        """A PriorityClass created, changed or deleted (`body` None): the queue is ordered again by it, and a job that
        waits for a class that now exists is placed."""
        self.priorities.changed(name, body)
        self.queue.poke()

    # ---- the task -------------------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        """Waits for a placement being written and lets no other start (its task is cancelled by the caller)."""
        await self._committing.acquire()
        if self._hold_timer is not None:
            self._hold_timer.cancel()

    async def placements_written(self) -> None:
        """Returns once no placement is being written (one under way lands first: its pod creation is then under
        way)."""
        async with self._committing:
            pass

    async def run(self) -> None:
        while True:
            if self.capacity.dra is not None and self.queue.pending:
                # `dra` mode: no watch on claims and DeviceClasses, so waiting jobs are looked at again
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.queue.next_poke(), timing.CLAIMS_SECONDS)
            else:
                await self.queue.next_poke()
            if not self.queue.pending:
                continue
            try:
                if self.capacity.rebuild_due(asyncio.get_running_loop().time()):
                    await self.completion.rebuild_ledger()
                await self._pass()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the scheduler must survive a failed pass
                log.exception("scheduling pass failed; rebuilding from the statuses and retrying")
                self.capacity.distrust()
                await asyncio.sleep(1.0)
                self.queue.poke()

    async def _pass(self) -> None:
        """One pass in the queue's order (priority, then creation). A job whose PriorityClass does not exist is not
        ordered, nor placed: Kubernetes would refuse its pod, and the class may be created later."""
        walk = Walk(self.queueing, time.time())
        await self.capacity.refresh_dra()
        problem = self.capacity.dra.problem() if self.capacity.dra is not None else None
        ranked: list[tuple[Priority, Pending]] = []
        for pending in list(self.queue.pending.values()):
            priority = self.priorities.of(pending.body.get("spec") or {})
            if priority.known:
                ranked.append((priority, pending))
            else:
                await self._wait_for_class(pending, priority.class_name)
        for priority, pending in sorted(ranked, key=lambda r: r[1].order(r[0])):
            if self.statuses.find(pending.key, "PriorityResolved", "False") is not None:
                await self.statuses.write(pending.namespace, pending.name, {}, condition(
                    "PriorityResolved", True, "PriorityClassFound",
                    f"PriorityClass {priority.class_name} exists now: queued with priority {priority.value}"))
            if problem is not None:  # the cluster can allocate no claim at all: said on every waiting job
                await self._say_waiting(pending, priority, Decision(None, reason=problem[1]), "", (), [], [],
                                        problem[0])
                continue
            await self.place(pending, walk, priority)
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if walk.next_hold is not None:  # a head's wait bound ends then: it is said, and held for, without other news
            delay = max(0.0, walk.next_hold - time.time())
            self._hold_timer = asyncio.get_running_loop().call_later(delay, self.queue.poke)

    async def _wait_for_class(self, pending: Pending, name: str) -> None:
        """A priorityClassName no PriorityClass has: said on the job (condition and Warning Event) with the fix, rather
        than as a refused pod at creation; it waits queued and unplaced until the class exists (as a Kubernetes
        controller's pod creation is retried), since it cannot be ordered without its priority."""
        message = missing_class_message(name)
        pending.since = pending.since or utc_timestamp()
        queue = queue_status(reason=message, shortfallBytes=0, since=pending.since, priorityClassName=name)
        if queue != pending.said:
            self._said_queued(pending, queue)
            queued = {"phase": "Queued", "message": message, "queue": queue}
            await self.statuses.write(pending.namespace, pending.name, queued,
                                      condition("PriorityResolved", False, "PriorityClassNotFound", message))

    def _said_queued(self, pending: Pending, queue: dict) -> None:
        if pending.said is None:
            self.metrics.admissions.labels("queued").inc()
        pending.said = queue

    # ---- one job --------------------------------------------------------------------------------
    async def place(self, pending: Pending, walk: Walk | None = None, priority: Priority | None = None) -> None:
        """Places the job on a GPU not held for an earlier job of the pass (`walk`), or says how it waits."""
        if self.capacity.booked(pending.key):  # placed by an earlier pass (or operator)
            self.queue.pending.pop(pending.key, None)
            return
        walk = walk or Walk(self.queueing, time.time())
        spec = pending.spec
        candidate = Candidate(pending.key, pending.forecast, spec.memory_budget, spec.selector, spec.max_swap_rate)
        usable = matching(self.capacity.gpus, candidate)
        free = walk.free([g.uuid for g in usable])
        gpus = [g for g in usable if g.uuid in free]
        dra = self.capacity.dra is not None
        alone_fits = too_large_for_claims if dra else too_large
        started = time.perf_counter()
        decision = None if dra else fit_unchanged(gpus, self.capacity.ledger, candidate)
        if decision is None and gpus:  # the joint planner may run: off the event loop, on a snapshot of the ledger
            decision = await asyncio.to_thread(choose_claimed if dra else choose, gpus, self.capacity.snapshot(),
                                               candidate, self.planner)
        if gpus:
            planned = "true" if decision is not None and decision.planned else "false"
            self.metrics.placement_seconds.labels(planned).observe(time.perf_counter() - started)
        if decision is not None and decision.gpu is not None:
            async with self._committing:
                await self.commit(pending, decision.gpu, decision.peaks, decision.claim_bytes)
            return
        held = [g.uuid for g in usable if g.uuid not in free]
        if not self.capacity.gpus:
            decision = Decision(None, reason="no ResourceSlice publishes a shared GPU with a memory capacity yet" if dra
                                else "no TensileNode publishes a GPU yet")
        elif not usable:
            decision = Decision(None, reason="no GPU matches spec.gpuSelector")
        elif decision is None or (decision.too_large and alone_fits(usable, candidate) is None):
            decision = Decision(None)  # only GPUs held for earlier jobs could hold it: the reason is that hold
        alone = [g.uuid for g in usable if alone_fits([g], candidate) is None]  # large enough to hold it alone
        wait = walk.waiting(pending.key, alone, pending.head_since)
        await self._say_waiting(pending, priority or Priority(), decision, wait.head_since, wait.holds,
                                walk.holders(held), held)

    async def _say_waiting(self, pending: Pending, priority: Priority, decision: Decision, head_since: str,
                           holds: tuple[str, ...], behind: list[str], held: list[str],
                           cluster_problem: str = "") -> None:
        """`status.queue` and the `Admitted` condition of a job that waits: its shortfall, its priority, since when it
        is the head of the queue, the GPUs held for it, and the earlier jobs it waits behind (or, as the condition's
        reason, what keeps the cluster from allocating any claim: `cluster_problem`). Written when it changes."""
        pending.head_since = head_since
        reason = decision.reason
        if behind:
            reason = (f"waits behind {', '.join(behind)}: holding GPU room on {', '.join(held)} for "
                      f"{'them' if len(behind) > 1 else 'it'} ({self.queueing.rule()})"
                      ) + (f"; {reason}" if reason else "")
        elif holds:
            reason = (f"holding GPU room on {', '.join(holds)} for {pending.key} ({self.queueing.rule()}): later jobs "
                      f"are not placed there until it is; {reason}")
        # when it first waited: a new shortfall (the reason names it) or a restart reset it before
        pending.since = pending.since or utc_timestamp()
        queue = queue_status(reason=reason, shortfallBytes=decision.shortfall_bytes, since=pending.since,
                             priority=priority.value, priorityClassName=priority.class_name or None,
                             headSince=head_since or None, holding=list(holds) or None, waitingBehind=behind or None)
        if queue == pending.said:
            return
        self._said_queued(pending, queue)
        if cluster_problem:
            admitted = condition("Admitted", False, cluster_problem, f"{reason}; retried when the cluster changes")
        elif decision.too_large:  # kept queued, as Kubernetes keeps an unschedulable pod Pending: a larger GPU may join
            fix = "reduce spec.workload.batchSize" if pending.forecast is not None \
                else f"lower {pending.spec.budget_field}"
            admitted = condition("Admitted", False, "NoGpuLargeEnough",
                                 f"{reason} (a TensileNode with more memory), or {fix}")
        else:
            why = "WaitingBehind" if behind else "HoldingRoom" if holds else "Queued"
            admitted = condition("Admitted", False, why, f"{reason}; retried when capacity frees")
        queued = {"phase": "Queued", "message": reason, "queue": queue}
        await self.statuses.write(pending.namespace, pending.name, queued, admitted)

    async def commit(self, pending: Pending, gpu: Gpu, peaks: dict[str, int], claim_bytes: int | None = None) -> None:
        """Books the placement `place` decided, unless the job left the queue meanwhile (deleted while the joint
        planner ran on its thread, or while a write awaited): booked anyway, it got a pod and kept its GPU."""
        key = pending.key
        if self.queue.pending.get(key) is not pending:
            return
        reserved = peaks[key]
        booked = {j: b.reserved_bytes for j in peaks if j != key and (b := self.capacity.booking(j)) is not None}
        changes = {j: p for j, p in peaks.items() if j in booked and booked[j] != p}
        lower = {j: p for j, p in changes.items() if p < booked[j]}
        await self._repeak(lower)
        if self.queue.pending.get(key) is not pending:  # lowered peaks stay valid: the channels only got freer
            return
        # it went while the job was planned: placed in the next pass
        if all(g.uuid != gpu.uuid for g in self.capacity.gpus):
            self.queue.poke()
            return
        spec = pending.spec
        profile = spec.workload.profile if pending.forecast is None else None
        meta = pending.body["metadata"]
        claim = claim_name(meta["namespace"], meta["name"], meta.get("uid", "")) if claim_bytes is not None else ""
        booking = Booking(key, gpu.uuid, gpu.node, reserved, pending.forecast, spec.memory_budget, spec.max_swap_rate,
                          profile, spec.plan_events, spec.recompute, claim_bytes, claim)
        self.capacity.book(booking)
        fstatus = (pending.forecast.to_status() if pending.forecast else {"source": "budget"}) | {
            "scheduledPeakBytes": reserved, "reservedBytes": reserved, "plannedWith": sum(1 for j in peaks if j != key)}
        placement = {"node": gpu.node, "gpu": gpu.uuid, "gpuName": gpu.name, "simulated": gpu.simulated,
                     "agent": gpu.agent or "", "planEvents": pending.spec.plan_events, "admittedAt": utc_timestamp()}
        held = f"{memory_text(reserved)} reserved"
        if claim_bytes is not None:
            placement |= {"claim": claim, "claimBytes": claim_bytes}
            held += f", claiming {memory_text(claim_bytes)} (ResourceClaim {claim})"
        await self.statuses.write(pending.namespace, pending.name, {
            "phase": "Admitted", "message": f"placed on {gpu.node} GPU {gpu.uuid}", "placement": placement,
            "forecast": fstatus, "queue": None}, condition(
                "Admitted", True, "Placed",
                f"placed on {gpu.node} GPU {gpu.uuid} with {held}"))
        self.admitted_at[key] = asyncio.get_running_loop().time()
        self.metrics.admissions.labels("admitted").inc()
        self.queue.pending.pop(key, None)
        await self._repeak({j: p for j, p in changes.items() if j not in lower})
        # the placement is durable now; the scheduler goes on to the next job while the pod is created
        self.pods.launch(pending.body, booking)

    async def _repeak(self, peaks: dict[str, int]) -> None:
        """Co-located jobs' scheduled peaks after planning them together with a newcomer."""
        async def one(job: str, peak: int) -> None:
            booking = self.capacity.booking(job)
            if booking is None:
                return
            booking.reserved_bytes = peak
            namespace, name = job.split("/", 1)
            peaks_now = {"forecast": {"scheduledPeakBytes": peak, "reservedBytes": peak}}
            await self.statuses.write(namespace, name, peaks_now)
        await asyncio.gather(*(one(j, p) for j, p in peaks.items()))
