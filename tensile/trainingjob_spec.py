"""A TrainingJob's spec and annotations as plain data, and the checks a CRD schema cannot express.

Every problem is a `SpecProblem`: the field it is about and a message that says how to fix it. The
webhook, the create handler and the CLI all use these functions, so a cluster without the webhook
still reports the same messages (as a Failed phase with a condition). In the core, not in `operator/`: the local
runner reads TrainingJob files with it too, and the core imports nothing of the operator (DESIGN section 2).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

from tensile.devices import parse_bytes
from tensile.errors import TensileUserError
from tensile.forecast import DTYPES, OPTIMIZERS
from tensile.knobs import KnobError, parse_swap_rate
from tensile.plan import PLAN_EVENTS, native_plan_events

ANNOTATION_PREFIX = "tensile.dev/"
ANNOTATIONS = {
    "max-swap-rate": "maxSwapRate",
    "memory-budget": "memoryBudget",
    "recompute": "recompute",
    "plan-events": "planEvents",
}
PHASES = ("Pending", "Forecasting", "Queued", "Admitted", "Running", "Succeeded", "Failed")
FINISHED = ("Succeeded", "Failed")

class SpecError(ValueError):
    """One or more problems with a TrainingJob; str() lists each as 'field: message'."""

    def __init__(self, problems: list[SpecProblem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


@dataclass(frozen=True)
class SpecProblem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def parse_quantity(value: object, field_name: str) -> int:
    """Bytes from an int or a memory quantity: Kubernetes' ('6Gi', '512Mi', '2e9') or the CLI's ('6GiB', '80GB'),
    parsed as the hook and the CLI parse them (`tensile.devices.parse_bytes`)."""
    hint = "write bytes or a quantity like 6Gi"
    not_memory = SpecError([SpecProblem(field_name, f"'{value}' is not a memory size; {hint}")])
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise not_memory
    try:
        number = float(value)
    except ValueError:  # a number with a unit
        try:
            number = float(parse_bytes(str(value)))
        except TensileUserError:
            raise not_memory from None
    if not math.isfinite(number):
        raise not_memory
    if not number > 0:
        raise SpecError([SpecProblem(field_name, f"must be positive (was {value}); {hint}")])
    if number < 1:  # 0.6 is no budget of 0 bytes: the user meant a fraction, which only the CLI's --memory-budget takes
        raise SpecError([SpecProblem(field_name, f"'{value}' is under one byte: {hint} "
                                     "(a fraction of the vanilla peak is for the CLI's --memory-budget, not a TrainingJob)")])
    return int(number)


@dataclass(frozen=True)
class WorkloadSpec:
    """What the forecaster traces: a zoo model with its batch, or a stored workload profile by name."""

    model: str | None = None
    batch_size: int = 16
    input_shape: tuple[int, ...] | None = None
    optimizer: str = "adam"
    dtype: str = "float32"
    micro_batches: int = 1
    device: str = "cuda"
    profile: str | None = None

    @property
    def key(self) -> tuple:
        """Identifies one trace: equal keys trace to the same workload (and so the same signature)."""
        return (self.model, self.batch_size, self.input_shape, self.optimizer, self.dtype, self.micro_batches, self.device)


@dataclass(frozen=True)
class GpuSelector:
    nodes: tuple[str, ...] = ()
    gpu_names: tuple[str, ...] = ()  # substrings of the GPU's product name, e.g. "H100"
    uuids: tuple[str, ...] = ()
    min_memory_bytes: int = 0
    allow_simulated: bool = True

    def matches(self, node: str, gpu_uuid: str, gpu_name: str, memory_bytes: int, simulated: bool) -> bool:
        if self.nodes and node not in self.nodes:
            return False
        if self.uuids and gpu_uuid not in self.uuids:
            return False
        if self.gpu_names and not any(n.lower() in gpu_name.lower() for n in self.gpu_names):
            return False
        if memory_bytes < self.min_memory_bytes:
            return False
        return self.allow_simulated or not simulated

    @property
    def empty(self) -> bool:
        return not (self.nodes or self.gpu_names or self.uuids or self.min_memory_bytes) and self.allow_simulated


@dataclass(frozen=True)
class PlanScope:
    """Which events a job's plans may use: its forecast, the joint plans of placement, its agent and its
    hook all plan with the same, or admission counts on a peak the job's plans do not reach."""

    activations_only: bool = False  # native events only: activation swaps, recomputes of convolutions and batch norms (planEvents on the job's device)
    recompute: bool = True  # spec.scheduling.recompute

    def to_status(self) -> dict:
        """The scope in a job's status.forecast (what a restarted operator books the job with)."""
        return {"activationsOnly": self.activations_only, "recompute": self.recompute}

    @classmethod
    def from_status(cls, forecast_status: dict) -> PlanScope:
        return cls(bool(forecast_status.get("activationsOnly")), forecast_status.get("recompute", True) is not False)


