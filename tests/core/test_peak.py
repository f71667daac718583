"""Algorithm 1 against small hand-computed tensor access sequences."""

from __future__ import annotations

from tensile.peak import ALLOC, FREE, Change, analyze_vanilla, sweep, vanilla_changes
from tensile.workload import Op, TensorInfo, Workload


def small_workload() -> Workload:
    """P param 100 and I input 10 resident; A activation 50; B temporary 30; G gradient 100; P2 updates P."""
    tensors = {
        0: TensorInfo(0, 100, "param", "float32", -1, 3),
        1: TensorInfo(1, 10, "input", "float32", -1, None),
        2: TensorInfo(2, 50, "activation", "float32", 0, 2),
        3: TensorInfo(3, 30, "temporary", "float32", 1, 1),
        4: TensorInfo(4, 100, "gradient", "float32", 2, None),
        5: TensorInfo(5, 100, "param", "float32", 3, None, reuses=0),
    }
    ops = [
        Op(0, "aten.mm.default", "forward", (0, 1), (2,)),
        Op(1, "aten.relu.default", "forward", (2,), (3,)),
        Op(2, "aten.mm.default", "backward", (2, 3), (4,)),
        Op(3, "aten.add_.Tensor", "optimizer", (0, 4), (5,), writes=(0,)),
    ]
    return Workload("hand", 1, "cuda", tensors, ops)


def test_vanilla_peak_hand_computed():
    result = analyze_vanilla(small_workload())
    # start 110; op0 +50 = 160; op1 +30 = 190, then B freed -> 160; op2 +100 = 260, A freed -> 210;
    # op3: the updated param takes over P's memory: still 210.
    assert result.peak_bytes == 260
    assert result.peak_op == 2
    assert result.peak_phase == "backward"
    assert result.alive_at_peak == [0, 1, 2, 4]
    assert result.op_memory == [160, 190, 260, 210]
    assert result.bytes_by_role == {
        "param": 100, "input": 10, "activation": 50, "gradient": 100, "optimizer_state": 0, "temporary": 0,
    }
    assert result.timeline[-1][1] == 210


def test_an_earlier_release_lowers_the_peak():
    workload = small_workload()
    changes = [c for c in vanilla_changes(workload) if c.tensor != 2]
    changes += [Change(0, ALLOC, 2, 0), Change(1.6, FREE, 2, 1)]  # release A after op 1 instead of op 2
    result = sweep(workload, changes)
    assert result.peak_bytes == 210  # 110 + B 30 freed, A 50 freed, + G 100
    assert result.peak_op == 2
    assert 2 not in result.alive_at_peak


def test_equal_footprint_later_does_not_move_the_peak():
    workload = small_workload()
    workload.tensors[4].size = 30  # op2 then reaches 190 again, the same as op1
    result = analyze_vanilla(workload)
    assert result.peak_bytes == 190
    assert result.peak_op == 1


def test_peak_at_iteration_start_when_nothing_grows():
    workload = small_workload()
    for tid in (2, 3, 4):
        workload.tensors[tid].size = 0
    result = analyze_vanilla(workload)
    assert result.peak_bytes == 110
    assert result.peak_op == -1
    assert result.peak_phase == "start"
