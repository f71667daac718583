"""A TrainingJob's admission into the queue: validated, forecast (trace + plan on the CPU, cached) and queued, or failed
saying why and what to fix."""

from __future__ import annotations

import time

from tensile import trainingjob_spec as model
from tensile.knobs import memory_text
from tensile_operator.capacity import CapacityLedger
from tensile_operator.completion import JobCompletion
from tensile_operator.forecasting import Forecaster, ForecastError, JobForecast
from tensile_operator.metrics import OperatorMetrics
from tensile_operator.pod_creation import PodLauncher
from tensile_operator.pod_state import had_pod
from tensile_operator.queueing import JobQueue, Pending
from tensile_operator.statuses import JobStatuses, condition, job_key
from tensile_operator.validation import unreachable_budget


class JobIntake:
    """Admits new and resumed jobs (Kopf runs one handler per object, concurrently); the scheduler places them."""

    def __init__(self, capacity: CapacityLedger, queue: JobQueue, statuses: JobStatuses, pods: PodLauncher,
                 completion: JobCompletion, forecaster: Forecaster, metrics: OperatorMetrics) -> None:
        self.capacity = capacity
        self.queue = queue
        self.statuses = statuses
        self.pods = pods
        self.completion = completion
        self.forecaster = forecaster
        self.metrics = metrics
        self._admitting: set[str] = set()  # jobs being validated and forecast (`admit`)

    async def admit(self, body: dict) -> None:
        meta = body["metadata"]
        key = job_key(body)
        status = body.get("status") or {}
        self.statuses.remember(body)
        if status.get("phase") in model.FINISHED or meta.get("deletionTimestamp"):
            return
        await self.capacity.ready.wait()
        if status.get("placement"):
            # a pod is made on resume only for a job that never had one: a job whose pod ran and is gone now
            # (ended and cleaned up, or deleted, while no operator ran) is ended by the rebuild, not run again
            # (a job whose GPU went is placed again instead: `Replacement.check_nodes_at_start`)
            # (tracked as a placement's creation is: a look at the job, its GPU gone or it deleted, waits for it)
            booking = self.capacity.booking(key)
            if booking is not None and not had_pod(status) and self.capacity.gone(booking) is None \
                    and self.pods.creation(key) is None:
                self.pods.launch(body, booking, register=False)
            return
        # admitted already, or being admitted: Kopf resumes a job from the body it saw at start-up, which may be one
        # that a re-placement wrote and is admitting (a second admission's "queued" write landed after its placement)
        if key in self._admitting or key in self.queue.pending or self.capacity.booked(key):
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
            await self.statuses.write(namespace, name, {"phase": "Failed", "message": str(exc)},
                                      condition("Validated", False, "InvalidSpec", str(exc)), *noted)
            return
        valid = [condition("Validated", True, "Valid"), *noted]
        # cached: straight to Queued, one status write less
        if self.forecaster.ready(spec.workload, spec.scope, namespace):
            self.statuses.merge(key, valid)
        elif status.get("phase") != "Forecasting":
            forecasting = {"phase": "Forecasting", "message": "tracing and planning on the CPU"}
            await self.statuses.write(namespace, name, forecasting, *valid)
        forecast: JobForecast | None = None
        failure: ForecastError | None = None
        started = time.perf_counter()
        try:
            forecast = await self.forecaster.forecast(spec.workload, spec.scope, namespace)
        except ForecastError as exc:
            failure = exc
        self.metrics.forecast_seconds.observe(time.perf_counter() - started)
        if failure is not None:
            if spec.memory_budget is None:
                self.metrics.admissions.labels("forecast_failed").inc()
                failed = {"phase": "Failed", "message": f"forecast failed: {failure}"}
                await self.statuses.write(namespace, name, failed, condition(
                    "Forecasted", False, "ForecastFailed",
                    f"{failure}; fix spec.workload, or set spec.memoryBudget to admit the job by it"))
                return
            self.statuses.merge(key, [condition("Forecasted", False, "ForecastFailed",
                                                f"{failure}; admitted by spec.memoryBudget")])
        if forecast is None and spec.memory_budget is None:
            self.metrics.admissions.labels("no_budget").inc()
            failed = {"phase": "Failed", "message": "no forecastable workload and no budget"}
            await self.statuses.write(namespace, name, failed, condition(
                "Forecasted", False, "NoProfile",
                f"profile '{spec.workload.profile}' is not stored yet: set spec.memoryBudget to admit the job by it"))
            return
        unreachable = unreachable_budget(spec, forecast)
        if unreachable is not None:
            await self.fail_unreachable(namespace, name, unreachable)
            return
        if forecast is not None:
            conds = [condition("Forecasted", True, "Forecasted", (
                f"forecast from its {forecast.source} workload: peak {memory_text(forecast.vanilla_peak_bytes)} "
                f"without Tensile, {memory_text(forecast.min_peak_bytes)} at the lowest a Tensile plan reaches"))]
            fstatus = forecast.to_status()
        else:
            conds = [] if self.statuses.find(key, "Forecasted") is not None else [
                condition("Forecasted", False, "NoProfile",
                          f"profile '{spec.workload.profile}' not stored yet: admitted by spec.memoryBudget; its first "
                          "run's live workload becomes the profile")]
            fstatus = {"source": "budget"}
        queued = {"phase": "Queued", "message": "waiting for placement", "forecast": fstatus}
        await self.statuses.write(namespace, name, queued, *conds)
        if self.completion.being_deleted(key):  # deleted while it was admitted (a re-placement's): `deleted` has it
            return
        queue = status.get("queue") or {}
        self.queue.pending[key] = Pending(key, namespace, name, body, spec, forecast, since=queue.get("since") or "",
                                          head_since=queue.get("headSince") or "")
        self.queue.poke()

    async def fail_unreachable(self, namespace: str, name: str, problem: model.SpecProblem, *conds: dict) -> None:
        """A budget below the lowest peak any plan reaches for the job's workload: its hook could never keep to it,
        so the job fails (at admission, or when a queued job's budget annotation is lowered to it) naming where the
        budget was set."""
        self.metrics.admissions.labels("budget_unreachable").inc()
        await self.statuses.write(namespace, name, {"phase": "Failed", "message": str(problem)},
                                  condition("Forecasted", True, "BudgetUnreachable", str(problem)), *conds)

    def annotation_conditions(self, key: str, annotations: dict | None) -> list[dict]:
        """`UnknownAnnotations` True while the job has tensile.dev/* annotations that are no knob (a misspelt name is
        ignored, not failed: Kubernetes takes any annotation), False once they are gone; none for a job that never
        had one."""
        unknown = model.unknown_annotations(annotations)
        if unknown:
            return [condition("UnknownAnnotations", True, "Ignored", model.unknown_annotations_message(unknown))]
        if self.statuses.find(key, "UnknownAnnotations", "True") is not None:
            return [condition("UnknownAnnotations", False, "AllKnown",
                              "every tensile.dev/* annotation is one Tensile reads")]
        return []
