"""`tensile run`: run an unmodified training command under the Tensile hook (local mode)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console

import tensile.runtime_hook
from tensile.agent_client import Http
from tensile.commands import option_value, output_file
from tensile.errors import TensileUserError
from tensile.knobs import parse_swap_rate
from tensile.local_jobs import local_command
from tensile.plan import PLAN_EVENTS, load_plan
from tensile.runtime_hook.report import RunTotals
from tensile.runtime_hook.settings import parse_budget
from tensile.workload_io import load_workload

SITE_DIR = Path(tensile.runtime_hook.__file__).parent / "site"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run a training command under the Tensile hook", description=__doc__)
    parser.add_argument("--job", default="local", help="job name shown in reports and metrics")
    parser.add_argument("--memory-budget", help="bytes (12GiB), or a fraction of the vanilla peak (e.g. 0.6)")
    parser.add_argument("--workload", help="the workload the plan is for (tensile forecast --save)")
    parser.add_argument("--plan", help="a plan for that workload (tensile forecast --save-plan); default: plan in-process")
    parser.add_argument("--agent", help="node agent URL; without it the hook plans in-process")
    parser.add_argument("--token", help="the job's token for the agent")
    parser.add_argument("--max-swap-rate", type=float, help="the share of the GPU's swap traffic in (0, 1] plans may use")
    parser.add_argument("--report", help="write the hook's JSON report here")
    parser.add_argument("--plan-events", choices=PLAN_EVENTS,
                        help="which events plans use (TENSILE_PLAN_EVENTS); default auto: activation swaps only on CUDA")
    parser.add_argument("--no-recompute", dest="recompute", action="store_false",
                        help="plans never recompute a tensor (TENSILE_RECOMPUTE=false)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ...")
    parser.set_defaults(run=run)


def hook_environment(args: argparse.Namespace) -> dict[str, str]:
    """The TENSILE_* variables and PYTHONPATH that switch the hook on in the child process."""
    env = dict(os.environ)
    env["TENSILE_JOB"] = args.job
    python_path = [str(SITE_DIR), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in python_path if p)
    optional = {
        "TENSILE_MEMORY_BUDGET": args.memory_budget,
        "TENSILE_WORKLOAD": args.workload,
        "TENSILE_PLAN": args.plan,
        "TENSILE_AGENT": args.agent,
        "TENSILE_TOKEN": args.token,
        "TENSILE_MAX_SWAP_RATE": None if args.max_swap_rate is None else str(args.max_swap_rate),
        "TENSILE_REPORT": args.report,
        "TENSILE_PLAN_EVENTS": args.plan_events,
        "TENSILE_RECOMPUTE": None if args.recompute else "false",
    }
    env.update({k: v for k, v in optional.items() if v})
    return env


def _check(args: argparse.Namespace) -> list[str]:
    """Everything the hook would refuse in the child, refused here before the command starts; the command
    with a leading `python` as `tensile local` runs it: this Python, the one that has the hook."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise TensileUserError("tensile run needs a command after '--', e.g. tensile run -- python train.py")
    command, problem = local_command(command)
    if problem:
        raise TensileUserError(f"{problem}; check the command after '--'")
    if args.memory_budget:
        option_value(parse_budget, args.memory_budget, "--memory-budget")
    if args.max_swap_rate is not None:
        option_value(parse_swap_rate, str(args.max_swap_rate), "--max-swap-rate")
    if args.agent:
        try:
            Http(args.agent)  # the client's own check of the URL, before the hook in the child meets it
        except ValueError as exc:
            raise TensileUserError(f"--agent: {exc}") from None
    if args.report:
        output_file(args.report, "--report")
    if args.plan and not args.workload:
        raise TensileUserError("--plan needs --workload: the workload the plan was made for")
    if args.workload:
        workload = load_workload(args.workload)  # a malformed file is reported here, not in the child
        if args.plan:
            try:
                load_plan(args.plan, workload, "--plan")
            except ValueError as exc:
                raise TensileUserError(str(exc)) from None
    return command


def run(args: argparse.Namespace) -> int:
    command = _check(args)
    console = Console(stderr=True)
    report = args.report
    if report is None:
        report = args.report = str(Path(tempfile.mkdtemp(prefix="tensile-")) / "report.json")
    try:
        returncode = subprocess.call(command, env=hook_environment(args))
    except OSError as exc:  # e.g. a file marked executable that is no program ("Exec format error")
        raise TensileUserError(f"cannot start '{command[0]}': {exc.strerror}; check the command after '--'") from None
    if Path(report).exists():
        data = json.loads(Path(report).read_text())
        totals = RunTotals.of(data)
        console.print(
            f"tensile: {totals.iterations} iterations, {totals.planned} under plan "
            f"(source: {data['plan_source'] or 'none'}), peak {totals.peak_bytes / 2**20:,.1f} MiB"
            f"{_under_plan(totals, data.get('scheduled_peak_bytes'))}; report: {report}"
        )
        over = _over_budget(totals, data.get("memory_budget_bytes"), data.get("guard_slack_bytes"))
        if over:
            console.print(f"[yellow]tensile: {over}[/]")
        if data.get("stood_down"):
            console.print(f"[yellow]tensile: the hook stood down: {data['stood_down']}[/]")
    return returncode


def _over_budget(totals: RunTotals, budget: int | None, slack: int | None) -> str:
    """The peak under plan against the memory budget, said where it went over: the guard keeps the job under the
    budget plus what one op needs at once (its inputs and outputs, which it cannot evict), and the summary said
    neither. (The iterations before the plan run at the vanilla peak: a fractional budget needs it measured.)"""
    peak = totals.planned_peak_bytes
    if not budget or peak is None or peak <= budget:
        return ""
    mib = 2**20
    over = peak - budget
    said = f"the peak under plan, {peak / mib:,.1f} MiB, went over the memory budget of {budget / mib:,.1f} MiB by {over / mib:,.2f} MiB"
    if slack is None:
        return said
    if over <= slack:
        return f"{said}: within the guard's slack of {slack / mib:,.1f} MiB (what one op needs on the device at once)"
    # the slack is measured on the iteration the plan was matched with: shapes grown since (a batch size or dtype
    # changed mid-run, with the same ops) keep that plan, and no message said so
    return (f"{said}: more than the guard's slack of {slack / mib:,.1f} MiB (what one op of the matched iteration needs); "
            "the report's messages may say why, and shapes grown since that iteration (a larger batch or dtype "
            "mid-run) are not planned for")


def _under_plan(totals: RunTotals, scheduled: int | None) -> str:
    """The peak measured under the plan, beside its forecast: the run's peak includes the first, unplanned
    iterations at the vanilla peak, which read against the forecast look like a miss."""
    if totals.planned_peak_bytes is None:
        return ""
    forecast = f" against {scheduled / 2**20:,.1f} forecast" if scheduled else ""
    return f" ({totals.planned_peak_bytes / 2**20:,.1f} MiB measured under plan{forecast})"
