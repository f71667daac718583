"""The admitted size (tensile.admission): consumable capacity's request policy rounding, and the one sum admission,
claims and `tensile render` share."""

from __future__ import annotations

from tensile.admission import GIB, MIB, RequestPolicy, admitted_bytes, allocator_slack, parse_quantity, quantity
from tensile.allocator import reserved_peak
from tensile.forecast import trace_workload


def test_a_request_without_an_amount_takes_the_default_else_the_whole_device() -> None:
    assert RequestPolicy(default=GIB).consumed(None, 80 * GIB) == GIB
    assert RequestPolicy().consumed(None, 80 * GIB) == 80 * GIB


def test_valid_range_rounds_up_to_min_then_to_min_plus_steps_and_refuses_above_max() -> None:
    policy = RequestPolicy(default=GIB, minimum=GIB, maximum=8 * GIB, step=256 * MIB)
    assert policy.consumed(1, 80 * GIB) == GIB
    assert policy.consumed(GIB + 1, 80 * GIB) == GIB + 256 * MIB
    assert policy.consumed(GIB + 256 * MIB, 80 * GIB) == GIB + 256 * MIB
    assert policy.consumed(8 * GIB, 80 * GIB) == 8 * GIB
    assert policy.consumed(8 * GIB + 1, 80 * GIB) is None
    assert RequestPolicy(minimum=GIB).consumed(GIB + 3, 80 * GIB) == GIB + 3  # no step: as it is


def test_valid_values_round_up_to_the_next_listed_value() -> None:
    policy = RequestPolicy(default=GIB, valid_values=(GIB, 4 * GIB, 10 * GIB))
    assert policy.consumed(2 * GIB, 80 * GIB) == 4 * GIB
    assert policy.consumed(11 * GIB, 80 * GIB) is None


def test_a_policy_reads_back_what_it_writes() -> None:
    policy = RequestPolicy(default=256 * MIB, minimum=256 * MIB, step=256 * MIB)
    entry = policy.to_capacity(48 * GIB)
    assert entry == {"value": "48Gi", "requestPolicy": {"default": "256Mi", "validRange": {"min": "256Mi",
                                                                                           "step": "256Mi"}}}
    assert RequestPolicy.from_capacity(entry) == policy
    assert parse_quantity(entry["value"]) == 48 * GIB


def test_quantities_are_written_in_the_largest_whole_unit() -> None:
    assert [quantity(n) for n in (3 * GIB, 1536 * MIB, 2048, 1000)] == ["3Gi", "1536Mi", "2Ki", "1000"]


def test_the_admitted_size_is_peak_plus_slack_plus_context_rounded_to_the_policy() -> None:
    policy = RequestPolicy(default=256 * MIB, minimum=256 * MIB, step=256 * MIB)
    assert admitted_bytes(1000 * MIB, 20 * MIB, 600 * MIB) == 1620 * MIB
    assert admitted_bytes(1000 * MIB, 20 * MIB, 600 * MIB, policy) == 1792 * MIB
    assert admitted_bytes(1000 * MIB, 20 * MIB, 600 * MIB, policy, capacity=GIB) is None


def test_the_allocator_slack_is_the_reserved_over_the_requested_peak_on_cuda_and_none_on_the_cpu(tiny_workload) -> None:
    """What admission adds over the tensors' peak: the caching allocator's rounding and fragmentation (expandable
    segments, the pods' default); the CPU device's allocator caches nothing, so a CPU job is booked without it."""
    cuda = tiny_workload()
    peaks = reserved_peak(cuda, expandable_segments=True)
    assert cuda.device == "cuda" and allocator_slack(cuda) == peaks.reserved_peak_bytes - peaks.requested_peak_bytes > 0
    cpu = trace_workload("examples/tiny_mlp.py:build", 4, device="cpu")
    assert allocator_slack(cpu) == 0
