"""Moving storages between the device and host memory, and freeing them in place.

The tensor objects keep their identity: a storage is emptied to zero bytes while its bytes are on
the host, and filled again when they come back. On the CPU device, where both are the same RAM, its
memory itself is handed to a host storage and back, without a copy (the same logic, for tests and
GPU-less machines; a PyTorch without the call for it, such as 2.11, copies). On CUDA, a storage is copied
out and resized to zero bytes, later resized back and copied in; copies run on one side stream per
direction, ordered by events (never host sleeps), into pinned host buffers taken from a pool so that
pinning does not serialise the copies. A swap-out never makes the compute stream wait: the freed block
is marked as used by the copy stream, so the allocator hands it out again only after the copy has read it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from tensile_hook.storages import StorageSlot


class PinnedBufferPool:
    """Reusable pinned host buffers by size: allocated (and pinned) once."""

    def __init__(self) -> None:
        self.free: dict[int, list[torch.UntypedStorage]] = defaultdict(list)

    def get(self, nbytes: int) -> torch.UntypedStorage:
        if self.free[nbytes]:
            return self.free[nbytes].pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()

    def put(self, buffer: torch.UntypedStorage) -> None:
        self.free[buffer.nbytes()].append(buffer)


# PyTorch 2.13 hands a storage's memory to another storage (`UntypedStorage._swap_data_ptr_`); 2.11 (the GPU
# image's) has no such call, and there a swap on the CPU device copies
HANDS_MEMORY_OVER = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class CpuMover:
    """The CPU device's device memory and host memory are the same RAM: a swap-out hands the storage's memory to
    a host storage of its own without copying a byte (`_swap_data_ptr_`), and a swap-in hands it back. The
    device storage holds 0 bytes meanwhile, as after a copy out and `resize_(0)`; the copies it saves would only
    move bytes within the same memory, evicting the caches on their way (50 MB a ResNet-50 activation at batch
    16: the hook's own steps after each ran 14 µs slower, 0.45 ms of `hook_seconds` an iteration). A storage
    that is not resizable (from numpy) is refused, as on CUDA. The empty host storages are kept for the next
    swap-outs (`spare`): one made at each swap-out, right after the kernels, took it from 6 to 16 µs (stamped).
    A PyTorch without that call (`hands_over` False) copies out and in, as CUDA's mover does, synchronously."""

    def __init__(self, hands_over: bool = HANDS_MEMORY_OVER) -> None:
        self.hands_over = hands_over
        self.spare: list[torch.UntypedStorage] = []  # host storages of 0 bytes, given back by swap-ins

    def swap_out(self, slot: StorageSlot, storage: torch.UntypedStorage) -> None:
        if not storage.resizable():
            raise RuntimeError("the storage is not resizable")
        if self.hands_over:
            host = self.spare.pop() if self.spare else torch.UntypedStorage(0)
            host._swap_data_ptr_(storage)  # type: ignore[attr-defined]  # PyTorch's own, without a stub
        else:
            host = torch.UntypedStorage(storage.nbytes())
            host.copy_(storage)
            storage.resize_(0)
        slot.host = host

    def swap_in(self, slot: StorageSlot, storage: torch.UntypedStorage) -> None:
        """The memory back to the storage: the tensor may change before its next swap-out. The host storage then
        holds what the storage held while away, no memory unless something resized it meanwhile: only an empty one
        waits for the next swap-out, which must leave its storage empty. A copied one goes, with its memory."""
        host = slot.host
        assert host is not None
        if self.hands_over:
            storage._swap_data_ptr_(host)  # type: ignore[attr-defined]
            if not host.nbytes():
                self.spare.append(host)
        else:
            storage.resize_(host.nbytes())
            storage.copy_(host)
        slot.host = None

    def wait(self, slot: StorageSlot) -> None:
        """Nothing is in flight on the CPU."""

    def drop_host(self, slot: StorageSlot) -> None:
        """The host storage goes with its memory (only empty ones wait in `spare`)."""
        slot.host = None

    def release_host(self, host: torch.UntypedStorage) -> None:
        """A storage died while swapped out: its memory goes with the host storage."""

    def settle(self) -> None:
        """Nothing is in flight on the CPU."""


class CudaMover:
    """Side streams and events: the compute stream waits on an event only when it needs the tensor.

    Its swaps run on the training loop's host path, right after big kernel launches (cold caches), 24 a
    ResNet-50 iteration: each gets the compute stream once, makes no throwaway event (`wait_stream`) and
    switches streams with `set_stream` rather than `torch.cuda.stream`, whose context looks the current
    device and stream up several times.
    """

    def __init__(self, device: torch.device) -> None:
        self.pool = PinnedBufferPool()
        # indexed, so that a storage's device compares equal ("cuda" alone is not "cuda:0")
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.index: int = self.device.index  # an int: torch.cuda's device lookups return it at once
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        # "the compute stream's work queued so far", recorded anew by each copy: a stream waits for the
        # state an event had when the wait was queued, so recording it again later changes no earlier wait
        self.mark = torch.cuda.Event()
        self.returning: list[tuple[torch.cuda.Event, torch.UntypedStorage]] = []  # buffers still read by a copy

    def swap_out(self, slot: StorageSlot, storage: torch.UntypedStorage) -> None:
        if storage.device != self.device:  # its copy would run on its own device's stream, not ordered by ours
            raise RuntimeError(f"a storage on {storage.device} is not moved by the mover of {self.device}")
        self._collect_returned()
        slot.host = self.pool.get(slot.nbytes)
        # the copy reads what compute wrote, and what a swap-in still in flight writes (evicted before any
        # op read it); a swap-in copies the host buffer back only after it (slot.pending)
        self._copy(self.d2h, slot, slot.host, storage)
        self._used_by(storage, self.d2h)  # compute goes on while the copy reads the freed block
        storage.resize_(0)

    def swap_in(self, slot: StorageSlot, storage: torch.UntypedStorage) -> None:
        storage.resize_(slot.nbytes)  # allocated on the compute stream, which last freed it
        assert slot.host is not None
        self._copy(self.h2d, slot, storage, slot.host)
        self._used_by(storage, self.h2d)  # should the tensor die unread, the copy may still be writing its block
        self.returning.append((slot.pending, slot.host))
        slot.host = None

    def _copy(self, side: torch.cuda.Stream, slot: StorageSlot, dst: torch.UntypedStorage,
              src: torch.UntypedStorage) -> None:
        """Queue dst.copy_(src) on `side` after the compute stream's work queued so far and after
        slot.pending, which then marks the copy's end (a new event: each slot keeps its own until it is
        waited for or its buffer returns); the current stream and device are what they were before."""
        compute = torch.cuda.current_stream(self.index)
        self.mark.record(compute)
        self.mark.wait(side)
        if slot.pending is not None:
            slot.pending.wait(side)
        if torch.cuda.current_device() != self.index:  # set_stream would make the side's device current too
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
        else:
            torch.cuda.set_stream(side)
            try:
                dst.copy_(src, non_blocking=True)
            finally:
                torch.cuda.set_stream(compute)  # the current device's current stream, as it was
        slot.pending = torch.cuda.Event()
        slot.pending.record(side)

    def _used_by(self, storage: torch.UntypedStorage, stream: torch.cuda.Stream) -> None:
        """The caching allocator hands the storage's block out again only once `stream`'s work queued so
        far has run (`record_stream` takes a tensor: a 0-element one on the storage)."""
        torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage).record_stream(stream)

    def drop_host(self, slot: StorageSlot) -> None:
        """Return the buffer once no copy reads it any more."""
        if slot.host is not None:
            self.returning.append((self.d2h.record_event(), slot.host))
            slot.host = None

    def release_host(self, host: torch.UntypedStorage) -> None:
        """Straight back to the pool, no event: the copy that last wrote it (the swap-out) and the next one to use it
        (another swap-out) both run on the d2h stream, in order."""
        self.pool.put(host)

    def _collect_returned(self) -> None:
        still = []
        for event, buffer in self.returning:
            if event.query():
                self.pool.put(buffer)
            else:
                still.append((event, buffer))
        self.returning = still

    def wait(self, slot: StorageSlot) -> None:
        if slot.pending is not None:
            slot.pending.wait(torch.cuda.current_stream(self.index))
            slot.pending = None

    def settle(self) -> None:
        """The compute stream waits for every transfer queued so far: at an iteration's end (the paper's
        Executor, §III) and after a restore, whose swap-ins nothing else waits for."""
        compute = torch.cuda.current_stream(self.index)
        compute.wait_stream(self.d2h)
        compute.wait_stream(self.h2d)


Mover = CpuMover | CudaMover  # the device's: CUDA's, or the CPU device's (tests, GPU-less machines)
