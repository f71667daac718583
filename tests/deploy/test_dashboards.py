"""The shipped Grafana dashboards (charts/tensile/dashboards/*.json): made by tensile/dashboards.py, and
every query in them returns series from a real Prometheus (Debian's package, started here) scraping what they
chart: a real agent while two jobs train under the hook in local mode (`tensile run --agent`), and the
operator's metrics server while admission decisions are recorded through it as the operator records them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from tensile_operator.metrics import OperatorMetrics
from tests.support.agent_harness import ROOT, ThreadedAgent, free_port, get

from tensile.dashboards import build, render

DASHBOARDS = ROOT / "charts" / "tensile" / "dashboards"
SCRAPE_JOB = "tensile-agent"
OPERATOR_SCRAPE_JOB = "tensile-operator"
AGENT_DASHBOARDS = ("tensile-gpus.json", "tensile-jobs.json")  # each checked against the metrics it charts
OPERATOR_DASHBOARDS = ("tensile-operator.json",)
RATE_INTERVAL = "5s"  # what Grafana's $__rate_interval is at least: 4 x the 1 s scrape interval, plus slack
LABEL_VALUES = re.compile(r"^label_values\((?P<match>.+),\s*(?P<label>\w+)\)$")
JOBS = {"a": [], "b": ["--memory-budget", "0.8"]}  # one job under a budget below its vanilla peak: it swaps
HOOK_ENV = {"TENSILE_AGENT_INTERVAL": "0.2", "TENSILE_AGENT_MAX_BACKOFF": "0.5"}


def shipped() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def substitute(expr: str) -> str:
    """What Grafana sends with every template variable on All: `$__rate_interval` an interval, the others `.*`."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def test_committed_files_are_what_the_builder_makes():
    built = build()
    assert sorted(shipped()) == sorted(built), "run `python -m tensile.dashboards` and commit charts/tensile/dashboards/"
    for name, dashboard in built.items():
        assert (DASHBOARDS / name).read_text() == render(dashboard), f"{name} was edited or is stale: run `python -m tensile.dashboards`"


def test_every_panel_has_an_id_a_title_a_unit_and_targets():
    dashboards = shipped()
    assert len({d["uid"] for d in dashboards.values()}) == len(dashboards)
    for name, dashboard in dashboards.items():
        declared = variables(dashboard)
        assert declared["datasource"]["type"] == "datasource" and declared["datasource"]["query"] == "prometheus"
        for variable in declared.values():
            if variable["type"] == "query":
                assert LABEL_VALUES.match(variable["definition"]), f"{name}: variable {variable['name']} is not label_values(...)"
        panels = dashboard["panels"]
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), f"{name}: panel ids repeat: {ids}"
        for panel in panels:
            where = f"{name}: panel {panel['id']} ({panel.get('title')!r})"
            assert panel["title"] and panel["description"], where
            assert panel["fieldConfig"]["defaults"]["unit"], where
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel["targets"], f"{where} has no target"
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), where
            used = {v for t in panel["targets"] for v in re.findall(r"\$(\w+)", t["expr"])} | set(re.findall(r"\$(\w+)", panel["title"]))
            assert used - {"__rate_interval"} <= set(declared), f"{where} uses undeclared variables {used - set(declared)}"
    assert {"gpu"} <= set(variables(dashboards["tensile-gpus.json"]))
    assert {"gpu", "namespace", "job"} <= set(variables(dashboards["tensile-jobs.json"]))


def test_every_dashboard_is_queried_against_the_metrics_it_charts():
    """The real-Prometheus tests below each take the dashboards of one exporter: a new one must be given to one."""
    assert sorted(shipped()) == sorted(AGENT_DASHBOARDS + OPERATOR_DASHBOARDS)


def test_a_repeated_panel_has_its_rows_to_itself():
    """Grafana fills a horizontally repeated panel's row with its copies and allows no other panel there."""
    for name, dashboard in shipped().items():
        panels = dashboard["panels"]
        for repeated in (p for p in panels if p.get("repeat")):
            top, bottom = repeated["gridPos"]["y"], repeated["gridPos"]["y"] + repeated["gridPos"]["h"]
            beside = [p["title"] for p in panels if p is not repeated and p["gridPos"]["y"] < bottom
                      and p["gridPos"]["y"] + p["gridPos"]["h"] > top]
            assert not beside, f"{name}: {beside} on the rows of the repeated panel {repeated['title']!r}"
    assert any(p.get("repeat") for p in shipped()["tensile-gpus.json"]["panels"])


