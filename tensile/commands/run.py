"""`tensile run`: run an unmodified training command under the Tensile hook (local mode)."""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console

from tensile.agent_client import Http
from tensile.agent_contract import GPU_PATTERN
from tensile.child_process import ends_with_this_process
from tensile.commands import output_file
from tensile.console import print_note
from tensile.errors import TensileUserError
from tensile.trace_choices import DEFAULT_BATCH_SIZE, DTYPE_NAMES, OPTIMIZER_NAMES
from tensile.knobs import CONTEXT_BYTES, MAX_SWAP_RATE, MEMORY_BUDGET, MEMORY_CAP, PLAN_EVENTS, RECOMPUTE
from tensile.training_command import local_command
from tensile.plan import PLAN_EVENTS as PLAN_EVENT_CHOICES, load_plan
from tensile_hook.launch import check_environment, hook_environment, hook_variables
from tensile_hook.report import PlanPeak, RunTotals, UnderPlan, memory_cap_outcome
from tensile_hook.settings import HookSettings
from tensile.workload_io import load_workload, save_workload

# passed on to the command when sent to `tensile run` alone; siginfo's si_code of one the kernel sent to the whole
# foreground process group (a terminal's Ctrl-C, its hangup), which the command, in that group, got too
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SI_KERNEL = 0x80
MIB = 2**20
MAX_PLANS_SAID = 3  # plans the summary names; the report lists every iteration's


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run a training command under the Tensile hook", description=__doc__)
    parser.add_argument("--job", help="the job's name in reports, metrics and the node agent (default: 'local'; with "
                                      "--agent, the script's name and 6 random hex digits, e.g. train-3f9a1c, so that two "
                                      "runs never share a registration)")
    parser.add_argument(MEMORY_BUDGET.option, help="bytes (12GiB), or a fraction of the vanilla peak (e.g. 0.6)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--workload", help="the workload the plan is for (tensile forecast --save)")
    source.add_argument("--model", metavar="NAME|FILE.py:FUNC",
                        help="trace the job's iteration from this model before the command starts, as tensile forecast "
                             "--model does, and (without --agent) plan from it: the plan applies from iteration 2 if the "
                             "live iteration matches it, else the hook plans from the live one")
    parser.add_argument("--batch-size", type=int, help=f"with --model: the batch size it is traced at (default {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_NAMES),
                        help="with --model: default adam (zoo) or the model's own make_optimizer")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="with --model: bfloat16/float16 for autocast (default float32)")
    parser.add_argument("--micro-batches", type=int, help="with --model: gradient accumulation steps per optimizer step (1)")
    parser.add_argument("--plan", help="a plan for that workload (tensile forecast --save-plan); default: plan in-process")
    parser.add_argument("--agent", help="node agent URL; without it the hook plans in-process")
    parser.add_argument("--token", help="the job's token for the agent")
    parser.add_argument("--gpu", metavar="UUID|INDEX",
                        help="the agent's GPU the job runs on (TENSILE_GPU): needed where the agent has several")
    parser.add_argument(MAX_SWAP_RATE.option, type=float,
                        help="the share of the GPU's swap traffic in (0, 1] plans may use")
    parser.add_argument(MEMORY_CAP.option, metavar="BYTES",
                        help=f"cap the command's CUDA memory at this ({MEMORY_CAP.variable}: e.g. 12Gi, what it was "
                             "admitted with), also where the hook stands down: past it the job gets an out-of-memory "
                             "error of its own, which the hook turns into evictions where it can")
    parser.add_argument(CONTEXT_BYTES.option, metavar="BYTES",
                        help=f"with {MEMORY_CAP.option}: what of it the process holds outside PyTorch's caching "
                             f"allocator, its CUDA context ({CONTEXT_BYTES.variable}); the allocator gets the rest. "
                             "Default: the GPU preset's by the device's name (600-700 MiB), else 600 MiB")
    parser.add_argument("--report", help="write the hook's JSON report here")
    parser.add_argument("--keep-files", action="store_true",
                        help="keep the run's own files (without --report, the hook's report; with --model, the traced "
                             "workload and its plan) in a temporary folder and say where; they are kept anyway when "
                             "the command fails")
    parser.add_argument("--plot", metavar="PNG", help="write the iterations' measured peaks against the plan's forecast "
                                                       "and the budget, and their times, here")
    parser.add_argument(PLAN_EVENTS.option, choices=PLAN_EVENT_CHOICES,
                        help=f"which events plans use ({PLAN_EVENTS.variable}); default auto: native events only on "
                             "CUDA")
    parser.add_argument(RECOMPUTE.option, dest="recompute", action="store_false",
                        help=f"plans never recompute a tensor ({RECOMPUTE.variable}=false)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ...")
    parser.set_defaults(run=run)


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
        MEMORY_BUDGET.from_option(args.memory_budget)
    if args.max_swap_rate is not None:
        MAX_SWAP_RATE.from_option(str(args.max_swap_rate))
    if args.memory_cap is not None:
        args.memory_cap = MEMORY_CAP.from_option(args.memory_cap)
    if args.context_bytes is not None:
        # the cap the command runs under: the flag's, else the one its environment already sets
        cap, named = args.memory_cap, MEMORY_CAP.option
        if cap is None:
            try:
                cap, named = MEMORY_CAP.from_environment(os.environ, None), MEMORY_CAP.variable
            except ValueError as exc:  # KnobError, naming the variable
                raise TensileUserError(str(exc)) from None
        if cap is None:
            raise TensileUserError(f"{CONTEXT_BYTES.option} is the part of {MEMORY_CAP.option} kept for the CUDA "
                                   f"context: give {MEMORY_CAP.option} too (or set {MEMORY_CAP.variable})")
        args.context_bytes = CONTEXT_BYTES.from_option(args.context_bytes)
        if args.context_bytes >= cap:
            raise TensileUserError(f"{CONTEXT_BYTES.option} ({args.context_bytes:,} bytes) leaves nothing of "
                                   f"{named} ({cap:,} bytes) for the caching allocator: give a larger cap or a "
                                   "smaller context")
    if args.agent:
        try:
            Http(args.agent)  # the client's own check of the URL, before the hook in the child meets it
        except ValueError as exc:
            raise TensileUserError(f"--agent: {exc}") from None
    if args.gpu is not None:
        if not args.agent:
            raise TensileUserError("--gpu names one of the node agent's GPUs: give --agent too")
        if not re.match(GPU_PATTERN, args.gpu):
            raise TensileUserError(f"--gpu: '{args.gpu}' is no GPU UUID or index (the agent lists its GPUs at /v1/gpus)")
    for path, option in ((args.report, "--report"), (args.plot, "--plot")):
        if path:
            output_file(path, option)
    tracing = [option for option, value in (("--batch-size", args.batch_size), ("--optimizer", args.optimizer),
               ("--dtype", args.dtype), ("--micro-batches", args.micro_batches)) if value is not None]
    if tracing and not args.model:
        raise TensileUserError(f"{', '.join(tracing)}: how to trace --model; give --model NAME|FILE.py:FUNC too")
    if args.plan and args.model:
        raise TensileUserError("--plan is for the --workload it was made for; with --model the plan is made now from the "
                               "traced iteration (tensile forecast --model ... --save W.json --save-plan P.json keeps one)")
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


