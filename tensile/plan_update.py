"""Scheduling plan updating (TENSILE IV-E): the rule that says when a job's op latencies have drifted.

Measured op latencies of each job are folded into an exponentially weighted moving average
(`tensile.latency.LatencyEWMA`). When a job's average latency rate of change |s' - s| / s (s' the sum of its
corrected op latencies, s the sum its current plan was made with) passes the threshold, every job of its GPU
is planned again with the corrected latencies: the node agent does that off its request path
(node_agent/tensile_agent/planning.py), and the new plans take effect at each job's next iteration boundary.
"""

from __future__ import annotations

DEFAULT_THRESHOLD = 0.1  # |s' - s| / s past which a GPU is planned again (the paper leaves it to be set)


def change_rate(corrected_sum: float, planned_sum: float) -> float:
    """|s' - s| / s; 0 while nothing was planned with latencies (s = 0)."""
    return abs(corrected_sum - planned_sum) / planned_sum if planned_sum else 0.0


def drifted(corrected_sum: float, planned_sum: float, threshold: float = DEFAULT_THRESHOLD) -> bool:
    """Whether the job's latencies moved far enough from those its plan was made with to plan again."""
    return change_rate(corrected_sum, planned_sum) > threshold
