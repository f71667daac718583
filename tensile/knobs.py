"""A job's knobs, each named once for every medium that sets it and read by one rule; amounts of memory as
messages show them.

A knob (memory budget, max swap rate, recompute, plan events) is written in a TrainingJob's spec or its
`tensile.dev/*` annotation (tensile/trainingjob_spec.py: the operator's webhook and `tensile local` read jobs
with it), reaches the hook as a TENSILE_* variable (the operator's pod, `tensile run`, `tensile local`;
runtime_hook/tensile_hook/settings.py reads it) and is a flag of the CLI. Each `Knob` below holds the four names
and the rules; with a rule of their own each, a TrainingJob's annotation `tensile.dev/max-swap-rate: 2` was
admitted and placed, and its pod's hook then refused the same value and switched itself off: the job ran at its
unscheduled peak on a GPU admitted by its scheduled one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tensile.devices import bytes_written, over_max_bytes
from tensile.errors import TensileUserError
from tensile.plan import PLAN_EVENTS as PLAN_EVENT_CHOICES

T = TypeVar("T", covariant=True)  # a knob's value read from its variable or its flag
J = TypeVar("J", covariant=True)  # read from a TrainingJob
D = TypeVar("D")
KIB = 1024
MIB = 1024**2
ANNOTATION_PREFIX = "tensile.dev/"


class KnobError(ValueError):
    """A knob's value refused: `field` (a variable, a CLI option, a spec field or an annotation) and `problem`
    (what is wrong and what to write instead); str() is 'field: problem', as the hook and the CLI print it."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """A value the hook reads from its environment variable, which a CLI flag sets: `parse` reads the text of either
    and raises KnobError naming the field it is given."""

    variable: str  # the hook's environment variable: TENSILE_MAX_SWAP_RATE
    option: str  # the CLI's flag: --max-swap-rate
    parse: Callable[[str, str], T]

    def from_option(self, text: str) -> T:
        """The flag's value, refused as bad input naming the flag: the command and the hook it starts take the same."""
        try:
            return self.parse(text, self.option)
        except ValueError as exc:
            raise TensileUserError(str(exc)) from None

    def from_environment(self, environ: Mapping[str, str], default: D) -> T | D:
        """The variable's value (unset or empty: `default`), as the hook reads it."""
        text = environ.get(self.variable)
        return self.parse(text, self.variable) if text else default


@dataclass(frozen=True)
class Knob(Setting[T], Generic[T, J]):
    """One knob by each of its names, and how its values are read. `parse` reads the text of its variable or its
    flag; `parse_in_job` a value written in a TrainingJob (YAML: a number or a boolean in the spec, text in the
    annotation). Both raise KnobError naming the field they are given."""

    spec_field: str  # the field of a TrainingJob's spec, as a message names it: spec.scheduling.maxSwapRate
    annotation: str  # the annotation that overrides the field: tensile.dev/max-swap-rate
    parse_in_job: Callable[[object, str], J]

    @property
    def annotation_field(self) -> str:
        """The annotation as a message names it, beside the spec's fields."""
        return f"metadata.annotations.{self.annotation}"

    def in_job(self, spec: Mapping, annotations: Mapping | None) -> tuple[object, str]:
        """The knob's value in a TrainingJob, unparsed, and the field it was read from: its annotation over its spec
        field; (None, the spec field) when neither sets it."""
        value = (annotations or {}).get(self.annotation)
        if value is not None:
            return value, self.annotation_field
        node: object = spec
        for key in self.spec_field.split(".")[1:]:
            node = node.get(key) if isinstance(node, Mapping) else None
        return node, self.spec_field


def parse_number(text: object, field: str, valid: Callable[[float], bool], expected: str) -> float:
    """One number checked against its range, the error naming `field`. Takes text (a variable, an option, an
    annotation) or a number (a spec field); a boolean, NaN and infinities are no numbers of any range."""
    try:
        if isinstance(text, bool) or not isinstance(text, (int, float, str)):
            raise ValueError(text)
        value = float(text)
    except ValueError:
        raise KnobError(field, f"'{text}' is not a number; give {expected}") from None
    if not valid(value):  # NaN compares false with everything, so no range lets it through
        raise KnobError(field, f"must be {expected} (was {text})")
    return value


def parse_choice(value: object, field: str, choices: Collection[str], note: str = "") -> str:
    """One of `choices`, as written (no case folded); `note` says what they mean."""
    if not isinstance(value, str) or value not in choices:
        raise KnobError(field, f"'{value}' is not one of {', '.join(choices)}{note}")
    return value


