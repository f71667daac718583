"""Every script of benchmarks/ runs for real at its smallest setting: as a process of its own from the repository root,
on the CPU device, into a temporary folder (TENSILE_BENCH_RESULTS, benchmarks/bench_results.py), leaving the committed
results as they are. It must exit 0 and write results holding what its row of benchmarks/README.md reads, so that a
script broken by a change elsewhere fails here rather than when it is run by hand or by gpu_session.sh on a GPU. The
figures themselves are not checked: at these sizes they mean nothing. benchmarks/colocation.py has a test of its own
(tests/local/test_colocation.py); mover_overhead.py and cuda_context.py need CUDA: here their refusal, on a GPU a
small run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
COMMITTED = BENCHMARKS / "results"
TESTED_ELSEWHERE = {"colocation": ROOT / "tests" / "local" / "test_colocation.py"}
EVERY = "*"  # in a key path: every item of a list or value of a dict, of which there must be at least one


@dataclass(frozen=True)
class Smoke:
    """One script's smallest run: its arguments, the files it writes (globs in the results folder, the first its JSON)
    and the key paths its README row reads there."""

    script: str
    args: tuple[str, ...]
    writes: tuple[str, ...]
    reads: tuple[tuple[str, ...], ...]
    name: str = ""

    @property
    def id(self) -> str:
        return self.name or self.script


SMOKES = [
    Smoke("agent_load", ("--seconds", "1", "--clients", "2", "--iteration", "0.05"), ("agent_load.json",),
          (("latency", "plan fetch (re-planning)", "p99_ms"), ("latency", "plan fetch (idle)", "p99_ms"),
           ("replan_8_resnet50_b16", "knob_to_new_plan_seconds_median"), ("target_met",))),
    Smoke("forecast_accuracy", ("--models", "resnet50"), ("forecast_accuracy.json",),
          (("worst_relative_error",), ("rows", EVERY, "error_vs_allocator"), ("rows", EVERY, "error_vs_live"),
           ("rows", EVERY, "error_vs_memtracker"))),
    Smoke("forecast_speed", ("--repeats", "1"), ("forecast_speed.json",),
          (("forecast_seconds_median",), ("ratio",))),
    Smoke("hook_overhead", ("--batch-size", "1", "--steps", "4", "--device", "cpu"), ("hook_overhead.json",),
          (("device",), ("rows", EVERY, "ratio"), ("rows", EVERY, "hook_seconds_per_iteration"))),
    Smoke("latency_accuracy", ("--quick", "--passes", "1", "--repeats", "1", "--models", "resnet50", "--skip-zoo-ops"),
          ("latency_cpu.json",),
          (("device",), ("families", EVERY, "median_ape"), ("zoo", EVERY, "error_percent"))),
    Smoke("latency_fit_variance",
          ("--quick", "--passes", "1", "--seeds", "1", "--members", "1", "--cache", "{out}/fits.pkl"),
          ("latency_fit_variance_cpu.json", "fits.pkl"),
          (("summary", EVERY, "fits_with_every_family_within_target"), ("fits", EVERY, EVERY, EVERY, "median_ape"))),
    Smoke("operator_admission", ("--jobs", "3", "--interval", "0"), ("operator_admission.json",),
          (("latency_seconds", "p50"), ("latency_seconds", "p99")), name="operator_admission-fit"),
    # two 2 GiB GPUs a node: one job admitted by the shortcut, one planned jointly, one waits
    Smoke("operator_admission", ("--scenario", "tight", "--jobs", "4", "--gpu-gib", "2", "--interval", "0"),
          ("operator_admission_tight.json",),
          (("latency_seconds", "p50"), ("latency_seconds", "p99"), ("admitted_planned_jointly",),
           ("admitted_by_shortcut",), ("waited",), ("planner_calls", "misses", "count"),
           ("operator_loop_lateness", "max_seconds")), name="operator_admission-tight"),
    Smoke("paper_tables", ("--quick", "--models", "vgg16"), ("paper_tables.json", "paper_tables.md"),
          (("table_iii", EVERY, "gpu", EVERY, "cbr"), ("table_iv", "gpu", EVERY, "cbr"),
           ("paper_platform", "table_iii", EVERY, "gpu", EVERY, "cbr"))),
    Smoke("planner_speed", ("--max-jobs", "2", "--repeats", "1"), ("planner_speed.json", "planner_speed.md"),
          (("four_resnet50_b16_seconds",), ("four_resnet50_rounds",), ("four_resnet50_msr",), ("growth_exponent",))),
    Smoke("real_training", ("--models", "resnet50", "--batch-size", "1", "--steps", "4", "--device", "cpu"),
          ("real_training_*.json",),
          (("device",), ("rows", EVERY, "msr"), ("rows", EVERY, "eor"), ("rows", EVERY, "bit_identical"),
           ("rows", EVERY, "allocated_forecast_error"))),
    Smoke("recompute_cost", ("--batch-size", "1", "--steps", "4", "--device", "cpu"), ("recompute_cost.json",),
          (("rows", EVERY, "seconds"), ("rows", EVERY, "hook_seconds"), ("rows", EVERY, "events_per_iteration"))),
]
CUDA_ONLY = [  # here: their refusal; on a GPU, a small run
    Smoke("mover_overhead",
          ("--rounds", "1", "--storages", "2", "--min-mib", "1", "--max-mib", "2", "--small-ops", "2"),
          ("mover_overhead_*.json",),
          (("rows", EVERY, "mover", "median_us"), ("rows", EVERY, "bare_copy", "median_us"),
           ("bit_identical", "mover"))),
    Smoke("cuda_context", ("--cap", "1GiB"), ("cuda_context_*.json",),
          (("outside_allocator_bytes",), ("booked_context_bytes",), ("cap", "process_bytes"), ("cap", "within_cap"))),
]


def run_script(script: str, args: tuple[str, ...], out: Path) -> subprocess.CompletedProcess:
    """The script as a user runs it, with its results going to `out`."""
    command = [sys.executable, str(BENCHMARKS / f"{script}.py"), *(arg.format(out=out) for arg in args)]
    return subprocess.run(command, cwd=ROOT, env=os.environ | {"TENSILE_BENCH_RESULTS": str(out)}, capture_output=True,
                          text=True, timeout=300)


def committed_files() -> dict[str, tuple[int, int]]:
    return {path.name: (path.stat().st_mtime_ns, path.stat().st_size) for path in COMMITTED.iterdir()}


def missing(value: object, path: tuple[str, ...]) -> list[str]:
    """The key paths under `value` that `path` names and it lacks (EVERY: each item, at least one)."""
    if not path:
        return []
    key, rest = path[0], path[1:]
    if key == EVERY:
        items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
        if not items:
            return [f"{EVERY} (none)"]
        return [f"{EVERY}/{gap}" for item in items for gap in missing(item, rest)]
    if not isinstance(value, dict) or key not in value:
        return [key]
    return [f"{key}/{gap}" for gap in missing(value[key], rest)]


def smoke_run(smoke: Smoke, out: Path) -> None:
    before = committed_files()
    started = time.perf_counter()
    done = run_script(smoke.script, smoke.args, out)
    seconds = time.perf_counter() - started
    assert done.returncode == 0, f"{smoke.id} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert committed_files() == before, "the run wrote into benchmarks/results/"
    written = [sorted(out.glob(pattern)) for pattern in smoke.writes]
    assert all(len(found) == 1 for found in written), f"{smoke.writes} -> {written} in {seconds:.0f} s"
    result = json.loads(written[0][0].read_text())
    gaps = [gap for path in smoke.reads for gap in missing(result, path)]
    assert not gaps, f"{written[0][0].name} lacks {gaps}"


@pytest.mark.slow
@pytest.mark.parametrize("smoke", SMOKES, ids=lambda smoke: smoke.id)
def test_the_script_runs_at_its_smallest_setting_and_writes_what_its_readme_row_reads(smoke: Smoke,
                                                                                      tmp_path: Path) -> None:
    smoke_run(smoke, tmp_path / "results")  # a folder not made yet, as a user names one


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("smoke", CUDA_ONLY, ids=lambda smoke: smoke.id)
def test_a_cuda_only_script_runs_small_on_a_gpu(smoke: Smoke, tmp_path: Path) -> None:
    smoke_run(smoke, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("smoke", CUDA_ONLY, ids=lambda smoke: smoke.id)
def test_a_cuda_only_script_says_it_needs_cuda_where_there_is_none(smoke: Smoke, tmp_path: Path) -> None:
    """Its only path without CUDA: its options, then a refusal that names the cause, and no file written."""
    assert run_script(smoke.script, ("--help",), tmp_path).returncode == 0
    done = run_script(smoke.script, smoke.args, tmp_path)
    assert done.returncode == 1 and "no CUDA device is visible" in done.stderr, done.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_every_benchmark_script_has_a_smoke_run() -> None:
    """A new script gets a smoke run here (or a test of its own, named in TESTED_ELSEWHERE)."""
    scripts = {path.stem for path in BENCHMARKS.glob("*.py")} - {"bench_results"}
    smoked = {smoke.script for smoke in [*SMOKES, *CUDA_ONLY]}
    assert scripts == smoked | set(TESTED_ELSEWHERE)
    assert all(path.exists() for path in TESTED_ELSEWHERE.values())


def test_the_results_folder_is_benchmarks_results_unless_the_environment_names_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default is what gpu_session.sh and the README rely on: the committed folder."""
    spec = importlib.util.spec_from_file_location("bench_results", BENCHMARKS / "bench_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("TENSILE_BENCH_RESULTS", raising=False)
    assert module.results_dir() == COMMITTED
    monkeypatch.setenv("TENSILE_BENCH_RESULTS", str(tmp_path))
    assert module.results_dir() == tmp_path
