"""The bounded caches of long-lived services: the LRU itself, and the operator's forecasts under it."""

from __future__ import annotations

import asyncio

import pytest

from tensile.lru import Lru
from tensile_operator.forecasting import Forecaster
from tensile.trainingjob_spec import PlanScope, WorkloadSpec


def test_lru_keeps_the_most_recently_used_entries():
    cache: Lru[str, int] = Lru(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # read: "a" is now the newest, "b" the oldest
    cache.put("c", 3)
    assert "b" not in cache and cache.get("b") is None
    assert (cache.get("a"), cache.get("c"), len(cache)) == (1, 3, 2)
    cache.put("a", 4)  # rewritten: the new value, and the newest again
    cache.put("d", 5)
    assert (cache.get("a"), "c" in cache, len(cache)) == (4, False, 2)
    with pytest.raises(ValueError, match="capacity"):
        Lru(0)


def test_the_operators_forecast_caches_stay_bounded_and_an_evicted_spec_is_traced_again():
    """An operator that kept every distinct spec a cluster ran would grow into its pod's memory limit."""
    forecaster = Forecaster(capacity=1)
    scope = PlanScope(activations_only=True)
    small, large = WorkloadSpec("vgg16", batch_size=1, device="cpu"), WorkloadSpec("vgg16", batch_size=2, device="cpu")
    try:
        first = asyncio.run(forecaster.forecast(small, scope))
        assert asyncio.run(forecaster.forecast(small, scope)) is first and forecaster.traces == 1  # cached
        asyncio.run(forecaster.forecast(large, scope))
        assert forecaster.traces == 2 and not forecaster.ready(small, scope)
        assert forecaster.by_signature(first.signature, scope) is None  # the oldest forecast went
        again = asyncio.run(forecaster.forecast(small, scope))
        assert forecaster.traces == 3 and again.signature == first.signature
        assert again.min_peak_bytes == first.min_peak_bytes  # the same answer, computed again
        assert forecaster.ready(small, scope) and not forecaster.ready(large, scope)
    finally:
        forecaster.close()


def test_stored_profiles_keep_the_recent_ones_in_memory_and_the_rest_on_disk(tmp_path):
    """With a directory the files are the store: memory holds the most recently used, an evicted profile
    is read back from its file. Without one, memory is the only copy and keeps every profile."""
    from tests.support import tracing_models
    from tensile_operator.forecasting import CACHED_WORKLOADS, ProfileStore
    from tensile.tracer import TrainingStep, trace_step

    model, batch, loss_fn, make_optimizer = tracing_models.views(2)
    workload = trace_step(TrainingStep(model, batch, loss_fn, [make_optimizer(model.parameters())]),
                          model_name="views", batch_size=2, target_device="cpu")
    on_disk, in_memory = ProfileStore(tmp_path), ProfileStore()
    names = [f"profile-{i}" for i in range(CACHED_WORKLOADS + 3)]
    for name in names:
        on_disk.put("default", name, workload)
        in_memory.put("default", name, workload)
    assert len(on_disk._profiles) == CACHED_WORKLOADS and ("default", names[0]) not in on_disk._profiles
    assert len(list(tmp_path.glob("default/*.json.gz"))) == len(names)
    back = on_disk.get("default", names[0])  # evicted from memory: read from its file
    assert back is not None and back is not workload and back.signature == workload.signature
    assert all(in_memory.get("default", name) is workload for name in names)
