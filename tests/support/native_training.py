"""Small image classifiers trained under hand-made plans until the hook carries them on its native path (module
hooks and autograd node pre-hooks, no dispatch mode), on the CPU device or on a GPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tensile_hook import activate, deactivate
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings
from tests.support.plans import feature_swaps
from tests.support.training import fit

STEPS = 7  # 0-1 recorded, 2 aligns the swaps on the dispatch path, 3-6 carry them natively


class Blocks(nn.Module):
    """Conv, batch norm and ReLU modules; one in-place ReLU module is called twice (as in
    torchvision's Bottleneck), a residual add sits between module calls, and max pooling saves
    indices no module returns. In the forward calls in `detour_at` an extra module runs: the
    forward takes another branch. With `prologue` the forward starts with an op on the input
    alone, before the first op on a parameter."""

    def __init__(self, detour_at: frozenset[int] = frozenset(), prologue: bool = False) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.extra = nn.Conv2d(8, 8, 1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(128, 10)
        self.detour_at = detour_at
        self.prologue = prologue
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.prologue:
            x = x * 2
        y = self.relu(self.bn1(self.conv1(x)))
        z = self.relu(self.bn2(self.conv2(y)) + y)
        if self.calls in self.detour_at:
            z = self.extra(z)
        return self.fc(self.pool(z).flatten(1))


def image_classifier(make: Callable[[], nn.Module], batch_size: int) -> tuple:
    """A builder's parts for a model of 8x8 images in 10 classes: seeded, the batch made before the model."""
    torch.manual_seed(0)
    batch = (torch.randn(batch_size, 3, 8, 8), torch.randint(0, 10, (batch_size,)))

    def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    return make(), batch, loss_fn, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)


def blocks(batch_size: int, detour_at: frozenset[int] = frozenset(), prologue: bool = False) -> tuple:
    return image_classifier(lambda: Blocks(detour_at, prologue), batch_size)


class Noisy(nn.Module):
    """A convolution, an in-place ReLU, dropout, a second convolution, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.relu, self.drop = nn.ReLU(inplace=True), nn.Dropout(0.5)
        self.fc = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv2(self.drop(self.relu(self.conv1(x)))).flatten(1))


def noisy(batch_size: int) -> tuple:
    return image_classifier(Noisy, batch_size)


def on_device(build, device: torch.device):  # type: ignore[no-untyped-def]
    """A model builder of these tests, its model and batch moved to `device` (tests/hook/test_cuda.py)."""
    if device.type == "cpu":
        return build

    def built(batch_size: int) -> tuple:
        model, batch, loss_fn, make_optimizer = build(batch_size)
        return model.to(device), tuple(t.to(device) for t in batch), loss_fn, make_optimizer
    return built


def hooked(build, planner, steps: int = STEPS, micro_batches: int = 1,  # type: ignore[no-untyped-def]
           observe: bool = False, settings: HookSettings = HookSettings(job="job"),
           device: torch.device = torch.device("cpu")) -> tuple[dict, HookReport]:
    executor = activate(settings, planner=planner, device=device)
    executor.observe_native = observe
    try:
        return fit(on_device(build, device), 4, steps, micro_batches), executor.report
    finally:
        deactivate()


def out_of_memory_in_a_native_backward(device: torch.device) -> HookReport:
    """Iteration 4's swap-ins fail out of memory: its backward must raise; then, without Tensile, the model trains
    on (its gradients finite)."""
    executor = activate(HookSettings(job="job"), planner=feature_swaps, device=device)
    try:
        torch.manual_seed(1234)
        model, batch, loss_fn, make_optimizer = on_device(blocks, device)(4)
        optimizer = make_optimizer(model.parameters())
        for _ in range(4):  # 0-1 recorded, 2 aligned, 3 native
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()
        swap_in = executor.residency.mover.swap_in

        def out_of_memory(slot, storage):  # type: ignore[no-untyped-def]
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        executor.residency.mover.swap_in = out_of_memory
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        with pytest.raises(torch.OutOfMemoryError):
            loss.backward()
        executor.residency.mover.swap_in = swap_in
    finally:
        deactivate()
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model, batch).backward()  # the model goes on training without Tensile
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # an illegal memory access would surface here
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    return executor.report


def assert_blocks_recomputed_natively(report: HookReport) -> None:
    """`blocks` under `feature_recomputes`, with no stand-down: conv1, bn1 (+ ReLU) and conv2 released in the iteration
    that aligns them (on the dispatch path: every event exactly) and in each native one after it. conv2's recompute
    reads bn1's output, which reads conv1's: those two come back as its inputs, checked before use, and only conv2's
    counts as a planned recompute."""
    assert report.stood_down is None, report.stood_down
    aligned = report.iterations[2]
    assert aligned.events["release"] == 3 and aligned.recompute_bytes == 3 * 4 * 8 * 8 * 8 * 4, aligned
    for it in report.iterations[3:]:
        assert (it.path, it.mode) == ("native", "planned"), (it.path, it.mode, report.messages)
        assert it.events == aligned.events and it.recompute_bytes == aligned.recompute_bytes, it
        assert it.swap_out_bytes == 0, it
