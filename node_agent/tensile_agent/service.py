"""What the agent does for each API call, without the web framework: app.py only maps HTTP onto this.

Every refusal is a `Problem(status, code, detail)`: 404 unknown job / GPU (with the reason), 401/403 a
missing or wrong token, 409 a conflicting registration, 422 a body the contract or the workload
parser rejects. Anything heavier than a dictionary update (parsing a workload, predicting its op
latencies) runs in the caller's worker thread; planning runs in the planning thread.
"""

from __future__ import annotations

import copy
import logging
import math
import secrets
import time
import warnings

from tensile.agent_contract import (
    MAX_SECONDS,
    NEEDS_WORKLOAD,
    PLANNING,
    ContractError,
    JobRef,
    Knobs,
    Measurements,
    MeasurementsResponse,
    RegisterRequest,
    RegisterResponse,
    higher,
)
from tensile.devices import preset_name_for
from tensile.errors import TensileUserError
from tensile.latency import LatencyEWMA
from tensile.workload import Workload
from tensile.workload_io import workload_from_dict, workload_to_dict

from tensile_agent.auth import LOCAL, OPERATOR, POD, Admission, Authenticator, Caller, NoCredential, RegistrationLimits
from tensile_agent.auth import registrations_over
from tensile_agent.planning import ALLOCATOR, PlanningService
from tensile_agent.problems import Problem
from tensile_agent.state import AgentState, Job

log = logging.getLogger("tensile_agent.service")

# catch_warnings is not thread-safe; a module filter is (the warning is attributed to this module)
warnings.filterwarnings("ignore", message="no calibrated latency model", module=__name__)


MAX_TENSOR_BYTES = 2**50


