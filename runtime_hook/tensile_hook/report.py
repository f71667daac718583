"""What the hook tells the user (--report), the agent and the logs: one JSON object per run."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tensile.agent_contract import higher, measured_under_plan, planned_peak
from tensile.knobs import memory_text
from tensile.plan import EVENT_KINDS
from tensile_hook.memory_cap import MemoryCap


@dataclass
class IterationStats:
    iteration: int
    mode: str = "recording"  # recording | planned | guarded | diverged | stood_down
    plan_version: int | None = None
    path: str = "dispatch"  # dispatch (every op seen, exact) | native (module, step and autograd node hooks; no op in Python)
    peak_bytes: int = 0
    peak_source: str = "measured"  # measured | planned: a native CPU iteration not observed reports the forecast
    # what the process held at the iteration's peak. CUDA: the caching allocator's max_memory_reserved (its segments:
    # what a neighbour on a shared GPU finds taken, fragmentation included). The CPU device has no caching allocator
    # (PyTorch's CPU allocator hands each freed block back), so there it is peak_bytes itself: the tracked storages'
    # peak (or the forecast, where peak_source is planned), not a measurement of anything more. None: not measured
    reserved_bytes: int | None = None
    seconds: float = 0.0
    stall_seconds: float = 0.0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    recompute_bytes: int = 0
    passive_evictions: int = 0
    # allocation failures (torch.OutOfMemoryError: the device full, or the job's memory cap reached) the guard turned
    # into passive evictions and a retry
    out_of_memory_retries: int = 0
    events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVENT_KINDS, 0))
    hook_seconds: float = 0.0  # the hook's own logic, without the mover's copies or the recomputes' replays
    transfer_seconds: float = 0.0  # time in the mover's calls (enqueuing copies on CUDA; handing memory over, no copy, on the CPU device)
    recompute_seconds: float = 0.0  # time replaying recipes into released storages (their ops' kernels on the CPU; enqueuing them on CUDA)
    ops: int = 0
    # what the iteration ran against (HookReport.add stamps them): the guard's budget (None: no budget, or a fraction
    # not yet made bytes), and the forecast scheduled peak of the plan in force. A run's plan and budget change (a
    # re-plan, an operator's PATCH of the budget): its report's own figures are only the last ones
    memory_budget_bytes: int | None = None
    scheduled_peak_bytes: int | None = None


KEPT_ITERATIONS = 1000  # a long run's report lists its first and its last this many iterations one by one


# IterationStats' figures that add up over iterations
SUMMED = ("seconds", "stall_seconds", "swap_out_bytes", "swap_in_bytes", "recompute_bytes", "passive_evictions",
          "out_of_memory_retries", "hook_seconds", "transfer_seconds", "recompute_seconds", "ops")


@dataclass
class PlanPeak:
    """The peaks measured under one plan, its version and forecast: re-plans (drift, knobs, a neighbour) and new
    shapes change both mid-run, and one plan's iterations compare with its own forecast alone. Its first iteration
    each time it takes over is kept apart: it starts with what the plan keeps off the device between iterations
    still there (the iteration before ran no swap-outs of this plan at its step, so the swap-ins of this plan's
    cross-iteration events find their tensors on the device), and it peaks above the forecast by up to those
    bytes, within the budget the guard keeps (the guard evicts instead)."""

    plan_version: int | None
    scheduled_peak_bytes: int | None  # the forecast
    iterations: int = 0  # measured under it, its first ones included
    peak_bytes: int | None = None  # the largest of its other iterations: what compares with the forecast
    first_peak_bytes: int | None = None  # the largest of its first iterations


@dataclass
class UnderPlan:
    """The iterations measured under a plan (`measured_under_plan`), taken in order: each plan's peaks, and the
    iteration furthest over the budget in force when it ran (an operator's budget PATCH lowers it mid-run: the
    iterations before kept to the budget they had)."""

    plans: list[PlanPeak] = field(default_factory=list)  # in the order they first took over
    over_budget: list[int] | None = None  # [peak, budget] of the iteration furthest over its budget; None: none was

    @classmethod
    def of(cls, data: dict | None) -> UnderPlan:
        """From a report's JSON (an older hook's report has none: empty)."""
        if not data:
            return cls()
        return cls([PlanPeak(**p) for p in data["plans"]], data["over_budget"])

    def absorb(self, it: Mapping[str, Any], previous: Mapping[str, Any] | None) -> None:
        """One iteration (IterationStats' fields, as a mapping), after `previous` (None: the run's first)."""
        if not measured_under_plan(it.get("mode"), it.get("peak_source", "measured")):
            return
        key = (it.get("plan_version"), it.get("scheduled_peak_bytes"))
        plan = self._plan(*key)
        plan.iterations += 1
        peak = int(it.get("peak_bytes") or 0)
        if previous is None or (previous.get("plan_version"), previous.get("scheduled_peak_bytes")) != key:
            plan.first_peak_bytes = higher(plan.first_peak_bytes, peak)
        else:
            plan.peak_bytes = higher(plan.peak_bytes, peak)
        self._over(peak, it.get("memory_budget_bytes"))

    def merge(self, other: UnderPlan) -> None:
        """Another stretch of the run's iterations (a long run's omitted ones), taken after this one's."""
        for theirs in other.plans:
            plan = self._plan(theirs.plan_version, theirs.scheduled_peak_bytes)
            plan.iterations += theirs.iterations
            plan.peak_bytes = higher(plan.peak_bytes, theirs.peak_bytes)
            plan.first_peak_bytes = higher(plan.first_peak_bytes, theirs.first_peak_bytes)
        if other.over_budget is not None:
            self._over(*other.over_budget)

    def _plan(self, version: int | None, forecast: int | None) -> PlanPeak:
        plan = next((p for p in self.plans if (p.plan_version, p.scheduled_peak_bytes) == (version, forecast)), None)
        if plan is None:
            plan = PlanPeak(version, forecast)
            self.plans.append(plan)
        return plan

    def _over(self, peak: int, budget: int | None) -> None:
        if budget and peak > budget and (self.over_budget is None or peak - budget > self.over_budget[0] - self.over_budget[1]):
            self.over_budget = [peak, budget]


