"""The repository's folders as Python sees them while the tests run: tests/operator and operator/ are plain folders,
so `import operator` (which torch and much of the standard library use) is still the standard library's module."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def test_operator_is_the_standard_librarys_in_the_test_process_and_from_the_repository_root():
    import operator

    assert Path(operator.__file__).resolve().parent == STDLIB, operator.__file__
    probe = subprocess.run([sys.executable, "-c", "import operator; print(operator.__file__)"], cwd=ROOT,
                           capture_output=True, text=True, check=True, timeout=60)
    assert Path(probe.stdout.strip()).resolve().parent == STDLIB, probe.stdout


def _contracts() -> list[dict]:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        return tomllib.load(handle)["tool"]["importlinter"]["contracts"]


def test_every_module_of_the_core_is_named_in_a_layer():
    """A layers contract says nothing of a module it does not name: a new core module must be placed in a layer."""
    (layers,) = [contract["layers"] for contract in _contracts() if contract["type"] == "layers"]
    named = {name.strip() for layer in layers for name in re.split(r"[:|]", layer)}
    core = ROOT / "tensile"
    modules = {f"tensile.{path.stem if path.is_file() else path.name}" for path in core.iterdir()
               if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()}
    assert modules - named == set(), f"name these in a layer of pyproject.toml's layers contract: {modules - named}"
    assert {"tensile_hook", "tensile_agent", "tensile_operator"} <= named


def test_the_import_contracts_hold():
    """lint-imports (import-linter) on the installed packages: the layers, and no web, Kubernetes or CLI library in
    the hook."""
    done = subprocess.run([str(Path(sys.executable).parent / "lint-imports")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
