"""The repository's folders as Python sees them while the tests run: tests/operator and operator/ are plain folders,
so `import operator` (which torch and much of the standard library use) is still the standard library's module."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def test_operator_is_the_standard_librarys_in_the_test_process_and_from_the_repository_root():
    import operator

    assert Path(operator.__file__).resolve().parent == STDLIB, operator.__file__
    probe = subprocess.run([sys.executable, "-c", "import operator; print(operator.__file__)"], cwd=ROOT,
                           capture_output=True, text=True, check=True, timeout=60)
    assert Path(probe.stdout.strip()).resolve().parent == STDLIB, probe.stdout