@dataclass
class OmittedIterations:
    """What a long run's report no longer lists one by one (the iterations between its first and its
    last KEPT_ITERATIONS), as totals: the hook's memory and the report file stay bounded however long
    the job trains (a listed iteration takes about 430 bytes in the process and 390 in the file)."""

    count: int = 0
    first: int | None = None  # the first omitted iteration's number
    modes: dict[str, int] = field(default_factory=dict)  # iterations per mode
    # their figures summed, peak_bytes the largest; iteration, mode, path, plan version, budget and forecast the last one's
    totals: IterationStats = field(default_factory=lambda: IterationStats(0))
    planned_peak_bytes: int | None = None  # the largest peak of those measured under a plan (measured_under_plan)
    under_plan: UnderPlan = field(default_factory=UnderPlan)  # theirs, by plan

    def absorb(self, stats: IterationStats, listed_before: IterationStats) -> None:
        """`stats` follows the last one absorbed, or `listed_before` (the last of the first listed) for the first."""
        self.under_plan.absorb(vars(stats), vars(self.totals if self.count else listed_before))
        self.count += 1
        self.first = stats.iteration if self.first is None else self.first
        self.modes[stats.mode] = self.modes.get(stats.mode, 0) + 1
        totals = self.totals
        for name in SUMMED:
            setattr(totals, name, getattr(totals, name) + getattr(stats, name))
        for kind, count in stats.events.items():
            totals.events[kind] = totals.events.get(kind, 0) + count
        totals.peak_bytes = max(totals.peak_bytes, stats.peak_bytes)
        totals.reserved_bytes = higher(totals.reserved_bytes, stats.reserved_bytes)
        totals.iteration, totals.mode, totals.path, totals.plan_version = stats.iteration, stats.mode, stats.path, stats.plan_version
        totals.peak_source = stats.peak_source
        totals.memory_budget_bytes, totals.scheduled_peak_bytes = stats.memory_budget_bytes, stats.scheduled_peak_bytes
        if measured_under_plan(stats.mode, stats.peak_source):
            self.planned_peak_bytes = higher(self.planned_peak_bytes, stats.peak_bytes)


