"""A placed job's pod: its forecast registered with its node agent, then the pod made where the job is booked; and an
unstarted pod deleted so that its job can be placed again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from enum import Enum
from typing import Any

from tensile.devices import DEFAULT_CONTEXT_BYTES
from tensile_operator import timing
from tensile_operator.agent import NodeAgentClient
from tensile_operator.capacity import CapacityLedger
from tensile_operator.claims import JobClaims
from tensile_operator.completion import JobCompletion
from tensile_operator.events import NORMAL, EventRecorder, Said
from tensile_operator.kube import Conflict, Kube, KubeError, retried, transient
from tensile_operator.placement import Booking, Gpu, slack_of
from tensile_operator.pod_state import pinned_elsewhere, started
from tensile_operator.pods import JobTokens, build_pod, owner_of, pod_name
from tensile_operator.statuses import JobStatuses, condition
from tensile_operator.tasks import Background

log = logging.getLogger("tensile_operator")


class PodDeletion(Enum):
    """What `delete_unstarted_pod` did: the job's pod deleted, no pod of the job found, or its pod has started (left
    alone: Tensile never stops training by its own decision)."""

    DELETED = "deleted"
    NO_POD = "no pod"
    STARTED = "started"


def pod_budget(booking: Booking) -> int | None:
    """The budget the job's hook holds to (TENSILE_MEMORY_BUDGET): its own, else, admitted by a budget, what it
    reserved."""
    if booking.budget_bytes is not None:
        return booking.budget_bytes
    return booking.reserved_bytes if booking.forecast is None else None


def admitted_size(booking: Booking, gpu: Gpu | None) -> int:
    """What the job was admitted with, its process's CUDA memory cap (TENSILE_MEMORY_CAP): its claim's request in `dra`
    mode, else its booked peak plus what its process holds beyond it, its allocator's slack and its context (without
    its GPU, the slack with the largest cuBLAS workspaces a GPU may give and the default context: its allocator's share
    is never below what it was booked with)."""
    if booking.claim_bytes is not None:
        return booking.claim_bytes
    return booking.reserved_bytes + slack_of(booking.forecast, gpu) + context_of(gpu)


def context_of(gpu: Gpu | None) -> int:
    """The part of a job's admitted size counted for what its process holds outside the caching allocator
    (TENSILE_CONTEXT_BYTES, which its memory cap keeps out of the allocator's share): its GPU's per-job context."""
    return gpu.context_bytes if gpu is not None else DEFAULT_CONTEXT_BYTES


class PodLauncher:
    """Makes each placed job's pod on a task of its own (the scheduler goes on meanwhile), idempotently: a 409 is the
    job's own pod (made before a restart), unless another owns it. The API server's trouble is retried; a refusal, or
    trouble that lasts, ends the job and frees its GPU."""

    def __init__(self, kube: Kube, capacity: CapacityLedger, statuses: JobStatuses, events: EventRecorder,
                 agents: NodeAgentClient, tokens: JobTokens, completion: JobCompletion, background: Background,
                 image: str, claims: JobClaims | None = None) -> None:
        self.kube = kube
        self.capacity = capacity
        self.statuses = statuses
        self.events = events
        self.agents = agents
        self.tokens = tokens
        self.completion = completion
        self.background = background
        self.image = image
        self.claims = claims  # `dra` mode: each pod's ResourceClaim
        self._creating: dict[str, asyncio.Task] = {}  # key -> the task creating the job's pod
        # uid of an unstarted pod deleted to place its job again -> set at its DELETED event (not the job's end)
        self.deleting: dict[str, asyncio.Event] = {}

    def launch(self, body: dict, booking: Booking, register: bool = True) -> None:
        """The job's pod made on a task of its own, tracked (`creation`) until it is made or has failed."""
        self._creating[booking.job] = self.background.spawn(self.start_pod(body, booking, register))

    def creation(self, key: str) -> asyncio.Task | None:
        """The task making the job's pod, while it runs."""
        return self._creating.get(key)

    async def start_pod(self, body: dict, booking: Booking, register: bool = True) -> None:
        """`register`: the forecast to the agent first (a new placement; not on resume, see `_register_forecast`)."""
        try:
            if self.capacity.booked(booking.job):  # not released by a deletion seen while the placement was written
                if register:
                    await self._register_forecast(body, booking)
                await self.ensure_pod(body, booking)
        except Exception:  # noqa: BLE001 - the job stays placed; a restarted operator creates its pod (resume)
            log.exception("%s: creating its pod failed", booking.job)
        finally:
            self._creating.pop(booking.job, None)

    async def _register_forecast(self, body: dict, booking: Booking) -> None:
        """A new placement's forecast to its node agent before the pod exists (TENSILE's cold start: planned before
        the first iteration, with the GPU's other jobs). The pod's hook finds it by TENSILE_SIGNATURE; where the
        agent cannot take it (or the job was admitted by its budget: no forecast), the hook registers the live
        workload after its first iteration instead. Not on resume: a running hook may have replaced it."""
        gpu = self.capacity.gpu_of(booking)
        if booking.forecast is None or gpu is None or not gpu.agent:
            return
        token = self.tokens.issue(body)
        if await self.agents.register(gpu.agent, booking.job, token, booking.gpu, booking.forecast, pod_budget(booking),
                                      booking.max_swap_rate, booking.recompute, booking.plan_events):
            log.info("%s: registered with the agent of %s with its forecast", booking.job, gpu.node)

    async def ensure_pod(self, body: dict, booking: Booking) -> None:
        """The job's pod (after its claim, in `dra` mode: no pod runs without the claim it names)."""
        meta = body["metadata"]
        claim = None
        if self.claims is not None and booking.claim_bytes is not None:
            try:
                claim = await self.claims.ensure(body, booking)
            except KubeError as exc:
                await self.completion.finish(
                    meta["namespace"], meta["name"], "Failed", "ClaimRejected", f"the API server did not make the "
                    f"job's ResourceClaim ({exc}): resource.k8s.io/v1 with consumable capacity needs Kubernetes 1.36+ "
                    "(else install the chart with gpuAccess.mode=legacy); then create the TrainingJob again")
                return
        gpu = self.capacity.gpu_of(booking)
        signature = booking.forecast.signature if booking.forecast else None
        pod = build_pod(body, booking.node, booking.gpu, gpu.agent if gpu else None,
                        pod_budget(booking), booking.max_swap_rate, signature, self.image, booking.plan_events,
                        booking.recompute, claim, memory_cap=admitted_size(booking, gpu), context_bytes=context_of(gpu))
        namespace, name = meta["namespace"], pod["metadata"]["name"]
        await self.admit(booking, gpu, meta.get("uid", ""))

        async def retrying(exc: Exception, delay: float) -> None:
            message = f"creating pod {name} failed ({exc}): tried again in {delay:g} s"
            log.warning("%s: %s", booking.job, message)
            with contextlib.suppress(KubeError):  # the same trouble may refuse this write too: the log says it
                await self.statuses.write(namespace, meta["name"], {"message": message},
                                          condition("PodRunning", False, "PodCreateFailed", message))

        owner = (meta["name"], meta.get("uid", ""))
        try:
            for again in (False, True):
                try:
                    await retried(lambda: self.kube.create_pod(namespace, pod), timing.RETRY_DELAYS, retrying)
                except Conflict:  # created before a restart, or a pod of that name that is not this job's
                    existing = await self.kube.find_pod(namespace, name)
                    # an unstarted pod of the job's earlier placement (a resume's creation that landed after the job
                    # was placed again): pinned to a node or GPU the job no longer has, it was followed for good
                    if not again and existing is not None and owner_of(existing) == owner \
                            and pinned_elsewhere(existing, booking) \
                            and await self.delete_unstarted_pod(namespace, name, owner) is not PodDeletion.STARTED:
                        continue  # made anew where the job is booked
                    if existing is None or owner_of(existing) == owner:
                        # ours: keep following it (None: gone meanwhile; if it was ours, its DELETED event ends the job)
                        return
                    await self.completion.finish(
                        namespace, meta["name"], "Failed", "PodRejected", f"pod {name} already exists and is not this "
                        "TrainingJob's: delete that pod, or create the TrainingJob under another name")
                    return
                self.events.post(namespace, meta["name"], meta.get("uid", ""), Said(
                    NORMAL, "PodCreated", f"created pod {name} on {booking.node}, GPU {booking.gpu}", "CreatePod"))
                return
        except KubeError as exc:
            if transient(exc):  # still the API server's trouble after about a minute: the GPU is not held for good
                await self.completion.finish(
                    namespace, meta["name"], "Failed", "PodCreateFailed", f"the API server did not create pod {name} "
                    f"in {sum(timing.RETRY_DELAYS):g} s of attempts ({exc}): create the TrainingJob again")
                return
            # refused (invalid, PodSecurity, ResourceQuota): it never will be, so the job ends and frees its GPU
            await self.completion.finish(
                namespace, meta["name"], "Failed", "PodRejected", f"the API server refused pod {name} ({exc}): fix "
                "spec.template (or what the namespace enforces: PodSecurity, ResourceQuota) and create the TrainingJob "
                "again")

    async def admit(self, booking: Booking, gpu: Gpu | None, uid: str) -> bool:
        """The job's pod (of the TrainingJob with that uid) may register it with the agent of `gpu`, its booked GPU,
        with the job's token and at most the budget its hook holds to: at the pod's creation, and again for an agent
        that restarted (`Readmission`). True when the agent took the admission."""
        namespace, name = booking.job.split("/", 1)
        return await self.agents.admit(gpu.agent if gpu else None, booking.job,
                                       self.tokens.issue_for(namespace, name, uid), booking.gpu,
                                       pod_name(namespace, name, uid), pod_budget(booking))

    async def delete_unstarted_pod(self, namespace: str, pod: str, owner: tuple[str, str]) -> PodDeletion:
        """Deletes the job's pod unless it has started, and waits until it is gone (the job's next pod takes its
        name). Deleted at once (no grace period: none of its containers runs, and a kubelet of a node that is gone
        never confirms a graceful deletion) and only as it was read (preconditions: uid and resourceVersion), so a
        pod that changed meanwhile (it may have started) is read again. A pod of that name with another owner is never
        touched (NO_POD). Each call is retried through the API server's trouble; what still fails is raised."""
        def find() -> Coroutine[Any, Any, dict | None]:
            return self.kube.find_pod(namespace, pod)

        for _ in range(5):
            found = await retried(find, timing.RETRY_DELAYS)
            if found is None or owner_of(found) != owner:
                return PodDeletion.NO_POD
            if started(found):
                return PodDeletion.STARTED
            uid = found["metadata"].get("uid", "")
            version = found["metadata"].get("resourceVersion")
            options = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid, "resourceVersion": version}}
            # by uid: its DELETED event may come after the job's next pod (of the same name) exists
            gone = self.deleting.setdefault(uid, asyncio.Event())
            try:
                await retried(lambda: self.kube.delete_pod(namespace, pod, options), timing.RETRY_DELAYS)
            except BaseException as exc:
                # not deleted: a DELETED event of that pod (another deletion, the garbage collector) is the job's end
                self.deleting.pop(uid, None)
                if isinstance(exc, Conflict):
                    continue
                raise
            # deleted: its marker stays until its DELETED event (which may come after the pod is found gone here)
            while not gone.is_set() and (found := await retried(find, timing.RETRY_DELAYS)) is not None \
                    and found["metadata"].get("uid") == uid:
                with contextlib.suppress(TimeoutError):  # looked up again meanwhile, in case its event is missed
                    await asyncio.wait_for(gone.wait(), timing.POD_CHECK_SECONDS)
            return PodDeletion.DELETED
        return PodDeletion.STARTED  # changed at every read: left alone, as a started pod is

    def deleted_by_us(self, uid: str) -> bool:
        """Whether a pod's DELETED event is of an unstarted pod deleted to place its job again (not the job's end);
        its deletion is told it is gone."""
        gone = self.deleting.pop(uid, None)
        if gone is None:
            return False
        gone.set()
        return True
