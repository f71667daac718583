"""Starting a process under the hook on this machine (`tensile run`, `tensile local`): its environment, and that
environment checked as the hook will read it, before the process starts."""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path

from tensile.agent_client import Http
from tensile.agent_contract import GPU_PATTERN
from tensile.allocator import expandable_segments_setting
from tensile.errors import TensileUserError
from tensile.knobs import CONTEXT_BYTES, MEMORY_CAP, knob_variables
from tensile.workload_io import load_workload
from tensile_hook.settings import HookSettings

SITE_DIR = Path(__file__).parent / "site"  # its sitecustomize switches the hook on in every Python started with it


def hook_variables(*, memory_budget: str | None = None, workload: str | None = None, plan: str | None = None,
                   agent: str | None = None, token: str | None = None, gpu: str | None = None,
                   max_swap_rate: float | None = None, report: str | None = None, plan_events: str | None = None,
                   recompute: bool = True, memory_cap: int | None = None,
                   context_bytes: int | None = None) -> dict[str, str]:
    """The TENSILE_* variables of these settings. One not given (None, empty) is left out, and recompute is set
    only when off: the environment's value, else the hook's default, stands. `memory_cap`: the bytes the job was
    admitted with, its process's CUDA memory cap, of which `context_bytes` were counted for its CUDA context
    (tensile_hook.memory_cap)."""
    named = {"TENSILE_WORKLOAD": workload, "TENSILE_PLAN": plan, "TENSILE_AGENT": agent, "TENSILE_TOKEN": token,
             "TENSILE_GPU": gpu, "TENSILE_REPORT": report}
    knobs = knob_variables(memory_budget, max_swap_rate, plan_events, None if recompute else False, memory_cap,
                           context_bytes)
    return {name: value for name, value in (named | knobs).items() if value}


def hook_environment(job: str, variables: Mapping[str, str],
                     environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` (default: this process's) with the hook switched on for `job`: its site folder first on PYTHONPATH,
    `variables` (`hook_variables`) over the environment's own, and the CUDA allocator's expandable segments merged
    with the environment's own allocator setting (never over it: tensile.allocator)."""
    env = dict(os.environ if environ is None else environ)
    env["TENSILE_JOB"] = job
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH", "")) if p)
    env.update(variables)
    env.update(expandable_segments_setting(env))
    return env


def check_environment(env: Mapping[str, str], checked: Collection[str] = ()) -> None:
    """The hook's settings as the child will read them (the options over the environment), refused here where the hook
    would refuse them, naming the variable: a bad one (TENSILE_LATENCY_SAMPLE_EVERY=abc, an agent URL, a workload file)
    made the hook stand down in the child, and the training ran without Tensile, which a line in its output was all
    that said (`tensile local`: in its jobs' logs). `checked`: variables an option set, checked already as options."""
    try:
        settings = HookSettings.from_env(dict(env))
        if settings.agent_url and "TENSILE_AGENT" not in checked:
            try:
                Http(settings.agent_url)
            except ValueError as exc:
                raise ValueError(f"TENSILE_AGENT: {exc}") from None
        if settings.gpu and "TENSILE_GPU" not in checked and not re.match(GPU_PATTERN, settings.gpu):
            raise ValueError(f"TENSILE_GPU: '{settings.gpu}' is no GPU UUID or index "
                             "(the agent lists its GPUs at /v1/gpus)")
        if {"TENSILE_PLAN", "TENSILE_WORKLOAD"} & {k for k, v in env.items() if v} - set(checked):
            if settings.plan_path:
                from tensile_hook.plan_source import load_plan_files  # torch: only when there are files to check

                load_plan_files(settings)
            elif settings.workload_path:
                load_workload(settings.workload_path)
        for setting in (MEMORY_CAP, CONTEXT_BYTES):  # read by the cap (tensile_hook.memory_cap), before the hook
            if setting.variable not in checked:
                setting.from_environment(env, None)
    except (ValueError, TensileUserError) as exc:
        raise TensileUserError(f"{exc} (set in the environment: fix or unset it)") from None
