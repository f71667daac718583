"""Recompute recipes: how the hook regenerates a tensor the plan released (TENSILE's recompute event).

At the op that produced a tensor the plan recomputes, the hook keeps the op, its inputs and the random state
just before it ran; in-place ops that later write the tensor alone join the recipe. Replayed with those
random states, dropout draws the same numbers and the result is bit-identical; batch norm is replayed
without its running statistics, which it must not update twice. A write to a recipe's input that it cannot
follow makes the recipe (and every recipe reading the written tensor) invalid: the release then keeps a host
copy instead (`PlanExecutor._apply`).

A replay runs as the op first ran: below autograd, in the grad mode it saw. Recomputes run in the backward,
where grad is off, and some kernels read the mode: oneDNN's LSTM layer (`aten.mkldnn_rnn_layer`) then takes
its inference path, which returns no workspace and other bits. And an output is not always the op's to
reproduce: that workspace is memory the kernel leaves partly uninitialized. So the first time an op is kept
with given arguments (dtypes, shapes, strides, the other values), it is replayed once and compared byte for
byte with what it recorded; only the outputs it reproduces get recipes, the others are swapped instead.
Workspaces are never recomputed (`WORKSPACES`): their uninitialized bytes may match once by chance.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from tensile_hook.storages import map_leaves, tensors_in
from tensile.timeline import WORKSPACES
from tensile.tracer import written_values


class DeviceRandom:
    """One device's random state, through its default generator: what a replay restores for dropout to draw
    the same numbers, and what the executor records before an op that may be replayed."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            self.generator = torch.cuda.default_generators[index]
        else:
            self.generator = torch.default_generator

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


@dataclass
class Step:
    """One op to replay, with the random state just before it first ran and the grad mode it ran in."""

    func: Any
    args: tuple
    kwargs: dict
    rng: torch.Tensor | None
    grad: bool

    def replay(self, random: DeviceRandom, key: int | None = None, result: torch.Tensor | None = None) -> Any:
        """Run it again; with `key`, the storage it wrote is replaced by `result` (no version bump
        on the user's tensor, which autograd may have saved)."""
        args, kwargs = self.args, self.kwargs
        if key is not None:
            args, kwargs = _substitute((args, kwargs), key, result)
        if self.rng is not None:
            current = random.state()
            random.set_state(self.rng)
        try:
            # as it first ran: below autograd (a replay outside the dispatcher records no graph), in its grad mode
            with torch.set_grad_enabled(self.grad), torch._C._AutoDispatchBelowADInplaceOrView():
                return self.func(*args, **kwargs)
        finally:
            if self.rng is not None:
                random.set_state(current)


@dataclass
class Recipe:
    """How to regenerate a released tensor: the op that made it, then the in-place ops that wrote
    it afterwards (batch norm then an in-place ReLU), each with its random state."""

    producer: Step
    position: int  # which tensor of the producer's result
    geometry: tuple  # (shape, stride, storage offset) of that tensor
    then: list[Step] = field(default_factory=list)

    def inputs(self, own_key: int | None = None) -> list[torch.Tensor]:
        """The tensors the replay reads, other than the regenerated one itself."""
        tensors = tensors_in([(step.args, step.kwargs) for step in (self.producer, *self.then)])
        return [t for t in tensors if id(t.untyped_storage()) != own_key]


