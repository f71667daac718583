"""Prometheus metrics, made from the agent's state at scrape time.

A collector reads the state on each scrape instead of keeping labelled series alive: a job that
unregisters simply stops appearing, so cardinality stays bounded by the jobs that are there now.
Conventions: base units (`_bytes`, `_seconds`), counters end in `_total`; labels `gpu` (uuid),
`namespace`, `job`. Per-job counters restart at 0 when an agent restarts (Prometheus sees a counter
reset, which `rate()` handles).

Note for scrape configs: `job` is also Prometheus's own target label; scrape the agent with
`honor_labels: true` (the chart's ServiceMonitor does) or the job label lands in `exported_job`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tensile.agent_contract import REPLAN_REASONS
from tensile_agent.state import AgentState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JOB_LABELS = ["gpu", "namespace", "job"]


class AgentCollector(Collector):
    def __init__(self, state: AgentState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        state = self.state
        inventory = state.inventory
        info = GaugeMetricFamily("tensile_agent_info", "The node agent: 1, with its node, start epoch and GPU source",
                                 labels=["node", "epoch", "simulated", "reason"])
        info.add_metric([state.node, state.epoch, str(inventory.simulated).lower(), inventory.reason or ""], 1)
        yield info
        yield GaugeMetricFamily("tensile_agent_gpus", "GPUs this agent manages (0 without NVML)", value=len(inventory.gpus))
        yield GaugeMetricFamily("tensile_queued_jobs", "Jobs waiting for GPU memory (set by the local runner; 0 otherwise)",
                                value=state.queued_jobs)

        gpu_info = GaugeMetricFamily("tensile_gpu_info", "A GPU of this node: 1, with its name and whether it is simulated",
                                     labels=["gpu", "index", "name", "simulated"])
        memory = GaugeMetricFamily("tensile_gpu_memory_bytes", "Device memory", labels=["gpu"])
        capacity = GaugeMetricFamily("tensile_gpu_capacity_bytes", "Memory available to admission (device memory less headroom)", labels=["gpu"])
        used = GaugeMetricFamily("tensile_gpu_used_bytes", "Used memory from NVML (simulated GPUs: the jobs' observed peaks "
                                 "plus the per-job context the GPU is simulated with, --context-bytes)", labels=["gpu", "simulated"])
        util = GaugeMetricFamily("tensile_gpu_utilization_ratio", "GPU utilization from NVML, 0..1", labels=["gpu"])
        vanilla = GaugeMetricFamily("tensile_gpu_forecast_vanilla_peak_bytes", "Sum of the jobs' forecast vanilla peaks", labels=["gpu"])
        scheduled = GaugeMetricFamily("tensile_gpu_forecast_scheduled_peak_bytes", "Sum of the jobs' forecast scheduled peaks", labels=["gpu"])
        jobs_g = GaugeMetricFamily("tensile_gpu_jobs", "Jobs registered on the GPU", labels=["gpu"])
        round_s = GaugeMetricFamily("tensile_gpu_last_planning_seconds", "Duration of the GPU's last planning round", labels=["gpu"])
        planning = CounterMetricFamily("tensile_agent_planning_seconds", "Time spent planning this GPU", labels=["gpu"])
        replans = CounterMetricFamily("tensile_agent_replans", f"Planning rounds by reason ({', '.join(REPLAN_REASONS)})",
                                      labels=["gpu", "reason"])

        job_metrics = {
            "vanilla": GaugeMetricFamily("tensile_job_forecast_vanilla_peak_bytes", "Forecast peak without scheduling", labels=JOB_LABELS),
            "scheduled": GaugeMetricFamily("tensile_job_forecast_scheduled_peak_bytes", "Forecast peak under the current plan", labels=JOB_LABELS),
            "forecast_reserved": GaugeMetricFamily(
                "tensile_job_forecast_reserved_peak_bytes",
                "Forecast of what the job's process reserves under the current plan: on CUDA the caching allocator's "
                "segments (its model, with cuBLAS's workspaces), on the CPU device the scheduled peak",
                labels=JOB_LABELS),
            "observed": GaugeMetricFamily("tensile_job_observed_peak_bytes", "Highest memory peak the hook measured", labels=JOB_LABELS),
            "observed_planned": GaugeMetricFamily(
                "tensile_job_observed_planned_peak_bytes",
                "Highest memory peak the hook measured in iterations under the current plan: compare with the forecast scheduled peak",
                labels=JOB_LABELS),
            "reserved": GaugeMetricFamily(
                "tensile_job_observed_reserved_peak_bytes",
                "Highest memory the job's process held, as the hook measured it: on CUDA the caching allocator's "
                "max_memory_reserved (absent until the hook sends it)", labels=JOB_LABELS),
            "cap": GaugeMetricFamily(
                "tensile_job_allocator_cap_bytes",
                "The cap on what the job's process's caching allocator may reserve (its admitted size less its CUDA "
                "context), as its hook registered it: absent without one (the CPU device, no cap set)",
                labels=JOB_LABELS),
            "iteration": GaugeMetricFamily("tensile_job_iteration_seconds", "Mean iteration time in the hook's last report", labels=JOB_LABELS),
            "predicted": GaugeMetricFamily("tensile_job_predicted_iteration_seconds", "Vanilla iteration time the plan was made with", labels=JOB_LABELS),
            "eor": GaugeMetricFamily("tensile_job_observed_eor_ratio", "Observed extra overhead rate: iteration time / the vanilla "
                                     "iteration time the hook measured (absent until it sends one)", labels=JOB_LABELS),
            "forecast_eor": GaugeMetricFamily("tensile_job_forecast_eor_ratio", "Predicted extra overhead rate of the current plan "
                                              "(the latency model's: planned / vanilla iteration time)", labels=JOB_LABELS),
            "silent": GaugeMetricFamily("tensile_job_silent_seconds", "Seconds since the job's last call with its token (a live "
                                        "hook polls twice a second)", labels=JOB_LABELS),
            "version": GaugeMetricFamily("tensile_job_plan_version", "Version of the job's current plan", labels=JOB_LABELS),
            "applied": GaugeMetricFamily("tensile_job_applied_plan_version", "Plan version the hook reported running", labels=JOB_LABELS),
            "budget": GaugeMetricFamily("tensile_job_memory_budget_bytes", "The memory budget the job's hook holds it to (the "
                                        "current plan's): its own, or its share of a GPU it shares (see docs/agent.md)", labels=JOB_LABELS),
        }
        counters = {
            "iterations": CounterMetricFamily("tensile_job_iterations", "Iterations the hook reported", labels=JOB_LABELS),
            "stall": CounterMetricFamily("tensile_job_stall_seconds", "Time ops waited for tensors not resident", labels=JOB_LABELS),
            "swapped": CounterMetricFamily("tensile_job_swapped_bytes", "Bytes swapped, by direction (out: device to host)", labels=[*JOB_LABELS, "direction"]),
            "recomputed": CounterMetricFamily("tensile_job_recomputed_bytes", "Bytes recomputed", labels=JOB_LABELS),
            "out_of_memory": CounterMetricFamily(
                "tensile_job_out_of_memory_retries", "Out-of-memory errors (the device full, or the job's memory cap "
                "reached) the hook's guard turned into passive evictions and a retry", labels=JOB_LABELS),
        }

        summaries = {uuid: state.gpu_summary(uuid) for uuid in inventory.gpus}
        with state.lock:
            jobs = list(state.jobs.values())
            rounds = dict(state.rounds)
            replan_counts = dict(state.replans)
            rows = []
            for j in jobs:
                f = j.plan.forecast if j.plan else None
                held_to = j.plan.memory_budget_bytes if j.plan and j.plan.memory_budget_bytes else j.memory_budget_bytes
                rows.append(([j.gpu, j.ref.namespace, j.ref.name], f, j.reserved_forecast, j.allocator_cap_bytes,
                             j.version, held_to, j.observed.to_dict(), j.silent_seconds))
        for uuid, s in summaries.items():
            gpu_info.add_metric([uuid, str(s["index"]), s["name"], str(s["simulated"]).lower()], 1)
            memory.add_metric([uuid], s["memory_bytes"])
            capacity.add_metric([uuid], s["capacity_bytes"])
            if s["used_bytes"] is not None:
                used.add_metric([uuid, str(s["simulated"]).lower()], s["used_bytes"])
            if s["utilization"] is not None:
                util.add_metric([uuid], s["utilization"])
            vanilla.add_metric([uuid], s["committed"]["vanilla_peak_bytes"])
            scheduled.add_metric([uuid], s["committed"]["scheduled_peak_bytes"])
            jobs_g.add_metric([uuid], s["jobs_count"])
            last = rounds.get(uuid)
            if last is not None:
                round_s.add_metric([uuid], last.seconds)
                planning.add_metric([uuid], last.rounds_seconds_total)
        # every reason of every GPU from 0: rate()/increase() need a sample before the first re-plan to count it
        zeros = {(uuid, reason): 0 for uuid in inventory.gpus for reason in REPLAN_REASONS}
        for (uuid, reason), count in sorted((zeros | replan_counts).items()):
            replans.add_metric([uuid, reason], count)
        for labels, forecast, reserved, cap, version, budget, obs, silent in rows:
            if forecast is not None:
                job_metrics["vanilla"].add_metric(labels, forecast.vanilla_peak_bytes)
                job_metrics["scheduled"].add_metric(labels, forecast.scheduled_peak_bytes)
                job_metrics["predicted"].add_metric(labels, forecast.predicted_iteration_seconds)
                job_metrics["forecast_eor"].add_metric(labels, forecast.predicted_eor)
            if reserved is not None:
                job_metrics["forecast_reserved"].add_metric(labels, reserved.reserved_peak_bytes)
            if cap is not None:
                job_metrics["cap"].add_metric(labels, cap)
            job_metrics["version"].add_metric(labels, version)
            job_metrics["silent"].add_metric(labels, silent)
            if budget is not None:
                job_metrics["budget"].add_metric(labels, budget)
            if obs["peak_bytes"] is not None:
                job_metrics["observed"].add_metric(labels, obs["peak_bytes"])
            if obs["planned_peak_bytes"] is not None:
                job_metrics["observed_planned"].add_metric(labels, obs["planned_peak_bytes"])
            if obs["reserved_peak_bytes"] is not None:
                job_metrics["reserved"].add_metric(labels, obs["reserved_peak_bytes"])
            if obs["iteration_seconds"] is not None:
                job_metrics["iteration"].add_metric(labels, obs["iteration_seconds"])
            if obs["eor"] is not None:
                job_metrics["eor"].add_metric(labels, obs["eor"])
            if obs["plan_version"] is not None:
                job_metrics["applied"].add_metric(labels, obs["plan_version"])
            counters["iterations"].add_metric(labels, obs["iterations"])
            counters["stall"].add_metric(labels, obs["stall_seconds"])
            counters["swapped"].add_metric([*labels, "out"], obs["swap_out_bytes"])
            counters["swapped"].add_metric([*labels, "in"], obs["swap_in_bytes"])
            counters["recomputed"].add_metric(labels, obs["recompute_bytes"])
            counters["out_of_memory"].add_metric(labels, obs["out_of_memory_retries"])
        yield from (gpu_info, memory, capacity, used, util, vanilla, scheduled, jobs_g, round_s, planning, replans)
        yield from job_metrics.values()
        yield from counters.values()


def make_registry(state: AgentState) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(state))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
