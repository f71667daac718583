"""The local runner (docs/local-mode.md): TrainingJobs on one machine, admitted onto one GPU by their forecast
scheduled peaks, each run as a subprocess under the hook and linked to the in-process node agent.

Admission is first come, first served: the next job starts when the sum of the running jobs' admitted sizes
(what the caching allocator reserves at the forecast scheduled peak, `tensile.admission.forecast_admitted_bytes`, or the
memory budget of a job without a traceable model, plus the GPU's per-job context) leaves room for its own; the
others wait, queued. Each job's process is capped at its admitted size (TENSILE_MEMORY_CAP). A traced job whose
memory budget is below the lowest peak its plan can reach fails (the operator's `BudgetUnreachable`): admitted by
that budget, it would hold more of the GPU than it was admitted with.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tensile.agent_contract import higher
from tensile.child_process import ends_with_this_process
from tensile.console import print_note
from tensile.admission import forecast_admitted_bytes
from tensile.failure import last_line, outgrew_cap
from tensile.knobs import unreachable_budget_text
from tensile.local.jobs import LocalJob

if TYPE_CHECKING:
    from tensile.local.agent import LocalAgent

POLL_SECONDS = 0.5


@dataclass
class JobRun:
    """One job's life in the runner: forecast, phase and what the agent and the hook reported."""

    job: LocalJob
    phase: str = "Pending"  # Pending, Forecasting, Queued, Running, Succeeded, Failed
    vanilla_peak: int | None = None
    scheduled_peak: int | None = None
    workload_path: Path | None = None
    demand: int | None = None  # the bytes its tensors are held to (its budget, else its forecast scheduled peak)
    # the forecast (`forecast_summary`) with the budget the job is held to: what its admitted size is made from
    summary: dict | None = None
    observed_peak: int | None = None  # of every iteration: the unplanned first ones run at the vanilla peak
    observed_planned_peak: int | None = None  # of the iterations measured under a plan: compare with scheduled_peak
    observed_reserved_peak: int | None = None  # what the process held (CUDA: max_memory_reserved; CPU: observed_peak)
    out_of_memory_retries: int = 0  # allocation failures (its cap, a full device) the guard evicted for and retried
    iterations: int = 0
    stall_seconds: float = 0.0
    message: str = ""
    process: subprocess.Popen | None = None
    log: Path | None = None
    report: Path | None = None
    started: float | None = None
    seconds: float | None = None
    # each listed iteration's (start, end, peak bytes) on the runner's clock (time.monotonic), from its report's
    # iteration times counted back from when the runner saw the job end: its memory over time
    iteration_spans: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.job.name


def forecast(run: JobRun, device: str, preset: str, directory: Path) -> tuple[str, ...]:
    """Trace and plan the job's model (CPU, meta device); a job given by profile keeps its budget. What the latency
    model noted, for the caller to say once for all jobs."""
    from tensile.allocator import expandable_segments_in
    from tensile.forecast import optimizer_for, trace_workload
    from tensile.job_forecast import make_forecast
    from tensile.workload_io import save_workload

    spec = run.job.spec
    declared = spec.workload  # what the TrainingJob says to trace
    if declared.model is None:
        run.demand = spec.memory_budget
        run.message = f"profile '{declared.profile}': admitted by its memory budget"
        return ()
    optimizer = optimizer_for(declared.model, run.job.optimizer)
    workload = trace_workload(declared.model, declared.batch_size, optimizer=optimizer, dtype=declared.dtype,
                              device=device, micro_batches=declared.micro_batches, input_shape=declared.input_shape)
    # with its max swapping rate, as the agent plans it: without, mlp-wide (maxSwapRate 0.5) was admitted at a
    # 7.1 MiB peak its plan could not reach (9.1 MiB) and every iteration ran guarded, evicting
    result = make_forecast(workload, preset, plan_events=spec.plan_events, recompute=spec.recompute,
                           max_swap_rate=spec.max_swap_rate or 1.0,
                           expandable_segments=expandable_segments_in(os.environ), environ=os.environ)
    run.vanilla_peak = result.summary["vanilla_peak_bytes"]
    run.scheduled_peak = result.summary["scheduled_peak_bytes"]
    run.demand = run.scheduled_peak if spec.memory_budget is None else min(run.scheduled_peak, spec.memory_budget)
    run.summary = result.summary | {"memory_budget_bytes": spec.memory_budget}
    run.workload_path = directory / f"{run.name}.workload.json.gz"
    save_workload(workload, run.workload_path)
    return result.notes


