"""The limits of the agent's HTTP server: every pod of the node may reach it, so no client may hold it up.

uvicorn bounds concurrent requests (503 past `limit_concurrency`) and the idle time between requests
(`timeout_keep_alive`), but not the number of open connections nor the time a request's head takes to
arrive: 2,000 connections held open, or sending one header byte at a time, each kept a socket and a
protocol object for as long as the client liked. `limited_h11.LimitedH11Protocol` is uvicorn's h11 protocol that
closes a connection past `max_connections` at once and one whose request head has not arrived within
`head_seconds` (of the connection, or of the previous response) or is larger than `max_head_bytes` (431).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 512  # open connections; a request past it is answered 503, a connection past it closed
    head_seconds: float = 10.0  # from a connection (or a response) to its next request's full head
    keep_alive_seconds: int = 5  # an idle connection's life after a response
    max_head_bytes: int = 16 * 1024  # a request line and headers (the agent's requests need a few hundred bytes)

    def uvicorn_settings(self) -> dict[str, Any]:
        """uvicorn.Config's keywords for these limits (uvicorn is imported here: `tensile run` builds the agent's
        command line without it)."""
        from tensile_agent.limited_h11 import LimitedH11Protocol

        protocol = type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": self})
        return {"http": protocol, "limit_concurrency": self.max_connections, "timeout_keep_alive": self.keep_alive_seconds,
                "h11_max_incomplete_event_size": self.max_head_bytes}
