"""The `tensile` command: one sub-command per module in tensile.commands."""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

import tensile
from tensile.console import print_user_error
from tensile.errors import TensileUserError

# Each module defines `add_parser(subparsers)` and a `run(args) -> int` set as the parser's default. A module imports
# torch and the other heavy libraries inside `run`, not at its top: `tensile --help` answers at once.
COMMANDS = ("forecast", "run", "install-hook", "calibrate", "operator", "simulate", "agent", "local", "render")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensile", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tensile {tensile.__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, print the whole traceback (of the user's model code too), not one line")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"tensile.commands.{name.replace('-', '_')}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except TensileUserError as exc:
        if args.debug and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__)
        return print_user_error(exc)


if __name__ == "__main__":
    sys.exit(main())
