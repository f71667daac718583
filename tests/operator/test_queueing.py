"""The TrainingJob queue as Kubernetes users know it from the scheduler and Kueue: ordered by the PriorityClass of the
job's pod template, then by creation; a priorityClassName that names no PriorityClass said on the job; a queueing
strategy (StrictFIFO, or BestEffortFIFO whose head cannot starve: GPU room is held for it once it has waited at the
head longer than a bound); the chart's values for them. Kopf runs against the emulator, as in
test_lifecycle.py. Every job here is admitted by its budget (no tracing): ~10 s."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from helm_python import Chart, HelmValuesError

from tests.support.chart_render import CHART_DIR, objects, one, render
from tests.support.operator_harness import Cluster, gpu_held_by_big, phase, trainingjob
from tensile.errors import TensileUserError
from tensile_operator.app import OperatorApp
from tensile_operator.events import COMPONENT
from tensile_operator.forecasting import Forecaster
from tensile_operator.queueing import BEST_EFFORT, DURATION, HOLD_ENV, STRATEGY_ENV, STRICT, QueueConfig


def job(name: str, budget: str, priority_class: str | None = None) -> dict:
    """A budget-admitted job whose pod template names `priority_class`."""
    body = trainingjob(name, None, profile="p", memoryBudget=budget)
    if priority_class:
        body["spec"]["template"]["spec"]["priorityClassName"] = priority_class
    return body


def queue(c: Cluster, name: str) -> dict:
    return ((c.job(name) or {}).get("status") or {}).get("queue") or {}


def admitted(c: Cluster, name: str) -> dict:
    """The job's `Admitted` condition."""
    return next((x for x in ((c.job(name) or {}).get("status") or {}).get("conditions") or [] if x["type"] == "Admitted"), {})


def events(c: Cluster, name: str) -> dict[str, dict]:
    """The operator's Events on job `name`, by reason."""
    return {e["reason"]: e for e in c.emu.items("v1/events")
            if e.get("source", {}).get("component") == COMPONENT and e["involvedObject"]["name"] == name}


async def end(c: Cluster, name: str) -> None:
    """The job's pod succeeds: its GPU room is freed."""
    pod = await c.wait(lambda: c.emu.get("v1/pods", "default", f"{name}-tensile"), 10, f"{name}'s pod")
    await c.set_pod_status(pod, {"phase": "Succeeded"})  # type: ignore[arg-type]


async def queued(c: Cluster, *names: str) -> None:
    for name in names:
        await c.wait(lambda: admitted(c, name).get("status") == "False", 10, f"{name} queued")  # noqa: B023


async def placed_in_order(c: Cluster, order: list[str]) -> None:
    """Each job is placed while those after it wait, then its pod ends and frees the room for the next."""
    for i, name in enumerate(order):
        await c.wait(lambda: phase(c.job(name)) == "Admitted", 10, f"{name} placed")  # noqa: B023
        assert [phase(c.job(n)) for n in order[i + 1:]] == ["Queued"] * len(order[i + 1:]), name
        await end(c, name)


def classes(*specs: tuple[str, int, bool]) -> Callable[[Cluster], Awaitable[None]]:
    """PriorityClasses made before the operator starts (it lists them at start-up)."""
    async def make(c: Cluster) -> None:
        for name, value, global_default in specs:
            await c.priority_class(name, value, global_default)
    return make


@pytest.mark.cluster
def test_priority_orders_the_queue_before_creation_and_ties_go_by_creation(tmp_path: Path, forecaster: Forecaster) -> None:
    """Three 3 GiB jobs wait for big's GPU: the two of PriorityClass "high" (created after, or with, the one of no
    class) are placed first, the earlier created of them first although its name sorts after; the pod keeps its
    priorityClassName (Kubernetes' eviction order reads it). The queue was FIFO by creation alone."""
    async def scenario() -> None:
        async with gpu_held_by_big(tmp_path, forecaster) as (c, app):
            await c.priority_class("high", 1000)  # after the start: Kopf's watch brings it
            priorities = app.scheduler.priorities
            await c.wait(lambda: priorities.of(job("x", "1Gi", "high")["spec"]).known, 10, "the class watched")
            await c.apply(job("m-low", "3Gi"))
            await c.apply(job("x-high", "3Gi", "high"))
            await asyncio.sleep(1.1)  # creationTimestamp has whole seconds
            await c.apply(job("a-high", "3Gi", "high"))
            await queued(c, "m-low", "x-high", "a-high")
            assert (queue(c, "x-high")["priority"], queue(c, "x-high")["priorityClassName"]) == (1000, "high")
            assert queue(c, "m-low")["priority"] == 0 and "priorityClassName" not in queue(c, "m-low")
            await end(c, "big")
            await placed_in_order(c, ["x-high", "a-high", "m-low"])
            assert c.emu.get("v1/pods", "default", "x-high-tensile")["spec"]["priorityClassName"] == "high"  # type: ignore[index]

    asyncio.run(scenario())


