"""Hook overhead, measured side by side in one run (no timed assertions anywhere else):

1. a model of many tiny ops, where Python overhead dominates: iteration time with the hook and an
   empty plan against the same loop without Tensile (target: at most 1.3x);
2. ResNet-50 (batch from --batch-size, 16 by default) under the planner's full plan for a 0.6
   budget: `hook_seconds` per iteration (the hook's own logic; the mover's calls, host copies on
   CUDA and memory handed over on the CPU device, are `transfer_seconds`, reported beside it;
   target: at most 2 ms; the median of the native iterations, each listed) and the iteration time ratio;
3. ResNet-50 at the same batch under an empty plan (the native path).

Each row says which path (dispatch / native) its measured iterations took, with the figures of
each path apart (`by_path`): the first iteration under a plan runs on the dispatch path (it aligns
the plan's swaps with module and autograd node hooks), the later ones natively when they can. The
full plan's row also says which module calls and autograd nodes carried it (`carried_by`): that plan
is made from this run's measured latencies, so it differs between runs, and the hook's time with it.

On CUDA (`--device cuda`) every iteration's time ends at a device synchronisation, and `hook_seconds`
is host time: there the kernels run asynchronously, so the hook's Python does not run right after
kernels that emptied the host's caches, as it does on the CPU device.

Run: .venv/bin/python benchmarks/hook_overhead.py [--batch-size N] [--device cuda]
  -> benchmarks/results/hook_overhead.json (CPU), hook_overhead_<gpu>.json (CUDA)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import NamedTuple

import torch
from rich.console import Console
from rich.table import Table

from bench_results import results_dir
from tensile.latency.calibrate import local_device, torch_device
from tensile.latency.measure import HostLoad, synchronize
from tensile.plan import Plan
from tensile_hook import activate, deactivate
from tensile_hook.report import HookReport
from tensile_hook.settings import HookSettings
from tensile.workload import Workload
from tensile.zoo import build_zoo_parts

RESULTS = results_dir() / "hook_overhead.json"


def tiny_ops_model(batch_size: int, device: torch.device) -> tuple:
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(100)]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 4)).to(device)
    batch = (torch.randn(batch_size, 16, device=device), torch.randint(0, 4, (batch_size,), device=device))

    def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    return model, batch, loss_fn, lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)


def empty_plan(workload: Workload, budget: int | None) -> Plan:
    return Plan("bench", 1, workload.signature, [])


def full_plan(device: torch.device):  # type: ignore[no-untyped-def]
    """The in-process planner's plan for the device, as the hook makes it by default."""
    from tensile_hook.plan_source import local_planner

    return local_planner(HookSettings(job="bench"), device)


def timed_step(model: torch.nn.Module, batch: tuple, loss_fn, optimizer: torch.optim.Optimizer,  # type: ignore[no-untyped-def]
               device: torch.device) -> float:
    """Seconds of one training step, from a device with nothing queued to the step's last kernel."""
    synchronize(device.type)
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model, batch).backward()
    optimizer.step()
    synchronize(device.type)
    return time.perf_counter() - started


class Timed(NamedTuple):
    times: list[float]
    report: HookReport | None
    carried: dict[str, int] | None  # how the native path carried the plan (`NativeSwaps.carried_by`)


