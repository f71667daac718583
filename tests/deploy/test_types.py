"""mypy over the four packages, with the settings in pyproject.toml's [tool.mypy], run as a contributor runs it:
`mypy` from the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_mypy_passes(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy_cache")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"mypy found errors:\n{done.stdout}{done.stderr}"
