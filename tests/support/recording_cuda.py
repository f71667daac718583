"""A stand-in for torch.cuda, as far as the hook's memory cap uses it, that records the calls: the CPU machines that
run the suite have no CUDA device to cap."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

GIB = 2**30


class RecordingCuda:
    """torch.cuda as far as the cap uses it: `devices` devices of `total` bytes named `name`, the calls recorded in
    order."""

    def __init__(self, devices: int = 1, total: int = 80 * GIB, available: bool = True,
                 name: str = "NVIDIA H100 80GB HBM3") -> None:
        self.devices, self.total, self.available, self.name = devices, total, available, name
        self.calls: list[tuple] = []
        self.current = 0

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return self.current

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        self.calls.append(("device", index))
        before, self.current = self.current, index
        yield
        self.current = before

    def get_device_properties(self, index: int) -> SimpleNamespace:
        return SimpleNamespace(total_memory=self.total, name=self.name)

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        self.calls.append(("set_per_process_memory_fraction", fraction, device, self.current))

    def stand_in_for_torch_cuda(self, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        """torch.cuda's functions that the cap calls replaced by this one's, for the test (pytest's monkeypatch)."""
        import torch

        for name in ("is_available", "device_count", "current_device", "device", "get_device_properties",
                     "set_per_process_memory_fraction"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
