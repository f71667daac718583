"""Device presets: what the simulator, the latency prior and admission need to know about a device.

Figures are vendor datasheet peaks (dense FP32 / TF32 where a training step would use it), host
link bandwidth as typically achieved with pinned memory, and the memory a process can allocate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tensile.errors import TensileUserError

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    memory_bytes: int  # device memory
    flops_per_second: float  # peak rate a training step's matmuls / convolutions can reach
    memory_bandwidth: float  # bytes/s, device memory
    host_link_bandwidth: float  # bytes/s per direction, host <-> device (PCIe / NVLink-C2C)
    # per process, what it holds outside PyTorch's caching allocator (the CUDA context, the kernels it loads, the
    # libraries' handles): booked beside its reserved peak, and what a job's memory cap keeps out of its allocator's
    # share (tensile_hook.memory_cap). cuDNN's workspaces come from the allocator's share (tensile.cublas_workspaces)
    context_bytes: int
    compute_capability_major: int = 0  # what sizes cuBLAS's workspaces (tensile.cublas_workspaces); 0: no CUDA


PRESETS: dict[str, DeviceSpec] = {
    "a6000": DeviceSpec("NVIDIA RTX A6000", 48 * GIB, 38.7e12, 768e9, 25e9, 600 * 1024**2, 8),
    "h100": DeviceSpec("NVIDIA H100 80GB HBM3", 80 * GIB, 67e12, 3.35e12, 50e9, 700 * 1024**2, 9),
    "h200": DeviceSpec("NVIDIA H200", 141 * GIB, 67e12, 4.8e12, 50e9, 700 * 1024**2, 9),
    "cpu": DeviceSpec("CPU", 24 * GIB, 1.0e11, 2.0e10, 2.0e10, 0),
}


# per process where neither a preset nor a measurement says (the presets: 600-700 MiB)
DEFAULT_CONTEXT_BYTES = 600 * 1024**2


def preset_name_for(gpu_name: str) -> str | None:
    """The short name of a GPU's preset by the name its driver (or a file named after it) gives it: "NVIDIA H100 80GB
    HBM3" and "nvidia-h100-80gb-hbm3" are h100's, "NVIDIA GH200 480GB" h200's; None where no preset's is in it."""
    squeezed = re.sub(r"[^a-z0-9]", "", gpu_name.lower())
    return next((key for key in PRESETS if key != "cpu" and key in squeezed), None)


def preset_for(gpu_name: str) -> DeviceSpec | None:
    """The preset of a GPU by its driver's name (`preset_name_for`), or None."""
    key = preset_name_for(gpu_name)
    return PRESETS[key] if key is not None else None


def context_for(gpu_name: str) -> int:
    """The per-job context of a GPU no one measured: its preset's, by its driver's name, else the default."""
    preset = preset_for(gpu_name)
    return preset.context_bytes if preset is not None else DEFAULT_CONTEXT_BYTES


def device_preset(name: str) -> DeviceSpec:
    """A preset by short name; an unknown name lists the known ones."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise TensileUserError(f"unknown GPU preset '{name}'; known: {', '.join(PRESETS)}") from None


# units of an amount of memory, matched without case: SI (80GB, 80G) and binary (48GiB), with Kubernetes' own
# spellings of both (6Gi, 512Mi, 2e9) so that a budget written for a TrainingJob works as well in a flag or
# `TENSILE_MEMORY_BUDGET` ("m" is mega here: a thousandth of a byte is never what is meant)
_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: base**power
    for power, (decimal, binary) in enumerate((("k", "ki"), ("m", "mi"), ("g", "gi"), ("t", "ti"), ("p", "pi")), start=1)
    for prefix, base in ((decimal, 1000), (binary, 1024))
    for suffix in ("", "b")
}
_AMOUNT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+]?[0-9]+)?)\s*([A-Za-z]*)\s*")


# the most bytes any amount of memory may be, wherever it is written (a TrainingJob, the CLI, the hook's variables,
# the agent's API): far above any GPU, and below int64 with room for sums, so no budget overflows a counter
MAX_BYTES = 2**62


def bytes_written(text: str) -> float | None:
    """The number of bytes `text` writes (a number, with a unit or not), uncapped; None when it is no amount of memory."""
    match = _AMOUNT.fullmatch(text)
    if not match or match.group(2).lower() not in _UNITS:
        return None
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def over_max_bytes(number: float) -> str | None:
    """Why `number` bytes is refused (more than MAX_BYTES), or None: the one cap on every amount of memory, which
    each place that reads one raises with its field's name."""
    if not number > MAX_BYTES:
        return None
    return f"{number:.4g} bytes is more than any GPU holds: amounts of memory go up to 2^62 bytes (4 EiB)"


def parse_bytes(text: str, field: str | None = None) -> int:
    """An amount of memory: bytes, or a number with a unit (48GiB, 6Gi, 80GB, 600MiB, 2e9): GPU sizes, budgets.
    `field` names where it was written, for the error."""
    number = bytes_written(text)
    where = f"{field}: " if field else ""
    if number is None:
        raise TensileUserError(f"{where}'{text}' is not an amount of memory: write bytes or a number with a unit, "
                               "e.g. 6Gi, 48GiB, 80GB or 16000000000")
    if problem := over_max_bytes(number):
        raise TensileUserError(f"{where}{problem}")
    return int(number)
