"""mypy over the four packages, with the settings in pyproject.toml's [tool.mypy].

mypy cannot follow the package-dir mapping (tensile.operator lives in operator/, and so on): the
editable install maps them with an import hook that mypy does not run. And mypy always searches
the directory it runs in, so run from the repository root it would take operator/ for the standard
library's `operator` (torch imports it). So mypy runs in a temporary directory holding `tensile/`
as the installed package is laid out: links to the entries of tensile/ and to operator/,
node_agent/ and runtime_hook/. The paths in its messages are turned back into the repository's.

Run by hand: `python tests/test_types.py` (prints mypy's report, exits with its status).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = ("operator", "node_agent", "runtime_hook")  # [tool.setuptools.package-dir]: tensile.X is X/


def _link_tree(dest: Path) -> None:
    """dest/tensile: the installed layout of the package, made of links into the repository."""
    package = dest / "tensile"
    package.mkdir(parents=True)
    for entry in sorted((ROOT / "tensile").iterdir()):
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    for name in MAPPED:
        (package / name).symlink_to(ROOT / name, target_is_directory=True)


def run_mypy(workdir: Path) -> tuple[int, str]:
    """(mypy's exit status, its report with repository paths); caches under workdir, not in the repo."""
    src = workdir / "src"
    _link_tree(src)
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    # -p tensile covers tensile.operator, tensile.node_agent and tensile.runtime_hook: they are in the tree.
    command += ["--cache-dir", str(workdir / "mypy_cache"), "-p", "tensile"]
    env = {key: value for key, value in os.environ.items() if key != "MYPYPATH"}
    done = subprocess.run(command, cwd=src, env=env, capture_output=True, text=True)
    report = done.stdout + done.stderr
    for name in MAPPED:
        report = report.replace(f"tensile/{name}/", f"{name}/")
    return done.returncode, report


def test_mypy_passes(tmp_path: Path) -> None:
    status, report = run_mypy(tmp_path)
    assert status == 0, f"mypy found errors:\n{report}"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as workdir:
        status, report = run_mypy(Path(workdir))
    print(report, end="")
    sys.exit(status)
