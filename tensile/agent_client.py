"""The node agent's client, for the runtime hook and the operator: standard library only (urllib).

The hook holds one `AgentClient` per job and calls it at iteration boundaries:

    client = AgentClient.from_env()                    # TENSILE_AGENT, TENSILE_JOB, TENSILE_TOKEN_FILE, TENSILE_GPU
    client.register(workload=w, memory_budget_bytes=b) # or signature=...; then upload_workload(w) if asked
    plan, changed = client.poll()                      # at each iteration boundary: cheap (ETag -> 304)
    client.post_measurements(Measurements(...))        # every few iterations
    client.unregister()                                # at exit

It never lets the agent cost the training run: every call has a short timeout and a few quick retries
with exponential backoff; once those are spent the client stops calling for a while (doubling, up
to `max_backoff` seconds), keeps the last plan it had and answers from it. When the agent answers
404 "unknown job" (it restarted and lost its state) the client registers again with what it
registered before, its token and its plan version, and repeats the call.

Every call carries the caller's credential (`Authorization: Bearer`, read from TENSILE_TOKEN_FILE: in a pod its
projected service-account token, in local mode the runner's secret); the agent asks for it to register a job.
The operator uses the module functions `admit`, `register`, `update_knobs`, `unregister` and `live_workload`.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import re
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tensile.agent_contract import (
    ETAG_HEADER,
    FAILED,
    NEEDS_WORKLOAD,
    TOKEN_HEADER,
    WARNING_HEADER,
    JobRef,
    Measurements,
    MeasurementsResponse,
    PlanResponse,
    RegisterRequest,
    RegisterResponse,
    encode_body,
    job_path,
    jobs_path,
    strict_knobs,
)

if TYPE_CHECKING:
    from tensile.plan import Plan
    from tensile.workload import Workload

_WARNING = re.compile(r'^\d{3} \S+ "((?:[^"\\]|\\.)*)"')  # warn-code warn-agent "warn-text" [date]

log = logging.getLogger("tensile.agent_client")
RETRY_STATUSES = (429, 502, 503, 504)
_warned: set[str] = set()  # the agent's Warning headers already logged, once each per process
_warned_lock = threading.Lock()
MAX_WARNINGS_LOGGED = 100  # distinct warnings logged at most (an agent could send a new one with every answer)


def agent_warnings(values: list[str]) -> list[str]:
    """The texts of HTTP `Warning` header values (RFC 7234: `299 - "unknown field \\"x\\""`), unquoted."""
    texts = []
    for value in values:
        match = _WARNING.match(value.strip())
        texts.append(re.sub(r"\\(.)", r"\1", match.group(1)) if match else value.strip())
    return texts


def _log_warnings(where: str, values: list[str]) -> None:
    """Each warning the agent answers with, logged once (a newer hook's field an older agent ignores is said once,
    not at every poll)."""
    for text in agent_warnings(values):
        with _warned_lock:
            if text in _warned or len(_warned) >= MAX_WARNINGS_LOGGED:
                continue
            _warned.add(text)
        log.warning("tensile: the node agent at %s warns: %s", where, text)


class AgentError(Exception):
    """The agent answered with an error the client cannot retry away (status and the agent's reason)."""

    def __init__(self, status: int, detail: str, code: str | None = None) -> None:
        super().__init__(f"agent answered {status}: {detail}")
        self.status = status
        self.detail = detail
        self.code = code


class AgentUnreachable(Exception):
    """No answer from the agent (connection refused, timeout, or 5xx after the retries)."""


def _workload_dict(workload: Any) -> dict | None:
    if workload is None or isinstance(workload, dict):
        return workload
    from tensile.workload_io import workload_to_dict

    return workload_to_dict(workload)


Credential = Callable[[], "str | None"]  # who the caller is, for `Authorization: Bearer`, read at each call


def credential_file(path: str | None) -> Credential | None:
    """The credential in the file at `path`, read at each call: a projected service-account token, which the kubelet
    renews in place, or the local runner's secret. None without a path."""
    if not path:
        return None

    def read() -> str | None:
        try:
            with open(path) as handle:
                return handle.read().strip() or None
        except OSError as exc:
            log.info("the credential file %s cannot be read: %s", path, exc)
            return None

    return read


class Http:
    """JSON requests over one kept-alive connection, with retries and exponential backoff; raises
    AgentError / AgentUnreachable. A hook polls at every iteration: a new TCP connection per call
    would cost both sides more than the call itself. `credential`: sent as `Authorization: Bearer`."""

    def __init__(self, base_url: str, timeout: float = 2.0, retries: int = 2, backoff: float = 0.05,
                 credential: Credential | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"agent URL '{base_url}' must be http://HOST:PORT or https://HOST:PORT")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.credential = credential
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=self.timeout)

    def _send(self, method: str, path: str, data: bytes | None, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        with self._lock:
            for fresh in (False, True):
                conn = None if fresh else self._conn
                reused = conn is not None
                if conn is None:
                    conn = self._connect()
                self._conn = None
                try:
                    conn.request(method, self._prefix + path, body=data, headers=headers)
                    response = conn.getresponse()
                    payload = response.read()
                except (http.client.HTTPException, OSError):
                    conn.close()
                    if reused:  # the agent closed an idle kept-alive connection: once more on a new one
                        continue
                    raise
                if response.will_close:
                    conn.close()
                else:
                    self._conn = conn
                warnings = response.headers.get_all(WARNING_HEADER) or []
                if warnings:
                    _log_warnings(self.base_url, warnings)
                return response.status, payload, {k: v for k, v in response.getheaders()}
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def request(self, method: str, path: str, body: Any = None, token: str | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict | None, dict[str, str]]:
        """(status, JSON body or None, response headers); 304 comes back as a status, not an error."""
        data = None
        send = {"Accept": "application/json"} | dict(headers or {})
        if body is not None:
            data, body_headers = encode_body(body)
            send.update(body_headers)
        if token:
            send[TOKEN_HEADER] = token
        proof = self.credential() if self.credential is not None else None
        if proof:
            send["Authorization"] = f"Bearer {proof}"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * (2 ** (attempt - 1)) * (0.5 + random.random()))
            try:
                status, raw, response_headers = self._send(method, path, data, send)
            except (http.client.HTTPException, OSError) as exc:
                last = AgentUnreachable(f"{method} {self.base_url}{path}: {exc or type(exc).__name__}")
                continue
            if status < 300 or status == 304:
                return status, _json(raw) if status != 304 else None, response_headers
            payload = _json(raw)
            if status in RETRY_STATUSES or status >= 500:
                last = AgentUnreachable(f"{method} {path}: {status} {_detail(payload)}")
                continue
            code = payload.get("code") if isinstance(payload, dict) else None
            raise AgentError(status, _detail(payload), code)
        assert last is not None
        raise last


