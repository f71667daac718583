"""Training under a plan that swaps, releases, recomputes and swaps parameters and optimizer state
across iterations ends bit-identical to the same training without Tensile."""

from __future__ import annotations

import pytest
import torch

from tensile_hook import activate, deactivate
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings
from tests.support import tracing_models
from tests.support.bit_identity import assert_identical
from tests.support.hook_probes import replayed_ops
from tests.support.plans import aggressive_plan
from tests.support.training import EXAMPLES, STEPS, state_of, train
from tests.support.training import import_example as _import_example

pytestmark = pytest.mark.usefixtures("deterministic")


CASES = {
    "views+batchnorm+inplace": (tracing_models.views, 4, 1),
    "tied weights": (tracing_models.tied, 4, 1),
    "two parameter groups": (tracing_models.two_groups, 4, 1),
    "dropout (examples/tiny_mlp)": (_import_example("tiny_mlp"), 8, 1),
    "gradient accumulation": (tracing_models.views, 4, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_under_an_aggressive_plan_is_bit_identical(case):
    build, batch_size, micro_batches = CASES[case]
    plain, _ = train(build, batch_size, micro_batches=micro_batches)
    hooked, report = train(build, batch_size, planner=aggressive_plan, micro_batches=micro_batches)
    assert_identical(plain, hooked)
    assert report is not None and report.stood_down is None, report.stood_down
    planned = [it for it in report.iterations if it.mode == "planned"]
    assert len(planned) >= 3, [it.mode for it in report.iterations]
    for it in planned:
        assert it.events["swap_out"] > 0 and it.events["swap_in"] > 0
        assert it.swap_out_bytes > 0 and it.swap_in_bytes > 0
    assert sum(it.events["recompute"] for it in planned) > 0
    assert sum(it.recompute_bytes for it in planned) > 0


def _run_amp_two_optimizers(hooked: bool) -> tuple[dict, HookReport | None]:
    """bf16 autocast, a GradScaler whose first steps overflow (skipped steps), two optimizers."""
    executor = activate(HookSettings(job="job"), planner=aggressive_plan, device=torch.device("cpu")) if hooked else None
    try:
        torch.manual_seed(1234)
        model, batch, loss_fn, _ = tracing_models.views(8)
        params = list(model.parameters())
        optimizers = [torch.optim.SGD(params[:2], lr=0.1, momentum=0.9), torch.optim.Adam(params[2:], lr=1e-3)]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # inf at first: those steps are skipped
        for _ in range(STEPS + 3):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model, batch)
            scaler.scale(loss).backward()
            for optimizer in optimizers:
                scaler.step(optimizer)
            scaler.update()
        return state_of(model, optimizers), executor.report if executor else None
    finally:
        if executor is not None:
            deactivate()


@pytest.mark.slow
def test_amp_with_skipped_steps_and_two_optimizers_is_bit_identical():
    plain, _ = _run_amp_two_optimizers(False)
    hooked, report = _run_amp_two_optimizers(True)
    assert_identical(plain, hooked)
    assert report.stood_down is None
    assert any(it.mode == "planned" for it in report.iterations)


@pytest.mark.slow
def test_tensile_run_trains_an_unmodified_script_bit_identically(tmp_path):
    import json
    import subprocess
    import sys

    script = str(EXAMPLES / "train_mlp.py")
    plain, hooked, report = tmp_path / "plain.pt", tmp_path / "hooked.pt", tmp_path / "report.json"
    subprocess.run([sys.executable, script, "--steps", "8", "--save", str(plain)], check=True, timeout=300)
    tensile = [sys.executable, "-m", "tensile.cli", "run", "--report", str(report), "--"]
    said = subprocess.run([*tensile, sys.executable, script, "--steps", "8", "--save", str(hooked)], check=True, timeout=300,
                          stderr=subprocess.PIPE, text=True).stderr
    assert_identical(torch.load(plain), torch.load(hooked))
    data = json.loads(report.read_text())
    # the summary tells the peak under the plan from the run's (its first iterations run unplanned), and leaves out
    # the plan's first iteration (it starts with the tensors the plan keeps off the device between iterations)
    under = max(it["peak_bytes"] for it in data["iterations"][3:] if it["mode"] == "planned" and it["peak_source"] == "measured")
    assert (f"MiB ({under / 2**20:,.1f} MiB measured under plan version {data['plan_version']} against "
            f"{data['scheduled_peak_bytes'] / 2**20:,.1f} forecast") in " ".join(said.split()), said
    assert data["job"] == "local" and len(data["iterations"]) >= 5
    # the script logs loss.item() after some steps: that stays with its iteration, which keeps to the plan
    assert [it["mode"] for it in data["iterations"] if it["mode"] not in ("recording", "planned")] == []
    for key in ("vanilla_peak_bytes", "scheduled_peak_bytes", "plan_version", "signature_match", "iterations"):
        assert key in data
    for key in ("peak_bytes", "seconds", "stall_seconds", "swap_out_bytes", "swap_in_bytes", "recompute_bytes", "events", "hook_seconds",
                "transfer_seconds", "recompute_seconds"):
        assert key in data["iterations"][0]


# small inputs keep every op of the model (the same graph) at a fraction of the CPU time
ZOO_INPUTS = {
    "resnet50": (3, 64, 64), "vgg16": (3, 32, 32), "inception_v3": (3, 80, 80), "inception_v4": (3, 80, 80),
    "densenet121": (3, 64, 64), "bert_base": (16,), "gpt2": (16,),
}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(ZOO_INPUTS))
def test_zoo_models_train_bit_identically_under_an_aggressive_plan(model):
    from tensile.zoo import build_zoo_parts

    def build(batch_size: int):
        net, batch, loss_fn, _ = build_zoo_parts(model, batch_size, device="cpu", input_shape=ZOO_INPUTS[model])
        return net, batch, loss_fn, lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    plain, _ = train(build, 2)
    hooked, report = train(build, 2, planner=aggressive_plan)
    assert_identical(plain, hooked)
    planned = [it for it in report.iterations if it.mode == "planned"]
    assert len(planned) >= 3 and report.stood_down is None
    assert all(it.events["swap_out"] and it.events["recompute"] for it in planned)
    assert min(it.peak_bytes for it in planned) < report.vanilla_peak_bytes


def test_batch_norm_then_inplace_relu_is_recomputed_as_a_chain(monkeypatch):
    """The in-place ReLU that wrote the batch-norm output is replayed on the regenerated tensor."""
    replayed = replayed_ops(monkeypatch)
    plain, _ = train(tracing_models.views, 4)
    hooked, report = train(tracing_models.views, 4, planner=aggressive_plan)
    assert_identical(plain, hooked)
    assert "aten.relu_.default" in replayed and "aten.native_batch_norm.default" in replayed
