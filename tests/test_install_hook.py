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

import tensile.runtime_hook
from tensile.cli import main

EXAMPLES = Path(__file__).parent.parent / "examples"
SITE = Path(tensile.runtime_hook.__file__).parent / "site"


def test_installed_hook_runs_a_training_script(tmp_path):
    hook_dir = tmp_path / "hook"
    assert main(["install-hook", str(hook_dir)]) == 0
    assert (hook_dir / "site" / "sitecustomize.py").exists()
    lib = hook_dir / "lib" / "tensile"
    assert (lib / "runtime_hook" / "executor.py").exists()
    assert not (lib / "operator").exists() and not (lib / "commands").exists()
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=f"{hook_dir}/site:{hook_dir}/lib", TENSILE_JOB="from-volume", TENSILE_REPORT=str(report))
    probe = "import tensile.runtime_hook as h, sys; print(h.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(hook_dir)), where.stderr
    subprocess.run([sys.executable, str(EXAMPLES / "train_mlp.py"), "--steps", "4"], env=env, check=True, timeout=300)
    data = json.loads(report.read_text())
    assert data["job"] == "from-volume" and len(data["iterations"]) >= 3 and data["stood_down"] is None


def test_the_init_containers_installer_does_not_load_torch(tmp_path):
    """The operator's init container runs `python -m tensile.runtime_hook.install` under a 128Mi limit
    (operator/pods.py): importing torch alone took 152 MB there, and the kernel killed it, so no training pod
    started. It copies files; the modules it imports must leave torch out."""
    probe = ("import runpy, sys\n"
             f"sys.argv = ['install', {str(tmp_path / 'hook')!r}]\n"
             "try:\n    runpy.run_module('tensile.runtime_hook.install', run_name='__main__')\n"
             "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
             "print('torch loaded:', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "torch loaded: False", done.stdout
    assert (tmp_path / "hook" / "lib" / "tensile" / "runtime_hook" / "lifecycle.py").exists()


def _sitecustomize() -> ModuleType:
    """The hook's sitecustomize as a module of its own (TENSILE_JOB unset here: loading it starts nothing)."""
    spec = importlib.util.spec_from_file_location("tensile_sitecustomize", SITE / "sitecustomize.py")
    assert spec is not None and spec.loader is not None and "TENSILE_JOB" not in os.environ
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
])
def test_torchruns_launcher_is_known_by_its_command_line(monkeypatch, argv: list[str], launcher: bool) -> None:
    """torchrun's own process starts the training's and trains nothing: it must not start the hook (its empty report
    replaced the training's at exit, and with an agent it would register as the job)."""
    monkeypatch.setattr(sys, "orig_argv", argv)
    assert _sitecustomize()._launcher() is launcher
