"""`tensile run --model` (and `--plot`): the job's iteration traced, and planned without an agent, before the command starts (the
forecast TENSILE plans from, made before the job runs); its plan applies when the live iteration matches it, the job
plans from the live one when not, and either way it trains bit-identically to the run without Tensile. Also which
process of the command is the job: the one that trains, not torchrun's launcher or a script that starts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from tests.support.agent_harness import ROOT
from tests.support.bit_identity import assert_identical
from tests.support.linked_hook import FAST
from tests.support.programs import path_with_another

from tensile.cli import main

TRAIN = ROOT / "examples" / "train_mlp.py"
MODEL = "examples/tiny_mlp.py:build"  # what examples/train_mlp.py trains
BATCH, STEPS = 32, 4
# the product's timeout of an agent call, not FAST's 0.5 s (made for exits from hung agents): a registration the agent
# answers in 0.8 s (an agent slowed on purpose, measured) reads as an agent that is away, and a job of iterations as
# short as these then plans locally (a loaded suite run once planned locally so; its cause was not confirmed)
AGENT_CALLS = {"TENSILE_AGENT_TIMEOUT": "2"}


def _train(tmp_path: Path, name: str, *tensile: str, batch: int = BATCH, train: tuple[str, ...] = (str(TRAIN),),
           env: dict[str, str] | None = None, program: str = sys.executable) -> tuple[dict, dict | None, str]:
    """A training script's final state (examples/train_mlp.py unless `train` names another and its arguments), run
    alone (no `tensile` options) or under `tensile run OPTIONS` (`env`: more of its environment; `program`: what
    runs `train`); its report and what `tensile run` said."""
    state, report = tmp_path / f"{name}.pt", tmp_path / f"{name}.json"
    script = [program, *train, "--steps", str(STEPS), "--batch-size", str(batch), "--save", str(state)]
    command = [sys.executable, "-m", "tensile.cli", "run", *tensile, "--report", str(report), "--", *script] if tensile else script
    done = subprocess.run(command, cwd=ROOT, env=os.environ | FAST | (env or {}), capture_output=True, text=True,
                          timeout=300)
    said = " ".join(done.stderr.split())
    assert done.returncode == 0, said
    return torch.load(state), (json.loads(report.read_text()) if tensile and report.exists() else None), said


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _train(tmp_path_factory.mktemp("plain"), "plain")[0]


@pytest.mark.slow
def test_a_model_traced_before_the_run_is_planned_and_its_plan_applied(tmp_path: Path, plain: dict) -> None:
    plot = tmp_path / "plots" / "iterations.png"
    # files an earlier run left in the environment, gone since: --model's stand in for them (the hook, given these,
    # would stand down)
    gone = {"TENSILE_WORKLOAD": str(tmp_path / "gone.json.gz"), "TENSILE_PLAN": str(tmp_path / "gone-plan.json")}
    hooked, report, said = _train(tmp_path, "hooked", "--model", MODEL, "--batch-size", str(BATCH), "--plot", str(plot),
                                  "--keep-files", env=gone)
    assert_identical(plain, hooked)
    assert report is not None and report["plan_source"] == "file" and report["signature_match"] is True, report
    recorded = report["iterations"][1]  # the matched iteration, before any plan: the vanilla peak, measured
    assert recorded["mode"] == "recording"
    # the forecast's vanilla peak, traced on the meta device, against the one measured
    assert abs(report["vanilla_peak_bytes"] - recorded["peak_bytes"]) <= 0.05 * recorded["peak_bytes"], report
    planned = [it for it in report["iterations"] if it["mode"] == "planned"]
    assert len(planned) == STEPS - 2 and all(sum(it["events"].values()) > 0 for it in planned), planned
    assert f"forecast of {MODEL} at batch {BATCH} (cpu): vanilla peak" in said, said
    folder = Path(said.split("the run's files (report, traced workload, plan) kept in ")[1].split()[0])
    assert json.loads((folder / "plan.json").read_text())["signature"] == report["live_signature"]
    assert f"tensile:plot:{plot}" in said.replace(" ", "") and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 20_000


@pytest.mark.slow
def test_a_model_traced_at_another_batch_size_leaves_the_job_to_plan_from_the_live_iteration(tmp_path: Path,
                                                                                              plain: dict) -> None:
    """A budget given as a share of the vanilla peak is this workload's share, not one of the peak forecast at the
    other batch size."""
    hooked, report, _ = _train(tmp_path, "other", "--model", MODEL, "--batch-size", str(BATCH // 2), "--memory-budget", "0.8")
    assert_identical(plain, hooked)
    assert report is not None and report["signature_match"] is False and report["plan_source"] == "local", report
    assert any("the plan was made for another workload" in m for m in report["messages"]), report["messages"]
    assert report["memory_budget_bytes"] == int(0.8 * report["vanilla_peak_bytes"]), report


@pytest.mark.slow
def test_a_zoo_model_traced_before_the_run_holds_a_0_6_budget_at_its_forecast(tmp_path: Path) -> None:
    """examples/train_zoo.py trains ResNet-50 as `--model resnet50` traces it: the forecast's plan applies, the peak
    under it is the scheduled one (within 5%) and under 60% of the vanilla peak plus the guard's slack."""
    zoo = (str(ROOT / "examples" / "train_zoo.py"), "resnet50")
    plain = _train(tmp_path, "plain", batch=2, train=zoo)[0]
    hooked, report, _ = _train(tmp_path, "hooked", "--model", "resnet50", "--batch-size", "2", "--memory-budget", "0.6",
                               batch=2, train=zoo)
    assert_identical(plain, hooked)
    assert report is not None and report["plan_source"] == "file" and report["signature_match"] is True, report
    steady = [it for it in report["iterations"] if it["mode"] == "planned"][1:]  # the first starts from an unplanned state
    assert steady and all(sum(it["events"].values()) > 0 for it in steady)
    for it in steady:
        assert abs(it["peak_bytes"] - report["scheduled_peak_bytes"]) <= 0.05 * report["scheduled_peak_bytes"], it
        assert it["peak_bytes"] <= 0.6 * report["vanilla_peak_bytes"] + report["guard_slack_bytes"], it


