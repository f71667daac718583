"""`tensile run` as a user meets it: job names that never clash at the node agent, signals
passed on to the training, a command killed by a signal said so, the summary comparing each plan with its own
forecast and each iteration with the budget in force then, and `--gpu` for an agent with several GPUs."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import pytest
import torch
from tests.support.agent_harness import ROOT, get
from tests.support.agent_harness import wait_for as _wait
from tests.support.bit_identity import assert_identical
from tests.support.linked_hook import FAST, SCRIPT
from tests.support.linked_hook import agent_settings as _agent_settings
from tests.support.linked_hook import fit_linked as _fit_linked
from tests.support.linked_hook import live_workload as _live_workload
from tests.support.training import fit

from tests.support import tracing_models
from tensile.agent_client import AgentClient, update_knobs
from tensile.agent_contract import NAME_PATTERN
from tensile.cli import main
from tensile.commands.run import _over_budget, _unique_job, _under_plan
from tensile.peak import analyze_vanilla
from tensile_hook.agent_link import AgentLink
from tensile_hook.plan_source import local_planner
from tensile_hook.report import KEPT_ITERATIONS, HookReport, IterationStats, RunTotals

MIB = 2**20


def _start(*options: str, script: str = SCRIPT, script_args: tuple[str, ...] = ("--steps", "3"), env: dict | None = None,
           python: tuple[str, ...] = (), **popen) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    """`tensile run OPTIONS -- python PYTHON SCRIPT ARGS` as a process of its own, stderr kept."""
    command = [sys.executable, "-m", "tensile.cli", "run", *options, "--", sys.executable, *python, script, *script_args]
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(command, cwd=ROOT, env=os.environ | FAST | (env or {}), text=True, **popen)


def _said(proc: subprocess.Popen, timeout: float = 120) -> str:
    """What it printed on stderr, its lines joined (rich wraps them)."""
    _, err = proc.communicate(timeout=timeout)
    return " ".join(err.split())


def _jobs(url: str) -> list[dict]:
    return get(url, "/v1/jobs")[1]["jobs"]  # type: ignore[index]


def _child_of(pid: int) -> int:
    _wait(lambda: Path(f"/proc/{pid}/task/{pid}/children").read_text().split(), 30, "the command's process")
    return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])


# -- 1. job names --------------------------------------------------------------------------------------------


def test_a_default_job_name_is_the_scripts_and_never_the_same_twice():
    names = {_unique_job([sys.executable, "examples/train.py", "--steps", "3"]) for _ in range(20)}
    assert len(names) == 20 and all(re.fullmatch(r"train-[0-9a-f]{6}", n) for n in names), names
    for command, stem in (([sys.executable, "-m", "pkg.trainer"], "pkg.trainer"), (["torchrun", "--nproc", "2"], "torchrun"),
                          ([sys.executable, "my script!.py"], "my-script"), ([sys.executable, "..py"], "job")):
        name = _unique_job(command)
        assert name.rsplit("-", 1)[0] == stem and re.fullmatch(NAME_PATTERN, name), name


@pytest.mark.slow
def test_a_name_registered_already_is_refused_with_the_fix(agent_server, tiny_workload, tmp_path):
    """A job re-run under its name right after a kill (the agent holds it until --expire-silent-jobs) was told only
    that it was "registered already under another token": the user had chosen no token."""
    agent = agent_server()
    AgentClient(agent.url, "victim").register(workload=tiny_workload())  # the killed run, not yet forgotten
    proc = _start("--agent", agent.url, "--job", "victim", "--report", str(tmp_path / "r.json"))
    said = _said(proc)
    assert proc.returncode == 0, said
    assert ("node agent refused the job (agent answered 403: a job named default/victim is registered already, under another "
            "token (a run still going, or one stopped less than the agent's --expire-silent-jobs ago") in said, said
    assert "training goes on without it; give this run another --job NAME (TENSILE_JOB)" in said, said


# -- 2, 3. signals ------------------------------------------------------------------------------------------

CHILD = """
import os, signal, sys, time
wakeup, written = os.pipe()  # a byte per signal delivered, written by the C handler: Python runs its handler once for
os.set_blocking(written, False)  # two that come before it runs, and a test of double delivery would pass by chance
signal.set_wakeup_fd(written)
for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(number, lambda n, frame: None)
open(sys.argv[1] + ".ready", "w").write(str(os.getpid()))
got = os.read(wakeup, 1)
time.sleep(1.0)  # a second delivery would come in this time
os.set_blocking(wakeup, False)
try:
    got += os.read(wakeup, 100)
