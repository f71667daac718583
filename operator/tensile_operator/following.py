"""A placed job's pod, followed: its job's status says it runs, cannot start, or has ended (the job's end); a deleted
job's room is freed once its pod is really gone."""

from __future__ import annotations

import asyncio
import contextlib

from tensile import trainingjob_spec as model
from tensile_operator import timing
from tensile_operator.capacity import CapacityLedger
from tensile_operator.completion import JobCompletion
from tensile_operator.kube import Kube, NotFound
from tensile_operator.pod_creation import PodDeletion, PodLauncher
from tensile_operator.pod_state import pod_end, pod_holder, unschedulable, waiting
from tensile_operator.pods import JobTokens, owner_of, pod_name
from tensile_operator.queueing import JobQueue
from tensile_operator.replacement import Replacement
from tensile_operator.statuses import JobStatuses, condition, job_key


class PodFollower:
    """Takes each training pod's events (Kopf's watch) to its job, and a TrainingJob's deletion to its release."""

    def __init__(self, kube: Kube, capacity: CapacityLedger, queue: JobQueue, statuses: JobStatuses, pods: PodLauncher,
                 completion: JobCompletion, replacement: Replacement, tokens: JobTokens) -> None:
        self.kube = kube
        self.capacity = capacity
        self.queue = queue
        self.statuses = statuses
        self.pods = pods
        self.completion = completion
        self.replacement = replacement
        self.tokens = tokens

    async def pod_changed(self, pod: dict, deleted: bool = False) -> None:
        meta = pod["metadata"]
        if deleted and self.pods.deleted_by_us(meta.get("uid", "")):
            return  # the unstarted pod deleted to place its job again: not the job's end
        owner = owner_of(pod)
        if owner is None or not await self._of_current_job(meta["namespace"], *owner):
            return
        namespace, job = meta["namespace"], owner[0]
        key = f"{namespace}/{job}"
        phase = (pod.get("status") or {}).get("phase", "Pending")
        if deleted and phase not in model.FINISHED:
            if self.capacity.booked(key):
                await self.completion.finish(namespace, job, "Failed", "PodDeleted",
                                             "the training pod was deleted before it finished")
            return
        if meta.get("deletionTimestamp") and phase not in model.FINISHED:
            if self.capacity.booked(key):  # its container may hold the GPU through its grace period
                said = f"pod {meta['name']} is terminating: its GPU stays booked until it is gone"
                await self.statuses.write(namespace, job, {"message": said})
            return
        if phase == "Pending":
            booking = self.capacity.booking(key)
            refused = unschedulable(pod)
            if refused is not None and booking is not None and booking.claim:
                self.replacement.claim_unallocatable(booking, refused)
                return
            cannot_start = waiting(pod)
            if cannot_start is not None and self.capacity.booked(key):
                await self._pod_waiting(namespace, job, meta["name"], *cannot_start)
        elif phase == "Running":
            booking = self.capacity.booking(key)
            if booking is not None and booking.profile:
                self.completion.profile_while_running(key)
            running = {"phase": "Running", "message": "training", "podName": meta["name"]}
            await self.statuses.write(namespace, job, running, condition(
                "PodRunning", True, "Running", f"pod {meta['name']} is running on {pod['spec'].get('nodeName')}"))
        elif phase in model.FINISHED and (self.capacity.booked(key) or self.statuses.phase(key) not in model.FINISHED):
            # an ended pod's events come again (an operator restart lists every kept pod, a finished pod's deletion):
            # finishing a job already ended rewrote its `finishedAt` and message (`finish` releases once it is written)
            await self.completion.finish(namespace, job, *pod_end(pod))

    async def _pod_waiting(self, namespace: str, job: str, pod: str, reason: str, message: str) -> None:
        """A pod Kubernetes cannot start yet (ImagePullBackOff, CreateContainerConfigError): the job showed
        `Admitted`, "placed on ...", while it held its GPU and never ran. Said (`PodRunning=False` with Kubernetes'
        reason), not ended: the pull or the missing Secret may recover. Written once per reason and message."""
        said = f"pod {pod} cannot start: {reason}: {message}"
        if any(c["type"] == "PodRunning" and (c["status"], c["reason"], c["message"]) == ("False", reason, said)
               for c in self.statuses.of(f"{namespace}/{job}")):
            return
        await self.statuses.write(namespace, job, {"message": f"{said} (its GPU stays booked while Kubernetes retries: "
                                                              "fix spec.template, or delete the TrainingJob)"},
                                  condition("PodRunning", False, reason, said))

    async def _of_current_job(self, namespace: str, name: str, uid: str) -> bool:
        """Whether a pod's owner is the TrainingJob of that name now, by uid: the late DELETED event of a finished
        job's pod, deleted and created again under the same name, ended the new job (matched by name) and freed
        the GPU its pod ran on. A job not seen yet (a restart's pod events can come first) is read once."""
        try:
            current = await self.statuses.read_uid(namespace, name)
        except NotFound:
            return False
        return current in ("", uid)  # "": a body without a uid (only made by hand) is taken by name

    async def deleted(self, body: dict) -> None:
        """A deleted TrainingJob's room is freed when its pod is really gone (its DELETED event, or found
        absent or terminated here), not when the deletion is seen: a terminating pod's container still holds
        the GPU and its memory through its grace period. Kopf's finalizer keeps the TrainingJob, and with it
        the placement in its status, until this returns, so a restarted operator books the room again."""
        meta = body["metadata"]
        namespace, name, key = meta["namespace"], meta["name"], job_key(body)
        self.statuses.remember(body)  # a restarted operator may see the deletion first: its end keeps them
        self.queue.pending.pop(key, None)
        # set first: a re-placement under way (`Replacement`, `JobIntake`) sees the deletion and neither releases nor
        # queues
        freed = self.completion.deletion_started(key)
        owner = (name, meta.get("uid", ""))
        pod_of_job = pod_name(namespace, name, meta.get("uid", ""))
        try:
            await self.capacity.ready.wait()
            for task in (self.pods.creation(key), self.replacement.check_of(key)):
                if task is not None:  # the pod being created lands, and a look at a job whose GPU went ends, first
                    await asyncio.wait({task})
            self.queue.pending.pop(key, None)  # queued again by a re-placement that ended first
            booking = self.capacity.booking(key)
            if booking is not None:  # else queued (no pod ever), ended, or its pod was found gone by a rebuild
                # unregistering at the agent needs it (a restarted operator has not made it yet)
                self.tokens.issue(body)
            pod = await self.kube.find_pod(namespace, pod_of_job)
            if pod is not None and owner_of(pod) == owner:  # never another job's pod
                # on a node or GPU that went, an unstarted pod is deleted at once: a kubelet that is gone never
                # confirms a graceful deletion, and the finalizer waited for it for good
                if booking is None or self.capacity.gone(booking) is None \
                        or await self.pods.delete_unstarted_pod(namespace, pod_of_job, owner) is PodDeletion.STARTED:
                    await self.kube.delete_pod(namespace, pod_of_job)
            while self.capacity.booked(key):
                freed.clear()
                pod = await self.kube.find_pod(namespace, pod_of_job)
                if pod is None or pod_holder(pod) != key:  # gone, or ended: its containers hold nothing
                    await self.completion.finish(namespace, name, "Failed", "Deleted",
                                                 "the TrainingJob was deleted and its pod is gone")
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(freed.wait(), timing.POD_CHECK_SECONDS)
        finally:
            self.completion.deletion_ended(key)
        self.statuses.forget(key)
