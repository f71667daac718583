"""benchmarks/colocation.py at a tiny size: several jobs on one simulated device, alone, capped at declared shares,
and under Tensile through local mode's agent and runner."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.support.agent_harness import ROOT

JOBS = "examples/tiny_mlp.py:build@64,examples/tiny_mlp.py:build@512"


@pytest.mark.slow
def test_tensile_runs_every_job_at_once_where_declared_shares_lose_some(tmp_path):
    out = tmp_path / "colocation.json"
    done = subprocess.run([sys.executable, "benchmarks/colocation.py", "--jobs", JOBS, "--steps", "4", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"device", "date", "command", "capacity_bytes", "jobs", "policies"} <= set(result)
    assert result["device"] == "cpu" and [j["batch_size"] for j in result["jobs"]] == [64, 512]
    assert set(result["policies"]) == {"alone", "declared", "tensile"}
    capacity = result["capacity_bytes"]
    assert max(j["vanilla_peak_bytes"] for j in result["jobs"]) <= capacity < sum(j["vanilla_peak_bytes"]
                                                                                   for j in result["jobs"])
    for name, policy in result["policies"].items():
        assert {"seconds", "at_once", "out_of_memory", "used_over_time", "peak_used_bytes", "jobs"} <= set(policy), name
        for job in policy["jobs"]:
            assert {"peak_bytes", "reserved_peak_bytes", "iteration_seconds", "slowdown", "out_of_memory"} <= set(job)
    alone, declared, tensile = (result["policies"][name] for name in ("alone", "declared", "tensile"))
    assert alone["out_of_memory"] == 0 and alone["at_once"] == 1
    assert declared["out_of_memory"] >= 1  # an equal share is below a job's vanilla peak
    assert tensile["out_of_memory"] == 0 and tensile["at_once"] == 2
    assert all(job["completed_steps"] == 4 and job["reserved_peak_bytes"] >= job["peak_bytes"] > 0
               for job in tensile["jobs"])
    assert tensile["peak_used_bytes"] <= capacity
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