except BlockingIOError:
    pass
open(sys.argv[1], "w").write(" ".join(signal.Signals(n).name for n in got))
signal.signal(got[0], signal.SIG_DFL)
os.kill(os.getpid(), got[0])
"""


def _signalled_child(tmp_path: Path, **popen) -> tuple[subprocess.Popen, Path, int]:  # type: ignore[no-untyped-def]
    """`tensile run` of a script that records the signals it gets and then dies of the first; once it is ready. Plain
    Python (-S: no site, so no hook): torch's threads could take a signal for the main thread, which then runs its
    handler once for two."""
    script, got = tmp_path / "child.py", tmp_path / "got"
    script.write_text(CHILD)
    proc = _start(script=str(script), script_args=(str(got),), python=("-S",), **popen)
    ready = Path(f"{got}.ready")
    _wait(lambda: ready.exists() and ready.read_text(), 60, "the command's signal handlers")
    return proc, got, int(ready.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_tensile_run_reaches_the_command_which_it_waits_for(tmp_path, sent):
    """`kill` of `tensile run` left the training running with no parent (PPID 1) and its memory held."""
    proc, got, child = _signalled_child(tmp_path)
    proc.send_signal(sent)
    said = _said(proc)
    assert got.read_text() == sent.name
    assert proc.returncode == 128 + sent, said  # as a shell gives a command killed by it
    assert f"child.py was killed by {sent.name} before the hook wrote its report" in said, said
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["command", "tensile run"])
def test_sigterm_ends_a_hooked_training_through_the_hooks_exit(tmp_path, to):
    """A pod's termination, `kill` of the training or of `tensile run` (passed on) send SIGTERM, whose default ended the
    process at once: the report stopped at its last periodic write (here the first), the node agent kept the job."""
    report = tmp_path / "report.json"
    proc = _start("--report", str(report), script_args=("--steps", "100000", "--pause", "0.01"),
                  env={"TENSILE_REPORT_INTERVAL": "3000"}, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    steps = [line for line, _ in zip(proc.stdout, range(3))]  # steps 0, 5 and 10: 11 iterations at least
    assert steps[-1].startswith("step 10:"), steps
    os.kill(proc.pid if to == "tensile run" else _child_of(proc.pid), signal.SIGTERM)
    said = _said(proc)
    assert proc.returncode == 128 + signal.SIGTERM, said
    assert RunTotals.of(json.loads(report.read_text())).iterations >= 11, said
    assert "the training ends here, after the hook's last report" in said, said


SIGTERM_IN_A_CALLBACK = """
import os, signal, sys, threading, weakref
sys.path.insert(0, {examples!r})
from tiny_mlp import build
model, batch, loss_fn, make_optimizer = build(8)
optimizer = make_optimizer(model.parameters())
class Doomed: pass
def terminate_inside(_ref):  # the handler runs here, inside a weakref callback, whose exceptions Python ignores
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    for _ in range(10000): pass
for step in range(200):
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model, batch).backward()
    optimizer.step()
    if step == 3:
        doomed = Doomed()
        ref = weakref.ref(doomed, terminate_inside)
        del doomed
        print("went on past the SIGTERM", flush=True)