@pytest.mark.slow
def test_with_an_agent_the_traced_model_is_what_the_job_registers(agent_server, tmp_path: Path, plain: dict) -> None:
    """No plan is made here: the node agent plans from the workload the job registers at its start, the traced one,
    not from a plan file the environment names (one of another run, gone since: the hook would stand down)."""
    agent = agent_server()
    hooked, report, said = _train(tmp_path, "agent", "--agent", agent.url, "--model", MODEL, "--batch-size", str(BATCH),
                                  env={"TENSILE_PLAN": str(tmp_path / "gone-plan.json")} | AGENT_CALLS)
    assert_identical(plain, hooked)
    assert "traced; the node agent plans from it" in said and "forecast of" not in said, said
    assert report is not None and report["plan_source"] == "agent" and report["signature_match"] is True, said


@pytest.mark.parametrize("options, named", [
    (["--model", MODEL, "--workload", "w.json"], "argument --workload: not allowed with argument --model"),
    (["--batch-size", "8"], "--batch-size: how to trace --model; give --model NAME|FILE.py:FUNC too"),
    (["--model", MODEL, "--plan", "p.json"], "--plan is for the --workload it was made for; with --model the plan is made now"),
    (["--model", MODEL, "--batch-size", "0"], "--batch-size must be a positive integer (was 0)"),
    (["--model", MODEL, "--micro-batches", "0"], "--micro-batches must be a positive integer (was 0)"),
    (["--model", "resnet51"], "unknown model 'resnet51'; known models: vgg16"),
    (["--model", "examples/none.py:build"], "--model examples/none.py:build: file 'examples/none.py' does not exist"),
])
def test_tensile_run_refuses_a_model_it_cannot_trace_before_the_command_starts(capsys, monkeypatch, tmp_path: Path,
                                                                               options: list[str], named: str) -> None:
    ran = tmp_path / "ran"
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the forecast's folder would be made
    try:
        code = main(["run", *options, "--", sys.executable, "-c", f"open({str(ran)!r}, 'w')"])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    said = " ".join(capsys.readouterr().err.split())
    assert named in said, said
    assert not ran.exists()


