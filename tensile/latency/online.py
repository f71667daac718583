"""Online correction (paper IV-E): EWMA of measured latencies, per op family and shape.

Predictions start the job; measurements take over as they come. Ops with the same family, name,
shapes and parameters share one average (a transformer's twelve identical layers learn together),
and a family's measured/predicted ratio corrects its ops not measured yet. The plan-updating rule
compares `corrected_sum()` (s') with the sum its plan was made from (s).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tensile.latency.families import family_of
from tensile.workload import Op, Workload


def op_key(op: Op) -> str:
    """Family + name + shapes + params (+ the inputs' contiguous runs when one is not contiguous): ops that
    must take the same time share this key. A float operand's value is left out unless it is whole or a
    half (pow's fast paths: 2, 3, 0.5, -1): Adam divides by a bias correction and steps by a size that
    change every step, so with them in the key its 411 MB `div` on VGG-16's FC weight, measured by
    calibration, was never found again at another step and the MLP priced it at a third of its time."""
    key = [family_of(op) or "other", op.name, op.shapes, _timeless(op.params), *([op.runs] if op.runs else [])]
    return json.dumps(key, separators=(",", ":"), default=str)


def _timeless(value: Any) -> Any:
    """The params with every float that does not pick a kernel path replaced by 'float'."""
    if isinstance(value, float):
        return value if (2 * value).is_integer() else "float"
    if isinstance(value, (tuple, list)):
        return [_timeless(item) for item in value]
    return value


class LatencyEWMA:
    """Corrected latencies of one workload's ops from an exponentially weighted moving average."""

    def __init__(self, workload: Workload, alpha: float = 0.3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._ops = workload.ops
        self.predicted = [op.latency for op in workload.ops]  # the cold-start predictions
        self._keys = [op_key(op) for op in workload.ops]
        self._families = [family_of(op) or "other" for op in workload.ops]
        self._ewma: dict[str, float] = {}
        self._ratio: dict[str, float] = {}  # family -> EWMA of measured / predicted

    def _update(self, table: dict[str, float], key: str, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1.0 - self.alpha) * old + self.alpha * value

    def observe(self, op: Op | int, seconds: float) -> None:
        """One measured latency of op (an Op of the workload or its index)."""
        index = op if isinstance(op, int) else op.index
        if seconds < 0 or seconds != seconds:
            return
        self._update(self._ewma, self._keys[index], float(seconds))
        predicted = self.predicted[index]
        if predicted > 0:
            self._update(self._ratio, self._families[index], float(seconds) / predicted)

    def observe_iteration(self, seconds: Sequence[float]) -> None:
        """The measured latencies of one whole iteration, one per op in order."""
        if len(seconds) != len(self._ops):
            raise ValueError(f"expected {len(self._ops)} latencies, got {len(seconds)}")
        for index, value in enumerate(seconds):
            self.observe(index, value)

    def latency(self, index: int) -> float:
        """The measured average for this op's key; else its prediction scaled by its family's ratio."""
        measured = self._ewma.get(self._keys[index])
        if measured is not None:
            return measured
        return self.predicted[index] * self._ratio.get(self._families[index], 1.0)

    def latencies(self) -> list[float]:
        return [self.latency(i) for i in range(len(self._ops))]

    def corrected_sum(self) -> float:
        """s' of the plan-updating rule: the newest estimate of the sum of op latencies."""
        return float(sum(self.latencies()))

    def predicted_sum(self) -> float:
        """The cold-start sum (s before any measurement), kept however `apply` rewrites the ops."""
        return float(sum(self.predicted))

    def apply(self, workload: Workload | None = None) -> None:
        """Write the corrected latencies into the workload's ops (for re-planning)."""
        ops = workload.ops if workload is not None else self._ops
        for index, op in enumerate(ops):
            op.latency = self.latency(index)
