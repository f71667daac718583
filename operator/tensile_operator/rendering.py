"""What the operator creates for a TrainingJob once it is admitted onto a GPU, built as the operator builds it: its
ResourceClaim (`dra` mode) and its pod. `tensile render` prints it, before anything is applied."""

from __future__ import annotations

from tensile import trainingjob_spec as model
from tensile.errors import TensileUserError
from tensile_operator.claim_fit import choose_claimed
from tensile_operator.claims import GpuAccess, build_claim, claim_name
from tensile_operator.forecasting import Forecaster, JobForecast
from tensile_operator.placement import Booking, Candidate, Gpu, JointPlanner, Ledger, choose
from tensile_operator.pod_creation import admitted_size, context_of, pod_budget
from tensile_operator.pods import DEFAULT_IMAGE, build_pod


def job_forecast(spec: model.JobSpec, forecaster: Forecaster) -> JobForecast | None:
    """The forecast admission would use: the traced model's (None for a stored profile: admitted by its budget)."""
    if spec.workload.model is None:
        return None
    return forecaster.submit(spec.workload, spec.scope).result()


def admitted_objects(body: dict, forecast: JobForecast | None, gpu: Gpu, access: GpuAccess,
                     image: str = DEFAULT_IMAGE) -> list[dict]:
    """The claim (in `dra` mode) and the pod of the TrainingJob `body` admitted alone onto `gpu`."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
    spec = model.parse_spec(body.get("spec") or {}, meta.get("annotations"))
    if spec.workload.model is None and spec.memory_budget is None:
        raise TensileUserError(f"{name}: a job without a forecastable model is admitted by spec.memoryBudget: set it")
    key = f"{namespace}/{name}"
    candidate = Candidate(key, forecast, spec.memory_budget, spec.selector, spec.max_swap_rate)
    decision = (choose_claimed if access.dra else choose)([gpu], Ledger(), candidate, JointPlanner())
    if decision.gpu is None:
        raise TensileUserError(f"{name} would not be admitted: {decision.reason}")
    claim = claim_name(namespace, name, uid) if access.dra else ""
    booking = Booking(key, gpu.uuid, gpu.node, decision.peaks[key], forecast, spec.memory_budget, spec.max_swap_rate,
                      None, spec.plan_events, spec.recompute, decision.claim_bytes, claim)
    pod = build_pod(body, gpu.node, gpu.uuid, gpu.agent, pod_budget(booking), spec.max_swap_rate,
                    forecast.signature if forecast else None, image, spec.plan_events, spec.recompute,
                    claim or None, memory_cap=admitted_size(booking, gpu), context_bytes=context_of(gpu))
    if decision.claim_bytes is None:
        return [pod]
    return [build_claim(body, gpu.uuid, decision.claim_bytes, access), pod]
