"""The agent's server against clients that hold it up, on 127.0.0.1: connections held open idle, a request head sent a
byte at a time, more connections than it keeps, an oversized head. Each is closed in bounded time; a well-behaved
client is served before, during and after."""

from __future__ import annotations

import http.client
import socket
import time

import pytest

from tests.support.agent_harness import ThreadedAgent
from tensile_agent.connections import ConnectionLimits

LIMITS = ConnectionLimits(max_connections=16, head_seconds=0.5, keep_alive_seconds=1)


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` within `within` seconds (what it sends before that is read and dropped)."""
    sock.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True
    return False


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    finally:
        conn.close()


@pytest.fixture
def agent():  # type: ignore[no-untyped-def]
    with ThreadedAgent(["a6000:8GiB"], limits=LIMITS) as server:
        yield server


def test_idle_and_half_sent_connections_are_closed_after_the_head_deadline(agent):
    """2,000 connections held open, idle or sending one header byte at a time, each kept a socket for as long as the
    client liked."""
    idle = [socket.create_connection(("127.0.0.1", agent.port)) for _ in range(4)]
    slow = socket.create_connection(("127.0.0.1", agent.port))
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()
    with pytest.raises(OSError):  # one byte of a header every 0.05 s, never a whole head, until the server closes it
        while time.monotonic() - started < 5:
            slow.sendall(b"X")
            time.sleep(0.05)
    assert time.monotonic() - started < LIMITS.head_seconds + 1.0
    assert all(_closed_by_server(s, 1.0) for s in idle), "idle connections were kept open"
    assert _healthy(agent.port)


def test_connections_past_the_cap_are_closed_at_once_and_the_server_recovers(agent):
    held = [socket.create_connection(("127.0.0.1", agent.port)) for _ in range(LIMITS.max_connections)]
    time.sleep(0.1)
    extra = [socket.create_connection(("127.0.0.1", agent.port)) for _ in range(20)]
    assert all(_closed_by_server(s, 0.3) for s in extra), "connections past the cap were kept"
    for sock in held + extra:
        sock.close()
    time.sleep(0.2)
    assert _healthy(agent.port)


def test_an_oversized_head_is_refused(agent):
    sock = socket.create_connection(("127.0.0.1", agent.port))
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (LIMITS.max_head_bytes + 1024) + b"\r\n\r\n")
    sock.settimeout(2)
    answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]
    assert _closed_by_server(sock, 2)


def test_a_keep_alive_client_is_served_across_requests(agent):
    """The head deadline runs from each response to the next head: a client that sends its requests is never cut."""
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=5)
    try:
        for _ in range(5):
            conn.request("GET", "/healthz")
            response = conn.getresponse()
            response.read()
            assert response.status == 200
            time.sleep(LIMITS.head_seconds / 2)
    finally:
        conn.close()
