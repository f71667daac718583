"""Trace one training iteration (forward, loss, backward, optimizer step) into a Workload.

One TorchDispatchMode sees every aten op. On the meta device nothing is computed, so a forecast
needs no GPU and no data; on real CPU tensors the same recorder traces a *live* iteration, and both
give the same signature. Memory is accounted per storage; a storage's free is recorded by a weakref
finalizer at the moment PyTorch drops it, so the vanilla timeline is the allocator's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from tensile.cuda_ops import as_traced, ops_as_on_cuda
from tensile.errors import TensileUserError
from tensile.workload import Op, TensorInfo, Workload, round_allocation

_UPDATED_ROLES = ("param", "optimizer_state")


@dataclass
class TrainingStep:
    """What one iteration runs: the user contract (model, batch, loss_fn, make_optimizer), prepared."""

    model: torch.nn.Module
    batch: tuple[torch.Tensor, ...]
    loss_fn: Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    optimizers: list[torch.optim.Optimizer]
    micro_batches: int = 1  # gradient accumulation: forward+backward this many times per step
    autocast_dtype: torch.dtype | None = None
    autocast_device: str = "cpu"
    phase_listener: Callable[[str], None] | None = field(default=None, repr=False)

    def run(self) -> None:
        """One iteration as a training loop runs it; gradients were set to None before it."""
        for _ in range(self.micro_batches):
            self._phase("forward")
            if self.autocast_dtype is not None:
                with torch.autocast(self.autocast_device, dtype=self.autocast_dtype):
                    loss = self.loss_fn(self.model, self.batch)
            else:
                loss = self.loss_fn(self.model, self.batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TensileUserError("loss_fn(model, batch) must return a scalar tensor (one element)")
            self._phase("backward")
            (loss / self.micro_batches if self.micro_batches > 1 else loss).backward()
            del loss
        self._phase("optimizer")
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def _phase(self, phase: str) -> None:
        if self.phase_listener is not None:
            self.phase_listener(phase)


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.UntypedStorage, torch.TypedStorage)):
        # a storage's str() lists every element, each read through the dispatcher: a script reading a weight's
        # storage byte by byte after each step ran 40x slower under the hook, and one 64-byte read never ended
        return f"{type(value).__name__}({value.nbytes()} bytes)"
    return str(value)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def contiguous_run(tensor: torch.Tensor) -> int:
    """Elements of the tensor's innermost run that lies contiguously in memory in row-major order: its numel
    when contiguous, the last dim's size after a transpose of the two before it, 1 after a 2-D transpose."""
    run, expected = 1, 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride())):
        if size == 1:
            continue
        if stride != expected:
            break
        run *= size
        expected *= size
    return run


