"""Reads of storages that bypass the dispatcher, where the hook cannot check before use.

`state_dict()` and `torch.save` read storages directly (a checkpoint of a swapped-out tensor would hold
0 bytes, silently); sharing a storage with another process hands its memory over (a DataLoader whose
workers are spawned pickles the dataset so: a storage the budget guard had evicted reached the workers
empty and training went on with NaNs); on the CPU device `Tensor.numpy()` aliases a storage's memory (an
evicted one read as garbage) and `Tensor.tolist()` reads it (one released raised); `copy.deepcopy` of a plain tensor (a model's buffer, for an EMA copy) clones
its storage directly. Saving brings everything back first, a copy its own storage; a storage shared or
aliased is brought back and pinned, since resizing it later would free memory the other side still reads.
While such a read runs, the ops it makes itself (pickling a Parameter detaches it) are only watched: the
budget guard must not evict what is being read, and they start no iteration.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tensile_hook.executor import PlanExecutor


def _storage_of(value: Any) -> torch.UntypedStorage | None:
    """The storage a tensor or a storage handed to another process shares (None for sparse and the like)."""
    if isinstance(value, torch.Tensor):
        return value.untyped_storage() if value.layout == torch.strided else None
    if isinstance(value, torch.TypedStorage):
        return value._untyped_storage
    return value if isinstance(value, torch.UntypedStorage) else None


def guard_outside_reads(executor: PlanExecutor) -> list[Callable[[], None]]:
    """Wrap every such read for this executor; returns the calls that undo it."""

    def restoring(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def read_everything(*args: Any, **kwargs: Any) -> Any:
            if executor.disabled:
                return original(*args, **kwargs)
            executor.restore_all()
            with executor.reading_outside(saving=True):
                return original(*args, **kwargs)

        return read_everything

    def bringing_back(pin: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def read_one(value: Any, *args: Any, **kwargs: Any) -> Any:
                if executor.disabled or (storage := _storage_of(value)) is None:
                    return original(value, *args, **kwargs)
                executor.bring_back(storage, pin)
                with executor.reading_outside():
                    return original(value, *args, **kwargs)

            return read_one

        return wrap

    pinning, copying = bringing_back(pin=True), bringing_back(pin=False)
    patches: list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = [
        (torch.nn.Module, "state_dict", restoring),
        (torch.optim.Optimizer, "state_dict", restoring),
        (torch, "save", restoring),
        (torch.serialization, "save", restoring),
        (torch.UntypedStorage, "share_memory_", pinning),
        (torch.Tensor, "__deepcopy__", copying),  # a plain tensor's copy clones its storage directly
    ]
    # on CUDA numpy() and tolist() copy to the host first, which the dispatcher sees
    if executor.state.device_type == "cpu":
        # tolist() reads the values once (logging predictions each step: released or swapped out, it raised)
        patches += [(torch.Tensor, "numpy", pinning), (torch.Tensor, "tolist", copying)]
    undo: list[Callable[[], None]] = []
    for owner, name, wrap in patches:
        own = name in vars(owner)  # else inherited (a C method of the base): undone by deleting ours
        original = getattr(owner, name)
        setattr(owner, name, wrap(original))
        undo.append(functools.partial(setattr, owner, name, original) if own else functools.partial(delattr, owner, name))
    # what multiprocessing pickles a tensor or storage with, for a worker or a queue: torch's reducers (their
    # size check comes before any method we could wrap: an evicted storage was sent as an empty one)
    reducers = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    for kind, reduce in list(reducers.items()):
        if isinstance(kind, type) and issubclass(kind, (torch.Tensor, torch.TypedStorage, torch.UntypedStorage)):
            reducers[kind] = pinning(reduce)
            undo.append(functools.partial(reducers.__setitem__, kind, reduce))
    return undo