def parse_swap_rate(text: object, field: str) -> float:
    """A job's max swapping rate, in (0, 1] as the planner, the agent and the hook take it: 0 or less would
    forbid every swap and above 1 means nothing, so either is a mistake to name, not to plan with."""
    return parse_number(text, field, lambda v: 0 < v <= 1, "a share of the GPU's swap traffic in (0, 1], e.g. 0.5")


SMALLEST_BUDGET = 2**20  # a byte budget below it is a unit left off ("2" meant 2 GiB), not a plan anyone wants


def parse_budget(text: str, field: str) -> float:
    """A memory budget as the hook and the CLI take it: '0.6' is 60% of the vanilla peak; '2e9', '2000000000',
    '12Gi' or '12GiB' is bytes. A number above 1 with a fraction ('1.5') is refused: it is a mistaken fraction,
    which read as bytes was a 1-byte budget."""
    expected = "give whole bytes (2000000000, 2e9, 12Gi, 12GiB) or a fraction of the vanilla peak in (0, 1] (e.g. 0.6)"
    try:
        value = float(text)
    except ValueError:
        written = bytes_written(text)
        if written is None:
            raise KnobError(field, f"'{text}' is not a number of bytes or a fraction of the vanilla peak; "
                                   f"{expected}") from None
        value = written
    if problem := over_max_bytes(value):
        raise KnobError(field, problem)
    if not value > 0:
        raise KnobError(field, f"must be positive (was {text}); {expected}")
    if value > 1 and not value.is_integer():
        raise KnobError(field, f"'{text}' is neither a fraction nor bytes: fractions of the vanilla peak must be in "
                               "(0, 1] (e.g. 0.6) and byte counts whole (e.g. 12GiB or 12000000000)")
    if 1 < value < SMALLEST_BUDGET:
        raise KnobError(field, f"'{text}' is {int(value):,} bytes, less than 1 MiB, which no training fits in: give a "
                               f"unit ({text}MiB, {text}GiB) or a fraction of the vanilla peak in (0, 1] (e.g. 0.6)")
    return value


def budget_bytes(budget: float | None, vanilla_peak: int) -> int | None:
    """A budget `parse_budget` read, in bytes: a fraction (<= 1) of the vanilla peak, else bytes."""
    if budget is None:
        return None
    return int(budget * vanilla_peak) if budget <= 1.0 else int(budget)


