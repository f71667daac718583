"""What the hook tells the user (--report), the agent and the logs: one JSON object per run."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
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

    def write(self, path: str | os.PathLike) -> None:
        """Atomically, so a reader never sees half a report."""
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(json.dumps(self.to_dict(), indent=1))
        partial.replace(target)
