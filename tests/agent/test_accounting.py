"""What the agent tells hooks and dashboards about a GPU's memory and time: each job's share of a shared GPU
(explorer-57: jobs that could not fit ran unguarded), EOR only from a measured vanilla time, the rounds counted
by reason, silent jobs of the operator's shown, and a GPU-less agent naming its fix."""

from __future__ import annotations

import logging
import re
import time

import pytest
from tests.support.agent_harness import ThreadedAgent, call, get

from tensile.admission import allocator_slack
from tensile.agent_client import AgentClient
from tensile.agent_contract import Measurements, PlanResponse
from tensile.cublas_workspaces import booked_workspace_bytes, cublas_workspace_bytes
from tensile.devices import PRESETS
from tensile_agent.gpus import Inventory
from tensile_agent.server import Agent, AgentConfig, add_arguments, config_from_args

MIB = 2**20
TOKEN = "o" * 32  # an operator's token: the job is not external


def client_of(url: str, job: str, **register: object) -> AgentClient:
    client = AgentClient(url, f"ns/{job}", token=register.pop("token", None), max_backoff=0.2)  # type: ignore[arg-type]
    assert client.register(**register) is not None  # type: ignore[arg-type]
    return client


def planned(server: ThreadedAgent, client: AgentClient, min_version: int = 1) -> PlanResponse:
    server.idle()
    plan = client.wait_for_plan(30, min_version=min_version)
    assert plan is not None and plan.status == "planned", plan
    return plan


def metric_lines(url: str, name: str) -> list[str]:
    text = get(url, "/metrics")[1]
    assert isinstance(text, str)
    return [line for line in text.splitlines() if line.startswith(name + "{")]


@pytest.mark.slow
def test_jobs_a_gpu_cannot_fit_are_each_held_to_a_share_that_keeps_them_within_it(agent_server, tiny_workload):
    """A 10 MiB GPU, two jobs of 6.1 MiB lowest reachable peak each: the agent knew (fits false) but each plan
    carried no budget, so the hooks' guards were off and on a real GPU the two would OOM together. The GPU has room
    for each process's allocator slack on top (no preset: its compute capability is unknown, so the slack is booked
    with the largest cuBLAS workspaces)."""
    workload = tiny_workload()
    slack = allocator_slack(workload, booked_workspace_bytes(0))
    room = 19 * MIB // 2  # for the two jobs' tensors
    server = agent_server([f"small:{room + 2 * slack}"], context_bytes=0, headroom=0.0)
    alone = client_of(server.url, "a", workload=workload)
    first = planned(server, alone)
    assert first.fits is True and first.gpu_share_bytes is None and first.plan_object().memory_budget_bytes is None
    big = 1024 * MIB  # a user's budget above its share: lowered to the share, never the other way
    other = client_of(server.url, "b", workload=workload, memory_budget_bytes=big)
    plans = {"a": planned(server, alone, first.version + 1), "b": planned(server, other)}
    budget = plans["a"].budget_bytes
    assert budget == room  # each process's allocator slack is kept out
    for name, plan in plans.items():
        assert plan.fits is False and "cannot fit" in plan.message, (name, plan.message)
        assert plan.co_planned == ["ns/a", "ns/b"] and plan.gpu_share_bytes
        assert plan.plan_object().memory_budget_bytes == plan.gpu_share_bytes, name  # what the hook's guard holds to
        assert f"share of the GPU is {plan.gpu_share_bytes / MIB:,.1f} MiB" in plan.message
        assert "guard evicts passively" in plan.message  # the share is below the lowest reachable peak
    assert sum(p.gpu_share_bytes or 0 for p in plans.values()) <= budget
    assert plans["b"].knobs is not None and plans["b"].knobs.memory_budget_bytes == big  # the user's knob is kept
    views = {j["job"]: j for j in get(server.url, "/v1/jobs")[1]["jobs"]}
    assert views["a"]["gpu_share_bytes"] == plans["a"].gpu_share_bytes
    budgets = metric_lines(server.url, "tensile_job_memory_budget_bytes")  # the share, not b's own 1 GiB
    for name, plan in plans.items():
        assert any(f'job="{name}"' in line and float(line.split()[-1]) == pytest.approx(plan.gpu_share_bytes, rel=1e-6)
                   for line in budgets), budgets


