"""Recompute recipes: how the hook regenerates a tensor the plan released (TENSILE's recompute event).

At the op that produced a tensor the plan recomputes, the hook keeps the op, its inputs and the random state
just before it ran; in-place ops that later write the tensor alone join the recipe. Replayed with those
random states, dropout draws the same numbers and the result is bit-identical; batch norm is replayed
without its running statistics, which it must not update twice. A write to a recipe's input that it cannot
follow makes the recipe (and every recipe reading the written tensor) invalid: the release then keeps a host
copy instead (`PlanExecutor._apply`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tensile.runtime_hook.storages import tensors_in
from tensile.tracer import written_values


class RandomState(Protocol):
    """Where a replay reads and sets the device's random state (the executor, for its device)."""

    def _rng_state(self) -> torch.Tensor: ...

    def _set_rng_state(self, state: torch.Tensor) -> None: ...


@dataclass
class Step:
    """One op to replay, with the random state just before it first ran."""

    func: Any
    args: tuple
    kwargs: dict
    rng: torch.Tensor | None

    def replay(self, random: RandomState, key: int | None = None, result: torch.Tensor | None = None) -> Any:
        """Run it again; with `key`, the storage it wrote is replaced by `result` (no version bump
        on the user's tensor, which autograd may have saved)."""
        args, kwargs = self.args, self.kwargs
        if key is not None:
            args, kwargs = _substitute((args, kwargs), key, result)
        if self.rng is not None:
            current = random._rng_state()
            random._set_rng_state(self.rng)
        try:
            return self.func(*args, **kwargs)
        finally:
            if self.rng is not None:
                random._set_rng_state(current)


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

    def __init__(self) -> None:
        self.recipes: dict[int, Recipe] = {}
        self.readers: dict[int, set[int]] = defaultdict(set)  # id(input storage) -> keys of the recipes reading it

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

    def readers_of(self, key: int) -> list[int]:
        """The recipes that read the storage `key` (a write to it would change what they regenerate)."""
        return list(self.readers.get(key, ()))

    def keep(self, key: int, func: Any, args: tuple, kwargs: dict, out: Any, rng: torch.Tensor | None) -> None:
        """Only ops that write nothing in place can be replayed; their inputs are kept referenced."""
        replay = _replayable(func, args)
        if replay is None:
            return
        func, args = replay
        for position, tensor in enumerate(tensors_in(out)):
            if id(tensor.untyped_storage()) == key:
                recipe = Recipe(Step(func, args, kwargs, rng), position, _geometry(tensor))
                self.recipes[key] = recipe
                for value in recipe.inputs():
                    self.readers[id(value.untyped_storage())].add(key)
                return

    def update(self, written: list[int], func: Any, args: tuple, kwargs: dict, rng: torch.Tensor | None) -> None:
        """An in-place op on a tensor with a recipe joins the recipe when it can be replayed on the
        regenerated tensor alone; any other write makes the recipes that read the tensor invalid."""
        for key in written:
            recipe = self.recipes.get(key)
            if recipe is not None and len(written) == 1 and _chains(recipe, func, args, kwargs):
                recipe.then.append(Step(func, args, kwargs, rng))
                for value in tensors_in((args, kwargs)):
                    if id(value.untyped_storage()) != key:
                        self.readers[id(value.untyped_storage())].add(key)
            else:
                self.recipes.pop(key, None)
            for dependent in self.readers.pop(key, set()) - {key}:
                self.recipes.pop(dependent, None)


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


def _substitute(values: Any, key: int, replacement: Any) -> Any:
    if isinstance(values, torch.Tensor):
        return replacement if id(values.untyped_storage()) == key else values
    if isinstance(values, (list, tuple)):
        return type(values)(_substitute(v, key, replacement) for v in values)
    if isinstance(values, dict):
        return {k: _substitute(v, key, replacement) for k, v in values.items()}
    return values


def _geometry(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


def _replayable(func: Any, args: tuple) -> tuple[Any, tuple] | None:
    """The op and arguments that regenerate an output without side effects, or None.

    Batch norm in training updates its running statistics in place without saying so in its
    schema; replayed without them it computes the same output and leaves the statistics alone.
    """
    name = str(func)
    if name == "aten.native_batch_norm.default":
        return func, (*args[:3], None, None, *args[5:])
    if "batch_norm" in name or any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return None
    return func, args
