"""The CPU device's mover: a swap hands the storage's memory to the host and back, without a copy; on a PyTorch
without `_swap_data_ptr_` (2.11, the GPU image's) it copies out and in, and the tests run that way too."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from tensile_hook.movers import HANDS_MEMORY_OVER, CpuMover
from tensile_hook.storages import StorageSlot


def _slot(storage: torch.UntypedStorage) -> StorageSlot:
    return StorageSlot(id(storage), weakref.ref(storage), storage.nbytes())


# each way this PyTorch can swap: handing the memory over needs its `_swap_data_ptr_`
WAYS = pytest.mark.parametrize("hands_over", [pytest.param(True, marks=pytest.mark.skipif(
    not HANDS_MEMORY_OVER, reason="this PyTorch has no UntypedStorage._swap_data_ptr_")), False],
    ids=["hands over", "copies"])


@WAYS
def test_a_swap_out_empties_the_storage_and_a_swap_in_gives_back_the_same_memory_and_values(hands_over: bool):
    values = torch.randn(1000)
    expected = values.clone()
    storage = values.untyped_storage()
    address, nbytes = storage.data_ptr(), storage.nbytes()
    slot, mover = _slot(storage), CpuMover(hands_over)
    mover.swap_out(slot, storage)
    assert storage.nbytes() == 0  # as after resize_(0): the tracker and the check before use see it away
    assert slot.host is not None and slot.host.nbytes() == nbytes
    assert (slot.host.data_ptr() == address) == hands_over  # moved, not copied (or copied)
    mover.swap_in(slot, storage)
    assert slot.host is None and storage.nbytes() == nbytes
    assert storage.data_ptr() == address or not hands_over  # its own memory back
    assert torch.equal(values, expected)
    values.add_(1)  # the tensor is usable again, in place too
    assert torch.equal(values, expected + 1)


@WAYS
def test_a_storage_that_is_not_resizable_is_refused_and_keeps_its_values(hands_over: bool):
    """From numpy, as on CUDA where resize_(0) refuses it: the executor then pins it on the device."""
    array = np.arange(16, dtype=np.float32)
    values = torch.from_numpy(array)
    storage = values.untyped_storage()
    slot = _slot(storage)
    with pytest.raises(RuntimeError, match="not resizable"):
        CpuMover(hands_over).swap_out(slot, storage)
    assert slot.host is None and storage.nbytes() == array.nbytes
    assert torch.equal(values, torch.arange(16, dtype=torch.float32))


@WAYS
def test_a_storage_that_dies_while_away_takes_its_memory_with_its_host_storage(hands_over: bool):
    values = torch.randn(1000)
    storage = values.untyped_storage()
    slot, mover = _slot(storage), CpuMover(hands_over)
    mover.swap_out(slot, storage)
    host = weakref.ref(slot.host)
    del values, storage
    assert slot.ref() is None  # the tensor died away: nothing comes back
    mover.drop_host(slot)
    assert slot.host is None and host() is None


@pytest.mark.skipif(not HANDS_MEMORY_OVER, reason="this PyTorch has no UntypedStorage._swap_data_ptr_")
def test_the_empty_host_storages_are_kept_for_the_next_swap_outs_and_one_holding_memory_is_not():
    """Made and freed at every swap they cost ~10 µs a swap-out on the caches the kernels leave; a host storage given
    back with memory (its storage was resized while away) would hand that memory to the next storage it takes."""
    first, second = torch.randn(1000), torch.randn(500)
    expected = second.clone()
    mover = CpuMover()
    first_slot = _slot(first.untyped_storage())
    mover.swap_out(first_slot, first.untyped_storage())
    host = first_slot.host
    mover.swap_in(first_slot, first.untyped_storage())
    second_slot = _slot(second.untyped_storage())
    mover.swap_out(second_slot, second.untyped_storage())
    assert second_slot.host is host and second.untyped_storage().nbytes() == 0  # reused, and the storage is empty
    mover.swap_in(second_slot, second.untyped_storage())
    assert torch.equal(second, expected)
    third = torch.randn(100)
    third_slot = _slot(third.untyped_storage())
    mover.swap_out(third_slot, third.untyped_storage())
    third.untyped_storage().resize_(400)  # something gave it memory again while away (PyTorch swaps equal sizes only)
    mover.swap_in(third_slot, third.untyped_storage())
    assert not mover.spare  # the one host storage there was took the third's memory back: not kept
