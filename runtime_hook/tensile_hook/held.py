"""Which storages the script itself can still read when backward starts.

The native path swaps activations out with no dispatch mode on the stack to check a read before use.
Autograd's own reads are checked (node pre-hooks), but a tensor the script holds (a value the model
returns, a module attribute set in forward, a view of either) can be read between forward and backward
in any step: in a step the learning iteration did not show (logging every N steps), that read would
find a storage of 0 bytes (a segmentation fault on the CPU device, an illegal memory access on CUDA).

So when the learning iteration's backward starts, every Python object that refers to a tensor on a
swapped storage is looked at, once (scans of the garbage collector's objects: about 0.2 s with BERT's
modules loaded), and so are the locals of the running frames, which the collector does not see. Autograd
keeps what backward reads in C++ (the Python objects PyTorch preserves for its saved tensors have no
Python referrer), so such a referrer is the script's, except for the locals of Tensile's and PyTorch's
own frames (the dispatch mode's hold the first backward op's inputs) and the attributes of a custom
autograd Function's context (read only by its backward node, which is checked).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch

_INTERNAL = (str(Path(torch.__file__).parent), str(Path(__file__).parent))  # PyTorch's code, the hook's


def held_storages(storages: list[torch.UntypedStorage], own: frozenset[int] = frozenset()) -> set[int]:
    """Those of the (live) storages that a tensor object the script refers to is on, by id; `own`: ids of the
    hook's own containers of tensors (its recompute recipes' arguments), which are not the script's."""
    if not storages:  # no scan of every object when there is nothing to look for
        return set()
    keys = {id(storage) for storage in storages}
    tensors, on_key = [], {}  # the tensors on those storages, and each one's storage by its id
    for tensor in _tensors():
        if (key := _storage_key(tensor)) in keys:
            tensors.append(tensor)
            on_key[id(tensor)] = key
    if not tensors:
        return set()
    referrers = [r for r in gc.get_referrers(*tensors) if r is not tensors]
    contexts = _autograd_contexts([r for r in referrers if type(r) is dict])
    held = {on_key[id(obj)] for r in referrers if id(r) not in contexts and id(r) not in own
            for obj in gc.get_referents(r) if id(obj) in on_key}
    return held | {on_key[id(value)] for value in _stack_locals() if id(value) in on_key}


def _tensors() -> list[torch.Tensor]:
    """Every tensor object alive (a type test, not isinstance: some module-level objects answer
    isinstance through a deprecated `__class__` that warns)."""
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return id(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError):  # sparse, or a subclass without storage
        return None


def _stack_locals() -> list[Any]:
    """The local variables of the script's running functions, in every thread: the garbage collector
    does not see into the frames that are executing (`logits, features = model(x)` holds `features` so).
    PyTorch's and the hook's own frames do not count (the dispatch mode's holds the first backward op's
    inputs)."""
    values: list[Any] = []
    frame: FrameType | None  # None at the end of each walk: no frame is kept (it would count as a holder)
    for frame in sys._current_frames().values():
        while frame is not None:
            if not frame.f_code.co_filename.startswith(_INTERNAL):
                values.extend(frame.f_locals.values())
            frame = frame.f_back
    return values


def _autograd_contexts(dicts: list[dict]) -> set[int]:
    """Ids of the dicts among these that are the attributes of a custom autograd Function's context
    (`ctx.x = x`): its backward node reads them, and the native path checks that node (one more scan)."""
    if not dicts:
        return set()
    ids = {id(d) for d in dicts}
    return {id(owner.__dict__) for owner in gc.get_referrers(*dicts)
            if isinstance(owner, torch.autograd.function.BackwardCFunction) and id(owner.__dict__) in ids}
