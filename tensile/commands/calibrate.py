"""`tensile calibrate`: measure op latencies on this machine's device and train the latency model."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("calibrate", help="measure op latencies on the local device and train the latency model",
                                   description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the local device to measure")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny grid (seconds; for tests and smoke checks); needs --out, since its model predicts "
                             "worse than the uncalibrated prior and must not replace the default one")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="directory for the model file (default: $TENSILE_HOME/latency or ~/.cache/tensile/latency)")
    parser.add_argument("--budget", type=float, default=480.0, metavar="SECONDS",
                        help="stop measuring after this long and train on what was measured (default 480)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads while measuring (default: torch's default; 1 on a busy shared CPU)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tensile.latency.calibrate import calibrate, describe

    console = Console()
    model, path = calibrate(args.device, quick=args.quick, model_dir=args.out, progress=console.is_terminal,
                            budget_s=args.budget, threads=args.threads)
    table = Table(title=f"Latency model: {model.device_name}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in describe(model):
        table.add_row(name, value)
    table.add_row("calibration time", f"{model.meta.get('calibration_seconds', 0):.1f} s "
                                      f"({model.meta['probes']}/{model.meta['probes_planned']} probes)")
    table.add_row("saved to", f"{path} ({path.stat().st_size / 1024:,.1f} KiB)")
    console.print(table)
    return 0
