"""CUDA op timing on a real GPU (skipped where PyTorch sees none: CI has none; a lent GPU machine runs it): what an
event pair around an op measures when the host is slower than the op's kernel."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from tensile.latency.measure import LEAD_SECONDS, CudaOpTimer, sleep_cycles_per_second

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_sleep_clock_is_a_gpu_clock():
    assert 0.3e9 < sleep_cycles_per_second(torch.cuda.current_device()) < 5e9


def test_the_op_timer_times_the_kernel_not_a_host_slower_than_it():
    """A host that takes 50 µs to launch each 4 KB add (as a dispatch mode recording every op may): the pairs read
    the adds' few microseconds, where without the lead they read at least the host's 50 µs."""
    x = torch.ones(1024, device="cuda")
    host_seconds = LEAD_SECONDS / 2
    timer = CudaOpTimer()
    torch.cuda.synchronize()
    for _ in range(50):
        start = timer.start()
        launch_due = time.perf_counter() + host_seconds
        while time.perf_counter() < launch_due:
            pass
        x.add_(1)
        timer.stop(start)
    seconds = timer.seconds()
    assert len(seconds) == 50 and min(seconds) > 0
    assert statistics.median(seconds) < host_seconds / 4, seconds
    assert torch.equal(x, torch.full_like(x, 51))
