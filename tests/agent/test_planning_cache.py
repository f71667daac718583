"""The planning child's workload cache: a round needs every one of its workloads, however many jobs it holds."""

from __future__ import annotations

import copy

from tensile.planner import JobToPlan


def test_a_round_with_more_jobs_than_the_cache_holds_plans_them_all(tiny_workload):
    """A round of more distinct workloads than the cache size once dropped the oldest of them before the child
    planned them, and the round failed with a KeyError for every job of the GPU."""
    from tensile_agent.planning import ProcessPlanner

    planner = ProcessPlanner(cache_size=3)
    planner.start()
    try:
        specs = [JobToPlan(f"job-{i}", copy.deepcopy(tiny_workload())) for i in range(5)]
        result = planner(specs, 1e9)
        assert sorted(result.plans) == sorted(spec.name for spec in specs)
        again = planner(specs[:2], 1e9)  # the cache is trimmed back to its size once the round is over
        assert sorted(again.plans) == ["job-0", "job-1"]
    finally:
        planner.stop()
