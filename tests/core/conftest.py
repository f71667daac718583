"""Fixtures of the core's tests (tensile): none of their own yet; `traced` and `deterministic` come from
tests/conftest.py, which the CLI's and the hook's tests share."""
