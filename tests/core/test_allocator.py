"""The caching allocator model against allocation sequences worked out by hand from PyTorch's rules
(c10/cuda/CUDACachingAllocator.cpp; docs/allocator.md), and its peaks against Algorithm 1's on workloads."""

from __future__ import annotations

import pytest
from tests.support.dag_workloads import chain_workload, random_workload

from tensile.allocator import LARGE_POOL_BASE, CachingAllocator, reserved_peak
from tensile.devices import PRESETS
from tensile.peak import analyze_plan, analyze_vanilla
from tensile.planner import plan_job
from tensile.workload import Op, TensorInfo, Workload

KIB, MIB = 1 << 10, 1 << 20
BANDWIDTH = PRESETS["a6000"].host_link_bandwidth


def test_small_requests_share_one_2_mib_segment():
    allocator = CachingAllocator()
    for nbytes in (1000, 300 * KIB, 700 * KIB):
        allocator.malloc(nbytes)
    # 1000 B rounds up to 1,024 (512 B blocks); 307,200 and 716,800 are multiples of 512 already: 1,025,024 B in all,
    # each request at most 1 MiB, so all three come from the small pool's first 2 MiB segment, split after each.
    assert (allocator.allocated, allocator.reserved) == (1_025_024, 2 * MIB)
    allocator.malloc(MIB)  # 1 MiB is still small; 2,097,152 - 1,025,024 = 1,072,128 B are left: it fits
    allocator.malloc(512)  # 1,072,128 - 1,048,576 = 23,552 B left (a remainder >= 512 B is kept): 512 fits
    assert allocator.reserved == 2 * MIB
    allocator.malloc(30 * KIB)  # 30,720 B > the 23,040 B left: a second 2 MiB segment
    assert allocator.reserved == 4 * MIB


