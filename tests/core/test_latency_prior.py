"""The roofline prior and the op-family features, on ops with known shapes."""

from __future__ import annotations

import math

import pytest

from tensile.devices import PRESETS
from tensile.latency.families import FAMILIES, conv_geometry, family_of, feature_count, features
from tensile.latency.prior import Roofline, compute_seconds, effective_bytes, prior_seconds
from tensile.latency.probes import Probe, build_step, make_grid
from tensile.tracer import trace_step
from tensile.workload import Op

ROOF = Roofline(flops_per_second=1e11, bytes_per_second=1e10, op_overhead=2e-6,
                gaps={"forward": 10e-6, "backward": 20e-6, "optimizer": 30e-6})


def op(name: str, shapes=(), params=(), phase="forward", flops=0.0, bytes_moved=0, dtypes=None) -> Op:
    return Op(0, name, phase, (), (), shapes=tuple(shapes), dtypes=dtypes or tuple("float32" for _ in shapes),
              params=tuple(params), flops=flops, bytes_moved=bytes_moved)


def test_compute_bound_matmul_is_flops_over_rate_plus_floor_and_gap():
    mm = op("aten.mm.default", [(1024, 1024), (1024, 1024)], flops=2 * 1024**3, bytes_moved=3 * 4 * 1024**2)
    assert compute_seconds(mm, ROOF) == pytest.approx(2 * 1024**3 / 1e11 + 2e-6)
    assert prior_seconds(mm, ROOF) == pytest.approx(2 * 1024**3 / 1e11 + 2e-6 + 10e-6)


def test_a_big_fresh_output_pays_first_touch_page_faults_in_place_ops_do_not():
    """VGG-16's Adam: sqrt(exp_avg_sq) on the 103M-element FC weight writes 412 MB of fresh pages."""
    from dataclasses import replace

    roof = replace(ROOF, fault_bytes_per_second=4e9)
    shape = [(4096, 25088)]
    out_bytes = 4096 * 25088 * 4
    sqrt = op("aten.sqrt.default", shape, phase="optimizer", bytes_moved=2 * out_bytes)
    assert compute_seconds(sqrt, roof) == pytest.approx(2 * out_bytes / 1e10 + out_bytes / 4e9 + 2e-6)
    assert compute_seconds(sqrt, ROOF) == pytest.approx(2 * out_bytes / 1e10 + 2e-6)  # a GPU / preset: no term
    in_place = op("aten.addcdiv_.default", shape * 3, phase="optimizer", bytes_moved=4 * out_bytes)
    assert compute_seconds(in_place, roof) == compute_seconds(in_place, ROOF)
    small = op("aten.sqrt.default", [(1024, 1024)], phase="optimizer", bytes_moved=8 << 20)  # below the mmap threshold
    assert compute_seconds(small, roof) == compute_seconds(small, ROOF)
    assert Roofline.from_dict(roof.to_dict()) == roof and roof.alone().fault_bytes_per_second == 4e9


def test_memory_bound_elementwise_is_bytes_over_bandwidth():
    add = op("aten.add.Tensor", [(1 << 20,), (1 << 20,)], phase="backward", bytes_moved=3 * 4 << 20)
    assert prior_seconds(add, ROOF) == pytest.approx((3 * 4 << 20) / 1e10 + 2e-6 + 20e-6)


def test_views_move_no_bytes_and_cost_the_floor():
    view = op("aten.view.default", [(4096, 4096)], bytes_moved=2 * 4 * 4096**2)
    assert family_of(view) == "view"
    assert effective_bytes(view) == 0
    assert compute_seconds(view, ROOF) == pytest.approx(2e-6)


def test_embedding_reads_only_gathered_rows():
    emb = op("aten.embedding.default", [(30522, 768), (2, 128)], params=(0,), bytes_moved=30522 * 768 * 4,
             dtypes=("float32", "int64"))
    assert effective_bytes(emb) == 256 * 768 * 4 * 2 + 256 * 8


def test_preset_prior_for_cpu_and_gpu():
    cpu = Roofline.from_spec(PRESETS["cpu"], "cpu")
    gpu = Roofline.from_spec(PRESETS["h100"], "cuda")
    assert cpu.gaps and not gpu.gaps
    assert gpu.flops_per_second == PRESETS["h100"].flops_per_second


