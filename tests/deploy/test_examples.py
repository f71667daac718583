"""The cluster examples run as they are: each TrainingJob names the examples' image (examples/Dockerfile), whose
PyTorch the hook supports, and a script that image holds, and that script trains what the job's spec.workload
describes, so that the operator's forecast is of the training that runs."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tensile.zoo import ZOO
from tensile_hook.lifecycle import OLDEST_TORCH

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "examples" / "Dockerfile"
JOBS = sorted((ROOT / "examples").glob("trainingjob-*.yaml"))


def image_tag() -> str:
    """The tag the examples' Dockerfile says to build, which must be the chart's appVersion."""
    (tag,) = re.findall(r"docker build -f examples/Dockerfile -t (\S+) \.", DOCKERFILE.read_text())
    return tag


def containers(path: Path) -> list[dict]:
    return yaml.safe_load(path.read_text())["spec"]["template"]["spec"]["containers"]


def test_the_examples_image_is_the_charts_version_on_a_pytorch_the_hook_supports() -> None:
    app_version = yaml.safe_load((ROOT / "charts" / "tensile" / "Chart.yaml").read_text())["appVersion"]
    assert image_tag() == f"ghcr.io/tensile/examples:{app_version}"
    (base,) = re.findall(r"^ARG PYTORCH_IMAGE=pytorch/pytorch:(\d+)\.(\d+)\.\d+-", DOCKERFILE.read_text(), re.M)
    assert (int(base[0]), int(base[1])) >= OLDEST_TORCH


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_each_example_job_runs_a_script_of_the_examples_image(path: Path) -> None:
    copied = re.findall(r"^COPY (examples/\S+) \./examples/$", DOCKERFILE.read_text(), re.M)
    for container in containers(path):
        assert container["image"] == image_tag(), f"{path.name}: {container['image']}"
        program, script = container["command"][:2]
        assert program == "python" and (ROOT / script).is_file(), f"{path.name}: {shlex.join(container['command'])}"
        assert any(Path(script).match(pattern) for pattern in copied), f"{script} is not copied into the image"


def _train_zoo():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("train_zoo", ROOT / "examples" / "train_zoo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", [p for p in JOBS if yaml.safe_load(p.read_text())["spec"]["workload"].get("model") in ZOO],
                         ids=lambda p: p.name)
def test_a_zoo_jobs_command_trains_the_workload_its_spec_forecasts(path: Path) -> None:
    workload = yaml.safe_load(path.read_text())["spec"]["workload"]
    (container,) = containers(path)
    args = _train_zoo().arguments(container["command"][2:])
    assert (args.name, args.batch_size, args.optimizer, args.dtype, args.input_shape) == (
        workload["model"], workload.get("batchSize", 16), workload.get("optimizer", "adam"),
        workload.get("dtype", "float32"), workload.get("inputShape"))
