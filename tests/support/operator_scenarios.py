"""Steps and reads that operator scenarios share: a job's Events and conditions, its pod started by the test's
kubelet, the operator restarted."""

from __future__ import annotations

import asyncio

from tensile_operator.events import COMPONENT
from tensile_operator.forecasting import Forecaster
from tests.support.operator_harness import Cluster, RunningOperator, phase, start_operator


def events_of(c: Cluster, name: str) -> list[dict]:
    """The operator's Events on TrainingJob `name`, in the order posted."""
    return sorted((e for e in c.emu.items("v1/events") if e.get("source", {}).get("component") == COMPONENT
                   and e["involvedObject"]["name"] == name), key=lambda e: e["eventTime"])


def reasons(c: Cluster, name: str) -> list[str]:
    return [e["reason"] for e in events_of(c, name)]


def conditions(c: Cluster, name: str) -> dict[str, dict]:
    return {x["type"]: x for x in ((c.job(name) or {}).get("status") or {}).get("conditions") or []}


async def running(c: Cluster, name: str) -> dict:
    """The job's pod, started by the test's kubelet."""
    pod = await c.wait(lambda: c.emu.get("v1/pods", "default", f"{name}-tensile"), 30, f"{name}'s pod")
    assert isinstance(pod, dict)
    await c.set_pod_status(pod, {"phase": "Running"})
    await c.wait(lambda: phase(c.job(name)) == "Running", 10, f"{name} running")
    return pod


async def restarted(c: Cluster, op: RunningOperator, forecaster: Forecaster, *jobs: str) -> RunningOperator:
    """The operator stopped and started again, once it has seen `jobs` again and has had time to post."""
    await op.stop()
    op = await start_operator(forecaster)
    await c.wait(lambda: all(op.app.statuses.uids.get(f"default/{j}") for j in jobs), 20, "the jobs seen again")
    await asyncio.sleep(1.0)
    return op