def test_jobs_sharing_a_gpu_that_fits_get_their_peak_and_a_part_of_the_room_left(agent_server, tiny_workload):
    """A share is at least the job's scheduled peak when the GPU fits its jobs; a budget of the job's own stays its
    guard's then, even above its share (the joint plan holds it below; lowering it by rounding bytes made hooks
    with a budget of their own refuse the plan's), and the plan says nothing of a share. The GPU has room for each
    process's allocator slack on top (the largest cuBLAS workspaces': no preset, no compute capability known)."""
    workload = tiny_workload()
    slack = allocator_slack(workload, booked_workspace_bytes(0))
    server = agent_server([f"small:{60 * MIB + 2 * slack}"], context_bytes=0, headroom=0.0)
    own = 40 * MIB
    clients = {name: client_of(server.url, name, workload=workload, **extra)
               for name, extra in (("free", {}), ("budgeted", {"memory_budget_bytes": own}))}
    free, budgeted = (planned(server, client) for client in clients.values())  # after the round of both
    assert free.co_planned == budgeted.co_planned == ["ns/free", "ns/budgeted"]
    assert free.fits is True and budgeted.fits is True
    peak = free.plan_object().forecast.scheduled_peak_bytes
    assert free.gpu_share_bytes and free.gpu_share_bytes > peak and free.plan_object().memory_budget_bytes == free.gpu_share_bytes
    assert "share of the GPU" in free.message
    assert budgeted.gpu_share_bytes and peak < budgeted.gpu_share_bytes < own
    assert budgeted.plan_object().memory_budget_bytes == own and "share of the GPU" not in budgeted.message
    assert free.gpu_share_bytes + budgeted.gpu_share_bytes <= free.budget_bytes


def test_a_plan_response_from_an_older_agent_without_a_share_still_parses():
    body = {"job": "a", "namespace": "ns", "gpu": "g", "version": 1, "status": "planned", "message": "fits", "round": 1,
            "co_planned": ["ns/a"], "fits": True, "budget_bytes": 10, "plan": None}
    assert PlanResponse.from_dict(body).gpu_share_bytes is None
    assert PlanResponse.from_dict(body | {"gpu_share_bytes": 5}).gpu_share_bytes == 5


def test_the_observed_eor_is_exported_only_against_a_vanilla_time_the_hook_measured(agent_server, tiny_workload):
    """Without a vanilla time the agent divided the iteration time by itself less stalls: ~1.0 whatever the plan cost."""
    server = agent_server()
    client = client_of(server.url, "a", workload=tiny_workload())
    planned(server, client)

    def observed() -> dict:
        return get(server.url, "/v1/jobs/ns/a", client.token)[1]["observed"]

    assert client.post_measurements(Measurements(iterations=2, iteration_seconds=0.3, stall_seconds=0.01)) is not None
    assert observed()["eor"] is None and observed()["iteration_seconds"] == 0.3
    assert metric_lines(server.url, "tensile_job_observed_eor_ratio") == []
    forecast = metric_lines(server.url, "tensile_job_forecast_eor_ratio")
    assert len(forecast) == 1 and float(forecast[0].split()[-1]) >= 1.0  # the plan's own prediction, named so
    assert client.post_measurements(Measurements(iterations=1, iteration_seconds=0.3, vanilla_iteration_seconds=0.2))
    assert observed()["eor"] == pytest.approx(1.5)
    assert client.post_measurements(Measurements(iterations=1, iteration_seconds=0.25))  # against the vanilla time it sent
    assert observed()["eor"] == pytest.approx(1.25)
    assert [float(line.split()[-1]) for line in metric_lines(server.url, "tensile_job_observed_eor_ratio")] == [pytest.approx(1.25)]


def test_the_round_after_the_last_job_left_is_counted_as_an_unregister(agent_server, tiny_workload):
    server = agent_server()
    client = client_of(server.url, "a", workload=tiny_workload())
    planned(server, client)
    client.unregister()
    server.idle()
    counts = {re.search(r'reason="(\w+)"', line)[1]: float(line.split()[-1])  # type: ignore[index]
              for line in metric_lines(server.url, "tensile_agent_replans_total")}
    assert counts["register"] == 1 and counts["unregister"] == 1


