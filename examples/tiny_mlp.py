"""A user model in the FILE.py:FUNC contract: `tensile forecast --model examples/tiny_mlp.py:build`."""

import torch


def build(batch_size: int):
    """(model, batch, loss_fn, make_optimizer), all on the CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(512, 512),
        torch.nn.GELU(),
        torch.nn.Linear(512, 10),
    )
    batch = (torch.randn(batch_size, 256), torch.randint(0, 10, (batch_size,)))

    def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        inputs, labels = batch
        return torch.nn.functional.cross_entropy(model(inputs), labels)

    def make_optimizer(params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3)

    return model, batch, loss_fn, make_optimizer
