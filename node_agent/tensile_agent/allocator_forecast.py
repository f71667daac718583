"""What each job's process reserves in the CUDA caching allocator under its current plan: tensile.allocator's model
with the job's cuBLAS workspaces, the forecast beside the reserved peak its hook observes (what a neighbour on the
GPU finds taken). A CPU job's is its scheduled peak: PyTorch's CPU allocator caches nothing.

Made where the planner runs (the planning child process, `planning.ProcessPlanner`; this thread with `--planning
thread`), never on a request's path, and once per plan version: the model costs a good share of a round
(docs/agent.md: BERT-base at batch 16, 24 ms against 79 ms of planning; ResNet-50's 25 ms, eight of them each round of
benchmarks/agent_load.py), and made in the agent's own process it would hold the GIL that long while hooks wait for
their plans. A round that keeps a job's plan keeps its forecast.

The allocator's settings are the hook's word (`RegisterRequest.expandable_segments`, `.cublas_workspace_bytes`).
Where it did not say (an older hook, or the operator's registration before the pod runs), the agent assumes
Tensile's pod default, expandable segments on (tensile.allocator.expandable_segments_setting), and the workspace of
the GPU's compute capability (tensile_agent.gpus: NVML's, else its preset's) with CUBLAS_WORKSPACE_CONFIG unset; none
where that is unknown.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable

from tensile.allocator import expandable_segments_in
from tensile.cublas_workspaces import cublas_workspace_bytes
from tensile.job_forecast import scheduled_reserved_peak
from tensile.plan import Plan
from tensile.workload import Workload

from tensile_agent.gpus import GpuInfo
from tensile_agent.state import AgentState, AllocatorForecast, Job

log = logging.getLogger("tensile_agent.allocator_forecast")
# what a pod Tensile starts runs with, unless its user's own setting says otherwise
POD_EXPANDABLE_SEGMENTS = expandable_segments_in({})


def allocator_settings_of(job: Job, gpu: GpuInfo) -> tuple[bool, int]:
    """(expandable segments, one cuBLAS workspace's bytes) of the job's process: what its hook said, else assumed."""
    expandable = POD_EXPANDABLE_SEGMENTS if job.expandable_segments is None else job.expandable_segments
    if job.cublas_workspace_bytes is not None:
        return expandable, job.cublas_workspace_bytes
    major = gpu.compute_capability_major
    return expandable, cublas_workspace_bytes(major, {}) if major else 0


# one job's (workload, plan, expandable segments, one cuBLAS workspace's bytes): what `reserved_peaks` is asked
ReservedRequest = tuple[Workload, Plan, bool, int]
# its (reserved, allocated) peaks, or why the model could not replay it (a traceback's text)
ReservedAnswer = tuple[int, int] | str


def reserved_peaks(requests: list[ReservedRequest], bandwidth: float) -> list[ReservedAnswer]:
    """Each request's (reserved, allocated) peaks under its plan, its workload's ops at the latencies it was planned
    with; a workload the model cannot replay gets the reason instead (it leaves its job without this forecast)."""
    answers: list[ReservedAnswer] = []
    for workload, plan, expandable, workspace in requests:
        try:
            answers.append(scheduled_reserved_peak(workload, plan, bandwidth, expandable, workspace))
        except Exception:  # noqa: BLE001 - one job's failure is its own
            answers.append(traceback.format_exc())
    return answers


def refresh_forecasts(state: AgentState, gpu: str, bandwidth: float,
                      planned: list[tuple[Job, int, int, Plan, Workload]],
                      reserve: Callable[[list[ReservedRequest], float], list[ReservedAnswer]] = reserved_peaks) -> None:
    """Forecast what each (job, incarnation, plan version, plan, workload) reserves, unless its forecast of that
    version and the job's allocator's settings is there already, with `reserve` (`reserved_peaks` where the planner
    runs). Kept only while the job is still at that incarnation and version and its settings are still those (a
    registration may change them meanwhile)."""
    info = state.gpu(gpu)
    todo = []
    for job, incarnation, version, plan, workload in planned:
        with state.lock:
            settings = allocator_settings_of(job, info)
            made = job.allocator
        if made is None or not made.is_for(incarnation, version, settings):
            todo.append((job, incarnation, version, settings, (workload, plan, *settings)))
    if not todo:
        return
    answers = reserve([request for *_, request in todo], bandwidth)
    for (job, incarnation, version, settings, _), answer in zip(todo, answers, strict=True):
        if isinstance(answer, str):
            log.error("the reserved-memory forecast of job %s failed:\n%s", job.key, answer)
            continue
        with state.lock:
            if (state.jobs.get(job.key) is job and (job.incarnation, job.version) == (incarnation, version)
                    and allocator_settings_of(job, info) == settings):
                job.allocator = AllocatorForecast(incarnation, version, *settings, *answer)
