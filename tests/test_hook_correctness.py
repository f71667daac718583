"""Training under a plan that swaps, releases, recomputes and swaps parameters and optimizer state
across iterations ends bit-identical to the same training without Tensile."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tracing_models
from tensile.plan import Event, Plan
from tensile_hook import activate, deactivate
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings
from tensile.workload import Workload

STEPS = 5  # iterations 0-1 are recorded and matched, 2-4 run under the plan
EXAMPLES = Path(__file__).parent.parent / "examples"


def first_uses(workload: Workload) -> dict[int, list[int]]:
    uses: dict[int, list[int]] = {}
    for op in workload.ops:
        for t in op.inputs:
            uses.setdefault(t, []).append(op.index)
    return uses


def aggressive_plan(workload: Workload, budget: int | None = None) -> Plan:
    """Every activation swapped or recomputed across the forward/backward gap; every updated
    parameter and optimizer state swapped out after its update and back before its next use."""
    uses = first_uses(workload)
    events: list[Event] = []
    for tensor in workload.tensors.values():
        accesses = uses.get(tensor.id, [])
        if tensor.role == "activation" and tensor.created_by >= 0:
            forward = [i for i in accesses if workload.ops[i].phase == "forward"]
            backward = [i for i in accesses if workload.ops[i].phase != "forward"]
            if not backward:
                continue
            last_forward = max(forward, default=tensor.created_by)
            producer = workload.ops[tensor.created_by]
            kind = "release" if not producer.writes and tensor.id % 2 == 0 else "swap_out"
            events.append(Event("job", kind, tensor.id, last_forward))
            events.append(Event("job", "recompute" if kind == "release" else "swap_in", tensor.id, backward[0] - 1))
        elif tensor.reuses is not None:
            old_uses = [i for i in uses.get(tensor.reuses, []) if i < tensor.created_by]
            events.append(Event("job", "swap_out", tensor.id, max([tensor.created_by, *uses.get(tensor.id, [])])))
            if old_uses:
                events.append(Event("job", "swap_in", tensor.id, max(0, old_uses[0] - 1), next_iteration=True))
    return Plan("job", 1, workload.signature, events)


def state_of(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, optimizer in enumerate(optimizers):
        for j, state in enumerate(optimizer.state.values()):
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"opt{i}.{j}.{name}"] = value.clone()
    return out


def train(build: Callable[[int], tuple], batch_size: int, planner=None, micro_batches: int = 1, budget: float | None = None,
          plan_events: Callable[[Workload], Plan] | None = None) -> tuple[dict, HookReport | None]:
    executor = None
    if planner is not None or budget is not None:
        executor = activate(HookSettings(job="job", memory_budget=budget), planner=planner, device=torch.device("cpu"))
    try:
        return fit(build, batch_size, STEPS, micro_batches), executor.report if executor else None
    finally:
        if executor is not None:
            deactivate()


def fit(build: Callable[[int], tuple], batch_size: int, steps: int = STEPS, micro_batches: int = 1) -> dict:
    """Parameters, buffers and optimizer state after `steps` steps of `fit_model`."""
    return state_of(*fit_model(build, batch_size, steps, micro_batches))


def fit_model(build: Callable[[int], tuple], batch_size: int, steps: int = STEPS, micro_batches: int = 1,
              after_step: Callable[[int], None] | None = None) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """A plain training loop, seeded; `after_step(step)` runs between steps (a test waits there)."""
    torch.manual_seed(1234)
    model, batch, loss_fn, make_optimizer = build(batch_size)
    optimizer = make_optimizer(model.parameters())
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(micro_batches):
            loss = loss_fn(model, batch) / micro_batches
            loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step(step)
    return model, [optimizer]


def assert_identical(plain: dict, hooked: dict) -> None:
    assert plain.keys() == hooked.keys()
    different = [k for k in plain if not torch.equal(plain[k], hooked[k])]
    assert not different, f"not bit-identical: {different[:5]}"


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def _import_example(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build


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


def test_amp_with_skipped_steps_and_two_optimizers_is_bit_identical():
    plain, _ = _run_amp_two_optimizers(False)
    hooked, report = _run_amp_two_optimizers(True)
    assert_identical(plain, hooked)
    assert report.stood_down is None
    assert any(it.mode == "planned" for it in report.iterations)


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
    a, b = torch.load(plain), torch.load(hooked)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
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


def replayed_ops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the ops the hook replays from now on, as they replay."""
    from tensile_hook import recipes

    replayed: list[str] = []
    original = recipes.Step.replay

    def replay(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        replayed.append(str(self.func))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(recipes.Step, "replay", replay)
    return replayed


def test_batch_norm_then_inplace_relu_is_recomputed_as_a_chain(monkeypatch):
    """The in-place ReLU that wrote the batch-norm output is replayed on the regenerated tensor."""
    replayed = replayed_ops(monkeypatch)
    plain, _ = train(tracing_models.views, 4)
    hooked, report = train(tracing_models.views, 4, planner=aggressive_plan)
    assert_identical(plain, hooked)
    assert "aten.relu_.default" in replayed and "aten.native_batch_norm.default" in replayed
