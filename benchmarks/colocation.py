"""Several training jobs on one device at once: TENSILE's promise (the paper's Fig. 6 and Table IV) measured against
two ways of running the same jobs without it.

The jobs (MODEL@BATCH: a zoo model or a FILE.py:FUNC user model) run as processes of their own, side by side in one
call, under three policies:

- (a) alone: each job by itself, one after another (the device holds one job at a time);
- (b) declared: all started together without Tensile, each capped at a declared size, an equal share of the device
  (what declared-memory sharing such as HAMi gives): a job that outgrows its share dies of out-of-memory;
- (c) tensile: all started together through `tensile local`'s machinery (tensile/local/: the in-process node agent
  plans them jointly, admission by reserved memory plus context, each process under the hook with its budget and
  its memory cap).

The device's capacity is simulated (the local agent's `--simulate`), tight by construction: the larger of the jobs'
forecast scheduled peaks together and the largest vanilla peak, 5% over, so each job fits alone, the jobs fit
together only as Tensile schedules them, and an equal share is below the larger jobs' vanilla peaks.

On the CPU device there is no caching allocator and no memory cap to hit: the device is the hook's storage tracker.
(a) and (b) run under the hook with no plan and no budget (it only watches: every iteration on the dispatch path,
its peak measured), and (b)'s cap is simulated: after each optimizer step the job compares the peak the hook measured
in that iteration with its declared size and, above it, ends as CUDA's allocator would have ended it, out of memory
(exit status 3). (c)'s peaks are the hook's report's: measured on the dispatch path, the forecast where the hook
says so (`peak_source: planned`, a native iteration on the CPU; counted per job as `forecast_iterations`). The
device's used memory over time is the jobs' per-iteration peaks summed, each held from its iteration's start to its
end (an upper bound of what they held together). Each job computes on one thread in every policy: the CPU's cores
are the device's compute, shared by the jobs that run at once as a GPU's are, and its iteration times are only as
steady as the machine's other load lets them be. On a GPU the same jobs run on CUDA: (b)'s cap is the real one
(`torch.cuda.set_per_process_memory_fraction`), peaks are `max_memory_allocated` and `max_memory_reserved` per
iteration (the hook's, under Tensile), and the used memory over time is NVML's, sampled every 0.2 s.

Per job: peak allocated and reserved, median iteration time, slowdown against (a), out-of-memory deaths. Per
device: used memory over time against capacity, plotted. Per policy: the most jobs that ran at once, total time.

Run: python benchmarks/colocation.py [--jobs MODEL@BATCH,...] [--steps 15] [--plot PNG] [--out JSON]
     -> benchmarks/results/colocation_<device>.json and colocation_<device>.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench_results import results_dir

ROOT = Path(__file__).resolve().parents[1]
RESULTS = results_dir()
MIB = 2**20
OOM_EXIT = 3  # a job's exit status when it ran out of memory
TIGHT = 1.05  # the capacity over the larger of the jobs' scheduled peaks together and the largest vanilla peak
SKIPPED_ITERATIONS = 3  # recorded, matched and aligned before a plan runs steadily: out of the median iteration time
CPU_JOBS = "examples/tiny_mlp.py:build@512,examples/tiny_mlp.py:build@2048,examples/tiny_mlp.py:build@4096"
GPU_JOBS = "resnet50@64,vgg16@32,bert_base@16"  # three: each job's process loads torch, and the GPU item has 170 s
POLICIES = ("alone", "declared", "tensile")


@dataclass(frozen=True)
class JobSpec:
    model: str  # a zoo name or FILE.py:FUNC
    batch_size: int
    name: str  # a Kubernetes name, as tensile local takes it

    @classmethod
    def parse(cls, text: str, index: int) -> JobSpec:
        model, _, batch = text.rpartition("@")
        stem = Path(model.partition(":")[0]).stem if ":" in model else model
        return cls(model, int(batch), f"j{index}-{stem.replace('_', '-')}-b{batch}")


# -- the job process --------------------------------------------------------------------------------------------

def job_main(args: argparse.Namespace) -> int:
    """One job: `--steps` optimizer steps of its model; each step's end time (and on CUDA without the hook, its
    peaks) in `--timeline`. Without Tensile's hook (no TENSILE_JOB) on the CPU it starts the hook itself, watching
    only, to measure its peaks; `--declared` is the cap it dies of."""
    spec = JobSpec.parse(args.job, 0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    watcher = None
    if not cuda:  # one thread each: jobs side by side on a few cores would otherwise fight over them, thread by thread
        torch.set_num_threads(1)
    if not cuda and not os.environ.get("TENSILE_JOB"):
        from tensile_hook import activate
        from tensile_hook.settings import HookSettings

        watcher = activate(HookSettings(job=spec.name, report_path=args.report), planner=lambda workload, budget: None,
                           device=device)
    if cuda and args.declared:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.declared / total))
    model, batch, loss_fn, optimizer = _parts(spec, device)
    timeline: dict = {"start": time.time(), "steps": [], "peaks": [], "reserved": [], "out_of_memory": False}
    try:
        for _ in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
            timeline["steps"].append(time.time())
            if cuda and not os.environ.get("TENSILE_JOB"):
                timeline["peaks"].append(torch.cuda.max_memory_allocated())
                timeline["reserved"].append(torch.cuda.max_memory_reserved())
                torch.cuda.reset_peak_memory_stats()
            if watcher is not None and args.declared and watcher.state.stats.peak_bytes > args.declared:
                raise torch.OutOfMemoryError(f"simulated: {watcher.state.stats.peak_bytes} bytes, over the declared "
                                             f"{args.declared}")
    except torch.OutOfMemoryError as exc:
        print(f"out of memory: {exc}", file=sys.stderr)
        timeline["out_of_memory"] = True
    Path(args.timeline).write_text(json.dumps(timeline))
    return OOM_EXIT if timeline["out_of_memory"] else 0


def _parts(spec: JobSpec, device: torch.device) -> tuple:
    """The model, batch, loss and optimizer as `tensile local` forecasts them (zoo: Adam at lr 1e-3)."""
    if ":" in spec.model:
        from tensile.user_model import load_user_parts

        model, batch, loss_fn, make_optimizer = load_user_parts(spec.model, spec.batch_size)
        model, batch = model.to(device), tuple(t.to(device) for t in batch)
        return model, batch, loss_fn, make_optimizer(model.parameters())
    from tensile.zoo import build_zoo_parts

    model, batch, loss_fn, _ = build_zoo_parts(spec.model, spec.batch_size, device=str(device))
    return model, batch, loss_fn, torch.optim.Adam(model.parameters(), lr=1e-3)


# -- the policies -----------------------------------------------------------------------------------------------

def job_command(spec: JobSpec, steps: int, folder: Path, policy: str, declared: int | None = None) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--job", f"{spec.model}@{spec.batch_size}",
               "--steps", str(steps), "--timeline", str(folder / f"{policy}-{spec.name}.timeline.json"),
               "--report", str(folder / f"{policy}-{spec.name}.report.json")]
    return command + (["--declared", str(declared)] if declared else [])


def _stderr_file(folder: Path, policy: str, spec: JobSpec) -> Path:
    return folder / f"{policy}-{spec.name}.stderr"


def _refuse_crashes(policy: str, jobs: list[JobSpec], codes: dict[str, int | None], folder: Path) -> None:
    """A job that failed other than by running out of memory measured nothing: the figures would lie by omission."""
    from tensile.local.runner import job_log

    for spec in jobs:
        code = codes.get(spec.name)
        if code not in (0, OOM_EXIT):
            logs = [path for path in (_stderr_file(folder, policy, spec), job_log(folder, spec.name)) if path.exists()]
            said = logs[0].read_text()[-2000:] if logs else ""
            raise SystemExit(f"colocation: {policy}: job {spec.name} failed with exit status {code}, not of "
                             f"running out of memory; the measurement is void:\n{said}")


def _plain_environment() -> dict[str, str]:
    """This process's environment without Tensile's hook (the jobs of (a) and (b) run without it)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TENSILE_")}