def unreachable_budget(run: JobRun) -> str | None:
    """Why the job's memory budget cannot be held, or None: a budget below the lowest peak any plan reaches (the
    forecast plans without a budget, as far as swaps and recomputes go at the job's max swap rate). Admitted by
    such a budget, the job would hold its reachable peak on the GPU, more than admission counted (two mlp-wide
    jobs with `memoryBudget: 1Ki` were admitted together and held ~6 MiB of a 4.75 MiB GPU). As the operator's
    `BudgetUnreachable`, the job fails."""
    spec = run.job.spec
    if spec.memory_budget is None or run.scheduled_peak is None:
        return None  # no budget, or a profile job: admitted by its budget, nothing forecast to compare it with
    lowest = min(run.scheduled_peak, run.vanilla_peak or run.scheduled_peak)
    if spec.memory_budget >= lowest:
        return None
    text = unreachable_budget_text(spec.memory_budget, lowest, spec.max_swap_rate, spec.swap_rate_field)
    return f"BudgetUnreachable: {spec.budget_field} {text}"


def job_environment(run: JobRun, agent_url: str, credential_path: str, admitted: int,
                    context: int) -> dict[str, str]:
    """The environment the job runs in: this process's, with the hook switched on and told what `tensile run` would
    be (the local agent and the file of its credential, the budget the job was admitted with, its knobs, where to
    write its report) and its CUDA memory capped at its `admitted` size, `context` of it counted for its process's
    CUDA context (outside the caching allocator)."""
    from tensile_hook.launch import hook_environment, hook_variables

    spec = run.job.spec
    variables = hook_variables(memory_budget=str(run.demand) if run.demand else None, agent=agent_url,
                               workload=str(run.workload_path) if run.workload_path else None, report=str(run.report),
                               max_swap_rate=spec.max_swap_rate, plan_events=spec.plan_events, recompute=spec.recompute,
                               memory_cap=admitted, context_bytes=context)
    return hook_environment(run.name, variables) | {"TENSILE_TOKEN_FILE": credential_path}


def log_tail(log: Path, tail: int = 4096) -> str:
    """The last `tail` bytes of a job's log; "" where there is none."""
    try:
        with log.open("rb") as file:
            file.seek(max(0, file.seek(0, 2) - tail))
            return file.read().decode(errors="replace")
    except OSError:
        return ""


def job_log(reports: Path, name: str) -> Path:
    """Where the runner writes a job's stdout and stderr: named here once, for whoever reads them back."""
    return reports / f"{name}.log"


def job_report(reports: Path, name: str) -> Path:
    """Where a job's hook writes its report (TENSILE_REPORT): named here once, for whoever reads it back."""
    return reports / f"{name}.report.json"


def iteration_spans(iterations: list[dict], ended: float) -> list[tuple[float, float, int]]:
    """(start, end, peak) of a report's listed iterations, placed back to back before `ended`: the process's exit
    after its last iteration is short beside the iterations, and a report holds their durations, not their times."""
    spans = []
    end = ended
    for it in reversed(iterations):
        spans.append((end - it["seconds"], end, it["peak_bytes"]))
        end -= it["seconds"]
    return spans[::-1]


class FirstComeFirstServed:
    """Admission onto one GPU of `capacity` bytes, `context` more per job, in the order the jobs were queued."""

    def __init__(self, capacity: int, context: int) -> None:
        self.capacity = capacity
        self.context = context

    def need(self, run: JobRun) -> int:
        """The job's admitted size: from its forecast (reserved + context), or its budget plus context."""
        if run.summary is not None:
            return forecast_admitted_bytes(run.summary, self.context)
        return (run.demand or 0) + self.context

    def fits_alone(self, run: JobRun) -> bool:
        return self.need(run) <= self.capacity

    def admit(self, queue: list[JobRun], running: list[JobRun]) -> list[JobRun]:
        """The queued jobs that start now, in order, while they fit beside the running ones."""
        used = sum(self.need(r) for r in running)
        admitted = []
        for run in queue:
            if used + self.need(run) > self.capacity:
                break  # in order: a large job at the head is not overtaken forever
            used += self.need(run)
            admitted.append(run)
        return admitted


