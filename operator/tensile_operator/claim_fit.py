"""Where a job fits when GPUs are handed out by Dynamic Resource Allocation (`dra` mode): by claims.

A ResourceClaim's request cannot change once made, and the scheduler keeps every device's consumed sum within its
capacity. So a GPU's room for a newcomer is its memory capacity less what every claim on it takes: the claims of the
jobs booked there (allocated or not yet), other workloads' allocated claims, and what its agent hosts outside any
claim. The newcomer is admitted with `tensile.admission.admitted_bytes` of its vanilla peak where that fits; else the
GPU's jobs are planned together with it, each neighbour within the peak it holds now (its claim does not grow) and the
newcomer within the room left, and admitted with its planned peak where that fits. Best fit among the GPUs that take
the claim of its vanilla peak: the one left with the least room; where none does, the first GPU, least unclaimed room
first, that takes the claim of its planned peak (each plan costs tenths of a second, and every job behind it waits).
Co-located jobs keep their peaks (and claims): nobody's claim is raised, none is lowered behind its back.
"""

from __future__ import annotations

from tensile.admission import admitted_bytes
from tensile.knobs import memory_text
from tensile_operator.placement import (Booking, Candidate, Decision, Gpu, JointPlanner, Ledger, PlanEntry, held_by,
                                        matching, process_overhead, slack_of)


def claim_room(gpu: Gpu, ledger: Ledger) -> int:
    """What the GPU's memory capacity has left for another claim."""
    held = sum(b.claim_bytes if b.claim_bytes is not None else held_by(gpu, b) for b in ledger.on_gpu(gpu.uuid))
    return gpu.memory_bytes - held - ledger.external(gpu)


def _least(new: Candidate) -> int:
    """The smallest peak the job can run at: its budget (admitted by it), else its lowest reachable peak."""
    if new.forecast is None:
        return new.fixed_bytes or 0
    peak = new.forecast.min_peak_bytes
    return min(peak, new.budget_bytes) if new.budget_bytes is not None else peak


def size_on(gpu: Gpu, new: Candidate, peak: int) -> int | None:
    """The claim `new` asks for on `gpu` when admitted at `peak` (None: the device takes no claim that large)."""
    return admitted_bytes(peak, slack_of(new.forecast, gpu), gpu.context_bytes, gpu.policy, gpu.memory_bytes)


def claim_unplanned(gpu: Gpu, room: int, new: Candidate) -> Decision | None:
    """What `gpu`, with `room` unclaimed, says of `new` without planning: it fits with the claim of its vanilla peak,
    or not even with that of its lowest reachable peak (refused with the shortfall); None when only a plan beside its
    jobs can tell."""
    if new.forecast is None:
        peak = new.fixed_bytes or 0
    else:
        vanilla = new.forecast.vanilla_peak_bytes
        peak = min(vanilla, new.budget_bytes) if new.budget_bytes is not None else vanilla
    size = size_on(gpu, new, peak)
    if size is not None and size <= room:
        return Decision(gpu, {new.job: peak}, claim_bytes=size)
    lowest = size_on(gpu, new, _least(new))
    if new.forecast is None or lowest is None or lowest > room:
        short = (lowest if lowest is not None else _least(new) + process_overhead(gpu, new.forecast)) - room
        return Decision(None, reason=f"{gpu.node}/{gpu.uuid}: {memory_text(max(short, 0))} short of the claim it "
                                     f"needs ({memory_text(room)} unclaimed)", shortfall_bytes=max(short, 1))
    return None


def plan_claim(gpu: Gpu, room: int, ledger: Ledger, new: Candidate, planner: JointPlanner) -> Decision:
    """Whether `new`, planned beside the jobs of `gpu` (where `claim_unplanned` cannot tell), fits the `room` their
    claims leave, at which peak and with which claim."""
    assert new.forecast is not None  # a job admitted by its budget is decided unplanned
    entries: list[PlanEntry] = [(b.job, b.forecast, b.max_swap_rate, b.reserved_bytes)
                                for b in ledger.on_gpu(gpu.uuid) if b.forecast is not None]
    own = room - process_overhead(gpu, new.forecast)
    own = own if new.budget_bytes is None else min(own, new.budget_bytes)
    entries.append((new.job, new.forecast, new.max_swap_rate, own))
    _, peaks = planner.plan(entries, sum(e[3] or 0 for e in entries), gpu.bandwidth)
    peak = min(peaks[new.job], own)
    size = size_on(gpu, new, peak)
    if size is None or size > room:
        short = (size or peak) - room
        return Decision(None, reason=f"{gpu.node}/{gpu.uuid}: planned beside its jobs, its claim is "
                                     f"{memory_text(short)} over the {memory_text(room)} unclaimed",
                        shortfall_bytes=max(short, 1), planned=True)
    return Decision(gpu, {new.job: peak}, planned=True, claim_bytes=size)


