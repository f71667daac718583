"""What the operator tells a node agent: a job's knobs changed, a job left, fetch a job's live workload.

Through `tensile.agent_client` (the contract of DESIGN §7), on a worker thread (its client is blocking).
An agent that is unreachable or refuses never stops admission: the call is logged and reported as not
done, and the knobs still reach the hook through the pod's environment when it (re)starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from tensile import agent_client

log = logging.getLogger("tensile.operator.agent")


class AgentLink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, dict]] = []  # (agent, job, knobs): what was forwarded

    async def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.to_thread(function, *args)
        except Exception as exc:  # noqa: BLE001 - an unreachable agent must not stop admission
            log.warning("agent call %s failed: %s", function.__name__, exc)
            return None

    async def update_knobs(self, agent: str | None, job: str, token: str, knobs: dict) -> bool:
        self.sent.append((agent or "", job, dict(knobs)))
        if not agent:
            return False
        return await self._call(agent_client.update_knobs, agent, job, token, knobs) is not None

    async def unregister(self, agent: str | None, job: str, token: str) -> None:
        if agent:
            await self._call(agent_client.unregister, agent, job, token)

    async def live_workload(self, agent: str | None, job: str, token: str):  # type: ignore[no-untyped-def]
        """The workload the job's hook traced live (for a job admitted by its budget), or None."""
        if not agent:
            return None
        return await self._call(agent_client.live_workload, agent, job, token)
