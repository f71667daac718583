"""The CUDA mover's stream ordering, on a real GPU (skipped where PyTorch sees none: CI has none; a lent
GPU machine runs it). On the CPU device no bytes move (`test_movers.py`), so these orderings cannot go wrong there."""

from __future__ import annotations

import weakref

import pytest
import torch

from tensile_hook.movers import CudaMover
from tensile_hook.storages import StorageSlot

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_tensor_swapped_out_again_while_its_swap_in_is_in_flight_keeps_its_values():
    """The budget guard may evict a storage whose prefetch has not landed yet (no op has read it): the
    swap-out's copy must wait for the swap-in's, or it saves whatever the block held before."""
    device = torch.device("cuda", 0)
    mover = CudaMover(device)
    for _ in range(3):
        values = torch.arange(64 * 2**20, dtype=torch.float32, device=device)  # 256 MB: copies take a while
        expected = values.cpu()
        storage = values.untyped_storage()
        slot = StorageSlot(id(storage), weakref.ref(storage), storage.nbytes())
        mover.swap_out(slot, storage)
        torch.cuda.synchronize(device)
        scribble = torch.zeros(64 * 2**20, dtype=torch.float32, device=device)  # likely the freed block
        del scribble
        mover.swap_in(slot, storage)  # in flight on the h2d stream ...
        mover.swap_out(slot, storage)  # ... when the guard evicts it again
        mover.swap_in(slot, storage)
        mover.wait(slot)
        torch.cuda.synchronize(device)
        assert torch.equal(values.cpu(), expected)
