"""The roofline prior: what an op costs from its FLOPs, the bytes it moves and a fixed per-op cost.

It needs no measurements of the op itself, so it answers for any op on any device with a rate and a
bandwidth (a preset, or the figures `tensile calibrate` measured); the learned model corrects it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from tensile.devices import DeviceSpec
from tensile.latency.families import _numel, base_name, dtype_bytes, family_of, output_bytes
from tensile.workload import Op

# Framework time between ops on the host (Python, autograd engine, the optimizer's loop): on a CPU it
# adds to the iteration; on a GPU the host runs ahead of the device, so it is hidden.
DEFAULT_CPU_GAPS = {"forward": 15e-6, "backward": 15e-6, "optimizer": 25e-6}
DEFAULT_CPU_OVERHEAD = 4e-6
DEFAULT_CUDA_OVERHEAD = 5e-6  # kernel launch + small-kernel floor
# glibc's largest dynamic mmap threshold: a CPU allocation above it is always a fresh mmap, so the op
# that writes it first pays a page fault per 4 KiB (VGG-16's Adam sqrt on its 103M-element FC weight:
# 0.54 s measured against 0.16 s predicted without this term).
FRESH_ALLOCATION_BYTES = 32 * 1024**2


@dataclass(frozen=True, slots=True)
class Roofline:
    """A device as the prior sees it: peak-ish rates, a per-op floor, and per-phase host gaps."""

    flops_per_second: float
    bytes_per_second: float
    op_overhead: float  # seconds every op costs however small (dispatch / launch)
    gaps: dict[str, float] = field(default_factory=dict)  # phase -> seconds of host time between ops
    # phase -> factor from an op's time measured on its own to its share of a bare iteration (1 if absent)
    scales: dict[str, float] = field(default_factory=dict)
    # bytes/s at which fresh pages are first touched (CPU page faults); 0: no such cost (GPU caching allocator)
    fault_bytes_per_second: float = 0.0

    @classmethod
    def from_spec(cls, spec: DeviceSpec, kind: str) -> Roofline:
        """A preset's datasheet figures; CPU presets get host gaps, GPUs hide them."""
        if kind == "cpu":
            return cls(spec.flops_per_second, spec.memory_bandwidth, DEFAULT_CPU_OVERHEAD, dict(DEFAULT_CPU_GAPS))
        return cls(spec.flops_per_second, spec.memory_bandwidth, DEFAULT_CUDA_OVERHEAD, {})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Roofline:
        return cls(float(data["flops_per_second"]), float(data["bytes_per_second"]), float(data["op_overhead"]),
                   {str(k): float(v) for k, v in dict(data.get("gaps", {})).items()},
                   {str(k): float(v) for k, v in dict(data.get("scales", {})).items()},
                   float(data.get("fault_bytes_per_second", 0.0)))

    def alone(self) -> Roofline:
        """The same device without host gaps or in-iteration scales: an op's own time."""
        return replace(self, gaps={}, scales={})


def effective_bytes(op: Op, family: str | None = None) -> float:
    """Bytes the op really moves: views move none; an embedding reads only the rows it gathers."""
    family = family if family is not None else family_of(op)
    if family == "view":
        return 0.0
    if family == "embedding" and len(op.shapes) >= 2:
        elem = dtype_bytes(op)
        if base_name(op.name) == "embedding":
            rows, dim = _numel(op.shapes[1]), op.shapes[0][-1]
            return float(rows * dim * elem * 2 + rows * 8)
        grad = _numel(op.shapes[0])
        ints = [p for p in op.params if isinstance(p, int) and not isinstance(p, bool)]
        table = (ints[0] if ints else 0) * op.shapes[0][-1]
        return float(grad * elem * 2 + table * elem)
    return float(op.bytes_moved)


def fresh_output_bytes(op: Op, family: str | None = None) -> float:
    """Bytes of the op's new outputs big enough to be fresh mmaps, whatever its family: VGG-16's 411 MB FC
    weight gradient (an mm), GPT-2's logits and their softmax, BERT's embedding gradient."""
    return float(sum(b for b in output_bytes(op, family) if b > FRESH_ALLOCATION_BYTES))


def size_class(nbytes: float) -> int:
    """Bytes in classes a factor of 4 apart: how samples of one op are grouped by what ran around it."""
    return round(math.log2(1.0 + nbytes) / 2)


def view_key(op: Op, preceding: float) -> str:
    """A view op's price key by the size of the op before it ('view@9'); the name alone is the fallback."""
    return f"{base_name(op.name)}@{size_class(preceding)}"


def preceding_bytes(ops: Sequence[Op]) -> list[float]:
    """For each op of an iteration in order, the bytes moved by the op whose traffic it finds in the caches
    (0 for the first): for a view op, the op right before it; for any other, the last op before it that was
    no view, since views move nothing. A clone after a permute finds the caches as the op before the permute
    left them; counted as after the permute (0 bytes), the copy family's held-out median over three seeds was
    17.0%, counted past it 15.3% (one calibration's measurements, benchmarks/latency_fit_variance.py's; views
    priced past other views went 6.7 -> 9.5%)."""
    out: list[float] = []
    last = moved = 0.0
    for op in ops:
        family = family_of(op)
        out.append(last if family == "view" else moved)
        last = effective_bytes(op, family)
        if family != "view":
            moved = last
    return out


def iteration_bytes(ops: Sequence[Op]) -> float:
    """Bytes all the ops of an iteration move: how much of the caches, the TLB and the heap the rest of the
    step takes from each op. Fitted with the zoo models' steps and without this, the probes' batch-norm
    backward came out 14.6% high on validation folds (0.2% fitted without the zoo); with it as a feature,
    six families' fold medians came down in both seeds tried (docs/latency_model.md)."""
    return float(sum(effective_bytes(op) for op in ops))


def compute_seconds(op: Op, roofline: Roofline, family: str | None = None) -> float:
    """The op's own time: the slower of compute and memory traffic, plus first-touching a fresh output,
    plus the per-op floor."""
    family = family if family is not None else family_of(op)
    work = max(op.flops / roofline.flops_per_second, effective_bytes(op, family) / roofline.bytes_per_second)
    if roofline.fault_bytes_per_second > 0:
        work += fresh_output_bytes(op, family) / roofline.fault_bytes_per_second
    return work + roofline.op_overhead


def gap_seconds(op: Op, roofline: Roofline) -> float:
    """Host time the framework spends around this op that the iteration pays for."""
    return roofline.gaps.get(op.phase, 0.0)


def prior_seconds(op: Op, roofline: Roofline) -> float:
    """Roofline latency of one op as it runs inside a training iteration."""
    return compute_seconds(op, roofline) + gap_seconds(op, roofline)
