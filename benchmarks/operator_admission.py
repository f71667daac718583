"""Admission latency of the operator with a warm forecast cache: TrainingJob created -> status Admitted.

Kopf runs the real operator against the Kubernetes emulator of tests/ (one process, loopback HTTP; the
operator in a thread with its own event loop, as tests/support/operator_harness.py runs it).
Jobs of three zoo models (their forecasts traced once before timing) are created one every
`--interval` seconds onto 2 nodes x 2 simulated GPUs large enough to hold them all, so each
admission includes the joint-plan fit test on every candidate GPU (the planner and its cache
included). Latency is measured on one clock: from just before the create request to the moment
the operator's status write with the placement returned. The machine may be shared: the 1-minute load
average before and after the run is recorded with the figures.

    python benchmarks/operator_admission.py [--jobs 120] [--interval 0.02]
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
import time
from pathlib import Path

from tensile.latency.measure import HostLoad
from tensile.trainingjob_spec import parse_spec
from tensile_operator.forecasting import Forecaster
from tests.support.operator_harness import cluster, fake_kubelet, simulated_gpu, start_operator, trainingjob

ROOT = Path(__file__).resolve().parents[1]
MODELS = [("vgg16", 1), ("gpt2", 1), ("bert_base", 1)]


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


async def measure(jobs: int, interval: float, gpu_gib: float) -> dict:
    forecaster = Forecaster()
    host_load = HostLoad()
    started = time.perf_counter()
    for model, batch in MODELS:
        spec = parse_spec(trainingjob("warm-up", model, batch)["spec"])  # as the jobs below are forecast
        await forecaster.forecast(spec.workload, spec.scope)
    warmup = time.perf_counter() - started
    async with cluster(Path(tempfile.mkdtemp())) as c:
        for node in ("node-a", "node-b"):
            await c.publish_node(node, [simulated_gpu(f"GPU-{node}-{i}", gpu_gib) for i in range(2)])
        kubelet = asyncio.create_task(fake_kubelet(c, lambda pod: 3600.0))  # jobs keep running: GPUs fill up
        op = await start_operator(forecaster)
        loop = asyncio.get_running_loop()
        created: dict[str, float] = {}
        pauses = GcPauses()
        gc.callbacks.append(pauses)
        try:
            for i in range(jobs):
                name = f"bench-{i:04d}"
                created[f"default/{name}"] = loop.time()
                await c.apply(trainingjob(name, *MODELS[i % len(MODELS)]))
                await asyncio.sleep(interval)
            await c.wait(lambda: len(op.app.scheduler.admitted_at) >= jobs, 120, "all admitted")
            latencies = [op.app.scheduler.admitted_at[k] - created[k] for k in created]
            planner_runs = op.app.planner.runs
        finally:
            gc.callbacks.remove(pauses)
            await op.stop()
            kubelet.cancel()
            await asyncio.gather(kubelet, return_exceptions=True)
            forecaster.close()
    return {
        "benchmark": "operator_admission",
        "jobs": jobs,
        "interval_seconds": interval,
        "gpus": "2 nodes x 2 simulated GPUs",
        "gpu_memory_gib": gpu_gib,
        "models": [f"{m} b{b}" for m, b in MODELS],
        "forecast_warmup_seconds": round(warmup, 3),
        "traces": forecaster.traces,
        "joint_planner_runs": planner_runs,
        "latency_seconds": {
            "p50": round(statistics.median(latencies), 4),
            "p90": round(percentile(latencies, 0.90), 4),
            "p99": round(percentile(latencies, 0.99), 4),
            "max": round(max(latencies), 4),
            "mean": round(statistics.fmean(latencies), 4),
        },
        "target_p99_seconds": 0.2,
        "full_gc_pauses": pauses.summary(),
        "load_average_1min": host_load.around(),
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=120)
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "operator_admission.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = asyncio.run(measure(args.jobs, args.interval, args.gpu_gib))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
