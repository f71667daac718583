"""Swap scheduling (TENSILE Algorithm 2): place a tensor's swap-out and swap-in on the GPU's copy channels.

A swap-out may start once the access before the peak has ended and must end before the peak op
starts; a swap-in must start after the peak op (and the swap-out) and end before the next access
starts. The swap-out goes as early as possible, the swap-in as late as possible, and neither
overlaps another transfer in its direction: PCIe moves one tensor at a time per direction, for all
jobs of the GPU together. A swap whose swap-in cannot be hidden is not planned at all: no plan
relies on a passive swap-in.

The cross-iteration rule falls out of the slot model: a persistent slot's last gap runs from its
last access in this iteration (the optimizer's update) to its first access in the next one.

Each job's transfers repeat every iteration, so a job books the channel on a circle of its own
period; all jobs are taken to start their iterations together (the planner cannot know their phase).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tensile.timeline import Slot, Timeline, transfer_seconds

EPS = 1e-12


@dataclass(frozen=True, slots=True)
class Transfer:
    """One booked copy: its job, slot, direction and time on the job's unrolled axis."""

    job: str
    slot: int
    direction: str  # "d2h" (swap-out) or "h2d" (swap-in)
    start: float
    end: float


class Channel:
    """The busy intervals of one copy direction of one GPU, kept sorted and disjoint."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    @staticmethod
    def _pieces(start: float, duration: float, period: float) -> list[tuple[float, float]]:
        base = start % period
        if base + duration <= period + EPS:
            return [(base, base + duration)]
        return [(base, period), (0.0, base + duration - period)]

    def _after_conflict(self, lo: float, hi: float) -> float | None:
        """End of the latest interval overlapping [lo, hi), or None when it is free."""
        i = bisect.bisect_left(self.starts, hi - EPS) - 1
        if i >= 0 and self.ends[i] > lo + EPS:
            return self.ends[i]
        return None

    def _before_conflict(self, lo: float, hi: float) -> float | None:
        """Start of the earliest interval overlapping [lo, hi), or None when it is free."""
        i = bisect.bisect_right(self.ends, lo + EPS)
        if i < len(self.starts) and self.starts[i] < hi - EPS:
            return self.starts[i]
        return None

    def earliest(self, lo: float, hi: float, duration: float, period: float) -> float | None:
        """Earliest start x >= lo with [x, x + duration) free and x + duration <= hi."""
        x = lo
        while x + duration <= hi + EPS:
            shift = 0.0
            for a, b in self._pieces(x, duration, period):
                end = self._after_conflict(a, b)
                if end is not None:
                    shift = max(shift, end - a)
            if shift == 0.0:
                return x
            x += shift
        return None

    def latest(self, lo: float, hi: float, duration: float, period: float) -> float | None:
        """Latest start x with x >= lo, [x, x + duration) free and x + duration <= hi."""
        x = hi - duration
        while x >= lo - EPS:
            shift = 0.0
            for a, b in self._pieces(x, duration, period):
                start = self._before_conflict(a, b)
                if start is not None:
                    shift = max(shift, b - start)
            if shift == 0.0:
                return x
            x -= shift
        return None

    def book(self, start: float, duration: float, period: float) -> None:
        for a, b in self._pieces(start, duration, period):
            i = bisect.bisect_left(self.starts, a)
            self.starts.insert(i, a)
            self.ends.insert(i, b)


def gap_at(slot: Slot, p: int, n: int, cyclic: bool) -> tuple[int, int, int] | None:
    """The gap between two accesses of `slot` that contains op p: (before, after, p) unrolled, or None.

    `cyclic` allows the gap across the iteration boundary (persistent slots); p is then moved to
    the next iteration when it lies before the slot's first access."""
    acc = slot.accesses
    if not acc:
        return None
    i = bisect.bisect_left(acc, p)
    if i < len(acc) and acc[i] == p:
        return None
    if 0 < i < len(acc):
        return acc[i - 1], acc[i], p
    if not cyclic:
        return None
    if i == len(acc):
        return acc[-1], acc[0] + n, p
    return acc[-1], acc[0] + n, p + n


def place_swap(
    timeline: Timeline, gap: tuple[int, int, int], size: int, bandwidth: float, d2h: Channel, h2d: Channel
) -> tuple[float, float] | None:
    """(swap-out start, swap-in start) that frees the slot for the whole peak op, or None."""
    before, after, p = gap
    duration = transfer_seconds(size, bandwidth)
    period = timeline.period
    out = d2h.earliest(timeline.end(before), timeline.start(p), duration, period)
    if out is None:
        return None
    back = h2d.latest(max(timeline.end(p), out + duration), timeline.start(after), duration, period)
    if back is None:
        return None
    return out, back
