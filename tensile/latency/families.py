"""Op families and the fixed-length features the latency model sees for each (no torch needed).

Ops with one kernel shape-to-time behaviour share a family, so one small MLP learns each family from a
few hundred measured shapes. Features follow the paper (input dims, op parameters, device utilization)
plus log FLOPs and log bytes; sizes enter as log2(1 + x) because latency scales multiplicatively.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tensile.workload import Op

FEATURE_VERSION = 10  # 3: the prior counts fresh-page faults; 4: of every family's outputs, + the preceding op,
# + measured ops; 5: a cheap op's target is the mean of a batch of repeats (measure.batched_seconds);
# 6: copies see their phase, convolutions a strided 1x1 and a oneDNN flag; op keys carry Op.runs;
# 7: every family sees the bytes its whole iteration moves; 8: op keys leave out float operands that pick no kernel;
# 9: copies see their shortest contiguous run (Op.runs); 10: an op after views sees the bytes of the op before them

# Ops that only make a new view or an uninitialised allocation: no data moves, cost is dispatch.
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "detach", "alias", "slice", "select",
    "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "as_strided", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "_reshape_alias", "unfold", "narrow", "chunk",
    "lift_fresh", "view_as", "expand_as", "_local_scalar_dense", "resize_", "set_",
})

_OPS: dict[str, tuple[str, ...]] = {
    "conv": ("convolution", "convolution_backward", "_convolution", "mkldnn_convolution", "cudnn_convolution"),
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm"),
    "norm": (
        "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training", "native_layer_norm",
        "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
        "batch_norm_backward", "cudnn_batch_norm", "cudnn_batch_norm_backward",
    ),
    "pool": (
        "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward",
        "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "adaptive_max_pool2d",
        "adaptive_max_pool2d_backward", "max_pool3d_with_indices", "avg_pool3d",
    ),
    "softmax": ("_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data"),
    "embedding": ("embedding", "embedding_dense_backward", "embedding_backward"),
    "copy": (
        "copy_", "_to_copy", "clone", "cat", "stack", "constant_pad_nd", "contiguous", "slice_backward",
        "select_backward", "index_select", "gather", "repeat",
    ),
    "elementwise": (
        "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "relu", "relu_", "threshold_backward",
        "gelu", "gelu_backward", "tanh", "tanh_backward", "sigmoid", "sigmoid_backward", "silu", "silu_backward",
        "pow", "sqrt", "rsqrt", "exp", "log", "neg", "where", "bernoulli_", "native_dropout",
        "native_dropout_backward", "fill_", "zero_", "zeros", "zeros_like", "ones_like", "full", "fill", "le",
        "lt", "ge", "gt", "eq", "ne", "masked_fill", "masked_fill_", "clamp", "clamp_min", "hardtanh",
        "hardtanh_backward", "sum", "mean", "amax", "max", "var_mean", "addcmul", "addcdiv", "lerp", "abs",
        "sign", "reciprocal", "erf", "maximum", "minimum", "scalar_tensor", "arange",
    ),
}
# The optimizer's per-parameter ops are elementwise kernels, but they run inside a Python loop on small
# tensors, so they get their own family (with the foreach kernels that replace the loop on CUDA).
_OPTIMIZER_OPS = (
    "add", "add_", "mul", "mul_", "lerp_", "addcmul_", "addcdiv_", "sqrt", "div", "div_", "sub", "sub_",
    "maximum", "copy_", "neg", "clone", "zero_", "foreach_other",
)
FAMILIES = (*_OPS, "optimizer")
_FAMILY_OF = {base: family for family, bases in _OPS.items() for base in bases}


def base_name(name: str) -> str:
    """'aten.convolution_backward.default' -> 'convolution_backward'."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]


def family_of(op: Op) -> str | None:
    """The family an op is predicted by; 'view' for metadata-only ops; None: the roofline prior alone."""
    base = base_name(op.name)
    if base in VIEW_OPS:
        return "view"
    if base.startswith("_foreach_") or (op.phase == "optimizer" and base in _OPTIMIZER_OPS):
        return "optimizer"
    return _FAMILY_OF.get(base)


def _lg(x: float) -> float:
    return math.log2(1.0 + max(float(x), 0.0))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _dims(shape: Sequence[int], count: int) -> list[float]:
    """The last `count` dims (left-padded with 1s, leading extras folded into the first), as logs."""
    dims = [int(d) for d in shape]
    if len(dims) > count:
        dims = [_numel(dims[: len(dims) - count + 1]), *dims[len(dims) - count + 1:]]
    dims = [1] * (count - len(dims)) + dims
    return [_lg(d) for d in dims]