def run_alone(jobs: list[JobSpec], steps: int, folder: Path) -> dict:
    started = time.time()
    codes = {}
    for spec in jobs:
        with _stderr_file(folder, "alone", spec).open("w") as stderr:
            codes[spec.name] = subprocess.run(job_command(spec, steps, folder, "alone"), env=_plain_environment(),
                                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr).returncode
    return {"seconds": time.time() - started, "at_once": 1, "exit_codes": codes, "started": started}


def run_declared(jobs: list[JobSpec], steps: int, folder: Path, capacity: int) -> dict:
    share = capacity // len(jobs)
    started = time.time()
    with contextlib.ExitStack() as files:
        processes = {}
        for spec in jobs:
            stderr = files.enter_context(_stderr_file(folder, "declared", spec).open("w"))
            processes[spec.name] = subprocess.Popen(job_command(spec, steps, folder, "declared", share),
                                                    env=_plain_environment(), cwd=ROOT, stdout=subprocess.DEVNULL,
                                                    stderr=stderr)
        codes = {name: process.wait() for name, process in processes.items()}
    return {"seconds": time.time() - started, "at_once": len(jobs), "exit_codes": codes, "started": started,
            "declared_bytes": share}


def run_tensile(jobs: list[JobSpec], steps: int, folder: Path, capacity: int) -> dict:
    """`tensile local`'s runner and agent (tensile/local/), the jobs written as TrainingJob files it reads."""
    from tensile.local.agent import LocalAgent
    from tensile.local.jobs import load_jobs
    from tensile.local.runner import POLL_SECONDS, LocalRunner
    from tensile_agent.gpus import DEFAULT_HEADROOM

    paths = []
    for spec in jobs:
        path = folder / f"{spec.name}.yaml"
        command = job_command(spec, steps, folder, "tensile")
        path.write_text(json.dumps({  # JSON is YAML
            "apiVersion": "tensile.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": spec.name},
            "spec": {"workload": {"model": spec.model, "batchSize": spec.batch_size},
                     "template": {"spec": {"containers": [{"name": "train", "image": "local",
                                                           "command": ["python", *command[1:]]}]}}}}))
        paths.append(str(path))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the simulated device's memory, of which admission leaves its headroom free: `capacity` for the jobs
    memory = int(capacity / (1 - DEFAULT_HEADROOM)) + 1
    agent = LocalAgent("127.0.0.1", 0, [f"colocation:{memory}"]).start()
    assert agent.gpu.capacity_bytes >= capacity, (agent.gpu.capacity_bytes, capacity)
    runner = LocalRunner(load_jobs(paths), agent, folder, device, "a6000" if device == "cuda" else "cpu")
    at_once = 0
    try:
        runner.forecast_all()
        started = time.time()
        while runner.step():
            at_once = max(at_once, len(runner.running()))
            time.sleep(POLL_SECONDS / 5)
    finally:
        runner.stop()
        agent.stop()
    codes = {run.name: run.process.returncode if run.process else None for run in runner.runs}
    messages = {run.name: run.message for run in runner.runs if run.message}
    return {"seconds": time.time() - started, "at_once": at_once, "exit_codes": codes, "started": started,
            "messages": messages, "admitted_bytes": {run.name: runner.admission.need(run) for run in runner.runs}}


