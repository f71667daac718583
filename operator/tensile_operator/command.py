"""The operator's command line: `tensile operator` and `python -m tensile_operator.main` take the same options.
Kopf is imported only to run, so that the CLI builds this parser in images without it."""

from __future__ import annotations

import argparse
import os

from tensile.console import print_user_error
from tensile.errors import TensileUserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--standalone", action="store_true", help="no peering: for a single local run only")
    parser.add_argument("--priority", type=int, default=0, help="peering priority (the highest one is active)")
    parser.add_argument("--profiles", default=os.environ.get("TENSILE_PROFILE_DIR"),
                        help="directory of stored workload profiles")
    parser.add_argument("--liveness", default=os.environ.get("TENSILE_LIVENESS"),
                        help="e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port at /metrics; 0 turns them off "
                             "(default: $TENSILE_OPERATOR_METRICS_PORT, else 8080)")
    parser.add_argument("--metrics-addr", default=os.environ.get("TENSILE_OPERATOR_METRICS_ADDR", "0.0.0.0"),
                        help="address the metrics server listens on")


def run(args: argparse.Namespace) -> int:
    """Run the operator with the options `add_arguments` read; a bad one raises TensileUserError (exit 2)."""
    from tensile_operator.main import require_credentials, run as run_operator
    from tensile_operator.metrics import metrics_port

    port = metrics_port(args.metrics_port)  # a bad port is bad input (exit 2, as every command's)
    try:
        require_credentials()
    except TensileUserError as exc:  # nothing to connect to: one line naming the fix, exit 1
        print_user_error(exc)
        return 1
    run_operator(standalone=args.standalone, priority=args.priority, profiles=args.profiles, liveness=args.liveness,
                 metrics_port=port, metrics_addr=args.metrics_addr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tensile_operator.main [OPTIONS]` (it ignored its arguments, `--help` included, and started the
    operator)."""
    parser = argparse.ArgumentParser(prog="python -m tensile_operator.main", description="the Tensile operator")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except TensileUserError as exc:
        return print_user_error(exc)
