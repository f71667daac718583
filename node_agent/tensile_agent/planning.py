"""Global TENSILE planning per GPU, off the event loop.

Every change to a GPU's jobs (register, unregister, knobs, an uploaded workload, latency drift) marks
the GPU dirty with a reason; one worker thread plans dirty GPUs, each round over *all* the GPU's jobs
at once with the core planner (`tensile.planner.plan_gpu`, Algorithm 3). Changes that arrive while a
round runs coalesce into the next round. Requests never wait for planning: they see the previous plan
until the round commits, and a hook picks the new plan up at its next iteration boundary.

Latency drift is the core's plan-updating rule (TENSILE IV-E, `tensile.plan_update.drifted`): measured op
latencies feed an EWMA per job (`tensile.latency.LatencyEWMA`); when |s' - s| / s passes the
threshold the GPU is re-planned with the corrected latencies of all its jobs. s is moved to s' when
the re-plan is requested, so one drift triggers exactly one re-plan.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from tensile.admission import allocator_slack
from tensile.agent_contract import FAILED, PLANNED
from tensile.cublas_workspaces import booked_workspace_bytes
from tensile.lru import Lru
from tensile.plan import Plan
from tensile.plan_update import DEFAULT_THRESHOLD, drifted
from tensile.planner import GpuPlan, JobToPlan, plan_gpu
from tensile.workload import Workload

from tensile_agent.allocator_forecast import ReservedAnswer, ReservedRequest, refresh_forecasts, reserved_peaks
from tensile_agent.state import AgentState, GpuRound, Job

log = logging.getLogger("tensile_agent.planning")
# a request's reason that asks for no round: a job's allocator's settings changed, its reserved forecast is made again
ALLOCATOR = "allocator"
PLANNER_NICE = 19  # the planning process's niceness, relative to the agent
SLACK_CACHE = 256  # (workload, workspace size) pairs whose allocator slack is kept


def gpu_budget(state: AgentState, uuid: str, jobs: list[Job], slack: int) -> int:
    """What the planner may fill: capacity less a context per job, the caching allocator's `slack` over the planned
    jobs' tensors with the GPU's cuBLAS workspaces (their processes reserve it beside the tensors, and the operator
    books it), and the budgets of jobs it cannot plan (no workload yet); when every plannable job has a budget, at
    most their sum."""
    gpu = state.gpu(uuid)
    fixed = sum(j.memory_budget_bytes or 0 for j in jobs if not j.plannable)
    available = gpu.capacity_bytes - gpu.context_bytes * len(jobs) - slack - fixed
    plannable = [j for j in jobs if j.plannable]
    if plannable and all(j.memory_budget_bytes for j in plannable):
        available = min(available, sum(j.memory_budget_bytes or 0 for j in plannable))
    return max(available, 0)


def gpu_shares(result: GpuPlan, budget: int) -> dict[str, int]:
    """Each planned job's share of the round's budget, in proportion to its scheduled peak. When the jobs fit, a
    share is at least that peak (the room left is shared out alike, so a forecast a little low does not make the
    guard evict); when they cannot, the peaks are the lowest the planner reached and the shares still add up to
    at most the budget: each job gives up room in proportion to what it needs, and the hooks' guards keep the
    jobs within the GPU together instead of letting them OOM together."""
    peaks = {name: plan.forecast.scheduled_peak_bytes for name, plan in result.plans.items() if plan.forecast}
    total = sum(peaks.values())
    if budget <= 0 or total <= 0:
        return {}
    return {name: share for name, peak in peaks.items() if (share := budget * peak // total) > 0}


def same_plan(a: Plan | None, b: Plan | None) -> bool:
    """Same events for the same signature, forecast and budget: no new version is handed out."""
    if a is None or b is None:
        return False
    return (a.signature == b.signature and a.events == b.events and a.forecast == b.forecast
            and a.memory_budget_bytes == b.memory_budget_bytes)


_CHILD_WORKLOADS: dict[str, Workload] = {}  # in the planning process: workloads by key, sent once


def _hold(new: dict[str, str], keep: list[str]) -> None:
    """In the planning process: take the workloads sent (JSON by key) and drop those the agent no longer keeps."""
    from tensile.workload_io import workload_from_dict

    for key, text in new.items():
        _CHILD_WORKLOADS[key] = workload_from_dict(json.loads(text), key)
    for key in set(_CHILD_WORKLOADS) - set(keep):
        del _CHILD_WORKLOADS[key]


def _at_latencies(key: str, latencies: list[float]) -> Workload:
    """The workload held under `key`, its ops at the latencies of this call."""
    workload = _CHILD_WORKLOADS[key]
    for op, seconds in zip(workload.ops, latencies):
        op.latency = seconds
    return workload


def _plan_in_child(new: dict[str, str], keep: list[str], jobs: list[tuple[str, str, list[float], float, bool, int | None, bool]],
                   bandwidth: float, options: dict) -> GpuPlan:
    _hold(new, keep)
    specs = [JobToPlan(name, _at_latencies(key, latencies), rate, recompute, budget, activations_only)
             for name, key, latencies, rate, recompute, budget, activations_only in jobs]
    result = plan_gpu(specs, bandwidth, **options)
    result.transfers = []  # not needed by the agent; keeps the answer small
    return result


def _reserve_in_child(new: dict[str, str], keep: list[str], requests: list[tuple[str, list[float], Plan, bool, int]],
                      bandwidth: float) -> list[ReservedAnswer]:
    _hold(new, keep)
    return reserved_peaks([(_at_latencies(key, latencies), plan, expandable, workspace)
                           for key, latencies, plan, expandable, workspace in requests], bandwidth)


def _child_init() -> None:
    """Planning is background work: let the agent's request loop win the CPU over it. The child
    also leaves when the agent is gone (SIGTERM, SIGKILL): a pool shut down without waiting does not
    stop a round in progress, and an orphaned planner would burn a core for nothing. Ctrl-C is the
    agent's to handle (it shuts the pool down): the terminal sends SIGINT to the child too, which
    printed a KeyboardInterrupt traceback from the pool's worker as the agent stopped."""
    import os
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(PLANNER_NICE)
    except OSError:
        pass
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="tensile-planner-watchdog").start()
    import tensile.planner  # noqa: F401 - import numpy and the planner before the first round


