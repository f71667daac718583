"""`tensile operator`: run the Kopf operator that admits TrainingJobs by their scheduled memory-peak forecasts."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("operator", help="run the Kubernetes operator (Kopf)", description=__doc__)
    from tensile_operator.command import add_arguments

    add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tensile_operator.command import run as run_operator

    return run_operator(args)