def _one_hot(value: str, choices: Sequence[str]) -> list[float]:
    return [1.0 if value == c else 0.0 for c in choices]


_DTYPE_BYTES = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "bool": 1,
                "uint8": 1, "int8": 1}


def dtype_bytes(op: Op) -> int:
    return _DTYPE_BYTES.get(op.dtypes[0], 4) if op.dtypes else 4


def _ints(params: Sequence) -> list[int]:
    return [int(p) for p in params if isinstance(p, int) and not isinstance(p, bool)]


def conv_geometry(op: Op) -> dict[str, float]:
    """Input, weight, stride, padding, groups of a convolution (fwd or bwd) from its flattened args."""
    backward = base_name(op.name) == "convolution_backward"
    shapes = op.shapes
    x, w = (shapes[1], shapes[2]) if backward else (shapes[0], shapes[1])
    rank = max(len(x) - 2, 1)
    params = list(op.params)
    t = next((i for i, p in enumerate(params) if isinstance(p, bool)), None)
    stride = padding = dilation = [1] * rank
    groups, mask = 1, [1.0, 1.0, 1.0]
    if t is not None and t >= 3 * rank:
        stride = params[t - 3 * rank: t - 2 * rank]
        padding = params[t - 2 * rank: t - rank]
        dilation = params[t - rank: t]
        if t + 1 + rank < len(params):
            groups = int(params[t + 1 + rank] or 1)
        if backward:
            mask = [float(bool(p)) for p in params[t + 2 + rank: t + 5 + rank]] or mask
    spatial = list(x[2:]) or [1]
    kernel = list(w[2:]) or [1]
    return {
        "n": x[0], "cin": x[1] if len(x) > 1 else 1, "h": spatial[0], "w": _numel(spatial[1:]) if len(spatial) > 1 else 1,
        "cout": w[0], "kh": kernel[0], "kw": _numel(kernel[1:]) if len(kernel) > 1 else 1,
        "stride": sum(int(s or 1) for s in stride) / len(stride), "padding": sum(int(p or 0) for p in padding) / len(padding),
        "dilation": sum(int(d or 1) for d in dilation) / len(dilation), "groups": groups,
        "backward": float(backward), "mask_in": mask[0], "mask_w": mask[1] if len(mask) > 1 else 1.0,
        "mask_b": mask[2] if len(mask) > 2 else 0.0,
        # per spatial dim (first, then the last) for output sizes: Inception pads a 1x7 kernel (0, 3)
        "stride_h": int(stride[0] or 1), "stride_w": int(stride[-1] or 1), "pad_h": int(padding[0] or 0),
        "pad_w": int(padding[-1] or 0), "dil_h": int(dilation[0] or 1), "dil_w": int(dilation[-1] or 1),
    }


