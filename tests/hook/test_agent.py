"""The hook's agent path (runtime_hook/tensile_hook/agent_link.py) against a real agent on 127.0.0.1: the job registers,
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
from tests.support.agent_harness import ROOT, AgentProcess, free_port, get
from tests.support.agent_harness import agent_job as _job
from tests.support.agent_harness import wait_for as _wait

from tests.support import tracing_models
from tensile.knobs import memory_text
from tensile.agent_client import AgentClient, update_knobs
from tensile.forecast import trace_workload
from tensile.peak import analyze_vanilla
from tensile_hook import activate, deactivate
from tensile_hook.agent_link import AgentLink
from tensile_hook.plan_source import local_planner
from tensile_hook.report import HookReport, IterationStats
from tensile_hook.settings import HookSettings
from tests.support.bit_identity import assert_identical
from tests.support.linked_hook import FAST, SCRIPT, trains
from tests.support.linked_hook import agent_settings as _agent_settings
from tests.support.linked_hook import fit_linked as _fit_linked
from tests.support.linked_hook import live_workload as _live_workload
from tests.support.training import STEPS, fit, fit_model, train
from tests.support.training import import_example as _import_example

pytestmark = pytest.mark.usefixtures("deterministic")


def _tensile_run(url: str, job: str, report: Path, *script_args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tensile.cli", "run", "--agent", url, "--job", job, "--report", str(report),
               "--", sys.executable, SCRIPT, *script_args]
    return subprocess.Popen(command, cwd=ROOT, env=os.environ | FAST, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-3000:]


@pytest.mark.slow
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
    trains()
    try:
        _wait(lambda: _job(agent.url, "link") is not None, 30, "the registration")
        job = _job(agent.url, "link")
        assert job["activations_only"] is activations_only and job["recompute"] is recompute
    finally:
        link.close()


def test_a_process_that_trains_nothing_registers_nothing(agent_server, tiny_workload):
    """A script that starts the training as a process of its own runs the hook too (`tensile run -- ./launch.py`,
    `accelerate launch`): registered with the forecast at its start, it held the job's name under the token the
    agent issued it, and the training's registration was refused. The registration waits for a module call with
    gradients on (a call under no_grad, a launcher's summary of the model, does not train), which a global pre-hook
    catches and then removes (while there, every module call takes PyTorch's slow path); a link that saw none leaves
    no hook behind and unregisters nothing at exit."""
    from torch.nn.modules.module import _global_forward_pre_hooks

    agent = agent_server()
    hooks = dict(_global_forward_pre_hooks)
    settings = HookSettings(job="ns/starter", agent_interval=0.05)

    def link() -> AgentLink:
        return AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2)).start(tiny_workload())

    idle = link()
    with torch.no_grad():  # a launcher's model summary, an evaluation before training: not training yet
        trains()
    time.sleep(0.5)  # ten rounds of the link's thread
    assert _job(agent.url, "starter") is None
    idle.close()
    assert dict(_global_forward_pre_hooks) == hooks
    trainer = link()
    trains()
    assert dict(_global_forward_pre_hooks) == hooks  # gone at the first module call
    try:
        _wait(lambda: _job(agent.url, "starter") is not None, 30, "the trainer's registration")
        starter = link()  # beside the training (in its own process, it would see none of the training's module calls)
        time.sleep(0.5)
        starter.close()  # unregisters nothing: the training's registration stays
        assert (starter.client.registrations, starter._refused) == (0, None)
        assert _job(agent.url, "starter") is not None and trainer.client.registrations == 1
    finally:
        trainer.close()
    assert _job(agent.url, "starter") is None and dict(_global_forward_pre_hooks) == hooks


def test_the_link_posts_what_tells_the_peak_under_plan_from_the_others(agent_server, tiny_workload):
    """Each iteration's mode and peak source reach the agent: the recorded iterations' vanilla peak and a native
    CPU iteration's forecast (peak_source planned) are no measurement under the plan."""
    agent = agent_server()
    settings = HookSettings(job="ns/link", agent_interval=0.1)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2)).start(tiny_workload())
    trains()
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