class NvmlSampler:
    """The GPU's used memory (NVML) every 0.2 s while a policy runs; nothing without NVML."""

    def __init__(self) -> None:
        self.samples: list[list[float]] = []
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.thread = threading.Thread(target=self._sample, daemon=True)
        except Exception:  # noqa: BLE001 - the CPU device, or no NVML
            self.handle = None

    def _sample(self) -> None:
        import pynvml

        while not self.stop.is_set():
            self.samples.append([time.time(), float(pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)])
            time.sleep(0.2)

    def __enter__(self) -> NvmlSampler:
        if self.thread is not None:
            self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


# -- figures ----------------------------------------------------------------------------------------------------

def job_figures(spec: JobSpec, folder: Path, policy: str, code: int | None) -> dict:
    """One job's figures under one policy, from its timeline and its hook's report (where it has one)."""
    from tensile.local.runner import job_report

    timeline_path = folder / f"{policy}-{spec.name}.timeline.json"
    report_path = job_report(folder, spec.name) if policy == "tensile" else folder / f"{policy}-{spec.name}.report.json"
    timeline = json.loads(timeline_path.read_text()) if timeline_path.exists() else None
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    steps = timeline["steps"] if timeline else []
    starts = [timeline["start"], *steps[:-1]] if timeline else []
    seconds = [end - start for start, end in zip(starts, steps)]
    peaks = list(timeline["peaks"]) if timeline else []
    reserved = list(timeline["reserved"]) if timeline else []
    forecast = 0
    if report is not None and not peaks:
        listed = report["iterations"][:len(steps)]
        peaks = [it["peak_bytes"] for it in listed]
        reserved = [it.get("reserved_bytes") or it["peak_bytes"] for it in listed]
        forecast = sum(1 for it in listed if it.get("peak_source") == "planned")
    steady = seconds[SKIPPED_ITERATIONS:] or seconds
    return {
        "job": spec.name, "model": spec.model, "batch_size": spec.batch_size, "exit_code": code,
        "out_of_memory": code == OOM_EXIT or bool(timeline and timeline["out_of_memory"]),
        "completed_steps": len(steps), "peak_bytes": max(peaks, default=None),
        "reserved_peak_bytes": max(reserved, default=None), "forecast_iterations": forecast,
        "iteration_seconds": statistics.median(steady) if steady else None,
        "stood_down": report.get("stood_down") if report else None,
        "iterations": [[start, end, peak, held] for start, end, peak, held in zip(starts, steps, peaks, reserved)],
    }


