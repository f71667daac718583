"""Forecasts on the CPU, cached: a hundred TrainingJobs of one model cost one trace and one plan.

Two caches: the trace cache maps a workload spec (model, batch, shape, optimizer, dtype, ...) to the
traced workload's signature; the forecast cache maps a signature to the workload and its standalone
forecast (vanilla peak, lowest reachable scheduled peak). Both are also keyed by the events the plan may
use (`PlanScope`: native events only, a job's planEvents on its device; recompute, its
scheduling.recompute): that changes the lowest reachable peak, not the trace, so a spec forecast in
several scopes is traced once (the traced workloads are kept by spec). Traces run one at a time on a worker thread
(tracing is CPU-bound and the operator shares its cores); concurrent requests for the same key wait
for the one trace in flight. Stored profiles (a job's live workload, uploaded after its first run)
are workloads by namespace and name, kept in memory and, when a directory is configured, on disk (a folder per
namespace): a job names only the profiles of its own namespace.

The caches keep the CACHED_WORKLOADS most recently used entries each: a forecast holds 0.6 MB (VGG-16)
to 23 MB (BERT-base, GPT-2) of memory at batch 16 (tracemalloc, after a collection), so an operator that
kept every distinct spec a cluster ever ran (a batch-size sweep makes one per job) would grow into its
pod's memory limit. A spec evicted and seen again is traced again; a placed job's booking holds its own
forecast, so nothing admitted depends on the cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tensile.admission import allocator_slack
from tensile.cublas_workspaces import DEFAULT_WORKSPACE_SIZES
from tensile.lru import Lru
from tensile_operator.heap import freeze_long_lived
from tensile.trainingjob_spec import PlanScope, WorkloadSpec
from tensile.workload import Workload

log = logging.getLogger("tensile_operator.forecast")
DEFAULT_BANDWIDTH = 25e9  # bytes/s per direction, the A6000 preset's link, for a GPU that publishes none
CACHED_WORKLOADS = 32  # entries per cache (see the module's docstring)


class ForecastError(Exception):
    """The workload could not be traced or planned; the message is for the job's condition."""


@dataclass(frozen=True)
class JobForecast:
    """What admission needs about one workload, planned alone on a GPU."""

    signature: str
    workload: Workload
    vanilla_peak_bytes: int
    min_peak_bytes: int  # lowest scheduled peak any plan reaches alone (swaps as far as they go)
    predicted_iteration_seconds: float
    source: str  # "traced" or "profile"
    scope: PlanScope  # the events it was planned with, as the job's hook will plan
    # what the caching allocator reserves beyond the tensors' peak (tensile.admission.allocator_slack), by the size of
    # one cuBLAS workspace, for each size a GPU may book (tensile.cublas_workspaces.DEFAULT_WORKSPACE_SIZES;
    # placement.slack_of picks the GPU's): made with the forecast, off the event loop, since placement reads it inline
    allocator_slack_bytes: Mapping[int, int]

    def to_status(self) -> dict:
        return {
            "signature": self.signature,
            "vanillaPeakBytes": self.vanilla_peak_bytes,
            "minPeakBytes": self.min_peak_bytes,
            "predictedIterationSeconds": round(self.predicted_iteration_seconds, 6),
            "source": self.source,
            **self.scope.to_status(),
        }


def _standalone(workload: Workload, source: str, bandwidth: float, scope: PlanScope) -> JobForecast:
    from tensile.latency.predict import assign_latencies
    from tensile.peak import analyze_vanilla
    from tensile.planner import plan_job

    # which source (calibrated or the prior) is the forecast's own concern, not a warning on every job
    assign_latencies(workload, "cuda" if workload.device == "cuda" else "cpu", warn=False)
    vanilla = analyze_vanilla(workload).peak_bytes
    planned = plan_job(workload, bandwidth, activations_only=scope.activations_only, recompute=scope.recompute)
    return JobForecast(
        signature=workload.signature,
        workload=workload,
        vanilla_peak_bytes=vanilla,
        min_peak_bytes=min(vanilla, planned.scheduled_peak_bytes),
        predicted_iteration_seconds=sum(op.latency for op in workload.ops),
        source=source,
        scope=scope,
        allocator_slack_bytes={size: allocator_slack(workload, size) for size in DEFAULT_WORKSPACE_SIZES},
    )


def _trace(spec: WorkloadSpec) -> Workload:
    from tensile.forecast import trace_workload

    return trace_workload(
        spec.model or "",
        spec.batch_size,
        optimizer=spec.optimizer,
        dtype=spec.dtype,
        device=spec.device,
        micro_batches=spec.micro_batches,
        input_shape=spec.input_shape,
    )


