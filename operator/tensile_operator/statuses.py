"""What the operator writes on TrainingJob statuses, and what it knows they say.

Every collaborator writes a job's status through `JobStatuses`: its conditions are merged with those the job has
(read back from the status by a restarted operator), and each condition that says something new is posted as an Event.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tensile.agent_contract import utc_timestamp
from tensile_operator.events import EventRecorder, transitions
from tensile_operator.kube import Kube, NotFound, retried

log = logging.getLogger("tensile_operator")


def job_key(body: dict) -> str:
    """namespace/name: how the ledger, the queue and the statuses name a TrainingJob."""
    return f"{body['metadata']['namespace']}/{body['metadata']['name']}"


def condition(type_: str, ok: bool, reason: str, message: str = "") -> dict:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message,
            "lastTransitionTime": utc_timestamp()}


def merge_conditions(old: list[dict], *new: dict) -> list[dict]:
    kept = {c["type"]: c for c in old or []}
    for c in new:
        previous = kept.get(c["type"])
        if previous and previous.get("status") == c["status"] and previous.get("reason") == c["reason"]:
            c = dict(c, lastTransitionTime=previous.get("lastTransitionTime", c["lastTransitionTime"]))
        kept[c["type"]] = c
    return list(kept.values())


class JobStatuses:
    """Each job's conditions, its phase (the metrics count jobs by it) and its uid (its Events name it; a pod is the
    job's only if its owner has it), as last written or read; and the writes that keep them."""

    def __init__(self, kube: Kube, events: EventRecorder) -> None:
        self.kube = kube
        self.events = events
        self.conditions: dict[str, list[dict]] = {}
        self.phases: dict[str, str] = {}  # key -> the phase last seen or written (metrics)
        self.uids: dict[str, str] = {}  # key -> uid of the TrainingJob of that name this operator admitted or read

    async def write(self, namespace: str, name: str, status: dict, *conds: dict, delays: Sequence[float] = ()) -> None:
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

    def remember(self, body: dict) -> None:
        """What a TrainingJob's body says of it: its uid, and its conditions and phase unless this run knows them."""
        key = job_key(body)
        self.uids[key] = body["metadata"].get("uid", "")
        if key not in self.conditions:
            self.conditions[key] = list((body.get("status") or {}).get("conditions") or [])
        self.phases.setdefault(key, (body.get("status") or {}).get("phase") or "Pending")

    def of(self, key: str) -> list[dict]:
        """The job's conditions as last written or read."""
        return self.conditions.get(key, [])

    def find(self, key: str, type_: str, status: str | None = None) -> dict | None:
        """The job's condition of `type_` (with `status`, "True" or "False", when given), if it has one."""
        return next((c for c in self.of(key) if c["type"] == type_ and status in (None, c["status"])), None)

    def drop(self, key: str, types: frozenset[str]) -> None:
        """The job's conditions of `types` forgotten (its next status write no longer carries them)."""
        self.conditions[key] = [c for c in self.of(key) if c["type"] not in types]

    def phase(self, key: str) -> str | None:
        return self.phases.get(key)

    async def read_uid(self, namespace: str, name: str) -> str:
        """The uid of the TrainingJob of that name as last read, else read now and remembered (a restarted operator's
        pod events, and its bookings from the statuses' LIST, can come before the job is read one by one); raises
        NotFound when the job is gone."""
        uid = self.uids.get(f"{namespace}/{name}")
        if uid is None:
            body = await self.kube.get_job(namespace, name)
            self.remember(body)
            uid = body["metadata"].get("uid", "")
        return uid

    def phase_snapshot(self) -> dict[str, str]:
        """job -> phase, copied (the metrics' scrape thread must not iterate the live dict)."""
        return dict(self.phases)

    def forget(self, key: str) -> None:
        """The job is gone: a new one of the same name starts with nothing said."""
        self.conditions.pop(key, None)
        self.phases.pop(key, None)
        self.uids.pop(key, None)
        self.events.forget(key)