def _exit_with_parent(parent: int, interval: float = 1.0) -> None:
    import os

    while os.getppid() == parent:
        time.sleep(interval)
    os._exit(0)


def _warm() -> None:
    pass


class ProcessPlanner:
    """`plan_gpu` in a child process of its own, so a planning round never holds the agent's GIL:
    requests stay fast while it runs. The child keeps each workload it was sent (as JSON, once) and
    gets only the op latencies, swap rates and budget per round. A child that dies is replaced."""

    def __init__(self, cache_size: int = 256) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._sent: dict[str, Workload] = {}  # key -> workload (held so its id stays unique), LRU order
        self.cache_size = cache_size
        self._lock = threading.Lock()  # the pool, `_closed` and `_rounds`
        self._closed = False  # stopped: no round starts (and no new child) until `start`
        self._rounds = 0  # rounds in the child now

    def start(self) -> None:
        with self._lock:
            self._closed = False
            self._ensure()

    def _ensure(self) -> ProcessPoolExecutor:
        """The pool, started when there is none (under the lock)."""
        if self._closed:
            raise RuntimeError("the planning process is stopped (the agent is shutting down)")
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_child_init)
            self._pool.submit(_warm)
            self._sent.clear()
        return self._pool

    def stop(self) -> None:
        """Shut the child down and wait for it, so that the pool's queues and their semaphores are released before
        the agent exits. Shut down without waiting, the agent stopped by SIGTERM (uvicorn re-raises it once it has
        shut down: the process dies of it, with no exit handlers) left them to the resource tracker, which warned of
        "5 leaked semaphore objects". A round still in the child is ended, not waited for: its plan is of no use now."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._closed = True
            busy = self._rounds > 0
        if pool is None:
            return
        if busy:
            for process in list((pool._processes or {}).values()):  # noqa: SLF001 - the pool has no public way to end a call
                process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)

    def __call__(self, specs: list[JobToPlan], bandwidth: float, **options: Any) -> GpuPlan:
        """One planning round in the child: the workloads it does not hold yet (as JSON, once), latencies and knobs."""
        def arguments(keys: list[str]) -> tuple:
            return ([(spec.name, key, [op.latency for op in spec.workload.ops], spec.max_swap_rate, spec.recompute,
                      spec.budget_bytes, spec.activations_only) for spec, key in zip(specs, keys)], bandwidth, options)
        return self._in_child(_plan_in_child, [spec.workload for spec in specs], arguments)

    def reserved_peaks(self, requests: list[ReservedRequest], bandwidth: float) -> list[ReservedAnswer]:
        """`allocator_forecast.reserved_peaks` in the child, which holds the workloads planned already."""
        def arguments(keys: list[str]) -> tuple:
            return ([(key, [op.latency for op in workload.ops], plan, expandable, workspace)
                     for key, (workload, plan, expandable, workspace) in zip(keys, requests)], bandwidth)
        return self._in_child(_reserve_in_child, [workload for workload, *_ in requests], arguments)

    def _send(self, workloads: list[Workload]) -> tuple[list[str], dict[str, str]]:
        """Each workload's key in the child, and the JSON of those the child does not hold yet, now counted as held.
        Called from the planning thread alone."""
        from tensile.workload_io import workload_to_dict

        keys = [f"{workload.signature}:{id(workload)}" for workload in workloads]
        used = dict(zip(keys, workloads))
        new = {key: json.dumps(workload_to_dict(w), separators=(",", ":")) for key, w in used.items() if key not in self._sent}
        for key, workload in used.items():  # most recently used last; the child keeps the same set
            self._sent.pop(key, None)
            self._sent[key] = workload
        while len(self._sent) > max(self.cache_size, len(used)):  # never one this call needs (they are the newest)
            del self._sent[next(iter(self._sent))]
        return keys, new

    def _in_child(self, function: Callable[..., Any], workloads: list[Workload],
                  arguments: Callable[[list[str]], tuple]) -> Any:
        """`function(new, keep, *arguments(keys))` in the child, where `keys` name `workloads` there, `new` holds those
        it lacks and `keep` all it may hold. A child that died is replaced and the call made once more, with every
        workload (a new child holds none)."""
        for attempt in range(2):
            with self._lock:
                pool = self._ensure()
                self._rounds += 1
            try:
                keys, new = self._send(workloads)
                return pool.submit(function, new, list(self._sent), *arguments(keys)).result()
            except BrokenProcessPool:
                with self._lock:
                    closed = self._closed
                    if self._pool is pool:
                        self._pool = None
                if closed:
                    raise RuntimeError("the planning process was stopped during the round (the agent is shutting down)") from None
                log.warning("the planning process died; starting a new one")
                if attempt:
                    raise
            finally:
                with self._lock:
                    self._rounds -= 1
        raise AssertionError("unreachable")


class PlanningService:
    def __init__(self, state: AgentState, threshold: float = DEFAULT_THRESHOLD,
                 on_round: Callable[[str], None] | None = None, planner: Callable = plan_gpu,
                 freeze_gc: bool = False) -> None:
        self.state = state
        self.freeze_gc = freeze_gc
        self.threshold = threshold
        self.on_round = on_round
        self.planner = planner
        # the allocator model's replays run where the planner does: in its child, off the agent's GIL, where it has one
        self._reserve = planner.reserved_peaks if isinstance(planner, ProcessPlanner) else reserved_peaks
        # (workload signature, one cuBLAS workspace's bytes) -> tensile.admission.allocator_slack
        self._slack: Lru[tuple[str, int], int] = Lru(SLACK_CACHE)
        self._dirty: OrderedDict[str, set[str]] = OrderedDict()
        self._cv = threading.Condition()
        self._busy: str | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        if isinstance(self.planner, ProcessPlanner):
            self.planner.start()
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="tensile-planning", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if isinstance(self.planner, ProcessPlanner):
            self.planner.stop()

    def request(self, gpu: str, reason: str) -> None:
        """Mark `gpu` for a planning round (coalesced with any other pending reason)."""
        with self._cv:
            self._dirty.setdefault(gpu, set()).add(reason)
            self._cv.notify_all()

    def idle(self) -> bool:
        with self._cv:
            return not self._dirty and self._busy is None

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Until no round is pending or running (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._dirty or self._busy is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    # ------------------------------------------------------------------ drift

    def observe(self, job: Job, samples: list[list[float]]) -> bool:
        """Fold measured op latencies in; True when they drifted past the threshold (a re-plan is requested)."""
        with job.lock:
            ewma = job.ewma
            if ewma is None or not samples:
                return False
            for index, seconds in samples:
                ewma.observe(int(index), float(seconds))
            corrected = ewma.corrected_sum()
            if not drifted(corrected, job.planned_sum, self.threshold):
                return False
            job.planned_sum = corrected  # this drift is now being planned for: it cannot trigger twice
        self.request(job.gpu, "drift")
        return True

    # ------------------------------------------------------------------ rounds

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._dirty and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                gpu, reasons = self._dirty.popitem(last=False)
                self._busy = gpu
            try:
                if reasons - {ALLOCATOR}:
                    self.plan_round(gpu, reasons - {ALLOCATOR})  # its forecasts are made for every plan it keeps
                else:
                    self.refresh_allocator_forecasts(gpu)
            except Exception:  # noqa: BLE001 - the planning thread must survive anything
                log.exception("planning round for GPU %s failed", gpu)
            finally:
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()
            if self.freeze_gc:
                # Workloads and plans are large, long-lived and acyclic (reference counting frees them):
                # moving them out of the collector's reach keeps full collections, which hold the GIL
                # for tens of milliseconds, from stalling requests.
                gc.freeze()
            if self.on_round is not None:
                try:
                    self.on_round(gpu)
                except Exception:  # noqa: BLE001
                    log.exception("after-round callback failed")

    def _serialize(self, jobs: list[Job]) -> None:
        """Make the new plan responses here, not in the first request after the round: a large plan
        takes milliseconds to serialize, which the event loop should not spend."""
        for job in jobs:
            with self.state.lock:
                if job.body is not None:
                    continue
                key = (job.version, job.round, job.status)
                data = job.plan_dict_shallow()
            body = job.encode_plan(data)
            with self.state.lock:
                if job.body is None and (job.version, job.round, job.status) == key:
                    job.body = body

    def refresh_allocator_forecasts(self, gpu: str) -> None:
        """The reserved forecasts of the GPU's planned jobs, for the plans they have, made where none is there for
        that plan and the job's allocator's settings: after each round, and alone when only a job's settings
        changed."""
        state = self.state
        with state.lock:
            if gpu not in state.inventory.gpus:
                return
            bandwidth = state.gpu(gpu).bandwidth
            planned = [(job, job.incarnation, job.version, job.plan, job.workload) for job in state.on_gpu(gpu)
                       if job.plan is not None and job.workload is not None]
        refresh_forecasts(state, gpu, bandwidth, planned, self._reserve)
        state.changed.set()

    def _allocator_slack(self, workload: Workload, workspace_bytes: int) -> int:
        """What the job's caching allocator reserves over its tensors with cuBLAS workspaces of `workspace_bytes` (the
        GPU's booked size, as the operator books it), once per workload and size (its vanilla replay: a few ms to
        tens of ms)."""
        key = (workload.signature, workspace_bytes)
        slack = self._slack.get(key)
        if slack is None:
            slack = allocator_slack(workload, workspace_bytes)
            self._slack.put(key, slack)
        return slack

    def plan_round(self, gpu: str, reasons: set[str]) -> None:
        """Plan every job of `gpu` together and commit the plans that changed (new versions)."""
        state = self.state
        with state.lock:
            if gpu not in state.inventory.gpus:
                return
            jobs = state.on_gpu(gpu)
            plannable = [j for j in jobs if j.plannable]
            taken = [(job, job.incarnation, job.workload, job.ewma) for job in plannable]
            info = state.gpu(gpu)
            bandwidth, workspace = info.bandwidth, booked_workspace_bytes(info.compute_capability_major)
        # outside the lock: the allocator model replays a workload new to this planner
        slack = sum(self._allocator_slack(workload, workspace) for _, _, workload, _ in taken if workload is not None)
        with state.lock:
            budget = gpu_budget(state, gpu, jobs, slack)
        latencies_of = {}
        for job, _, _, ewma in taken:  # outside the state lock: requests never wait for this
            with job.lock:
                latencies = ewma.latencies() if ewma is not None else None
                if latencies is not None:
                    job.planned_sum = float(sum(latencies))
            latencies_of[job.key] = latencies
        snapshot = [(job, incarnation, workload, latencies_of[job.key]) for job, incarnation, workload, _ in taken
                    if workload is not None]  # plannable: all of them
        if not snapshot:  # the last job left (or none has a workload): still a round of its reasons for the metrics
            with state.lock:
                state.rounds[gpu] = GpuRound(state.rounds[gpu].round, 0.0, None, "no jobs to plan", budget,
                                             state.rounds[gpu].rounds_seconds_total)
                for reason in reasons:
                    state.replans[(gpu, reason)] += 1
            state.changed.set()
            return
        specs = []
        for job, _, workload, latencies in snapshot:
            if latencies is not None:
                for op, seconds in zip(workload.ops, latencies):
                    op.latency = seconds
            # a job whose hook keeps to its native path gets only the activation swaps that path carries
            specs.append(JobToPlan(job.key, workload, job.max_swap_rate or 1.0, job.recompute, job.memory_budget_bytes,
                                 job.activations_only))
        started = time.perf_counter()
        error = None
        try:
            result = self.planner(specs, bandwidth, budget_bytes=budget)
        except Exception as exc:  # noqa: BLE001 - a bad workload fails its GPU's round, not the agent
            log.exception("planner failed on GPU %s", gpu)
            result, error = None, f"planning failed: {type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - started
        names = [job.key for job, *_ in snapshot]
        # a GPU's jobs share it (or one job cannot fit it): each is held to its share, so one cannot take the others' room
        shares = gpu_shares(result, budget) if result is not None and (len(jobs) > 1 or not result.fits) else {}
        with state.lock:
            last = state.rounds.setdefault(gpu, GpuRound())
            number = last.round + 1
            for job, incarnation, *_ in snapshot:
                current = state.jobs.get(job.key)
                if current is not job or current.incarnation != incarnation:
                    continue  # re-registered or gone meanwhile: its own request re-plans it
                job.round, job.co_planned, job.budget_bytes, job.body = number, names, budget, None
                if result is None:
                    state.set_status(job, FAILED, error or "planning failed")
                    job.fits = None
                    continue
                plan = result.plans[job.key]
                share = job.gpu_share_bytes = shares.get(job.key)
                own = job.memory_budget_bytes
                # a budget of the job's own is never raised, and lowered to its share only when the jobs cannot fit:
                # when they fit, the joint plan holds each below its own budget (which admission counted already)
                plan.memory_budget_bytes = own if share is None or (own and result.fits) else min(own or share, share)
                if not same_plan(plan, job.plan):
                    job.version += 1
                    plan.version = job.version
                    job.plan = plan
                job.fits = result.fits
                message = result.message
                peak, guard = job.scheduled_peak, plan.memory_budget_bytes
                if share is not None and guard == share and share != own:
                    message += (f"; this job's share of the GPU is {share / 2**20:,.1f} MiB, its memory budget here: "
                                "the hook's guard holds it there so the jobs sharing the GPU fit together")
                if guard and peak and peak > guard:
                    message += (f"; this job's scheduled peak {peak / 2**20:,.1f} MiB is above its budget of "
                                f"{guard / 2**20:,.1f} MiB: the hook's guard evicts passively")
                state.set_status(job, PLANNED, message)
            state.rounds[gpu] = GpuRound(number, seconds, result.fits if result else None,
                                         result.message if result else (error or ""), budget,
                                         last.rounds_seconds_total + seconds)
            for reason in reasons:
                state.replans[(gpu, reason)] += 1
        self._serialize([job for job, *_ in snapshot])
        self.refresh_allocator_forecasts(gpu)  # for the plans this round made (a kept plan keeps its forecast)
        state.changed.set()
        log.info("GPU %s round %d (%s): %d jobs planned in %.3f s", gpu, number, ",".join(sorted(reasons)), len(names), seconds)
