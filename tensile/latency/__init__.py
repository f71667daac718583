"""Op latencies before a job runs (roofline prior + learned correction) and while it runs (EWMA).

Importing this package does not import torch: predicting needs numpy only; `tensile calibrate`
(measuring and training) is where torch comes in.
"""

from tensile.latency.online import LatencyEWMA, op_key
from tensile.latency.predict import (
    QuickCalibrationWarning,
    UncalibratedWarning,
    assign_latencies,
    find_model,
    iteration_seconds,
    predict_iteration_seconds,
    predict_seconds,
)

__all__ = [
    "LatencyEWMA",
    "QuickCalibrationWarning",
    "UncalibratedWarning",
    "assign_latencies",
    "find_model",
    "iteration_seconds",
    "op_key",
    "predict_iteration_seconds",
    "predict_seconds",
]
