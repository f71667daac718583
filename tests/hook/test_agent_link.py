"""The hook's link to its node agent at the edges: the agent's word that a GPU cannot fit its jobs reaches the user,
and an agent that does not answer costs the exit at most `agent_timeout` seconds, saying what was not delivered."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import torch

from tests.support import tracing_models
from tests.support.agent_harness import free_port, get, wait_for
from tensile.knobs import memory_text
from tensile.agent_client import AgentClient
from tensile.forecast import trace_workload
from tensile.workload import Workload
from tensile_hook import activate, deactivate
from tensile_hook.agent_link import AgentLink
from tensile_hook.memory_cap import MemoryCap
from tensile_hook.plan_source import local_planner
from tensile_hook.report import HookReport, IterationStats
from tensile_hook.settings import HookSettings
from tests.support.bit_identity import assert_identical
from tests.support.training import STEPS, fit_model, state_of

pytestmark = pytest.mark.usefixtures("deterministic")

CPU = torch.device("cpu")


@pytest.mark.slow
def test_the_agents_cannot_fit_verdict_is_said_once_with_the_guards_budget(agent_server):
    """A GPU too small for the job: the agent plans the best it can (fits false) and holds the job to its share; the
    hook says so in its report and log, once, with the budget its guard keeps. Before, only /v1/jobs said it."""
    plain = state_of(*fit_model(tracing_models.views, 4, STEPS + 2))
    agent = agent_server(simulate=["tiny:96KiB"], context_bytes=0)
    settings = HookSettings(job="ns/nofit", agent_url=agent.url, agent_wait=30.0, agent_interval=0.05, agent_timeout=0.5,
                            agent_max_backoff=0.3)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2), local_planner(settings, CPU)).start()
    executor = activate(settings, planner=link.planner, device=CPU, listener=link.listener)
    try:
        hooked = state_of(*fit_model(tracing_models.views, 4, STEPS + 2))
    finally:
        deactivate()
        link.close()
    assert_identical(plain, hooked)
    report = executor.report
    said = [m for m in report.messages if "the node agent cannot fit this GPU's jobs" in m]
    assert len(said) == 1, report.messages
    assert report.plan_source == "agent" and report.memory_budget_bytes is not None
    assert f"the budget guard keeps this job under {memory_text(report.memory_budget_bytes)}" in said[0]


def _hung_agent() -> tuple[str, socket.socket]:
    """A server that accepts connections and never answers (an agent hung in a long pause)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(server.accept()[0]) for _ in iter(int, 1)], daemon=True).start()
    return f"http://127.0.0.1:{server.getsockname()[1]}", server


def test_an_agent_that_does_not_answer_costs_the_exit_at_most_the_timeout(caplog, tiny_workload):
    """The link's thread is stuck in a call to an agent that accepted the connection and never answers: the exit waits
    for it at most `agent_timeout` seconds in all (it was 7.7 s: a join of 5 s, then retries) and says what was lost."""
    url, server = _hung_agent()
    settings = HookSettings(job="ns/hung", agent_url=url, agent_timeout=1.0, agent_interval=0.05)
    link = AgentLink.from_env(settings, environ={"TENSILE_AGENT": url, "TENSILE_JOB": settings.job}).start(tiny_workload())
    try:
        link.listener(IterationStats(0, "recording"), HookReport("ns/hung", "cpu"))
        time.sleep(0.2)  # the thread is in its registration call now
        with caplog.at_level(logging.WARNING, logger="tensile.hook"):
            started = time.monotonic()
            link.close()
            seconds = time.monotonic() - started
    finally:
        server.close()
    assert seconds < settings.agent_timeout + 0.5, seconds
    assert "not delivered to the node agent at exit" in caplog.text
    assert "the figures of the last 1 iterations" in caplog.text and "the unregistration" in caplog.text


def test_an_agent_that_is_gone_costs_the_exit_nothing(caplog, tiny_workload):
    """Nothing listens: the calls fail at once, and the exit says what did not go out."""
    url = f"http://127.0.0.1:{free_port()}"
    settings = HookSettings(job="ns/gone", agent_url=url, agent_timeout=1.0, agent_interval=0.05)
    link = AgentLink.from_env(settings, environ={"TENSILE_AGENT": url, "TENSILE_JOB": settings.job}).start(tiny_workload())
    link.listener(IterationStats(0, "recording"), HookReport("ns/gone", "cpu"))
    time.sleep(0.2)  # the thread has tried its registration: the process trains
    with caplog.at_level(logging.WARNING, logger="tensile.hook"):
        started = time.monotonic()
        link.close()
        seconds = time.monotonic() - started
    assert seconds < 0.5, seconds
    assert "not delivered to the node agent at exit" in caplog.text and "the unregistration" in caplog.text


