"""Real training loops for the hook's tests, each returning what it produced (losses, states) so that a plain run
and a run under a plan can be compared bit for bit."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from tests.support.training import state_of

Results = dict[str, Any]  # what a loop produced: tensors and numbers, nested in dicts and lists
Loop = Callable[[], Results]
Batch = tuple[torch.Tensor, torch.Tensor]
EPOCHS = [8, 8, 8, 5] * 4  # 4 epochs of 4 batches, the last of 5 examples instead of 8


class Net(nn.Module):
    """A conv/bn/ReLU stem, a conv/bn/ReLU block with a residual add (optionally under activation
    checkpointing, "reentrant" or not), max pooling, a fixed random projection kept as a buffer (64 KiB, read
    once per forward: what a memory budget evicts first) and a linear head; with `detour` an extra
    module runs after the block: the forward takes another branch."""

    def __init__(self, checkpointed: bool | str = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.extra = nn.Conv2d(8, 8, 1)
        self.pool = nn.MaxPool2d(2)
        self.register_buffer("mix", torch.randn(128, 128) * 0.05)
        self.head = nn.Linear(128, 10)
        self.checkpointed = checkpointed
        self.detour = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.stem(x))

    def rest(self, y: torch.Tensor) -> torch.Tensor:
        """Everything after the stem."""
        if self.checkpointed:
            z = checkpoint(self.block, y, use_reentrant=self.checkpointed == "reentrant")
        else:
            z = self.block(y)
        z = z + y
        if self.detour:
            z = self.extra(z)
        h = self.pool(z).flatten(1)
        return self.head(h + h @ self.mix)


def net(checkpointed: bool | str = False) -> Net:
    torch.manual_seed(1234)
    return Net(checkpointed)


def batches(sizes: Sequence[int], seed: int = 0) -> list[Batch]:
    """One batch per step, of the given sizes, from a generator of their own (not the global RNG)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, 8, 8, generator=generator), torch.randint(0, 10, (n,), generator=generator))
            for n in sizes]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def forward_backward(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and the logits, after backward."""
    logits = model(batch[0])
    loss = F.cross_entropy(logits, batch[1])
    loss.backward()
    return loss, logits


def final(model: nn.Module, *optimizers: torch.optim.Optimizer) -> Results:
    return state_of(model, list(optimizers))


def losses_loop(sizes: Sequence[int], make: Callable[[], Net] = net,
                before_step: Callable[[Net, int], None] | None = None) -> Loop:
    """The plain loop over batches of these sizes, its losses kept: `make` builds the model,
    `before_step` changes it before each step."""

    def loop() -> Results:
        model = make()
        optimizer = sgd(model)
        losses = []
        for step, batch in enumerate(batches(sizes)):
            if before_step is not None:
                before_step(model, step)
            optimizer.zero_grad(set_to_none=True)
            loss, _ = forward_backward(model, batch)
            optimizer.step()
            losses.append(loss.detach())
        return {"losses": losses, "state": final(model, optimizer)}

    return loop