def test_the_jobs_observed_peak_under_plan_is_plotted_against_the_forecasts():
    """The peak of every iteration includes the unplanned first ones at the vanilla peak: read alone against the
    scheduled forecast it looks like a miss, so the peak measured under a plan stands beside it; and the reserved
    peak the hook observes beside the agent's forecast of it and the cap on it (how close the job runs to its share)."""
    panels = {p["title"]: [t["expr"] for t in p["targets"]] for p in shipped()["tensile-jobs.json"]["panels"]}
    peaks, accuracy = panels["Peaks: forecast against observed"], panels["Observed peak / forecast scheduled peak"]
    forecasts = ["tensile_job_forecast_vanilla_peak_bytes", "tensile_job_forecast_scheduled_peak_bytes",
                 "tensile_job_forecast_reserved_peak_bytes"]
    observed = ["tensile_job_observed_peak_bytes", "tensile_job_observed_planned_peak_bytes",
                "tensile_job_observed_reserved_peak_bytes"]
    assert [expr.split("{")[0] for expr in peaks] == [*forecasts, *observed, "tensile_job_allocator_cap_bytes"]
    assert [expr.split("{")[0] for expr in accuracy] == observed[1::-1]  # each over the scheduled forecast


def test_the_eor_panel_shows_the_measured_eor_and_the_forecast_apart():
    """The observed EOR read ~100% whatever the slowdown (time / (time - stalls) without a vanilla time): the agent now
    exports it only against the hook's vanilla time, and the panel names the forecast beside it as a forecast."""
    (panel,) = [p for p in shipped()["tensile-jobs.json"]["panels"] if "EOR" in p["title"]]
    assert [(t["expr"].split("{")[0], t["legendFormat"].rsplit(" ", 1)[-1]) for t in panel["targets"]] == [
        ("tensile_job_observed_eor_ratio", "observed"), ("tensile_job_forecast_eor_ratio", "forecast")]
    assert "vanilla time the hook measured" in panel["description"]


@contextmanager
def prometheus(tmp_path: Path, target: str, job: str = SCRAPE_JOB) -> Iterator[str]:
    """Debian's prometheus with its own config and data in tmp_path, scraping `target` every second as `job`."""
    binary, promtool = shutil.which("prometheus"), shutil.which("promtool")
    assert binary and promtool, "Prometheus is not installed: apt-get install prometheus (Debian's package)"
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        # honor_labels: the agent's `job` label is the training job's (as the chart's ServiceMonitor keeps it)
        "scrape_configs": [{"job_name": job, "honor_labels": True, "static_configs": [{"targets": [target]}]}],
    }, indent=2))
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "prometheus.log"
    with log.open("w") as out:
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not _answers(url, "/-/ready"):
            assert proc.poll() is None, f"prometheus exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"prometheus not ready: {log.read_text()[-2000:]}"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


def _answers(url: str, path: str) -> bool:
    try:
        return get(url, path)[0] == 200
    except OSError:
        return False


