"""Other processes and reads the dispatcher never sees: a DataLoader's worker processes are the trainer's
helpers (they must not run a job of their own, nor receive a dataset the guard had evicted), and what is
saved, pickled, shared or aliased by numpy must be the tensor's bytes, not an evicted storage's nothing."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multiprocessing.reduction import ForkingPickler

from tests.support.bit_identity import assert_identical
from tests.support.hook_probes import swapped_out

LOADER_SCRIPT = Path(__file__).parents[1] / "support" / "loader_training.py"


def _train(tmp_path: Path, start_method: str, hooked: bool) -> tuple[dict, dict | None]:
    saved, report = tmp_path / f"{start_method}-{hooked}.pt", tmp_path / f"{start_method}.report.json"
    script = [sys.executable, str(LOADER_SCRIPT), "--start-method", start_method, "--save", str(saved)]
    tensile = [sys.executable, "-m", "tensile.cli", "run", "--memory-budget", "0.6", "--report", str(report), "--"]
    subprocess.run(tensile + script if hooked else script, check=True, timeout=300, capture_output=True)
    state = torch.load(saved)
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    flat.update({f"opt.{i}.{k}": v for i, s in state["optimizer"]["state"].items() for k, v in s.items()})
    return flat, json.loads(report.read_text()) if hooked else None


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_dataloader_workers_leave_the_training_to_the_trainer(tmp_path, start_method):
    """Spawned workers used to start a hook of their own (sitecustomize) and each wrote the job's report at
    exit: the trainer's 8 iterations were replaced by a worker's 0. Worse, the trainer's budget guard evicted
    the dataset, which the trainer never reads itself, and pickling it for the workers sent an empty storage:
    training went on with NaNs. Forked workers inherit the executor: what it had swapped out comes back there
    (single-threaded: OpenMP's pool does not survive a fork, and a parallel copy hung)."""
    plain, _ = _train(tmp_path, start_method, hooked=False)
    hooked, report = _train(tmp_path, start_method, hooked=True)
    assert_identical(plain, hooked)
    assert len(report["iterations"]) == 8 and report["stood_down"] is None
    assert any(it["swap_out_bytes"] or it["passive_evictions"] for it in report["iterations"])  # the plan moved tensors


def test_a_forked_child_gets_what_was_swapped_out_and_runs_without_the_hook(planless):
    own = torch.arange(2**16, dtype=torch.float32)
    swapped_out(planless, own)
    pid = os.fork()
    if pid == 0:  # the child: the tensor is back, the hook off, nothing else runs here
        torch.set_num_threads(1)  # as a DataLoader worker does: OpenMP's threads do not survive a fork
        quiet = planless.iterations.report_writer is None
        os._exit(0 if planless.disabled and quiet and own.sum().item() == float(sum(range(2**16))) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not planless.disabled  # the parent goes on under the hook


@pytest.mark.parametrize("read", ["numpy", "tolist", "torch.save", "share_memory_", "multiprocessing pickle"])
def test_a_read_outside_the_dispatcher_sees_the_tensors_bytes(planless, read):
    """Each of these reads the storage directly; on the old code each saw the evicted storage (numpy: garbage,
    torch.save and sharing: 0 bytes; tolist raised on the unallocated storage). What numpy aliases or another process
    shares stays on the device."""
    expected = torch.arange(2**16, dtype=torch.float32)
    own = expected.clone()
    slot = swapped_out(planless, own)
    if read == "numpy":
        got = torch.from_numpy(own.numpy().copy())
    elif read == "tolist":
        got = torch.tensor(own.tolist())
    elif read == "torch.save":
        buffer = io.BytesIO()
        torch.save({"tensor": own}, buffer)
        got = torch.load(io.BytesIO(buffer.getvalue()))["tensor"]
    elif read == "share_memory_":
        got = own.share_memory_().clone()
    else:
        got = pickle.loads(ForkingPickler.dumps(own))
    assert torch.equal(got, expected)
    if read not in ("torch.save", "tolist"):  # these read once: the tensor may go out again
        assert slot.pinned and not planless.residency.swap_out(slot)  # aliased or shared: never resized again
