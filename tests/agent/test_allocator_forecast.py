"""The agent's forecast of what each job's process reserves under its current plan (tensile_agent.allocator_forecast),
served for real: the allocator model's figure for the plan the API hands out, with the allocator's settings the hook
registered or, from an older hook, the documented assumption."""

from __future__ import annotations

import json

import pytest
from tests.support.agent_harness import call, get
from tests.support.fake_nvml import FakeGpu

from tensile.agent_client import AgentClient
from tensile.agent_contract import PlanResponse, RegisterRequest
from tensile.allocator import reserved_peak
from tensile.cublas_workspaces import cublas_workspace_bytes, cublas_workspaces
from tensile.devices import GIB, PRESETS
from tensile.forecast import trace_workload
from tensile.workload import Workload
from tensile.workload_io import workload_from_dict, workload_to_dict

METRIC = "tensile_job_forecast_reserved_peak_bytes"
# large-pool workspaces: with expandable segments each maps 20 MiB pages, without it gets a 12 MiB segment
WORKSPACE = 12 * 2**20
KIB, MIB = 2**10, 2**20


def _gauge(text: str, job: str) -> float | None:
    line = next((l for l in text.splitlines() if l.startswith(METRIC + "{") and f'job="{job}"' in l), None)
    return None if line is None else float(line.split()[-1])


def _registered(url: str, workload: Workload, job: str, **allocator) -> AgentClient:  # type: ignore[no-untyped-def]
    client = AgentClient(url, f"ns/{job}", max_backoff=0.2)
    assert client.register(workload=workload, **allocator) is not None
    return client


def _independent(url: str, job: str, token: str, expandable: bool, workspace: int) -> tuple[int, int]:
    """The allocator model's (reserved, allocated) peaks for the job's plan and workload as the API gives them."""
    plan = PlanResponse.from_dict(get(url, f"/v1/jobs/ns/{job}/plan", token)[1])
    assert plan.plan is not None
    workload = workload_from_dict(get(url, f"/v1/jobs/ns/{job}/workload", token)[1], "the agent's")
    bandwidth = get(url, f"/v1/gpus/{plan.gpu}")[1]["host_link_bandwidth"]
    peaks = reserved_peak(workload, plan.plan_object(), bandwidth, expandable_segments=expandable,
                          workspaces=cublas_workspaces(workload, workspace))
    return peaks.reserved_peak_bytes, peaks.allocated_peak_bytes


def _forecast(url: str, job: str, token: str) -> dict:
    return get(url, f"/v1/jobs/ns/{job}", token)[1]["forecast"]


def test_a_cuda_jobs_reserved_forecast_is_the_allocator_models_under_its_plan(agent_server, tiny_workload):
    """Registered with expandable segments and a workspace size, then again without expandable segments: each time
    the exported forecast is the model's for the plan the API hands out, and the two differ as the model says."""
    server = agent_server()
    client = _registered(server.url, tiny_workload(), "cuda", expandable_segments=True,
                         cublas_workspace_bytes=WORKSPACE)
    client.wait_for_plan(30)
    server.idle()
    expandable = _independent(server.url, client.ref.name, client.token, True, WORKSPACE)
    assert _gauge(get(server.url, "/metrics")[1], "cuda") == expandable[0]
    forecast = _forecast(server.url, client.ref.name, client.token)
    assert (forecast["scheduled_reserved_peak_bytes"], forecast["scheduled_allocated_peak_bytes"]) == expandable
    assert (forecast["expandable_segments"], forecast["cublas_workspace_bytes"]) == (True, WORKSPACE)
    (listed,) = get(server.url, "/v1/jobs")[1]["jobs"]
    assert listed["forecast"] == forecast

    client.register(workload=tiny_workload(), expandable_segments=False, cublas_workspace_bytes=WORKSPACE)
    server.idle()
    segments = _independent(server.url, client.ref.name, client.token, False, WORKSPACE)
    assert segments[0] != expandable[0]  # the model's own verdict on this workload: pages against segments
    assert _gauge(get(server.url, "/metrics")[1], "cuda") == segments[0]
    assert _forecast(server.url, client.ref.name, client.token)["scheduled_reserved_peak_bytes"] == segments[0]


