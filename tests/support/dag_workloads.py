"""Random small training-iteration workloads (forward DAG, mirrored backward, optimizer updates) for invariant tests."""

from __future__ import annotations

import random

from tensile.workload import Op, TensorInfo, Workload


class _Builder:
    """Tensors and ops of a hand-made workload, numbered in the order they are made; an op's latency is
    drawn from `latency_range` unless given."""

    def __init__(self, rng: random.Random, latency_range: tuple[float, float]) -> None:
        self.rng = rng
        self.latency_range = latency_range
        self.tensors: dict[int, TensorInfo] = {}
        self.ops: list[Op] = []

    def tensor(self, size: int, role: str, created_by: int) -> int:
        tid = len(self.tensors)
        self.tensors[tid] = TensorInfo(tid, size, role, "float32", created_by)
        return tid

    def op(self, name: str, phase: str, inputs: tuple[int, ...], outputs: tuple[int, ...], writes: tuple[int, ...] = (),
           latency: float | None = None) -> int:
        index = len(self.ops)
        self.ops.append(Op(index, name, phase, inputs, outputs, writes,
                           latency=latency or self.rng.uniform(*self.latency_range), flops=1e9))
        return index


def random_workload(seed: int, layers: int = 12) -> Workload:
    """A random DAG network: params and an optimizer state per layer updated across the iteration boundary."""
    rng = random.Random(seed)
    build = _Builder(rng, (0.2e-3, 2e-3))
    tensors, ops, tensor, op = build.tensors, build.ops, build.tensor, build.op

    x = tensor(rng.randrange(1, 8) << 20, "input", -1)
    params = [tensor(rng.randrange(1, 16) << 20, "param", -1) for _ in range(layers)]
    states = [tensor(tensors[p].size, "optimizer_state", -1) for p in params]
    acts = [x]
    for layer in range(layers):
        inputs = tuple(rng.sample(acts, min(len(acts), rng.choice((1, 1, 2)))))
        out = tensor(rng.randrange(2, 64) << 20, "activation", len(ops))
        op("aten.convolution.default" if rng.random() < 0.6 else "aten.add.Tensor", "forward", (*inputs, params[layer]), (out,))
        acts.append(out)
    loss = tensor(512, "activation", len(ops))
    op("aten.sum.default", "forward", (acts[-1],), (loss,))
    grads = []
    for layer in reversed(range(layers)):
        forward = ops[layer]
        temp = tensor(rng.randrange(1, 32) << 20, "temporary", len(ops))
        grad = tensor(tensors[params[layer]].size, "gradient", len(ops))
        op("aten.convolution_backward.default", "backward", forward.inputs, (temp, grad))
        grads.append((layer, grad))
    for layer, grad in grads:
        new_state = tensor(tensors[states[layer]].size, "optimizer_state", len(ops))
        tensors[new_state].reuses = states[layer]
        op("aten.lerp_.Scalar", "optimizer", (states[layer], grad), (new_state,), (states[layer],))
        new_param = tensor(tensors[params[layer]].size, "param", len(ops))
        tensors[new_param].reuses = params[layer]
        op("aten.addcdiv_.default", "optimizer", (params[layer], new_state), (new_param,), (params[layer],))
    last_use: dict[int, int] = {}
    for o in ops:
        for t in (*o.inputs, *o.outputs):
            last_use[t] = o.index
    for t in tensors.values():
        if t.role in ("activation", "temporary"):
            t.freed_after = last_use[t.id]
        elif t.role == "gradient":
            t.freed_after = None if rng.random() < 0.5 else last_use[t.id]
        elif t.created_by < 0 and t.role != "input":
            t.freed_after = next(o.index for o in ops if t.id in o.writes)
    return Workload(f"random{seed}", 1, "cuda", tensors, ops)


def chain_workload(seed: int, blocks: int = 10) -> Workload:
    """Conv -> batch norm -> (add_ residual) -> relu_ blocks, as traced from PyTorch: the batch norm output
    is written in place after it is made, so it can only be recomputed as a chain."""
    rng = random.Random(seed)
    build = _Builder(rng, (0.5e-3, 2e-3))
    tensors, ops, tensor, op = build.tensors, build.ops, build.tensor, build.op

    x = tensor(4 << 20, "input", -1)
    params = [tensor(rng.randrange(1, 4) << 20, "param", -1) for _ in range(blocks)]
    saved: list[tuple[int, int, int, int]] = []  # (block input, conv out, bn out, param)
    act = x
    for b in range(blocks):
        size = rng.randrange(8, 48) << 20
        conv = tensor(size, "activation", len(ops))
        op("aten.convolution.default", "forward", (act, params[b]), (conv,))
        bn = tensor(size, "activation", len(ops))
        stats = tensor(4096, "activation", len(ops))
        op("aten.native_batch_norm.default", "forward", (conv,), (bn, stats), latency=rng.uniform(0.05e-3, 0.2e-3))
        if b % 2 == 1 and tensors[act].size == size:
            op("aten.add_.Tensor", "forward", (bn, act), (), (bn,), latency=0.05e-3)
        op("aten.relu_.default", "forward", (bn,), (), (bn,), latency=0.05e-3)
        saved.append((act, conv, bn, params[b]))
        act = bn
    loss = tensor(512, "activation", len(ops))
    op("aten.sum.default", "forward", (act,), (loss,))
    grad = tensor(tensors[act].size, "temporary", len(ops))
    op("aten.ones_like.default", "backward", (loss,), (grad,))
    for block_in, conv, bn, param in reversed(saved):
        g1 = tensor(tensors[bn].size, "temporary", len(ops))
        op("aten.threshold_backward.default", "backward", (grad, bn), (g1,))
        g2 = tensor(tensors[conv].size, "temporary", len(ops))
        op("aten.native_batch_norm_backward.default", "backward", (g1, conv), (g2,))
        g3 = tensor(tensors[block_in].size, "temporary", len(ops))
        pg = tensor(tensors[param].size, "gradient", len(ops))
        op("aten.convolution_backward.default", "backward", (g2, block_in, param), (g3, pg))
        new_param = tensor(tensors[param].size, "param", len(ops))
        tensors[new_param].reuses = param
        op("aten.add_.Tensor", "optimizer", (param, pg), (new_param,), (param,))
        grad = g3
    last_use: dict[int, int] = {}
    for o in ops:
        for t in (*o.inputs, *o.outputs, *o.writes):
            last_use[t] = o.index
    for t in tensors.values():
        if t.role in ("activation", "temporary", "gradient"):
            t.freed_after = last_use[t.id]
        elif t.created_by < 0 and t.role == "param":
            t.freed_after = next(o.index for o in ops if t.id in o.writes)
    return Workload(f"chain{seed}", 1, "cuda", tensors, ops)
