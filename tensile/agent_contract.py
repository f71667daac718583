"""The node agent's HTTP contract (docs/agent.md, "API"), in one place for both sides.

The agent (`tensile_agent`, FastAPI) mirrors these shapes in pydantic models; the runtime hook's
client (`tensile.agent_client`, standard library only) and the operator build and read them from
here. Plain dataclasses and JSON helpers: importing this module imports neither FastAPI nor pydantic,
so the hook can use it inside a user's training image.

Wire format: JSON objects with snake_case keys; a request body may be gzip-compressed
(`Content-Encoding: gzip`). Every job-scoped call carries the job's token in `TOKEN_HEADER`.

    POST   /v1/jobs                                register (or re-register) a job -> RegisterResponse
    GET    /v1/jobs                                all jobs with forecasts and observations (no tokens)
    GET    /v1/jobs/{namespace}/{job}              one job                       (token)
    DELETE /v1/jobs/{namespace}/{job}              unregister                    (token)
    GET    /v1/jobs/{namespace}/{job}/plan         its current plan; ETag / If-None-Match -> 304 (token)
    POST   /v1/jobs/{namespace}/{job}/measurements what the hook measured -> MeasurementsResponse (token)
    PATCH  /v1/jobs/{namespace}/{job}/knobs        max swap rate, memory budget, recompute (token)
    PUT    /v1/jobs/{namespace}/{job}/workload     upload the live workload (signature mismatch) (token)
    GET    /v1/jobs/{namespace}/{job}/workload     the workload the agent plans with  (token)
    GET    /v1/gpus, /v1/gpus/{gpu}, /v1/info, /healthz, /metrics, /openapi.json
"""

from __future__ import annotations

import gzip
import json
import math
import re
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from tensile.devices import over_max_bytes
from tensile.knobs import KnobError, parse_swap_rate

if TYPE_CHECKING:
    from tensile.plan import Plan

API_VERSION = "v1"
PREFIX = f"/{API_VERSION}"
DEFAULT_PORT = 8470
TOKEN_HEADER = "X-Tensile-Token"
ETAG_HEADER = "ETag"

# Size caps (bytes). A ResNet-50 workload is a few hundred kB of JSON, a GPT-2 one a few MB.
MAX_REGISTER_BYTES = 32 * 1024**2  # a register / workload upload body as sent (gzip or not)
MAX_DECODED_BYTES = 128 * 1024**2  # the same body once decompressed (a gzip bomb stops here)
MAX_MEASUREMENT_BYTES = 4 * 1024**2
MAX_SMALL_BYTES = 64 * 1024  # knobs and anything else
MAX_OP_SAMPLES = 200_000  # per-op latency samples in one measurements body
MAX_SECONDS = 1e9  # any duration in a body (seconds); keeps every sum the agent makes finite
GZIP_ABOVE_BYTES = 64 * 1024  # the client compresses bodies larger than this
MAX_FIELD_NAME_SHOWN = 100  # characters of an unknown field's name in a Warning header
WARNING_HEADER = "Warning"

NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$"  # a Kubernetes name, relaxed
TOKEN_PATTERN = r"^[A-Za-z0-9._~+/=-]{16,128}$"
GPU_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
SIGNATURE_PATTERN = r"^[0-9a-f]{8,64}$"
_NAME = re.compile(NAME_PATTERN)
_TOKEN = re.compile(TOKEN_PATTERN)
_GPU = re.compile(GPU_PATTERN)
_SIGNATURE = re.compile(SIGNATURE_PATTERN)

# A job's planning status, as the agent reports it.
PLANNING = "planning"  # registered; its GPU's planning round has not finished yet
PLANNED = "planned"  # a plan is ready (it may still not fit: see `fits` and the message)
NEEDS_WORKLOAD = "needs_workload"  # registered by signature the agent does not know: PUT the workload
FAILED = "failed"  # planning raised; the message says why (the hook runs guarded)

REPLAN_REASONS = ("register", "unregister", "knobs", "drift", "workload")


TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # as Kubernetes writes times: UTC, to the second


