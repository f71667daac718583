"""Tensile's Grafana dashboards, made as code.

`python -m tensile.dashboards` writes `charts/tensile/dashboards/*.json` (Grafana 10+ dashboard JSON
model); the chart ships those files as ConfigMaps labelled `grafana_dashboard: "1"`. The files are
generated, never edited by hand: a test compares them with what this module builds now.

The GPUs and Jobs dashboards follow the agent's metrics (node_agent/tensile_agent/metrics.py): labels `gpu`,
`namespace`, `job`, so Prometheus must scrape the agent with `honor_labels: true` (the chart's ServiceMonitor does).
The Operator dashboard follows the operator's (operator/tensile_operator/metrics.py), scraped from the operator's own
Service; they carry no GPU or job label. The data source is the `${datasource}` template variable, so the dashboards
work in any Grafana whatever its Prometheus data source is called. docs/dashboards.md says what each panel answers.
"""

from __future__ import annotations

import argparse
import json
import string
from dataclasses import dataclass
from pathlib import Path

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_COLUMNS = 24
RATE = "$__rate_interval"
JOB_LABELS = ("gpu", "namespace", "job")


def sel(metric: str, *labels: str) -> str:
    """`metric{label=~"$label", ...}`: the series picked by the dashboard's template variables."""
    if not labels:
        return metric
    return metric + "{" + ", ".join(f'{label}=~"${label}"' for label in labels) + "}"


def rate(metric: str, *labels: str) -> str:
    return f"rate({sel(metric, *labels)}[{RATE}])"


def ratio(numerator: str, denominator: str, *labels: str) -> str:
    return f"{sel(numerator, *labels)} / {sel(denominator, *labels)}"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """A time series panel; `unit` is a Grafana unit id (bytes, binBps, s, percentunit, ops, short)."""

    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    width: int = 12
    height: int = 8
    repeat: str | None = None  # a template variable: one panel per selected value


@dataclass(frozen=True)
class Variable:
    """A query variable filled by Grafana's `label_values(METRIC, LABEL)` (multi-select, All = any)."""

    name: str
    label: str
    metric: str  # a series selector that carries the label

    @property
    def query(self) -> str:
        return f"label_values({self.metric}, {self.name})"


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    panels: tuple[Panel, ...]


def _target(target: Target, index: int) -> dict:
    return {"datasource": DATASOURCE, "refId": string.ascii_uppercase[index], "expr": target.expr,
            "legendFormat": target.legend, "range": True, "instant": False, "editorMode": "code"}


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    out = {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {"unit": panel.unit, "min": 0,
                         "custom": {"lineWidth": 1, "fillOpacity": 0, "showPoints": "never", "spanNulls": False}},
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True, "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [_target(t, i) for i, t in enumerate(panel.targets)],
    }
    if panel.repeat:
        out |= {"repeat": panel.repeat, "repeatDirection": "h", "maxPerRow": GRID_COLUMNS // panel.width}
    return out


def _variable(variable: Variable) -> dict:
    return {
        "name": variable.name, "label": variable.label, "type": "query", "datasource": DATASOURCE,
        "definition": variable.query, "query": {"query": variable.query, "refId": "StandardVariableQuery"},
        "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "sort": 1, "regex": "", "hide": 0,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "skipUrlSync": False,
    }


DATASOURCE_VARIABLE = {
    "name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "regex": "",
    "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1, "skipUrlSync": False,
}


def _layout(panels: tuple[Panel, ...]) -> list[dict]:
    """Left to right, top to bottom on Grafana's 24-column grid; ids 1, 2, ... in that order. A repeated
    panel gets rows of its own: Grafana fills its row with the copies and allows no other panel there."""
    out, x, y, row_height = [], 0, 0, 0
    for panel_id, panel in enumerate(panels, start=1):
        if x + panel.width > GRID_COLUMNS or (panel.repeat and x):
            x, y, row_height = 0, y + row_height, 0
        out.append(_panel(panel, panel_id, x, y))
        x = GRID_COLUMNS if panel.repeat else x + panel.width
        row_height = max(row_height, panel.height)
    return out


def to_json(dashboard: Dashboard) -> dict:
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["tensile"],
        "editable": False,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "title": "Tensile", "tags": ["tensile"], "asDropdown": False,
                   "includeVars": False, "keepTime": True}],
        "templating": {"list": [DATASOURCE_VARIABLE, *(_variable(v) for v in dashboard.variables)]},
        "panels": _layout(dashboard.panels),
    }


