"""What the hook tells the user (--report), the agent and the logs: one JSON object per run."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

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
    messages: list[str] = field(default_factory=list)
    iterations: list[IterationStats] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class ReportWriter:
    """Keeps the --report file current without costing the training a growing share of each step:
    every iteration is serialised once, and the file is rewritten at most every `interval` seconds,
    and never more often than keeps the writes under 1% of the time (plus at the end). Rewriting the
    whole report at every step cost 38 ms an iteration after 1,000 iterations and 0.5 s after 10,000;
    this way a write at 10,000 iterations takes about 20 ms."""

    SHARE = 0.01  # of the run's time the writes may take

    def __init__(self, path: str | os.PathLike, interval: float) -> None:
        self.path = Path(path)
        self.interval = interval
        self.written_at: float | None = None
        self.write_seconds = 0.0  # how long the last write took
        self.iteration_texts: list[str] = []  # the report's iterations, serialised as they came

    def due(self) -> bool:
        return self.written_at is None or time.monotonic() - self.written_at >= max(self.interval, self.write_seconds / self.SHARE)

    def write(self, report: HookReport) -> None:
        """Atomically, so a reader never sees half a report."""
        started = time.monotonic()
        for stats in report.iterations[len(self.iteration_texts):]:
            self.iteration_texts.append(json.dumps(asdict(stats)))
        head = json.dumps({f.name: getattr(report, f.name) for f in fields(report) if f.name != "iterations"}, indent=1)
        text = head[:-2] + ',\n "iterations": [\n  ' + ",\n  ".join(self.iteration_texts) + "\n ]\n}\n"
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(text)
        partial.replace(self.path)
        self.written_at = time.monotonic()
        self.write_seconds = self.written_at - started
