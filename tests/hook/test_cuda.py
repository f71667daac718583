"""The hook on a real GPU (skipped where PyTorch sees none: CI has none; a lent GPU machine runs it): what the
CPU device cannot show (copies on side streams that the compute stream must wait for, the CUDA allocator's own
bytes beside the tensors a plan moves), with the CPU tests' models and plans moved to the device."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch

from tensile_hook import activate, deactivate
from tensile_hook.plan_source import local_planner
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings
from tensile.zoo import build_zoo_parts
from tests.support.bit_identity import assert_identical
from tests.support.native_training import blocks, hooked, on_device, out_of_memory_in_a_native_backward
from tests.support.plans import feature_swaps
from tests.support.training import fit, state_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
STEPS = 7  # recorded 0-1, aligned 2, native from 3
DEVICE = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def deterministic():  # type: ignore[no-untyped-def]
    torch.use_deterministic_algorithms(True, warn_only=True)  # cuBLAS wants CUBLAS_WORKSPACE_CONFIG for the strict kind
    torch.backends.cudnn.benchmark = False
    yield
    torch.use_deterministic_algorithms(False)


def _train(budget: float | None) -> tuple[dict, HookReport | None]:
    executor = None
    if budget is not None:
        settings = HookSettings(job="job", memory_budget=budget)
        executor = activate(settings, planner=local_planner(settings, DEVICE), device=DEVICE)
    try:
        torch.manual_seed(1234)
        model, batch, loss_fn, make_optimizer = build_zoo_parts("resnet50", 8, device="cuda")
        optimizer = make_optimizer(model.parameters())
        for _ in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()
        report = executor.report if executor else None
    finally:
        if executor is not None:
            deactivate()
    return state_of(model, [optimizer]), report


def test_a_budgeted_job_runs_natively_with_the_libraries_workspaces_booked_outside_its_budget():
    """The allocator's peak holds cuDNN's and cuBLAS's workspaces, which no plan moves (about 100 MB for ResNet-50 on
    an H100): held to the budget alone, a plan that kept it ran on the dispatch path ever after, 3.7x slower."""
    plain, _ = _train(None)
    hooked, report = _train(0.6)
    assert report is not None and report.stood_down is None
    assert_identical(plain, hooked)
    assert report.workspace_bytes, report.workspace_bytes  # None before the match, 0 if nothing beside the tensors
    steady = report.iterations[3:]
    assert [it.path for it in steady] == ["native"] * len(steady), report.messages
    assert report.memory_budget_bytes and report.guard_slack_bytes
    for it in steady:
        assert it.peak_bytes <= report.memory_budget_bytes + report.workspace_bytes + report.guard_slack_bytes
        assert it.swap_out_bytes > 0


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_native_swaps_on_side_streams_train_bit_identically(micro_batches):
    plain = fit(on_device(blocks, DEVICE), 4, STEPS, micro_batches)
    state, report = hooked(blocks, feature_swaps, micro_batches=micro_batches, device=DEVICE)
    assert_identical(plain, state)
    assert report.stood_down is None, report.stood_down
    swaps = report.iterations[2].events["swap_out"]
    assert swaps >= 5 * micro_batches
    for it in report.iterations[3:]:
        assert (it.path, it.mode) == ("native", "planned")
        assert it.events["swap_out"] == it.events["swap_in"] == swaps


def test_convolutions_and_cudnns_batch_norms_are_recomputed_natively_and_train_bit_identically():
    """conv1, bn1 (cuDNN's op, with its in-place ReLU) and conv2 released and recomputed in every iteration from the
    one that aligns them (`tests/support/plans.py`'s `feature_recomputes`), natively from the next."""
    from tests.support.native_training import assert_blocks_recomputed_natively
    from tests.support.plans import feature_recomputes

    plain = fit(on_device(blocks, DEVICE), 4, STEPS)
    state, report = hooked(blocks, feature_recomputes, device=DEVICE)
    assert_identical(plain, state)
    assert_blocks_recomputed_natively(report)


def test_a_divergence_mid_iteration_restores_with_the_compute_stream_waiting_for_the_copies():
    """The restore's swap-ins are waited for by nothing but the compute stream's wait at the restore."""
    build = lambda n: blocks(n, frozenset({5}))  # noqa: E731 - forward call 5 (iteration 4) takes another branch
    plain = fit(on_device(build, DEVICE), 4, STEPS)
    state, report = hooked(build, feature_swaps, device=DEVICE)
    assert_identical(plain, state)
    assert [(it.path, it.mode) for it in report.iterations[3:]] == [
        ("native", "planned"), ("native", "diverged"), ("dispatch", "planned"), ("native", "planned")]
    assert report.iterations[4].events["swap_out"] > 0


def test_a_hook_failure_in_a_native_backward_brings_every_swapped_tensor_back(monkeypatch):
    from tensile_hook.residency import Residency

    fetch = Residency.fetch

    def failing(self, slot):  # type: ignore[no-untyped-def]
        if self.state.iteration == 4 and not self.state.disabled and torch._C._current_autograd_node() is not None:
            raise RuntimeError("injected hook failure")
        fetch(self, slot)

    monkeypatch.setattr(Residency, "fetch", failing)
    plain = fit(on_device(blocks, DEVICE), 4, STEPS)
    state, report = hooked(blocks, feature_swaps, device=DEVICE)
    assert_identical(plain, state)
    assert report.stood_down == "RuntimeError: injected hook failure"
    assert report.iterations[4].path == "native" and report.iterations[4].events["swap_out"] > 0


def test_a_node_whose_input_cannot_come_back_raises_out_of_memory_not_an_illegal_access():
    report = out_of_memory_in_a_native_backward(DEVICE)
    assert report.iterations[3].path == "native"


def test_the_recorded_iteration_times_kernels_not_the_recording_host():
    """The planner plans a job's swaps against its recorded iteration's op latencies. Timed as the host launched them
    under the recording dispatch mode (calibration's summed to 2-5x a plain iteration on an H100), swaps were planned to
    hide behind compute that is not there; kernels run back to back can sum to no more than a plain iteration."""
    torch.manual_seed(1234)
    model, batch, loss_fn, make_optimizer = build_zoo_parts("resnet50", 16, device="cuda")
    optimizer = make_optimizer(model.parameters())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        optimizer.step()

    plain = []
    for _ in range(5):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        plain.append(time.perf_counter() - started)
    settings = HookSettings(job="job")
    executor = activate(settings, planner=local_planner(settings, DEVICE), device=DEVICE)
    try:
        for _ in range(3):
            step()
        live = executor.live
    finally:
        deactivate()
    assert live is not None
    kernels, iteration = sum(op.latency for op in live.ops), statistics.median(plain[2:])
    assert 0.3 * iteration < kernels < 1.1 * iteration, (kernels, iteration)


def test_a_training_batch_norm_runs_cudnns_op_and_the_hooks_replay_gives_its_output_bit_for_bit():
    """What recomputing batch norm's outputs on CUDA rests on (`tensile.cuda_ops`): the op a training batch norm
    runs there is cuDNN's, and the hook's replay of it (without the running statistics, `recipes._replayable`) gives
    the forward's output bit for bit and leaves the module's statistics alone. The forecast says what it is worth
    (H100 preset, default events): DenseNet-121 MSR 0.286 -> 0.55, Inception-V3 0.364 -> 0.474,
    ResNet-50 0.456 -> 0.471 (Table III 0.514, 0.436, 0.426)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tensile_hook.recipes import DeviceRandom, RecipeBook

    seen: list[tuple] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if "batch_norm" in str(func):
                seen.append((func, args, kwargs or {}, out))
            return out

    torch.manual_seed(0)
    norm = torch.nn.BatchNorm2d(64).to(DEVICE).train()
    x = torch.randn(16, 64, 28, 28, device=DEVICE, requires_grad=True)
    with Record():
        y = norm(x)
    assert [str(s[0]) for s in seen] == ["aten.cudnn_batch_norm.default"]
    func, args, kwargs, out = seen[0]
    statistics_before = (norm.running_mean.clone(), norm.running_var.clone())
    random = DeviceRandom(DEVICE)
    book = RecipeBook(random)
    key = id(out[0].untyped_storage())
    book.keep(key, func, args, kwargs, out, None)  # kept only if a first replay gave the output byte for byte
    recipe = book.get(key)
    assert recipe is not None, "the replay differs"
    with torch.no_grad():
        again = recipe.producer.replay(random)[recipe.position]
    assert torch.equal(again, y.detach())
    assert torch.equal(norm.running_mean, statistics_before[0]) and torch.equal(norm.running_var, statistics_before[1])


@pytest.mark.parametrize("model", ["blocks", "resnet50"])
def test_a_forecast_has_the_signature_of_the_iteration_that_runs_on_the_gpu(model: str):
    """The forecast, traced on the meta device (cuDNN's batch norm run as a GPU runs it, `tensile.cuda_ops`), and
    the live iteration on the GPU record the same ops: the forecast's plan applies from the job's start."""
    from tensile.forecast import OPTIMIZERS, trace_workload
    from tensile.tracer import TrainingStep, trace_step

    if model == "blocks":
        build = blocks
        parts = blocks(2)
        meta_model, meta_batch = parts[0].to("meta"), tuple(t.to("meta") for t in parts[1])
        meta_step = TrainingStep(meta_model, meta_batch, parts[2], [OPTIMIZERS["sgd"](meta_model.parameters())])
        forecast = trace_step(meta_step, model_name=model, batch_size=2, target_device="cuda")
    else:
        build = lambda n: build_zoo_parts("resnet50", n, device="cpu")  # noqa: E731
        forecast = trace_workload("resnet50", 2, optimizer="sgd", device="cuda")
    net, batch, loss_fn, _ = on_device(build, DEVICE)(2)
    live = trace_step(TrainingStep(net, batch, loss_fn, [OPTIMIZERS["sgd"](net.parameters())]), model_name=model,
                      batch_size=2, target_device="cuda")
    different = next(((a.index, a.name, a.shapes, b.name, b.shapes) for a, b in zip(forecast.ops, live.ops)
                      if (a.name, a.shapes, a.dtypes) != (b.name, b.shapes, b.dtypes)), None)
    assert forecast.signature == live.signature, (len(forecast.ops), len(live.ops), different)


# Trains the example MLP for a few steps in a fresh process (the allocator's cache and cuBLAS's workspaces start
# empty there, as in a job) and prints what the caching allocator measured.
_MEASURE = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from tiny_mlp import build
model, batch, loss_fn, make_optimizer = build(int(sys.argv[1]))
model = model.cuda()
batch = tuple(t.cuda() for t in batch)
optimizer = make_optimizer(model.parameters())
for _ in range(5):
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model, batch).backward()
    optimizer.step()
torch.cuda.synchronize()
print(json.dumps({"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                  "major": torch.cuda.get_device_capability()[0]}))
"""


@pytest.mark.parametrize("expandable", [False, True])
def test_an_mlps_measured_allocator_peaks_are_its_forecast(expandable):
    """An MLP runs no cuDNN, so what PyTorch holds beside its tensors is cuBLAS's workspaces and blocks handed out
    whole, which the forecast counts (tensile.cublas_workspaces, tensile.allocator): the measured peaks of
    `max_memory_allocated` within 1% of the forecast, of `max_memory_reserved` within 3%."""
    import json
    import os
    import subprocess
    import sys

    from tensile.allocator import reserved_peak
    from tensile.cublas_workspaces import cublas_workspace_bytes, cublas_workspaces
    from tensile.forecast import trace_workload

    # large enough that a 20 MiB page (the large pool's, with expandable segments) is under 3% of what it reserves
    batch, examples = 65536, Path(__file__).parents[2] / "examples"
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if expandable:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(batch), str(examples)], env=environ, capture_output=True, text=True,
                          timeout=300, check=True)
    measured = json.loads(done.stdout.splitlines()[-1])
    workload = trace_workload(f"{examples / 'tiny_mlp.py'}:build", batch, optimizer=None, device="cuda")
    workspaces = cublas_workspaces(workload, cublas_workspace_bytes(measured["major"], environ))
    forecast = reserved_peak(workload, expandable_segments=expandable, workspaces=workspaces)
    assert abs(forecast.allocated_peak_bytes / measured["allocated"] - 1) <= 0.01, (forecast, measured)
    assert abs(forecast.reserved_peak_bytes / measured["reserved"] - 1) <= 0.03, (forecast, measured)
