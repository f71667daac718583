"""`tensile local`: TrainingJob YAMLs run on this machine under the hook, admitted onto one (simulated)
GPU by their forecast scheduled peaks, with the node agent in-process."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.support.agent_harness import ROOT, get

from tensile.errors import TensileUserError
from tensile.forecast import trace_workload
from tensile.job_forecast import make_forecast
from tensile.knobs import memory_text
from tensile.local.agent import LocalAgent
from tensile.local.jobs import load_job, load_jobs
from tensile.local.runner import JobRun, LocalRunner, iteration_spans
from tensile.local.view import declared_at_once, job_view, plot_peaks, sharing_summary

MIB = 2**20

JOB = """apiVersion: tensile.dev/v1alpha1
kind: TrainingJob
metadata:
  name: {name}
spec:
  workload:
    model: examples/tiny_mlp.py:build
    batchSize: 64
  template:
    spec:
      containers:
        - name: train
          image: example
          command: [python, {script}, --steps, "8", --batch-size, "64", --pause, "0.05"]
"""


def _write(tmp_path: Path, name: str, script: str = "examples/train_mlp.py") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(JOB.format(name=name, script=script))
    return path


def _run_to_the_end(runner: LocalRunner, agent: LocalAgent, watch: Callable[[], None] = lambda: None) -> None:
    """Forecast, admit and run the jobs until all have ended (2 minutes at most), `watch` after every pass;
    the runner and the agent stop whatever happens."""
    try:
        runner.forecast_all()
        deadline = time.monotonic() + 120
        while runner.step():
            assert time.monotonic() < deadline, "the jobs did not finish"
            watch()
            time.sleep(0.1)
    finally:
        runner.stop()
        agent.stop()


@pytest.mark.slow
def test_two_jobs_share_a_gpu_too_small_for_both_one_waits_queued(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the container commands run from the repository, as in the quickstart
    workload = trace_workload("examples/tiny_mlp.py:build", 64, optimizer=None, device="cpu")
    scheduled = make_forecast(workload, "cpu").summary["scheduled_peak_bytes"]
    memory = int(1.5 * scheduled / 0.95)  # one job's scheduled peak fits in the capacity, two do not
    jobs = load_jobs([str(_write(tmp_path, "first")), str(_write(tmp_path, "second")),
                      str(_write(tmp_path, "missing", "examples/no_such_script.py"))])
    agent = LocalAgent("127.0.0.1", 0, [f"small:{memory}"]).start()
    runner = LocalRunner(jobs, agent, tmp_path, "cpu", "cpu")
    phases: dict[str, set[str]] = {j.name: set() for j in jobs}
    in_agent: set[str] = set()
    queued_gauge: list[float] = []

    def watch() -> None:
        for run in runner.runs:
            phases[run.name].add(run.phase)
        in_agent.update(j["job"] for j in get(agent.url, "/v1/jobs")[1]["jobs"])
        metrics = get(agent.url, "/metrics")[1]
        queued_gauge.append(float(next(l for l in metrics.splitlines() if l.startswith("tensile_queued_jobs ")).split()[1]))

    _run_to_the_end(runner, agent, watch)
    first, second, missing = runner.runs
    assert first.phase == second.phase == "Succeeded", [(r.name, r.message) for r in runner.runs]
    assert "Queued" in phases["second"] and 1.0 in queued_gauge and queued_gauge[-1] == 0.0
    assert in_agent == {"first", "second"}  # both registered through their hooks
    for run in (first, second):
        assert run.scheduled_peak == scheduled and run.observed_peak > 0 and run.iterations == 8
        assert run.report.exists() and run.log.exists()
    assert missing.phase == "Failed" and "no_such_script.py does not exist" in missing.message
    assert [len(run.iteration_spans) for run in (first, second)] == [8, 8] and runner.most_at_once == 1
    assert first.iteration_spans[-1][1] <= second.iteration_spans[0][0]  # queued: the second ran after the first
    png = plot_peaks(runner.runs, tmp_path / "peaks.png", "test", runner.admission.capacity)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def refusal(path: Path, edit: Callable[[str], str]) -> str:
    """What loading the example job, edited and written to `path`, is refused with."""
    path.write_text(edit(JOB.format(name=path.stem, script="examples/train_mlp.py")))
    with pytest.raises(TensileUserError) as error:
        load_job(path)
    return str(error.value)


@pytest.mark.parametrize("edit, field", [
    (lambda t: t.replace("batchSize: 64", "batchSize: 0"), "spec.workload.batchSize"),
    (lambda t: t.replace("batchSize: 64", "batchSize: 64\n    optimiser: adam"), "spec.workload"),
    (lambda t: t.replace("kind: TrainingJob", "kind: Job"), "apiVersion/kind"),
    (lambda t: t + "  memoryBudget: lots\n", "spec.memoryBudget: 'lots' is not valid under any of the given schemas; "
                                              "expected most device memory the job may hold (bytes or a quantity like 6Gi)"),
    (lambda t: t.replace("  workload:", "  workload: [", 1), "not valid YAML"),
    (lambda t: t.replace("batchSize: 64", "batchSize: 64\n    batchSize: 8"), "key 'batchSize' is set twice"),  # kept silently
    (lambda t: t.replace("  template:", "  scheduling:\n    planEvents: swaps\n  template:"), "spec.scheduling.planEvents"),
    (lambda t: t.replace("metadata:\n", "metadata:\n  annotations:\n    tensile.dev/plan-events: swaps\n"),
     "metadata.annotations.tensile.dev/plan-events"),
    (lambda t: t.replace("metadata:\n", "metadata:\n  annotations:\n    tensile.dev/max-swap-rate: fast\n"),
     "metadata.annotations.tensile.dev/max-swap-rate"),
    (lambda t: t.replace("metadata:\n", "metadata:\n  annotations:\n    tensile.dev/memory-budget: lots\n"),
     "metadata.annotations.tensile.dev/memory-budget"),
    (lambda t: t.replace("metadata:\n", "metadata:\n  annotations:\n    tensile.dev/recompute: flase\n"),
     "metadata.annotations.tensile.dev/recompute"),
])
def test_a_bad_job_file_is_refused_naming_the_file_and_field(tmp_path, edit, field):
    path = tmp_path / "bad.yaml"
    message = refusal(path, edit)
    assert str(path) in message and field in message


def test_the_live_view_shows_each_jobs_note_whole_on_an_80_column_terminal(tmp_path):
    """A note is a sentence; as a table column at 80 characters it was cut into a few letters a line."""
    from rich.console import Console

    from tensile.local.runner import JobRun

    waiting = JobRun(load_job(_write(tmp_path, "waiting")), phase="Queued",
                     message="waits for 12.0 MiB on [small]: 3.0 MiB free")
    running = JobRun(load_job(_write(tmp_path, "running")), phase="Running", vanilla_peak=8 * 2**20)
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(job_view([waiting, running], "test"))
    lines = console.export_text().splitlines()
    assert "waiting: waits for 12.0 MiB on [small]: 3.0 MiB free" in lines  # whole, markup-like text kept
    assert not any(line.startswith("running:") for line in lines)  # no note, no line
    assert any("Running" in line and "8.0" in line for line in lines)


def test_the_view_shows_the_peak_under_plan_beside_the_peak_of_every_iteration(tmp_path, tiny_workload):
    """Live from the agent's observation, and at the end from the hook's report: the recorded first iterations
    run at the vanilla peak, so `observed` alone read against `sched.` looks like a forecast miss."""
    from rich.console import Console

    from tensile.agent_client import AgentClient, credential_file
    from tensile.agent_contract import Measurements
    from tensile_hook.report import HookReport, IterationStats, ReportWriter

    agent = LocalAgent("127.0.0.1", 0, ["small:1GiB"]).start()
    runner = LocalRunner([load_job(_write(tmp_path, "live")), load_job(_write(tmp_path, "done"))], agent, tmp_path, "cpu", "cpu")
    live, done = runner.runs
    try:
        # a job of the runner's, with the credential it hands its jobs
        client = AgentClient(agent.url, "default/live", max_backoff=0.2, credential=credential_file(agent.credential_path))
        assert client.register(workload=tiny_workload()) is not None
        for mode, peak in (("recording", 9 * 2**20), ("planned", 6 * 2**20)):
            assert client.post_measurements(Measurements.from_iterations([{"mode": mode, "peak_bytes": peak}])).accepted
        live.phase = "Running"
        runner.refresh()
    finally:
        runner.stop()
        agent.stop()
    assert (live.observed_peak, live.observed_planned_peak) == (9 * 2**20, 6 * 2**20)
    report = HookReport("done", "cpu")
    for stats in (IterationStats(0, "recording", peak_bytes=8 * 2**20), IterationStats(1, "planned", 1, peak_bytes=5 * 2**20)):
        report.add(stats)
    done.report = tmp_path / "done.report.json"
    ReportWriter(done.report, interval=0).write(report)
    runner._finished(done, 0)
    assert (done.phase, done.observed_peak, done.observed_planned_peak) == ("Succeeded", 8 * 2**20, 5 * 2**20)
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(job_view([live, done], "test"))
    lines = console.export_text().splitlines()
    header = [[cell.strip() for cell in line.split("┃")[5:7]] for line in lines if line.startswith("┃")]
    assert header == [["", "under"], ["observed", "plan"]], lines
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    assert {row[0]: row[4:6] for row in rows} == {"live": ["9.0", "6.0"], "done": ["8.0", "5.0"]}, lines
    png = plot_peaks([live, done], tmp_path / "peaks.png", "test", 64 * 2**20)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_command_line_refuses_a_bad_file_before_starting_anything(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(JOB.format(name="bad", script="examples/train_mlp.py").replace("batchSize: 64", "batchSize: -1"))
    done = subprocess.run([sys.executable, "-m", "tensile.cli", "local", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "bad.yaml" in done.stderr and "spec.workload.batchSize" in done.stderr


@pytest.mark.parametrize(("option", "value", "named"), [
    ("--reports", "afile", "--reports {tmp}/afile: {tmp}/afile is a file, not a folder"),
    ("--plot", "afile/peaks.png", "--plot {tmp}/afile/peaks.png: {tmp}/afile is a file, not a folder"),
    ("--plot", "", "--plot {tmp}: is a folder"),
    ("--simulate-gpu", "a6000:0", "--simulate-gpu 'a6000:0': the memory must be positive"),
])
def test_the_command_line_refuses_bad_paths_and_gpus_before_starting_anything(tmp_path, capsys, option, value, named):
    """A --reports that was a file, or a --plot in a folder that could not be made, met a traceback after the jobs
    had run; a simulated GPU of 0 bytes was taken."""
    from tensile.cli import main

    (tmp_path / "afile").write_text("")
    given = value if option == "--simulate-gpu" else str(tmp_path / value)
    assert main(["local", str(_write(tmp_path, "job")), option, given]) == 2
    assert named.format(tmp=tmp_path) in " ".join(capsys.readouterr().err.split())


def test_the_command_line_refuses_a_bad_hook_setting_in_the_environment(tmp_path, capsys, monkeypatch):
    """Every job's hook stood down on it, each said so only in its own log, and the jobs ran without Tensile."""
    from tensile.cli import main

    monkeypatch.setenv("TENSILE_LINK_SHARE", "2")
    assert main(["local", str(_write(tmp_path, "job"))]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "TENSILE_LINK_SHARE" in said and "set in the environment: fix or unset it" in said, said


def test_the_peaks_plot_makes_its_folder(tmp_path):
    png = plot_peaks([], tmp_path / "new" / "folder" / "peaks.png", "test", 2**20)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_shipped_examples_load_for_local_runs(monkeypatch):
    monkeypatch.chdir(ROOT)
    jobs = load_jobs(sorted(str(p) for p in (ROOT / "examples").glob("trainingjob-mlp*.yaml")))
    assert sorted(j.name for j in jobs) == ["mlp", "mlp-wide"]
    assert all(j.problem is None and j.command[0] == sys.executable for j in jobs)


def test_a_jobs_plan_events_and_recompute_reach_its_forecast_and_its_hook(tmp_path):
    """spec.scheduling.planEvents and recompute (or their annotations) are what the local forecast plans with
    and what the job's hook is told (TENSILE_PLAN_EVENTS, TENSILE_RECOMPUTE), as the operator does for a pod."""
    from tensile.local.runner import JobRun, job_environment

    path = tmp_path / "job.yaml"
    path.write_text(JOB.format(name="native", script="examples/train_mlp.py").replace(
        "  template:", "  scheduling:\n    planEvents: native\n  template:"))
    job = load_job(path)
    assert job.spec.plan_events == "native"
    assert job_environment(JobRun(job), "http://127.0.0.1:1", "/dev/null", MIB, 0)["TENSILE_PLAN_EVENTS"] == "native"
    annotated = path.read_text().replace("metadata:\n", "metadata:\n  annotations:\n    tensile.dev/plan-events: all\n")
    path.write_text(annotated)
    assert load_job(path).spec.plan_events == "all"
    plain = load_job(_write(tmp_path, "plain"))
    assert plain.spec.plan_events == "auto" and plain.spec.recompute
    assert "TENSILE_RECOMPUTE" not in job_environment(JobRun(plain), "http://127.0.0.1:1", "/dev/null", MIB, 0)
    path.write_text(annotated.replace("metadata:\n  annotations:\n", "metadata:\n  annotations:\n    tensile.dev/recompute: \"off\"\n"))
    env = job_environment(JobRun(load_job(path)), "http://127.0.0.1:1", "/dev/null", MIB, 0)
    assert env["TENSILE_RECOMPUTE"] == "false"


def test_a_jobs_annotations_override_its_budget_and_swap_rate_as_in_the_cluster(tmp_path):
    """The operator's annotations (tensile.dev/memory-budget, max-swap-rate) tune a local job the same way."""
    path = _write(tmp_path, "tuned")
    plain = load_job(path)
    path.write_text(path.read_text().replace(
        "metadata:\n", "metadata:\n  annotations:\n    tensile.dev/memory-budget: 3Mi\n    tensile.dev/max-swap-rate: \"0.5\"\n"))
    tuned = load_job(path)
    assert tuned.spec.memory_budget == 3 * 2**20 != plain.spec.memory_budget
    assert tuned.spec.max_swap_rate == 0.5 != plain.spec.max_swap_rate


@pytest.mark.slow
def test_a_job_with_a_max_swap_rate_is_admitted_at_the_peak_its_plan_reaches(tmp_path, monkeypatch):
    """The agent plans a job with its max swapping rate; admission must too, or the job's memory budget (its
    admitted peak) lies below what its plan can reach and every iteration runs guarded, evicting: mlp-wide
    (maxSwapRate 0.5) was admitted at 7.1 MiB and planned at 9.1."""
    monkeypatch.chdir(ROOT)
    workload = trace_workload("examples/tiny_mlp.py:build", 64, optimizer=None, device="cpu")
    free, limited = (make_forecast(workload, "cpu", max_swap_rate=rate).summary["scheduled_peak_bytes"]
                     for rate in (1.0, 0.5))
    assert limited > free  # this job's plan needs more than half of the swaps
    path = tmp_path / "rated.yaml"
    path.write_text(JOB.format(name="rated", script="examples/train_mlp.py").replace(
        "  template:", "  scheduling:\n    maxSwapRate: 0.5\n  template:"))
    agent = LocalAgent("127.0.0.1", 0, ["a6000:48GiB"]).start()
    runner = LocalRunner(load_jobs([str(path)]), agent, tmp_path, "cpu", "cpu")
    _run_to_the_end(runner, agent)
    (run,) = runner.runs
    assert run.phase == "Succeeded", run.message
    assert run.scheduled_peak == run.demand == limited
    report = json.loads(run.report.read_text())
    assert report["memory_budget_bytes"] == limited and report["scheduled_peak_bytes"] <= limited, report["messages"]
    assert not any("against a memory budget" in m for m in report["messages"]), report["messages"]


def test_a_failed_job_is_named_once_at_the_end_and_its_reason_said_once(tmp_path, capsys):
    """The reason stays under the table (the job's note); the end names the jobs that did not succeed. It was
    said twice, the second time as 'NAME: Failed: reason'."""
    from tensile.cli import main

    assert main(["local", str(_write(tmp_path, "broken", script="examples/no_such_script.py"))]) == 1
    out = capsys.readouterr().out
    assert out.count("no_such_script.py does not exist") == 1, out
    assert "1 of 1 jobs did not succeed: broken (Failed)" in out, out


def _budgeted(tmp_path: Path, name: str, budget: str, annotation: bool = False) -> Path:
    path = _write(tmp_path, name)
    text = path.read_text()
    if annotation:
        text = text.replace("metadata:\n", f"metadata:\n  annotations:\n    tensile.dev/memory-budget: {budget}\n")
    else:
        text = text.replace("  template:", f"  memoryBudget: {budget}\n  template:")
    path.write_text(text)
    return path


def test_a_budget_below_the_lowest_reachable_peak_fails_the_job_and_the_others_go_on(tmp_path, monkeypatch):
    """As the operator's BudgetUnreachable: two mlp-wide copies with `memoryBudget: 1Ki` were admitted by their
    budgets together onto a 4.75 MiB GPU (demand = min(scheduled, budget)) and held ~6 MiB on it."""
    monkeypatch.chdir(ROOT)
    workload = trace_workload("examples/tiny_mlp.py:build", 64, optimizer=None, device="cpu")
    lowest = make_forecast(workload, "cpu").summary["scheduled_peak_bytes"]
    jobs = load_jobs([str(_budgeted(tmp_path, "tiny", "1Ki")), str(_budgeted(tmp_path, "noted", "1Ki", annotation=True)),
                      str(_write(tmp_path, "plain")), str(_budgeted(tmp_path, "roomy", str(lowest + 2**20)))])
    agent = LocalAgent("127.0.0.1", 0, ["small:1GiB"])  # not served: forecasting and admission need no requests
    runner = LocalRunner(jobs, agent, tmp_path, "cpu", "cpu")
    runner.forecast_all()
    runner.http.close()
    tiny, noted, plain, roomy = runner.runs
    for run, field in ((tiny, "spec.memoryBudget"), (noted, "metadata.annotations.tensile.dev/memory-budget")):
        assert run.phase == "Failed", (run.name, run.phase, run.message)
        assert run.message.startswith(f"BudgetUnreachable: {field} 1 KiB is below the lowest peak any plan reaches, "
                                      f"{memory_text(lowest)}: raise it"), run.message
        assert "reduce spec.workload.batchSize" in run.message and run.scheduled_peak == lowest
    assert (plain.phase, plain.demand) == ("Queued", lowest) and not plain.message
    assert (roomy.phase, roomy.demand) == ("Queued", lowest)
    assert [r.name for r in runner.admission.admit([plain, roomy], [])] == ["plain", "roomy"]


def test_an_unreachable_budget_at_the_jobs_swap_rate_names_the_rate_too(tmp_path, monkeypatch):
    """The agent plans the job at its maxSwapRate, so the lowest peak it can reach is the one at that rate."""
    monkeypatch.chdir(ROOT)
    path = _budgeted(tmp_path, "rated", "1Ki")
    path.write_text(path.read_text().replace("  template:", "  scheduling:\n    maxSwapRate: 0.5\n  template:"))
    agent = LocalAgent("127.0.0.1", 0, ["small:1GiB"])
    runner = LocalRunner(load_jobs([str(path)]), agent, tmp_path, "cpu", "cpu")
    runner.forecast_all()
    runner.http.close()
    (run,) = runner.runs
    assert run.phase == "Failed" and "reaches at spec.scheduling.maxSwapRate 0.5," in run.message, run.message
    assert "raise spec.scheduling.maxSwapRate" in run.message


@pytest.mark.parametrize(("name", "suggested"), [("My_Job", "my-job"), ("job.", "job"), ("-job", "job"), ("a" * 254, "a" * 253),
                                                 ("ok..dots", "ok.dots"), ("UPPER", "upper")])
def test_a_name_kubernetes_refuses_is_refused_naming_the_file_field_and_rule(tmp_path, name, suggested):
    """metadata.name of a custom resource is a DNS-1123 subdomain; `My_Job` was run locally and refused by a cluster."""
    path = tmp_path / "named.yaml"
    path.write_text(JOB.format(name=f"'{name}'", script="examples/train_mlp.py"))
    with pytest.raises(TensileUserError) as error:
        load_job(path)
    message = str(error.value)
    assert message.startswith(f"{path}: metadata.name: ") and "DNS-1123 subdomain" in message, message
    assert "lowercase letters, digits, '-' and '.'" in message and f"e.g. '{suggested}'" in message, message


def test_names_kubernetes_takes_load_and_a_bad_namespace_is_refused(tmp_path):
    path = tmp_path / "named.yaml"
    path.write_text(JOB.format(name="team.job-1", script="examples/train_mlp.py"))
    assert load_job(path).name == "team.job-1"
    path.write_text(path.read_text().replace("metadata:\n", "metadata:\n  namespace: Team_A\n"))
    with pytest.raises(TensileUserError, match=r"metadata.namespace: 'Team_A' .*\(a DNS-1123 label\), e.g. 'team-a'"):
        load_job(path)


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda t: t.replace("    batchSize: 64", "    profile: mlp-profile\n    batchSize: 64"),
     "spec.workload: spec.workload.model and spec.workload.profile are both set; keep one: model or profile, not both"),
    (lambda t: t.replace("    model: examples/tiny_mlp.py:build\n", ""),
     "spec.workload: set one of spec.workload.model or spec.workload.profile"),
])
def test_model_and_profile_together_or_neither_is_refused_naming_both_fields(tmp_path, edit, expected):
    """jsonschema's oneOf said "... is valid under each of {'required': ['model']}, {'required': ['profile']}"."""
    path = tmp_path / "both.yaml"
    message = refusal(path, edit)
    assert message.startswith(f"{path}: {expected}"), message
    assert "valid under" not in message