def gpus_dashboard() -> Dashboard:
    gpu = ("gpu",)
    memory = Panel(
        "GPU $gpu: memory",
        "Capacity (device memory less headroom) against the sums of the jobs' forecast peaks, with and without "
        "Tensile's plans, and the memory NVML reports used. Scheduled below capacity: the plans fit.",
        "bytes",
        (Target(sel("tensile_gpu_capacity_bytes", *gpu), "capacity"),
         Target(sel("tensile_gpu_forecast_scheduled_peak_bytes", *gpu), "forecast scheduled peaks (sum)"),
         Target(sel("tensile_gpu_forecast_vanilla_peak_bytes", *gpu), "forecast vanilla peaks (sum)"),
         Target(sel("tensile_gpu_used_bytes", *gpu), "used (NVML)")),
        repeat="gpu",
    )
    committed = Panel(
        "Capacity committed",
        "The sum of forecast peaks as a share of capacity: scheduled (what admission counts) and vanilla "
        "(what the same jobs would need without Tensile).",
        "percentunit",
        (Target(ratio("tensile_gpu_forecast_scheduled_peak_bytes", "tensile_gpu_capacity_bytes", *gpu), "{{gpu}} scheduled"),
         Target(ratio("tensile_gpu_forecast_vanilla_peak_bytes", "tensile_gpu_capacity_bytes", *gpu), "{{gpu}} vanilla")),
    )
    jobs = Panel("Jobs per GPU", "Jobs registered with the node agent on each GPU.", "short",
                 (Target(sel("tensile_gpu_jobs", *gpu), "{{gpu}}"),))
    queued = Panel("Queued jobs", "Jobs waiting for GPU memory: in a cluster the operator's count of TrainingJobs in "
                   "phase Queued, in local mode the local runner's (node agents export 0).",
                   "short", (Target("sum(tensile_queued_jobs)", "queued"),))
    replans = Panel(
        "Re-plans by reason",
        "Planning rounds per second: register, unregister, knobs, drift (latency model), workload (upload).",
        "ops",
        (Target(f"sum by (gpu, reason) ({rate('tensile_agent_replans_total', *gpu)})", "{{gpu}} {{reason}}"),),
    )
    planning = Panel("Planning time", "Share of wall time the agent spends planning each GPU.", "percentunit",
                     (Target(rate("tensile_agent_planning_seconds_total", *gpu), "{{gpu}}"),))
    return Dashboard("tensile-gpus", "Tensile / GPUs", "GPU memory: capacity, forecast peaks, NVML use; jobs, queue, re-plans.",
                     (Variable("gpu", "GPU", "tensile_gpu_capacity_bytes"),),
                     (memory, committed, jobs, queued, replans, planning))


def jobs_dashboard() -> Dashboard:
    who = "{{namespace}}/{{job}}"
    peaks = Panel(
        "Peaks: forecast against observed",
        "Each job's forecast peak without scheduling (vanilla) and under its current plan (scheduled), "
        "against the highest peak the hook measured in any iteration (the first ones run unplanned, at the "
        "vanilla peak) and in the iterations under its current plan (what the scheduled forecast predicts); and "
        "what the process holds (reserved: on CUDA the caching allocator's segments, what its neighbours find taken), "
        "forecast under the current plan and observed, against the cap on it (on CUDA: the job's admitted size less "
        "its context, past which an allocation fails out of memory).",
        "bytes",
        (Target(sel("tensile_job_forecast_vanilla_peak_bytes", *JOB_LABELS), f"{who} forecast vanilla"),
         Target(sel("tensile_job_forecast_scheduled_peak_bytes", *JOB_LABELS), f"{who} forecast scheduled"),
         Target(sel("tensile_job_forecast_reserved_peak_bytes", *JOB_LABELS), f"{who} forecast reserved"),
         Target(sel("tensile_job_observed_peak_bytes", *JOB_LABELS), f"{who} observed"),
         Target(sel("tensile_job_observed_planned_peak_bytes", *JOB_LABELS), f"{who} observed under plan"),
         Target(sel("tensile_job_observed_reserved_peak_bytes", *JOB_LABELS), f"{who} observed reserved"),
         Target(sel("tensile_job_allocator_cap_bytes", *JOB_LABELS), f"{who} allocator cap")),
        width=24,
    )
    accuracy = Panel(
        "Observed peak / forecast scheduled peak",
        "Under plan: 100% the forecast was exact, above it the plan holds more than forecast. All iterations: "
        "also the unplanned first ones, which run at the vanilla peak.",
        "percentunit",
        (Target(ratio("tensile_job_observed_planned_peak_bytes", "tensile_job_forecast_scheduled_peak_bytes", *JOB_LABELS),
                f"{who} under plan"),
         Target(ratio("tensile_job_observed_peak_bytes", "tensile_job_forecast_scheduled_peak_bytes", *JOB_LABELS),
                f"{who} all iterations")),
    )
    swap = Panel(
        "Swap traffic",
        "Bytes per second swapped out (device to host) and in, and recomputed instead of kept.",
        "binBps",
        (Target(f"sum by (namespace, job, direction) ({rate('tensile_job_swapped_bytes_total', *JOB_LABELS)})",
                f"{who} swap {{{{direction}}}}"),
         Target(rate("tensile_job_recomputed_bytes_total", *JOB_LABELS), f"{who} recomputed")),
    )
    stalls = Panel("Stalls", "Share of wall time ops waited for tensors that were not resident.", "percentunit",
                   (Target(rate("tensile_job_stall_seconds_total", *JOB_LABELS), who),))
    out_of_memory = Panel(
        "Out-of-memory retries",
        "Out-of-memory errors per second (the device full, or the job's memory cap reached) the hook's guard turned "
        "into passive evictions and a retry of the op. Any at all: the process held more than there was room for "
        "(compare its observed reserved peak with its share); ops then wait for the tensors each retry evicted.",
        "ops",
        (Target(rate("tensile_job_out_of_memory_retries_total", *JOB_LABELS), who),),
    )
    eor = Panel("EOR: observed and forecast",
                "Extra overhead rate, 100% is none. Observed: the measured iteration time against the vanilla time the "
                "hook measured (no line until a hook sends one: the agent exports no EOR it has no vanilla time for). "
                "Forecast: what the latency model predicts for the current plan.", "percentunit",
                (Target(sel("tensile_job_observed_eor_ratio", *JOB_LABELS), f"{who} observed"),
                 Target(sel("tensile_job_forecast_eor_ratio", *JOB_LABELS), f"{who} forecast")))
    version = Panel("Plan version", "The agent's current plan and the plan the hook reports running; a step is a re-plan.",
                    "none",
                    (Target(sel("tensile_job_plan_version", *JOB_LABELS), f"{who} planned"),
                     Target(sel("tensile_job_applied_plan_version", *JOB_LABELS), f"{who} running")))
    iteration = Panel("Iteration time", "Measured mean iteration time, and the vanilla time the plan was made with.", "s",
                      (Target(sel("tensile_job_iteration_seconds", *JOB_LABELS), f"{who} observed"),
                       Target(sel("tensile_job_predicted_iteration_seconds", *JOB_LABELS), f"{who} planned for")))
    return Dashboard("tensile-jobs", "Tensile / Jobs",
                     "Per job: forecast against observed peaks, swap traffic, stalls, out-of-memory retries, "
                     "EOR, plans.",
                     (Variable("namespace", "Namespace", "tensile_job_plan_version"),
                      Variable("job", "Job", 'tensile_job_plan_version{namespace=~"$namespace"}'),
                      Variable("gpu", "GPU", "tensile_job_plan_version")),
                     (peaks, accuracy, swap, stalls, out_of_memory, eor, version, iteration))


