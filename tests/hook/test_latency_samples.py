"""Op latencies for the node agent's drift rule (TENSILE IV-E; runtime_hook/tensile_hook/latency_samples.py): with an agent, the
first iteration under the plan and then one in every `latency_sample_every` run on the dispatch path with their ops
timed, and the link posts the [op index, seconds] pairs with its measurements. Before, the hook posted none: the
agent's EWMA never moved and its drift re-plan never happened, whatever the threshold."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tensile.agent_client import AgentClient
from tensile_agent.state import Job
from tensile_hook import activate, deactivate
from tensile_hook.agent_link import AgentLink
from tensile_hook.latency_samples import OpSamples
from tensile_hook.plan_source import local_planner
from tensile_hook.report import HookReport, IterationStats
from tensile_hook.settings import HookSettings
from tests.support.agent_harness import wait_for as _wait
from tests.support.bit_identity import assert_identical
from tests.support.linked_hook import trains
from tests.support.training import state_of

pytestmark = pytest.mark.usefixtures("deterministic")

CPU = torch.device("cpu")
SLOW = {"seconds": 0.0}  # what the test's own op sleeps: the slowdown


@torch.library.custom_op("tensile_test::slow", mutates_args=())
def slow(x: torch.Tensor) -> torch.Tensor:
    """One op of the forward whose latency the test sets (it sleeps inside the op, where the hook times it). In the
    forward: ops after the last step (the next batch's) are not seen when the next iteration runs natively."""
    time.sleep(SLOW["seconds"])
    return x.clone()


slow.register_autograd(lambda ctx, grad: grad)


class Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return slow(x)


def _train(steps: int, after_step: Callable[[int], None] | None = None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), Slow(), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if after_step is not None:
            after_step(step)
    return state_of(model, [optimizer])


@pytest.mark.slow
def test_sampled_op_latencies_reach_the_agent_and_a_slowdown_replans_for_drift(agent_server):
    """Native iterations (the agent's plan for a roomy GPU), every third one sampled on the dispatch path (from the first
    under the plan, there anyway); the agent folds the samples into its EWMA at its workload's op indices, and when the
    test's op slows down it re-plans with reason drift. Bit-identical to the plain run."""
    steps, slow_from, every = 13, 6, 3
    plain = _train(steps)
    # a drift threshold of 0.5: the slowdown moves the planned sum by 1.2 of itself, while the noise of a loaded 2-core
    # machine in the unslowed samples (iterations 2 and 5) can pass the default 0.1 and re-plan before the slow sample
    # comes, which would end the wait below with the slowdown not yet at the agent
    agent = agent_server(threshold=0.5)
    settings = HookSettings(job="ns/drift", agent_url=agent.url, agent_wait=30.0, agent_interval=0.05, agent_timeout=0.5,
                            agent_max_backoff=0.3, plan_events="native", latency_sample_every=every)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2), local_planner(settings, CPU)).start()

    def job() -> Job:
        return agent.agent.state.jobs["ns/drift"]

    def drifts() -> int:
        return sum(count for (_, reason), count in agent.agent.state.replans.items() if reason == "drift")

    seen: dict[str, float] = {}

    def after_step(step: int) -> None:
        if step == slow_from - 1:  # iterations 2 (the first under the plan) and 5 were sampled (they may have drifted)
            _wait(lambda: job().ewma is not None and len(job().ewma._ewma) > 0, 30, "the first op latencies at the agent")
            assert job().workload is not None and job().workload.signature == executor.report.live_signature
            seen["drifts"], seen["index"] = drifts(), next(op.index for op in job().workload.ops if "slow" in op.name)
            # twenty times the sum the plan was made with: one sample moves the EWMA by 0.3 of it (its alpha), six
            # times that sum, whatever this machine's noise makes of the other ops (a loaded machine's unslowed sample
            # of iteration 5 can inflate the sum a drift re-plans with several times before the slow one comes)
            SLOW["seconds"] = min(max(0.05, 20 * job().planned_sum), 2.0)
        if step == slow_from + every:  # iteration 8, slow, was sampled and posted
            # a re-plan for drift made with the slowdown in its latencies (its planned sum holds 0.3 of it): a drift of
            # the unslowed sample of iteration 5, which may reach the agent after the count above on a loaded machine,
            # re-plans without it and does not end this wait
            _wait(lambda: drifts() > seen["drifts"] and job().planned_sum >= 0.25 * SLOW["seconds"], 30,
                  "a re-plan for drift with the slowdown")
            with job().lock:  # the slowdown, at its op's index
                assert job().ewma is not None and job().ewma.latency(int(seen["index"])) > 0.25 * SLOW["seconds"]
            SLOW["seconds"] = 0.0

    executor = activate(settings, planner=link.planner, device=CPU, listener=link.listener)
    try:
        hooked = _train(steps, after_step)
    finally:
        SLOW["seconds"] = 0.0
        deactivate()
        link.close()
    assert_identical(plain, hooked)
    report = executor.report
    assert report.stood_down is None and report.plan_source == "agent", report.messages
    paths = {it.iteration: it.path for it in report.iterations}
    # the sampling iterations on the dispatch path; the others native, but the first under each plan (a re-plan)
    assert all(paths[i] == "dispatch" for i in range(2, steps, every)), paths
    assert sum(path == "native" for path in paths.values()) >= 4, paths
    assert all(it.mode == "planned" for it in report.iterations[2:]), [it.mode for it in report.iterations]


