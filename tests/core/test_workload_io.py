"""The workload JSON round-trips exactly and a malformed file names the field that is wrong."""

from __future__ import annotations

import copy
import gzip
import json

import pytest

from tensile.errors import TensileUserError
from tensile.workload_io import load_workload, save_workload, workload_from_dict, workload_to_dict


@pytest.fixture(scope="module")
def mlp(traced):
    return traced("examples/tiny_mlp.py:build", 4)


@pytest.mark.parametrize("name", ["w.json", "w.json.gz"])
def test_round_trip_is_exact(tmp_path, mlp, name):
    path = tmp_path / name
    save_workload(mlp, path)
    loaded = load_workload(path)
    assert loaded.ops == mlp.ops
    assert loaded.tensors == mlp.tensors
    assert loaded.signature == mlp.signature
    assert (loaded.model, loaded.batch_size, loaded.device, loaded.meta) == (mlp.model, mlp.batch_size, mlp.device, mlp.meta)
    if name.endswith(".gz"):
        assert gzip.decompress(path.read_bytes()).startswith(b"{")


@pytest.mark.slow
def test_resnet50_file_is_compact(tmp_path, traced):
    path = tmp_path / "r50.json.gz"
    save_workload(traced("resnet50", 16), path)
    assert path.stat().st_size < 200_000


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(version=99), "version"),
        (lambda d: d.update(format="other"), "format"),
        (lambda d: d.pop("ops"), "ops"),
        (lambda d: d["tensors"][0].__setitem__(2, "weights"), "tensors[0].role"),
        (lambda d: d["tensors"][1].__setitem__(1, -5), "tensors[1].size"),
        (lambda d: d["ops"][3].__setitem__(1, "sideways"), "ops[3].phase"),
        (lambda d: d["ops"][2].__setitem__(2, [10**9]), "ops[2].inputs"),
        (lambda d: d["ops"].pop(), "signature"),
    ],
)
def test_malformed_workload_names_the_field(mlp, mutate, field):
    data = copy.deepcopy(json.loads(json.dumps(workload_to_dict(mlp))))
    mutate(data)
    with pytest.raises(TensileUserError, match=f"field '{field.replace('[', '.').replace(']', '.')}"):
        workload_from_dict(data, "bad.json")


def test_not_json_is_a_clear_error(tmp_path):
    path = tmp_path / "w.json"
    path.write_text("{not json")
    with pytest.raises(TensileUserError, match="not a workload JSON file"):
        load_workload(path)
    with pytest.raises(TensileUserError, match="cannot read"):
        load_workload(tmp_path / "missing.json")


def test_a_file_saved_before_ops_recorded_contiguous_runs_still_loads(mlp):
    data = json.loads(json.dumps(workload_to_dict(mlp)))
    assert data["op_fields"][-1] == "runs"
    data["op_fields"].pop()
    for row in data["ops"]:
        row.pop()
    loaded = workload_from_dict(data, "old.json")
    assert [op.name for op in loaded.ops] == [op.name for op in mlp.ops]
    assert all(op.runs == () for op in loaded.ops)


def test_a_workloads_signature_is_hashed_once_and_a_copy_made_with_other_ops_gets_its_own(mlp, monkeypatch):
    """The node agent reads a job's signature several times a planning round (ResNet-50: 4 ms to hash), once with the
    GIL the hooks' requests wait for; a workload's ops are complete once it is made, so its hash is kept. A workload
    made from another's ops with one op changed (not the same object) hashes its own."""
    import hashlib

    import tensile.workload as workload_module
    from tensile.workload import Workload

    data = workload_to_dict(mlp)  # the fixture's own hash, before counting
    hashed = []
    sha256 = hashlib.sha256

    def counted(*args: object) -> object:
        hashed.append(1)
        return sha256(*args)

    monkeypatch.setattr(workload_module.hashlib, "sha256", counted)
    fresh = workload_from_dict(data, "copy")  # checks the file's signature: the one hash
    assert fresh.signature == fresh.signature == data["signature"]
    assert len(hashed) == 1
    ops = copy.deepcopy(fresh.ops)
    ops[0].shapes = ((1, *ops[0].shapes[0]), *ops[0].shapes[1:])
    other = Workload(fresh.model, fresh.batch_size, fresh.device, fresh.tensors, ops)
    assert other.signature != fresh.signature
