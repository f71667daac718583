"""The hook installs into a bare directory and works from there, without the rest of Tensile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tensile.cli import main

EXAMPLES = Path(__file__).parent.parent / "examples"


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