def utc_timestamp() -> str:
    """Now, as Kubernetes writes times: one format for the agent's TensileNode and the operator's TrainingJob
    statuses."""
    return datetime.now(UTC).strftime(TIMESTAMP_FORMAT)


class ContractError(ValueError):
    """A body that breaks the contract: `field` names what is wrong (the agent answers 422)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class BodyTooLarge(ValueError):
    """A body over its cap (the agent answers 413)."""


# --------------------------------------------------------------------------- names and paths


@dataclass(frozen=True, slots=True)
class JobRef:
    namespace: str
    name: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @classmethod
    def parse(cls, job: str, namespace: str | None = None) -> JobRef:
        """'ns/name' (what the operator calls a job) or a bare name in `namespace` (default 'default')."""
        if "/" in job:
            ns, _, name = job.partition("/")
        else:
            ns, name = namespace or "default", job
        check_name("namespace", ns)
        check_name("job", name)
        return cls(ns, name)


def check_name(field_name: str, value: Any) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ContractError(field_name, f"must be 1-253 letters, digits, '.', '_' or '-', starting and ending alphanumeric (was {value!r:.80})")
    return value


def jobs_path() -> str:
    return f"{PREFIX}/jobs"


def job_path(ref: JobRef, suffix: str = "") -> str:
    return f"{PREFIX}/jobs/{ref.namespace}/{ref.name}" + (f"/{suffix}" if suffix else "")


def plan_etag(epoch: str, version: int, round_: int = 0) -> str:
    """Strong ETag of a job's plan response: the agent's start epoch (a restarted agent never answers
    304 to a plan it did not hand out), the plan version and the GPU round that last confirmed it."""
    return f'"{epoch}-{version}-{round_}"'


# --------------------------------------------------------------------------- validation helpers


def _opt_int(data: dict, key: str, minimum: int = 0) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ContractError(key, f"must be an integer >= {minimum} or null (was {value!r:.80})")
    return value


def _opt_bytes(data: dict, key: str) -> int | None:
    """An amount of memory: whole bytes, at most the one cap on every amount (tensile.devices.MAX_BYTES), or None."""
    value = _opt_int(data, key)
    if value is not None and (problem := over_max_bytes(value)):
        raise ContractError(key, problem)
    return value


def _int(data: dict, key: str, default: int = 0, minimum: int = 0) -> int:
    value = _opt_int(data, key, minimum)
    return default if value is None else value


def _opt_float(data: dict, key: str, minimum: float = 0.0, maximum: float = MAX_SECONDS) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not minimum <= value <= maximum):
        raise ContractError(key, f"must be a number in [{minimum}, {maximum:g}] or null (was {value!r:.80})")
    return float(value)


def _float(data: dict, key: str, default: float = 0.0) -> float:
    value = _opt_float(data, key)
    return default if value is None else value


def _opt_bool(data: dict, key: str) -> bool | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ContractError(key, f"must be true or false (was {value!r:.80})")
    return value


def _swap_rate(data: dict, key: str = "max_swap_rate") -> float | None:
    """The job's max swap rate by the knob's one rule (tensile.knobs), as a TrainingJob and the hook read it."""
    rate = _opt_float(data, key)
    if rate is not None:
        try:
            parse_swap_rate(rate, key)
        except KnobError as exc:
            raise ContractError(exc.field, exc.problem) from None
    return rate


def _object(data: Any, what: str) -> dict:
    if not isinstance(data, dict):
        raise ContractError("(body)", f"{what} must be a JSON object")
    return data


def _known(data: dict, cls: type, unknown: list[str] | None) -> dict:
    """The fields of `data` that `cls` has. Unknown ones are ignored, as Kubernetes' API server does by default
    (fieldValidation=Warn): a newer hook's new field must not get it refused by an older agent, which would
    fall back to planning alone. Their names go to `unknown` (the agent answers a Warning header for each)."""
    names = {f.name for f in fields(cls)}
    if unknown is not None:
        unknown.extend(sorted(str(k) for k in data if k not in names))
    return {k: v for k, v in data.items() if k in names}


def unknown_field_warning(name: str) -> str:
    """The HTTP `Warning` header value for an ignored request field, as the API server writes it:
    `299 - "unknown field \\"name\\""` (the name ASCII-escaped and cut, so that any name makes a valid header)."""
    shown = json.dumps(name[:MAX_FIELD_NAME_SHOWN])[1:-1]  # ASCII, control characters escaped
    text = f'unknown field "{shown}"'
    return '299 - "' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# --------------------------------------------------------------------------- register


@dataclass(slots=True)
class RegisterRequest:
    """POST /v1/jobs with `workload` (its JSON, tensile.workload_io) or its `signature` (or both, agreeing).

    `token`: the job's token (the operator derives one per TrainingJob); omitted, the agent issues
    one. A re-registering hook sends the token it has and `last_plan_version`, so a restarted agent
    continues the job's plan versions instead of starting again at 1."""

    job: str
    namespace: str = "default"
    gpu: str | None = None  # uuid or index; None: the node's only GPU
    workload: dict | None = None
    signature: str | None = None
    memory_budget_bytes: int | None = None
    max_swap_rate: float | None = None
    recompute: bool = True
    token: str | None = None
    last_plan_version: int = 0
    external: bool = False  # not placed by the operator (tensile run --agent)
    # plan native events only (activation swaps, recomputes of convolutions and batch norms): what the hook's native path carries, so a CUDA job
    # under the agent keeps off the dispatch path (tensile.plan.native_plan_events)
    activations_only: bool = False
    # what decides the process's caching allocator, for the agent's forecast of what it reserves (tensile.allocator):
    # whether it runs with expandable segments, and the size of one cuBLAS workspace (tensile.cublas_workspaces; 0 on
    # the CPU device). None, as from an older hook: the agent assumes what docs/agent.md says
    expandable_segments: bool | None = None
    cublas_workspace_bytes: int | None = None
    # the cap on what the process's caching allocator may reserve (tensile_hook.memory_cap: the job's admitted size
    # less its CUDA context), shown beside the reserved peaks. None: no cap (the CPU device, no TENSILE_MEMORY_CAP, or
    # an older hook)
    allocator_cap_bytes: int | None = None

    @property
    def ref(self) -> JobRef:
        return JobRef(self.namespace, self.job)

    def validate(self) -> RegisterRequest:
        check_name("job", self.job)
        check_name("namespace", self.namespace)
        if self.gpu is not None and (not isinstance(self.gpu, str) or not _GPU.match(self.gpu)):
            raise ContractError("gpu", f"must be a GPU uuid or index (was {self.gpu!r:.80})")
        if self.workload is None and self.signature is None:
            raise ContractError("workload", "give the workload JSON or its signature")
        if isinstance(self.workload, dict) and self.signature is not None and self.workload.get("signature") not in (None, self.signature):
            raise ContractError("signature", "does not match workload.signature")
        if self.workload is not None and not isinstance(self.workload, dict):
            raise ContractError("workload", "must be a workload JSON object (tensile.workload_io)")
        if self.signature is not None and (not isinstance(self.signature, str) or not _SIGNATURE.match(self.signature)):
            raise ContractError("signature", f"must be a workload signature (hex) (was {self.signature!r:.80})")
        if self.token is not None and (not isinstance(self.token, str) or not _TOKEN.match(self.token)):
            raise ContractError("token", "must be 16-128 characters of [A-Za-z0-9._~+/=-]")
        data = {"memory_budget_bytes": self.memory_budget_bytes, "max_swap_rate": self.max_swap_rate,
                "last_plan_version": self.last_plan_version, "expandable_segments": self.expandable_segments,
                "cublas_workspace_bytes": self.cublas_workspace_bytes, "allocator_cap_bytes": self.allocator_cap_bytes}
        _opt_int(data, "memory_budget_bytes", 1)
        _swap_rate(data)
        _int(data, "last_plan_version")
        _opt_bool(data, "expandable_segments")
        _opt_bytes(data, "cublas_workspace_bytes")
        _opt_bytes(data, "allocator_cap_bytes")
        for name in ("recompute", "external", "activations_only"):
            if not isinstance(getattr(self, name), bool):
                raise ContractError(name, "must be true or false")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, unknown: list[str] | None = None) -> RegisterRequest:
        """Unknown fields are ignored (their names appended to `unknown`); known ones are checked."""
        data = _known(_object(data, "a registration"), cls, unknown)
        if "job" not in data:
            raise ContractError("job", "is required")
        known = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        defaults = {"namespace": "default", "recompute": True, "last_plan_version": 0, "external": False, "activations_only": False}
        for key, value in defaults.items():
            if known.get(key) is None:
                known[key] = value
        return cls(**known).validate()