def test_a_file_of_several_trainingjobs_loads_each_as_kubectl_takes_it(tmp_path):
    """`---`-separated documents (kubectl apply -f takes them); a file of two was refused."""
    first, second = (JOB.format(name=n, script="examples/train_mlp.py") for n in ("first", "second"))
    path = tmp_path / "jobs.yaml"
    path.write_text(f"---\n{first}---\n# nothing here\n---\n{second}")
    jobs = load_jobs([str(path), str(_write(tmp_path, "third"))])
    assert [j.name for j in jobs] == ["first", "second", "third"] and jobs[0].path == path
    with pytest.raises(TensileUserError, match="holds 2 TrainingJobs"):
        load_job(path)
    path.write_text(f"{first}---\n{second.replace('batchSize: 64', 'batchSize: 0')}")
    with pytest.raises(TensileUserError) as error:
        load_jobs([str(path)])
    assert str(error.value).startswith(f"{path} (document 2 of 2): spec.workload.batchSize: 0"), str(error.value)
    path.write_text(f"{first}---\n{first}")
    with pytest.raises(TensileUserError, match=f"two TrainingJobs name the job 'first' \\({path}\\)"):
        load_jobs([str(path)])
    path.write_text(f"{first}---\n- a list\n")
    with pytest.raises(TensileUserError, match=r"\(document 2 of 2\): expected a TrainingJob object"):
        load_jobs([str(path)])
    path.write_text("---\n")
    with pytest.raises(TensileUserError, match="no TrainingJob in it"):
        load_jobs([str(path)])