def _json(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return {"detail": raw[:200].decode(errors="replace")}


def _detail(payload: Any) -> str:
    if isinstance(payload, dict):
        detail = payload.get("detail")
        return detail if isinstance(detail, str) else json.dumps(detail)[:500]
    return str(payload)[:500]


class AgentClient:
    """One job's link to its node agent. Thread-safe. `fetch_plan`/`poll`/`post_measurements` never raise
    for the agent's sake (unreachable or refusing: last plan kept, `last_error` says why); `register`,
    `upload_workload`, `update_knobs` raise AgentError when the agent refuses (e.g. unknown GPU)."""

    def __init__(self, url: str, job: str, namespace: str | None = None, token: str | None = None,
                 gpu: str | None = None, timeout: float = 2.0, retries: int = 2, backoff: float = 0.05,
                 max_backoff: float = 30.0, credential: Credential | None = None) -> None:
        self.ref = JobRef.parse(job, namespace)
        self.http = Http(url, timeout, retries, backoff, credential)
        # A job without a token of its own chooses one before its first registration, so that a registration sent
        # again after a timeout (the agent registered the first, its answer came too late) is the same one, not a
        # second job of the same name under the agent's token.
        self.token = token or secrets.token_urlsafe(24)
        self.gpu = gpu
        self.max_backoff = max_backoff
        self.backoff = backoff
        self.registration: RegisterRequest | None = None
        self.registered: RegisterResponse | None = None
        self.last_plan: PlanResponse | None = None  # kept while the agent is unreachable
        self.last_error: str | None = None
        self.registrations = 0  # how often this client registered (re-registrations after restarts count)
        self._etag: str | None = None
        self._failures = 0
        self._quiet_until = 0.0
        self._lock = threading.RLock()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **options: Any) -> AgentClient:
        env = os.environ if environ is None else environ
        url = env.get("TENSILE_AGENT")
        if not url:
            raise ValueError("TENSILE_AGENT is not set: no node agent to talk to")
        options.setdefault("credential", credential_file(env.get("TENSILE_TOKEN_FILE")))
        return cls(url, env.get("TENSILE_JOB", "local"), env.get("TENSILE_NAMESPACE"), env.get("TENSILE_TOKEN") or None,
                   env.get("TENSILE_GPU") or None, **options)

    # ------------------------------------------------------------------ state

    @property
    def plan_version(self) -> int:
        return self.last_plan.version if self.last_plan else 0

    @property
    def current_plan(self) -> Plan | None:
        """The last plan received (tensile.plan.Plan) or None."""
        return self.last_plan.plan_object() if self.last_plan and self.last_plan.plan else None

    @property
    def reachable(self) -> bool:
        return self._failures == 0

    def _call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
              reregister: bool = True) -> tuple[int, dict | None, dict[str, str]] | None:
        """None when the agent is unreachable (or in the quiet period after failures)."""
        if time.monotonic() < self._quiet_until:
            return None
        try:
            result = self.http.request(method, path, body, self.token, headers)
        except AgentUnreachable as exc:
            self._failed(str(exc))
            return None
        except AgentError as exc:
            if exc.status == 404 and exc.code == "unknown_job" and reregister and self.registration is not None:
                log.info("agent does not know job %s (restarted?): registering again", self.ref.key)
                if self._register(self.registration) is None:
                    return None
                return self._call(method, path, body, headers, reregister=False)
            raise
        self._failures = 0
        self._quiet_until = 0.0
        self.last_error = None
        return result

    # A refusal and the agent going away are logged at INFO: the hook's AgentLink (runtime_hook/tensile_hook/agent_link.py) says
    # each as a warning and in the report (`reachable`, `last_error`); logged here too, `tensile run` printed each twice.
    def _refused(self, exc: AgentError) -> None:
        if self.last_error != str(exc):
            log.info("node agent refused a call for %s: %s; keeping plan version %d", self.ref.key, exc, self.plan_version)
        self.last_error = str(exc)

    def _failed(self, why: str) -> None:
        self._failures += 1
        self.last_error = why
        delay = min(self.max_backoff, self.backoff * 2 ** min(self._failures, 30))
        self._quiet_until = time.monotonic() + delay
        if self._failures == 1:
            log.info("node agent unreachable (%s); keeping plan version %d", why, self.plan_version)

    # ------------------------------------------------------------------ calls

    def register(self, workload: Any = None, signature: str | None = None, memory_budget_bytes: int | None = None,
                 max_swap_rate: float | None = None, recompute: bool = True, external: bool = False,
                 activations_only: bool = False, expandable_segments: bool | None = None,
                 cublas_workspace_bytes: int | None = None,
                 allocator_cap_bytes: int | None = None) -> RegisterResponse | None:
        """Register the job (workload: a Workload or its JSON dict; or its signature), with what decides its process's
        caching allocator and the cap on it where known. None: unreachable, remembered and retried by the next call.
        Raises AgentError for a refused registration."""
        request = RegisterRequest(job=self.ref.name, namespace=self.ref.namespace, gpu=self.gpu,
                                  workload=_workload_dict(workload), signature=signature,
                                  memory_budget_bytes=memory_budget_bytes, max_swap_rate=max_swap_rate,
                                  recompute=recompute, token=self.token, external=external,
                                  activations_only=activations_only, expandable_segments=expandable_segments,
                                  cublas_workspace_bytes=cublas_workspace_bytes,
                                  allocator_cap_bytes=allocator_cap_bytes).validate()
        with self._lock:
            self.registration = request
            self._quiet_until = 0.0
            return self._register(request)

    def _register(self, request: RegisterRequest) -> RegisterResponse | None:
        request.token = self.token
        request.last_plan_version = self.plan_version
        result = self._call("POST", jobs_path(), request.to_dict(), reregister=False)
        if result is None:
            return None
        _, payload, _ = result
        response = RegisterResponse.from_dict(payload or {})
        self.token = response.token
        self.gpu = self.gpu or response.gpu
        self.registered = response
        self.registrations += 1
        self._etag = None  # a restarted agent has a new epoch: fetch the plan in full
        return response

    def _ensure_registered(self) -> bool:
        """Registered, or registering now what `register` was given (the agent was away then)."""
        if self.registered is None and self.registration is not None:
            return self._register(self.registration) is not None
        return self.registered is not None

    def fetch_plan(self) -> PlanResponse | None:
        """The job's current plan response (conditional GET); the last one when unchanged or unreachable."""
        with self._lock:
            if not self._ensure_registered():
                return self.last_plan
            headers = {"If-None-Match": self._etag} if self._etag else None
            try:
                result = self._call("GET", job_path(self.ref, "plan"), headers=headers)
            except AgentError as exc:  # refused (e.g. its GPU is gone after a restart): train on with what we have
                self._refused(exc)
                return self.last_plan
            if result is None:
                return self.last_plan
            status, payload, response_headers = result
            if status == 304:
                return self.last_plan
            self.last_plan = PlanResponse.from_dict(payload or {})
            self._etag = response_headers.get(ETAG_HEADER) or response_headers.get(ETAG_HEADER.lower())
            knobs = self.last_plan.knobs
            if knobs is not None and self.registration is not None:  # registering again sends what holds now
                self.registration.memory_budget_bytes = knobs.memory_budget_bytes
                self.registration.max_swap_rate = knobs.max_swap_rate
                self.registration.recompute = bool(knobs.recompute)
            return self.last_plan

    def poll(self) -> tuple[Plan | None, bool]:
        """(plan, changed): what the hook calls at an iteration boundary. `plan` is a tensile.plan.Plan
        (None while there is none); `changed` says it differs from the one the previous poll gave."""
        before = self.plan_version
        response = self.fetch_plan()
        version = response.version if response else 0
        return self.current_plan, version != before

    def wait_for_plan(self, timeout: float = 30.0, min_version: int = 1, interval: float = 0.02) -> PlanResponse | None:
        """Poll until a plan of at least `min_version` is ready (or the job needs its workload)."""
        deadline = time.monotonic() + timeout
        while True:
            response = self.fetch_plan()
            if response is not None and (response.version >= min_version or response.status in (NEEDS_WORKLOAD, FAILED)):
                return response
            if time.monotonic() > deadline:
                return response
            time.sleep(interval)

    def post_measurements(self, measurements: Measurements) -> MeasurementsResponse | None:
        """None when unreachable (these measurements are dropped: the next ones carry on)."""
        measurements.validate()
        with self._lock:
            try:
                if not self._ensure_registered():
                    return None
                result = self._call("POST", job_path(self.ref, "measurements"), measurements.to_dict())
            except AgentError as exc:
                self._refused(exc)
                return None
        return MeasurementsResponse.from_dict(result[1] or {}) if result else None

    def upload_workload(self, workload: Any) -> RegisterResponse | None:
        """The live workload (after a signature mismatch): the agent re-plans the GPU with it."""
        body = {"workload": _workload_dict(workload)}
        with self._lock:
            if self.registration is not None:
                self.registration.workload = body["workload"]
                self.registration.signature = None
            if not self._ensure_registered():
                return None
            result = self._call("PUT", job_path(self.ref, "workload"), body)
        return RegisterResponse.from_dict(result[1] or {}) if result else None

    def workload(self) -> Workload | None:
        """The workload the agent holds for the job (the forecast the operator registered it with, or an upload);
        None when the agent is unreachable. Raises AgentError when it has none (404)."""
        with self._lock:
            result = self._call("GET", job_path(self.ref, "workload"), reregister=False)
        return _workload_from(result[1], f"the agent's workload of {self.ref.key}") if result else None

    def update_knobs(self, **knobs: Any) -> dict | None:
        body = strict_knobs(knobs).to_dict()
        with self._lock:
            if self.registration is not None:
                for key, value in body.items():
                    setattr(self.registration, key, value)
            result = self._call("PATCH", job_path(self.ref, "knobs"), body)
        return result[1] if result else None

    def close(self) -> None:
        """Drop the kept-alive connection."""
        self.http.close()

    def unregister(self) -> bool:
        with self._lock:
            self.registration = None
            try:
                result = self._call("DELETE", job_path(self.ref), reregister=False)
            except AgentError as exc:
                if exc.status == 404:
                    return True
                raise
        return result is not None


