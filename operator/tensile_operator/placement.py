"""Where a job fits: GPUs from TensileNodes, the jobs committed to each, and the joint-plan fit test.

A GPU's committed memory is the sum of its jobs' scheduled peaks (the paper's MP = sum MP_j) plus what each job's
process holds beside its tensors (`process_overhead`: a CUDA context, and the caching allocator's slack over the
tensors: what its segments round and fragment, and the cuBLAS workspaces of the GPU's compute capability), plus what
the jobs its agent hosts outside Tensile hold. A candidate fits when the TENSILE planner, planning the GPU's jobs
together with the candidate under the GPU's capacity, reaches a sum within it. Two shortcuts avoid planning: if
the vanilla peaks already fit, no job needs a plan change; if even each job's lowest reachable peak
alone does not fit, no joint plan can (co-located jobs share the copy channels, they never swap
more than alone). Each job is planned with the events its hook will use (its forecast's
`scope`: native events only, recompute) and within its own budget. Joint plans are cached by the
multiset of (workload signature, scope, max swap rate, own budget) and the GPU's budget. Where the newcomer
must be planned, the GPUs are planned one at a time, the one with the least room at every job's lowest reachable
peak first (best fit, by arithmetic), and the first where a joint plan fits takes it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tensile.admission import RequestPolicy
from tensile.cublas_workspaces import booked_workspace_bytes
from tensile.knobs import memory_text
from tensile.lru import Lru
from tensile_operator.forecasting import DEFAULT_BANDWIDTH, JobForecast
from tensile.trainingjob_spec import GpuSelector

PlanEntry = tuple[str, JobForecast, float | None, int | None]  # (job, forecast, max swap rate, its own budget)


@dataclass(frozen=True)
class Gpu:
    node: str
    uuid: str
    name: str
    memory_bytes: int
    capacity_bytes: int
    context_bytes: int = 0  # per job: what its process holds outside the caching allocator (the CUDA context)
    simulated: bool = False
    bandwidth: float = DEFAULT_BANDWIDTH
    agent: str | None = None  # the node agent's URL
    hosted: tuple[tuple[str, int], ...] = ()  # (job, bytes it holds besides its context) of every job its agent hosts
    policy: RequestPolicy | None = None  # its memory capacity's request policy (a device a ResourceSlice publishes)
    claimed: tuple[tuple[str, int], ...] = ()  # (owning job or "", bytes) of every allocated claim on it
    compute_capability_major: int = 0  # what sizes its processes' cuBLAS workspaces (`slack_of`); 0: unknown


def gpus_from_tensilenode(body: dict) -> list[Gpu]:
    """The GPUs a TensileNode publishes (status written by the node agent)."""
    name = body["metadata"]["name"]
    status = body.get("status") or {}
    agent = status.get("agentAddress")
    result = []
    for gpu in status.get("gpus") or []:
        memory = int(gpu.get("memoryBytes") or 0)
        hosted = tuple((str(j.get("job", "")), hosted_bytes(j)) for j in gpu.get("jobs") or [])
        result.append(Gpu(
            node=name,
            uuid=gpu["uuid"],
            name=gpu.get("name", ""),
            memory_bytes=memory,
            capacity_bytes=int(gpu.get("capacityBytes") or memory),
            context_bytes=int(gpu.get("contextBytesPerJob") or 0),
            simulated=bool(gpu.get("simulated", False)),
            bandwidth=float(gpu.get("hostLinkBandwidth") or DEFAULT_BANDWIDTH),
            agent=agent,
            hosted=hosted,
            compute_capability_major=int(gpu.get("computeCapabilityMajor") or 0),
        ))
    return result


def hosted_bytes(job: dict) -> int:
    """What a job its agent hosts holds on the GPU besides its CUDA context, as its TensileNode says: the most of its
    scheduled peak (until it is planned, its memory budget), the reserved peak forecast under its plan and the
    reserved peak its hook observed (the caching allocator keeps what it reserved)."""
    scheduled = job.get("scheduledPeakBytes")
    own = int(scheduled if scheduled is not None else job.get("memoryBudgetBytes") or 0)
    return max(own, int(job.get("forecastReservedPeakBytes") or 0), int(job.get("observedReservedPeakBytes") or 0))


def slack_of(forecast: JobForecast | None, gpu: Gpu | None) -> int:
    """The caching allocator's slack over a job's tensors on `gpu` (`JobForecast.allocator_slack_bytes`), with the
    cuBLAS workspaces its compute capability gives (`booked_workspace_bytes`; without the GPU, or where its compute
    capability is unknown, the largest); a job admitted by its budget has no forecast, and none known."""
    if forecast is None:
        return 0
    return forecast.allocator_slack_bytes[booked_workspace_bytes(gpu.compute_capability_major if gpu else 0)]


def process_overhead(gpu: Gpu, forecast: JobForecast | None) -> int:
    """What a job's process holds on `gpu` beyond its tensors' peak: its CUDA context and its allocator's slack with
    the GPU's cuBLAS workspaces (`slack_of`). A neighbour pays for both, so both are booked."""
    return gpu.context_bytes + slack_of(forecast, gpu)