print("trained to the end", flush=True)
"""


@pytest.mark.slow
def test_a_sigterm_swallowed_by_a_callback_still_ends_the_training(tmp_path):
    """Python runs a signal's handler inside whatever Python code runs, a weakref callback too (the hook's storage
    registry runs hundreds an iteration), where its SystemExit is printed and ignored: the training went on to its end."""
    script, report = tmp_path / "train.py", tmp_path / "report.json"
    script.write_text(SIGTERM_IN_A_CALLBACK.format(examples=str(ROOT / "examples")))
    proc = _start("--report", str(report), script=str(script), script_args=(), stdout=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    said = " ".join(err.split())
    assert "went on past the SIGTERM" in out and "SystemExit" in said, said  # swallowed first, as the callback ran
    assert "trained to the end" not in out and proc.returncode == 128 + signal.SIGTERM, said
    assert RunTotals.of(json.loads(report.read_text())).iterations == 5, said  # ended at the step after the callback


@pytest.mark.slow
def test_sigkill_of_tensile_run_ends_the_command_with_sigterm(tmp_path):
    """No handler sees SIGKILL, so nothing passed it on: the training went on with no parent (PPID 1), its memory held.
    The kernel sends the command SIGTERM instead (the parent-death signal), which the hook's exit handling sees."""
    proc, got, child = _signalled_child(tmp_path)
    proc.kill()
    proc.wait(30)
    _wait(lambda: got.exists() and got.read_text(), 30, "the command's record of its signal")
    assert got.read_text() == "SIGTERM"
    _wait(lambda: _gone(child), 30, "the command's end")


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie that its new parent (a container's PID 1 may not reap) has yet to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_ctrl_c_at_the_terminal_reaches_the_command_once(tmp_path):
    """The terminal sends SIGINT to the whole foreground group, the command included: passed on too, the command
    got two, and a second KeyboardInterrupt can cut the hook's exit short (its last report, unregistering)."""
    controller, terminal = os.openpty()

    def own_terminal() -> None:  # a session of its own, the pty its controlling terminal: its group in the foreground
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        proc, got, _ = _signalled_child(tmp_path, stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True,
                                        preexec_fn=own_terminal)
        os.write(controller, b"\x03")
        assert proc.wait(60) == 128 + signal.SIGINT
        assert got.read_text() == "SIGINT"
    finally:
        os.close(controller)
        os.close(terminal)


@pytest.mark.slow
def test_a_command_killed_by_sigkill_is_said_killed_with_what_its_report_holds(tmp_path):
    """It printed the stale report's summary as if the training had finished, and exited 247."""
    report = tmp_path / "report.json"
    proc = _start("--report", str(report), script_args=("--steps", "1000", "--pause", "0.05"),
                  env={"TENSILE_REPORT_INTERVAL": "0.2"})
    _wait(lambda: report.exists() and len(json.loads(report.read_text())["iterations"]) >= 4, 60, "a report of 4 iterations")
    os.kill(_child_of(proc.pid), signal.SIGKILL)
    said = _said(proc)
    assert proc.returncode == 128 + signal.SIGKILL, said
    written = time.strftime("%H:%M:%S", time.localtime(report.stat().st_mtime))
    iterations = RunTotals.of(json.loads(report.read_text())).iterations
    assert (f"train_mlp.py was killed by SIGKILL after {iterations} iterations; the report holds what was written up to "
            f"{written} (the hook rewrites it every TENSILE_REPORT_INTERVAL, 0.2 s)") in said, said
    assert f"tensile: {iterations} iterations" in said, said


# -- 4. the summary: each plan against its own forecast, each iteration against its budget ------------------


def _report(*iterations: tuple[str, int | None, int, int | None, int | None]) -> HookReport:
    """Iterations of (mode, plan version, peak, budget, forecast) in MiB, stamped as the hook stamps them."""
    report = HookReport("job", "cpu")
    for i, (mode, version, peak, budget, forecast) in enumerate(iterations):
        report.plan_version = version
        report.memory_budget_bytes = None if budget is None else budget * MIB
        report.scheduled_peak_bytes = None if forecast is None else forecast * MIB
        report.add(IterationStats(i, mode, version, peak_bytes=peak * MIB))
    return report


def test_each_plans_peak_is_said_against_its_own_forecast_and_each_iteration_against_its_budget():
    """A plan version 1 iteration's peak was said against version 3's forecast, and a budget the
    agent lowered mid-run (PATCH /knobs) made the summary say the iterations before had gone over it."""
    report = _report(("recording", None, 48, None, None), ("recording", None, 48, 40, None),
                     ("planned", 1, 30, 40, 26), ("planned", 1, 23, 40, 26), ("diverged", 1, 23, 40, 26), ("planned", 1, 23, 40, 26),
                     ("planned", 2, 24, 25, 16), ("planned", 2, 19, 25, 16), ("planned", 2, 19, 25, 16))
    assert [it.memory_budget_bytes for it in report.iterations][1:3] == [40 * MIB, 40 * MIB]
    data = json.loads(json.dumps(report.to_dict()))
    under_plan = RunTotals.of(data).under_plan
    assert [(p.plan_version, p.peak_bytes, p.first_peak_bytes, p.iterations) for p in under_plan.plans] == [
        (1, 23 * MIB, 30 * MIB, 3), (2, 19 * MIB, 24 * MIB, 3)]
    assert under_plan.over_budget is None and _over_budget(under_plan, 12 * MIB) == ""
    assert _under_plan(under_plan) == (
        " (23.0 MiB measured under plan version 1 against 26.0 forecast; 19.0 MiB measured under plan version 2 against "
        "16.0 forecast; the first iteration under a plan left out (30.0 MiB): it starts with what the plan keeps off the "
        "device between iterations still there)")
    # one iteration over the budget in force then (the guard's slack allows what one op needs at once)
    over = RunTotals.of(_report(("planned", 1, 30, 40, 26), ("planned", 1, 41, 40, 26), ("planned", 2, 26, 25, 16)).to_dict())
    assert over.under_plan.over_budget == [41 * MIB, 40 * MIB]
    assert _over_budget(over.under_plan, 12 * MIB) == ("the peak under plan, 41.0 MiB, went over the memory budget of 40.0 MiB "
                                                      "by 1.00 MiB: within the guard's slack of 12.0 MiB (what one op needs on "
                                                      "the device at once)")
    # on CUDA the peak holds the libraries' workspaces too, booked outside the budget: over by them and the slack
    assert _over_budget(over.under_plan, 512 * 1024, 2 * MIB) == (
        "the peak under plan, 41.0 MiB, went over the memory budget of 40.0 MiB by 1.00 MiB, 2.0 MiB of it CUDA's "
        "library workspaces (booked outside the budget): within the guard's slack of 0.5 MiB (what one op needs on the "
        "device at once)")
    assert "more than the guard's slack" in _over_budget(over.under_plan, 512 * 1024, MIB // 4)


def test_many_plans_are_summed_up_and_a_plan_with_one_iteration_says_so():
    report = _report(*[("planned", v, 20 + (v == 2), 40, 20) for v in range(1, 7) for _ in range(2)], ("planned", 7, 9, 40, 10))
    said = _under_plan(RunTotals.of(report.to_dict()).under_plan)
    assert said == (" (21.0 MiB measured under plan version 2 against 20.0 forecast; plan version 7: only its first "
                    "iteration measured, 9.0 MiB against 10.0 forecast; 5 other plans within their forecasts)")


def test_a_long_runs_omitted_iterations_keep_their_plans_and_budgets():
    """The middle of a run past 2,000 iterations is totalled: its plans, first iterations and budgets still count,
    and the first listed after them knows the plan it follows."""
    change = KEPT_ITERATIONS + 50
    rows = [("planned", 1 if i < change else 2, 30 if i == change else 20 + (i == 400), 40 if i < change else 25,
             26 if i < change else 16) for i in range(2 * KEPT_ITERATIONS + 100)]
    rows[change + 10] = ("planned", 2, 27, 25, 16)  # omitted, over the lowered budget
    totals = RunTotals.of(json.loads(json.dumps(_report(*rows).to_dict())))
    assert [(p.plan_version, p.peak_bytes, p.first_peak_bytes, p.iterations) for p in totals.under_plan.plans] == [
        (1, 21 * MIB, 20 * MIB, change), (2, 27 * MIB, 30 * MIB, len(rows) - change)]
    assert totals.under_plan.over_budget == [30 * MIB, 25 * MIB]


@pytest.mark.slow
def test_a_budget_lowered_mid_run_is_each_iterations_own(agent_server):
    """Through a real agent: the iterations before an operator lowered the budget ran under the higher one, and
    the summary no longer says they went over the lower one."""
    steps = 8
    plain = fit(tracing_models.views, 4, steps)
    live, agent = _live_workload(tracing_models.views, 4), agent_server()
    budget = analyze_vanilla(live).peak_bytes // 2
    settings = dataclasses.replace(_agent_settings(agent.url, "ns/lowered", agent_wait=30.0), memory_budget=0.9)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2), local_planner(settings, torch.device("cpu")))
    link.start(live)

    def after_step(step: int) -> None:
        if step == 4:
            assert link.client.token is not None
            update_knobs(agent.url, "ns/lowered", link.client.token, {"memoryBudgetBytes": budget})
            _wait(lambda: link._plan_ready(), 30, "the plan for the lowered budget at the link")

    hooked, report, _ = _fit_linked(link, settings, steps, after_step)
    assert_identical(plain, hooked)
    budgets = [it.memory_budget_bytes for it in report.iterations]
    higher = int(0.9 * analyze_vanilla(live).peak_bytes)
    assert set(budgets[2:5]) == {higher} and budgets[-2:] == [budget, budget], (budgets, higher)
    planned = [(it.plan_version, it.scheduled_peak_bytes) for it in report.iterations if it.mode == "planned"]
    assert len({version for version, _ in planned}) == 2 and all(forecast for _, forecast in planned), planned
    totals = RunTotals.of(report.to_dict())
    assert totals.planned_peak_bytes is not None and totals.planned_peak_bytes > budget  # what was said against the lower budget
    over = totals.under_plan.over_budget
    assert over is None or over[0] - over[1] <= (report.guard_slack_bytes or 0), over