@dataclass(slots=True)
class RegisterResponse:
    job: str
    namespace: str
    gpu: str  # the GPU's uuid
    token: str
    status: str
    message: str
    plan_version: int  # 0 until the first plan is ready
    created: bool  # False: the job was registered already (a retry or a hook's re-registration)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RegisterResponse:
        return cls(**{f.name: data[f.name] for f in fields(cls)})


# --------------------------------------------------------------------------- plan


@dataclass(slots=True)
class PlanResponse:
    """GET .../plan. `plan` is `tensile.plan.Plan.to_dict()` (None until planned). `round` numbers the
    GPU's planning rounds: co-located jobs planned together share it; `co_planned` names them."""

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
    plan: dict | None
    # the job's knobs as the agent holds them (the operator PATCHes them): a hook that registers again after
    # an agent restart sends these, not the ones it started with; None from an agent older than this field
    knobs: Knobs | None = None
    # this job's share of a GPU it shares with others (the joint plan's: its scheduled peak, plus its part of the
    # room left, or less when the GPU cannot fit them all). The plan's memory_budget_bytes is this for a job without
    # a budget of its own, and the smaller of the two when the jobs cannot fit, so the hook's guard keeps co-runners
    # apart (docs/agent.md "Shares of a shared GPU"). None alone on a GPU it fits, or from an agent older than this
    gpu_share_bytes: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PlanResponse:
        knobs = data.get("knobs")
        optional = {"knobs", "gpu_share_bytes"}  # absent from an older agent's answers
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name not in optional},
                   knobs=Knobs(**{f.name: knobs.get(f.name) for f in fields(Knobs)}) if knobs else None,
                   gpu_share_bytes=data.get("gpu_share_bytes"))

    def plan_object(self) -> Plan | None:
        """The plan as a tensile.plan.Plan (or None)."""
        from tensile.plan import Plan

        return Plan.from_dict(self.plan) if self.plan else None


