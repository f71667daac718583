"""The TENSILE planner's invariants, on random small DAG workloads and on the zoo models."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from tests.support.dag_workloads import chain_workload, random_workload
from tensile.devices import device_preset
from tensile.peak import absent_ranges, analyze_plan, analyze_vanilla, plan_timeline
from tensile.plan import Plan
from tensile.planner import GpuPlan, JobToPlan, co_run_slowdown, plan_gpu, plan_job
from tensile.knobs import MEMORY_BUDGET, budget_bytes
from tensile.recompute import NATIVE_CREATORS, chain_inputs
from tensile.simulator import SimJob, simulate
from tensile.errors import TensileUserError
from tensile.timeline import build_slots, slot_of
from tensile.workload import Workload

BANDWIDTH = 2e9  # slow enough that the copy channels are contended in small workloads
DEVICE = dataclasses.replace(device_preset("a6000"), host_link_bandwidth=BANDWIDTH)
ZOO = ("vgg16", "inception_v3", "inception_v4", "resnet50", "densenet121", "bert_base", "gpt2")


def check_invariants(result: GpuPlan, workloads: dict[str, Workload], bandwidth: float, slowdown: float = 1.0) -> None:
    for name, plan in result.plans.items():
        workload = workloads[name]
        slots = build_slots(workload)
        root_of = slot_of(slots)
        writers: dict[int, list[int]] = {}
        for op in workload.ops:
            for t in op.writes:
                writers.setdefault(t, []).append(op.index)
        replayed = Plan.from_dict(plan.to_dict())
        timeline = plan_timeline(workload, replayed.events, slowdown)
        absent = absent_ranges(replayed.events, bandwidth, timeline, slots)
        # no event overlaps an access of its tensor: the slot is on the device for every access
        for root, ranges in absent.items():
            for lo, hi in ranges:
                assert not any(lo <= a <= hi for a in slots[root].accesses), (name, root, lo, hi)
        # every swap-in has an earlier swap-out of the same slot (cyclically, across the boundary)
        n, period = len(workload.ops), timeline.period
        by_slot: dict[int, list[tuple[float, str]]] = {}
        for e in replayed.events:
            if e.kind in ("swap_out", "swap_in"):
                at = timeline.end(e.trigger + (n if e.next_iteration else 0)) + e.delay
                by_slot.setdefault(root_of[e.tensor], []).append((at, e.kind))
        for root, swaps in by_slot.items():
            swaps.sort()
            assert [k for _, k in swaps].count("swap_in") == [k for _, k in swaps].count("swap_out")
            if swaps[0][1] == "swap_in":  # the swap-out of the previous iteration
                assert swaps[-1][1] == "swap_out"
            kinds = [k for _, k in swaps]
            assert all(a != b for a, b in zip(kinds, kinds[1:])), (root, swaps)  # out, in, out, in...
        # a recomputed tensor's inputs are on the device when it is recomputed
        for e in replayed.events:
            if e.kind == "recompute":
                slot = slots[root_of[e.tensor]]
                chain = slot.chain(e.trigger + 1)
                assert chain and chain[0] == workload.tensors[e.tensor].created_by
                for k, t in chain_inputs(workload, slot, chain):  # every op of the chain
                    assert not any(k < w < e.trigger + 1 for w in writers.get(t, ())), (e, k, t)  # unchanged
                    r = root_of[t]
                    for k in (e.trigger, e.trigger + 1):
                        assert slots[r].first <= k <= slots[r].last
                        assert not any(lo <= k <= hi for lo, hi in absent.get(r, ())), (e, t)
        # replaying the plan through Algorithm 1 reproduces the forecast, never above vanilla
        replay = analyze_plan(workload, replayed.events, bandwidth, slowdown)
        assert replay.peak_bytes == plan.forecast.scheduled_peak_bytes
        assert plan.forecast.scheduled_peak_bytes <= analyze_vanilla(workload).peak_bytes
    assert result.scheduled_peak_bytes <= result.vanilla_peak_bytes
    # transfers in one direction never overlap on the GPU (each job's on the circle of its period)
    periods = {name: plan.forecast.predicted_iteration_seconds for name, plan in result.plans.items()}
    for direction in ("d2h", "h2d"):
        pieces = []
        for t in result.transfers:
            if t.direction != direction:
                continue
            base = t.start % periods[t.job]
            end = base + (t.end - t.start)
            pieces += [(base, min(end, periods[t.job]))] + ([(0.0, end - periods[t.job])] if end > periods[t.job] else [])
        pieces.sort()
        for (a0, b0), (a1, b1) in zip(pieces, pieces[1:]):
            assert a1 >= b0 - 1e-9, (direction, (a0, b0), (a1, b1))


@pytest.mark.parametrize("seed", range(12))
def test_invariants_single_job_random(seed):
    workload = random_workload(seed)
    result = plan_gpu([JobToPlan("a", workload)], BANDWIDTH)
    check_invariants(result, {"a": workload}, BANDWIDTH)
    assert result.fits
    assert any(e.kind == "swap_out" for e in result.plans["a"].events)


@pytest.mark.parametrize("seed", range(6))
def test_invariants_with_recompute_and_budget(seed):
    workload = random_workload(seed, layers=16)
    vanilla = analyze_vanilla(workload).peak_bytes
    result = plan_gpu([JobToPlan("a", workload)], BANDWIDTH, budget_bytes=int(0.5 * vanilla))
    check_invariants(result, {"a": workload}, BANDWIDTH)


@pytest.mark.parametrize("seed", range(4))
def test_invariants_several_jobs_share_the_channels(seed):
    workloads = {f"j{i}": random_workload(seed * 10 + i, layers=8 + 2 * i) for i in range(3)}
    slowdown = co_run_slowdown(3, 0.1)
    result = plan_gpu([JobToPlan(n, w) for n, w in workloads.items()], BANDWIDTH, slowdown=slowdown)
    check_invariants(result, workloads, BANDWIDTH, slowdown)


def test_replay_matches_the_planner_and_the_simulator():
    workload = random_workload(3)
    result = plan_gpu([JobToPlan("a", workload)], BANDWIDTH)
    plan = result.plans["a"]
    sim = simulate([SimJob("a", workload, plan)], DEVICE).jobs["a"]
    assert sim.stall_seconds == 0
    assert sim.peak_bytes == plan.forecast.scheduled_peak_bytes
    forecast = plan.forecast
    assert sim.steady_iteration_seconds == pytest.approx(forecast.predicted_iteration_seconds + forecast.predicted_extra_seconds)


def test_vanilla_simulation_matches_algorithm_1():
    for seed in range(4):
        workload = random_workload(seed)
        sim = simulate([SimJob("a", workload)], DEVICE).jobs["a"]
        assert sim.peak_bytes == analyze_vanilla(workload).peak_bytes
        assert sim.steady_iteration_seconds == pytest.approx(sum(op.latency for op in workload.ops))


def test_recomputation_costs_time_in_the_simulator():
    workload = random_workload(1, layers=16)
    vanilla = analyze_vanilla(workload).peak_bytes
    plan = plan_gpu([JobToPlan("a", workload)], BANDWIDTH, budget_bytes=int(0.4 * vanilla)).plans["a"]
    if not any(e.kind == "recompute" for e in plan.events):
        pytest.skip("no recomputation chosen for this workload")
    sim = simulate([SimJob("a", workload, plan)], DEVICE).jobs["a"]
    assert sim.recompute_seconds > 0
    assert sim.peak_bytes <= plan.forecast.scheduled_peak_bytes
    assert sim.steady_iteration_seconds == pytest.approx(plan.forecast.predicted_iteration_seconds + plan.forecast.predicted_extra_seconds)


def test_cannot_fit_answers_with_the_lowest_reachable_peak():
    workload = random_workload(2)
    result = plan_gpu([JobToPlan("a", workload)], BANDWIDTH, budget_bytes=1024)
    assert not result.fits
    assert "cannot fit" in result.message
    assert f"{result.scheduled_peak_bytes / 1024**2:,.1f} MiB" in result.message
    assert result.scheduled_peak_bytes < result.vanilla_peak_bytes


def test_a_budget_stops_planning_early():
    workload = random_workload(5)
    lowest = plan_gpu([JobToPlan("a", workload)], BANDWIDTH)
    vanilla = lowest.vanilla_peak_bytes
    budget = (vanilla + lowest.scheduled_peak_bytes) // 2
    relaxed = plan_gpu([JobToPlan("a", workload)], BANDWIDTH, budget_bytes=budget)
    assert relaxed.fits and relaxed.scheduled_peak_bytes <= budget
    assert len(relaxed.plans["a"].events) <= len(lowest.plans["a"].events)


def _cross_iteration_swaps(plan: Plan, workload: Workload) -> int:
    """Swaps of updated parameters and optimizer states that come back in the next iteration."""
    return sum(e.kind == "swap_in" and e.next_iteration and workload.tensors[e.tensor].role in ("param", "optimizer_state")
               for e in plan.events)


def test_max_swapping_rate_is_honoured():
    workloads = {f"j{i}": random_workload(40 + i) for i in range(3)}
    jobs = [JobToPlan("j0", workloads["j0"], 0.2), JobToPlan("j1", workloads["j1"]), JobToPlan("j2", workloads["j2"])]
    result = plan_gpu(jobs, BANDWIDTH)
    swaps = {n: sum(e.kind == "swap_out" for e in p.events) for n, p in result.plans.items()}
    assert swaps["j0"] - _cross_iteration_swaps(result.plans["j0"], workloads["j0"]) <= 0.2 * sum(swaps.values()) + 1
    with pytest.raises(TensileUserError):
        plan_gpu([JobToPlan("a", workloads["j0"], 0.0)], BANDWIDTH)


@pytest.mark.parametrize("seed", (41, 42, 53, 57))
def test_updated_parameters_swap_across_iterations_whatever_the_rate(seed):
    """Algorithm 2 schedules an updated parameter's swap in the optimizer phase without the max swapping
    rate check: a job held to 1% of the GPU's swaps still swaps its parameters and optimizer states."""
    low, other = random_workload(seed), random_workload(seed + 100)
    result = plan_gpu([JobToPlan("low", low, 0.01), JobToPlan("other", other)], BANDWIDTH)
    swaps = {n: sum(e.kind == "swap_out" for e in p.events) for n, p in result.plans.items()}
    cross = _cross_iteration_swaps(result.plans["low"], low)
    assert cross >= 2  # held to its share, it would get one swap in all
    assert swaps["low"] - cross <= 0.01 * sum(swaps.values()) + 1  # every other swap still within its share
    check_invariants(result, {"low": low, "other": other}, BANDWIDTH)