@pytest.mark.cluster
def test_a_global_default_class_applies_to_jobs_that_name_none(tmp_path: Path, forecaster: Forecaster) -> None:
    """No priorityClassName: the PriorityClass with globalDefault (listed at the operator's start) gives the priority,
    as Kubernetes' Priority admission gives it to a pod; so the job passes an earlier one of a lower class."""
    async def scenario() -> None:
        async with gpu_held_by_big(tmp_path, forecaster, classes(("fallback", 500, True), ("low", 100, False))) as (c, _):
            await c.apply(job("a-low", "3Gi", "low"))
            await c.apply(job("b-unset", "3Gi"))
            await queued(c, "a-low", "b-unset")
            assert (queue(c, "b-unset")["priority"], queue(c, "b-unset")["priorityClassName"]) == (500, "fallback")
            assert queue(c, "a-low")["priority"] == 100
            await end(c, "big")
            await placed_in_order(c, ["b-unset", "a-low"])

    asyncio.run(scenario())


@pytest.mark.cluster
def test_a_priority_class_that_does_not_exist_is_said_and_the_job_waits_for_it(tmp_path: Path, forecaster: Forecaster) -> None:
    """Kubernetes would refuse the pod of a priorityClassName no PriorityClass has (it failed at pod creation): the
    job says so with the fix (condition, Warning Event; the webhook warns) and waits queued, unplaced though it fits,
    until the class is created, as a controller's pod creation is retried; then it is placed."""
    async def scenario() -> None:
        async with gpu_held_by_big(tmp_path, forecaster) as (c, app):
            body = job("urgent-job", "512Mi", "urgent")
            await c.apply(body)
            await c.wait(lambda: "PriorityClassNotFound" in events(c, "urgent-job"), 10, "the Warning Event")
            said = next(x for x in c.job("urgent-job")["status"]["conditions"] if x["type"] == "PriorityResolved")  # type: ignore[index]
            assert (said["status"], said["reason"]) == ("False", "PriorityClassNotFound")
            assert "kubectl create priorityclass urgent --value=N" in said["message"]
            assert events(c, "urgent-job")["PriorityClassNotFound"]["type"] == "Warning"
            assert app.scheduler.priorities.warnings(body["spec"]) == [said["message"]]
            assert phase(c.job("urgent-job")) == "Queued" and not c.emu.get("v1/pods", "default", "urgent-job-tensile")
            await c.priority_class("urgent", 10)
            await c.wait(lambda: phase(c.job("urgent-job")) == "Admitted", 10, "placed once the class exists")
            assert "PriorityClassFound" in events(c, "urgent-job")
            assert not app.scheduler.priorities.warnings(body["spec"])

    asyncio.run(scenario())


