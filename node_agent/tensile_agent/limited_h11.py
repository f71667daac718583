"""uvicorn's h11 protocol with the agent's connection limits (tensile_agent.connections says why)."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from tensile_agent.connections import ConnectionLimits


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a cap on open connections and a deadline on each request head."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # of the head awaited, so far

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.close()
            return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_deadline is not None:  # a head is awaited: h11 bounds one that is incomplete, not one that came whole
            end = data.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else end
            if self._head_bytes > self.limits.max_head_bytes:
                self._head_arrived()
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
                                     b"connection: close\r\n\r\n")
                self.transport.close()
                return
            if end >= 0:
                self._head_bytes = 0
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's head was parsed: its handling is the app's and uvicorn's
            self._head_arrived()

    def on_response_complete(self) -> None:
        before = self.cycle
        super().on_response_complete()  # handles a pipelined request's head, if one came
        if self.cycle is before and not self.transport.is_closing():
            self._await_head()

    def _await_head(self) -> None:
        self._head_arrived()
        self._head_bytes = 0
        self._head_deadline = self.loop.call_later(self.limits.head_seconds, self._head_late)

    def _head_arrived(self) -> None:
        deadline, self._head_deadline = self._head_deadline, None
        if deadline is not None:
            deadline.cancel()

    def _head_late(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()