def test_stopping_rule_reads_each_jobs_own_peak():
    """The paper stops swapping when the peaks of the jobs it swapped in fell by less than 0.05% over three
    rounds: each job's own peak. On the sum of four jobs' peaks a swap gains a quarter as much, so four
    copies of a workload, with copies free, would stop far above where one stops alone."""
    for seed in range(10):
        workload = random_workload(seed)
        one = plan_gpu([JobToPlan("a", workload)], 1e12, stop_after_rounds=3, stop_gain=0.02)
        four = plan_gpu([JobToPlan(f"j{i}", workload) for i in range(4)], 1e12, stop_after_rounds=3, stop_gain=0.02)
        alone = one.plans["a"].forecast.scheduled_peak_bytes
        assert four.scheduled_peak_bytes <= 4 * alone * 1.05, seed


def test_a_budget_is_a_fraction_of_the_vanilla_peak_or_an_amount_of_memory():
    """As every command and the hook take it (`MEMORY_BUDGET`'s rule, the CLI's errors through `Knob.from_option`)."""

    def resolve(text: str, vanilla_peak_bytes: int) -> int | None:
        return budget_bytes(MEMORY_BUDGET.from_option(text), vanilla_peak_bytes)

    assert resolve("0.5", 1000) == 500
    assert resolve("2GiB", 1) == 2 * 1024**3
    assert resolve("2097152", 1000) == 2 * 1024**2
    for refused in ("lots", "1500"):  # a bare number is bytes, and under 1 MiB no training fits
        with pytest.raises(TensileUserError):
            resolve(refused, 1000)