def forecast_files(args: argparse.Namespace, console: Console, folder: Path) -> dict[str, str | None]:
    """--model: the job's iteration traced before the command starts, for the device it will run on, and planned here
    when no node agent plans it (TENSILE's forecast, made before the job runs): the TENSILE_WORKLOAD and TENSILE_PLAN
    of the command (None: no plan file, the agent plans), files in the run's `folder`."""
    import torch

    from tensile import job_forecast
    from tensile.allocator import expandable_segments_in
    from tensile.forecast import optimizer_for, trace_workload
    from tensile.latency.device import forecast_preset

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with console.status(f"tracing one training iteration of {args.model}..."):
        workload = trace_workload(args.model, DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size,
                                  optimizer_for(args.model, args.optimizer), args.dtype or "float32", device,
                                  micro_batches=1 if args.micro_batches is None else args.micro_batches)
    saved = folder / "workload.json.gz"
    save_workload(workload, saved)
    traced = f"{args.model} at batch {workload.batch_size} ({device})"
    if args.agent:
        console.print(f"tensile: {traced} traced; the node agent plans from it", highlight=False)
        return {"TENSILE_WORKLOAD": str(saved), "TENSILE_PLAN": None}
    with console.status("planning swaps and recomputations..."):
        # the preset of this machine's GPU (and its calibrated latency model, where one is on file)
        preset = forecast_preset(device)
        budget = MEMORY_BUDGET.from_option(args.memory_budget) if args.memory_budget else None
        forecast = job_forecast.make_forecast(workload, preset, budget, args.plan_events or "auto", args.recompute,
                                              args.max_swap_rate or 1.0,
                                              expandable_segments=expandable_segments_in(os.environ),
                                              environ=os.environ)
    for note in forecast.notes:
        print_note(note)
    summary = forecast.summary
    plan_file = folder / "plan.json"
    plan_file.write_text(json.dumps(forecast.plan.to_dict(), indent=1))
    unfit = "" if summary["fits"] else f" ({summary['plan_message']})"
    console.print(f"tensile: forecast of {traced}: vanilla peak {summary['vanilla_peak_bytes'] / MIB:,.1f} MiB, "
                  f"scheduled {summary['scheduled_peak_bytes'] / MIB:,.1f} MiB by {summary['plan_events']} events{unfit}",
                  highlight=False)
    return {"TENSILE_WORKLOAD": str(saved), "TENSILE_PLAN": str(plan_file)}


