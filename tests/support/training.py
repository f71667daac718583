"""Plain training loops, seeded, run with or without the hook: what the hook's tests compare bit for bit."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch

from tensile.plan import Plan
from tensile.workload import Workload
from tensile_hook import activate, deactivate
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings

STEPS = 5  # iterations 0-1 are recorded and matched, 2-4 run under the plan
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def state_of(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, optimizer in enumerate(optimizers):
        for j, state in enumerate(optimizer.state.values()):
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"opt{i}.{j}.{name}"] = value.clone()
    return out


def train(build: Callable[[int], tuple], batch_size: int, planner=None, micro_batches: int = 1,
          budget: float | None = None, plan_events: Callable[[Workload], Plan] | None = None,
          ) -> tuple[dict, HookReport | None]:
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


def import_example(name: str):
    """The `build` of examples/NAME.py, loaded from its file (the examples folder is no package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build
