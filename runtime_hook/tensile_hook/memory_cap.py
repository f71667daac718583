"""The hard cap on a job process's CUDA memory: its caching allocator may reserve no more than the job was admitted
with (TENSILE_MEMORY_CAP, `tensile.knobs.MEMORY_CAP`), so a job that outgrows its admission gets an out-of-memory
error of its own instead of taking its neighbours' memory on a shared GPU.

Set by sitecustomize before the hook starts and whether it starts or not (an unsupported PyTorch, a job of several
processes, a failure at start): a job the hook does not carry runs unguarded, and the cap is then all that keeps it
to its share. `torch.cuda.set_per_process_memory_fraction` caps the allocator's reserved bytes (its segments) as a
share of the device's memory; the CUDA context and memory taken outside the allocator stay outside it, which the
admitted size counts apart (its context bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensile.knobs import MEMORY_CAP


@dataclass(frozen=True)
class MemoryCap:
    """The cap as set: `cap_bytes` of the `device_bytes` of CUDA device `device`, the allocator's `fraction`."""

    cap_bytes: int
    device: int
    device_bytes: int
    fraction: float


def cap_memory(cuda: Any, environ: Mapping[str, str]) -> MemoryCap | None:
    """Cap this process's CUDA memory (`cuda`: torch.cuda, or a stand-in) at TENSILE_MEMORY_CAP on its device: the one
    numbered LOCAL_RANK for a process a launcher (torchrun) starts, else the current one. None where no cap is given
    or no CUDA device is there (the CPU device has no allocator to cap). The cap is set with the device current, so
    no other device gets a CUDA context of this process."""
    cap = MEMORY_CAP.from_environment(environ, None)
    if cap is None or not cuda.is_available():
        return None
    device = _device(cuda, environ)
    with cuda.device(device):
        total = int(cuda.get_device_properties(device).total_memory)
        fraction = min(1.0, cap / total)
        cuda.set_per_process_memory_fraction(fraction, device)
    return MemoryCap(cap, device, total, fraction)


def _device(cuda: Any, environ: Mapping[str, str]) -> int:
    """The process's device: LOCAL_RANK's where it is one of the visible devices, else the current one."""
    rank = environ.get("LOCAL_RANK", "")
    if rank.isdigit() and int(rank) < cuda.device_count():
        return int(rank)
    return int(cuda.current_device())


def cap_text(cap: MemoryCap) -> str:
    """The cap as sitecustomize says it on stderr."""
    return (f"CUDA memory of device {cap.device} capped at {cap.cap_bytes / 2**20:,.0f} MiB "
            f"({cap.fraction:.1%} of its {cap.device_bytes / 2**20:,.0f} MiB; TENSILE_MEMORY_CAP)")
