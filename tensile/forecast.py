"""Trace a model's training iteration into a Workload, the way a forecast needs it.

Zoo models are built directly on the meta device; user models are built on the CPU and moved to
meta. A live trace (`live=True`) runs the same iteration on real CPU tensors instead. Mixed
precision is traced on fake CPU tensors, because autocast has no meta device.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from tensile.errors import TensileUserError
from tensile.trace_choices import DEVICES, is_user_model
from tensile.tracer import TrainingStep, trace_step
from tensile.user_model import CONTRACT, load_user_parts, user_code
from tensile.workload import Workload
from tensile.zoo import build_zoo_parts, zoo_entry

# foreach is left unset here: trace_step chooses it for the target device (or as --foreach says).
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}
DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def optimizer_for(model: str, optimizer: str | None) -> str | None:
    """The optimizer a model is traced with: the one asked for, else Adam for a zoo model, and a user model's own
    make_optimizer (None)."""
    return optimizer or (None if is_user_model(model) else "adam")


def _check_choice(field: str, value: str, choices: Collection[str]) -> None:
    if value not in choices:
        raise TensileUserError(f"{field} '{value}' is not supported; choose one of: {', '.join(choices)}")


@contextlib.contextmanager
def _tracing_backend(kind: str) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Yield a function that moves a CPU/meta tensor onto the backend: meta, fake CPU, or real CPU."""
    if kind == "meta":
        yield lambda t: t.to("meta")
    elif kind == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield lambda t: mode.from_tensor(t)
    else:
        yield lambda t: t


def _move_module(model: torch.nn.Module, move: Callable[[torch.Tensor], torch.Tensor]) -> torch.nn.Module:
    """Move parameters and buffers in place, keeping tied (shared) ones shared."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        # _parameters gets Parameters back (moved below), _buffers Tensors
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for slots in tables:
            for name, value in list(slots.items()):
                if value is None:
                    continue
                if id(value) not in moved:
                    if isinstance(value, torch.nn.Parameter):
                        moved[id(value)] = torch.nn.Parameter(move(value.detach()), requires_grad=value.requires_grad)
                    else:
                        moved[id(value)] = move(value)
                slots[name] = moved[id(value)]
    return model


def trace_workload(
    model: str,
    batch_size: int,
    optimizer: str | None = "adam",
    dtype: str = "float32",
    device: str = "cuda",
    live: bool = False,
    foreach: bool | None = None,
    micro_batches: int = 1,
    input_shape: tuple[int, ...] | None = None,
) -> Workload:
    """One steady-state training iteration of `model` as it would run on `device`.

    `optimizer=None` keeps a user model's own make_optimizer; zoo models default to Adam.
    `foreach=None` lets the target device choose, as PyTorch does; True / False applies to the user's
    make_optimizer too.
    """
    if batch_size < 1:
        raise TensileUserError(f"--batch-size must be a positive integer (was {batch_size})")
    if micro_batches < 1:
        raise TensileUserError(f"--micro-batches must be a positive integer (was {micro_batches}): "
                               "the gradient accumulation steps per optimizer step")
    _check_choice("--dtype", dtype, DTYPES)
    _check_choice("--device", device, DEVICES)
    if optimizer is not None:
        _check_choice("--optimizer", optimizer, OPTIMIZERS)
    autocast = DTYPES[dtype]
    backend = "cpu" if live else ("fake" if autocast is not None else "meta")
    user = is_user_model(model)
    name = model if user else zoo_entry(model)[0]
    with warnings.catch_warnings(), _quiet_transformers(), user_code(model) if user else contextlib.nullcontext():
        warnings.simplefilter("ignore", UserWarning)
        if user:
            net, batch, loss_fn, make_optimizer = load_user_parts(model, batch_size)
        else:
            net, batch, loss_fn, make_optimizer = build_zoo_parts(
                name, batch_size, device="meta" if backend == "meta" else "cpu", input_shape=input_shape
            )
        with _tracing_backend(backend) as move:
            if not (backend == "meta" and not user):
                net = _move_module(net, move)
                batch = tuple(move(t) for t in batch)
            if optimizer is not None:
                opt = OPTIMIZERS[optimizer](net.parameters())
            else:
                opt = make_optimizer(net.parameters())
                if not isinstance(opt, torch.optim.Optimizer):
                    raise TensileUserError(f"--model {model}: {CONTRACT}; make_optimizer returned {type(opt).__name__}")
                if needs_closure(opt):
                    raise TensileUserError(
                        f"--model {model}: make_optimizer returned {type(opt).__name__}, whose step needs a closure: it "
                        "runs the forward and backward itself, as often as the values decide, which a trace cannot "
                        "follow; trace with --optimizer (adam, sgd, ...) for a forecast, or run the job without a "
                        "forecast (tensile run without --model): the hook plans from its live iterations")
            step = TrainingStep(net, batch, loss_fn, [opt], micro_batches, autocast)
            return trace_step(
                step,
                model_name=name,
                batch_size=batch_size,
                target_device=device,
                meta={"optimizer": optimizer or type(opt).__name__.lower(), "dtype": dtype, "micro_batches": micro_batches},
                foreach=foreach,
            )


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Its step cannot run without a closure (LBFGS's): one `step()` is no iteration of it."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers logs config notes on every model build; a forecast's output is the table."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)
