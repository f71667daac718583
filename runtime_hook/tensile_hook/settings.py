"""The hook's settings, from TENSILE_* environment variables (set by `tensile run` or the operator)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# a job's knobs by their variables and rules in core: TrainingJobs and the CLI read them so too
from tensile.knobs import MAX_SWAP_RATE, MEMORY_BUDGET, PLAN_EVENTS, RECOMPUTE, parse_number
from tensile.plan import native_plan_events

DEFAULT_SAMPLE_EVERY = 200  # docs/runtime-hook.md, "Op latencies for the agent": what a sampling iteration costs


@dataclass(frozen=True)
class HookSettings:
    job: str
    plan_path: str | None = None  # a plan JSON (tensile forecast --save-plan)
    workload_path: str | None = None  # the workload the plan was made for
    # the forecast's signature (the operator sets it): the node agent holds that workload when the operator
    # registered the job with it at admission
    signature: str | None = None
    memory_budget: float | None = None  # bytes, or a fraction (<= 1) of the vanilla peak
    agent_url: str | None = None
    token: str | None = None
    gpu: str | None = None
    report_path: str | None = None
    report_interval: float = 10.0  # seconds between rewrites of the report file (and always at exit)
    max_swap_rate: float | None = None
    # which events plans may use, the in-process planner's and the agent's (tensile.plan.PLAN_EVENTS)
    plan_events: str = "auto"
    recompute: bool = True  # a TrainingJob's spec.scheduling.recompute: false keeps every plan free of recomputes
    link_share: float = 1.0  # the share of the measured host link the in-process planner counts on
    # the agent path (runtime_hook/tensile_hook/agent_link.py): how long iteration 1 may wait for the agent's first
    # plan, each call's timeout, the longest quiet spell after failures, how often to post and poll
    agent_wait: float = 5.0
    agent_timeout: float = 2.0
    agent_max_backoff: float = 10.0
    agent_interval: float = 0.5
    # with an agent: one iteration in this many runs on the dispatch path with its ops timed, for the agent's drift
    # rule (runtime_hook/tensile_hook/latency_samples.py; 0: never)
    latency_sample_every: int = DEFAULT_SAMPLE_EVERY

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> HookSettings:
        env = os.environ if environ is None else environ
        return cls(
            job=env.get("TENSILE_JOB", "local"),
            plan_path=env.get("TENSILE_PLAN") or None,
            workload_path=env.get("TENSILE_WORKLOAD") or None,
            signature=env.get("TENSILE_SIGNATURE") or None,
            memory_budget=MEMORY_BUDGET.from_environment(env, None),
            agent_url=env.get("TENSILE_AGENT") or None,
            token=env.get("TENSILE_TOKEN") or None,
            gpu=env.get("TENSILE_GPU") or None,
            report_path=env.get("TENSILE_REPORT") or None,
            report_interval=_seconds(env, "TENSILE_REPORT_INTERVAL", cls.report_interval),
            max_swap_rate=MAX_SWAP_RATE.from_environment(env, None),
            plan_events=PLAN_EVENTS.from_environment(env, cls.plan_events),
            recompute=RECOMPUTE.from_environment(env, cls.recompute),
            link_share=_share(env, "TENSILE_LINK_SHARE", cls.link_share),
            agent_wait=_seconds(env, "TENSILE_AGENT_WAIT", cls.agent_wait),
            agent_timeout=_seconds(env, "TENSILE_AGENT_TIMEOUT", cls.agent_timeout),
            agent_max_backoff=_seconds(env, "TENSILE_AGENT_MAX_BACKOFF", cls.agent_max_backoff),
            agent_interval=_seconds(env, "TENSILE_AGENT_INTERVAL", cls.agent_interval),
            latency_sample_every=int(_number(env, "TENSILE_LATENCY_SAMPLE_EVERY", cls.latency_sample_every,
                                             lambda v: v >= 0 and v.is_integer(), "a whole number of iterations, 0 for never")),
        )


def native_plans(settings: HookSettings, device_type: str) -> bool:
    """Plans kept to what the native path carries (activation swaps aligned with module calls)."""
    return native_plan_events(settings.plan_events, device_type)


def _share(env: Mapping[str, str], name: str, default: float) -> float:
    return _number(env, name, default, lambda v: 0 < v <= 1, "a share in (0, 1], e.g. 0.5")


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    return _number(env, name, default, lambda v: 0 < v < 3600, "seconds between 0 and 3600")


def _number(env: Mapping[str, str], name: str, default: float, valid: Callable[[float], bool], expected: str) -> float:
    text = env.get(name)
    return parse_number(text, name, valid, expected) if text else default
