"""Releases and recomputes carried on the native path: an activation freed after its last forward use and
regenerated before backward reads it, from the inputs autograd saved behind it, with no dispatch mode;
training stays bit-identical and the measured peak falls."""

from __future__ import annotations

from tensile.plan import Event, Plan
from tensile.workload import Workload
from test_hook_correctness import assert_identical, deterministic, fit  # noqa: F401
from test_hook_native_swaps import STEPS, blocks, feature_activations, hooked

MADE_BY = ("aten.convolution.default", "aten.native_batch_norm.default")  # what the plans below recompute


def feature_recomputes(workload: Workload, budget: int | None = None, swap_the_rest: bool = False) -> Plan:
    """Every activation of the feature extractor that a convolution or a batch norm made (after which an in-place
    ReLU may write it) released after its last forward read and recomputed before its first backward read; with
    `swap_the_rest`, the others swapped as `feature_swaps` does."""
    events = []
    for tensor, last, first in feature_activations(workload):
        if workload.ops[tensor.created_by].name in MADE_BY:
            events += [Event("job", "release", tensor.id, last), Event("job", "recompute", tensor.id, first - 1)]
        elif swap_the_rest:
            events += [Event("job", "swap_out", tensor.id, last), Event("job", "swap_in", tensor.id, first - 1)]
    return Plan("job", 1, workload.signature, events)


def test_recomputes_are_carried_natively_and_train_bit_identically():
    plain = fit(blocks, 4, STEPS)
    state, report = hooked(blocks, feature_recomputes)
    assert_identical(plain, state)
    assert report.stood_down is None and not any("align" in m or "map" in m for m in report.messages), report.messages
    aligned = report.iterations[2]  # on the dispatch path: every event exactly
    # conv1, bn1 (+ ReLU) and conv2 released; conv2's recompute reads bn1's output, which reads conv1's: those two
    # come back as its inputs, checked before use, and only conv2's counts as a planned recompute
    assert aligned.events["release"] == 3 and aligned.recompute_bytes == 3 * 4 * 8 * 8 * 8 * 4, aligned
    for it in report.iterations[3:]:
        assert (it.path, it.mode) == ("native", "planned"), (it.path, it.mode)
        assert it.events == aligned.events and it.recompute_bytes == aligned.recompute_bytes, it
        assert it.swap_out_bytes == 0


def test_recomputes_and_swaps_together_lower_the_measured_peak():
    """A recompute reads a tensor the same iteration swapped out (batch norm's input, a convolution's output):
    it comes back first. Measured (an observed native iteration), the peak stays below both plans' parts."""
    plain = fit(blocks, 4, STEPS)
    both = lambda workload, budget=None: feature_recomputes(workload, budget, swap_the_rest=True)  # noqa: E731
    state, report = hooked(blocks, both, observe=True)
    assert_identical(plain, state)
    native = [it for it in report.iterations if it.path == "native"]
    assert len(native) == STEPS - 3, [(it.path, it.mode) for it in report.iterations]
    for it in native:
        assert it.peak_source == "measured" and it.events["release"] == 3 and it.events["swap_out"] > 0, it.events
        assert it.peak_bytes < report.vanilla_peak_bytes, (it.peak_bytes, report.vanilla_peak_bytes)
