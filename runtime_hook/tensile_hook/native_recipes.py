"""Recomputes on the native path: how a released activation is regenerated without the dispatch mode.

The dispatch path keeps, at the op that made a tensor, the op and its arguments (`recipes.py`). A native
iteration sees no op, so what a replay reads is found where autograd keeps it: in the learning iteration (on
the dispatch path, under the plan) the tensor's recipe is known, and at the module call where the native path
takes the tensor, each argument of the recipe is looked up among the tensors saved by the autograd nodes
behind the tensor's own node (`grad_fn`): a convolution's input is its node's `_saved_input`, batch norm's
input its node's. Those nodes run in backward only after every node that reads the tensor, so what they saved
is still there when the tensor is recomputed. Parameters are the same objects in every iteration and are kept.
A recipe with another argument, or with a random state (dropout: a native iteration cannot restore the state
an op drew from), does not align; nor does a tensor whose saved inputs a saved-tensor hook packed (activation
checkpointing), which is found out at the release: the tensor then stays on the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tensile_hook.saved_tensors import saved_storages, saved_tensor
from tensile_hook.storages import map_leaves
from tensile_hook.recipes import Recipe, Step

SAVED_DEPTH = 4  # autograd nodes behind the tensor's own searched for its recipe's inputs (batch norm's input after a ReLU's: 1)


@dataclass(frozen=True, slots=True)
class SavedAt:
    """A recipe argument read at the release from a node behind the tensor's own node."""

    path: tuple[int, ...]  # next_functions indices from the tensor's node to the node that saved it
    name: str  # its `_raw_saved_` attribute
    shape: tuple[int, ...]  # what it was in the learning iteration: another graph may hold another tensor there
    dtype: torch.dtype


class _Itself:
    """The regenerated tensor, as an argument of the in-place ops that wrote it after the op that made it."""


ITSELF = _Itself()


@dataclass(slots=True)
class StepTemplate:
    func: Any
    args: tuple  # tensors as SavedAt, ITSELF, or a parameter (kept)
    kwargs: dict
    grad: bool


@dataclass(slots=True)
class NativeRecipe:
    """A recipe whose per-iteration tensors are where autograd saved them."""

    producer: StepTemplate
    position: int
    geometry: tuple
    then: list[StepTemplate] = field(default_factory=list)

    def bind(self, node: Any, storage: torch.UntypedStorage) -> Recipe | None:
        """This iteration's recipe for the tensor taken with autograd node `node`, whose storage is `storage`;
        None where a saved input cannot be read as learnt (a saved-tensor hook packed it, or the graph differs)."""
        itself = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

        def bound(value: Any) -> Any:
            return _read(value, node) if isinstance(value, SavedAt) else itself if value is ITSELF else value

        try:
            steps = [Step(step.func, map_leaves(step.args, bound), map_leaves(step.kwargs, bound), None, step.grad)
                     for step in (self.producer, *self.then)]
        except LookupError:
            return None
        return Recipe(steps[0], self.position, self.geometry, steps[1:])


def learn(recipe: Recipe, node: Any, key: int) -> NativeRecipe | str:
    """The recipe of the tensor on storage `key`, whose autograd node is `node` at the module call that takes it,
    with its per-iteration arguments found behind that node; or why it cannot be replayed natively."""
    steps = (recipe.producer, *recipe.then)
    if any(torch.Tag.nondeterministic_seeded in step.func.tags for step in steps):
        return "its recompute replays a random op (dropout), whose state a native iteration cannot restore"
    if node is None:
        return "no autograd node made it"
    where: dict[int, tuple[tuple[int, ...], str]] = {}
    for saved, at in _saved_behind(node):
        where.setdefault(saved, at)  # the nearest node's: `_saved_behind` yields nearer nodes first

    def template(value: Any) -> Any:
        return _template(value, key, where) if isinstance(value, torch.Tensor) else value

    try:
        templates = [StepTemplate(step.func, map_leaves(step.args, template), map_leaves(step.kwargs, template), step.grad)
                     for step in steps]
    except LookupError as missing:
        return f"an input of its recompute ({missing.args[0]}) is neither a parameter nor saved by autograd behind it"
    return NativeRecipe(templates[0], recipe.position, recipe.geometry, templates[1:])


def _saved_behind(node: Any) -> Iterator[tuple[int, tuple[tuple[int, ...], str]]]:
    """(id(storage), (path, `_raw_saved_` name)) of the tensors saved by `node` and the nodes up to SAVED_DEPTH behind
    it, nearest first."""
    queue: deque[tuple[Any, tuple[int, ...]]] = deque([(node, ())])
    seen = {id(node)}
    while queue:
        current, path = queue.popleft()
        for name, key in saved_storages(current):
            yield key, (path, name)
        if len(path) < SAVED_DEPTH:
            for position, (following, _) in enumerate(current.next_functions):
                if following is not None and id(following) not in seen:
                    seen.add(id(following))
                    queue.append((following, (*path, position)))


def _template(value: torch.Tensor, key: int, where: dict[int, tuple[tuple[int, ...], str]]) -> Any:
    """A tensor argument as the template keeps it: where autograd saved it, else a parameter itself (updated in place
    by the optimizer, the same tensor in every iteration; a batch made before the iteration is not one)."""
    storage = id(value.untyped_storage())
    if storage == key:
        return ITSELF
    if storage in where:
        return SavedAt(*where[storage], tuple(value.shape), value.dtype)
    if isinstance(value, torch.nn.Parameter):
        return value
    raise LookupError(f"{tuple(value.shape)} {value.dtype}")


def _read(at: SavedAt, node: Any) -> torch.Tensor:
    """The tensor saved where `at` says, behind this iteration's node, if it is what was learnt there."""
    try:
        holder = node
        for position in at.path:
            holder = holder.next_functions[position][0]
        tensor = saved_tensor(holder, at.name)
    except (IndexError, TypeError, AttributeError, RuntimeError):  # another graph, or a node that ran and freed it
        tensor = None
    if tensor is None or tuple(tensor.shape) != at.shape or tensor.dtype != at.dtype:
        raise LookupError(at.name)
    return tensor