@pytest.mark.slow
@pytest.mark.parametrize("model", ZOO)
def test_invariants_on_zoo_models(model, traced):
    from tensile.latency import assign_latencies

    workload = traced(model, 2)
    workload = dataclasses.replace(workload, ops=[dataclasses.replace(op) for op in workload.ops])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assign_latencies(workload, "a6000")
    bandwidth = device_preset("a6000").host_link_bandwidth
    vanilla = analyze_vanilla(workload).peak_bytes
    result = plan_gpu([JobToPlan(model, workload)], bandwidth, budget_bytes=int(0.5 * vanilla))
    check_invariants(result, {model: workload}, bandwidth)


@pytest.mark.parametrize("seed", range(8))
def test_invariants_with_chains(seed):
    """Batch norm then in-place ReLU (and residual add_) everywhere: the outputs are recomputed as chains."""
    workload = chain_workload(seed)
    result = plan_job(workload, BANDWIDTH, name="a")
    check_invariants(result, {"a": workload}, BANDWIDTH)
    slots = build_slots(workload)
    root_of = slot_of(slots)
    chains = [slots[root_of[e.tensor]].chain(e.trigger + 1) for e in result.plans["a"].events if e.kind == "recompute"]
    assert any(len(c) > 1 for c in chains), "no chain recomputed"
    sim = simulate([SimJob("a", workload, result.plans["a"])], DEVICE).jobs["a"]
    assert sim.peak_bytes <= result.plans["a"].forecast.scheduled_peak_bytes
    forecast = result.plans["a"].forecast
    assert sim.steady_iteration_seconds == pytest.approx(forecast.predicted_iteration_seconds + forecast.predicted_extra_seconds)


