"""Faults never cost correctness: wrong, stale or missing plans and undersized budgets cost time
only, training ends bit-identical, and the report says what happened."""

from __future__ import annotations

import random
import re
import sys

import pytest
import torch

from tests.support import tracing_models
from tensile.plan import EVENT_KINDS, Event, Plan
from tensile_hook.settings import HookSettings, native_plans
from tensile.workload import Workload
from tests.support.bit_identity import assert_identical
from tests.support.hook_probes import swapped_out
from tests.support.plans import aggressive_plan
from tests.support.programs import path_with_another
from tests.support.training import EXAMPLES, fit, train

pytestmark = pytest.mark.usefixtures("deterministic")


def wrong_plan(workload: Workload, budget: int | None = None) -> Plan:
    """Events of every kind on random tensors at random ops: swap-ins before swap-outs, releases of
    tensors used later, recomputes of tensors written in place, cross-iteration swap-ins of anything."""
    rng = random.Random(7)
    ids = list(workload.tensors)
    events = [
        Event("job", rng.choice(EVENT_KINDS), rng.choice(ids), rng.randrange(len(workload.ops)), 0.0, rng.random() < 0.2)
        for _ in range(4 * len(workload.ops))
    ]
    return Plan("job", 9, workload.signature, events)


def test_a_deliberately_wrong_plan_costs_time_not_correctness():
    plain, _ = train(tracing_models.views, 4)
    hooked, report = train(tracing_models.views, 4, planner=wrong_plan)
    assert_identical(plain, hooked)
    planned = [it for it in report.iterations if it.mode == "planned"]
    assert planned and all(it.stall_seconds > 0 for it in planned)
    assert report.stood_down is None


def test_no_plan_runs_guarded_and_says_so():
    plain, _ = train(tracing_models.tied, 4)
    hooked, report = train(tracing_models.tied, 4, planner=lambda workload, budget: None)
    assert_identical(plain, hooked)
    assert any("no plan" in m for m in report.messages)
    assert all(it.mode in ("recording", "guarded") for it in report.iterations)


def test_a_planners_plan_for_another_workload_is_refused():
    """Its events name another workload's tensors: the job runs guarded and says so (the agent's failed round
    after an upload answered with the plan made for the forecast workload, and the hook applied it)."""
    plain, _ = train(tracing_models.views, 4)
    hooked, report = train(tracing_models.views, 4,
                           planner=lambda workload, budget: Plan("job", 3, "another-signature", wrong_plan(workload).events))
    assert_identical(plain, hooked)
    assert any("plan version 3 was made for another workload" in m for m in report.messages), report.messages
    assert all(it.mode in ("recording", "guarded") for it in report.iterations)


@pytest.mark.slow
def test_a_stale_plan_is_replaced_by_one_from_the_live_iteration():
    from tensile.forecast import trace_workload
    from tensile_hook import activate, deactivate
    from tensile_hook.settings import HookSettings

    stale_workload = trace_workload("examples/tiny_mlp.py:build", 16, optimizer=None, device="cpu", live=True)
    stale = aggressive_plan(stale_workload)
    plain, _ = train(tracing_models.views, 4)
    executor = activate(HookSettings(job="job"), stale, stale_workload, planner=aggressive_plan, device=torch.device("cpu"))
    try:
        hooked = fit(tracing_models.views, 4, 5)
    finally:
        deactivate()
    assert_identical(plain, hooked)
    report = executor.report
    assert report.signature_match is False
    assert report.plan_source == "local"
    assert any("signature mismatch" in m for m in report.messages)
    assert [it.mode for it in report.iterations][2:] == ["planned"] * (len(report.iterations) - 2)