def held_by(gpu: Gpu, booking: Booking) -> int:
    """What a booked job's process holds on `gpu`: its booked peak and its `process_overhead`."""
    return booking.reserved_bytes + process_overhead(gpu, booking.forecast)


@dataclass
class Booking:
    """One job committed to a GPU: by its forecast (planned) or by its declared budget (fixed)."""

    job: str  # namespace/name
    gpu: str  # uuid
    node: str
    reserved_bytes: int  # the scheduled peak it is admitted with (or its budget)
    forecast: JobForecast | None = None
    budget_bytes: int | None = None
    max_swap_rate: float | None = None
    profile: str | None = None  # admitted by budget: the profile its live workload is stored under
    plan_events: str = "auto"  # the job's spec.scheduling.planEvents at admission: its pod's TENSILE_PLAN_EVENTS
    recompute: bool = True  # spec.scheduling.recompute (or its annotation): its pod's TENSILE_RECOMPUTE
    claim_bytes: int | None = None  # what its ResourceClaim requests (`dra` mode): fixed at admission
    claim: str = ""  # its ResourceClaim's name (`dra` mode)


@dataclass
class Decision:
    gpu: Gpu | None
    peaks: dict[str, int] = field(default_factory=dict)  # job -> scheduled peak on that GPU (incl. the new one)
    reason: str = ""
    shortfall_bytes: int = 0
    planned: bool = False  # whether the joint planner ran (rather than a shortcut)
    too_large: bool = False  # the job fits no matching GPU even alone: only a larger GPU joining can place it
    claim_bytes: int | None = None  # the size its claim requests (`dra` mode)


@dataclass(frozen=True)
class Candidate:
    job: str
    forecast: JobForecast | None
    budget_bytes: int | None
    selector: GpuSelector
    max_swap_rate: float | None = None

    @property
    def fixed_bytes(self) -> int | None:
        """Reservation of a job admitted by its declared budget (no forecastable workload)."""
        return self.budget_bytes if self.forecast is None else None


class JointPlanner:
    """plan the jobs of one GPU together (tensile.planner.plan_gpu), with an LRU cache."""

    def __init__(self, size: int = 512):
        self._cache: Lru[tuple, tuple[bool, tuple[int, ...]]] = Lru(size)
        self._lock = threading.Lock()
        self.runs = 0

    def plan(self, entries: list[PlanEntry], budget: int, bandwidth: float) -> tuple[bool, dict[str, int]]:
        """Entries: (job, forecast, max swap rate, its own budget): each job is planned to stay within its
        budget, as the agent plans it, so the room it leaves goes to its neighbours."""
        order = sorted(range(len(entries)), key=lambda i: (*_planned_as(entries[i]), entries[i][0]))
        key = (tuple(_planned_as(entries[i]) for i in order), budget, bandwidth)
        with self._lock:
            hit = self._cache.get(key)
        if hit is None:
            from tensile.planner import JobToPlan, plan_gpu

            specs = []
            for k, i in enumerate(order):
                _, forecast, rate, job_budget = entries[i]
                specs.append(JobToPlan(f"j{k}", forecast.workload, min(1.0, rate or 1.0), forecast.scope.recompute,
                                       job_budget, forecast.scope.activations_only))
            result = plan_gpu(specs, bandwidth, budget_bytes=max(budget, 0))
            hit = (result.fits, tuple(result.forecast_of(f"j{k}").scheduled_peak_bytes for k in range(len(order))))
            self.runs += 1
            with self._lock:
                self._cache.put(key, hit)
        fits, peaks = hit
        return fits, {entries[i][0]: peaks[k] for k, i in enumerate(order)}


