"""Which GPU preset a job about to run on this machine is forecast with (`tensile run`, `tensile local`)."""

from __future__ import annotations

import pytest

from tensile.latency import device


@pytest.mark.parametrize("name, preset", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA RTX A6000", "a6000"),
                                          ("NVIDIA H200", "h200"), ("NVIDIA GH200 480GB", "h200"),
                                          ("NVIDIA L40S", device.DEFAULT_CUDA_PRESET)])
def test_a_gpu_machine_forecasts_with_its_gpus_preset(monkeypatch, name, preset):
    """Its latencies, host link and compute capability (what sizes cuBLAS's workspaces) are that GPU's, found by the
    same rule the node agent finds its GPUs' presets by (tensile.devices.preset_name_for)."""
    monkeypatch.setattr(device, "gpu_name", lambda index=0: name)
    assert device.forecast_preset("cuda") == preset


def test_without_a_gpu_name_or_calibration_the_default_preset_is_used(monkeypatch, tmp_path):
    monkeypatch.setattr(device, "gpu_name", lambda index=0: None)
    monkeypatch.setattr(device, "default_model_dir", lambda: tmp_path)
    assert device.forecast_preset("cuda") == device.DEFAULT_CUDA_PRESET


def test_the_cpu_is_its_own_preset(monkeypatch):
    monkeypatch.setattr(device, "gpu_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    assert device.forecast_preset("cpu") == "cpu"
