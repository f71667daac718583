"""The cap on a job process's CUDA memory (tensile_hook.memory_cap), with a stand-in for torch.cuda that records the
calls: the CPU machines that run the suite have no CUDA device to cap."""

from __future__ import annotations

import pytest
import torch
from tests.support.recording_cuda import RecordingCuda

from tensile.devices import DEFAULT_CONTEXT_BYTES, PRESETS
from tensile_hook.memory_cap import cap_memory
from tensile_hook.report import HookReport, RunTotals, memory_cap_outcome

GIB = 2**30


def test_the_allocator_is_capped_at_the_admitted_size_less_the_context_as_a_share_of_the_devices_memory():
    """The fraction caps only the caching allocator; the CUDA context is held beside it, so the allocator gets the
    admitted size less the context admission counted, and the process as a whole stays within its admission."""
    cuda = RecordingCuda()
    cap = cap_memory(cuda, {"TENSILE_MEMORY_CAP": "20Gi", "TENSILE_CONTEXT_BYTES": "4Gi"})
    assert cap is not None
    assert (cap.cap_bytes, cap.context_bytes, cap.allocator_bytes) == (20 * GIB, 4 * GIB, 16 * GIB)
    assert (cap.device, cap.device_bytes, cap.fraction) == (0, 80 * GIB, 0.2)
    assert cuda.calls == [("device", 0), ("set_per_process_memory_fraction", 0.2, 0, 0)]


@pytest.mark.parametrize("name, context", [("NVIDIA H100 80GB HBM3", PRESETS["h100"].context_bytes),
                                           ("NVIDIA RTX A6000", PRESETS["a6000"].context_bytes),
                                           ("NVIDIA L40S", DEFAULT_CONTEXT_BYTES)])
def test_without_a_context_given_the_devices_preset_says_it_else_the_default(name, context):
    """`tensile run --memory-cap` by hand names no context: the GPU's preset, found by the device's name, says it."""
    cuda = RecordingCuda(name=name)
    cap = cap_memory(cuda, {"TENSILE_MEMORY_CAP": "20Gi"})
    assert cap is not None and cap.context_bytes == context and cap.allocator_bytes == 20 * GIB - context
    assert cuda.calls[-1] == ("set_per_process_memory_fraction", (20 * GIB - context) / (80 * GIB), 0, 0)


@pytest.mark.parametrize("written", ["0", "0Mi"])
def test_a_context_of_none_leaves_the_allocator_the_whole_cap(written):
    """A GPU simulated without a per-job context (`tensile local`, `--context-bytes 0`) gives its pods 0: refused as
    no memory size, the cap was not set at all."""
    cuda = RecordingCuda()
    cap = cap_memory(cuda, {"TENSILE_MEMORY_CAP": "20Gi", "TENSILE_CONTEXT_BYTES": written})
    assert cap is not None and (cap.context_bytes, cap.allocator_bytes, cap.fraction) == (0, 20 * GIB, 0.25)


def test_a_cap_no_larger_than_the_context_caps_the_allocator_at_the_whole_cap_and_says_why():
    """Refused, it left the job with no cap at all, where the cap may be all that keeps it to its share."""
    cuda = RecordingCuda()
    cap = cap_memory(cuda, {"TENSILE_MEMORY_CAP": "512Mi", "TENSILE_CONTEXT_BYTES": "512Mi"})
    assert cap is not None and (cap.context_bytes, cap.allocator_bytes) == (0, 512 * 2**20)
    assert cuda.calls[-1] == ("set_per_process_memory_fraction", 512 * 2**20 / (80 * GIB), 0, 0)
    assert "TENSILE_MEMORY_CAP (512 MiB) would leave" in cap.note and "TENSILE_CONTEXT_BYTES" in cap.note


def test_a_process_a_launcher_numbers_caps_its_own_device_with_it_current():
    """Set with device 0 current, a torchrun job's eight processes each made a CUDA context on GPU 0."""
    cuda = RecordingCuda(devices=4)
    cap = cap_memory(cuda, {"TENSILE_MEMORY_CAP": str(9 * GIB), "TENSILE_CONTEXT_BYTES": str(GIB), "LOCAL_RANK": "2"})
    assert cap is not None and cap.device == 2
    assert cuda.calls == [("device", 2), ("set_per_process_memory_fraction", 0.1, 2, 2)]


@pytest.mark.parametrize("environ, cuda", [({}, RecordingCuda()),
                                           ({"TENSILE_MEMORY_CAP": "1Gi"}, RecordingCuda(available=False))])
def test_no_cap_without_an_admitted_size_or_without_cuda(environ, cuda):
    assert cap_memory(cuda, environ) is None and cuda.calls == []


def test_a_cap_above_the_device_is_the_whole_device():
    cuda = RecordingCuda(total=16 * GIB)
    cap = cap_memory(cuda, {"TENSILE_MEMORY_CAP": "20Gi"})
    assert cap is not None and cap.fraction == 1.0


def test_an_out_of_memory_error_the_guard_retries_is_counted_and_said(planless):
    """The cap (or a full device) raises torch.OutOfMemoryError; where the hook runs, the guard evicts and retries,
    and the report says how often."""
    other = torch.ones(2**18)
    planless.residency.registry.watch(other.untyped_storage())
    attempts = []

    def out_of_memory_once(x: torch.Tensor) -> torch.Tensor:
        attempts.append(1)
        if len(attempts) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: the process's cap)")
        return x + 1

    planless.residency.run_op(out_of_memory_once, (torch.zeros(4),), {})
    assert planless.state.stats.out_of_memory_retries == 1 and planless.state.stats.passive_evictions == 1
    report = HookReport("job", "cuda:0", memory_cap={"cap_bytes": 20 * GIB, "context_bytes": 4 * GIB,
                                                     "allocator_bytes": 16 * GIB, "device": 0,
                                                     "device_bytes": 80 * GIB, "fraction": 0.2})
    report.add(planless.state.stats)
    data = report.to_dict()
    assert memory_cap_outcome(data, RunTotals.of(data)) == ("CUDA memory capped at 20,480 MiB (16,384 MiB for its "
                                                            "caching allocator); 1 out-of-memory errors turned into "
                                                            "passive evictions and retried")


def test_a_report_without_a_cap_or_a_retry_says_nothing_of_them():
    data = HookReport("job", "cpu").to_dict()
    assert memory_cap_outcome(data, RunTotals.of(data)) is None


def test_on_the_cpu_device_reserved_is_what_the_tracked_storages_peak_at(planless):
    """No caching allocator on the CPU: the report's reserved figure is the observed peak, said so, not measured."""
    x = torch.ones(2**16, requires_grad=True)
    optimizer = torch.optim.SGD([x], lr=0.1)
    for _ in range(2):
        (x * 2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    stats = planless.report.iterations
    assert stats and all(it.reserved_bytes == it.peak_bytes > 0 for it in stats)
