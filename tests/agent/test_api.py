"""The node agent served for real (uvicorn on 127.0.0.1) with hook clients (tensile.agent_client) in threads."""

from __future__ import annotations

import concurrent.futures as cf
import gzip
import json
import threading
import time
import warnings

import pytest
from tests.support.agent_harness import call, get

from tensile import agent_client
from tensile.agent_client import AgentClient
from tensile.agent_contract import MAX_SMALL_BYTES, REPLAN_REASONS, ContractError, Measurements
from tensile.latency import UncalibratedWarning
from tensile_agent.gpus import Inventory
from tensile_agent.server import Agent, AgentConfig
from tensile.peak import analyze_vanilla
from tensile.workload_io import workload_to_dict

TOKEN = "t" * 32


def register(url, workload, job="a", namespace="ns", **extra):  # type: ignore[no-untyped-def]
    client = AgentClient(url, f"{namespace}/{job}", token=extra.pop("token", None), max_backoff=0.2)
    response = client.register(workload=workload, **extra)
    assert response is not None
    return client


def test_register_plan_measure_unregister(agent_server, tiny_workload):
    server = agent_server()
    client = register(server.url, tiny_workload(), memory_budget_bytes=6 * 2**20)
    assert client.registered.created and client.registered.gpu.startswith("SIM-")
    plan = client.wait_for_plan(30)
    assert plan.status == "planned" and plan.version == 1 and plan.co_planned == ["ns/a"]
    assert plan.plan["signature"] == tiny_workload().signature and plan.plan["forecast"]["scheduled_peak_bytes"] > 0
    # unchanged: a conditional fetch is a 304 and the client keeps what it has
    etag = client._etag
    status, _ = get(server.url, "/v1/jobs/ns/a/plan", client.token, {"If-None-Match": etag})
    assert status == 304
    assert client.poll()[1] is False and client.current_plan.version == 1
    answer = client.post_measurements(Measurements(plan_version=1, peak_bytes=5_000_000, iteration_seconds=0.2,
                                                   stall_seconds=0.02, swap_out_bytes=100, swap_in_bytes=90, recompute_bytes=7))
    assert answer.accepted and not answer.replan
    status, jobs = get(server.url, "/v1/jobs")
    (view,) = jobs["jobs"]
    assert "token" not in json.dumps(view)
    # no EOR without a vanilla time from the hook (0.2 / (0.2 - stalls) was no overhead rate: test_accounting.py)
    assert view["observed"]["peak_bytes"] == 5_000_000 and view["observed"]["eor"] is None
    # the operator's calls
    assert agent_client.update_knobs(server.url, "ns/a", client.token, {"maxSwapRate": 0.5})["replanning"] is True
    server.idle()
    assert agent_client.live_workload(server.url, "ns/a", client.token).signature == tiny_workload().signature
    assert agent_client.unregister(server.url, "ns/a", client.token)
    assert get(server.url, "/v1/jobs")[1]["jobs"] == []
    assert agent_client.unregister(server.url, "ns/a", client.token)  # gone already: fine


def test_a_job_on_a_gpu_without_a_latency_model_says_so_in_its_view_and_warns_nobody(agent_server, tiny_workload,
                                                                                     tmp_path, monkeypatch):
    """Every registration on a GPU no calibrated latency model covers would warn the same UncalibratedWarning into the
    agent's log; the job's view says which source its latencies came from instead."""
    monkeypatch.setenv("TENSILE_HOME", str(tmp_path))  # no latency model calibrated on this machine counts
    server = agent_server(["a6000:48GiB"])
    with warnings.catch_warnings(record=True) as caught:  # the agent serves in a thread of this process
        warnings.simplefilter("always")
        client = register(server.url, tiny_workload())
        client.wait_for_plan(30)
    view = get(server.url, "/v1/jobs/ns/a", client.token)[1]
    assert view["latency_source"] == "prior"
    assert not [w for w in caught if issubclass(w.category, UncalibratedWarning)], [str(w.message) for w in caught]


