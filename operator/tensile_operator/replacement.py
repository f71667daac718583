"""Jobs whose booked GPU left the inventory (its TensileNode removed, or no longer listing it; in `dra` mode, no
ResourceSlice publishing it).

A job whose pod has not started is placed again: pinned by `nodeName` (or by its claim) to a GPU that is gone, its pod
would never run, and the job waited on it for good while other GPUs had room. A job whose pod started is said
(`NodeAvailable=False`) and left alone: Tensile never stops training by its own decision, and the pod keeps its GPU's
memory (in `dra` mode its claim stays allocated). Looked at live, at start-up (it went while no operator ran), and
again every RESYNC_SECONDS while a look failed.
"""

from __future__ import annotations

import asyncio
import logging

from tensile_operator import timing
from tensile_operator.capacity import GPU_REMOVED, GPU_UNPUBLISHED, CapacityLedger, Gone
from tensile_operator.completion import JobCompletion
from tensile_operator.edits import JobEdits
from tensile_operator.intake import JobIntake
from tensile_operator.kube import Kube, NotFound, retried
from tensile_operator.placement import Booking
from tensile_operator.pod_creation import PodDeletion, PodLauncher
from tensile_operator.pods import pod_name
from tensile_operator.scheduler import Scheduler
from tensile_operator.statuses import JobStatuses, condition, job_key
from tensile_operator.tasks import Background

log = logging.getLogger("tensile_operator")
# conditions about a job's placement and its pod: dropped when the job is placed again (its next pod is made anew)
CLAIM_UNALLOCATABLE = "ClaimUnallocatable"
PLACED_CONDITIONS = frozenset({"PodRunning", "NodeAvailable", "SpecApplied", "PlanEventsApplied", "KnobsApplied"})


def node_condition(booking: Booking, gone: Gone | None, said: dict | None) -> dict:
    """`NodeAvailable` of a job whose pod has started on a GPU that went (`gone`), or that is back (`said`: the
    condition that said it went)."""
    if gone is None:
        went = said.get("reason") if said is not None else None
        if went == GPU_REMOVED:
            return condition("NodeAvailable", True, "GPUPublished",
                             f"TensileNode {booking.node} lists GPU {booking.gpu} again")
        if went == GPU_UNPUBLISHED:
            return condition("NodeAvailable", True, "GPUPublished",
                             f"a ResourceSlice publishes GPU {booking.gpu} of node {booking.node} again")
        return condition("NodeAvailable", True, "TensileNodePublished",
                         f"TensileNode {booking.node} is published again")
    if gone.reason == GPU_UNPUBLISHED:
        return condition("NodeAvailable", False, gone.reason, (
            f"{gone.what}: the job's pod had started, so it is left to run (its ResourceClaim stays allocated: "
            "Kubernetes' allocation stands) and its claim stays booked until it ends, and no job is placed on that GPU "
            "until a ResourceSlice publishes it again"))
    return condition("NodeAvailable", False, gone.reason, (
        f"{gone.what}: the job's pod had started, so it is left to run and its GPU stays booked until it ends, but no "
        "node agent re-plans its memory or takes its knob changes there, and no job is placed on that GPU until it is "
        "published again"))


