"""Time every aten op of real training iterations, with the same op features the tracer records.

Each op is timed where it really runs (inside an iteration: real cache state, real arguments). CUDA
ops are timed with events on the stream, read after one synchronisation at the iteration's end, so
timing does not serialise the host.

The model predicts an op's latency on an otherwise idle device, but this machine is shared: other
processes preempt ours, and a preemption lands inside whichever op or iteration is running. So on a
CPU with one torch thread, time is the process's CPU clock (user + system time of this process: time
spent descheduled is not counted), and every estimate is robust: repeats are interleaved, and a
repeat more than OUTLIER_TOLERANCE above the fastest is an outlier (neighbours only ever add time);
the estimate is the median of the repeats near the fastest, and whole iterations are re-measured
until at least two agree.
An op too cheap for one clock reading (under BATCH_BELOW) is timed as a batch of repeats right where
it ran (batched_seconds).
"""

from __future__ import annotations

import functools
import gc
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tensile.latency.prior import FRESH_ALLOCATION_BYTES, Roofline
from tensile.tracer import Recorder, TrainingStep, written_values
from tensile.workload import Op


OUTLIER_TOLERANCE = 0.15  # a repeat this much slower than the fastest was disturbed by the neighbours
AGREE = 2  # whole iterations are re-measured until this many repeats agree with the fastest
MAX_EXTRA_REPEATS = 2  # ... but at most this many extra (a zoo iteration takes seconds)
# A CPU op faster than BATCH_BELOW is at the clock's noise (a view takes 1-3 us, a clock read ~0.5 us):
# it is run again BATCH_TARGET / its time times (at most MAX_BATCH) right where it ran, and the batch's
# mean is its sample.
BATCH_BELOW = 20e-6
BATCH_TARGET = 40e-6
MAX_BATCH = 32


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a new (spawned) process, as a user's job runs: one process's history (glibc's trimmed
    arenas, heap fragmentation) changes what memory costs, so it must not leak into another measurement."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def uses_cpu_clock(device_type: str) -> bool:
    """CPU time equals idle wall time only for a single-threaded CPU run (threads would add up)."""
    return device_type == "cpu" and torch.get_num_threads() == 1


def host_clock(device_type: str) -> Callable[[], float]:
    """The clock timings are read from: process CPU time for a 1-thread CPU run, else wall time."""
    return time.process_time if uses_cpu_clock(device_type) else time.perf_counter


def load_average() -> float:
    """The machine's 1-minute load average (recorded with every measurement), 0 where unknown."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0


@dataclass
class HostLoad:
    """The machine's load around a benchmark's measurements, taken when made and again at `around()`: ratios of
    runs made one after another mean something only on a quiet machine, so each result file says how quiet."""

    before: float = field(default_factory=load_average)

    def around(self) -> dict[str, float | int | None]:
        return {"before": self.before, "after": load_average(), "cores": os.cpu_count()}

    @staticmethod
    def said(load: dict[str, float | int | None]) -> str:
        return f"load average (1 min): {load['before']:.2f} before, {load['after']:.2f} after, {load['cores']} cores"


def outliers(samples: Sequence[float], tolerance: float = OUTLIER_TOLERANCE) -> list[int]:
    """Indices of repeats more than `tolerance` above the fastest."""
    low = min(samples)
    return [i for i, s in enumerate(samples) if s > low * (1.0 + tolerance)]


def robust_seconds(samples: Sequence[float], tolerance: float = OUTLIER_TOLERANCE) -> float:
    """Median of the repeats within `tolerance` of the fastest: the time on an undisturbed device."""
    if not samples:
        raise ValueError("no timing samples")
    rejected = set(outliers(samples, tolerance))
    return statistics.median(s for i, s in enumerate(samples) if i not in rejected)


def settled(samples: Sequence[float], agree: int = AGREE, tolerance: float = OUTLIER_TOLERANCE) -> bool:
    """Enough repeats agree with the fastest (within tolerance) to trust it."""
    return bool(samples) and len(samples) - len(outliers(samples, tolerance)) >= agree


def repeat_until_settled(measure: Callable[[], float], repeats: int, max_extra: int = MAX_EXTRA_REPEATS) -> list[float]:
    """`repeats` samples of measure(), then more (at most max_extra) while they do not agree."""
    samples = [measure() for _ in range(repeats)]
    while samples and not settled(samples) and len(samples) < repeats + max_extra:
        samples.append(measure())
    return samples


def _scratch(value: Any) -> Any:
    """A copy of a written argument (a tensor or a list of them) for an op's repeats to write into."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_scratch(v) for v in value)
    return value


