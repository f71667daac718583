"""The HTTP API (FastAPI): /v1 routes over `AgentService`, pydantic models mirroring
`tensile.agent_contract`, /healthz, /metrics and the published OpenAPI schema (/openapi.json).

Bodies are size-capped before they are parsed (413) and may be gzip-compressed; malformed bodies get
422, unknown jobs and GPUs 404 with the reason, and a missing / wrong job token 401 / 403. Every
error body is `{"detail": ..., "code": ...}`. A request field the agent does not know is ignored and
answered with a `Warning: 299 - "unknown field \\"x\\""` header (Kubernetes' fieldValidation=Warn):
a newer hook's new field never gets its call refused by an older agent.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from tensile.devices import MAX_BYTES
from tensile.agent_contract import (
    GPU_PATTERN,
    MAX_OP_SAMPLES,
    MAX_SECONDS,
    NAME_PATTERN,
    SIGNATURE_PATTERN,
    TOKEN_HEADER,
    TOKEN_PATTERN,
    WARNING_HEADER,
    BodyTooLarge,
    ContractError,
    JobRef,
    Knobs,
    Measurements,
    RegisterRequest,
    body_cap,
    decode_body,
    decoded_cap,
    plan_etag,
    unknown_field_warning,
)

from tensile_agent import metrics
from tensile_agent.service import AgentService, Problem
from tensile_agent.state import Job

log = logging.getLogger("tensile_agent")
BIG = 2**62  # the most a count may be (amounts of memory: tensile.devices.MAX_BYTES)
INLINE_SAMPLES = 256  # measurements with more op latency samples are folded in a worker thread
MAX_WARNINGS = 20  # Warning headers on one answer (one per unknown field; the rest counted in one more)
MAX_LOGGED_FIELDS = 256  # unknown field names the agent logs (once each) before it stops logging new ones


# ---------------------------------------------------------------------- models (mirror the contract)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Request(_Model):
    """A request body: fields this agent does not know are kept aside (`model_extra`), ignored and warned of
    (Kubernetes' fieldValidation=Warn); known ones are checked as ever (422)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class RegisterIn(_Request):
    job: str = Field(pattern=NAME_PATTERN, max_length=253)
    namespace: str = Field("default", pattern=NAME_PATTERN, max_length=253)
    gpu: str | None = Field(None, pattern=GPU_PATTERN)
    workload: dict[str, Any] | None = Field(None, description="tensile.workload_io JSON (format tensile.workload, version 1)")
    signature: str | None = Field(None, pattern=SIGNATURE_PATTERN)
    memory_budget_bytes: int | None = Field(None, ge=1, le=MAX_BYTES)
    max_swap_rate: float | None = Field(None, gt=0, le=1)
    recompute: bool = True
    token: str | None = Field(None, pattern=TOKEN_PATTERN)
    last_plan_version: int = Field(0, ge=0, le=BIG)
    external: bool = False
    activations_only: bool = Field(False, description="plan native events only (activation swaps, recomputes of convolutions and batch norms): what the hook's native path carries")
    expandable_segments: bool | None = Field(None, description="whether the process's CUDA caching allocator runs "
                                             "with expandable segments; null: the agent assumes so (the pod default)")
    cublas_workspace_bytes: int | None = Field(None, ge=0, le=MAX_BYTES, description="the size of one cuBLAS "
                                               "workspace of the process (0 on the CPU device); null: the GPU "
                                               "preset's default")
    allocator_cap_bytes: int | None = Field(None, ge=0, le=MAX_BYTES, description="the cap on what the process's "
                                            "caching allocator may reserve (its admitted size less its CUDA context); "
                                            "null: no cap (the CPU device, or none set)")


class RegisterOut(_Model):
    job: str
    namespace: str
    gpu: str
    token: str
    status: str
    message: str
    plan_version: int
    created: bool


class ForecastOut(_Model):
    vanilla_peak_bytes: int
    scheduled_peak_bytes: int
    predicted_iteration_seconds: float = 0.0
    predicted_extra_seconds: float = 0.0


class JobForecastOut(ForecastOut):
    """A job's forecast: its plan's, and what its process reserves under it (the allocator model, once computed)."""

    scheduled_reserved_peak_bytes: int | None = None
    scheduled_allocated_peak_bytes: int | None = None
    expandable_segments: bool | None = None
    cublas_workspace_bytes: int | None = None


class EventOut(_Model):
    job: str
    kind: str
    tensor: int
    trigger: int
    delay: float = 0.0
    next_iteration: bool = False


class PlanBody(_Model):
    job: str
    version: int
    signature: str
    events: list[EventOut]
    forecast: ForecastOut | None
    memory_budget_bytes: int | None = Field(None, description="the job's budget the plan was made for: the hook's guard holds to it")


class KnobsOut(_Model):
    max_swap_rate: float | None
    memory_budget_bytes: int | None
    recompute: bool


class PlanOut(_Model):
    job: str
    namespace: str
    gpu: str
    version: int
    status: str
    message: str
    round: int
    co_planned: list[str]
    fits: bool | None
    budget_bytes: int | None
    plan: PlanBody | None
    knobs: KnobsOut = Field(description="the job's knobs as the agent holds them: a hook re-registering after an agent restart sends these")
    gpu_share_bytes: int | None = Field(None, description="the job's share of a GPU it shares: the plan's memory budget "
                                                          "without a budget of its own, and at most this when the jobs cannot fit")


class MeasurementsIn(_Request):
    plan_version: int | None = Field(None, ge=0, le=BIG)
    iterations: int = Field(1, ge=1, le=BIG)
    op_latencies: list[tuple[Annotated[int, Field(ge=0, le=BIG)], Annotated[float, Field(ge=0, le=MAX_SECONDS)]]] = Field(
        default_factory=list, max_length=MAX_OP_SAMPLES, description="sampled [op index, seconds] pairs")
    peak_bytes: int | None = Field(None, ge=0, le=MAX_BYTES)
    planned_peak_bytes: int | None = Field(None, ge=0, le=MAX_BYTES, description="highest peak measured under a plan")
    reserved_peak_bytes: int | None = Field(None, ge=0, le=MAX_BYTES, description="highest memory the process held "
                                            "(CUDA: the caching allocator's max_memory_reserved)")
    iteration_seconds: float | None = Field(None, ge=0, le=MAX_SECONDS)
    vanilla_iteration_seconds: float | None = Field(None, ge=0, le=MAX_SECONDS)
    stall_seconds: float = Field(0.0, ge=0, le=MAX_SECONDS)
    swap_out_bytes: int = Field(0, ge=0, le=MAX_BYTES)
    swap_in_bytes: int = Field(0, ge=0, le=MAX_BYTES)
    recompute_bytes: int = Field(0, ge=0, le=MAX_BYTES)
    out_of_memory_retries: int = Field(0, ge=0, le=BIG, description="allocation failures the hook's guard turned into "
                                                                   "passive evictions and a retry")
    signature_match: bool | None = None


class MeasurementsOut(_Model):
    accepted: bool
    plan_version: int
    replan: bool


class AdmissionIn(_Request):
    """The operator's admission of a job onto one of the agent's GPUs: the pod it runs in, and the job's token."""

    job: str = Field(pattern=NAME_PATTERN, max_length=253)
    namespace: str = Field(pattern=NAME_PATTERN, max_length=253)
    gpu: str = Field(pattern=GPU_PATTERN)
    pod: str = Field(pattern=NAME_PATTERN, max_length=253)
    token: str = Field(pattern=TOKEN_PATTERN)
    memory_budget_bytes: int | None = Field(None, ge=1, le=MAX_BYTES, description="the budget the job was admitted with")


class KnobsIn(_Request):
    max_swap_rate: float | None = Field(None, gt=0, le=1)
    memory_budget_bytes: int | None = Field(None, ge=1, le=MAX_BYTES)
    recompute: bool | None = None


class WorkloadIn(_Request):
    workload: dict[str, Any]


class ObservedOut(_Model):
    iterations: int
    peak_bytes: int | None
    planned_peak_bytes: int | None
    reserved_peak_bytes: int | None
    iteration_seconds: float | None
    eor: float | None
    stall_seconds: float
    swap_out_bytes: int
    swap_in_bytes: int
    recompute_bytes: int
    out_of_memory_retries: int
    plan_version: int | None
    signature_match: bool | None
    updated_at: float | None


class JobOut(_Model):
    job: str
    namespace: str
    gpu: str
    status: str
    message: str
    signature: str | None
    plan_version: int
    round: int
    memory_budget_bytes: int | None
    allocator_cap_bytes: int | None = Field(description="the cap on what the process's caching allocator may reserve, "
                                            "as its hook registered it; null: none said")
    max_swap_rate: float | None
    recompute: bool
    activations_only: bool
    external: bool
    latency_source: str | None
    events: int
    forecast: JobForecastOut | None
    observed: ObservedOut
    registered_at: float
    gpu_share_bytes: int | None = None
    silent_seconds: float = Field(0.0, description="since the job's last call with its token (a live hook polls twice a second)")
    replanning: bool | None = None


class Error(_Model):
    detail: Any
    code: str


ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": Error} for status in (401, 403, 404, 413, 415, 422)}


# ---------------------------------------------------------------------- body limits


_PLAN_PATH = re.compile(r"^/v1/jobs/([^/]+)/([^/]+)/plan$")
_NAME_RE = re.compile(NAME_PATTERN)


class BodyLimit:
    """Pure ASGI: caps each request body by route before anything parses it (413), undoes gzip under a
    second cap (a gzip bomb stops there), and hands the plain body on.

    It also answers the hot path itself: every hook polls its plan at every iteration, so
    GET /v1/jobs/{namespace}/{job}/plan with valid names is served here, without the framework's
    routing and validation (the FastAPI route of the same path documents it and answers the rest)."""

    def __init__(self, app: Any, fast_plan: Any = None) -> None:
        self.app = app
        self.fast_plan = fast_plan

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and self.fast_plan is not None:
            match = _PLAN_PATH.match(path)
            if match and _NAME_RE.match(match.group(1)) and _NAME_RE.match(match.group(2)):
                await self.fast_plan(scope, match.group(1), match.group(2), send)
                return
        cap = body_cap(method, path)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > cap):
            await _send_error(send, 413 if length.isdigit() else 400, "too_large" if length.isdigit() else "bad_request",
                              f"request body over the cap of {cap} bytes for {method} {path}" if length.isdigit() else "bad Content-Length")
            return
        chunks, size = [], 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                await _send_error(send, 413, "too_large", f"request body over the cap of {cap} bytes for {method} {path}")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        encoding = headers.get("content-encoding")
        if encoding and body:
            try:
                body = decode_body(body, encoding, decoded_cap(method, path))
            except BodyTooLarge as exc:
                await _send_error(send, 413, "too_large", str(exc))
                return
            except ContractError as exc:
                await _send_error(send, 415 if exc.field == "Content-Encoding" else 422, "bad_encoding", str(exc))
                return
        new_headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in (b"content-encoding", b"content-length")]
        new_headers.append((b"content-length", str(len(body)).encode()))
        scope = dict(scope, headers=new_headers)
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_error(send: Any, status: int, code: str, detail: str, close: bool = True) -> None:
    import json

    payload = json.dumps({"detail": detail, "code": code}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if close:  # the rest of an oversized body is not read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


# ---------------------------------------------------------------------- the app


def create_app(agent: Any) -> FastAPI:
    """`agent`: a tensile_agent.server.Agent (state, planning, service, metrics registry, publisher)."""
    service: AgentService = agent.service

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        agent.start()
        try:
            yield
        finally:
            await asyncio.to_thread(agent.stop)

    app = FastAPI(title="Tensile node agent", version="v1", lifespan=lifespan,
                  description="Global TENSILE planning for the GPUs of one node (docs/agent.md). Job-scoped calls "
                              f"need the job's token in the {TOKEN_HEADER} header.")
    token_header = APIKeyHeader(name=TOKEN_HEADER, auto_error=False, description="the job's token")

    @app.exception_handler(Problem)
    async def problem(_: Request, exc: Problem) -> JSONResponse:
        return JSONResponse({"detail": exc.detail, "code": exc.code}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in exc.errors()[:20]]
        return JSONResponse({"detail": errors, "code": "bad_request"}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": exc.detail, "code": "http_error"}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    logged: set[tuple[str, str]] = set()
    logged_lock = threading.Lock()

    def warn_unknown(response: Response, what: str, names: list[str]) -> None:
        """One Warning header per ignored field, and a log line at the agent once per (body, field name). Every hook
        poll and post passes here: without unknown fields, nothing is done (no lock taken)."""
        if not names:
            return
        for name in names[:MAX_WARNINGS]:
            response.headers.append(WARNING_HEADER, unknown_field_warning(name))
        if len(names) > MAX_WARNINGS:
            response.headers.append(WARNING_HEADER, f'299 - "{len(names) - MAX_WARNINGS} more unknown fields"')
        with logged_lock:
            new = [n for n in names if (what, n) not in logged][:max(MAX_LOGGED_FIELDS - len(logged), 0)]
            logged.update((what, n) for n in new)
        for name in new:
            log.warning("ignored the unknown field %r in %s (from a newer client? this agent does not know it)",
                        name[:100], what)

    def job_of(namespace: str = Path(pattern=NAME_PATTERN, max_length=253), job: str = Path(pattern=NAME_PATTERN, max_length=253),
               token: str | None = Depends(token_header), authorization: str | None = Header(None)) -> Job:
        return service.job(namespace, job, token, authorization)

    @app.get("/healthz", tags=["agent"])
    async def healthz() -> dict:
        info = service.info()
        return {"status": "ok", "gpus": info["gpus"], "simulated": info["simulated"], "reason": info["reason"]}

    @app.get("/metrics", tags=["agent"], response_class=Response,
             responses={200: {"content": {metrics.CONTENT_TYPE: {}}, "description": "Prometheus text format"}})
    async def prometheus() -> Response:
        body = await asyncio.to_thread(metrics.render, agent.registry)
        return Response(body, media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/info", tags=["agent"])
    async def info() -> dict:
        return service.info()

    @app.get("/v1/gpus", tags=["gpus"])
    def gpus() -> dict:
        inventory = agent.state.inventory
        return {"gpus": [agent.state.gpu_summary(uuid) for uuid in inventory.gpus], "simulated": inventory.simulated,
                "reason": inventory.reason}

    @app.get("/v1/gpus/{gpu}", tags=["gpus"], responses=ERRORS)
    def gpu(gpu: str = Path(pattern=GPU_PATTERN)) -> dict:
        found = agent.state.inventory.find(gpu)
        if found is None:
            raise Problem(404, "unknown_gpu", f"unknown GPU '{gpu}': this agent has {', '.join(agent.state.inventory.gpus) or 'no GPUs'}"
                                              + (f" ({agent.state.inventory.reason})" if agent.state.inventory.reason else ""))
        return agent.state.gpu_summary(found.uuid)

    @app.get("/v1/jobs", tags=["jobs"])
    async def jobs() -> dict[str, list[JobOut]]:
        with agent.state.lock:
            views = [j.view() for j in agent.state.jobs.values()]
        return {"jobs": [JobOut.model_validate(v) for v in views]}

    @app.post("/v1/jobs", tags=["jobs"], responses=ERRORS | {201: {"model": RegisterOut}}, response_model=RegisterOut)
    def register(body: RegisterIn, response: Response, authorization: str | None = Header(None)) -> RegisterOut:
        unknown: list[str] = []
        try:
            request = RegisterRequest.from_dict(body.model_dump(), unknown)
        except ContractError as exc:
            raise Problem(422, "bad_request", str(exc)) from None
        warn_unknown(response, "a registration", unknown)
        result = service.register(request, authorization)
        response.status_code = 201 if result.created else 200
        return RegisterOut.model_validate(result.to_dict())

    @app.post("/v1/admissions", tags=["jobs"], responses=ERRORS)
    def admit(body: AdmissionIn, authorization: str | None = Header(None)) -> dict:
        return service.admit(authorization, JobRef(body.namespace, body.job), body.gpu, body.pod, body.token,
                             body.memory_budget_bytes)

    @app.get("/v1/jobs/{namespace}/{job}", tags=["jobs"], responses=ERRORS)
    async def job_view(job: Job = Depends(job_of)) -> JobOut:
        with agent.state.lock:
            view = job.view()
        return JobOut.model_validate(view)

    @app.delete("/v1/jobs/{namespace}/{job}", tags=["jobs"], responses=ERRORS)
    async def unregister(job: Job = Depends(job_of)) -> dict:
        return service.unregister(job)

    def current_plan(job: Job) -> tuple[str, bytes]:
        with agent.state.lock:
            return plan_etag(agent.state.epoch, job.version, job.round), job.plan_body()

    @app.get("/v1/jobs/{namespace}/{job}/plan", tags=["plans"], response_model=PlanOut,
             responses=ERRORS | {304: {"description": "unchanged since the ETag in If-None-Match"}})
    async def plan(request: Request, job: Job = Depends(job_of)) -> Response:
        etag, body = current_plan(job)
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"ETag": etag})
        return Response(body, media_type="application/json", headers={"ETag": etag, "Cache-Control": "no-cache"})

    async def fast_plan(scope: dict, namespace: str, name: str, send: Any) -> None:
        """The same answer as `plan` above, in raw ASGI (see BodyLimit)."""
        token = match = None
        for key, value in scope.get("headers", ()):
            if key == b"x-tensile-token":
                token = value.decode("latin-1")
            elif key == b"if-none-match":
                match = value.decode("latin-1")
        try:
            job = service.job(namespace, name, token)
        except Problem as exc:
            await _send_error(send, exc.status, exc.code, exc.detail, close=False)
            return
        etag, body = current_plan(job)
        if match == etag:
            await send({"type": "http.response.start", "status": 304, "headers": [(b"etag", etag.encode())]})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"etag", etag.encode()), (b"cache-control", b"no-cache")]})
        await send({"type": "http.response.body", "body": body})

    @app.post("/v1/jobs/{namespace}/{job}/measurements", tags=["plans"], responses=ERRORS)
    async def measurements(body: MeasurementsIn, response: Response, job: Job = Depends(job_of)) -> MeasurementsOut:
        def fold() -> MeasurementsOut:
            data = body.model_dump()
            data["op_latencies"] = [list(pair) for pair in data["op_latencies"]]
            unknown: list[str] = []
            try:
                m = Measurements.from_dict(data, unknown)
            except ContractError as exc:
                raise Problem(422, "bad_request", str(exc)) from None
            warn_unknown(response, "measurements", unknown)
            return MeasurementsOut.model_validate(service.measurements(job, m).to_dict())

        if len(body.op_latencies) <= INLINE_SAMPLES:  # a few samples: cheaper than a thread hop
            return fold()
        return await asyncio.to_thread(fold)

    @app.patch("/v1/jobs/{namespace}/{job}/knobs", tags=["jobs"], responses=ERRORS)
    async def knobs(body: KnobsIn, response: Response, job: Job = Depends(job_of),
                    authorization: str | None = Header(None)) -> JobOut:
        unknown: list[str] = []
        try:
            parsed = Knobs.from_dict(body.model_dump(), unknown)
        except ContractError as exc:
            raise Problem(422, "bad_request", str(exc)) from None
        warn_unknown(response, "knobs", unknown)
        return JobOut.model_validate(await asyncio.to_thread(service.knobs, job, parsed, authorization))

    @app.put("/v1/jobs/{namespace}/{job}/workload", tags=["jobs"], responses=ERRORS)
    def upload_workload(body: WorkloadIn, response: Response, job: Job = Depends(job_of)) -> RegisterOut:
        warn_unknown(response, "a workload upload", sorted(str(k) for k in body.model_extra or {}))
        return RegisterOut.model_validate(service.upload_workload(job, body.workload).to_dict())

    @app.get("/v1/jobs/{namespace}/{job}/workload", tags=["jobs"], responses=ERRORS)
    def get_workload(job: Job = Depends(job_of)) -> dict:
        return service.workload_dict(job)

    app.add_middleware(BodyLimit, fast_plan=fast_plan)
    return app
