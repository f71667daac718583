"""Where each storage the hook watches is, and the calls that move it: the plan's events applied (swap out and in,
release, recompute), the check before use (a late or wrong plan costs a stall, never correctness), and the budget
guard (Capuchin's passive mode: the least recently used storages out when the device holds more than the budget).

A swap-out and a fetch time the mover's call (its copy) as transfer time, not the hook's own, inline: on the native
path they run right after kernels, on caches those emptied, where a helper's call costs 3-5 µs. The bookkeeping
stays after the copy: a copy that passes through the dispatch mode (a caller outside its `__torch_dispatch__`) must
find its storage resident, or the check before use fetches it back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from time import perf_counter
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from tensile.plan import Event
from tensile_hook.movers import CpuMover, CudaMover, Mover
from tensile_hook.recipes import DeviceRandom, Recipe, RecipeBook
from tensile_hook.run_state import RunState
from tensile_hook.storages import StorageRegistry, StorageSlot
from tensile_hook.storages import tensors_in as _tensors

log = logging.getLogger("tensile.hook")
MIN_EVICT_BYTES = 4096  # smaller storages are not worth a transfer
# nor is an overshoot smaller than that worth an eviction: the forecast a budget comes from can miss a few
# bytes (a CPU forecast leaves out Adam's 4-byte step counters; mlp-wide, admitted at its forecast exactly, ran
# 24 bytes over at one op and evicted a storage every iteration, stalling on it later)
BUDGET_TOLERANCE_BYTES = MIN_EVICT_BYTES
BRING_BACK = ("swap_in", "recompute")  # events that allocate: they fire at the next op's entry


class OpFailed(Exception):
    """The user's op raised: re-raise its error as it is."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class OwnSlots(Protocol):
    """The native iteration's swaps, in slots of their own outside the registry (`native_swaps.NativeSwaps`)."""

    def slots(self) -> list[StorageSlot | None]: ...

    def restore(self) -> None: ...