def run(args: argparse.Namespace) -> int:
    command = _check(args)
    console = Console(stderr=True)
    named = args.job is None
    if named:
        args.job = _unique_job(command) if args.agent else "local"
    variables = hook_variables(memory_budget=args.memory_budget, workload=args.workload, plan=args.plan,
                               agent=args.agent, token=args.token, gpu=args.gpu, max_swap_rate=args.max_swap_rate,
                               report=args.report, plan_events=args.plan_events, recompute=args.recompute,
                               memory_cap=args.memory_cap, context_bytes=args.context_bytes)
    env = hook_environment(args.job, variables)
    # before --model's tracing and its files, which stand in for the environment's: a bad setting is refused before
    # anything is done or made
    check_environment(env, set(variables) | ({"TENSILE_WORKLOAD", "TENSILE_PLAN"} if args.model else set()))
    scratch = Path(tempfile.mkdtemp(prefix="tensile-"))  # the run's own files: removed at the end unless kept
    returncode = 1
    try:
        returncode = _run_in(scratch, args, command, env, named, console)
        return returncode
    finally:
        if (args.keep_files or returncode != 0) and any(scratch.iterdir()):
            console.print(f"tensile: the run's files (report, traced workload, plan) kept in {scratch}",
                          highlight=False, soft_wrap=True)  # a path broken over lines cannot be pasted
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def _run_in(scratch: Path, args: argparse.Namespace, command: list[str], env: dict[str, str], named: bool,
            console: Console) -> int:
    """The command run under the hook, its own files in `scratch`; its exit status."""
    if args.model:  # with --agent no plan file: the agent plans from the traced workload, not one the environment names
        for variable, path in forecast_files(args, console, scratch).items():
            if path is None:
                env.pop(variable, None)
            else:
                env[variable] = path
    if named and args.agent:
        console.print(f"tensile: the job registers with the node agent as {args.job} (--job names it)", highlight=False)
    report = args.report
    if report is None:
        report = env["TENSILE_REPORT"] = str(scratch / "report.json")
    started = time.time() - 1  # file times are coarse: a write just after this may read a few ms earlier
    returncode = _run_forwarding(command, env)
    killed = _signal_name(-returncode) if returncode < 0 else None
    # a report file of an earlier run, which this one never rewrote (killed first), is not this run's
    data = json.loads(Path(report).read_text()) if Path(report).exists() and Path(report).stat().st_mtime >= started else None
    if killed:
        console.print(f"[yellow]tensile: {_killed(_script(command), killed, report, data)}[/]", highlight=False)
    if data is not None:
        totals = RunTotals.of(data)
        console.print(
            f"tensile: {totals.iterations} iterations, {totals.planned} under plan "
            f"(source: {data['plan_source'] or 'none'}), peak {totals.peak_bytes / MIB:,.1f} MiB"
            f"{_under_plan(totals.under_plan)}{f'; report: {report}' if args.report else ''}"
        )
        over = _over_budget(totals.under_plan, data.get("guard_slack_bytes"), data.get("workspace_bytes"))
        if over:
            console.print(f"[yellow]tensile: {over}[/]")
        if data.get("stood_down"):
            console.print(f"[yellow]tensile: the hook stood down: {data['stood_down']}[/]")
        capped = memory_cap_outcome(data, totals)
        if capped:
            console.print(f"tensile: {capped}", highlight=False)
    if args.plot:
        if data is not None and data["iterations"]:
            from tensile.plots import plot_iterations

            title = f"{_script(command)} under Tensile ({data['device']}): {RunTotals.of(data).iterations} iterations"
            console.print(f"tensile: plot: {plot_iterations(data, args.plot, title)}", highlight=False)
        else:
            console.print(f"[yellow]tensile: no iteration was reported: no plot written to {args.plot}[/]", highlight=False)
    return 128 - returncode if returncode < 0 else returncode  # a signal's exit status, as a shell gives it


