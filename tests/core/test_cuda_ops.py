"""The ops a GPU runs where the meta device runs others (`tensile.cuda_ops`): cuDNN's batch norm and the fused
dropout. A forecast for CUDA, traced on the meta device, runs them as a GPU would and records cuDNN's batch norm as
the native op; on the CPU device, where the test runs them, the hook records, binds and replays them, so the
forecast's plan applies and batch norm's outputs are recomputed on both of the hook's paths, bit-identically.

There is no GPU here: `aten::cudnn_batch_norm` and its backward get CPU kernels for the test (the native ops, with a
reserve of `reserve_bytes`, empty as cuDNN's for a plain batch norm), and the training runs under `ops_as_on_cuda`,
as the forecast's trace does. The ops are the real ones, with their schemas and autograd formulas
(`CudnnBatchNormBackward0` saves what cuDNN's backward reads); `tests/hook/test_cuda.py` checks on a GPU that a
forecast has the live iteration's signature."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tensile.cuda_ops import ops_as_on_cuda
from tensile_hook import activate, deactivate
from tensile_hook.recipes import DeviceRandom, RecipeBook
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings
from tensile.timeline import build_slots
from tensile.tracer import TrainingStep, trace_step
from tensile.workload import Workload
from tests.support.bit_identity import assert_identical
from tests.support.hook_probes import replayed_ops
from tests.support.native_training import STEPS, assert_blocks_recomputed_natively, blocks, noisy
from tests.support.plans import every_recompute, feature_recomputes
from tests.support.training import fit

pytestmark = pytest.mark.usefixtures("deterministic")

aten = torch.ops.aten
NATIVE, CUDNN = "aten.native_batch_norm.default", "aten.cudnn_batch_norm.default"
BACKWARD = "aten.native_batch_norm_backward.default"


@pytest.fixture
def cudnn_on_cpu(request: pytest.FixtureRequest) -> Iterator[int]:
    """cuDNN's batch-norm ops run on the CPU device, with a reserve of `request.param` bytes (0: none)."""
    reserve_bytes = getattr(request, "param", 0)

    def forward(input, weight, bias, running_mean, running_var, training, factor, eps):  # type: ignore[no-untyped-def]
        output, mean, invstd = aten.native_batch_norm.default(input, weight, bias, running_mean, running_var, training,
                                                              factor, eps)
        return output, mean, invstd, torch.zeros(reserve_bytes, dtype=torch.uint8, device=input.device)

    def backward(input, grad_output, weight, running_mean, running_var,  # type: ignore[no-untyped-def]
                 save_mean, save_var, eps, reserve):
        return aten.native_batch_norm_backward.default(grad_output, input, weight, running_mean, running_var, save_mean,
                                                       save_var, True, eps, [True, True, True])

    library = torch.library.Library("aten", "IMPL")
    library.impl("cudnn_batch_norm", forward, "CPU")
    library.impl("cudnn_batch_norm_backward", backward, "CPU")
    try:
        yield reserve_bytes
    finally:
        library._destroy()


def traced(backend: str, target: str, build: Callable[[int], tuple] = blocks) -> Workload:
    """The iteration of `build`'s model at batch 4 as `fit` runs it (its loss divided by its one micro-batch), traced
    on `backend` (meta: a forecast) for the `target` device, its optimizer's kernels the CPU's (per-parameter loops)."""
    model, batch, loss_fn, make_optimizer = build(4)
    model, batch = model.to(backend), tuple(t.to(backend) for t in batch)
    step = TrainingStep(model, batch, lambda m, b: loss_fn(m, b) / 1, [make_optimizer(model.parameters())])
    return trace_step(step, model_name="blocks", batch_size=4, target_device=target, foreach=False)


@pytest.fixture(scope="module")
def forecast() -> Workload:
    return traced("meta", "cuda")


