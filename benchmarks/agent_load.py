"""Node agent under load: p50/p99 latency of plan fetches and measurement posts from 64 concurrent hook
clients, idle and while the agent re-plans 8 ResNet-50 (batch 16) jobs on one GPU, and the re-planning time.

    python benchmarks/agent_load.py [--seconds 8] [--clients 64]

The agent runs as its own process (`python -m tensile_agent`, two simulated GPUs); the clients are
threads of this process using tensile.agent_client, so a latency includes the client's own Python
time. Each client polls its plan the way a hook does at an iteration boundary (conditional GET: 304
while unchanged) and posts measurements. GPU 0 holds 8 ResNet-50 jobs under budgets of 60% of their
vanilla peak, GPU 1 the other 56 (small MLPs); the jobs belong to tenants of 16 each (namespaces), as the agent takes at
most 32 of one namespace on a GPU. During the "re-planning" phase a knob change on GPU 0
is sent as soon as the previous round committed, so a planning round is running nearly all the time.
Each client's "iteration" lasts --iteration seconds (default 0.1 s, a fast training step): one plan fetch
per iteration, a measurements post every other. Writes benchmarks/results/agent_load.json. Target: p99 of plan fetches under 20 ms while a re-plan runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from bench_results import results_dir
from tensile import agent_client
from tensile.agent_client import AgentClient
from tensile.agent_contract import Measurements
from tensile.forecast import trace_workload
from tensile.peak import analyze_vanilla
from tensile.workload_io import workload_to_dict

ROOT = Path(__file__).resolve().parents[1]
RESULTS = results_dir()
JOBS_PER_NAMESPACE = 16  # the jobs of one tenant (namespace): the agent takes at most 32 of one on a GPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=30) as r:
        return json.loads(r.read())


def start_agent(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tensile_agent", "--port", str(port), "--log-level", "warning",
                             "--simulate-gpu", "a6000:48GiB", "--simulate-gpu", "h100:80GiB"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            get_json(f"http://127.0.0.1:{port}/healthz")
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the agent did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), 0 elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def percentiles(samples: list[float]) -> dict:
    if not samples:
        return {"count": 0}
    ms = np.array(samples) * 1000.0
    return {"count": int(ms.size), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "max_ms": float(ms.max())}


def load(clients: list[AgentClient], seconds: float, samples: dict[str, list[list[float]]], iteration: float) -> tuple[list[float], list[float]]:
    fetches: list[float] = []
    posts: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def run(client: AgentClient) -> None:
        mine_f, mine_p = [], []
        step = 0
        time.sleep(iteration * (hash(client.ref.key) % 100) / 100)  # hooks are not in lockstep
        while time.monotonic() < stop:
            began = started = time.perf_counter()
            client.fetch_plan()
            mine_f.append(time.perf_counter() - started)
            step += 1
            if step % 2 == 0:  # a hook posts every few iterations
                m = Measurements(plan_version=client.plan_version, iterations=2, peak_bytes=1_000_000, iteration_seconds=0.05,
                                 stall_seconds=0.001, swap_out_bytes=1 << 20, swap_in_bytes=1 << 20,
                                 op_latencies=samples[client.ref.key][(step % 4) * 8:(step % 4) * 8 + 8])
                started = time.perf_counter()
                client.post_measurements(m)
                mine_p.append(time.perf_counter() - started)
            time.sleep(max(0.0, iteration - (time.perf_counter() - began)))  # the rest of the iteration
        with lock:
            fetches.extend(mine_f)
            posts.extend(mine_p)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return fetches, posts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--iteration", type=float, default=0.1,
                        help="seconds per training iteration of each client: it fetches once per iteration, posts every other")
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)  # 64 client threads: do not let the GIL add to the latencies measured
    console = Console()
    big = trace_workload("resnet50", 16)
    small = trace_workload("examples/tiny_mlp.py:build", 4)
    big_dict, small_dict = workload_to_dict(big), workload_to_dict(small)
    budget = int(0.6 * analyze_vanilla(big).peak_bytes)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_agent(port)
    try:
        clients = []
        for i in range(args.clients):
            heavy = i < 8
            client = AgentClient(url, f"bench-{i // JOBS_PER_NAMESPACE}/job-{i}", gpu="0" if heavy else "1", timeout=30)
            if client.register(workload=big_dict if heavy else small_dict, memory_budget_bytes=budget if heavy else None) is None:
                raise SystemExit(f"the agent did not take job {client.ref.key}: {client.last_error}")
            clients.append(client)
        for client in clients:
            response = client.wait_for_plan(120)
            if response is None or response.version < 1:
                raise SystemExit(f"job {client.ref.key} has no plan after 120 s: {client.last_error or 'none made'}")
        gpu0 = clients[0].registered.gpu
        deadline = time.monotonic() + 120
        while get_json(f"{url}/v1/info")["planning_idle"] is False and time.monotonic() < deadline:
            time.sleep(0.05)
        initial = get_json(f"{url}/v1/gpus/{gpu0}")["last_round"]
        console.print(f"registered {len(clients)} jobs; first round of GPU 0 ({gpu0}): {initial['seconds']:.3f} s, {initial['message']}")

        # steady state: each hook reports op latencies as the agent predicted them (no drift, no re-plan)
        samples = {}
        for client in clients:
            planned = agent_client.live_workload(url, client.ref.key, client.token)
            samples[client.ref.key] = [[op.index, op.latency] for op in planned.ops[:32]]
        cpu0, own0, t0 = cpu_seconds(proc.pid), time.process_time(), time.monotonic()
        idle_f, idle_p = load(clients, args.seconds / 2, samples, args.iteration)
        cpu_idle = {"agent_cores": (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0),
                    "clients_cores": (time.process_time() - own0) / (time.monotonic() - t0)}

        replans: list[dict] = []
        stop = threading.Event()

        def replanner() -> None:
            rate = [1.0, 0.9]
            k = 0
            while not stop.is_set():
                before = get_json(f"{url}/v1/gpus/{gpu0}")["last_round"]["round"]
                started = time.perf_counter()
                k += 1
                clients[0].update_knobs(max_swap_rate=rate[k % 2])
                while not stop.is_set():
                    last = get_json(f"{url}/v1/gpus/{gpu0}")["last_round"]
                    if last["round"] > before:
                        replans.append({"wall_seconds": time.perf_counter() - started, "planner_seconds": last["seconds"]})
                        break
                    time.sleep(0.05)

        thread = threading.Thread(target=replanner)
        thread.start()
        time.sleep(0.2)
        cpu0, own0, t0 = cpu_seconds(proc.pid), time.process_time(), time.monotonic()
        busy_f, busy_p = load(clients, args.seconds, samples, args.iteration)
        cpu_busy = {"agent_cores": (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0),
                    "clients_cores": (time.process_time() - own0) / (time.monotonic() - t0)}
        stop.set()
        thread.join()
    finally:
        proc.terminate()
        proc.wait(10)

    rows = {
        "plan fetch (idle)": percentiles(idle_f),
        "measurements post (idle)": percentiles(idle_p),
        "plan fetch (re-planning)": percentiles(busy_f),
        "measurements post (re-planning)": percentiles(busy_p),
    }
    planner = [r["planner_seconds"] for r in replans]
    wall = [r["wall_seconds"] for r in replans]
    result = {
        "clients": args.clients,
        "seconds": args.seconds,
        "iteration_seconds": args.iteration,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "note": "agent and clients share the machine"},
        "latency": rows,
        "replan_8_resnet50_b16": {
            "rounds": len(replans),
            "planner_seconds_median": float(np.median(planner)) if planner else None,
            "planner_seconds_max": float(np.max(planner)) if planner else None,
            "knob_to_new_plan_seconds_median": float(np.median(wall)) if wall else None,
            "budget_bytes_per_job": budget,
        },
        "cpu": {"idle": cpu_idle, "re-planning": cpu_busy},
        "target_fetch_p99_ms_while_replanning": 20.0,
        "target_met": bool(rows["plan fetch (re-planning)"].get("p99_ms", 1e9) < 20.0),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "agent_load.json").write_text(json.dumps(result, indent=1) + "\n")
    table = Table(title=f"node agent, {args.clients} concurrent hook clients")
    for column in ("call", "count", "p50 ms", "p99 ms", "max ms"):
        table.add_column(column, justify="right" if column != "call" else "left")
    for name, row in rows.items():
        table.add_row(name, str(row.get("count", 0)), f"{row.get('p50_ms', 0):.2f}", f"{row.get('p99_ms', 0):.2f}", f"{row.get('max_ms', 0):.2f}")
    console.print(table)
    console.print(f"CPU cores used (agent / clients): idle {cpu_idle['agent_cores']:.2f} / {cpu_idle['clients_cores']:.2f}, "
                  f"re-planning {cpu_busy['agent_cores']:.2f} / {cpu_busy['clients_cores']:.2f}")
    r = result["replan_8_resnet50_b16"]
    console.print(f"re-planning 8 ResNet-50 b16 jobs on one GPU: {r['rounds']} rounds, planner median "
                  f"{(r['planner_seconds_median'] or 0):.3f} s (max {(r['planner_seconds_max'] or 0):.3f} s), knob change to new plan "
                  f"median {(r['knob_to_new_plan_seconds_median'] or 0):.3f} s; fetch p99 target met: {result['target_met']}")


if __name__ == "__main__":
    main()