def timed_iterations(parts: tuple, steps: int, planner=None, budget: float | None = None,  # type: ignore[no-untyped-def]
                     device: torch.device = torch.device("cpu")) -> Timed:
    executor = activate(HookSettings(job="bench", memory_budget=budget), planner=planner, device=device) if planner else None
    try:
        model, batch, loss_fn, make_optimizer = parts
        optimizer = make_optimizer(model.parameters())
        times = [timed_step(model, batch, loss_fn, optimizer, device) for _ in range(steps)]
        return Timed(times, executor.report, executor.swaps.carried_by()) if executor else Timed(times, None, None)
    finally:
        if executor is not None:
            deactivate()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16)
    # 7 native iterations: their median is the steady state's, not left to the first one's making of its slots
    parser.add_argument("--steps", type=int, default=10, help="ResNet-50 iterations (the first 2 are recorded, the 3rd aligns)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    device_type, device_key, device_name = local_device(args.device)
    device = torch_device(device_type)
    console = Console()
    host_load = HostLoad()
    rows = []
    # 1. tiny ops, empty plan; interleave repeats so noise hits both alike
    plain_times, hooked_times, hook_seconds = [], [], []
    for _ in range(3):
        plain = timed_iterations(tiny_ops_model(4, device), 30, device=device).times
        hooked, report, _ = timed_iterations(tiny_ops_model(4, device), 30, planner=empty_plan, device=device)
        iterations = report.iterations
        plain_times += plain[5:]
        hooked_times += hooked[5:]
        hook_seconds += [it.hook_seconds for it in iterations[5:]]
        paths = sorted({it.path for it in iterations[5:]})
    tiny = {
        "case": "tiny ops (100 x Linear 16 + tanh), empty plan",
        "plain_seconds": statistics.median(plain_times),
        "hooked_seconds": statistics.median(hooked_times),
        "hook_seconds_per_iteration": statistics.median(hook_seconds),
        "paths": paths,
        "target_ratio": 1.3,
    }
    tiny["ratio"] = tiny["hooked_seconds"] / tiny["plain_seconds"]
    rows.append(tiny)
    # 2-3. ResNet-50 under the planner's full plan, then under an empty plan, between two plain runs
    # (the machine is shared: their steady iterations together are the plain figure)
    resnet_rows = []
    plain = timed_iterations(build_zoo_parts("resnet50", args.batch_size, device=device_type), args.steps, device=device).times[2:]
    for label, planner, budget in (("full plan (budget 0.6)", full_plan(device), 0.6), ("empty plan", empty_plan, None)):
        hooked, report, carried = timed_iterations(build_zoo_parts("resnet50", args.batch_size, device=device_type),
                                                   args.steps, planner=planner, budget=budget, device=device)
        iterations = report.iterations
        planned = [it for it in iterations if it.mode == "planned"]
        native = [it for it in planned if it.path == "native"]
        by_path = {path: {"iterations": len(its), "seconds": statistics.median([it.seconds for it in its]),
                          "hook_seconds": statistics.median([it.hook_seconds for it in its]),
                          "transfer_seconds": statistics.median([it.transfer_seconds for it in its])}
                   for path in ("dispatch", "native") if (its := [it for it in planned if it.path == path])}
        steady = native or planned  # the steady state: the native path when the plan reaches it
        row = {
            "case": f"resnet50 batch {args.batch_size}, {label}",
            "hooked_seconds": statistics.median([it.seconds for it in steady]) if steady else None,
            "hook_seconds_per_iteration": statistics.median([it.hook_seconds for it in steady]) if steady else None,
            "hook_seconds_by_iteration": [it.hook_seconds for it in steady],
            "transfer_seconds_per_iteration": statistics.median([it.transfer_seconds for it in steady]) if steady else None,
            "stall_seconds_per_iteration": statistics.median([it.stall_seconds for it in steady]) if steady else None,
            "planned_iterations": len(planned),
            "paths": sorted({it.path for it in planned}),
            "events_per_iteration": steady[-1].events if steady else None,
            "carried_by": carried,
            "by_path": by_path,
            "messages": report.messages,
            "target_hook_seconds": 0.002,
        }
        resnet_rows.append(row)
    plain += timed_iterations(build_zoo_parts("resnet50", args.batch_size, device=device_type), args.steps, device=device).times[2:]
    for row in resnet_rows:
        row["plain_seconds"] = statistics.median(plain)
        if row["hooked_seconds"]:
            row["ratio"] = row["hooked_seconds"] / row["plain_seconds"]
        rows.append(row)
    table = Table(title=f"Runtime hook overhead ({device_name})")
    for column in ("case", "plain s/iter", "hooked s/iter", "ratio", "hook s/iter"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["case"], f"{row['plain_seconds']:.4f}",
            "-" if row["hooked_seconds"] is None else f"{row['hooked_seconds']:.4f}",
            f"{row.get('ratio', float('nan')):.2f}x",
            "-" if row["hook_seconds_per_iteration"] is None else f"{row['hook_seconds_per_iteration'] * 1e3:.2f} ms",
        )
    console.print(table)
    out = RESULTS if device_type == "cpu" else RESULTS.with_name(f"hook_overhead_{device_key}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    # the ResNet-50 ratios compare runs made one after the other: only meaningful on a quiet machine
    load = host_load.around()
    console.print(HostLoad.said(load))
    out.write_text(json.dumps({"device": device_name, "device_key": device_key, "machine": platform.machine(),
                               "torch": torch.__version__, "load_average_1min": load, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
