"""Where the hook's plan comes from: files named by TENSILE_PLAN/TENSILE_WORKLOAD, the node agent
(TENSILE_AGENT), or the core planner in-process."""

from __future__ import annotations

import functools
import itertools

import torch

from tensile.plan import Plan, load_plan
from tensile_hook.agent_link import AgentLink
from tensile_hook.memory_cap import MemoryCap
from tensile_hook.plan_book import Planner
from tensile_hook.settings import HookSettings, native_plans
from tensile.workload import Workload
from tensile.workload_io import load_workload


def load_plan_files(settings: HookSettings) -> tuple[Plan | None, Workload | None]:
    if not settings.plan_path:
        return None, None
    if not settings.workload_path:
        raise ValueError("TENSILE_PLAN needs TENSILE_WORKLOAD: the workload the plan was made for")
    workload = load_workload(settings.workload_path)
    plan = load_plan(settings.plan_path, workload, "TENSILE_PLAN")
    return plan, workload


def agent_link(settings: HookSettings, fallback: Planner, memory_cap: MemoryCap | None = None) -> AgentLink | None:
    """The link to the node agent when TENSILE_AGENT is set, started: with TENSILE_WORKLOAD the job
    registers that workload at once, otherwise the live one after iteration 1; with the process's memory cap, which
    its registration tells the agent."""
    if not settings.agent_url:
        return None
    workload = load_workload(settings.workload_path) if settings.workload_path else None
    return AgentLink.from_env(settings, fallback, memory_cap=memory_cap).start(workload)


def local_planner(settings: HookSettings, device: torch.device) -> Planner:
    """Plan in-process with the core planner (no agent): one job alone on its device, from the
    live iteration's measured op latencies, within the job's max swapping rate as the agent would plan
    it. On CUDA the plan keeps to activation swaps by default:
    events only the dispatch path carries cost more per iteration in Python than a GPU iteration
    takes (docs/runtime-hook.md, "On the GPU"). Its plans are numbered 1, 2, ... as it makes them:
    a re-plan after the iterations left the plan is a newer version in the report and the logs."""
    activations_only = native_plans(settings, device.type)
    versions = itertools.count(1)

    def plan(workload: Workload, budget: int | None) -> Plan | None:
        from tensile.planner import plan_job

        made = plan_job(workload, host_link_bandwidth(device) * settings.link_share, budget, name=settings.job,
                        activations_only=activations_only, recompute=settings.recompute,
                        max_swap_rate=settings.max_swap_rate or 1.0).plans[settings.job]
        made.version = next(versions)
        return made

    return plan


@functools.cache
def host_link_bandwidth(device: torch.device) -> float:
    """Bytes/s per direction between host and device. On CUDA measured once, the slower direction
    of pinned copies: the preset's datasheet figure was twice what a virtualised H100 moved, and
    a plan made for a faster link leaves compute waiting for its swap-ins."""
    from tensile.devices import PRESETS

    if device.type != "cuda":
        return PRESETS["cpu"].host_link_bandwidth
    return measure_host_link(device)


def measure_host_link(device: torch.device, nbytes: int = 64 * 1024**2, repeats: int = 3) -> float:
    from tensile.latency.measure import median_time

    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    on_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def rate(source: torch.Tensor, target: torch.Tensor) -> float:
        return nbytes / median_time(lambda: target.copy_(source, non_blocking=True), "cuda", repeats)

    return min(rate(on_device, on_host), rate(on_host, on_device))