def test_a_cpu_jobs_reserved_forecast_is_its_scheduled_peak(agent_server):
    """PyTorch's CPU allocator caches nothing: the process holds what its tensors do under the plan."""
    server = agent_server()
    workload = trace_workload("examples/tiny_mlp.py:build", 4, device="cpu")
    client = _registered(server.url, workload, "cpu", expandable_segments=True, cublas_workspace_bytes=0)
    client.wait_for_plan(30)
    server.idle()
    forecast = _forecast(server.url, client.ref.name, client.token)
    scheduled = forecast["scheduled_peak_bytes"]
    assert forecast["scheduled_reserved_peak_bytes"] == forecast["scheduled_allocated_peak_bytes"] == scheduled
    assert _gauge(get(server.url, "/metrics")[1], "cpu") == scheduled


@pytest.mark.parametrize(("field", "value"), [
    ("cublas_workspace_bytes", -1), ("cublas_workspace_bytes", 2**62 + 1), ("cublas_workspace_bytes", "8MiB"),
    ("cublas_workspace_bytes", 1.5), ("expandable_segments", "maybe"), ("expandable_segments", 2),
    ("allocator_cap_bytes", -1), ("allocator_cap_bytes", "12GiB"), ("allocator_cap_bytes", 2**62 + 1),
])
def test_bad_allocator_settings_are_refused_naming_the_field(agent_server, tiny_workload, field, value):
    server = agent_server()
    body = RegisterRequest(job="bad", namespace="ns", signature=tiny_workload().signature).to_dict() | {field: value}
    status, answer = call(server.url, "POST", "/v1/jobs", body)
    assert status == 422 and field in json.dumps(answer), answer
    assert get(server.url, "/v1/jobs")[1]["jobs"] == []


def _older_registration(url: str, workload: Workload, job: str) -> str:
    """A registration as an older hook sends it: without the allocator's settings. Its token."""
    body = RegisterRequest(job=job, namespace="ns", workload=workload_to_dict(workload)).to_dict()
    for name in ("expandable_segments", "cublas_workspace_bytes"):
        del body[name]
    status, answer = call(url, "POST", "/v1/jobs", body)
    assert status == 201, answer
    return answer["token"]


@pytest.mark.parametrize(("gpu", "assumed_workspace"), [
    ("a6000:48GiB", cublas_workspace_bytes(PRESETS["a6000"].compute_capability_major, {})),
    ("h100:80GiB", cublas_workspace_bytes(PRESETS["h100"].compute_capability_major, {})),
    ("homemade:48GiB", 0),  # simulated, and no preset names it: compute capability unknown, no workspace assumed
])
def test_an_older_registration_gets_the_documented_assumption(agent_server, tiny_workload, gpu, assumed_workspace):
    """No settings from the hook: expandable segments on (Tensile's pod default) and the workspace of the GPU's
    compute capability (a simulated GPU's preset's) with CUBLAS_WORKSPACE_CONFIG unset."""
    server = agent_server(simulate=[gpu])
    token = _older_registration(server.url, tiny_workload(), "older")
    server.idle()
    forecast = _forecast(server.url, "older", token)
    assert (forecast["expandable_segments"], forecast["cublas_workspace_bytes"]) == (True, assumed_workspace)
    reserved, _ = _independent(server.url, "older", token, True, assumed_workspace)
    assert forecast["scheduled_reserved_peak_bytes"] == reserved == _gauge(get(server.url, "/metrics")[1], "older")


@pytest.mark.parametrize(("gpu", "assumed_workspace"), [
    (FakeGpu("NVIDIA L40S", 48 * GIB, (8, 9)), 8 * MIB + 128 * KIB),
    (FakeGpu("NVIDIA B200", 180 * GIB, (10, 0)), 32 * MIB),
])
def test_an_older_registration_on_a_gpu_no_preset_names_gets_its_compute_capabilitys_workspace(
        agent_server, nvml_gpus, tiny_workload, gpu, assumed_workspace):
    """A GPU NVML lists and no preset names: the assumed workspace is that of the compute capability NVML gives."""
    nvml_gpus(gpu)
    server = agent_server(simulate=[])
    token = _older_registration(server.url, tiny_workload(), "older")
    server.idle()
    forecast = _forecast(server.url, "older", token)
    assert (forecast["expandable_segments"], forecast["cublas_workspace_bytes"]) == (True, assumed_workspace)
    reserved, _ = _independent(server.url, "older", token, True, assumed_workspace)
    assert forecast["scheduled_reserved_peak_bytes"] == reserved


