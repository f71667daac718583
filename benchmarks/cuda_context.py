"""What a CUDA training process holds outside PyTorch's caching allocator, against the per-job context Tensile books
for its GPU, and whether the memory cap holds the whole process to its admitted size.

Admission books each job its reserved peak plus its GPU's per-job context (`tensile.devices` presets: 600-700 MiB;
the agents' `--context-bytes`), and the hook caps the caching allocator at the admitted size less that context
(runtime_hook/tensile_hook/memory_cap.py). Both are right only if the context figure is at least what a process
really holds beside its allocator: the CUDA context, the kernels it loads, cuBLAS's and cuDNN's handles.

1. The process trains a little (a matmul model and a convolution, forward, backward and an Adam step: cuBLAS and
   cuDNN loaded), then reads what it holds on the device and what its allocator reserved. What it holds is NVML's
   figure for this process (pynvml, where this process's id is in NVML's list); else the device's used memory
   (`torch.cuda.mem_get_info`), which also counts what the driver and other processes hold: an upper bound, said so.
2. The cache emptied, the allocator is capped as a pod's would be (`cap_memory` with `--cap` and the GPU's preset
   context), and 16 MiB tensors are allocated until the allocator refuses: what the process then holds, against the
   cap.

Run (GPU only): python benchmarks/cuda_context.py [--cap 2GiB]  -> benchmarks/results/cuda_context_<gpu>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench_results import results_dir
from tensile.devices import context_for, parse_bytes
from tensile.latency.calibrate import local_device
from tensile_hook.memory_cap import cap_memory

MIB = 2**20


class Held:
    """What this process holds on device 0, by NVML's per-process figure where it lists this process, else the
    device's used memory."""

    def __init__(self) -> None:
        self.nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001 - no NVML binding: the device-wide figure stands in
            self.nvml = None

    def __call__(self) -> tuple[int, str]:
        """(bytes, how they were read)."""
        if self.nvml is not None:
            for process in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if process.pid == os.getpid() and process.usedGpuMemory:
                    return int(process.usedGpuMemory), "nvml process"
        free, total = torch.cuda.mem_get_info(0)
        return int(total - free), "device used (an upper bound: the driver's and other processes' too)"


def train_a_little(device: torch.device) -> None:
    """Load what training loads: cuBLAS (matmuls, forward and backward), cuDNN (a convolution), an optimizer step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(16 * 30 * 30, 64), torch.nn.Linear(64, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(3):
        loss = model(torch.randn(8, 3, 32, 32, device=device)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize(device)


def fill_to_cap(device: torch.device, chunk: int) -> int:
    """Allocate `chunk`-byte tensors until the allocator refuses; how many bytes the tensors held."""
    kept = []
    try:
        while True:
            kept.append(torch.empty(chunk, dtype=torch.uint8, device=device))
    except torch.OutOfMemoryError:
        pass
    held = len(kept) * chunk
    del kept
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", default="2GiB", help="the admitted size the cap is checked with (2GiB)")
    parser.add_argument("--chunk-mib", type=int, default=16, help="the tensors allocated up to the cap (16 MiB)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_context: no CUDA device is visible to PyTorch here; run it on a GPU machine")
    _, device_key, device_name = local_device("cuda")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    booked = context_for(device_name)
    held = Held()

    train_a_little(device)
    process_bytes, method = held()
    reserved = torch.cuda.memory_reserved(device)
    outside = process_bytes - reserved

    torch.cuda.empty_cache()
    cap_bytes = parse_bytes(args.cap, "--cap")
    cap = cap_memory(torch.cuda, {"TENSILE_MEMORY_CAP": str(cap_bytes)})
    assert cap is not None
    tensors = fill_to_cap(device, args.chunk_mib * MIB)
    capped_bytes, capped_method = held()
    capped_reserved = torch.cuda.memory_reserved(device)  # the tensors freed, their segments still cached

    console = Console()
    table = Table(title=f"Memory outside the caching allocator ({device_name}, torch {torch.__version__})")
    for column in ("figure", "MiB"):
        table.add_column(column, justify="right" if column == "MiB" else "left")
    rows = [("process holds after training a little", process_bytes), ("its allocator reserved", reserved),
            ("outside the allocator", outside), ("booked per-job context (preset)", booked),
            ("cap (admitted size)", cap_bytes), ("allocator's share under the cap", cap.allocator_bytes),
            ("tensors allocated up to the cap", tensors), ("allocator reserved at the cap", capped_reserved),
            ("process holds at the cap", capped_bytes)]
    for figure, value in rows:
        table.add_row(figure, f"{value / MIB:,.1f}")
    console.print(table)
    within = capped_bytes <= cap_bytes
    console.print(f"outside the allocator {outside / MIB:,.1f} MiB against {booked / MIB:,.0f} MiB booked "
                  f"({'within' if outside <= booked else 'OVER'} the booking; read as: {method}); the capped process "
                  f"holds {capped_bytes / MIB:,.1f} MiB of its {cap_bytes / MIB:,.0f} MiB "
                  f"({'within' if within else 'OVER'} its cap)")
    out = results_dir() / f"cuda_context_{device_key}.json"
    out.write_text(json.dumps({
        "device": device_name, "device_key": device_key, "torch": torch.__version__, "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(), "command": "python benchmarks/cuda_context.py "
        + " ".join(sys.argv[1:]), "method": method,
        "process_bytes": process_bytes, "reserved_bytes": reserved, "outside_allocator_bytes": outside,
        "booked_context_bytes": booked, "outside_within_booking": outside <= booked,
        "cap": {"cap_bytes": cap.cap_bytes, "context_bytes": cap.context_bytes, "allocator_bytes": cap.allocator_bytes,
                "tensor_bytes": tensors, "reserved_bytes": capped_reserved, "process_bytes": capped_bytes,
                "method": capped_method, "within_cap": within},
    }, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
