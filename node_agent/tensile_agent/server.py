"""Wiring: inventory -> state -> planning -> service -> app, the cluster publisher, and uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensile.agent_contract import DEFAULT_PORT
from tensile.console import print_user_error
from tensile.errors import TensileUserError

from tensile_agent.auth import MODES, Authenticator, NoCredential, RegistrationLimits, SharedSecret, TokenReviewer
from tensile_agent.cluster import ClusterPublisher, in_cluster
from tensile_agent.connections import ConnectionLimits
from tensile_agent.expiry import DEFAULT_SILENT_SECONDS, SilentJobExpiry
from tensile.devices import parse_bytes
from tensile_agent.gpus import DEFAULT_HEADROOM, Inventory
from tensile_agent.metrics import make_registry
from tensile_agent.planning import PlanningService, ProcessPlanner
from tensile.plan_update import DEFAULT_THRESHOLD
from tensile.planner import plan_gpu
from tensile_agent.service import AgentService, no_gpus_message
from tensile_agent.state import AgentState

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("tensile_agent")
SWITCH_INTERVAL = 0.0005  # seconds; the agent process's GIL switch interval (Python's default: 0.005)


@dataclass
class AgentConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    simulate: list[str] = field(default_factory=list)
    node: str | None = None
    advertise: str | None = None  # the URL hooks and the operator use (TensileNode .status.agentAddress)
    headroom: float = DEFAULT_HEADROOM
    context_bytes: int | None = None
    threshold: float = DEFAULT_THRESHOLD
    planning: str = "process"  # "process": plan in a child process (requests keep the GIL); "thread": in-process
    freeze_gc: bool = False  # gc.freeze() after each planning round (the agent process: `serve`)
    expire_silent: float = DEFAULT_SILENT_SECONDS  # seconds without a call before an external job is dropped; 0: never
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    # who may register (tensile_agent.auth): kubernetes (TokenReview), secret (`credential`), none; None: kubernetes in a
    # cluster, else none, which is refused on any address but loopback
    auth: str | None = None
    credential: str | None = None
    operator_accounts: tuple[str, ...] = ("system:serviceaccount:tensile-system:tensile-operator",)
    registrations: RegistrationLimits = field(default_factory=RegistrationLimits)


class Agent:
    """Everything one agent process holds; `start`/`stop` run with the app's lifespan."""

    def __init__(self, config: AgentConfig, inventory: Inventory | None = None, cluster_api: object | None = None,
                 authenticator: Authenticator | None = None) -> None:
        self.config = config
        self.inventory = inventory or Inventory.discover(config.simulate, config.node, config.headroom, config.context_bytes)
        self.state = AgentState(self.inventory, config.node)
        if config.planning not in ("process", "thread"):
            raise TensileUserError(f"--planning must be 'process' or 'thread' (was {config.planning!r})")
        planner = ProcessPlanner() if config.planning == "process" else plan_gpu
        self.planning = PlanningService(self.state, config.threshold, planner=planner, freeze_gc=config.freeze_gc)
        self.service = AgentService(self.state, self.planning, authenticator or authenticator_for(config),
                                    config.registrations)
        self.expiry = SilentJobExpiry(self.service, config.expire_silent)
        self.registry = make_registry(self.state)
        self.publisher: ClusterPublisher | None = None
        if cluster_api is not None or in_cluster(config.node):
            url = config.advertise or f"http://{os.environ.get('POD_IP') or socket.gethostname()}:{config.port}"
            self.publisher = ClusterPublisher(self.state, config.node or socket.gethostname(), url, cluster_api)
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
            self.planning.start()
            self.expiry.start()
            if self.publisher is not None:
                self.publisher.start()
        if not self.inventory.gpus:
            log.warning("%s; until then it refuses every job (404 no_gpus)", no_gpus_message(self.inventory.reason))
        else:
            kind = "simulated " if self.inventory.simulated else ""
            log.info("%d %sGPU(s): %s", len(self.inventory.gpus), kind,
                     ", ".join(f"{g.uuid} {g.name} {g.memory_bytes / 2**30:.1f} GiB" for g in self.inventory.gpus.values()))

    def stop(self) -> None:
        with self._lock:
            if not self._started:
                return
            self._started = False
        self.planning.stop()
        self.expiry.stop()
        if self.publisher is not None:
            self.publisher.stop()

    def app(self) -> FastAPI:
        from tensile_agent.app import create_app

        return create_app(self)

    def uvicorn_settings(self, log_level: str = "info") -> dict[str, Any]:
        """uvicorn's keywords for the agent's server, with its connection limits (what `serve` runs, and the tests)."""
        return {"host": self.config.host, "port": self.config.port, "log_level": log_level.lower(), "access_log": False,
                "timeout_graceful_shutdown": 5, **self.config.limits.uvicorn_settings()}


