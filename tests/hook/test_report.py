"""The hook's report (runtime_hook/tensile_hook/report.py): the peak of the iterations measured under a plan is kept apart
from the peak of every iteration. The first iterations run unplanned (recording, matching) at the vanilla
peak, and a native CPU iteration nothing observed reports the forecast as its peak: neither compares with
the forecast scheduled peak."""

from __future__ import annotations

from tensile_hook.report import KEPT_ITERATIONS, HookReport, IterationStats, RunTotals

MIB = 2**20


def first_iterations() -> list[IterationStats]:
    """A short run: recorded at the vanilla peak, then under a plan, measured and not."""
    return [IterationStats(0, "recording", peak_bytes=8 * MIB),
            IterationStats(1, "recording", peak_bytes=9 * MIB),
            IterationStats(2, "planned", 1, peak_bytes=6 * MIB),
            IterationStats(3, "planned", 1, peak_bytes=7 * MIB, peak_source="planned"),  # the forecast, not measured
            IterationStats(4, "planned", 1, peak_bytes=5 * MIB),
            IterationStats(5, "guarded", peak_bytes=10 * MIB)]


def test_run_totals_keep_the_peak_measured_under_a_plan_apart():
    report = HookReport("job", "cpu")
    for stats in first_iterations():
        report.add(stats)
    totals = RunTotals.of(report.to_dict())
    assert (totals.peak_bytes, totals.planned_peak_bytes, totals.planned) == (10 * MIB, 6 * MIB, 3)


def test_a_run_without_a_measured_iteration_under_a_plan_has_no_planned_peak():
    report = HookReport("job", "cpu")
    for stats in first_iterations()[:2] + [IterationStats(2, "planned", 1, peak_bytes=6 * MIB, peak_source="planned")]:
        report.add(stats)
    totals = RunTotals.of(report.to_dict())
    assert (totals.peak_bytes, totals.planned_peak_bytes) == (9 * MIB, None)


def test_the_omitted_iterations_keep_their_planned_peak_and_the_totals_count_it():
    """A long run's highest peak under a plan among the iterations it no longer lists still counts."""
    report = HookReport("job", "cpu")
    total = 2 * KEPT_ITERATIONS + 10
    peaks = {0: 9 * MIB, KEPT_ITERATIONS + 3: 6 * MIB}  # the recorded first iteration's; an omitted one's under the plan
    for i in range(total):
        report.add(IterationStats(i, "planned" if i else "recording", peak_bytes=peaks.get(i, 5 * MIB)))
    report.add(IterationStats(total, "planned", 1, peak_bytes=8 * MIB, peak_source="planned"))  # the forecast: no count
    assert report.omitted.planned_peak_bytes == 6 * MIB and report.omitted.totals.peak_bytes == 6 * MIB
    totals = RunTotals.of(report.to_dict())
    assert (totals.iterations, totals.peak_bytes, totals.planned_peak_bytes) == (total + 1, 9 * MIB, 6 * MIB)


def test_omitted_iterations_that_ran_unplanned_keep_no_planned_peak():
    report = HookReport("job", "cpu")
    for i in range(2 * KEPT_ITERATIONS + 1):
        report.add(IterationStats(i, "guarded", peak_bytes=9 * MIB))
    assert report.omitted.count == 1 and report.omitted.planned_peak_bytes is None
    assert RunTotals.of(report.to_dict()).planned_peak_bytes is None
