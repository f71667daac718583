"""The operator's state and flow: forecast, queue, place, start the pod, follow it, release.

One `Admission` per operator run. Placement is done by one scheduler task, so two jobs can never
take the same memory. The ledger is rebuilt from the TrainingJobs' statuses (the durable record: a
placement is written to the status before its pod exists) at start-up, after a failed pass and every
RESYNC_SECONDS, so a restarted operator, or one that takes over through peering, starts from what
the cluster says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from tensile.agent_contract import utc_timestamp
from tensile.knobs import memory_text
from tensile import trainingjob_spec as model
from tensile_operator.agent import FORWARDED, UNREGISTERED, AgentLink
from tensile_operator.events import NORMAL, Recorder, Said, transitions
from tensile_operator.forecasting import Forecaster, ForecastError, JobForecast
from tensile_operator.heap import freeze_long_lived
from tensile_operator.kube import Conflict, Kube, KubeError, NotFound, retried, transient
from tensile_operator.metrics import OperatorMetrics
from tensile_operator.placement import (Booking, Candidate, Decision, Gpu, JointPlanner, Ledger, choose, fit_unchanged,
                                        gpus_from_tensilenode, matching, too_large)
from tensile_operator.pods import DEFAULT_IMAGE, JOB_LABEL, build_pod, job_token, owner_of, pod_name
from tensile_operator.queueing import Priorities, Priority, QueueConfig, Walk, missing_class_message
from tensile_operator.validation import unreachable_budget

log = logging.getLogger("tensile_operator")
PROFILE_POLL_SECONDS = 1.0  # how often the live workload of a running job admitted by its budget is asked for
# the ledger is checked against the statuses at most this often (and after a failed pass); the jobs still booked on a
# GPU that went, whose look failed, are looked at again this often (`_recheck_forever`)
RESYNC_SECONDS = 30.0
POD_CHECK_SECONDS = 5.0  # a deleted job's terminating pod is looked up again this often (its DELETED event may be missed)
# seconds between attempts at a pod creation or a job's end refused by the API server's trouble (5xx, 429): about a minute
RETRY_DELAYS: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)


def job_key(body: dict) -> str:
    """namespace/name: how the ledger, the queue and the statuses name a TrainingJob."""
    return f"{body['metadata']['namespace']}/{body['metadata']['name']}"


def condition(type_: str, ok: bool, reason: str, message: str = "") -> dict:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message, "lastTransitionTime": utc_timestamp()}


def merge_conditions(old: list[dict], *new: dict) -> list[dict]:
    kept = {c["type"]: c for c in old or []}
    for c in new:
        previous = kept.get(c["type"])
        if previous and previous.get("status") == c["status"] and previous.get("reason") == c["reason"]:
            c = dict(c, lastTransitionTime=previous.get("lastTransitionTime", c["lastTransitionTime"]))
        kept[c["type"]] = c
    return list(kept.values())


@dataclass
class Pending:
    key: str
    namespace: str
    name: str
    body: dict
    spec: model.JobSpec
    forecast: JobForecast | None
    said: dict | None = None  # the `status.queue` last written for the job (written again only when it changes)
    since: str = ""  # when the job first waited (`status.queue.since`, read back after a restart)
    head_since: str = ""  # when it became the head of the queue (`status.queue.headSince`, read back after a restart)

    def order(self, priority: Priority) -> tuple[int, str, str]:
        """The queue's order: by priority (highest first), then FIFO by the job's creation
        (`metadata.creationTimestamp`, whole seconds), ties by namespace/name. By the loop time its forecast and
        `Queued` write ended (as it was), jobs created in order were placed out of it, and a restarted operator's
        queue followed which forecast was cached."""
        return -priority.value, self.body["metadata"].get("creationTimestamp", ""), self.key


NODE_REMOVED, GPU_REMOVED = "TensileNodeRemoved", "GPURemoved"
# conditions about a job's placement and its pod: dropped when the job is placed again (its next pod is made anew)
PLACED_CONDITIONS = frozenset({"PodRunning", "NodeAvailable", "SpecApplied", "PlanEventsApplied", "KnobsApplied"})


@dataclass(frozen=True)
class Gone:
    """Why a job's booked GPU left the inventory: the condition reason (NODE_REMOVED, GPU_REMOVED) and what went."""

    reason: str
    what: str


class PodDeletion(Enum):
    """What `_delete_unstarted_pod` did: the job's pod deleted, no pod of the job found, or its pod has started (left
    alone: Tensile never stops training by its own decision)."""

    DELETED = "deleted"
    NO_POD = "no pod"
    STARTED = "started"