def scratch_arguments(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """args and kwargs with every value the op writes in place (`Tensor(a!)`) replaced by a copy: repeats
    read the same values the op really read, and the step's parameters, optimizer state and gradients are
    changed once, as in training."""
    if not written_values(func, args, kwargs):
        return args, kwargs
    copied, kwargs = list(args), dict(kwargs)
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if position < len(copied):
            copied[position] = _scratch(copied[position])
        elif argument.name in kwargs:
            kwargs[argument.name] = _scratch(kwargs[argument.name])
    return tuple(copied), kwargs


def batched_seconds(func: Any, args: tuple, kwargs: dict, first: float, clock: Callable[[], float]) -> float:
    """Seconds per call of an op that took `first` seconds, from one timed batch of repeats of it.

    Each repeat allocates its own output (the previous one is freed first, so glibc hands back a
    recently freed chunk, as it mostly does in training) and writes into scratch copies of what the op
    writes in place. The batch runs right after the op itself, in the same place of the
    iteration, so it sees the caches the op saw (warmed by the op's own first run)."""
    repeats = min(MAX_BATCH, max(2, math.ceil(BATCH_TARGET / max(first, 1e-7))))
    args, kwargs = scratch_arguments(func, args, kwargs)
    t0 = clock()
    for _ in range(repeats):
        func(*args, **kwargs)
    return (clock() - t0) / repeats


LEAD_SECONDS = 100e-6  # device time queued ahead of each timed op: longer than the host takes to launch one


@functools.cache
def sleep_cycles_per_second(device: int) -> float:
    """The clock `torch.cuda._sleep` counts (the device's SM clock), timed once per device: a sleep of known
    cycles between two events, queued behind another sleep so that the device reaches the pair only once the host
    has queued all of it."""
    cycles = 20_000_000  # about 10 ms on current GPUs: the host's few microseconds between the calls are lost in it
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles // 10)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1e3)


class CudaOpTimer:
    """Kernel time of each op on the current stream: an event pair around it, all read after one
    synchronisation (host clocks would time the asynchronous launch, not the kernel). A short sleep on the
    device (LEAD_SECONDS) is queued ahead of each pair: without it a device faster than the host (small
    kernels; a dispatch mode that records every op) runs the start event at once and then waits for the
    launch, so the pair measured the host's launch and the recorder's work, not the kernel (the recorded
    iterations' sums in calibration ran 2-5x a plain iteration on an H100). The sleeps add device time to the
    timed iterations alone (the hook's recorded one, its sampled ones, calibration's), which their recording host
    slows anyway. The lead must outlast the host's work between a pair's two events (the op's launch): a pair
    whose launch takes longer still times the host."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Any, Any]] = []
        self.lead_cycles = 0  # set at the first op: the clock is timed on the device the ops run on

    def start(self) -> Any:
        if not self.lead_cycles:
            self.lead_cycles = max(1, round(LEAD_SECONDS * sleep_cycles_per_second(torch.cuda.current_device())))
        torch.cuda._sleep(self.lead_cycles)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, start: Any) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pairs.append((start, end))

    def seconds(self) -> list[float]:
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in self.pairs]
        self.pairs = []
        return times


class TimingRecorder(Recorder):
    """The tracer's recorder, plus the time each op's kernel(s) took (CPU ops under BATCH_BELOW: the mean
    of a batch of repeats, see batched_seconds)."""

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type, device_type)
        self.cuda = device_type == "cuda"
        self.clock = host_clock(device_type)
        self.times: list[float] = []
        self._timer = CudaOpTimer()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "profiler":
            return func(*args, **kwargs)
        if self.cuda:
            start = self._timer.start()
            out = func(*args, **kwargs)
            self._timer.stop(start)
        else:
            t0 = self.clock()
            out = func(*args, **kwargs)
            seconds = self.clock() - t0
            if seconds < BATCH_BELOW:
                seconds = batched_seconds(func, args, kwargs, seconds, self.clock)
            self.times.append(seconds)
        self.record(func, args, kwargs, out)
        return out

    def finish(self) -> list[float]:
        """Seconds per recorded op (synchronises CUDA once)."""
        if self.cuda:
            self.times = self._timer.seconds()
        return self.times


def synchronize(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def time_plain_iteration(step: TrainingStep, device_type: str) -> tuple[float, dict[str, float]]:
    """Time of one iteration with nothing watching (what a job really pays), and of each phase
    (host_clock: CPU time of a 1-thread CPU run, else wall time)."""
    clock = host_clock(device_type)
    step.zero_grad()
    marks: list[tuple[str, float]] = []

    def mark(phase: str) -> None:
        synchronize(device_type)
        marks.append((phase, clock()))

    step.phase_listener = mark
    synchronize(device_type)
    t0 = clock()
    try:
        step.run()
        synchronize(device_type)
    finally:
        step.phase_listener = None
    end = clock()
    phases: dict[str, float] = {}
    for (phase, start), (_, stop) in zip(marks, [*marks[1:], ("end", end)]):
        phases[phase] = phases.get(phase, 0.0) + stop - start
    return end - t0, phases


@dataclass(slots=True)
class StepTiming:
    ops: list[Op]  # features of every op of one iteration
    seconds: list[float]  # robust latency of each op (robust_seconds over the timed iterations)
    iteration_seconds: float  # robust plain iteration
    utilization: float
    phase_seconds: dict[str, float]  # robust plain time of each phase (forward includes the loss)
    load_average: float = 0.0  # the machine's 1-minute load when this was measured
    clock: str = "wall"  # "cpu" (process CPU time) or "wall"


def measure_step(step: TrainingStep, device_type: str, timed: int = 3, plain: int = 2, warmup: int = 1,
                 utilization: float = 0.0) -> StepTiming:
    """Warm up, then alternate bare iterations (`plain` of them, more while they disagree) with op-by-op
    timed ones (`timed`); robust estimates of both. Alternating keeps a shared machine's load drift out
    of the bare-minus-ops difference the host gaps are fitted from."""
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
        collecting = gc.isenabled()
        gc.disable()  # the recorder's own objects would trigger collections inside whichever op allocates next
        try:
            with recorder:
                step.run()
        finally:
            step.phase_listener = None
            if collecting:
                gc.enable()
        recorder.stop()
        seconds = recorder.finish()
        if ops and [op.name for op in recorder.ops] != [op.name for op in ops]:
            continue  # the op sequence changed (data-dependent control flow): keep the first
        ops = ops or recorder.ops
        runs.append(seconds)
    while plain_runs and not settled([t for t, _ in plain_runs]) and len(plain_runs) < plain + MAX_EXTRA_REPEATS:
        plain_runs.append(time_plain_iteration(step, device_type))
    step.zero_grad()
    plain_times = [total for total, _ in plain_runs]
    estimates = [robust_seconds(values) for values in zip(*runs)]
    phases = {phase: robust_seconds([run[phase] for _, run in plain_runs if phase in run])
              for phase in {p for _, run in plain_runs for p in run}}
    return StepTiming(ops, estimates, robust_seconds(plain_times) if plain_times else sum(estimates), utilization,
                      phases, load_average(), "cpu" if uses_cpu_clock(device_type) else "wall")


def median_time(fn: Any, device_type: str, repeats: int) -> float:
    """Seconds `fn` takes on the device after a warm-up (CUDA: between events), robust over `repeats`."""
    fn()
    synchronize(device_type)
    clock = host_clock(device_type)
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
            t0 = clock()
            fn()
            times.append(clock() - t0)
    return robust_seconds(times)


def measure_roofline(device_type: str, quick: bool = False) -> Roofline:
    """FLOP/s of a large matmul, bytes/s of a large copy, seconds of a tiny op and, on a CPU, bytes/s of
    first-touching fresh pages (filling a new tensor minus filling an existing one): the prior's figures."""
    n = 512 if quick else (1024 if device_type == "cpu" else 8192)
    a = torch.randn(n, n, device=device_type)
    b = torch.randn(n, n, device=device_type)
    repeats = 3 if quick else 7
    flops = 2.0 * n**3 / median_time(lambda: torch.mm(a, b), device_type, repeats)
    elements = (4 if quick else 16) * 1024**2 if device_type == "cpu" else 256 * 1024**2
    src = torch.randn(elements, device=device_type)
    dst = torch.empty_like(src)
    bandwidth = 2.0 * src.numel() * 4 / median_time(lambda: dst.copy_(src), device_type, repeats)
    x = torch.ones(1, device=device_type)
    tiny = median_time(lambda: torch.add(x, x), device_type, 50 if quick else 200)
    fault = 0.0
    if device_type == "cpu":
        big = torch.empty(max(FRESH_ALLOCATION_BYTES // 2, src.numel()))  # above the mmap threshold
        extra = (median_time(lambda: torch.empty_like(big).fill_(1.0), device_type, repeats)
                 - median_time(lambda: big.fill_(1.0), device_type, repeats))
        fault = big.numel() * 4 / extra if extra > 0 else 0.0
    return Roofline(flops, bandwidth, tiny, fault_bytes_per_second=fault)