# -- 5. --gpu ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_agent_with_several_gpus_takes_the_job_on_the_one_given_with_gpu(agent_server, tmp_path):
    """Its refusal named only the request's 'gpu' field, which `tensile run` had no option for. Both runs name no job:
    each registers under a name of its own (both were `local`, and the second was refused as "registered already")."""
    agent = agent_server(["a6000:48GiB", "a6000:48GiB"])
    unnamed = _start("--agent", agent.url, "--report", str(tmp_path / "a.json"))
    said = _said(unnamed)
    assert unnamed.returncode == 0 and "this node has several GPUs" in said, said
    assert "training goes on without it; name one of its GPUs with --gpu UUID|INDEX (TENSILE_GPU)" in said, said
    first = re.search(r"registers with the node agent as (train_mlp-[0-9a-f]{6}) ", said)
    named = _start("--agent", agent.url, "--gpu", "1", "--report", str(tmp_path / "b.json"), script_args=("--steps", "30", "--pause", "0.05"))
    gpu = agent.agent.state.inventory.find("1").uuid
    try:
        _wait(lambda: [j["job"] for j in _jobs(agent.url) if j["gpu"] == gpu], 60, "the job on GPU 1")
        registered = _jobs(agent.url)[0]["job"]
    finally:
        said = _said(named)
    assert named.returncode == 0 and "refused" not in said, said
    assert first is not None and f"registers with the node agent as {registered} " in said and registered != first[1], said
    assert json.loads((tmp_path / "b.json").read_text())["plan_source"] == "agent"


