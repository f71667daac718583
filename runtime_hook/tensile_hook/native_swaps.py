"""Activation swaps on the native path: module hooks and autograd node pre-hooks, no op in Python.

`native_align.py` learns, in a dispatch-path iteration under the plan, where each swap goes.
In native iterations (`SwapCarrier`) a global module forward pre-hook counts the module calls and
compares each with the learnt one (and a global forward hook the exits of the modules whose exits
act); at the learnt boundaries the tensors are taken and
swapped out (the storage resized to 0, as on the dispatch path), and the nodes, found by walking
`next_functions` from the boundary's root, get pre-hooks: the swap-in node fetches the tensor (the
prefetch), every reading node fetches it if it is still absent (check before use, a stall). A
native iteration that leaves the learnt boundaries (another module, another number of autograd
nodes between two anchored boundaries, another size, a node not found) brings every tensor back
at once and runs the rest without events; the next iteration aligns again on the dispatch path.
At each top-level module exit before backward, a tensor taken with more references than there in the
aligned iteration and the native ones before (the script keeps it in some steps only) comes back for that
iteration. `swap_stages.py` puts the learner and the carrier on and takes them off.
"""

from __future__ import annotations

import weakref
from functools import partial
from time import perf_counter
from typing import Any

import torch
from torch.nn.modules.module import (
    _global_forward_hooks,
    _global_forward_pre_hooks,
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils._python_dispatch import _disable_current_modes

from tensile_hook.native_align import (
    Action,
    Alignment,
    NodeHook,
    foreign_global_hooks,
    nodes_behind,
    reference_count,
    user_forward_hooks,
)
from tensile_hook.native_host import NativeHost
from tensile_hook.native_recipes import NativeRecipe
from tensile_hook.saved_tensors import saved_tensor
from tensile_hook.storages import StorageSlot, Tensor

# one name each on the hot paths, not two or three attribute lookups
_current_node = torch._C._current_autograd_node
_weak = weakref.ref


class _Diverged(Exception):
    """The native iteration left the learnt boundaries."""


# one found node hook: the next_functions index path from its root to the node, the hook, and the 0-element tensor
# whose backward-hook dict the node takes (None for a hook that only takes a saved tensor)
HookPath = tuple[tuple[int, ...], NodeHook, torch.Tensor | None]
FoundHook = tuple[Any, NodeHook, torch.Tensor | None]  # the node itself in the path's place


def _follow(root: Any, sequence: int, paths: list[HookPath]) -> list[FoundHook] | None:
    """The nodes at the ends of the paths, or None where one no longer leads to a node of its hook's
    sequence number (another graph: the caller walks). The root itself (the empty path) is its own."""
    nodes = []
    for path, hook, holder in paths:
        node = root
        for position in path:
            functions = node.next_functions
            if position >= len(functions) or (node := functions[position][0]) is None:
                return None
        if path and node._sequence_nr() - sequence != hook.delta:
            return None
        nodes.append((node, hook, holder))
    return nodes


class SwapCarrier:
    """Carries the aligned swaps in native iterations: global module hooks while installed. One idea, long: its hot
    paths (`_boundary`, `_act`, `_node_pre`) run right after kernels, where each helper's call costs 3-5 µs, so they
    keep their steps inline rather than in smaller collaborators."""

    def __init__(self, host: NativeHost, alignment: Alignment) -> None:
        self.host = host
        self.state = host.state
        self.residency = residency = host.residency
        self.expected = alignment.expected
        # per boundary index: its action or None, a list (indexing beats a dict lookup in the hot hook)
        self.actions: list[Action | None] = [alignment.actions.get(i) for i in range(len(alignment.expected))]
        hook_lists = [hooks for action in alignment.actions.values() for hooks in (action.hooks, action.deferred) if hooks]
        # per list of node hooks (an acting boundary's own or its deferred ones), keyed by id(list):
        # the hooks by sequence number relative to the root, and the lowest
        self.node_hooks = {id(hooks): ({hook.delta: hook for hook in hooks}, min(h.delta for h in hooks))
                           for hooks in hook_lists}
        # roots whose deferred node hooks wait for the next flush: (root, sequence number, id(hooks))
        self.pending: list[tuple[Any, int, int]] = []
        # per node hook that fetches or checks, for the carrier's life: a 0-element tensor whose backward-hook dict
        # holds the hook's callback, attached to each iteration's node in C++ (`_register_hook_dict`: 0.4 µs warm,
        # where `register_prehook` makes an OrderedDict and a RemovableHandle in Python, 2.4 µs, 4.5 µs at the
        # flush); none for one that only takes a saved tensor (max pooling's indices): its readers' hooks check it
        self.callbacks: dict[int, torch.Tensor] = {}
        with _disable_current_modes():  # made at a step: not an op of the next iteration
            for hooks in hook_lists:
                for hook in hooks:
                    if hook.fetch or hook.check:
                        holder = self.callbacks[id(hook)] = torch.empty(0)
                        holder._backward_hooks = {0: partial(self._node_pre, hook)}
        # per list of node hooks: the next_functions index paths from its root to its nodes, as the learning
        # iteration's walks found them; native iterations follow them (a few steps, not a walk) while they hold
        self.paths: dict[int, list[HookPath]] = {
            id(hooks): [(hook.path, hook, self.callbacks.get(id(hook))) for hook in hooks] for hooks in hook_lists}
        self.registry_slots = residency.registry.slots
        self.swaps = alignment.swaps
        # per swap: how it is recomputed where it is a release and a recompute (no copies), and this iteration's
        # autograd node of its tensor, taken with it: the recipe's inputs are read behind it at the release
        self.recipes: list[NativeRecipe | None] = [alignment.recipes.get(swap) for swap in range(alignment.swaps)]
        self.nodes: list[Any] = [None] * alignment.swaps
        self.unbound: set[int] = set()  # recomputed swaps whose inputs could not be read at a release: named once
        self.exits = alignment.exits
        self.hooked = alignment.hooked
        self.global_hooks = alignment.global_hooks
        # the global hooks' handle ids when they last counted as learnt: while unchanged they are not counted again
        self.seen_hooks: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.handles: list[Any] = []
        self.live = False  # carrying the current iteration
        self.diverged = False
        self.index = 0
        # this iteration's time at boundaries and node hooks and its swaps, kept on the carrier, which the hooks read
        # anyway (the iteration's figures are two objects further, each a cache miss after a kernel): `_settle_figures`
        self.seconds = 0.0
        self.swapped_out = self.swapped_in = self.released = self.recomputed = 0
        # the mover's calls on the swaps' own slots (`_act`, `_node_pre`): transfer time, not the hook's, and bytes
        self.moving = 0.0
        self.out_bytes = self.in_bytes = 0
        self.mover = residency.mover
        # this iteration's slots by swap: one list, emptied in place, that the callbacks read (a node
        # of an older graph run late finds this iteration's slots: at worst it fetches one early)
        self.slots: list[StorageSlot | None] = [None] * self.swaps
        self.own: list[StorageSlot | None] = [None] * self.swaps  # each swap's own slot, reused by its takes (`_act`)
        self.last_root: int | None = None
        # this iteration's tensors taken at module calls, held until backward starts, so that the references
        # to them can be counted at each top-level exit; by (exit, swap), the fewest counted there in the
        # aligned iteration or a native one that kept to it, and this iteration's counts where new or fewer (in
        # most iterations none: an equal count changes nothing), merged at its end if it kept to them (one of
        # another kind, a GAN's other step, may reach an exit before it leaves the calls); the swaps left on the
        # device this iteration; those the report has named
        self.taken: list[tuple[torch.Tensor, int] | None] = [None] * self.swaps  # with its storage's handle
        self.fewest: dict[tuple[int, int], int] = dict(alignment.references)
        self.counted: dict[tuple[int, int], int] = {}
        self.kept: set[int] = set()
        self.named: set[int] = set()

    def install(self) -> None:
        if not self.handles:
            # global hooks, not hooks on the user's modules: a model deep-copied or pickled between
            # iterations (an EMA copy, torch.save(model)) must not carry the hook's objects along
            self.handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.live = False

    def begin(self) -> None:
        """The iteration starts: nothing of the last one is left (`end` forgot it; a new carrier has none)."""
        self.live, self.diverged, self.index, self.last_root = True, False, 0, None
        seen = (tuple(_global_forward_pre_hooks), tuple(_global_forward_hooks))
        if seen == self.seen_hooks:
            return
        if foreign_global_hooks() != self.global_hooks:
            self._abort("a global module forward hook was added or removed since they were learnt")
        else:
            self.seen_hooks = seen

    def end(self) -> bool:
        """At the step: anything still absent comes back. True when the iteration left the boundaries."""
        if self.live and self.index != len(self.expected):
            self._abort(f"{self.index} module call boundaries, {len(self.expected)} learnt")
        self.live = False
        self.restore()
        if not self.diverged:
            self._settle_counts()
        self._forget()
        self._settle_figures()
        return self.diverged

    def _settle_figures(self) -> None:
        """The iteration's time at boundaries and node hooks, its swaps, and the mover's time and bytes on the swaps'
        own slots join its figures, once, at its end: boundaries act only while it is carried, and node hooks swap
        only the slots it has until `end` forgets them (one of an older graph run late counts in the iteration whose
        slots it finds, as before)."""
        stats = self.state.stats
        stats.hook_seconds += self.seconds - self.moving
        stats.transfer_seconds += self.moving
        stats.swap_out_bytes += self.out_bytes
        stats.swap_in_bytes += self.in_bytes
        events = stats.events
        events["swap_out"] += self.swapped_out
        events["swap_in"] += self.swapped_in
        if self.released or self.recomputed:
            events["release"] += self.released
            events["recompute"] += self.recomputed
        self.seconds, self.swapped_out, self.swapped_in, self.released, self.recomputed = 0.0, 0, 0, 0, 0
        self.moving, self.out_bytes, self.in_bytes = 0.0, 0, 0

    def _settle_counts(self) -> None:
        """The iteration kept to the learnt calls: its counts join the fewest, and the swaps it kept on the
        device because the script held more references are named, once each."""
        self.fewest.update(self.counted)  # each new or fewer than the fewest (`_recount`)
        if not self.kept:  # as most iterations: no set made, nothing sorted
            return
        for swap in sorted(self.kept - self.named):
            self.named.add(swap)
            self.state.say(f"native swap {swap}: the script holds a reference to its tensor that earlier iterations "
                           "did not (set in some steps only): it stays on the device in the iterations that hold it")

    def _forget(self) -> None:
        """Nothing of an iteration is carried into the next (its containers emptied in place, not made anew)."""
        self.slots[:] = [None] * self.swaps
        self.nodes[:] = [None] * self.swaps
        self._let_go()
        self.pending.clear()
        self.kept.clear()
        self.counted.clear()

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        state = self.state
        if state.step_done and state.next_path == "native":
            self.host.start_at_module(module, args)  # the iteration starts here, whichever global hook runs first
        if self.live:
            self._boundary(id(module) * 2 + 1, args, module)

    def _post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if self.live and id(module) in self.exits:
            self._boundary(id(module) * 2, (args, out))

    def _boundary(self, code: int, values: Any, entered: torch.nn.Module | None = None) -> None:
        """Every module call's entry (`entered`: the module) and the learnt modules' exits: kept lean, it
        runs ~200 times an iteration on ResNet-50, often with caches a large kernel has just emptied."""
        state = self.state
        if state.in_step or _current_node() is not None:
            return
        started = perf_counter()
        index = self.index
        self.index = index + 1
        try:
            expected = self.expected
            if index >= len(expected) or expected[index] != code:
                raise _Diverged(f"module call boundary {index} is not the learnt one")
            if entered is not None and (entered._forward_pre_hooks or entered._forward_hooks) \
                    and user_forward_hooks(entered) != self.hooked.get(code):  # it may keep what the plan swaps
                raise _Diverged(f"a forward hook was added to a {type(entered).__name__} since they were learnt")
            action = self.actions[index]
            if action is not None:
                if state.in_mode:  # an observed native iteration: its copies must not pass through the mode
                    with _disable_current_modes():
                        self._act(action, values)
                else:
                    self._act(action, values)
        except _Diverged as diverged:
            self._abort(str(diverged))
        except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
            self.live = False
            self.host.stand_down(exc)
        self.seconds += perf_counter() - started

    def _act(self, action: Action, values: Any) -> None:
        """Every call runs right after the module's kernels have emptied the caches, where each
        Python step costs ten times its warm figure: it indexes straight to what it takes."""
        slots, taken, own, registry_slots = self.slots, self.taken, self.own, self.registry_slots
        # the index paths' steps inline: the loop's opcodes are the interpreter's own, still cached, where a helper's
        # call costs 3-5 µs and C's `reduce(getitem, path, values)` was stamped at 5 µs a take (the loop: 0.5 µs)
        try:
            for swap, path, nbytes in action.take:
                tensor = values
                for position in path:
                    tensor = tensor[position]
                # no device check here: the mover refuses a storage on another device, which then stays
                if not isinstance(tensor, Tensor) or (storage := tensor.untyped_storage()).nbytes() != nbytes:
                    raise _Diverged(f"the tensor at boundary {self.index - 1} is not the learnt one")
                # the swap's own slot, reset for this take (a new one cost 7 µs after the kernels); a new one where it
                # still holds a host buffer (its storage died away), the registry's where that watches the storage
                if (slot := own[swap]) is None or slot.host is not None or (key := id(storage)) in registry_slots:
                    slot = self._slot(swap, storage, nbytes)
                else:
                    slot.key, slot.ref, slot.nbytes, slot.resident, slot.pending, slot.passive, slot.pinned, slot.recipe = (
                        key, _weak(storage), nbytes, True, None, False, False, None)
                slots[swap] = slot
                taken[swap] = (tensor, storage._cdata)
                if self.recipes[swap] is not None:
                    self.nodes[swap] = tensor.grad_fn
            tensor = storage = None  # type: ignore[assignment]  # not to count as references at a recount below
            rooted = None
            if action.root is not None:
                rooted = values
                for position in action.root:
                    rooted = rooted[position]
        except (LookupError, TypeError):
            raise _Diverged("a module call's values are not laid out as learnt") from None
        if action.root is not None:
            node = getattr(rooted, "grad_fn", None)
            rooted = None  # not to count as a reference at a recount below
            if node is None:
                raise _Diverged(f"no autograd node at boundary {self.index - 1}")
            sequence = node._sequence_nr()
            if action.root_step is not None and self.last_root is not None and sequence - self.last_root != action.root_step:
                raise _Diverged(f"another number of autograd nodes before boundary {self.index - 1}")
            self.last_root = sequence
            if action.hooks:
                self._hook_nodes([(node, sequence, id(action.hooks))])
            if action.deferred:
                self.pending.append((node, sequence, id(action.deferred)))
        if action.recount:
            self._recount(self.index - 1)
            if action.let_go:
                self._let_go()
        kept, recipes = self.kept, self.recipes
        for swap in action.swap_out:
            slot = slots[swap]
            if slot is None:
                raise _Diverged(f"swap {swap} was not taken")
            if not slot.resident or (kept and swap in kept):
                continue
            if (recipe := recipes[swap]) is not None:
                self.released += self._release(swap, slot, recipe)
            elif slot.counted:  # the registry's (an observed native iteration)
                self.swapped_out += self.residency.swap_out(slot)
            elif not slot.pinned and (leaving := slot.ref()) is not None:
                # the swap's own slot: the mover's call here, not through the residency's (a call costs 3-5 µs after the
                # kernels); a storage that is not resizable (from numpy) is refused by the mover and stays, as there
                started = perf_counter()
                try:
                    self.mover.swap_out(slot, leaving)
                    slot.resident = False
                    self.swapped_out += 1
                    self.out_bytes += slot.nbytes
                except RuntimeError:
                    self.mover.drop_host(slot)
                    slot.pinned = True
                self.moving += perf_counter() - started
        if action.flush:
            # every node made so far exists and backward has not started: hooking them in one go here,
            # with the hook's code in the caches, costs a fraction of hooking each at its own boundary
            self._hook_nodes(self.pending)
            self.pending.clear()

    def _release(self, swap: int, slot: StorageSlot, recipe: NativeRecipe) -> bool:
        """A tensor the plan recomputes is freed, its recipe bound to this iteration's inputs first; one whose inputs
        cannot be read as learnt stays on the device, named once."""
        storage = slot.ref()
        if storage is None:
            return False
        bound = recipe.bind(self.nodes[swap], storage)
        if bound is None:
            if swap not in self.unbound:
                self.unbound.add(swap)
                self.state.say(f"native recompute {swap}: an input of its recipe is not what autograd saved there "
                               "when it was learnt (a saved-tensor hook packed it, or the graph differs): it stays on "
                               "the device in such iterations")
            return False
        storage.resize_(0)
        slot.recipe = bound
        if slot.counted:
            self.residency.registry.mark_absent(slot)
        else:
            slot.resident = False
        return True

    def _recount(self, index: int) -> None:
        """A top-level call returned before backward. A taken tensor with more references here than in the
        aligned iteration and every native one before may be read by the script before backward (an
        attribute, a dict entry or an alias of it set in some steps only; held.py saw the aligned
        iteration's): it comes back now, or is not swapped out, in this iteration."""
        fewest, counted = self.fewest, self.counted
        for swap, taken in enumerate(self.taken):
            if taken is None:
                continue
            count, key = reference_count(*taken), (index, swap)
            least = fewest.get(key)
            if least is None or count < least:
                counted[key] = count
            elif count > least and swap not in self.kept:
                self.kept.add(swap)
                slot = self.slots[swap]
                if slot is not None and not slot.resident:
                    recomputing = slot.recipe is not None
                    self.residency.fetch(slot)
                    if recomputing:
                        self.recomputed += 1
                    else:
                        self.swapped_in += 1

    def _let_go(self) -> None:
        """Backward starts (or the iteration ends early): the graph alone decides how long the tensors live."""
        self.taken[:] = [None] * self.swaps

    def _slot(self, swap: int, storage: torch.UntypedStorage, nbytes: int) -> StorageSlot:
        """The registry's slot when it watches the storage (an observed native iteration counts its bytes), else a new
        one of the swap's own: no registry entry, no callback when its storage dies (`_act` resets it for later takes)."""
        slot = self.registry_slots.get(id(storage))
        if slot is None:
            slot = self.own[swap] = StorageSlot(id(storage), _weak(storage), nbytes, counted=False)
        return slot

    def _hook_nodes(self, roots: list[tuple[Any, int, int]]) -> None:
        """Pre-hook the nodes behind each root (root, its sequence number, id of its list of node hooks): along
        the paths learnt (or last walked) when they still lead to nodes of the learnt sequence numbers (relative
        to the root), else by one walk shared by that root's hooks. One call for all of a flush's roots: a call a
        root cost ~6 µs after the model's kernels."""
        known, slots = self.paths, self.slots
        for root, sequence, key in roots:
            nodes = _follow(root, sequence, known[key])
            if nodes is None:
                nodes, known[key] = self._walk(root, sequence, *self.node_hooks[key])
            for node, hook, holder in nodes:
                for swap, name, nbytes in hook.take:
                    saved = saved_tensor(node, name)
                    if saved is None or (storage := saved.untyped_storage()).nbytes() != nbytes:
                        raise _Diverged(f"the tensor {name} saved at boundary {self.index - 1} is not the learnt one")
                    slots[swap] = self._slot(swap, storage, nbytes)
                if holder is not None:
                    node._register_hook_dict(holder)

    def _walk(self, root: Any, sequence: int, wanted: dict[int, NodeHook],
              low_delta: int) -> tuple[list[FoundHook], list[HookPath]]:
        """One walk back from the root to all the wanted nodes (by sequence number relative to the
        root, built at learning time): the nodes, and the index paths that lead to them."""
        nodes, paths = [], []
        for node, number, path in nodes_behind(root, sequence + low_delta):
            hook = wanted.get(number - sequence)
            if hook is not None:
                holder = self.callbacks.get(id(hook))
                nodes.append((node, hook, holder))
                paths.append((path, hook, holder))
                if len(nodes) == len(wanted):
                    break
        if len(nodes) < len(wanted):
            raise _Diverged(f"{len(wanted) - len(nodes)} autograd nodes not found from boundary {self.index - 1}")
        return nodes, paths

    def _node_pre(self, hook: NodeHook, _grad: Any, outside: bool = False) -> None:
        """Before a node runs in backward: the swap-ins planned before it (the prefetch), then check before use:
        a tensor it reads that is still absent comes back now, as a stall; on CUDA an in-flight one is waited
        for. Inline: it runs right after a backward kernel, where each helper's call costs 3-5 µs."""
        residency = self.residency
        if self.state.in_mode and not outside:  # an observed native iteration: its copies must not pass the mode
            with _disable_current_modes():
                return self._node_pre(hook, _grad, True)
        started = perf_counter()
        slots = self.slots
        try:
            for swap in hook.fetch:
                slot = slots[swap]
                if slot is None or slot.resident:
                    continue
                if not slot.counted and slot.recipe is None and (storage := slot.ref()) is not None:
                    # the swap's own slot back by the mover's call here, as in `_act`
                    begun = perf_counter()
                    self.mover.swap_in(slot, storage)
                    self.moving += perf_counter() - begun
                    slot.resident = True
                    self.in_bytes += slot.nbytes
                    self.swapped_in += 1
                    continue
                recomputing = slot.recipe is not None  # a release's recipe, or a swap's host copy
                residency.fetch(slot)
                if recomputing:
                    self.recomputed += 1
                else:
                    self.swapped_in += 1
            for swap in hook.check:  # mostly back already: the call only when there is something to do
                slot = slots[swap]
                if slot is not None and (not slot.resident or slot.pending is not None):
                    residency.ensure_slot_resident(slot)
        except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
            self.host.stand_down(exc)
            if any((slot := slots[swap]) is not None and not slot.resident for swap in hook.check):
                raise exc  # a tensor the node reads could not come back (out of memory): never run on 0 bytes
        finally:
            self.seconds += perf_counter() - started  # the iteration's figures at its end, as the boundaries'
        return None

    def restore(self) -> None:
        """Every tensor this iteration swapped out back now (its copies are transfer time). On CUDA the
        compute stream then waits for the copies: after a divergence the rest of the iteration reads
        them with no node hook left to wait for each."""
        absent = [slot for slot in self.slots if slot is not None and not slot.resident]
        if not absent:
            return
        failed = None
        with _disable_current_modes():
            for slot in absent:
                try:
                    self.residency.fetch(slot)
                except Exception as exc:  # noqa: BLE001 - bring the others back, then say
                    failed = failed or exc
            self.mover.settle()
        if failed is not None:
            raise failed

    def halt(self) -> None:
        """Nothing more is carried in this iteration, and every tensor it swapped out comes back now."""
        self.live = False
        self.pending = []
        self._let_go()
        self.restore()

    def _abort(self, reason: str) -> None:
        """Every tensor back now; the rest of the iteration runs without events."""
        self.diverged = True
        self.halt()
        state = self.state
        state.stats.mode = "diverged"
        state.say(f"the native iteration left the learnt module calls ({reason}): every tensor is back, "
                  "the rest of it runs without events and the plan is aligned again on the dispatch path")
