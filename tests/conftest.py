"""Fixtures that tests of several parts use (tests/<part>/conftest.py holds those of one part): traces are cached
for the whole test session (tracing costs ~0.5-2 s each)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tensile.forecast import trace_workload
from tensile.workload import Workload


def pytest_configure(config: pytest.Config) -> None:
    """Each worker of `pytest -n N` (and the processes its tests start) computes on its share of the cores. With every
    process on as many threads as there are cores, OpenMP's threads spin waiting for one another on cores the other
    workers hold: on 2 cores the suite took 13 min with two threads a worker, 6 min with one (docs/architecture.md).
    OpenMP reads OMP_NUM_THREADS once, when a process starts, for every thread of it (torch.set_num_threads sets only
    the calling thread's): the controller sets it here, before it starts the workers, which inherit it."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT") or getattr(config.option, "numprocesses", None) or 1
    cores = os.cpu_count() or 1
    threads = max(1, cores // int(workers)) if str(workers).isdigit() else 1  # -n auto: a worker per core
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@functools.lru_cache(maxsize=None)
def _cached_trace(model: str, batch_size: int, device: str, optimizer: str, live: bool) -> Workload:
    return trace_workload(model, batch_size, optimizer=optimizer, device=device, live=live)


@pytest.fixture(scope="session")
def traced():
    """traced(model, batch_size, device="cuda", optimizer="adam", live=False) -> Workload, cached per session.

    Callers must not mutate the returned workload (copy it first)."""

    def get(model: str, batch_size: int, device: str = "cuda", optimizer: str = "adam", live: bool = False) -> Workload:
        return _cached_trace(model, batch_size, device, optimizer, live)

    return get


# --- node agent (tests/agent, and the hook, CLI and local-mode tests that serve one) -----------------


@functools.lru_cache(maxsize=None)
def _tiny_workload(batch_size: int) -> Workload:
    return trace_workload("examples/tiny_mlp.py:build", batch_size)


@pytest.fixture(scope="session")
def tiny_workload():
    """tiny_workload(batch_size=4) -> the traced examples/tiny_mlp.py workload (cached; do not mutate)."""

    def get(batch_size: int = 4) -> Workload:
        return _tiny_workload(batch_size)

    return get


@pytest.fixture
def agent_server():
    """A node agent served by uvicorn on 127.0.0.1 in a thread: agent_server(simulate=[...]) -> ThreadedAgent."""
    from tests.support.agent_harness import ThreadedAgent

    started = []

    def make(simulate: list[str] | None = None, **config):  # type: ignore[no-untyped-def]
        server = ThreadedAgent(simulate, **config).__enter__()
        started.append(server)
        return server

    yield make
    for server in started:
        server.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def _agent_client_stays_on_loopback(monkeypatch):
    """Tests may reach servers on this machine only: the agent client refuses any other host here.

    (tests/operator/test_operator.py publishes TensileNodes with an agent address of 10.0.0.1; the operator
    forwards knobs there through tensile.agent_client, which must not leave the machine.)"""
    import ipaddress

    from tensile import agent_client

    original = agent_client.Http._connect

    def loopback_only(self):  # type: ignore[no-untyped-def]
        host = self._host
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConnectionRefusedError(f"tests reach loopback addresses only, not {host}")
        return original(self)

    monkeypatch.setattr(agent_client.Http, "_connect", loopback_only)


@pytest.fixture
def deterministic():  # type: ignore[no-untyped-def]
    """Deterministic algorithms for one test, which bit-identity needs (a module asks for it with
    `pytestmark = pytest.mark.usefixtures("deterministic")`)."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)