def test_a_misspelt_annotation_is_said_at_load_as_the_operator_says_it(tmp_path):
    """`tensile.dev/memory-budgett` was ignored in silence in local mode; the operator gives the job an
    UnknownAnnotations condition with the same words, and `tensile local` prints them as a note."""
    path = tmp_path / "typo.yaml"
    path.write_text(JOB.format(name="typo", script="examples/train_mlp.py").replace(
        "metadata:\n", "metadata:\n  annotations:\n    tensile.dev/memory-budgett: 1Gi\n"))
    job = load_job(path)
    assert job.spec.memory_budget is None
    assert job.unknown_annotations is not None and "did you mean tensile.dev/memory-budget?" in job.unknown_annotations
    assert load_job(_write(tmp_path, "plain")).unknown_annotations is None


def test_iterations_are_placed_back_to_back_before_the_job_ended():
    spans = iteration_spans([{"seconds": 2.0, "peak_bytes": 9}, {"seconds": 1.0, "peak_bytes": 5},
                             {"seconds": 0.5, "peak_bytes": 6}], ended=10.0)
    assert spans == [(6.5, 8.5, 9), (8.5, 9.5, 5), (9.5, 10.0, 6)]


def test_the_summary_sets_what_ran_at_once_against_what_declared_memory_would_fit():
    """Three jobs whose vanilla peaks (12 + 10 + 8 MiB) do not fit 24 MiB together but whose scheduled ones
    (7 + 6 + 5 MiB) do: declared-memory sharing fits the two smallest, Tensile ran all three."""
    mib = 2**20
    runs = [JobRun(None, "Succeeded", vanilla_peak=v * mib, demand=d * mib, iterations=5)  # type: ignore[arg-type]
            for v, d in ((12, 7), (10, 6), (8, 5))]
    assert declared_at_once(runs, 24 * mib, 0) == 2 and declared_at_once(runs, 24 * mib, 4 * mib) == 1
    said = sharing_summary(runs, 24 * mib, 0, 3).plain
    assert said == ("Tensile ran 3 of 3 jobs at once in 24.0 MiB: their scheduled peaks need 18.0 MiB together. "
                    "Sharing by declared memory (each job reserving its vanilla peak, 30.0 MiB together) fits 2 at "
                    "once."), said