def test_a_5_mib_request_takes_a_20_mib_segment_that_a_12_mib_request_then_splits():
    allocator = CachingAllocator()
    allocator.malloc(5 * MIB)  # large (> 1 MiB) and under 10 MiB: a 20 MiB segment, 15 MiB left (> 1 MiB: split off)
    assert allocator.reserved == 20 * MIB
    allocator.malloc(12 * MIB)  # the 15 MiB free block is the best fit: no new segment, 3 MiB split off
    assert (allocator.allocated, allocator.reserved) == (17 * MIB, 20 * MIB)
    third = allocator.malloc(5 * MIB // 2)  # 2.5 MiB fits the 3 MiB block; 0.5 MiB is not > 1 MiB: not split
    assert third.size == 3 * MIB and allocator.reserved == 20 * MIB
    allocator.malloc(3 * MIB // 2)  # no free large block left: another 20 MiB segment
    assert allocator.reserved == 40 * MIB


def test_a_request_of_10_mib_or_more_gets_a_segment_of_its_size_rounded_to_2_mib():
    allocator = CachingAllocator()
    allocator.malloc(10 * MIB)  # kMinLargeAlloc itself is not "under 10 MiB": 10 MiB, a multiple of 2 MiB
    allocator.malloc(11 * MIB + 1)  # 11 MiB + 512 B rounds up to 12 MiB
    assert allocator.reserved == 22 * MIB


def test_a_freed_block_is_reused_best_fit():
    allocator = CachingAllocator()
    first, second = allocator.malloc(14 * MIB), allocator.malloc(12 * MIB)  # segments of 14 and 12 MiB: 26 MiB
    allocator.free(first)
    allocator.free(second)
    # 11 MiB: the smallest free block that fits is the 12 MiB one (first fit by address would take the 14 MiB one);
    # 1 MiB is left, not more than 1 MiB, so the whole block is handed out. 13 MiB then fits the 14 MiB block.
    # First fit would have left 12 MiB for the 13 MiB request: a third segment, 40 MiB.
    assert allocator.malloc(11 * MIB) is second
    assert allocator.malloc(13 * MIB) is first
    assert allocator.reserved == 26 * MIB


def test_freed_neighbours_merge_within_their_segment():
    allocator = CachingAllocator()
    a, b = allocator.malloc(5 * MIB), allocator.malloc(5 * MIB)  # one 20 MiB segment: a, b, then 10 MiB free
    allocator.free(a)
    allocator.free(b)  # b merges with a before it and the 10 MiB after it: 20 MiB free in one block
    allocator.malloc(18 * MIB)  # fits the merged block: still one segment
    assert allocator.reserved == 20 * MIB


def test_segments_do_not_merge_but_an_expandable_segment_does():
    default, expandable = CachingAllocator(), CachingAllocator(expandable_segments=True)
    for allocator in (default, expandable):
        a, b = allocator.malloc(12 * MIB), allocator.malloc(12 * MIB)
        allocator.free(a)
        allocator.free(b)
        allocator.malloc(24 * MIB)
    # Default: two 12 MiB segments; freed, they are two 12 MiB blocks of two segments, so 24 MiB needs a third
    # segment: 48 MiB. Expandable: a maps one 20 MiB page (8 MiB free after it); b does not fit the 8 MiB tail, so
    # one more page is mapped, 40 MiB, b at 12-24 MiB with 16 MiB free after it; freed, the one segment is one free
    # 40 MiB block, and 24 MiB fits it.
    assert default.reserved == 48 * MIB
    assert expandable.reserved == 40 * MIB


def test_an_expandable_segment_grows_by_pages_and_keeps_its_tail_for_last():
    allocator = CachingAllocator(expandable_segments=True)
    allocator.malloc(100 * KIB)  # small pool: one 2 MiB page
    a = allocator.malloc(12 * MIB)  # large pool: one 20 MiB page; a at its start, 8 MiB free after it
    allocator.malloc(4 * MIB)  # the 8 MiB tail is the only free block: taken, split at 4 MiB
    assert allocator.reserved == 22 * MIB
    allocator.free(a)
    # Free now: a's 12 MiB at the start and the 4 MiB tail. 3 MiB fits both; the smaller is the tail, but the tail can
    # grow, so best fit takes a's block (the lowest address of the large pool) and splits it (any rest >= 512 B).
    assert allocator.malloc(3 * MIB).address == LARGE_POOL_BASE
    allocator.malloc(9 * MIB)  # the 9 MiB left of a's block, exactly
    allocator.malloc(6 * MIB)  # the 4 MiB tail is short by 2 MiB: one more 20 MiB page
    assert (allocator.allocated, allocator.reserved) == (100 * KIB + 22 * MIB, 42 * MIB)


def test_memory_allocated_counts_a_block_whose_rest_was_not_split_off_whole():
    default, expandable = CachingAllocator(), CachingAllocator(expandable_segments=True)
    for allocator in (default, expandable):
        allocator.malloc(23 * MIB // 2)
    # 11.5 MiB gets a segment of its size rounded up to 2 MiB, 12 MiB; the 0.5 MiB left is not more than 1 MiB, so the
    # whole 12 MiB block is handed out and counts in torch.cuda.memory_allocated, while the request is 11.5 MiB.
    # Expandable: one 20 MiB page, and any rest of 512 B or more is split off: allocated is the request.
    assert (default.requested, default.allocated, default.reserved) == (23 * MIB // 2, 12 * MIB, 12 * MIB)
    assert (expandable.requested, expandable.allocated, expandable.reserved) == (23 * MIB // 2, 23 * MIB // 2, 20 * MIB)
    small = default.malloc(5 * MIB)  # a 20 MiB segment, 15 MiB split off
    default.free(small)  # one free 20 MiB block again
    default.malloc(39 * MIB // 2)  # 19.5 MiB fits it with 0.5 MiB to spare: handed out whole
    assert (default.requested, default.allocated, default.reserved) == (31 * MIB, 32 * MIB, 32 * MIB)
    assert default.peak_allocated == 32 * MIB and default.peak_requested == 31 * MIB


def test_a_workspace_is_allocated_once_after_its_op_and_held_across_iterations():
    # An 11 MiB activation made by op 1 and freed after it; the cuBLAS workspace of op 0, 8 MiB + 128 KiB (the default
    # below Hopper), is taken after op 0's own outputs (none here).
    workload = workload_of((MIB // 2, 0, 0), (11 * MIB, 1, 1))
    workspace = 8 * MIB + 128 * KIB
    peaks = reserved_peak(workload, workspaces={0: workspace})
    # Op 0's 0.5 MiB output: the small pool's first 2 MiB segment. The workspace, a large request under 10 MiB, takes a
    # 20 MiB segment; its 11.875 MiB rest is split off. The 11 MiB activation fits that rest; the 0.875 MiB left is not
    # split off, so 11.875 MiB count as allocated. The next iteration allocates no second workspace and finds the
    # same blocks free: 22 MiB reserved, the workspace counted once.
    assert peaks.requested_peak_bytes == workspace + 11 * MIB
    assert peaks.allocated_peak_bytes == 20 * MIB
    assert peaks.reserved_peak_bytes == 22 * MIB
    without = reserved_peak(workload)
    assert (without.requested_peak_bytes, without.reserved_peak_bytes) == (11 * MIB, 14 * MIB)


def workload_of(*tensors: tuple[int, int, int | None], reuses: dict[int, int] | None = None) -> Workload:
    """Tensors i = 0, 1, ... as (size, op that makes it or -1 when resident, op after which PyTorch frees it or None);
    one op per index, making the tensors that name it."""
    infos = {i: TensorInfo(i, size, "activation", "float32", made, freed)
             for i, (size, made, freed) in enumerate(tensors)}
    for new, old in (reuses or {}).items():
        infos[new].reuses = old
    count = 1 + max(max(made, freed or 0) for _, made, freed in tensors)
    ops = [Op(k, "aten.add.Tensor", "forward", (), tuple(i for i, (_, made, _) in enumerate(tensors) if made == k))
           for k in range(count)]
    return Workload("hand", 1, "cuda", infos, ops)


def test_a_workload_reuses_its_freed_memory_in_the_next_iteration():
    # A 5 MiB and a 12 MiB activation, freed after ops 1 and 2, then a 12 MiB gradient alive at the iteration's end.
    workload = workload_of((5 * MIB, 0, 1), (12 * MIB, 1, 2), (12 * MIB, 3, None))
    peaks = reserved_peak(workload)
    # Iteration 1: 5 MiB takes a 20 MiB segment, 12 MiB fits its 15 MiB rest (17 MiB allocated, the peak); both freed,
    # the segment is one free 20 MiB block; the gradient takes 12 MiB of it. Freed before iteration 2 (nothing is
    # resident at an iteration's start), it leaves the segment one free block, which iteration 2 runs in without a new
    # one; iteration 3 would start as iteration 2 did: 2 iterations replayed, 20 MiB reserved.
    assert (peaks.requested_peak_bytes, peaks.reserved_peak_bytes, peaks.iterations) == (17 * MIB, 20 * MIB, 2)


def test_an_updated_parameter_keeps_its_memory_across_iterations():
    # A resident 12 MiB parameter, updated at op 1 into the same memory; a 30 MiB activation of op 0 in between.
    workload = workload_of((12 * MIB, -1, 1), (30 * MIB, 0, 0), (12 * MIB, 1, None), reuses={2: 0})
    peaks = reserved_peak(workload)
    # Segments of 12 and 30 MiB (both >= 10 MiB: their own size); the update takes the parameter's block over, and it
    # starts iteration 2 as the parameter: the activation reuses its freed segment. 42 MiB, as allocated.
    assert (peaks.requested_peak_bytes, peaks.reserved_peak_bytes) == (42 * MIB, 42 * MIB)


def test_a_plan_without_bandwidth_is_refused():
    workload = random_workload(1)
    plan = plan_job(workload, BANDWIDTH).plans["job"]
    with pytest.raises(ValueError, match="bandwidth"):
        reserved_peak(workload, plan)


@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("make", [random_workload, chain_workload])
@pytest.mark.parametrize("seed", range(4))
def test_hand_made_workloads_reserve_at_least_what_they_allocate(make, seed, expandable):
    """The allocated peak is Algorithm 1's, vanilla and under a plan; reserved is never below it."""
    workload = make(seed)
    plan = plan_job(workload, BANDWIDTH).plans["job"]
    vanilla = reserved_peak(workload, expandable_segments=expandable)
    scheduled = reserved_peak(workload, plan, BANDWIDTH, expandable_segments=expandable)
    assert vanilla.requested_peak_bytes == analyze_vanilla(workload).peak_bytes
    assert scheduled.requested_peak_bytes == analyze_plan(workload, plan.events, BANDWIDTH).peak_bytes
    for peaks in (vanilla, scheduled):
        assert peaks.reserved_peak_bytes >= peaks.allocated_peak_bytes >= peaks.requested_peak_bytes


@pytest.mark.parametrize("expandable", [False, True])
def test_a_traced_model_reserves_at_least_what_it_allocates(traced, expandable):
    workload = traced("examples/tiny_mlp.py:build", 64)
    peaks = reserved_peak(workload, expandable_segments=expandable)
    assert peaks.requested_peak_bytes == analyze_vanilla(workload).peak_bytes
    assert peaks.reserved_peak_bytes >= peaks.allocated_peak_bytes >= peaks.requested_peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("model", ["vgg16", "inception_v3", "resnet50", "densenet121", "bert_base", "gpt2"])
def test_zoo_models_allocate_their_vanilla_peak(traced, model):
    workload = traced(model, 4)
    for expandable in (False, True):
        peaks = reserved_peak(workload, expandable_segments=expandable)
        assert peaks.requested_peak_bytes == analyze_vanilla(workload).peak_bytes
        assert peaks.reserved_peak_bytes >= peaks.allocated_peak_bytes >= peaks.requested_peak_bytes


@pytest.mark.parametrize("environ, setting", [
    ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
     {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": ""}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, {}),  # the user's explicit choice stands
    ({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6, expandable_segments : True"}, {}),
    ({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, {}),  # no segments to expand
    ({"PYTORCH_CUDA_ALLOC_CONF": None}, {}),  # a pod's value from a ConfigMap: unread, left alone
    # PyTorch reads PYTORCH_ALLOC_CONF where both are set: the merge goes there
    ({"PYTORCH_ALLOC_CONF": "roundup_power2_divisions:4", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"},
     {"PYTORCH_ALLOC_CONF": "roundup_power2_divisions:4,expandable_segments:True"}),
])
def test_expandable_segments_are_merged_with_the_users_allocator_setting_never_over_it(environ, setting):
    from tensile.allocator import expandable_segments_in, expandable_segments_setting

    assert expandable_segments_setting(environ) == setting
    if None not in environ.values():
        expected = "False" not in str(environ) and "cudaMallocAsync" not in str(environ)
        assert expandable_segments_in(environ) is expected