def _run_forwarding(command: list[str], env: dict[str, str]) -> int:
    """The command's exit status (negative: the signal that ended it, as Popen's), passing on SIGINT, SIGTERM and
    SIGHUP sent to `tensile run` alone: `kill` of it left the training running with no parent, its GPU memory held
    (`kill -9`, which no handler sees: the kernel sends the command SIGTERM, `ends_with_this_process`). The command
    stays in this process group, so it keeps the terminal (reads it, stops at Ctrl-Z); a signal the terminal sent
    reached the command already, and is not sent twice (a second SIGINT would cut short the hook's exit: the
    report's last write, the agent's unregistering). The signals are blocked and waited for (with SIGCHLD, the
    command's end) rather than handled, for their si_code, which tells the terminal's apart."""
    watched = {*FORWARDED, signal.SIGCHLD}
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    try:
        try:
            child = subprocess.Popen(command, env=env, preexec_fn=ends_with_this_process(
                lambda: signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)))
        except OSError as exc:  # e.g. a file marked executable that is no program ("Exec format error")
            raise TensileUserError(f"cannot start '{command[0]}': {exc.strerror}; check the command after '--'") from None
        while True:
            info = signal.sigtimedwait(watched, 1.0)  # the timeout only guards against a missed SIGCHLD
            if info is not None and info.si_signo != signal.SIGCHLD and info.si_code != SI_KERNEL:
                child.send_signal(info.si_signo)
            if child.poll() is not None:
                while signal.sigtimedwait(watched, 0) is not None:  # those that came as it ended: consumed, not raised
                    pass
                return child.returncode
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def _script(command: list[str]) -> str:
    """What the command runs, by name: the first .py file, a `-m` module, else the program."""
    script = next((a for a in command[1:] if a.endswith(".py")), None)
    if script is not None:
        return Path(script).name
    if "-m" in command[1:-1]:
        return command[command.index("-m", 1) + 1]
    return Path(command[0]).name