def test_a_job_is_admitted_by_what_its_allocator_reserves_and_capped_at_it(tmp_path, monkeypatch):
    """Admission counts reserved memory plus context (tensile.admission.forecast_admitted_bytes), not the tensors' bytes
    alone, and the job's process is capped at that size; its allocator setting gains expandable segments."""
    from tensile.local.runner import FirstComeFirstServed, JobRun, job_environment

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    admission = FirstComeFirstServed(capacity=100 * MIB, context=5 * MIB)
    summary = {"scheduled_peak_bytes": 40 * MIB, "scheduled_reserved_peak_bytes": 52 * MIB, "memory_budget_bytes": None}
    run = JobRun(load_job(_write(tmp_path, "reserving")), demand=40 * MIB, summary=summary)
    assert admission.need(run) == 57 * MIB  # 52 reserved + 5 context
    held = JobRun(run.job, demand=30 * MIB, summary=summary | {"memory_budget_bytes": 30 * MIB})
    assert admission.need(held) == 47 * MIB  # tensors held to 30, the allocator's 12 over them, 5 context
    assert [r.name for r in admission.admit([run, held], [])] == ["reserving"]  # 104 MiB together: one waits
    env = job_environment(run, "http://127.0.0.1:1", "/dev/null", admission.need(run), admission.context)
    assert env["TENSILE_MEMORY_CAP"] == str(57 * MIB) and env["TENSILE_MEMORY_BUDGET"] == str(40 * MIB)
    assert env["TENSILE_CONTEXT_BYTES"] == str(5 * MIB)  # the cap's part for the CUDA context: the allocator gets 52
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    profile = JobRun(run.job, demand=20 * MIB)  # admitted by its budget: no forecast
    assert admission.need(profile) == 25 * MIB


