"""The tracer on small models with views, in-place ops, tied weights, parameter groups, two
optimizers and gradient accumulation; meta and live CPU traces must agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensile.crosscheck import memtracker_peak
from tensile.errors import TensileUserError
from tensile.forecast import trace_workload
from tensile.peak import analyze_vanilla
from tensile.tracer import TrainingStep, trace_step
from tensile.workload import round_allocation

from tests.support import tracing_models

MODELS = str(Path(__file__).parents[1] / "support" / "tracing_models.py")


def both(func: str, batch_size: int = 4, **kwargs):
    spec = f"{MODELS}:{func}"
    meta = trace_workload(spec, batch_size, optimizer=None, device="cpu", **kwargs)
    live = trace_workload(spec, batch_size, optimizer=None, device="cpu", live=True, **kwargs)
    return meta, live


@pytest.mark.parametrize("func", ["views", "tied", "two_groups"])
def test_meta_and_live_traces_agree(func):
    meta, live = both(func)
    assert meta.signature == live.signature
    assert [op.name for op in meta.ops] == [op.name for op in live.ops]
    assert [op.phase for op in meta.ops] == [op.phase for op in live.ops]
    meta_peak, live_peak = analyze_vanilla(meta), analyze_vanilla(live)
    assert meta_peak.peak_op == live_peak.peak_op
    # live CPU traces also count the optimizers' CPU step counters; allow for those few bytes.
    assert abs(meta_peak.peak_bytes - live_peak.peak_bytes) <= 64 * len(live.ops)


def test_views_share_storage_and_inplace_ops_allocate_nothing():
    workload, _ = both("views")
    views = [op for op in workload.ops if op.name.split(".")[1] in ("view", "transpose", "slice", "_unsafe_view", "t")]
    assert views and all(op.outputs == () and op.inputs for op in views)
    inplace = [
        op for op in workload.ops
        if op.name in ("aten.relu_.default", "aten.add_.Tensor") and op.phase == "forward" and len(op.shapes[0]) == 4
    ]
    assert len(inplace) == 2
    assert all(op.outputs == () and op.writes == op.inputs[:1] for op in inplace)
    # phases appear in training order
    phases = [op.phase for op in workload.ops]
    assert phases.index("backward") > 0 and phases.index("optimizer") > phases.index("backward")
    assert phases == sorted(phases, key=["forward", "backward", "optimizer"].index)


def test_roles_and_updated_tensors_reuse_memory():
    workload, _ = both("views")
    model = tracing_models.ViewsAndInplace()
    params = [t for t in workload.tensors.values() if t.role == "param" and t.created_by < 0]
    # 6 parameters + 3 batch-norm buffers (running mean, var, batches tracked)
    assert len(params) == len(list(model.parameters())) + len(list(model.buffers()))
    grads = [t for t in workload.tensors.values() if t.role == "gradient"]
    assert len(grads) == len(list(model.parameters()))
    assert sorted(t.size for t in grads) == sorted(p.numel() * 4 for p in model.parameters())
    momentum = [t for t in workload.tensors.values() if t.role == "optimizer_state" and t.created_by < 0]
    assert len(momentum) == len(list(model.parameters()))
    updated = [t for t in workload.tensors.values() if t.reuses is not None]
    # every parameter and every momentum buffer gets a new version in the optimizer phase
    assert len(updated) == 2 * len(list(model.parameters()))
    for t in updated:
        old = workload.tensors[t.reuses]
        assert old.created_by < 0 and old.size == t.size and old.role == t.role
        assert workload.ops[t.created_by].phase == "optimizer" and old.freed_after == t.created_by
    assert any(t.role == "activation" for t in workload.tensors.values())
    inputs = [t for t in workload.tensors.values() if t.role == "input"]
    assert len(inputs) == 2


def test_tied_weights_are_one_tensor():
    workload, _ = both("tied")
    model = tracing_models.TiedLM()
    # embedding (= output projection), mix weight, mix bias
    assert len([t for t in workload.tensors.values() if t.role == "param" and t.created_by < 0]) == len(list(model.parameters())) == 3
    embed_bytes = round_allocation(50 * 32 * 4, "cpu")
    grads = [t for t in workload.tensors.values() if t.role == "gradient"]
    assert sum(t.size == embed_bytes for t in grads) == 1


def test_two_parameter_groups_update_every_parameter():
    workload, _ = both("two_groups")
    updated = [t for t in workload.tensors.values() if t.reuses is not None and t.role == "param"]
    assert len(updated) == 6


def _steps(micro_batches: int, device: str, optimizers: int = 1) -> TrainingStep:
    model, batch, loss_fn, _ = tracing_models.views(4)
    if device == "meta":
        model = model.to("meta")
        batch = tuple(t.to("meta") for t in batch)
    params = list(model.parameters())
    groups = [params[:2], params[2:]] if optimizers == 2 else [params]
    opts = [torch.optim.SGD(groups[0], lr=0.1)] + [torch.optim.Adam(g) for g in groups[1:]]
    return TrainingStep(model, batch, loss_fn, opts, micro_batches=micro_batches)


def test_two_optimizers_and_gradient_accumulation():
    for micro_batches, optimizers in ((2, 1), (1, 2), (2, 2)):
        traces = [
            trace_step(_steps(micro_batches, device, optimizers), model_name="views", batch_size=4, target_device="cpu")
            for device in ("meta", "cpu")
        ]
        meta, live = traces
        assert meta.signature == live.signature
        phases = [op.phase for op in meta.ops]
        switches = sum(1 for a, b in zip(phases, phases[1:]) if a != b)
        assert switches == 2 * micro_batches  # fwd, bwd, (fwd, bwd,) optimizer
        updated = [t for t in meta.tensors.values() if t.reuses is not None and t.role == "param"]
        assert len(updated) == 6
        if optimizers == 2:
            assert sum(1 for t in meta.tensors.values() if t.role == "optimizer_state" and t.created_by < 0) == 2 * 4
        grads = [t for t in meta.tensors.values() if t.role == "gradient"]
        assert len(grads) == 6


def test_forecast_matches_memtracker_on_a_small_cnn():
    workload, _ = both("views", batch_size=16)
    model, batch, loss_fn, make_optimizer = tracing_models.views(16)
    step = TrainingStep(model, batch, loss_fn, [make_optimizer(model.parameters())])
    assert analyze_vanilla(workload).peak_bytes == pytest.approx(memtracker_peak(step), rel=0.02)


def test_cuda_forecast_uses_foreach_optimizer_and_512_byte_blocks(traced):
    cuda = traced("examples/tiny_mlp.py:build", 4, device="cuda", optimizer="adam")
    cpu = traced("examples/tiny_mlp.py:build", 4, device="cpu", optimizer="adam")
    assert any("_foreach_" in op.name for op in cuda.ops)
    assert not any("_foreach_" in op.name for op in cpu.ops)
    assert all(t.size % 512 == 0 for t in cuda.tensors.values())
    assert cuda.signature != cpu.signature


def test_mixed_precision_is_traced_as_it_runs():
    workload = trace_workload(f"{MODELS}:views", 4, optimizer="sgd", dtype="bfloat16", device="cpu")
    convs = [op for op in workload.ops if op.name.startswith("aten.convolution")]
    assert convs and all(op.dtypes[0] == "bfloat16" for op in convs)
    assert any(op.name == "aten._to_copy.default" for op in workload.ops)


def test_data_dependent_step_points_to_live_tracing():
    with pytest.raises(TensileUserError, match="--live"):
        trace_workload(f"{MODELS}:item_in_loss", 2, optimizer=None, device="cpu")
    live = trace_workload(f"{MODELS}:item_in_loss", 2, optimizer=None, device="cpu", live=True)
    assert any(op.name == "aten._local_scalar_dense.default" for op in live.ops)


@pytest.mark.parametrize(
    ("func", "message"),
    [
        ("wrong_arity", "must return \\(model, batch, loss_fn, make_optimizer\\)"),
        ("not_a_module", "model \\(item 1\\) must be a torch.nn.Module"),
        ("batch_not_tensors", "batch \\(item 2\\)"),
        ("missing_function", "has no function 'missing_function'"),
        ("lbfgs", "returned LBFGS, whose step needs a closure.*trace with --optimizer"),  # was LBFGS's TypeError
    ],
)
def test_user_model_contract_violations_say_which_part(func, message):
    with pytest.raises(TensileUserError, match=message):
        trace_workload(f"{MODELS}:{func}", 2, optimizer=None)


def test_a_closure_optimizers_model_traces_with_another_optimizer():
    workload = trace_workload(f"{MODELS}:lbfgs", 2, optimizer="adam", device="cpu")
    assert workload.meta["optimizer"] == "adam" and any(op.phase == "optimizer" for op in workload.ops)


def test_a_copy_of_a_transposed_tensor_records_its_contiguous_runs():
    """Op.runs: () for ops on contiguous tensors; for the clone of a transposed slice, each argument's innermost
    contiguous run (1: it jumps every element), the same on meta as live."""
    from tensile.tracer import contiguous_run

    meta, live = both("views")
    for workload in (meta, live):
        clones = [op for op in workload.ops if op.name == "aten.clone.default" and op.phase == "forward"]
        assert [op.runs for op in clones] == [(1,)]
        convs = [op for op in workload.ops if op.name == "aten.convolution.default"]
        assert convs and all(op.runs == () for op in convs)
    heads = torch.empty(2, 4, 52, 32, device="meta").transpose(1, 2)  # attention's (n, t, heads, dh) view
    assert contiguous_run(heads) == 32 and contiguous_run(heads.contiguous()) == 2 * 52 * 4 * 32


def _foreach_ops(workload) -> int:
    return sum("_foreach_" in op.name for op in workload.ops)


@pytest.mark.parametrize("backend", [{"dtype": "bfloat16"}, {"live": True}], ids=["autocast", "live"])
def test_cuda_forecast_runs_foreach_kernels_whatever_device_traces_it(backend):
    """Autocast traces on fake CPU tensors and --live on real ones; a CUDA forecast must still run the
    optimizer as CUDA does (foreach), a CPU forecast as the CPU does (loops). tied's Adam leaves foreach unset."""
    cuda = trace_workload(f"{MODELS}:tied", 2, optimizer=None, device="cuda", **backend)
    cpu = trace_workload(f"{MODELS}:tied", 2, optimizer=None, device="cpu", **backend)
    assert _foreach_ops(cuda) > 0
    assert _foreach_ops(cpu) == 0


