"""Fixtures of local mode's tests (`tensile local`): none of their own yet; `tiny_workload` comes from
tests/conftest.py."""
