"""What the operator tells a node agent: a job placed (with its forecast), its knobs changed, it left; fetch a
job's live workload.

Through `tensile.agent_client` (the contract of docs/agent.md, "API"), on a worker thread (its client is blocking).
An agent that is unreachable or refuses never stops admission: the call is logged and reported as not
done, and the knobs still reach the hook through the pod's environment when it (re)starts.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tensile import agent_client
from tensile.plan import native_plan_events

if TYPE_CHECKING:
    from tensile_operator.forecasting import JobForecast
    from tensile.workload import Workload

log = logging.getLogger("tensile_operator.agent")
FORWARDED, UNREGISTERED, NOT_FORWARDED = "forwarded", "unregistered", "not forwarded"


class NodeAgentClient:
    """The operator's calls to the node agents (one client for every agent: each call names the agent's URL), each
    with the operator's credential: its service-account token for the audience `tensile` (TENSILE_OPERATOR_TOKEN_FILE,
    a projected token the chart mounts), which agents verify with TokenReview."""

    def __init__(self, credential: agent_client.Credential | None = None) -> None:
        self.sent: list[tuple[str, str, dict]] = []  # (agent, job, knobs): what was forwarded
        self.credential = credential or agent_client.credential_file(os.environ.get("TENSILE_OPERATOR_TOKEN_FILE"))

    async def _call(self, function: Callable[..., Any], *args: Any,
                    expected: Callable[[Exception], bool] = lambda exc: False) -> tuple[Any, Exception | None]:
        """(result, None), or (None, the error): logged unless `expected`, never raised (an unreachable agent
        must not stop admission)."""
        try:
            return await asyncio.to_thread(function, *args), None
        except Exception as exc:  # noqa: BLE001 - an unreachable agent must not stop admission
            if not expected(exc):
                log.warning("agent call %s failed: %s", function.__name__, exc)
            return None, exc

    async def update_knobs(self, agent: str | None, job: str, token: str, knobs: dict) -> str:
        """FORWARDED; UNREGISTERED when the agent does not know the job yet (its hook registers once its pod
        runs, and a job's knobs can change before that); else NOT_FORWARDED (no agent, unreachable, refused)."""
        self.sent.append((agent or "", job, dict(knobs)))
        if not agent:
            return NOT_FORWARDED
        _, error = await self._call(agent_client.update_knobs, agent, job, token, knobs, self.credential,
                                    expected=_unknown_job)
        if error is None:
            return FORWARDED
        return UNREGISTERED if _unknown_job(error) else NOT_FORWARDED

    async def register(self, agent: str, job: str, token: str, gpu: str, forecast: JobForecast, budget: int | None,
                       max_swap_rate: float | None, recompute: bool, plan_events: str) -> bool:
        """The placed job with its forecast workload, before its pod runs; True when the agent took it. It plans with
        the events the pod's hook will (TENSILE_PLAN_EVENTS on the workload's device), so the hook's own
        registration is the same one, not a change to re-plan for."""
        activations_only = native_plan_events(plan_events, forecast.workload.device)
        registered, _ = await self._call(agent_client.register, agent, job, token, gpu, forecast.workload, budget,
                                         max_swap_rate, recompute, activations_only, self.credential)
        return registered is not None

    async def admit(self, agent: str | None, job: str, token: str, gpu: str, pod: str, budget: int | None) -> bool:
        """The job's pod `pod` may register it with the agent of its GPU (by its own credential; it gets `token`), with
        at most `budget` bytes; True when the agent took the admission."""
        if not agent:
            return False
        admitted, _ = await self._call(agent_client.admit, agent, job, token, gpu, pod, budget, self.credential)
        return admitted is not None

    async def unregister(self, agent: str | None, job: str, token: str) -> None:
        if agent:
            await self._call(agent_client.unregister, agent, job, token, self.credential)

    async def live_workload(self, agent: str | None, job: str, token: str) -> Workload | None:
        """The workload the job's hook traced live (for a job admitted by its budget), or None."""
        if not agent:
            return None
        workload, _ = await self._call(agent_client.live_workload, agent, job, token, self.credential)
        return workload


def _unknown_job(error: Exception) -> bool:
    """The agent does not know the job: its hook has not registered (yet)."""
    return isinstance(error, agent_client.AgentError) and error.status == 404 and error.code == "unknown_job"
