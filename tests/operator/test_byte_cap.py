"""One cap on every amount of memory, wherever it is written: 2^62 bytes (tensile.devices.MAX_BYTES), refused with
a message that names the field. The webhook took a budget of 99999Pi (over int64) that the agent refuses."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.operator_harness import trainingjob
from tensile.devices import MAX_BYTES, parse_bytes
from tensile.errors import TensileUserError
from tensile.knobs import MEMORY_BUDGET, KnobError, parse_budget, parse_memory
from tensile_operator.validation import check
from tensile_hook.settings import HookSettings

OVER = ("99999Pi", "4611686018427400000", "1e19", "4097Pi")


def test_the_webhook_refuses_a_budget_over_the_cap_naming_its_field(forecaster):
    spec = trainingjob("x", "vgg16", 1)["spec"]
    for value in (*OVER, 2**63):
        problems = asyncio.run(check(spec | {"memoryBudget": value}, {}, [], forecaster, wait=0))
        assert [p.field for p in problems] == ["spec.memoryBudget"], (value, problems)
        assert "2^62 bytes" in str(problems[0])
        problems = asyncio.run(check(spec, {MEMORY_BUDGET.annotation: str(value)}, [], forecaster, wait=0))
        assert [p.field for p in problems] == [MEMORY_BUDGET.annotation_field], (value, problems)
    problems = asyncio.run(check(spec | {"gpuSelector": {"minMemory": "99999Pi"}}, {}, [], forecaster, wait=0))
    assert [p.field for p in problems] == ["spec.gpuSelector.minMemory"], problems


def test_the_cli_the_hook_and_the_agent_flags_refuse_the_same_amounts():
    for value in OVER:
        with pytest.raises(KnobError, match=r"^--memory-budget: .*2\^62 bytes"):
            parse_budget(value, "--memory-budget")
        with pytest.raises(KnobError, match=r"^TENSILE_MEMORY_BUDGET: .*2\^62 bytes"):
            HookSettings.from_env({"TENSILE_MEMORY_BUDGET": value})
        with pytest.raises(TensileUserError, match=r"^--context-bytes: .*2\^62 bytes"):
            parse_bytes(value, "--context-bytes")
    assert parse_memory(f"{MAX_BYTES}", "f") == parse_bytes("4096Pi") == MAX_BYTES == parse_budget("4096Pi", "f")