@pytest.mark.cluster
def test_strict_fifo_keeps_a_later_small_job_from_passing_a_waiting_one(tmp_path: Path, forecaster: Forecaster,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """StrictFIFO: a 512 MiB job that fits waits behind the 2 GiB one created before it (both say so); a later job of
    a higher PriorityClass is ahead of both in the queue and is placed (priorities decide the order, strictness who
    passes within it). Before, the small job was placed at once."""
    monkeypatch.setenv(STRATEGY_ENV, STRICT)

    async def scenario() -> None:
        async with gpu_held_by_big(tmp_path, forecaster, classes(("high", 1000, False))) as (c, _):
            await c.apply(job("head", "2Gi"))
            await queued(c, "head")
            await c.apply(job("small", "512Mi"))
            await c.wait(lambda: admitted(c, "small").get("reason") == "WaitingBehind", 10, "small waits behind head")
            assert queue(c, "small")["waitingBehind"] == ["default/head"] and phase(c.job("small")) == "Queued"
            assert admitted(c, "head")["reason"] == "HoldingRoom" and queue(c, "head")["holding"] == ["GPU-a0"]
            await c.wait(lambda: "HoldingRoom" in events(c, "head"), 10, "head's HoldingRoom Event")  # posted off-path
            assert "holding GPU room on GPU-a0 for default/head" in events(c, "head")["HoldingRoom"]["message"]
            await c.apply(job("urgent", "512Mi", "high"))
            await c.wait(lambda: phase(c.job("urgent")) == "Admitted", 10, "the higher priority placed")
            assert phase(c.job("small")) == "Queued"
            await end(c, "big")
            await c.wait(lambda: phase(c.job("head")) == phase(c.job("small")) == "Admitted", 10, "both placed")

    asyncio.run(scenario())


@pytest.mark.cluster
def test_best_effort_fifo_lets_later_jobs_pass_until_the_heads_wait_bound_then_holds(
        tmp_path: Path, forecaster: Forecaster, monkeypatch: pytest.MonkeyPatch) -> None:
    """BestEffortFIFO with holdHeadAfter 2s: a small later job passes the waiting 2 GiB head; once the head has waited
    at the head 2 s it says it holds GPU room (without other news: the scheduler wakes for it), and the next small
    job waits behind it. Before, small jobs passed it for ever."""
    monkeypatch.setenv(HOLD_ENV, "2s")

    async def scenario() -> None:
        async with gpu_held_by_big(tmp_path, forecaster) as (c, _):
            await c.apply(job("head", "2Gi"))
            await queued(c, "head")
            assert queue(c, "head")["headSince"] and admitted(c, "head")["reason"] == "Queued"
            await c.apply(job("small-1", "256Mi"))
            await c.wait(lambda: phase(c.job("small-1")) == "Admitted", 10, "small-1 passes the head")
            await c.wait(lambda: admitted(c, "head").get("reason") == "HoldingRoom", 8, "the head holds after 2 s")
            await c.wait(lambda: "HoldingRoom" in events(c, "head"), 10, "head's HoldingRoom Event")  # posted off-path
            assert "at the head of the queue for longer than 2s, BestEffortFIFO" in events(c, "head")["HoldingRoom"]["message"]
            await c.apply(job("small-2", "256Mi"))
            await c.wait(lambda: admitted(c, "small-2").get("reason") == "WaitingBehind", 10, "small-2 waits behind")
            assert queue(c, "small-2")["waitingBehind"] == ["default/head"]
            await end(c, "big")
            await c.wait(lambda: phase(c.job("head")) == phase(c.job("small-2")) == "Admitted", 10, "both placed")

    asyncio.run(scenario())


@pytest.mark.parametrize("env,named", [
    ({STRATEGY_ENV: "LIFO"}, "TENSILE_QUEUEING_STRATEGY='LIFO': set BestEffortFIFO"),
    ({HOLD_ENV: "30 minutes"}, "TENSILE_QUEUE_HOLD_HEAD_AFTER='30 minutes': write a duration such as 30m"),
    ({HOLD_ENV: "0s"}, "'0s': write a duration such as 30m, 1h30m or 90s (no zero parts), or never"),
    ({HOLD_ENV: "1d"}, "'1d'"),
])
def test_the_operator_refuses_a_bad_queueing_setting_naming_it_and_the_fix(monkeypatch: pytest.MonkeyPatch, env: dict,
                                                                        named: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TensileUserError, match=re.escape(named)) as caught:
        OperatorApp()
    assert "operator.queueing." in str(caught.value)  # the chart value to fix


@pytest.fixture(scope="module")
def chart() -> Chart:
    with Chart.load(CHART_DIR) as loaded:
        yield loaded


def operator_env(chart: Chart, values: dict) -> dict[str, str]:
    deployment = one(objects(render(chart, values)), "Deployment", "operator")
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}


def test_the_chart_sets_the_queueing_the_operator_reads_and_refuses_bad_values(chart: Chart) -> None:
    assert QueueConfig.from_env(operator_env(chart, {})) == QueueConfig(BEST_EFFORT, 1800.0) == QueueConfig()
    strict = operator_env(chart, {"operator": {"queueing": {"strategy": "StrictFIFO", "holdHeadAfter": "1h30m"}}})
    assert QueueConfig.from_env(strict) == QueueConfig(STRICT, 5400.0)
    assert QueueConfig.from_env(operator_env(chart, {"operator": {"queueing": {"holdHeadAfter": "never"}}})).hold_head_after is None
    for values, field in [({"strategy": "LIFO"}, "/operator/queueing/strategy"),
                          ({"holdHeadAfter": "30 minutes"}, "/operator/queueing/holdHeadAfter"),
                          ({"holdHeadAfter": "0s"}, "/operator/queueing/holdHeadAfter"),
                          ({"holdAfter": "30m"}, "holdAfter")]:
        with pytest.raises(HelmValuesError) as caught:
            render(chart, {"operator": {"queueing": values}})
        assert field in str(caught.value), str(caught.value)
    # the schema's durations are the operator's
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert schema["properties"]["operator"]["properties"]["queueing"]["properties"]["holdHeadAfter"]["pattern"] == DURATION