class Residency:
    """The registry's storages, moved by the plan's events, the check before use and the budget guard."""

    def __init__(self, state: RunState, own: OwnSlots, on_free: Callable[[int], None]) -> None:
        self.state = state
        self.own = own
        self.on_free = on_free  # told when a storage dies (the recording iteration forgets it)
        self.registry = StorageRegistry(on_free=self._storage_freed)
        self.mover: Mover = CudaMover(state.device) if state.device_type == "cuda" else CpuMover()
        self.registry.release_host = self.mover.release_host
        self.random = DeviceRandom(state.device)
        self.recipes = RecipeBook(self.random)  # this iteration's, by id(storage)
        # swap-ins and recomputes triggered by op k, fired at op k + 1's entry: the forecast (peak.absent_ranges)
        # allocates them after op k's inputs that nothing reads later are freed; fired right after op k,
        # while those inputs were still alive, a plan carried out exactly measured above its forecast
        self.deferred: list[Event] = []
        self.tracked_peak = 0  # on CUDA, the tracked storages' peak in this iteration (`Iterations` measures with it)

    def _storage_freed(self, key: int) -> None:
        self.recipes.pop(key)
        self.on_free(key)

    def begin_iteration(self) -> None:
        """The last iteration's recipes go (their inputs with them), and the tracked peak starts from what is left."""
        self.recipes.clear()
        self.tracked_peak = self.registry.device_bytes

    def end_iteration(self) -> None:
        """What the iteration's last op triggered fires now, and every transfer settles."""
        if self.deferred and not self.state.disabled:
            with _disable_current_modes():  # also called from a module hook, where the mode may be on the stack
                self.apply_deferred()
        self.mover.settle()

    # -- check before use ---------------------------------------------------------------------
    def ensure_resident(self, leaves: list[Any]) -> list[int]:
        """The leaves on the device resident; their storages' keys, for a caller that looks for them elsewhere too."""
        device_type = self.state.device_type
        keys = [id(v.untyped_storage()) for v in leaves if v.device.type == device_type]
        self.ensure_keys_resident(keys)
        return keys

    def ensure_keys_resident(self, keys: list[int]) -> None:
        slots = self.registry.slots
        for key in keys:
            slot = slots.get(key)
            if slot is not None:
                try:
                    self.ensure_slot_resident(slot)
                except torch.OutOfMemoryError:  # no room to bring it back: make some, as `run_op` does for an op
                    self.state.say("out of memory bringing a tensor back: evicting passively and retrying")
                    self.state.stats.out_of_memory_retries += 1
                    self.evict(slot.nbytes, protected=set(keys))
                    self.ensure_slot_resident(slot)
                self.registry.touch(slot)

    def ensure_slot_resident(self, slot: StorageSlot) -> None:
        """Check before use (the paper's Executor): a missing input is fetched now, as a stall."""
        if not slot.resident:
            started = time.perf_counter()
            self.fetch(slot)
            self.state.stats.stall_seconds += time.perf_counter() - started
        if slot.pending is not None:  # on CUDA: the op waits for the copy, on the stream, not the host
            self.mover.wait(slot)

    def run_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run the op; on CUDA an out-of-memory error evicts passively (never the op's own inputs, which
        the retry reads) and retries.

        The op's own errors are the user's: they pass through untouched (`OpFailed`), not as a hook failure."""
        for attempt in range(3):
            try:
                return func(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                if attempt == 2:
                    raise OpFailed(exc) from None
                self.state.say("out of memory: evicting passively and retrying the op")
                self.state.stats.out_of_memory_retries += 1
                own = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
                self.evict(self.registry.device_bytes // 2, protected=own)
            except Exception as exc:
                raise OpFailed(exc) from None
        raise AssertionError("unreachable")

    # -- events -------------------------------------------------------------------------------
    def fire(self, events: list[Event]) -> None:
        """Events an op triggers: those that bring a tensor back at the next op's entry, the others now."""
        for event in events:
            if event.kind in BRING_BACK:
                self.deferred.append(event)
            else:
                self.apply(event)

    def apply_deferred(self) -> None:
        deferred, self.deferred = self.deferred, []
        for event in deferred:
            self.apply(event)

    def recompute_before_write(self, written: list[int]) -> None:
        """A released tensor whose input is about to change in place is regenerated first."""
        for key in written:
            for dependent in self.recipes.readers_of(key):
                slot = self.registry.slots.get(dependent)
                if slot is not None and slot.recipe is not None and dependent != key:
                    self.fetch(slot)

    def apply(self, event: Event) -> None:
        """Fire one event. A release without a recipe keeps a host copy: if the plan is wrong and
        the tensor is read again, it comes back instead of being lost."""
        state = self.state
        active = state.active  # releases fire inline, under the plan (deferred events bring back)
        if (event.kind == "release" and active is not None and event.tensor in active.freed_soon
                and event.tensor not in active.recompute):
            return
        key = state.keys.get(event.tensor)
        slot = self.registry.slots.get(key) if key is not None else None
        if slot is None:
            return  # already freed by PyTorch, or never seen: nothing to do
        if event.kind in ("swap_out", "release"):
            if not slot.resident or slot.nbytes == 0 or slot.pinned:
                return
            recipe = self.recipes.get(slot.key) if event.kind == "release" else None
            if recipe is not None:
                storage = slot.storage()
                if storage is None:
                    return
                storage.resize_(0)
                slot.recipe = recipe
                self.registry.mark_absent(slot)
            elif not self.swap_out(slot):
                return
        elif not slot.resident:  # swap_in or recompute: bring it back ahead of its use
            self.fetch(slot)
        else:
            return
        state.stats.events[event.kind] += 1

    def swap_out(self, slot: StorageSlot) -> bool:
        storage = slot.ref()
        if storage is None or slot.pinned:
            return False
        stats = self.state.stats
        started = perf_counter()
        try:
            try:
                self.mover.swap_out(slot, storage)
            finally:
                spent = perf_counter() - started
                stats.transfer_seconds += spent
                stats.hook_seconds -= spent
        except RuntimeError:  # e.g. a storage that is not resizable (from numpy): leave it alone
            self.mover.drop_host(slot)
            slot.pinned = True
            return False
        self.registry.mark_absent(slot)  # a native swap's own slot is swapped out by its carrier (`SwapCarrier._act`)
        stats.swap_out_bytes += slot.nbytes
        return True

    def fetch(self, slot: StorageSlot) -> None:
        storage = slot.ref()
        if storage is None:  # died while away: nothing comes back, its host buffer goes (back to the pool on CUDA)
            self.mover.drop_host(slot)
            slot.recipe = None  # nor do its recipe's inputs stay referenced
            return
        if slot.recipe is not None:
            self._recompute(slot, storage)
        else:
            stats = self.state.stats
            started = perf_counter()
            try:
                self.mover.swap_in(slot, storage)
            finally:
                spent = perf_counter() - started
                stats.transfer_seconds += spent
                stats.hook_seconds -= spent
            stats.swap_in_bytes += slot.nbytes
        slot.passive = False
        if slot.counted:
            self.registry.mark_resident(slot)
        else:
            slot.resident = True

    def _recompute(self, slot: StorageSlot, storage: torch.UntypedStorage) -> None:
        """Replay the recipe with the random states it first ran with: dropout draws the same numbers."""
        recipe: Recipe = slot.recipe
        inputs = recipe.inputs(own_key=slot.key)
        keys = self.ensure_resident(inputs)
        if own := self.own.slots():  # a native iteration's, outside the registry: its inputs among them come back
            for swapped in own:
                if swapped is not None and swapped.key in keys:
                    self.ensure_slot_resident(swapped)
        stats = self.state.stats
        # the replay's ops are the recompute's cost, not the hook's logic: timed apart, as copies are
        started = perf_counter()
        try:
            result = _tensors(recipe.producer.replay(self.random))[recipe.position]
            for step in recipe.then:
                step.replay(self.random, slot.key, result)
            storage.resize_(slot.nbytes)
            storage.copy_(result.untyped_storage())
        finally:
            spent = perf_counter() - started
            stats.recompute_seconds += spent
            stats.hook_seconds -= spent
        slot.recipe = None
        self.recipes.pop(slot.key)  # its inputs need not outlive this
        stats.recompute_bytes += slot.nbytes

    # -- budget guard -------------------------------------------------------------------------
    def after_accounting(self, protected: set[int]) -> None:
        """After an op: over the budget, the least recently used storages but the op's own go; and the peak."""
        state = self.state
        registry = self.registry
        if state.budget is not None and registry.device_bytes > state.budget + BUDGET_TOLERANCE_BYTES:
            self.evict(registry.device_bytes - state.budget, protected)
        device_bytes = registry.device_bytes
        if state.device_type == "cuda":  # the allocator measures the peak; this one tells its workspaces apart
            if device_bytes > self.tracked_peak:
                self.tracked_peak = device_bytes
        elif device_bytes > state.stats.peak_bytes:
            state.stats.peak_bytes = device_bytes

    def evict(self, need: int, protected: set[int]) -> None:
        """Capuchin's passive mode: swap out the least recently used tensors until `need` bytes are free."""
        freed = 0
        for key in list(self.registry.lru):
            if freed >= need:
                break
            slot = self.registry.slots.get(key)
            if slot is None or key in protected or slot.nbytes < MIN_EVICT_BYTES or slot.pinned:
                continue
            if self.swap_out(slot):
                slot.passive = True
                freed += slot.nbytes
                self.state.stats.passive_evictions += 1

    # -- everything back ----------------------------------------------------------------------
    def settle(self) -> None:
        """The compute stream waits for every transfer queued so far (nothing to wait for on the CPU)."""
        self.mover.settle()

    def restore_absent(self) -> None:
        """Every absent storage back: the native iteration's own slots, then the registry's."""
        self.own.restore()
        with _disable_current_modes():
            for slot in self.registry.absent():
                self.fetch(slot)
        self.mover.settle()

    def restore_all(self) -> None:
        """Before anything reads storages outside the dispatcher (state_dict, torch.save); called
        outside the hook's timed sections, so timed here."""
        started = time.perf_counter()
        self.restore_absent()
        self.state.stats.hook_seconds += time.perf_counter() - started

    def restore_each(self) -> None:
        """The hook stands down: nothing deferred fires, and every absent storage of the registry comes back, each
        tried (one that cannot does not keep the others away)."""
        self.deferred = []
        with _disable_current_modes():
            for slot in self.registry.absent():
                try:
                    self.fetch(slot)
                except Exception:  # noqa: BLE001 - keep restoring the others
                    log.exception("tensile: could not restore a tensor")
        self.mover.settle()

    def bring_back(self, storage: torch.UntypedStorage, pin: bool) -> None:
        """A storage about to be read outside the dispatcher: back now; pinned when it stays read so (shared
        with another process, aliased by a numpy array): a resize would free what the other side reads."""
        started = time.perf_counter()
        key = id(storage)
        if any(slot is not None and slot.key == key for slot in self.own.slots()):
            self.own.restore()  # a native iteration's own swap: back with the others, as at a divergence
        slot = self.registry.slots.get(key)
        if slot is not None:
            if not slot.resident:
                with _disable_current_modes():
                    self.fetch(slot)
                self.mover.settle()
            slot.pinned = slot.pinned or pin
        self.state.stats.hook_seconds += time.perf_counter() - started
