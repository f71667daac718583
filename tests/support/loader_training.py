"""A training script whose batches come from a DataLoader with worker processes (`--start-method` spawn,
fork or forkserver), as most real ones do: the workers are the parent's helpers, not trainings of their own.

Usage: python tests/support/loader_training.py --start-method spawn --save STATE.pt
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--start-method", default="spawn")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save", required=True)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(128, 32), torch.randint(0, 10, (128,)))
    loader = DataLoader(data, batch_size=32, shuffle=True, num_workers=1, multiprocessing_context=args.start_method,
                        generator=torch.Generator().manual_seed(0))
    for _ in range(args.epochs):
        for inputs, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.save)


if __name__ == "__main__":
    main()