# ---------------------------------------------------------------------- for the operator


def _one_shot(agent: str, timeout: float = 5.0, credential: Credential | None = None) -> Http:
    return Http(agent, timeout=timeout, retries=3, backoff=0.2, credential=credential)


def admit(agent: str, job: str, token: str, gpu: str, pod: str, memory_budget_bytes: int | None,
          credential: Credential | None = None) -> dict:
    """The operator's admission of a job onto the agent's GPU `gpu`: its pod `pod` may then register it (and only it)
    with the pod's own credential, with at most `memory_budget_bytes`, and gets the job's `token`. Raises AgentError /
    AgentUnreachable."""
    ref = JobRef.parse(job)
    link = _one_shot(agent, credential=credential)
    try:
        _, payload, _ = link.request("POST", "/v1/admissions", {"job": ref.name, "namespace": ref.namespace, "gpu": gpu,
                                                                "pod": pod, "token": token,
                                                                "memory_budget_bytes": memory_budget_bytes})
    finally:
        link.close()
    return payload or {}


def update_knobs(agent: str, job: str, token: str, knobs: dict, credential: Credential | None = None) -> dict:
    """Forward a TrainingJob's knob annotations (operator names maxSwapRate/memoryBudgetBytes welcome).
    Returns the job as the agent now has it; raises AgentError / AgentUnreachable."""
    body = strict_knobs(knobs).to_dict()
    link = _one_shot(agent, credential=credential)
    try:
        _, payload, _ = link.request("PATCH", job_path(JobRef.parse(job), "knobs"), body, token)
    finally:
        link.close()
    return payload or {}