# --------------------------------------------------------------------------- measurements


def measured_under_plan(mode: str | None, peak_source: str | None) -> bool:
    """Whether an iteration's peak compares with the forecast scheduled peak: it ran under a plan and its
    peak was measured. The first iterations (recording, matching) run at the vanilla peak, and a native
    CPU iteration nothing observed reports the forecast itself as its peak (`peak_source` planned)."""
    return mode == "planned" and peak_source == "measured"


def planned_peak(iterations: Iterable[dict]) -> int | None:
    """The highest peak measured under a plan among the hook's report iterations (as dicts; an entry
    without `peak_source` counts as measured, IterationStats' default), None without one."""
    return max((int(it.get("peak_bytes") or 0) for it in iterations
                if measured_under_plan(it.get("mode"), it.get("peak_source", "measured"))), default=None)


def higher(a: int | None, b: int | None) -> int | None:
    """The larger of two peaks, either of which may be unknown (None)."""
    return a if b is None else b if a is None else max(a, b)


@dataclass(slots=True)
class Measurements:
    """POST .../measurements: what the hook measured over `iterations` iterations since its last post.

    `op_latencies`: sampled [op index, seconds] pairs of the job's workload (indices as in the workload
    the agent plans with); they drive the EWMA and the drift re-plan. Byte and stall figures are totals
    over the iterations covered; `peak_bytes` the highest; `planned_peak_bytes` the highest of the
    iterations measured under a plan (`measured_under_plan`; absent from an older hook's body);
    `reserved_peak_bytes` the highest the process held (on CUDA the caching allocator's max_memory_reserved, on the
    CPU device the same as `peak_bytes`; absent from an older hook's body); `out_of_memory_retries` the allocation
    failures the hook's guard turned into passive evictions and a retry (absent from an older hook's body: 0);
    `iteration_seconds` the mean."""

    plan_version: int | None = None
    iterations: int = 1
    op_latencies: list[list[float]] = field(default_factory=list)
    peak_bytes: int | None = None
    planned_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    iteration_seconds: float | None = None
    vanilla_iteration_seconds: float | None = None  # measured without a plan, when the hook knows it
    stall_seconds: float = 0.0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    recompute_bytes: int = 0
    out_of_memory_retries: int = 0
    signature_match: bool | None = None

    def validate(self) -> Measurements:
        data = asdict(self)
        _opt_int(data, "plan_version")
        _int(data, "iterations", 1, 1)
        _opt_int(data, "peak_bytes")
        _opt_int(data, "planned_peak_bytes")
        _opt_int(data, "reserved_peak_bytes")
        _opt_float(data, "iteration_seconds")
        _opt_float(data, "vanilla_iteration_seconds")
        for key in ("stall_seconds",):
            _float(data, key)
        for key in ("swap_out_bytes", "swap_in_bytes", "recompute_bytes", "out_of_memory_retries"):
            _int(data, key)
        _opt_bool(data, "signature_match")
        samples = self.op_latencies
        if not isinstance(samples, list) or len(samples) > MAX_OP_SAMPLES:
            raise ContractError("op_latencies", f"must be a list of at most {MAX_OP_SAMPLES} [op index, seconds] pairs")
        for i, pair in enumerate(samples):
            if (not isinstance(pair, (list, tuple)) or len(pair) != 2 or isinstance(pair[0], bool) or not isinstance(pair[0], int)
                    or pair[0] < 0 or isinstance(pair[1], bool) or not isinstance(pair[1], (int, float))
                    or not math.isfinite(pair[1]) or not 0 <= pair[1] <= MAX_SECONDS):
                raise ContractError(f"op_latencies[{i}]", f"must be [op index >= 0, 0 <= seconds <= {MAX_SECONDS:g}]")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, unknown: list[str] | None = None) -> Measurements:
        """Unknown fields are ignored (their names appended to `unknown`); known ones are checked."""
        data = _known(_object(data, "measurements"), cls, unknown)
        known = {f.name: data[f.name] for f in fields(cls) if f.name in data and data[f.name] is not None}
        return cls(**known).validate()

    @classmethod
    def from_iterations(cls, iterations: list[dict], op_latencies: list[list[float]] | None = None,
                        plan_version: int | None = None, signature_match: bool | None = None) -> Measurements:
        """Fold the hook's per-iteration report entries (runtime_hook.report.IterationStats as dicts; `mode`
        and `peak_source` decide which count for `planned_peak_bytes`)."""
        if not iterations:
            raise ContractError("iterations", "need at least one iteration")
        n = len(iterations)
        reserved = [int(it["reserved_bytes"]) for it in iterations if it.get("reserved_bytes") is not None]
        return cls(
            plan_version=plan_version if plan_version is not None else iterations[-1].get("plan_version"),
            iterations=n,
            op_latencies=list(op_latencies or []),
            peak_bytes=max(int(it.get("peak_bytes") or 0) for it in iterations),
            planned_peak_bytes=planned_peak(iterations),
            reserved_peak_bytes=max(reserved) if reserved else None,
            iteration_seconds=sum(float(it.get("seconds") or 0.0) for it in iterations) / n,
            stall_seconds=sum(float(it.get("stall_seconds") or 0.0) for it in iterations),
            swap_out_bytes=sum(int(it.get("swap_out_bytes") or 0) for it in iterations),
            swap_in_bytes=sum(int(it.get("swap_in_bytes") or 0) for it in iterations),
            recompute_bytes=sum(int(it.get("recompute_bytes") or 0) for it in iterations),
            out_of_memory_retries=sum(int(it.get("out_of_memory_retries") or 0) for it in iterations),
            signature_match=signature_match,
        ).validate()


