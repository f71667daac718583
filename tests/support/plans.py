"""Plans made by hand for the hook's tests: each moves a known set of tensors at known ops, so a test knows what the
hook must have done."""

from __future__ import annotations

from collections.abc import Iterator

from tensile.plan import Event, Plan
from tensile.workload import TensorInfo, Workload

MADE_BY = ("aten.convolution.default", "aten.native_batch_norm.default")  # what `feature_recomputes` recomputes


def first_uses(workload: Workload) -> dict[int, list[int]]:
    uses: dict[int, list[int]] = {}
    for op in workload.ops:
        for t in op.inputs:
            uses.setdefault(t, []).append(op.index)
    return uses


def aggressive_plan(workload: Workload, budget: int | None = None) -> Plan:
    """Every activation swapped or recomputed across the forward/backward gap; every updated
    parameter and optimizer state swapped out after its update and back before its next use."""
    uses = first_uses(workload)
    events: list[Event] = []
    for tensor in workload.tensors.values():
        accesses = uses.get(tensor.id, [])
        if tensor.role == "activation" and tensor.created_by >= 0:
            forward = [i for i in accesses if workload.ops[i].phase == "forward"]
            backward = [i for i in accesses if workload.ops[i].phase != "forward"]
            if not backward:
                continue
            last_forward = max(forward, default=tensor.created_by)
            producer = workload.ops[tensor.created_by]
            kind = "release" if not producer.writes and tensor.id % 2 == 0 else "swap_out"
            events.append(Event("job", kind, tensor.id, last_forward))
            events.append(Event("job", "recompute" if kind == "release" else "swap_in", tensor.id, backward[0] - 1))
        elif tensor.reuses is not None:
            old_uses = [i for i in uses.get(tensor.reuses, []) if i < tensor.created_by]
            events.append(Event("job", "swap_out", tensor.id, max([tensor.created_by, *uses.get(tensor.id, [])])))
            if old_uses:
                events.append(Event("job", "swap_in", tensor.id, max(0, old_uses[0] - 1), next_iteration=True))
    return Plan("job", 1, workload.signature, events)


def feature_activations(workload: Workload) -> Iterator[tuple[TensorInfo, int, int]]:
    """Every activation of the feature extractor (read in backward, last read in forward before the classifier's
    matmul; batch norm's per-channel statistics are too small to move), with its last forward read and first
    backward read."""
    uses = first_uses(workload)
    head = max(op.index for op in workload.ops if op.phase == "forward" and op.name == "aten.addmm.default")
    for tensor in workload.tensors.values():
        accesses = uses.get(tensor.id, [])
        forward = [i for i in accesses if workload.ops[i].phase == "forward"]
        backward = [i for i in accesses if workload.ops[i].phase == "backward"]
        if tensor.role == "activation" and tensor.created_by >= 0 and backward and tensor.size >= 1024 \
                and (last := max(forward, default=tensor.created_by)) < head:
            yield tensor, last, backward[0]


def feature_swaps(workload: Workload, budget: int | None = None) -> Plan:
    """Every activation of the feature extractor swapped out after its last forward read and back before its first
    backward read."""
    events = []
    for tensor, last, first in feature_activations(workload):
        events += [Event("job", "swap_out", tensor.id, last), Event("job", "swap_in", tensor.id, first - 1)]
    return Plan("job", 1, workload.signature, events)


def feature_recomputes(workload: Workload, budget: int | None = None, swap_the_rest: bool = False) -> Plan:
    """Every activation of the feature extractor that a convolution or a batch norm made (after which an in-place
    ReLU may write it) released after its last forward read and recomputed before its first backward read; with
    `swap_the_rest`, the others swapped as `feature_swaps` does."""
    events = []
    for tensor, last, first in feature_activations(workload):
        if workload.ops[tensor.created_by].name in MADE_BY:
            events += [Event("job", "release", tensor.id, last), Event("job", "recompute", tensor.id, first - 1)]
        elif swap_the_rest:
            events += [Event("job", "swap_out", tensor.id, last), Event("job", "swap_in", tensor.id, first - 1)]
    return Plan("job", 1, workload.signature, events)


def every_recompute(workload: Workload, budget: int | None = None) -> Plan:
    """Every activation of the feature extractor released and recomputed, whatever made it."""
    events = []
    for tensor, last, first in feature_activations(workload):
        events += [Event("job", "release", tensor.id, last), Event("job", "recompute", tensor.id, first - 1)]
    return Plan("job", 1, workload.signature, events)


def pooled_swaps(workload: Workload, budget: int | None = None) -> Plan:
    """For the native path: every activation of 1 KiB or more that backward reads, swapped out
    after its last forward read and back before its first backward read, when that last forward
    read comes before the iteration's first max pooling (so a module call follows it). Unlike
    `feature_swaps` (up to the last linear head) a validation pass after the step, recorded in the
    same iteration, does not draw the training head's input in."""
    uses = first_uses(workload)
    pools = [op.index for op in workload.ops if op.phase == "forward" and op.name.startswith("aten.max_pool2d")]
    events = []
    for tensor in workload.tensors.values():
        accesses = uses.get(tensor.id, [])
        forward = [i for i in accesses if workload.ops[i].phase == "forward"]
        backward = [i for i in accesses if workload.ops[i].phase == "backward"]
        if tensor.role != "activation" or tensor.created_by < 0 or not backward or tensor.size < 1024 or not pools:
            continue
        if max(forward, default=tensor.created_by) < pools[0]:
            events.append(Event("job", "swap_out", tensor.id, max(forward, default=tensor.created_by)))
            events.append(Event("job", "swap_in", tensor.id, backward[0] - 1))
    return Plan("job", 1, workload.signature, events)
