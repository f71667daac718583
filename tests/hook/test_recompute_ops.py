"""Recomputes of ops whose replay is not simply the recorded call: a multi-layer LSTM on the CPU runs
oneDNN's `aten.mkldnn_rnn_layer`, which reads the grad mode (off in the backward, where recomputes run)
and returns a workspace PyTorch allocates uninitialized. Training under the hook must stay bit-identical
to the plain run and the hook must not stand down: a tensor it cannot regenerate is swapped, never lost."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tensile.plan import Event, Plan
from tensile_hook import recipes
from tensile_hook.plan_source import local_planner
from tensile_hook.settings import HookSettings
from tensile.timeline import build_slots
from tensile.tracer import TrainingStep, trace_step
from tensile.workload import Workload
from tests.support.bit_identity import assert_identical
from tests.support.plans import first_uses
from tests.support.training import train

pytestmark = pytest.mark.usefixtures("deterministic")


class Recurrent(nn.Module):
    """The tester's 2-layer LSTM classifier; `embed` puts an Embedding in front, `dropout` between the layers."""

    def __init__(self, embed: bool, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 64) if embed else None
        self.rnn = nn.LSTM(64, 128, num_layers=2, batch_first=True, dropout=dropout)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x) if self.embed is not None else x)
        return self.head(out[:, -1])


def lstm(embed: bool = False, dropout: float = 0.0):  # type: ignore[no-untyped-def]
    def build(batch_size: int) -> tuple:
        model = Recurrent(embed, dropout)
        x = torch.randint(0, 50, (batch_size, 20)) if embed else torch.randn(batch_size, 20, 64)
        batch = (x, torch.randint(0, 10, (batch_size,)))
        return (model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    return build


def release_everything(workload: Workload, budget: int | None = None) -> Plan:
    """Every activation the backward reads released after its last forward use, recomputed before it."""
    uses = first_uses(workload)
    events: list[Event] = []
    for tensor in workload.tensors.values():
        accesses = uses.get(tensor.id, [])
        backward = [i for i in accesses if workload.ops[i].phase != "forward"]
        producer = workload.ops[tensor.created_by] if tensor.created_by >= 0 else None
        if tensor.role != "activation" or producer is None or producer.writes or not backward:
            continue
        forward = [i for i in accesses if workload.ops[i].phase == "forward"]
        events.append(Event("job", "release", tensor.id, max(forward, default=tensor.created_by)))
        events.append(Event("job", "recompute", tensor.id, backward[0] - 1))
    return Plan("job", 1, workload.signature, events)


@pytest.fixture(autouse=True)
def one_thread():
    """As the tester ran it (and the 2 shared cores this suite runs on)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("embed,dropout", [(False, 0.0), (True, 0.2)], ids=["lstm", "embedding+dropout"])
def test_a_two_layer_lstm_trains_bit_identically_under_the_in_process_planner(embed, dropout):
    build = lstm(embed, dropout)
    plain, _ = train(build, 32)
    hooked, report = train(build, 32, planner=local_planner(HookSettings(job="job"), torch.device("cpu")), budget=0.6)
    assert report is not None and report.stood_down is None, report.stood_down
    assert_identical(plain, hooked)
    planned = [it for it in report.iterations if it.mode == "planned"]
    assert planned and all(it.events["release"] > 0 for it in planned), [it.mode for it in report.iterations]


def test_what_a_replay_cannot_reproduce_is_swapped_and_the_rest_recomputed(monkeypatch):
    """Every LSTM output released: the workspaces are swapped (never recomputed), the outputs and states
    are recomputed, and each recompute is bit-identical (the parameters after training say so)."""
    recomputed: list[str] = []
    original = recipes.Step.replay

    def replay(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if torch._C._current_autograd_node() is not None:  # a recompute in the backward, not the check
            recomputed.append(str(self.func))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(recipes.Step, "replay", replay)
    plain, _ = train(lstm(), 32)
    hooked, report = train(lstm(), 32, planner=release_everything)
    assert report is not None and report.stood_down is None, report.stood_down
    assert_identical(plain, hooked)
    planned = [it for it in report.iterations if it.mode == "planned"]
    assert len(planned) >= 3 and all(it.swap_out_bytes > 0 and it.recompute_bytes > 0 for it in planned)
    assert "aten.mkldnn_rnn_layer.default" in recomputed


def test_a_replay_runs_in_the_grad_mode_the_op_ran_in():
    """Under no_grad (as in the backward) oneDNN's LSTM layer would return no workspace and other bits:
    a recipe replays as the op ran, and no recipe is made for the workspace."""
    recorded: dict[int, torch.Tensor] = {}
    workspaces: list[int] = []
    random = recipes.DeviceRandom(torch.device("cpu"))
    book = recipes.RecipeBook(random)

    class Keep(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mkldnn_rnn_layer.default:
                workspaces.append(id(out[3].untyped_storage()))
                for tensor in out:
                    recorded[id(tensor.untyped_storage())] = tensor.clone()
                    book.keep(id(tensor.untyped_storage()), func, args, kwargs or {}, out, None)
            return out

    with Keep():
        nn.LSTM(8, 16, num_layers=2, batch_first=True)(torch.randn(4, 5, 8))
    assert len(workspaces) == 2 and len(book.recipes) == 6 and not set(workspaces) & set(book.recipes)
    with torch.no_grad():
        for key, recipe in book.recipes.items():
            again = recipes.tensors_in(recipe.producer.replay(random))
            assert len(again) == 4 and torch.equal(again[recipe.position], recorded[key])


def test_the_planner_never_plans_a_workspace_recomputed():
    """The hook swaps an RNN workspace instead of recomputing it; a plan (and its forecast) that counted on
    recomputing it would promise what the hook does not do. The layer's other outputs stay recomputable."""
    model, batch, loss_fn, optimizer = lstm()(4)
    step = TrainingStep(model, batch, loss_fn, [optimizer(model.parameters())])
    workload = trace_step(step, model_name="lstm", batch_size=4, target_device="cpu")
    layers = [op for op in workload.ops if op.name == "aten.mkldnn_rnn_layer.default"]
    assert len(layers) == 2 and all(len(op.outputs) == 4 for op in layers), [op.outputs for op in layers]
    slots = build_slots(workload)
    for op in layers:
        *outputs, workspace = op.outputs
        assert slots[workspace].recomputable_by is None
        assert all(slots[t].recomputable_by == op.index for t in outputs if t in slots)
