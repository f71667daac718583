"""Keep CPython's full garbage collections off the operator's long-lived heap.

Torch and the cached forecasts (a traced workload is some 70,000 objects) give the operator ~400,000
tracked objects; a full collection then scans them all, 0.2-0.4 s with every thread stopped, and the
admissions in flight waited that long (the p99 of benchmarks/operator_admission.py). Objects known to
be long-lived (after start-up, after each new forecast) are collected once and then frozen, so the
collector's later passes scan only the operator's churn."""

from __future__ import annotations

import gc


def freeze_long_lived() -> None:
    """Collect what is garbage now (so no cycle is frozen forever), then freeze the rest."""
    gc.collect()
    gc.freeze()
