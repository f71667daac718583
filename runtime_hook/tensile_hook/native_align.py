"""Aligning a plan's activation swaps with module calls and autograd nodes, in one dispatch-path
iteration under the plan, for the native path (`native_swaps.py` carries them).

Every module call's entry and exit is a *boundary*, numbered in call order (a ReLU module called
three times is three calls). Each swapped plan tensor (bound to its storage by the executor in that
iteration) is found among a boundary's inputs or outputs, or else among the tensors an autograd
node saved (`_raw_saved_*`, read without unpacking it; such as max pooling's indices, which no module returns); its swap-out moves
to the first boundary after the plan's trigger and its last forward use (later is always safe); the
autograd nodes that read it in backward (and those that saved it but never ran in that backward), and
the one whose ops follow the plan's swap-in trigger,
are known by their sequence numbers relative to the newest node at the first boundary after they
are made (a *root*). A tensor that cannot be aligned is named, with why.
"""

from __future__ import annotations

import sys
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.module import (
    _global_forward_hooks,
    _global_forward_pre_hooks,
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from tensile.plan import Event
from tensile_hook.active_plan import ActivePlan
from tensile_hook.held import held_storages
from tensile_hook.native_host import NativeHost
from tensile_hook.native_recipes import NativeRecipe, learn
from tensile_hook.run_state import RunState
from tensile_hook.saved_tensors import saved_storages
from tensile_hook.storages import tensor_paths

MAX_WALK = 4096  # autograd nodes visited from one root: a bound that a model keeping to the plan never reaches


def sequence_number(node: Any) -> int | None:
    """The autograd node's sequence number; None for the node of a Python autograd Function (DDP's output, a custom
    Function) whose graph a backward has freed: PyTorch 2.11 then refuses it every attribute (a RuntimeError that
    calls it "a legacy access pattern"), where 2.13 still answers. Such a node ran: it reads nothing any more."""
    try:
        return node._sequence_nr()
    except RuntimeError:
        return None


def nodes_behind(root: Any, low: int) -> Iterator[tuple[Any, int, tuple[int, ...]]]:
    """The autograd nodes behind `root` (through `next_functions`, the root first) whose sequence numbers
    run from `low` up to the root's, each once with its number and the index path that reaches it, at most
    MAX_WALK; none from a root whose graph is gone (`sequence_number`)."""
    sequence = sequence_number(root)
    if sequence is None:
        return
    stack: list[tuple[Any, int, tuple[int, ...]]] = [(root, sequence, ())]
    seen = {sequence}
    while stack and len(seen) < MAX_WALK:
        node, number, path = stack.pop()
        yield node, number, path
        for position, (following, _) in enumerate(node.next_functions):
            if (following is not None and (behind := sequence_number(following)) is not None
                    and low <= behind <= sequence and behind not in seen):
                seen.add(behind)
                stack.append((following, behind, (*path, position)))


def user_forward_hooks(module: torch.nn.Module) -> int:
    """The forward (pre-)hooks on the module: the user's (the hook's own are global), each may keep what it sees."""
    return len(module._forward_pre_hooks) + len(module._forward_hooks)


OWN_PACKAGE = __name__.partition(".")[0]  # tensile_hook: the package whose bound methods are the hook's own hooks


def foreign_global_hooks() -> int:
    """Global module forward (pre-)hooks that are not the hook's own: each sees every module call."""
    return sum(type(getattr(hook, "__self__", None)).__module__.partition(".")[0] != OWN_PACKAGE
               for hooks in (_global_forward_pre_hooks, _global_forward_hooks) for hook in hooks.values())


@dataclass
class Boundary:
    """A module call's entry (`pre`) or exit in the learning iteration."""

    pre: bool
    module: int  # id(module): modules live across iterations
    op: int  # ops run before it in the iteration
    keys: list[int]  # id(storage) of its tensors (an exit: the call's inputs, then outputs), by position
    nbytes: list[int]  # their storages' full sizes (a storage the plan swapped out reads 0 bytes)
    paths: list[tuple[Any, ...]]  # their index paths into the hook's values (args, or (args, output))
    root: tuple[int, int] | None  # (position, sequence number) of its tensors' newest autograd node
    root_node: Any = None  # that node, for the walks that check an anchor reaches a node (learning only)
    alive: list[weakref.ref[torch.Tensor]] = field(default_factory=list)  # weak references to its tensors, by position


def reference_count(tensor: torch.Tensor, handle: int) -> int:
    """What the script could reach the tensor by: Python references to it (an attribute set to it) and
    tensors on its storage (`handle`: `untyped_storage()._cdata`; an alias kept). The aligned iteration and
    the native ones count it from frames alike (one reference of the caller's own), so the counts compare."""
    return sys.getrefcount(tensor) + torch._C._storage_Use_Count(handle)


@dataclass(slots=True)  # slots: read in node hooks right after backward kernels, where each dict lookup misses the caches
class NodeHook:
    """A node to pre-hook, by its sequence number relative to its boundary's root."""

    delta: int
    path: tuple[int, ...] = ()  # the next_functions index path from the root to it in the learning iteration
    take: list[tuple[int, str, int]] = field(default_factory=list)  # (swap, `_raw_saved_` attribute, nbytes): taken when found
    fetch: list[int] = field(default_factory=list)  # swaps whose (planned) swap-in runs before this node
    check: list[int] = field(default_factory=list)  # swaps it reads: fetched if still absent (a stall)


@dataclass(slots=True)  # slots: read at acting boundaries right after forward kernels (as NodeHook)
class Action:
    """What a native iteration does at one boundary, in this order."""

    take: list[tuple[int, tuple[Any, ...], int]] = field(default_factory=list)  # (swap, index path, nbytes)
    root: tuple[Any, ...] | None = None  # index path of the tensor whose grad_fn anchors the node hooks
    root_step: int | None = None  # its sequence number minus the previous anchoring boundary's
    hooks: list[NodeHook] = field(default_factory=list)  # pre-hooked here
    deferred: list[NodeHook] = field(default_factory=list)  # found from this root, pre-hooked at the next flush
    swap_out: list[int] = field(default_factory=list)
    flush: bool = False  # a top-level call's exit before backward: the deferred node hooks are registered
    recount: bool = False  # a top-level call's exit before backward: the taken tensors' references are counted
    let_go: bool = False  # and backward starts before the next one: the taken tensors are let go


@dataclass
class Alignment:
    """The plan's swaps on module boundaries and autograd nodes, as learnt."""

    # every module call's entry and the exits of `exits`, in order, each as id(module) * 2 + (1 at
    # the entry, 0 at the exit): one int is cheap to compare in the native iteration's hooks
    expected: list[int]
    actions: dict[int, Action]  # index in `expected` -> what to do there
    swaps: int
    exits: set[int]  # id(module) of the modules whose exits act: the others' exits are not boundaries
    # the user's forward (pre-)hooks seen: per entry code (as in `expected`) of a module that had any, how
    # many; and the global ones. A hook added since may keep a tensor that the native path would swap out
    hooked: dict[int, int] = field(default_factory=dict)
    global_hooks: int = 0
    # per (top-level exit before backward, swap taken at a module call): the references to its tensor
    # there (Python's and the tensors' on its storage), the first counts a native iteration compares with
    references: dict[tuple[int, int], int] = field(default_factory=dict)
    recipes: dict[int, NativeRecipe] = field(default_factory=dict)  # swap -> how it is recomputed (a release, no copy)


def in_forward(state: RunState) -> bool:
    """Module calls count as boundaries outside backward (checkpointing replays them) and the optimizer."""
    return state.in_step == 0 and torch._C._current_autograd_node() is None


class SwapLearner:
    """Watches one dispatch-path iteration: its module boundaries and every backward op's node."""

    def __init__(self, host: NativeHost) -> None:
        self.host = host
        self.state = host.state
        self.iteration = self.state.iteration + 1
        self.started = False
        self.boundaries: list[Boundary] = []
        self.nodes: dict[int, int] = {}  # backward op index -> sequence number of the node running it
        self.saved: dict[int, tuple[int, str, int]] = {}  # plan tensor -> (node, saved attribute, nbytes)
        self.wanted: set[int] | None = None  # the plan tensors the plan swaps
        self.failed: str | None = None  # what went wrong while learning: nothing is aligned then
        # (boundary, node sequence number) -> the index path from its root to the node, None where it is not behind it
        self.reach: dict[tuple[int, int], tuple[int, ...] | None] = {}
        self.user_hooked: set[int] = set()  # id(storage) of what a module's own forward (pre-)hooks saw
        self.unexecuted: dict[int, set[int]] = {}  # id(storage) -> nodes that saved it but did not run (align)
        self.held: set[int] = set()  # id(storage) of the swapped ones the script holds when backward starts
        self.hooked: dict[int, int] = {}  # entry code of a module with forward (pre-)hooks -> how many
        self.global_hooks = 0  # the user's global module forward (pre-)hooks in this iteration
        self.depth = 0  # module calls entered and not returned
        self.references: dict[tuple[int, int, int], int] = {}  # (top-level exit, boundary, position) -> references
        # (boundary, id(storage)) -> the native recipe of a tensor the plan recomputes, as taken there, or why none;
        # and the number of ops in its recipe there (an in-place op after the take would be missing from the first)
        self.recipes: dict[tuple[int, int], NativeRecipe | str] = {}
        self.recipe_ops: dict[tuple[int, int], int] = {}
        self.handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        state = self.state
        if not self.started:  # where a native iteration starts: the first module forward after the step
            self.started = (state.step_done or state.iteration == self.iteration) and torch.is_grad_enabled()
            if self.started:
                self.global_hooks = foreign_global_hooks()
        self._record(True, module, args)

    def _post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        self._record(False, module, (args, out))  # an exit sees the call's inputs and outputs

    def _record(self, pre: bool, module: torch.nn.Module, values: Any) -> None:
        if self.started and self.failed is None and in_forward(self.state):
            try:
                self._boundary(pre, module, values)
                self.depth += 1 if pre else -1
                if self.depth == 0:
                    self._count_references(len(self.boundaries) - 1)
            except Exception as exc:  # noqa: BLE001 - learning must never cost the user their training
                self.failed = f"{type(exc).__name__}: {exc}"

    def _count_references(self, exit: int) -> None:
        """At a top-level exit, what a native iteration's carrier counts there (SwapCarrier._recount), from
        the same frames: each live tensor of the boundaries so far (one reference here, as the carrier's
        tuple holds one), so that the first native iteration has counts to compare with too."""
        for index, boundary in enumerate(self.boundaries):
            for position, alive in enumerate(boundary.alive):
                if (tensor := alive()) is not None:
                    self.references[exit, index, position] = reference_count(tensor, tensor.untyped_storage()._cdata)

    def _boundary(self, pre: bool, module: torch.nn.Module, values: Any) -> None:
        state = self.state
        found = tensor_paths(values)
        tensors = [tensor for _, tensor in found]
        keys = [id(t.untyped_storage()) for t in tensors]
        if pre and (hooks := user_forward_hooks(module)):
            self.hooked[id(module) * 2 + 1] = hooks
        if self.global_hooks or (module._forward_pre_hooks if pre else module._forward_hooks):  # the user's: it may keep what it sees
            self.user_hooked.update(keys)
        slots = self.host.residency.registry.slots
        nbytes = [slots[k].nbytes if k in slots else t.untyped_storage().nbytes() for k, t in zip(keys, tensors)]
        seqs = [(t.grad_fn._sequence_nr(), i) for i, t in enumerate(tensors) if t.grad_fn is not None]
        root = (max(seqs)[1], max(seqs)[0]) if seqs else None
        op = state.op_index if state.iteration == self.iteration else 0
        self._learn_recipes(tensors, keys)
        self.boundaries.append(Boundary(pre, id(module), op, keys, nbytes, [path for path, _ in found], root,
                                        tensors[root[0]].grad_fn if root is not None else None,
                                        [weakref.ref(tensor) for tensor in tensors]))

    def _learn_recipes(self, tensors: list[torch.Tensor], keys: list[int]) -> None:
        """For each tensor of this boundary that the plan recomputes: its recipe with its inputs found behind its
        autograd node as it is here (`native_recipes.py`), for the native iterations that take it here."""
        state, active = self.state, self.state.active
        if active is None or state.iteration != self.iteration:
            return
        native = active.mapped(state.say)
        if native is None or not native.recomputes:
            return
        recomputed = {state.keys[t] for t in native.recomputes if t in state.keys}
        index = len(self.boundaries)
        book = self.host.residency.recipes
        recipes = {key: recipe for key in recomputed if (recipe := book.get(key)) is not None}
        for key, recipe in recipes.items():
            self.recipe_ops[index, key] = 1 + len(recipe.then)
        for tensor, key in zip(tensors, keys):
            if key in recomputed:
                recipe = recipes.get(key)
                self.recipes[index, key] = "no recipe for it at the module call" if recipe is None else \
                    learn(recipe, tensor.grad_fn, key)

    def on_op(self, index: int) -> None:
        """Called by the dispatch path for every op that keeps to the plan."""
        state = self.state
        node = torch._C._current_autograd_node()
        active = state.active  # the plan this op kept to
        if state.iteration != self.iteration or node is None or self.failed is not None or active is None:
            return
        try:
            if self.wanted is None:
                native = active.mapped(state.say)
                self.wanted = {out.tensor for out, _ in native.swaps} if native is not None else set()
            if not self.nodes:  # backward starts: what the script holds now, it may read before backward
                residency = self.host.residency
                slots, keys = residency.registry.slots, state.keys
                self.held = held_storages([storage for tensor in self.wanted
                                           if (slot := slots.get(keys.get(tensor, -1))) is not None
                                           and (storage := slot.storage()) is not None],
                                          residency.recipes.containers())
            self.nodes[index] = sequence = node._sequence_nr()
            for tensor in self.wanted.intersection(active.workload.ops[index].inputs):
                if tensor not in self.saved:  # the plan says this op reads it: it was bound in this iteration
                    self._find_saved(node, sequence, tensor, state.keys[tensor])
        except Exception as exc:  # noqa: BLE001 - learning must never cost the user their training
            self.failed = f"{type(exc).__name__}: {exc}"

    def _find_saved(self, node: Any, sequence: int, tensor: int, key: int) -> None:
        """Which of the node's saved tensors the storage is (autograd keeps many a tensor, such as
        max pooling's indices, that no module returns)."""
        for name, saved in saved_storages(node):
            if saved == key:
                self.saved[tensor] = (sequence, name, self.host.residency.registry.slots[key].nbytes)
                return

    def align(self, plan: ActivePlan, swaps: list[tuple[Event, Event | None]], keys: dict[int, int],
              recomputes: set[int]) -> tuple[Alignment | None, dict[int, str]]:
        """The plan's swaps on this iteration's boundaries and nodes (those that align), and why the
        others cannot be, by plan tensor; no alignment at all when learning failed (`failed` says why).
        A swap of a tensor in `recomputes` is its release (out) and recompute (back), with a native recipe."""
        if self.failed is not None:
            return None, {}
        wanted = {out.tensor for out, _ in swaps}
        accesses: dict[int, list[int]] = defaultdict(list)
        for op in plan.workload.ops:
            for tensor in op.inputs:
                if tensor in wanted:
                    accesses[tensor].append(op.index)
        unmapped: dict[int, str] = {}  # plan tensor -> why its swap does not align
        placed_swaps = []
        native_recipes: dict[int, NativeRecipe] = {}
        self.unexecuted = self._unexecuted_readers({key for out, _ in swaps if (key := keys.get(out.tensor)) is not None})
        for swap, (out, back) in enumerate(swaps):
            placed = self._place(plan, out, back, accesses[out.tensor], keys.get(out.tensor))
            if isinstance(placed, str):
                unmapped[out.tensor] = placed
                continue
            taken, swapped, fetch, checks = placed
            if out.tensor in recomputes:
                key = keys[out.tensor]
                if isinstance(taken[0], str):
                    recipe: NativeRecipe | str | None = "taken from a node that saved it, not at a module call"
                elif self.recipe_ops.get((taken[0], key)) != self.recipe_ops.get((swapped, key)):
                    recipe = "an op wrote it in place after the module call that takes it"
                else:
                    recipe = self.recipes.get((taken[0], key))
                if not isinstance(recipe, NativeRecipe):
                    unmapped[out.tensor] = f"its recompute: {recipe or 'not learnt at the module call that takes it'}"
                    continue
                native_recipes[swap] = recipe
            take_anchor = None
            if isinstance(taken[0], str):  # a saved tensor: taken from its node when the node is found
                take_anchor = self._anchor(taken[1])
                if take_anchor is None:
                    unmapped[out.tensor] = "the node saving it is made after the last module call"
                    continue
                swapped = max(swapped, take_anchor)  # taken before it goes out
            placed_swaps.append((swap, out, taken, take_anchor, swapped, fetch, checks))
        top_exits = self._top_level_exits()
        # boundaries that act anyway: node hooks anchor on them where they can, so fewer boundaries act
        acting = set(top_exits)
        for _, _, taken, take_anchor, swapped, _, _ in placed_swaps:
            acting.update((swapped, taken[0] if take_anchor is None else take_anchor))
        actions: dict[int, Action] = defaultdict(Action)
        eager: dict[int, dict[int, NodeHook]] = defaultdict(dict)  # boundary -> node sequence number -> hook
        deferred: dict[int, dict[int, NodeHook]] = defaultdict(dict)
        for swap, out, taken, take_anchor, swapped, fetch, checks in placed_swaps:
            targets = [(s, "check") for s in checks] + ([(fetch, "fetch")] if fetch is not None else [])
            ordered = sorted(acting)
            anchors = [a if (a := self._anchor(s, ordered)) is not None else self._anchor(s) for s, _ in targets]
            if any(a is None for a, (_, why) in zip(anchors, targets) if why != "fetch"):
                unmapped[out.tensor] = "a node reading it is made after the last module call"
                native_recipes.pop(swap, None)
                continue
            if take_anchor is not None:
                hook = eager[take_anchor].setdefault(taken[1], self._node_hook(take_anchor, taken[1]))
                hook.take.append((swap, taken[0], taken[2]))
            else:
                actions[taken[0]].take.append((swap, taken[1], taken[2]))
            actions[swapped].swap_out.append(swap)
            for anchor, (sequence, why) in zip(anchors, targets):
                if anchor is None:  # the swap-in node comes after the last module call: the first reader fetches
                    continue
                acting.add(anchor)
                # registered at the exit of the top-level call that made it (in one go, with warm
                # caches) when no backward ran in between, else right at the anchor
                flush = self._flush_for(anchor, top_exits)
                if flush is not None:
                    actions[flush].flush = True
                hooks = eager if flush is None else deferred
                hook = hooks[anchor].setdefault(sequence, self._node_hook(anchor, sequence))
                (hook.fetch if why == "fetch" else hook.check).append(swap)
        recounts = list(self._exits_before_backward(top_exits))
        for index, last in recounts:
            actions[index].recount, actions[index].let_go = True, last
        for index, by_sequence in eager.items():
            actions[index].hooks = list(by_sequence.values())
        for index, by_sequence in deferred.items():
            actions[index].deferred = list(by_sequence.values())
        previous = None
        for index in sorted(actions):
            root = self.boundaries[index].root
            if root is not None and (actions[index].hooks or actions[index].deferred):
                actions[index].root = self.boundaries[index].paths[root[0]]
                actions[index].root_step = None if previous is None else root[1] - previous
                previous = root[1]
        # every entry is checked against the learnt one (a global pre-hook); exits only of the modules
        # whose exits act (half the hook calls, the costly part on a large model)
        exits = {self.boundaries[i].module for i in actions if not self.boundaries[i].pre}
        kept = [i for i, b in enumerate(self.boundaries) if b.pre or b.module in exits]
        renumber = {old: new for new, old in enumerate(kept)}
        expected = [self.boundaries[i].module * 2 + self.boundaries[i].pre for i in kept]
        references = {}  # what the carrier compares with first: its takes at module calls, counted here
        for swap, _, taken, take_anchor, *_ in placed_swaps:
            if take_anchor is None:
                position = self.boundaries[taken[0]].paths.index(taken[1])
                for index, _ in recounts:
                    if (count := self.references.get((index, taken[0], position))) is not None:
                        references[renumber[index], swap] = count
        alignment = Alignment(expected, {renumber[i]: a for i, a in actions.items()}, len(swaps), exits,
                              self.hooked, self.global_hooks, references,
                              native_recipes)
        return alignment, unmapped

    def _unexecuted_readers(self, keys: set[int]) -> dict[int, set[int]]:
        """Per storage: the nodes the forward made that saved it but the learning backward never ran (an
        auxiliary loss some iterations add): in those iterations they read it, so they check it too. Their
        saved tensors are still there: backward frees only those of the nodes it runs."""
        ran = set(self.nodes.values())
        roots = {sequence: b.root_node for b in self.boundaries
                 if b.root_node is not None and (sequence := sequence_number(b.root_node)) is not None}
        stack, seen = list(roots.items()), set(roots)
        found: dict[int, set[int]] = defaultdict(set)
        while stack:
            sequence, node = stack.pop()
            if sequence not in ran:
                for _, key in saved_storages(node):
                    if key in keys:
                        found[key].add(sequence)
            for following, _ in node.next_functions:
                if following is not None and (number := sequence_number(following)) is not None and number not in seen:
                    seen.add(number)
                    stack.append((number, following))
        return found

    def _top_level_exits(self) -> list[int]:
        """The boundaries where a top-level module call returns: every node its forward made exists
        there, and a backward through them cannot start before it returns."""
        exits, depth = [], 0
        for index, boundary in enumerate(self.boundaries):
            depth += 1 if boundary.pre else -1
            if depth == 0 and not boundary.pre:
                exits.append(index)
        return exits

    def _exits_before_backward(self, exits: list[int]) -> Iterator[tuple[int, bool]]:
        """The top-level exits that a backward op follows, each with whether one follows before the next exit."""
        for i, index in enumerate(exits):
            start = self.boundaries[index].op
            if self._backward_between(start, None):
                yield index, i + 1 == len(exits) or self._backward_between(start, self.boundaries[exits[i + 1]].op)

    def _backward_between(self, start: int, end: int | None) -> bool:
        """Whether a backward op ran after op `start` (up to op `end`) in the learning iteration."""
        return any(start < op and (end is None or op <= end) for op in self.nodes)

    def _flush_for(self, anchor: int, exits: list[int]) -> int | None:
        """The first top-level exit at or after the anchor, if no backward op ran between them."""
        flush = next((i for i in exits if i >= anchor), None)
        if flush is None:
            return None
        return None if self._backward_between(self.boundaries[anchor].op, self.boundaries[flush].op) else flush

    def _place(self, plan: ActivePlan, out: Event, back: Event | None, accesses: list[int],
               key: int | None) -> tuple[tuple, int, int | None, list[int]] | str:
        """(where it is taken: (boundary, index path, bytes) or (saved attribute, node, bytes); the
        swap-out boundary; the swap-in node; the reading nodes), or why not."""
        ops, boundaries = plan.workload.ops, self.boundaries
        if key is None:
            return "not bound to a storage in the learning iteration"
        forward = [a for a in accesses if ops[a].phase != "backward"]
        after = max([out.trigger, *forward]) + 1
        swapped = next((i for i, b in enumerate(boundaries) if b.op >= after), None)
        if swapped is None:
            return "no module call after its last forward use"
        # (after the structural reason: PyTorch's own arguments to backward hold the loss's gradient)
        if key in self.user_hooked:  # logging a kept activation every few steps reads it where no hook can check
            return "a forward hook of the user's (its module's, or a global one) sees it and may keep it"
        if key in self.held:  # a value the model returns, an attribute: the script may read it before backward
            return "the script holds it when backward starts (a returned value, an attribute) and may read it there"
        later = [a for a in accesses if a >= boundaries[swapped].op]
        outside = [a for a in later if a not in self.nodes]
        if outside:
            return f"op {outside[0]} reads it outside an autograd node"
        created = plan.workload.tensors[out.tensor].created_by
        # the latest boundary that holds it, the swap-out's own when it can: fewer boundaries act
        index = next((i for i in range(swapped, -1, -1) if boundaries[i].op > created and key in boundaries[i].keys), None)
        if index is not None:
            position = boundaries[index].keys.index(key)
            taken: tuple = (index, boundaries[index].paths[position], boundaries[index].nbytes[position])
        elif out.tensor in self.saved:
            node, name, nbytes = self.saved[out.tensor]
            taken = (name, node, nbytes)
        else:
            return "not a module input or output before its swap-out, nor a tensor autograd saved"
        checks = sorted({self.nodes[a] for a in later} | self.unexecuted.get(key, set()))
        fetch = None
        if back is not None and later:  # the first node after the trigger that a module call's root reaches
            newest = max((b.root[1] for b in boundaries if b.root is not None), default=-1)
            first = next((a for a in range(back.trigger + 1, later[0]) if self.nodes.get(a, newest + 1) <= newest), later[0])
            fetch = self.nodes[first]
        return taken, swapped, fetch, checks

    def _anchor(self, sequence: int, candidates: Iterable[int] | None = None) -> int | None:
        """The first of the candidate boundaries (all by default) whose root is at least as new as the
        node: the node is made before it, so it is a walk back from the root (the node hooks read the
        swap's slot only when they run, after it was taken)."""
        indices = range(len(self.boundaries)) if candidates is None else candidates
        return next((i for i in indices if (root := self.boundaries[i].root) is not None and root[1] >= sequence
                     and self._reaches(i, sequence)), None)

    def _node_hook(self, anchor: int, sequence: int) -> NodeHook:
        """A hook on the node, found from the anchor's root (`_anchor` picks only boundaries whose root reaches it)
        by the path its walk took here: the first native iteration follows it instead of walking again."""
        root, path = self.boundaries[anchor].root, self.reach.get((anchor, sequence))
        assert root is not None and path is not None, f"boundary {anchor} anchors node {sequence} without reaching it"
        return NodeHook(sequence - root[1], path)

    def _reaches(self, index: int, sequence: int) -> bool:
        """Whether the node is behind the boundary's root: a node of a parallel branch (a residual
        block's main path, seen from its shortcut's exit) is newer than some roots it is not behind."""
        if (index, sequence) not in self.reach:
            behind = nodes_behind(self.boundaries[index].root_node, sequence)
            self.reach[index, sequence] = next((path for _, number, path in behind if number == sequence), None)
        return self.reach[index, sequence] is not None
