"""The dispatch path: a TorchDispatchMode that sees every aten op, on the stack for the iterations that need it (the
recorded one, the first under a plan, plans with events the native hooks cannot carry, budget guarding).

Per op it (1) checks that every input is resident and fetches it if not (a stall: a late or wrong plan costs time,
never correctness), (2) runs the op, (3) records it with the tracer's Recorder, in the recorded iteration, so live
tensors map positionally onto the plan's tensor ids, and (4) fires the plan's events whose trigger is this op.
An op that leaves the plan's op stream makes the rest of its iteration run guarded (a divergence)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tensile.cuda_ops import traced_name
from tensile.latency.measure import CudaOpTimer
from tensile.tracer import Recorder, classify_roles, written_values
from tensile.workload import Workload
from tensile_hook.active_plan import ActivePlan
from tensile_hook.latency_samples import OpSampler
from tensile_hook.residency import OpFailed, Residency
from tensile_hook.run_state import RunState
from tensile_hook.storages import StorageRegistry
from tensile_hook.storages import tensors_in as _tensors
from tensile_hook.swap_stages import NativeSwaps


def reads_only(func: Any) -> bool:
    """An op that returns no tensor and writes none: a read (`loss.item()`'s _local_scalar_dense, `torch.equal`,
    `bool(t)`'s is_nonzero, `_assert_async`) that neither allocates nor frees device memory. A script runs such reads
    in some steps only (logging every tenth): they are no ops of the plan's iteration, never the start of a forward
    pass."""
    schema = func._schema
    return (not any("Tensor" in str(value.type) for value in schema.returns)
            and not any(argument.alias_info is not None and argument.alias_info.is_write
                        for argument in schema.arguments))


class Unsupported(Exception):
    """What the job does that the hook cannot carry (not a failure of Tensile's): it stands down saying so,
    without a traceback, and training goes on without it."""


class LiveRecorder(Recorder):
    """The tracer's Recorder, with storages watched once for their whole life by the registry."""

    def __init__(self, device_type: str, registry: StorageRegistry) -> None:
        super().__init__(device_type, device_type)
        self.registry = registry

    def _watch(self, storage: torch.UntypedStorage) -> None:
        self.registry.watch(storage)

    def freed(self, key: int) -> None:
        """The registry saw the storage die."""
        self._on_free(key)

    def key_of(self, tensor: int) -> int:
        """The id of the storage the recorded tensor is on."""
        return self._key_of[tensor]


class DispatchPath(TorchDispatchMode):
    """The mode itself: pushed and popped by `Paths`, it calls `begin` when an op starts the next iteration."""

    def __init__(self, state: RunState, residency: Residency, swaps: NativeSwaps, sampler: OpSampler,
                 begin: Callable[[], None], stand_down: Callable[[BaseException], None]) -> None:
        super().__init__()
        self.state = state
        self.residency = residency
        self.swaps = swaps
        self.sampler = sampler
        self.begin = begin
        self.stand_down = stand_down
        self.recorder = LiveRecorder(state.device_type, residency.registry)
        self.op_timer = CudaOpTimer() if state.device_type == "cuda" else None  # the recorded ops' kernel times
        self.names: dict[Any, str] = {}  # op -> its name as a workload has it, cached: str(op) is costly per call
        self.reads: dict[Any, bool] = {}  # op -> whether it only reads (`reads_only`), cached
        self.reads_by_name: dict[str, bool] = {}  # the same by a plan op's name
        self.outside_reads = 0  # reads outside the dispatcher under way (`only_watching`)
        # this iteration's divergence (op, what ran, what the plan expected), said at its step: an iteration that
        # never reaches one is the script's code after its last step (an evaluation), said quietly at exit
        self.divergence: tuple[int, str, str] | None = None

    @contextlib.contextmanager
    def only_watching(self) -> Iterator[None]:
        """While a read outside the dispatcher runs, its ops are only watched: nothing evicted or fired."""
        self.outside_reads += 1
        try:
            yield
        finally:
            self.outside_reads -= 1

    # -- the recorded iteration ---------------------------------------------------------------
    def start_recording(self) -> None:
        self.recorder = LiveRecorder(self.state.device_type, self.residency.registry)

    def ops_recorded(self) -> int:
        return len(self.recorder.ops)

    def recorded(self) -> Workload:
        """The recorded iteration as a workload, with each op's kernel time on CUDA (its host time elsewhere)."""
        recorder = self.recorder
        if self.op_timer is not None:
            for op, seconds in zip(recorder.ops, self.op_timer.seconds()):
                op.latency = seconds
        recorder.stop()
        classify_roles(recorder)
        state = self.state
        return Workload(state.settings.job, 0, state.device_type, recorder.tensors, recorder.ops)

    def storage_freed(self, key: int) -> None:
        if self.state.iteration == self.state.match_at:
            self.recorder.freed(key)

    # -- the hot path -------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        state = self.state
        if state.disabled or func.namespace == "profiler":
            return func(*args, **kwargs)
        started = time.perf_counter()
        try:
            leaves = _tensors((args, kwargs))
            if self.outside_reads:
                return self._dispatch_observed(func, args, kwargs, leaves)
            if state.step_done and self._starts_iteration(func, leaves):
                self.begin()
            if state.path == "native":
                return self._dispatch_observed(func, args, kwargs, leaves)
            if state.iteration == state.match_at:
                return self._dispatch_recording(func, args, kwargs, leaves, started)
            return self._dispatch_fast(func, args, kwargs, leaves, started)
        except OpFailed as failure:
            raise failure.error from None
        except Exception as exc:  # noqa: BLE001 - the hook must never cost the user their training
            self.stand_down(exc)
            state.stats.hook_seconds += time.perf_counter() - started  # its restores' copies were subtracted
            if any(t.numel() and not t.untyped_storage().nbytes() for t in _tensors((args, kwargs))):
                raise exc  # an input the stand-down could not bring back (out of memory): never run on 0 bytes
            return func(*args, **kwargs)

    def _dispatch_observed(self, func: Any, args: tuple, kwargs: dict, leaves: list[Any]) -> Any:
        """A native iteration under observation: its storages are watched for the CPU peak, nothing else
        (inputs are checked only because an out-of-memory retry in `run_op` may have evicted some)."""
        residency = self.residency
        residency.ensure_resident(leaves)
        out = residency.run_op(func, args, kwargs)
        state = self.state
        device_type = state.device_type
        registry = residency.registry
        slots = registry.slots
        for value in _tensors(out):
            if value.device.type == device_type and id(storage := value.untyped_storage()) not in slots:
                registry.watch(storage)
        if device_type != "cuda" and registry.device_bytes > state.stats.peak_bytes:
            state.stats.peak_bytes = registry.device_bytes
        return out

    def _dispatch_read(self, func: Any, args: tuple, kwargs: dict, leaves: list[Any], started: float) -> Any:
        """A read (`reads_only`) the plan's iteration did not make here: its inputs checked before use, then run,
        outside the plan's op stream. A script logging `loss.item()` every tenth step made that step diverge from the
        plan at the read."""
        residency = self.residency
        keys = [id(v.untyped_storage()) for v in leaves if v.device.type == self.state.device_type]
        residency.ensure_keys_resident(keys)
        before_op = time.perf_counter()
        out = residency.run_op(func, args, kwargs)
        after_op = time.perf_counter()
        residency.after_accounting(set(keys))  # a fetch may have brought a storage back
        self.state.stats.hook_seconds += (before_op - started) + (time.perf_counter() - after_op)
        return out

    def _dispatch_recording(self, func: Any, args: tuple, kwargs: dict, leaves: list[Any], started: float) -> Any:
        """The iteration the plan is matched against: recorded in full with the tracer's Recorder."""
        residency = self.residency
        residency.ensure_resident(leaves)
        timer = self.op_timer
        kernel_started = timer.start() if timer is not None else None
        before_op = time.perf_counter()
        out = residency.run_op(func, args, kwargs)
        after_op = time.perf_counter()
        if timer is not None:
            timer.stop(kernel_started)
        try:
            recorder = self.recorder
            recorder.phase = self._phase()
            op = recorder.record(func, args, kwargs, out)
            op.latency = after_op - before_op  # on CUDA the kernel's time replaces it at the iteration's end
            residency.after_accounting({recorder.key_of(t) for t in op.inputs + op.outputs})
        except Exception as exc:  # noqa: BLE001 - the op ran: keep its result, stand down
            self.stand_down(exc)
        self.state.stats.hook_seconds += (before_op - started) + (time.perf_counter() - after_op)
        return out

    def _dispatch_fast(self, func: Any, args: tuple, kwargs: dict, leaves: list[Any], started: float) -> Any:
        """Every other iteration: check inputs, run, watch new storages, fire this op's events."""
        state = self.state
        residency = self.residency
        index = state.op_index
        active = state.active
        name = self._name(func)
        if active is not None and index < len(active.names) and active.names[index] != name:
            if self._reads_only(func):
                return self._dispatch_read(func, args, kwargs, leaves, started)
            index = self._skip_reads(active, index, name)
        state.op_index = index + 1
        if active is not None and index >= len(active.names):
            active = None  # after the plan's last op (a script logging loss.item()): nothing left to fire
        elif active is not None and active.names[index] != name:
            self._diverge(index, func, active.names[index])
            active = None
        if residency.deferred:
            residency.apply_deferred()
        device_type = state.device_type
        arg_keys = list(dict.fromkeys(id(v.untyped_storage()) for v in leaves if v.device.type == device_type))
        residency.ensure_keys_resident(arg_keys)
        if self.swaps.learner is not None and active is not None:
            self.swaps.learner.on_op(index)
        written: list[int] = []
        recipes = residency.recipes
        if recipes:
            written = [id(t.untyped_storage()) for t in _tensors(written_values(func, args, kwargs))]
            residency.recompute_before_write(written)
        wants_rng = ((active is not None and index in active.capture and active.recompute)
                     or any(k in recipes for k in written))
        rng = residency.random.state() if wants_rng else None
        sampler = self.sampler
        sampled = sampler.start(index, name) if sampler.on else None
        before_op = time.perf_counter()
        out = residency.run_op(func, args, kwargs)
        after_op = time.perf_counter()
        if sampled is not None:
            sampler.stop(index, sampled, after_op - before_op)
        try:
            self._after_fast(active, index, arg_keys, written, func, args, kwargs, out, rng)
        except Exception as exc:  # noqa: BLE001 - the op ran: keep its result, stand down
            self.stand_down(exc)
        state.stats.hook_seconds += (before_op - started) + (time.perf_counter() - after_op)
        return out

    def _after_fast(self, active: ActivePlan | None, index: int, arg_keys: list[int], written: list[int], func: Any,
                    args: tuple, kwargs: dict, out: Any, rng: torch.Tensor | None) -> None:
        device_type = self.state.device_type
        residency = self.residency
        registry = residency.registry
        new_keys = []
        for value in _tensors(out):
            if value.device.type == device_type:
                if value.layout != torch.strided:  # no storage of its own to watch or move (sparse gradients)
                    raise Unsupported(f"{self._name(func)} made a tensor of layout {value.layout}: Tensile schedules "
                                      "strided tensors only")
                storage = value.untyped_storage()
                if id(storage) not in registry.slots:
                    registry.watch(storage)
                    new_keys.append(id(storage))
        if written:
            residency.recipes.update(written, func, args, kwargs, rng)
        if active is not None:
            self._bind(active, index, arg_keys, new_keys, func, args, kwargs, out, rng)
            self._fire(active, index)
        residency.after_accounting({*arg_keys, *new_keys})

    def _fire(self, active: ActivePlan, index: int) -> None:
        """The events op `index` triggers (the plan's cross-iteration ones where the last iteration ran under it)."""
        events = active.by_trigger.get(index, [])
        if self.state.previous_planned:
            events = events + active.next_by_trigger.get(index, [])
        self.residency.fire(events)

    def _skip_reads(self, active: ActivePlan, index: int, name: str) -> int:
        """The plan's ops from `index` on that are reads this iteration does not make (the recorded iteration logged,
        this one does not), up to the op named `name`: each fires its events where it stood, and the op's index in
        the plan is returned; `index` where no such run of reads leads to it (a divergence)."""
        names = active.names
        ahead = index
        while ahead < len(names) and names[ahead] != name and self._read_named(names[ahead]):
            ahead += 1
        if ahead == index or ahead == len(names) or names[ahead] != name:
            return index
        residency = self.residency
        for skipped in range(index, ahead):
            if residency.deferred:
                residency.apply_deferred()
            self._fire(active, skipped)
        return ahead

    def _name(self, func: Any) -> str:
        name = self.names.get(func)
        if name is None:
            name = self.names[func] = traced_name(func)
        return name

    def _bind(self, active: ActivePlan, index: int, arg_keys: list[int], new_keys: list[int], func: Any,
              args: tuple, kwargs: dict, out: Any, rng: torch.Tensor | None) -> None:
        """Plan tensor ids first seen at this op get their live storages, by position."""
        live_keys = self.state.keys
        for tensor, where, position in active.capture.get(index, ()):
            if where == "reuse":
                key = live_keys.get(position)
            else:
                keys = arg_keys if where == "in" else new_keys
                key = keys[position] if position < len(keys) else None
            if key is None:
                continue
            live_keys[tensor] = key
            if tensor in active.recompute and where == "out":
                self.residency.recipes.keep(key, func, args, kwargs, out, rng)

    def _starts_iteration(self, func: Any, leaves: list[Any]) -> bool:
        """After the step(s): the first forward op on a leaf that requires grad (a parameter, or an
        input the user marked) starts the next one.

        Not simply "the first op after a step": a GradScaler and several optimizers run ops between
        and after the steps, and scripts log `loss.item()` after them; those stay with the iteration
        they belong to. (A parameter copied out with `detach()` does start one: after the last step
        that ends the plan's iteration cleanly, and a detach inside a forward is rare.)
        """
        return (self.state.start_due() and not self._reads_only(func)
                and any(v.requires_grad and v.is_leaf for v in leaves))

    def _reads_only(self, func: Any) -> bool:
        reads = self.reads.get(func)
        if reads is None:
            reads = self.reads[func] = reads_only(func)
        return reads

    def _read_named(self, name: str) -> bool:
        """Whether the plan's op of this name (`aten._local_scalar_dense.default`) only reads."""
        reads = self.reads_by_name.get(name)
        if reads is None:
            namespace, op, overload = (name.split(".") + ["", ""])[:3]
            func = getattr(getattr(getattr(torch.ops, namespace, None), op, None), overload, None)
            reads = self.reads_by_name[name] = func is not None and reads_only(func)
        return reads

    def _phase(self) -> str:
        if self.state.in_step:
            return "optimizer"
        return "backward" if torch._C._current_autograd_node() is not None else "forward"

    # -- divergence ---------------------------------------------------------------------------
    def _diverge(self, index: int, func: Any, expected: str) -> None:
        """The rest of this iteration runs guarded; the plan is tried again at the next one. At its first
        op this is most often the script's code after its last step (an evaluation, reading the weights
        out): said quietly, not as a fault of the plan. Later, it is said at the iteration's step (or, where
        none comes, at exit: code after the last step that began as a training forward does)."""
        state = self.state
        if index == 0:
            state.say(f"what runs after the step does not start as a planned iteration does (its first op is {func}, "
                      f"the plan's is {expected}): it runs guarded, outside the plan", logging.INFO)
        else:
            self.divergence = (index, str(func), expected)
        state.active = None
        state.stats.mode = "diverged"

    def say_divergence(self, stepped: bool) -> None:
        """This iteration's divergence, if any, said at its step (`stepped`) or at exit."""
        if self.divergence is None:
            return
        index, func, expected = self.divergence
        self.divergence = None
        if stepped:
            self.state.say(f"the iteration diverged from the plan (op {index} is {func}, the plan expected "
                           f"{expected}); the rest of it ran guarded")
        else:
            self.state.say(f"what ran after the last step followed the plan for {index} ops, then left it (op {index} "
                           f"is {func}, the plan expected {expected}): code after training, not a training step; it "
                           "ran guarded", logging.INFO)
