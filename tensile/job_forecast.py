"""One job's forecast from its traced iteration: op latencies, the vanilla peak and the TENSILE plan alone on its
GPU, and what the caching allocator reserves at each peak, as `tensile forecast`, `tensile run --model` and
`tensile local` make it."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from tensile.allocator import reserved_peak
from tensile.cublas_workspaces import cublas_workspace_bytes, cublas_workspaces
from tensile.devices import device_preset
from tensile.knobs import budget_bytes
from tensile.latency import QuickCalibrationWarning, UncalibratedWarning, assign_latencies, iteration_seconds
from tensile.peak import PeakResult, analyze_vanilla
from tensile.plan import Plan, native_plan_events
from tensile.planner import GpuPlan, plan_job
from tensile.workload import Workload


@dataclass(frozen=True)
class ForecastResult:
    summary: dict  # `forecast_summary`: what `tensile forecast --json` prints
    plan: Plan
    vanilla: PeakResult
    notes: tuple[str, ...]  # what the latency model warned (uncalibrated, a quick calibration), for the caller to say


@dataclass(frozen=True)
class ReservedPeaks:
    """What the process holds in the caching allocator at its peak, vanilla and under the plan: in segments (reserved,
    torch.cuda.max_memory_reserved) and in the blocks it hands out (allocated, max_memory_allocated), cuBLAS's
    workspaces (tensile.cublas_workspaces) included in both."""

    vanilla_bytes: int
    scheduled_bytes: int
    vanilla_allocated_bytes: int
    scheduled_allocated_bytes: int
    cublas_workspace_bytes: int  # all the workspaces the iteration holds
    expandable_segments: bool


def reserved_peaks(workload: Workload, plan: Plan, bandwidth: float, expandable_segments: bool = False,
                   workspace_bytes: int = 0) -> ReservedPeaks:
    """The allocator model's peaks (tensile.allocator) for a CUDA workload, each cuBLAS workspace `workspace_bytes`.
    The CPU device has no caching allocator (PyTorch's CPU allocator hands each freed block back) and no cuBLAS: there
    the process holds what its tensors do."""
    assert plan.forecast is not None
    scheduled, scheduled_allocated = scheduled_reserved_peak(workload, plan, bandwidth, expandable_segments,
                                                             workspace_bytes)
    if workload.device != "cuda":
        vanilla_peak = plan.forecast.vanilla_peak_bytes
        return ReservedPeaks(vanilla_peak, scheduled, vanilla_peak, scheduled_allocated, 0, expandable_segments)
    workspaces = cublas_workspaces(workload, workspace_bytes)
    vanilla = reserved_peak(workload, expandable_segments=expandable_segments, workspaces=workspaces)
    return ReservedPeaks(vanilla.reserved_peak_bytes, scheduled, vanilla.allocated_peak_bytes, scheduled_allocated,
                         sum(workspaces.values()), expandable_segments)


def scheduled_reserved_peak(workload: Workload, plan: Plan, bandwidth: float, expandable_segments: bool = False,
                            workspace_bytes: int = 0) -> tuple[int, int]:
    """The reserved and the allocated peak under `plan` (`reserved_peaks`' scheduled pair): what the node agent
    forecasts for a job's current plan. On the CPU device both are the plan's scheduled peak."""
    assert plan.forecast is not None
    if workload.device != "cuda":
        return plan.forecast.scheduled_peak_bytes, plan.forecast.scheduled_peak_bytes
    peaks = reserved_peak(workload, plan, bandwidth, expandable_segments=expandable_segments,
                          workspaces=cublas_workspaces(workload, workspace_bytes))
    return peaks.reserved_peak_bytes, peaks.allocated_peak_bytes


def forecast_summary(workload: Workload, vanilla: PeakResult, latency_source: str, gpu_plan: GpuPlan, plan: Plan,
                     reserved: ReservedPeaks, activations_only: bool = False) -> dict:
    """The forecast as one JSON-able object (the keys other tools rely on)."""
    peak_op = workload.ops[vanilla.peak_op] if vanilla.peak_op >= 0 else None
    assert plan.forecast is not None
    return {
        "model": workload.model,
        "batch_size": workload.batch_size,
        "device": workload.device,
        "optimizer": workload.meta.get("optimizer"),
        "dtype": workload.meta.get("dtype"),
        "signature": workload.signature,
        "ops": len(workload.ops),
        "tensors": len(workload.tensors),
        "flops": workload.total_flops,
        "vanilla_peak_bytes": vanilla.peak_bytes,
        "allocated_peak_bytes": reserved.vanilla_allocated_bytes,
        "reserved_peak_bytes": reserved.vanilla_bytes,
        "cublas_workspace_bytes": reserved.cublas_workspace_bytes,
        "peak_op_index": vanilla.peak_op,
        "peak_op": peak_op.name if peak_op else None,
        "peak_phase": vanilla.peak_phase,
        "bytes_by_role": vanilla.bytes_by_role,
        "latency_source": latency_source,
        "predicted_iteration_seconds": iteration_seconds(workload),
        "scheduled_peak_bytes": plan.forecast.scheduled_peak_bytes,
        "scheduled_allocated_peak_bytes": reserved.scheduled_allocated_bytes,
        "scheduled_reserved_peak_bytes": reserved.scheduled_bytes,
        "expandable_segments": reserved.expandable_segments,
        "msr": plan.forecast.msr,
        "predicted_eor": plan.forecast.predicted_eor,
        "memory_budget_bytes": gpu_plan.budget_bytes,
        "fits": gpu_plan.fits,
        "plan_message": gpu_plan.message,
        "plan_events": len(plan.events),
        "activations_only": activations_only,
        "plan_seconds": gpu_plan.seconds,
    }


def make_forecast(workload: Workload, preset: str, memory_budget: float | None = None, plan_events: str = "auto",
                  recompute: bool = True, max_swap_rate: float = 1.0, expandable_segments: bool = False,
                  environ: Mapping[str, str] | None = None) -> ForecastResult:
    """Latencies, vanilla peak analysis and the TENSILE plan for one traced workload, with the events
    the hook would plan with on the workload's device (and the job's max swapping rate: alone on its GPU,
    the strictest the agent's joint plan can hold it to). `memory_budget` as `tensile.knobs.parse_budget` reads
    one: bytes, or a fraction of the vanilla peak. The reserved peaks are for the caching allocator's default
    settings, or with `expandable_segments`, and hold cuBLAS's workspaces as a process started from `environ`
    (CUBLAS_WORKSPACE_CONFIG) on the preset's GPU would."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UncalibratedWarning)
        warnings.simplefilter("always", QuickCalibrationWarning)
        latency_source = assign_latencies(workload, device=preset if workload.device == "cuda" else "cpu")
    vanilla = analyze_vanilla(workload)
    budget = budget_bytes(memory_budget, vanilla.peak_bytes)
    activations_only = native_plan_events(plan_events, workload.device)
    device = device_preset(preset)
    bandwidth = device.host_link_bandwidth
    gpu_plan = plan_job(workload, bandwidth, budget, activations_only=activations_only, recompute=recompute,
                        max_swap_rate=max_swap_rate)
    plan = gpu_plan.plans["job"]
    plan.memory_budget_bytes = budget  # a saved plan holds the hook to its budget (`tensile run --plan`)
    workspace = cublas_workspace_bytes(device.compute_capability_major, environ or {})
    reserved = reserved_peaks(workload, plan, bandwidth, expandable_segments, workspace)
    summary = forecast_summary(workload, vanilla, latency_source, gpu_plan, plan, reserved, activations_only)
    return ForecastResult(summary, plan, vanilla, tuple(str(warning.message) for warning in caught))