def conv_output(g: dict[str, float]) -> tuple[int, int]:
    """Output height and width of a convolution from its geometry."""
    def out(size: float, k: float, stride: float, pad: float, dilation: float) -> int:
        return max(int((size + 2 * pad - dilation * (k - 1) - 1) // max(stride, 1)) + 1, 1)

    return (out(g["h"], g["kh"], g["stride_h"], g["pad_h"], g["dil_h"]),
            out(g["w"], g["kw"], g["stride_w"], g["pad_w"], g["dil_w"]))


def _conv(op: Op) -> list[float]:
    """Geometry, plus the implicit GEMM a CPU / GPU convolution runs: M = n*out pixels, K = cin/g*kernel,
    N = cout/g, and the tensor sizes (input, weight, output) that set its memory traffic."""
    g = conv_geometry(op)
    groups = max(int(g["groups"]), 1)
    oh, ow = conv_output(g)
    cin_g, cout_g = g["cin"] / groups, g["cout"] / groups
    gemm_m, gemm_k = g["n"] * oh * ow, cin_g * g["kh"] * g["kw"]
    x_numel = g["n"] * g["cin"] * g["h"] * g["w"]
    w_numel = g["cout"] * cin_g * g["kh"] * g["kw"]
    y_numel = g["n"] * g["cout"] * oh * ow
    return [_lg(g["n"]), _lg(g["cin"]), _lg(g["h"]), _lg(g["w"]), _lg(g["cout"]), _lg(g["kh"]), _lg(g["kw"]),
            g["stride"], g["padding"], g["dilation"], _lg(groups), float(groups == g["cin"] and groups > 1),
            g["backward"], g["mask_in"], g["mask_w"], g["mask_b"],
            _lg(oh), _lg(ow), _lg(cin_g), _lg(cout_g), _lg(gemm_m), _lg(gemm_k), _lg(x_numel), _lg(w_numel),
            _lg(y_numel), float(g["kh"] * g["kw"] == 1), float(g["kh"] != g["kw"]),
            float(int(g["cin"]) % 16 == 0), float(int(g["cout"]) % 16 == 0),
            # a strided 1x1 convolution skips pixels: on this CPU 60-90 us more than one of the subsampled input
            float(g["kh"] * g["kw"] == 1 and g["stride"] > 1), float(runs_onednn(g))]


def runs_onednn(g: dict[str, float]) -> bool:
    """Whether PyTorch (2.x, one CPU thread, float32) runs this convolution with oneDNN rather than its own
    im2col + GEMM kernel (ATen's use_mkldnn): a switch in cost the smooth size features do not show.
    Single-image convolutions flip at 20480 input elements; an unstrided 1x1 stays on the GEMM path."""
    pointwise = g["kh"] == 1 and g["kw"] == 1
    if not (g["stride"] > 1 or g["dilation"] > 1 or g["n"] >= 16 or not pointwise):
        return False
    return (g["groups"] > 1 or (g["kh"] > 3 and g["kw"] > 3) or g["n"] > 1
            or g["n"] * g["cin"] * g["h"] * g["w"] > 20480)


def _matmul(op: Op) -> list[float]:
    base = base_name(op.name)
    mats = [s for s in op.shapes if len(s) >= 2]
    a, b = (mats + [(1, 1), (1, 1)])[:2]
    batch = _numel(a[:-2]) if len(a) > 2 else 1
    m, k, n = a[-2], a[-1], b[-1]
    return [_lg(batch), _lg(m), _lg(k), _lg(n), float(len(op.shapes) > len(mats) or base in ("addmm", "baddbmm")),
            *_one_hot(base, ("mm", "addmm", "bmm", "baddbmm"))]


_NORM = ("native_batch_norm", "native_batch_norm_backward", "native_layer_norm", "native_layer_norm_backward")


def _norm(op: Op) -> list[float]:
    base = base_name(op.name)
    backward = base.endswith("backward")
    x = op.shapes[1] if backward and len(op.shapes) > 1 else (op.shapes[0] if op.shapes else ())
    if "layer_norm" in base:
        inner = _numel(op.shapes[-1]) if len(op.shapes) > 1 else (x[-1] if x else 1)
        channels, rows = inner, _numel(x) // max(inner, 1)
    else:
        channels, rows = (x[1] if len(x) > 1 else 1), _numel(x) // max(x[1] if len(x) > 1 else 1, 1)
    training = float(next((p for p in op.params if isinstance(p, bool)), True))
    return [_lg(_numel(x)), _lg(channels), _lg(rows), _lg(x[0] if x else 1), training, float(backward),
            *_one_hot(base, _NORM)]


_POOL = ("max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward",
         "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward")


def _pool(op: Op) -> list[float]:
    base = base_name(op.name)
    backward = base.endswith("backward")
    x = op.shapes[1] if backward and len(op.shapes) > 1 else op.shapes[0]
    out = op.shapes[0] if backward else ()
    ints = _ints(op.params)
    kernel = ints[0] if ints else 1
    stride = ints[2] if len(ints) > 2 else kernel
    if "adaptive" in base:
        kernel = max(x[-1] // max(ints[-1] if ints else 1, 1), 1)
        stride = kernel
    return [*_dims(x, 4), _lg(_numel(out)), _lg(kernel), _lg(stride), float(backward), *_one_hot(base, _POOL)]


_SOFTMAX = ("_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data")


def _softmax(op: Op) -> list[float]:
    x = op.shapes[0]
    dim = next((p for p in op.params if isinstance(p, int) and not isinstance(p, bool)), -1)
    row = x[dim] if x and -len(x) <= dim < len(x) else 1
    return [_lg(_numel(x)), _lg(row), _lg(_numel(x) // max(row, 1)), float(dim in (-1, len(x) - 1)),
            *_one_hot(base_name(op.name), _SOFTMAX)]


def _embedding(op: Op) -> list[float]:
    base = base_name(op.name)
    backward = base != "embedding"
    if backward:
        grad, indices = op.shapes[0], op.shapes[1]
        ints = _ints(op.params)
        rows, dim = (ints[0] if ints else 1), grad[-1]
    else:
        weight, indices = op.shapes[0], op.shapes[1]
        rows, dim = weight[0], weight[-1]
    return [_lg(rows), _lg(dim), _lg(_numel(indices)), float(backward)]


_COPY = ("copy_", "_to_copy", "clone", "cat", "stack", "constant_pad_nd", "slice_backward", "index_select", "gather")


def _copy(op: Op) -> list[float]:
    """Sizes, dtype, name, the shortest contiguous run it reads (Op.runs; its size when every argument is
    contiguous: a clone of a (2, 8, 158, 20) tensor whose last dim was transposed reads single elements and
    took 3x the time the same features without it predicted), and whether it runs in the forward pass: there
    its output is an activation kept for backward, so the heap grows and the output's pages are new
    (attention's 26K-element head-merging clone took 22-29 us forward; one of the same size in backward, into
    memory just freed, 9 us)."""
    base = base_name(op.name)
    sizes = [_numel(s) for s in op.shapes] or [0]
    run = min(op.runs) if op.runs else max(sizes)
    return [_lg(sum(sizes)), _lg(max(sizes)), _lg(len(op.shapes)), _lg(dtype_bytes(op)),
            float(len(set(op.dtypes)) > 1), _lg(run), float(bool(op.runs)), *_one_hot(base, _COPY),
            float(op.phase == "forward")]


_ELEMENTWISE = (
    "add", "add_", "mul", "mul_", "div", "div_", "relu_", "relu", "threshold_backward", "gelu", "gelu_backward",
    "tanh", "tanh_backward", "pow", "sqrt", "where", "bernoulli_", "sum", "mean", "ones_like", "zeros",
    "native_dropout", "sigmoid", "silu", "le", "sub", "fill_", "zero_",
)


def _elementwise(op: Op) -> list[float]:
    base = base_name(op.name)
    sizes = [_numel(s) for s in op.shapes] or [1]
    largest = max(sizes)
    return [_lg(largest), _lg(min(sizes)), _lg(sum(sizes)), float(len(op.shapes)), float(base.endswith("_")),
            float(len(set(sizes)) > 1), _lg(dtype_bytes(op)), *_one_hot(base, _ELEMENTWISE),
            float(base not in _ELEMENTWISE)]


def _optimizer(op: Op) -> list[float]:
    base = base_name(op.name)
    foreach = base.startswith("_foreach_")
    key = base.removeprefix("_foreach_") if foreach else base
    if foreach and key not in _OPTIMIZER_OPS:
        key = "foreach_other"
    sizes = [_numel(s) for s in op.shapes] or [1]
    return [_lg(sum(sizes)), _lg(max(sizes)), _lg(len(sizes)), float(foreach), *_one_hot(key, _OPTIMIZER_OPS)]


_REDUCTIONS = frozenset({"sum", "mean", "amax", "max", "var_mean", "_local_scalar_dense"})
_PREDICATES = frozenset({"le", "lt", "ge", "gt", "eq", "ne"})


def output_bytes(op: Op, family: str | None = None) -> list[float]:
    """Bytes of each new tensor the op allocates, from its argument shapes (none for in-place ops,
    views and reductions): what the CPU allocator must find fresh pages for."""
    family = family if family is not None else family_of(op)
    base = base_name(op.name)
    if family in (None, "view") or base.endswith("_") or base.startswith("_foreach_") or base in _REDUCTIONS \
            or not op.shapes:
        return []
    elem = _DTYPE_BYTES.get(op.dtypes[-1], 4) if base == "where" and op.dtypes else dtype_bytes(op)  # bool condition first
    try:
        numels = _output_numels(op, family, base)
    except (IndexError, TypeError, ValueError, ZeroDivisionError):
        return []
    return [float(n * (1 if base in _PREDICATES else elem)) for n in numels]


def _output_numels(op: Op, family: str, base: str) -> list[int]:
    shapes = op.shapes
    if family == "conv":
        g = conv_geometry(op)
        if g["backward"]:  # grad_input, grad_weight (grad_bias is small)
            x_numel = g["n"] * g["cin"] * g["h"] * g["w"]
            w_numel = g["cout"] * g["cin"] / max(int(g["groups"]), 1) * g["kh"] * g["kw"]
            return [int(x_numel * g["mask_in"]), int(w_numel * g["mask_w"])]
        oh, ow = conv_output(g)
        return [int(g["n"] * g["cout"] * oh * ow)]
    if family == "matmul":
        mats = [s for s in shapes if len(s) >= 2]
        a, b = mats[-2], mats[-1]
        return [_numel(a[:-1]) * b[-1]]
    if family == "embedding":
        dim = shapes[0][-1]
        if base == "embedding":
            return [_numel(shapes[1]) * dim]
        ints = _ints(op.params)
        return [(ints[0] if ints else 0) * dim]
    if family == "pool":  # the backward's grad_input; a forward's output is smaller than its input
        return [_numel(shapes[1])] if base.endswith("backward") and len(shapes) > 1 else []
    if family == "norm":
        x = shapes[1] if base.endswith("backward") and len(shapes) > 1 else shapes[0]
        return [_numel(x)]
    if family == "copy" and base in ("cat", "stack"):
        return [sum(_numel(s) for s in shapes)]
    if family == "copy" and base in ("slice_backward", "select_backward"):  # params lead with the full size
        return [_numel(_ints(op.params)[: len(shapes[0]) + (base == "select_backward")])]
    return [_numel(_broadcast(shapes))]  # softmax, elementwise, copy, optimizer


def _broadcast(shapes: Sequence[Sequence[int]]) -> list[int]:
    """The shape operands broadcast to (an elementwise op's output)."""
    rank = max(len(s) for s in shapes)
    return [max((int(s[len(s) - rank + i]) for s in shapes if len(s) - rank + i >= 0), default=1) for i in range(rank)]


FEATURES: dict[str, Callable[[Op], list[float]]] = {
    "conv": _conv, "matmul": _matmul, "norm": _norm, "pool": _pool, "softmax": _softmax,
    "embedding": _embedding, "copy": _copy, "elementwise": _elementwise, "optimizer": _optimizer,
}
assert set(FEATURES) == set(FAMILIES)


def features(op: Op, family: str, utilization: float = 0.0, preceding_bytes: float = 0.0,
             iteration_bytes: float = 0.0) -> list[float]:
    """The family's feature vector: its own dims and params, then log FLOPs, log bytes, log bytes the op
    before it moved (a big op evicts the caches a small one then refills: on this CPU an optimizer sqrt
    measured 21 us after a slow op and 5.5 us after a fast one), log bytes its whole iteration moves (the
    same op runs slower inside a big model than in a small one), utilization."""
    try:
        own = FEATURES[family](op)
    except (IndexError, TypeError, ValueError, ZeroDivisionError):
        own = [0.0] * feature_count(family, own_only=True)
    return [*own, _lg(op.flops), _lg(op.bytes_moved), _lg(preceding_bytes), _lg(iteration_bytes), float(utilization)]


_COUNTS: dict[str, int] = {}


def feature_count(family: str, own_only: bool = False) -> int:
    """Length of a family's feature vector (measured once on a representative op)."""
    if family not in _COUNTS:
        samples = {
            "conv": Op(0, "aten.convolution.default", "forward", (), (), shapes=((1, 3, 8, 8), (4, 3, 3, 3)),
                       params=(None, 1, 1, 0, 0, 1, 1, False, 0, 0, 1)),
            "matmul": Op(0, "aten.mm.default", "forward", (), (), shapes=((2, 3), (3, 4))),
            "norm": Op(0, "aten.native_layer_norm.default", "forward", (), (), shapes=((2, 4), (4,), (4,))),
            "pool": Op(0, "aten.avg_pool2d.default", "forward", (), (), shapes=((1, 2, 4, 4),), params=(2, 2)),
            "softmax": Op(0, "aten._softmax.default", "forward", (), (), shapes=((2, 4),), params=(-1, False)),
            "embedding": Op(0, "aten.embedding.default", "forward", (), (), shapes=((10, 4), (2,))),
            "copy": Op(0, "aten.clone.default", "forward", (), (), shapes=((2, 4),), dtypes=("float32",)),
            "elementwise": Op(0, "aten.add.Tensor", "forward", (), (), shapes=((2, 4),), dtypes=("float32",)),
            "optimizer": Op(0, "aten.add_.Tensor", "optimizer", (), (), shapes=((2, 4),)),
        }
        _COUNTS[family] = len(FEATURES[family](samples[family]))
    return _COUNTS[family] if own_only else _COUNTS[family] + 5
