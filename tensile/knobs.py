"""A job's knobs as every entry point reads them, and amounts of memory as messages show them.

One rule per knob: the hook (TENSILE_* variables, runtime_hook/tensile_hook/settings.py), the CLI (`tensile run
--max-swap-rate`), a TrainingJob's spec and its `tensile.dev/*` annotations (tensile/trainingjob_spec.py, which
`tensile local` and the webhook use too) all call these. With a rule of their own each, a TrainingJob's
annotation `tensile.dev/max-swap-rate: 2` was admitted and placed, and its pod's hook then refused the
same value and switched itself off: the job ran at its unscheduled peak on a GPU admitted by its
scheduled one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

KIB = 1024
MIB = 1024**2
SWAP_RATE = "a share of the GPU's swap traffic in (0, 1], e.g. 0.5"


class KnobError(ValueError):
    """A knob's value refused: `field` (a variable, a CLI option, a spec field or an annotation) and `problem`
    (what is wrong and what to write instead); str() is 'field: problem', as the hook and the CLI print it."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


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


def parse_swap_rate(text: object, field: str) -> float:
    """A job's max swapping rate, in (0, 1] as the planner, the agent and the hook take it: 0 or less would
    forbid every swap and above 1 means nothing, so either is a mistake to name, not to plan with."""
    return parse_number(text, field, lambda v: 0 < v <= 1, SWAP_RATE)


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
