"""The hook installs into a bare directory and works from there, without the rest of Tensile."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import tensile_hook
from tensile.cli import main

EXAMPLES = Path(__file__).parents[2] / "examples"
SITE = Path(tensile_hook.__file__).parent / "site"


@pytest.mark.slow
def test_installed_hook_runs_a_training_script(tmp_path):
    hook_dir = tmp_path / "hook"
    assert main(["install-hook", str(hook_dir)]) == 0
    assert (hook_dir / "site" / "sitecustomize.py").exists()
    lib = hook_dir / "lib" / "tensile"
    assert (hook_dir / "lib" / "tensile_hook" / "executor.py").exists()
    assert not (hook_dir / "lib" / "tensile_operator").exists() and not (lib / "commands").exists()
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=f"{hook_dir}/site:{hook_dir}/lib", TENSILE_JOB="from-volume", TENSILE_REPORT=str(report))
    probe = "import tensile_hook as h, sys; print(h.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(hook_dir)), where.stderr
    subprocess.run([sys.executable, str(EXAMPLES / "train_mlp.py"), "--steps", "4"], env=env, check=True, timeout=300)
    data = json.loads(report.read_text())
    assert data["job"] == "from-volume" and len(data["iterations"]) >= 3 and data["stood_down"] is None


def test_the_init_containers_installer_does_not_load_torch(tmp_path):
    """The operator's init container runs `python -m tensile_hook.install` under a 128Mi limit
    (operator/tensile_operator/pods.py): importing torch alone took 152 MB there, and the kernel killed it, so no training pod
    started. It copies files; the modules it imports must leave torch out."""
    probe = ("import runpy, sys\n"
             f"sys.argv = ['install', {str(tmp_path / 'hook')!r}]\n"
             "try:\n    runpy.run_module('tensile_hook.install', run_name='__main__')\n"
             "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
             "print('torch loaded:', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "torch loaded: False", done.stdout
    assert (tmp_path / "hook" / "lib" / "tensile_hook" / "lifecycle.py").exists()


def _sitecustomize(starts: bool = False) -> ModuleType:
    """The hook's sitecustomize as a module of its own (TENSILE_JOB unset here: loading it starts nothing; `starts`:
    set, loading it starts the hook as at a training's start)."""
    spec = importlib.util.spec_from_file_location("tensile_sitecustomize", SITE / "sitecustomize.py")
    assert spec is not None and spec.loader is not None and ("TENSILE_JOB" in os.environ) == starts
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, launcher", [
    (["python", "/venv/bin/torchrun", "--nproc_per_node=1", "train.py"], True),
    (["python", "-m", "torch.distributed.run", "--standalone", "train.py"], True),
    (["python", "-u", "-X", "dev", "-mtorch.distributed.launch", "train.py"], True),
    (["python", "-W", "ignore", "-m", "torch.distributed.run", "train.py"], True),
    (["python", "train.py", "-m", "torch.distributed.run"], False),  # the script's own arguments
    (["python", "-c", "import torchrun"], False),
    (["python", "/work/torchrun.py"], False),
    (["python", "-m", "trainer"], False),
    (["python", "/venv/bin/accelerate", "launch", "train.py"], True),
    (["python", "/venv/bin/accelerate-launch", "train.py"], True),
    (["python", "-m", "accelerate.commands.launch", "train.py"], True),
    (["python", "/usr/local/bin/deepspeed", "--num_gpus=1", "train.py"], True),
    (["python", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "train.py"], True),
    (["python", "/work/accelerate.py"], False),
])
def test_a_launcher_is_known_by_its_command_line(monkeypatch, argv: list[str], launcher: bool) -> None:
    """A launcher's own process (torchrun, accelerate, DeepSpeed) starts the training's and trains nothing: it must not
    start the hook (its empty report replaced the training's at exit, and on a GPU the hook and the cap gave it a CUDA
    context of its own)."""
    monkeypatch.setattr(sys, "orig_argv", argv)
    assert _sitecustomize()._launcher() is launcher


