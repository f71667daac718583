"""Fixtures of the node agent's tests (tensile_agent): none of their own yet; `agent_server` and `tiny_workload` come
from tests/conftest.py, which the hook's and the CLI's tests share."""