@pytest.mark.parametrize(("name", "phase", "family"), [
    ("aten.convolution.default", "forward", "conv"),
    ("aten.convolution_backward.default", "backward", "conv"),
    ("aten.addmm.default", "forward", "matmul"),
    ("aten.bmm.default", "backward", "matmul"),
    ("aten.native_batch_norm_backward.default", "backward", "norm"),
    ("aten.native_layer_norm.default", "forward", "norm"),
    ("aten.max_pool2d_with_indices.default", "forward", "pool"),
    ("aten.relu_.default", "forward", "elementwise"),
    ("aten.add_.Tensor", "forward", "elementwise"),
    ("aten.add_.Tensor", "optimizer", "optimizer"),
    ("aten._foreach_lerp_.Scalar", "optimizer", "optimizer"),
    ("aten._softmax_backward_data.default", "backward", "softmax"),
    ("aten.embedding_dense_backward.default", "backward", "embedding"),
    ("aten.cat.default", "forward", "copy"),
    ("aten.transpose.int", "forward", "view"),
    ("aten.nll_loss_forward.default", "forward", None),
])
def test_family_of(name, phase, family):
    assert family_of(op(name, phase=phase)) == family


def test_conv_geometry_from_traced_arguments():
    fwd = op("aten.convolution.default", [(2, 3, 224, 224), (64, 3, 7, 7)], params=(None, 2, 2, 3, 3, 1, 1, False, 0, 0, 1))
    g = conv_geometry(fwd)
    assert (g["n"], g["cin"], g["h"], g["cout"], g["kh"], g["kw"], g["stride"], g["padding"], g["groups"]) == (
        2, 3, 224, 64, 7, 7, 2, 3, 1)
    bwd = op("aten.convolution_backward.default", [(2, 2048, 7, 7), (2, 512, 7, 7), (2048, 512, 1, 1)],
             params=(0, 1, 1, 0, 0, 1, 1, False, 0, 0, 1, True, True, False))
    g = conv_geometry(bwd)
    assert (g["cin"], g["cout"], g["backward"], g["mask_in"], g["mask_w"], g["mask_b"]) == (512, 2048, 1.0, 1.0, 1.0, 0.0)


def test_every_family_appears_in_probe_traces_with_fixed_length_features():
    """Trace the quick probe grid on meta: each family's features have one length, all finite."""
    seen = set()
    for probe in [*make_grid("quick"), Probe("conv", tuple(sorted({
            "n": 1, "cin": 8, "cout": 16, "h": 9, "kh": 3, "kw": 3, "stride": 1, "pad": "same", "groups": 1, "bn": True,
            "relu": True, "pool": "max", "cat": True, "grad_input": True}.items())), "adam", True)]:
        workload = trace_step(build_step(probe, "meta"), model_name=probe.kind, batch_size=1, target_device="cpu")
        for o in workload.ops:
            family = family_of(o)
            if family in FEATURES_FAMILIES:
                vector = features(o, family, 0.5)
                assert len(vector) == feature_count(family), (o.name, family)
                assert all(math.isfinite(v) for v in vector)
                seen.add(family)
    assert seen == set(FAMILIES)


FEATURES_FAMILIES = set(FAMILIES)


def test_conv_features_carry_output_size_and_implicit_gemm():
    """A 7x7 stride-2 stem: output 112x112; GEMM M = n*112*112, K = 3*7*7, N = 64; grouped convs divide K, N."""
    from tensile.latency.families import conv_output

    stem = op("aten.convolution.default", [(2, 3, 224, 224), (64, 3, 7, 7)], params=(None, 2, 2, 3, 3, 1, 1, False, 0, 0, 1))
    assert conv_output(conv_geometry(stem)) == (112, 112)
    lg = lambda x: math.log2(1 + x)  # noqa: E731
    vector = features(stem, "conv")
    assert lg(112) in vector and lg(2 * 112 * 112) in vector and lg(3 * 49) in vector
    grouped = op("aten.convolution.default", [(1, 64, 56, 56), (64, 2, 3, 3)], params=(None, 1, 1, 1, 1, 1, 1, False, 0, 0, 32))
    g = conv_geometry(grouped)
    assert g["groups"] == 32 and conv_output(g) == (56, 56)
    assert lg(2 * 9) in features(grouped, "conv")  # K = cin/groups * kernel
    asym = op("aten.convolution.default", [(1, 128, 17, 17), (192, 128, 1, 7)], params=(None, 1, 1, 0, 3, 1, 1, False, 0, 0, 1))
    assert conv_output(conv_geometry(asym)) == (17, 17)


def test_default_grid_probes_the_zoo_at_calibration_batches_only():
    from tensile.latency.probes import ZOO_CALIBRATION_BATCHES, ZOO_MODELS

    default = make_grid("default")
    zoo = [p for p in default if p.kind == "zoo"]
    assert default[: len(zoo)] == zoo  # measured first: a budget cut keeps them
    assert {(p.params["model"], p.params["batch"]) for p in zoo} == {
        (m, b) for m in ZOO_MODELS for b in ZOO_CALIBRATION_BATCHES}
    assert not any(p.kind == "zoo" for p in make_grid("quick")) and not any(p.kind == "zoo" for p in make_grid("holdout", 1))
    assert 2 not in ZOO_CALIBRATION_BATCHES  # the accuracy benchmark evaluates the zoo at batch 2


