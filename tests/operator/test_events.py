"""Kubernetes Events on TrainingJobs (what `kubectl describe trainingjob` lists), and a removed TensileNode said on
the jobs placed there. Kopf runs against the emulator, as in test_lifecycle.py."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import kubernetes_validate
import pytest

from tests.support.operator_harness import TN, cluster, phase, simulated_gpu, start_operator, trainingjob
from tensile.knobs import memory_text
from tensile_operator.events import COMPONENT, MAX_MESSAGE, EventRecorder, Said, event_body, transitions
from tensile_operator.forecasting import Forecaster
from tensile_operator.kube import Kube
from tensile_operator.statuses import condition
from tests.support.operator_scenarios import conditions, events_of, reasons, restarted, running

TJP = "/apis/tensile.dev/v1alpha1/namespaces/default/trainingjobs/"
QUALIFIED = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def assert_valid(event: dict, job: dict) -> None:
    """About the job (as `kubectl describe` finds it: kind, name and uid), and what the API server takes: the
    Event schema (strict), and what it checks on an Event with eventTime (pkg/apis/core/validation/events.go)."""
    meta = job["metadata"]
    assert event["involvedObject"] == {"apiVersion": "tensile.dev/v1alpha1", "kind": "TrainingJob",
                                       "namespace": meta["namespace"], "name": meta["name"], "uid": meta["uid"]}
    assert event["metadata"]["namespace"] == meta["namespace"] and event["type"] in ("Normal", "Warning")
    assert re.fullmatch(r"[A-Z][A-Za-z]+", event["reason"]) and event["message"]
    assert QUALIFIED.match(event["reportingComponent"]) and 0 < len(event["reportingInstance"]) <= 128
    assert 0 < len(event["action"]) <= 128 and len(event["message"]) <= MAX_MESSAGE
    assert len(event["metadata"]["name"]) <= 253 and SUBDOMAIN.match(event["metadata"]["name"])
    kubernetes_validate.validate(event, "1.34.0", strict=True)


@pytest.mark.cluster
def test_a_jobs_lifecycle_is_posted_as_events_in_order(tmp_path: Path, forecaster: Forecaster) -> None:
    """`kubectl describe trainingjob` listed no Events: the forecast, the placement, the pod and its end were said
    only in the status. Each is an Event on the job, once (the kubelet's repeated pod updates say nothing new); a
    spec the operator refuses is a Warning."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await c.publish_node("node-a", [simulated_gpu("GPU-a0", 8)])
            op = await start_operator(forecaster)
            try:
                await c.apply(trainingjob("one", "vgg16", 1))
                pod = await running(c, "one")
                await c.set_pod_status(pod, {"phase": "Running"})  # again: nothing new to say
                await c.set_pod_status(pod, {"phase": "Succeeded", "containerStatuses": [
                    {"name": "train", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]})
                await c.wait(lambda: "Succeeded" in reasons(c, "one"), 10, "the end said")
                await asyncio.sleep(0.3)
                job = c.job("one")
                assert job is not None
                events = events_of(c, "one")
                assert [e["reason"] for e in events] == ["Forecast", "Placed", "PodCreated", "Running", "Succeeded"]
                for event in events:
                    assert_valid(event, job)
                    assert event["type"] == "Normal", event
                said = {e["reason"]: e["message"] for e in events}
                assert memory_text(job["status"]["forecast"]["vanillaPeakBytes"]) in said["Forecast"]
                assert "node-a" in said["Placed"] and "GPU-a0" in said["Placed"]
                assert "one-tensile" in said["PodCreated"] and "node-a" in said["Running"]
                assert "exited with 0" in said["Succeeded"]
                await c.apply(trainingjob("bad", None, profile="p", memoryBudget="1Gi", scheduling={"maxSwapRate": 2}))
                await c.wait(lambda: reasons(c, "bad"), 10, "the refusal said")
                [refused] = events_of(c, "bad")
                assert (refused["type"], refused["reason"]) == ("Warning", "InvalidSpec") and "maxSwapRate" in refused["message"]
            finally:
                await op.stop()

    asyncio.run(scenario())


@pytest.mark.cluster
def test_a_queued_job_names_its_shortfall_once_and_a_restart_posts_nothing_again(tmp_path: Path, forecaster: Forecaster) -> None:
    """A queued job's Event names what it lacks; a new shortfall (its budget annotation lowered) and a restarted
    operator (which writes the job's status again) post nothing new. Its placement, once room frees, does; a job
    whose training a deletion stopped ends with a Warning."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await c.publish_node("node-a", [simulated_gpu("GPU-a0", 4)])
            op = await start_operator(forecaster)
            try:
                await c.apply(trainingjob("big", None, profile="p", memoryBudget="3Gi"))
                await c.wait(lambda: phase(c.job("big")) == "Admitted", 20, "big admitted")
                await c.apply(trainingjob("q", None, profile="p", memoryBudget="2Gi"))
                await c.wait(lambda: "Queued" in reasons(c, "q"), 20, "q's Queued Event")
                shortfall = c.job("q")["status"]["queue"]["shortfallBytes"]
                [queued] = [e for e in events_of(c, "q") if e["reason"] == "Queued"]
                assert queued["type"] == "Normal" and f"{memory_text(shortfall)} short" in queued["message"], queued
                await c.annotate("q", {"tensile.dev/memory-budget": "1536Mi"})
                await c.wait(lambda: c.job("q")["status"]["queue"]["shortfallBytes"] != shortfall, 10, "a new shortfall")
                op = await restarted(c, op, forecaster, "q", "big")
                assert reasons(c, "q") == ["NoProfile", "Queued"]
                assert reasons(c, "big") == ["NoProfile", "Placed", "PodCreated"]
                await c.delete("big")
                await c.wait(lambda: "PodCreated" in reasons(c, "q"), 20, "q placed once big is gone")
                assert reasons(c, "q") == ["NoProfile", "Queued", "Placed", "PodCreated"]
                end = events_of(c, "big")[-1]
                assert end["type"] == "Warning" and end["reason"] in ("Deleted", "PodDeleted"), end
            finally:
                await op.stop()

    asyncio.run(scenario())


@pytest.mark.cluster
def test_an_event_the_api_server_refuses_does_not_stop_the_job(tmp_path: Path, forecaster: Forecaster) -> None:
    """Events are a courtesy: with every Event refused (500), the job is still placed, its pod made, and followed."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            c.emu.refuse("v1/events", 500)
            await c.publish_node("node-a", [simulated_gpu("GPU-a0", 4)])
            op = await start_operator(forecaster)
            try:
                await c.apply(trainingjob("x", None, profile="p", memoryBudget="1Gi"))
                await running(c, "x")
                tried = [e["reason"] for e in c.emu.refusals if e.get("source", {}).get("component") == COMPONENT]
                assert tried[:3] == ["NoProfile", "Placed", "PodCreated"], tried
                assert not c.emu.items("v1/events")
            finally:
                await op.stop()

    asyncio.run(scenario())


@pytest.mark.cluster
def test_a_removed_tensilenode_is_said_on_its_jobs_which_keep_running(tmp_path: Path, forecaster: Forecaster) -> None:
    """A TensileNode deleted (node drained or deleted, agent uninstalled) left the jobs placed there saying nothing.
    They say so (`NodeAvailable=False`, `TensileNodeRemoved`, the node named, a Warning Event), keep their pod and
    their booking, and no job is placed there until it is published again (then `NodeAvailable=True`)."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await c.publish_node("node-a", [simulated_gpu("GPU-a0", 8)])
            await c.publish_node("node-b", [simulated_gpu("GPU-b0", 1)])
            op = await start_operator(forecaster)
            try:
                await c.apply(trainingjob("r", None, profile="p", memoryBudget="2Gi"))
                await running(c, "r")
                await c.request("DELETE", "/apis/tensile.dev/v1alpha1/tensilenodes/node-a", status_ok=(200, 202))
                await c.wait(lambda: "NodeAvailable" in conditions(c, "r"), 10, "the removal said on r")
                said = conditions(c, "r")["NodeAvailable"]
                assert (said["status"], said["reason"]) == ("False", "TensileNodeRemoved") and "node-a" in said["message"]
                await c.wait(lambda: "TensileNodeRemoved" in reasons(c, "r"), 10, "its Event")
                [event] = [e for e in events_of(c, "r") if e["reason"] == "TensileNodeRemoved"]
                assert event["type"] == "Warning" and "node-a" in event["message"]
                pod = c.emu.get("v1/pods", "default", "r-tensile")
                assert pod is not None and not pod["metadata"].get("deletionTimestamp")  # training goes on
                assert phase(c.job("r")) == "Running" and "default/r" in op.app.capacity.ledger.bookings
                await c.apply(trainingjob("w", None, profile="p", memoryBudget="2Gi"))
                await c.wait(lambda: phase(c.job("w")) == "Queued" and "queue" in c.job("w")["status"], 10, "w queued")
                assert "node-a" not in c.job("w")["status"]["queue"]["reason"]
                await c.publish_node("node-a", [simulated_gpu("GPU-a0", 8)])
                await c.wait(lambda: conditions(c, "r")["NodeAvailable"]["status"] == "True", 10, "the node back, said")
                assert conditions(c, "r")["NodeAvailable"]["reason"] == "TensileNodePublished"
                await c.wait(lambda: phase(c.job("w")) == "Admitted", 10, "w placed on node-a")
                assert c.job("w")["status"]["placement"]["node"] == "node-a"
                await c.publish_node("node-a", [simulated_gpu("GPU-a0", 8)])  # a heartbeat: nothing new
                await asyncio.sleep(0.3)
                assert reasons(c, "r")[-2:] == ["TensileNodeRemoved", "TensileNodePublished"]
                assert reasons(c, "r").count("TensileNodePublished") == 1
            finally:
                await op.stop()

    asyncio.run(scenario())


@pytest.mark.cluster
def test_a_tensilenode_removed_while_no_operator_ran_is_said_at_start(tmp_path: Path, forecaster: Forecaster) -> None:
    """Removed while the operator was down, the node is said by the next one at start-up, and once: a further
    restart finds it said."""

    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await c.publish_node("node-a", [simulated_gpu("GPU-a0", 8)])
            op = await start_operator(forecaster)
            try:
                await c.apply(trainingjob("r", None, profile="p", memoryBudget="2Gi"))
                await running(c, "r")
                await op.stop()
                await c.request("DELETE", "/apis/tensile.dev/v1alpha1/tensilenodes/node-a", status_ok=(200, 202))
                assert c.emu.get(TN, None, "node-a") is None
                op = await start_operator(forecaster)
                await c.wait(lambda: "TensileNodeRemoved" in reasons(c, "r"), 10, "the removal said at start")
                said = conditions(c, "r")
                assert said["NodeAvailable"]["reason"] == "TensileNodeRemoved" and said["PodRunning"]["status"] == "True"
                op = await restarted(c, op, forecaster, "r")
                assert reasons(c, "r").count("TensileNodeRemoved") == 1 and c.emu.get("v1/pods", "default", "r-tensile")
            finally:
                await op.stop()

    asyncio.run(scenario())


def test_transitions_say_each_change_once_and_an_end_as_its_end() -> None:
    """What the Events are made of: a condition written again as it was, or a queue's shortfall that moved, says
    nothing; a job's end is one Event (not also its `PodRunning=False`), a Warning unless it succeeded."""
    queued = condition("Admitted", False, "Queued", "1.0 GiB short")
    assert [s.reason for s in transitions([], [queued])] == ["Queued"]
    assert transitions([queued], [condition("Admitted", False, "Queued", "0.5 GiB short")]) == []
    running = condition("PodRunning", True, "Running", "pod x is running on node-a")
    assert transitions([running], [running]) == []
    ended = [condition("PodRunning", False, "Evicted", "evicted"), condition("Finished", True, "Evicted", "evicted")]
    assert transitions([running], ended, failing=True) == [Said("Warning", "Evicted", "evicted", "Finished")]
    done = [condition("PodRunning", False, "Completed", "ok"), condition("Finished", True, "Completed", "ok")]
    assert transitions([running], done) == [Said("Normal", "Succeeded", "ok", "Finished")]
    pulling = condition("PodRunning", False, "ImagePullBackOff", "pod x cannot start")
    assert transitions([], [pulling]) == [Said("Warning", "ImagePullBackOff", "pod x cannot start", "PodRunning")]
    assert transitions([], [condition("Validated", True, "Valid")]) == []


def test_an_events_name_and_message_are_what_the_api_server_takes() -> None:
    """A job name of 253 characters (the most a TrainingJob may have) and a long message still make a valid Event."""
    recorder = EventRecorder(Kube())
    name = recorder._name("a" * 250 + "-b.c")
    assert len(name) <= 253 and SUBDOMAIN.match(name) and recorder._name("x") < recorder._name("x")
    body = event_body("default", "j", "u", Said("Warning", "PodFailed", "m" * 5000, "Finished"), "j.1", "host")
    assert len(body["message"]) <= MAX_MESSAGE
    kubernetes_validate.validate(body, "1.34.0", strict=True)