def test_an_out_of_memory_error_the_guard_retried_reaches_the_agent(agent_server, monkeypatch):
    """An op that runs out of memory (the device full, or the job's memory cap reached) is retried by the guard after
    passive evictions: the retry goes out with its iteration's other figures and the agent totals it (the link sent
    every figure of the iteration but this one, so nothing outside the job's own report ever heard of them)."""
    from tensile_hook.residency import Residency

    plain = fit(tracing_models.views, 4, STEPS)
    agent = agent_server()
    settings = _agent_settings(agent.url, "ns/oom", agent_wait=30.0)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2),
                     local_planner(settings, torch.device("cpu")))
    link.start(_live_workload(tracing_models.views, 4))  # registered from the start: every iteration's figures go out
    run_op, armed, attempts = Residency.run_op, [False], []

    def out_of_memory_once(self, func, args, kwargs):  # type: ignore[no-untyped-def]
        if not armed[0]:
            return run_op(self, func, args, kwargs)
        armed[0] = False

        def first_attempt_fails(*a, **k):  # type: ignore[no-untyped-def]
            attempts.append(func)
            if len(attempts) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return func(*a, **k)

        return run_op(self, first_attempt_fails, args, kwargs)

    monkeypatch.setattr(Residency, "run_op", out_of_memory_once)

    def after_step(step: int) -> None:
        if step == 1:  # the next op runs under the agent's plan, on the dispatch path
            armed[0] = True
        if step == STEPS - 1:  # the iteration of the retry ended before this one began: its figures are at the link
            _wait(lambda: _job(agent.url, "oom")["observed"]["out_of_memory_retries"] > 0, 30, "the retry at the agent")
            assert _job(agent.url, "oom")["observed"]["out_of_memory_retries"] == 1

    hooked, report, _ = _fit_linked(link, settings, STEPS, after_step)
    assert len(attempts) == 2 and sum(it.out_of_memory_retries for it in report.iterations) == 1
    assert report.plan_source == "agent" and report.iterations[2].mode == "planned"
    assert_identical(plain, hooked)


def test_the_cap_sitecustomize_set_reaches_the_agent(agent_server, monkeypatch):
    """sitecustomize hands activate_from_env the cap it set on the process's CUDA memory: the link's registration
    tells the agent its caching allocator's share, which the job's view then shows."""
    from tensile_hook import lifecycle
    from tensile_hook.memory_cap import MemoryCap

    agent = agent_server()
    for variable, value in (FAST | {"TENSILE_JOB": "ns/capped", "TENSILE_AGENT": agent.url}).items():
        monkeypatch.setenv(variable, value)
    for variable in ("TENSILE_PLAN", "TENSILE_WORKLOAD", "TENSILE_SIGNATURE", "TENSILE_TOKEN", "TENSILE_REPORT"):
        monkeypatch.delenv(variable, raising=False)
    seen: list[int | None] = []

    def after_step(step: int) -> None:
        if step == STEPS - 1:  # registered after iteration 1, unregistered at the end
            _wait(lambda: (job := _job(agent.url, "capped")) is not None and job["allocator_cap_bytes"] is not None,
                  30, "the job's cap at the agent")
            seen.append(_job(agent.url, "capped")["allocator_cap_bytes"])

    lifecycle.activate_from_env(MemoryCap(2**30, 2**28, 3 * 2**28, 0, 2**32, 0.1875))
    try:
        fit_model(tracing_models.views, 4, STEPS, after_step=after_step)
    finally:
        lifecycle.deactivate()
    assert seen == [3 * 2**28]


@pytest.mark.slow
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
    assert_identical(torch.load(plain), torch.load(hooked))
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
    hooked, report, seconds = _fit_linked(link.start(), settings)
    assert seconds < 20  # not the 30 s agent_wait
    assert_identical(plain, hooked)
    assert report.plan_source == "local"
    assert any("planning locally" in m for m in report.messages), report.messages


def test_a_plan_the_agent_made_while_the_job_recorded_is_taken_at_the_match(agent_server):
    """Registered with its forecast workload (so in the cluster and in local mode), the job has the agent's plan
    before its first iterations end. Taken at iteration 0's end, where the executor, not matched yet, dropped it, the
    plan was lost: the match then waited out agent_wait for a newer version and planned
    locally (`tensile local`'s second job said so at every run)."""
    plain, _ = train(tracing_models.views, 4)
    device, agent = torch.device("cpu"), agent_server()
    settings = _agent_settings(agent.url, "ns/early", agent_wait=30.0)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2), local_planner(settings, device))
    link.start(_live_workload(tracing_models.views, 4))
    trains()  # iteration 0's first module call
    _wait(lambda: link._plan_ready(), 30, "the agent's plan at the link")  # before iteration 0 ends
    hooked, report, seconds = _fit_linked(link, settings)
    assert seconds < 20  # not the 30 s agent_wait
    assert_identical(plain, hooked)
    assert (report.plan_source, report.plan_version, report.signature_match) == ("agent", 1, True)
    assert not any("gave no plan" in m for m in report.messages), report.messages
    assert [it.mode for it in report.iterations[2:]] == ["planned"] * (STEPS - 2)


