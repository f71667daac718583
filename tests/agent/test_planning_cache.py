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


def test_a_planning_child_that_died_is_replaced_and_sent_every_workload_again(tiny_workload):
    """The workloads a dead child held are gone with it: the call made again in a new child sends them all, for a
    round and for the reserved forecasts alike."""
    from tensile_agent.planning import ProcessPlanner

    planner = ProcessPlanner()
    planner.start()
    try:
        specs = [JobToPlan(f"job-{i}", copy.deepcopy(tiny_workload())) for i in range(2)]
        first = planner(specs, 1e9)
        requests = [(spec.workload, first.plans[spec.name], True, 0) for spec in specs]
        calls = {"round": lambda: sorted(planner(specs, 1e9).plans),
                 "reserved forecasts": lambda: [type(answer) for answer in planner.reserved_peaks(requests, 1e9)]}
        expected = {"round": ["job-0", "job-1"], "reserved forecasts": [tuple, tuple]}
        for name, call in calls.items():
            pool = planner._pool
            assert pool is not None
            for process in list((pool._processes or {}).values()):
                process.kill()
                process.join(10)
            assert call() == expected[name], name
            assert planner._pool is not pool, name  # a new child answered
    finally:
        planner.stop()