def test_a_simulated_gpus_used_memory_is_the_observed_peaks_plus_the_context_it_is_simulated_with(agent_server, tiny_workload):
    """`tensile local` simulates a GPU with no context (CPU jobs); `tensile agent --simulate-gpu` keeps the preset's
    unless --context-bytes says otherwise: the rounds reserve it, and the used memory counts it alike."""
    for context, expected in ((None, 600 * MIB), (0, 0)):
        server = agent_server(["a6000:48GiB"], context_bytes=context)
        client = client_of(server.url, "a", workload=tiny_workload())
        planned(server, client)
        assert client.post_measurements(Measurements(iterations=1, peak_bytes=5 * MIB)) is not None
        (gpu,) = get(server.url, "/v1/gpus")[1]["gpus"]
        assert gpu["context_bytes"] == expected and gpu["used_bytes"] == 5 * MIB + expected
        slack = allocator_slack(tiny_workload(), cublas_workspace_bytes(PRESETS["a6000"].compute_capability_major, {}))
        assert gpu["last_round"]["budget_bytes"] == gpu["capacity_bytes"] - expected - slack
    text = get(server.url, "/metrics")[1]
    assert "# HELP tensile_gpu_used_bytes Used memory from NVML (simulated GPUs: the jobs' observed peaks plus the per-job context" in text


@pytest.mark.parametrize("preset", ["a6000", "h100"])
def test_a_rounds_budget_keeps_out_the_slack_with_the_cublas_workspaces_of_the_gpus_compute_capability(
        agent_server, tiny_workload, preset):
    """An A6000's processes hold cuBLAS workspaces of 8 MiB + 128 KiB, an H100's of 32 MiB: the round keeps out the
    allocator's slack with those of the GPU, as the operator books it."""
    server = agent_server([f"{preset}:48GiB"], context_bytes=0)
    planned(server, client_of(server.url, "a", workload=tiny_workload()))
    (gpu,) = get(server.url, "/v1/gpus")[1]["gpus"]
    assert gpu["compute_capability_major"] == PRESETS[preset].compute_capability_major
    workspace = cublas_workspace_bytes(PRESETS[preset].compute_capability_major, {})
    assert workspace == {"a6000": 8 * MIB + 128 * 1024, "h100": 32 * MIB}[preset]
    assert gpu["last_round"]["budget_bytes"] == gpu["capacity_bytes"] - allocator_slack(tiny_workload(), workspace)


def test_a_silent_job_of_the_operators_is_kept_shown_and_said_once(agent_server, tiny_workload, caplog):
    """A tokened job is the operator's: it books the job's share until the pod goes, so expiry keeps it; but a pod
    killed -9 left it silent for good, and nothing showed it."""
    server = agent_server(expire_silent=0.3)
    placed = client_of(server.url, "placed", workload=tiny_workload(), token=TOKEN)
    planned(server, placed)
    with caplog.at_level(logging.WARNING, logger="tensile_agent.service"):
        time.sleep(1.2)  # four expiry checks
    jobs = {j["job"]: j for j in get(server.url, "/v1/jobs")[1]["jobs"]}
    assert jobs["placed"]["external"] is False and jobs["placed"]["silent_seconds"] > 0.9
    said = [r.getMessage() for r in caplog.records if "ns/placed" in r.getMessage()]
    assert len(said) == 1 and "kept" in said[0], said
    (line,) = metric_lines(server.url, "tensile_job_silent_seconds")
    assert 'job="placed"' in line and float(line.split()[-1]) > 0.9
    assert placed.fetch_plan() is not None  # a call: silent no more
    assert get(server.url, "/v1/jobs/ns/placed", TOKEN)[1]["silent_seconds"] < 0.3


def test_an_agent_without_gpus_says_how_to_simulate_one(caplog):
    """`tensile local` simulates a GPU by itself; a plain `tensile agent` refused every job with NVML's reason alone."""
    reason = "NVML library not found: no NVIDIA driver on this node, so no GPUs"
    agent = Agent(AgentConfig(planning="thread"), inventory=Inventory([], reason))
    with caplog.at_level(logging.WARNING, logger="tensile_agent"):
        agent.start()
        agent.stop()
    (warning,) = [r.getMessage() for r in caplog.records if "--simulate-gpu" in r.getMessage()]
    assert reason in warning and "refuses every job" in warning
    with ThreadedAgent(simulate=[]) as server:
        status, body = call(server.url, "POST", "/v1/jobs", {"job": "a", "signature": "abcdef01"})
    assert isinstance(body, dict) and (status, body["code"]) == (404, "no_gpus")
    assert "found no GPU" in body["detail"] and "NVML" in body["detail"]
    example = re.search(r"e\.g\. (--simulate-gpu \S+?)\)", body["detail"])
    assert example, body["detail"]
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(example[1].split())).simulate == ["a6000:48GiB"]  # the option exists as said
