"""Simulator, baselines, plan updating and `tensile simulate` on small workloads."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.support.dag_workloads import random_workload
from tests.support.docs_tables import documented_keys
from tensile.baselines.capuchin import CapuchinPolicy
from tensile.baselines.vdnn import vdnn_job
from tensile.cli import main
from tensile.commands import CANNOT_FIT
from tensile.compare import compare
from tensile.devices import device_preset
from tensile.latency import LatencyEWMA
from tensile.peak import analyze_vanilla
from tensile.plan_update import change_rate, drifted
from tensile.planner import JobToPlan
from tensile.simulator import SimJob, simulate

DEVICE = dataclasses.replace(device_preset("a6000"), host_link_bandwidth=2e9)


def test_co_running_jobs_slow_each_other_down():
    workload = random_workload(0)
    alone = simulate([SimJob("a", workload)], DEVICE).jobs["a"].steady_iteration_seconds
    together = simulate([SimJob("a", workload), SimJob("b", workload)], DEVICE, overlap=0.0).jobs["a"].steady_iteration_seconds
    assert together == pytest.approx(2 * alone, rel=1e-6)


def test_baselines_run_and_keep_capuchin_near_its_budget():
    workload = random_workload(4)
    vanilla = analyze_vanilla(workload).peak_bytes
    budget = int(0.8 * vanilla)
    capuchin = simulate([CapuchinPolicy("a", workload, budget, DEVICE.host_link_bandwidth).job()], DEVICE).jobs["a"]
    assert capuchin.peak_bytes <= vanilla
    vdnn = simulate([vdnn_job("a", workload)], DEVICE).jobs["a"]
    assert vdnn.swap_out_bytes > 0 and vdnn.peak_bytes <= vanilla


def test_compare_rows_and_gpu_row():
    jobs = [JobToPlan("a", random_workload(1)), JobToPlan("b", random_workload(2))]
    comparison = compare(jobs, DEVICE)
    assert {(r["policy"], r["job"]) for r in comparison.rows} == {(p, j) for p in ("vanilla", "vdnn", "capuchin", "tensile") for j in ("a", "b", "*")}
    tensile = {r["job"]: r for r in comparison.rows if r["policy"] == "tensile"}
    assert tensile["*"]["vanilla_peak_bytes"] == tensile["a"]["vanilla_peak_bytes"] + tensile["b"]["vanilla_peak_bytes"]
    assert tensile["*"]["msr"] > 0 and tensile["*"]["eor"] >= 1.0 - 1e-9


def test_latencies_drifted_past_the_threshold_call_for_a_new_plan():
    """TENSILE IV-E's |s' - s| / s, as the node agent applies it to each job's corrected op latencies."""
    workload = random_workload(6)
    latencies = [op.latency for op in workload.ops]
    for factor, expected in ((1.05, False), (0.95, False), (2.0, True), (0.5, True)):
        ewma = LatencyEWMA(workload, alpha=1.0)  # alpha 1: the newest iteration is the estimate
        ewma.observe_iteration(latencies)
        planned = ewma.corrected_sum()  # s: what the current plan was made with
        ewma.observe_iteration([x * factor for x in latencies])
        assert change_rate(ewma.corrected_sum(), planned) == pytest.approx(abs(factor - 1.0))
        assert drifted(ewma.corrected_sum(), planned) is expected
        assert drifted(ewma.corrected_sum(), planned, threshold=abs(factor - 1.0) + 0.01) is False
    assert not drifted(1.0, 0.0)  # no latencies planned with yet: nothing to drift from


@pytest.mark.slow
def test_simulate_cli_json(capsys, tmp_path):
    code = main(["simulate", "--job", "resnet50:2", "--job", "resnet50:2", "--max-swap-rate", "2=0.5", "--json", "--plot", str(tmp_path)])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan_seconds"] >= 0
    rows = {(r["policy"], r["job"]): r for r in out["rows"]}
    assert set(rows) >= {("tensile", "*"), ("capuchin", "resnet50:2#2"), ("vdnn", "resnet50:2"), ("vanilla", "*")}
    assert set(out["rows"][0]) == {"policy", "job", "vanilla_peak_bytes", "peak_bytes", "msr", "eor", "cbr"}
    assert (tmp_path / "metrics.png").exists() and (tmp_path / "memory_tensile.png").exists()


def test_simulate_cli_bad_input(capsys):
    assert main(["simulate", "--job", "resnet50:2", "--max-swap-rate", "x=2"]) == 2
    assert "max-swap-rate" in capsys.readouterr().err


@pytest.mark.parametrize("job", ["resnet50:abc", "resnet50:-2", "resnet50:0", "examples/tiny_mlp.py:build:x"])
def test_simulate_cli_names_a_bad_batch_not_an_unknown_model(capsys, job):
    assert main(["simulate", "--job", job]) == 2
    assert f"--job '{job}': the batch '{job.rpartition(':')[2]}' must be a positive integer" in capsys.readouterr().err


@pytest.mark.slow
def test_simulate_json_says_whether_the_plan_fits_as_the_text_does(capsys, tmp_path):
    """--json had gpu, latencies, rows and plan_seconds only: no word that the plan could not fit, nor its budget,
    nor where --plot wrote; the text said "cannot fit: the lowest reachable peak is ... above the budget of ..."."""
    job = "examples/tiny_mlp.py:build:8"
    assert main(["simulate", "--job", job, "--memory-budget", "0.01", "--json", "--plot", str(tmp_path)]) == CANNOT_FIT
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["message"].startswith("cannot fit: the lowest reachable peak is "), out["message"]
    assert 0 < out["budget_bytes"] < out["scheduled_peak_bytes"]
    assert out["plots"] and all(p.startswith(str(tmp_path)) and p.endswith(".png") for p in out["plots"])
    assert set(out) == documented_keys("`tensile simulate ... --json` prints")
    assert main(["simulate", "--job", job, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True and out["message"].startswith("fits: ") and out["plots"] == []
    assert main(["simulate", "--job", job, "--json", "--policy", "vanilla,vdnn"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["fits"], out["message"], out["budget_bytes"]) == (None, None, None)
