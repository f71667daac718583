"""One local run from start to end: the node agent served in-process, the jobs forecast, admitted and run
(tensile/local/runner.py) under a live table of their peaks, a plot of them at the end."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live

from tensile.latency.device import forecast_preset
from tensile.local.agent import LocalAgent
from tensile.local.jobs import LocalJob
from tensile.local.runner import POLL_SECONDS, LocalRunner
from tensile.local.view import job_view, plot_peaks, sharing_summary


def run_jobs(jobs: list[LocalJob], reports: Path | None, *, host: str, port: int, simulate: list[str],
             plot: str | None, linger: float) -> int:
    """Run the jobs on this machine's GPU (NVML's, or the `simulate`d one; the agent serves on host:port, 0 for a free
    port), their reports and logs in `reports` (default: a temporary folder), the peaks plotted to `plot`, the agent
    kept serving `linger` seconds after the jobs end. The exit status: 0 when every job succeeded, 1 when one did
    not, 130 when stopped by Ctrl-C."""
    import torch

    console = Console()
    for job in jobs:
        if job.unknown_annotations:  # ignored, not refused: Kubernetes takes any annotation
            console.print(f"[yellow]note:[/] {job.path} job {job.name}: {job.unknown_annotations}", highlight=False)
    scratch = reports is None  # a folder of this run's own: removed at the end unless a job failed
    reports = reports or Path(tempfile.mkdtemp(prefix="tensile-local-"))
    cuda = torch.cuda.is_available()
    agent = LocalAgent(host, port, list(simulate)).start()
    if agent.note:
        console.print(f"[yellow]note:[/] {agent.note}", highlight=False)
    gpu = agent.gpu
    kind = "simulated " if gpu.simulated else ""
    title = f"Tensile local: {kind}{gpu.name} {gpu.capacity_bytes / 2**20:,.0f} MiB for jobs"
    kept = " (removed at the end unless a job fails; --reports DIR keeps them)" if scratch else ""
    console.print(f"agent {agent.url} (/v1/jobs, /metrics); reports and logs in {reports}{kept}", highlight=False)
    device = "cuda" if cuda else "cpu"
    runner = LocalRunner(jobs, agent, reports, device, forecast_preset(device))
    try:
        with Live(job_view(runner.runs, title), console=console, refresh_per_second=4) as live:
            runner.forecast_all(lambda: live.update(job_view(runner.runs, title)))
            while runner.step():
                live.update(job_view(runner.runs, title))
                time.sleep(POLL_SECONDS)
            live.update(job_view(runner.runs, title))
        if not console.is_terminal:  # piped or logged: Live's last render ends without a newline
            console.line()
        console.print(sharing_summary(runner.runs, gpu.capacity_bytes, gpu.context_bytes, runner.most_at_once))
        if plot:
            console.print(f"plot: {plot_peaks(runner.runs, plot, title, gpu.capacity_bytes)}",
                          highlight=False)
        if linger:
            console.print(f"agent serving {agent.url}/metrics for {linger:g} s more", highlight=False)
            time.sleep(linger)
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
        if scratch:
            console.print(f"their reports and logs are kept in {reports}", highlight=False, soft_wrap=True)
    elif scratch:
        shutil.rmtree(reports, ignore_errors=True)
    return 1 if failed else 0
