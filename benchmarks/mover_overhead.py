"""Host time of one CUDA mover call (`CudaMover.swap_out`, `swap_in`), side by side with a bare copy.

In a real training run on a fast GPU the loop is host-bound, so the mover's Python counts in full: 24
swaps each way per ResNet-50 iteration at batch 16. This benchmark times each call the way training
makes it: 24 storages of 4 to 64 MiB (sizes spread), and between two calls a 2048x2048 matmul, an
elementwise op on 64 MB and a run of small ops on other tensors, so that the GPU stays busy (the host
runs ahead of it, as in training) and the host's caches hold the dispatcher's code rather than the
mover's. Swap-outs run in one order, swap-ins in the reverse one (forward, then backward), and the
compute stream waits for each swapped-in storage only once all swap-ins are queued.

The floor beside it, timed in the same rounds and setting: a bare `copy_(non_blocking=True)` between
the same storage and a pinned host buffer, on a side stream entered with `torch.cuda.stream` (no
events, no resize, no pool). Rounds alternate between the two (2 warm-up rounds each, not counted),
the device is synchronised between rounds, and every round checks that each storage came back
bit-identical to a host copy made before the first swap-out. Figures are medians over all calls of the
measured rounds.

Run (GPU only): .venv/bin/python benchmarks/mover_overhead.py [--rounds N]
  -> benchmarks/results/mover_overhead_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
import weakref

import torch
from rich.console import Console
from rich.table import Table

from bench_results import results_dir
from tensile.latency.calibrate import local_device
from tensile.latency.measure import HostLoad
from tensile_hook.movers import CudaMover
from tensile_hook.storages import StorageSlot

RESULTS = results_dir()
WARMUP_ROUNDS = 2


class Busywork:
    """Kernels between two mover calls, on tensors of their own (outputs preallocated: no allocator churn)."""

    def __init__(self, device: torch.device, small_ops: int) -> None:
        self.a = torch.randn(2048, 2048, device=device)
        self.b = torch.randn(2048, 2048, device=device)
        self.c = torch.empty(2048, 2048, device=device)
        self.x = torch.randn(16 * 2**20, device=device)
        self.y = torch.empty_like(self.x)
        self.small = torch.randn(4096, device=device)
        self.small_out = torch.empty_like(self.small)
        self.small_ops = small_ops

    def __call__(self) -> None:
        torch.mm(self.a, self.b, out=self.c)
        torch.mul(self.x, 1.0001, out=self.y)
        for i in range(self.small_ops):
            if i % 2:
                torch.add(self.small, self.small_out, alpha=0.5, out=self.small_out)
            else:
                torch.clamp(self.small, min=0.0, out=self.small_out)


def spread_sizes(count: int, min_mib: float, max_mib: float) -> list[int]:
    """Bytes (a multiple of 4: float32 storages) spread geometrically over [min_mib, max_mib], in a fixed
    shuffled order so that consecutive calls move different sizes."""
    ratio = max_mib / min_mib
    sizes = [int(min_mib * ratio ** (i / max(count - 1, 1)) * 2**20) // 4 * 4 for i in range(count)]
    random.Random(0).shuffle(sizes)
    return sizes


def mover_round(mover: CudaMover, slots: list[StorageSlot], storages: list[torch.UntypedStorage],
                busy: Busywork) -> tuple[list[float], list[float]]:
    """Seconds of each swap_out, then of each swap_in (in reverse order)."""
    outs, ins = [], []
    for slot, storage in zip(slots, storages):
        busy()
        started = time.perf_counter()
        mover.swap_out(slot, storage)
        outs.append(time.perf_counter() - started)
    for slot, storage in zip(reversed(slots), reversed(storages)):
        busy()
        started = time.perf_counter()
        mover.swap_in(slot, storage)
        ins.append(time.perf_counter() - started)
    for slot in slots:
        mover.wait(slot)
    mover.settle()
    return outs, ins


def bare_round(side: torch.cuda.Stream, hosts: list[torch.Tensor], storages: list[torch.UntypedStorage],
               busy: Busywork) -> tuple[list[float], list[float]]:
    """The same loop with a bare copy each way, both on one side stream (so each copy back reads a
    host buffer its copy out has written)."""
    outs, ins = [], []
    for host, storage in zip(hosts, storages):
        busy()
        started = time.perf_counter()
        with torch.cuda.stream(side):
            host.untyped_storage().copy_(storage, non_blocking=True)
        outs.append(time.perf_counter() - started)
    for host, storage in zip(reversed(hosts), reversed(storages)):
        busy()
        started = time.perf_counter()
        with torch.cuda.stream(side):
            storage.copy_(host.untyped_storage(), non_blocking=True)
        ins.append(time.perf_counter() - started)
    torch.cuda.current_stream().wait_stream(side)
    return outs, ins


def summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"calls": len(ordered), "median_us": statistics.median(ordered) * 1e6,
            "p10_us": ordered[len(ordered) // 10] * 1e6, "p90_us": ordered[len(ordered) * 9 // 10] * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10,
                        help=f"measured rounds of each kind (after {WARMUP_ROUNDS} warm-up ones)")
    parser.add_argument("--storages", type=int, default=24, help="storages swapped out and back in per round")
    parser.add_argument("--min-mib", type=float, default=4.0)
    parser.add_argument("--max-mib", type=float, default=64.0)
    parser.add_argument("--small-ops", type=int, default=20, help="small elementwise ops between two calls")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mover_overhead: no CUDA device is visible to PyTorch here; run it on a GPU machine")
    _, device_key, device_name = local_device("cuda")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    console = Console()
    host_load = HostLoad()

    torch.manual_seed(0)
    sizes = spread_sizes(args.storages, args.min_mib, args.max_mib)
    tensors = [torch.randn(nbytes // 4, device=device) for nbytes in sizes]
    expected = [tensor.cpu() for tensor in tensors]
    storages = [tensor.untyped_storage() for tensor in tensors]
    slots = [StorageSlot(id(storage), weakref.ref(storage), storage.nbytes()) for storage in storages]
    hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for nbytes in sizes]
    mover = CudaMover(device)
    side = torch.cuda.Stream(device)
    busy = Busywork(device, args.small_ops)

    times: dict[str, dict[str, list[float]]] = {kind: {"swap_out": [], "swap_in": []} for kind in ("mover", "bare")}
    identical: dict[str, list[bool]] = {"mover": [], "bare": []}
    for round_index in range(WARMUP_ROUNDS + args.rounds):
        # alternate which goes first, so that drift hits both alike
        kinds = ("mover", "bare") if round_index % 2 == 0 else ("bare", "mover")
        for kind in kinds:
            torch.cuda.synchronize(device)
            outs, ins = (mover_round(mover, slots, storages, busy) if kind == "mover"
                         else bare_round(side, hosts, storages, busy))
            torch.cuda.synchronize(device)
            identical[kind].append(all(torch.equal(tensor.cpu(), want) for tensor, want in zip(tensors, expected)))
            if round_index >= WARMUP_ROUNDS:
                times[kind]["swap_out"] += outs
                times[kind]["swap_in"] += ins

    table = Table(title=f"CUDA mover host time per call ({device_name})")
    for column in ("call", "mover median µs", "p10-p90", "bare copy median µs", "p10-p90", "ratio"):
        table.add_column(column, justify="right")
    rows = []
    for call in ("swap_out", "swap_in"):
        mover_stats, bare_stats = summary(times["mover"][call]), summary(times["bare"][call])
        ratio = mover_stats["median_us"] / bare_stats["median_us"]
        rows.append({"call": call, "mover": mover_stats, "bare_copy": bare_stats, "ratio": ratio})
        table.add_row(call,
                      f"{mover_stats['median_us']:.1f}", f"{mover_stats['p10_us']:.0f}-{mover_stats['p90_us']:.0f}",
                      f"{bare_stats['median_us']:.1f}", f"{bare_stats['p10_us']:.0f}-{bare_stats['p90_us']:.0f}",
                      f"{ratio:.2f}x")
    console.print(table)
    rounds = WARMUP_ROUNDS + args.rounds
    for kind, checks in identical.items():
        console.print(f"{kind}: data bit-identical after {sum(checks)} of {rounds} rounds")
    load = host_load.around()
    console.print(HostLoad.said(load))
    out = RESULTS / f"mover_overhead_{device_key}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": device_name, "device_key": device_key, "machine": platform.machine(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "load_average_1min": load,
        "setting": {"storages": args.storages, "sizes_mib": [round(nbytes / 2**20, 2) for nbytes in sizes],
                    "rounds": args.rounds, "warmup_rounds": WARMUP_ROUNDS, "small_ops": args.small_ops,
                    "between_calls": "2048x2048 fp32 matmul, a 16M-element mul, small elementwise ops"},
        "rows": rows, "bit_identical": identical,
    }, indent=2))
    console.print(f"wrote {out}")
    if not all(identical["mover"]) or not all(identical["bare"]):
        sys.exit("mover_overhead: some storage did not come back bit-identical")


if __name__ == "__main__":
    main()
