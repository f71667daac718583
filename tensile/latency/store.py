"""The calibrated model on disk: one small gzip'd JSON file per device, found by the device's name.

JSON (not pickle, not a torch checkpoint) so that loading runs no code and needs no torch, and a
damaged or foreign file is detected and named instead of mis-predicting.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from tensile.errors import TensileUserError
from tensile.latency.families import FAMILIES, FEATURE_VERSION, feature_count
from tensile.latency.mlp import FamilyEnsemble, FamilyMLP
from tensile.latency.prior import Roofline

FORMAT = "tensile-latency-model"
FORMAT_VERSION = 1
SUFFIX = ".json.gz"


@dataclass(slots=True)
class LatencyModel:
    """Measured roofline figures of one device plus an MLP correction per op family."""

    device_key: str  # file key, e.g. "cpu-amd-epyc-7b13" or "nvidia-h100-80gb-hbm3"
    device_name: str
    kind: str  # "cpu" or "cuda"
    roofline: Roofline
    families: dict[str, FamilyEnsemble | FamilyMLP] = field(default_factory=dict)
    view_seconds: float | None = None  # measured cost of a view / metadata op (any name)
    meta: dict = field(default_factory=dict)  # torch version, threads, samples, calibration seconds, ...
    view_ops: dict[str, float] = field(default_factory=dict)  # per view op name ('view', 'as_strided'): its cost
    # op_key -> median seconds of an op calibration measured (the zoo's parameter-shaped ops: the optimizer's,
    # weight gradients): its own time, where the MLP would only approximate it
    measured_ops: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": FORMAT_VERSION, "feature_version": FEATURE_VERSION,
            "device_key": self.device_key, "device_name": self.device_name, "kind": self.kind,
            "roofline": self.roofline.to_dict(), "view_seconds": self.view_seconds, "view_ops": self.view_ops,
            "meta": self.meta, "measured_ops": self.measured_ops,
            "families": {name: model.to_dict() for name, model in self.families.items()},
        }


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def default_model_dir() -> Path:
    """$TENSILE_HOME/latency, else ~/.cache/tensile/latency."""
    home = os.environ.get("TENSILE_HOME")
    return Path(home) / "latency" if home else Path.home() / ".cache" / "tensile" / "latency"


def model_path(device_key: str, model_dir: str | os.PathLike | None = None) -> Path:
    """Where the model for `device_key` lives in `model_dir` (default: default_model_dir())."""
    return Path(model_dir if model_dir is not None else default_model_dir()) / f"{device_key}{SUFFIX}"


def save_model(model: LatencyModel, model_dir: str | os.PathLike | None = None) -> Path:
    """Write atomically (a crash mid-write never leaves a half file under the real name)."""
    path = model_path(model.device_key, model_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as fh:
        json.dump(model.to_dict(), fh, separators=(",", ":"))
    os.replace(tmp, path)
    return path


def _bad(path: Path, why: str) -> TensileUserError:
    return TensileUserError(
        f"latency model file {path} is unusable: {why}. Delete it or re-create it with `tensile calibrate`"
    )


def load_model(path: str | os.PathLike, expect_key: str | None = None) -> LatencyModel:
    """Read and validate a model file; any problem is a TensileUserError naming the file."""
    path = Path(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"cannot be read as gzip'd JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _bad(path, "not a Tensile latency model")
    if data.get("version") != FORMAT_VERSION or data.get("feature_version") != FEATURE_VERSION:
        raise _bad(path, f"made by another version (format {data.get('version')}, features "
                         f"{data.get('feature_version')}; this Tensile reads {FORMAT_VERSION}/{FEATURE_VERSION})")
    if expect_key is not None and data.get("device_key") != expect_key:
        raise _bad(path, f"it was calibrated for device '{data.get('device_key')}', not '{expect_key}'")
    try:
        families: dict[str, FamilyEnsemble | FamilyMLP] = {}
        for name, family in dict(data["families"]).items():
            if name not in FAMILIES:
                raise ValueError(f"unknown op family '{name}'")
            mlp = FamilyEnsemble.from_dict(family)
            if mlp.n_features != feature_count(name):
                raise ValueError(f"family '{name}' expects {mlp.n_features} features, this Tensile makes "
                                 f"{feature_count(name)}")
            families[name] = mlp
        roofline = Roofline.from_dict(data["roofline"])
        if roofline.flops_per_second <= 0 or roofline.bytes_per_second <= 0:
            raise ValueError("non-positive roofline rates")
        view = data.get("view_seconds")
        view_ops = {str(k): float(v) for k, v in dict(data.get("view_ops", {})).items()}
        measured = {str(k): float(v) for k, v in dict(data["measured_ops"]).items()}
        return LatencyModel(str(data["device_key"]), str(data["device_name"]), str(data["kind"]), roofline,
                            families, float(view) if view is not None else None, dict(data.get("meta", {})), view_ops,
                            measured)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _bad(path, f"malformed content ({exc})") from None
