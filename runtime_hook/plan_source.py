"""Where the hook's plan comes from: files named by TENSILE_PLAN/TENSILE_WORKLOAD, the node agent
(TENSILE_AGENT), or the core planner in-process."""

from __future__ import annotations

import json

import torch

from tensile.plan import Plan
from tensile.runtime_hook.agent_link import AgentLink
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


def agent_link(settings: HookSettings, fallback: Planner) -> AgentLink | None:
    """The link to the node agent when TENSILE_AGENT is set, started: with TENSILE_WORKLOAD the job
    registers that workload at once, otherwise the live one after iteration 1."""
    if not settings.agent_url:
        return None
    workload = load_workload(settings.workload_path) if settings.workload_path else None
    return AgentLink.from_env(settings, fallback).start(workload)


def local_planner(settings: HookSettings, device: torch.device) -> Planner:
    """Plan in-process with the core planner (no agent): one job alone on its device, from the
    live iteration's measured op latencies."""

    def plan(workload: Workload, budget: int | None) -> Plan | None:
        from tensile.planner import plan_job

        return plan_job(workload, host_link_bandwidth(device), budget, name=settings.job).plans[settings.job]

    return plan


def host_link_bandwidth(device: torch.device) -> float:
    """Bytes/s per direction between host and device: the preset for a known GPU, else a default."""
    from tensile.devices import PRESETS

    if device.type != "cuda":
        return PRESETS["cpu"].host_link_bandwidth
    name = torch.cuda.get_device_name(device).lower()
    for key, spec in PRESETS.items():
        if key in name:
            return spec.host_link_bandwidth
    return PRESETS["a6000"].host_link_bandwidth
