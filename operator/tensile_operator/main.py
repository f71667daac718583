"""Run the operator: `tensile operator` / `python -m tensile_operator.main` (the same options, `--help`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import kopf
import yaml

from tensile.errors import TensileUserError
from tensile_operator.app import OperatorApp
from tensile_operator.forecasting import Forecaster, ProfileStore
from tensile_operator.handlers import PEERING, build_registry, login, webhook_server
from tensile_operator import metrics

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures
    import threading

    # what kopf.operator takes for stop_flag and ready_flag (kopf's own alias is private)
    Flag = asyncio.Future[Any] | asyncio.Event | concurrent.futures.Future[Any] | threading.Event


async def operator(app: OperatorApp | None = None, *, standalone: bool = False, priority: int = 0,
                   webhook: kopf.WebhookServer | None = None, liveness: str | None = None,
                   stop_flag: Flag | None = None, ready_flag: Flag | None = None, metrics_port: int = 0,
                   metrics_addr: str = "127.0.0.1") -> None:
    """The operator as a coroutine (tests run several in one event loop, one after another)."""
    app = app or OperatorApp()
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


NO_CREDENTIALS = ("no Kubernetes credentials: not in a pod with a service account, and no kubeconfig ($KUBECONFIG is unset "
                  "and ~/.kube/config does not exist): set KUBECONFIG to your cluster's kubeconfig, or run the operator in "
                  "the cluster (helm install tensile ./charts/tensile)")


def require_credentials() -> None:
    """The credentials the operator will log in with, checked before Kopf starts: found missing by Kopf's start-up
    handler, they ended the run in a 54-line traceback."""
    try:
        info = login(settings=kopf.OperatorSettings())
    except (OSError, yaml.YAMLError, ValueError, LookupError, TypeError, AttributeError, kopf.LoginError) as exc:
        # unreadable, not YAML, not a kubeconfig, no current context or one naming a missing cluster or user
        detail = " ".join(str(exc).split())  # one line: a YAML error spans several
        raise TensileUserError(f"the kubeconfig cannot be used ({type(exc).__name__}: {detail}): fix $KUBECONFIG "
                               "(or ~/.kube/config) so that `kubectl config current-context` names your cluster") from None
    if info is None:
        raise TensileUserError(NO_CREDENTIALS)


def run(*, standalone: bool = False, priority: int = 0, profiles: str | None = None, liveness: str | None = None,
        metrics_port: int = metrics.DEFAULT_PORT, metrics_addr: str = "0.0.0.0") -> None:
    """Kopf's run; `tensile operator` checks the credentials first (`require_credentials`)."""
    app = OperatorApp(Forecaster(ProfileStore(profiles)))
    kopf.configure(verbose=False)
    kopf.run(registry=build_registry(app, webhook_server(), metrics_port, metrics_addr), clusterwide=True, standalone=standalone, priority=priority,
             peering_name=PEERING, liveness_endpoint=liveness, memo=kopf.Memo(app=app))


if __name__ == "__main__":
    from tensile_operator.command import main

    sys.exit(main())
