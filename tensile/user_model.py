"""Load a user's model from FILE.py:FUNC and check it meets the contract.

FUNC(batch_size: int) returns (model, batch, loss_fn, make_optimizer): `model` an nn.Module built
on the CPU, `batch` a tuple of CPU tensors, `loss_fn(model, batch)` a scalar loss, and
`make_optimizer(params)` a torch.optim.Optimizer. Users and other parts rely on this contract.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

from tensile.errors import TensileUserError
from tensile.zoo import ModelParts

CONTRACT = "FUNC(batch_size) must return (model, batch, loss_fn, make_optimizer)"


@contextlib.contextmanager
def _folder_on_path(path: Path) -> Iterator[None]:
    """The model file's folder first on sys.path while it loads and builds, as `python FILE.py` has it:
    a model file that imports a module beside it works under Tensile as it does alone."""
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)  # the first occurrence: the one put there above


@contextlib.contextmanager
def user_code(spec: str) -> Iterator[None]:
    """An exception raised in the user's model file, as one line naming its type, message, function, file and line: the
    user's mistake, not Tensile's, so Tensile's frames around it would only hide it (`tensile --debug` shows them all).
    An exception whose traceback never passes through that file is Tensile's own and goes on as it is."""
    path = Path(spec.rpartition(":")[0]).resolve()
    try:
        yield
    except TensileUserError:
        raise
    except Exception as exc:
        theirs = [frame for frame in traceback.extract_tb(exc.__traceback__) if Path(frame.filename).resolve() == path]
        if not theirs:
            raise
        where = theirs[-1]
        raise TensileUserError(f"--model {spec}: {type(exc).__name__}: {exc} (in {where.name}, {where.filename}:"
                               f"{where.lineno}; `tensile --debug ...` shows the whole traceback)") from exc


def load_user_parts(spec: str, batch_size: int) -> ModelParts:
    """Import FILE.py, call FUNC(batch_size) and check each part of what it returns."""
    file_name, _, func_name = spec.rpartition(":")
    path = Path(file_name)
    if not path.is_file():
        raise TensileUserError(f"--model {spec}: file '{file_name}' does not exist")
    module_name = f"tensile_user_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise TensileUserError(f"--model {spec}: '{file_name}' cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    with _folder_on_path(path):
        try:
            module_spec.loader.exec_module(module)
        except (ImportError, SyntaxError) as exc:
            del sys.modules[module_name]
            hint = " (its own folder is searched, as by `python FILE.py`; install what it imports)" if isinstance(exc, ImportError) else ""
            raise TensileUserError(f"--model {spec}: importing '{file_name}' failed: {type(exc).__name__}: {exc}{hint}") from None
        func = getattr(module, func_name, None)
        if not callable(func):
            raise TensileUserError(f"--model {spec}: '{file_name}' has no function '{func_name}'")
        parts = func(batch_size)
    if not isinstance(parts, tuple) or len(parts) != 4:
        raise TensileUserError(f"--model {spec}: {CONTRACT}; it returned {type(parts).__name__}")
    model, batch, loss_fn, make_optimizer = parts
    if not isinstance(model, torch.nn.Module):
        raise TensileUserError(f"--model {spec}: model (item 1) must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(batch, tuple) or not batch or not all(isinstance(t, torch.Tensor) for t in batch):
        raise TensileUserError(f"--model {spec}: batch (item 2) must be a non-empty tuple of tensors")
    if any(t.device.type != "cpu" for t in batch) or any(p.device.type != "cpu" for p in model.parameters()):
        raise TensileUserError(f"--model {spec}: model and batch must be built on the CPU (they are moved for tracing)")
    if not callable(loss_fn):
        raise TensileUserError(f"--model {spec}: loss_fn (item 3) must be callable as loss_fn(model, batch)")
    if not callable(make_optimizer):
        raise TensileUserError(f"--model {spec}: make_optimizer (item 4) must be callable as make_optimizer(params)")
    return model, batch, loss_fn, make_optimizer
