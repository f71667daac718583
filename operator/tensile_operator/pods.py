"""The training pod of an admitted TrainingJob: the user's template, given its GPU, hooked.

Its GPU comes from its ResourceClaim (`claim`: the scheduler binds the pod where the claim is allocated and the DRA
driver makes the GPU visible), or, in legacy mode, from `spec.nodeName` and NVIDIA_VISIBLE_DEVICES/CUDA_VISIBLE_DEVICES.

The hook reaches the user's image without changing it: an init container from the Tensile image
copies the hook (and the core it needs) into a shared emptyDir, and every container gets that
folder on PYTHONPATH (its sitecustomize switches the hook on) plus the TENSILE_* settings.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import os
import secrets

from tensile.allocator import expandable_segments_setting
from tensile.knobs import knob_variables
from tensile_operator import API_VERSION

HOOK_VOLUME = "tensile-hook"
HOOK_MOUNT = "/tensile"
# the pod's credential for its node agent: a service-account token for the audience `tensile` (projected, renewed by the
# kubelet, bound to the pod), never a value in the pod spec that whoever may read pods could copy
TOKEN_VOLUME = "tensile-token"
TOKEN_MOUNT = "/var/run/secrets/tensile"
TOKEN_AUDIENCE = "tensile"
TOKEN_SECONDS = 3600
DEFAULT_IMAGE = "ghcr.io/tensile/tensile:0.1.0"
JOB_LABEL = "tensile.dev/job"
CLAIM = "tensile-gpu"  # the pod's name for its job's ResourceClaim (spec.resourceClaims, resources.claims)
# The init container passes PodSecurity "restricted" (and baseline): no privilege escalation, no capabilities, a
# non-root user (the image's USER is the numeric 10001, which the kubelet can check; no runAsUser is set, so
# platforms that assign user ids, such as OpenShift, still can), the runtime's default seccomp profile, and a
# read-only root filesystem (it writes only to the shared emptyDir). Without it, no training pod was admitted in a
# namespace that enforces "restricted", and build_pod replaces any init container the user names tensile-hook.
HOOK_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


SHORT_NAME = 40  # job names up to this long name their pod and label as they are


def _fit(namespace: str, name: str, uid: str, limit: int) -> str:
    """`name` if at most `limit` characters, else its first 40 (no trailing '.'/'-', which would end an invalid
    name) and 8 hex of a hash of namespace/name/uid: cut alone, two long names sharing their start shared a pod."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(f"{namespace}/{name}/{uid}".encode()).hexdigest()[:8]
    return f"{name[:SHORT_NAME].rstrip('.-')}-{digest}"


def pod_name(namespace: str, name: str, uid: str) -> str:
    """The job's pod: deterministic per job (a restarted operator finds it), unique, a valid name. A short name
    keeps the `<name>-tensile` of earlier versions, so their running pods are still found after an upgrade."""
    return f"{_fit(namespace, name, uid, SHORT_NAME)}-tensile"


def job_label(namespace: str, name: str, uid: str) -> str:
    """The pod's JOB_LABEL value: the job's name when it fits a label value (63 characters), else cut and hashed.
    Only selected on by presence; the pod's job is its controller owner reference (`owner_of`)."""
    return _fit(namespace, name, uid, 63)


def owner_of(pod: dict) -> tuple[str, str] | None:
    """(name, uid) of the TrainingJob a training pod belongs to: its controller owner reference, and only when the
    pod has the name that job's pod gets (so a pod of another job, or someone else's, is never taken for it)."""
    meta = pod["metadata"]
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "TrainingJob" and ref.get("controller"):
            name, uid = ref.get("name", ""), ref.get("uid", "")
            return (name, uid) if name and meta.get("name") == pod_name(meta.get("namespace", ""), name, uid) else None
    return None


def job_token(key: bytes, namespace: str, name: str, uid: str) -> str:
    """The job's token for its node agent: derived, so a restarted operator gives the same one."""
    return hmac.new(key, f"{namespace}/{name}/{uid}".encode(), hashlib.sha256).hexdigest()[:32]


class JobTokens:
    """Each job's token (`job_token`), kept from the operator's first use of it until the job's agent is told it left.
    The key: `key`, else $TENSILE_TOKEN_KEY (so that a restarted operator gives a job the same token), else random."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or os.environ.get("TENSILE_TOKEN_KEY", "").encode() or secrets.token_bytes(32)
        self._tokens: dict[str, str] = {}  # namespace/name -> the job's token

    def issue(self, body: dict) -> str:
        """The TrainingJob's token, kept for its job."""
        meta = body["metadata"]
        return self.issue_for(meta["namespace"], meta["name"], meta.get("uid", ""))

    def issue_for(self, namespace: str, name: str, uid: str) -> str:
        """The token of the TrainingJob `namespace/name` with that uid, kept for its job."""
        token = job_token(self._key, namespace, name, uid)
        self._tokens[f"{namespace}/{name}"] = token
        return token

    def get(self, key: str) -> str:
        """The token kept for the job ("" when none is)."""
        return self._tokens.get(key, "")

    def forget(self, key: str) -> str:
        """The token kept for the job ("" when none is), no longer kept."""
        return self._tokens.pop(key, "")


