"""What a training pod's status says for its job: whether it holds its GPU, has started or cannot start, how it
ended."""

from __future__ import annotations

from tensile import trainingjob_spec as model
from tensile.failure import last_line, outgrew_cap
from tensile.knobs import MEMORY_CAP
from tensile_operator.placement import Booking
from tensile_operator.pods import owner_of

# waiting reasons of a container that is starting as it should; any other (ImagePullBackOff, ErrImagePull,
# CreateContainerConfigError, ...) is a problem the job shows
STARTING = ("ContainerCreating", "PodInitializing")


def pod_holder(pod: dict) -> str:
    """namespace/name of the TrainingJob a pod holds a GPU for ("" when it is not a training pod or has ended)."""
    owner = owner_of(pod)
    if owner is None or (pod.get("status") or {}).get("phase") in model.FINISHED:
        return ""
    return f"{pod['metadata']['namespace']}/{owner[0]}"


def had_pod(status: dict) -> bool:
    """Whether a job's status says its pod ran (`podName` is written with phase Running and PodRunning=True)."""
    return bool(status.get("podName")) or any(c.get("type") == "PodRunning" and c.get("status") == "True"
                                              for c in status.get("conditions") or [])


def waiting(pod: dict) -> tuple[str, str] | None:
    """(reason, message) of the first container (init containers first) Kubernetes cannot start; None when none."""
    status = pod.get("status") or {}
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        state = (container.get("state") or {}).get("waiting") or {}
        if state.get("reason") and state["reason"] not in STARTING:
            return state["reason"], f"container {container.get('name')}: {state.get('message') or state['reason']}"
    return None


def pinned_elsewhere(pod: dict, booking: Booking) -> bool:
    """Whether a pod of the job is pinned to another node or GPU than its booking (`nodeName`, `TENSILE_GPU`)."""
    spec = pod.get("spec") or {}
    gpus = {e.get("value") for c in spec.get("containers") or [] for e in c.get("env") or []
            if e.get("name") == "TENSILE_GPU"}
    # a pod with a claim is bound by the scheduler, to its claim's node
    node = spec.get("nodeName") or (booking.node if spec.get("resourceClaims") else None)
    return node != booking.node or gpus != {booking.gpu}


def unschedulable(pod: dict) -> str | None:
    """The scheduler's message for an unbound pod it cannot place (PodScheduled False, Unschedulable: for a pod with
    a claim, the claim cannot be allocated); None when it is not said to be."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if (cond.get("type"), cond.get("status"), cond.get("reason")) == ("PodScheduled", "False", "Unschedulable"):
            return str(cond.get("message") or "unschedulable")
    return None


def started(pod: dict) -> bool:
    """Whether a pod has left Pending or started any of its containers (init containers too): only a pod that has
    not is deleted to place its job again (Tensile never stops training, or a container about to train, by its own
    decision)."""
    status = pod.get("status") or {}
    if status.get("phase", "Pending") != "Pending":
        return True
    return any(c.get("started") or c.get("restartCount") or {"running", "terminated"} & (c.get("state") or {}).keys()
               or (c.get("lastState") or {}).get("terminated")
               for c in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])])


def pod_end(pod: dict) -> tuple[str, str, str]:
    """An ended pod as its job's end: phase, reason, message. An evicted pod (node pressure, a preemption) ends its
    job `Evicted` with the kubelet's message: as `PodFailed` it read as the training's own failure."""
    status = pod["status"]
    if status.get("reason") == "Evicted":
        said = f"pod {pod['metadata']['name']} was evicted: {status.get('message') or 'no message'}"
        return "Failed", "Evicted", said
    phase = status["phase"]
    if phase == "Succeeded":
        return phase, "Completed", _termination(pod)
    said = _termination(pod)
    outgrew = outgrew_cap(said, _cap(pod))
    if outgrew is not None:
        return "Failed", "OutOfMemory", outgrew
    return phase, "PodFailed", said


def _termination(pod: dict) -> str:
    """How the first ended container ended, with the last line of its termination message (the training's last log
    line, where it failed: the pods' FallbackToLogsOnError)."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated:
            said = (f"container {status.get('name')} exited with {terminated.get('exitCode')} "
                    f"({terminated.get('reason', '')})")
            last = last_line(terminated.get("message") or "")
            return f"{said}: {last}" if last else said
    return (pod.get("status") or {}).get("message") or (pod.get("status") or {}).get("phase", "")


def _cap(pod: dict) -> int | None:
    """The memory cap the pod gives its process (TENSILE_MEMORY_CAP); None where it names none it can read."""
    written = {e.get("name"): e.get("value") for c in (pod.get("spec") or {}).get("containers") or []
               for e in c.get("env") or []}
    try:
        return MEMORY_CAP.from_environment(written, None)
    except ValueError:
        return None