def unregister(agent: str, job: str, token: str, credential: Credential | None = None) -> bool:
    """True when the agent no longer has the job (404 counts as done)."""
    link = _one_shot(agent, credential=credential)
    try:
        link.request("DELETE", job_path(JobRef.parse(job)), None, token)
    except AgentError as exc:
        if exc.status == 404:
            return True
        raise
    finally:
        link.close()
    return True


def register(agent: str, job: str, token: str, gpu: str, workload: Workload, memory_budget_bytes: int | None,
             max_swap_rate: float | None, recompute: bool, activations_only: bool,
             credential: Credential | None = None) -> RegisterResponse:
    """A job the operator placed, registered with its forecast before its pod runs: the agent plans it with the GPU's
    other jobs at once, and the pod's hook (TENSILE_SIGNATURE) fetches that workload and registers the same.
    Raises AgentError / AgentUnreachable."""
    ref = JobRef.parse(job)
    request = RegisterRequest(job=ref.name, namespace=ref.namespace, gpu=gpu, workload=_workload_dict(workload),
                              memory_budget_bytes=memory_budget_bytes, max_swap_rate=max_swap_rate, recompute=recompute,
                              token=token, activations_only=activations_only).validate()
    link = _one_shot(agent, timeout=30.0, credential=credential)
    try:
        _, payload, _ = link.request("POST", jobs_path(), request.to_dict(), token)
    finally:
        link.close()
    return RegisterResponse.from_dict(payload or {})


def live_workload(agent: str, job: str, token: str, credential: Credential | None = None) -> Workload | None:
    """The workload the agent holds for the job (the hook's live trace when it uploaded one), or None."""
    link = _one_shot(agent, timeout=30.0, credential=credential)
    try:
        _, payload, _ = link.request("GET", job_path(JobRef.parse(job), "workload"), None, token)
    except AgentError as exc:
        if exc.status == 404:
            return None
        raise
    finally:
        link.close()
    return _workload_from(payload, f"agent {agent} workload of {job}")


def _workload_from(payload: dict | None, what: str) -> Workload | None:
    from tensile.workload_io import workload_from_dict

    return workload_from_dict(payload, what) if payload else None