def _planned_as(entry: PlanEntry) -> tuple[str, bool, bool, float, int]:
    """What a job's plan depends on besides its neighbours: jobs equal in it share cached joint plans."""
    _, forecast, rate, budget = entry
    return forecast.signature, forecast.scope.activations_only, forecast.scope.recompute, rate or 1.0, budget or 0


class Ledger:
    """Which job holds which GPU, and with how much. Only the scheduler adds; anyone may release."""

    def __init__(self) -> None:
        self.bookings: dict[str, Booking] = {}

    def on_gpu(self, uuid: str) -> list[Booking]:
        return [b for b in self.bookings.values() if b.gpu == uuid]

    def committed(self, gpu: Gpu) -> int:
        """What the GPU's booked jobs' processes hold (`held_by`) and what no booking holds (`external`)."""
        return sum(held_by(gpu, b) for b in self.on_gpu(gpu.uuid)) + self.external(gpu)

    def external(self, gpu: Gpu) -> int:
        """What the jobs the GPU's agent hosts and no booking holds commit (e.g. `tensile run --agent`: what it holds,
        `hosted_bytes`, and a CUDA context), and the allocated claims no booking holds (other workloads'). By job
        name, not the agent's `external` flag: the hook registers every job as external, and a job placed here is
        already counted by its booking."""
        return sum(held + gpu.context_bytes for job, held in gpu.hosted if job not in self.bookings) + \
            sum(size for job, size in gpu.claimed if job not in self.bookings)

    def book(self, booking: Booking) -> None:
        if booking.job in self.bookings and self.bookings[booking.job].gpu != booking.gpu:
            raise RuntimeError(f"{booking.job} is already placed on {self.bookings[booking.job].gpu}")
        self.bookings[booking.job] = booking

    def release(self, job: str) -> Booking | None:
        return self.bookings.pop(job, None)


def _reserve(peak: int, budget: int | None) -> int:
    """The hook's budget guard keeps a job under its budget, so that is all it can take."""
    return min(peak, budget) if budget is not None else peak


def _together(gpu: Gpu, ledger: Ledger, new: Candidate) -> tuple[list[Booking], list[PlanEntry], int]:
    """The GPU's jobs, those of them and `new` that are planned (by forecast), and the budget those share: the GPU's
    capacity less every process's overhead, what its agent hosts and the jobs admitted by their budgets."""
    jobs = ledger.on_gpu(gpu.uuid)
    overheads = sum(process_overhead(gpu, b.forecast) for b in jobs) + process_overhead(gpu, new.forecast)
    available = gpu.capacity_bytes - overheads - ledger.external(gpu)
    fixed = sum(b.reserved_bytes for b in jobs if b.forecast is None)
    planned = [(b.job, b.forecast, b.max_swap_rate, b.budget_bytes) for b in jobs if b.forecast is not None]
    if new.forecast is None:
        fixed += new.fixed_bytes or 0
    else:
        planned.append((new.job, new.forecast, new.max_swap_rate, new.budget_bytes))
    return jobs, planned, available - fixed


def _lowest(planned: list[PlanEntry]) -> int:
    return sum(_reserve(f.min_peak_bytes, b) for _, f, _, b in planned)


def evaluate(gpu: Gpu, together: tuple[list[Booking], list[PlanEntry], int], new: Candidate,
             planner: JointPlanner) -> Decision:
    """Does `new` fit on `gpu` with the jobs already there (`together`: `_together`'s), planned together? With which
    peaks?"""
    jobs, planned, budget = together
    vanilla = sum(_reserve(f.vanilla_peak_bytes, b) for _, f, _, b in planned)
    if vanilla <= budget:
        return Decision(gpu, {j: _reserve(f.vanilla_peak_bytes, b) for j, f, _, b in planned} | _fixed(jobs, new))
    short = _lowest(planned) - budget
    if short > 0:
        return Decision(None, reason=f"{gpu.node}/{gpu.uuid}: {memory_text(short)} short even at every job's lowest reachable peak",
                        shortfall_bytes=short)
    fits, peaks = planner.plan(planned, budget, gpu.bandwidth)
    budgets = {j: b for j, _, _, b in planned}
    peaks = {j: _reserve(p, budgets[j]) for j, p in peaks.items()}
    total = sum(peaks.values())
    if not fits and total > budget:
        short = total - budget
        return Decision(None, reason=f"{gpu.node}/{gpu.uuid}: planned together, the jobs' peaks are {memory_text(short)} over capacity",
                        shortfall_bytes=short, planned=True)
    return Decision(gpu, peaks | _fixed(jobs, new), planned=True)


