"""A restarted node agent's jobs admitted again: it keeps the operator's admissions in memory only, so after a restart
it refused every hook's registration (403 `not_admitted`) until its jobs ended.

An agent publishes the identity of its process in its TensileNode (`status.agentEpoch`); a new one (or the first this
operator run sees) has each job booked on the node's GPUs whose pod exists admitted there again, as at its pod's
creation. An admission the agent has already is replaced by the same one, so admitting again is harmless.
"""

from __future__ import annotations

import logging

from tensile_operator.capacity import CapacityLedger
from tensile_operator.kube import Kube, NotFound
from tensile_operator.placement import Booking
from tensile_operator.pod_creation import PodLauncher
from tensile_operator.pod_state import pod_holder
from tensile_operator.pods import owner_of, pod_name
from tensile_operator.statuses import JobStatuses

log = logging.getLogger("tensile_operator")


class Readmission:
    """Each node's agent epoch whose jobs were all admitted again; an epoch not recorded (new, or a re-admission that
    failed) admits the node's jobs at its TensileNode's next event."""

    def __init__(self, kube: Kube, capacity: CapacityLedger, statuses: JobStatuses, pods: PodLauncher) -> None:
        self.kube = kube
        self.capacity = capacity
        self.statuses = statuses
        self.pods = pods
        self._admitted: dict[str, str] = {}  # node -> the agent epoch all of whose jobs were admitted again

    async def node_changed(self, body: dict | None, name: str) -> None:
        """A TensileNode as published now (None: removed); after the ledger's start-up rebuild."""
        epoch = ((body or {}).get("status") or {}).get("agentEpoch")
        if body is None or not epoch:  # removed, or an agent that does not say (its restarts go unseen)
            self._admitted.pop(name, None)
            return
        if self._admitted.get(name) == epoch:
            return
        failed = [b.job for b in self.capacity.bookings() if b.node == name and not await self._admit(b)]
        if failed:
            log.warning("agent %s of node %s: admitting %s again failed; tried again at its TensileNode's next event",
                        epoch, name, ", ".join(failed))
            return
        self._admitted[name] = epoch

    async def _admit(self, booking: Booking) -> bool:
        """The job admitted again where its pod exists (or is being made: its admission may have gone to the agent
        before the restart); True when done or not needed."""
        namespace, name = booking.job.split("/", 1)
        try:
            uid = await self.statuses.read_uid(namespace, name)
            if self.pods.creation(booking.job) is None:
                found = await self.kube.find_pod(namespace, pod_name(namespace, name, uid))
                if found is None or owner_of(found) != (name, uid) or pod_holder(found) != booking.job:
                    return True  # no pod (made later, and admitted then), or it ended: nothing will register
        except NotFound:
            return True  # the job is gone: its release tells the agent
        except Exception as exc:  # noqa: BLE001 - the API server's trouble: tried again at the next event
            log.warning("%s: reading it to admit it again failed: %s", booking.job, exc)
            return False
        gpu = self.capacity.gpu_of(booking)
        if gpu is None or not gpu.agent:
            return True  # its GPU or agent went: `Replacement` looks at it
        if not await self.pods.admit(booking, gpu, uid):
            return False
        log.info("%s: admitted again with the agent of %s", booking.job, booking.node)
        return True
