"""`tensile local`: run TrainingJob YAML files on this machine, sharing one GPU (or a simulated one)
by their forecast scheduled peaks, with the node agent in-process and a live table of peaks."""

from __future__ import annotations

import argparse
import os

from tensile.commands import output_file, output_folder
from tensile.errors import TensileUserError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("local", help="run TrainingJob YAMLs on this machine under Tensile", description=__doc__)
    parser.add_argument("jobs", nargs="+", metavar="JOB.yaml", help="TrainingJob files (as for the cluster)")
    parser.add_argument("--simulate-gpu", action="append", default=[], metavar="NAME:MEMORY",
                        help="a simulated GPU (e.g. a6000:48GiB); default: NVML's, or a simulated one when there is none")
    parser.add_argument("--host", default="127.0.0.1", help="the agent's address (default %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="the agent's port (default: a free one)")
    parser.add_argument("--plot", metavar="PNG", help="write forecast vs observed peaks per job here")
    parser.add_argument("--reports", metavar="DIR", help="the hooks' reports and the jobs' logs (default: a temporary folder)")
    parser.add_argument("--linger", type=float, default=0.0, metavar="SECONDS",
                        help="keep the agent serving this long after the jobs end (for scraping /metrics)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # here, not at the top: `tensile run` builds this parser too, in images without jsonschema
    from tensile.local.jobs import load_jobs
    from tensile.local.session import run_jobs
    from tensile_agent.gpus import simulated_gpus
    from tensile_hook.launch import check_environment

    if not 0 <= args.port < 65536:
        raise TensileUserError(f"--port must be 0-65535 (was {args.port})")
    if args.linger < 0:
        raise TensileUserError(f"--linger must be 0 or more seconds (was {args.linger})")
    simulated_gpus(args.simulate_gpu)  # NAME:MEMORY as the agent reads it, refused before anything runs
    check_environment(os.environ, ("TENSILE_AGENT",))  # what every job's hook reads (each is given the local agent)
    if args.plot:
        output_file(args.plot, "--plot")  # before the jobs run: a bad path once met only the plot, after them
    jobs = load_jobs(args.jobs)
    reports = output_folder(args.reports, "--reports") if args.reports else None
    return run_jobs(jobs, reports, host=args.host, port=args.port, simulate=args.simulate_gpu, plot=args.plot,
                    linger=args.linger)