class Admission:
    def __init__(self, forecaster: Forecaster | None = None, planner: JointPlanner | None = None,
                 image: str | None = None, token_key: bytes | None = None, queueing: QueueConfig | None = None):
        self.queueing = queueing or QueueConfig.from_env()  # a bad setting stops the operator before it starts
        self.priorities = Priorities()
        self.kube = Kube()
        self.events = Recorder(lambda: self.kube)
        self.forecaster = forecaster or Forecaster()
        self.planner = planner or JointPlanner()
        self.agent = AgentLink()
        self.image = image or os.environ.get("TENSILE_IMAGE", DEFAULT_IMAGE)
        key = token_key or os.environ.get("TENSILE_TOKEN_KEY", "").encode()
        self.token_key = key or secrets.token_bytes(32)
        self.ledger = Ledger()
        self.inventory: dict[str, list[Gpu]] = {}
        self.unlisted: set[str] = set()  # TensileNodes whose GPUs are not published yet (they say nothing of them)
        self.pending: dict[str, Pending] = {}
        self.conditions: dict[str, list[dict]] = {}
        self.phases: dict[str, str] = {}  # key -> the phase last seen or written (metrics)
        self.metrics = OperatorMetrics(lambda: dict(self.phases))
        self.tokens: dict[str, str] = {}  # key -> the job's agent token
        self.admitted_at: dict[str, float] = {}  # key -> loop time the placement was written (benchmarks)
        self.wake = asyncio.Event()
        self.rebuilt_at = float("-inf")  # loop time of the last rebuild from the statuses
        self._released: set[str] = set()  # jobs released while a rebuild's LIST was in flight
        self._early: dict[str, dict] = {}  # key -> the newest TrainingJob seen before the start-up rebuild ended
        self.ready = asyncio.Event()  # set once the ledger was rebuilt and the scheduler runs
        self._scheduler: asyncio.Task | None = None
        self._hold_timer: asyncio.TimerHandle | None = None  # wakes the scheduler when a head's wait bound ends
        self._background: set[asyncio.Task] = set()  # pod creations, profile fetches
        # held while a placement is written: stopping waits for it, so no status write of this operator
        # lands after a successor has listed the statuses (its in-memory ledger would miss the booking)
        self._committing = asyncio.Lock()
        self._profiling: set[str] = set()  # jobs whose live workload is being fetched
        self._creating: dict[str, asyncio.Task] = {}  # key -> the task creating the job's pod
        self._knob_retries: dict[str, asyncio.Task] = {}  # key -> the task sending knobs until the hook registers
        self._freed: dict[str, asyncio.Event] = {}  # key -> set when a deleted job's booking is released
        self._ending: dict[str, asyncio.Event] = {}  # key -> set once the end `finish` is writing has been written
        self._checking: dict[str, asyncio.Task] = {}  # key -> the task looking at a job whose GPU went (`_booked_gpu_gone`)
        self._admitting: set[str] = set()  # jobs being validated and forecast (`admit`)
        # uid of an unstarted pod deleted to place its job again -> set at its DELETED event (which is not the job's end)
        self._deleting: dict[str, asyncio.Event] = {}
        self.uids: dict[str, str] = {}  # key -> uid of the TrainingJob of that name this operator admitted or read

    # ---- inventory ------------------------------------------------------------------------------
    @property
    def gpus(self) -> list[Gpu]:
        return [g for gpus in self.inventory.values() for g in gpus]

    def gpu_of(self, booking: Booking) -> Gpu | None:
        """The booked GPU as its node's TensileNode now lists it (None: the node or its agent is gone)."""
        return next((g for g in self.gpus if g.uuid == booking.gpu), None)

    def agent_of(self, booking: Booking) -> str | None:
        """The agent of the booked GPU, else of its node (a GPU its TensileNode stopped listing: the node's agent still
        runs and holds the job's registration and live workload); None when the node's TensileNode is gone."""
        gpu = self.gpu_of(booking)
        if gpu is not None:
            return gpu.agent
        return next((g.agent for g in self.inventory.get(booking.node, []) if g.agent), None)

    def set_node(self, body: dict | None, name: str) -> None:
        if body is None:
            self.inventory.pop(name, None)
            self.unlisted.discard(name)
        else:
            self.inventory[name] = gpus_from_tensilenode(body)
            if "gpus" in (body.get("status") or {}):
                self.unlisted.discard(name)
            else:  # created, its status not written yet (its agent writes it next)
                self.unlisted.add(name)
        self.wake.set()

    async def node_changed(self, body: dict | None, name: str) -> None:
        """A TensileNode published, updated or removed (`body` None): the jobs booked there are checked against what
        it lists now (`_check_node`)."""
        self.set_node(body, name)
        await self.ready.wait()
        await self._check_node(name)

    async def load_priority_classes(self) -> None:
        """Every PriorityClass, listed once at start-up so the first pass orders by them (a job naming a class the
        watch had not delivered yet would be said to name none); Kopf's watch keeps them after (`priority_class_changed`)."""
        for body in await self.kube.list_priorityclasses():
            self.priorities.changed(body["metadata"]["name"], body)

    def priority_class_changed(self, body: dict | None, name: str) -> None:
        """A PriorityClass created, changed or deleted (`body` None): the queue is ordered again by it, and a job that
        waits for a class that now exists is placed."""
        self.priorities.changed(name, body)
        self.wake.set()

    def _gone(self, booking: Booking) -> Gone | None:
        """Why a job's booked GPU left the inventory; None while it is listed, or while its TensileNode has not
        published its GPUs yet (created again, it says nothing of them until its agent writes its status)."""
        if booking.node not in self.inventory:
            return Gone(NODE_REMOVED, f"TensileNode {booking.node} was removed (its node drained or deleted, or its "
                                      "agent uninstalled)")
        if booking.node in self.unlisted or any(g.uuid == booking.gpu for g in self.inventory[booking.node]):
            return None
        return Gone(GPU_REMOVED, f"GPU {booking.gpu} is no longer listed by TensileNode {booking.node} (it failed, or "
                                 "was reconfigured, e.g. its MIG layout)")

    async def _check_node(self, node: str) -> None:
        """The jobs booked on `node` against what its TensileNode lists now. A job whose GPU went is looked at on a
        task of its own (`_booked_gpu_gone`: placed again if its pod has not started, said if it has), once per
        removal; one said to have lost its node or GPU hears of its return once it is listed again. Before, a
        removed TensileNode was only said, and a GPU its TensileNode stopped listing not even that."""
        if node in self.unlisted:  # created again, its GPUs not published yet: it says nothing of them
            return
        back: list[Booking] = []
        for booking in list(self.ledger.bookings.values()):
            if booking.node != node:
                continue
            gone, said = self._gone(booking), self._node_said(booking.job)
            if gone is None:
                if said is not None:
                    back.append(booking)
            elif booking.job not in self._checking and booking.job not in self._freed \
                    and (said is None or said["reason"] != gone.reason):  # a job being deleted: `deleted` has it
                self._checking[booking.job] = self._spawn(self._booked_gpu_gone(booking, gone))
        await asyncio.gather(*(self._say_node(b, None) for b in back))

    def _node_said(self, key: str) -> dict | None:
        """The job's `NodeAvailable=False` (its node or GPU said gone), if it has one."""
        return next((c for c in self.conditions.get(key, []) if c["type"] == "NodeAvailable" and c["status"] == "False"), None)

    async def _say_node(self, booking: Booking, gone: Gone | None) -> None:
        """`NodeAvailable` on a job whose pod has started on a GPU that went (`gone`), or that is back (None)."""
        namespace, name = booking.job.split("/", 1)
        try:
            await self.set_status(namespace, name, {}, _node_condition(booking, gone, self._node_said(booking.job)))
        except Exception as exc:  # noqa: BLE001 - one job's write must not keep the others' (or the inventory) back
            log.warning("%s: NodeAvailable not written: %s", booking.job, exc)

    async def _booked_gpu_gone(self, booking: Booking, gone: Gone) -> None:
        """A job whose booked GPU went. Its pod started (running, or a container started), it is said and left alone:
        Tensile never stops training by its own decision, and the pod keeps its GPU's memory. Not started (no pod
        yet, or one Pending with no container started), it is placed again (`_requeue`): pinned by `nodeName` to a
        node whose TensileNode or GPU is gone, its pod would never run, and the job waited on it for good while
        other GPUs had room."""
        key = booking.job
        try:
            async with self._committing:  # a placement being written lands first; its pod creation is then under way
                pass
            creating = self._creating.get(key)
            if creating is not None:  # the pod being created lands before the job is looked at
                await asyncio.wait({creating})
            if not self._booked_on(key, booking.gpu):  # ended, deleted or placed again meanwhile
                return
            if self.phases.get(key) == "Running" or not await self._requeue(booking, gone):
                await self._say_node(booking, gone)
        except Exception:  # noqa: BLE001 - one job's trouble must not stop the others' (`_recheck_forever` retries it)
            log.exception("%s: its GPU went, and it was not placed again (looked at again in %g s)", key, RESYNC_SECONDS)
        finally:
            self._checking.pop(key, None)

    def _booked_on(self, key: str, gpu: str) -> bool:
        """Booked on `gpu` and not being deleted (`deleted` frees its room). By value: a rebuild replaces the ledger's
        bookings with equal ones."""
        booking = self.ledger.bookings.get(key)
        return booking is not None and booking.gpu == gpu and key not in self._freed

    async def _requeue(self, booking: Booking, gone: Gone) -> bool:
        """The job's unstarted pod deleted, its booking released (after the status says it is queued again, so a
        rebuild does not book it from its placement), and the job admitted again: queued in its place (by priority
        and creation) and placed where it fits, by its spec and annotations as they are now (its pod is made anew).
        False when its pod has started (it is left alone); True when it is queued again, or ended or deleted meanwhile."""
        key = booking.job
        namespace, name = key.split("/", 1)
        try:
            body = await retried(lambda: self.kube.get_job(namespace, name), RETRY_DELAYS)
        except NotFound:
            return True  # gone: `deleted` freed its room
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            return True  # `deleted` frees its room
        self.remember_conditions(body)
        deletion = await self._delete_unstarted_pod(namespace, pod_name(namespace, name, meta.get("uid", "")),
                                                    (name, meta.get("uid", "")))
        if deletion is PodDeletion.STARTED:
            return False
        if not self._booked_on(key, booking.gpu):
            return True  # ended, or being deleted: `finish` or `deleted` has its room
        self.conditions[key] = [c for c in self.conditions.get(key, []) if c["type"] not in PLACED_CONDITIONS]
        pod = f", its pod {pod_name(namespace, name, meta.get('uid', ''))} deleted" if deletion is PodDeletion.DELETED else ""
        said = (f"{gone.what} before the job's pod started: its booking on {booking.node} GPU {booking.gpu} was "
                f"released{pod}, and it is queued again, in its place (by priority and creation), to be placed where it fits")
        await self.set_status(namespace, name, {
            "phase": "Queued", "message": said, "placement": None,
            "forecast": dict.fromkeys(("scheduledPeakBytes", "reservedBytes", "plannedWith"))},
            condition("Admitted", False, gone.reason, said), delays=RETRY_DELAYS)
        if not self._booked_on(key, booking.gpu):  # checked again with no await before the release: the write may
            return True  # have taken a minute of retries, in which the job was deleted (`deleted` waits for this task)
        released = self.release(key)
        retry = self._knob_retries.pop(key, None)
        if retry is not None:  # its next pod starts with the knobs in its environment
            retry.cancel()
        await self.after_release(key, released)
        status = {k: v for k, v in (body.get("status") or {}).items() if k != "placement"}
        await self.admit(body | {"status": status | {"phase": "Queued"}})
        return True

    async def _delete_unstarted_pod(self, namespace: str, pod: str, owner: tuple[str, str]) -> PodDeletion:
        """Deletes the job's pod unless it has started, and waits until it is gone (the job's next pod takes its
        name). Deleted at once (no grace period: none of its containers runs, and a kubelet of a node that is gone
        never confirms a graceful deletion) and only as it was read (preconditions: uid and resourceVersion), so a
        pod that changed meanwhile (it may have started) is read again. A pod of that name with another owner is never
        touched (NO_POD). Each call is retried through the API server's trouble; what still fails is raised."""
        def find() -> Coroutine[Any, Any, dict | None]:
            return self.kube.find_pod(namespace, pod)

        for _ in range(5):
            found = await retried(find, RETRY_DELAYS)
            if found is None or owner_of(found) != owner:
                return PodDeletion.NO_POD
            if _started(found):
                return PodDeletion.STARTED
            uid = found["metadata"].get("uid", "")
            options = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid, "resourceVersion": found["metadata"].get("resourceVersion")}}
            # by uid: its DELETED event may come after the job's next pod (of the same name) exists
            gone = self._deleting.setdefault(uid, asyncio.Event())
            try:
                await retried(lambda: self.kube.delete_pod(namespace, pod, options), RETRY_DELAYS)
            except BaseException as exc:
                # not deleted: a DELETED event of that pod (another deletion, the garbage collector) is the job's end
                self._deleting.pop(uid, None)
                if isinstance(exc, Conflict):
                    continue
                raise
            # deleted: its marker stays until its DELETED event (which may come after the pod is found gone here)
            while not gone.is_set() and (found := await retried(find, RETRY_DELAYS)) is not None \
                    and found["metadata"].get("uid") == uid:
                with contextlib.suppress(TimeoutError):  # looked up again meanwhile, in case its event is missed
                    await asyncio.wait_for(gone.wait(), POD_CHECK_SECONDS)
            return PodDeletion.DELETED
        return PodDeletion.STARTED  # changed at every read: left alone, as a started pod is

    def _nodes_with_gone(self) -> set[str]:
        """The nodes where a job is booked on a GPU that went."""
        return {b.node for b in list(self.ledger.bookings.values()) if self._gone(b) is not None}

    async def _check_nodes_at_start(self, listed: list[dict]) -> None:
        """At start-up: jobs whose booked GPU went while no operator ran (their conditions read first: what they say
        is kept, and a removal said already is not said again)."""
        nodes = self._nodes_with_gone()
        for body in listed:
            booking = self.ledger.bookings.get(job_key(body))
            if booking is not None and booking.node in nodes:
                self.remember_conditions(body)
        for node in nodes:
            await self._check_node(node)

    async def _recheck_forever(self) -> None:
        """Every RESYNC_SECONDS, the jobs still booked on a GPU that went, neither placed again nor said (their look
        failed: the API server's trouble), are looked at again: a removed TensileNode sends no further event, so a
        failed look left the job booked for good on a GPU that is gone."""
        while True:
            await asyncio.sleep(RESYNC_SECONDS)
            try:
                for node in self._nodes_with_gone():
                    await self._check_node(node)
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("looking again at the jobs whose GPU went failed")

    # ---- status ---------------------------------------------------------------------------------
    async def set_status(self, namespace: str, name: str, status: dict, *conds: dict, delays: Sequence[float] = ()) -> None:
        """`delays`: the write is made again after each while the API server's trouble refuses it."""
        key = f"{namespace}/{name}"
        if conds:
            status = dict(status, conditions=self.merge(key, conds, failing=status.get("phase") == "Failed"))
        if status.get("phase"):
            self.phases[key] = status["phase"]
        try:
            await retried(lambda: self.kube.patch_job_status(namespace, name, status), delays)
        except NotFound:
            log.info("%s is gone; status not written", key)

    def merge(self, key: str, conds: Sequence[dict], failing: bool = False) -> list[dict]:
        """The job's conditions with `conds` merged in; an Event is posted for each that is a transition (what the
        conditions said before, read back from the status by a restarted operator, is not said again)."""
        before = self.conditions.get(key, [])
        self.conditions[key] = merge_conditions(before, *conds)
        namespace, name = key.split("/", 1)
        for said in transitions(before, conds, failing):
            self.events.post(namespace, name, self.uids.get(key, ""), said)
        return self.conditions[key]

    def remember_conditions(self, body: dict) -> None:
        key = job_key(body)
        self.uids[key] = body["metadata"].get("uid", "")
        if key not in self.conditions:
            self.conditions[key] = list((body.get("status") or {}).get("conditions") or [])
        self.phases.setdefault(key, (body.get("status") or {}).get("phase") or "Pending")

    # ---- admit: validate + forecast + enqueue ---------------------------------------------------
    async def admit(self, body: dict) -> None:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        key = f"{namespace}/{name}"
        status = body.get("status") or {}
        self.remember_conditions(body)
        if status.get("phase") in model.FINISHED or meta.get("deletionTimestamp"):
            return
        await self.ready.wait()
        if status.get("placement"):
            # a pod is made on resume only for a job that never had one: a job whose pod ran and is gone now
            # (ended and cleaned up, or deleted, while no operator ran) is ended by the rebuild, not run again
            # (a job whose GPU went is placed again instead: `_check_nodes_at_start`)
            # (tracked as a placement's creation is: a look at the job, its GPU gone or it deleted, waits for it)
            booking = self.ledger.bookings.get(key)
            if booking is not None and not had_pod(status) and self._gone(booking) is None and key not in self._creating:
                self._creating[key] = self._spawn(self._start_pod(body, booking, register=False))
            return
        # admitted already, or being admitted: Kopf resumes a job from the body it saw at start-up, which may be one
        # that `_requeue` wrote and is admitting (a second admission's "queued" write landed after its placement)
        if key in self._admitting or key in self.pending or key in self.ledger.bookings:
            return
        self._admitting.add(key)
        try:
            await self._admit(body)
        finally:
            self._admitting.discard(key)

    async def _admit(self, body: dict) -> None:
        """Validate, forecast and enqueue a job that is not placed."""
        meta = body["metadata"]
        namespace, name, key = meta["namespace"], meta["name"], job_key(body)
        status = body.get("status") or {}
        noted = self.annotation_conditions(key, meta.get("annotations"))
        try:
            spec = model.parse_spec(body.get("spec") or {}, meta.get("annotations"))
        except model.SpecError as exc:
            self.metrics.admissions.labels("invalid").inc()
            await self.set_status(namespace, name, {"phase": "Failed", "message": str(exc)},
                                  condition("Validated", False, "InvalidSpec", str(exc)), *noted)
            return
        valid = [condition("Validated", True, "Valid"), *noted]
        if self.forecaster.ready(spec.workload, spec.scope):  # cached: straight to Queued, one status write less
            self.merge(key, valid)
        elif status.get("phase") != "Forecasting":
            await self.set_status(namespace, name, {"phase": "Forecasting", "message": "tracing and planning on the CPU"}, *valid)
        forecast: JobForecast | None = None
        failure: ForecastError | None = None
        started = time.perf_counter()
        try:
            forecast = await self.forecaster.forecast(spec.workload, spec.scope)
        except ForecastError as exc:
            failure = exc
        self.metrics.forecast_seconds.observe(time.perf_counter() - started)
        if failure is not None:
            if spec.memory_budget is None:
                self.metrics.admissions.labels("forecast_failed").inc()
                await self.set_status(namespace, name, {"phase": "Failed", "message": f"forecast failed: {failure}"},
                                      condition("Forecasted", False, "ForecastFailed",
                                                f"{failure}; fix spec.workload, or set spec.memoryBudget to admit the job by it"))
                return
            self.merge(key, [condition("Forecasted", False, "ForecastFailed", f"{failure}; admitted by spec.memoryBudget")])
        if forecast is None and spec.memory_budget is None:
            self.metrics.admissions.labels("no_budget").inc()
            await self.set_status(namespace, name, {"phase": "Failed", "message": "no forecastable workload and no budget"},
                                  condition("Forecasted", False, "NoProfile",
                                            f"profile '{spec.workload.profile}' is not stored yet: set spec.memoryBudget to admit the job by it"))
            return
        unreachable = unreachable_budget(spec, forecast)
        if unreachable is not None:
            await self._fail_unreachable(namespace, name, unreachable)
            return
        if forecast is not None:
            conds = [condition("Forecasted", True, "Forecasted", f"forecast from its {forecast.source} workload: peak "
                                                                   f"{memory_text(forecast.vanilla_peak_bytes)} without Tensile, "
                                                                   f"{memory_text(forecast.min_peak_bytes)} at the lowest a Tensile plan reaches")]
            fstatus = forecast.to_status()
        else:
            conds = [] if any(c["type"] == "Forecasted" for c in self.conditions.get(key, [])) else [
                condition("Forecasted", False, "NoProfile", f"profile '{spec.workload.profile}' not stored yet: admitted by spec.memoryBudget; "
                                                            "its first run's live workload becomes the profile")]
            fstatus = {"source": "budget"}
        await self.set_status(namespace, name, {"phase": "Queued", "message": "waiting for placement", "forecast": fstatus}, *conds)
        if key in self._freed:  # deleted while it was admitted (a re-placement's admission): `deleted` has it
            return
        queue = status.get("queue") or {}
        self.pending[key] = Pending(key, namespace, name, body, spec, forecast, since=queue.get("since") or "",
                                    head_since=queue.get("headSince") or "")
        self.wake.set()

    async def _fail_unreachable(self, namespace: str, name: str, problem: model.SpecProblem, *conds: dict) -> None:
        """A budget below the lowest peak any plan reaches for the job's workload: its hook could never keep to it,
        so the job fails (at admission, or when a queued job's budget annotation is lowered to it) naming where the
        budget was set."""
        self.metrics.admissions.labels("budget_unreachable").inc()
        await self.set_status(namespace, name, {"phase": "Failed", "message": str(problem)},
                              condition("Forecasted", True, "BudgetUnreachable", str(problem)), *conds)

    def annotation_conditions(self, key: str, annotations: dict | None) -> list[dict]:
        """`UnknownAnnotations` True while the job has tensile.dev/* annotations that are no knob (a misspelt name is
        ignored, not failed: Kubernetes takes any annotation), False once they are gone; none for a job that never
        had one."""
        unknown = model.unknown_annotations(annotations)
        if unknown:
            return [condition("UnknownAnnotations", True, "Ignored", model.unknown_annotations_message(unknown))]
        if any(c["type"] == "UnknownAnnotations" and c["status"] == "True" for c in self.conditions.get(key, [])):
            return [condition("UnknownAnnotations", False, "AllKnown", "every tensile.dev/* annotation is one Tensile reads")]
        return []

    async def annotations_changed(self, body: dict) -> None:
        """Only tensile.dev/* annotations that are no knob changed: the job's `UnknownAnnotations` condition says so."""
        meta = body["metadata"]
        noted = self.annotation_conditions(job_key(body), meta.get("annotations"))
        if noted:
            await self.set_status(meta["namespace"], meta["name"], {}, *noted)

    # ---- scheduler ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Rebuild from the cluster, then run the scheduler (Kopf startup)."""
        for node in await self.kube.list_tensilenodes():
            self.set_node(node, node["metadata"]["name"])
        listed = await self.rebuild()
        self.ready.set()
        await self._check_nodes_at_start(listed)
        self._spawn(self._recheck_forever())
        finished = {job_key(b) for b in listed if (b.get("status") or {}).get("phase") in model.FINISHED}
        for key, body in self._early.items():  # seen while the LIST was in flight: it may predate their placement
            if key not in finished:
                self.adopt(body)
        self._early.clear()
        freeze_long_lived()
        self._scheduler = asyncio.get_running_loop().create_task(self._schedule_forever())

    async def stop(self) -> None:
        await self._committing.acquire()
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        tasks = [t for t in [self._scheduler, *self._background] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.events.close()
        await self.kube.close()

    async def rebuild(self) -> list[dict]:
        """The ledger from the statuses: every job that holds a placement and has not finished (a job
        released while the LIST was in flight stays released: its final status may not be in it).
        A deleted job (kept by its finalizer until its pod is gone) is booked while its pod is still
        there and not terminated: the pod holds the GPU through its grace period. A job whose pod ran and has
        ended, or is gone, while its status still shows it placed (its end was not seen: the operator was down,
        or the write of its end failed) is booked until its end is written now, not booked for good by a stale
        status. Returns the TrainingJobs listed."""
        ledger = Ledger()
        self._released.clear()
        items = await self.kube.list_trainingjobs()
        bookings = [(b, body) for body in items if (b := self._booking_of(body)) is not None]
        gone: set[str] = set()
        ends: list[tuple[dict, tuple[str, str, str]]] = []  # (job, its end: phase, reason, message) to write
        if any(body["metadata"].get("deletionTimestamp") or had_pod(body["status"]) for _, body in bookings):
            pods = {(p["metadata"]["namespace"], *owner): p for p in await self.kube.list_pods(JOB_LABEL)
                    if (owner := owner_of(p)) is not None}
            for booking, body in bookings:
                meta = body["metadata"]
                pod = pods.get((meta["namespace"], meta["name"], meta.get("uid", "")))
                ended = pod is None or pod_holder(pod) == ""
                if meta.get("deletionTimestamp") and ended:
                    gone.add(booking.job)
                elif ended and had_pod(body["status"]) and booking.job not in self._ending:
                    ends.append((body, _pod_end(pod) if pod is not None else ("Failed", "PodDeleted", (
                        f"pod {pod_name(meta['namespace'], meta['name'], meta.get('uid', ''))} disappeared "
                        f"{'and its end was not seen' if self.ready.is_set() else 'while the operator was down'}: "
                        "whether its training finished is unknown; create the TrainingJob again to run it"))))
        for booking, _ in bookings:
            if booking.job not in self._released and booking.job not in gone:
                ledger.book(booking)
        self.ledger = ledger
        for body, end in ends:  # booked until the end is written, as every end
            if job_key(body) in ledger.bookings:
                self.remember_conditions(body)  # the end keeps them, and its Event names the job's uid
                self.token(body)  # its agent is told at the release (a restarted operator has no token yet)
                self._spawn(self.finish(body["metadata"]["namespace"], body["metadata"]["name"], *end))
        for booking, body in bookings:
            if booking.job in gone:  # released: a later event showing its placement must not book it again
                self.release(booking.job)
                self.token(body)  # its agent is told, as after every release (a restarted operator has no token yet)
                self._spawn(self.after_release(booking.job, booking))
        self.rebuilt_at = asyncio.get_running_loop().time()
        return items

    def _booking_of(self, body: dict) -> Booking | None:
        """The placement a TrainingJob's status holds, as a booking (None when unplaced or finished)."""
        status = body.get("status") or {}
        placement = status.get("placement")
        if not placement or status.get("phase") in model.FINISHED:
            return None
        fstatus = status.get("forecast") or {}
        forecast = self.forecaster.by_signature(fstatus.get("signature", ""), model.PlanScope.from_status(fstatus))
        spec = body.get("spec") or {}
        try:  # the knobs as admission and knob changes read them: the spec with its annotations applied
            parsed = model.parse_spec(spec, (body.get("metadata") or {}).get("annotations"))
            budget, rate, recompute = parsed.memory_budget, parsed.max_swap_rate, parsed.recompute
        except model.SpecError:  # edited since into something invalid: the knobs last forwarded, if any
            applied = status.get("knobs") or {}
            budget, rate, recompute = applied.get("memoryBudgetBytes"), applied.get("maxSwapRate"), applied.get("recompute", True)
        profile = (spec.get("workload") or {}).get("profile") if forecast is None else None
        return Booking(job_key(body), placement["gpu"], placement["node"],
                       int(fstatus.get("reservedBytes") or 0), forecast, budget, rate, profile,
                       placement.get("planEvents", "auto"), recompute)

    def adopt(self, body: dict) -> None:
        """A placement seen in a status but missing from the ledger (a predecessor's write that landed after
        this operator listed the statuses) is booked at once, before the next pass can give its room away."""
        if not self.ready.is_set():  # kept until the start-up rebuild's ledger exists
            self._early[job_key(body)] = body
            return
        booking = self._booking_of(body)
        if booking is None or booking.job in self.ledger.bookings or booking.job in self._released:
            return
        log.warning("%s: placed on %s by an earlier operator after the statuses were read; booked now", booking.job, booking.gpu)
        self.ledger.book(booking)

    def release(self, key: str) -> Booking | None:
        self._released.add(key)
        freed = self._freed.get(key)
        if freed is not None:
            freed.set()
        return self.ledger.release(key)

    async def _schedule_forever(self) -> None:
        """Passes over the pending jobs. The ledger is kept in memory between passes (only this task books,
        releases are immediate) and checked against the statuses every RESYNC_SECONDS: a LIST of every
        TrainingJob before each pass cost O(all jobs) per admission."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            if not self.pending:
                continue
            try:
                if asyncio.get_running_loop().time() - self.rebuilt_at > RESYNC_SECONDS:
                    await self.rebuild()
                await self._pass()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the scheduler must survive a failed pass
                log.exception("scheduling pass failed; rebuilding from the statuses and retrying")
                self.rebuilt_at = float("-inf")
                await asyncio.sleep(1.0)
                self.wake.set()

    async def _pass(self) -> None:
        """One pass in the queue's order (priority, then creation). A job whose PriorityClass does not exist is not
        ordered, nor placed: Kubernetes would refuse its pod, and the class may be created later."""
        walk = Walk(self.queueing, time.time())
        ranked: list[tuple[Priority, Pending]] = []
        for pending in list(self.pending.values()):
            priority = self.priorities.of(pending.body.get("spec") or {})
            if priority.known:
                ranked.append((priority, pending))
            else:
                await self._wait_for_class(pending, priority.class_name)
        for priority, pending in sorted(ranked, key=lambda r: r[1].order(r[0])):
            if self._class_was_missing(pending.key):
                await self.set_status(pending.namespace, pending.name, {}, condition(
                    "PriorityResolved", True, "PriorityClassFound",
                    f"PriorityClass {priority.class_name} exists now: queued with priority {priority.value}"))
            await self.place(pending, walk, priority)
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if walk.next_hold is not None:  # a head's wait bound ends then: it is said, and held for, without other news
            self._hold_timer = asyncio.get_running_loop().call_later(max(0.0, walk.next_hold - time.time()), self.wake.set)

    def _class_was_missing(self, key: str) -> bool:
        return any(c["type"] == "PriorityResolved" and c["status"] == "False" for c in self.conditions.get(key, []))

    async def _wait_for_class(self, pending: Pending, name: str) -> None:
        """A priorityClassName no PriorityClass has: said on the job (condition and Warning Event) with the fix, rather
        than as a refused pod at creation; it waits queued and unplaced until the class exists (as a Kubernetes
        controller's pod creation is retried), since it cannot be ordered without its priority."""
        message = missing_class_message(name)
        pending.since = pending.since or utc_timestamp()
        queue = _queue_status(reason=message, shortfallBytes=0, since=pending.since, priorityClassName=name)
        if queue != pending.said:
            self._said_queued(pending, queue)
            await self.set_status(pending.namespace, pending.name, {"phase": "Queued", "message": message, "queue": queue},
                                  condition("PriorityResolved", False, "PriorityClassNotFound", message))

    def _said_queued(self, pending: Pending, queue: dict) -> None:
        if pending.said is None:
            self.metrics.admissions.labels("queued").inc()
        pending.said = queue

    async def place(self, pending: Pending, walk: Walk | None = None, priority: Priority | None = None) -> None:
        """Places the job on a GPU not held for an earlier job of the pass (`walk`), or says how it waits."""
        if pending.key in self.ledger.bookings:  # placed by an earlier pass (or operator)
            self.pending.pop(pending.key, None)
            return
        walk = walk or Walk(self.queueing, time.time())
        spec = pending.spec
        candidate = Candidate(pending.key, pending.forecast, spec.memory_budget, spec.selector, spec.max_swap_rate)
        usable = matching(self.gpus, candidate)
        free = walk.free([g.uuid for g in usable])
        gpus = [g for g in usable if g.uuid in free]
        decision = fit_unchanged(gpus, self.ledger, candidate)
        if decision is None and gpus:  # the joint planner may run: off the event loop, on a snapshot of the ledger
            snapshot = Ledger()
            snapshot.bookings = dict(self.ledger.bookings)
            decision = await asyncio.to_thread(choose, gpus, snapshot, candidate, self.planner)
        if decision is not None and decision.gpu is not None:
            async with self._committing:
                await self.commit(pending, decision.gpu, decision.peaks)
            return
        held = [g.uuid for g in usable if g.uuid not in free]
        if not self.gpus:
            decision = Decision(None, reason="no TensileNode publishes a GPU yet")
        elif not usable:
            decision = Decision(None, reason="no GPU matches spec.gpuSelector")
        elif decision is None or (decision.too_large and too_large(usable, candidate) is None):
            decision = Decision(None)  # only GPUs held for earlier jobs could hold it: the reason is that hold
        wait = walk.waiting(pending.key, [g.uuid for g in usable if too_large([g], candidate) is None], pending.head_since)
        await self._say_waiting(pending, priority or Priority(), decision, wait.head_since, wait.holds,
                                walk.holders(held), held)

    async def _say_waiting(self, pending: Pending, priority: Priority, decision: Decision, head_since: str,
                           holds: tuple[str, ...], behind: list[str], held: list[str]) -> None:
        """`status.queue` and the `Admitted` condition of a job that waits: its shortfall, its priority, since when it is
        the head of the queue, the GPUs held for it, and the earlier jobs it waits behind. Written when it changes."""
        pending.head_since = head_since
        reason = decision.reason
        if behind:
            reason = (f"waits behind {', '.join(behind)}: holding GPU room on {', '.join(held)} for "
                      f"{'them' if len(behind) > 1 else 'it'} ({self.queueing.rule()})") + (f"; {reason}" if reason else "")
        elif holds:
            reason = (f"holding GPU room on {', '.join(holds)} for {pending.key} ({self.queueing.rule()}): later jobs are "
                      f"not placed there until it is; {reason}")
        # when it first waited: a new shortfall (the reason names it) or a restart reset it before
        pending.since = pending.since or utc_timestamp()
        queue = _queue_status(reason=reason, shortfallBytes=decision.shortfall_bytes, since=pending.since,
                              priority=priority.value, priorityClassName=priority.class_name or None,
                              headSince=head_since or None, holding=list(holds) or None, waitingBehind=behind or None)
        if queue == pending.said:
            return
        self._said_queued(pending, queue)
        if decision.too_large:  # kept queued, as Kubernetes keeps an unschedulable pod Pending: a larger GPU may join
            fix = "reduce spec.workload.batchSize" if pending.forecast is not None else f"lower {pending.spec.budget_field}"
            admitted = condition("Admitted", False, "NoGpuLargeEnough", f"{reason} (a TensileNode with more memory), or {fix}")
        else:
            why = "WaitingBehind" if behind else "HoldingRoom" if holds else "Queued"
            admitted = condition("Admitted", False, why, f"{reason}; retried when capacity frees")
        await self.set_status(pending.namespace, pending.name, {"phase": "Queued", "message": reason, "queue": queue},
                              admitted)

    async def commit(self, pending: Pending, gpu: Gpu, peaks: dict[str, int]) -> None:
        """Books the placement `place` decided, unless the job left the queue meanwhile (deleted while the joint
        planner ran on its thread, or while a write awaited): booked anyway, it got a pod and kept its GPU."""
        key = pending.key
        if self.pending.get(key) is not pending:
            return
        reserved = peaks[key]
        changes = {j: p for j, p in peaks.items() if j != key and j in self.ledger.bookings and self.ledger.bookings[j].reserved_bytes != p}
        lower = {j: p for j, p in changes.items() if p < self.ledger.bookings[j].reserved_bytes}
        await self._repeak(lower)
        if self.pending.get(key) is not pending:  # lowered peaks stay valid: the channels only got freer
            return
        if all(g.uuid != gpu.uuid for g in self.gpus):  # it went while the job was planned: placed in the next pass
            self.wake.set()
            return
        profile = pending.spec.workload.profile if pending.forecast is None else None
        booking = Booking(key, gpu.uuid, gpu.node, reserved, pending.forecast, pending.spec.memory_budget, pending.spec.max_swap_rate,
                          profile, pending.spec.plan_events, pending.spec.recompute)
        self.ledger.book(booking)
        fstatus = (pending.forecast.to_status() if pending.forecast else {"source": "budget"}) | {
            "scheduledPeakBytes": reserved, "reservedBytes": reserved, "plannedWith": sum(1 for j in peaks if j != key)}
        placement = {"node": gpu.node, "gpu": gpu.uuid, "gpuName": gpu.name, "simulated": gpu.simulated,
                     "agent": gpu.agent or "", "planEvents": pending.spec.plan_events, "admittedAt": utc_timestamp()}
        await self.set_status(pending.namespace, pending.name, {
            "phase": "Admitted", "message": f"placed on {gpu.node} GPU {gpu.uuid}", "placement": placement,
            "forecast": fstatus, "queue": None}, condition("Admitted", True, "Placed", f"placed on {gpu.node} GPU {gpu.uuid} "
                                                                                       f"with {memory_text(reserved)} reserved"))
        self.admitted_at[key] = asyncio.get_running_loop().time()
        self.metrics.admissions.labels("admitted").inc()
        self.pending.pop(key, None)
        await self._repeak({j: p for j, p in changes.items() if j not in lower})
        # the placement is durable now; the scheduler goes on to the next job while the pod is created
        self._creating[key] = self._spawn(self._start_pod(pending.body, booking))

    def _knobs_retry(self, namespace: str, name: str, agent: str | None, token: str, knobs: dict) -> None:
        """Knobs the agent could not take because the job's hook has not registered yet (404): until the
        nineteenth session they were marked as sent to no reachable agent and never sent again, so the hook
        registered with the knobs of its pod's environment. One retry task per job; a newer change replaces it."""
        key = f"{namespace}/{name}"
        previous = self._knob_retries.pop(key, None)
        if previous is not None:
            previous.cancel()
        self._knob_retries[key] = self._spawn(self._send_knobs_again(namespace, name, agent, token, knobs))

    async def _send_knobs_again(self, namespace: str, name: str, agent: str | None, token: str, knobs: dict) -> None:
        key = f"{namespace}/{name}"
        try:
            for delay in KNOBS_RETRY_DELAYS:
                await asyncio.sleep(delay)
                if key not in self.ledger.bookings:
                    return  # ended or deleted
                outcome = await self.agent.update_knobs(agent, key, token, knobs)
                if outcome != UNREGISTERED:
                    await self.set_status(namespace, name, {}, _knobs_condition(outcome))
                    return
        finally:
            if self._knob_retries.get(key) is asyncio.current_task():
                del self._knob_retries[key]

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _start_pod(self, body: dict, booking: Booking, register: bool = True) -> None:
        """`register`: the forecast to the agent first (a new placement; not on resume, see `_register_forecast`)."""
        try:
            if booking.job in self.ledger.bookings:  # not released by a deletion seen while the placement was written
                if register:
                    await self._register_forecast(body, booking)
                await self.ensure_pod(body, booking)
        except Exception:  # noqa: BLE001 - the job stays placed; a restarted operator creates its pod (resume)
            log.exception("%s: creating its pod failed", booking.job)
        finally:
            self._creating.pop(booking.job, None)

    async def _repeak(self, peaks: dict[str, int]) -> None:
        """Co-located jobs' scheduled peaks after planning them together with a newcomer."""
        async def one(job: str, peak: int) -> None:
            booking = self.ledger.bookings.get(job)
            if booking is None:
                return
            booking.reserved_bytes = peak
            namespace, name = job.split("/", 1)
            await self.set_status(namespace, name, {"forecast": {"scheduledPeakBytes": peak, "reservedBytes": peak}})
        await asyncio.gather(*(one(j, p) for j, p in peaks.items()))

    # ---- pods -----------------------------------------------------------------------------------
    def token(self, body: dict) -> str:
        meta = body["metadata"]
        token = job_token(self.token_key, meta["namespace"], meta["name"], meta.get("uid", ""))
        self.tokens[job_key(body)] = token
        return token

    async def _register_forecast(self, body: dict, booking: Booking) -> None:
        """A new placement's forecast to its node agent before the pod exists (TENSILE's cold start: planned before
        the first iteration, with the GPU's other jobs). The pod's hook finds it by TENSILE_SIGNATURE; where the
        agent cannot take it (or the job was admitted by its budget: no forecast), the hook registers the live
        workload after its first iteration instead. Not on resume: a running hook may have replaced it."""
        gpu = self.gpu_of(booking)
        if booking.forecast is None or gpu is None or not gpu.agent:
            return
        if await self.agent.register(gpu.agent, booking.job, self.token(body), booking.gpu, booking.forecast,
                                     _pod_budget(booking), booking.max_swap_rate, booking.recompute, booking.plan_events):
            log.info("%s: registered with the agent of %s with its forecast", booking.job, gpu.node)

    async def ensure_pod(self, body: dict, booking: Booking) -> None:
        meta = body["metadata"]
        gpu = self.gpu_of(booking)
        signature = booking.forecast.signature if booking.forecast else None
        budget = _pod_budget(booking)
        pod = build_pod(body, booking.node, booking.gpu, gpu.agent if gpu else None, self.token(body), budget,
                        booking.max_swap_rate, signature, self.image, booking.plan_events, booking.recompute)
        namespace, name = meta["namespace"], pod["metadata"]["name"]

        async def retrying(exc: Exception, delay: float) -> None:
            message = f"creating pod {name} failed ({exc}): tried again in {delay:g} s"
            log.warning("%s: %s", booking.job, message)
            with contextlib.suppress(KubeError):  # the same trouble may refuse this write too: the log says it
                await self.set_status(namespace, meta["name"], {"message": message},
                                      condition("PodRunning", False, "PodCreateFailed", message))

        owner = (meta["name"], meta.get("uid", ""))
        try:
            for again in (False, True):
                try:
                    await retried(lambda: self.kube.create_pod(namespace, pod), RETRY_DELAYS, retrying)
                except Conflict:  # created before a restart, or a pod of that name that is not this job's
                    existing = await self.kube.find_pod(namespace, name)
                    # an unstarted pod of the job's earlier placement (a resume's creation that landed after the job
                    # was placed again): pinned to a node or GPU the job no longer has, it was followed for good
                    if not again and existing is not None and owner_of(existing) == owner and _pinned_elsewhere(existing, booking) \
                            and await self._delete_unstarted_pod(namespace, name, owner) is not PodDeletion.STARTED:
                        continue  # made anew where the job is booked
                    if existing is None or owner_of(existing) == owner:
                        return  # ours: keep following it (None: gone meanwhile; if it was ours, its DELETED event ends the job)
                    await self.finish(namespace, meta["name"], "Failed", "PodRejected",
                                      f"pod {name} already exists and is not this TrainingJob's: delete that pod, or create "
                                      "the TrainingJob under another name")
                    return
                self.events.post(namespace, meta["name"], meta.get("uid", ""), Said(
                    NORMAL, "PodCreated", f"created pod {name} on {booking.node}, GPU {booking.gpu}", "CreatePod"))
                return
        except KubeError as exc:
            if transient(exc):  # still the API server's trouble after about a minute: the GPU is not held for good
                await self.finish(namespace, meta["name"], "Failed", "PodCreateFailed",
                                  f"the API server did not create pod {name} in {sum(RETRY_DELAYS):g} s of attempts "
                                  f"({exc}): create the TrainingJob again")
                return
            # refused (invalid, PodSecurity, ResourceQuota): it never will be, so the job ends and frees its GPU
            await self.finish(namespace, meta["name"], "Failed", "PodRejected",
                              f"the API server refused pod {name} ({exc}): fix spec.template (or what the namespace "
                              "enforces: PodSecurity, ResourceQuota) and create the TrainingJob again")

    # ---- follow ---------------------------------------------------------------------------------
    async def pod_changed(self, pod: dict, deleted: bool = False) -> None:
        meta = pod["metadata"]
        if deleted and (gone := self._deleting.pop(meta.get("uid", ""), None)) is not None:
            gone.set()  # the unstarted pod deleted to place its job again: not the job's end
            return
        owner = owner_of(pod)
        if owner is None or not await self._of_current_job(meta["namespace"], *owner):
            return
        namespace, job = meta["namespace"], owner[0]
        key = f"{namespace}/{job}"
        phase = (pod.get("status") or {}).get("phase", "Pending")
        if deleted and phase not in model.FINISHED:
            if key in self.ledger.bookings:
                await self.finish(namespace, job, "Failed", "PodDeleted", "the training pod was deleted before it finished")
            return
        if meta.get("deletionTimestamp") and phase not in model.FINISHED:
            if key in self.ledger.bookings:  # its container may hold the GPU through its grace period
                await self.set_status(namespace, job, {"message": f"pod {meta['name']} is terminating: its GPU stays booked until it is gone"})
            return
        if phase == "Pending":
            waiting = _waiting(pod)
            if waiting is not None and key in self.ledger.bookings:
                await self._pod_waiting(namespace, job, meta["name"], *waiting)
        elif phase == "Running":
            booking = self.ledger.bookings.get(key)
            if booking is not None and booking.profile and key not in self._profiling:
                self._profiling.add(key)
                self._spawn(self._profile_while_running(key))
            await self.set_status(namespace, job, {"phase": "Running", "message": "training", "podName": meta["name"]},
                                  condition("PodRunning", True, "Running", f"pod {meta['name']} is running on {pod['spec'].get('nodeName')}"))
        elif phase in model.FINISHED and (key in self.ledger.bookings or self.phases.get(key) not in model.FINISHED):
            # an ended pod's events come again (an operator restart lists every kept pod, a finished pod's deletion):
            # finishing a job already ended rewrote its `finishedAt` and message (`finish` releases once it is written)
            await self.finish(namespace, job, *_pod_end(pod))

    async def _pod_waiting(self, namespace: str, job: str, pod: str, reason: str, message: str) -> None:
        """A pod Kubernetes cannot start yet (ImagePullBackOff, CreateContainerConfigError): the job showed
        `Admitted`, "placed on ...", while it held its GPU and never ran. Said (`PodRunning=False` with Kubernetes'
        reason), not ended: the pull or the missing Secret may recover. Written once per reason and message."""
        said = f"pod {pod} cannot start: {reason}: {message}"
        if any(c["type"] == "PodRunning" and (c["status"], c["reason"], c["message"]) == ("False", reason, said)
               for c in self.conditions.get(f"{namespace}/{job}", [])):
            return
        await self.set_status(namespace, job, {"message": f"{said} (its GPU stays booked while Kubernetes retries: "
                                                          "fix spec.template, or delete the TrainingJob)"},
                              condition("PodRunning", False, reason, said))

    async def _of_current_job(self, namespace: str, name: str, uid: str) -> bool:
        """Whether a pod's owner is the TrainingJob of that name now, by uid: the late DELETED event of a finished
        job's pod, deleted and created again under the same name, ended the new job (matched by name) and freed
        the GPU its pod ran on. A job not seen yet (a restart's pod events can come first) is read once."""
        key = f"{namespace}/{name}"
        if key not in self.uids:
            try:
                self.remember_conditions(await self.kube.get_job(namespace, name))
            except NotFound:
                return False
        return self.uids[key] in ("", uid)  # "": a body without a uid (only made by hand) is taken by name

    async def finish(self, namespace: str, name: str, phase: str, reason: str, message: str) -> None:
        """The job's end is written before its room is released. Released first, a placement made in the
        meantime could land before the end did, and the statuses showed the GPU over-committed (the 60-job
        restart test, with a burst of ends and placements after the restart); a rebuild whose LIST was
        served in between also booked the finished job again. The write is retried through the API server's
        trouble (written once, a 503 left the job Running for good). One end per job: a second caller (the
        pod's event and a rebuild, or a deletion) waits for the end being written."""
        key = f"{namespace}/{name}"
        self.pending.pop(key, None)
        if (ending := self._ending.get(key)) is not None:
            await ending.wait()
            return
        ending = self._ending[key] = asyncio.Event()
        try:
            await self.set_status(namespace, name, {"phase": phase, "message": message, "finishedAt": utc_timestamp()},
                                  condition("PodRunning", False, reason, message), condition("Finished", True, reason, message),
                                  delays=RETRY_DELAYS)
        finally:  # a write that failed for good still frees the room (the pod has ended); a rebuild ends the job
            booking = self.release(key)
            del self._ending[key]
            ending.set()
        await self.after_release(key, booking)

    async def after_release(self, key: str, booking: Booking | None) -> None:
        self.wake.set()
        if booking is None:
            return
        await self._store_profile(key, booking)  # not fetched while it ran (or the operator restarted)
        # its node's agent when its GPU is no longer listed: it still holds the job (and the forecast registered for it)
        await self.agent.unregister(self.agent_of(booking), key, self.tokens.pop(key, ""))

    async def _store_profile(self, key: str, booking: Booking) -> bool:
        """The live workload the job's hook gave its agent, stored under the booking's profile name."""
        agent = self.agent_of(booking)
        if not booking.profile or agent is None:
            return False
        live = await self.agent.live_workload(agent, key, self.tokens.get(key, ""))
        if live is None:
            return False
        self.forecaster.store_profile(booking.profile, live)
        log.info("%s: its live workload is now profile %r", key, booking.profile)
        booking.profile = None  # stored: not asked for again
        return True

    async def _profile_while_running(self, key: str) -> None:
        """The hook gives the agent its live workload after iteration 1 and unregisters when the training
        exits, before the pod's end reaches the operator: so it is asked for while the job runs."""
        try:
            while (booking := self.ledger.bookings.get(key)) is not None and booking.profile:
                if await self._store_profile(key, booking):
                    return
                await asyncio.sleep(PROFILE_POLL_SECONDS)
        finally:
            self._profiling.discard(key)

    async def deleted(self, body: dict) -> None:
        """A deleted TrainingJob's room is freed when its pod is really gone (its DELETED event, or found
        absent or terminated here), not when the deletion is seen: a terminating pod's container still holds
        the GPU and its memory through its grace period. Kopf's finalizer keeps the TrainingJob, and with it
        the placement in its status, until this returns, so a restarted operator books the room again."""
        meta = body["metadata"]
        namespace, name, key = meta["namespace"], meta["name"], job_key(body)
        self.remember_conditions(body)  # a restarted operator may see the deletion first: its end keeps them
        self.pending.pop(key, None)
        # set first: a re-placement under way (`_requeue`, `_admit`) sees the deletion and neither releases nor queues
        freed = self._freed.setdefault(key, asyncio.Event())
        owner = (name, meta.get("uid", ""))
        pod_of_job = pod_name(namespace, name, meta.get("uid", ""))
        try:
            await self.ready.wait()
            for task in (self._creating.get(key), self._checking.get(key)):
                if task is not None:  # the pod being created lands, and a look at a job whose GPU went ends, first
                    await asyncio.wait({task})
            self.pending.pop(key, None)  # queued again by a re-placement that ended first
            booking = self.ledger.bookings.get(key)
            if booking is not None:  # else queued (no pod ever), ended, or its pod was found gone by a rebuild
                self.token(body)  # unregistering at the agent needs it (a restarted operator has not made it yet)
            pod = await self.kube.find_pod(namespace, pod_of_job)
            if pod is not None and owner_of(pod) == owner:  # never another job's pod
                # on a node or GPU that went, an unstarted pod is deleted at once: a kubelet that is gone never
                # confirms a graceful deletion, and the finalizer waited for it for good
                if booking is None or self._gone(booking) is None \
                        or await self._delete_unstarted_pod(namespace, pod_of_job, owner) is PodDeletion.STARTED:
                    await self.kube.delete_pod(namespace, pod_of_job)
            while key in self.ledger.bookings:
                freed.clear()
                pod = await self.kube.find_pod(namespace, pod_of_job)
                if pod is None or pod_holder(pod) != key:  # gone, or ended: its containers hold nothing
                    await self.finish(namespace, name, "Failed", "Deleted", "the TrainingJob was deleted and its pod is gone")
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(freed.wait(), POD_CHECK_SECONDS)
        finally:
            self._freed.pop(key, None)
        self.conditions.pop(key, None)
        self.phases.pop(key, None)
        self.uids.pop(key, None)
        self.events.forget(key)

    async def knobs_changed(self, body: dict) -> None:
        meta = body["metadata"]
        key = job_key(body)
        noted = self.annotation_conditions(key, meta.get("annotations"))
        booking = self.ledger.bookings.get(key)
        pending = self.pending.get(key) if booking is None else None
        # a queued job's knobs apply to the spec it was forecast with (an edited spec is forecast by `spec_changed`):
        # taken from the edited spec here, the job was placed by the old forecast and its pod made from the new spec
        spec_body = pending.body if pending is not None else body
        try:
            spec = model.parse_spec(spec_body.get("spec") or {}, meta.get("annotations"))
        except model.SpecError as exc:
            await self.set_status(meta["namespace"], meta["name"], {},
                                  condition("KnobsApplied", False, "InvalidAnnotation", str(exc)), *noted)
            return
        if booking is None:
            await self._queued_knobs_changed(body, pending, spec, noted)
            return  # not placed yet: its pod starts with the knobs in its environment
        # a knob forwarded before that neither annotation nor spec sets now goes back to its default: the agent
        # reads a missing knob as unchanged, so an annotation removed from a job whose spec has no value held for good
        forwarded_before = (body.get("status") or {}).get("knobs") or {}
        knobs: dict = {"recompute": spec.recompute}
        if spec.max_swap_rate is not None or "maxSwapRate" in forwarded_before:
            knobs["maxSwapRate"] = spec.max_swap_rate or 1.0  # 1.0: no cap, as the planner reads none
        if spec.memory_budget is not None or "memoryBudgetBytes" in forwarded_before:  # the job's reservation
            knobs["memoryBudgetBytes"] = min(spec.memory_budget or booking.reserved_bytes, booking.reserved_bytes)
        booking.recompute = spec.recompute
        booking.max_swap_rate = spec.max_swap_rate
        booking.budget_bytes = spec.memory_budget
        gpu = self.gpu_of(booking)
        agent, token = gpu.agent if gpu else None, self.token(body)
        outcome = await self.agent.update_knobs(agent, key, token, knobs)
        if outcome == UNREGISTERED:
            self._knobs_retry(meta["namespace"], meta["name"], agent, token, knobs)
        conditions = [_knobs_condition(outcome)]
        if spec.plan_events != booking.plan_events:  # the pod's TENSILE_PLAN_EVENTS is set when it is created
            conditions.append(condition(
                "PlanEventsApplied", False, "FixedAtAdmission",
                f"planEvents is now {spec.plan_events}, but the pod runs with {booking.plan_events} (its hook and its "
                "forecast were set up with it when it was placed): delete and create the TrainingJob again to change it"))
        await self.set_status(meta["namespace"], meta["name"], {"knobs": knobs}, *conditions, *noted)

    async def _queued_knobs_changed(self, body: dict, pending: Pending | None, spec: model.JobSpec, noted: list[dict]) -> None:
        """Valid knobs on a job not placed. Queued, it is placed (and its pod made) by them, checked as admission checks
        a new job's: a budget below the lowest peak its plans reach fails it (taken as it was, such a budget placed the
        job at once, over-committing the GPU), and `KnobsApplied` says they were taken (an earlier `InvalidAnnotation`
        stayed after the fix). Not queued (ended): only the annotations' condition."""
        meta = body["metadata"]
        namespace, name, key = meta["namespace"], meta["name"], job_key(body)
        if pending is None:
            if noted:
                await self.set_status(namespace, name, {}, *noted)
            return
        taken = condition("KnobsApplied", True, "AtPlacement", "recorded while the job is queued: it is placed, and its pod "
                                                               "started, with these knobs")
        if spec.scope != pending.spec.scope:  # admission again (it writes the annotations' condition too)
            await self._forecast_again(pending, pending.body | {"metadata": meta})
            if key in self.pending:  # queued again (else failed: the budget is out of its new plans' reach)
                await self.set_status(namespace, name, {}, taken)
            return
        problem = unreachable_budget(spec, pending.forecast)
        if problem is not None:
            del self.pending[key]  # before any await: a commit under way for it books nothing
            self.wake.set()
            await self._fail_unreachable(namespace, name, problem, condition("KnobsApplied", False, "BudgetUnreachable", str(problem)), *noted)
            return
        # placed by the knobs as they are now: parsed once, at admission, a budget lowered to fit beside the
        # running jobs left the job queued by the old one
        pending.spec = spec
        self.wake.set()
        await self.set_status(namespace, name, {}, taken, *noted)

    async def spec_changed(self, body: dict) -> None:
        """A spec edited after creation. A queued job is admitted again by it (forecast by the edited spec, keeping
        its place in the queue), as a restarted operator admits it: before, the edit was ignored until a restart,
        or half taken by a knob annotation (the pod made from the edited spec, placed by the old forecast). A placed
        job keeps the spec its pod was made from, and `SpecApplied` says so (nothing did)."""
        meta = body["metadata"]
        namespace, name, key = meta["namespace"], meta["name"], job_key(body)
        pending = self.pending.get(key)
        if key in self.ledger.bookings:
            await self.set_status(namespace, name, {}, condition(
                "SpecApplied", False, "FixedAtAdmission",
                f"spec edited (generation {meta.get('generation')}) after the job was placed: its pod runs the spec it was "
                "placed with; delete and create the TrainingJob again to run the edited spec (tensile.dev/* annotations "
                "change a placed job's knobs)"))
        elif pending is not None:
            await self._forecast_again(pending, body)
            if key in self.pending:  # queued again (else failed: the edited spec is invalid or its budget out of reach)
                await self.set_status(namespace, name, {}, condition(
                    "SpecApplied", True, "ForecastAgain", f"spec edited (generation {meta.get('generation')}) while "
                    "queued: forecast again, and placed and run by the edited spec"))

    async def _forecast_again(self, pending: Pending, body: dict) -> None:
        """A queued job whose plan scope changed (`plan-events`, `recompute`): its forecast counted on the peak
        of plans made with the old events, which its hook's plans may not reach. It is admitted again (forecast
        by the new scope, or failed if its budget is now out of reach) and keeps its place in the queue (its creation)
        and when it first waited; a commit already under way for it sees it left the queue and books nothing."""
        del self.pending[pending.key]
        await self.admit(body)
        again = self.pending.get(pending.key)
        if again is not None:
            again.since = pending.since or again.since
            again.head_since = pending.head_since or again.head_since


def _queue_status(**fields: object) -> dict:
    """`status.queue` with every field it may hold: one left None is removed by the merge patch (left out, the
    API server would keep what an earlier write said, such as a hold that has ended)."""
    return dict.fromkeys(("reason", "shortfallBytes", "since", "priority", "priorityClassName", "headSince", "holding",
                          "waitingBehind")) | fields


KNOBS_RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0, 15.0) + (30.0,) * 18  # seconds: about ten minutes for a pod to start


def _pod_budget(booking: Booking) -> int | None:
    """The budget the job's hook holds to (TENSILE_MEMORY_BUDGET): its own, else, admitted by a budget, what it reserved."""
    if booking.budget_bytes is not None:
        return booking.budget_bytes
    return booking.reserved_bytes if booking.forecast is None else None


def _node_condition(booking: Booking, gone: Gone | None, said: dict | None) -> dict:
    """`NodeAvailable` of a job whose pod has started on a GPU that went (`gone`), or that is back (`said`: the
    condition that said it went)."""
    if gone is None:
        if said is not None and said.get("reason") == GPU_REMOVED:
            return condition("NodeAvailable", True, "GPUPublished", f"TensileNode {booking.node} lists GPU {booking.gpu} again")
        return condition("NodeAvailable", True, "TensileNodePublished", f"TensileNode {booking.node} is published again")
    return condition("NodeAvailable", False, gone.reason, (
        f"{gone.what}: the job's pod had started, so it is left to run and its GPU stays booked until it ends, but no "
        "node agent re-plans its memory or takes its knob changes there, and no job is placed on that GPU until it is "
        "published again"))


def _knobs_condition(outcome: str) -> dict:
    if outcome == FORWARDED:
        return condition("KnobsApplied", True, "Forwarded", "forwarded to the node agent")
    if outcome == UNREGISTERED:
        return condition("KnobsApplied", False, "WaitingForHook", "the job's hook has not registered with its node "
                         "agent yet (its pod is starting): sent again until it has")
    return condition("KnobsApplied", False, "NoAgent", "recorded; no agent reachable to forward to")


def pod_holder(pod: dict) -> str:
    """namespace/name of the TrainingJob a pod holds a GPU for ("" when it is not a training pod or has ended)."""
    owner = owner_of(pod)
    if owner is None or (pod.get("status") or {}).get("phase") in model.FINISHED:
        return ""
    return f"{pod['metadata']['namespace']}/{owner[0]}"


def had_pod(status: dict) -> bool:
    """Whether a job's status says its pod ran (`podName` is written with phase Running and PodRunning=True)."""
    return bool(status.get("podName")) or any(c.get("type") == "PodRunning" and c.get("status") == "True"
                                              for c in status.get("conditions") or [])


# waiting reasons of a container that is starting as it should; any other (ImagePullBackOff, ErrImagePull,
# CreateContainerConfigError, ...) is a problem the job shows
STARTING = ("ContainerCreating", "PodInitializing")


def _waiting(pod: dict) -> tuple[str, str] | None:
    """(reason, message) of the first container (init containers first) Kubernetes cannot start; None when none."""
    status = pod.get("status") or {}
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") and waiting["reason"] not in STARTING:
            return waiting["reason"], f"container {container.get('name')}: {waiting.get('message') or waiting['reason']}"
    return None


def _pinned_elsewhere(pod: dict, booking: Booking) -> bool:
    """Whether a pod of the job is pinned to another node or GPU than its booking (`nodeName`, `TENSILE_GPU`)."""
    spec = pod.get("spec") or {}
    gpus = {e.get("value") for c in spec.get("containers") or [] for e in c.get("env") or [] if e.get("name") == "TENSILE_GPU"}
    return spec.get("nodeName") != booking.node or gpus != {booking.gpu}


def _started(pod: dict) -> bool:
    """Whether a pod has left Pending or started any of its containers (init containers too): only a pod that has
    not is deleted to place its job again (Tensile never stops training, or a container about to train, by its own
    decision)."""
    status = pod.get("status") or {}
    if status.get("phase", "Pending") != "Pending":
        return True
    return any(c.get("started") or c.get("restartCount") or {"running", "terminated"} & (c.get("state") or {}).keys()
               or (c.get("lastState") or {}).get("terminated")
               for c in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])])


def _pod_end(pod: dict) -> tuple[str, str, str]:
    """An ended pod as its job's end: phase, reason, message. An evicted pod (node pressure, a preemption) ends its
    job `Evicted` with the kubelet's message: as `PodFailed` it read as the training's own failure."""
    status = pod["status"]
    if status.get("reason") == "Evicted":
        return "Failed", "Evicted", f"pod {pod['metadata']['name']} was evicted: {status.get('message') or 'no message'}"
    phase = status["phase"]
    return phase, "Completed" if phase == "Succeeded" else "PodFailed", _termination(pod)


def _termination(pod: dict) -> str:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated:
            return f"container {status.get('name')} exited with {terminated.get('exitCode')} ({terminated.get('reason', '')})"
    return (pod.get("status") or {}).get("message") or (pod.get("status") or {}).get("phase", "")