class LocalRunner:
    def __init__(self, jobs: list[LocalJob], agent: LocalAgent, reports: Path, device: str, preset: str) -> None:
        from tensile.agent_client import Http

        self.runs = [JobRun(job) for job in jobs]
        self.agent = agent
        self.reports = reports
        self.device = device
        self.preset = preset
        gpu = agent.gpu
        self.admission = FirstComeFirstServed(gpu.capacity_bytes, gpu.context_bytes)
        self.http = Http(agent.url, timeout=2.0, retries=1)
        self.most_at_once = 0  # jobs that ran at the same time, at most
        self.noted: set[str] = set()  # the forecasts' notes said so far

    # -- phases ------------------------------------------------------------------------------------
    def forecast_all(self, on_change: Callable[[], object] = lambda: None) -> None:
        from tensile.errors import TensileUserError

        for run in self.runs:
            if run.job.problem:
                run.phase, run.message = "Failed", run.job.problem
                continue
            run.phase = "Forecasting"
            on_change()
            try:
                for note in forecast(run, self.device, self.preset, self.reports):
                    if note not in self.noted:  # the latency model's word, said once for all the jobs
                        self.noted.add(note)
                        print_note(note)
            except (TensileUserError, ValueError, RuntimeError) as exc:
                run.phase, run.message = "Failed", f"forecast failed: {exc}"
                continue
            unreachable = unreachable_budget(run)
            if unreachable:
                run.phase, run.message = "Failed", unreachable
                continue
            if not self.admission.fits_alone(run):
                run.phase = "Failed"
                run.message = (f"needs {self.admission.need(run) / 2**20:,.1f} MiB, more than the GPU's "
                               f"{self.admission.capacity / 2**20:,.1f} MiB even alone")
                continue
            run.phase = "Queued"
            on_change()

    def step(self) -> bool:
        """One pass: reap finished jobs, start what fits, refresh from the agent. False when all ended."""
        for run in self.running():
            code = run.process.poll() if run.process else None
            if code is not None:
                self._finished(run, code)
        queue = [r for r in self.runs if r.phase == "Queued"]
        for run in self.admission.admit(queue, self.running()):
            self._start(run)
        self.most_at_once = max(self.most_at_once, len(self.running()))
        self.agent.set_queued(sum(1 for r in self.runs if r.phase == "Queued"))
        self.refresh()
        return any(r.phase in ("Queued", "Running", "Forecasting", "Pending") for r in self.runs)

    def running(self) -> list[JobRun]:
        return [r for r in self.runs if r.phase == "Running"]

    def _start(self, run: JobRun) -> None:
        run.report = job_report(self.reports, run.name)
        run.log = job_log(self.reports, run.name)
        env = job_environment(run, self.agent.url, self.agent.credential_path, self.admission.need(run),
                              self.admission.context)
        with open(run.log, "wb") as log:
            try:
                run.process = subprocess.Popen(run.job.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               preexec_fn=ends_with_this_process())
            except OSError as exc:
                run.phase, run.message = "Failed", f"cannot start {run.job.command[0]}: {exc.strerror}"
                return
        run.phase, run.started = "Running", time.monotonic()

    def _finished(self, run: JobRun, code: int) -> None:
        ended = time.monotonic()
        run.seconds = ended - (run.started or ended)
        run.phase = "Succeeded" if code == 0 else "Failed"
        if code != 0:
            run.message = self._failure(run, code)
        if run.report and run.report.exists():
            from tensile_hook.report import RunTotals

            data = json.loads(run.report.read_text())
            totals = RunTotals.of(data)
            if totals.iterations:
                run.observed_peak, run.observed_planned_peak = totals.peak_bytes, totals.planned_peak_bytes
                run.observed_reserved_peak = totals.reserved_peak_bytes
            run.iterations = totals.iterations
            run.out_of_memory_retries = totals.out_of_memory_retries
            run.stall_seconds = totals.stall_seconds
            run.iteration_spans = iteration_spans(data["iterations"], ended)
            run.vanilla_peak = run.vanilla_peak or data.get("vanilla_peak_bytes")
            run.scheduled_peak = run.scheduled_peak or data.get("scheduled_peak_bytes")

    def _failure(self, run: JobRun, code: int) -> str:
        """A failed job's message: its exit code and its log's last line, with what running out of CUDA memory under
        its cap means (`tensile.failure.outgrew_cap`: on the CPU device there is no cap)."""
        last = last_line(log_tail(run.log)) if run.log is not None else ""
        if not last:
            return f"exit code {code}; see {run.log}"
        said = f"exit code {code}: {last}"
        cap = self.admission.need(run) if self.device == "cuda" else None
        return f"{outgrew_cap(said, cap) or said}; see {run.log}"

    def refresh(self) -> None:
        """Observed figures of the running jobs, from the agent (a finished job has unregistered)."""
        from tensile.agent_client import AgentError, AgentUnreachable

        try:
            _, body, _ = self.http.request("GET", "/v1/jobs")
        except (AgentError, AgentUnreachable):
            return
        by_name = {j["job"]: j for j in (body or {}).get("jobs", [])}
        for run in self.running():
            seen = by_name.get(run.name)
            if seen is None:
                continue
            observed = seen["observed"]
            run.observed_peak = higher(run.observed_peak, observed.get("peak_bytes"))
            run.observed_planned_peak = higher(run.observed_planned_peak, observed.get("planned_peak_bytes"))
            run.observed_reserved_peak = higher(run.observed_reserved_peak, observed.get("reserved_peak_bytes"))
            run.iterations = max(run.iterations, observed.get("iterations") or 0)
            run.out_of_memory_retries = max(run.out_of_memory_retries, observed.get("out_of_memory_retries") or 0)
            run.stall_seconds = observed.get("stall_seconds") or 0.0
            if run.vanilla_peak is None and seen.get("forecast"):  # a profile job: the agent's plan forecasts it
                run.vanilla_peak = seen["forecast"]["vanilla_peak_bytes"]
                run.scheduled_peak = seen["forecast"]["scheduled_peak_bytes"]

    def stop(self) -> None:
        """Ctrl-C: end the jobs still running."""
        for run in self.running():
            if run.process is not None:
                run.process.terminate()
                try:
                    run.process.wait(10)
                except subprocess.TimeoutExpired:
                    run.process.kill()
                run.phase, run.message = "Failed", "stopped by the user"
        self.http.close()
