"""Fixtures of the node agent's tests (tensile_agent): `nvml_gpus`; `agent_server` and `tiny_workload` come from
tests/conftest.py, which the hook's and the CLI's tests share."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
from tests.support.fake_nvml import FakeGpu, fake_pynvml


@pytest.fixture
def nvml_gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """nvml_gpus(FakeGpu(...), ...): the agent's `import pynvml` then finds a stand-in answering for these GPUs
    (until the test ends), so an agent discovering its GPUs (no --simulate-gpu) finds them."""

    def install(*gpus: FakeGpu) -> None:
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(list(gpus)))

    return install