def test_chain_needs_single_tensor_writes():
    workload = chain_workload(0)
    slots = build_slots(workload)
    written = [t for op in workload.ops for t in op.writes if workload.tensors[t].created_by >= 0]
    assert written and all(slots[t].recomputable_by is not None and slots[t].rewrites for t in written)
    chain = slots[written[0]].chain(len(workload.ops))
    names = [workload.ops[k].name for k in chain]
    assert names[0] == "aten.native_batch_norm.default" and names[-1] == "aten.relu_.default" and len(names) >= 2
    assert slots[written[0]].chain(chain[0] + 1) == chain[:1]  # before its rewrites, the creator alone
    # an in-place op writing two tensors breaks the chain: not recomputable
    op = next(o for o in workload.ops if o.writes and workload.tensors[o.writes[0]].created_by >= 0)
    other = next(t for t in op.inputs if t not in op.writes) if len(op.inputs) > 1 else op.writes[0]
    broken = dataclasses.replace(workload, ops=[dataclasses.replace(o) for o in workload.ops])
    broken.ops[op.index].writes = (*op.writes, other)
    assert build_slots(broken)[op.writes[0]].recomputable_by is None


def test_lowest_peak_mode_recomputes_without_a_budget():
    workload = chain_workload(1)
    lowest = plan_job(workload, BANDWIDTH)
    assert any(e.kind == "recompute" for e in lowest.plans["job"].events)
    # a job alone that may not recompute (TENSILE_RECOMPUTE=false, the hook's in-process planner) gets none
    kept = plan_job(workload, BANDWIDTH, recompute=False)
    assert kept.plans["job"].events and not any(e.kind == "recompute" for e in kept.plans["job"].events)
    budgeted = plan_job(workload, BANDWIDTH, budget_bytes=lowest.scheduled_peak_bytes)
    assert lowest.scheduled_peak_bytes <= budgeted.scheduled_peak_bytes


@pytest.mark.parametrize("seed", range(4))
def test_an_input_of_a_replay_is_itself_replayed_early(seed):
    """A tensor that a planned replay reads inside its gap is replayed just before that replay (not
    before its own next access), so both save memory at the peak; the simulator needs no passive fetch."""
    workload = chain_workload(seed)
    result = plan_job(workload, BANDWIDTH, name="a")
    check_invariants(result, {"a": workload}, BANDWIDTH)
    plan = result.plans["a"]
    slots = build_slots(workload)
    root_of = slot_of(slots)
    recomputes = [e for e in plan.events if e.kind == "recompute"]
    replay_reads = {  # (slot, op after which a replay that reads it runs)
        (root_of[t], e.trigger)
        for e in recomputes
        for _, t in chain_inputs(workload, slots[root_of[e.tensor]], slots[root_of[e.tensor]].chain(e.trigger + 1))
    }
    early = [e for e in recomputes if (root_of[e.tensor], e.trigger + 1) in replay_reads]
    assert early, "no input of a replay was replayed itself"
    for e in early:  # back just before the replay that reads it, well before its own next access
        assert min(a for a in slots[root_of[e.tensor]].accesses if a > e.trigger) > e.trigger + 1
    sim = simulate([SimJob("a", workload, plan)], DEVICE).jobs["a"]
    assert sim.passive_swap_ins == 0 and sim.stall_seconds == 0
    assert sim.peak_bytes <= plan.forecast.scheduled_peak_bytes


