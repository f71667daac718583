"""Op latencies measured in sampling iterations, for the node agent's drift rule (TENSILE IV-E).

With a node agent, the first iteration after the match (under its plan, on the dispatch path anyway) and then one in
every `TENSILE_LATENCY_SAMPLE_EVERY` run on the dispatch path (a native one is moved there at the step before it; one
on the dispatch path anyway costs nothing more) and each of their ops is timed:
on the CPU device by the host clock around the op, as the recorded iteration is; on CUDA by an event pair per op, read
after the iteration's end with one synchronisation per sampled iteration, never one per op (the host clock times the
launch, not the kernel). An op is timed only while the iteration keeps to the live workload's op names, so each index
names the op the agent holds at that index (the link posts them only for the workload the agent plans with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensile.latency.measure import CudaOpTimer
from tensile.workload import Workload


@dataclass(frozen=True)
class OpSamples:
    """One iteration's measured op latencies: `seconds[i]` of op `indices[i]` of the live workload of `signature`. Two
    flat lists: the [index, seconds] pairs the contract posts are made in the link's thread, not the training one."""

    signature: str
    iteration: int
    indices: list[int]
    seconds: list[float]


class OpSampler:
    """Which iterations are sampled, and the timing of their ops."""

    def __init__(self, device_type: str, every: int) -> None:
        self.every = every  # 0: never
        self.timer = CudaOpTimer() if device_type == "cuda" else None
        # the iteration sampled last; none yet: the first iteration after the match (under its plan, on the dispatch path
        # anyway) is sampled, which corrects the agent's cold-start latencies at no cost
        self.last: int | None = None
        self.begun = False  # this iteration is sampled
        self.iteration = 0
        self.named: Workload | None = None  # the workload `names` lists the ops of, and `signature` names
        self.names: list[str] = []
        self.signature = ""  # computed once per workload: a Workload hashes all its ops for it
        self.on = False  # timing this iteration's ops (off once it leaves the workload's ops)
        self.indices: list[int] = []
        self.seconds: list[float] = []  # host clock (the CPU device); CUDA's come from the timer

    def due(self, iteration: int) -> bool:
        return self.every > 0 and (self.last is None or iteration - self.last >= self.every)

    def begin(self, iteration: int, live: Workload) -> None:
        if live is not self.named:
            self.named, self.names, self.signature = live, [op.name for op in live.ops], live.signature
        self.last = self.iteration = iteration
        self.begun = self.on = True

    def start(self, index: int, name: str) -> Any:
        """Before op `index`: its start event on CUDA, True on the CPU device; None where the op is not the workload's
        op `index` (the iteration diverged: the ops before it keep their samples, none after)."""
        if index >= len(self.names) or self.names[index] != name:
            self.on = False
            return None
        return self.timer.start() if self.timer is not None else True

    def stop(self, index: int, started: Any, host_seconds: float) -> None:
        if self.timer is not None:
            self.timer.stop(started)
        else:
            self.seconds.append(host_seconds)
        self.indices.append(index)

    def end(self) -> OpSamples | None:
        """At the iteration's end, after its copies settled: its samples, or None (not sampled, or no op timed)."""
        begun, self.begun, self.on = self.begun, False, False
        indices, seconds, self.indices, self.seconds = self.indices, self.seconds, [], []
        if not begun or not indices:
            return None
        if self.timer is not None:
            seconds = self.timer.seconds()  # the one synchronisation
        return OpSamples(self.signature, self.iteration, indices, seconds)
