"""One job's iteration on a time axis, and each tensor's memory slot with its accesses.

The planner, the plan replay of Algorithm 1 and the simulator must agree on when an op runs, how
long a transfer takes and which ops a tensor is absent for; this module is that single agreement.

A *slot* is one piece of device memory: a tensor, or for an updated parameter / optimizer state the
old tensor and the updated one that takes over its memory (the paper's rule). A *persistent* slot is
resident at iteration start and alive at its end, so it can be swapped across the iteration boundary.
Times of the next iteration are written on an unrolled axis: op k of the next iteration is k + n.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tensile.workload import Op, Workload

TRANSFER_SETUP_SECONDS = 10e-6  # per cudaMemcpyAsync, on top of size / bandwidth


def transfer_seconds(size: int, bandwidth: float) -> float:
    """Time one host <-> device copy of `size` bytes occupies its channel."""
    return TRANSFER_SETUP_SECONDS + size / bandwidth


@dataclass(slots=True)
class Slot:
    """One device allocation over the iteration, under its one or two tensor names."""

    root: int  # the tensor present at iteration start (or created in the iteration)
    size: int
    accesses: list[int]  # op indices that read, write or create it, ascending, deduplicated
    first: int  # first op it is present for (0 when resident at start)
    last: int  # last op it is present for in vanilla PyTorch
    persistent: bool
    successor: int | None = None  # the updated tensor that takes the memory over
    handover: int = -1  # op that creates the successor
    recomputable_by: int | None = None  # creating op, when it can be replayed
    names: tuple[int, ...] = field(default=())
    rewrites: tuple[int, ...] = ()  # in-place ops that write the tensor after it is made (replayed after the creator)

    def chain(self, before: int) -> tuple[int, ...]:
        """The ops a recomputation just before op `before` replays: the creator, then the in-place
        writes it has had by then (e.g. native_batch_norm, add_, relu_). Empty when not recomputable."""
        if self.recomputable_by is None:
            return ()
        return (self.recomputable_by, *(w for w in self.rewrites if w < before))

    def name_at(self, op: int) -> int:
        """The tensor name this memory carries after op `op` (an index in [0, n))."""
        if self.successor is not None and op >= self.handover:
            return self.successor
        return self.root


class Timeline:
    """Op start and end times of one iteration (op k runs [starts[k], ends[k]]), period `period`.

    `extra_after[k]` is compute inserted after op k (recomputations) before op k + 1 starts.
    """

    def __init__(self, latencies: list[float], slowdown: float = 1.0, extra_after: dict[int, float] | None = None) -> None:
        self.n = len(latencies)
        self.starts: list[float] = []
        self.ends: list[float] = []
        now = 0.0
        extra_after = extra_after or {}
        for k, latency in enumerate(latencies):
            self.starts.append(now)
            now += latency * slowdown
            self.ends.append(now)
            now += extra_after.get(k, 0.0) * slowdown
        self.period = now

    def start(self, k: int) -> float:
        """Start of op k on the unrolled axis (k in [-n, 2n))."""
        q, r = divmod(k, self.n)
        return self.starts[r] + q * self.period

    def end(self, k: int) -> float:
        q, r = divmod(k, self.n)
        return self.ends[r] + q * self.period

    def first_op_from(self, t: float) -> int:
        """Unrolled index of the first op starting at or after time t."""
        q, r = divmod(t, self.period)
        return int(q) * self.n + bisect.bisect_left(self.starts, r - 1e-12)

    def last_op_until(self, t: float) -> int:
        """Unrolled index of the last op ending at or before time t."""
        q, r = divmod(t, self.period)
        return int(q) * self.n + bisect.bisect_right(self.ends, r + 1e-12) - 1

    def absent_ops(self, gone: float, back: float) -> tuple[int, int]:
        """Unrolled op range a tensor misses: freed at `gone`, allocated again at `back`.

        An op counts only when it runs entirely inside (gone, back): memory is charged per op."""
        return self.first_op_from(gone), self.last_op_until(back)

    def trigger_of(self, t: float) -> tuple[int, float, bool]:
        """(trigger op, delay, next_iteration) for an event starting at unrolled time t in [0, 2 * period).

        The trigger is the last op that ends by t; before op 0 ends, that is the previous iteration's last op."""
        k = self.last_op_until(t)
        if k < 0:
            raise ValueError("an event before the iteration starts has no trigger")
        delay = max(0.0, t - self.end(k))
        if k >= self.n:
            return k - self.n, delay, True
        return k, delay, False