def test_new_output_sizes_match_the_tracer_and_big_ones_pay_page_faults():
    """output_bytes (from argument shapes only) against the sizes of the tensors the tracer saw each op create,
    on real probe steps; then the fresh-page term for VGG-16's 411 MB FC weight gradient (an mm) and GPT-2's
    154 MB embedding gradient, which no in-place rule would catch."""
    from collections import defaultdict
    from dataclasses import replace

    from tensile.latency.families import output_bytes

    checked = set()
    for probe in make_grid("holdout", seed=1)[::12]:
        workload = trace_step(build_step(probe, "meta"), model_name=probe.kind, batch_size=1, target_device="cpu")
        created: dict[int, int] = defaultdict(int)
        for tensor in workload.tensors.values():
            if tensor.created_by >= 0:
                created[tensor.created_by] += tensor.size
        for o in workload.ops:
            sizes = output_bytes(o)
            if sizes and family_of(o) != "optimizer":  # the tracer versions parameters updated in place
                assert sum(sizes) == pytest.approx(created[o.index], rel=0.05, abs=64), (o.name, o.shapes)
                checked.add(family_of(o))
    assert {"conv", "matmul", "norm", "elementwise", "copy"} <= checked
    roof = replace(ROOF, fault_bytes_per_second=4e9)
    fc_grad = op("aten.mm.default", [(4096, 2), (2, 25088)], phase="backward", flops=2 * 4096 * 2 * 25088)
    assert compute_seconds(fc_grad, roof) - compute_seconds(fc_grad, ROOF) == pytest.approx(4096 * 25088 * 4 / 4e9)
    wte_grad = op("aten.embedding_dense_backward.default", [(2, 1024, 768), (2, 1024)], params=(50257, -1, False),
                  phase="backward", dtypes=("float32", "int64"))
    assert output_bytes(wte_grad) == [50257 * 768 * 4]
    total = op("aten.sum.default", [(4096, 25088)], phase="backward")  # a reduction's output is small
    assert output_bytes(total) == [] and compute_seconds(total, roof) == compute_seconds(total, ROOF)


def test_copy_features_see_the_phase_and_keys_tell_a_permuted_copy_from_a_contiguous_one():
    """A forward copy's output is an activation kept for backward (new heap pages), a backward one's lands in
    memory just freed: the copy family sees the phase. A clone of a transposed input (Op.runs) and one of a
    contiguous input of the same shape are different op keys (calibration's measured ops, the EWMA) and
    different features."""
    from dataclasses import replace

    from tensile.latency.online import op_key

    forward = op("aten.clone.default", [(2, 52, 4, 32)], params=("torch.contiguous_format",))
    backward = replace(forward, phase="backward")
    count = feature_count("copy", own_only=True)
    assert [features(o, "copy")[count - 1] for o in (forward, backward)] == [1.0, 0.0]
    assert features(forward, "copy")[: count - 1] == features(backward, "copy")[: count - 1]
    heads = replace(forward, runs=(32,))
    assert op_key(heads) != op_key(forward) and op_key(replace(forward, runs=())) == op_key(forward)
    # the model sees the run too: rows of 32 elements, single elements, and the whole tensor in order
    elements = replace(forward, runs=(1,))
    runs = {tuple(features(o, "copy")[: count - 1]) for o in (forward, heads, elements)}
    assert len(runs) == 3