class RecipeBook:
    """One iteration's recipes by id(storage), and for each input storage the recipes that read it."""

    def __init__(self, random: DeviceRandom) -> None:
        self.random = random  # the check in `keep` replays with it
        self.recipes: dict[int, Recipe] = {}
        self.readers: dict[int, set[int]] = defaultdict(set)  # id(input storage) -> keys of the recipes reading it
        # op and arguments' signature -> the output positions its replay reproduced; kept across iterations
        self.reproduced: dict[tuple, frozenset[int]] = {}

    def __bool__(self) -> bool:
        return bool(self.recipes or self.readers)

    def __contains__(self, key: int) -> bool:
        return key in self.recipes

    def get(self, key: int) -> Recipe | None:
        return self.recipes.get(key)

    def pop(self, key: int) -> None:
        self.recipes.pop(key, None)

    def clear(self) -> None:
        self.recipes.clear()
        self.readers.clear()

    def containers(self) -> frozenset[int]:
        """Ids of the tuples, lists and dicts its recipes hold arguments in: references to tensors that are the
        hook's, not the script's (`held.py`)."""
        found: set[int] = set()
        for recipe in self.recipes.values():
            for step in (recipe.producer, *recipe.then):
                _containers((step.args, step.kwargs), found)
        return frozenset(found)

    def readers_of(self, key: int) -> list[int]:
        """The recipes that read the storage `key` (a write to it would change what they regenerate)."""
        return list(self.readers.get(key, ()))

    def keep(self, key: int, func: Any, args: tuple, kwargs: dict, out: Any, rng: torch.Tensor | None) -> None:
        """Only ops that write nothing in place can be replayed, and only outputs a replay reproduces
        byte for byte get a recipe; their inputs are kept referenced."""
        replay = _replayable(func, args)
        if replay is None:
            return
        workspace = WORKSPACES.get(str(func))
        if workspace is not None and isinstance(out, (list, tuple)) and _is_storage(out[workspace], key):
            return
        func, args = replay
        step = Step(func, args, kwargs, rng, torch.is_grad_enabled())  # made right after the op ran: its mode
        outputs = tensors_in(out)
        for position, tensor in enumerate(outputs):
            if id(tensor.untyped_storage()) == key:
                if position not in self._reproduced(step, outputs):
                    return
                recipe = Recipe(step, position, _geometry(tensor))
                self.recipes[key] = recipe
                for value in recipe.inputs():
                    self.readers[id(value.untyped_storage())].add(key)
                return

    def _reproduced(self, step: Step, outputs: list[torch.Tensor]) -> frozenset[int]:
        """The positions of `outputs` that `step` regenerates, checked once per signature: right after
        the op ran, none of them has been written yet."""
        signature = (step.func, step.grad, _signature((step.args, step.kwargs)))
        known = self.reproduced.get(signature)
        if known is None:
            known = self.reproduced[signature] = _reproduces(step, outputs, self.random)
        return known

    def update(self, written: list[int], func: Any, args: tuple, kwargs: dict, rng: torch.Tensor | None) -> None:
        """An in-place op on a tensor with a recipe joins the recipe when it can be replayed on the
        regenerated tensor alone; any other write makes the recipes that read the tensor invalid."""
        for key in written:
            recipe = self.recipes.get(key)
            if recipe is not None and len(written) == 1 and _chains(recipe, func, args, kwargs):
                recipe.then.append(Step(func, args, kwargs, rng, torch.is_grad_enabled()))
                for value in tensors_in((args, kwargs)):
                    if id(value.untyped_storage()) != key:
                        self.readers[id(value.untyped_storage())].add(key)
            else:
                self.recipes.pop(key, None)
            for dependent in self.readers.pop(key, set()) - {key}:
                self.recipes.pop(dependent, None)


def _reproduces(step: Step, recorded: list[torch.Tensor], random: DeviceRandom) -> frozenset[int]:
    """Replay once: the positions whose storages come back byte for byte, laid out as recorded; none
    when the replay fails or returns other outputs (a missing workspace shifts the positions)."""
    try:
        replayed = tensors_in(step.replay(random))
    except Exception:  # noqa: BLE001 - what cannot be replayed now is swapped, never recomputed
        return frozenset()
    if len(replayed) != len(recorded):
        return frozenset()
    return frozenset(i for i, (a, b) in enumerate(zip(recorded, replayed)) if _same_bytes(a, b))


def _same_bytes(recorded: torch.Tensor, replayed: torch.Tensor) -> bool:
    """Same dtype and layout, and the whole storage equal byte for byte (a recompute copies all of it;
    bytes compare NaN with NaN)."""
    if recorded.dtype != replayed.dtype or _geometry(recorded) != _geometry(replayed):
        return False
    a, b = recorded.untyped_storage(), replayed.untyped_storage()
    if a.nbytes() != b.nbytes() or a.device != b.device:
        return False
    as_bytes = [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s) for s in (a, b)]
    return torch.equal(*as_bytes)


def _signature(values: Any) -> Any:
    """What a kernel's choice of path depends on: tensors' dtype, device and layout, other values as written."""
    if isinstance(values, torch.Tensor):
        return (values.dtype, values.device, _geometry(values))
    if isinstance(values, (list, tuple)):
        return tuple(_signature(v) for v in values)
    if isinstance(values, dict):
        return tuple((k, _signature(v)) for k, v in values.items())
    return repr(values)


def _chains(recipe: Recipe, func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an in-place op can join the recipe: it writes only the regenerated tensor, as it is laid out."""
    if _replayable(func, args) is not None or "batch_norm" in str(func):
        return False  # not in place, or in place on more than it says
    written = tensors_in(written_values(func, args, kwargs))
    return (
        len(written) == 1
        and not any(isinstance(a, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in a) for a in args)
        and _geometry(written[0]) == recipe.geometry
    )


def _containers(values: Any, found: set[int]) -> None:
    if isinstance(values, (list, tuple, dict)):
        found.add(id(values))
        for value in values.values() if isinstance(values, dict) else values:
            _containers(value, found)


def _is_storage(value: Any, key: int) -> bool:
    return isinstance(value, torch.Tensor) and id(value.untyped_storage()) == key


def _substitute(values: Any, key: int, replacement: Any) -> Any:
    return map_leaves(values, lambda value: replacement if _is_storage(value, key) else value)


def _geometry(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


BATCH_NORMS = ("aten.native_batch_norm.default", "aten.cudnn_batch_norm.default")  # running statistics: arguments 3, 4


def _replayable(func: Any, args: tuple) -> tuple[Any, tuple] | None:
    """The op and arguments that regenerate an output without side effects, or None.

    Batch norm in training updates its running statistics in place without saying so in its
    schema (cuDNN's, which CUDA runs, too); replayed without them it computes the same output and leaves the
    statistics alone.
    """
    name = str(func)
    if name in BATCH_NORMS:
        return func, (*args[:3], None, None, *args[5:])
    if "batch_norm" in name or any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return None
    return func, args