def test_the_hooks_settings_stand_when_the_operator_registers_again_without_them(agent_server, tiny_workload):
    """The operator registers a job before its pod runs (no settings), the pod's hook with them, the operator again
    (a placement renewed): what the hook said stays."""
    server = agent_server()
    token = "operator-made-token-0123"
    operator = AgentClient(server.url, "ns/placed", token=token, max_backoff=0.2)
    hook = AgentClient(server.url, "ns/placed", token=token, max_backoff=0.2)
    operator.register(workload=tiny_workload())
    hook.register(workload=tiny_workload(), expandable_segments=False, cublas_workspace_bytes=WORKSPACE)
    operator.register(workload=tiny_workload())
    server.idle()
    forecast = _forecast(server.url, "placed", token)
    assert (forecast["expandable_segments"], forecast["cublas_workspace_bytes"]) == (False, WORKSPACE)
    assert forecast["scheduled_reserved_peak_bytes"] == _independent(server.url, "placed", token, False, WORKSPACE)[0]


def test_a_round_that_keeps_the_plan_keeps_its_reserved_forecast(agent_server, tiny_workload):
    """The model costs about as much as a round: it runs once per plan version, not at every round."""
    server = agent_server()
    client = _registered(server.url, tiny_workload(), "kept", expandable_segments=True,
                         cublas_workspace_bytes=WORKSPACE)
    client.wait_for_plan(30)
    server.idle()
    job = server.agent.state.jobs["ns/kept"]
    made, version = job.allocator, job.version
    assert made is not None and made.version == version
    server.agent.planning.request(job.gpu, "drift")
    server.idle()
    assert server.agent.state.rounds[job.gpu].round == 2 and job.version == version
    assert job.allocator is made


def test_the_hooks_settings_after_the_operators_registration_take_no_round(agent_server, tiny_workload):
    """The operator registers a job it places (no allocator's settings); the pod's hook registers the same workload
    with them: the job keeps its registration and plan, no round runs, and its reserved forecast is made again for
    the hook's settings."""
    server = agent_server()
    token = "operator-made-token-0123"
    AgentClient(server.url, "ns/placed", token=token, max_backoff=0.2).register(workload=tiny_workload())
    server.idle()
    job = server.agent.state.jobs["ns/placed"]
    rounds, version, incarnation = server.agent.state.rounds[job.gpu].round, job.version, job.incarnation
    assumed = _forecast(server.url, "placed", token)
    assert assumed["expandable_segments"] is True
    hook = AgentClient(server.url, "ns/placed", token=token, max_backoff=0.2)
    answer = hook.register(workload=tiny_workload(), expandable_segments=False, cublas_workspace_bytes=WORKSPACE)
    assert answer is not None and not answer.created
    server.idle()
    assert server.agent.state.jobs["ns/placed"] is job
    assert (server.agent.state.rounds[job.gpu].round, job.version, job.incarnation) == (rounds, version, incarnation)
    forecast = _forecast(server.url, "placed", token)
    assert (forecast["expandable_segments"], forecast["cublas_workspace_bytes"]) == (False, WORKSPACE)
    reserved = _independent(server.url, "placed", token, False, WORKSPACE)[0]
    assert forecast["scheduled_reserved_peak_bytes"] == reserved == _gauge(get(server.url, "/metrics")[1], "placed")


def test_with_a_planning_process_the_reserved_forecast_is_made_there_not_in_the_agent(agent_server, tiny_workload,
                                                                                        monkeypatch):
    """The allocator model's replay costs a good share of a round's planning (ResNet-50: 25 ms a job); made in the
    agent's own process it held the GIL while the hooks waited for their plans (benchmarks/agent_load.py, plan
    fetches' p99 while re-planning: 25-53 ms, against 11-28 ms with it in the child, three runs in alternation). With
    the planning child the forecast is still the model's figure, made there: in the agent's process the model is
    broken here."""
    import tensile_agent.allocator_forecast as allocator_forecast

    def broken(*_: object) -> tuple[int, int]:
        raise AssertionError("the reserved forecast was made in the agent's process")

    monkeypatch.setattr(allocator_forecast, "scheduled_reserved_peak", broken)
    server = agent_server(planning="process")
    client = _registered(server.url, tiny_workload(), "child", expandable_segments=True,
                         cublas_workspace_bytes=WORKSPACE)
    client.wait_for_plan(60)
    server.idle()
    forecast = _forecast(server.url, client.ref.name, client.token)
    assert forecast is not None and "scheduled_reserved_peak_bytes" in forecast, forecast
    expected = _independent(server.url, client.ref.name, client.token, True, WORKSPACE)
    assert (forecast["scheduled_reserved_peak_bytes"], forecast["scheduled_allocated_peak_bytes"]) == expected
