"""The agent's state: the jobs of each GPU, their plans (versioned), tokens and what their hooks measured.

One lock guards everything; request handlers and the planning thread hold it only for dictionary
work, never while planning or doing I/O. Nothing is written to disk: a restarted agent rebuilds this
from the hooks, which register again (with their tokens and plan versions) when it answers 404.
"""

from __future__ import annotations

import copy
import hmac
import json
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from tensile.agent_contract import FAILED, NEEDS_WORKLOAD, PLANNED, PLANNING, JobRef, higher
from tensile.latency import LatencyEWMA
from tensile.lru import Lru
from tensile.plan import Plan
from tensile.workload import Workload

from tensile_agent.gpus import GpuInfo, Inventory


@dataclass
class Observed:
    """What the hook reported, folded: totals since registration, latest values otherwise."""

    iterations: int = 0
    peak_bytes: int | None = None  # of every iteration, the unplanned first ones too: what the device held
    planned_peak_bytes: int | None = None  # of the iterations measured under the current plan: what its forecast predicts
    planned_peak_version: int | None = None  # the plan version planned_peak_bytes was measured under
    reserved_peak_bytes: int | None = None  # what the process held (CUDA: max_memory_reserved), when the hook sends it
    iteration_seconds: float | None = None
    vanilla_iteration_seconds: float | None = None  # the hook's own measurement without a plan, the last it sent
    eor: float | None = None  # iteration_seconds / vanilla_iteration_seconds: None until the hook measured a vanilla time
    stall_seconds: float = 0.0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    recompute_bytes: int = 0
    out_of_memory_retries: int = 0  # allocation failures the hook's guard turned into passive evictions and a retry
    plan_version: int | None = None
    signature_match: bool | None = None
    updated_at: float | None = None

    def fold_planned_peak(self, peak: int | None, version: int | None, current: int) -> None:
        """Keep the highest peak measured under the job's current plan `current`: a re-plan changes the
        forecast, so a peak of an earlier plan would skew the observed/forecast ratio. A post under an older
        plan is ignored, one under another version starts over; one without a version (an older hook) folds in."""
        if peak is None or (version is not None and version < current):
            return
        if version is None or version == self.planned_peak_version:
            self.planned_peak_bytes = higher(self.planned_peak_bytes, peak)
        else:
            self.planned_peak_bytes, self.planned_peak_version = peak, version

    def to_dict(self) -> dict:
        """The reported figures (API's ObservedOut); the bookkeeping behind planned_peak_bytes and eor is left out."""
        return {k: v for k, v in self.__dict__.items() if k not in ("planned_peak_version", "vanilla_iteration_seconds")}


@dataclass(frozen=True, slots=True)
class AllocatorForecast:
    """What the job's process reserves in the caching allocator under one plan version (tensile.allocator's model,
    with cuBLAS's workspaces), and the allocator settings it was made with (the hook's, or the assumed ones)."""

    incarnation: int
    version: int
    expandable_segments: bool
    cublas_workspace_bytes: int  # one workspace's size
    reserved_peak_bytes: int
    allocated_peak_bytes: int

    def is_for(self, incarnation: int, version: int, settings: tuple[bool, int]) -> bool:
        """Whether it is the forecast of this registration's plan version with these (expandable segments, workspace)
        settings."""
        return (self.incarnation, self.version, self.expandable_segments, self.cublas_workspace_bytes) == (
            incarnation, version, *settings)

    def to_dict(self) -> dict:
        """The figures as the job's view shows them beside its plan's forecast."""
        return {"scheduled_reserved_peak_bytes": self.reserved_peak_bytes,
                "scheduled_allocated_peak_bytes": self.allocated_peak_bytes,
                "expandable_segments": self.expandable_segments, "cublas_workspace_bytes": self.cublas_workspace_bytes}


