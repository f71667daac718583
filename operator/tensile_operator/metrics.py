"""The operator's Prometheus metrics: its queue, the jobs by phase, admissions by result, forecast time.

One registry per operator run (several runs share a test process); the gauges are made from the
operator's view of the phases at scrape time, so a deleted job stops counting without bookkeeping.
Served over HTTP on `--metrics-port` (default 8080, path /metrics; 0 turns it off).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tensile.errors import TensileUserError
from tensile.trainingjob_spec import PHASES

DEFAULT_PORT = 8080
PORT_ENV = "TENSILE_OPERATOR_METRICS_PORT"
FORECAST_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PLACEMENT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
log = logging.getLogger("tensile_operator.metrics")


def metrics_port(flag: int | None = None) -> int:
    """The metrics port: the flag, else $TENSILE_OPERATOR_METRICS_PORT, else 8080; 0 turns metrics off."""
    raw, source = (flag, "--metrics-port") if flag is not None else (os.environ.get(PORT_ENV, DEFAULT_PORT), PORT_ENV)
    try:
        port = int(raw)
    except (TypeError, ValueError):
        port = -1
    if not 0 <= port <= 65535:
        raise TensileUserError(f"{source}={raw!r}: set a port number from 1 to 65535, or 0 to turn metrics off")
    return port


class _Phases(Collector):
    def __init__(self, phases: Callable[[], dict[str, str]]) -> None:
        self.phases = phases

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = dict.fromkeys(PHASES, 0)
        for phase in self.phases().values():
            counts[phase] = counts.get(phase, 0) + 1
        queued = GaugeMetricFamily("tensile_queued_jobs", "TrainingJobs waiting for GPU memory (phase Queued)")
        queued.add_metric([], counts["Queued"])
        yield queued
        by_phase = GaugeMetricFamily("tensile_trainingjobs", "TrainingJobs by phase, as this operator saw them", labels=["phase"])
        for phase, count in counts.items():
            by_phase.add_metric([phase], count)
        yield by_phase


class OperatorMetrics:
    """`phases`: a snapshot of job -> phase (called from the scrape thread: it must copy, not iterate live)."""

    def __init__(self, phases: Callable[[], dict[str, str]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Phases(phases))
        # a job placed again (its node or GPU went before its pod started) is admitted again: a decision of its own
        self.admissions = Counter("tensile_admissions", "Admission decisions by result: admitted (each placement, a job "
                                  "placed again after its node or GPU went counted again), queued (each admission that "
                                  "had to wait), or why refused", ["result"], registry=self.registry)
        self.forecast_seconds = Histogram("tensile_forecast_seconds", "Time to forecast a job (trace + plan; cache hits too)",
                                          buckets=FORECAST_BUCKETS, registry=self.registry)
        # the scheduler places one job at a time: a slow decision (the joint planner's) delays every job behind it
        self.placement_seconds = Histogram(
            "tensile_placement_seconds", "Time to decide where a job goes or why it waits (the fit test on the GPUs it "
            "may use); joint_plan: whether the joint planner was asked (a cache hit too)", ["joint_plan"],
            buckets=PLACEMENT_BUCKETS, registry=self.registry)
        self._server: WSGIServer | None = None

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve /metrics on a thread of prometheus_client's own (never the event loop)."""
        if port and self._server is None:
            try:
                self._server, _ = start_http_server(port, addr, registry=self.registry)
            except OSError as exc:
                raise TensileUserError(f"--metrics-port {port}: cannot listen on {addr}:{port} ({exc.strerror}); "
                                       "pick a free port, or 0 to turn metrics off") from exc
            log.info("metrics on http://%s:%d/metrics", addr, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
