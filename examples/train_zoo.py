"""A plain PyTorch training loop over one of Tensile's zoo models, as `tensile run --model NAME` traces it (Adam at
lr 1e-3, the zoo's own batch and loss): `tensile run --model resnet50 --batch-size 2 -- python examples/train_zoo.py
resnet50 --batch-size 2`.

Usage: python examples/train_zoo.py NAME [--batch-size B] [--steps N] [--save STATE.pt]
"""

import argparse

import torch

from tensile.zoo import ZOO, build_zoo_parts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=list(ZOO), help="a zoo model")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save", help="write the final model and optimizer state here")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, batch, loss_fn, _ = build_zoo_parts(args.name, args.batch_size, device=device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        if step % 5 == 0:  # not every step: a read of the loss is an op the iteration `--model` traced does not have
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.save)


if __name__ == "__main__":
    main()