def _registered_allocator(agent_url: str, job: str, environ: dict[str, str], workload: Workload,
                          memory_cap: MemoryCap | None = None) -> tuple[tuple, dict]:
    """What the link's registration of `workload`, from a process with `environ` (and `memory_cap`), told the agent of
    its allocator: (expandable segments, workspace bytes, cap) as sent, and the job's forecast as the agent made it."""
    settings = HookSettings(job=job, agent_url=agent_url, agent_timeout=1.0, agent_interval=0.05)
    process = {"TENSILE_AGENT": agent_url, "TENSILE_JOB": job} | environ
    link = AgentLink.from_env(settings, environ=process, memory_cap=memory_cap).start(workload)
    try:
        link.listener(IterationStats(0, "recording"), HookReport(job, workload.device))  # the process trains
        client = link.client
        wait_for(lambda: client.registered is not None, 30, "the link's registration")
        assert client.registration is not None
        registration = client.registration
        sent = (registration.expandable_segments, registration.cublas_workspace_bytes, registration.allocator_cap_bytes)
        wait_for(lambda: (get(agent_url, f"/v1/jobs/{job}", client.token)[1]["forecast"] or {}).get(
            "scheduled_reserved_peak_bytes") is not None, 30, "the agent's reserved forecast")
        return sent, get(agent_url, f"/v1/jobs/{job}", client.token)[1]["forecast"]
    finally:
        link.close()


@pytest.mark.parametrize(("variable", "setting", "expandable"), [
    ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True", True),
    ("PYTORCH_ALLOC_CONF", "expandable_segments:False", False),
    (None, None, False),  # PyTorch's default
])
def test_the_registration_tells_the_agent_whether_the_allocator_expands_its_segments(agent_server, variable, setting,
                                                                                      expandable):
    """Read from the process's environment as PyTorch reads it; a CPU job has no cuBLAS workspace."""
    agent = agent_server()
    environ = {variable: setting} if variable else {}
    workload = trace_workload("examples/tiny_mlp.py:build", 4, device="cpu")
    sent, forecast = _registered_allocator(agent.url, "ns/allocator", environ | {"CUBLAS_WORKSPACE_CONFIG": ":4096:3"},
                                           workload)
    assert sent == (expandable, 0, None)  # no memory cap: none told
    assert (forecast["expandable_segments"], forecast["cublas_workspace_bytes"]) == sent[:2]


def test_the_registration_tells_the_agent_the_allocators_cap(agent_server, tiny_workload):
    """The cap sitecustomize set: the agent is told the caching allocator's share of it (the admitted size less the
    context), what the process's reserved peak runs up against."""
    cap = MemoryCap(cap_bytes=2 * 2**30, context_bytes=2**29, allocator_bytes=3 * 2**29, device=0,
                    device_bytes=16 * 2**30, fraction=3 / 32)
    sent, _ = _registered_allocator(agent_server().url, "ns/capped", {}, tiny_workload(), cap)
    assert sent == (False, 0, 3 * 2**29)


def test_the_workspace_is_sized_by_the_device_the_training_thread_works_on(agent_server, tiny_workload, monkeypatch):
    """CUDA's current device is per thread: the link's own thread would read device 0, an A6000 here, where the
    training works on device 1, an H100 (a stand-in for torch.cuda says which thread asks)."""
    trainer = threading.get_ident()
    capability = {0: (8, 6), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1 if threading.get_ident() == trainer else 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: capability[torch.cuda.current_device() if device is None else device])
    sent, _ = _registered_allocator(agent_server().url, "ns/second-gpu", {}, tiny_workload())
    assert sent == (False, 32 * 2**20, None)


def test_a_job_that_has_not_started_cuda_is_not_made_to(monkeypatch):
    """Asking for the current device starts CUDA (a context on GPU 0) in a job that trains on the CPU."""
    from tensile_hook.allocator_settings import training_device

    def started() -> int:
        raise AssertionError("CUDA started by the hook")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", started)
    assert training_device() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_jobs_registration_carries_its_cublas_workspace_size(agent_server, tiny_workload):
    """CUBLAS_WORKSPACE_CONFIG's :SIZE:COUNT pairs, whatever the GPU's compute capability; unset, its default."""
    agent = agent_server()
    sent, _ = _registered_allocator(agent.url, "ns/cuda-set", {"CUBLAS_WORKSPACE_CONFIG": ":4096:3"}, tiny_workload())
    assert sent == (False, 12 * 2**20, None)
    major, _ = torch.cuda.get_device_capability()
    sent, _ = _registered_allocator(agent.url, "ns/cuda-default", {}, tiny_workload())
    assert sent == (False, 32 * 2**20 if major in (9, 10, 12) else 8 * 2**20 + 128 * 2**10, None)