@pytest.mark.slow
def test_a_run_that_reports_no_iteration_writes_no_plot_and_says_so(capsys, tmp_path: Path) -> None:
    plot = tmp_path / "iterations.png"
    assert main(["run", "--plot", str(plot), "--report", str(tmp_path / "r.json"), "--", sys.executable, "-c", "pass"]) == 0
    said = capsys.readouterr().err.replace("\n", "")  # rich wraps a long path anywhere
    assert f"no iteration was reported: no plot written to {plot}" in said, said
    assert not plot.exists()


def test_the_iterations_plot_draws_each_iterations_figures(monkeypatch, tmp_path: Path) -> None:
    """What `--plot` draws, read back from the figure: the measured peaks, each mode's points, the plan's forecast and
    the budget where they were in force, the vanilla peak, and the times."""
    from tensile import plots

    mib = 2**20
    rows = [(0, "recording", 8, None, None), (1, "recording", 8, None, None), (2, "planned", 6, 7, 6.5),
            (3, "diverged", 7, 7, 6.5), (4, "planned", 6, 7, 6.5)]
    report = {"vanilla_peak_bytes": 8 * mib, "iterations": [
        {"iteration": i, "mode": mode, "peak_bytes": peak * mib, "scheduled_peak_bytes": None if plan is None else plan * mib,
         "memory_budget_bytes": None if budget is None else int(budget * mib), "seconds": 0.1 + i / 100,
         "stall_seconds": 0.0, "hook_seconds": 0.002, "recompute_seconds": 0.004 if mode == "planned" else 0.0}
        for i, mode, peak, plan, budget in rows]}
    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig) or Path(path))
    plots.plot_iterations(report, tmp_path / "p.png", "test")
    memory, seconds = drawn[0].axes
    lines = {line.get_label(): line for line in memory.get_lines()}
    assert list(memory.get_lines()[0].get_ydata()) == [8, 8, 6, 7, 6]
    assert [list(p.get_offsets()[:, 1]) for p in memory.collections] == [[8, 8], [6, 6], [7]]  # recording, planned, diverged
    forecast = lines["plan's forecast (scheduled peak)"].get_ydata()
    assert list(forecast[2:]) == [7, 7, 7] and all(v != v for v in forecast[:2])  # nan where no plan was in force
    assert list(lines["memory budget"].get_ydata()[2:]) == [6.5, 6.5, 6.5]
    assert list(lines["vanilla peak"].get_ydata()) == [8, 8]
    times = {line.get_label(): list(line.get_ydata()) for line in seconds.get_lines()}
    assert times["iteration"] == pytest.approx([100, 110, 120, 130, 140]) and times["inside the hook"] == [2.0] * 5
    assert times["recomputing"] == [0.0, 0.0, 4.0, 0.0, 4.0]


@pytest.mark.slow
def test_on_a_gpu_machine_the_forecast_is_cudas_with_the_gpus_preset(capsys, monkeypatch, tmp_path: Path) -> None:
    """The CUDA branch without a GPU: the trace is for the device the command will run on, on the meta device, and the
    plan takes the latencies of this machine's GPU (NVML's name, as `tensile calibrate` keys its model), not the A6000's."""
    from tensile import job_forecast
    from tensile.latency import device
    from tensile.workload_io import load_workload

    presets = []
    make_forecast = job_forecast.make_forecast
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # a CUDA build of PyTorch (the GPU image's) asks the driver from the optimizer's step, which the trace runs: whether
    # a CUDA graph is being captured (a check named as 2.11 names it, and as 2.10 did; 2.14 asks through torch.accelerator)
    for check in ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check"):
        monkeypatch.setattr(torch.optim.Optimizer, check, lambda self: None, raising=False)
    monkeypatch.setattr(device, "gpu_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(job_forecast, "make_forecast", lambda workload, preset, *rest, **options: presets.append(preset)
                        or make_forecast(workload, preset, *rest, **options))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["run", "--model", MODEL, "--batch-size", "8", "--report", str(tmp_path / "r.json"), "--keep-files",
                 "--", sys.executable, "-c", "pass"]) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert f"forecast of {MODEL} at batch 8 (cuda): vanilla peak" in said and presets == ["h100"], (presets, said)
    (workload,) = tmp_path.glob("tensile-*/workload.json.gz")
    assert load_workload(workload).device == "cuda"


