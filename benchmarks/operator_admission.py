"""Admission latency of the operator with a warm forecast cache: TrainingJob created -> status Admitted.

Kopf runs the real operator against the Kubernetes emulator of tests/ (one process, loopback HTTP; the
operator in a thread with its own event loop, as tests/support/operator_harness.py runs it; GPUs published
by TensileNodes, the `legacy` access mode). Jobs of three zoo models (their forecasts traced once before
timing) are created one every `--interval` seconds onto 2 nodes x 2 simulated GPUs large enough to hold
them all at their vanilla peaks, so every admission takes the fit test's shortcut and the joint planner
never runs. Latency is measured on one clock: from just before the create request to the moment the
operator's status write with the placement returned. The machine may be shared: the 1-minute load
average before and after the run is recorded with the figures.

    python benchmarks/operator_admission.py [--jobs 120] [--interval 0.02]

`--scenario tight` sizes the GPUs so that most jobs fit only when the joint planner cuts their peaks: five
workloads whose plans can cut them (ResNet-50, DenseNet-121, BERT-base and Inception-V3 at batch 16, ResNet-50
at 32) onto 4 nodes x 4 simulated 4 GiB GPUs, more jobs than the GPUs hold even planned together. Once no GPU
holds the newcomer at its vanilla peak with every committed peak unchanged, an admission plans the jobs of one
candidate GPU after another together with it, tightest first, up to the first where a joint plan fits
(`placement.choose`, on a worker thread, one job at a time), and the jobs the cluster cannot hold wait. How much the
plans cut the admitted jobs' vanilla peaks (`peak_cut`) is what placement costs them. The operator's planner is timed
per call (`TimedPlanner`), and the lateness of a 10 ms tick on the operator's event loop (`LoopLag`) shows whether
the planning thread stalls it. It prints a table and writes `operator_admission_tight.json`:

    python benchmarks/operator_admission.py --scenario tight [--jobs 60]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import platform
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench_results import results_dir
from tensile.latency.measure import HostLoad
from tensile.trainingjob_spec import parse_spec
from tensile_operator.claims import LEGACY, GpuAccess
from tensile_operator.forecasting import Forecaster, JobForecast
from tensile_operator.placement import JointPlanner
from tests.support.operator_harness import Cluster, cluster, fake_kubelet, simulated_gpu, start_operator, trainingjob

MODELS = [("vgg16", 1), ("gpt2", 1), ("bert_base", 1)]


@dataclass(frozen=True)
class Scenario:
    """What is admitted onto what. `joint`: the GPUs cannot hold the jobs at their vanilla peaks, so admissions run
    the joint planner and some jobs wait; its run reports the planner's calls, the waits and the loop's lateness."""

    name: str
    models: tuple[tuple[str, int], ...]
    gpu_gib: float
    jobs: int
    out: str
    nodes: int = 2
    gpus_per_node: int = 2
    joint: bool = False


SCENARIOS = {
    "fit": Scenario("fit", tuple(MODELS), 80.0, 120, "operator_admission.json"),
    # vanilla peaks 1.60, 2.04, 3.43, 1.76 and 2.88 GiB, lowest reachable 0.81, 0.95, 2.93, 0.95 and 1.24 GiB: a 4 GiB
    # GPU holds one or two of them at their vanilla peaks, up to four planned together
    "tight": Scenario("tight", (("resnet50", 16), ("densenet121", 16), ("bert_base", 16), ("inception_v3", 16),
                                ("resnet50", 32)), 4.0, 60, "operator_admission_tight.json", nodes=4, gpus_per_node=4,
                      joint=True),
}


class GcPauses:
    """Full (generation 2) garbage collections while timing: CPython stops every thread for them."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds.append(time.perf_counter() - self._started)

    def summary(self) -> dict:
        return {"count": len(self.seconds), "max_seconds": round(max(self.seconds, default=0.0), 4),
                "total_seconds": round(sum(self.seconds), 4)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


@dataclass(frozen=True)
class PlannerCall:
    began: float  # time.monotonic(), the clock of both event loops
    seconds: float
    miss: bool  # planned (not a cached joint plan)
    jobs: tuple[str, ...]  # the GPU's jobs and the one being placed

    def placing(self, admitted_at: dict[str, float]) -> str:
        """The job being placed: the one not admitted before the call (the scheduler places one job at a time)."""
        (job,) = [j for j in self.jobs if admitted_at.get(j, float("inf")) > self.began]
        return job


class TimedPlanner(JointPlanner):
    """The operator's joint planner, every call timed (cached joint plans too; wall time on the scheduler's worker
    thread, GIL waits included). `placement.evaluate` calls it only when neither shortcut decides, so the jobs it
    is called for are the admissions that planned jointly."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[PlannerCall] = []

    def plan(self, entries: list[tuple[str, JobForecast, float | None, int | None]], budget: int,
             bandwidth: float) -> tuple[bool, dict[str, int]]:
        began, runs = time.monotonic(), self.runs
        result = super().plan(entries, budget, bandwidth)
        self.calls.append(PlannerCall(began, time.monotonic() - began, self.runs > runs, tuple(e[0] for e in entries)))
        return result


class LoopLag:
    """How late a 10 ms tick runs on an event loop (the operator's, in its thread): for that long the loop ran
    nothing else, so every admission in flight waited as long."""

    PERIOD = 0.01

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.late: list[float] = []
        self._due = 0.0
        self._stopped = threading.Event()

    def start(self) -> None:
        self.loop.call_soon_threadsafe(self._tick)

    def stop(self) -> None:
        self._stopped.set()

    def _tick(self) -> None:
        now = self.loop.time()
        if self._due:
            self.late.append(max(0.0, now - self._due))
        if not self._stopped.is_set():
            self._due = now + self.PERIOD
            self.loop.call_later(self.PERIOD, self._tick)

    def summary(self) -> dict:
        stalls = [s for s in list(self.late) if s > 0.1]
        return {"ticks": len(self.late), "p99_seconds": round(percentile(self.late, 0.99), 4) if self.late else 0.0,
                "max_seconds": round(max(self.late, default=0.0), 4), "over_100ms": len(stalls),
                "over_100ms_total_seconds": round(sum(stalls), 3)}


def latency_figures(latencies: list[float], quantiles: tuple[float, ...] = (0.90, 0.99)) -> dict:
    if not latencies:
        return {}
    return {"p50": round(statistics.median(latencies), 4)} | {
        f"p{round(q * 100)}": round(percentile(latencies, q), 4) for q in quantiles} | {
        "max": round(max(latencies), 4), "mean": round(statistics.fmean(latencies), 4)}


def spread(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    return {"count": len(values), "p50": round(statistics.median(values), 4), "max": round(max(values), 4),
            "total": round(sum(values), 3)}


def settled(c: Cluster, admitted_at: dict[str, float], created: dict[str, float]) -> bool:
    """Every job admitted, or told by the scheduler why it waits (`status.queue`; phase Queued alone is also a job
    not placed yet): jobs never end here, so no room frees for one later."""
    return all(k in admitted_at or ((c.job(k.split("/", 1)[1]) or {}).get("status") or {}).get("queue")
               for k in created)


def planned_admission(job: str, calls: list[PlannerCall], created: float, admitted: float, first: float) -> dict:
    """One admission that planned, in seconds from the first job's creation: the time from its creation to the
    planner's first call for it is the scheduler busy with earlier jobs."""
    return {"job": job.split("/", 1)[1], "created": round(created, 3),
            "first_call": round(min(call.began for call in calls) - first, 3), "planner_calls": len(calls),
            "planner_misses": sum(call.miss for call in calls),
            "planner_seconds": round(sum(call.seconds for call in calls), 3), "admitted": round(admitted, 3)}


def joint_figures(c: Cluster, planner: TimedPlanner, admitted_at: dict[str, float], created: dict[str, float],
                  queued_decisions: float) -> dict:
    """Which admissions planned and which took a shortcut (from the planner's calls), the planner's time, the jobs
    that waited, and the peaks the statuses hold at the end (the operator's record of the cuts)."""
    per_job: dict[str, list[PlannerCall]] = {}
    for call in planner.calls:
        per_job.setdefault(call.placing(admitted_at), []).append(call)
    admitted = [k for k in created if k in admitted_at]
    waited = [k for k in created if k not in admitted_at]
    statuses = {k: (c.job(k.split("/", 1)[1]) or {}).get("status") or {} for k in created}
    cut = [k for k in admitted if statuses[k]["forecast"]["scheduledPeakBytes"] <
           statuses[k]["forecast"]["vanillaPeakBytes"]]
    # what the plans take off the admitted jobs' vanilla peaks: the memory they swap out or recompute, what placement
    # costs the jobs
    shares = [1 - statuses[k]["forecast"]["scheduledPeakBytes"] / statuses[k]["forecast"]["vanillaPeakBytes"]
              for k in admitted]
    taken = sum(statuses[k]["forecast"]["vanillaPeakBytes"] - statuses[k]["forecast"]["scheduledPeakBytes"]
                for k in admitted)
    per_gpu: dict[str, int] = {}
    for k in admitted:
        gpu = statuses[k]["placement"]["gpu"]
        per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
    planned = [k for k in admitted if k in per_job]
    first = min(created.values())
    return {
        "admitted": len(admitted),
        "admitted_planned_jointly": len(planned),
        "admitted_by_shortcut": len(admitted) - len(planned),
        "waited": len(waited),
        "waited_after_planning": sum(1 for k in waited if k in per_job),
        "queued_decisions_metric": queued_decisions,
        "admitted_with_peak_below_vanilla": len(cut),
        "peak_cut": {"total_gib": round(taken / 2**30, 2), "share_mean": round(statistics.fmean(shares), 3) if shares
                     else 0.0, "share_max": round(max(shares, default=0.0), 3)},
        "jobs_per_gpu": dict(sorted(per_gpu.items())),
        "planner_calls": {
            "misses": spread([call.seconds for call in planner.calls if call.miss]),
            "cache_hits": spread([call.seconds for call in planner.calls if not call.miss]),
            "per_planned_admission_seconds": spread([sum(call.seconds for call in per_job[k]) for k in planned]),
        },
        "planned_admissions": [planned_admission(k, per_job[k], created[k] - first, admitted_at[k] - first, first)
                               for k in planned],
        "latency_seconds_planned": latency_figures([admitted_at[k] - created[k] for k in planned], (0.95, 0.99)),
        "latency_seconds_shortcut": latency_figures(
            [admitted_at[k] - created[k] for k in admitted if k not in per_job], (0.95, 0.99)),
    }


async def measure(scenario: Scenario, jobs: int, interval: float, gpu_gib: float) -> dict:
    forecaster = Forecaster()
    host_load = HostLoad()
    started = time.perf_counter()
    for model, batch in scenario.models:
        spec = parse_spec(trainingjob("warm-up", model, batch)["spec"])  # as the jobs below are forecast
        await forecaster.forecast(spec.workload, spec.scope)
    warmup = time.perf_counter() - started
    planner = TimedPlanner()
    joint: dict = {}
    async with cluster(Path(tempfile.mkdtemp())) as c:
        for node in [f"node-{chr(ord('a') + n)}" for n in range(scenario.nodes)]:
            gpus = [simulated_gpu(f"GPU-{node}-{i}", gpu_gib) for i in range(scenario.gpus_per_node)]
            await c.publish_node(node, gpus)
        kubelet = asyncio.create_task(fake_kubelet(c, lambda pod: 3600.0))  # jobs keep running: GPUs fill up
        # GPUs published by TensileNodes, placed by node name (`dra` mode would need ResourceSlices and claims)
        op = await start_operator(forecaster, planner=planner, access=GpuAccess(LEGACY))
        lag = None
        if scenario.joint:
            await c.wait(lambda: op.app.scheduler.task, 30, "the scheduler started")
            assert op.app.scheduler.task is not None
            lag = LoopLag(op.app.scheduler.task.get_loop())
            lag.start()
        loop = asyncio.get_running_loop()
        created: dict[str, float] = {}
        pauses = GcPauses()
        gc.callbacks.append(pauses)
        try:
            for i in range(jobs):
                name = f"bench-{i:04d}"
                created[f"default/{name}"] = loop.time()
                await c.apply(trainingjob(name, *scenario.models[i % len(scenario.models)]))
                await asyncio.sleep(interval)
            admitted_at = op.app.scheduler.admitted_at
            if scenario.joint:
                await c.wait(lambda: settled(c, admitted_at, created), 600, "every job admitted or queued")
            else:
                await c.wait(lambda: len(admitted_at) >= jobs, 120, "all admitted")
            latencies = [admitted_at[k] - created[k] for k in created if k in admitted_at]
            planner_runs = op.app.planner.runs
            if lag is not None:
                lag.stop()
                queued = op.app.metrics.registry.get_sample_value("tensile_admissions_total", {"result": "queued"})
                joint = {"scenario": scenario.name} | joint_figures(c, planner, admitted_at, created, queued or 0) | {
                    "operator_loop_lateness": lag.summary()}
        finally:
            gc.callbacks.remove(pauses)
            await op.stop()
            kubelet.cancel()
            await asyncio.gather(kubelet, return_exceptions=True)
            forecaster.close()
    result = {
        "benchmark": "operator_admission",
        "jobs": jobs,
        "interval_seconds": interval,
        "gpus": f"{scenario.nodes} nodes x {scenario.gpus_per_node} simulated GPUs",
        "gpu_memory_gib": gpu_gib,
        "models": [f"{m} b{b}" for m, b in scenario.models],
        "forecast_warmup_seconds": round(warmup, 3),
        "traces": forecaster.traces,
        "joint_planner_runs": planner_runs,
        "latency_seconds": latency_figures(latencies, (0.90, 0.95, 0.99) if scenario.joint else (0.90, 0.99)),
        "target_p99_seconds": 0.2,
        "full_gc_pauses": pauses.summary(),
        "load_average_1min": host_load.around(),
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
    }
    return result | joint


def quantiles_ms(figures: dict) -> str:
    return ", ".join(f"{q} {figures[q] * 1000:.0f} ms" for q in ("p50", "p95", "p99", "max") if q in figures) or "-"


def spread_text(figures: dict) -> str:
    if not figures["count"]:
        return "0"
    return (f"{figures['count']}: p50 {figures['p50'] * 1000:.1f} ms, max {figures['max'] * 1000:.1f} ms, "
            f"total {figures['total']:.2f} s")


def table(result: dict) -> str:
    """The figures of a joint-planning run, one a line."""
    lat, planned, calls = result["latency_seconds"], result["latency_seconds_planned"], result["planner_calls"]
    load, lateness, pauses = result["load_average_1min"], result["operator_loop_lateness"], result["full_gc_pauses"]
    rows = [
        ("jobs created", f"{result['jobs']} ({', '.join(result['models'])}), one every {result['interval_seconds']} s"),
        ("GPUs", f"{result['gpus']}, {result['gpu_memory_gib']} GiB each; jobs per GPU {result['jobs_per_gpu']}"),
        ("admitted", f"{result['admitted']}: {result['admitted_planned_jointly']} planned jointly, "
                     f"{result['admitted_by_shortcut']} by a shortcut; {result['admitted_with_peak_below_vanilla']} "
                     "hold a peak below their vanilla peak"),
        ("cut off vanilla peaks", f"{result['peak_cut']['total_gib']} GiB in all; per job "
                                  f"{result['peak_cut']['share_mean']:.1%} on average, "
                                  f"{result['peak_cut']['share_max']:.1%} at most"),
        ("waited (never admitted)", f"{result['waited']} ({result['waited_after_planning']} after planning); "
                                    f"queued decisions (metric): {result['queued_decisions_metric']:.0f}"),
        ("latency, all admitted", quantiles_ms(lat)),
        ("latency, planned jointly", quantiles_ms(planned)),
        ("latency, by a shortcut", quantiles_ms(result["latency_seconds_shortcut"])),
        ("planner calls, cache misses", spread_text(calls["misses"])),
        ("planner calls, cache hits", spread_text(calls["cache_hits"])),
        ("planner time per planned job", spread_text(calls["per_planned_admission_seconds"])),
        ("operator loop lateness", f"max {lateness['max_seconds'] * 1000:.0f} ms, "
                                   f"p99 {lateness['p99_seconds'] * 1000:.0f} ms, "
                                   f"{lateness['over_100ms']} ticks over 100 ms"),
        ("full GC pauses", f"{pauses['count']}, max {pauses['max_seconds'] * 1000:.0f} ms"),
        ("load average (1 min)", f"{load['before']} before, {load['after']} after, {load['cores']} cores (shared)"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="fit",
                        help="fit: every job fits at its vanilla peak (default); tight: jobs must be planned together")
    parser.add_argument("--jobs", type=int, help="default: 120 (fit), 60 (tight)")
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--gpu-gib", type=float, help="default: 80 (fit), 4 (tight)")
    parser.add_argument("--out", help="default: benchmarks/results/operator_admission.json (fit), "
                                      "operator_admission_tight.json (tight)")
    args = parser.parse_args()
    scenario = SCENARIOS[args.scenario]
    logging.basicConfig(level=logging.WARNING)
    result = asyncio.run(measure(scenario, args.jobs or scenario.jobs, args.interval, args.gpu_gib or scenario.gpu_gib))
    out = Path(args.out or results_dir() / scenario.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result) + f"\n(written to {out})" if scenario.joint else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