@contextmanager
def training(tmp_path: Path, agent_url: str, job: str, options: list[str]) -> Iterator[subprocess.Popen]:
    """`tensile run --agent URL --job JOB -- python examples/train_mlp.py` running (long) until the block ends."""
    tensile = Path(sys.executable).with_name("tensile")
    command = [str(tensile), "run", "--agent", agent_url, "--job", job, *options, "--report", str(tmp_path / f"{job}.json"),
               "--", sys.executable, str(ROOT / "examples" / "train_mlp.py"), "--steps", "100000"]
    with (tmp_path / f"{job}.log").open("w") as log:
        # a new session: `tensile run` and the training under it are stopped together
        proc = subprocess.Popen(command, cwd=tmp_path, env=os.environ | HOOK_ENV, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def query(prometheus_url: str, expr: str) -> list[dict]:
    status, body = get(prometheus_url, "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert status == 200 and isinstance(body, dict) and body["status"] == "success", f"{expr}: {status} {body}"
    return body["data"]["result"]


def label_values(prometheus_url: str, definition: str) -> list[str]:
    """Grafana's label_values(MATCH, LABEL) through Prometheus' API, as Grafana asks it."""
    parts = LABEL_VALUES.match(definition)
    assert parts, definition
    path = f"/api/v1/label/{parts['label']}/values?" + urllib.parse.urlencode({"match[]": substitute(parts["match"])})
    status, body = get(prometheus_url, path)
    assert status == 200 and isinstance(body, dict) and body["status"] == "success", f"{definition}: {status} {body}"
    return body["data"]


# series the agent exports only once a hook measured them: the observed EOR needs a vanilla iteration time from the
# hook (the agent no longer makes one up from time / (time - stalls)), which `tensile run` does not send yet
HOOK_MEASURED_ONLY = ("tensile_job_observed_eor_ratio",)
# series the agent exports only for a job on CUDA: the allocator's cap is set under TENSILE_MEMORY_CAP on a CUDA device,
# and the jobs trained here run on the CPU device, which has no caching allocator to cap
CUDA_ONLY = ("tensile_job_allocator_cap_bytes",)


def empty_queries(prometheus_url: str, dashboards: dict[str, dict]) -> list[str]:
    """Every panel query and template variable of every dashboard that returns nothing now."""
    empty = []
    for name, dashboard in dashboards.items():
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                if target["expr"].startswith(HOOK_MEASURED_ONLY + CUDA_ONLY):
                    continue
                if not query(prometheus_url, substitute(target["expr"])):
                    empty.append(f"{name} / {panel['title']} / {target['refId']}: {target['expr']}")
        for variable in variables(dashboard).values():
            if variable["type"] == "query" and not label_values(prometheus_url, variable["definition"]):
                empty.append(f"{name} / variable {variable['name']}: {variable['definition']}")
    return empty


def test_every_agent_dashboard_query_returns_series_from_a_real_prometheus(tmp_path):
    dashboards = {name: board for name, board in shipped().items() if name in AGENT_DASHBOARDS}
    with ExitStack() as stack:
        agent = stack.enter_context(ThreadedAgent())
        jobs = {job: stack.enter_context(training(tmp_path, agent.url, job, options)) for job, options in JOBS.items()}
        prom = stack.enter_context(prometheus(tmp_path, f"127.0.0.1:{agent.port}"))
        deadline = time.monotonic() + 120
        while True:
            for job, proc in jobs.items():
                assert proc.poll() is None, f"training {job} exited {proc.returncode}: {(tmp_path / f'{job}.log').read_text()[-3000:]}"
            empty = empty_queries(prom, dashboards)
            # both training jobs registered through the hook, and their `job` label survived the scrape
            seen = sorted(label_values(prom, 'label_values(tensile_job_observed_peak_bytes{namespace="default"}, job)'))
            # the job under a budget has applied its plan in a scraped iteration (its counters exist from
            # registration on, at 0 until then: a scrape can land between the two)
            moved = query(prom, 'sum(tensile_job_swapped_bytes_total{job="b"}) + sum(tensile_job_recomputed_bytes_total{job="b"})')
            if (not empty and seen == sorted(JOBS) and moved and float(moved[0]["value"][1]) > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not empty, "queries without series:\n" + "\n".join(empty)
        assert seen == sorted(JOBS), f"jobs seen by Prometheus: {seen}"
        assert [s["value"][1] for s in query(prom, f'up{{job="{SCRAPE_JOB}"}}')] == ["1"]
        assert moved and float(moved[0]["value"][1]) > 0, "the job under a budget neither swapped nor recomputed"


def record_decisions(metrics: OperatorMetrics, round_: int) -> None:
    """What the operator's intake and scheduler record for a few jobs: each call makes every counter and histogram grow
    (the dashboard's rates and quantiles need an increase within the rate interval)."""
    metrics.admissions.labels("invalid").inc()  # the intake's refusals, then the scheduler's decisions
    metrics.forecast_seconds.observe(0.02 + 0.01 * (round_ % 3))
    metrics.admissions.labels("no_budget").inc()
    metrics.admissions.labels("queued").inc()
    metrics.placement_seconds.labels("false").observe(0.0008)
    metrics.placement_seconds.labels("true").observe(0.3 + 0.1 * (round_ % 2))
    metrics.admissions.labels("admitted").inc()


@pytest.mark.slow
def test_every_operator_dashboard_query_returns_series_from_a_real_prometheus(tmp_path):
    dashboards = {name: board for name, board in shipped().items() if name in OPERATOR_DASHBOARDS}
    phases = {"default/a": "Running", "default/b": "Queued", "default/c": "Forecasting", "ml/d": "Succeeded"}
    metrics = OperatorMetrics(lambda: dict(phases))
    port = free_port()
    metrics.serve(port, "127.0.0.1")
    try:
        with prometheus(tmp_path, f"127.0.0.1:{port}", OPERATOR_SCRAPE_JOB) as prom:
            deadline, round_ = time.monotonic() + 30, 0
            while True:
                record_decisions(metrics, round_)
                round_ += 1
                empty = empty_queries(prom, dashboards)
                if not empty or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert not empty, "queries without series:\n" + "\n".join(empty)
            assert [s["value"][1] for s in query(prom, f'up{{job="{OPERATOR_SCRAPE_JOB}"}}')] == ["1"]
            panels = {p["title"]: p["targets"] for p in dashboards["tensile-operator.json"]["panels"]}
            (phases_target,) = panels["TrainingJobs by phase"]
            by_phase = {s["metric"]["phase"]: s["value"][1] for s in query(prom, phases_target["expr"])}
            assert {phase: by_phase[phase] for phase in ("Running", "Queued", "Forecasting", "Admitted")} == {
                "Running": "1", "Queued": "1", "Forecasting": "1", "Admitted": "0"}
            for target in panels["Placement time"]:  # a line for each joint_plan, a number (an increase), not NaN
                placement = query(prom, substitute(target["expr"]))
                assert {s["metric"]["joint_plan"] for s in placement} == {"true", "false"}
                assert all(0 < float(s["value"][1]) <= 1 for s in placement), placement
    finally:
        metrics.close()
