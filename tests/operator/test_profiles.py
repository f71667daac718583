"""Stored workload profiles are per namespace: a job names only the profiles its own namespace's jobs stored."""

from __future__ import annotations

import asyncio

from tests.support import tracing_models
from tests.support.operator_harness import trainingjob
from tensile.tracer import TrainingStep, trace_step
from tensile.trainingjob_spec import PlanScope, WorkloadSpec
from tensile.workload import Workload
from tensile_operator.forecasting import Forecaster, ProfileStore
from tensile_operator.validation import check


def _traced(batch: int) -> Workload:
    model, inputs, loss_fn, make_optimizer = tracing_models.views(batch)
    return trace_step(TrainingStep(model, inputs, loss_fn, [make_optimizer(model.parameters())]),
                      model_name="views", batch_size=batch, target_device="cpu")


def test_two_namespaces_with_the_same_profile_name_get_their_own_workloads(tmp_path):
    """Profiles were stored by bare name: a job of namespace B naming profile `p` was forecast (and admitted) by the
    workload namespace A's job recorded, and B's first run replaced A's. Each namespace has its own `p`, in a folder
    of its own on disk; a namespace that stored none has none (its job is admitted by its budget)."""
    team_a, team_b = _traced(2), _traced(4)
    assert team_a.signature != team_b.signature
    forecaster = Forecaster(ProfileStore(tmp_path))
    try:
        forecaster.store_profile("team-a", "p", team_a)
        forecaster.store_profile("team-b", "p", team_b)
        spec, scope = WorkloadSpec(profile="p"), PlanScope()

        async def forecast(namespace: str) -> str | None:
            found = await forecaster.forecast(spec, scope, namespace)
            return found.signature if found is not None else None

        assert asyncio.run(forecast("team-a")) == team_a.signature
        assert asyncio.run(forecast("team-b")) == team_b.signature
        assert asyncio.run(forecast("team-c")) is None and not asyncio.run(forecast(""))
        # the webhook asks a job of a namespace with no such profile for its budget
        unbudgeted = trainingjob("x", None, profile="p")["spec"]
        assert not asyncio.run(check(unbudgeted, None, [], forecaster, namespace="team-a"))
        (problem,) = asyncio.run(check(unbudgeted, None, [], forecaster, namespace="team-c"))
        assert problem.field == "spec.memoryBudget" and "profile 'p' is not stored yet" in problem.message
    finally:
        forecaster.close()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.json.gz")) == [
        "team-a/p.json.gz", "team-b/p.json.gz"]
    again = ProfileStore(tmp_path)  # a restarted operator reads each back from its namespace's folder
    assert [again.get(n, "p").signature for n in ("team-a", "team-b")] == [team_a.signature, team_b.signature]
    assert again.get("team-c", "p") is None
