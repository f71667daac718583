"""Scheduling plan updating (TENSILE IV-E): re-plan a GPU's jobs when their op latencies drift.

Measured op latencies of each job are folded into an exponentially weighted moving average. When a
job's average latency rate of change |s' - s| / s (s' the newest sum of its op latencies, s the sum
the current plan was made with) exceeds the threshold, all jobs of the GPU are planned again with
the corrected latencies. A new plan is handed out with a higher version and takes effect at the job's
next iteration boundary (the hook and the simulator fetch plans only there).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

from tensile.latency import LatencyEWMA
from tensile.plan import Plan
from tensile.planner import GpuPlan, JobSpec, plan_gpu


class PlanUpdater:
    """Holds the current plans of one GPU's jobs and re-plans them when latencies drift."""

    def __init__(
        self,
        jobs: list[JobSpec],
        bandwidth: float,
        threshold: float = 0.1,
        alpha: float = 0.3,
        **planner_options,
    ) -> None:
        # own copies: corrected latencies are written into the workloads when re-planning
        self.jobs = {job.name: dataclasses.replace(job, workload=copy.deepcopy(job.workload)) for job in jobs}
        self.bandwidth = bandwidth
        self.threshold = threshold
        self.options = planner_options
        self.ewma = {name: LatencyEWMA(job.workload, alpha) for name, job in self.jobs.items()}
        self.planned_sum = {name: sum(op.latency for op in job.workload.ops) for name, job in self.jobs.items()}
        self.versions = dict.fromkeys(self.jobs, 0)
        self.current: GpuPlan = self._plan()

    def _plan(self) -> GpuPlan:
        result = plan_gpu(list(self.jobs.values()), self.bandwidth, **self.options)
        for name, plan in result.plans.items():
            self.versions[name] += 1
            plan.version = self.versions[name]
        return result

    def plan(self, job: str) -> Plan:
        return self.current.plans[job]

    def change_rate(self, job: str) -> float:
        """|s' - s| / s for one job."""
        s = self.planned_sum[job]
        return abs(self.ewma[job].corrected_sum() - s) / s if s else 0.0

    def observe(self, job: str, latencies: Sequence[float]) -> bool:
        """Fold one measured iteration of `job` in; re-plan every job of the GPU if it drifted.

        Returns whether new plans were made (fetch them with `plan` at the next iteration boundary)."""
        self.ewma[job].observe_iteration(latencies)
        if self.change_rate(job) <= self.threshold:
            return False
        for name, spec in self.jobs.items():
            self.ewma[name].apply(spec.workload)
            self.planned_sum[name] = sum(op.latency for op in spec.workload.ops)
        self.current = self._plan()
        return True