def test_a_pod_the_operator_registered_takes_its_forecast_from_the_agent(agent_server):
    """The operator registers a job it places with its forecast workload and gives the pod only the forecast's
    signature (TENSILE_SIGNATURE): the hook fetches that workload from the agent and registers with it (the
    same registration, with its allocator's settings added: nothing re-planned), so the agent's plan is at the link before iteration 0 ends and
    applies from the match, as with TENSILE_WORKLOAD. Before, the hook never read TENSILE_SIGNATURE and
    registered the live workload after iteration 1: its first plan came an iteration later, or not within
    agent_wait."""
    plain, _ = train(tracing_models.views, 4)
    device, agent, forecast = torch.device("cpu"), agent_server(), _live_workload(tracing_models.views, 4)
    token = "operator-made-token-0123"
    admitted = AgentClient(agent.url, "ns/placed", token=token).register(workload=forecast)
    assert admitted is not None and admitted.created
    settings = HookSettings(job="ns/placed", agent_url=agent.url, agent_wait=30.0, agent_interval=0.05,
                            agent_timeout=0.5, agent_max_backoff=0.3, token=token, signature=forecast.signature,
                            latency_sample_every=0)  # as _agent_settings
    client = AgentClient(agent.url, settings.job, token=token, max_backoff=0.2)
    link = AgentLink(settings, client, local_planner(settings, device)).start()
    trains()  # iteration 0's first module call
    _wait(lambda: link._plan_ready(), 30, "the agent's plan at the link")  # before iteration 0 ends
    hooked, report, seconds = _fit_linked(link, settings)
    assert seconds < 20  # not the 30 s agent_wait
    assert_identical(plain, hooked)
    assert client.registered is not None and not client.registered.created  # the operator's registration, kept
    assert (report.plan_source, report.plan_version, report.signature_match) == ("agent", 1, True), report.messages
    assert [it.mode for it in report.iterations[2:]] == ["planned"] * (STEPS - 2)


def test_a_job_running_guarded_takes_the_agents_plan_when_it_comes(agent_server):
    """No plan at the match (the agent had none within agent_wait, the fallback none either): the job runs
    guarded, and the agent's plan, when it comes, applies from the next iteration (it was dropped: the
    executor took newer plans only in place of one it had)."""
    steps = STEPS + 2
    plain = fit(tracing_models.views, 4, steps)
    agent = agent_server()
    settings = _agent_settings(agent.url, "ns/late", agent_wait=0.0)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2), lambda live, budget: None).start()

    def after_step(step: int) -> None:
        if step == 2:  # the plan is at the link before the last iterations start
            _wait(lambda: link._plan_ready(), 30, "the agent's plan at the link")

    hooked, report, _ = _fit_linked(link, settings, steps, after_step)
    assert_identical(plain, hooked)
    assert any("returned no plan: running guarded" in m for m in report.messages), report.messages
    modes = [it.mode for it in report.iterations[2:]]
    assert modes[-1] == "planned" and modes == sorted(modes) and report.plan_source == "agent", modes  # guarded, then planned


@pytest.mark.slow
def test_a_failed_round_after_an_upload_gives_no_plan_for_the_forecast_workload(agent_server):
    """Registered with a stale forecast, the job uploads its live workload and the agent's round for it fails:
    the response keeps the plan made for the forecast, which the hook applied (its events name the other
    workload's tensors). Now the hook plans locally, says why, and the agent hears the signatures differed."""
    plain, _ = train(tracing_models.views, 4)
    live, agent = _live_workload(tracing_models.views, 4), agent_server()
    planner = agent.agent.planning.planner

    def failing(specs, bandwidth, **options):  # type: ignore[no-untyped-def]
        if any(spec.workload.signature == live.signature for spec in specs):
            raise RuntimeError("the planner failed on the live workload")
        return planner(specs, bandwidth, **options)

    agent.agent.planning.planner = failing
    settings = _agent_settings(agent.url, "ns/stale", agent_wait=30.0)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2), local_planner(settings, torch.device("cpu")))
    link.start(_live_workload(tracing_models.views, 2))  # the forecast: another batch size, another signature
    trains()
    _wait(lambda: link._response is not None, 30, "the forecast's plan at the link")

    def after_step(step: int) -> None:  # the agent hears of the mismatch while the job is registered
        if step == STEPS - 1:
            _wait(lambda: _job(agent.url, "stale")["observed"]["signature_match"] is False, 30, "the posted mismatch")

    hooked, report, seconds = _fit_linked(link, settings, after_step=after_step)
    assert seconds < 20  # the failure gives up at once, not after agent_wait
    assert_identical(plain, hooked)
    assert (report.plan_source, report.signature_match) == ("local", False)
    assert any("gave no plan (planning failed" in m for m in report.messages), report.messages


