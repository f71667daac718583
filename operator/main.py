"""Run the operator: `tensile operator` / `python -m tensile.operator.main`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import kopf

from tensile.operator.admission import Admission
from tensile.operator.forecasting import Forecaster, ProfileStore
from tensile.operator.handlers import PEERING, build_registry, webhook_server
from tensile.operator import metrics

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures
    import threading

    # what kopf.operator takes for stop_flag and ready_flag (kopf's own alias is private)
    Flag = asyncio.Future[Any] | asyncio.Event | concurrent.futures.Future[Any] | threading.Event


async def operator(app: Admission | None = None, *, standalone: bool = False, priority: int = 0,
                   webhook: kopf.WebhookServer | None = None, liveness: str | None = None,
                   stop_flag: Flag | None = None, ready_flag: Flag | None = None, metrics_port: int = 0,
                   metrics_addr: str = "127.0.0.1") -> None:
    """The operator as a coroutine (tests run several in one event loop, one after another)."""
    app = app or Admission()
    await kopf.operator(
        registry=build_registry(app, webhook, metrics_port, metrics_addr),
        clusterwide=True,
        standalone=standalone,
        priority=priority,
        peering_name=PEERING,
        liveness_endpoint=liveness,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        memo=kopf.Memo(app=app),
    )


def run(*, standalone: bool = False, priority: int = 0, profiles: str | None = None, liveness: str | None = None,
        metrics_port: int = metrics.DEFAULT_PORT, metrics_addr: str = "0.0.0.0") -> None:
    app = Admission(Forecaster(ProfileStore(profiles)))
    kopf.configure(verbose=False)
    kopf.run(registry=build_registry(app, webhook_server(), metrics_port, metrics_addr), clusterwide=True, standalone=standalone, priority=priority,
             peering_name=PEERING, liveness_endpoint=liveness, memo=kopf.Memo(app=app))


if __name__ == "__main__":
    run(metrics_port=metrics.metrics_port())