@dataclass(frozen=True)
class JobSpec:
    workload: WorkloadSpec
    memory_budget: int | None = None
    selector: GpuSelector = field(default_factory=GpuSelector)
    max_swap_rate: float | None = None
    recompute: bool = True
    template: dict = field(default_factory=dict)
    plan_events: str = "auto"  # tensile.plan.PLAN_EVENTS; the pod's TENSILE_PLAN_EVENTS
    # where the budget and the swap rate were read: messages about them name the annotation when one set them
    budget_field: str = field(default="spec.memoryBudget", compare=False)
    swap_rate_field: str = field(default="spec.scheduling.maxSwapRate", compare=False)
    # tensile.dev/* annotations that are no knob (a misspelt one): ignored, and said so (`unknown_annotations_message`)
    unknown_annotations: tuple[str, ...] = field(default=(), compare=False)

    @property
    def activations_only(self) -> bool:
        """Whether the forecast and placement plan as the hook will: native events only, by the hook's
        rule on the device the job declares (planned with every event, the peak admitted is one the
        hook does not reach)."""
        return native_plan_events(self.plan_events, self.workload.device)

    @property
    def scope(self) -> PlanScope:
        return PlanScope(self.activations_only, self.recompute)


def _int(value: object, field_name: str, problems: list[SpecProblem], minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.append(SpecProblem(field_name, f"must be an integer >= {minimum} (was {value!r})"))
        return minimum
    return value


def switch(value: object) -> bool | None:
    """A yes/no knob from the spec (a boolean) or an annotation (text: true/false, yes/no, on/off, 1/0);
    None for anything else, which parse_spec refuses rather than guess (a typo must not flip a knob)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return True if text in ("true", "1", "yes", "on") else False if text in ("false", "0", "no", "off") else None


def unknown_annotations(annotations: dict | None) -> list[str]:
    """The tensile.dev/* annotations that are no knob (`tensile.dev/memory-budgett`): a job does not fail for one
    (an annotation is free text to Kubernetes), but nothing may ignore it silently either."""
    known = {ANNOTATION_PREFIX + k for k in ANNOTATIONS}
    return sorted(k for k in annotations or {} if k.startswith(ANNOTATION_PREFIX) and k not in known)


def unknown_annotations_message(names: list[str] | tuple[str, ...]) -> str:
    """What the webhook warns and the job's `UnknownAnnotations` condition says: each name, the one it was
    probably meant to be, and the annotations Tensile reads."""
    known = [ANNOTATION_PREFIX + k for k in ANNOTATIONS]
    parts = []
    for name in names:
        close = difflib.get_close_matches(name.removeprefix(ANNOTATION_PREFIX), list(ANNOTATIONS), n=1, cutoff=0.75)
        parts.append(f"{name} (did you mean {ANNOTATION_PREFIX}{close[0]}?)" if close else name)
    return (f"{', '.join(parts)}: not {'a Tensile annotation' if len(names) == 1 else 'Tensile annotations'}, "
            f"ignored; Tensile reads {', '.join(known)}")


def parse_spec(spec: dict, annotations: dict | None = None) -> JobSpec:
    """The spec (with tensile.dev/* annotations overriding knobs) as a JobSpec; SpecError lists every problem."""
    problems: list[SpecProblem] = []
    raw = dict(spec.get("workload") or {})
    shape = raw.get("inputShape")
    if shape is not None and (not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d > 0 for d in shape)):
        problems.append(SpecProblem("spec.workload.inputShape", f"must be a list of positive integers, e.g. [3, 224, 224] (was {shape!r})"))
        shape = None
    optimizer = raw.get("optimizer", "adam")
    if optimizer not in OPTIMIZERS:
        problems.append(SpecProblem("spec.workload.optimizer", f"'{optimizer}' is not supported; use one of {', '.join(OPTIMIZERS)}"))
    dtype = raw.get("dtype", "float32")
    if dtype not in DTYPES:
        problems.append(SpecProblem("spec.workload.dtype", f"'{dtype}' is not supported; use one of {', '.join(DTYPES)}"))
    device = raw.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        problems.append(SpecProblem("spec.workload.device", f"'{device}' is not supported; use cuda or cpu"))
    workload = WorkloadSpec(
        model=raw.get("model"),
        batch_size=_int(raw.get("batchSize", 16), "spec.workload.batchSize", problems),
        input_shape=tuple(shape) if shape else None,
        optimizer=optimizer,
        dtype=dtype,
        micro_batches=_int(raw.get("microBatches", 1), "spec.workload.microBatches", problems),
        device=device,
        profile=raw.get("profile"),
    )
    if workload.model is None and workload.profile is None:
        problems.append(SpecProblem("spec.workload", "name a model (spec.workload.model, e.g. resnet50) or a stored profile (spec.workload.profile)"))
    knobs = dict(spec.get("scheduling") or {})
    budget_raw = spec.get("memoryBudget")
    # where each knob was read: a problem names the annotation the user set, not the spec field it overrides
    fields = {"memoryBudget": "spec.memoryBudget", **{k: f"spec.scheduling.{k}" for k in ("maxSwapRate", "planEvents", "recompute")}}
    for key, target in ANNOTATIONS.items():
        value = (annotations or {}).get(ANNOTATION_PREFIX + key)
        if value is not None:
            fields[target] = f"metadata.annotations.{ANNOTATION_PREFIX}{key}"
            if target == "memoryBudget":
                budget_raw = value
            else:
                knobs[target] = value
    budget = None
    if budget_raw is not None:
        try:
            budget = parse_quantity(budget_raw, fields["memoryBudget"])
        except SpecError as exc:
            problems.extend(exc.problems)
    rate = knobs.get("maxSwapRate")
    if rate is not None:
        try:  # the hook's own rule (tensile.knobs): a rate it refuses would switch it off inside the pod
            rate = parse_swap_rate(rate, fields["maxSwapRate"])
        except KnobError as exc:
            problems.append(SpecProblem(exc.field, exc.problem))
            rate = None
    recompute = switch(knobs.get("recompute", True))
    if recompute is None:
        problems.append(SpecProblem(fields["recompute"], f"'{knobs['recompute']}' is not a yes/no value; write true or false"))
        recompute = True
    plan_events = knobs.get("planEvents", "auto")
    if plan_events not in PLAN_EVENTS:
        problems.append(SpecProblem(fields["planEvents"], f"'{plan_events}' is not one of {', '.join(PLAN_EVENTS)} "
                                    "(auto: native events only on CUDA, every event on the CPU)"))
    raw_sel = dict(spec.get("gpuSelector") or {})
    min_memory = 0
    if raw_sel.get("minMemory") is not None:
        try:
            min_memory = parse_quantity(raw_sel["minMemory"], "spec.gpuSelector.minMemory")
        except SpecError as exc:
            problems.extend(exc.problems)
    selector = GpuSelector(
        nodes=tuple(raw_sel.get("nodes") or ()),
        gpu_names=tuple(raw_sel.get("gpuNames") or ()),
        uuids=tuple(raw_sel.get("uuids") or ()),
        min_memory_bytes=min_memory,
        allow_simulated=bool(raw_sel.get("allowSimulated", True)),
    )
    template = spec.get("template") or {}
    containers = (template.get("spec") or {}).get("containers") or []
    if not containers:
        problems.append(SpecProblem("spec.template.spec.containers", "needs at least one container: the training command"))
    if problems:
        raise SpecError(problems)
    return JobSpec(workload, budget, selector, rate, recompute, template, plan_events, fields["memoryBudget"],
                   fields["maxSwapRate"], tuple(unknown_annotations(annotations)))
