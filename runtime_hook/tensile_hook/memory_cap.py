"""The hard cap on a job process's CUDA memory: the process may hold no more than the job was admitted with
(TENSILE_MEMORY_CAP, `tensile.knobs.MEMORY_CAP`), so a job that outgrows its admission gets an out-of-memory error of
its own instead of taking its neighbours' memory on a shared GPU.

Set by sitecustomize before the hook starts and whether it starts or not (an unsupported PyTorch, a job of several
processes, a failure at start): a job the hook does not carry runs unguarded, and the cap is then all that keeps it
to its share. `torch.cuda.set_per_process_memory_fraction` caps only what the caching allocator reserves (its
segments), as a share of the device's memory; the process holds its CUDA context beside them, outside the
allocator. So the allocator is capped at the admitted size less the context that admission counted apart
(TENSILE_CONTEXT_BYTES, `tensile.knobs.CONTEXT_BYTES`: the GPU's per-job context; where no one says, its preset's
by the device's name, else `tensile.devices.DEFAULT_CONTEXT_BYTES`), and the two together stay within the admitted
size. cuDNN's workspaces come from the allocator's share: PyTorch's convolutions fall back to an algorithm with a
smaller workspace where one does not fit, slower, not failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensile.devices import context_for
from tensile.knobs import CONTEXT_BYTES, MEMORY_CAP


@dataclass(frozen=True)
class MemoryCap:
    """The cap as set: the process's `cap_bytes` of the `device_bytes` of CUDA device `device`, of which
    `context_bytes` are kept for what it holds outside the caching allocator and the rest, `allocator_bytes`, is the
    allocator's `fraction` of the device; `note`: what was wrong with the settings, said on stderr ("" if nothing)."""

    cap_bytes: int
    context_bytes: int
    allocator_bytes: int
    device: int
    device_bytes: int
    fraction: float
    note: str = ""


def cap_memory(cuda: Any, environ: Mapping[str, str]) -> MemoryCap | None:
    """Cap this process's CUDA memory (`cuda`: torch.cuda, or a stand-in) at TENSILE_MEMORY_CAP on its device: the one
    numbered LOCAL_RANK for a process a launcher (torchrun) starts, else the current one. None where no cap is given
    or no CUDA device is there (the CPU device has no allocator to cap). The cap is set with the device current, so
    no other device gets a CUDA context of this process. A cap no larger than the context would leave the allocator
    nothing: the allocator is then capped at the whole cap, and the note says why (never uncapped: the cap may be
    all that keeps the job to its share)."""
    cap = MEMORY_CAP.from_environment(environ, None)
    if cap is None or not cuda.is_available():
        return None
    device = _device(cuda, environ)
    with cuda.device(device):
        properties = cuda.get_device_properties(device)
        total = int(properties.total_memory)
        context = CONTEXT_BYTES.from_environment(environ, None)
        if context is None:
            context = context_for(str(getattr(properties, "name", "")))
        note = ""
        if cap <= context:
            note = (f"{MEMORY_CAP.variable} ({cap / 2**20:,.0f} MiB) would leave the caching allocator nothing beside "
                    f"the process's CUDA context ({context / 2**20:,.0f} MiB, {CONTEXT_BYTES.variable}): the allocator "
                    "is capped at the whole cap, and the process may hold its context beyond it; give a larger cap, "
                    "or the context the GPU really takes")
            context = 0
        allocator = cap - context
        fraction = min(1.0, allocator / total)
        cuda.set_per_process_memory_fraction(fraction, device)
    return MemoryCap(cap, context, allocator, device, total, fraction, note)


def _device(cuda: Any, environ: Mapping[str, str]) -> int:
    """The process's device: LOCAL_RANK's where it is one of the visible devices, else the current one."""
    rank = environ.get("LOCAL_RANK", "")
    if rank.isdigit() and int(rank) < cuda.device_count():
        return int(rank)
    return int(cuda.current_device())


def cap_text(cap: MemoryCap) -> str:
    """The cap as sitecustomize says it on stderr."""
    return (f"CUDA memory of device {cap.device} capped at {cap.cap_bytes / 2**20:,.0f} MiB: its caching allocator at "
            f"{cap.allocator_bytes / 2**20:,.0f} MiB ({cap.fraction:.1%} of its {cap.device_bytes / 2**20:,.0f} MiB), "
            f"{cap.context_bytes / 2**20:,.0f} MiB kept for its context (TENSILE_MEMORY_CAP, TENSILE_CONTEXT_BYTES)")
