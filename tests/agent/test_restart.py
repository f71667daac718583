"""Kill the agent (SIGKILL) while hooks train: they keep their last plan, register again when it is back,
and the agent's state and metrics come back from them."""

from __future__ import annotations

import threading
import time

import pytest
from tests.support.agent_harness import AgentProcess, get
from tests.support.agent_harness import wait_for as _wait

from tensile.agent_client import AgentClient, update_knobs
from tensile.agent_contract import Measurements


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its new parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.slow
def test_agent_restart_is_survived(tiny_workload):
    workload = tiny_workload()
    agent = AgentProcess().start()
    stop = threading.Event()
    clients = [AgentClient(agent.url, f"train/job-{i}", timeout=1.0, retries=1, backoff=0.02, max_backoff=0.3) for i in range(6)]
    planless_while_down: list[str] = []
    iterations = [0] * len(clients)
    down = threading.Event()

    def train(i: int) -> None:
        client = clients[i]
        client.register(workload=workload, memory_budget_bytes=6 * 2**20)
        while not stop.is_set():  # one "iteration": fetch at the boundary, run, report
            plan, _ = client.poll()
            if down.is_set() and plan is None:
                planless_while_down.append(client.ref.key)
            time.sleep(0.02)
            iterations[i] += 1
            client.post_measurements(Measurements(plan_version=client.plan_version, peak_bytes=4_000_000 + i,
                                                  iteration_seconds=0.02, swap_out_bytes=10, swap_in_bytes=10))

    threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(len(clients))]
    try:
        for t in threads:
            t.start()
        _wait(lambda: all(c.plan_version >= 1 for c in clients), 60, "first plans")
        planners = agent.children()
        assert planners, "the agent plans in a child process"
        agent.kill()
        down.set()
        before = list(iterations)
        _wait(lambda: all(not c.reachable for c in clients), 20, "clients to notice")
        # taken once no answer can come: before the kill, a re-plan for a neighbour's registration could still arrive
        versions = [c.plan_version for c in clients]
        _wait(lambda: all(n > b + 3 for n, b in zip(iterations, before)), 20, "training to go on")
        assert not planless_while_down
        _wait(lambda: not any(_alive(pid) for pid in planners), 10,
              "the planning process to leave with the killed agent")
        assert all(c.current_plan is not None and c.plan_version == v for c, v in zip(clients, versions))
        down.clear()
        agent.start()
        _wait(lambda: all(c.registrations >= 2 for c in clients), 60, "re-registration")
        _wait(lambda: len(get(agent.url, "/v1/jobs")[1]["jobs"]) == len(clients), 30, "jobs back")
        _wait(lambda: all(j["status"] == "planned" and j["observed"]["iterations"] > 0 for j in get(agent.url, "/v1/jobs")[1]["jobs"]),
              60, "plans and observations back")
        jobs = {j["namespace"] + "/" + j["job"]: j for j in get(agent.url, "/v1/jobs")[1]["jobs"]}
        for client, version in zip(clients, versions):
            assert jobs[client.ref.key]["plan_version"] >= version  # versions go on, they do not restart at 1
            assert client.token and jobs[client.ref.key]["gpu"] == client.registered.gpu
        text = get(agent.url, "/metrics")[1]
        for client in clients:
            assert f'tensile_job_observed_peak_bytes{{gpu="{client.registered.gpu}",job="{client.ref.name}",namespace="train"}}' in text
        assert "tensile_gpu_jobs{gpu=" in text and f"{len(clients)}.0" in text
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        agent.stop()


@pytest.mark.slow
def test_knobs_the_operator_changed_hold_after_an_agent_restart(tiny_workload):
    """The operator PATCHes a running job's knobs (an annotation); the agent restarts and the hook registers
    again: with the knobs that hold now (the plan response carries them), not with those it started with, which
    would give a job whose user had turned recompute off plans with recomputes again."""
    agent = AgentProcess().start()
    client = AgentClient(agent.url, "train/knobbed", timeout=1.0, retries=1, backoff=0.02, max_backoff=0.3)
    try:
        client.register(workload=tiny_workload(), memory_budget_bytes=6 * 2**20)
        _wait(lambda: client.fetch_plan() is not None and client.plan_version >= 1, 60, "the first plan")
        assert client.token is not None
        update_knobs(agent.url, "train/knobbed", client.token, {"memoryBudgetBytes": 5 * 2**20, "maxSwapRate": 0.5,
                                                                  "recompute": False})
        _wait(lambda: (r := client.fetch_plan()) is not None and r.knobs is not None and r.knobs.recompute is False, 60,
              "the new knobs in the plan response")
        assert client.current_plan.memory_budget_bytes == 5 * 2**20  # what the hook's guard holds the job to
        agent.kill()
        agent.start()
        _wait(lambda: client.fetch_plan() is not None and client.registrations >= 2, 60, "re-registration")
        job = next(j for j in get(agent.url, "/v1/jobs")[1]["jobs"] if j["job"] == "knobbed")
        assert (job["memory_budget_bytes"], job["max_swap_rate"], job["recompute"]) == (5 * 2**20, 0.5, False)
    finally:
        agent.stop()
