"""A node agent served for real by uvicorn on 127.0.0.1 (a free port), in a thread or a subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import uvicorn

from tensile_agent.server import Agent, AgentConfig

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, path: str, token: str | None = None, headers: dict | None = None) -> tuple[int, dict | str | None]:
    return call(url, "GET", path, None, token, headers)


def call(url: str, method: str, path: str, body=None, token: str | None = None, headers: dict | None = None,  # type: ignore[no-untyped-def]
         raw: bytes | None = None) -> tuple[int, dict | str | None]:
    send = dict(headers or {})
    data = raw
    if body is not None:
        data = json.dumps(body).encode()
        send.setdefault("Content-Type", "application/json")
    if token:
        send["X-Tensile-Token"] = token
    req = urllib.request.Request(url + path, data=data, method=method, headers=send)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as r:
            payload = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        payload, status = exc.read(), exc.code
    if not payload:
        return status, None
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode()


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    """Poll `predicate` every 50 ms until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def agent_jobs(url: str) -> dict[str, dict]:
    """The agent's jobs by NAMESPACE/JOB."""
    status, body = get(url, "/v1/jobs")
    assert status == 200, body
    return {f"{j['namespace']}/{j['job']}": j for j in body["jobs"]}  # type: ignore[index]


def agent_job(url: str, name: str) -> dict | None:
    """The agent's entry for job `name`, or None while it has none."""
    status, body = get(url, "/v1/jobs")
    assert status == 200
    return next((j for j in body["jobs"] if j["job"] == name), None)


class ThreadedAgent:
    """Agent + uvicorn in a thread of the test process (state inspectable from the test)."""

    def __init__(self, simulate: list[str] | None = None, cluster_api: object | None = None,  # type: ignore[no-untyped-def]
                 authenticator: object | None = None, port: int | None = None, **config) -> None:
        """`port`: a stopped agent's, to restart it at its address (else a free one)."""
        self.port = port or free_port()
        config.setdefault("planning", "thread")  # no child process per test (the restart test runs the default)
        if cluster_api is not None:  # publishing to a (test) cluster: advertise this loopback address
            config.setdefault("advertise", f"http://127.0.0.1:{self.port}")
        self.agent = Agent(AgentConfig(port=self.port, simulate=simulate if simulate is not None else ["a6000:48GiB"], **config),
                           cluster_api=cluster_api, authenticator=authenticator)  # type: ignore[arg-type]
        self.server = uvicorn.Server(uvicorn.Config(self.agent.app(), **self.agent.uvicorn_settings("warning")))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedAgent:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("agent did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
        self.server.should_exit = True
        self.thread.join(15)

    def idle(self, timeout: float = 60) -> None:
        assert self.agent.planning.wait_idle(timeout), "planning did not finish"


class AgentProcess:
    """`python -m tensile_agent` as a subprocess, killable with SIGKILL and restartable on its port."""

    def __init__(self, port: int | None = None, simulate: tuple[str, ...] = ("a6000:48GiB",), node: str = "test-node") -> None:
        self.port = port or free_port()
        self.simulate = simulate
        self.node = node
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> AgentProcess:
        args = [sys.executable, "-m", "tensile_agent", "--port", str(self.port), "--node-name", self.node,
                "--log-level", "warning"]
        for gpu in self.simulate:
            args += ["--simulate-gpu", gpu]
        env = dict(os.environ)
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited: {self.proc.stderr.read().decode()[-2000:] if self.proc.stderr else ''}")
            try:
                status, _ = get(self.url, "/healthz")
                if status == 200:
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("agent did not answer /healthz")
            time.sleep(0.05)

    def children(self) -> list[int]:
        """Pids of the agent's child processes (its planner), from /proc."""
        if self.proc is None:
            return []
        path = f"/proc/{self.proc.pid}/task/{self.proc.pid}/children"
        try:
            with open(path) as handle:
                return [int(pid) for pid in handle.read().split()]
        except OSError:
            return []

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
