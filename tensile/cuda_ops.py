"""The ops PyTorch runs on CUDA where the meta device runs others: run so while a CUDA iteration is traced on the
meta device, and recorded as its forecast names them.

A forecast is traced on the meta device, where a batch norm runs `aten.native_batch_norm` and its backward
`aten.native_batch_norm_backward`. On CUDA, PyTorch's `_batch_norm_impl_index` sends the same call to cuDNN's ops
instead: the same tensors, one more result (`reserve`, which the backward reads back; empty for a plain batch
norm), and a backward that takes `input` before `grad_output`. Recorded as they ran, a CUDA job's live iteration
never had its forecast's signature (so the forecast's plan never applied), and its plans could not recompute batch
norm's outputs, whose creator no recompute rule knew. So both recorders (the tracer's and the hook's) record them
as the native ops, and the hook's hot path names them so. (It binds an op's tensors to the plan's where they are
first seen, and every tensor the backward reads was seen before it: their order does not matter there.) A reserve
cuDNN fills is kept, as a fourth result and a last input: the forecast did not count it, so the signature then
differs and the job plans from its live iteration, which does (`timeline.RESERVES`).

The forecast must run CUDA's ops in the first place: on the meta device `_batch_norm_impl_index` takes the native
path, which first makes an empty reserve of its own (`aten.empty`, an op the CUDA iteration does not run), and
dropout runs as `bernoulli_` and `mul` (a mask of the input's dtype) where CUDA runs its fused `native_dropout` (a
mask of bools: at batch 16 on the H100 preset BERT-base's forecast vanilla peak fell from 3,733 to 3,513 MiB with
it). So while a CUDA iteration is traced on the meta device (`ops_as_on_cuda`), `torch.batch_norm` (what
`F.batch_norm` and the batch-norm modules call) calls cuDNN's op wherever PyTorch's `_select_batch_norm_backend`
picks cuDNN on a GPU, and dropout (`F.dropout` and `torch.dropout`) calls the fused op wherever PyTorch's
`is_fused_kernel_acceptable` would; the meta device has kernels for both and their backwards. The switch is per
thread: the operator traces jobs in threads, some for the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

CUDNN_BATCH_NORM = torch.ops.aten.cudnn_batch_norm.default
CUDNN_BATCH_NORM_BACKWARD = torch.ops.aten.cudnn_batch_norm_backward.default
_TRACED_AS = {
    CUDNN_BATCH_NORM: torch.ops.aten.native_batch_norm.default,
    CUDNN_BATCH_NORM_BACKWARD: torch.ops.aten.native_batch_norm_backward.default,
}


def traced_name(func: Any) -> str:
    """The op's name as a meta trace records it."""
    return str(_TRACED_AS.get(func, func))


def as_traced(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[Any, tuple, dict, Any]:
    """The call and its result as a meta trace records them (any op but cuDNN's batch norm: as they are)."""
    if func is CUDNN_BATCH_NORM:
        return _TRACED_AS[func], args, kwargs, out if out[3].numel() else out[:3]
    if func is CUDNN_BATCH_NORM_BACKWARD:
        input, grad_output, weight, running_mean, running_var, save_mean, save_var, eps, reserve = args
        native = (grad_output, input, weight, running_mean, running_var, save_mean, save_var, True, eps, [True] * 3)
        return _TRACED_AS[func], native + ((reserve,) if reserve.numel() else ()), kwargs, out
    return func, args, kwargs, out


_NATIVE_BATCH_NORM = torch.batch_norm
_UNFUSED_DROPOUT = torch.dropout
_tracing_for_cuda = threading.local()
_BATCH_LIMIT = {True: 880801, False: 65535}  # cuDNN's largest batch for a batch norm, in training and in evaluation


@contextmanager
def ops_as_on_cuda() -> Iterator[None]:
    """In this thread, batch norm and dropout run the ops PyTorch runs on a GPU (see the module's docstring)."""
    if torch.batch_norm is _NATIVE_BATCH_NORM:
        torch.batch_norm = _batch_norm
        torch.dropout = torch._VF.dropout = _dropout
    before = getattr(_tracing_for_cuda, "on", False)
    _tracing_for_cuda.on = True
    try:
        yield
    finally:
        _tracing_for_cuda.on = before


def _batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool, momentum: float,
                eps: float, cudnn_enabled: bool) -> torch.Tensor:
    tracing = getattr(_tracing_for_cuda, "on", False)
    if tracing and _cudnn_takes(input, weight, bias, running_mean, running_var, training, cudnn_enabled):
        return CUDNN_BATCH_NORM(input, weight, bias, running_mean, running_var, training, momentum, eps)[0]
    return _NATIVE_BATCH_NORM(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    if getattr(_tracing_for_cuda, "on", False) and train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, train)[0]
    return _UNFUSED_DROPOUT(input, p, train)


def _cudnn_takes(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                cudnn_enabled: bool) -> bool:
    """Whether PyTorch on a GPU runs this batch norm with cuDNN (`_select_batch_norm_backend`, PyTorch 2.x), for a
    PyTorch built with cuDNN. Its epsilon test is left out: cuDNN's smallest (`CUDNN_BN_MIN_EPSILON`, 1e-5 in older
    headers) is below or at every default. A wrong guess costs the forecast its match, never more."""
    return (
        cudnn_enabled and weight is not None and bias is not None
        and torch.bfloat16 not in (input.dtype, weight.dtype)
        and (input.dtype != torch.float16 or weight.dtype == torch.float32)
        and ((running_mean is not None and running_var is not None)
             or (running_mean is None and running_var is None and training))
        and input.dim() >= 3 and input.shape[0] <= _BATCH_LIMIT[training] and input.numel() < 2**31 - 1
    )
