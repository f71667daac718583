"""`tensile operator`: run the Kopf operator that admits TrainingJobs by their scheduled memory-peak forecasts."""

from __future__ import annotations

import argparse
import os


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("operator", help="run the Kubernetes operator (Kopf)", description=__doc__)
    parser.add_argument("--standalone", action="store_true", help="no peering: for a single local run only")
    parser.add_argument("--priority", type=int, default=0, help="peering priority (the highest one is active)")
    parser.add_argument("--profiles", default=os.environ.get("TENSILE_PROFILE_DIR"), help="directory of stored workload profiles")
    parser.add_argument("--liveness", default=os.environ.get("TENSILE_LIVENESS"), help="e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port at /metrics; 0 turns them off "
                             "(default: $TENSILE_OPERATOR_METRICS_PORT, else 8080)")
    parser.add_argument("--metrics-addr", default=os.environ.get("TENSILE_OPERATOR_METRICS_ADDR", "0.0.0.0"),
                        help="address the metrics server listens on")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tensile.operator.main import run as run_operator
    from tensile.operator.metrics import metrics_port

    run_operator(standalone=args.standalone, priority=args.priority, profiles=args.profiles, liveness=args.liveness,
                 metrics_port=metrics_port(args.metrics_port), metrics_addr=args.metrics_addr)
    return 0