def test_safety_tokens_404_413_422(agent_server, tiny_workload):
    server = agent_server()
    url = server.url
    client = register(url, tiny_workload(), token=TOKEN)
    assert client.token == TOKEN
    status, body = get(url, "/v1/jobs/ns/a/plan")
    assert (status, body["code"]) == (401, "missing_token")
    status, body = get(url, "/v1/jobs/ns/a/plan", "x" * 32)
    assert (status, body["code"]) == (403, "wrong_token")
    status, body = get(url, "/v1/jobs/ns/nobody/plan", TOKEN)
    assert (status, body["code"]) == (404, "unknown_job") and "register" in body["detail"]
    # someone else registering the same job under another token is refused
    status, body = call(url, "POST", "/v1/jobs", {"job": "a", "namespace": "ns", "signature": tiny_workload().signature, "token": "y" * 32})
    assert status == 403
    status, body = call(url, "POST", "/v1/jobs", {"job": "b", "signature": tiny_workload().signature, "gpu": "GPU-nope"})
    assert (status, body["code"]) == (404, "unknown_gpu") and "SIM-" in body["detail"]
    # malformed
    weird = workload_to_dict(tiny_workload())
    weird["ops"] = [list(row) for row in weird["ops"]]
    weird["ops"][0][10] = "slow"  # a latency that is not a number
    for bad in ({"job": "b", "workload": weird}, {"job": "b"}, {"job": "b", "workload": {"format": "x"}}, {"job": "b", "signature": "abcdef01", "max_swap_rate": 3},
                {"job": "b", "workload": workload_to_dict(tiny_workload()) | {"ops": [["aten::mm", "forward", [999], [], [], [], [], [], 0, 0, 0]]}}):
        status, body = call(url, "POST", "/v1/jobs", bad)
        assert status == 422, (bad, body)
    status, _ = call(url, "POST", "/v1/jobs", raw=b"{not json", headers={"Content-Type": "application/json"})
    assert status == 422
    status, _ = call(url, "POST", "/v1/jobs/ns/a/measurements", {"op_latencies": [[10_000, 0.1]]}, TOKEN)
    assert status == 422
    # oversized, plain and as a gzip bomb
    status, body = call(url, "PATCH", "/v1/jobs/ns/a/knobs", raw=b"{" + b" " * (MAX_SMALL_BYTES + 10) + b"}", token=TOKEN,
                        headers={"Content-Type": "application/json"})
    assert (status, body["code"]) == (413, "too_large")
    bomb = gzip.compress(b"[" + b"0," * (10 * 1024**2) + b"0]")  # 20 MiB inflated
    status, body = call(url, "POST", "/v1/jobs/ns/a/measurements", raw=bomb, token=TOKEN,
                        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 413
    # a gzip body within the caps is fine
    raw = gzip.compress(json.dumps({"iterations": 2, "peak_bytes": 1}).encode())
    status, body = call(url, "POST", "/v1/jobs/ns/a/measurements", raw=raw, token=TOKEN,
                        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 200 and body["accepted"]


def test_no_nvml_means_no_gpus_with_a_reason(tiny_workload):
    agent = Agent(AgentConfig(), inventory=Inventory.discover())  # this machine has no NVIDIA driver
    assert agent.inventory.gpus == {} and "NVML" in agent.inventory.reason
    from tests.support.agent_harness import ThreadedAgent

    with ThreadedAgent(simulate=[]) as server:
        status, body = get(server.url, "/v1/gpus")
        assert status == 200 and body["gpus"] == [] and "NVML" in body["reason"]
        status, body = call(server.url, "POST", "/v1/jobs", {"job": "a", "signature": "abcdef01"})
        assert (status, body["code"]) == (404, "no_gpus") and "NVML" in body["detail"]
        assert "tensile_agent_gpus 0.0" in get(server.url, "/metrics")[1]


def test_signature_only_then_upload(agent_server, tiny_workload):
    server = agent_server(["h100:80GiB", "a6000:48GiB"])
    w = tiny_workload()
    client = AgentClient(server.url, "ns/sig", gpu="1")
    response = client.register(signature=w.signature)
    assert response.status == "needs_workload" and response.gpu.endswith("-1")
    assert client.upload_workload(w).status == "planning"
    assert client.wait_for_plan(30).status == "planned"
    # the agent now knows the signature: another job registers by it alone
    other = AgentClient(server.url, "ns/sig2", gpu="1")
    assert other.register(signature=w.signature) is not None
    assert other.wait_for_plan(30).status == "planned"
    status, gpus = get(server.url, "/v1/gpus")
    assert all(g["simulated"] for g in gpus["gpus"]) and gpus["gpus"][1]["jobs_count"] == 2


def test_many_concurrent_hooks_and_one_global_round(agent_server, tiny_workload):
    """48 hook clients on 2 GPUs register, poll and post at once; each GPU's final plans come from one
    planning round over all its jobs."""
    server = agent_server(["a6000:48GiB", "a6000:48GiB"])
    calls: list[list[str]] = []
    planner = server.agent.planning.planner

    def spy(specs, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(sorted(s.name for s in specs))
        return planner(specs, *args, **kwargs)

    server.agent.planning.planner = spy
    workloads = [tiny_workload(4), tiny_workload(8)]
    errors: list[BaseException] = []
    clients: list[AgentClient] = []
    lock = threading.Lock()

    def hook(i: int) -> None:
        try:
            client = AgentClient(server.url, f"team/job-{i}", gpu=str(i % 2), timeout=10)
            assert client.register(workload=workloads[i % 2], max_swap_rate=1.0) is not None
            with lock:
                clients.append(client)
            for step in range(5):
                client.poll()
                client.post_measurements(Measurements(plan_version=client.plan_version, peak_bytes=1000 + step,
                                                      iteration_seconds=0.01, swap_out_bytes=1, swap_in_bytes=1))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with cf.ThreadPoolExecutor(48) as pool:
        list(pool.map(hook, range(48)))
    assert not errors, errors[:3]
    server.idle()
    for gpu in ("0", "1"):
        mine = [c for c in clients if c.registered.gpu.endswith(f"-{gpu}")]
        answers = [c.fetch_plan() for c in mine]
        names = sorted(c.ref.key for c in mine)
        assert len(mine) == 24
        assert {a.round for a in answers} == {answers[0].round}, "co-located plans come from one round"
        assert all(sorted(a.co_planned) == names for a in answers)
        assert names in calls  # the planner saw all of the GPU's jobs at once
        assert all(a.status == "planned" and a.plan["job"] == f"{a.namespace}/{a.job}" for a in answers)
    status, jobs = get(server.url, "/v1/jobs")
    assert len(jobs["jobs"]) == 48 and all(j["observed"]["iterations"] == 5 for j in jobs["jobs"])


def test_drifted_latency_triggers_exactly_one_replan(agent_server, tiny_workload):
    server = agent_server()
    w = tiny_workload()
    clients = [register(server.url, w, job=f"d{i}") for i in range(2)]
    for c in clients:
        c.wait_for_plan(30)
    server.idle()
    state = server.agent.state
    gpu = clients[0].registered.gpu
    rounds_before = state.rounds[gpu].round
    slow = [[op.index, max(op.latency, 1e-6) * 3.0] for op in w.ops]  # every op 3x slower than planned
    answers = []
    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: clients[0].post_measurements(Measurements(op_latencies=slow, iteration_seconds=0.1)), range(12)))
    server.idle()
    assert sum(a.replan for a in answers) == 1
    assert state.replans[(gpu, "drift")] == 1
    assert state.rounds[gpu].round == rounds_before + 1
    # the other job was re-planned in the same round, with its own latencies
    assert {state.jobs[c.ref.key].round for c in clients} == {rounds_before + 1}
    # steady measurements at the new speed do not re-plan again
    for _ in range(5):
        assert not clients[0].post_measurements(Measurements(op_latencies=slow)).replan
    server.idle()
    assert state.replans[(gpu, "drift")] == 1


def test_metrics_series_and_cardinality(agent_server, tiny_workload):
    server = agent_server()
    clients = [register(server.url, tiny_workload(), job=f"m{i}") for i in range(3)]
    for c in clients:
        c.wait_for_plan(30)
        c.post_measurements(Measurements(peak_bytes=123, iteration_seconds=0.5, stall_seconds=0.1, swap_out_bytes=7,
                                         swap_in_bytes=6, recompute_bytes=5, plan_version=c.plan_version))
    server.idle()
    text = get(server.url, "/metrics")[1]
    gpu = clients[0].registered.gpu
    for line in (f'tensile_gpu_capacity_bytes{{gpu="{gpu}"}}', f'tensile_gpu_jobs{{gpu="{gpu}"}} 3.0',
                 f'tensile_job_observed_peak_bytes{{gpu="{gpu}",job="m0",namespace="ns"}} 123.0',
                 f'tensile_job_swapped_bytes_total{{direction="out",gpu="{gpu}",job="m1",namespace="ns"}} 7.0',
                 f'tensile_job_recomputed_bytes_total{{gpu="{gpu}",job="m2",namespace="ns"}} 5.0',
                 'tensile_job_stall_seconds_total{', 'tensile_job_forecast_eor_ratio{', 'tensile_job_plan_version{',
                 'tensile_job_silent_seconds{',
                 'tensile_job_forecast_scheduled_peak_bytes{', 'tensile_gpu_forecast_vanilla_peak_bytes{',
                 f'tensile_agent_replans_total{{gpu="{gpu}",reason="register"}}', 'simulated="true"'):
        assert line in text, line
    for c in clients[:2]:
        assert c.unregister()
    server.idle()
    text = get(server.url, "/metrics")[1]
    assert 'job="m0"' not in text and 'job="m1"' not in text and 'job="m2"' in text
    assert f'tensile_agent_replans_total{{gpu="{gpu}",reason="unregister"}}' in text


def _gauge(text: str, metric: str, job: str) -> float | None:
    """A per-job gauge's value in /metrics text, None when the series is absent."""
    line = next((l for l in text.splitlines() if l.startswith(metric + "{") and f'job="{job}"' in l), None)
    return None if line is None else float(line.split()[-1])


def test_the_peak_under_plan_is_folded_apart_from_the_peak_of_every_iteration(agent_server, tiny_workload):
    """A post of the unplanned first iterations (at the vanilla peak), then one under the plan: the job keeps
    the higher peak of all and the peak under the plan apart, in /v1/jobs and /metrics; an older hook's post
    without planned_peak_bytes is accepted and leaves the peak under the plan as it was."""
    server = agent_server()
    client = register(server.url, tiny_workload())
    client.wait_for_plan(30)
    recorded = Measurements.from_iterations([{"mode": "recording", "peak_bytes": 9_000_000}] * 2)
    planned = Measurements.from_iterations([{"mode": "planned", "peak_bytes": 6_000_000, "plan_version": 1},
                                            {"mode": "planned", "peak_bytes": 7_000_000, "peak_source": "planned"}])
    assert client.post_measurements(recorded).accepted
    metrics = get(server.url, "/metrics")[1]
    assert _gauge(metrics, "tensile_job_observed_peak_bytes", "a") == 9e6
    assert _gauge(metrics, "tensile_job_observed_planned_peak_bytes", "a") is None  # nothing under a plan yet
    assert client.post_measurements(planned).accepted
    older = {"plan_version": 1, "iterations": 1, "peak_bytes": 8_000_000, "iteration_seconds": 0.1}
    assert call(server.url, "POST", "/v1/jobs/ns/a/measurements", older, client.token)[0] == 200
    (view,) = get(server.url, "/v1/jobs")[1]["jobs"]
    assert (view["observed"]["peak_bytes"], view["observed"]["planned_peak_bytes"]) == (9_000_000, 6_000_000)
    metrics = get(server.url, "/metrics")[1]
    assert _gauge(metrics, "tensile_job_observed_peak_bytes", "a") == 9e6
    assert _gauge(metrics, "tensile_job_observed_planned_peak_bytes", "a") == 6e6
    assert ("# HELP tensile_job_observed_planned_peak_bytes Highest memory peak the hook measured in iterations under the "
            "current plan: compare with the forecast scheduled peak") in metrics


def test_the_reserved_peak_is_exported_once_the_hook_sends_it(agent_server, tiny_workload):
    """What the process held (CUDA: max_memory_reserved) beside its tensors' peak: absent until a hook sends it (an
    older hook never does), then the highest sent."""
    server = agent_server()
    client = register(server.url, tiny_workload())
    client.wait_for_plan(30)
    older = Measurements.from_iterations([{"mode": "recording", "peak_bytes": 9_000_000}])
    assert client.post_measurements(older).accepted
    assert _gauge(get(server.url, "/metrics")[1], "tensile_job_observed_reserved_peak_bytes", "a") is None
    for reserved in (12_000_000, 10_000_000):
        sent = Measurements.from_iterations([{"mode": "recording", "peak_bytes": 9_000_000,
                                              "reserved_bytes": reserved}])
        assert client.post_measurements(sent).accepted
    (view,) = get(server.url, "/v1/jobs")[1]["jobs"]
    assert view["observed"]["reserved_peak_bytes"] == 12_000_000
    assert _gauge(get(server.url, "/metrics")[1], "tensile_job_observed_reserved_peak_bytes", "a") == 12e6


def test_out_of_memory_retries_are_totalled_and_exported_as_a_counter(agent_server, tiny_workload):
    """The out-of-memory errors the hook's guard retried add up over posts, in /v1/jobs and as a per-job counter that
    starts at 0 (rate() counts the first retry); an older hook's post without them adds none."""
    server = agent_server()
    client = register(server.url, tiny_workload())
    client.wait_for_plan(30)
    assert _gauge(get(server.url, "/metrics")[1], "tensile_job_out_of_memory_retries_total", "a") == 0
    for retries in ([2, 0], [1]):
        sent = Measurements.from_iterations([{"mode": "planned", "peak_bytes": 6_000_000, "out_of_memory_retries": r}
                                             for r in retries])
        assert client.post_measurements(sent).accepted
    older = {"plan_version": 1, "iterations": 1, "peak_bytes": 6_000_000, "iteration_seconds": 0.1}
    assert call(server.url, "POST", "/v1/jobs/ns/a/measurements", older, client.token)[0] == 200
    (view,) = get(server.url, "/v1/jobs")[1]["jobs"]
    assert view["observed"]["out_of_memory_retries"] == 3
    metrics = get(server.url, "/metrics")[1]
    assert _gauge(metrics, "tensile_job_out_of_memory_retries_total", "a") == 3
    assert "# TYPE tensile_job_out_of_memory_retries_total counter" in metrics


def test_the_peak_under_plan_is_that_of_the_current_plan_version(agent_server, tiny_workload):
    """After a re-plan the figure compared with the new forecast starts over from the first post under the new
    version (not the max since registration); a late post under the older plan is ignored."""
    server = agent_server()
    client = register(server.url, tiny_workload(1024))
    forecast = client.wait_for_plan(30).plan["forecast"]
    client.post_measurements(Measurements(plan_version=1, planned_peak_bytes=9_000_000))
    assert client.update_knobs(memory_budget_bytes=int(forecast["scheduled_peak_bytes"] * 0.7))["replanning"]
    assert client.wait_for_plan(30, min_version=2).version == 2
    client.post_measurements(Measurements(plan_version=2, planned_peak_bytes=5_000_000))
    client.post_measurements(Measurements(plan_version=1, planned_peak_bytes=8_000_000))  # late, under plan 1
    assert _gauge(get(server.url, "/metrics")[1], "tensile_job_observed_planned_peak_bytes", "a") == 5e6
    client.post_measurements(Measurements(plan_version=2, planned_peak_bytes=6_000_000))
    (view,) = get(server.url, "/v1/jobs")[1]["jobs"]
    assert view["observed"]["planned_peak_bytes"] == 6_000_000


def test_replan_counters_start_at_zero_for_every_reason(agent_server):
    """A series that appears at 1 is invisible to rate()/increase(): every reason of every GPU is there at 0."""
    server = agent_server(simulate=["a:1GiB", "b:1GiB"])
    text = get(server.url, "/metrics")[1]
    gpus = list(server.agent.state.inventory.gpus)
    assert len(gpus) == 2
    for gpu in gpus:
        for reason in REPLAN_REASONS:
            assert f'tensile_agent_replans_total{{gpu="{gpu}",reason="{reason}"}} 0.0' in text, (gpu, reason)


def test_knobs_replan_and_reregister_is_idempotent(agent_server, tiny_workload):
    server = agent_server()
    client = register(server.url, tiny_workload())
    client.wait_for_plan(30)
    server.idle()
    state = server.agent.state
    gpu = client.registered.gpu
    again = client.register(workload=tiny_workload())  # a retry that changes nothing
    assert again.created is False
    server.idle()
    assert state.replans[(gpu, "register")] == 1
    view = client.update_knobs(max_swap_rate=0.5, recompute=False)
    assert view["max_swap_rate"] == 0.5 and view["replanning"] is True
    server.idle()
    assert state.replans[(gpu, "knobs")] == 1
    with pytest.raises(ContractError):
        client.update_knobs(max_swap_rate=5)
    status, body = call(server.url, "PATCH", "/v1/jobs/ns/a/knobs", {"max_swap_rate": 5}, client.token)
    assert status == 422


def test_a_registration_the_client_retried_after_its_timeout_is_the_same_registration(agent_server, tiny_workload,
                                                                                      monkeypatch):
    """On a loaded machine the agent answered a registration after the client's timeout; the client sent it again, and
    the agent, which had registered the first under a token of its own, refused the retry (403 "registered already,
    under another token"): the job planned without its agent. A retried registration carries the same credential."""
    server = agent_server()
    service = server.agent.service
    answer = service.register
    calls: list[float] = []

    def slow_at_first(request, authorization=None):  # type: ignore[no-untyped-def]
        calls.append(time.monotonic())
        done = answer(request, authorization)
        if len(calls) == 1:
            time.sleep(0.6)  # past the client's 0.3 s: the first answer is lost, the job registered all the same
        return done

    monkeypatch.setattr(service, "register", slow_at_first)
    client = AgentClient(server.url, "ns/slow", timeout=0.3, retries=2, max_backoff=0.2)
    registered = client.register(workload=tiny_workload())
    assert registered is not None and len(calls) >= 2
    assert client.wait_for_plan(30) is not None and client.last_error is None
    (job,) = get(server.url, "/v1/jobs")[1]["jobs"]  # type: ignore[index]
    assert (job["namespace"], job["job"]) == ("ns", "slow")  # one job, however often its registration was sent


@pytest.mark.parametrize("planning", ["thread", "process"])
def test_a_job_registered_activations_only_gets_activation_swaps_only(agent_server, tiny_workload, planning):
    """What a hook on CUDA asks for (TENSILE_PLAN_EVENTS auto): no event on parameters, optimizer state or the
    batch and no recompute, planned in the agent's thread and in its child process alike. The same job
    without the flag recomputes under the same budget; registering again with the flag changed re-plans."""
    server = agent_server(planning=planning)
    workload = tiny_workload(1024)  # activations of 2 MiB: above the planner's smallest swap
    budget = analyze_vanilla(workload).peak_bytes // 2

    def planned(client: AgentClient) -> tuple[set[str], set[str]]:
        server.idle()
        plan = client.wait_for_plan(60).plan_object()
        return {e.kind for e in plan.events}, {workload.tensors[e.tensor].role for e in plan.events if e.kind != "release"}

    native = register(server.url, workload, job="native", memory_budget_bytes=budget, activations_only=True)
    every = register(server.url, workload, job="every", memory_budget_bytes=budget)
    kinds, roles = planned(native)
    assert "recompute" not in kinds and not roles & {"param", "optimizer_state", "input"}, (kinds, roles)
    assert "recompute" in planned(every)[0]
    views = {j["job"]: j for j in get(server.url, "/v1/jobs")[1]["jobs"]}
    assert views["native"]["activations_only"] is True and views["every"]["activations_only"] is False
    version = every.plan_version
    assert every.register(workload=workload, memory_budget_bytes=budget, activations_only=True).created is False
    server.idle()
    assert every.wait_for_plan(60, min_version=version + 1).version > version
    assert "recompute" not in planned(every)[0]


def test_cluster_publisher_writes_tensilenode_and_observed(tiny_workload):
    class FakeApi:
        def __init__(self) -> None:
            self.objects: dict = {}
            self.calls: list = []

        def get_cluster_custom_object(self, group, version, plural, name):  # type: ignore[no-untyped-def]
            if name not in self.objects:
                error = Exception("not found")
                error.status = 404  # type: ignore[attr-defined]
                raise error
            return self.objects[name]

        def create_cluster_custom_object(self, group, version, plural, body):  # type: ignore[no-untyped-def]
            self.objects[body["metadata"]["name"]] = body

        def patch_cluster_custom_object_status(self, group, version, plural, name, body):  # type: ignore[no-untyped-def]
            self.objects[name]["status"] = body["status"]

        def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body):  # type: ignore[no-untyped-def]
            self.calls.append((namespace, plural, name, body))

    from tests.support.agent_harness import free_port

    api = FakeApi()
    agent = Agent(AgentConfig(port=free_port(), simulate=["a6000:48GiB"], node="gpu-node-1", advertise="http://10.0.0.5:8470"),
                  cluster_api=api)
    from tensile.agent_contract import RegisterRequest

    agent.planning.start()
    try:
        agent.service.register(RegisterRequest(job="j", namespace="ns", workload=workload_to_dict(tiny_workload())))
        assert agent.planning.wait_idle(30)
        job = agent.state.jobs["ns/j"]
        agent.service.measurements(job, Measurements(peak_bytes=99, iteration_seconds=0.1))
        agent.publisher.publish()
    finally:
        agent.planning.stop()
    node = api.objects["gpu-node-1"]
    assert node["spec"]["nodeName"] == "gpu-node-1"
    (gpu,) = node["status"]["gpus"]
    assert node["status"]["agentAddress"] == "http://10.0.0.5:8470" and gpu["simulated"] is True
    assert gpu["jobs"][0]["job"] == "ns/j" and gpu["committed"]["scheduledPeakBytes"] > 0
    assert api.calls[0][:3] == ("ns", "trainingjobs", "j") and api.calls[0][3]["status"]["observed"]["peakBytes"] == 99
    from tensile_operator.placement import gpus_from_tensilenode

    (seen,) = gpus_from_tensilenode(node)
    assert seen.uuid == gpu["uuid"] and seen.agent == "http://10.0.0.5:8470" and seen.capacity_bytes == gpu["capacityBytes"]