@pytest.mark.slow
def test_a_budget_the_operator_lowers_while_the_job_runs_holds_the_hooks_guard(agent_server):
    """A TrainingJob's budget annotation lowered mid-run reaches the agent as a knob: its re-plan carries the
    budget, and the hook's guard holds the job to it from the next iteration (the agent re-planned and said the
    guard would evict, but the hook never learnt the budget)."""
    steps = STEPS + 3
    plain = fit(tracing_models.views, 4, steps)
    live, agent = _live_workload(tracing_models.views, 4), agent_server()
    budget = analyze_vanilla(live).peak_bytes // 2
    settings = _agent_settings(agent.url, "ns/lowered", agent_wait=30.0)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2), local_planner(settings, torch.device("cpu")))
    link.start(live)

    def after_step(step: int) -> None:
        if step == 2:  # the operator forwards the annotation; the re-plan is at the link before iteration 3 starts
            assert link.client.token is not None
            update_knobs(agent.url, "ns/lowered", link.client.token, {"memoryBudgetBytes": budget})
            _wait(lambda: link._plan_ready(), 30, "the plan for the lowered budget at the link")

    hooked, report, _ = _fit_linked(link, settings, steps, after_step)
    assert_identical(plain, hooked)
    assert report.memory_budget_bytes == budget
    assert any(f"memory budget of {memory_text(budget)}" in m for m in report.messages), report.messages
    assert all(it.peak_bytes <= budget + report.guard_slack_bytes for it in report.iterations[4:])


def _train_mlp(steps: int, batch_size: int = 64) -> None:
    """examples/train_mlp.py's loop: the iteration `tensile forecast --model examples/tiny_mlp.py:build` traces."""
    model, data, loss_fn, make_optimizer = _import_example("tiny_mlp")(batch_size)
    optimizer = make_optimizer(model.parameters())
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, data).backward()
        optimizer.step()


@pytest.mark.slow
def test_the_agents_plan_for_the_forecast_is_applied_to_the_same_tensors_of_the_live_iteration(agent_server):
    """A forecast traced on the meta device has the live iteration's signature but numbers its tensors in its own
    order (and leaves out Adam's step counters): the agent's plan for it, bound with the live iteration's ids,
    swapped and released other tensors than planned. tensile local's mlp-wide applied 2 of its 3 swap-outs and
    1 of its 3 swap-ins and evicted a storage every iteration; the link now maps the plan onto the live ids."""
    forecast = trace_workload("examples/tiny_mlp.py:build", 64, optimizer=None, device="cpu")
    agent = agent_server()
    settings = HookSettings(job="ns/mapped", agent_url=agent.url, agent_wait=30.0, agent_interval=0.05, agent_timeout=0.5,
                            agent_max_backoff=0.3, memory_budget=0.8, latency_sample_every=0)  # as _agent_settings
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2), local_planner(settings, torch.device("cpu")))
    link.start(forecast)
    executor = activate(settings, planner=link.planner, device=torch.device("cpu"), listener=link.listener)
    try:
        _train_mlp(6)
    finally:
        deactivate()
        link.close()
    report = executor.report
    assert (report.plan_source, report.signature_match) == ("agent", True), report.messages
    plan = link.client.current_plan
    planned = {kind: sum(e.kind == kind for e in plan.events) for kind in ("swap_out", "swap_in")}
    assert planned["swap_out"] > 0
    steady = [it for it in report.iterations if it.mode == "planned"][1:]  # the first starts from an unplanned state
    assert steady and all({kind: it.events[kind] for kind in planned} == planned for it in steady), \
        ([it.events for it in steady], planned)