@pytest.mark.parametrize(("x", "kernel", "stride", "strided_pointwise", "onednn"), [
    ((1, 464, 17, 17), 1, 2, 1.0, 1.0),  # strided 1x1: oneDNN
    ((1, 464, 17, 17), 1, 1, 0.0, 0.0),  # unstrided 1x1: ATen's GEMM, no im2col
    ((1, 464, 17, 17), 3, 2, 0.0, 1.0),
    ((1, 16, 30, 30), 3, 1, 0.0, 0.0),  # one small image (14400 elements <= 20480): im2col + GEMM
    ((1, 16, 40, 40), 3, 1, 0.0, 1.0),  # 25600 elements: oneDNN
    ((2, 16, 30, 30), 3, 1, 0.0, 1.0),  # a batch: oneDNN
])
def test_conv_features_flag_strided_pointwise_and_the_onednn_path(x, kernel, stride, strided_pointwise, onednn):
    """The two flags, for the forward and the backward of the same convolution; the oneDNN flag is what the
    installed PyTorch really runs on one CPU thread (its profiler names mkldnn_convolution or thnn_conv2d)."""
    import torch
    from torch.profiler import profile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        inputs = torch.randn(*x, requires_grad=True)
        with profile() as prof:
            torch.nn.functional.conv2d(inputs, torch.randn(16, x[1], kernel, kernel), stride=stride).sum().backward()
    finally:
        torch.set_num_threads(threads)
    assert ("aten::mkldnn_convolution" in {e.name for e in prof.events()}) == bool(onednn)
    count = feature_count("conv", own_only=True)
    w = (16, x[1], kernel, kernel)
    params = (stride, stride, 0, 0, 1, 1, False, 0, 0, 1)
    fwd = op("aten.convolution.default", [x, w], params=(None, *params))
    out = (x[0], 16, (x[2] - kernel) // stride + 1, (x[3] - kernel) // stride + 1)
    bwd = op("aten.convolution_backward.default", [out, x, w], params=(0, *params, True, True, False))
    for o in (fwd, bwd):
        assert features(o, "conv")[count - 2: count] == [strided_pointwise, onednn]


def test_training_grid_adds_its_extra_probes_without_moving_the_others(monkeypatch):
    """The extra probe kinds are drawn after the original ones: the original probes and the held-out grid do
    not change (the held-out grid has none of the extra kinds)."""
    from tensile.latency import probes

    default = make_grid("default")
    extra = {"conv_pointwise_s2", "layout", "norm", "embedding_more", "layout_more"}
    original = {kind: count for kind, count in probes.GRIDS["default"].items() if kind not in extra}
    monkeypatch.setitem(probes.GRIDS, "default", original)
    before = make_grid("default")
    assert len(before) == len(default) - 216 and before == default[: len(before)]
    monkeypatch.undo()
    added = default[len(before):]
    assert [p.kind for p in added] == ["conv"] * 16 + ["layout"] * 30 + ["norm"] * 40 + ["embedding"] * 30 + ["layout"] * 100
    assert len(set(added[16:46] + added[116:])) == 130  # the second run of layout probes draws new shapes
    assert all((p.params["kh"], p.params["kw"], p.params["stride"]) == (1, 1, 2) for p in added[:16])
    holdout = make_grid("holdout", 1)
    monkeypatch.setitem(probes.GRIDS, "holdout", {k: c for k, c in probes.GRIDS["holdout"].items() if k not in extra})
    assert holdout[:108] == make_grid("holdout", 1)  # the later kinds leave the first ones' shapes as they were
    monkeypatch.undo()
    assert [p.kind for p in holdout[108:]] == ["embedding"] * 16 + ["layout"] * 10 and "norm" not in {p.kind for p in holdout}
    norms = {p.params["type"] for p in added[46:86]}
    assert norms == {"batch", "layer"}
    for probe in added[46:48] + added[86:87]:  # norm and embedding probes trace to their families' ops
        workload = trace_step(build_step(probe, "meta"), model_name=probe.kind, batch_size=1, target_device="cpu")
        assert probe.kind in {family_of(o) for o in workload.ops}
    runs = set()
    for probe in [p for p in make_grid("quick") if p.kind == "layout"] + added[16:20]:
        workload = trace_step(build_step(probe, "meta"), model_name=probe.kind, batch_size=1, target_device="cpu")
        runs.update(o.runs for o in workload.ops if family_of(o) == "copy")
    assert any(r and min(r) < 1000 for r in runs)  # permuted copies, forward and back


def test_op_keys_leave_out_float_operands_that_change_every_step_but_keep_those_that_pick_a_kernel():
    """Adam divides by a bias correction and steps by a size that change every step: calibration's
    measurement of VGG-16's 411 MB `div` must be found again at any step. pow's exponent picks a kernel
    (2: a square, 0.5: a square root), so it stays; so do ints (dims, strides)."""
    from tensile.latency.online import op_key

    shape = [(4096, 25088)]
    step_3, step_9 = (op("aten.div.Tensor", shape, params=(p,), phase="optimizer") for p in (0.0547, 0.0948))
    assert op_key(step_3) == op_key(step_9)
    assert op_key(op("aten.addcdiv_.default", shape * 3, params=(-0.00369,))) == \
        op_key(op("aten.addcdiv_.default", shape * 3, params=(-0.00112,)))
    squares, roots, cubes = (op("aten.pow.Tensor_Scalar", shape, params=(e,)) for e in (2.0, 0.5, 3.0))
    assert len({op_key(squares), op_key(roots), op_key(cubes)}) == 3
    assert op_key(op("aten.sum.dim_IntList", shape, params=([0], True))) != \
        op_key(op("aten.sum.dim_IntList", shape, params=([1], True)))