def test_cli_parses_agent_options():
    from tensile.cli import build_parser
    from tensile_agent.server import config_from_args

    args = build_parser().parse_args(["agent", "--port", "0", "--simulate-gpu", "a6000:48GiB", "--simulate-gpu", "x:1GB"])
    config = config_from_args(args)
    assert config.simulate == ["a6000:48GiB", "x:1GB"] and config.host == "127.0.0.1"
    agent = Agent(config)
    assert [g.memory_bytes for g in agent.inventory.gpus.values()] == [48 * 2**30, 10**9]


def test_client_keeps_plan_and_backs_off_when_agent_is_gone(tiny_workload):
    from tests.support.agent_harness import ThreadedAgent

    with ThreadedAgent() as server:
        client = AgentClient(server.url, "ns/gone", timeout=0.5, retries=1, backoff=0.01, max_backoff=0.2)
        client.register(workload=tiny_workload())
        assert client.wait_for_plan(30).version == 1
    started = time.monotonic()
    for _ in range(20):
        plan, changed = client.poll()
        assert plan is not None and plan.version == 1 and not changed
        assert client.post_measurements(Measurements(peak_bytes=1)) is None
    assert time.monotonic() - started < 5  # the quiet period keeps calls from waiting on a dead agent
    assert not client.reachable and client.last_error
    with pytest.raises(ContractError):  # refused before any I/O
        AgentClient("http://127.0.0.1:9", "ns/x").update_knobs(max_swap_rate=7)


