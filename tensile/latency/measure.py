"""Time every aten op of real training iterations, with the same op features the tracer records.

Each op is timed where it really runs (inside an iteration: real cache state, real arguments), and
an op's latency is the median over a few iterations. CUDA ops are timed with events on the stream,
read after one synchronisation at the iteration's end, so timing does not serialise the host.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from tensile.tracer import Recorder, TrainingStep
from tensile.workload import Op


class TimingRecorder(Recorder):
    """The tracer's recorder, plus the time each op's kernel(s) took."""

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type, device_type)
        self.cuda = device_type == "cuda"
        self.times: list[float] = []
        self._events: list[tuple[Any, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "profiler":
            return func(*args, **kwargs)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = func(*args, **kwargs)
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            self.times.append(time.perf_counter() - t0)
        self.record(func, args, kwargs, out)
        return out

    def finish(self) -> list[float]:
        """Seconds per recorded op (synchronises CUDA once)."""
        if self.cuda:
            torch.cuda.synchronize()
            self.times = [start.elapsed_time(end) / 1e3 for start, end in self._events]
            self._events = []
        return self.times


def synchronize(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def time_plain_iteration(step: TrainingStep, device_type: str) -> tuple[float, dict[str, float]]:
    """Wall time of one iteration with nothing watching (what a job really pays), and of each phase."""
    step.zero_grad()
    marks: list[tuple[str, float]] = []

    def mark(phase: str) -> None:
        synchronize(device_type)
        marks.append((phase, time.perf_counter()))

    step.phase_listener = mark
    synchronize(device_type)
    t0 = time.perf_counter()
    try:
        step.run()
        synchronize(device_type)
    finally:
        step.phase_listener = None
    end = time.perf_counter()
    phases: dict[str, float] = {}
    for (phase, start), (_, stop) in zip(marks, [*marks[1:], ("end", end)]):
        phases[phase] = phases.get(phase, 0.0) + stop - start
    return end - t0, phases


@dataclass(slots=True)
class StepTiming:
    ops: list[Op]  # features of every op of one iteration
    seconds: list[float]  # median latency of each op
    iteration_seconds: float  # median plain iteration
    utilization: float
    phase_seconds: dict[str, float]  # median plain time of each phase (forward includes the loss)


def measure_step(step: TrainingStep, device_type: str, timed: int = 3, plain: int = 2, warmup: int = 1,
                 utilization: float = 0.0) -> StepTiming:
    """Warm up, then alternate bare iterations (`plain` of them) with op-by-op timed ones (`timed`);
    medians of both. Alternating keeps a shared machine's load drift out of the bare-minus-ops
    difference the host gaps are fitted from."""
    for _ in range(warmup):
        time_plain_iteration(step, device_type)
    plain_runs: list[tuple[float, dict[str, float]]] = []
    runs: list[list[float]] = []
    ops: list[Op] = []
    for i in range(max(timed, plain)):
        if i < plain:
            plain_runs.append(time_plain_iteration(step, device_type))
        if i >= timed:
            continue
        step.zero_grad()
        recorder = TimingRecorder(device_type)
        step.phase_listener = lambda phase, recorder=recorder: setattr(recorder, "phase", phase)
        synchronize(device_type)
        try:
            with recorder:
                step.run()
        finally:
            step.phase_listener = None
        recorder.stop()
        seconds = recorder.finish()
        if ops and [op.name for op in recorder.ops] != [op.name for op in ops]:
            continue  # the op sequence changed (data-dependent control flow): keep the first
        ops = ops or recorder.ops
        runs.append(seconds)
    step.zero_grad()
    plain_times = [total for total, _ in plain_runs]
    medians = [statistics.median(values) for values in zip(*runs)]
    phases = {phase: statistics.median(run[phase] for _, run in plain_runs if phase in run)
              for phase in {p for _, run in plain_runs for p in run}}
    return StepTiming(ops, medians, statistics.median(plain_times) if plain_times else sum(medians), utilization, phases)


def _median_time(fn: Any, device_type: str, repeats: int) -> float:
    fn()
    synchronize(device_type)
    times = []
    for _ in range(repeats):
        if device_type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_roofline(device_type: str, quick: bool = False) -> tuple[float, float, float]:
    """(FLOP/s of a large matmul, bytes/s of a large copy, seconds of a tiny op): the prior's figures."""
    n = 512 if quick else (1024 if device_type == "cpu" else 8192)
    a = torch.randn(n, n, device=device_type)
    b = torch.randn(n, n, device=device_type)
    repeats = 3 if quick else 7
    flops = 2.0 * n**3 / _median_time(lambda: torch.mm(a, b), device_type, repeats)
    elements = (4 if quick else 16) * 1024**2 if device_type == "cpu" else 256 * 1024**2
    src = torch.randn(elements, device=device_type)
    dst = torch.empty_like(src)
    bandwidth = 2.0 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), device_type, repeats)
    x = torch.ones(1, device=device_type)
    tiny = _median_time(lambda: torch.add(x, x), device_type, 50 if quick else 200)
    return flops, bandwidth, tiny