@dataclass
class HookReport:
    job: str
    device: str
    vanilla_peak_bytes: int | None = None
    scheduled_peak_bytes: int | None = None
    memory_budget_bytes: int | None = None
    guard_slack_bytes: int | None = None  # the largest single op's inputs + outputs: what the guard cannot evict
    # CUDA: what the allocator held at the recorded iteration beyond the forecast's tensors (library workspaces, its
    # rounding); no plan moves it, and measured peaks are held to the budget plus it (`PlanExecutor._measure_workspace`)
    workspace_bytes: int | None = None
    plan_version: int | None = None
    plan_source: str | None = None  # file | local | agent
    signature_match: bool | None = None
    live_signature: str | None = None
    stood_down: str | None = None
    # the process's CUDA memory cap (tensile_hook.memory_cap.MemoryCap's fields), set before the hook started and kept
    # whether it ran or stood down; None: no cap (none given, or the CPU device)
    memory_cap: dict | None = None
    messages: list[str] = field(default_factory=list)  # each said once, from the iteration it was first said in
    repeated: dict[str, int] = field(default_factory=dict)  # message -> how many more times it was said
    omitted: OmittedIterations = field(default_factory=OmittedIterations)
    iterations: list[IterationStats] = field(default_factory=list)

    def add(self, stats: IterationStats) -> None:
        """One more iteration, at its end, stamped with the budget and the forecast it ran under (a plan or budget
        that comes at its end is taken from the next iteration on); listed, and the one that leaves the middle of a
        long run's list totalled."""
        stats.memory_budget_bytes = self.memory_budget_bytes
        under_this = stats.plan_version is not None and stats.plan_version == self.plan_version
        stats.scheduled_peak_bytes = self.scheduled_peak_bytes if under_this else None
        self.iterations.append(stats)
        if len(self.iterations) > 2 * KEPT_ITERATIONS:
            self.omitted.absorb(self.iterations.pop(KEPT_ITERATIONS), self.iterations[KEPT_ITERATIONS - 1])

    def to_dict(self) -> dict:
        return asdict(self)


def write_stood_down(path: str | os.PathLike, job: str, reason: str, cap: MemoryCap | None) -> None:
    """The report of a process whose hook never started (sitecustomize: several processes, a failure at start): why,
    and the memory cap it runs under all the same."""
    device = f"cuda:{cap.device}" if cap is not None else "unknown"
    report = HookReport(job=job, device=device, stood_down=reason, memory_cap=asdict(cap) if cap else None)
    ReportWriter(path, 0.0).write(report)


