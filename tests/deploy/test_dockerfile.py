"""The Dockerfile without a Docker engine: what it copies exists (and is not excluded by .dockerignore),
its entrypoints are real commands of the package, and every version it pins is the project's pin."""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import json
import re
import shlex
import tomllib
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"""["']?([A-Za-z0-9_.\-]+)==([0-9][^\s"'+]*)(\+[A-Za-z0-9.]+)?["']?""")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined, current = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            joined.append(current.strip())
            current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "") for text in joined]


def stages() -> list[dict]:
    """Each FROM with its base image (ARG defaults substituted), its name and its instructions."""
    args: dict[str, str] = {}
    result: list[dict] = []
    for op, rest in instructions():
        if op == "ARG" and not result and "=" in rest:
            key, value = rest.split("=", 1)
            args[key] = value
        elif op == "FROM":
            words = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], words[0])
            result.append({"image": image, "name": words[2] if len(words) > 2 and words[1].upper() == "AS" else None,
                           "steps": []})
        else:
            result[-1]["steps"].append((op, rest))
    return result


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def project_pins() -> dict[str, str]:
    """Package -> version from pyproject's dependencies, its extras and constraints.txt."""
    data = pyproject()["project"]
    lines = list(data["dependencies"]) + [d for extra in data["optional-dependencies"].values() for d in extra]
    lines += [line for line in (ROOT / "constraints.txt").read_text().splitlines() if not line.startswith("#")]
    pins: dict[str, str] = {}
    for line in lines:
        if match := PIN.fullmatch(line.strip()):
            name = match[1].lower().replace("_", "-")
            assert pins.setdefault(name, match[2]) == match[2], f"{name} pinned twice with different versions"
    return pins


def test_multi_stage_slim_non_root() -> None:
    builder, runtime = stages()[0], stages()[-1]
    assert len(stages()) >= 2 and builder["name"]
    assert builder["image"] == runtime["image"], "the venv's interpreter must be the same in both stages"
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?", runtime["image"]), runtime["image"]
    assert pyproject()["project"]["requires-python"] == ">=3.11"
    steps = runtime["steps"]
    users = [rest for op, rest in steps if op == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}, "the runtime stage runs as a non-root user"
    runs = " ".join(rest for op, rest in steps if op == "RUN")
    assert not re.search(r"\b(apt-get|apk|pip|gcc|make)\b", runs), "no package installs or compilers at run time"
    copies = [rest for op, rest in steps if op == "COPY"]
    assert copies == [f"--from={builder['name']} /opt/venv /opt/venv"], "runtime gets only the builder's venv"


def test_copied_paths_exist_and_are_in_the_build_context() -> None:
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    names = {s["name"] for s in stages() if s["name"]}
    copied = []
    for stage in stages():
        for op, rest in stage["steps"]:
            if op not in {"COPY", "ADD"}:
                continue
            words = shlex.split(rest)
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")][:-1]
            if any(f.startswith("--from=") for f in flags):
                assert {f.split("=", 1)[1] for f in flags if f.startswith("--from=")} <= names
                continue
            assert op == "COPY", "ADD fetches and unpacks: use COPY"
            for path in paths:
                assert (ROOT / path).exists(), f"COPY {path}: not in the repository"
                assert not any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in ignored), \
                    f"COPY {path}: excluded by .dockerignore"
                copied.append(path.rstrip("/"))
    # The wheel is built from these: pyproject's package folders must all be copied.
    package_dirs = {path.split("/")[0] for path in pyproject()["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]}
    assert package_dirs <= set(copied), package_dirs - set(copied)
    assert {"pyproject.toml", pyproject()["project"]["readme"]} <= set(copied)


def test_pins_match_the_project() -> None:
    pins = project_pins()
    text = " ".join(rest for _, rest in instructions() if _ == "RUN")
    found = PIN.findall(text)
    assert found, "the Dockerfile pins torch"
    for name, version, local in found:
        key = name.lower().replace("_", "-")
        assert pins.get(key) == version, f"Dockerfile pins {name}=={version}, the project {pins.get(key)}"
        if key in {"torch", "torchvision"}:
            assert local == "+cpu", f"{name}: the image needs the CPU build (forecasting only)"
    assert "-c constraints.txt" in text


def test_installed_extras_cover_the_entrypoints() -> None:
    extras = pyproject()["project"]["optional-dependencies"]
    text = " ".join(rest for op, rest in instructions() if op == "RUN")
    (spec,) = re.findall(r"\"\.\[([a-z,]+)\]\"", text)
    installed = set(spec.split(","))
    assert installed <= set(extras)
    assert {"operator", "agent", "zoo"} <= installed, "operator (kopf), agent (fastapi...), zoo (models to forecast)"


def test_entrypoints_exist() -> None:
    steps = stages()[-1]["steps"]
    (entrypoint,) = [rest for op, rest in steps if op == "ENTRYPOINT"]
    assert entrypoint.startswith("["), "ENTRYPOINT in exec form (signals reach the process)"
    (command,) = json.loads(entrypoint)
    target = pyproject()["project"]["scripts"][command]
    module, func = target.split(":")
    assert callable(getattr(importlib.import_module(module), func))
    env = " ".join(rest for op, rest in steps if op == "ENV")
    assert re.search(r"PATH=/opt/venv/bin:", env), "python and tensile come from the venv"
    from tensile.cli import build_parser

    parser = build_parser()
    for sub in ("operator", "agent"):
        assert parser.parse_args([sub]).command == sub


def test_the_operators_init_container_command_exists() -> None:
    from tensile_operator.pods import build_pod

    body = {"metadata": {"namespace": "ns", "name": "j"}, "spec": {"template": {"spec": {"containers": [{"name": "t"}]}}}}
    (installer,) = [c for c in build_pod(body, "n", "GPU-1", None, None, None, None)["spec"]["initContainers"]]
    python, flag, module, _dest = installer["command"]
    assert (python, flag) == ("python", "-m")
    assert importlib.util.find_spec(module) is not None, module
    assert callable(importlib.import_module(module).main)
