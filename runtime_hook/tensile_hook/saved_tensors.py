"""The tensors autograd saved for backward, read from their nodes without unpacking them: the native path
takes swapped tensors from there (max pooling's indices, which no module returns) and finds a recomputed
tensor's inputs there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def saved_tensor(node: Any, raw_name: str) -> torch.Tensor | None:
    """A tensor the node saved, read without unpacking it: where saved-tensor hooks packed it (activation
    checkpointing, `save_on_cpu`) it is None, since unpacking runs the user's hook (a checkpoint's nested
    recomputation updated batch norm's running statistics once more)."""
    raw = getattr(node, raw_name, None)
    # torch's stubs leave out SavedTensor's attributes
    if not isinstance(raw, torch._C._autograd.SavedTensor) or raw.unpack_hook is not None:  # type: ignore[attr-defined]
        return None
    return raw.data  # type: ignore[attr-defined]


def saved_storages(node: Any) -> Iterator[tuple[str, int]]:
    """(`_raw_saved_` attribute, id(storage)) of each tensor the node saved and still holds (`saved_tensor`)."""
    for name in dir(node):
        if name.startswith("_raw_saved_"):
            try:
                value = saved_tensor(node, name)
            except RuntimeError:  # freed: a backward ran the node
                continue
            if value is not None:
                yield name, id(value.untyped_storage())