class ProfileStore:
    """Workloads by namespace and profile name (what a job without a forecastable model ran, measured live). A namespace
    is a tenant: its jobs neither read nor replace another namespace's profile of the same name."""

    def __init__(self, directory: str | Path | None = None):
        self.directory = Path(directory) if directory else None
        # with a directory the files are the store and memory keeps the most recently used; without
        # one, memory is the only copy and keeps them all
        self._profiles: Lru[tuple[str, str], Workload] = Lru(CACHED_WORKLOADS if self.directory else sys.maxsize)

    def _file(self, namespace: str, name: str) -> Path | None:
        """The profile's file in its namespace's folder; None without a directory, or without a namespace (the store's
        top folder is no namespace's)."""
        if self.directory is None or not namespace:
            return None
        return self.directory / namespace / f"{name}.json.gz"

    def get(self, namespace: str, name: str) -> Workload | None:
        key = (namespace, name)
        path = self._file(namespace, name)
        if key not in self._profiles and path is not None and path.exists():
            from tensile.workload_io import load_workload

            self._profiles.put(key, load_workload(str(path)))
        return self._profiles.get(key)

    def put(self, namespace: str, name: str, workload: Workload) -> None:
        if not namespace:
            raise ValueError(f"profile {name!r}: a profile is stored in the namespace of the job that ran it")
        self._profiles.put((namespace, name), workload)
        path = self._file(namespace, name)
        if path is not None:
            from tensile.workload_io import save_workload

            path.parent.mkdir(parents=True, exist_ok=True)
            save_workload(workload, str(path))


class Forecaster:
    """Single-flight, cached forecasts; safe to share between operator runs in one process."""

    def __init__(self, profiles: ProfileStore | None = None, bandwidth: float = DEFAULT_BANDWIDTH,
                 capacity: int = CACHED_WORKLOADS):
        self.profiles = profiles or ProfileStore()
        self.bandwidth = bandwidth
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensile-forecast")
        self._lock = threading.Lock()
        self._by_key: Lru[tuple, concurrent.futures.Future[JobForecast]] = Lru(capacity)  # (spec key, scope)
        self._by_signature: Lru[tuple[str, PlanScope], JobForecast] = Lru(capacity)
        self._traced: Lru[tuple, Workload] = Lru(capacity)  # spec key -> its traced workload, whatever the scope
        self.traces = 0  # how many traces really ran (tests and benchmarks read it)

    def cached(self, spec: WorkloadSpec, scope: PlanScope) -> JobForecast | None:
        future = self._by_key.get((spec.key, scope))
        if future is not None and future.done() and not future.cancelled() and future.exception() is None:
            return future.result()
        return None

    def by_signature(self, signature: str, scope: PlanScope) -> JobForecast | None:
        return self._by_signature.get((signature, scope))

    def _compute(self, spec: WorkloadSpec, scope: PlanScope) -> JobForecast:
        try:
            workload = self._traced.get(spec.key)  # traced already, for another scope
            if workload is None:
                workload = _trace(spec)
                self._traced.put(spec.key, workload)
                self.traces += 1
            found = self._by_signature.get((workload.signature, scope))
            if found is not None:
                return found
            forecast = _standalone(workload, "traced", self.bandwidth, scope)
        except Exception as exc:  # noqa: BLE001 - any failure becomes the job's condition
            log.warning("forecast of %s failed: %s", spec, exc)
            raise ForecastError(f"{type(exc).__name__}: {exc}") from exc
        self._by_signature.put((forecast.signature, scope), forecast)
        freeze_long_lived()
        return forecast

    def submit(self, spec: WorkloadSpec, scope: PlanScope) -> concurrent.futures.Future[JobForecast]:
        key = (spec.key, scope)
        with self._lock:
            future = self._by_key.get(key)
            if future is None or (future.done() and (future.cancelled() or future.exception() is not None)):
                future = self._executor.submit(self._compute, spec, scope)
                self._by_key.put(key, future)
            return future

    async def forecast(self, spec: WorkloadSpec, scope: PlanScope, namespace: str = "") -> JobForecast | None:
        """The spec's forecast, planned with the events of `scope` (model.JobSpec's); None when the
        workload is a profile not stored yet (admit by budget). `namespace`: the job's, whose profiles it may name (a
        model's forecast does not depend on it)."""
        if spec.model is None:
            return await self.from_profile(namespace, spec.profile or "", scope)
        # shielded: a cancelled waiter (an operator stopping) must not cancel the shared trace
        return await asyncio.shield(asyncio.wrap_future(self.submit(spec, scope)))

    async def from_profile(self, namespace: str, name: str, scope: PlanScope) -> JobForecast | None:
        workload = self.profiles.get(namespace, name)
        if workload is None:
            return None
        found = self._by_signature.get((workload.signature, scope))
        if found is None:
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(self._executor, _standalone, workload, "profile", self.bandwidth, scope)
            self._by_signature.put((found.signature, scope), found)
            freeze_long_lived()
        return found

    def ready(self, spec: WorkloadSpec, scope: PlanScope, namespace: str = "") -> bool:
        """Whether `forecast(spec, scope, namespace)` answers at once (no trace or plan to wait for)."""
        if spec.model is not None:
            return self.cached(spec, scope) is not None
        workload = self.profiles.get(namespace, spec.profile or "")
        return workload is None or (workload.signature, scope) in self._by_signature

    def store_profile(self, namespace: str, name: str, workload: Workload) -> None:
        self.profiles.put(namespace, name, workload)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