@dataclass(slots=True)
class MeasurementsResponse:
    accepted: bool
    plan_version: int  # the job's current plan version: newer than the hook's -> fetch at the next boundary
    replan: bool  # these measurements drifted the latencies past the threshold: a re-plan is under way

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MeasurementsResponse:
        return cls(**{f.name: data[f.name] for f in fields(cls)})


# --------------------------------------------------------------------------- knobs


_KNOB_ALIASES = {"maxSwapRate": "max_swap_rate", "memoryBudgetBytes": "memory_budget_bytes"}


@dataclass(slots=True)
class Knobs:
    """PATCH .../knobs: only the fields given change (null: unchanged)."""

    max_swap_rate: float | None = None
    memory_budget_bytes: int | None = None
    recompute: bool | None = None

    def validate(self) -> Knobs:
        data = asdict(self)
        _swap_rate(data)
        _opt_int(data, "memory_budget_bytes", 1)
        _opt_bool(data, "recompute")
        return self

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Any, unknown: list[str] | None = None) -> Knobs:
        """Also takes the operator's camelCase names (maxSwapRate, memoryBudgetBytes). Unknown fields are ignored
        (their names appended to `unknown`): `strict_knobs` refuses them where the caller builds the body."""
        data = {_KNOB_ALIASES.get(k, k): v for k, v in _object(data, "knobs").items()}
        return cls(**_known(data, cls, unknown)).validate()