def contiguous_runs(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """Op.runs: () when every tensor is contiguous, else each one's contiguous_run."""
    if all(t.is_contiguous() for t in tensors):
        return ()
    return tuple(contiguous_run(t) for t in tensors)


def written_values(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The argument values the op's schema marks as written in place (`Tensor(a!)`)."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if position < len(args):
            written.append(args[position])
        elif argument.name in kwargs:
            written.append(kwargs[argument.name])
    return written


class Recorder(TorchDispatchMode):
    """Records ops and storages of one device type; `phase` is set by whoever drives the step."""

    def __init__(self, device_type: str, target_device: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.target_device = target_device
        self.phase = "forward"
        self.tensors: dict[int, TensorInfo] = {}
        self.ops: list[Op] = []
        self._current: dict[int, int] = {}  # id(storage) -> current tensor id
        self._key_of: dict[int, int] = {}  # tensor id -> id(storage)
        self._updated: set[int] = set()  # resident tensors already given a new version this iteration
        self._live = True

    # -- storages -------------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor, role: str) -> int:
        """A storage that exists before the iteration starts (param, buffer, optimizer state, input)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._current:
            return self._current[key]
        return self._new_tensor(storage, role, _dtype_name(tensor.dtype), created_by=-1)

    def _new_tensor(self, storage: torch.UntypedStorage, role: str, dtype: str, created_by: int) -> int:
        tid = len(self.tensors)
        size = round_allocation(storage.nbytes(), self.target_device)
        self.tensors[tid] = TensorInfo(tid, size, role, dtype, created_by)
        key = id(storage)
        self._current[key] = tid
        self._key_of[tid] = key
        self._watch(storage)
        return tid

    def _watch(self, storage: torch.UntypedStorage) -> None:
        """Learn when PyTorch frees the storage (the runtime hook shares one watcher across iterations)."""
        weakref.finalize(storage, self._on_free, id(storage))

    def _on_free(self, key: int) -> None:
        tid = self._current.pop(key, None)
        if tid is not None and self._live:
            self.tensors[tid].freed_after = len(self.ops) - 1

    def _tracked(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.device.type == self.device_type

    def _storage_id(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        tid = self._current.get(id(storage))
        if tid is None:  # existed before tracing but nobody registered it: resident
            tid = self._new_tensor(storage, "param", _dtype_name(tensor.dtype), created_by=-1)
        return tid

    def stop(self) -> None:
        """Frees after the iteration (the next zero_grad, interpreter exit) are not part of it."""
        self._live = False

    # -- ops ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "profiler":  # record_function markers: no tensors, and only when profiled
            self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Op:
        """Append the op that just ran with these arguments and result; new storages become tensors (cuDNN's batch
        norm is recorded as the native op a meta trace records: `cuda_ops`)."""
        index = len(self.ops)
        written = written_values(func, args, kwargs)
        flop_fn = flop_registry.get(func._overloadpacket)
        flops = 0.0 if flop_fn is None else float(flop_fn(*args, **kwargs, out_val=out))
        func, args, kwargs, out = as_traced(func, args, kwargs, out)
        in_leaves = tree_leaves((args, kwargs))
        in_tensors = [v for v in in_leaves if isinstance(v, torch.Tensor)]
        inputs: dict[int, None] = {}
        for tensor in in_tensors:
            if self._tracked(tensor):
                inputs[self._storage_id(tensor)] = None
        writes: dict[int, None] = {}
        for value in tree_leaves(written):
            if self._tracked(value):
                writes[self._storage_id(value)] = None
        outputs: dict[int, None] = {}
        out_tensors = [v for v in tree_leaves(out) if isinstance(v, torch.Tensor)]
        for tensor in out_tensors:
            if not self._tracked(tensor):
                continue
            storage = tensor.untyped_storage()
            tid = self._current.get(id(storage))
            if tid is None:
                outputs[self._new_tensor(storage, "temporary", _dtype_name(tensor.dtype), index)] = None
            elif tid not in outputs:
                inputs[tid] = None  # a view or an in-place result: an access of an existing storage
        if self.phase == "optimizer":
            for tid in writes:
                new_tid = self._new_version(tid, index)
                if new_tid is not None:
                    outputs[new_tid] = None
        moved = sum(t.numel() * t.element_size() for t in in_tensors + out_tensors)
        op = Op(
            index=index,
            name=str(func),
            phase=self.phase,
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            writes=tuple(writes),
            shapes=tuple(tuple(t.shape) for t in in_tensors),
            dtypes=tuple(_dtype_name(t.dtype) for t in in_tensors),
            params=tuple(_json_safe(v) for v in in_leaves if not isinstance(v, torch.Tensor)),
            flops=flops,
            bytes_moved=moved,
            runs=contiguous_runs(in_tensors),
        )
        self.ops.append(op)
        return op

    def _new_version(self, tid: int, index: int) -> int | None:
        """The paper's rule: an updated param / optimizer state is a new tensor in the old memory."""
        old = self.tensors[tid]
        if old.created_by >= 0 or old.role not in _UPDATED_ROLES or tid in self._updated:
            return None
        self._updated.add(tid)
        new_tid = len(self.tensors)
        self.tensors[new_tid] = TensorInfo(new_tid, old.size, old.role, old.dtype, index, reuses=tid)
        old.freed_after = index
        key = self._key_of[tid]
        self._current[key] = new_tid
        self._key_of[new_tid] = key
        return new_tid


def classify_roles(recorder: Recorder, gradient_ids: set[int] | None = None) -> None:
    """Roles of tensors created during the iteration, from when they live.

    Without the parameters' `.grad` ids (a live run the hook watches), gradients are the tensors
    born in the backward pass that outlive the iteration: PyTorch frees them only at `zero_grad`.
    """
    ops = recorder.ops
    if gradient_ids is None:
        gradient_ids = {
            t.id for t in recorder.tensors.values()
            if t.created_by >= 0 and t.freed_after is None and ops[t.created_by].phase == "backward"
        }
    for tensor in recorder.tensors.values():
        if tensor.created_by < 0 or tensor.reuses is not None:
            continue
        if tensor.id in gradient_ids:
            tensor.role = "gradient"
        elif ops[tensor.created_by].phase == "forward" and (
            tensor.freed_after is None or ops[tensor.freed_after].phase != "forward"
        ):
            tensor.role = "activation"


def choose_foreach(optimizers: Sequence[torch.optim.Optimizer], target_device: str, foreach: bool | None) -> None:
    """Make the optimizers run the kernels the target device would, whatever device the trace runs on.

    PyTorch's optimizers default to foreach kernels on CUDA and to per-parameter loops on the CPU and
    meta, and a CUDA forecast is traced on meta or (autocast, --live) on the CPU: left alone, it would
    trace the loops. `foreach=None` emulates the target's default for optimizers that leave it unset;
    True / False (--foreach on / off) sets every group, the user's own optimizer's included.
    """
    for optimizer in optimizers:
        groups = [group for group in optimizer.param_groups if "foreach" in group]
        if foreach is None:
            if target_device == "cuda":
                for group in groups:
                    if group["foreach"] is None and not group.get("fused"):
                        group["foreach"] = True
            continue
        flag = f"--foreach {'on' if foreach else 'off'}"
        name = type(optimizer).__name__
        if not groups:
            raise TensileUserError(f"{flag}: the optimizer {name} has no foreach option; use --foreach auto")
        if any(group.get("fused") for group in groups):
            raise TensileUserError(
                f"{flag}: the optimizer {name} was made with fused=True, which runs neither foreach kernels nor "
                f"loops; use --foreach auto, or make it without fused=True"
            )
        for group in groups:
            group["foreach"] = foreach


def trace_step(
    step: TrainingStep,
    *,
    model_name: str,
    batch_size: int,
    target_device: str,
    meta: dict | None = None,
    foreach: bool | None = None,
) -> Workload:
    """Run a warm-up iteration (optimizer state appears), then record the next one.

    `foreach`: the optimizers' kernels (None: as `target_device` defaults; see `choose_foreach`). A CUDA iteration
    traced on the meta device runs batch norm and dropout as a GPU would (`cuda_ops`).
    """
    device_type = step.batch[0].device.type
    choose_foreach(step.optimizers, target_device, foreach)
    as_on_cuda = ops_as_on_cuda() if target_device == "cuda" and device_type == "meta" else nullcontext()
    try:
        with as_on_cuda:
            step.zero_grad()
            step.run()
            step.zero_grad()
            recorder = Recorder(device_type, target_device)
            for name, tensor in (*step.model.named_parameters(), *step.model.named_buffers()):
                recorder.register(tensor, "param")
            for optimizer in step.optimizers:
                for state in optimizer.state.values():
                    for value in state.values():
                        if isinstance(value, torch.Tensor) and value.device.type == device_type:
                            recorder.register(value, "optimizer_state")
            for tensor in step.batch:
                recorder.register(tensor, "input")

            def set_phase(phase: str) -> None:
                recorder.phase = phase

            step.phase_listener = set_phase
            with recorder:
                step.run()
            recorder.stop()
    except TensileUserError:
        raise
    except (RuntimeError, NotImplementedError) as exc:
        if device_type == "meta" and ("meta" in str(exc).lower() or "data-dependent" in str(exc).lower()):
            raise TensileUserError(
                f"the training step cannot be traced on the meta device: it depends on tensor values "
                f"({str(exc).splitlines()[0]}). Trace a live CPU iteration instead: add --live"
            ) from None
        raise
    finally:
        step.phase_listener = None
    gradient_ids = {
        recorder._current[id(p.grad.untyped_storage())]
        for p in step.model.parameters()
        if p.grad is not None and id(p.grad.untyped_storage()) in recorder._current
    }
    classify_roles(recorder, gradient_ids)
    info = {"tracer": "meta" if device_type == "meta" else f"live-{device_type}", **(meta or {})}
    return Workload(model_name, batch_size, target_device, recorder.tensors, recorder.ops, info)