def authenticator_for(config: AgentConfig) -> Authenticator:
    """Who may register with an agent of `config` (tensile_agent.auth)."""
    mode = config.auth or ("kubernetes" if in_cluster(config.node) else "none")
    if mode not in MODES:
        raise TensileUserError(f"--auth must be one of {', '.join(MODES)} (was {mode!r})")
    if mode == "kubernetes":
        return TokenReviewer(set(config.operator_accounts))
    if mode == "secret":
        if not config.credential or len(config.credential) < 16:
            raise TensileUserError("--auth secret needs --credential-file: a file holding at least 16 characters")
        return SharedSecret(config.credential)
    if config.auth is None and config.host not in ("127.0.0.1", "::1", "localhost"):
        raise TensileUserError(f"an agent listening on {config.host} outside a cluster needs a credential: give --auth "
                               "secret --credential-file FILE (or --auth none to take registrations from anyone)")
    return NoCredential()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=os.environ.get("TENSILE_AGENT_HOST", "127.0.0.1"),
                        help="address to listen on (in a DaemonSet: 0.0.0.0 or the host IP)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("TENSILE_AGENT_PORT", DEFAULT_PORT)))
    parser.add_argument("--simulate-gpu", action="append", default=[], metavar="NAME:MEMORY",
                        help="a simulated GPU instead of NVML's, e.g. a6000:48GiB (repeatable); shown as simulated")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME"),
                        help="this node's name: in a cluster, the TensileNode the agent publishes to")
    parser.add_argument("--advertise-url", default=os.environ.get("TENSILE_AGENT_URL"),
                        help="the URL hooks and the operator reach this agent at (TensileNode .status.agentAddress)")
    parser.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                        help="share of each GPU's memory kept free by admission (default %(default)s)")
    parser.add_argument("--context-bytes", default=None,
                        help="per job: what its process holds outside PyTorch's caching allocator, its CUDA context "
                             "(e.g. 600MiB; default: the GPU preset's)")
    parser.add_argument("--replan-threshold", type=float, default=DEFAULT_THRESHOLD,
                        help="re-plan when a job's op latencies drift by more than this share (|s'-s|/s)")
    parser.add_argument("--planning", choices=("process", "thread"), default="process",
                        help="plan in a child process (default: requests stay fast during a round) or in a thread")
    parser.add_argument("--expire-silent-jobs", type=float, default=DEFAULT_SILENT_SECONDS, metavar="SECONDS",
                        help="drop a job registered by its own hook (not placed by the operator) after this many seconds "
                             "without a call: its process died unregistered (default %(default)s; 0: never)")
    parser.add_argument("--auth", choices=MODES, default=os.environ.get("TENSILE_AGENT_AUTH") or None,
                        help="who may register jobs: kubernetes (service-account tokens, TokenReview; the default in a "
                             "cluster), secret (--credential-file), none (the default on loopback outside a cluster)")
    parser.add_argument("--credential-file", default=os.environ.get("TENSILE_AGENT_CREDENTIAL_FILE"),
                        help="with --auth secret: the file holding the credential jobs present")
    parser.add_argument("--operator-service-account", action="append", default=None, metavar="USER",
                        help="the operator's user as TokenReview names it (repeatable; default "
                             "system:serviceaccount:tensile-system:tensile-operator, or $TENSILE_OPERATOR_ACCOUNT)")
    parser.add_argument("--max-jobs-per-gpu", type=int, default=RegistrationLimits.per_gpu)
    parser.add_argument("--max-jobs-per-namespace", type=int, default=RegistrationLimits.per_namespace)
    parser.add_argument("--log-level", default=os.environ.get("TENSILE_LOG_LEVEL", "info"))


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    if not 0 <= args.headroom < 1:
        raise TensileUserError(f"--headroom must be in [0, 1) (was {args.headroom})")
    if not 0 < args.replan_threshold:
        raise TensileUserError(f"--replan-threshold must be positive (was {args.replan_threshold})")
    if not 0 <= args.port < 65536:
        raise TensileUserError(f"--port must be 0-65535 (was {args.port})")
    if not 0 <= args.expire_silent_jobs:
        raise TensileUserError(f"--expire-silent-jobs must be 0 (never) or a number of seconds (was {args.expire_silent_jobs})")
    if args.max_jobs_per_gpu < 1 or args.max_jobs_per_namespace < 1:
        raise TensileUserError("--max-jobs-per-gpu and --max-jobs-per-namespace must be at least 1")
    credential = None
    if args.credential_file:
        try:
            with open(args.credential_file) as handle:
                credential = handle.read().strip()
        except OSError as exc:
            raise TensileUserError(f"--credential-file {args.credential_file}: {exc.strerror}") from None
    accounts = args.operator_service_account or [a for a in [os.environ.get("TENSILE_OPERATOR_ACCOUNT")] if a]
    return AgentConfig(host=args.host, port=args.port, simulate=list(args.simulate_gpu), node=args.node_name,
                       auth=args.auth, credential=credential,
                       registrations=RegistrationLimits(args.max_jobs_per_gpu, args.max_jobs_per_namespace),
                       operator_accounts=tuple(accounts) or AgentConfig.operator_accounts,
                       advertise=args.advertise_url, headroom=args.headroom,
                       context_bytes=parse_bytes(args.context_bytes, "--context-bytes") if args.context_bytes else None,
                       threshold=args.replan_threshold, planning=args.planning, expire_silent=args.expire_silent_jobs)


def serve(config: AgentConfig, log_level: str = "info") -> None:
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The planning thread is CPU-bound Python; with the default 5 ms GIL switch interval every request
    # would queue behind it for several slices. A short interval keeps requests fast during a re-plan.
    sys.setswitchinterval(SWITCH_INTERVAL)
    config.freeze_gc = True
    agent = Agent(config)
    uvicorn.run(agent.app(), **agent.uvicorn_settings(log_level))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensile_agent", description="the Tensile node agent")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        serve(config_from_args(args), args.log_level)
    except TensileUserError as exc:
        return print_user_error(exc)
    return 0