def test_the_view_shows_reserved_memory_where_it_is_more_than_the_tensors(tmp_path):
    """On CUDA the caching allocator holds more than the tensors (what a neighbour pays for): the view shows it; on
    the CPU device (no caching allocator) reserved is the observed peak again, and the column stays out."""
    from rich.console import Console

    from tensile.local.runner import JobRun

    job = load_job(_write(tmp_path, "held"))
    for reserved, shown in ((9 * MIB, True), (8 * MIB, False)):
        run = JobRun(job, phase="Running", observed_peak=8 * MIB, observed_reserved_peak=reserved)
        console = Console(width=120, record=True, file=io.StringIO())
        console.print(job_view([run], "test"))
        text = console.export_text()
        assert ("reserved" in text and "9.0" in text) is shown, text


def test_the_view_shows_out_of_memory_retries_where_a_job_had_any(tmp_path):
    """A job that met its cap or a full device, and went on because the hook evicted and retried, is said so under the
    table; without any, nothing is said."""
    from rich.console import Console

    from tensile.local.runner import JobRun

    job = load_job(_write(tmp_path, "capped"))
    for retries, shown in ((3, True), (0, False)):
        run = JobRun(job, phase="Running", observed_peak=8 * MIB, out_of_memory_retries=retries)
        console = Console(width=120, record=True, file=io.StringIO())
        console.print(job_view([run], "test"))
        text = console.export_text()
        assert ("capped: 3 out-of-memory errors the hook evicted for and retried" in " ".join(text.split())) is shown, text


