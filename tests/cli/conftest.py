"""Fixtures of the CLI's tests (`tensile run`, `tensile forecast`): none of their own yet; `traced`, `tiny_workload`
and `agent_server` come from tests/conftest.py."""