def test_a_cuda_forecast_runs_cudnns_batch_norm_and_records_the_native_op(forecast: Workload):
    """The same ops as the CPU's forecast but the empty reserve the native path makes first; the backward's tensors
    in the native op's order (its input, the forward's, second)."""
    cpu = traced("meta", "cpu")
    assert not any("cudnn" in op.name for op in forecast.ops)
    assert [(op.name, op.shapes, op.dtypes, op.params) for op in forecast.ops] == \
           [(op.name, op.shapes, op.dtypes, op.params) for op in cpu.ops if op.name != "aten.empty.memory_format"]
    assert len(cpu.ops) == len(forecast.ops) + 2
    forwards = [op for op in forecast.ops if op.name == NATIVE]
    backwards = [op for op in forecast.ops if op.name == BACKWARD]
    assert len(forwards) == len(backwards) == 2
    for forward, backward in zip(forwards, reversed(backwards)):
        assert backward.inputs[1] == forward.inputs[0] and backward.inputs[5:7] == forward.outputs[1:3]


def ops_run(call: Callable[[], object], names: str = "batch_norm") -> list[str]:
    """The ops `call` runs whose names match the regular expression `names`."""
    seen: list[str] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if re.search(names, str(func)):
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        call()
    return seen


def meta_batch_norm(shape: tuple[int, ...] = (4, 8, 5, 5), dtype: torch.dtype = torch.float32, affine: bool = True,
                    training: bool = True) -> Callable[[], object]:
    features = shape[1]
    affine_parameters = torch.ones(features, device="meta"), torch.zeros(features, device="meta")
    weight, bias = affine_parameters if affine else (None, None)
    stats = torch.zeros(features, device="meta"), torch.ones(features, device="meta")
    return lambda: F.batch_norm(torch.ones(shape, dtype=dtype, device="meta"), *stats, weight, bias, training)


@pytest.mark.parametrize(("case", "runs"), [
    ({}, CUDNN),
    ({"training": False}, CUDNN),
    ({"dtype": torch.bfloat16}, NATIVE),  # cuDNN takes no bfloat16
    ({"affine": False}, NATIVE),  # nor a batch norm without weight and bias
    ({"shape": (4, 8)}, NATIVE),  # nor fewer than 3 dimensions (BatchNorm1d over features)
])
def test_while_tracing_for_cuda_a_batch_norm_runs_cudnns_op_where_a_gpu_would(case: dict, runs: str):
    with ops_as_on_cuda():
        assert ops_run(meta_batch_norm(**case)) == [runs]


@pytest.mark.parametrize(("p", "training", "inplace", "fused"), [
    (0.5, True, False, True),
    (0.5, False, False, False),  # evaluation: no op at all
    (0.0, True, False, False),  # nothing dropped: PyTorch's unfused path
    (0.5, True, True, False),  # in place: unfused on a GPU too
])
def test_while_tracing_for_cuda_dropout_runs_the_fused_op_where_a_gpu_would(p: float, training: bool, inplace: bool,
                                                                             fused: bool):
    x = torch.ones(4, 8, device="meta")
    with ops_as_on_cuda():
        seen = ops_run(lambda: F.dropout(x, p, training, inplace), "dropout")
        assert seen == (["aten.native_dropout.default"] if fused else [])
        if not inplace:
            assert ops_run(lambda: torch.dropout(x, p, training), "dropout") == seen


def test_only_the_thread_tracing_for_cuda_runs_cudas_ops():
    seen: list[list[str]] = []
    with ops_as_on_cuda():
        other = threading.Thread(target=lambda: seen.append(ops_run(meta_batch_norm())))
        other.start()
        other.join()
        assert ops_run(meta_batch_norm()) == [CUDNN]
    assert seen == [[NATIVE]] and ops_run(meta_batch_norm()) == [NATIVE]


@pytest.mark.parametrize("cudnn_on_cpu", [64], indirect=True)
def test_a_reserve_cudnn_fills_is_recorded_and_never_recomputed(forecast: Workload, cudnn_on_cpu: int):
    """The forecast did not count it: the signature differs (the job plans from its live iteration, which does)."""
    with ops_as_on_cuda():
        live = traced("cpu", "cpu")
    assert live.signature != forecast.signature
    norms = [op for op in live.ops if op.name == NATIVE]
    slots = build_slots(live)
    assert len(norms) == 2
    for op in norms:
        output, *_, reserve = op.outputs
        assert len(op.outputs) == 4 and live.tensors[reserve].size == cudnn_on_cpu
        assert slots[reserve].recomputable_by is None and slots[output].recomputable_by == op.index
        reader = next(o for o in live.ops if o.phase == "backward" and reserve in o.inputs)
        assert reader.name == BACKWARD and reader.inputs[-1] == reserve


