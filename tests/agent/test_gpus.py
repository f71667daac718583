"""The node's GPU inventory (tensile_agent.gpus): each GPU's compute capability, which sizes its processes' cuBLAS
workspaces, is NVML's where NVML says it, else its preset's (0 where none names it), and /v1/gpus shows it."""

from __future__ import annotations

from tests.support.agent_harness import ThreadedAgent, get
from tests.support.fake_nvml import FakeGpu

from tensile.devices import GIB, PRESETS
from tensile_agent.gpus import Inventory, simulated_gpus


def _capabilities(inventory: Inventory) -> list[tuple[str, int]]:
    return [(g.name, g.compute_capability_major) for g in inventory.gpus.values()]


def test_discovery_reads_each_gpus_compute_capability_from_nvml(nvml_gpus):
    """GPUs no preset names (an L40S, a B200) as well as one a preset names: NVML's figure for each."""
    nvml_gpus(FakeGpu("NVIDIA L40S", 48 * GIB, (8, 9)), FakeGpu("NVIDIA B200", 180 * GIB, (10, 0)),
              FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0)))
    inventory = Inventory.discover()
    assert inventory.reason is None and not inventory.simulated
    assert _capabilities(inventory) == [("NVIDIA L40S", 8), ("NVIDIA B200", 10), ("NVIDIA H100 80GB HBM3", 9)]


def test_an_nvml_error_on_the_compute_capability_leaves_discovery_with_the_presets(nvml_gpus):
    """NVML failing that one call lists the GPU all the same, with its preset's compute capability, unknown (0) where
    no preset names it."""
    nvml_gpus(FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, None), FakeGpu("NVIDIA L40S", 48 * GIB, None))
    inventory = Inventory.discover()
    assert inventory.reason is None
    assert _capabilities(inventory) == [("NVIDIA H100 80GB HBM3", PRESETS["h100"].compute_capability_major),
                                        ("NVIDIA L40S", 0)]
    assert [g.memory_bytes for g in inventory.gpus.values()] == [80 * GIB, 48 * GIB]


def test_simulated_gpus_get_their_presets_compute_capability():
    gpus = simulated_gpus(["a6000:48GiB", "h100:80GiB", "homemade:48GiB"], node="node-a")
    assert [g.compute_capability_major for g in gpus] == [PRESETS["a6000"].compute_capability_major,
                                                          PRESETS["h100"].compute_capability_major, 0]


def test_v1_gpus_shows_the_compute_capability(nvml_gpus):
    nvml_gpus(FakeGpu("NVIDIA L40S", 48 * GIB, (8, 9)))
    with ThreadedAgent(simulate=[]) as server:
        (gpu,) = get(server.url, "/v1/gpus")[1]["gpus"]
    assert (gpu["name"], gpu["compute_capability_major"], gpu["simulated"]) == ("NVIDIA L40S", 8, False)
