"""The hook's agent path (runtime_hook/agent_link.py) against a real agent on 127.0.0.1: the job registers,
gets its plan, reports what it measured; an agent that dies mid-run costs no correctness, and the hook
registers again when it is back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from agent_harness import ROOT, AgentProcess, free_port, get

import tracing_models
from tensile.agent_client import AgentClient
from tensile.runtime_hook import activate, deactivate
from tensile.runtime_hook.agent_link import AgentLink
from tensile.runtime_hook.plan_source import local_planner
from tensile.runtime_hook.report import HookReport, IterationStats
from tensile.runtime_hook.settings import HookSettings
from test_hook_correctness import assert_identical, deterministic, fit, train  # noqa: F401

SCRIPT = str(ROOT / "examples" / "train_mlp.py")
FAST = {"TENSILE_AGENT_MAX_BACKOFF": "0.3", "TENSILE_AGENT_INTERVAL": "0.1", "TENSILE_AGENT_TIMEOUT": "0.5"}


def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _tensile_run(url: str, job: str, report: Path, *script_args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tensile.cli", "run", "--agent", url, "--job", job, "--report", str(report),
               "--", sys.executable, SCRIPT, *script_args]
    return subprocess.Popen(command, cwd=ROOT, env=os.environ | FAST, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _job(url: str, name: str) -> dict | None:
    status, body = get(url, "/v1/jobs")
    assert status == 200
    return next((j for j in body["jobs"] if j["job"] == name), None)


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-3000:]


def test_the_job_registers_gets_the_agents_plan_and_shows_its_peak(agent_server, tmp_path):
    agent = agent_server()
    report = tmp_path / "report.json"
    proc = _tensile_run(agent.url, "mlp-a", report, "--steps", "40", "--pause", "0.05")
    try:
        _wait(lambda: (j := _job(agent.url, "mlp-a")) is not None and (j["observed"]["peak_bytes"] or 0) > 0, 60, "observations")
        job = _job(agent.url, "mlp-a")
        assert job["status"] == "planned" and job["external"] and job["forecast"]["scheduled_peak_bytes"] > 0
        metrics = get(agent.url, "/metrics")[1]
        line = next(l for l in metrics.splitlines() if l.startswith("tensile_job_observed_peak_bytes{") and 'job="mlp-a"' in l)
        assert float(line.split()[-1]) == job["observed"]["peak_bytes"]
    finally:
        _finish(proc)
    data = json.loads(report.read_text())
    assert data["plan_source"] == "agent" and data["plan_version"] >= 1
    assert any(it["mode"] == "planned" for it in data["iterations"])
    assert _job(agent.url, "mlp-a") is None  # unregistered at exit


@pytest.mark.parametrize(("plan_events", "activations_only", "recompute"), [("auto", True, True), ("all", False, False)])
def test_the_link_asks_the_agent_for_the_events_the_hook_would_plan(agent_server, tiny_workload, plan_events, activations_only,
                                                                    recompute):
    """A CUDA workload under TENSILE_PLAN_EVENTS auto registers activations_only, so the agent's plans stay on
    the native path; `all` asks for every event; TENSILE_RECOMPUTE=false (a TrainingJob's recompute: false)
    registers without recomputes."""
    agent = agent_server()
    workload = tiny_workload()
    assert workload.device == "cuda"
    settings = HookSettings(job="ns/link", plan_events=plan_events, recompute=recompute)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2)).start(workload)
    try:
        _wait(lambda: _job(agent.url, "link") is not None, 30, "the registration")
        job = _job(agent.url, "link")
        assert job["activations_only"] is activations_only and job["recompute"] is recompute
    finally:
        link.close()


def test_the_link_posts_what_tells_the_peak_under_plan_from_the_others(agent_server, tiny_workload):
    """Each iteration's mode and peak source reach the agent: the recorded iterations' vanilla peak and a native
    CPU iteration's forecast (peak_source planned) are no measurement under the plan."""
    agent = agent_server()
    settings = HookSettings(job="ns/link", agent_interval=0.1)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2)).start(tiny_workload())
    report = HookReport("ns/link", "cpu")
    try:
        _wait(lambda: _job(agent.url, "link") is not None, 30, "the registration")
        for stats in (IterationStats(0, "recording", peak_bytes=9_000_000), IterationStats(1, "planned", 1, peak_bytes=6_000_000),
                      IterationStats(2, "planned", 1, peak_bytes=7_000_000, peak_source="planned")):
            link.listener(stats, report)
        _wait(lambda: _job(agent.url, "link")["observed"]["iterations"] == 3, 30, "the posted figures")
        observed = _job(agent.url, "link")["observed"]
        assert (observed["peak_bytes"], observed["planned_peak_bytes"]) == (9_000_000, 6_000_000)
    finally:
        link.close()


def test_the_agent_dies_mid_run_training_is_unharmed_and_registers_again(tmp_path):
    plain, hooked, report = tmp_path / "plain.pt", tmp_path / "hooked.pt", tmp_path / "report.json"
    steps = ["--steps", "80", "--pause", "0.05"]
    reference = subprocess.Popen([sys.executable, SCRIPT, *steps[:2], "--save", str(plain)], cwd=ROOT)
    agent = AgentProcess(simulate=("a6000:48GiB",)).start()
    proc = _tensile_run(agent.url, "mlp-b", report, *steps, "--save", str(hooked))
    try:
        _wait(lambda: (j := _job(agent.url, "mlp-b")) is not None and j["observed"]["iterations"] > 0, 60, "the job's first figures")
        agent.kill()
        time.sleep(0.5)
        assert proc.poll() is None, "training stopped with the agent"
        agent.start()
        _wait(lambda: _job(agent.url, "mlp-b") is not None, 30, "re-registration")
    finally:
        _finish(proc)
        agent.stop()
        assert reference.wait(120) == 0
    a, b = torch.load(plain), torch.load(hooked)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    data = json.loads(report.read_text())
    assert any("unreachable" in m for m in data["messages"]), data["messages"]
    assert any("registered again" in m for m in data["messages"]), data["messages"]
    assert data["stood_down"] is None


def test_no_agent_at_all_falls_back_to_the_local_planner_at_once():
    """Nothing listens at the URL: iteration 1 does not wait out agent_wait, the plan comes from the
    local planner, training is bit-identical and the report says why."""
    plain, _ = train(tracing_models.views, 4)
    settings = HookSettings(job="job", agent_url=f"http://127.0.0.1:{free_port()}", agent_wait=30.0,
                            agent_timeout=0.5, agent_max_backoff=0.3)
    device = torch.device("cpu")
    link = AgentLink.from_env(settings, local_planner(settings, device), environ={"TENSILE_AGENT": settings.agent_url, "TENSILE_JOB": "job"})
    link.start()
    executor = activate(settings, planner=link.planner, device=device, listener=link.listener)
    try:
        hooked = fit(tracing_models.views, 4)
    finally:
        deactivate()
        link.close()
    assert_identical(plain, hooked)
    report = executor.report
    assert report.plan_source == "local"
    assert any("planning locally" in m for m in report.messages), report.messages
    assert max(it.seconds for it in report.iterations) < 10  # not the 30 s agent_wait
