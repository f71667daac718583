"""A plain PyTorch training script: Tensile runs it unmodified with `tensile run -- python examples/train_mlp.py`.

Usage: python examples/train_mlp.py [--steps N] [--batch-size B] [--pause SECONDS] [--save STATE.pt]
"""

import argparse
import time

import torch

from tiny_mlp import build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--pause", type=float, default=0.0, help="sleep this long after each step (a slower job, to watch live)")
    parser.add_argument("--save", help="write the final model and optimizer state here")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    model, batch, loss_fn, make_optimizer = build(args.batch_size)
    optimizer = make_optimizer(model.parameters())
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        if args.pause:
            time.sleep(args.pause)
        if step % 5 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.save)


if __name__ == "__main__":
    main()
