"""Which device a prediction is for: the model file's key, and the preset the prior falls back to.

Done without torch: the local GPU is named through NVML (nvidia-ml-py), which also gives the GPU
utilization the model takes as a feature. Without a GPU or its driver NVML raises; that is "no GPU".
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tensile.devices import PRESETS, DeviceSpec, preset_name_for
from tensile.errors import TensileUserError
from tensile.latency.prior import Roofline
from tensile.latency.store import SUFFIX, default_model_dir, slug

DEFAULT_CUDA_PRESET = "a6000"  # the paper's GPU; the prior's guess for an unnamed CUDA device


@dataclass(frozen=True, slots=True)
class Target:
    key: str  # model file key
    kind: str  # "cpu" or "cuda"
    prior: Roofline  # used when no calibrated model exists
    preset: str  # the preset the prior came from


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (calibrations do not transfer between CPU models)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def cpu_key() -> str:
    return "cpu-" + slug(cpu_name())


def _nvml() -> ModuleType | None:
    """pynvml, initialised, or None when there is no NVIDIA driver / library / package."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # NVMLError_LibraryNotFound / DriverNotLoaded / NoPermission...
        return None
    return pynvml


def gpu_name(index: int = 0) -> str | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index))
        return name.decode() if isinstance(name, bytes) else str(name)
    except nvml.NVMLError:
        return None


def gpu_utilization(index: int = 0) -> float | None:
    """Current GPU utilization in [0, 1] from NVML; None without a GPU."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return nvml.nvmlDeviceGetUtilizationRates(nvml.nvmlDeviceGetHandleByIndex(index)).gpu / 100.0
    except nvml.NVMLError:
        return None


def _preset_for(name: str) -> str:
    """The preset a GPU's latencies are predicted with where it is not calibrated: its own, else the default."""
    return preset_name_for(name) or DEFAULT_CUDA_PRESET


def _cuda_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        return []
    return sorted(p for p in model_dir.glob(f"*{SUFFIX}") if not p.name.startswith("cpu-"))


def forecast_preset(device: str) -> str:
    """The GPU preset a job about to run on this machine's `device` ('cuda' or 'cpu') is forecast with: its GPU's, by
    NVML's name (where NVML names none, the one calibrated GPU on file, else the default); 'cpu' for the CPU. Its
    latencies, host link and compute capability (cuBLAS's workspaces) are the GPU's the job will run on."""
    return resolve_target("cuda").preset if device == "cuda" else "cpu"


def resolve_target(device: str, model_dir: str | os.PathLike | None = None) -> Target:
    """'cpu', 'cuda' (the local GPU, else the one calibrated GPU on file), or a preset name ('h100')."""
    name = device.lower()
    if name == "cpu":
        return Target(cpu_key(), "cpu", Roofline.from_spec(PRESETS["cpu"], "cpu"), "cpu")
    if name == "cuda":
        local = gpu_name()
        if local is not None:
            preset = _preset_for(local)
            return Target(slug(local), "cuda", Roofline.from_spec(PRESETS[preset], "cuda"), preset)
        files = _cuda_files(Path(model_dir) if model_dir is not None else default_model_dir())
        key = files[0].name.removesuffix(SUFFIX) if len(files) == 1 else "cuda"
        preset = _preset_for(key) if len(files) == 1 else DEFAULT_CUDA_PRESET
        return Target(key, "cuda", Roofline.from_spec(PRESETS[preset], "cuda"), preset)
    if name in PRESETS:
        spec: DeviceSpec = PRESETS[name]
        return Target(slug(spec.name), "cuda", Roofline.from_spec(spec, "cuda"), name)
    raise TensileUserError(f"unknown latency device '{device}'; use cpu, cuda or one of: {', '.join(PRESETS)}")