def used_over_time(jobs: list[dict], started: float) -> list[list[float]]:
    """The jobs' per-iteration peaks summed over time (seconds from `started`), as [time, bytes] steps."""
    edges = sorted({t for job in jobs for start, end, *_ in job["iterations"] for t in (start, end)})
    used = []
    for t in edges:
        held = sum(peak for job in jobs for start, end, peak, _ in job["iterations"] if start <= t < end)
        used.append([round(t - started, 4), held])
    return used


def plot(result: dict, path: Path) -> Path:
    from tensile.plots import pyplot, save_figure

    plt = pyplot()
    capacity = result["capacity_bytes"] / MIB
    fig, axes = plt.subplots(1, len(POLICIES), figsize=(5 * len(POLICIES), 3.6), sharey=True)
    for ax, name in zip(axes, POLICIES):
        policy = result["policies"][name]
        used = policy["used_over_time"]
        if used:
            ax.step([t for t, _ in used], [b / MIB for _, b in used], where="post", color="#4c72b0", label="used")
        ax.axhline(capacity, color="#c44e52", linestyle="--", label="capacity")
        died = [j["job"] for j in policy["jobs"] if j["out_of_memory"]]
        note = f"; OOM: {', '.join(died)}" if died else ""
        letter = "abc"[POLICIES.index(name)]
        ax.set_title(f"({letter}) {name}: {policy['at_once']} at once, {policy['seconds']:.1f} s{note}",
                     fontsize="small")
        ax.set_xlabel("seconds (the jobs' processes start at 0)")
        ax.set_xlim(left=0)
    axes[0].set_ylabel("device memory used (MiB)")
    axes[0].legend(fontsize="small")
    fig.suptitle(f"{len(result['jobs'])} jobs on {result['device']} ({capacity:,.0f} MiB simulated)", fontsize="medium")
    return save_figure(fig, path)


def forecasts(jobs: list[JobSpec], device: str) -> list[dict]:
    """Each job's forecast as tensile local makes it (its vanilla and scheduled peaks choose the capacity)."""
    from tensile.allocator import expandable_segments_in
    from tensile.forecast import optimizer_for, trace_workload
    from tensile.job_forecast import make_forecast
    from tensile.latency.device import forecast_preset

    summaries = []
    for spec in jobs:
        workload = trace_workload(spec.model, spec.batch_size, optimizer=optimizer_for(spec.model, None), device=device)
        summaries.append(make_forecast(workload, forecast_preset(device),
                                       expandable_segments=expandable_segments_in(os.environ),
                                       environ=os.environ).summary)
    return summaries


