"""Scheduling events, plans and forecasts: what the planner hands to the hook, agent and operator (docs/concepts.md)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from tensile.devices import MAX_BYTES

if TYPE_CHECKING:
    from tensile.workload import Workload

EVENT_KINDS = ("swap_out", "swap_in", "release", "recompute")
# which events a job's plans may use (TENSILE_PLAN_EVENTS, a TrainingJob's spec.scheduling.planEvents):
# "all", "native" (activation swaps, recomputes of convolutions and batch norms) or "auto" (native on CUDA, all on the CPU device)
PLAN_EVENTS = ("auto", "all", "native")


def native_plan_events(plan_events: str, device_type: str) -> bool:
    """Whether plans keep to native events (the planner's `activations_only`: activation swaps, recomputes of convolutions and batch norms): what the hook's native
    path carries; on a GPU the dispatch path that every other event needs costs more than it saves."""
    return plan_events == "native" or (plan_events == "auto" and device_type == "cuda")


@dataclass(frozen=True, slots=True)
class Event:
    """One scheduling instruction; it fires `delay` seconds after op `trigger` of the job ends.

    `next_iteration` marks a cross-iteration swap-in: its trigger op is in the following iteration.
    A recompute fires after `trigger` so the tensor is back before the op that needs it.
    """

    job: str
    kind: str
    tensor: int
    trigger: int
    delay: float = 0.0
    next_iteration: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def memory_saving_rate(vanilla_peak_bytes: int, scheduled_peak_bytes: int) -> float:
    """The paper's MSR, (VMP - EMP) / VMP."""
    if not vanilla_peak_bytes:
        return 0.0
    return (vanilla_peak_bytes - scheduled_peak_bytes) / vanilla_peak_bytes


@dataclass(slots=True)
class Forecast:
    """The numbers the operator admits by and the dashboards show beside the observed ones."""

    vanilla_peak_bytes: int
    scheduled_peak_bytes: int
    predicted_iteration_seconds: float = 0.0  # vanilla, from the latency model
    predicted_extra_seconds: float = 0.0  # added by the plan

    @property
    def msr(self) -> float:
        return memory_saving_rate(self.vanilla_peak_bytes, self.scheduled_peak_bytes)

    @property
    def predicted_eor(self) -> float:
        """Extra overhead rate ETC / VTC."""
        if not self.predicted_iteration_seconds:
            return 1.0
        return (self.predicted_iteration_seconds + self.predicted_extra_seconds) / self.predicted_iteration_seconds


@dataclass(slots=True)
class Plan:
    """The events of one job, versioned, for the workload signature it was made for."""

    job: str
    version: int
    signature: str
    events: list[Event] = field(default_factory=list)
    forecast: Forecast | None = None
    # the job's memory budget the plan was made for, when a node agent made it: the operator may lower it
    # while the job runs (an annotation), and the hook's guard then holds the job to it
    memory_budget_bytes: int | None = None

    def to_dict(self) -> dict:
        return {
            "job": self.job,
            "version": self.version,
            "signature": self.signature,
            "events": [e.to_dict() for e in self.events],
            "forecast": asdict(self.forecast) if self.forecast else None,
            "memory_budget_bytes": self.memory_budget_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        forecast = data.get("forecast")
        return cls(
            job=data["job"],
            version=int(data["version"]),
            signature=data["signature"],
            events=[Event(**e) for e in data.get("events", [])],
            forecast=Forecast(**forecast) if forecast else None,
            memory_budget_bytes=data.get("memory_budget_bytes"),
        )


def plan_problems(plan: Plan, workload: Workload) -> list[str]:
    """What in `plan` cannot belong to a plan for `workload` (events of unknown kinds, on tensors it does not
    have, triggered by ops it does not have, or delayed by a negative or endless time; a budget or forecast that
    is no amount of memory): a plan file edited or saved for another trace, or an agent's answer gone wrong,
    refused before it runs rather than carried as far as it goes."""
    problems = [f"{name} {value!r} is not a whole number" for name, value in (("version", plan.version),)
                if not _whole(value, 0)]
    if plan.memory_budget_bytes is not None and not _whole(plan.memory_budget_bytes, 1):
        problems.append(f"memory_budget_bytes {plan.memory_budget_bytes!r} is not an amount of memory "
                        f"(whole bytes from 1 to {MAX_BYTES})")
    if plan.forecast is not None:
        problems += [f"forecast {name} {value!r} is not an amount of memory" for name, value in
                     (("vanilla_peak_bytes", plan.forecast.vanilla_peak_bytes),
                      ("scheduled_peak_bytes", plan.forecast.scheduled_peak_bytes)) if not _whole(value, 0)]
        problems += [f"forecast {name} {value!r} is not a time" for name, value in
                     (("predicted_iteration_seconds", plan.forecast.predicted_iteration_seconds),
                      ("predicted_extra_seconds", plan.forecast.predicted_extra_seconds)) if not _seconds(value)]
    for number, event in enumerate(plan.events):
        where = f"event {number} ({event.kind} of tensor {event.tensor})"
        if event.kind not in EVENT_KINDS:
            problems.append(f"{where}: kind '{event.kind}' is not one of {', '.join(EVENT_KINDS)}")
        elif not _whole(event.tensor, 0) or event.tensor not in workload.tensors:
            problems.append(f"{where}: the workload has no tensor {event.tensor!r}")
        elif not _whole(event.trigger, 0) or not event.trigger < len(workload.ops):
            problems.append(f"{where}: trigger op {event.trigger!r} is not one of the workload's ops 0-{len(workload.ops) - 1}")
        elif not _seconds(event.delay):
            problems.append(f"{where}: delay {event.delay!r} s is not a time after its trigger op")
        elif not _flag(event.next_iteration):
            problems.append(f"{where}: next_iteration {event.next_iteration!r} is not true or false")
    return problems


def _whole(value: object, least: int) -> bool:
    """A whole number (no bool) from `least` to MAX_BYTES."""
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= MAX_BYTES


def _flag(value: object) -> bool:
    return isinstance(value, bool)


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def plan_from_data(data: object) -> Plan:
    """A plan as JSON gives it (a plan file, a node agent's answer), or a ValueError saying why it is none."""
    try:
        if not isinstance(data, dict):
            raise TypeError(f"a JSON object was expected, not {type(data).__name__}")
        return Plan.from_dict(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from None


def summary(problems: list[str]) -> str:
    """The first three of a plan's problems, and how many more."""
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"{'; '.join(problems[:3])}{more}"


def load_plan(path: str, workload: Workload, what: str) -> Plan:
    """A plan file (`tensile forecast --save-plan`) for `workload`, or a ValueError that names it (`what`: the
    option or variable it was given by) and what is wrong with it."""
    try:
        with open(path) as handle:
            data = json.load(handle)
        plan = plan_from_data(data)
    except (OSError, ValueError) as exc:
        why = str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}"  # plan_from_data's says its type
        raise ValueError(f"{what} {path} is not a readable plan file ({why}); "
                         "save one with tensile forecast --save-plan") from None
    problems = plan_problems(plan, workload)
    if problems:
        raise ValueError(f"{what} {path} is no plan for the workload given with it: {summary(problems)}; "
                         "save the plan with the workload it was made for (tensile forecast --save W.json --save-plan P.json)")
    return plan


def rebind(plan: Plan, made_for: Workload, onto: Workload) -> Plan | None:
    """`plan`, made for `made_for`, in the tensor ids of `onto`: another recording of the same iteration (equal
    signatures), whose ids can differ (a forecast traced on the meta device numbers its tensors in its own
    order: mlp-wide's forecast and live iteration differed at 185 of their op operands, so an agent's plan for
    the forecast swapped the wrong tensors in the live one). Tensors correspond by their place among the ops'
    operands where both recorded them (a trace on the meta device leaves out what stays on the host, such as
    Adam's step counters, which a live CPU iteration records); None where the two do not map one to one."""
    if made_for is onto:
        return plan
    if made_for.signature != onto.signature or len(made_for.ops) != len(onto.ops):
        return None
    ids: dict[int, int] = {}
    taken: dict[int, int] = {}
    for a, b in zip(made_for.ops, onto.ops):
        here, there = [*a.inputs, *a.outputs], [*b.inputs, *b.outputs]
        if len(here) != len(there):
            continue
        for x, y in zip(here, there):
            if ids.setdefault(x, y) != y or taken.setdefault(y, x) != x:
                return None
    if any(event.tensor not in ids for event in plan.events):
        return None
    return replace(plan, events=[replace(event, tensor=ids[event.tensor]) for event in plan.events])
