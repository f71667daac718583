"""Render charts/tensile with the real Helm engine (helm-python-sdk), as objects.

`Chart.render` of helm-python-sdk 0.2.2 does not pass the Kubernetes version or the API versions the
cluster serves, but its native `helm_render` call takes both (`kube_version`, `api_versions`): this is
what lets a test render as on a cluster with the Prometheus Operator (`monitoring.coreos.com/v1`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from helm_python import Chart, _native

CHART_DIR = Path(__file__).resolve().parents[2] / "charts" / "tensile"
RELEASE, NAMESPACE = "tensile", "tensile-system"


def render(chart: Chart, values: dict | None = None, *, kube_version: str = "v1.34.0",
           api_versions: tuple[str, ...] = ()) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` with `--kube-version` and `--api-versions`."""
    opts: dict[str, Any] = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True,
                            "kube_version": kube_version, "api_versions": list(api_versions)}
    text = _native.call_string("helm_render", chart._raw(), None if values is None else json.dumps(values),
                               json.dumps(opts))
    return json.loads(text)


def objects(rendered: dict[str, str]) -> list[dict]:
    """Every Kubernetes object of a render (NOTES.txt is not one)."""
    return [doc for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def find(objs: list[dict], kind: str, component: str | None = None) -> list[dict]:
    """Objects of a kind, optionally of one component (app.kubernetes.io/component)."""
    return [o for o in objs if o["kind"] == kind and (
        component is None or o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component)]


def one(objs: list[dict], kind: str, component: str | None = None) -> dict:
    found = find(objs, kind, component)
    assert len(found) == 1, f"expected one {kind} ({component}), got {len(found)}"
    return found[0]