class Replacement:
    """Looks at each job booked on a node against what its TensileNode lists, one task a job whose GPU went."""

    def __init__(self, kube: Kube, capacity: CapacityLedger, statuses: JobStatuses, scheduler: Scheduler,
                 pods: PodLauncher, completion: JobCompletion, intake: JobIntake, edits: JobEdits,
                 background: Background) -> None:
        self.kube = kube
        self.capacity = capacity
        self.statuses = statuses
        self.scheduler = scheduler
        self.pods = pods
        self.completion = completion
        self.intake = intake
        self.edits = edits
        self.background = background
        # key -> the task looking at a job whose GPU went (`_booked_gpu_gone`)
        self.checking: dict[str, asyncio.Task] = {}

    async def check_node(self, node: str) -> None:
        """The jobs booked on `node` against what its TensileNode lists now (in `dra` mode, what the ResourceSlices
        publish). A job whose GPU went is looked at on a task of its own (`_booked_gpu_gone`: placed again if its pod
        has not started, said if it has), once per removal; one said to have lost its node or GPU hears of its return
        once it is listed again. Before, a removed TensileNode was only said, and a GPU its TensileNode stopped listing
        not even that."""
        if not self.capacity.lists(node):  # created again, its GPUs not published yet: it says nothing of them
            return
        # in `dra` mode a TensileNode's event moves no GPU (`gone` reads the slices alone), yet the walk is made: what
        # it answers also follows the jobs' conditions (read back after a restart) and bookings (a rebuild, an
        # adoption), which change without a slice event, and the agent publishes its TensileNode every 15 s
        back: list[Booking] = []
        for booking in self.capacity.bookings():
            if booking.node != node:
                continue
            gone, said = self.capacity.gone(booking), self._node_said(booking.job)
            if gone is None:
                if said is not None:
                    back.append(booking)
            elif booking.job not in self.checking and not self.completion.being_deleted(booking.job) \
                    and (said is None or said["reason"] != gone.reason):  # a job being deleted: `deleted` has it
                self.checking[booking.job] = self.background.spawn(self._booked_gpu_gone(booking, gone))
        await asyncio.gather(*(self._say_node(b, None) for b in back))

    def claim_unallocatable(self, booking: Booking, message: str) -> None:
        """A job whose pod the scheduler cannot bind because its claim cannot be allocated (its GPU filled up between
        placement and allocation, e.g. with another workload's claim): placed again, as a job whose GPU went is, on a
        task of its own (once at a time)."""
        if booking.job in self.checking or self.completion.being_deleted(booking.job):
            return
        gone = Gone(CLAIM_UNALLOCATABLE, f"the scheduler could not allocate ResourceClaim {booking.claim} on "
                                         f"{booking.node} GPU {booking.gpu} ({message})")
        self.checking[booking.job] = self.background.spawn(self._booked_gpu_gone(booking, gone))

    def check_of(self, key: str) -> asyncio.Task | None:
        """The task looking at the job (its GPU went), while it runs."""
        return self.checking.get(key)

    def _node_said(self, key: str) -> dict | None:
        """The job's `NodeAvailable=False` (its node or GPU said gone), if it has one."""
        return self.statuses.find(key, "NodeAvailable", "False")

    async def _say_node(self, booking: Booking, gone: Gone | None) -> None:
        """`NodeAvailable` on a job whose pod has started on a GPU that went (`gone`), or that is back (None)."""
        namespace, name = booking.job.split("/", 1)
        try:
            await self.statuses.write(namespace, name, {}, node_condition(booking, gone, self._node_said(booking.job)))
        except Exception as exc:  # noqa: BLE001 - one job's write must not keep the others' (or the inventory) back
            log.warning("%s: NodeAvailable not written: %s", booking.job, exc)

    async def _booked_gpu_gone(self, booking: Booking, gone: Gone) -> None:
        """A job whose booked GPU went: said and left alone if its pod started (running, or a container started),
        else (no pod yet, or one Pending with no container started) placed again (`_requeue`)."""
        key = booking.job
        try:
            await self.scheduler.placements_written()  # a placement being written lands first
            creating = self.pods.creation(key)
            if creating is not None:  # the pod being created lands before the job is looked at
                await asyncio.wait({creating})
            if not self._booked_on(key, booking.gpu):  # ended, deleted or placed again meanwhile
                return
            if self.statuses.phase(key) == "Running" or not await self._requeue(booking, gone):
                await self._say_node(booking, gone)
        except Exception:  # noqa: BLE001 - one job's trouble must not stop the others' (`recheck_forever` retries it)
            log.exception("%s: its GPU went, and it was not placed again (looked at again in %g s)", key,
                          timing.RESYNC_SECONDS)
        finally:
            self.checking.pop(key, None)

    def _booked_on(self, key: str, gpu: str) -> bool:
        """Booked on `gpu` and not being deleted (`deleted` frees its room). By value: a rebuild replaces the ledger's
        bookings with equal ones."""
        booking = self.capacity.booking(key)
        return booking is not None and booking.gpu == gpu and not self.completion.being_deleted(key)

    async def _requeue(self, booking: Booking, gone: Gone) -> bool:
        """The job's unstarted pod deleted, its booking released (after the status says it is queued again, so a
        rebuild does not book it from its placement), and the job admitted again: queued in its place (by priority
        and creation) and placed where it fits, by its spec and annotations as they are now (its pod is made anew).
        False when its pod has started (it is left alone); True when it is queued again, or ended or deleted
        meanwhile."""
        key = booking.job
        namespace, name = key.split("/", 1)
        try:
            body = await retried(lambda: self.kube.get_job(namespace, name), timing.RETRY_DELAYS)
        except NotFound:
            return True  # gone: `deleted` freed its room
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            return True  # `deleted` frees its room
        self.statuses.remember(body)
        deletion = await self.pods.delete_unstarted_pod(namespace, pod_name(namespace, name, meta.get("uid", "")),
                                                        (name, meta.get("uid", "")))
        if deletion is PodDeletion.STARTED:
            return False
        if not self._booked_on(key, booking.gpu):
            return True  # ended, or being deleted: `finish` or `deleted` has its room
        self.statuses.drop(key, PLACED_CONDITIONS)
        pod = f", its pod {pod_name(namespace, name, meta.get('uid', ''))} deleted" \
            if deletion is PodDeletion.DELETED else ""
        said = (f"{gone.what} before the job's pod started: its booking on {booking.node} GPU {booking.gpu} was "
                f"released{pod}, and it is queued again, in its place (by priority and creation), to be placed where "
                "it fits")
        await self.statuses.write(namespace, name, {
            "phase": "Queued", "message": said, "placement": None,
            "forecast": dict.fromkeys(("scheduledPeakBytes", "reservedBytes", "plannedWith"))},
            condition("Admitted", False, gone.reason, said), delays=timing.RETRY_DELAYS)
        if not self._booked_on(key, booking.gpu):  # checked again with no await before the release: the write may
            return True  # have taken a minute of retries, in which the job was deleted (`deleted` waits for this task)
        released = self.completion.release(key)
        self.edits.cancel_retry(key)  # its next pod starts with the knobs in its environment
        await self.completion.after_release(key, released)
        status = {k: v for k, v in (body.get("status") or {}).items() if k != "placement"}
        await self.intake.admit(body | {"status": status | {"phase": "Queued"}})
        return True

    async def check_nodes_at_start(self, listed: list[dict]) -> None:
        """At start-up: jobs whose booked GPU went while no operator ran (their conditions read first: what they say
        is kept, and a removal said already is not said again)."""
        nodes = self.capacity.nodes_with_gone()
        for body in listed:
            booking = self.capacity.booking(job_key(body))
            if booking is not None and booking.node in nodes:
                self.statuses.remember(body)
        for node in nodes:
            await self.check_node(node)

    async def recheck_forever(self) -> None:
        """Every RESYNC_SECONDS, the jobs still booked on a GPU that went, neither placed again nor said (their look
        failed: the API server's trouble), are looked at again: a removed TensileNode sends no further event, so a
        failed look left the job booked for good on a GPU that is gone. In `dra` mode the ResourceSlices are read
        first: a watch that reconnects lists them again but says nothing of one deleted meanwhile, and while no job
        waits no scheduling pass reads them."""
        while True:
            await asyncio.sleep(timing.RESYNC_SECONDS)
            try:
                if self.capacity.bookings():  # no job booked: no GPU of one can go, nothing to read
                    await self.capacity.refresh_dra()
                for node in self.capacity.nodes_with_gone():
                    await self.check_node(node)
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("looking again at the jobs whose GPU went failed")
