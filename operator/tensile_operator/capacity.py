"""The operator's inventory and capacity ledger: what each GPU has (its TensileNode) and what is booked on it.

The ledger is rebuilt from the TrainingJobs' statuses (the durable record: a placement is written to the status before
its pod exists) at start-up, after a failed scheduling pass and every RESYNC_SECONDS, so a restarted operator, or one
that takes over through peering, starts from what the cluster says.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from tensile import trainingjob_spec as model
from tensile_operator import timing
from tensile_operator.dra_inventory import DraInventory
from tensile_operator.forecasting import Forecaster
from tensile_operator.kube import Kube
from tensile_operator.placement import Booking, Gpu, Ledger, gpus_from_tensilenode
from tensile_operator.pod_state import had_pod, pod_end, pod_holder
from tensile_operator.pods import JOB_LABEL, owner_of, pod_name
from tensile_operator.statuses import job_key

log = logging.getLogger("tensile_operator")
NODE_REMOVED, GPU_REMOVED, GPU_UNPUBLISHED = "TensileNodeRemoved", "GPURemoved", "GPUUnpublished"


@dataclass(frozen=True)
class Gone:
    """Why a job's booked GPU left the inventory: the condition reason (NODE_REMOVED, GPU_REMOVED, GPU_UNPUBLISHED) and
    what went."""

    reason: str
    what: str


@dataclass
class Rebuilt:
    """What a rebuild read, and what it left to settle: the TrainingJobs listed; the jobs whose pod ran and has ended or
    gone unseen (each with its end to write: phase, reason, message), still booked until it is written; the deleted
    jobs whose pod is gone, not booked (their release is still to be told)."""

    listed: list[dict]
    ends: list[tuple[dict, tuple[str, str, str]]] = field(default_factory=list)
    gone: list[tuple[Booking, dict]] = field(default_factory=list)


class CapacityLedger:
    """The GPUs the TensileNodes list and the bookings on them. New placements are booked by the scheduler alone (one
    task: two jobs never take the same memory) and a predecessor's placement seen late is adopted; a job's end, deletion
    or re-placement releases, and a rebuild replaces the bookings."""

    def __init__(self, kube: Kube, forecaster: Forecaster, dra: DraInventory | None = None) -> None:
        self.kube = kube
        self.forecaster = forecaster  # a rebuilt booking's forecast is the cached one of its status's signature
        self.dra = dra  # `dra` mode: the GPUs are the ResourceSlices' devices, TensileNodes add their agents' view
        self._dra_gpus: list[Gpu] = []
        self.ledger = Ledger()
        self.inventory: dict[str, list[Gpu]] = {}
        self.unlisted: set[str] = set()  # TensileNodes whose GPUs are not published yet (they say nothing of them)
        self.ready = asyncio.Event()  # set once the ledger was rebuilt at start-up and the scheduler runs
        self.rebuilt_at = float("-inf")  # loop time of the last rebuild from the statuses
        self._released: set[str] = set()  # jobs released while a rebuild's LIST was in flight
        self._early: dict[str, dict] = {}  # key -> the newest TrainingJob seen before the start-up rebuild ended

    # ---- inventory ------------------------------------------------------------------------------
    @property
    def gpus(self) -> list[Gpu]:
        if self.dra is not None:
            return self._dra_gpus
        return [g for gpus in self.inventory.values() for g in gpus]

    async def refresh_dra(self) -> None:
        """`dra` mode: the devices and claims read again (at start-up, before each scheduling pass and every
        RESYNC_SECONDS)."""
        if self.dra is not None:
            await self.dra.refresh()
            self._merge_dra()

    def slice_changed(self, body: dict | None, name: str) -> None:
        """`dra` mode: a ResourceSlice as its watch delivers it (None: deleted)."""
        if self.dra is not None:
            self.dra.slice_changed(body, name)
            self._merge_dra()

    def _merge_dra(self) -> None:
        """`dra` mode: the GPUs made again from the devices and claims last read and the agents' view from the
        TensileNodes, after either changed (kept: `gpus` is read many times a pass)."""
        if self.dra is not None:
            self._dra_gpus = self.dra.gpus(self.inventory)

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
        """A TensileNode as published now (None: removed)."""
        if body is None:
            self.inventory.pop(name, None)
            self.unlisted.discard(name)
        else:
            self.inventory[name] = gpus_from_tensilenode(body)
            if "gpus" in (body.get("status") or {}):
                self.unlisted.discard(name)
            else:  # created, its status not written yet (its agent writes it next)
                self.unlisted.add(name)
        self._merge_dra()

    def lists(self, node: str) -> bool:
        """Whether the node's TensileNode says which GPUs it has (created again, it says nothing of them until its
        agent writes its status); always in `dra` mode, where the ResourceSlices say it (read at start-up, before
        anything asks)."""
        return self.dra is not None or node not in self.unlisted

    def gone(self, booking: Booking) -> Gone | None:
        """Why a job's booked GPU left the inventory; None while it is listed, or while its TensileNode has not
        published its GPUs yet (created again, it says nothing of them until its agent writes its status). In `dra` mode
        the GPU goes when no ResourceSlice publishes it (by UUID, on its node), whatever TensileNodes say (the slices
        are read at start-up, before the ledger is `ready` and anything asks)."""
        if self.dra is not None:
            if self.dra.publishes(booking.node, booking.gpu):
                return None
            return Gone(GPU_UNPUBLISHED, (
                f"no ResourceSlice publishes GPU {booking.gpu} of node {booking.node} any more (its DRA driver "
                "withdrew it: the device went unhealthy, the node was drained, or the driver restarted without it)"))
        if booking.node not in self.inventory:
            return Gone(NODE_REMOVED, f"TensileNode {booking.node} was removed (its node drained or deleted, or its "
                                      "agent uninstalled)")
        if booking.node in self.unlisted or any(g.uuid == booking.gpu for g in self.inventory[booking.node]):
            return None
        return Gone(GPU_REMOVED, f"GPU {booking.gpu} is no longer listed by TensileNode {booking.node} (it failed, or "
                                 "was reconfigured, e.g. its MIG layout)")

    def nodes_with_gone(self) -> set[str]:
        """The nodes where a job is booked on a GPU that went."""
        return {b.node for b in list(self.ledger.bookings.values()) if self.gone(b) is not None}

    # ---- bookings -------------------------------------------------------------------------------
    def booking(self, key: str) -> Booking | None:
        return self.ledger.bookings.get(key)

    def booked(self, key: str) -> bool:
        return key in self.ledger.bookings

    def bookings(self) -> list[Booking]:
        """The bookings as they are now (a copy: the caller may await while it goes through them)."""
        return list(self.ledger.bookings.values())

    def book(self, booking: Booking) -> None:
        self.ledger.book(booking)

    def release(self, key: str) -> Booking | None:
        """The job's room freed; a rebuild whose LIST is in flight does not book it again."""
        self._released.add(key)
        return self.ledger.release(key)

    def snapshot(self) -> Ledger:
        """A copy of the ledger's bookings, for the joint planner's thread while the event loop goes on."""
        snapshot = Ledger()
        snapshot.bookings = dict(self.ledger.bookings)
        return snapshot

    def rebuild_due(self, now: float) -> bool:
        return now - self.rebuilt_at > timing.RESYNC_SECONDS

    def distrust(self) -> None:
        """The ledger is rebuilt before the next pass (the last one failed)."""
        self.rebuilt_at = float("-inf")

    # ---- rebuilt from the statuses --------------------------------------------------------------
    async def rebuild(self, ending: Callable[[str], bool]) -> Rebuilt:
        """The ledger from the statuses: every job that holds a placement and has not finished (a job
        released while the LIST was in flight stays released: its final status may not be in it).
        A deleted job (kept by its finalizer until its pod is gone) is booked while its pod is still
        there and not terminated: the pod holds the GPU through its grace period. A job whose pod ran and has
        ended, or is gone, while its status still shows it placed (its end was not seen: the operator was down,
        or the write of its end failed) is booked until its end is written (`Rebuilt.ends`; not for a job whose end
        is being written: `ending`), not booked for good by a stale status."""
        ledger = Ledger()
        self._released.clear()
        rebuilt = Rebuilt(await self.kube.list_trainingjobs())
        bookings = [(b, body) for body in rebuilt.listed if (b := self._booking_of(body)) is not None]
        gone: set[str] = set()
        if any(body["metadata"].get("deletionTimestamp") or had_pod(body["status"]) for _, body in bookings):
            pods = {(p["metadata"]["namespace"], *owner): p for p in await self.kube.list_pods(JOB_LABEL)
                    if (owner := owner_of(p)) is not None}
            for booking, body in bookings:
                meta = body["metadata"]
                pod = pods.get((meta["namespace"], meta["name"], meta.get("uid", "")))
                ended = pod is None or pod_holder(pod) == ""
                if meta.get("deletionTimestamp") and ended:
                    gone.add(booking.job)
                elif ended and had_pod(body["status"]) and not ending(booking.job):
                    rebuilt.ends.append((body, pod_end(pod) if pod is not None else ("Failed", "PodDeleted", (
                        f"pod {pod_name(meta['namespace'], meta['name'], meta.get('uid', ''))} disappeared "
                        f"{'and its end was not seen' if self.ready.is_set() else 'while the operator was down'}: "
                        "whether its training finished is unknown; create the TrainingJob again to run it"))))
        for booking, _ in bookings:
            if booking.job not in self._released and booking.job not in gone:
                ledger.book(booking)
        self.ledger = ledger
        rebuilt.ends = [(body, end) for body, end in rebuilt.ends if job_key(body) in ledger.bookings]
        rebuilt.gone = [(booking, body) for booking, body in bookings if booking.job in gone]
        self.rebuilt_at = asyncio.get_running_loop().time()
        return rebuilt

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
            budget, rate = applied.get("memoryBudgetBytes"), applied.get("maxSwapRate")
            recompute = applied.get("recompute", True)
        profile = (spec.get("workload") or {}).get("profile") if forecast is None else None
        claim_bytes = placement.get("claimBytes")
        return Booking(job_key(body), placement["gpu"], placement["node"],
                       int(fstatus.get("reservedBytes") or 0), forecast, budget, rate, profile,
                       placement.get("planEvents", "auto"), recompute,
                       int(claim_bytes) if claim_bytes is not None else None, placement.get("claim", ""))

    def adopt(self, body: dict) -> None:
        """A placement seen in a status but missing from the ledger (a predecessor's write that landed after
        this operator listed the statuses) is booked at once, before the next pass can give its room away."""
        if not self.ready.is_set():  # kept until the start-up rebuild's ledger exists
            self._early[job_key(body)] = body
            return
        booking = self._booking_of(body)
        if booking is None or booking.job in self.ledger.bookings or booking.job in self._released:
            return
        log.warning("%s: placed on %s by an earlier operator after the statuses were read; booked now", booking.job,
                    booking.gpu)
        self.ledger.book(booking)

    def adopt_early(self, finished: set[str]) -> None:
        """The placements seen while the start-up LIST was in flight (it may predate them), but of no job it showed
        `finished`."""
        for key, body in self._early.items():
            if key not in finished:
                self.adopt(body)
        self._early.clear()