def _unique_job(command: list[str]) -> str:
    """A job name for the node agent that no other run has: a fixed one ('local') made every second job started
    without --job, and a job re-run within the agent's --expire-silent-jobs after a kill, a clash the agent refused.
    Random, not the process id: a container's processes get the same ids every start."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", _script(command).removesuffix(".py")).strip("._-")[:40].strip("._-")
    return f"{stem or 'job'}-{secrets.token_hex(3)}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _killed(script: str, signal_name: str, report: str, data: dict | None) -> str:
    """The command ended by a signal: its report is the last one the hook wrote before (its exit handlers ran only
    for SIGINT, which Python turns into KeyboardInterrupt), and the summary read as if it had finished."""
    if data is None:
        return f"{script} was killed by {signal_name} before the hook wrote its report"
    written = time.strftime("%H:%M:%S", time.localtime(Path(report).stat().st_mtime))
    interval = os.environ.get("TENSILE_REPORT_INTERVAL") or HookSettings.report_interval
    return (f"{script} was killed by {signal_name} after {RunTotals.of(data).iterations} iterations; the report holds what "
            f"was written up to {written} (the hook rewrites it every TENSILE_REPORT_INTERVAL, {interval} s)")


def _over_budget(under_plan: UnderPlan, slack: int | None, workspace: int | None = None) -> str:
    """The iteration under plan furthest over the memory budget in force when it ran, where one went over: the
    guard keeps the job under the budget plus what one op needs at once (its inputs and outputs, which it cannot
    evict), and the summary said neither. Each against its own budget: one lowered mid-run (an operator's PATCH)
    is not what the iterations before kept to. (The iterations before the plan run at the vanilla peak: a
    fractional budget needs it measured.) On CUDA the peak also holds the libraries' workspaces, which no plan
    moves and the operator books outside the budget (`workspace_bytes`)."""
    if under_plan.over_budget is None:
        return ""
    peak, budget = under_plan.over_budget
    over = peak - budget
    said = f"the peak under plan, {peak / MIB:,.1f} MiB, went over the memory budget of {budget / MIB:,.1f} MiB by {over / MIB:,.2f} MiB"
    if workspace:
        said += f", {workspace / MIB:,.1f} MiB of it CUDA's library workspaces (booked outside the budget)"
        over -= workspace
    if slack is None:
        return said
    if over <= slack:
        return f"{said}: within the guard's slack of {slack / MIB:,.1f} MiB (what one op needs on the device at once)"
    # the slack is the largest op of the iterations recorded: shapes grown since go unseen where the model takes
    # keyword arguments only (runtime_hook/tensile_hook/shapes.py compares the first module call's positional tensors)
    return (f"{said}: more than the guard's slack of {slack / MIB:,.1f} MiB (what one op of a recorded iteration needs); "
            "the report's messages may say why; a model called with keyword arguments only (model(**batch)) is not "
            "checked for a batch grown mid-run")


def _under_plan(under_plan: UnderPlan) -> str:
    """Each plan's peak measured under it beside its own forecast: the run's peak includes the first, unplanned
    iterations at the vanilla peak, and one plan's peak read against another's forecast (a re-plan's) looks like
    a miss. A plan's first iteration is left out, said where it peaked higher (PlanPeak says why)."""
    plans = under_plan.plans
    if not plans:
        return ""
    shown = plans
    if len(plans) > MAX_PLANS_SAID:  # the last plan, and the latest of those over their forecast
        shown = [p for p in plans[:-1] if _over_forecast(p)][-(MAX_PLANS_SAID - 1):] + plans[-1:]
    said = [_plan_peak(p) for p in shown]
    if len(shown) < len(plans):
        within = " within their forecasts" if not any(_over_forecast(p) for p in plans if p not in shown) else ""
        said.append(f"{len(plans) - len(shown)} other plans{within}")
    firsts = [first for p in plans if p.peak_bytes is not None and (first := p.first_peak_bytes or 0) > p.peak_bytes]
    if firsts:
        said.append(f"the first iteration under a plan left out ({max(firsts) / MIB:,.1f} MiB): it starts with what the "
                    "plan keeps off the device between iterations still there")
    return f" ({'; '.join(said)})"


def _over_forecast(plan: PlanPeak) -> bool:
    return plan.peak_bytes is not None and plan.scheduled_peak_bytes is not None and plan.peak_bytes > plan.scheduled_peak_bytes


def _plan_peak(plan: PlanPeak) -> str:
    forecast = f" against {plan.scheduled_peak_bytes / MIB:,.1f} forecast" if plan.scheduled_peak_bytes else ""
    if plan.peak_bytes is None:  # it ran one iteration each time it took over
        return f"plan version {plan.plan_version}: only its first iteration measured, {(plan.first_peak_bytes or 0) / MIB:,.1f} MiB{forecast}"
    return f"{plan.peak_bytes / MIB:,.1f} MiB measured under plan version {plan.plan_version}{forecast}"