def parse_workload(data: dict, source: str) -> Workload:
    try:
        workload = workload_from_dict(data, source)
    except TensileUserError as exc:
        raise Problem(422, "bad_workload", str(exc)) from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise Problem(422, "bad_workload", f"{source}: malformed workload ({type(exc).__name__}: {exc})") from None
    if not workload.ops:
        raise Problem(422, "bad_workload", f"{source}: a workload needs at least one op")
    for op in workload.ops:  # what workload_from_dict leaves to its callers: numbers the planner sums
        for name in ("latency", "flops"):
            value = getattr(op, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= MAX_SECONDS * 1e9:
                raise Problem(422, "bad_workload", f"{source}: ops[{op.index}].{name} must be a non-negative number (was {value!r:.40})")
            if name == "latency" and value > MAX_SECONDS:
                raise Problem(422, "bad_workload", f"{source}: ops[{op.index}].latency must be at most {MAX_SECONDS:g} s")
        if isinstance(op.bytes_moved, bool) or not isinstance(op.bytes_moved, int) or op.bytes_moved < 0:
            raise Problem(422, "bad_workload", f"{source}: ops[{op.index}].bytes_moved must be a non-negative integer")
    for t in workload.tensors.values():
        if t.size > MAX_TENSOR_BYTES:
            raise Problem(422, "bad_workload", f"{source}: tensor {t.id} has {t.size} bytes, more than any GPU holds")
        for name in ("created_by", "freed_after", "reuses"):
            value = getattr(t, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise Problem(422, "bad_workload", f"{source}: tensor {t.id}.{name} must be an integer or null")
    return workload


def no_gpus_message(reason: str | None) -> str:
    """Why this agent refuses every job, and the fix: `tensile local` simulates a GPU by itself, `tensile agent` only
    when told to."""
    return (f"this agent found no GPU ({reason}): start it with --simulate-gpu NAME:MEMORY (e.g. --simulate-gpu "
            "a6000:48GiB) to plan for a simulated one")


class AgentService:
    """`auth` proves who registers (tensile_agent.auth); `limits` caps the jobs per GPU and per namespace."""

    def __init__(self, state: AgentState, planning: PlanningService, auth: Authenticator | None = None,
                 limits: RegistrationLimits | None = None) -> None:
        self.state = state
        self.planning = planning
        self.auth: Authenticator = auth or NoCredential()
        self.limits = limits or RegistrationLimits()
        self.admissions: dict[str, Admission] = {}  # job key -> the operator's admission (under the state lock)

    # ------------------------------------------------------------------ lookups

    def job(self, namespace: str, name: str, token: str | None, authorization: str | None = None) -> Job:
        """The job a call names, for the holder of its token, or for the pod admitted for it (by the pod's own credential:
        its hook fetches the forecast workload before it has registered and been given the token)."""
        key = f"{namespace}/{name}"
        with self.state.lock:
            job = self.state.jobs.get(key)
        if job is None:
            raise Problem(404, "unknown_job", f"unknown job {key}: register it first (POST /v1/jobs); "
                                              "an agent that restarted has forgotten its jobs until their hooks register again")
        if not job.check_token(token) and not (authorization is not None and self._admitted_pod(job, authorization)):
            if token is None:
                raise Problem(401, "missing_token", "this call needs the job's token in the X-Tensile-Token header")
            raise Problem(403, "wrong_token", f"the token does not match job {key}'s")
        job.seen_at, job.silence_logged = time.monotonic(), False
        return job

    def _gpu(self, ref: str | None) -> str:
        inventory = self.state.inventory
        if not inventory.gpus:
            raise Problem(404, "no_gpus", no_gpus_message(inventory.reason))
        gpu = inventory.find(ref)
        if gpu is None:
            known = ", ".join(f"{g.uuid} (index {g.index})" for g in inventory.gpus.values())
            if ref is None:
                raise Problem(404, "unknown_gpu", f"this node has several GPUs: name one of {known} in 'gpu'")
            raise Problem(404, "unknown_gpu", f"unknown GPU '{ref}': this agent has {known}")
        return gpu.uuid

    # ------------------------------------------------------------------ workloads

    def _prepare(self, workload: Workload, gpu: str) -> tuple[str, LatencyEWMA]:
        """Op latencies (the calibrated model or the prior, unless the hook measured them) and their EWMA."""
        try:
            return self._predict(workload, gpu)
        except Problem:
            raise
        except Exception as exc:  # noqa: BLE001 - a workload the latency model cannot read is the sender's problem
            raise Problem(422, "bad_workload", f"cannot predict the workload's op latencies: {type(exc).__name__}: {exc}") from None

    def _predict(self, workload: Workload, gpu: str) -> tuple[str, LatencyEWMA]:
        source = "given"
        if not any(op.latency > 0 for op in workload.ops):
            from tensile.latency import assign_latencies

            device = preset_name_for(self.state.gpu(gpu).name) or "cuda"
            try:  # "prior" (uncalibrated) is reported per job in latency_source, not warned about per call
                source = assign_latencies(workload, device, warn=False)
            except TensileUserError:
                source = assign_latencies(workload, "cuda", warn=False)
        return source, LatencyEWMA(workload)

    # ------------------------------------------------------------------ calls

    def admit(self, authorization: str | None, ref: JobRef, gpu_ref: str, pod: str, token: str,
              budget: int | None = None) -> dict:
        """The operator's word that `pod` runs job `ref` on GPU `gpu_ref` of this node with `token` and at most
        `budget` bytes: that pod's registration of that job, and only its, is then accepted (given the job's token)."""
        if self.auth.identify(authorization).kind not in (OPERATOR, LOCAL):
            raise Problem(403, "not_the_operator", "only the operator admits jobs onto this agent's GPUs")
        gpu = self._gpu(gpu_ref)
        with self.state.lock:
            self.admissions[ref.key] = Admission(pod, gpu, token, budget)
        return {"admitted": True, "job": ref.name, "namespace": ref.namespace, "gpu": gpu, "pod": pod}

    def _admitted_pod(self, job: Job, authorization: str) -> bool:
        """Whether the caller proves to be the pod the operator admitted for `job`."""
        try:
            caller = self.auth.identify(authorization)
        except Problem:
            return False
        if caller.kind != POD:
            return False
        with self.state.lock:
            admission = self.admissions.get(job.key)
        return admission is not None and caller.namespace == job.ref.namespace and admission.pod == caller.pod

    def _admission(self, ref: JobRef, gpu: str, caller: Caller) -> Admission:
        """A pod's registration: of the job the operator admitted with this pod's name, in its namespace, onto `gpu`."""
        with self.state.lock:
            admission = self.admissions.get(ref.key)
        if admission is None or caller.namespace != ref.namespace or admission.pod != caller.pod:
            raise Problem(403, "not_admitted", f"pod {caller.namespace}/{caller.pod} was not admitted for job {ref.key} "
                                               "on this agent: a pod registers only the job the operator placed it for")
        if admission.gpu != gpu:
            raise Problem(403, "not_admitted", f"job {ref.key} was admitted onto GPU {admission.gpu}, not {gpu}")
        return admission

    @staticmethod
    def _within_admission(request: RegisterRequest, admission: Admission) -> None:
        """A pod's registration keeps to the budget its job was admitted with (its neighbours' room): none given is
        that budget, more is refused."""
        if admission.budget is None:
            return
        if request.memory_budget_bytes is not None and request.memory_budget_bytes > admission.budget:
            raise Problem(403, "over_admitted_budget", f"memory_budget_bytes: {request.memory_budget_bytes} is more than "
                                                       f"job {request.ref.key} was admitted with, {admission.budget}")
        request.memory_budget_bytes = request.memory_budget_bytes or admission.budget

    def register(self, request: RegisterRequest, authorization: str | None = None) -> RegisterResponse:
        caller = self.auth.identify(authorization)  # before anything of the request is looked at
        try:
            request.validate()
        except ContractError as exc:
            raise Problem(422, "bad_request", str(exc)) from None
        ref = request.ref
        gpu = self._gpu(request.gpu)
        admission = self._admission(ref, gpu, caller) if caller.kind == POD else None
        workload = parse_workload(request.workload, f"workload of {ref.key}") if request.workload is not None else None
        if workload is not None and request.signature is not None and workload.signature != request.signature:
            raise Problem(422, "bad_request", f"signature: {request.signature} does not match the workload's {workload.signature}")
        signature = workload.signature if workload is not None else request.signature
        if workload is None and signature is not None:
            workload = self.state.known_workload(signature)
        with self.state.lock:
            existing = self.state.jobs.get(ref.key)
            if existing is None or existing.gpu != gpu:
                on_gpu = self.state.on_gpu(gpu)
                registrations_over(self.limits, len(on_gpu), sum(1 for j in on_gpu if j.ref.namespace == ref.namespace),
                                   gpu, ref.namespace)
        if admission is not None:  # the job's token is the operator's: its later calls and the pod's are the job's
            request.token = admission.token
            self._within_admission(request, admission)
        if existing is not None:  # what a registration leaves unsaid of the allocator stays as said before
            if request.expandable_segments is None:
                request.expandable_segments = existing.expandable_segments
            if request.cublas_workspace_bytes is None:
                request.cublas_workspace_bytes = existing.cublas_workspace_bytes
            if request.allocator_cap_bytes is None and existing.gpu == gpu:  # a cap is its GPU's admission's
                request.allocator_cap_bytes = existing.allocator_cap_bytes
        if existing is not None:
            if caller.kind == OPERATOR:
                pass  # the operator placed the job (again): its registration stands for the job's
            elif request.token is None or not existing.check_token(request.token):
                raise Problem(403, "wrong_token", f"a job named {ref.key} is registered already, under another token (a run "
                                                  "still going, or one stopped less than the agent's --expire-silent-jobs ago, "
                                                  "300 s by default: the agent forgets a job that registered by itself once it "
                                                  "has been silent that long)")
            if (existing.gpu == gpu and existing.signature == signature and existing.memory_budget_bytes == request.memory_budget_bytes
                    and existing.max_swap_rate == request.max_swap_rate and existing.recompute == request.recompute
                    and existing.activations_only == request.activations_only
                    and (existing.workload is not None or workload is None)):
                # nothing the plan depends on changed: a retry, or the pod's hook saying its allocator's settings
                # after the operator's registration (a new reserved forecast for the same plan, no round)
                self._take_allocator_settings(existing, request)
                return self._response(existing, created=False)
        latency_source, ewma = (None, None)
        if workload is not None:
            original, workload = workload, copy.deepcopy(workload)  # the planning thread writes latencies into its copy
            latency_source, ewma = self._prepare(workload, gpu)
            self.state.remember_workload(original)
        token = request.token or (existing.token if existing else secrets.token_urlsafe(24))
        external = request.external if caller.kind == LOCAL else False  # a proved caller's job is the operator's
        job = Job(ref=ref, gpu=gpu, token=token, incarnation=self.state.next_incarnation(), workload=workload,
                  signature=signature, memory_budget_bytes=request.memory_budget_bytes, max_swap_rate=request.max_swap_rate,
                  recompute=request.recompute, external=external, activations_only=request.activations_only,
                  expandable_segments=request.expandable_segments,
                  cublas_workspace_bytes=request.cublas_workspace_bytes,
                  allocator_cap_bytes=request.allocator_cap_bytes,
                  latency_source=latency_source, ewma=ewma,
                  planned_sum=ewma.corrected_sum() if ewma else 0.0)
        if existing is not None:  # plan versions go on from the job's previous registration
            job.version, job.plan, job.observed = existing.version, existing.plan, existing.observed
        job.version = max(job.version, request.last_plan_version)
        if workload is None:
            job.status, job.message = NEEDS_WORKLOAD, (f"signature {signature} is not known to this agent: "
                                                       f"upload the workload (PUT /v1/jobs/{ref.namespace}/{ref.name}/workload)")
        with self.state.lock:
            self.state.jobs[ref.key] = job
        self.planning.request(gpu, "register")
        if existing is not None and existing.gpu != gpu:
            self.planning.request(existing.gpu, "unregister")
        self.state.changed.set()
        return self._response(job, created=existing is None)

    def _take_allocator_settings(self, job: Job, request: RegisterRequest) -> None:
        """The allocator's settings a registration says, where they differ from the job's: its reserved forecast is
        made again for them (`PlanningService.request(..., ALLOCATOR)`), its plan kept. Its cap is taken as said: it
        is shown beside the forecast, not part of it."""
        with self.state.lock:
            job.allocator_cap_bytes = request.allocator_cap_bytes
            if (job.expandable_segments, job.cublas_workspace_bytes) == (request.expandable_segments,
                                                                        request.cublas_workspace_bytes):
                return
            job.expandable_segments = request.expandable_segments
            job.cublas_workspace_bytes = request.cublas_workspace_bytes
            job.allocator = None
        self.planning.request(job.gpu, ALLOCATOR)

    def _response(self, job: Job, created: bool) -> RegisterResponse:
        return RegisterResponse(job=job.ref.name, namespace=job.ref.namespace, gpu=job.gpu, token=job.token,
                                status=job.status, message=job.message, plan_version=job.version, created=created)

    def upload_workload(self, job: Job, data: dict) -> RegisterResponse:
        original = parse_workload(data, f"workload of {job.key}")
        workload = copy.deepcopy(original)
        source, ewma = self._prepare(workload, job.gpu)
        self.state.remember_workload(original)
        with self.state.lock:
            job.workload, job.signature, job.latency_source, job.ewma = workload, workload.signature, source, ewma
            job.planned_sum = ewma.corrected_sum()
            job.incarnation = self.state.next_incarnation()
            self.state.set_status(job, PLANNING, "workload received: waiting for the GPU's planning round")
        self.planning.request(job.gpu, "workload")
        return self._response(job, created=False)

    def knobs(self, job: Job, knobs: Knobs, authorization: str | None = None) -> dict:
        """The operator's knobs for the job (its TrainingJob's annotations): a job's own hook may not raise its budget."""
        if self.auth.identify(authorization).kind not in (OPERATOR, LOCAL):
            raise Problem(403, "not_the_operator", "a job's knobs are its TrainingJob's: only the operator changes them")
        changed = False
        with self.state.lock:
            admission = self.admissions.get(job.key)
            if admission is not None and knobs.memory_budget_bytes is not None:
                admission.budget = knobs.memory_budget_bytes
            for name in ("max_swap_rate", "memory_budget_bytes", "recompute"):
                value = getattr(knobs, name)
                if value is not None and getattr(job, name) != value:
                    setattr(job, name, value)
                    changed = True
        if changed:
            self.planning.request(job.gpu, "knobs")
            self.state.changed.set()
        return job.view() | {"replanning": changed}

    def measurements(self, job: Job, m: Measurements) -> MeasurementsResponse:
        n = len(job.workload.ops) if job.workload is not None else 0
        bad = next((i for i, (index, _) in enumerate(m.op_latencies) if index >= n), None)
        if bad is not None:
            raise Problem(422, "bad_request", f"op_latencies[{bad}]: op index {m.op_latencies[bad][0]} is not an op of the "
                                              f"job's workload ({n} ops)")
        with self.state.lock:
            o = job.observed
            o.iterations += m.iterations
            o.peak_bytes = higher(o.peak_bytes, m.peak_bytes)
            o.fold_planned_peak(m.planned_peak_bytes, m.plan_version, job.version)
            o.reserved_peak_bytes = higher(o.reserved_peak_bytes, m.reserved_peak_bytes)
            if m.vanilla_iteration_seconds:
                o.vanilla_iteration_seconds = m.vanilla_iteration_seconds
            if m.iteration_seconds is not None:
                o.iteration_seconds = m.iteration_seconds
                # only against a vanilla time the hook measured: time / (time - stalls) read ~1.0 whatever the plan
                # cost (recomputes, swap copies and the hook's own work are no stalls), so it is not exported at all
                base = o.vanilla_iteration_seconds
                eor = m.iteration_seconds / base if base is not None and base > 1e-9 else None
                o.eor = eor if eor is not None and math.isfinite(eor) else None
            o.stall_seconds += m.stall_seconds
            o.swap_out_bytes += m.swap_out_bytes
            o.swap_in_bytes += m.swap_in_bytes
            o.recompute_bytes += m.recompute_bytes
            o.out_of_memory_retries += m.out_of_memory_retries
            if m.plan_version is not None:
                o.plan_version = m.plan_version
            if m.signature_match is not None:
                o.signature_match = m.signature_match
            o.updated_at = time.time()
        replan = self.planning.observe(job, m.op_latencies)
        self.state.changed.set()
        return MeasurementsResponse(accepted=True, plan_version=job.version, replan=replan)

    def unregister(self, job: Job) -> dict:
        with self.state.lock:
            if self.state.jobs.get(job.key) is job:
                del self.state.jobs[job.key]
                self.admissions.pop(job.key, None)
        self.planning.request(job.gpu, "unregister")
        self.state.changed.set()
        return {"removed": True, "job": job.ref.name, "namespace": job.ref.namespace}

    def expire_silent(self, seconds: float) -> list[str]:
        """Unregister external jobs (a hook the operator did not place: `tensile run --agent`) that made no call
        for `seconds`: their process died before it could unregister (SIGKILL, a crash), and their scheduled
        peak would hold the GPU's room for good. The operator unregisters the jobs it placed when their pods go;
        a hook that was only silent registers again at its next call (its client does so on 404). A job registered
        with a token is the operator's: it books the job's share on the GPU until the pod goes, so dropping it here
        would free room the operator still counts as taken; its silence is logged once and shown instead
        (`silent_seconds` in the job's view, `tensile_job_silent_seconds`)."""
        now = time.monotonic()
        with self.state.lock:
            silent = [job for job in self.state.jobs.values() if now - job.seen_at > seconds]
            placed = [job for job in silent if not job.external and not job.silence_logged]
            for job in placed:
                job.silence_logged = True
        for job in placed:  # the operator's (it books the job's share): shown (silent_seconds), said once, kept
            log.warning("job %s, registered with the operator's token, made no call for %.0f s: kept (the operator "
                        "unregisters it when its pod goes; tensile_job_silent_seconds shows how long)", job.key, now - job.seen_at)
        expired = [job for job in silent if job.external]
        for job in expired:
            log.warning("job %s made no call for %.0f s (its process is gone?): unregistered", job.key, now - job.seen_at)
            self.unregister(job)
        return [job.key for job in expired]

    def workload_dict(self, job: Job) -> dict:
        if job.workload is None:
            raise Problem(404, "no_workload", f"job {job.key} has no workload yet (registered by signature {job.signature})")
        return workload_to_dict(job.workload)

    def info(self) -> dict:
        inventory = self.state.inventory
        return {"api_version": "v1", "node": self.state.node, "epoch": self.state.epoch, "started": self.state.started,
                "gpus": len(inventory.gpus), "simulated": inventory.simulated, "reason": inventory.reason,
                "jobs": len(self.state.jobs), "planning_idle": self.planning.idle()}


__all__ = ["AgentService", "JobRef", "Problem"]
