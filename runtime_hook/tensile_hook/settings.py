"""The hook's settings, from TENSILE_* environment variables (set by `tensile run` or the operator)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tensile.devices import parse_bytes
from tensile.errors import TensileUserError
# one rule for a number's range and for a swap rate, in core: TrainingJobs and the CLI read them so too
from tensile.knobs import parse_number, parse_swap_rate
from tensile.plan import PLAN_EVENTS, native_plan_events

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
        budget = env.get("TENSILE_MEMORY_BUDGET")
        rate = env.get("TENSILE_MAX_SWAP_RATE")
        return cls(
            job=env.get("TENSILE_JOB", "local"),
            plan_path=env.get("TENSILE_PLAN") or None,
            workload_path=env.get("TENSILE_WORKLOAD") or None,
            signature=env.get("TENSILE_SIGNATURE") or None,
            memory_budget=parse_budget(budget, "TENSILE_MEMORY_BUDGET") if budget else None,
            agent_url=env.get("TENSILE_AGENT") or None,
            token=env.get("TENSILE_TOKEN") or None,
            gpu=env.get("TENSILE_GPU") or None,
            report_path=env.get("TENSILE_REPORT") or None,
            report_interval=_seconds(env, "TENSILE_REPORT_INTERVAL", cls.report_interval),
            max_swap_rate=parse_swap_rate(rate, "TENSILE_MAX_SWAP_RATE") if rate else None,
            plan_events=_choice(env, "TENSILE_PLAN_EVENTS", PLAN_EVENTS),
            recompute=_choice(env, "TENSILE_RECOMPUTE", ("true", "false")) == "true",
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


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    text = env.get(name) or choices[0]
    if text not in choices:
        raise ValueError(f"{name}: '{text}' is not one of {', '.join(choices)}")
    return text


def _share(env: Mapping[str, str], name: str, default: float) -> float:
    return _number(env, name, default, lambda v: 0 < v <= 1, "a share in (0, 1], e.g. 0.5")


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    return _number(env, name, default, lambda v: 0 < v < 3600, "seconds between 0 and 3600")


def _number(env: Mapping[str, str], name: str, default: float, valid: Callable[[float], bool], expected: str) -> float:
    text = env.get(name)
    return parse_number(text, name, valid, expected) if text else default


def parse_budget(text: str, field: str) -> float:
    """'0.6' is 60% of the vanilla peak; '2e9', '2000000000', '12Gi' or '12GiB' is bytes. A number above 1 with a
    fraction ('1.5') is refused: it is a mistaken fraction, which read as bytes was a 1-byte budget."""
    expected = "give whole bytes (2000000000, 2e9, 12Gi, 12GiB) or a fraction of the vanilla peak in (0, 1] (e.g. 0.6)"
    try:
        value = float(text)
    except ValueError:
        try:
            value = float(parse_bytes(text))
        except TensileUserError:
            raise ValueError(f"{field}: '{text}' is not a number of bytes or a fraction of the vanilla peak; {expected}") from None
    if not value > 0:
        raise ValueError(f"{field}: must be positive (was {text}); {expected}")
    if value > 1 and not value.is_integer():
        raise ValueError(f"{field}: '{text}' is neither a fraction nor bytes: fractions of the vanilla peak must be in "
                         "(0, 1] (e.g. 0.6) and byte counts whole (e.g. 12GiB or 12000000000)")
    return value


def budget_bytes(budget: float | None, vanilla_peak: int) -> int | None:
    if budget is None:
        return None
    return int(budget * vanilla_peak) if budget <= 1.0 else int(budget)