def test_foreach_flag_sets_the_user_models_own_optimizer():
    off = trace_workload(f"{MODELS}:tied", 2, optimizer=None, device="cuda", foreach=False)
    on = trace_workload(f"{MODELS}:tied", 2, optimizer=None, device="cpu", foreach=True)
    assert _foreach_ops(off) == 0
    assert _foreach_ops(on) > 0


@pytest.mark.parametrize(
    ("make_optimizer", "message"),
    [
        (lambda p: torch.optim.Adam(p, fused=True), "--foreach on: the optimizer Adam was made with fused=True"),
        (lambda p: torch.optim.LBFGS(p), "--foreach on: the optimizer LBFGS has no foreach option; use --foreach auto"),
    ],
    ids=["fused", "no-foreach-option"],
)
def test_foreach_flag_on_an_optimizer_it_cannot_set_says_so(make_optimizer, message):
    model, batch, loss_fn, _ = tracing_models.views(2)
    step = TrainingStep(model, batch, loss_fn, [make_optimizer(model.parameters())])
    with pytest.raises(TensileUserError, match=message):
        trace_step(step, model_name="views", batch_size=2, target_device="cuda", foreach=True)


def test_a_storage_argument_is_recorded_by_its_size_not_its_elements():
    """An op on a storage (`set_` onto a weight's storage) recorded the storage's str(), which reads every element
    through the dispatcher: under the hook a 64-byte read of three weights never finished its recorded iteration."""
    model = torch.nn.Linear(512, 512)
    batch = (torch.randn(4, 512),)

    def loss_fn(m: torch.nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        alias = torch.empty(0).set_(m.weight.detach().untyped_storage())  # an op with a storage argument
        return m(b[0]).sum() + alias.sum() * 0

    step = TrainingStep(model, batch, loss_fn, [torch.optim.SGD(model.parameters(), lr=0.1)])
    workload = trace_step(step, model_name="storage", batch_size=4, target_device="cpu")
    (set_op,) = [op for op in workload.ops if op.name.startswith("aten.set_")]
    assert "UntypedStorage(1048576 bytes)" in set_op.params, set_op.params