def test_out_of_memory_retries_are_read_from_the_agent_while_a_job_runs_and_from_its_report_at_the_end(
        tmp_path, tiny_workload):
    """The runner reads a job's retries twice: from the agent's observation while it runs, and from its hook's report
    when it ends (the whole run's, past the hook's last post to the agent). On the CPU no allocation fails: the hook's
    own iteration records carry the retries, posted as its link posts them and written by its report writer."""
    from dataclasses import asdict

    from rich.console import Console

    from tensile.agent_client import AgentClient, credential_file
    from tensile.agent_contract import Measurements
    from tensile.local.runner import job_report
    from tensile_hook.report import HookReport, IterationStats, ReportWriter

    def said(run: JobRun) -> str:
        console = Console(width=120, record=True, file=io.StringIO())
        console.print(job_view([run], "test"))
        return " ".join(console.export_text().split())

    iterations = [IterationStats(0, "recording", peak_bytes=8 * MIB),
                  IterationStats(1, "planned", peak_bytes=5 * MIB, out_of_memory_retries=2),
                  IterationStats(2, "planned", peak_bytes=5 * MIB, out_of_memory_retries=1)]
    agent = LocalAgent("127.0.0.1", 0, ["small:1GiB"]).start()
    runner = LocalRunner([load_job(_write(tmp_path, "capped"))], agent, tmp_path, "cpu", "cpu")
    (run,) = runner.runs
    credential = credential_file(agent.credential_path)  # the one the runner hands its jobs
    client = AgentClient(agent.url, "default/capped", max_backoff=0.2, credential=credential)
    try:
        assert client.register(workload=tiny_workload()) is not None
        posted = client.post_measurements(Measurements.from_iterations([asdict(it) for it in iterations[:2]]))
        assert posted is not None and posted.accepted
        run.phase = "Running"
        runner.refresh()
        assert "capped: 2 out-of-memory errors the hook evicted for and retried; the job went on" in said(run)
        # the job ends, its last iteration's retry in its report alone
        report = HookReport("capped", "cpu")
        for stats in iterations:
            report.add(stats)
        run.report = job_report(tmp_path, run.name)
        ReportWriter(run.report, interval=0).write(report)
        run.process = subprocess.Popen([sys.executable, "-c", ""])
        run.process.wait()
        assert not runner.step()
    finally:
        client.close()
        runner.stop()
        agent.stop()
    assert run.phase == "Succeeded", run.message
    assert "capped: 3 out-of-memory errors the hook evicted for and retried; the job went on" in said(run)


