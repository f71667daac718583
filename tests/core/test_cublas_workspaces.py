"""The cuBLAS workspaces a CUDA process holds, against the rules of PyTorch's CublasHandlePool.cpp."""

from __future__ import annotations

import pytest

from tensile.allocator import reserved_peak
from tensile.cublas_workspaces import (DEFAULT_WORKSPACE_SIZES, booked_workspace_bytes, cublas_workspace_bytes,
                                       cublas_workspaces)
from tensile.peak import analyze_vanilla
from tensile.workload import Op, TensorInfo, Workload

KIB, MIB = 1 << 10, 1 << 20


@pytest.mark.parametrize("major, size", [(9, 32 * MIB), (10, 32 * MIB), (12, 32 * MIB), (8, 8 * MIB + 128 * KIB),
                                         (7, 8 * MIB + 128 * KIB)])
def test_the_default_size_is_32_mib_on_hopper_and_blackwell_and_8_mib_before(major, size):
    assert cublas_workspace_bytes(major, {}) == size


@pytest.mark.parametrize("config, size", [
    (":4096:8", 32 * MIB),  # 4096 KiB, eight of them
    (":16:8", 128 * KIB),
    (":4096:2:16:8", 8 * MIB + 128 * KIB),  # pairs add up
    ("garbage", 32 * MIB),  # no :SIZE:COUNT pair: the default (a Hopper's here)
])
def test_cublas_workspace_config_sets_the_size(config, size):
    assert cublas_workspace_bytes(9, {"CUBLAS_WORKSPACE_CONFIG": config}) == size


def test_a_gpu_is_booked_the_default_size_of_its_compute_capability_and_an_unknown_one_the_largest():
    """Admission books the default environment's size (a pod's own CUBLAS_WORKSPACE_CONFIG is not read); where the
    GPU's compute capability is unknown, the largest default size, so that no job is booked below what it holds."""
    assert [booked_workspace_bytes(major) for major in (7, 8, 9, 10, 12)] == [
        cublas_workspace_bytes(major, {}) for major in (7, 8, 9, 10, 12)]
    assert booked_workspace_bytes(0) == 32 * MIB == max(cublas_workspace_bytes(major, {}) for major in range(1, 13))
    assert [booked_workspace_bytes(major) for major in (8, 9)] == [8 * MIB + 128 * 1024, 32 * MIB]  # PyTorch's sizes
    assert {booked_workspace_bytes(major) for major in range(13)} == set(DEFAULT_WORKSPACE_SIZES)


def workload(device: str, ops: list[tuple[str, str]]) -> Workload:
    """One 1 MiB output per op, freed after it."""
    tensors = {i: TensorInfo(i, MIB, "activation", "float32", i, i) for i in range(len(ops))}
    return Workload("hand", 1, device, tensors,
                    [Op(i, name, phase, (), (i,)) for i, (name, phase) in enumerate(ops)])


TRAINING = [("aten.relu.default", "forward"), ("aten.addmm.default", "forward"), ("aten.mm.default", "forward"),
            ("aten.mm.default", "backward"), ("aten.bmm.default", "backward"), ("aten._foreach_add_.List", "optimizer")]


def test_the_forward_and_the_backward_thread_each_take_one_at_their_first_matmul():
    assert cublas_workspaces(workload("cuda", TRAINING), 32 * MIB) == {1: 32 * MIB, 3: 32 * MIB}


def test_a_model_that_multiplies_matrices_only_in_its_backward_holds_one():
    ops = [("aten.convolution.default", "forward"), ("aten.mm.default", "backward")]
    assert cublas_workspaces(workload("cuda", ops), 32 * MIB) == {1: 32 * MIB}


def test_the_cpu_device_has_no_cublas():
    assert cublas_workspaces(workload("cpu", TRAINING), 32 * MIB) == {}


def test_workspaces_add_to_the_allocated_and_reserved_peaks_not_to_the_tensors():
    traced = workload("cuda", TRAINING)
    bare = reserved_peak(traced)
    held = reserved_peak(traced, workspaces=cublas_workspaces(traced, 32 * MIB))
    # Each 1 MiB output is a small request; the two 32 MiB workspaces take segments of their own and stay.
    assert analyze_vanilla(traced).peak_bytes == MIB
    assert held.requested_peak_bytes == bare.requested_peak_bytes + 64 * MIB
    assert held.allocated_peak_bytes == bare.allocated_peak_bytes + 64 * MIB
    assert held.reserved_peak_bytes == bare.reserved_peak_bytes + 64 * MIB
