"""Where the hook's plan comes from: files named by TENSILE_PLAN/TENSILE_WORKLOAD, or the core planner."""

from __future__ import annotations

import json

from tensile.plan import Plan
from tensile.runtime_hook.executor import Planner
from tensile.runtime_hook.settings import HookSettings
from tensile.workload import Workload
from tensile.workload_io import load_workload


def load_plan_files(settings: HookSettings) -> tuple[Plan | None, Workload | None]:
    if not settings.plan_path:
        return None, None
    if not settings.workload_path:
        raise ValueError("TENSILE_PLAN needs TENSILE_WORKLOAD: the workload the plan was made for")
    with open(settings.plan_path) as handle:
        plan = Plan.from_dict(json.load(handle))
    return plan, load_workload(settings.workload_path)


def local_planner(settings: HookSettings) -> Planner:
    """Plan in-process with the core planner (no agent): for one job alone on its device."""

    def plan(workload: Workload, budget: int | None) -> Plan | None:
        from tensile.planner import plan_single_job

        return plan_single_job(workload, job=settings.job, memory_budget=budget, max_swap_rate=settings.max_swap_rate)

    return plan