def choose_claimed(gpus: list[Gpu], ledger: Ledger, new: Candidate, planner: JointPlanner) -> Decision:
    """Best fit by claims among the GPUs `new` may use; else why it waits (too large for any GPU said so).

    GPUs where the claim of its vanilla peak fits are preferred (the job swaps nothing); only when there is none is
    it planned beside the jobs of one GPU after another, least unclaimed room first, until its claim fits. Where
    none fits, every GPU has been tried, and the refusal names the closest."""
    candidates = matching(gpus, new)
    if not candidates:
        return Decision(None, reason="no GPU matches spec.gpuSelector")
    rooms = {g.uuid: claim_room(g, ledger) for g in candidates}
    unplanned = {g.uuid: claim_unplanned(g, rooms[g.uuid], new) for g in candidates}
    fitting = [d for d in unplanned.values() if d is not None and d.gpu is not None]
    if fitting:
        return min(fitting, key=lambda d: rooms[d.gpu.uuid] - (d.claim_bytes or 0))  # type: ignore[union-attr]
    refusals = [d for d in unplanned.values() if d is not None]
    for gpu in sorted((g for g in candidates if unplanned[g.uuid] is None), key=lambda g: rooms[g.uuid]):
        decision = plan_claim(gpu, rooms[gpu.uuid], ledger, new, planner)
        if decision.gpu is not None:
            return decision
        refusals.append(decision)
    alone = too_large_for_claims(candidates, new)
    if alone is not None:
        return alone
    closest = min(refusals, key=lambda d: d.shortfall_bytes)
    return Decision(None, reason=f"no GPU has room: the closest is {closest.reason}",
                    shortfall_bytes=closest.shortfall_bytes, planned=any(d.planned for d in refusals))


def too_large_for_claims(gpus: list[Gpu], new: Candidate) -> Decision | None:
    """The refusal of a job whose smallest claim exceeds every GPU's whole memory capacity; None when one could hold
    it alone."""
    sizes = [size_on(g, new, _least(new)) for g in gpus]
    if any(s is not None and s <= g.memory_bytes for s, g in zip(sizes, gpus)):
        return None
    largest = max(gpus, key=lambda g: g.memory_bytes)
    need = _least(new) + process_overhead(largest, new.forecast)
    return Decision(None, reason=f"its smallest claim ({memory_text(need)}) is more than the largest GPU has "
                                 f"({largest.node}/{largest.uuid}: {memory_text(largest.memory_bytes)}): waits for a "
                                 "larger GPU", shortfall_bytes=need - largest.memory_bytes, too_large=True)


def knobs_outgrow_claim(booking: Booking, gpu: Gpu | None, max_swap_rate: float | None, recompute: bool) -> str | None:
    """Why knobs a placed job is given would need more than its claim (a lower max swap rate, or no recomputes, keeps
    more memory resident than it was admitted with), as a message with the fix; None when its claim still holds them.
    Its claim cannot grow, and its hook keeps the job within it, so such knobs are refused rather than run over it."""
    forecast = booking.forecast
    if booking.claim_bytes is None or forecast is None or gpu is None:
        return None
    from tensile.planner import plan_job

    planned = plan_job(forecast.workload, gpu.bandwidth, 0, activations_only=forecast.scope.activations_only,
                       recompute=recompute, max_swap_rate=min(1.0, max_swap_rate or 1.0))
    lowest = min(forecast.vanilla_peak_bytes, planned.forecast_of("job").scheduled_peak_bytes)
    if booking.budget_bytes is not None:
        lowest = min(lowest, booking.budget_bytes)
    need = admitted_bytes(lowest, slack_of(forecast, gpu), gpu.context_bytes, gpu.policy)
    if need is None or need <= booking.claim_bytes:
        return None
    return (f"with these knobs the job needs at least {memory_text(need)}, more than its ResourceClaim "
            f"{booking.claim} requests ({memory_text(booking.claim_bytes)}); a claim cannot grow: keep the earlier "
            "knobs, or delete and create the TrainingJob again to be admitted with them")