@pytest.mark.parametrize("options, named", [
    (["--gpu", "1"], "--gpu names one of the node agent's GPUs: give --agent too"),
    (["--agent", "http://127.0.0.1:1", "--gpu", "GPU 1"], "--gpu: 'GPU 1' is no GPU UUID or index"),
])
def test_tensile_run_refuses_a_gpu_it_cannot_name(capsys, options, named):
    assert main(["run", *options, "--", sys.executable, "-c", "pass"]) == 2
    assert named in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("variable, value, named", [
    ("TENSILE_LATENCY_SAMPLE_EVERY", "abc", "TENSILE_LATENCY_SAMPLE_EVERY: 'abc' is not a number"),
    ("TENSILE_AGENT_TIMEOUT", "-1", "TENSILE_AGENT_TIMEOUT"),
    ("TENSILE_AGENT", "ftp://host", "TENSILE_AGENT: "),
    ("TENSILE_GPU", "GPU 1", "TENSILE_GPU: 'GPU 1' is no GPU UUID or index"),
    ("TENSILE_WORKLOAD", "{tmp}/none.json", "{tmp}/none.json: cannot read workload file"),
    ("TENSILE_PLAN", "{tmp}/plan.json", "TENSILE_PLAN needs TENSILE_WORKLOAD"),
])
def test_tensile_run_refuses_a_bad_setting_from_the_environment_before_the_command_starts(capsys, monkeypatch, tmp_path,
                                                                                         variable, value, named):
    """The hook in the child stood down on it and the training ran without Tensile, said in one line of its output."""
    ran = tmp_path / "ran"
    monkeypatch.setenv(variable, value.format(tmp=tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a report's folder would be made
    assert main(["run", "--", sys.executable, "-c", f"open({str(ran)!r}, 'w')"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert named.format(tmp=tmp_path) in said and "set in the environment: fix or unset it" in said, said
    assert not ran.exists() and not list(tmp_path.glob("tensile-*"))  # refused before anything was made


# what the cluster's and the local runner's parts need; the GPU image docs/gpu-checklist.md runs on has none of them
CLUSTER_PARTS = ("jsonschema", "fastapi", "uvicorn", "kopf", "kubernetes", "kubernetes_validate")


@pytest.mark.slow
def test_tensile_run_needs_none_of_the_cluster_parts(tmp_path: Path) -> None:
    """`tensile run` runs in the training's environment, which may hold only what the hook needs: building the CLI's
    parsers imported every command's module, `tensile local`'s reader of TrainingJob files among them, which imports
    jsonschema (on a GPU image without it, `tensile run` died before the training started). A run of a training under
    the hook, with those modules refused, goes through and asks for none of them."""
    probe = (
        "import sys\n"
        f"PARTS = {CLUSTER_PARTS!r}\n"
        "asked = []\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in PARTS:\n"
        "            asked.append(name)\n"
        "            raise ModuleNotFoundError(f'no module named {name!r} in this image')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "from tensile.cli import main\n"
        f"code = main(['run', '--memory-budget', '0.6', '--report', {str(tmp_path / 'r.json')!r}, '--', sys.executable,"
        f" {str(SCRIPT)!r}, '--steps', '3'])\n"
        "print('asked for:', sorted(set(asked)))\n"
        "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=os.environ | FAST)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "asked for: []", done.stdout
    assert len(json.loads((tmp_path / "r.json").read_text())["iterations"]) == 3


@pytest.mark.slow
def test_the_runs_own_files_are_removed_unless_kept_or_the_command_failed(capsys, monkeypatch, tmp_path):
    """Every run without --report left a temporary folder behind; one that failed keeps its report for the post-mortem,
    and --keep-files keeps any."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["run", "--", sys.executable, "-c", "pass"]) == 0
    assert not list(tmp_path.glob("tensile-*")) and "kept in" not in capsys.readouterr().err
    assert main(["run", "--", sys.executable, "-c", "import torch; raise SystemExit(3)"]) == 3
    (kept,) = tmp_path.glob("tensile-*")
    assert (kept / "report.json").exists() and f"kept in {kept}" in " ".join(capsys.readouterr().err.split())
    assert main(["run", "--keep-files", "--", sys.executable, "-c", "import torch"]) == 0
    assert len(list(tmp_path.glob("tensile-*"))) == 2


@pytest.mark.slow
def test_a_script_that_crashes_before_its_first_step_is_said_to_have_crashed(capfd, monkeypatch, tmp_path):
    """Its own error, not "no optimizer step was seen" (which reads as Tensile missing the training)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    crash = "import torch\nraise FileNotFoundError('no dataset at /data/train')\n"
    assert main(["run", "--report", str(tmp_path / "r.json"), "--", sys.executable, "-c", crash]) == 1
    said = " ".join(capfd.readouterr().err.split())
    assert "FileNotFoundError: no dataset at /data/train" in said, said
    assert "the script ended with FileNotFoundError before its first optimizer step" in said, said
    assert "no optimizer step was seen" not in said, said
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["iterations"] == [] and "ended with FileNotFoundError" in report["messages"][0]


def test_tensile_run_refuses_a_memory_cap_that_is_no_size(capsys):
    assert main(["run", "--memory-cap", "lots", "--", sys.executable, "-c", "pass"]) == 2
    assert "--memory-cap: 'lots' is not a memory size" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("options, said", [
    (["--context-bytes", "700Mi"], "--context-bytes is the part of --memory-cap kept for the CUDA context: give "
                                   "--memory-cap too (or set TENSILE_MEMORY_CAP)"),
    (["--memory-cap", "1Gi", "--context-bytes", "1Gi"], "--context-bytes (1,073,741,824 bytes) leaves nothing of "
                                                        "--memory-cap (1,073,741,824 bytes) for the caching allocator"),
    (["--memory-cap", "1Gi", "--context-bytes", "some"], "--context-bytes: 'some' is not a memory size")])
def test_tensile_run_refuses_a_context_without_a_cap_or_as_large_as_it(capsys, options, said):
    assert main(["run", *options, "--", sys.executable, "-c", "pass"]) == 2
    assert said in " ".join(capsys.readouterr().err.split())


def test_a_context_is_taken_with_the_cap_the_environment_sets_and_held_against_it(capfd, monkeypatch, tmp_path):
    """A cap set in the environment (a wrapper script's, a pod's) is the cap `--context-bytes` is part of: the context
    reaches the command beside it, and one as large as it is refused naming the variable."""
    monkeypatch.setenv("TENSILE_MEMORY_CAP", "64Mi")
    assert main(["run", "--context-bytes", "64Mi", "--", sys.executable, "-c", "pass"]) == 2
    assert ("--context-bytes (67,108,864 bytes) leaves nothing of TENSILE_MEMORY_CAP (67,108,864 bytes)"
            in " ".join(capfd.readouterr().err.split()))
    probe = "import os; print(os.environ['TENSILE_MEMORY_CAP'], os.environ['TENSILE_CONTEXT_BYTES'])"
    assert main(["run", "--context-bytes", "16Mi", "--report", str(tmp_path / "r.json"), "--", sys.executable, "-c",
                 probe]) == 0
    assert f"64Mi {16 * 2**20}" in capfd.readouterr().out


def test_a_cap_in_the_environment_that_is_no_size_is_refused_before_the_command_starts(capsys, monkeypatch):
    """The cap's variables are read by sitecustomize, which would print a line and leave the job uncapped."""
    monkeypatch.setenv("TENSILE_CONTEXT_BYTES", "much")
    assert main(["run", "--", sys.executable, "-c", "pass"]) == 2
    assert "TENSILE_CONTEXT_BYTES: 'much' is not a memory size" in " ".join(capsys.readouterr().err.split())


@pytest.mark.slow
def test_tensile_run_gives_the_command_its_memory_cap_and_expandable_segments(capfd, monkeypatch, tmp_path):
    """The cap reaches the command's sitecustomize as TENSILE_MEMORY_CAP (bytes); the allocator setting gains
    expandable segments beside the user's own."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    probe = ("import os; print(os.environ['TENSILE_MEMORY_CAP'], os.environ['TENSILE_CONTEXT_BYTES'], "
             "os.environ['PYTORCH_CUDA_ALLOC_CONF'])")
    assert main(["run", "--memory-cap", "64Mi", "--context-bytes", "16Mi", "--report", str(tmp_path / "r.json"), "--",
                 sys.executable, "-c", probe]) == 0
    assert f"{64 * 2**20} {16 * 2**20} max_split_size_mb:128,expandable_segments:True" in capfd.readouterr().out
