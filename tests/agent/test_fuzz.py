"""Fuzz the agent's published OpenAPI schema with schemathesis against a real server: no 5xx, ever.

Bounded: a fixed number of examples per operation (about 30 s here in all). Half of the job-scoped
calls are aimed at a registered job with its token, so the fuzz reaches past the 404 / 401 checks.
"""

from __future__ import annotations

import itertools

import pytest
import schemathesis
from tests.support.agent_harness import ThreadedAgent
from hypothesis import HealthCheck, settings

from tensile.agent_client import AgentClient
from tensile_agent.server import Agent, AgentConfig

schema = schemathesis.openapi.from_dict(Agent(AgentConfig(simulate=["a6000:48GiB"])).app().openapi())
_turn = itertools.count()


@pytest.fixture(scope="module")
def fuzz_target(tiny_workload):
    with ThreadedAgent() as server:
        client = AgentClient(server.url, "fuzz/target", token="f" * 32)
        client.register(workload=tiny_workload())
        client.wait_for_plan(30)
        yield server, client


@schema.parametrize()
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzz_target):
    server, client = fuzz_target
    headers = {}
    if case.path_parameters and "namespace" in case.path_parameters and next(_turn) % 2 == 0:
        case.path_parameters["namespace"], case.path_parameters["job"] = "fuzz", "target"
        headers["X-Tensile-Token"] = client.token
    if case.method == "DELETE":  # keep the target job registered for the rest of the fuzz
        case.path_parameters["job"] = "not-the-target"
    case.call_and_validate(base_url=server.url, headers=headers, checks=[schemathesis.checks.not_a_server_error])