def build_slots(workload: Workload) -> dict[int, Slot]:
    """Slots by root tensor id; every tensor id maps to exactly one slot (see `slot_of`)."""
    n = len(workload.ops)
    accesses: dict[int, set[int]] = {}
    for op in workload.ops:
        for t in (*op.inputs, *op.outputs, *op.writes):
            accesses.setdefault(t, set()).add(op.index)
    written: dict[int, list[int]] = {}
    for op in workload.ops:
        for t in op.writes:
            written.setdefault(t, []).append(op.index)
    successor = workload.successor_of()
    taken_over = {t.id for t in workload.tensors.values() if t.reuses is not None}
    slots: dict[int, Slot] = {}
    for tensor in workload.tensors.values():
        if tensor.id in taken_over:
            continue
        names = [tensor.id]
        seen = set(accesses.get(tensor.id, ()))
        end_tensor = tensor
        handover = -1
        while end_tensor.id in successor:  # an old tensor handed over (possibly more than once)
            nxt = workload.tensors[successor[end_tensor.id]]
            handover = nxt.created_by
            names.append(nxt.id)
            seen |= accesses.get(nxt.id, set())
            end_tensor = nxt
        first = max(tensor.created_by, 0)
        last = n - 1 if end_tensor.freed_after is None else end_tensor.freed_after
        persistent = tensor.created_by < 0 and end_tensor.freed_after is None
        creator = _replayable_creator(workload, tensor.id, written)
        slots[tensor.id] = Slot(
            root=tensor.id,
            size=tensor.size,
            accesses=sorted(seen),
            first=first,
            last=max(last, first),
            persistent=persistent,
            successor=names[-1] if len(names) > 1 else None,
            handover=handover,
            recomputable_by=creator,
            names=tuple(names),
            rewrites=tuple(written.get(tensor.id, ())) if creator is not None else (),
        )
    return slots


def slot_of(slots: dict[int, Slot]) -> dict[int, int]:
    """Tensor id -> root id of its slot."""
    return {name: root for root, slot in slots.items() for name in slot.names}


def chain_latency(workload: Workload, chain: tuple[int, ...]) -> float:
    """Seconds (unscaled) a recomputation replaying `chain` takes."""
    return sum(workload.ops[k].latency for k in chain)


# Outputs (by index in the op's result) that PyTorch allocates uninitialized for the kernel's backward to
# read. oneDNN writes its LSTM workspace only in part: a replay reproduces the other bytes by chance, if at all
# (from 1 to 34 per cent of them changed, or none, run to run). cuDNN's and MIOpen's RNN reserves are the same
# kind of buffer, listed without that measurement (no GPU here): a swap is always safe, a recompute not.
WORKSPACES = {
    "aten.mkldnn_rnn_layer.default": 3,  # workspace
    "aten._cudnn_rnn.default": 3,  # reserve
    "aten.miopen_rnn.default": 3,  # reserve
    "aten.cudnn_batch_norm.default": 3,  # reserve, as the hook names the op it keeps recipes of (recorded: RESERVES)
}
# cuDNN's batch-norm reserve, where it is not empty: the fourth result of the native batch norm that op is recorded
# as (tensile.cuda_ops); a batch norm of three results has none
RESERVES = {"aten.native_batch_norm.default": 3}


def _is_workspace(op: Op, tensor: int) -> bool:
    """Whether `tensor` is the workspace `op` returns. The tracer lists an op's new storages in result order;
    if it listed fewer than the result has, which one is the workspace is unknown and none is replayed."""
    reserve = RESERVES.get(op.name)
    if reserve is not None:
        return len(op.outputs) > reserve and op.outputs[reserve] == tensor
    position = WORKSPACES.get(op.name)
    if position is None:
        return False
    return len(op.outputs) <= position or op.outputs[position] == tensor


def _replayable_creator(workload: Workload, tensor: int, written: dict[int, list[int]]) -> int | None:
    """The op that made `tensor`, if running it again (followed by the in-place ops that wrote the
    tensor afterwards: a *chain*) gives the same bytes, as the hook replays it.

    The creator must write nothing in place (batch norm in training is the exception: the hook
    replays it without its running statistics). Every later in-place op on the tensor must write
    that tensor and nothing else, and create nothing (relu_, add_ of a residual...); the hook
    checks the same at run time and keeps a host copy when the chain breaks. Whether the chain's
    other inputs are still resident and unchanged depends on when it is replayed: the planner
    checks that (recompute.py)."""
    info = workload.tensors[tensor]
    if info.created_by < 0 or info.reuses is not None:
        return None
    op = workload.ops[info.created_by]
    if op.name != "aten.native_batch_norm.default" and (op.writes or "batch_norm" in op.name):
        return None
    if op.phase == "optimizer" or not op.inputs or _is_workspace(op, tensor):
        return None
    for k in written.get(tensor, ()):
        rewrite = workload.ops[k]
        if (
            k <= op.index
            or rewrite.writes != (tensor,)
            or rewrite.outputs
            or rewrite.phase == "optimizer"
            or "batch_norm" in rewrite.name
            or "_foreach_" in rewrite.name
        ):
            return None
    return op.index
