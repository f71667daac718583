"""The admitted size (tensile.admission): consumable capacity's request policy rounding, and the one sum admission,
claims and `tensile render` share."""

from __future__ import annotations

from tensile.admission import GIB, MIB, RequestPolicy, admitted_bytes, allocator_slack, parse_quantity, quantity
from tensile.allocator import reserved_peak
from tensile.cublas_workspaces import LARGE_WORKSPACE_BYTES, SMALL_WORKSPACE_BYTES, cublas_workspaces
from tensile.forecast import trace_workload
from tensile.workload import Op, TensorInfo, Workload


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


def test_the_allocator_slack_is_the_reserved_peak_with_the_workspaces_over_the_tensors_on_cuda_and_none_on_the_cpu(
        tiny_workload) -> None:
    """What admission adds over the tensors' peak: the caching allocator's rounding and fragmentation (expandable
    segments, the pods' default) and the cuBLAS workspaces of the given size, which the tensors' peak does not hold
    (measured from the replay without them: the one with them requests the workspaces too); the CPU device's
    allocator caches nothing and it has no cuBLAS, so a CPU job is booked without it."""
    cuda = tiny_workload()
    assert cuda.device == "cuda"
    tensors = reserved_peak(cuda, expandable_segments=True).requested_peak_bytes
    slack = {size: allocator_slack(cuda, size) for size in (0, SMALL_WORKSPACE_BYTES, LARGE_WORKSPACE_BYTES)}
    for size, held in slack.items():
        with_workspaces = reserved_peak(cuda, expandable_segments=True, workspaces=cublas_workspaces(cuda, size))
        assert held == with_workspaces.reserved_peak_bytes - tensors
    assert 0 < slack[0] < slack[SMALL_WORKSPACE_BYTES] < slack[LARGE_WORKSPACE_BYTES]
    assert slack[LARGE_WORKSPACE_BYTES] >= slack[0] + 2 * LARGE_WORKSPACE_BYTES  # a workspace per thread, at least
    cpu = trace_workload("examples/tiny_mlp.py:build", 4, device="cpu")
    assert allocator_slack(cpu, LARGE_WORKSPACE_BYTES) == 0


def test_the_allocator_slack_holds_the_workspaces_in_the_pages_they_map() -> None:
    """A forward and a backward matmul, each making a 1 MiB output it frees at once: the tensors hold 1 MiB in the
    small pool's one 2 MiB page, and the two workspaces (one per thread) share the large pool's expandable segment,
    mapped in 20 MiB pages: 64 MiB of Hopper's take four of them, 16.25 MiB of an Ampere's one."""
    ops = [Op(0, "aten.mm.default", "forward", (), (0,)), Op(1, "aten.mm.default", "backward", (), (1,))]
    matmuls = Workload("hand", 1, "cuda", {i: TensorInfo(i, MIB, "activation", "float32", i, i) for i in (0, 1)}, ops)
    assert allocator_slack(matmuls, 0) == 2 * MIB - MIB
    assert allocator_slack(matmuls, SMALL_WORKSPACE_BYTES) == 20 * MIB + 2 * MIB - MIB
    assert allocator_slack(matmuls, LARGE_WORKSPACE_BYTES) == 4 * 20 * MIB + 2 * MIB - MIB
