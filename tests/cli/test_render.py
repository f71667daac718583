"""`tensile render`: the objects the operator would create for a TrainingJob, each valid for Kubernetes 1.36 and 1.37
(strict schemas), with the claim sized by the one admission rule."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tensile.admission import admitted_bytes, parse_quantity
from tensile.cli import main
from tensile.devices import device_preset

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ("1.36.0", "1.37.0")
GIB = 1024**3


def rendered(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict]:
    assert main(["render", *args]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    for obj in objects:
        for version in KUBERNETES:
            kubernetes_validate.validate(obj, version, strict=True)
    return objects


def job_file(tmp_path: Path, spec: dict, name: str = "budgeted") -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "tensile.dev/v1alpha1", "kind": "TrainingJob",
                                    "metadata": {"name": name, "namespace": "team"}, "spec": spec}))
    return path


TEMPLATE = {"spec": {"containers": [{"name": "train", "image": "example", "command": ["python", "train.py"]}]}}


def test_a_budgeted_job_renders_a_claim_of_budget_plus_context_and_a_pod_that_names_it(tmp_path, capsys):
    path = job_file(tmp_path, {"workload": {"profile": "p"}, "memoryBudget": "3Gi", "template": TEMPLATE})
    claim, pod = rendered(capsys, str(path), "--gpu", "GPU-1234", "--node", "node-7")
    context = device_preset("h100").context_bytes
    exactly = claim["spec"]["devices"]["requests"][0]["exactly"]
    assert parse_quantity(exactly["capacity"]["requests"]["memory"]) == admitted_bytes(3 * GIB, 0, context)
    assert exactly["selectors"][0]["cel"]["expression"] == 'device.attributes["gpu.nvidia.com"].uuid == "GPU-1234"'
    assert claim["metadata"]["namespace"] == pod["metadata"]["namespace"] == "team"
    assert pod["spec"]["resourceClaims"] == [{"name": "tensile-gpu", "resourceClaimName": claim["metadata"]["name"]}]
    assert "nodeName" not in pod["spec"]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert not {"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"} & env.keys()
    # capped as the operator caps it: at the claim's request, its context kept out of the allocator's share
    assert int(env["TENSILE_MEMORY_CAP"]) == parse_quantity(exactly["capacity"]["requests"]["memory"])
    assert int(env["TENSILE_CONTEXT_BYTES"]) == context


def test_legacy_renders_only_the_pod_pinned_by_node_and_variables(tmp_path, capsys):
    path = job_file(tmp_path, {"workload": {"profile": "p"}, "memoryBudget": "3Gi", "template": TEMPLATE})
    [pod] = rendered(capsys, str(path), "--gpu-access", "legacy", "--node", "node-7")
    assert pod["spec"]["nodeName"] == "node-7"
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == env["TENSILE_GPU"]
    context = device_preset("h100").context_bytes
    assert (int(env["TENSILE_MEMORY_CAP"]), int(env["TENSILE_CONTEXT_BYTES"])) == (3 * GIB + context, context)


def test_a_shipped_example_renders_on_a_simulated_gpu_sized_by_its_forecast(capsys):
    claim, pod = rendered(capsys, str(ROOT / "examples" / "trainingjob-resnet50.yaml"), "--device-class",
                          "gpus.example.com")
    exactly = claim["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["deviceClassName"] == "gpus.example.com"
    assert parse_quantity(exactly["capacity"]["requests"]["memory"]) > device_preset("h100").context_bytes
    assert pod["metadata"]["annotations"]["tensile.dev/gpu"].startswith("GPU-00000000")


def test_a_job_larger_than_the_gpu_is_refused_with_the_reason(tmp_path, capsys):
    path = job_file(tmp_path, {"workload": {"profile": "p"}, "memoryBudget": "200Gi", "template": TEMPLATE})
    assert main(["render", str(path)]) != 0
    captured = capsys.readouterr()
    assert "would not be admitted" in captured.out + captured.err
    assert "more than the largest GPU has" in captured.out + captured.err
