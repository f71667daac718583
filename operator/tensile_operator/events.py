"""Kubernetes Events on TrainingJobs: the lifecycle `kubectl describe trainingjob` shows.

Posted by the operator itself, as core/v1 Events through `kube.Kube` (RBAC: events create, which Kopf's own
posts needed already), not with `kopf.event`: most transitions happen in the scheduler and in background tasks,
where Kopf 1.45 has no event queue (`LookupError`), and `kopf.info` posts nothing under the operator's
`settings.posting.level` (WARNING, which keeps Kopf's per-handler chatter out).

An Event is posted for a condition's transition (its status or reason changed; for the conditions in
`MESSAGE_MATTERS`, its message too), never for a status write that repeats what the conditions say: a resync, a
running pod's repeated events and a restarted operator (which reads the conditions back from the status) post
nothing. A failed post is logged and dropped: an Event is a courtesy, admission never waits on it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tensile_operator import GROUP, VERSION
from tensile_operator.kube import Kube

log = logging.getLogger("tensile_operator")
NORMAL, WARNING = "Normal", "Warning"
COMPONENT = "tensile-operator"  # `kubectl describe`'s "From"
CONTROLLER = "tensile.dev/operator"  # reportingComponent: a qualified name, required with eventTime
MAX_MESSAGE = 1024  # the API server refuses a longer message on an Event with eventTime
MAX_NAME = 253  # an Event's name is a DNS subdomain

# (condition type, reason) -> (Event type, Event reason). Not listed: no Event (Validated=True, knobs forwarded),
# except the rules in `_said`
EVENTS: dict[tuple[str, str], tuple[str, str]] = {
    ("Validated", "InvalidSpec"): (WARNING, "InvalidSpec"),
    ("Forecasted", "Forecasted"): (NORMAL, "Forecast"),
    ("Forecasted", "ForecastFailed"): (WARNING, "ForecastFailed"),
    ("Forecasted", "NoProfile"): (NORMAL, "NoProfile"),
    ("Forecasted", "BudgetUnreachable"): (WARNING, "BudgetUnreachable"),
    ("Admitted", "Queued"): (NORMAL, "Queued"),
    ("Admitted", "NoGpuLargeEnough"): (WARNING, "NoGpuLargeEnough"),
    ("Admitted", "Placed"): (NORMAL, "Placed"),
    ("Admitted", "HoldingRoom"): (NORMAL, "HoldingRoom"),
    ("Admitted", "WaitingBehind"): (NORMAL, "WaitingBehind"),
    ("PriorityResolved", "PriorityClassNotFound"): (WARNING, "PriorityClassNotFound"),
    ("PriorityResolved", "PriorityClassFound"): (NORMAL, "PriorityClassFound"),
    ("PodRunning", "Running"): (NORMAL, "Running"),
    ("Finished", "Completed"): (NORMAL, "Succeeded"),
    ("Finished", "PodFailed"): (WARNING, "Failed"),
    ("SpecApplied", "ForecastAgain"): (NORMAL, "SpecApplied"),
    ("SpecApplied", "FixedAtAdmission"): (WARNING, "SpecNotApplied"),
    ("PlanEventsApplied", "FixedAtAdmission"): (WARNING, "PlanEventsNotApplied"),
    ("KnobsApplied", "InvalidAnnotation"): (WARNING, "InvalidAnnotation"),
    ("UnknownAnnotations", "Ignored"): (WARNING, "UnknownAnnotations"),
    ("NodeAvailable", "TensileNodeRemoved"): (WARNING, "TensileNodeRemoved"),
    ("NodeAvailable", "TensileNodePublished"): (NORMAL, "TensileNodePublished"),
    ("NodeAvailable", "GPURemoved"): (WARNING, "GPURemoved"),
    ("NodeAvailable", "GPUPublished"): (NORMAL, "GPUPublished"),
    ("NodeAvailable", "GPUUnpublished"): (WARNING, "GPUUnpublished"),
    ("Admitted", "ClaimUnallocatable"): (WARNING, "ClaimUnallocatable"),
    ("KnobsApplied", "ClaimTooSmall"): (WARNING, "KnobsNotApplied"),
    ("Admitted", "DeviceClassNotFound"): (WARNING, "DeviceClassNotFound"),
    ("Admitted", "NoMemoryCapacity"): (WARNING, "NoMemoryCapacity"),
    # a job whose pod had not started, placed again after its node or GPU went (as Kueue's requeued workloads)
    ("Admitted", "TensileNodeRemoved"): (NORMAL, "Requeued"),
    ("Admitted", "GPURemoved"): (NORMAL, "Requeued"),
    ("Admitted", "GPUUnpublished"): (NORMAL, "Requeued"),
}
# conditions whose new message is news (a new forecast, another edit or annotation); the others' messages carry
# amounts that move without anything happening to the job (the queue's shortfall, a retry's delay)
MESSAGE_MATTERS = frozenset({"Forecasted", "SpecApplied", "PlanEventsApplied", "KnobsApplied", "UnknownAnnotations"})


@dataclass(frozen=True)
class Said:
    """One Event to post on a TrainingJob."""

    type: str
    reason: str
    message: str
    action: str  # what the operator did or checked (the condition's type)


def transitions(before: Sequence[dict], new: Sequence[dict], failing: bool = False) -> list[Said]:
    """The Events for the conditions `new` writes over `before`: one per condition that says something new.
    `failing`: the write fails the job (phase Failed), so each is a Warning (a failed forecast of a job that has no
    budget to fall back on, a deletion that stopped its training)."""
    old = {c["type"]: c for c in before}
    ending = any(c["type"] == "Finished" for c in new)
    result = []
    for cond in new:
        said = _said(cond, ending)
        if said is not None and _changed(old.get(cond["type"]), cond):
            kind, reason = said
            result.append(Said(WARNING if failing else kind, reason, cond.get("message") or reason, cond["type"]))
    return result


def _said(cond: dict, ending: bool) -> tuple[str, str] | None:
    """Every end other than success is a Warning, and so is a pod that cannot start or be created; a job's end
    also writes `PodRunning=False`, which its `Finished` Event says already."""
    known = EVENTS.get((cond["type"], cond["reason"]))
    if known is not None:
        return known
    if cond["type"] == "Finished" or (cond["type"] == "PodRunning" and cond["status"] == "False" and not ending):
        return WARNING, cond["reason"]
    return None


def _changed(old: dict | None, new: dict) -> bool:
    if old is None:
        return True
    fields = ("status", "reason", "message") if new["type"] in MESSAGE_MATTERS else ("status", "reason")
    return any(old.get(f) != new.get(f) for f in fields)


def event_body(namespace: str, name: str, uid: str, said: Said, event_name: str, instance: str) -> dict:
    """A core/v1 Event on the TrainingJob, as `kubectl describe` finds it (involvedObject with its uid) and the
    API server takes it: with eventTime it needs reportingComponent, reportingInstance and action; the
    timestamps are set too for `kubectl get events --sort-by=.lastTimestamp`."""
    now = datetime.datetime.now(datetime.UTC)
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": event_name, "namespace": namespace},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "namespace": namespace,
                           "name": name, "uid": uid},
        "type": said.type, "reason": said.reason, "message": _cut(said.message), "action": said.action,
        "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), "firstTimestamp": stamp, "lastTimestamp": stamp,
        "count": 1, "source": {"component": COMPONENT}, "reportingComponent": CONTROLLER,
        "reportingInstance": instance[:128],
    }


def _cut(message: str) -> str:
    if len(message) <= MAX_MESSAGE:
        return message
    half = (MAX_MESSAGE - 3) // 2
    return f"{message[:half]}...{message[-half:]}"


class EventRecorder:
    """Posts Events in the order they were said, from one task (made on the first post, in the running loop), so
    an admission never waits for one. Within a run, an Event the job was given already is not posted again (a
    pod's waiting reason flapping between ErrImagePull and ImagePullBackOff)."""

    def __init__(self, kube: Kube):
        self._kube = kube
        self._queue: asyncio.Queue[dict] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._posted: dict[str, set[tuple[str, str]]] = {}  # job key -> (reason, message) posted by this run
        self._last_ns = 0
        self.instance = socket.gethostname()  # the pod's name, in a cluster

    def post(self, namespace: str, name: str, uid: str, said: Said) -> None:
        posted = self._posted.setdefault(f"{namespace}/{name}", set())
        if (said.reason, said.message) in posted:
            return
        posted.add((said.reason, said.message))
        if self._task is None or self._task.done():  # first post, or the loop of an earlier run has ended
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run(self._queue))
        self._queue.put_nowait(event_body(namespace, name, uid, said, self._name(name), self.instance))

    def forget(self, key: str) -> None:
        """The job is gone: a new one of the same name starts with no Events."""
        self._posted.pop(key, None)

    def _name(self, job: str) -> str:
        """`<job>.<nanoseconds in hex>`, as client-go names Events: unique, and listed in the order posted."""
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        suffix = f".{self._last_ns:x}"
        return job[:MAX_NAME - len(suffix)].rstrip(".-") + suffix

    async def _run(self, queue: asyncio.Queue[dict]) -> None:
        while True:
            event = await queue.get()
            try:
                await self._kube.create_event(event["metadata"]["namespace"], event)
            except Exception as exc:  # noqa: BLE001 - a failed Event never stops admission: logged, dropped
                log.warning("%s/%s: Event %s not posted: %s", event["metadata"]["namespace"],
                            event["involvedObject"]["name"], event["reason"], exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
