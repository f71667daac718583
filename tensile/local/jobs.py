"""TrainingJob YAML files for the local runner: validated against the CRD's schema, read into LocalJobs.

The same files as the cluster (examples/trainingjob-*.yaml), one TrainingJob or several (`---`
separated documents, as kubectl takes them); a mistake is reported with the file and the field, as
the API server would with strict field validation, and a name Kubernetes would refuse is refused.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import yaml

from tensile.errors import TensileUserError
from tensile.knobs import MEMORY_BUDGET
from tensile.trainingjob_spec import JobSpec, SpecError, parse_spec, unknown_annotations_message
from tensile.training_command import local_command

CRD = Path(__file__).resolve().parents[2] / "crds" / "trainingjobs.tensile.dev.yaml"
# Kubernetes' names: a custom resource's metadata.name is a DNS-1123 subdomain, a namespace a DNS-1123 label
DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = re.compile(rf"{DNS1123_LABEL}(\.{DNS1123_LABEL})*")  # fullmatch
DNS1123_LABEL_RE = re.compile(DNS1123_LABEL)


class _StrictLoader(yaml.SafeLoader):
    """Safe YAML that refuses a key set twice in one mapping, as kubectl does: PyYAML keeps the last one in
    silence, so a second `memoryBudget:` further down replaced the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    f"in the mapping at line {node.start_mark.line + 1}", node.start_mark,
                    f"key '{key}' is set twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1}): keep one",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


@dataclass(frozen=True)
class LocalJob:
    name: str
    path: Path
    # its workload and knobs as the operator reads them (the annotations over the spec's fields): what the runner
    # traces, forecasts and admits it by, and what its hook is told
    spec: JobSpec
    optimizer: str | None  # as written, not parse_spec's default: None is a user model's own make_optimizer (zoo: adam)
    command: list[str]  # the container's command + args, as it runs locally (python -> this Python)
    problem: str | None = None  # why the command cannot run here (reported, the job fails)
    # tensile.dev/* annotations Tensile does not read (a misspelt knob): said at load, as the operator's condition says
    unknown_annotations: str | None = None


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