@pytest.mark.parametrize("argv, helper", [
    (["python", "/venv/lib/python3.11/site-packages/torch/_inductor/compile_worker/__main__.py", "--workers=4"], True),
    (["python", "-m", "torch._inductor.compile_worker", "--kind=fork"], True),
    (["python", "-u", "-mtorch._inductor.compile_worker"], True),
    (["python", "torch/_inductor/compile_worker/__main__.py"], True),
    (["python", "/work/project/__main__.py"], False),  # a training package's own entry point
    (["python", "/work/mytorch/_inductor/compile_worker/__main__.py"], False),
    (["python", "train.py", "-m", "torch._inductor.compile_worker"], False),  # the script's own arguments
    (["python", "-c", "import torch._inductor.compile_worker"], False),
])
def test_pytorchs_compile_workers_are_known_by_their_command_line(monkeypatch, argv: list[str], helper: bool) -> None:
    monkeypatch.setattr(sys, "orig_argv", argv)
    assert _sitecustomize()._pytorch_helper() is helper


def test_torch_compiles_compile_worker_starts_neither_the_hook_nor_the_cap(tmp_path: Path) -> None:
    """torch.compile starts its compile worker with the job's environment (TENSILE_JOB, and PYTHONPATH with the
    hook's sitecustomize): with the hook there, its movers' CUDA streams gave the worker a CUDA context of its own on
    the job's GPU for the whole run, outside what the job was admitted with. Run here as the worker's own command line
    (asking for its help): it starts no hook, which would have written a report at its exit, and says nothing; a plain
    Python of the same environment does start it."""
    import torch._inductor.compile_worker as compile_worker

    env = {**os.environ, "TENSILE_JOB": "compiled", "TENSILE_MEMORY_CAP": "1Gi",
           "PYTHONPATH": os.pathsep.join([str(SITE), *sys.path])}
    env.pop("TENSILE_AGENT", None)
    worker = Path(compile_worker.__file__).parent / "__main__.py"
    for command, started in (([str(worker), "--help"], False), (["-c", "import torch"], True)):
        report = tmp_path / f"report-{started}.json"
        done = subprocess.run([sys.executable, *command], env={**env, "TENSILE_REPORT": str(report)},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert report.exists() is started, (command, done.stderr)
        assert ("tensile:" in done.stderr) is started, done.stderr


@pytest.mark.parametrize("version, refused", [("2.9.1+cu128", True), ("1.13.1", True), ("2.10.0+cu128", False),
                                              ("2.10.0a0+gitabc123", False), ("2.13.0+cpu", False), ("3.0.0", False)])
def test_a_pytorch_older_than_any_the_hook_was_checked_with_is_refused(version: str, refused: bool) -> None:
    """By release: a build or pre-release of 2.10 (NVIDIA's images number theirs `2.10.0a0+...`) is 2.10."""
    from tensile_hook.lifecycle import UnsupportedPyTorch, check_torch

    if refused:
        with pytest.raises(UnsupportedPyTorch, match=rf"PyTorch {version.replace('+', '[+]')} is older than 2\.10"):
            check_torch(version)
    else:
        check_torch(version)


def test_under_an_older_pytorch_the_training_runs_without_the_hook_and_says_why(monkeypatch, capsys,
                                                                                  tmp_path: Path) -> None:
    """Under PyTorch 2.9.1 a training under a budget crashed pickling a checkpoint, and the
    native path never engaged: the sitecustomize that starts the hook says why it does not, and starts nothing."""
    import torch
    from torch.nn.modules.module import _global_forward_pre_hooks

    from tensile_hook import lifecycle

    hooks = dict(_global_forward_pre_hooks)
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    monkeypatch.setenv("TENSILE_JOB", "old-torch")
    monkeypatch.setenv("TENSILE_REPORT", str(tmp_path / "report.json"))
    for variable in ("WORLD_SIZE", "TENSILE_AGENT"):
        monkeypatch.delenv(variable, raising=False)
    try:
        _sitecustomize(starts=True)
        said = capsys.readouterr().err
        assert said.startswith("tensile: hook not active (UnsupportedPyTorch: PyTorch 2.9.1+cu128 is older than 2.10"), \
            said
        assert said.rstrip().endswith("training runs without Tensile"), said
        assert lifecycle._active is None and dict(_global_forward_pre_hooks) == hooks
    finally:
        lifecycle.deactivate()  # a hook that did start would otherwise stay on for the worker's later tests


@pytest.mark.parametrize("stands_down", ["several processes", "failure at start", None])
def test_sitecustomize_caps_cuda_memory_whether_the_hook_runs_or_stands_down(monkeypatch, capsys, tmp_path: Path,
                                                                              stands_down: str | None) -> None:
    """A job the hook does not carry ran unguarded beside its neighbours: its CUDA memory is capped at its admitted
    size (TENSILE_MEMORY_CAP, its allocator at that less its context, TENSILE_CONTEXT_BYTES) before the hook starts
    and whatever it then does, and its report says so."""
    from tests.support.recording_cuda import GIB, RecordingCuda

    from tensile_hook import lifecycle

    cuda = RecordingCuda()
    cuda.stand_in_for_torch_cuda(monkeypatch)
    started = []

    def activate_from_env(memory_cap=None):  # type: ignore[no-untyped-def]
        if stands_down == "failure at start":
            raise RuntimeError("the plan file is unreadable")
        started.append(memory_cap)

    monkeypatch.setattr(lifecycle, "activate_from_env", activate_from_env)
    report = tmp_path / "report.json"
    for name, value in (("TENSILE_JOB", "capped"), ("TENSILE_MEMORY_CAP", "20Gi"), ("TENSILE_CONTEXT_BYTES", "4Gi"),
                        ("TENSILE_REPORT", str(report))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RANK", raising=False)
    if stands_down == "several processes":
        monkeypatch.setenv("WORLD_SIZE", "2")
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    _sitecustomize(starts=True)
    assert cuda.calls == [("device", 0), ("set_per_process_memory_fraction", 0.2, 0, 0)]
    said = capsys.readouterr().err
    if stands_down is None:
        assert [cap.cap_bytes for cap in started] == [20 * GIB] and not report.exists() and said == ""
        return
    assert started == [] and ("CUDA memory of device 0 capped at 20,480 MiB: its caching allocator at 16,384 MiB "
                              "(20.0% of its 81,920 MiB), 4,096 MiB kept for its context") in said, said
    data = json.loads(report.read_text())
    assert data["memory_cap"] == {"cap_bytes": 20 * GIB, "context_bytes": 4 * GIB, "allocator_bytes": 16 * GIB,
                                  "device": 0, "device_bytes": 80 * GIB, "fraction": 0.2, "note": ""}
    why = "2 processes" if stands_down == "several processes" else "the plan file is unreadable"
    assert why in data["stood_down"]
    assert data["iterations"] == [] and data["device"] == "cuda:0"


def test_an_active_hook_reports_the_cap_it_was_started_under(monkeypatch) -> None:
    from tensile_hook import lifecycle
    from tensile_hook.memory_cap import MemoryCap

    monkeypatch.setenv("TENSILE_JOB", "capped")
    for variable in ("TENSILE_AGENT", "TENSILE_PLAN", "TENSILE_WORKLOAD", "TENSILE_REPORT"):
        monkeypatch.delenv(variable, raising=False)
    try:
        executor = lifecycle.activate_from_env(MemoryCap(2**30, 2**28, 3 * 2**28, 0, 2**32, 0.1875))
        assert executor.report.memory_cap == {"cap_bytes": 2**30, "context_bytes": 2**28, "allocator_bytes": 3 * 2**28,
                                              "device": 0, "device_bytes": 2**32, "fraction": 0.1875, "note": ""}
        assert executor.report.stood_down is None
    finally:
        lifecycle.deactivate()
