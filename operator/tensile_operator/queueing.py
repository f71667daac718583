"""The queue's order and who may pass whom: PriorityClass values and the queueing strategy (Kueue's names).

Order: the value of the PriorityClass (scheduling.k8s.io/v1) the job's pod template names
(`spec.template.spec.priorityClassName`; unset: the class with `globalDefault: true`, else 0), highest first,
then creation, then namespace/name. A higher priority never stops a running job: Tensile never kills training by
its own decision (the pod keeps its priorityClassName, which Kubernetes' own eviction order reads).

Passing is decided per GPU. A waiting job *holds* the GPUs it could use (matching its selector and large enough
to hold it alone): no job after it in the queue is placed there. `StrictFIFO`: every waiting job holds, so nothing
passes an earlier job, whatever its priority (as Kueue's StrictFIFO: older workloads that cannot be admitted block
newer ones). `BestEffortFIFO`: later jobs that fit pass a waiting one, until the head of the queue (a waiting job
no earlier waiting job contends with for a GPU) has been the head for longer than `hold_head_after`: then it holds,
so it cannot starve while small jobs keep arriving. A job that fits no GPU even alone holds nothing (only a larger
GPU joining can place it: it must not stop the cluster).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tensile import trainingjob_spec as model
from tensile.agent_contract import TIMESTAMP_FORMAT
from tensile.errors import TensileUserError
from tensile_operator.forecasting import JobForecast

BEST_EFFORT, STRICT = "BestEffortFIFO", "StrictFIFO"
STRATEGIES = (BEST_EFFORT, STRICT)
STRATEGY_ENV = "TENSILE_QUEUEING_STRATEGY"
HOLD_ENV = "TENSILE_QUEUE_HOLD_HEAD_AFTER"
DEFAULT_HOLD = "30m"
NEVER = "never"
# Go-style durations without zero parts ("30m", "1h30m", "90s"), or "never": the chart's values.schema.json holds the
# same pattern (tests/operator/test_queueing.py checks they agree)
_PART = "[1-9][0-9]*"
DURATION = f"^({NEVER}|{_PART}h({_PART}m)?({_PART}s)?|{_PART}m({_PART}s)?|{_PART}s)$"
_UNITS = {"h": 3600, "m": 60, "s": 1}


@dataclass(frozen=True)
class QueueConfig:
    """The queueing strategy and BestEffortFIFO's bound (seconds at the head; None: never held, a head may starve)."""

    strategy: str = BEST_EFFORT
    hold_head_after: float | None = 1800.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> QueueConfig:
        """From $TENSILE_QUEUEING_STRATEGY and $TENSILE_QUEUE_HOLD_HEAD_AFTER (the chart's `operator.queueing`); a bad
        value stops the operator before it starts, naming the value and the fix."""
        strategy = env.get(STRATEGY_ENV) or BEST_EFFORT
        if strategy not in STRATEGIES:
            raise TensileUserError(f"{STRATEGY_ENV}={strategy!r}: set {BEST_EFFORT} (later jobs that fit pass a waiting "
                                   f"one) or {STRICT} (nothing passes an earlier waiting job); chart value "
                                   "operator.queueing.strategy")
        return cls(strategy, parse_hold(env.get(HOLD_ENV) or DEFAULT_HOLD, HOLD_ENV))

    def rule(self) -> str:
        """Why a waiting job holds its GPUs, for its status."""
        if self.strategy == STRICT:
            return "queueing strategy StrictFIFO"
        return f"at the head of the queue for longer than {duration_text(self.hold_head_after)}, BestEffortFIFO"


