"""`tensile agent`: run the node agent (global TENSILE planning for every GPU of this node, as a service)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("agent", help="run the node agent (FastAPI) for this node's GPUs", description=__doc__)
    from tensile_agent.server import add_arguments

    add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tensile_agent.server import config_from_args, serve

    serve(config_from_args(args), args.log_level)
    return 0