@dataclass(frozen=True)
class RunTotals:
    """A report file's whole run: its listed iterations and the ones it totals (`omitted`) together."""

    iterations: int
    planned: int  # iterations under a plan
    peak_bytes: int  # of every iteration: what the device had to hold
    reserved_peak_bytes: int | None  # of every iteration: what the process held (IterationStats.reserved_bytes)
    planned_peak_bytes: int | None  # of the iterations measured under a plan
    stall_seconds: float
    out_of_memory_retries: int  # allocation failures the guard turned into passive evictions
    under_plan: UnderPlan  # by plan, against each one's forecast and the budget in force: what `tensile run` says

    @classmethod
    def of(cls, data: dict) -> RunTotals:
        listed, omitted = data["iterations"], data["omitted"]
        under_plan = UnderPlan()
        previous = None
        for i, it in enumerate(listed):
            if i == KEPT_ITERATIONS and omitted["count"]:  # the omitted iterations come between the first and last listed
                under_plan.merge(UnderPlan.of(omitted.get("under_plan")))
                previous = omitted["totals"]
            under_plan.absorb(it, previous)
            previous = it
        return cls(
            iterations=len(listed) + omitted["count"],
            planned=sum(1 for it in listed if it["mode"] == "planned") + omitted["modes"].get("planned", 0),
            peak_bytes=max([it["peak_bytes"] for it in listed] + [omitted["totals"]["peak_bytes"]]),
            reserved_peak_bytes=max((r for r in [*(it.get("reserved_bytes") for it in listed),
                                                 omitted["totals"].get("reserved_bytes")] if r is not None),
                                    default=None),
            planned_peak_bytes=higher(planned_peak(listed), omitted["planned_peak_bytes"]),
            stall_seconds=sum(it["stall_seconds"] for it in listed) + omitted["totals"]["stall_seconds"],
            out_of_memory_retries=sum(it.get("out_of_memory_retries", 0) for it in listed)
            + omitted["totals"].get("out_of_memory_retries", 0),
            under_plan=under_plan,
        )


def memory_cap_outcome(data: Mapping[str, Any], totals: RunTotals) -> str | None:
    """Which happened, for a run's summary: its CUDA memory capped (with the hook running, or stood down: then the cap
    alone held the job to its admission), and allocation failures the guard turned into evictions; None: neither."""
    said = []
    cap = data.get("memory_cap")
    if cap:
        off = " with the hook stood down" if data.get("stood_down") else ""
        said.append(f"CUDA memory capped at {memory_text(cap['cap_bytes'])} ({memory_text(cap['allocator_bytes'])} "
                    f"for its caching allocator){off}")
    if totals.out_of_memory_retries:
        said.append(f"{totals.out_of_memory_retries} out-of-memory errors turned into passive evictions and retried")
    return "; ".join(said) or None


class ReportWriter:
    """Keeps the --report file current without costing the training a growing share of each step:
    every iteration is serialised once, and the file is rewritten at most every `interval` seconds,
    and never more often than keeps the writes under 1% of the time (plus at the end). Rewriting the
    whole report at every step cost 38 ms an iteration after 1,000 iterations and 0.5 s after 10,000;
    this way a write lists at most 2 x KEPT_ITERATIONS, each serialised once."""

    SHARE = 0.01  # of the run's time the writes may take

    def __init__(self, path: str | os.PathLike, interval: float) -> None:
        self.path = Path(path)
        self.interval = interval
        self.written_at: float | None = None
        self.write_seconds = 0.0  # how long the last write took
        self.iteration_texts: dict[int, str] = {}  # the listed iterations by number, serialised as they came
        self.opened = time.time()  # against the file's modification time (`written_elsewhere`)

    def due(self) -> bool:
        return self.written_at is None or time.monotonic() - self.written_at >= max(self.interval, self.write_seconds / self.SHARE)

    def written_elsewhere(self) -> bool:
        """Another process of the run wrote the file since this writer was made, and this one never did."""
        return self.written_at is None and self.path.exists() and self.path.stat().st_mtime >= self.opened

    def write(self, report: HookReport) -> None:
        """Atomically, so a reader never sees half a report."""
        started = time.monotonic()
        cached = self.iteration_texts
        self.iteration_texts = {stats.iteration: cached.get(stats.iteration) or json.dumps(asdict(stats))
                                for stats in report.iterations}
        head = {f.name: getattr(report, f.name) for f in fields(report) if f.name not in ("omitted", "iterations")}
        head["omitted"] = asdict(report.omitted)
        listed = ",\n  ".join(self.iteration_texts.values())
        text = json.dumps(head, indent=1)[:-2] + ',\n "iterations": [\n  ' + listed + "\n ]\n}\n"
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(text)
        partial.replace(self.path)
        self.written_at = time.monotonic()
        self.write_seconds = self.written_at - started