# torchrun's launcher, as a script and as a module; a script of the user's that starts the training as a process
LAUNCHERS = {"torchrun": (str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node=1"),
             "torch.distributed.run": ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"),
             "a script": ("-c", "import subprocess, sys; subprocess.run([sys.executable, *sys.argv[1:]], check=True)")}
# a starter that runs the model once without gradients first (a summary, a sanity check) before it starts the training
CHECKING_LAUNCHER = ("-c", "import subprocess, sys, torch\nwith torch.no_grad(): torch.nn.Linear(2, 2)(torch.zeros(1, 2))\n"
                           "subprocess.run([sys.executable, *sys.argv[1:]], check=True)")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_the_process_that_trains_is_the_job_not_the_one_that_starts_it(launcher: str, tmp_path: Path,
                                                                       plain: dict) -> None:
    """The starting process trains nothing: with the hook, its report ("no optimizer step was seen", 0 iterations)
    replaced the training's at exit. torchrun's does not start the hook; another keeps the training's report."""
    hooked, report, said = _train(tmp_path, "launched", "--memory-budget", "0.6", train=(*LAUNCHERS[launcher], str(TRAIN)))
    assert_identical(plain, hooked)
    assert report is not None and len(report["iterations"]) == STEPS and report["plan_source"] == "local", report
    assert "no optimizer step" not in said, said


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [LAUNCHERS["a script"], CHECKING_LAUNCHER], ids=["a script", "one that checks the model"])
def test_with_an_agent_the_process_that_trains_registers_not_the_one_that_starts_it(launcher: tuple[str, ...], agent_server,
                                                                                   tmp_path: Path, plain: dict) -> None:
    """A script that starts the training runs under the hook too. Registered at its start with the traced workload, it
    held the job's name under the token the agent gave it, and the training's own registration was refused (403): the
    job planned locally. Only a process that trains registers; the starter trains nothing (a forward under no_grad, as
    a model summary runs, is no training) and leaves the agent alone."""
    agent = agent_server()
    hooked, report, said = _train(tmp_path, "launched-agent", "--agent", agent.url, "--model", MODEL, "--batch-size",
                                  str(BATCH), train=(*launcher, str(TRAIN)), env=AGENT_CALLS)
    assert_identical(plain, hooked)
    assert "wrong_token" not in said and "registered already" not in said, said
    assert report is not None and report["plan_source"] == "agent" and report["signature_match"] is True, said
    assert len(report["iterations"]) == STEPS and "no optimizer step" not in said, said
    assert agent.agent.state.jobs == {}, agent.agent.state.jobs  # the training unregistered; the starter had nothing


@pytest.mark.slow
def test_a_leading_torchrun_is_this_pythons(tmp_path: Path, plain: dict) -> None:
    """As a leading `python` is: the `torchrun` on PATH may be another Python's, without Tensile (here one that
    exits 7), whose workers would have run without the hook."""
    path = {"PATH": path_with_another("torchrun", tmp_path / "bin")}
    hooked, report, _ = _train(tmp_path, "torchrun", "--memory-budget", "0.6", program="torchrun", env=path,
                               train=("--standalone", "--nproc_per_node=1", str(TRAIN)))
    assert_identical(plain, hooked)
    assert report is not None and len(report["iterations"]) == STEPS and report["plan_source"] == "local", report


@pytest.mark.slow
def test_a_job_of_several_processes_runs_without_the_hook_and_says_why(tmp_path: Path, plain: dict) -> None:
    """Each process has its own GPU's memory to plan, and they would share the job's report and its registration."""
    ranks = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN))
    trained, report, said = _train(tmp_path, "ranks", "--memory-budget", "0.6", train=ranks)
    # each process trained the MLP alone to the end (torchrun gives each one thread: not the plain run's bits)
    assert trained["model"].keys() == plain["model"].keys()
    assert all(torch.allclose(trained["model"][key], value, rtol=1e-3, atol=1e-5) for key, value in plain["model"].items())
    assert report is None and said.count("a job of 2 processes (WORLD_SIZE) is not carried") == 1, said