@pytest.mark.parametrize("budget", [0.5, 0.2])
def test_an_undersized_budget_evicts_passively_and_stays_under_it(budget):
    plain, _ = train(tracing_models.views, 16)
    hooked, report = train(tracing_models.views, 16, planner=lambda workload, b: None, budget=budget)
    assert_identical(plain, hooked)
    assert report.memory_budget_bytes is not None
    guarded = [it for it in report.iterations if it.iteration >= 2]
    assert guarded and all(it.passive_evictions > 0 for it in guarded)
    # an op's own inputs and outputs cannot be evicted while it runs: the report states that slack
    assert report.guard_slack_bytes > 0
    assert all(it.peak_bytes <= report.memory_budget_bytes + report.guard_slack_bytes for it in guarded)
    assert all(it.peak_bytes < report.vanilla_peak_bytes for it in guarded)


def test_a_peak_a_few_bytes_over_the_budget_evicts_nothing():
    """A budget is a forecast, which can miss a few bytes (a CPU forecast leaves out Adam's 4-byte step counters):
    mlp-wide, admitted at its forecast exactly, ran 24 bytes over at one op and evicted a storage every
    iteration, to fetch it back later. An overshoot under the least the guard would evict is tolerated."""
    plain, _ = train(tracing_models.views, 16)
    _, unbudgeted = train(tracing_models.views, 16, planner=lambda workload, b: None)
    peak = max(it.peak_bytes for it in unbudgeted.iterations)
    hooked, report = train(tracing_models.views, 16, planner=lambda workload, b: None, budget=float(peak - 24))
    assert_identical(plain, hooked)
    assert all(it.passive_evictions == 0 for it in report.iterations), [it.passive_evictions for it in report.iterations]
    assert all(it.peak_bytes <= report.memory_budget_bytes + report.guard_slack_bytes for it in report.iterations)


def test_a_budget_in_bytes_holds_from_the_first_iteration():
    """What a job was admitted with (bytes) is known before any plan: the recorded iterations are guarded too."""
    plain, _ = train(tracing_models.views, 16)
    _, unbudgeted = train(tracing_models.views, 16, planner=lambda workload, b: None)
    budget = unbudgeted.vanilla_peak_bytes // 2
    hooked, report = train(tracing_models.views, 16, planner=lambda workload, b: None, budget=float(budget))
    assert_identical(plain, hooked)
    assert report.memory_budget_bytes == budget
    recorded = [it for it in report.iterations if it.mode == "recording"]
    assert recorded and all(it.passive_evictions > 0 for it in recorded)
    assert all(it.peak_bytes <= budget + report.guard_slack_bytes for it in report.iterations)


