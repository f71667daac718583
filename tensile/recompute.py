"""Recomputation selection (TENSILE IV-D): release a tensor after one access, replay it before the next.

Only where swapping is spent. A tensor is replayed as a *chain*: the op that created it, then the
in-place ops that wrote it afterwards (native_batch_norm then relu_, or add_ then relu_ in a residual
block), each writing nothing but that tensor (timeline.py decides which tensors qualify). A
recomputation is legal only when every other input of every op of the chain is on the device,
unchanged since that op first ran, just before the access that needs the tensor, and stays so: the
replay must not need a swap-in or another replay of its own (that would undo the swap plan). Among
the legal ones, the highest MSPS (memory saving per second of recomputation, Capuchin's metric, with
the chain's summed latency as the time) wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tensile.timeline import Slot, chain_latency
from tensile.workload import Workload

MIN_SECONDS = 1e-9


@dataclass(frozen=True, slots=True)
class Recompute:
    slot: int
    after: int  # release after this access
    before: int  # replay just before this access
    seconds: float  # replay latency of the whole chain (unscaled)
    msps: float
    chain: tuple[int, ...] = ()  # the ops replayed, creator first


# the ops whose outputs the runtime hook's native path regenerates: their inputs are saved by their autograd nodes or are
# parameters (runtime_hook/tensile_hook/native_recipes.py); the same aten ops the dispatch path replays (runtime_hook/tensile_hook/recipes.py).
# On CUDA a batch norm runs cuDNN's op, recorded and planned as this native one (tensile.cuda_ops) and replayed as
# itself; a replay that does not give its output byte for byte leaves it swapped instead (recipes.RecipeBook.keep).
NATIVE_CREATORS = frozenset({"aten.convolution.default", "aten.native_batch_norm.default"})


def natively_replayable(workload: Workload, option: Recompute) -> bool:
    """A recomputation the native path carries: released after a forward access (at a module call) and made by a
    convolution or a batch norm, then written in place only by the ops of its chain."""
    ops = workload.ops
    return ops[option.after].phase == "forward" and bool(option.chain) and ops[option.chain[0]].name in NATIVE_CREATORS


def msps(size: int, seconds: float) -> float:
    """Memory saving per second of recomputation."""
    return size / max(seconds, MIN_SECONDS)


def chain_inputs(workload: Workload, slot: Slot, chain: tuple[int, ...]) -> list[tuple[int, int]]:
    """(op, tensor) for every input of the chain other than the recomputed slot itself."""
    own = set(slot.names)
    return [(k, t) for k in chain for t in workload.ops[k].inputs if t not in own]


def recompute_option(
    workload: Workload,
    slot: Slot,
    p: int,
    present: Callable[[int, int], bool],
    first_pin: Callable[[int, int, int], int | None],
    root_of: dict[int, int],
    writers: dict[int, list[int]],
) -> Recompute | None:
    """The recomputation of `slot` that frees it at op p, if one is legal.

    `present(root, op)`: the slot is on the device with its data for op; `first_pin(root, lo, hi)`: the first
    op in lo..hi where a planned replay reads the slot (None: none). A slot some replay reads inside its gap
    is replayed *early*, just before that op, so it is back for that replay: it then saves memory only
    up to there, which is enough when the peak lies before it."""
    if slot.recomputable_by is None or slot.persistent:
        return None
    acc = slot.accesses
    i = next((j for j, a in enumerate(acc) if a > p), None)
    if i is None or i == 0 or acc[i - 1] == p:
        return None
    after, before = acc[i - 1], acc[i]
    pin = first_pin(slot.root, after + 1, before - 1)
    if pin is not None:
        if pin <= p:
            return None
        before = pin  # no access of the slot lies in its gap: the chain is the same
    chain = slot.chain(before)
    for k, tensor in chain_inputs(workload, slot, chain):
        root = root_of[tensor]
        if root == slot.root or not (present(root, before - 1) and present(root, before)):
            return None
        if any(k < w < before for w in writers.get(tensor, ())):
            return None
    seconds = chain_latency(workload, chain)
    return Recompute(slot.root, after, before, seconds, msps(slot.size, seconds), chain)
