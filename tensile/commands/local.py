"""`tensile local`: run TrainingJob YAML files on this machine, sharing one GPU (or a simulated one)
by their forecast scheduled peaks, with the node agent in-process and a live table of peaks."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live

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
    import torch

    from tensile.commands.run import check_environment
    from tensile.local_agent import LocalAgent
    from tensile.local_jobs import load_jobs  # here, not at the top: `tensile run` builds this parser too, in images without jsonschema
    from tensile.local_runner import POLL_SECONDS, LocalRunner
    from tensile.local_view import job_view, plot_peaks
    from tensile_agent.gpus import simulated_gpus

    if not 0 <= args.port < 65536:
        raise TensileUserError(f"--port must be 0-65535 (was {args.port})")
    if args.linger < 0:
        raise TensileUserError(f"--linger must be 0 or more seconds (was {args.linger})")
    simulated_gpus(args.simulate_gpu)  # NAME:MEMORY as the agent reads it, refused before anything runs
    check_environment(dict(os.environ), ("TENSILE_AGENT",))  # what every job's hook reads (each is given the local agent)
    if args.plot:
        output_file(args.plot, "--plot")  # before the jobs run: a bad path once met only the plot, after them
    jobs = load_jobs(args.jobs)
    console = Console()
    for job in jobs:
        if job.unknown_annotations:  # ignored, not refused: Kubernetes takes any annotation
            console.print(f"[yellow]note:[/] {job.path} job {job.name}: {job.unknown_annotations}", highlight=False)
    reports = output_folder(args.reports, "--reports") if args.reports else Path(tempfile.mkdtemp(prefix="tensile-local-"))
    cuda = torch.cuda.is_available()
    agent = LocalAgent(args.host, args.port, list(args.simulate_gpu)).start()
    if agent.note:
        console.print(f"[yellow]note:[/] {agent.note}", highlight=False)
    gpu = agent.gpu
    kind = "simulated " if gpu.simulated else ""
    title = f"Tensile local: {kind}{gpu.name} {gpu.capacity_bytes / 2**20:,.0f} MiB for jobs; agent {agent.url}"
    console.print(f"agent {agent.url} (/v1/jobs, /metrics); reports and logs in {reports}", highlight=False)
    runner = LocalRunner(jobs, agent, reports, "cuda" if cuda else "cpu", "a6000" if cuda else "cpu")
    try:
        with Live(job_view(runner.runs, title), console=console, refresh_per_second=4) as live:
            runner.forecast_all(lambda: live.update(job_view(runner.runs, title)))
            while runner.step():
                live.update(job_view(runner.runs, title))
                time.sleep(POLL_SECONDS)
            live.update(job_view(runner.runs, title))
        if not console.is_terminal:  # piped or logged: Live's last render ends without a newline
            console.line()
        if args.plot:
            console.print(f"plot: {plot_peaks(runner.runs, args.plot, title)}", highlight=False)
        if args.linger:
            console.print(f"agent serving {agent.url}/metrics for {args.linger:g} s more", highlight=False)
            time.sleep(args.linger)
    except KeyboardInterrupt:
        runner.stop()
        return 130
    finally:
        runner.http.close()
        agent.stop()
    failed = [r for r in runner.runs if r.phase != "Succeeded"]
    if failed:  # why is each one's note under the table: named here, not said twice
        console.print(f"[red]{len(failed)} of {len(runner.runs)} jobs did not succeed:[/] "
                      + ", ".join(f"{r.name} ({r.phase})" for r in failed), highlight=False)
    return 1 if failed else 0

