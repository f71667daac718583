"""The cap on each job's caching allocator, as its hook registers it, served for real: in the job's view beside its
budget and in /metrics as tensile_job_allocator_cap_bytes, so that how close a job runs to its share can be seen."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from tests.support.agent_harness import agent_jobs, get

from tensile.agent_client import AgentClient

METRIC = "tensile_job_allocator_cap_bytes"
GIB = 2**30


def _exported(url: str) -> dict[str, float]:
    """The agent's tensile_job_allocator_cap_bytes series now, by NAMESPACE/JOB."""
    text = get(url, "/metrics")[1]
    assert isinstance(text, str)
    return {f"{s.labels['namespace']}/{s.labels['job']}": s.value
            for family in text_string_to_metric_families(text) if family.name == METRIC for s in family.samples}


def test_a_jobs_allocator_cap_is_shown_and_exported_as_registered(agent_server, tiny_workload):
    """Registered with a cap, the job's view and its series say it; registered again with another (a restarted
    process under a new admission), both say the new one; again without one (as the operator renews a placement),
    the hook's stands."""
    server = agent_server()
    client = AgentClient(server.url, "ns/capped", max_backoff=0.2)
    assert client.register(workload=tiny_workload(), allocator_cap_bytes=12 * GIB) is not None
    assert get(server.url, "/v1/jobs/ns/capped", client.token)[1]["allocator_cap_bytes"] == 12 * GIB
    assert agent_jobs(server.url)["ns/capped"]["allocator_cap_bytes"] == 12 * GIB
    assert _exported(server.url) == {"ns/capped": 12 * GIB}
    assert client.register(workload=tiny_workload(), allocator_cap_bytes=20 * GIB) is not None
    assert get(server.url, "/v1/jobs/ns/capped", client.token)[1]["allocator_cap_bytes"] == 20 * GIB
    assert _exported(server.url) == {"ns/capped": 20 * GIB}
    assert client.register(workload=tiny_workload()) is not None
    assert _exported(server.url) == {"ns/capped": 20 * GIB}


def test_a_job_without_a_cap_shows_null_and_exports_no_series(agent_server, tiny_workload):
    """No cap (the CPU device, or an older hook): null in the view, and no series rather than a made-up one."""
    server = agent_server()
    client = AgentClient(server.url, "ns/uncapped", max_backoff=0.2)
    assert client.register(workload=tiny_workload()) is not None
    assert get(server.url, "/v1/jobs/ns/uncapped", client.token)[1]["allocator_cap_bytes"] is None
    assert agent_jobs(server.url)["ns/uncapped"]["allocator_cap_bytes"] is None
    assert _exported(server.url) == {}


def test_a_job_registered_again_on_another_gpu_keeps_no_cap_of_the_old_one(agent_server, tiny_workload):
    """A cap is its admission's on one GPU: the job registered again on another, without one yet, shows none until
    its process there says its own."""
    server = agent_server(simulate=["a:1GiB", "b:1GiB"])
    first = AgentClient(server.url, "ns/moved", gpu="0", max_backoff=0.2)
    assert first.register(workload=tiny_workload(), allocator_cap_bytes=GIB // 2) is not None
    moved = AgentClient(server.url, "ns/moved", gpu="1", max_backoff=0.2)
    moved.token = first.token
    assert moved.register(workload=tiny_workload()) is not None
    assert agent_jobs(server.url)["ns/moved"]["allocator_cap_bytes"] is None and _exported(server.url) == {}
