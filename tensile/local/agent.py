"""The node agent served in-process for the local runner: a real uvicorn server in a thread.

Without a GPU (NVML finds none) it simulates one, with no per-job CUDA context: the jobs run on the
CPU device, so the memory they use is the tensors' alone. It takes registrations only with the credential it made
(`credential_path`, a file only this user reads): the runner hands it to its jobs (TENSILE_TOKEN_FILE).
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensile_agent.gpus import GpuInfo

DEFAULT_SIMULATED = "a6000:48GiB"


class LocalAgent:
    def __init__(self, host: str, port: int, simulate: list[str]) -> None:
        import uvicorn

        from tensile_agent.gpus import Inventory
        from tensile_agent.server import Agent, AgentConfig

        self.note: str | None = None
        inventory = None if simulate else Inventory.discover()
        if inventory is not None and not inventory.gpus:
            self.note = f"no GPU ({inventory.reason}): simulating {DEFAULT_SIMULATED}; the jobs run on the CPU"
            simulate = [DEFAULT_SIMULATED]
        context = 0 if simulate else None  # simulated: no CUDA context per job
        if simulate:
            inventory = Inventory.discover(simulate, context_bytes=context)
        self.port = port or _free_port(host)
        credential = secrets.token_urlsafe(32)
        handle, self.credential_path = tempfile.mkstemp(prefix="tensile-agent-", suffix=".credential")  # mode 0600
        with os.fdopen(handle, "w") as file:
            file.write(credential)
        self.agent = Agent(AgentConfig(host=host, port=self.port, simulate=simulate, context_bytes=context, planning="thread",
                                       auth="secret", credential=credential), inventory=inventory)
        self.agent.state.queued_jobs = 0  # exported as tensile_queued_jobs (node_agent/tensile_agent/metrics.py)
        self.server = uvicorn.Server(uvicorn.Config(self.agent.app(), **self.agent.uvicorn_settings("warning")))
        self.thread = threading.Thread(target=self.server.run, name="tensile-local-agent", daemon=True)
        self.url = f"http://{host}:{self.port}"

    @property
    def gpu(self) -> GpuInfo:
        """The GPU the local jobs share (the first)."""
        return next(iter(self.agent.inventory.gpus.values()))

    def set_queued(self, count: int) -> None:
        self.agent.state.queued_jobs = count

    def start(self, timeout: float = 20.0) -> LocalAgent:
        from tensile.errors import TensileUserError

        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise TensileUserError(f"the node agent could not serve on {self.url} (port in use? try --port)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        try:
            os.unlink(self.credential_path)
        except OSError:
            pass


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