def test_recompute_is_turned_off_per_job():
    """A job that may not recompute gets none; its neighbour on the same GPU still does."""
    workloads = {name: random_workload(seed, layers=16) for name, seed in (("a", 1), ("b", 1))}

    def kinds(recompute_a: bool) -> dict[str, set[str]]:
        specs = [JobToPlan("a", workloads["a"], recompute=recompute_a), JobToPlan("b", workloads["b"])]
        result = plan_gpu(specs, BANDWIDTH, budget_bytes=1)  # unreachable: every legal event is taken
        check_invariants(result, workloads, BANDWIDTH)
        return {name: {e.kind for e in plan.events} for name, plan in result.plans.items()}

    both = kinds(True)
    assert "recompute" in both["a"] and "recompute" in both["b"]
    only_b = kinds(False)
    assert "recompute" not in only_b["a"] and "recompute" in only_b["b"]


def test_each_job_keeps_its_own_budget_when_the_gpu_has_room():
    """The GPU's budget is loose, one job's own budget is tight: only that job gets events, down to it."""
    workloads = {"tight": random_workload(4, layers=16), "loose": random_workload(5, layers=16)}
    vanilla = {name: analyze_vanilla(w).peak_bytes for name, w in workloads.items()}
    own = int(0.8 * vanilla["tight"])
    specs = [JobToPlan("tight", workloads["tight"], budget_bytes=own), JobToPlan("loose", workloads["loose"])]
    result = plan_gpu(specs, BANDWIDTH, budget_bytes=10 * sum(vanilla.values()))
    check_invariants(result, workloads, BANDWIDTH)
    assert result.plans["tight"].forecast.scheduled_peak_bytes <= own
    moves = {"swap_out", "swap_in", "recompute"}  # releases after last use come with every plan
    assert not moves & {e.kind for e in result.plans["loose"].events}
    assert moves & {e.kind for e in result.plans["tight"].events}
    # without its own budget the loose GPU budget asks nothing of it
    alone = plan_gpu([JobToPlan("tight", workloads["tight"])], BANDWIDTH, budget_bytes=10 * vanilla["tight"])
    assert not moves & {e.kind for e in alone.plans["tight"].events}


@pytest.mark.parametrize("seed", range(4))
def test_activations_only_plans_move_no_persistent_tensor_and_recompute_only_what_the_native_path_replays(seed):
    """What the hook's native path carries (its default on CUDA): parameters, optimizer state and the
    batch stay on the device, a swap-out follows a forward use (the native path swaps out at module calls:
    a gradient made in backward and read by the optimizer stays, as the hook would leave it, so the forecast
    is what the job gets), and only convolutions' and batch norms' outputs are replayed, released after a
    forward use (these random workloads have neither); the peak still drops."""
    workload = random_workload(seed, layers=16)
    full = plan_job(workload, BANDWIDTH, name="a")
    native = plan_job(workload, BANDWIDTH, name="a", activations_only=True)
    moved = {e.tensor for e in native.plans["a"].events if e.kind in ("swap_out", "swap_in")}
    persistent = {t.id for t in workload.tensors.values() if t.created_by < 0 or t.reuses is not None}
    assert not moved & persistent
    for event in native.plans["a"].events:
        if event.kind == "swap_out":
            uses = [op.index for op in workload.ops if event.tensor in op.inputs + op.outputs and op.index <= event.trigger]
            assert workload.ops[max(uses)].phase == "forward", event
    assert not any(e.next_iteration for e in native.plans["a"].events)
    for event in native.plans["a"].events:
        if event.kind == "recompute":
            assert workload.ops[workload.tensors[event.tensor].created_by].name in NATIVE_CREATORS, event
        if event.kind == "release":
            assert workload.ops[event.trigger].phase == "forward", event
    if moved:
        assert native.scheduled_peak_bytes < native.vanilla_peak_bytes
    else:  # seed 3: at its peak (in backward) only gradients and persistent tensors could move
        assert native.scheduled_peak_bytes == native.vanilla_peak_bytes  # its releases are PyTorch's own frees
    assert full.scheduled_peak_bytes <= native.scheduled_peak_bytes
