"""A job's end and the release of its GPU room: the end written first, then the room freed and the job's agent told.

A budget-admitted job's live workload (its hook traced it) becomes its profile, fetched while it runs and at its
release. A deleted job waits here for its release (`deletion_started`).
"""

from __future__ import annotations

import asyncio
import logging

from tensile.agent_contract import utc_timestamp
from tensile_operator import timing
from tensile_operator.agent import NodeAgentClient
from tensile_operator.capacity import CapacityLedger
from tensile_operator.claims import JobClaims
from tensile_operator.forecasting import Forecaster
from tensile_operator.placement import Booking
from tensile_operator.pods import JobTokens
from tensile_operator.queueing import JobQueue
from tensile_operator.statuses import JobStatuses, condition
from tensile_operator.tasks import Background

log = logging.getLogger("tensile_operator")
PROFILE_POLL_SECONDS = 1.0  # how often the live workload of a running job admitted by its budget is asked for


class JobCompletion:
    """Ends jobs and releases their room: one end per job, written before its room is given away."""

    def __init__(self, capacity: CapacityLedger, queue: JobQueue, statuses: JobStatuses, agents: NodeAgentClient,
                 forecaster: Forecaster, tokens: JobTokens, background: Background,
                 claims: JobClaims | None = None) -> None:
        self.capacity = capacity
        self.queue = queue
        self.statuses = statuses
        self.agents = agents
        self.forecaster = forecaster
        self.tokens = tokens
        self.background = background
        self.claims = claims  # `dra` mode: a released job's claim is deleted
        self._ending: dict[str, asyncio.Event] = {}  # key -> set once the end `finish` is writing has been written
        self._freed: dict[str, asyncio.Event] = {}  # key -> set when a deleted job's booking is released
        self._profiling: set[str] = set()  # jobs whose live workload is being fetched

    async def finish(self, namespace: str, name: str, phase: str, reason: str, message: str) -> None:
        """The job's end is written before its room is released. Released first, a placement made in the
        meantime could land before the end did, and the statuses showed the GPU over-committed (the 60-job
        restart test, with a burst of ends and placements after the restart); a rebuild whose LIST was
        served in between also booked the finished job again. The write is retried through the API server's
        trouble (written once, a 503 left the job Running for good). One end per job: a second caller (the
        pod's event and a rebuild, or a deletion) waits for the end being written."""
        key = f"{namespace}/{name}"
        self.queue.pending.pop(key, None)
        if (ending := self._ending.get(key)) is not None:
            await ending.wait()
            return
        ending = self._ending[key] = asyncio.Event()
        try:
            end = {"phase": phase, "message": message, "finishedAt": utc_timestamp()}
            await self.statuses.write(namespace, name, end, condition("PodRunning", False, reason, message),
                                      condition("Finished", True, reason, message), delays=timing.RETRY_DELAYS)
        finally:  # a write that failed for good still frees the room (the pod has ended); a rebuild ends the job
            booking = self.release(key)
            del self._ending[key]
            ending.set()
        await self.after_release(key, booking)

    def ending(self, key: str) -> bool:
        """Whether the job's end is being written."""
        return key in self._ending

    def release(self, key: str) -> Booking | None:
        """The job's room freed (and its deletion, if one waits for it, told)."""
        freed = self._freed.get(key)
        if freed is not None:
            freed.set()
        return self.capacity.release(key)

    async def after_release(self, key: str, booking: Booking | None) -> None:
        self.queue.poke()
        if booking is None:
            return
        if self.claims is not None:
            try:  # its pod has ended or is gone: the claim holds nothing any more (its owner reference deletes it too)
                await self.claims.delete(booking)
            except Exception as exc:  # noqa: BLE001 - the release goes on; garbage collection deletes it with the job
                log.warning("%s: its ResourceClaim %s was not deleted: %s", key, booking.claim, exc)
        await self._store_profile(key, booking)  # not fetched while it ran (or the operator restarted)
        # its node's agent when its GPU is no longer listed: it still holds the job (and the forecast registered for it)
        await self.agents.unregister(self.capacity.agent_of(booking), key, self.tokens.forget(key))

    # ---- deletions ------------------------------------------------------------------------------
    def deletion_started(self, key: str) -> asyncio.Event:
        """The job is being deleted: the event is set when its booking is released. Set first by a deletion, so that
        a re-placement under way sees it and neither releases nor queues the job."""
        return self._freed.setdefault(key, asyncio.Event())

    def deletion_ended(self, key: str) -> None:
        self._freed.pop(key, None)

    def being_deleted(self, key: str) -> bool:
        return key in self._freed

    # ---- live workloads as profiles -------------------------------------------------------------
    def profile_while_running(self, key: str) -> None:
        """The hook gives the agent its live workload after iteration 1 and unregisters when the training
        exits, before the pod's end reaches the operator: so it is asked for while the job runs (one task a job)."""
        if key not in self._profiling:
            self._profiling.add(key)
            self.background.spawn(self._poll_profile(key))

    async def _poll_profile(self, key: str) -> None:
        try:
            while (booking := self.capacity.booking(key)) is not None and booking.profile:
                if await self._store_profile(key, booking):
                    return
                await asyncio.sleep(PROFILE_POLL_SECONDS)
        finally:
            self._profiling.discard(key)

    async def _store_profile(self, key: str, booking: Booking) -> bool:
        """The live workload the job's hook gave its agent, stored under the booking's profile name in its namespace."""
        agent = self.capacity.agent_of(booking)
        if not booking.profile or agent is None:
            return False
        live = await self.agents.live_workload(agent, key, self.tokens.get(key))
        if live is None:
            return False
        self.forecaster.store_profile(key.split("/", 1)[0], booking.profile, live)
        log.info("%s: its live workload is now profile %r", key, booking.profile)
        booking.profile = None  # stored: not asked for again
        return True

    # ---- the ledger rebuilt ---------------------------------------------------------------------
    async def rebuild_ledger(self) -> list[dict]:
        """The ledger rebuilt from the statuses (`CapacityLedger.rebuild`), and what it found settled: the end of a job
        whose pod ended unseen written (booked until then, as every end), a deleted job whose pod is gone released
        (a later event showing its placement must not book it again) and its agent told. Returns the TrainingJobs
        listed."""
        rebuilt = await self.capacity.rebuild(self.ending)
        for body, end in rebuilt.ends:
            self.statuses.remember(body)  # the end keeps them, and its Event names the job's uid
            self.tokens.issue(body)  # its agent is told at the release (a restarted operator has no token yet)
            self.background.spawn(self.finish(body["metadata"]["namespace"], body["metadata"]["name"], *end))
        for booking, body in rebuilt.gone:
            self.release(booking.job)
            self.tokens.issue(body)  # its agent is told, as after every release (a restarted operator has no token yet)
            self.background.spawn(self.after_release(booking.job, booking))
        return rebuilt.listed
