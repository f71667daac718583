"""A TrainingJob's spec and annotations as plain data, and the checks a CRD schema cannot express.

Every problem is a `SpecProblem`: the field it is about and a message that says how to fix it. The
webhook, the create handler and the CLI all use these functions, so a cluster without the webhook
still reports the same messages (as a Failed phase with a condition). In the core, not in `operator/`: the local
runner reads TrainingJob files with it too, and the core imports nothing of the operator (DESIGN section 2).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tensile.trace_choices import DTYPE_NAMES, OPTIMIZER_NAMES
from tensile.knobs import (ANNOTATION_PREFIX, KNOBS, MAX_SWAP_RATE, MEMORY_BUDGET, PLAN_EVENTS, RECOMPUTE, Knob,
                           KnobError, parse_memory)
from tensile.plan import native_plan_events

J = TypeVar("J")
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
    budget_field: str = field(default=MEMORY_BUDGET.spec_field, compare=False)
    swap_rate_field: str = field(default=MAX_SWAP_RATE.spec_field, compare=False)
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


def unknown_annotations(annotations: dict | None) -> list[str]:
    """The tensile.dev/* annotations that are no knob (`tensile.dev/memory-budgett`): a job does not fail for one
    (an annotation is free text to Kubernetes), but nothing may ignore it silently either."""
    known = {knob.annotation for knob in KNOBS}
    return sorted(k for k in annotations or {} if k.startswith(ANNOTATION_PREFIX) and k not in known)


def unknown_annotations_message(names: list[str] | tuple[str, ...]) -> str:
    """What the webhook warns and the job's `UnknownAnnotations` condition says: each name, the one it was
    probably meant to be, and the annotations Tensile reads."""
    known = [knob.annotation for knob in KNOBS]
    suffixes = [k.removeprefix(ANNOTATION_PREFIX) for k in known]  # alike by what follows the prefix all share
    parts = []
    for name in names:
        close = difflib.get_close_matches(name.removeprefix(ANNOTATION_PREFIX), suffixes, n=1, cutoff=0.75)
        parts.append(f"{name} (did you mean {ANNOTATION_PREFIX}{close[0]}?)" if close else name)
    return (f"{', '.join(parts)}: not {'a Tensile annotation' if len(names) == 1 else 'Tensile annotations'}, "
            f"ignored; Tensile reads {', '.join(known)}")


def _read(knob: Knob[Any, J], spec: dict, annotations: dict | None,
          problems: list[SpecProblem]) -> tuple[J | None, str]:
    """A knob's value in the job, by the rule the hook reads it with (a value it refused would switch it off inside
    the pod), and the field it was read from: a problem names the annotation the user set, not the spec field it
    overrides. None where neither sets it, or the value is refused (the problem noted)."""
    value, where = knob.in_job(spec, annotations)
    if value is None:
        return None, where
    try:
        return knob.parse_in_job(value, where), where
    except KnobError as exc:
        problems.append(SpecProblem(exc.field, exc.problem))
        return None, where


def parse_spec(spec: dict, annotations: dict | None = None) -> JobSpec:
    """The spec (with tensile.dev/* annotations overriding knobs) as a JobSpec; SpecError lists every problem."""
    problems: list[SpecProblem] = []
    raw = dict(spec.get("workload") or {})
    shape = raw.get("inputShape")
    if shape is not None and (not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d > 0 for d in shape)):
        problems.append(SpecProblem("spec.workload.inputShape", f"must be a list of positive integers, e.g. [3, 224, 224] (was {shape!r})"))
        shape = None
    optimizer = raw.get("optimizer", "adam")
    if optimizer not in OPTIMIZER_NAMES:
        problems.append(SpecProblem("spec.workload.optimizer", f"'{optimizer}' is not supported; use one of {', '.join(OPTIMIZER_NAMES)}"))
    dtype = raw.get("dtype", "float32")
    if dtype not in DTYPE_NAMES:
        problems.append(SpecProblem("spec.workload.dtype", f"'{dtype}' is not supported; use one of {', '.join(DTYPE_NAMES)}"))
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
    budget, budget_field = _read(MEMORY_BUDGET, spec, annotations, problems)
    rate, rate_field = _read(MAX_SWAP_RATE, spec, annotations, problems)
    recompute, _ = _read(RECOMPUTE, spec, annotations, problems)
    plan_events, _ = _read(PLAN_EVENTS, spec, annotations, problems)
    raw_sel = dict(spec.get("gpuSelector") or {})
    min_memory = 0
    if raw_sel.get("minMemory") is not None:
        try:
            min_memory = parse_memory(raw_sel["minMemory"], "spec.gpuSelector.minMemory")
        except KnobError as exc:
            problems.append(SpecProblem(exc.field, exc.problem))
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
    return JobSpec(workload, budget, selector, rate, recompute is not False, template, plan_events or "auto",
                   budget_field, rate_field, tuple(unknown_annotations(annotations)))
