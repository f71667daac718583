"""`tensile install-hook DIR`: copy the runtime hook into DIR, as the operator's init container does."""

from __future__ import annotations

import argparse

from rich.console import Console

from tensile_hook.install import install


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("install-hook", help="copy the runtime hook into a directory", description=__doc__)
    parser.add_argument("directory", help="target; the training process's PYTHONPATH then starts with DIR/site:DIR/lib")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    target = install(args.directory)
    Console(stderr=True).print(f"runtime hook installed in {target}: set PYTHONPATH={target}/site:{target}/lib and TENSILE_JOB to switch it on")
    return 0
