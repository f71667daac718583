"""Where every benchmark writes its results: benchmarks/results/, the committed figures, unless the environment names
another folder (TENSILE_BENCH_RESULTS), so that a trial run or the test suite's smoke run of a script leaves the
committed files as they are. The scripts import it as a sibling (`from bench_results import results_dir`): Python
puts a script's own folder first on its path."""

from __future__ import annotations

import os
from pathlib import Path

ENVIRONMENT = "TENSILE_BENCH_RESULTS"
COMMITTED = Path(__file__).resolve().parent / "results"


def results_dir() -> Path:
    """The folder named by TENSILE_BENCH_RESULTS where it is set and not empty (made if it is not there yet), else
    benchmarks/results/."""
    named = os.environ.get(ENVIRONMENT)
    if not named:
        return COMMITTED
    folder = Path(named)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
