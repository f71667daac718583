"""What the hook takes from its node agent is checked as a plan file is: a bad plan is refused with a message and the
job trains on (bit for bit) on its last good plan or its own; a malformed answer makes the link back off and retry."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import pytest
import torch

from tests.support import tracing_models
from tests.support.agent_harness import wait_for
from tests.support.bit_identity import assert_identical
from tests.support.training import STEPS, fit_model, state_of
from tensile.agent_client import AgentClient
from tensile.agent_contract import PlanResponse
from tensile_hook import activate, deactivate
from tensile_hook.agent_link import AgentLink
from tensile_hook.plan_source import local_planner
from tensile_hook.settings import HookSettings

pytestmark = pytest.mark.usefixtures("deterministic")

CPU = torch.device("cpu")


class _Corrupting(AgentClient):
    """A client whose plan answers are spoiled by `spoil` (an agent gone wrong, or a man in the middle)."""

    def __init__(self, url: str, job: str, spoil) -> None:  # type: ignore[no-untyped-def]
        super().__init__(url, job, max_backoff=0.2)
        self.spoil = spoil
        self.calls = 0
        self.answered = threading.Event()  # a call returned an answer, spoiled or not, rather than raising

    def fetch_plan(self) -> PlanResponse | None:
        self.calls += 1
        answer = self.spoil(super().fetch_plan(), self.calls)
        self.answered.set()
        return answer


def _train(agent_url: str, client: AgentClient, after_step: Callable[[int], None] | None = None,
           ) -> tuple[dict, list[str], str | None]:
    settings = HookSettings(job=client.ref.key, agent_url=agent_url, agent_wait=5.0, agent_interval=0.05,
                            agent_timeout=0.5, agent_max_backoff=0.2)
    link = AgentLink(settings, client, local_planner(settings, CPU)).start()
    executor = activate(settings, planner=link.planner, device=CPU, listener=link.listener)
    try:
        state = state_of(*fit_model(tracing_models.views, 4, STEPS + 2, after_step=after_step))
    finally:
        deactivate()
        link.close()
    return state, executor.report.messages, executor.report.plan_source


def _with_plan(response: PlanResponse | None, **changes) -> PlanResponse | None:  # type: ignore[no-untyped-def]
    if response is None or not response.plan:
        return response
    return dataclasses.replace(response, plan=response.plan | changes)


@pytest.mark.parametrize("spoil, named", [
    (lambda r, _: _with_plan(r, memory_budget_bytes="lots"), "memory_budget_bytes 'lots' is not an amount of memory"),
    (lambda r, _: _with_plan(r, events=[{"job": "j", "kind": "teleport", "tensor": 0, "trigger": 0}]),
     "kind 'teleport' is not one of"),
    (lambda r, _: _with_plan(r, events="none"), "it is no plan"),
])
def test_a_bad_plan_from_the_agent_is_refused_and_the_job_trains_on(agent_server, spoil, named):
    """An unknown event kind or a budget of "lots" from the agent made the hook stand down for the rest of the run."""
    plain = state_of(*fit_model(tracing_models.views, 4, STEPS + 2))
    agent = agent_server(simulate=["a6000:8GiB"])
    hooked, messages, source = _train(agent.url, _Corrupting(agent.url, "ns/victim", spoil))
    assert_identical(plain, hooked)
    refused = [m for m in messages if "is refused" in m]
    assert refused and all(named in m for m in refused), messages
    assert source == "local" and not any("stand" in m for m in messages), messages


def test_a_malformed_answer_makes_the_link_back_off_and_retry(agent_server):
    """One malformed 200 answer ended the hook's agent link for good: the job never got the agent's plan."""
    def malformed_twice(response: PlanResponse | None, calls: int) -> PlanResponse | None:
        if calls <= 2:
            return PlanResponse.from_dict({"status": "planned"})  # raises, as a 200 with a body of the wrong shape does
        return response

    plain = state_of(*fit_model(tracing_models.views, 4, STEPS + 2))
    agent = agent_server(simulate=["a6000:8GiB"])
    client = _Corrupting(agent.url, "ns/retried", malformed_twice)

    def after_step(step: int) -> None:  # training faster than the backoff ended before the link could try again
        if step == 3:  # the job registered at the end of its recorded iterations
            wait_for(client.answered.is_set, 10, "a good answer after the two malformed ones")

    hooked, messages, source = _train(agent.url, client, after_step)
    assert_identical(plain, hooked)
    assert client.calls > 2 and any("the agent link failed (KeyError" in m and "trying again" in m for m in messages), messages
    assert any("the agent link works again" in m for m in messages), messages
    assert source == "agent", messages
