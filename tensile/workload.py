"""The workload model shared by every part: one training iteration as tensors and ops (docs/concepts.md).

A *tensor* here is a device storage (views share it); its size is what the allocator hands out.
An updated parameter or optimizer state is a new tensor living in the memory of the one it `reuses`
(the paper's rule), so the planner can schedule it across the iteration boundary.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

ROLES = ("param", "input", "activation", "gradient", "optimizer_state", "temporary")
PHASES = ("forward", "backward", "optimizer")
CUDA_BLOCK_BYTES = 512


def round_allocation(nbytes: int, device: str) -> int:
    """Bytes the target device's allocator reserves for a request (CUDA caching allocator: 512 B blocks)."""
    if device == "cuda":
        return max(CUDA_BLOCK_BYTES, -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES)
    return nbytes


@dataclass(slots=True)
class TensorInfo:
    """One device storage: its allocation, its role, and when PyTorch creates and frees it."""

    id: int
    size: int
    role: str
    dtype: str
    created_by: int = -1  # op index of its generating access; -1: resident at iteration start
    freed_after: int | None = None  # op index after which PyTorch frees it; None: alive at iteration end
    reuses: int | None = None  # updated param / optimizer state: the tensor whose memory it takes over


@dataclass(slots=True)
class Op:
    """One aten op execution: its tensor accesses (TUA: inputs, TGA: outputs) and latency features."""

    index: int
    name: str
    phase: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    writes: tuple[int, ...] = ()  # inputs it mutates in place
    shapes: tuple[tuple[int, ...], ...] = ()  # shapes of its tensor arguments, in order
    dtypes: tuple[str, ...] = ()
    params: tuple = ()  # non-tensor arguments (stride, padding, groups, ...), JSON-safe
    flops: float = 0.0
    bytes_moved: int = 0
    latency: float = 0.0  # seconds, predicted or measured
    # Only when a tensor argument is not contiguous (a permuted and a contiguous copy of one shape are different
    # ops to time: the latency model's op keys include this): per tensor argument, the elements of its
    # innermost run that is contiguous in row-major order (its numel when contiguous). () when every argument
    # is contiguous, as most are.
    runs: tuple[int, ...] = ()


@dataclass(slots=True)
class Workload:
    """One training iteration of one job; it repeats."""

    model: str
    batch_size: int
    device: str  # the device the workload is modelled for: "cuda" or "cpu"
    tensors: dict[int, TensorInfo]
    ops: list[Op]
    meta: dict = field(default_factory=dict)  # optimizer, dtype, tracer backend, ...
    # the signature once computed: a workload's ops are complete when it is made (the tracer and the hook's recorder
    # build their lists first), and the node agent reads a ResNet-50's (4 ms to hash) several times a planning round
    _signature: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def resident(self) -> list[int]:
        """Tensors in device memory when an iteration starts: params, buffers, optimizer state, inputs."""
        return [t.id for t in self.tensors.values() if t.created_by < 0]

    @property
    def signature(self) -> str:
        """Content hash of (op names, shapes, dtypes): matches a forecast against what really runs."""
        if self._signature is None:
            digest = hashlib.sha256()
            for op in self.ops:
                digest.update(json.dumps([op.name, op.shapes, op.dtypes], separators=(",", ":")).encode())
            self._signature = digest.hexdigest()[:20]
        return self._signature

    @property
    def total_flops(self) -> float:
        return sum(op.flops for op in self.ops)

    def successor_of(self) -> dict[int, int]:
        """Map old tensor id -> the updated tensor that takes over its memory in this iteration."""
        return {t.reuses: t.id for t in self.tensors.values() if t.reuses is not None}