def load_file(path: str | Path) -> list[LocalJob]:
    """The TrainingJobs of one YAML file: one document, or several separated by `---` (empty ones skipped,
    as kubectl does); a mistake names the file, and the document when the file holds more than one."""
    path = Path(path)
    try:
        docs = [d for d in yaml.load_all(path.read_text(), Loader=_StrictLoader) if d is not None]
    except OSError as exc:
        raise TensileUserError(f"{path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise TensileUserError(f"{path}: not valid YAML ({exc})") from None
    if not docs:
        raise TensileUserError(f"{path}: no TrainingJob in it (the file is empty)")
    where = [str(path) if len(docs) == 1 else f"{path} (document {i} of {len(docs)})" for i in range(1, len(docs) + 1)]
    return [_job(doc, path, at) for doc, at in zip(docs, where)]


def load_job(path: str | Path) -> LocalJob:
    """The one TrainingJob of a file (`load_file` reads a file of several)."""
    jobs = load_file(path)
    if len(jobs) != 1:
        raise TensileUserError(f"{path}: holds {len(jobs)} TrainingJobs where one was expected")
    return jobs[0]


def _schema_message(error: jsonschema.ValidationError) -> str:
    """The schema's complaint with its fix: "is valid under each of ..." and "is not valid under any of ..."
    name the schemas, not the fields, and say nothing of what to change."""
    field = ".".join(map(str, error.absolute_path)) or "(top level)"
    schema = error.schema if isinstance(error.schema, dict) else {}
    branches = schema.get("oneOf") if error.validator == "oneOf" else None
    if isinstance(error.instance, dict) and isinstance(branches, list) and all(
            isinstance(b, dict) and set(b) == {"required"} and len(b["required"]) == 1 for b in branches):
        choices = [b["required"][0] for b in branches]  # spec.workload: model or profile, exactly one
        given = [c for c in choices if c in error.instance]
        what = f" ({schema['description']})" if schema.get("description") else ""
        if len(given) > 1:
            named = " and ".join(f"{field}.{c}" for c in given)
            return f"{field}: {named} are both set; keep one: {', '.join(given[:-1])} or {given[-1]}, not both{what}"
        return f"{field}: set one of {' or '.join(f'{field}.{c}' for c in choices)}{what}"
    # "is not valid under any of the given schemas" says nothing of the fix: the field's own description does
    expected = schema.get("description")
    hint = f"; expected {expected}" if expected else ""
    return f"{field}: {error.message}{hint}"


def _check_name(at: str, field: str, value: object, label: bool = False) -> None:
    """A name as the API server checks it: a TrainingJob's name a DNS-1123 subdomain, a namespace a DNS-1123 label."""
    limit, pattern = (63, DNS1123_LABEL_RE) if label else (253, DNS1123_SUBDOMAIN)
    if isinstance(value, str) and len(value) <= limit and pattern.fullmatch(value):
        return
    rule = (f"at most {limit} lowercase letters, digits and '-'" if label
            else f"at most {limit} lowercase letters, digits, '-' and '.'")
    kind = "DNS-1123 label" if label else "DNS-1123 subdomain"
    suggestion = re.sub(r"[^a-z0-9.-]+" if not label else r"[^a-z0-9-]+", "-", str(value).lower())
    suggestion = re.sub(r"[-.]*\.[-.]*", ".", suggestion).strip("-.")[:limit].strip("-.")
    fix = f", e.g. '{suggestion}'" if suggestion and suggestion != value else ""
    raise TensileUserError(f"{at}: {field}: {value!r:.80} is not a name Kubernetes takes: use {rule}, "
                           f"starting and ending with a letter or digit (a {kind}){fix}")


def _job(doc: object, path: Path, at: str) -> LocalJob:
    """One document as a LocalJob; `at` names it in messages (the file, and the document of several)."""
    if not isinstance(doc, dict):
        raise TensileUserError(f"{at}: expected a TrainingJob object (apiVersion, kind, metadata, spec), "
                               f"found a YAML {type(doc).__name__}")
    if (doc.get("apiVersion"), doc.get("kind")) != ("tensile.dev/v1alpha1", "TrainingJob"):
        raise TensileUserError(f"{at}: apiVersion/kind must be tensile.dev/v1alpha1 / TrainingJob "
                               f"(was {doc.get('apiVersion')} / {doc.get('kind')})")
    errors = sorted(_validator().iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise TensileUserError(f"{at}: {_schema_message(errors[0])}{more}")
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise TensileUserError(f"{at}: metadata: must be an object with a name")
    name = metadata.get("name")
    if not name:
        raise TensileUserError(f"{at}: metadata.name is required")
    _check_name(at, "metadata.name", name)
    if metadata.get("namespace") is not None:
        _check_name(at, "metadata.namespace", metadata["namespace"], label=True)
    annotations = metadata.get("annotations")
    spec = doc["spec"]
    workload = spec["workload"]
    containers = spec["template"].get("spec", {}).get("containers") or []
    if not containers or not containers[0].get("command"):
        raise TensileUserError(f"{at}: spec.template.spec.containers[0].command: the local runner runs this command; give one")
    command, problem = local_command([*containers[0]["command"], *containers[0].get("args", [])])
    try:  # the knobs as the operator reads them: the same annotations override the same fields
        parsed = parse_spec(spec, annotations)
    except SpecError as exc:
        shown, *others = exc.problems
        raise TensileUserError(f"{at}: {shown}" + (f" (and {len(others)} more)" if others else "")) from None
    if parsed.workload.profile and parsed.memory_budget is None:
        raise TensileUserError(f"{at}: {MEMORY_BUDGET.spec_field}: a job with workload.profile needs a memory budget "
                               "(nothing to trace locally); add e.g. memoryBudget: 1Gi")
    unknown = unknown_annotations_message(parsed.unknown_annotations) if parsed.unknown_annotations else None
    return LocalJob(name=name, path=path, spec=parsed, optimizer=workload.get("optimizer"), command=command,
                    problem=problem, unknown_annotations=unknown)


def load_jobs(paths: list[str]) -> list[LocalJob]:
    """Every TrainingJob of the files, in order; two of the same name are refused (they would share one job's
    registration with the agent, its report and its log)."""
    jobs = [job for p in paths for job in load_file(p)]
    seen: dict[str, LocalJob] = {}
    for job in jobs:
        first = seen.setdefault(job.name, job)
        if first is not job:
            places = str(first.path) if first.path == job.path else f"{first.path} and {job.path}"
            raise TensileUserError(f"metadata.name: two TrainingJobs name the job '{job.name}' ({places}); "
                                   "job names must differ: rename one")
    return jobs
