"""A plain PyTorch training loop over one of Tensile's zoo models, as `tensile run --model NAME` and a TrainingJob's
`spec.workload` trace it (the optimizer and dtype they name, Adam and float32 by default, the zoo's own batch and
loss): `tensile run --model resnet50 --batch-size 2 -- python examples/train_zoo.py resnet50 --batch-size 2`.

Usage: python examples/train_zoo.py NAME [--batch-size B] [--optimizer adam|adamw|sgd|momentum]
       [--dtype float32|bfloat16|float16] [--input-shape N ...] [--steps N] [--save STATE.pt]
"""

import argparse

import torch

from tensile.forecast import DTYPES, OPTIMIZERS
from tensile.zoo import ZOO, build_zoo_parts


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=list(ZOO), help="a zoo model")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adam", help="as the forecast builds it")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="bfloat16/float16: autocast")
    parser.add_argument("--input-shape", type=int, nargs="+", help="the model's input shape (default: the zoo's)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save", help="write the final model and optimizer state here")
    return parser.parse_args(argv)


def main() -> None:
    args = arguments()
    torch.use_deterministic_algorithms(True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, batch, loss_fn, _ = build_zoo_parts(args.name, args.batch_size, device=device, input_shape=args.input_shape)
    optimizer = OPTIMIZERS[args.optimizer](model.parameters())
    autocast = DTYPES[args.dtype]
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):  # as the trace: forward and loss
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        if step % 5 == 0:  # not every step: a read of the loss is an op the iteration `--model` traced does not have
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.save)


if __name__ == "__main__":
    main()