def test_the_link_posts_samples_only_for_the_workload_the_agent_plans_with(agent_server, tiny_workload):
    """Samples measured against another workload (shapes since changed: the agent plans the ones uploaded last) are
    dropped; the others go out with the next post, at most the contract's MAX_OP_SAMPLES pairs."""
    agent = agent_server()
    workload = tiny_workload()
    settings = HookSettings(job="ns/samples", agent_interval=0.05)
    link = AgentLink(settings, AgentClient(agent.url, settings.job, max_backoff=0.2)).start(workload)
    trains()
    report = HookReport("ns/samples", "cpu")
    try:
        _wait(lambda: "ns/samples" in agent.agent.state.jobs, 30, "the registration")
        link.listener(IterationStats(5, "planned", 1), report, OpSamples("another-signature", 5, [0], [9.0]))
        link.listener(IterationStats(6, "planned", 1), report, OpSamples(workload.signature, 6, [0, 1], [0.25, 0.5]))
        job = agent.agent.state.jobs["ns/samples"]
        _wait(lambda: job.observed.iterations == 2, 30, "the posted figures")
        with job.lock:
            assert job.ewma is not None
            assert (job.ewma.latency(0), job.ewma.latency(1)) == (0.25, 0.5)
    finally:
        link.close()


@pytest.mark.slow
def test_a_sampling_iteration_applies_the_native_plan_as_a_native_one_does():
    """Activation swaps carried natively (tests/support/plans.py's pooled_swaps); every third iteration sampled on the
    dispatch path swaps the same tensors out and back, times every op of the workload, and the training stays
    bit-identical to the plain run."""
    from tests.support.loops import batches, net
    from tests.support.plans import pooled_swaps

    def loop() -> dict:
        model = net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for x, y in batches([8] * 12):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        return state_of(model, [optimizer])

    plain = loop()
    got: list[OpSamples] = []

    def listener(stats: IterationStats, report: HookReport, samples: OpSamples | None = None) -> None:
        got.extend([samples] if samples is not None else [])

    settings = HookSettings(job="job", agent_url="http://127.0.0.1:9", latency_sample_every=3)  # never called here
    executor = activate(settings, planner=pooled_swaps, device=CPU, listener=listener)
    try:
        hooked = loop()
    finally:
        deactivate()
    assert_identical(plain, hooked)
    report = executor.report
    assert executor.live is not None
    by_iteration = {it.iteration: it for it in report.iterations}
    sampled = [by_iteration[s.iteration] for s in got]
    native = [it for it in report.iterations if it.path == "native"]
    assert [it.iteration for it in sampled] == [2, 5, 8, 11] and {it.path for it in sampled} == {"dispatch"}
    assert len(native) >= 6 and native[0].events["swap_out"] > 0
    assert {it.events["swap_out"] for it in sampled + native} == {native[0].events["swap_out"]}
    assert all(s.indices == list(range(len(s.indices))) and s.signature == executor.live.signature for s in got)
    assert len(got[-1].indices) == by_iteration[11].ops  # every op up to the step
