"""What the hook tells the user (--report), the agent and the logs: one JSON object per run."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tensile.agent_contract import higher, measured_under_plan, planned_peak
from tensile.plan import EVENT_KINDS


@dataclass
class IterationStats:
    iteration: int
    mode: str = "recording"  # recording | planned | guarded | diverged | stood_down
    plan_version: int | None = None
    path: str = "dispatch"  # dispatch (every op seen, exact) | native (module, step and autograd node hooks; no op in Python)
    peak_bytes: int = 0
    peak_source: str = "measured"  # measured | planned: a native CPU iteration not observed reports the forecast
    seconds: float = 0.0
    stall_seconds: float = 0.0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    recompute_bytes: int = 0
    passive_evictions: int = 0
    events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVENT_KINDS, 0))
    hook_seconds: float = 0.0  # the hook's own logic, without the mover's copies
    transfer_seconds: float = 0.0  # time in the mover's copies (synchronous on the CPU device, enqueued on CUDA)
    ops: int = 0


KEPT_ITERATIONS = 1000  # a long run's report lists its first and its last this many iterations one by one


SUMMED = ("seconds", "stall_seconds", "swap_out_bytes", "swap_in_bytes", "recompute_bytes", "passive_evictions",
          "hook_seconds", "transfer_seconds", "ops")  # IterationStats' figures that add up over iterations


@dataclass
class OmittedIterations:
    """What a long run's report no longer lists one by one (the iterations between its first and its
    last KEPT_ITERATIONS), as totals: the hook's memory and the report file stay bounded however long
    the job trains (a listed iteration takes about 430 bytes in the process and 390 in the file)."""

    count: int = 0
    first: int | None = None  # the first omitted iteration's number
    modes: dict[str, int] = field(default_factory=dict)  # iterations per mode
    # their figures summed, peak_bytes the largest; iteration, mode, path and plan version the last one's
    totals: IterationStats = field(default_factory=lambda: IterationStats(0))
    planned_peak_bytes: int | None = None  # the largest peak of those measured under a plan (measured_under_plan)

    def absorb(self, stats: IterationStats) -> None:
        self.count += 1
        self.first = stats.iteration if self.first is None else self.first
        self.modes[stats.mode] = self.modes.get(stats.mode, 0) + 1
        totals = self.totals
        for name in SUMMED:
            setattr(totals, name, getattr(totals, name) + getattr(stats, name))
        for kind, count in stats.events.items():
            totals.events[kind] = totals.events.get(kind, 0) + count
        totals.peak_bytes = max(totals.peak_bytes, stats.peak_bytes)
        totals.iteration, totals.mode, totals.path, totals.plan_version = stats.iteration, stats.mode, stats.path, stats.plan_version
        totals.peak_source = stats.peak_source
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
    plan_version: int | None = None
    plan_source: str | None = None  # file | local | agent
    signature_match: bool | None = None
    live_signature: str | None = None
    stood_down: str | None = None
    messages: list[str] = field(default_factory=list)  # each said once, from the iteration it was first said in
    repeated: dict[str, int] = field(default_factory=dict)  # message -> how many more times it was said
    omitted: OmittedIterations = field(default_factory=OmittedIterations)
    iterations: list[IterationStats] = field(default_factory=list)

    def add(self, stats: IterationStats) -> None:
        """One more iteration: listed, and the one that leaves the middle of a long run's list totalled."""
        self.iterations.append(stats)
        if len(self.iterations) > 2 * KEPT_ITERATIONS:
            self.omitted.absorb(self.iterations.pop(KEPT_ITERATIONS))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunTotals:
    """A report file's whole run: its listed iterations and the ones it totals (`omitted`) together."""

    iterations: int
    planned: int  # iterations under a plan
    peak_bytes: int  # of every iteration: what the device had to hold
    planned_peak_bytes: int | None  # of the iterations measured under a plan: what compares with the forecast
    stall_seconds: float

    @classmethod
    def of(cls, data: dict) -> RunTotals:
        listed, omitted = data["iterations"], data["omitted"]
        return cls(
            iterations=len(listed) + omitted["count"],
            planned=sum(1 for it in listed if it["mode"] == "planned") + omitted["modes"].get("planned", 0),
            peak_bytes=max([it["peak_bytes"] for it in listed] + [omitted["totals"]["peak_bytes"]]),
            planned_peak_bytes=higher(planned_peak(listed), omitted["planned_peak_bytes"]),
            stall_seconds=sum(it["stall_seconds"] for it in listed) + omitted["totals"]["stall_seconds"],
        )


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

    def due(self) -> bool:
        return self.written_at is None or time.monotonic() - self.written_at >= max(self.interval, self.write_seconds / self.SHARE)

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