def measure(jobs: list[JobSpec], steps: int) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    summaries = forecasts(jobs, device)
    capacity = int(TIGHT * max(sum(s["scheduled_reserved_peak_bytes"] for s in summaries),
                               max(s["reserved_peak_bytes"] for s in summaries)))
    policies = {}
    with tempfile.TemporaryDirectory(prefix="tensile-colocation-") as tmp:
        folder = Path(tmp)
        for name in POLICIES:
            with NvmlSampler() as sampler:
                if name == "alone":
                    outcome = run_alone(jobs, steps, folder)
                elif name == "declared":
                    outcome = run_declared(jobs, steps, folder, capacity)
                else:
                    outcome = run_tensile(jobs, steps, folder, capacity)
            _refuse_crashes(name, jobs, outcome["exit_codes"], folder)
            figures = [job_figures(spec, folder, name, outcome["exit_codes"].get(spec.name)) for spec in jobs]
            started = outcome.pop("started")
            used = ([[round(t - started, 4), b] for t, b in sampler.samples] if sampler.samples
                    else used_over_time(figures, started))
            policies[name] = {**outcome, "jobs": figures, "used_over_time": used,
                              "used_source": "nvml" if sampler.samples else "per-iteration peaks summed",
                              "out_of_memory": sum(j["out_of_memory"] for j in figures),
                              "peak_used_bytes": max((b for _, b in used), default=0)}
    alone = {j["job"]: j["iteration_seconds"] for j in policies["alone"]["jobs"]}
    for policy in policies.values():
        for job in policy["jobs"]:
            base, own = alone.get(job["job"]), job["iteration_seconds"]
            job["slowdown"] = own / base if base and own and not job["out_of_memory"] else None
    return {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", *sys.argv]),
        "torch": torch.__version__,
        "steps": steps,
        "capacity_bytes": capacity,
        "jobs": [{"job": spec.name, "model": spec.model, "batch_size": spec.batch_size,
                  "vanilla_peak_bytes": s["vanilla_peak_bytes"], "scheduled_peak_bytes": s["scheduled_peak_bytes"],
                  "reserved_peak_bytes": s["reserved_peak_bytes"],
                  "scheduled_reserved_peak_bytes": s["scheduled_reserved_peak_bytes"]}
                 for spec, s in zip(jobs, summaries)],
        "policies": policies,
    }


def show(result: dict) -> None:
    console = Console()
    table = Table(title=f"{len(result['jobs'])} jobs on {result['device']}, "
                        f"{result['capacity_bytes'] / MIB:,.1f} MiB simulated")
    for column in ("policy", "job", "peak MiB", "reserved MiB", "iter s", "slowdown", "OOM"):
        table.add_column(column, justify="left" if column in ("policy", "job") else "right")
    for name, policy in result["policies"].items():
        for job in policy["jobs"]:
            table.add_row(name, job["job"], _mib(job["peak_bytes"]), _mib(job["reserved_peak_bytes"]),
                          "-" if job["iteration_seconds"] is None else f"{job['iteration_seconds']:.3f}",
                          "-" if job["slowdown"] is None else f"{job['slowdown']:.2f}x",
                          "yes" if job["out_of_memory"] else "")
        table.add_row(f"[bold]{name}[/]", f"{policy['at_once']} at once", _mib(policy["peak_used_bytes"]), "",
                      f"{policy['seconds']:.1f} total", "", str(policy["out_of_memory"]), end_section=True)
    console.print(table)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", help=f"MODEL@BATCH,... (default on the CPU: {CPU_JOBS}; on CUDA: {GPU_JOBS})")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", help="the results JSON (default benchmarks/results/colocation_<device>.json)")
    parser.add_argument("--plot", help="the plot (default: beside the results, .png)")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # a job's own process
    parser.add_argument("--timeline", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    parser.add_argument("--declared", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job_main(args)
    os.chdir(ROOT)  # a user model's FILE.py is named from the repository, as tensile local's examples are
    text = args.jobs or (GPU_JOBS if torch.cuda.is_available() else CPU_JOBS)
    jobs = [JobSpec.parse(item.strip(), i) for i, item in enumerate(text.split(","))]
    result = measure(jobs, args.steps)
    show(result)
    named = result["device"].lower().replace(" ", "-")
    out = Path(args.out) if args.out else RESULTS / f"colocation_{named}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    picture = plot(result, Path(args.plot) if args.plot else out.with_suffix(".png"))
    print(f"results: {out}; plot: {picture}")
    tensile = result["policies"]["tensile"]
    return 0 if tensile["out_of_memory"] == 0 and all(code == 0 for code in tensile["exit_codes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
