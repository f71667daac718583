"""Versioned, compact JSON (gzip when the file name ends in .gz) for workloads; round-trips exactly."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from tensile.errors import TensileUserError
from tensile.workload import PHASES, ROLES, Op, TensorInfo, Workload

FORMAT = "tensile.workload"
VERSION = 1
_TENSOR_FIELDS = ("id", "size", "role", "dtype", "created_by", "freed_after", "reuses")
_OP_FIELDS = ("name", "phase", "inputs", "outputs", "writes", "shapes", "dtypes", "params", "flops", "bytes_moved", "latency",
              "runs")
_OLD_OP_FIELDS = _OP_FIELDS[:-1]  # files saved before ops recorded their inputs' contiguous runs: still loadable


def _tuples(value: Any) -> Any:
    """JSON arrays back to the tuples the dataclasses hold."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def workload_to_dict(workload: Workload) -> dict:
    """Rows instead of objects keep the file small: a ResNet-50 iteration is a few hundred kB."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": workload.model,
        "batch_size": workload.batch_size,
        "device": workload.device,
        "meta": workload.meta,
        "signature": workload.signature,
        "tensor_fields": list(_TENSOR_FIELDS),
        "tensors": [[getattr(t, f) for f in _TENSOR_FIELDS] for t in workload.tensors.values()],
        "op_fields": list(_OP_FIELDS),
        "ops": [[getattr(op, f) for f in _OP_FIELDS] for op in workload.ops],
    }


def _field_error(source: str, path: str, fix: str) -> TensileUserError:
    return TensileUserError(f"{source}: malformed workload: field '{path}' {fix}")


def workload_from_dict(data: Any, source: str = "workload") -> Workload:
    """Parse and validate; every problem names the field that is wrong."""
    if not isinstance(data, dict):
        raise _field_error(source, "(root)", "must be a JSON object")
    if data.get("format") != FORMAT:
        raise _field_error(source, "format", f"must be '{FORMAT}' (was {data.get('format')!r})")
    if data.get("version") != VERSION:
        raise _field_error(source, "version", f"must be {VERSION} (was {data.get('version')!r}); re-run 'tensile forecast --save'")
    for key, kind in (("model", str), ("batch_size", int), ("device", str), ("tensors", list), ("ops", list)):
        if not isinstance(data.get(key), kind):
            raise _field_error(source, key, f"must be a {kind.__name__}")
    op_fields = data.get("op_fields")
    if data.get("tensor_fields") != list(_TENSOR_FIELDS) or op_fields not in (list(_OP_FIELDS), list(_OLD_OP_FIELDS)):
        raise _field_error(source, "tensor_fields/op_fields", f"must be {list(_TENSOR_FIELDS)} and {list(_OP_FIELDS)}")
    tensors: dict[int, TensorInfo] = {}
    for i, row in enumerate(data["tensors"]):
        if not isinstance(row, list) or len(row) != len(_TENSOR_FIELDS):
            raise _field_error(source, f"tensors[{i}]", f"must be a list of {len(_TENSOR_FIELDS)} values")
        tensor = TensorInfo(*row)
        if not isinstance(tensor.id, int) or not isinstance(tensor.size, int) or tensor.size < 0:
            raise _field_error(source, f"tensors[{i}].size", "must be a non-negative integer")
        if tensor.role not in ROLES:
            raise _field_error(source, f"tensors[{i}].role", f"must be one of {ROLES}")
        tensors[tensor.id] = tensor
    ops: list[Op] = []
    for i, row in enumerate(data["ops"]):
        if not isinstance(row, list) or len(row) != len(op_fields):
            raise _field_error(source, f"ops[{i}]", f"must be a list of {len(op_fields)} values")
        op = Op(i, *(_tuples(v) for v in row))
        if op.phase not in PHASES:
            raise _field_error(source, f"ops[{i}].phase", f"must be one of {PHASES}")
        for name in ("inputs", "outputs", "writes"):
            unknown = [t for t in getattr(op, name) if t not in tensors]
            if unknown:
                raise _field_error(source, f"ops[{i}].{name}", f"names unknown tensor ids {unknown[:5]}")
        ops.append(op)
    workload = Workload(data["model"], data["batch_size"], data["device"], tensors, ops, dict(data.get("meta") or {}))
    if "signature" in data and data["signature"] != workload.signature:
        raise _field_error(source, "signature", "does not match the ops (the file was edited or truncated)")
    return workload


def save_workload(workload: Workload, path: str | Path) -> None:
    text = json.dumps(workload_to_dict(workload), separators=(",", ":"))
    path = Path(path)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)


def load_workload(path: str | Path) -> Workload:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TensileUserError(f"{path}: cannot read workload file ({exc.strerror})") from None
    try:
        text = gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TensileUserError(f"{path}: not a workload JSON file ({exc})") from None
    return workload_from_dict(data, str(path))
