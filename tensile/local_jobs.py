"""TrainingJob YAML files for the local runner: validated against the CRD's schema, read into LocalJobs.

The same files as the cluster (examples/trainingjob-*.yaml); a mistake is reported with the file and
the field, as the API server would with strict field validation.
"""

from __future__ import annotations

import copy
import functools
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import yaml

from tensile.errors import TensileUserError
from tensile.operator.model import SpecError, parse_spec

CRD = Path(__file__).resolve().parents[1] / "crds" / "trainingjobs.tensile.dev.yaml"


@dataclass(frozen=True)
class LocalJob:
    name: str
    path: Path
    model: str | None  # a zoo model the runner traces; None: a profile (admitted by its memoryBudget)
    profile: str | None
    batch_size: int
    input_shape: tuple[int, ...] | None
    optimizer: str | None  # None: a user model's own make_optimizer (zoo models: adam)
    dtype: str
    micro_batches: int
    memory_budget: int | None  # bytes
    max_swap_rate: float | None
    command: list[str]  # the container's command + args, as it runs locally (python -> this Python)
    problem: str | None = None  # why the command cannot run here (reported, the job fails)
    plan_events: str = "auto"  # spec.scheduling.planEvents: the forecast's and the hook's (TENSILE_PLAN_EVENTS)
    recompute: bool = True  # spec.scheduling.recompute: false keeps the job's plans free of recomputes


def strict_schema(schema: dict) -> dict:
    """Unknown fields are errors wherever the schema lists properties (kubectl's strict validation)."""
    schema = copy.deepcopy(schema)
    stack: list[object] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


@functools.cache
def _validator() -> jsonschema.Draft4Validator:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    # OpenAPI v3.0 schemas use draft 4's boolean exclusiveMinimum
    return jsonschema.Draft4Validator(strict_schema(version["schema"]["openAPIV3Schema"]))


def load_job(path: str | Path) -> LocalJob:
    path = Path(path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as exc:
        raise TensileUserError(f"{path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise TensileUserError(f"{path}: not valid YAML ({exc})") from None
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise TensileUserError(f"{path}: give exactly one TrainingJob object per file")
    doc = docs[0]
    if (doc.get("apiVersion"), doc.get("kind")) != ("tensile.dev/v1alpha1", "TrainingJob"):
        raise TensileUserError(f"{path}: apiVersion/kind must be tensile.dev/v1alpha1 / TrainingJob "
                               f"(was {doc.get('apiVersion')} / {doc.get('kind')})")
    errors = sorted(_validator().iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        first = errors[0]
        field = ".".join(map(str, first.absolute_path)) or "(top level)"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        # "is not valid under any of the given schemas" says nothing of the fix: the field's own description does
        expected = first.schema.get("description") if isinstance(first.schema, dict) else None
        hint = f"; expected {expected}" if expected else ""
        raise TensileUserError(f"{path}: {field}: {first.message}{hint}{more}")
    name = (doc.get("metadata") or {}).get("name")
    if not name:
        raise TensileUserError(f"{path}: metadata.name is required")
    spec = doc["spec"]
    workload = spec["workload"]
    containers = spec["template"].get("spec", {}).get("containers") or []
    if not containers or not containers[0].get("command"):
        raise TensileUserError(f"{path}: spec.template.spec.containers[0].command: the local runner runs this command; give one")
    command, problem = local_command([*containers[0]["command"], *containers[0].get("args", [])])
    try:  # the knobs as the operator reads them: the same annotations override the same fields
        knobs = parse_spec(spec, (doc.get("metadata") or {}).get("annotations"))
    except SpecError as exc:
        shown, *others = exc.problems
        raise TensileUserError(f"{path}: {shown}" + (f" (and {len(others)} more)" if others else "")) from None
    parsed = knobs.workload
    if parsed.profile and knobs.memory_budget is None:
        raise TensileUserError(f"{path}: spec.memoryBudget: a job with workload.profile needs a memory budget "
                               "(nothing to trace locally); add e.g. memoryBudget: 1Gi")
    # the optimizer as written, not parse_spec's default: none given means a user model's own make_optimizer
    return LocalJob(name=name, path=path, model=parsed.model, profile=parsed.profile, batch_size=parsed.batch_size,
                    input_shape=parsed.input_shape, optimizer=workload.get("optimizer"), dtype=parsed.dtype,
                    micro_batches=parsed.micro_batches, memory_budget=knobs.memory_budget,
                    max_swap_rate=knobs.max_swap_rate, command=command, problem=problem, plan_events=knobs.plan_events,
                    recompute=knobs.recompute)


def local_command(command: list[str]) -> tuple[list[str], str | None]:
    """The container command as it runs here (from the current directory): `python` is this Python
    (the one with Tensile); a program or script that does not exist here is a problem, not a crash."""
    program, *rest = command
    if Path(program).name in ("python", "python3"):
        program = sys.executable
        script = next((a for a in rest if not a.startswith("-")), None)
        if script is not None and script.endswith(".py") and not Path(script).exists():
            return [program, *rest], f"cannot run locally: {script} does not exist here (the command runs from {Path.cwd()})"
    elif shutil.which(program) is None:
        return command, f"cannot run locally: no program '{program}' here"
    return [program, *rest], None


def load_jobs(paths: list[str]) -> list[LocalJob]:
    jobs = [load_job(p) for p in paths]
    names = [j.name for j in jobs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TensileUserError(f"metadata.name: two files name the job '{duplicates[0]}'; job names must differ")
    return jobs