def parse_memory(value: object, field: str) -> int:
    """Bytes from an int or a memory quantity: Kubernetes' ('6Gi', '512Mi', '2e9') or the CLI's ('6GiB', '80GB'),
    as a TrainingJob writes them; no fraction, which only the CLI's budget takes."""
    hint = "write bytes or a quantity like 6Gi"
    not_memory = KnobError(field, f"'{value}' is not a memory size; {hint}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise not_memory
    try:
        number = float(value)
    except ValueError:  # a number with a unit
        written = bytes_written(str(value))
        if written is None:
            raise not_memory from None
        number = written
    if not math.isfinite(number):
        raise not_memory
    if problem := over_max_bytes(number):
        raise KnobError(field, problem)
    if not number > 0:
        raise KnobError(field, f"must be positive (was {value}); {hint}")
    if number < 1:  # 0.6 is no budget of 0 bytes: the user meant a fraction, which only the CLI's --memory-budget takes
        raise KnobError(field, f"'{value}' is under one byte: {hint} "
                               "(a fraction of the vanilla peak is for the CLI's --memory-budget, not a TrainingJob)")
    return int(number)


def parse_memory_or_zero(value: object, field: str) -> int:
    """`parse_memory`'s bytes, or none at all (0, 0Mi): a per-job context a simulated GPU's processes do not hold."""
    if isinstance(value, (int, str)) and not isinstance(value, bool) and bytes_written(str(value)) == 0:
        return 0
    return parse_memory(value, field)


def parse_switch(value: object, field: str) -> bool:
    """A yes/no value in a TrainingJob: a boolean (the spec) or text (an annotation: true/false, yes/no, on/off,
    1/0); anything else is refused rather than guessed (a typo must not flip a knob)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise KnobError(field, f"'{value}' is not a yes/no value; write true or false")


def parse_true_false(text: str, field: str) -> bool:
    """The hook's and the CLI's yes/no: `true` or `false`, as the operator writes the variable."""
    return parse_choice(text, field, ("true", "false")) == "true"


def parse_plan_events(value: object, field: str) -> str:
    """Which events a job's plans may use (tensile.plan.PLAN_EVENTS)."""
    return parse_choice(value, field, PLAN_EVENT_CHOICES, " (auto: native events only on CUDA, every event on the CPU)")


MAX_SWAP_RATE = Knob(variable="TENSILE_MAX_SWAP_RATE", option="--max-swap-rate", parse=parse_swap_rate,
                     spec_field="spec.scheduling.maxSwapRate", annotation=ANNOTATION_PREFIX + "max-swap-rate",
                     parse_in_job=parse_swap_rate)
# bytes or a fraction of the vanilla peak where it is text; a TrainingJob's budget is bytes
MEMORY_BUDGET = Knob(variable="TENSILE_MEMORY_BUDGET", option="--memory-budget", parse=parse_budget,
                     spec_field="spec.memoryBudget", annotation=ANNOTATION_PREFIX + "memory-budget",
                     parse_in_job=parse_memory)
RECOMPUTE = Knob(variable="TENSILE_RECOMPUTE", option="--no-recompute", parse=parse_true_false,
                 spec_field="spec.scheduling.recompute", annotation=ANNOTATION_PREFIX + "recompute",
                 parse_in_job=parse_switch)
PLAN_EVENTS = Knob(variable="TENSILE_PLAN_EVENTS", option="--plan-events", parse=parse_plan_events,
                   spec_field="spec.scheduling.planEvents", annotation=ANNOTATION_PREFIX + "plan-events",
                   parse_in_job=parse_plan_events)
# No TrainingJob names it: the memory the job was admitted with on its device (`tensile.admission.admitted_bytes`),
# which the operator's pod, `tensile local` and `tensile run --memory-cap` give its process, whose CUDA memory the
# hook's sitecustomize caps at it (runtime_hook/tensile_hook/memory_cap.py), whether the hook then runs or not
MEMORY_CAP = Setting("TENSILE_MEMORY_CAP", "--memory-cap", parse_memory)
# Beside it: the part of that size admission counted for what the process holds outside PyTorch's caching allocator
# (its GPU's per-job context: the CUDA context), which the cap keeps out of the allocator's share
CONTEXT_BYTES = Setting("TENSILE_CONTEXT_BYTES", "--context-bytes", parse_memory_or_zero)
KNOBS: tuple[Knob[Any, Any], ...] = (MAX_SWAP_RATE, MEMORY_BUDGET, RECOMPUTE, PLAN_EVENTS)


def knob_variables(memory_budget: str | int | None = None, max_swap_rate: float | None = None,
                   plan_events: str | None = None, recompute: bool | None = None,
                   memory_cap: int | None = None, context_bytes: int | None = None) -> dict[str, str]:
    """The hook's variables for a job's knobs and its memory cap (with the context it counts), as the operator's pods,
    `tensile run` and `tensile local` set them; one given as None is left out (the environment's value, else the
    hook's default, stands)."""
    values: dict[Setting[Any], object] = {MEMORY_BUDGET: memory_budget, MAX_SWAP_RATE: max_swap_rate,
                                          PLAN_EVENTS: plan_events, RECOMPUTE: recompute, MEMORY_CAP: memory_cap,
                                          CONTEXT_BYTES: context_bytes}
    return {knob.variable: _variable_text(value) for knob, value in values.items() if value is not None}


def _variable_text(value: object) -> str:
    """A value as its variable holds it: a yes/no as `true`/`false` (what `parse_true_false` reads back)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def memory_text(nbytes: float) -> str:
    """An amount of memory for a message: MiB from 1 MiB up, with a tenth below 100 MiB where it is not whole (a
    9.1 MiB peak shown as '9 MiB' read as if a 9Mi budget would do), KiB or bytes below (a 1 KiB budget showed as
    '0 MiB', which reads as no budget at all)."""
    if abs(nbytes) >= MIB:
        mib = nbytes / MIB
        return f"{mib:,.1f} MiB" if abs(mib) < 100 and round(mib, 1) != round(mib) else f"{mib:,.0f} MiB"
    if abs(nbytes) >= KIB:
        return f"{nbytes / KIB:,.0f} KiB"
    return f"{nbytes:,.0f} bytes"


def unreachable_budget_text(budget: int, lowest: int, rate: float | None = None, rate_field: str = "") -> str:
    """Why a job's memory budget cannot be held, and the fix, after the budget's field name: one text for the
    operator's `BudgetUnreachable` and `tensile local`'s, which had each a wording of their own. `lowest` is the
    lowest peak any plan reaches at the job's max swap rate (`rate`, set in `rate_field`), so a rate below 1
    is a second way out."""
    at_rate = f" at {rate_field} {rate:g}" if rate is not None and rate < 1 else ""
    raise_rate = f", raise {rate_field}" if at_rate else ""
    return (f"{memory_text(budget)} is below the lowest peak any plan reaches{at_rate}, {memory_text(lowest)}: raise it to "
            f"at least that (e.g. {math.ceil(lowest / MIB)}Mi){raise_rate} or reduce spec.workload.batchSize")