@pytest.mark.parametrize("cudnn_on_cpu", [64], indirect=True)
def test_the_hook_keeps_no_recipe_of_cudnns_reserve(cudnn_on_cpu: int):
    """Memory cuDNN's kernel leaves partly unwritten (as an RNN's reserve): a replay may give its bytes by chance."""
    args = (torch.randn(4, 8, 5, 5), torch.ones(8), torch.zeros(8), torch.zeros(8), torch.ones(8), True, 0.1, 1e-5)
    out = aten.cudnn_batch_norm.default(*args)
    book = RecipeBook(DeviceRandom(torch.device("cpu")))
    for tensor in out:
        book.keep(id(tensor.untyped_storage()), aten.cudnn_batch_norm.default, args, {}, out, None)
    assert [id(tensor.untyped_storage()) in book for tensor in out] == [True, True, True, False]


def recomputed_natively(forecast: Workload, monkeypatch: pytest.MonkeyPatch) -> tuple[HookReport, list[str]]:
    """`blocks` trained plain and under the hook, its batch norms running cuDNN's ops, with the forecast's plan of
    `feature_recomputes` (the hook plans the same from its live iteration if that one does not match): bit-identical,
    its recomputes carried natively (`assert_blocks_recomputed_natively`); the report and the ops replayed."""
    with ops_as_on_cuda():
        plain = fit(blocks, 4, STEPS)
        replayed = replayed_ops(monkeypatch)
        executor = activate(HookSettings(job="job"), feature_recomputes(forecast), forecast, planner=feature_recomputes,
                            device=torch.device("cpu"))
        try:
            state = fit(blocks, 4, STEPS)
        finally:
            deactivate()
    assert_identical(plain, state)
    assert_blocks_recomputed_natively(executor.report)
    return executor.report, replayed


@pytest.mark.slow
def test_a_forecast_whose_batch_norm_runs_cudnns_ops_applies_and_recomputes_it(forecast: Workload, cudnn_on_cpu: int,
                                                                               monkeypatch: pytest.MonkeyPatch):
    report, replayed = recomputed_natively(forecast, monkeypatch)
    assert (report.signature_match, report.plan_source) == (True, "file")
    assert CUDNN in replayed and NATIVE not in replayed


@pytest.mark.slow
@pytest.mark.parametrize("cudnn_on_cpu", [64], indirect=True)
def test_with_a_reserve_the_live_iteration_plans_and_batch_norm_is_recomputed(forecast: Workload, cudnn_on_cpu: int,
                                                                               monkeypatch: pytest.MonkeyPatch):
    report, replayed = recomputed_natively(forecast, monkeypatch)
    assert (report.signature_match, report.plan_source) == (False, "local")
    assert CUDNN in replayed


def test_a_cuda_forecast_counts_the_fused_dropouts_mask_of_bools():
    """Its plan applies where dropout runs the fused op (its outputs recomputed on the dispatch path, from the
    random state the op drew from; the native path leaves them on the device)."""
    forecast = traced("meta", "cuda", noisy)
    unfused = traced("meta", "cpu", noisy)
    dropout = next(op for op in forecast.ops if op.name == "aten.native_dropout.default")
    mask = forecast.tensors[dropout.outputs[1]]
    assert mask.dtype == "bool" and not any("bernoulli" in op.name for op in forecast.ops)
    noise = next(op for op in unfused.ops if op.name.startswith("aten.bernoulli_"))
    assert unfused.tensors[noise.inputs[0]].size == 4 * mask.size
    with ops_as_on_cuda():
        plain = fit(noisy, 4, STEPS)
        executor = activate(HookSettings(job="job"), every_recompute(forecast), forecast, device=torch.device("cpu"))
        try:
            state = fit(noisy, 4, STEPS)
        finally:
            deactivate()
    assert_identical(plain, state)
    report = executor.report
    assert report.signature_match is True and report.stood_down is None, (report.signature_match, report.messages)
    assert all(it.events["recompute"] > 0 for it in report.iterations[2:]), [it.events for it in report.iterations]
