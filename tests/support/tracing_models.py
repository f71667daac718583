"""Small models in the FILE.py:FUNC contract that exercise the tracer's hard cases."""

from __future__ import annotations

import torch
from torch import nn


class ViewsAndInplace(nn.Module):
    """Views (view, transpose, slicing) and in-place ops (relu_, add_) on activations."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu_(self.bn(self.conv(x)))
        y = y.transpose(2, 3)[:, :, :8, :8].contiguous()
        y.add_(1.0)
        return self.fc(y.view(y.shape[0], -1))


class TiedLM(nn.Module):
    """Embedding and output projection share one weight."""

    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


def _classify_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def _lm_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    (tokens,) = batch
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def views(batch_size: int):
    torch.manual_seed(0)
    batch = (torch.randn(batch_size, 3, 8, 8), torch.randint(0, 10, (batch_size,)))
    return ViewsAndInplace(), batch, _classify_loss, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)


def tied(batch_size: int):
    torch.manual_seed(0)
    batch = (torch.randint(0, 50, (batch_size, 12)),)
    return TiedLM(), batch, _lm_loss, lambda p: torch.optim.Adam(p, lr=1e-3)


def two_groups(batch_size: int):
    """One optimizer, two parameter groups with their own settings."""
    torch.manual_seed(0)
    model = ViewsAndInplace()
    batch = (torch.randn(batch_size, 3, 8, 8), torch.randint(0, 10, (batch_size,)))

    def make_optimizer(params):
        params = list(params)
        return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 1e-4, "weight_decay": 0.0}])

    return model, batch, _classify_loss, make_optimizer


def wrong_arity(batch_size: int):
    return nn.Linear(2, 2), (torch.zeros(1, 2),)


def not_a_module(batch_size: int):
    return "model", (torch.zeros(1, 2),), _classify_loss, lambda p: torch.optim.SGD(p, lr=0.1)


def batch_not_tensors(batch_size: int):
    return nn.Linear(2, 2), [1, 2], _classify_loss, lambda p: torch.optim.SGD(p, lr=0.1)


def lbfgs(batch_size: int):
    """An optimizer whose step needs a closure."""
    model, batch, loss_fn, _ = views(batch_size)
    return model, batch, loss_fn, lambda p: torch.optim.LBFGS(p, max_iter=3)


def item_in_loss(batch_size: int):
    """Data-dependent: the loss reads a value, which the meta device does not have."""
    torch.manual_seed(0)

    def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
        (x,) = batch
        out = model(x).sum()
        return out * 2 if out.item() > 0 else out

    return nn.Linear(4, 4), (torch.randn(batch_size, 4),), loss_fn, lambda p: torch.optim.SGD(p, lr=0.1)
