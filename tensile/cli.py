"""The `tensile` command: one sub-command per module in tensile.commands."""

from __future__ import annotations

import argparse
import importlib
import sys


from tensile.console import print_user_error
from tensile.errors import TensileUserError

# Each module defines `add_parser(subparsers)` and a `run(args) -> int` set as the parser's default.
COMMANDS = ("forecast", "run", "install-hook", "calibrate", "operator", "simulate", "agent", "local", "render")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensile", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"tensile.commands.{name.replace('-', '_')}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except TensileUserError as exc:
        return print_user_error(exc)


if __name__ == "__main__":
    sys.exit(main())
