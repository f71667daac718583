"""What the operator tells a node agent: a job's knobs changed, a job left, fetch a job's live workload.

The agent's client (`tensile.agent_client`, the contract of DESIGN §7) is used when it is installed;
without it (or without an agent address on the TensileNode) these calls are no-ops that say so in
the log, and the knobs still reach the hook through the pod's environment at start.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("tensile.operator.agent")


class AgentLink:
    def __init__(self) -> None:
        try:
            import tensile.agent_client as client  # type: ignore[import-not-found]
        except ImportError:
            client = None
        self._client = client
        self.sent: list[tuple[str, str, dict]] = []  # (agent, job, knobs): what was forwarded

    async def _call(self, name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        function = getattr(self._client, name, None) if self._client else None
        if function is None:
            log.info("agent call %s skipped: tensile.agent_client has no %s", name, name)
            return None
        try:
            return await asyncio.to_thread(function, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an unreachable agent must not stop admission
            log.warning("agent call %s failed: %s", name, exc)
            return None

    async def update_knobs(self, agent: str | None, job: str, token: str, knobs: dict) -> bool:
        self.sent.append((agent or "", job, dict(knobs)))
        if not agent:
            return False
        return await self._call("update_knobs", agent, job, token, knobs) is not None

    async def unregister(self, agent: str | None, job: str, token: str) -> None:
        if agent:
            await self._call("unregister", agent, job, token)

    async def live_workload(self, agent: str | None, job: str, token: str):  # type: ignore[no-untyped-def]
        """The workload the job's hook traced live (for a job admitted by its budget), or None."""
        if not agent:
            return None
        return await self._call("live_workload", agent, job, token)