@dataclass(eq=False)
class Job:
    ref: JobRef
    gpu: str  # uuid
    token: str
    incarnation: int  # changes on every (re-)registration that changes what is planned
    workload: Workload | None
    signature: str | None
    memory_budget_bytes: int | None
    max_swap_rate: float | None
    recompute: bool
    external: bool
    activations_only: bool  # plans keep to native events (what the hook's native path carries): activation swaps, recomputes of convolutions and batch norms
    # what the hook said of its process's caching allocator (None: not said, an older hook or the operator's
    # registration): tensile_agent.allocator_forecast assumes the rest
    expandable_segments: bool | None = None
    cublas_workspace_bytes: int | None = None
    allocator_cap_bytes: int | None = None  # what its hook capped the caching allocator at (None: no cap said)
    allocator: AllocatorForecast | None = None  # the reserved forecast of the latest plan version it was made for
    latency_source: str | None = None
    ewma: LatencyEWMA | None = None
    planned_sum: float = 0.0  # s of the plan-updating rule: op latencies the current plan was made with
    status: str = PLANNING
    message: str = "waiting for the GPU's planning round"
    plan: Plan | None = None
    version: int = 0
    round: int = 0
    co_planned: list[str] = field(default_factory=list)
    fits: bool | None = None
    budget_bytes: int | None = None  # the GPU budget the round planned for
    gpu_share_bytes: int | None = None  # its share of that budget on a shared GPU (planning.gpu_shares), else None
    body: bytes | None = None  # the plan response, serialized once per version
    observed: Observed = field(default_factory=Observed)
    registered_at: float = field(default_factory=time.time)
    seen_at: float = field(default_factory=time.monotonic)  # its last call with its token (silent-job expiry)
    silence_logged: bool = False  # a tokened job's long silence was logged (once per silence: service.expire_silent)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # guards `ewma`

    @property
    def key(self) -> str:
        return self.ref.key

    @property
    def plannable(self) -> bool:
        return self.workload is not None

    @property
    def vanilla_peak(self) -> int | None:
        return self.plan.forecast.vanilla_peak_bytes if self.plan and self.plan.forecast else None

    @property
    def scheduled_peak(self) -> int | None:
        return self.plan.forecast.scheduled_peak_bytes if self.plan and self.plan.forecast else None

    @property
    def reserved_forecast(self) -> AllocatorForecast | None:
        """The allocator model's forecast for the current plan, None until the planning thread made it."""
        made = self.allocator
        current = made is not None and (made.incarnation, made.version) == (self.incarnation, self.version)
        return made if current else None

    def check_token(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.token.encode())

    def plan_dict_shallow(self) -> dict:
        """The plan response with the Plan object itself (cheap to take under the lock; plans are never
        mutated once committed)."""
        return {
            "job": self.ref.name, "namespace": self.ref.namespace, "gpu": self.gpu, "version": self.version,
            "status": self.status, "message": self.message, "round": self.round, "co_planned": list(self.co_planned),
            "fits": self.fits, "budget_bytes": self.budget_bytes, "plan": self.plan,
            "knobs": {"max_swap_rate": self.max_swap_rate, "memory_budget_bytes": self.memory_budget_bytes,
                      "recompute": self.recompute},
            "gpu_share_bytes": self.gpu_share_bytes,
        }

    @property
    def silent_seconds(self) -> float:
        """Since its last call with its token: a live hook polls its plan twice a second, so a long silence
        means its process is gone (or, for a job the operator registered, its pod has not started yet)."""
        return max(time.monotonic() - self.seen_at, 0.0)

    @staticmethod
    def encode_plan(data: dict) -> bytes:
        """The same JSON as Plan.to_dict(), without dataclasses.asdict's deep copies (a large plan has
        thousands of events)."""
        plan = data["plan"]
        body = None
        if plan is not None:
            f = plan.forecast
            body = {"job": plan.job, "version": plan.version, "signature": plan.signature,
                    "events": [{"job": e.job, "kind": e.kind, "tensor": e.tensor, "trigger": e.trigger, "delay": e.delay,
                                "next_iteration": e.next_iteration} for e in plan.events],
                    "forecast": {"vanilla_peak_bytes": f.vanilla_peak_bytes, "scheduled_peak_bytes": f.scheduled_peak_bytes,
                                 "predicted_iteration_seconds": f.predicted_iteration_seconds,
                                 "predicted_extra_seconds": f.predicted_extra_seconds} if f is not None else None,
                    "memory_budget_bytes": plan.memory_budget_bytes}
        return json.dumps(data | {"plan": body}, separators=(",", ":")).encode()

    def plan_body(self) -> bytes:
        if self.body is None:
            self.body = self.encode_plan(self.plan_dict_shallow())
        return self.body

    def view(self) -> dict:
        """What GET /v1/jobs shows: no token, no events."""
        forecast = self.plan.forecast if self.plan else None
        reserved = self.reserved_forecast
        return {
            "job": self.ref.name, "namespace": self.ref.namespace, "gpu": self.gpu, "status": self.status,
            "message": self.message, "signature": self.signature, "plan_version": self.version, "round": self.round,
            "memory_budget_bytes": self.memory_budget_bytes, "allocator_cap_bytes": self.allocator_cap_bytes,
            "max_swap_rate": self.max_swap_rate, "recompute": self.recompute, "activations_only": self.activations_only,
            "external": self.external, "latency_source": self.latency_source,
            "events": len(self.plan.events) if self.plan else 0,
            "forecast": {
                "vanilla_peak_bytes": forecast.vanilla_peak_bytes,
                "scheduled_peak_bytes": forecast.scheduled_peak_bytes,
                "predicted_iteration_seconds": forecast.predicted_iteration_seconds,
                "predicted_extra_seconds": forecast.predicted_extra_seconds,
            } | (reserved.to_dict() if reserved else {}) if forecast else None,
            "observed": self.observed.to_dict(),
            "registered_at": self.registered_at,
            "gpu_share_bytes": self.gpu_share_bytes,
            "silent_seconds": round(self.silent_seconds, 3),
        }


