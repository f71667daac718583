"""Every Kubernetes API call the operator makes, as data.

`tensile_operator.kube.Kube` refuses any call not listed here, and Kopf's own calls (watching,
patching its handlers' progress, peering, posting its events) are listed with it. The chart's ClusterRole
(charts/tensile/templates/operator-rbac.yaml) is written by hand; tests/deploy/test_chart.py checks that it
grants exactly these rules, so the role is what the code needs.
"""

from __future__ import annotations

from tensile_operator import GROUP

# (API group, resource, verbs, why)
RULES: list[tuple[str, str, tuple[str, ...], str]] = [
    (GROUP, "trainingjobs", ("get", "list", "watch", "patch"), "the jobs it admits; Kopf's finalizer and progress annotations"),
    (GROUP, "trainingjobs/status", ("get", "patch"), "phase, conditions, forecast, placement"),
    (GROUP, "tensilenodes", ("get", "list", "watch"), "GPU inventory and committed forecasts published by node agents"),
    ("scheduling.k8s.io", "priorityclasses", ("list", "watch"), "the queue's order: PriorityClass values (listed at start-up, then watched)"),
    ("", "pods", ("get", "list", "watch", "create", "delete"), "the job's training pod, followed to completion"),
    ("resource.k8s.io", "resourceclaims", ("get", "list", "create", "delete"),
     "dra mode: each job's claim of GPU memory; everyone's allocated claims, read to place jobs"),
    ("resource.k8s.io", "resourceslices", ("list", "watch"),
     "dra mode: the GPUs, their nodes, UUIDs and memory capacity (watched: a GPU its driver withdraws is noticed)"),
    ("resource.k8s.io", "deviceclasses", ("get",), "dra mode: whether the configured DeviceClass exists"),
    ("", "events", ("create",), "a TrainingJob's lifecycle (events.py), and Kopf's handler failures, as Events"),
    ("", "namespaces", ("list", "watch"), "Kopf discovers the namespaces it serves"),
    ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"), "Kopf discovers the CRDs it serves"),
    ("kopf.dev", "clusterkopfpeerings", ("get", "list", "watch", "patch"), "one active operator (Kopf peering)"),
    ("authorization.k8s.io", "subjectaccessreviews", ("create",),
     "the webhook: whoever creates or edits a TrainingJob may create the pod the operator makes for it"),
]


def allowed(group: str, resource: str, verb: str) -> bool:
    return any(g == group and r == resource and verb in verbs for g, r, verbs, _ in RULES)

