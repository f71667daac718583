"""Small training steps whose ops cover the zoo's op families over a spread of shapes.

A probe is one block as the zoo's models use it (conv-bn-relu-pool, linear-activation-norm-dropout,
attention, embedding, classifier head with cross entropy) trained one step with an optimizer, so
forward, backward and optimizer ops appear with the arguments real models give them. Shapes are drawn
log-uniformly from ranges that span the zoo's layers; a different seed gives held-out shapes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tensile.tracer import TrainingStep

MAX_FLOPS = 6e9  # keep one probe iteration well under a second on a small CPU


@dataclass(frozen=True)
class Probe:
    kind: str  # conv | linear | attention | embedding | head | layout | norm | zoo
    config: tuple[tuple[str, object], ...]
    optimizer: str = "adam"
    foreach: bool = False

    @property
    def params(self) -> dict:
        return dict(self.config)

    def label(self) -> str:
        return f"{self.kind}(" + ", ".join(f"{k}={v}" for k, v in self.config) + ")"


def _log_uniform(rng: random.Random, low: float, high: float) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def _channels(rng: random.Random, low: int, high: int) -> int:
    c = _log_uniform(rng, low, high)
    return c if c < 16 else max(16, 8 * round(c / 8))


_KERNELS = [(1, 1)] * 8 + [(3, 3)] * 7 + [(5, 5), (7, 7), (1, 7), (7, 1), (1, 3), (3, 1)]


def _conv(rng: random.Random, scale: float, pointwise_strided: bool = False) -> dict:
    while True:
        kh, kw = rng.choice(_KERNELS)
        stride = 2 if rng.random() < 0.2 else 1
        if pointwise_strided:  # drawn first all the same, so the other kinds' shapes stay as they were
            kh, kw, stride = 1, 1, 2
        c: dict[str, Any] = {  # a probe's parameters: numbers, flags and names (Probe.params)
            "n": rng.choice((1, 1, 2, 4)), "cin": _channels(rng, 3, 1024), "cout": _channels(rng, 16, 1024),
            "h": _log_uniform(rng, 7, 224 * scale), "kh": kh, "kw": kw, "stride": stride,
            "pad": "same" if rng.random() < 0.75 else "valid", "groups": 1, "bn": rng.random() < 0.8,
            "relu": rng.random() < 0.85, "pool": rng.choice(("none", "none", "none", "max", "avg", "adaptive")),
            "cat": rng.random() < 0.15, "grad_input": rng.random() < 0.7,
        }
        out = max(c["h"] // stride, 1)
        flops = 2 * c["n"] * c["cin"] * c["cout"] * kh * kw * out * out
        if c["h"] >= max(kh, kw) and 1e5 <= flops <= MAX_FLOPS * scale and c["n"] * c["cin"] * c["h"] ** 2 * 4 < 64e6:
            return c


def _linear(rng: random.Random, scale: float) -> dict:
    while True:
        c: dict[str, Any] = {
            "n": rng.choice((1, 2, 4)), "t": rng.choice((1, 1, 32, 64, 128, 256)) if rng.random() < 0.8 else _log_uniform(rng, 1, 512),
            "din": _channels(rng, 64, 4096), "dout": _channels(rng, 16, 50000 if rng.random() < 0.25 else 4096),
            "act": rng.choice(("none", "gelu", "gelu_tanh", "relu", "tanh")), "ln": rng.random() < 0.6,
            "dropout": rng.random() < 0.5, "bias": rng.random() < 0.85,
        }
        flops = 6 * c["n"] * c["t"] * c["din"] * c["dout"]
        if flops <= 3 * MAX_FLOPS * scale and c["din"] * c["dout"] <= (110e6 if c["n"] * c["t"] <= 4 else 40e6) * scale:
            return c


def _attention(rng: random.Random, scale: float) -> dict:
    while True:
        c = {"n": rng.choice((1, 2, 4)), "heads": rng.choice((4, 8, 12, 16)), "t": _log_uniform(rng, 16, 512),
             "dh": rng.choice((32, 64, 64, 128)), "causal": rng.random() < 0.4, "dropout": rng.random() < 0.6}
        if c["n"] * c["heads"] * c["t"] ** 2 * 4 < 40e6 * scale:
            return c


def _embedding(rng: random.Random, scale: float) -> dict:
    while True:
        c = {"vocab": _log_uniform(rng, 500, 50000), "dim": _channels(rng, 64, 1024), "n": rng.choice((1, 2, 4)),
             "t": _log_uniform(rng, 8, 512)}
        if c["vocab"] * c["dim"] <= 40e6 * scale:
            return c


def _head(rng: random.Random, scale: float) -> dict:
    while True:
        c = {"n": rng.choice((1, 2, 4, 8)), "features": _channels(rng, 64, 4096), "classes": _log_uniform(rng, 10, 50000)}
        if c["features"] * c["classes"] <= 40e6 * scale:
            return c


def _strided_pointwise(rng: random.Random, scale: float) -> dict:
    """A 1x1 convolution with stride 2 (ResNet's downsampling shortcuts): PyTorch runs it with oneDNN, not
    the GEMM an unstrided 1x1 gets, and on this CPU it costs 60-90 us more than the same convolution of a
    pre-subsampled input; the random grid draws one in 26 convolutions."""
    return _conv(rng, scale, pointwise_strided=True)


_PERMUTATIONS = {  # what a copy reads: rows of the last dim (attention's heads), single elements, in order
    "heads": (0, 2, 1, 3), "transpose": (0, 1, 3, 2), "channels_last": (0, 2, 3, 1), "none": (0, 1, 2, 3),
}


def _layout(rng: random.Random, scale: float) -> dict:
    """A copy of a permuted (or, for contrast, a contiguous) tensor, forward and back: the grid's other
    copies are nearly all attention's head merges and conv blocks' concatenations."""
    while True:
        c: dict[str, Any] = {
            "dims": (rng.choice((1, 1, 2, 4)), _log_uniform(rng, 1, 64), _log_uniform(rng, 4, 1024), _log_uniform(rng, 2, 512)),
            "perm": rng.choice(("heads", "heads", "transpose", "channels_last", "none")),
        }
        if 2e3 <= math.prod(c["dims"]) <= 8e6 * scale:
            return c


def _norm(rng: random.Random, scale: float) -> dict:
    """A batch norm over a feature map or a layer norm over a sequence, alone: the grid's other norms come
    with a convolution or a linear layer, so their shapes follow those layers' (fewer distinct sizes)."""
    c: dict[str, Any]
    while True:
        if rng.random() < 0.5:
            h = _log_uniform(rng, 4, 224 * scale)
            c = {"type": "batch", "dims": (rng.choice((1, 1, 2, 4)), _channels(rng, 16, 1024), h,
                                           h if rng.random() < 0.75 else _log_uniform(rng, 4, 224 * scale))}
        else:  # (batch, features) or (batch, tokens, features)
            n, t, d = rng.choice((1, 2, 4)), rng.choice((1, _log_uniform(rng, 8, 512))), _channels(rng, 16, 4096)
            c = {"type": "layer", "dims": (n, t, d) if t > 1 else (n, d)}
        if 1e3 <= math.prod(c["dims"]) <= 16e6 * scale:
            return c


_MAKERS = {"conv": _conv, "linear": _linear, "attention": _attention, "embedding": _embedding, "head": _head,
           "conv_pointwise_s2": _strided_pointwise, "layout": _layout, "norm": _norm, "embedding_more": _embedding,
           "layout_more": _layout}
_KIND_OF = {"conv_pointwise_s2": "conv", "embedding_more": "embedding", "layout_more": "layout"}  # another block's kind
GRIDS = {  # probes of each kind; entries after "head" are drawn last, so the earlier ones stay as they were
    "default": {"conv": 150, "linear": 80, "attention": 35, "embedding": 25, "head": 25,
                "conv_pointwise_s2": 16, "layout": 30, "norm": 40, "embedding_more": 30, "layout_more": 100},
    # "layout_more": copy was the family at the edge and learns mostly from layout probes, which are cheap (40
    # measured in 2.6 s): its held-out median was 17.8% fitted on half the probes, 15.0% on all, 13.6% with these 100
    "quick": {"conv": 4, "linear": 3, "attention": 2, "embedding": 1, "head": 1, "layout": 1, "norm": 1},
    # evaluation only; "embedding_more" and "layout" came later (drawn after "head", so the first five kinds'
    # shapes are unchanged): 8 embedding probes gave a 16-op median that one op moved by a point or more,
    # and the copies calibration learns from layout probes had no held-out counterpart
    "holdout": {"conv": 50, "linear": 30, "attention": 12, "embedding": 8, "head": 8, "embedding_more": 16,
                "layout": 10},
}
# The default grid also trains each zoo model one step at these batch sizes, so the real layers (VGG's
# 103M-element FC weight, GPT-2's 50257-row LM head, grouped / 7x1 / strided convolutions, the optimizer
# on every parameter shape) are in the calibration data. Evaluation uses other batch sizes
# (EVALUATION_BATCH in benchmarks/latency_accuracy.py), so its activation shapes are never trained on.
ZOO_CALIBRATION_BATCHES = (1, 3)
ZOO_MODELS = ("vgg16", "inception_v3", "inception_v4", "resnet50", "densenet121", "bert_base", "gpt2")


def zoo_probes(batches: tuple[int, ...] = ZOO_CALIBRATION_BATCHES, models: tuple[str, ...] = ZOO_MODELS) -> list[Probe]:
    """One probe per zoo model and batch size: the model's own layers, trained one step with Adam."""
    return [Probe("zoo", (("batch", int(b)), ("model", m)), "adam", False) for m in models for b in batches]


def make_grid(grid: str = "default", seed: int = 0, device_type: str = "cpu", zoo: bool | None = None) -> list[Probe]:
    """The probes of a named grid; the quick grid uses small shapes so a run takes seconds.

    `zoo` (default: only for the "default" grid) puts the zoo models at ZOO_CALIBRATION_BATCHES first,
    so a calibration cut short by its time budget still has them.
    """
    counts = GRIDS[grid]
    scale = 0.02 if grid == "quick" else (1.0 if device_type == "cpu" else 8.0)
    rng = random.Random(f"{grid}-{seed}")
    probes = zoo_probes() if (grid == "default" if zoo is None else zoo) else []
    for kind, count in counts.items():
        for _ in range(count):
            config = _MAKERS[kind](rng, scale)
            if grid == "quick":
                config = _shrink(kind, config)
            roll = rng.random()
            optimizer = "adam" if roll < 0.6 else ("adamw" if roll < 0.8 else "momentum")
            foreach = device_type == "cuda" or rng.random() < 0.2
            probes.append(Probe(_KIND_OF.get(kind, kind), tuple(sorted(config.items())), optimizer, foreach))
    return probes


def _shrink(kind: str, c: dict) -> dict:
    """Tiny versions of the same blocks: every op family appears, each op takes microseconds."""
    c = dict(c)
    for key, cap in {"cin": 16, "cout": 16, "h": 12, "din": 64, "dout": 64, "t": 16, "vocab": 500, "dim": 64,
                     "features": 64, "classes": 100, "n": 2}.items():
        if key in c:
            c[key] = min(int(c[key]), cap)
    if kind == "conv":
        c["h"] = max(c["h"], c["kh"], c["kw"])
    return c


class _ConvBlock(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        padding = "same" if c["pad"] == "same" and c["stride"] == 1 else (0 if c["pad"] == "valid" else (c["kh"] // 2, c["kw"] // 2))
        self.conv = nn.Conv2d(c["cin"], c["cout"], (c["kh"], c["kw"]), stride=c["stride"], padding=padding,
                              groups=c["groups"], bias=not c["bn"])
        self.bn = nn.BatchNorm2d(c["cout"]) if c["bn"] else nn.Identity()
        self.relu = c["relu"]
        self.pool = c["pool"]
        self.cat = c["cat"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cat:  # densenet / inception: blocks read a concatenation of earlier outputs
            half = x.shape[1] // 2
            x = torch.cat([x[:, :half], x[:, half:]], dim=1)
        y = self.bn(self.conv(x))
        if self.relu:
            y = F.relu(y, inplace=True)
        if self.pool == "max" and y.shape[-1] >= 3 and y.shape[-2] >= 3:
            y = F.max_pool2d(y, 3, 2, 1)
        elif self.pool == "avg" and y.shape[-1] >= 3 and y.shape[-2] >= 3:
            y = F.avg_pool2d(y, 3, 1, 1)
        elif self.pool == "adaptive":
            y = F.adaptive_avg_pool2d(y, 1)
        return y


class _LinearBlock(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.linear = nn.Linear(c["din"], c["dout"], bias=c["bias"])
        self.act = c["act"]
        self.ln = nn.LayerNorm(c["dout"]) if c["ln"] else nn.Identity()
        self.dropout = nn.Dropout(0.1) if c["dropout"] else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.act == "gelu":
            y = F.gelu(y)
        elif self.act == "gelu_tanh":  # GPT-2's "new" gelu, as transformers writes it
            y = 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))
        elif self.act == "relu":
            y = F.relu(y)
        elif self.act == "tanh":
            y = torch.tanh(y)
        return self.dropout(self.ln(y))


class _Attention(nn.Module):
    """Eager attention as BERT / GPT-2 run it: matmul, scale, mask, softmax, dropout, matmul."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        self.c = c
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) * self.scale
        if self.c["causal"]:
            t = q.shape[-2]
            mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=q.device))
            scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1)
        if self.c["dropout"]:
            probs = F.dropout(probs, 0.1, training=True)
        return torch.matmul(probs, v).transpose(1, 2).contiguous()


class _LayoutBlock(nn.Module):
    """x.permute(...).contiguous() (x.clone() for "none"), scaled by a parameter: a permuted copy forward,
    and in backward the gradient's copy back into x's layout."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        self.perm = _PERMUTATIONS[c["perm"]]
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone() if self.perm == (0, 1, 2, 3) else x.permute(*self.perm).contiguous()
        return y * self.scale


class _NormBlock(nn.Module):
    """BatchNorm2d then ReLU (a CNN's), or LayerNorm then GELU (a transformer's): the activation hands the
    norm's backward a contiguous gradient, as in the zoo (a bare mean's would be a stride-0 expand)."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        self.batch = c["type"] == "batch"
        self.norm = nn.BatchNorm2d(c["dims"][1]) if self.batch else nn.LayerNorm(c["dims"][-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(x)) if self.batch else F.gelu(self.norm(x))


class _EmbeddingBlock(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.embedding = nn.Embedding(c["vocab"], c["dim"])
        self.ln = nn.LayerNorm(c["dim"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ln(self.embedding(ids))


_OPTIMIZERS = {
    "adam": lambda p, fe: torch.optim.Adam(p, lr=1e-3, foreach=fe),
    "adamw": lambda p, fe: torch.optim.AdamW(p, lr=1e-3, foreach=fe),
    "momentum": lambda p, fe: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=fe),
}


def _fresh(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Drop inputs' gradients so every iteration runs the same ops (no accumulation into .grad)."""
    for tensor in batch:
        tensor.grad = None
    return batch


def build_step(probe: Probe, device: str) -> TrainingStep:
    """The probe as a training step on `device` (inputs made once, as a data loader would)."""
    c = probe.params
    if probe.kind == "zoo":
        return _zoo_step(c["model"], c["batch"], device, probe.foreach)
    torch.manual_seed(0)
    with torch.device(device):
        if probe.kind == "conv":
            model: nn.Module = _ConvBlock(c)
            x = torch.randn(c["n"], c["cin"], c["h"], c["h"]).requires_grad_(c["grad_input"])
            batch: tuple[torch.Tensor, ...] = (x,)
            loss_fn = lambda m, b: m(_fresh(b)[0]).mean()  # noqa: E731
        elif probe.kind == "linear":
            model = _LinearBlock(c)
            shape: tuple[int, ...] = (c["n"], c["t"], c["din"]) if c["t"] > 1 else (c["n"], c["din"])
            batch = (torch.randn(*shape).requires_grad_(True),)
            loss_fn = lambda m, b: m(_fresh(b)[0]).mean()  # noqa: E731
        elif probe.kind == "attention":
            model = _Attention(c)
            shape = (c["n"], c["heads"], c["t"], c["dh"])
            batch = tuple(torch.randn(*shape).requires_grad_(True) for _ in range(3))
            loss_fn = lambda m, b: m(*_fresh(b)).mean()  # noqa: E731
        elif probe.kind in ("layout", "norm"):
            model = _LayoutBlock(c) if probe.kind == "layout" else _NormBlock(c)
            batch = (torch.randn(*c["dims"]).requires_grad_(True),)
            loss_fn = lambda m, b: m(_fresh(b)[0]).mean()  # noqa: E731
        elif probe.kind == "embedding":
            model = _EmbeddingBlock(c)
            batch = (torch.randint(0, c["vocab"], (c["n"], c["t"])),)
            loss_fn = lambda m, b: m(_fresh(b)[0]).mean()  # noqa: E731
        elif probe.kind == "head":
            model = nn.Linear(c["features"], c["classes"])
            batch = (torch.randn(c["n"], c["features"]), torch.randint(0, c["classes"], (c["n"],)))
            loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
        else:
            raise ValueError(f"unknown probe kind {probe.kind}")
    model.train()
    optimizer = _OPTIMIZERS[probe.optimizer](model.parameters(), probe.foreach)
    return TrainingStep(model, batch, loss_fn, [optimizer])


def _zoo_step(name: str, batch: int, device: str, foreach: bool) -> TrainingStep:
    """A zoo model's training step as a job runs it (Adam; foreach as the device defaults on CUDA)."""
    import warnings

    from tensile.zoo import build_zoo_parts

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, data, loss_fn, _ = build_zoo_parts(name, batch, device="meta" if device == "meta" else "cpu")
        if device not in ("meta", "cpu"):
            model = model.to(device)
            data = tuple(t.to(device) for t in data)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True if device == "cuda" else (foreach or None))
    return TrainingStep(model, data, loss_fn, [optimizer])
