"""`held_storages`: which swapped storages the script can still read when backward starts (the native
path keeps those on the device). End to end, with real training loops, in test_training_loops.py."""

from __future__ import annotations

from collections.abc import Callable
import pytest
import torch

from tensile_hook import executor
from tensile_hook.held import held_storages


def graph() -> tuple[torch.Tensor, torch.Tensor]:
    """An activation (held by nothing but autograd once this returns) and the loss behind it."""
    layer = torch.nn.Linear(8, 8)
    activation = layer(torch.randn(4, 8)) * 2
    return activation, torch.tanh(layer(activation)).sum()


def is_held(keep: Callable[[torch.Tensor], object]) -> bool:
    """Whether the activation's storage counts as held once `keep` had the activation (what `keep`
    returns stays alive through the check)."""
    activation, loss = graph()
    storage = activation.untyped_storage()
    kept = keep(activation)
    del activation
    try:
        return id(storage) in held_storages([storage])
    finally:
        del kept
        loss.backward()


class Holder(torch.nn.Module):
    pass


def as_attribute(tensor: torch.Tensor) -> object:
    holder = Holder()
    holder.features = tensor
    return holder


@pytest.mark.parametrize("keep", [
    pytest.param(lambda t: [t], id="in a list"),
    pytest.param(lambda t: {"features": t}, id="in a dict"),
    pytest.param(as_attribute, id="a module attribute"),
    pytest.param(lambda t: (t.flatten(),), id="a view of it"),
])
def test_what_the_script_keeps_is_held(keep: Callable[[torch.Tensor], object]) -> None:
    assert is_held(keep)


def test_what_only_autograd_keeps_is_not_held() -> None:
    assert not is_held(lambda t: None)


def test_a_local_variable_of_the_script_holds_it() -> None:
    activation, loss = graph()
    storage = activation.untyped_storage()
    assert id(storage) in held_storages([storage])
    loss.backward()


class Scale(torch.autograd.Function):
    """Keeps its input on the context as an attribute, read only by its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def, override]
        ctx.x = x
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def, override]
        (w,) = ctx.saved_tensors
        return grad * w, grad * ctx.x


def test_a_custom_functions_context_does_not_hold_it() -> None:
    activation, _ = graph()
    storage = activation.untyped_storage()
    out = Scale.apply(activation, torch.randn(4, 8))
    del activation
    assert id(storage) not in held_storages([storage])
    out.sum().backward()


def test_a_frame_of_tensiles_own_code_does_not_hold_it() -> None:
    """The dispatch mode's frame holds the inputs of the op it runs when backward starts."""
    internal = executor.__file__
    scope: dict = {"held_storages": held_storages}
    exec(compile("def check(tensor, storage):\n    return id(storage) in held_storages([storage])\n", internal, "exec"), scope)
    activation, loss = graph()
    storage = activation.untyped_storage()
    tensor = [activation]
    del activation
    held = scope["check"](tensor.pop(), storage)  # the tensor only on the stack: no local of this frame holds it
    assert not held
    loss.backward()
