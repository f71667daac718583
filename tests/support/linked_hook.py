"""The hook linked to a real node agent: the settings and environment that keep its calls quick in tests, and
`tracing_models.views` trained through the link."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tensile.workload import Workload
from tensile_hook import activate, deactivate
from tensile_hook.agent_link import AgentLink
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings
from tests.support import tracing_models
from tests.support.agent_harness import ROOT
from tests.support.training import STEPS, fit_model, state_of, train

SCRIPT = str(ROOT / "examples" / "train_mlp.py")
FAST = {"TENSILE_AGENT_MAX_BACKOFF": "0.3", "TENSILE_AGENT_INTERVAL": "0.1", "TENSILE_AGENT_TIMEOUT": "0.5"}


def trains() -> None:
    """A module call: what tells a link that its process trains (a registration waits for one)."""
    torch.nn.Identity()(torch.zeros(1))


def fit_linked(link: AgentLink, settings: HookSettings, steps: int = STEPS,
               after_step: Callable[[int], None] | None = None) -> tuple[dict, HookReport, float]:
    """`tracing_models.views` trained under the hook planned through `link` (closed after): the state, the
    report and the wall seconds, which hold the match's wait for the agent (in no iteration's seconds)."""
    executor = activate(settings, planner=link.planner, device=torch.device("cpu"), listener=link.listener)
    started = time.monotonic()
    try:
        hooked = state_of(*fit_model(tracing_models.views, 4, steps, after_step=after_step))
    finally:
        deactivate()
        link.close()
    return hooked, executor.report, time.monotonic() - started


def live_workload(build, batch_size: int) -> Workload:  # type: ignore[no-untyped-def]
    """The workload the hook records from `build`'s training: what a forecast made before the job gives."""
    seen: list[Workload] = []
    train(build, batch_size, planner=lambda live, budget: seen.append(live))
    return seen[0]


def agent_settings(url: str, job: str, agent_wait: float) -> HookSettings:
    """No latency samples: on a loaded host the first one re-plans for drift, a plan version these tests do not
    count."""
    return HookSettings(job=job, agent_url=url, agent_wait=agent_wait, agent_interval=0.05, agent_timeout=0.5,
                        agent_max_backoff=0.3, latency_sample_every=0)