def _fixed(jobs: list[Booking], new: Candidate) -> dict[str, int]:
    fixed = {b.job: b.reserved_bytes for b in jobs if b.forecast is None}
    if new.forecast is None:
        fixed[new.job] = new.fixed_bytes or 0
    return fixed


def matching(gpus: list[Gpu], new: Candidate) -> list[Gpu]:
    return [g for g in gpus if new.selector.matches(g.node, g.uuid, g.name, g.memory_bytes, g.simulated)]


def fit_unchanged(gpus: list[Gpu], ledger: Ledger, new: Candidate) -> Decision | None:
    """Best fit among the GPUs where `new` fits at its vanilla peak with every committed peak unchanged:
    nobody pays swap time and the planner need not run (microseconds: the scheduler calls it inline)."""
    need = (new.fixed_bytes if new.forecast is None else _reserve(new.forecast.vanilla_peak_bytes, new.budget_bytes)) or 0
    left = {gpu.uuid: gpu.capacity_bytes - ledger.committed(gpu) - process_overhead(gpu, new.forecast) - need
            for gpu in gpus}
    easy = [gpu for gpu in gpus if left[gpu.uuid] >= 0]
    if not easy:
        return None
    best = min(easy, key=lambda gpu: left[gpu.uuid])  # best fit: the least room kept
    return Decision(best, {b.job: b.reserved_bytes for b in ledger.on_gpu(best.uuid)} | {new.job: need})


def choose(gpus: list[Gpu], ledger: Ledger, new: Candidate, planner: JointPlanner) -> Decision:
    """Where the job goes: best fit among the GPUs where it fits without changing anyone's plan (vanilla peaks fit),
    else the first GPU, tightest first, where a joint plan fits.

    GPUs of the first kind are preferred: they cost no job any swapping time. Only when there is none does the joint
    planner run, and then on one GPU after another, tightest first (the least room kept were every job at its lowest
    reachable peak: no joint plan keeps more, and below zero none fits), until a joint plan fits: a plan costs tenths
    of a second, and every job behind this one waits for it. Where none fits, every GPU has been tried, and the refusal names the closest."""
    candidates = matching(gpus, new)
    if not candidates:
        return Decision(None, reason="no GPU matches spec.gpuSelector", shortfall_bytes=0)
    easy = fit_unchanged(candidates, ledger, new)
    if easy is not None:
        return easy
    together = {gpu.uuid: _together(gpu, ledger, new) for gpu in candidates}
    refusals: list[Decision] = []
    for gpu in sorted(candidates, key=lambda g: together[g.uuid][2] - _lowest(together[g.uuid][1])):
        decision = evaluate(gpu, together[gpu.uuid], new, planner)
        if decision.gpu is not None:
            return decision
        refusals.append(decision)
    alone = too_large(candidates, new)
    if alone is not None:
        return alone
    smallest = min(refusals, key=lambda d: d.shortfall_bytes)
    return Decision(None, reason=f"no GPU has room: the closest is {smallest.reason}", shortfall_bytes=smallest.shortfall_bytes,
                    planned=any(d.planned for d in refusals))


def too_large(gpus: list[Gpu], new: Candidate) -> Decision | None:
    """The refusal of a job that fits none of `gpus` even alone (no other job, nothing the agent hosts): the least it
    can take (its lowest reachable peak, or its budget) is above the largest GPU's room for one job. Said so, rather
    than as a shortfall that counts the jobs running now (which suggested their end would make room). None when
    it fits alone somewhere."""
    if not gpus:
        return None
    if new.forecast is None:
        need, what = new.fixed_bytes or 0, "its memory budget"
    else:
        need, what = _reserve(new.forecast.min_peak_bytes, new.budget_bytes), "even at its lowest reachable peak"
    largest = max(gpus, key=lambda g: g.capacity_bytes - process_overhead(g, new.forecast))
    room = largest.capacity_bytes - process_overhead(largest, new.forecast)
    if need <= room:
        return None
    return Decision(None, reason=f"does not fit even alone on the largest GPU ({largest.node}/{largest.uuid}: {memory_text(room)} "
                                 f"free of {memory_text(largest.memory_bytes)} with no other job; it needs {memory_text(need)}, "
                                 f"{what}): waits for a larger GPU", shortfall_bytes=need - room, too_large=True)