@pytest.mark.parametrize("device, cap", [("cuda", "Its process may hold 57 MiB (TENSILE_MEMORY_CAP, what it was "
                                                  "admitted with), so it failed alone"),
                                         ("cpu", "Its process ran out of CUDA memory")])
def test_a_failed_job_says_its_logs_last_line_and_what_running_out_of_cuda_memory_means(tmp_path, device, cap):
    """"exit code 1; see its log" was all a failed job said; its log's last line says why, and PyTorch's
    out-of-memory error there says the job outgrew what it was admitted with."""
    from types import SimpleNamespace

    gpu = SimpleNamespace(capacity_bytes=100 * MIB, context_bytes=5 * MIB)
    runner = LocalRunner([], SimpleNamespace(gpu=gpu, url="http://127.0.0.1:1"), tmp_path, device, "cpu")  # type: ignore[arg-type]
    summary = {"scheduled_peak_bytes": 40 * MIB, "scheduled_reserved_peak_bytes": 52 * MIB, "memory_budget_bytes": None}
    run = JobRun(load_job(_write(tmp_path, "oom")), demand=40 * MIB, summary=summary)
    run.log = tmp_path / "oom.log"
    run.log.write_text("step 0: loss 6.49\nTraceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out "
                       "of memory. Tried to allocate 20.00 MiB.\n\n"  # the hook's last words come after it
                       "WARNING:tensile_hook.agent_link:tensile: not delivered to the node agent at exit\n")
    runner._finished(run, 1)
    assert run.phase == "Failed"
    assert run.message.startswith("exit code 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 "
                                  f"MiB. {cap}"), run.message
    assert run.message.endswith(f"; see {run.log}")
    run.log.write_text("FileNotFoundError: no dataset at /data/train\n")
    runner._finished(run, 2)
    assert run.message == f"exit code 2: FileNotFoundError: no dataset at /data/train; see {run.log}"