@pytest.mark.parametrize("environ, named", [
    ({"TENSILE_PLAN_EVENTS": "swaps"}, "TENSILE_PLAN_EVENTS: 'swaps' is not one of auto, all, native"),
    ({"TENSILE_LINK_SHARE": "half"}, "TENSILE_LINK_SHARE: 'half' is not a number"),
    ({"TENSILE_LINK_SHARE": "1.5"}, "TENSILE_LINK_SHARE: must be a share in (0, 1]"),
    ({"TENSILE_RECOMPUTE": "no"}, "TENSILE_RECOMPUTE: 'no' is not one of true, false"),
    ({"TENSILE_MAX_SWAP_RATE": "2"}, "TENSILE_MAX_SWAP_RATE: must be a share of the GPU's swap traffic in (0, 1]"),
    ({"TENSILE_MAX_SWAP_RATE": "-1"}, "TENSILE_MAX_SWAP_RATE: must be a share of the GPU's swap traffic in (0, 1]"),
    ({"TENSILE_MEMORY_BUDGET": "1.5"}, "TENSILE_MEMORY_BUDGET: '1.5' is neither a fraction nor bytes"),
    ({"TENSILE_MEMORY_BUDGET": "12GB!"}, "TENSILE_MEMORY_BUDGET: '12GB!' is not a number of bytes"),
    ({"TENSILE_MEMORY_BUDGET": "2"}, "TENSILE_MEMORY_BUDGET: '2' is 2 bytes, less than 1 MiB, which no training fits in: "
                                     "give a unit (2MiB, 2GiB)"),
])
def test_bad_planning_settings_name_the_variable_and_the_fix(environ, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        HookSettings.from_env(environ)


def test_native_plans_are_cudas_default_and_can_be_chosen_anywhere():
    settings = HookSettings.from_env({"TENSILE_LINK_SHARE": "0.5"})
    assert settings.link_share == 0.5 and settings.plan_events == "auto" and settings.recompute
    assert not HookSettings.from_env({"TENSILE_RECOMPUTE": "false"}).recompute
    assert native_plans(settings, "cuda") and not native_plans(settings, "cpu")
    assert native_plans(HookSettings.from_env({"TENSILE_PLAN_EVENTS": "native"}), "cpu")
    assert not native_plans(HookSettings.from_env({"TENSILE_PLAN_EVENTS": "all"}), "cuda")


def test_a_budget_is_a_fraction_whole_bytes_or_a_quantity_as_tensile_forecast_takes_it():
    budgets = {text: HookSettings.from_env({"TENSILE_MEMORY_BUDGET": text}).memory_budget
               for text in ("0.6", "1", "2e9", "2000000000", "12GiB", "800MB")}
    assert budgets == {"0.6": 0.6, "1": 1.0, "2e9": 2e9, "2000000000": 2e9, "12GiB": 12 * 2**30, "800MB": 800e6}


def test_the_in_process_planner_keeps_to_the_jobs_max_swap_rate(monkeypatch, tiny_workload):
    """Without --agent, --max-swap-rate reached the hook's settings but not the planner."""
    import tensile.planner
    from tensile_hook.plan_source import local_planner

    rates = []
    plan_job = tensile.planner.plan_job
    monkeypatch.setattr(tensile.planner, "plan_job", lambda *a, **kw: rates.append(kw["max_swap_rate"]) or plan_job(*a, **kw))
    for environ in ({"TENSILE_MAX_SWAP_RATE": "0.01"}, {}):
        assert local_planner(HookSettings.from_env(environ), torch.device("cpu"))(tiny_workload(), None) is not None
    assert rates == [0.01, 1.0]


def _tensile_run(*args: str) -> int:
    from tensile.cli import main

    return main(["run", *args])


@pytest.mark.parametrize("options, named", [
    (["--max-swap-rate", "-1"], "--max-swap-rate: must be a share of the GPU's swap traffic in (0, 1], e.g. 0.5 (was -1.0)"),
    (["--max-swap-rate", "0"], "--max-swap-rate: must be a share of the GPU's swap traffic in (0, 1]"),
    (["--memory-budget", "1.5"], "--memory-budget: '1.5' is neither a fraction nor bytes: fractions of the vanilla peak "
                                 "must be in (0, 1] (e.g. 0.6) and byte counts whole"),
    (["--agent", "notaurl"], "--agent: agent URL 'notaurl' must be http://HOST:PORT or https://HOST:PORT"),
    (["--agent", "ftp://host:1"], "--agent: agent URL 'ftp://host:1' must be http://HOST:PORT"),
    (["--", "no-such-program-for-tensile"], "no program 'no-such-program-for-tensile' here; check the command after '--'"),
])
def test_tensile_run_refuses_bad_input_before_starting_the_command(capsys, options, named):
    command = [] if "--" in options else ["--", "python", "-c", "raise SystemExit(5)"]
    assert _tensile_run(*options, *command) == 2
    assert named in " ".join(capsys.readouterr().err.split())


@pytest.mark.slow
def test_a_plan_file_that_cannot_belong_to_its_workload_is_refused_naming_the_event(capsys, tmp_path, tiny_workload):
    """A plan with events on a tensor the workload lacks, triggers past its last op and negative delays ran as far
    as it went, taking the job 22% over its vanilla peak with no word."""
    import dataclasses
    import json

    from tensile.planner import plan_job
    from tensile_hook.plan_source import load_plan_files
    from tensile.workload_io import save_workload

    workload = tiny_workload()
    save_workload(workload, tmp_path / "w.json")
    plan = plan_job(workload, 2e10).plans["job"]  # as much saved as it can: events of every kind
    good = tmp_path / "good.json"
    good.write_text(json.dumps(plan.to_dict()))
    assert _tensile_run("--workload", str(tmp_path / "w.json"), "--plan", str(good), "--", sys.executable, "-c", "pass") == 0
    last = len(workload.ops)
    for bad_event, named in ((Event("job", "swap_out", 99999, 3), "event 0 (swap_out of tensor 99999): the workload has no tensor 99999"),
                             (Event("job", "swap_in", 0, last), f"trigger op {last} is not one of the workload's ops 0-{last - 1}"),
                             (Event("job", "release", 0, 1, -1.0), "delay -1.0 s is not a time after its trigger op"),
                             (Event("job", "evict", 0, 1), "kind 'evict' is not one of swap_out, swap_in, release, recompute")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(dataclasses.replace(plan, events=[bad_event, *plan.events]).to_dict()))
        capsys.readouterr()
        assert _tensile_run("--workload", str(tmp_path / "w.json"), "--plan", str(bad), "--", sys.executable, "-c", "pass") == 2
        said = " ".join(capsys.readouterr().err.split())
        assert f"--plan {bad} is no plan for the workload given with it: event 0 (" in said and named in said, said
        with pytest.raises(ValueError, match=f"TENSILE_PLAN {bad} is no plan"):
            load_plan_files(HookSettings.from_env({"TENSILE_JOB": "j", "TENSILE_PLAN": str(bad), "TENSILE_WORKLOAD": str(tmp_path / "w.json")}))
    (tmp_path / "bad.json").write_text("{not json")
    assert _tensile_run("--workload", str(tmp_path / "w.json"), "--plan", str(tmp_path / "bad.json"), "--", sys.executable, "-c", "pass") == 2
    assert "is not a readable plan file" in capsys.readouterr().err


def test_tensile_run_names_a_command_that_cannot_start(capsys, tmp_path):
    """A file marked executable that is no program: the exec fails (ENOEXEC) after the checks."""
    script = tmp_path / "notes.txt"
    script.write_text("not a program\n")
    script.chmod(0o755)
    assert _tensile_run("--", str(script)) == 2
    assert f"cannot start '{script}': Exec format error" in " ".join(capsys.readouterr().err.split())


@pytest.mark.slow
def test_tensile_run_takes_a_quantity_budget_and_makes_the_reports_folder(tmp_path):
    """A report in a missing folder made the hook stand down: training ran without Tensile."""
    report = tmp_path / "new" / "folder" / "report.json"
    assert _tensile_run("--memory-budget", "12GiB", "--report", str(report), "--", sys.executable, "-c", "pass") == 0
    assert report.parent.is_dir()


@pytest.mark.slow
def test_tensile_run_runs_a_leading_python_as_the_python_with_tensile(tmp_path, monkeypatch):
    """`tensile run -- python train.py` as the README writes it: the `python` on PATH may lack Tensile (no
    venv activated), and the hook was not active; `tensile local` runs this Python, and so does `tensile run`."""
    monkeypatch.setenv("PATH", path_with_another("python", tmp_path / "bin"))
    assert _tensile_run("--", "python", "-c", "import sys; raise SystemExit(0 if sys.executable == %r else 9)" % sys.executable) == 0


def test_the_report_file_is_spaced_out_during_the_run_and_complete_at_exit(tmp_path):
    """Rewriting the whole report at every step grew with the run; now the file is rewritten when its
    interval has passed (the first time at once) and always at exit."""
    import json

    from tensile_hook import activate, deactivate

    path = tmp_path / "report.json"
    settings = HookSettings(job="job", report_path=str(path), report_interval=3600)
    executor = activate(settings, planner=aggressive_plan, device=torch.device("cpu"))
    seen = []
    try:
        torch.manual_seed(0)
        model, batch, loss_fn, make_optimizer = tracing_models.tied(4)
        optimizer = make_optimizer(model.parameters())
        for _ in range(5):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()
            seen.append(len(json.loads(path.read_text())["iterations"]) if path.exists() else None)
    finally:
        deactivate()
    assert seen == [None, 1, 1, 1, 1]  # iteration 1 is written when iteration 2 starts, then not within the hour
    data = json.loads(path.read_text())
    assert len(data["iterations"]) == 5 and data == executor.report.to_dict()


def test_report_writes_stay_a_small_share_of_the_run(tmp_path):
    from tensile_hook.report import HookReport, ReportWriter

    writer = ReportWriter(tmp_path / "report.json", interval=10)
    assert writer.due()
    writer.write(HookReport("job", "cpu"))
    assert not writer.due()
    writer.written_at -= 11
    assert writer.due()
    writer.write_seconds = 1.0  # a report that took a second to write: at most one write per 100 s
    assert not writer.due()
    writer.written_at -= 100
    assert writer.due()


def test_a_long_runs_report_lists_its_first_and_last_iterations_and_totals_the_rest(tmp_path):
    """The hook's memory and the report file stay bounded however long the job trains."""
    import json

    from tensile_hook.report import KEPT_ITERATIONS, HookReport, IterationStats, ReportWriter

    report, writer = HookReport("job", "cpu"), ReportWriter(tmp_path / "report.json", interval=10)
    total = 2 * KEPT_ITERATIONS + 500
    for i in range(total):
        report.add(IterationStats(i, "planned", seconds=1.0, peak_bytes=i, events={"swap_out": 2}))
        if i in (KEPT_ITERATIONS, total - 1):  # written before and after the list starts to be cut
            writer.write(report)
    listed = [it.iteration for it in report.iterations]
    assert listed == [*range(KEPT_ITERATIONS), *range(total - KEPT_ITERATIONS, total)]
    omitted = report.omitted
    assert (omitted.count, omitted.first, omitted.totals.iteration) == (500, KEPT_ITERATIONS, KEPT_ITERATIONS + 499)
    assert omitted.totals.seconds == 500 and omitted.totals.events["swap_out"] == 1000 and omitted.modes == {"planned": 500}
    assert omitted.totals.peak_bytes == KEPT_ITERATIONS + 499
    assert json.loads((tmp_path / "report.json").read_text()) == report.to_dict()


def test_a_reports_run_totals_count_the_omitted_iterations_too():
    """`tensile run`'s summary and `tensile local`'s table read the report file: a long run's totals include
    the iterations it no longer lists."""
    from tensile_hook.report import KEPT_ITERATIONS, HookReport, IterationStats, RunTotals

    report = HookReport("job", "cpu")
    total = 2 * KEPT_ITERATIONS + 10
    for i in range(total):
        report.add(IterationStats(i, "planned" if i else "recording", peak_bytes=5 if i == KEPT_ITERATIONS + 3 else 1,
                                  stall_seconds=0.5))
    totals = RunTotals.of(report.to_dict())
    assert (totals.iterations, totals.planned, totals.peak_bytes, totals.planned_peak_bytes, totals.stall_seconds) == (
        total, total - 1, 5, 5, 0.5 * total)
    assert [(p.iterations, p.peak_bytes) for p in totals.under_plan.plans] == [(total - 1, 5)]
    assert RunTotals.of(HookReport("job", "cpu").to_dict()).iterations == 0


@pytest.mark.slow
def test_the_summary_says_where_the_peak_under_plan_went_over_the_budget(tmp_path, capfd):
    """A 1 MiB budget on a job whose one op needs more than that at once: the summary names the budget and the guard's
    slack that allows going over it."""
    import json

    report = tmp_path / "report.json"
    assert _tensile_run("--memory-budget", "1MiB", "--report", str(report), "--", sys.executable,
                        str(EXAMPLES / "train_mlp.py"), "--steps", "5") == 0
    data = json.loads(report.read_text())
    peak = max(it["peak_bytes"] for it in data["iterations"] if it["mode"] == "planned")
    assert peak > 2**20 and peak - 2**20 <= data["guard_slack_bytes"]
    said = " ".join(capfd.readouterr().err.split())
    assert (f"the peak under plan, {peak / 2**20:,.1f} MiB, went over the memory budget of 1.0 MiB by "
            f"{(peak - 2**20) / 2**20:,.2f} MiB: within the guard's slack of {data['guard_slack_bytes'] / 2**20:,.1f} MiB") in said, said


def test_an_op_retried_after_out_of_memory_keeps_its_own_inputs(planless):
    """On CUDA an out-of-memory error evicts passively and retries the op: the eviction must take other
    tensors, never the op's inputs, which the retry reads (a storage resized to 0 bytes, read by a kernel)."""
    from tensile_hook import deactivate

    older = [torch.ones(2**18) for _ in range(2)]  # 1 MB each, least recently used
    own = torch.arange(2**20, dtype=torch.float32)  # 4 MB: the op's input, more than half the bytes
    slots = [planless.residency.registry.watch(t.untyped_storage()) for t in (*older, own)]
    attempts = []

    def op_out_of_memory_once(x: torch.Tensor) -> torch.Tensor:
        attempts.append(x.untyped_storage().nbytes())
        if len(attempts) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return x * 2

    out = planless.residency.run_op(op_out_of_memory_once, (own,), {})
    assert attempts == [own.nbytes, own.nbytes] and slots[2].resident
    assert torch.equal(out, torch.arange(2**20, dtype=torch.float32) * 2)
    assert not slots[0].resident and not slots[1].resident  # room was made from the others
    assert any("out of memory" in m for m in planless.report.messages)
    deactivate()
    assert torch.equal(older[0], torch.ones(2**18))  # brought back


def test_no_room_to_bring_an_input_back_evicts_others_and_retries(planless):
    """The check before use can run out of memory bringing an input back (a tight budget, a shared GPU):
    it makes room from other tensors and retries, as an op's own out-of-memory retry does; without that
    the hook stood down and the op ran on a storage still at 0 bytes."""
    from torch.utils._python_dispatch import _disable_current_modes

    from tensile_hook import deactivate

    other = torch.ones(2**18)  # 1 MB, least recently used
    other_slot = planless.residency.registry.watch(other.untyped_storage())
    own = torch.arange(2**20, dtype=torch.float32)  # the op's input, swapped out
    own_slot = swapped_out(planless, own)
    swap_in, failures = planless.residency.mover.swap_in, []

    def out_of_memory_once(slot, storage):  # type: ignore[no-untyped-def]
        if not failures:
            failures.append(slot.key)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        swap_in(slot, storage)

    planless.residency.mover.swap_in = out_of_memory_once
    with _disable_current_modes():
        planless.residency.ensure_keys_resident([own_slot.key])
    assert failures == [own_slot.key] and own_slot.resident and not other_slot.resident
    assert torch.equal(own, torch.arange(2**20, dtype=torch.float32)) and planless.report.stood_down is None
    assert any("out of memory bringing a tensor back" in m for m in planless.report.messages)
    deactivate()
    assert torch.equal(other, torch.ones(2**18))


def test_an_input_the_hook_cannot_bring_back_raises_instead_of_running_on_a_freed_storage(planless):
    """When even the stand-down cannot bring an input back (out of memory, nothing else to evict), the op
    must not run on a storage at 0 bytes (on CUDA an illegal memory access that kills the process): the
    user's code gets the out-of-memory error, as it would without Tensile, and the tensor comes back later."""
    from tensile_hook import deactivate

    own = torch.arange(2**20, dtype=torch.float32)
    swapped_out(planless, own)
    swap_in = planless.residency.mover.swap_in

    def out_of_memory(slot, storage):  # type: ignore[no-untyped-def]
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    planless.residency.mover.swap_in = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        own * 2
    assert planless.report.stood_down and "OutOfMemoryError" in planless.report.stood_down
    planless.residency.mover.swap_in = swap_in
    deactivate()
    assert torch.equal(own, torch.arange(2**20, dtype=torch.float32))  # brought back once there was room
