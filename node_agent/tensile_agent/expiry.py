"""Silent external jobs expire: a hook that registered by itself (`tensile run --agent`) and was killed before
it could unregister would otherwise keep its scheduled peak on the GPU for the agent's life. A job registered with
the operator's token is kept (the operator books its share until its pod goes) and its silence logged once."""

from __future__ import annotations

import threading

from tensile_agent.service import AgentService

DEFAULT_SILENT_SECONDS = 300.0  # hooks poll every 0.5 s (TENSILE_AGENT_INTERVAL): minutes of silence mean gone


class SilentJobExpiry:
    """A thread that unregisters external jobs silent for `seconds` (0: never), checking four times as often."""

    def __init__(self, service: AgentService, seconds: float) -> None:
        self.service = service
        self.seconds = seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.seconds > 0 and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="tensile-silent-job-expiry", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.seconds / 4):
            self.service.expire_silent(self.seconds)
