"""Run the same jobs on one simulated GPU under each policy and measure MSR, EOR and CBR as the paper does.

MSR = (VMP - EMP) / VMP, EOR = ETC / VTC, CBR = MSR / EOR, where V is the vanilla run of the same jobs
on the same simulated GPU and E the run under the policy. Per job, peaks are the job's own; for the
whole GPU (job "*") the peak is the sum of the jobs' peaks (the paper's MP) and the time cost the sum
of the jobs' iteration times. Capuchin gets each job's TENSILE scheduled peak as its budget, as in
the paper.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tensile.baselines.capuchin import CapuchinPolicy
from tensile.baselines.vdnn import vdnn_job
from tensile.devices import DeviceSpec
from tensile.errors import TensileUserError
from tensile.planner import GpuPlan, JobToPlan, co_run_slowdown, plan_gpu
from tensile.simulator import SimJob, SimResult, simulate

POLICIES = ("vanilla", "vdnn", "capuchin", "tensile")


@dataclass(slots=True)
class Comparison:
    rows: list[dict]
    plan_seconds: float
    simulations: dict[str, SimResult] = field(default_factory=dict)
    gpu_plan: GpuPlan | None = None


def _metrics(vanilla_peak: int, peak: int, vanilla_seconds: float, seconds: float) -> dict:
    msr = (vanilla_peak - peak) / vanilla_peak if vanilla_peak else 0.0
    eor = seconds / vanilla_seconds if vanilla_seconds else 1.0
    return {"vanilla_peak_bytes": vanilla_peak, "peak_bytes": peak, "msr": msr, "eor": eor, "cbr": msr / eor if eor else 0.0}


def compare(
    jobs: list[JobToPlan],
    device: DeviceSpec,
    policies: tuple[str, ...] = POLICIES,
    overlap: float = 0.1,
    iterations: int = 3,
    budget_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> Comparison:
    """Simulate `jobs` under each policy; rows carry keys policy, job, vanilla_peak_bytes, peak_bytes, msr, eor, cbr."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise TensileUserError(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    say = progress or (lambda _: None)
    bandwidth = device.host_link_bandwidth
    say("simulating vanilla")
    runs: dict[str, SimResult] = {"vanilla": simulate([SimJob(j.name, j.workload) for j in jobs], device, overlap, iterations)}
    gpu_plan = None
    plan_seconds = 0.0
    if "tensile" in policies or "capuchin" in policies:
        say("planning with TENSILE")
        started = time.perf_counter()
        capacity = device.memory_bytes - len(jobs) * device.context_bytes
        gpu_plan = plan_gpu(jobs, bandwidth, budget_bytes, capacity, co_run_slowdown(len(jobs), overlap))
        plan_seconds = time.perf_counter() - started
    for policy in policies:
        if policy == "vanilla":
            continue
        say(f"simulating {policy}")
        if policy == "tensile":
            assert gpu_plan is not None  # planned above for tensile and capuchin
            sim_jobs = [SimJob(j.name, j.workload, gpu_plan.plans[j.name]) for j in jobs]
        elif policy == "vdnn":
            sim_jobs = [vdnn_job(j.name, j.workload) for j in jobs]
        else:
            assert gpu_plan is not None
            budgets = {name: gpu_plan.forecast_of(name).scheduled_peak_bytes for name in gpu_plan.plans}
            sim_jobs = [CapuchinPolicy(j.name, j.workload, budgets[j.name], bandwidth).job() for j in jobs]
        runs[policy] = simulate(sim_jobs, device, overlap, iterations)
    rows = []
    vanilla = runs["vanilla"].jobs
    for policy in policies:
        result = runs[policy].jobs
        for job in jobs:
            v, e = vanilla[job.name], result[job.name]
            rows.append({"policy": policy, "job": job.name, **_metrics(v.peak_bytes, e.peak_bytes, v.steady_iteration_seconds, e.steady_iteration_seconds)})
        total = _metrics(
            sum(vanilla[j.name].peak_bytes for j in jobs),
            sum(result[j.name].peak_bytes for j in jobs),
            sum(vanilla[j.name].steady_iteration_seconds for j in jobs),
            sum(result[j.name].steady_iteration_seconds for j in jobs),
        )
        rows.append({"policy": policy, "job": "*", **total})
    return Comparison(rows, plan_seconds, runs, gpu_plan)