def test_a_failing_planner_fails_the_round_not_the_agent(agent_server, tiny_workload):
    server = agent_server()

    def boom(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("planner exploded")

    server.agent.planning.planner = boom
    client = register(server.url, tiny_workload())
    answer = client.wait_for_plan(30)
    assert answer.status == "failed" and "planner exploded" in answer.message and answer.plan is None
    assert get(server.url, "/healthz")[0] == 200 and get(server.url, "/metrics")[0] == 200


def test_an_external_job_silent_for_too_long_is_dropped_and_comes_back_when_it_calls(agent_server, tiny_workload):
    """A hook that registered by itself and was killed (SIGKILL) before it could unregister left its job, and the
    job's scheduled peak on the GPU, for the agent's life. Now an external job silent for
    `expire_silent` seconds is dropped; a live hook's polls keep it, the operator's jobs are never dropped so,
    and a hook that was only silent registers again at its next call."""
    agent = agent_server(expire_silent=0.4)
    workload = tiny_workload()
    clients = {name: AgentClient(agent.url, f"ns/{name}", max_backoff=0.2) for name in ("polling", "killed", "placed")}
    for name, client in clients.items():
        assert client.register(workload=workload, external=name != "placed") is not None

    def listed() -> set[str]:
        return {job["job"] for job in get(agent.url, "/v1/jobs")[1]["jobs"]}

    deadline = time.monotonic() + 10
    while "killed" in listed():  # the polling hook calls every 50 ms meanwhile
        assert time.monotonic() < deadline, "the silent external job was never dropped"
        assert clients["polling"].fetch_plan() is not None
        time.sleep(0.05)
    assert listed() == {"polling", "placed"}
    assert clients["killed"].fetch_plan() is not None  # only silent after all: registered again
    assert "killed" in listed() and clients["killed"].registrations == 2


def _raw(url: str, method: str, path: str, body: dict, token: str | None = None) -> tuple[int, list[str], dict]:
    """(status, Warning header values, JSON body): harness `call` keeps no headers, and a dict keeps one Warning."""
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {"Content-Type": "application/json"} | ({"X-Tensile-Token": token} if token else {})
    try:
        conn.request(method, path, json.dumps(body), headers)
        response = conn.getresponse()
        return response.status, response.headers.get_all("Warning") or [], json.loads(response.read() or b"null")
    finally:
        conn.close()


def test_unknown_request_fields_are_ignored_with_a_warning_as_kubernetes_does(agent_server, tiny_workload, caplog):
    """A newer hook sending a field an older agent does not know got 422 (pydantic extra="forbid", the contract's own
    check) and fell back to planning alone. Now the field is ignored and named in a `Warning: 299` header, as the API
    server's fieldValidation=Warn does, and the agent logs it once per field name; known fields are still checked."""
    import logging

    server = agent_server()
    url = server.url
    body = {"job": "a", "namespace": "ns", "workload": workload_to_dict(tiny_workload()), "token": TOKEN}
    with caplog.at_level(logging.WARNING, logger="tensile_agent"):
        status, warnings, answer = _raw(url, "POST", "/v1/jobs", body | {"priority_class": "high", "zz": 1})
        assert status == 201, answer
        assert warnings == ['299 - "unknown field \\"priority_class\\""', '299 - "unknown field \\"zz\\""']
        server.idle()
        for method, path, sent in (("POST", "/v1/jobs/ns/a/measurements", {"peak_bytes": 5, "gpu_temperature": 70}),
                                   ("PATCH", "/v1/jobs/ns/a/knobs", {"max_swap_rate": 0.5, "gpu_temperature": 1}),
                                   ("PUT", "/v1/jobs/ns/a/workload", {"workload": body["workload"], "gpu_temperature": 1})):
            status, warnings, answer = _raw(url, method, path, sent, TOKEN)
            assert status == 200 and warnings == ['299 - "unknown field \\"gpu_temperature\\""'], (path, status, answer)
        status, warnings, _ = _raw(url, "POST", "/v1/jobs", body | {"priority_class": "high"})  # the same again
        assert status == 200 and len(warnings) == 1
        status, warnings, answer = _raw(url, "POST", "/v1/jobs", body | {"priority_class": "x", "max_swap_rate": 3})
        assert status == 422 and warnings == [], answer  # a malformed known field: refused as ever
        status, warnings, _ = _raw(url, "PATCH", "/v1/jobs/ns/a/knobs", {"max_swap_rate": 0.25}, TOKEN)
        assert status == 200 and warnings == []
    logged = [r.getMessage() for r in caplog.records if "unknown field" in r.getMessage()]
    assert sorted(logged) == sorted([
        "ignored the unknown field 'priority_class' in a registration (from a newer client? this agent does not know it)",
        "ignored the unknown field 'zz' in a registration (from a newer client? this agent does not know it)",
        *(f"ignored the unknown field 'gpu_temperature' in {what} (from a newer client? this agent does not know it)"
          for what in ("measurements", "knobs", "a workload upload"))]), logged


def test_the_client_logs_each_warning_the_agent_answers_once(agent_server, tiny_workload, caplog, monkeypatch):
    import logging

    server = agent_server()
    monkeypatch.setattr(agent_client, "_warned", set())
    link = agent_client.Http(server.url)
    body = {"job": "w", "namespace": "ns", "signature": tiny_workload().signature, "token": TOKEN, "new_knob": 1}
    with caplog.at_level(logging.WARNING, logger="tensile.agent_client"):
        for _ in range(3):
            link.request("POST", "/v1/jobs", body, TOKEN)
        agent_client.Http(server.url).request("POST", "/v1/jobs", body, TOKEN)  # another connection, the same process
    link.close()
    said = [r.getMessage() for r in caplog.records if r.name == "tensile.agent_client"]
    assert said == [f'tensile: the node agent at {server.url} warns: unknown field "new_knob"'], said


@pytest.mark.slow
def test_an_unreachable_agent_is_said_once_by_tensile_run(tmp_path):
    """The client warned "node agent unreachable" and the hook's link said the same as a note: twice in a row."""
    import subprocess
    import sys

    from tests.support.agent_harness import ROOT, free_port

    done = subprocess.run([sys.executable, "-m", "tensile.cli", "run", "--agent", f"http://127.0.0.1:{free_port()}",
                           "--report", str(tmp_path / "r.json"), "--", "python", "examples/train_mlp.py", "--steps", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    output = done.stdout + done.stderr
    assert output.count("node agent unreachable") == 1, output
    assert any("unreachable" in m for m in json.loads((tmp_path / "r.json").read_text())["messages"])


def test_the_client_leaves_saying_unreachable_to_the_hooks_link(caplog):
    """What the hook's AgentLink turns into its warning and report message; the client says it at INFO."""
    import logging

    from tests.support.agent_harness import free_port

    client = AgentClient(f"http://127.0.0.1:{free_port()}", "ns/away", timeout=0.5, retries=0)
    with caplog.at_level(logging.INFO, logger="tensile.agent_client"):
        assert client.fetch_plan() is None and client.register(signature="abcdef01") is None
    said = [r for r in caplog.records if r.name == "tensile.agent_client"]
    assert said and all(r.levelno == logging.INFO for r in said) and not client.reachable


def test_the_agent_info_metric_names_the_host_without_a_node_name(agent_server):
    """tensile_agent_info{node=""} outside a cluster; the host name is what a DaemonSet's NODE_NAME would say
    (and what the simulated GPUs' uuids and the TensileNode are named by without one)."""
    import socket

    server = agent_server()
    info = next(l for l in get(server.url, "/metrics")[1].splitlines() if l.startswith("tensile_agent_info{"))
    assert f'node="{socket.gethostname()}"' in info, info
    assert get(server.url, "/v1/info")[1]["node"] == socket.gethostname()
    named = agent_server(node="gpu-node-7")
    info = next(l for l in get(named.url, "/metrics")[1].splitlines() if l.startswith("tensile_agent_info{"))
    assert 'node="gpu-node-7"' in info, info


@pytest.mark.parametrize("how", ["SIGTERM to the agent", "Ctrl-C to its process group"])
def test_the_agent_stops_cleanly(tiny_workload, how):
    """Stopped by SIGTERM (uvicorn re-raises it after its shutdown: the process dies of it, without exit handlers),
    the agent left its planning pool's semaphores to the resource tracker: "There appear to be 5 leaked semaphore
    objects". Ctrl-C in a terminal reaches the planning child too, which printed a KeyboardInterrupt traceback."""
    import os
    import signal
    import subprocess
    import sys

    from tests.support.agent_harness import ROOT, free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    proc = subprocess.Popen([sys.executable, "-m", "tensile_agent", "--port", str(port), "--simulate-gpu", "a6000:48GiB",
                             "--log-level", "warning"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if get(url, "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.05)
        register(url, tiny_workload()).wait_for_plan(60)  # a round in the planning child
        if how.startswith("SIGTERM"):
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert "leaked semaphore" not in stderr and "Traceback" not in stderr, stderr


def test_stopping_the_planner_ends_a_round_in_progress_instead_of_waiting_for_it():
    """The stop waits for the planning child (so its semaphores are released), but not for a round's seconds."""
    from concurrent.futures.process import BrokenProcessPool

    from tensile_agent.planning import ProcessPlanner

    planner = ProcessPlanner()
    planner.start()
    pool = planner._pool
    assert pool is not None
    long_round = pool.submit(time.sleep, 60)  # stands for a long planning round
    planner._rounds = 1
    time.sleep(1.0)
    started = time.monotonic()
    planner.stop()
    assert time.monotonic() - started < 20
    assert isinstance(long_round.exception(timeout=5), BrokenProcessPool)
    with pytest.raises(RuntimeError, match="stopped"):  # no round (nor a new child) after the stop
        planner([], 1e9)