def strict_knobs(data: Any) -> Knobs:
    """Knobs a caller builds (the operator's, `AgentClient.update_knobs`): an unknown name is its own typo, refused
    naming the field, not sent to be ignored."""
    unknown: list[str] = []
    knobs = Knobs.from_dict(data, unknown)
    if unknown:
        raise ContractError(unknown[0], f"is not a knob; known: {', '.join(f.name for f in fields(Knobs))} "
                                        f"(or {', '.join(_KNOB_ALIASES)})")
    return knobs


# --------------------------------------------------------------------------- bodies


def encode_body(obj: Any, gzip_above: int = GZIP_ABOVE_BYTES) -> tuple[bytes, dict[str, str]]:
    """JSON bytes and headers; gzip when larger than `gzip_above`."""
    raw = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    headers = {"Content-Type": "application/json"}
    if len(raw) > gzip_above:
        raw = gzip.compress(raw, compresslevel=5, mtime=0)
        headers["Content-Encoding"] = "gzip"
    return raw, headers


def decode_body(raw: bytes, encoding: str | None = None, cap: int = MAX_DECODED_BYTES) -> bytes:
    """The body's bytes once `Content-Encoding` is undone, at most `cap` of them.

    Raises BodyTooLarge past the cap (without inflating further) and ContractError for a damaged
    or unsupported encoding."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("identity", ""):
        if len(raw) > cap:
            raise BodyTooLarge(f"body of {len(raw)} bytes is over the cap of {cap}")
        return raw
    if encoding not in ("gzip", "x-gzip"):
        raise ContractError("Content-Encoding", f"'{encoding}' is not supported; send gzip or identity")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(raw, cap + 1)
        if len(out) > cap or inflater.unconsumed_tail:
            raise BodyTooLarge(f"decompressed body is over the cap of {cap} bytes")
        out += inflater.flush()
    except zlib.error as exc:
        raise ContractError("(body)", f"not valid gzip ({exc})") from None
    if not inflater.eof:
        raise ContractError("(body)", "gzip stream is truncated")
    if len(out) > cap:
        raise BodyTooLarge(f"decompressed body is over the cap of {cap} bytes")
    return out


def body_cap(method: str, path: str) -> int:
    """The cap for a request body on the wire, by route."""
    if method == "POST" and path.rstrip("/") == jobs_path():
        return MAX_REGISTER_BYTES
    if method == "PUT" and path.endswith("/workload"):
        return MAX_REGISTER_BYTES
    if method == "POST" and path.endswith("/measurements"):
        return MAX_MEASUREMENT_BYTES
    return MAX_SMALL_BYTES


def decoded_cap(method: str, path: str) -> int:
    cap = body_cap(method, path)
    return MAX_DECODED_BYTES if cap == MAX_REGISTER_BYTES else cap * 4
