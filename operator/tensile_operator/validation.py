"""The checks of the validating webhook: what a CRD schema cannot say. Each problem names its field and fix."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from tensile.errors import TensileUserError
from tensile.knobs import ANNOTATION_PREFIX, MEMORY_BUDGET, unreachable_budget_text
from tensile import trainingjob_spec as model
from tensile_operator.forecasting import Forecaster, ForecastError, JobForecast
from tensile_operator.placement import Gpu
from tensile.zoo import zoo_entry

FORECAST_WAIT_SECONDS = 5.0  # a webhook must answer fast; a slower forecast is checked by the operator


async def check(spec: dict, annotations: dict | None, gpus: list[Gpu], forecaster: Forecaster,
                wait: float = FORECAST_WAIT_SECONDS, namespace: str = "") -> list[model.SpecProblem]:
    """`namespace`: the job's, whose stored profiles it may name."""
    try:
        job = model.parse_spec(spec, annotations)
    except model.SpecError as exc:
        return exc.problems
    problems: list[model.SpecProblem] = []
    workload = job.workload
    budget_field = MEMORY_BUDGET.spec_field
    if workload.model is not None:
        if ".py:" in workload.model:
            problems.append(model.SpecProblem("spec.workload.model", f"'{workload.model}' is a file the operator "
                                              "cannot read; use a zoo model, or spec.workload.profile with "
                                              f"{budget_field}"))
        else:
            try:
                zoo_entry(workload.model)
            except TensileUserError as exc:
                problems.append(model.SpecProblem("spec.workload.model",
                                                  f"{exc}; or use spec.workload.profile with {budget_field}"))
    elif (workload.profile is not None and forecaster.profiles.get(namespace, workload.profile) is None
          and job.memory_budget is None):
        problems.append(model.SpecProblem(budget_field, f"required: profile '{workload.profile}' is not stored yet, "
                                          "so the job is admitted by its budget (e.g. memoryBudget: 8Gi)"))
    if gpus and not job.selector.empty and not any(
            job.selector.matches(g.node, g.uuid, g.name, g.memory_bytes, g.simulated) for g in gpus):
        known = ", ".join(sorted({f"{g.node}/{g.name or g.uuid}" for g in gpus}))
        problems.append(model.SpecProblem("spec.gpuSelector", f"matches no GPU of any TensileNode; the cluster has: {known}"))
    if problems or job.memory_budget is None or workload.model is None:
        return problems
    forecast = forecaster.cached(workload, job.scope)
    if forecast is None:
        try:
            forecast = await asyncio.wait_for(asyncio.shield(forecaster.forecast(workload, job.scope)), wait)
        except (TimeoutError, ForecastError):
            return problems  # the operator checks again once the forecast is done
    unreachable = unreachable_budget(job, forecast)
    if unreachable is not None:
        problems.append(unreachable)
    return problems


def unreachable_budget(job: model.JobSpec, forecast: JobForecast | None) -> model.SpecProblem | None:
    """The job's budget below the lowest peak any plan reaches for its workload, named where it was set (the spec
    or its annotation); None when it is reachable or there is no budget or forecast. The webhook, admission and
    a queued job's budget annotation all check by this. Its forecast planned at full swap rate: no rate is named."""
    if forecast is None or job.memory_budget is None or job.memory_budget >= forecast.min_peak_bytes:
        return None
    return model.SpecProblem(job.budget_field, unreachable_budget_text(job.memory_budget, forecast.min_peak_bytes))


def leaves_the_job_alone(old: Mapping | None, new: Mapping | None) -> bool:
    """An UPDATE that keeps the spec and the tensile.dev/ annotations as they were (finalizers, status, labels, other
    annotations): always allowed. Checked against the cluster as it is now, it could be refused (the job's node gone),
    and a job whose finalizer could not be removed stayed Terminating."""
    if old is None or new is None:
        return False

    def owned(body: Mapping) -> tuple[object, dict]:
        annotations = (body.get("metadata") or {}).get("annotations") or {}
        return body.get("spec"), {k: v for k, v in annotations.items() if k.startswith(ANNOTATION_PREFIX)}

    return owned(old) == owned(new)


NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"  # the node of the pod a service-account token is bound to


def tensilenode_writer_problem(user: Mapping, node: str, agent_accounts: set[str]) -> str | None:
    """Why `user` may not write TensileNode `node`, or None. A node agent's account writes only its own node's: its
    token is bound to a pod of that node (the `node-name` the API server adds, Kubernetes 1.30 and later), so a stolen
    agent credential cannot publish another node's GPUs. Anyone else is left to the cluster's RBAC."""
    if user.get("username") not in agent_accounts:
        return None
    nodes = (user.get("extra") or {}).get(NODE_NAME_EXTRA) or []
    if list(nodes) != [node]:
        bound = ", ".join(nodes) or ("its token names no node: Kubernetes 1.30 or later binds service-account tokens "
                                     "to their pod's node")
        return f"{user.get('username')} may write only the TensileNode of its own node ({bound}), not {node}"
    return None


SERVER_SET = ("resourceVersion", "managedFields", "generation")  # metadata the API server sets on any write


def trainingjob_writer_problem(user: Mapping, old: Mapping | None, new: Mapping | None,
                               agent_accounts: set[str]) -> str | None:
    """Why `user` may not make this write of a TrainingJob (or its status), or None. A node agent's account writes only
    the observed figures (`status.observed`) of a job placed on its own node (its token's `node-name`): the operator
    books capacity from the rest of the status (placement, forecast, reserved bytes), so a stolen agent credential can
    neither move nor resize a booking, nor write the figures of a job on another node. Anyone else is left to RBAC."""
    if user.get("username") not in agent_accounts:
        return None
    meta = (new or old or {}).get("metadata") or {}
    job = f"{meta.get('namespace')}/{meta.get('name')}"
    node = (((old or {}).get("status") or {}).get("placement") or {}).get("node")
    nodes = list((user.get("extra") or {}).get(NODE_NAME_EXTRA) or [])
    if node is None or nodes != [node]:
        return (f"{user.get('username')} may write only the figures of a job placed on its own node "
                f"({', '.join(nodes) or 'its token names no node'}), not of {job} (placed on {node or 'no node'})")

    def beyond_observed(body: Mapping | None) -> dict:
        body = dict(body or {})
        body["metadata"] = {k: v for k, v in (body.get("metadata") or {}).items() if k not in SERVER_SET}
        body["status"] = {k: v for k, v in (body.get("status") or {}).items() if k != "observed"}
        return body

    if beyond_observed(old) != beyond_observed(new):
        return f"{user.get('username')} may write only status.observed of TrainingJob {job}"
    return None


def warnings(annotations: dict | None) -> list[str]:
    """What the webhook warns about (`kubectl` prints each) without refusing the job: misspelt tensile.dev/* annotations."""
    unknown = model.unknown_annotations(annotations)
    return [f"metadata.annotations: {model.unknown_annotations_message(unknown)}"] if unknown else []
