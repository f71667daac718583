"""What a hook report says about each iteration: where it ran, in which mode, and whether it moved tensors."""

from __future__ import annotations

from tensile_hook.report import HookReport, IterationStats


def moved(it: IterationStats) -> bool:
    return it.swap_out_bytes > 0 or it.recompute_bytes > 0 or it.passive_evictions > 0


def paths_and_modes(report: HookReport) -> list[tuple[int, str, str]]:
    return [(it.iteration, it.path, it.mode) for it in report.iterations]