def hook_env(job: str, gpu_uuid: str, agent: str | None, budget: int | None,
             max_swap_rate: float | None, signature: str | None, existing_path: str | None, plan_events: str,
             recompute: bool, visible_devices: bool = True, memory_cap: int | None = None,
             context_bytes: int | None = None) -> list[dict]:
    """`visible_devices`: the GPU named by environment variables (legacy mode; with a claim, the driver does it);
    `memory_cap`: the job's admitted size, its process's CUDA memory cap (TENSILE_MEMORY_CAP), of which `context_bytes`
    were counted for what the process holds outside its caching allocator (TENSILE_CONTEXT_BYTES)."""
    env = {
        "TENSILE_JOB": job,
        "TENSILE_GPU": gpu_uuid,
        **({"NVIDIA_VISIBLE_DEVICES": gpu_uuid, "CUDA_VISIBLE_DEVICES": gpu_uuid} if visible_devices else {}),
        "TENSILE_TOKEN_FILE": f"{TOKEN_MOUNT}/token",
        # the budget and rate it was admitted with, the events admission planned with (the hook's own plans and its
        # agent's keep to the same) and spec.scheduling.recompute (the hook registers with it, so the agent plans
        # without recomputes from the start)
        **knob_variables(budget, max_swap_rate, plan_events, recompute, memory_cap, context_bytes),
        "PYTHONPATH": os.pathsep.join(p for p in (f"{HOOK_MOUNT}/site", f"{HOOK_MOUNT}/lib", existing_path) if p),
    }
    if agent:
        env["TENSILE_AGENT"] = agent
    if signature:
        env["TENSILE_SIGNATURE"] = signature
    return [{"name": k, "value": v} for k, v in env.items()]


def build_pod(body: dict, node: str, gpu_uuid: str, agent: str | None, budget: int | None,
              max_swap_rate: float | None, signature: str | None, image: str = DEFAULT_IMAGE, plan_events: str = "auto",
              recompute: bool = True, claim: str | None = None, memory_cap: int | None = None,
              context_bytes: int | None = None) -> dict:
    """The pod manifest for the TrainingJob `body` placed on (node, gpu_uuid); with `claim`, its GPU is that
    ResourceClaim's (the pod names no node and no device). `memory_cap`: its process's CUDA memory cap, of which
    `context_bytes` are its context's (`hook_env`)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    template = copy.deepcopy(body["spec"].get("template") or {})
    pod_meta = template.get("metadata") or {}
    spec = template.get("spec") or {}
    labels = dict(pod_meta.get("labels") or {})
    labels[JOB_LABEL] = job_label(namespace, name, meta.get("uid", ""))
    if claim is None:
        spec["nodeName"] = node
    else:
        spec.pop("nodeName", None)
        claims = [c for c in spec.get("resourceClaims") or [] if c.get("name") != CLAIM]
        spec["resourceClaims"] = claims + [{"name": CLAIM, "resourceClaimName": claim}]
    spec.setdefault("restartPolicy", "Never")
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") not in (HOOK_VOLUME, TOKEN_VOLUME)]
    token = {"serviceAccountToken": {"audience": TOKEN_AUDIENCE, "expirationSeconds": TOKEN_SECONDS, "path": "token"}}
    spec["volumes"] = volumes + [{"name": HOOK_VOLUME, "emptyDir": {}},
                                 {"name": TOKEN_VOLUME, "projected": {"sources": [token]}}]
    mounts = [{"name": HOOK_VOLUME, "mountPath": HOOK_MOUNT, "readOnly": True},
              {"name": TOKEN_VOLUME, "mountPath": TOKEN_MOUNT, "readOnly": True}]
    job = f"{namespace}/{name}"
    for container in spec.get("containers") or []:
        existing = next((e.get("value") for e in container.get("env") or [] if e.get("name") == "PYTHONPATH"), None)
        ours = hook_env(job, gpu_uuid, agent, budget, max_swap_rate, signature, existing, plan_events, recompute,
                        visible_devices=claim is None, memory_cap=memory_cap, context_bytes=context_bytes)
        if claim is not None:
            resources = container.setdefault("resources", {})
            others = [c for c in resources.get("claims") or [] if c.get("name") != CLAIM]
            resources["claims"] = others + [{"name": CLAIM}]
        # expandable segments, merged with the container's own allocator setting, never over it (tensile.allocator)
        own = {e.get("name"): e.get("value") for e in container.get("env") or []}
        ours += [{"name": k, "value": v} for k, v in expandable_segments_setting(own).items()]
        names = {e["name"] for e in ours}
        container["env"] = [e for e in container.get("env") or [] if e.get("name") not in names] + ours
        container["volumeMounts"] = [m for m in container.get("volumeMounts") or []
                                     if m.get("name") not in (HOOK_VOLUME, TOKEN_VOLUME)] + mounts
        # a failed training's last log lines in its pod's status, where the job's end reads why (pod_state.pod_end);
        # a container that sets its own policy keeps it
        container.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    installer = {
        "name": "tensile-hook",
        "image": image,
        "command": ["python", "-m", "tensile_hook.install", HOOK_MOUNT],
        "volumeMounts": [{"name": HOOK_VOLUME, "mountPath": HOOK_MOUNT}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": copy.deepcopy(HOOK_SECURITY_CONTEXT),
    }
    spec["initContainers"] = [installer] + [c for c in spec.get("initContainers") or [] if c.get("name") != "tensile-hook"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(namespace, name, meta.get("uid", "")),
            "namespace": namespace,
            "labels": labels,
            "annotations": dict(pod_meta.get("annotations") or {}) | {"tensile.dev/gpu": gpu_uuid},
            "ownerReferences": [{
                "apiVersion": API_VERSION,
                "kind": "TrainingJob",
                "name": name,
                "uid": meta.get("uid", ""),
                "controller": True,
                "blockOwnerDeletion": True,
            }],
        },
        "spec": spec,
    }
