"""The suite's one bit-identity check: what a training run under Tensile produced (parameters, buffers, optimizer
state, whatever else its loop returned) equals, bit for bit, what the same run produced without Tensile."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def flatten(results: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of nested dicts, lists and tuples, named by its dotted path."""
    if isinstance(results, dict):
        for key, value in results.items():
            yield from flatten(value, f"{prefix}{key}.")
    elif isinstance(results, (list, tuple)):
        for i, value in enumerate(results):
            yield from flatten(value, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), results


def same(a: Any, b: Any) -> bool:
    """Bit for bit: tensors of one dtype and shape whose bytes are equal (torch.equal on the bytes, which tells -0.0
    from 0.0 and takes a NaN the skipped step leaves in batch norm's running statistics in both runs), other values
    by `==` (a NaN in both included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    return a == b or (a != a and b != b)  # NaN in both runs


def assert_identical(plain: Any, hooked: Any) -> None:
    """Bit-identical: the same leaves by path (`state_of`'s flat dict, a saved state dict, a loop's nested results),
    each the same by `same`."""
    a, b = dict(flatten(plain)), dict(flatten(hooked))
    assert a.keys() == b.keys(), f"not the same keys: {sorted(a.keys() ^ b.keys())[:5]}"
    different = [k for k in a if not same(a[k], b[k])]
    assert not different, f"not bit-identical: {different[:5]}"