def parse_hold(text: str, source: str) -> float | None:
    """Seconds from a duration such as "30m", "1h30m" or "90s"; None for "never"."""
    if not re.fullmatch(DURATION, text):
        raise TensileUserError(f"{source}={text!r}: write a duration such as 30m, 1h30m or 90s (no zero parts), or "
                               f"{NEVER} to let later jobs pass a waiting one for ever; chart value "
                               "operator.queueing.holdHeadAfter")
    if text == NEVER:
        return None
    return float(sum(int(n) * _UNITS[unit] for n, unit in re.findall(r"(\d+)([hms])", text)))


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return NEVER
    whole = int(seconds)
    parts = [(whole // 3600, "h"), (whole % 3600 // 60, "m"), (whole % 60, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n)


def epoch(stamp: str) -> float:
    """A status timestamp (whole seconds, UTC) as seconds since the epoch."""
    return datetime.datetime.strptime(stamp, TIMESTAMP_FORMAT).replace(tzinfo=datetime.UTC).timestamp()


def stamp(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime(TIMESTAMP_FORMAT)


@dataclass(frozen=True)
class Priority:
    """A job's place among priorities: the PriorityClass value, the class it came from ("" when none applies), and
    whether that class exists (a name no PriorityClass has: Kubernetes would refuse the pod)."""

    value: int = 0
    class_name: str = ""
    known: bool = True


class Priorities:
    """PriorityClass values by name: listed once at start-up (so the first pass orders by them), then kept by Kopf's
    watch. No GET per pass: the scheduler reads this cache."""

    def __init__(self) -> None:
        self._classes: dict[str, tuple[int, bool]] = {}  # name -> (value, globalDefault)

    def changed(self, name: str, body: dict | None) -> None:
        """A PriorityClass listed, created or updated (`body`), or deleted (None)."""
        if body is None:
            self._classes.pop(name, None)
        else:
            self._classes[name] = (int(body.get("value") or 0), bool(body.get("globalDefault")))

    def of(self, spec: Mapping) -> Priority:
        """The priority of a TrainingJob's `spec`, as Kubernetes' Priority admission gives its pod."""
        name = str(((spec.get("template") or {}).get("spec") or {}).get("priorityClassName") or "")
        if name:
            known = self._classes.get(name)
            return Priority(known[0], name) if known else Priority(0, name, known=False)
        defaults = sorted(((value, n) for n, (value, default) in self._classes.items() if default), reverse=True)
        return Priority(*defaults[0]) if defaults else Priority()

    def warnings(self, spec: Mapping) -> list[str]:
        """The webhook's warning (kubectl prints it) for a priorityClassName no PriorityClass has."""
        priority = self.of(spec)
        return [] if priority.known else [missing_class_message(priority.class_name)]


def missing_class_message(name: str) -> str:
    return (f"spec.template.spec.priorityClassName: no PriorityClass '{name}' exists, and Kubernetes would refuse the "
            f"pod: create it (kubectl create priorityclass {name} --value=N) or fix the name; the job waits queued, "
            "unplaced, until it exists")


@dataclass(frozen=True)
class Wait:
    """How a job that cannot be placed now waits: at the head of the queue (since when), and whether it holds."""

    head_since: str  # "" when it is not a head
    holds: tuple[str, ...]  # the GPUs held for it (uuids); () when it holds none


@dataclass
class Walk:
    """One scheduler pass over the queue, in order: which GPUs are held for which earlier waiting job."""

    config: QueueConfig
    now: float
    held: dict[str, str] = field(default_factory=dict)  # GPU uuid -> the first job it is held for
    contended: set[str] = field(default_factory=set)  # GPUs an earlier waiting job could use
    next_hold: float | None = None  # when a head not holding yet will hold: the scheduler passes again then

    def free(self, uuids: Sequence[str]) -> list[str]:
        return [u for u in uuids if u not in self.held]

    def holders(self, uuids: Sequence[str]) -> list[str]:
        """The earlier jobs GPU room among `uuids` is held for."""
        return sorted({self.held[u] for u in uuids if u in self.held})

    def waiting(self, job: str, usable: Sequence[str], head_since: str) -> Wait:
        """`job` waits; `usable`: the GPUs it could use (matching, large enough alone); `head_since`: when it became
        the head, as its status last said. A head keeps its clock; a job that is not the head loses it."""
        head = bool(usable) and not self.contended.intersection(usable)
        self.contended.update(usable)
        if not head:
            return Wait("", self._hold(job, usable) if self.config.strategy == STRICT else ())
        head_since = head_since or stamp(self.now)
        bound = self.config.hold_head_after
        if self.config.strategy == STRICT or (bound is not None and self.now - epoch(head_since) >= bound):
            return Wait(head_since, self._hold(job, usable))
        if bound is not None:
            due = epoch(head_since) + bound
            self.next_hold = due if self.next_hold is None else min(self.next_hold, due)
        return Wait(head_since, ())

    def _hold(self, job: str, usable: Sequence[str]) -> tuple[str, ...]:
        for uuid in usable:
            self.held.setdefault(uuid, job)
        return tuple(u for u in usable if self.held[u] == job)


@dataclass
class Pending:
    """A job admitted (validated and forecast) and waiting for its placement."""

    key: str
    namespace: str
    name: str
    body: dict
    spec: model.JobSpec
    forecast: JobForecast | None
    said: dict | None = None  # the `status.queue` last written for the job (written again only when it changes)
    since: str = ""  # when the job first waited (`status.queue.since`, read back after a restart)
    head_since: str = ""  # when it became the head of the queue (`status.queue.headSince`, read back after a restart)

    def order(self, priority: Priority) -> tuple[int, str, str]:
        """The queue's order: by priority (highest first), then FIFO by the job's creation
        (`metadata.creationTimestamp`, whole seconds), ties by namespace/name. By the loop time its forecast and
        `Queued` write ended (as it was), jobs created in order were placed out of it, and a restarted operator's
        queue followed which forecast was cached."""
        return -priority.value, self.body["metadata"].get("creationTimestamp", ""), self.key


class JobQueue:
    """The jobs waiting for a placement, by key, and the scheduler's wake-up: whatever may let a waiting job be placed
    (a job queued or changed, room freed, a GPU or a PriorityClass changed) pokes it, and the next pass runs."""

    def __init__(self) -> None:
        self.pending: dict[str, Pending] = {}
        self._poked = asyncio.Event()
        # set only while the scheduler waits for a poke and none has come: every pass poked for has ended
        self._idle = asyncio.Event()

    def poke(self) -> None:
        self._idle.clear()
        self._poked.set()

    async def next_poke(self) -> None:
        """The scheduler's wait between passes: returns at the next poke (at once if one came during the pass)."""
        if not self._poked.is_set():
            self._idle.set()
        await self._poked.wait()
        self._poked.clear()

    async def idle(self) -> None:
        """Returns once the scheduler has ended every pass it was poked for and waits for the next poke: its bookings
        and status writes are done (pods are made off the pass). A failed pass is retried first; a head's wait bound
        yet to end pokes later."""
        await self._idle.wait()