def quantiles(histogram: str, *by: str) -> tuple[Target, ...]:
    """p50 and p99 of a Prometheus histogram over the rate interval, a line for each value of the `by` labels."""
    grouped = f"sum by ({', '.join(('le', *by))}) ({rate(histogram + '_bucket')})"
    legend = " ".join(f"{label}={{{{{label}}}}}" for label in by)
    return tuple(Target(f"histogram_quantile({q}, {grouped})", f"{legend} p{round(q * 100)}".lstrip())
                 for q in (0.5, 0.99))


def operator_dashboard() -> Dashboard:
    phases = Panel("TrainingJobs by phase", "How many TrainingJobs the operator sees in each phase: how many wait "
                   "(Pending, Forecasting, Queued), hold GPU memory (Admitted, Running) or have finished.", "short",
                   (Target("sum by (phase) (tensile_trainingjobs)", "{{phase}}"),))
    admissions = Panel(
        "Admission decisions by result",
        "What admission decides, per second: admitted (each placement, a job placed again counted again), queued "
        "(an admission that had to wait), or why it refused (invalid, forecast_failed, no_budget, budget_unreachable).",
        "ops",
        (Target(f"sum by (result) ({rate('tensile_admissions_total')})", "{{result}}"),),
    )
    placement = Panel(
        "Placement time",
        "How long the scheduler takes to decide where a job goes or why it waits, with and without the joint "
        "planner (joint_plan). Jobs are placed one at a time: a slow placement delays every job behind it.",
        "s", quantiles("tensile_placement_seconds", "joint_plan"),
    )
    forecast = Panel("Forecast time", "How long forecasting a job takes (trace and plan, cache hits included): how "
                     "long a new TrainingJob stays in phase Forecasting before the scheduler can place it.", "s",
                     quantiles("tensile_forecast_seconds"))
    queued = Panel("Queued jobs", "How many TrainingJobs wait for GPU memory (phase Queued): above 0 for long, the "
                   "cluster's GPUs are full by forecast.", "short", (Target("sum(tensile_queued_jobs)", "queued"),),
                   width=24)
    return Dashboard("tensile-operator", "Tensile / Operator",
                     "Admission: TrainingJobs by phase, decisions by result, placement and forecast time, queue.",
                     (), (phases, admissions, placement, forecast, queued))


def build() -> dict[str, dict]:
    """File name -> dashboard JSON, for every dashboard Tensile ships."""
    return {f"{d.uid}.json": to_json(d) for d in (gpus_dashboard(), jobs_dashboard(), operator_dashboard())}


def render(dashboard: dict) -> str:
    return json.dumps(dashboard, indent=2) + "\n"


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, dashboard in build().items():
        path = directory / name
        path.write_text(render(dashboard))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tensile.dashboards", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("charts/tensile/dashboards"), help="folder for the JSON files")
    for path in write(parser.parse_args(argv).out):
        print(path)


if __name__ == "__main__":
    main()