@dataclass
class GpuRound:
    """The last planning round of one GPU."""

    round: int = 0
    seconds: float = 0.0
    fits: bool | None = None
    message: str = ""
    budget_bytes: int | None = None
    rounds_seconds_total: float = 0.0


class AgentState:
    def __init__(self, inventory: Inventory, node: str | None = None, workload_cache: int = 64) -> None:
        self.inventory = inventory
        # the node's name (--node-name, a DaemonSet's NODE_NAME), else this host's name: what the simulated GPUs'
        # uuids and the TensileNode are named by without one, and /metrics' tensile_agent_info{node} (it was "")
        self.node = node or socket.gethostname()
        self.epoch = secrets.token_hex(4)
        self.started = time.time()
        self.lock = threading.RLock()
        self.jobs: dict[str, Job] = {}
        self.rounds: dict[str, GpuRound] = {uuid: GpuRound() for uuid in inventory.gpus}
        self.replans: Counter[tuple[str, str]] = Counter()  # (gpu, reason) -> rounds
        self.workloads: Lru[str, Workload] = Lru(workload_cache)  # by signature, for signature-only registration
        self._incarnations = 0
        self.changed = threading.Event()  # set on every change the cluster publisher should see
        self.queued_jobs = 0  # jobs waiting for GPU memory: set by the local runner (no operator queues for it)

    def next_incarnation(self) -> int:
        with self.lock:
            self._incarnations += 1
            return self._incarnations

    def gpu(self, uuid: str) -> GpuInfo:
        return self.inventory.gpus[uuid]

    def on_gpu(self, uuid: str) -> list[Job]:
        with self.lock:
            return [j for j in self.jobs.values() if j.gpu == uuid]

    def remember_workload(self, workload: Workload) -> None:
        with self.lock:
            self.workloads.put(workload.signature, workload)

    def known_workload(self, signature: str) -> Workload | None:
        with self.lock:
            workload = self.workloads.get(signature)
        return copy.deepcopy(workload) if workload is not None else None

    def set_status(self, job: Job, status: str, message: str) -> None:
        job.status, job.message, job.body = status, message, None

    def gpu_summary(self, uuid: str) -> dict:
        """Inventory, live figures, committed forecasts and jobs of one GPU (for /v1/gpus, TensileNode)."""
        gpu = self.gpu(uuid)
        used, util = self.inventory.live(uuid)
        with self.lock:
            jobs = self.on_gpu(uuid)
            if gpu.simulated:  # no NVML: what the jobs' hooks measured plus the per-job context the rounds reserve (the
                # preset's or --context-bytes: NVML's figure on the GPU simulated; `tensile local` simulates none)
                seen = [j.observed.peak_bytes for j in jobs if j.observed.peak_bytes is not None]
                used = sum(seen) + gpu.context_bytes * len(seen)
            last = self.rounds.get(uuid, GpuRound())
            vanilla = sum(j.vanilla_peak or 0 for j in jobs)
            scheduled = sum(j.scheduled_peak or 0 for j in jobs)
            fixed = sum(j.memory_budget_bytes or 0 for j in jobs if not j.plannable)
            views = [{"job": j.key, "external": j.external, "status": j.status, "vanilla_peak_bytes": j.vanilla_peak,
                      "scheduled_peak_bytes": j.scheduled_peak, "observed_peak_bytes": j.observed.peak_bytes,
                      "observed_planned_peak_bytes": j.observed.planned_peak_bytes,
                      "observed_reserved_peak_bytes": j.observed.reserved_peak_bytes,
                      "forecast_reserved_peak_bytes": (r.reserved_peak_bytes if (r := j.reserved_forecast) else None),
                      "memory_budget_bytes": j.memory_budget_bytes,
                      "plan_version": j.version} for j in jobs]
        return gpu.to_dict() | {
            "used_bytes": used,
            "utilization": util,
            "jobs_count": len(views),
            "committed": {"vanilla_peak_bytes": vanilla + fixed, "scheduled_peak_bytes": scheduled + fixed},
            "last_round": {"round": last.round, "seconds": last.seconds, "fits": last.fits, "message": last.message,
                           "budget_bytes": last.budget_bytes},
            "jobs": views,
        }


__all__ = ["FAILED", "NEEDS_WORKLOAD", "PLANNED", "PLANNING", "AgentState", "AllocatorForecast", "GpuRound", "Job",
           "Observed"]
