"""The cuBLAS workspaces a CUDA training process holds in the caching allocator beside its tensors: memory the
tensors' peak does not count, which `torch.cuda.max_memory_allocated` and `max_memory_reserved` do.

The rules, read from PyTorch 2.13's aten/src/ATen/cuda/CublasHandlePool.cpp:

- each (cuBLAS handle, stream) pair gets a workspace the first time a matmul runs there (`setWorkspaceForHandle`),
  allocated through the caching allocator (`getNewWorkspace`) and kept until the process ends;
- handles are handed out per thread (`DeviceThreadHandlePool`). A training iteration runs its forward pass and its
  optimizer step in the training thread and its backward pass in the autograd engine's thread for the device, on
  the same stream: a model that multiplies matrices in both holds two workspaces;
- cuBLASLt's matmuls share the cuBLAS workspace of their handle and stream (`getCUDABlasLtWorkspace` while
  TORCH_CUBLASLT_UNIFIED_WORKSPACE is unset or true, PyTorch's default);
- the size (`parseChosenWorkspaceSize`): the `:SIZE:COUNT` pairs of CUBLAS_WORKSPACE_CONFIG, SIZE KiB times COUNT
  each, summed (a value with no pair counts as unset); unset, 32 MiB on compute capability 9.x, 10.x and 12.x
  (Hopper, Blackwell), else 8 MiB + 128 KiB (`:4096:2:16:8`).

Not modelled: cuDNN's convolution workspaces (allocated for one call, sized by the algorithm cuDNN's heuristics
pick, which no rule here can know), a workspace size the program sets from within (PyTorch's
`setChosenWorkspaceSize`), and cuBLASLt workspaces of their own where the unified one is switched off.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from tensile.latency.families import base_name
from tensile.workload import Op, Workload

KIB = 1024
WORKSPACE_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
LARGE_WORKSPACE_MAJORS = (9, 10, 12)  # compute capability majors whose default workspace is 32 MiB
LARGE_WORKSPACE_BYTES = 4096 * 8 * KIB  # :4096:8
SMALL_WORKSPACE_BYTES = 4096 * 2 * KIB + 16 * 8 * KIB  # :4096:2:16:8
DEFAULT_WORKSPACE_SIZES = (SMALL_WORKSPACE_BYTES, LARGE_WORKSPACE_BYTES)  # what `booked_workspace_bytes` returns
_PAIR = re.compile(r":([0-9]+):([0-9]+)")

# aten ops that run a cuBLAS or cuBLASLt matmul on CUDA (linear, matmul and einsum reach these as they decompose)
CUBLAS_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation", "_scaled_mm",
    "_int_mm",
})

TRAINING_THREAD = "training"
AUTOGRAD_THREAD = "autograd"


def cublas_workspace_bytes(compute_capability_major: int, environ: Mapping[str, str]) -> int:
    """The size of one cuBLAS workspace on a GPU of this compute capability in a process started from `environ`."""
    default = LARGE_WORKSPACE_BYTES if compute_capability_major in LARGE_WORKSPACE_MAJORS else SMALL_WORKSPACE_BYTES
    config = environ.get(WORKSPACE_CONFIG)
    pairs = _PAIR.findall(config) if config is not None else []
    if not pairs:
        return default
    return sum(int(size) * KIB * int(count) for size, count in pairs)


def booked_workspace_bytes(compute_capability_major: int) -> int:
    """The size of one cuBLAS workspace Tensile books for a job on a GPU of this compute capability (0: unknown): the
    default environment's (`cublas_workspace_bytes(major, {})`), since admission sizes a job before its process
    starts and does not read a pod's own CUBLAS_WORKSPACE_CONFIG; on a GPU whose compute capability is unknown, the
    largest default size, so that no job is booked below what its process may hold."""
    if compute_capability_major <= 0:
        return max(DEFAULT_WORKSPACE_SIZES)
    return cublas_workspace_bytes(compute_capability_major, {})


def thread_of(op: Op) -> str:
    """The thread an op of a training iteration runs in: the autograd engine's device thread for the backward pass,
    the training thread for the rest."""
    return AUTOGRAD_THREAD if op.phase == "backward" else TRAINING_THREAD


def cublas_workspaces(workload: Workload, workspace_bytes: int) -> dict[int, int]:
    """The workspaces a CUDA workload's iteration holds, by the index of the op that first allocates each (the first
    cuBLAS op of its thread), each `workspace_bytes`. Empty for the CPU device, which has no cuBLAS."""
    if workload.device != "cuda" or workspace_bytes <= 0:
        return {}
    first: dict[str, int] = {}
    for op in workload.ops:
        if base_name(op.name) in CUBLAS_OPS:
            first.setdefault(thread_of(op), op.index)
    return {index: workspace_bytes for index in first.values()}
