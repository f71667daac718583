"""Fixtures of the operator's tests (tensile_operator)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def forecaster():  # type: ignore[no-untyped-def]
    """The operator's forecast cache, one per test module: each model is traced once however many jobs use it."""
    from tensile_operator.forecasting import Forecaster

    f = Forecaster()
    yield f
    f.close()


@pytest.fixture(autouse=True)
def legacy_access_unless_given(monkeypatch):  # type: ignore[no-untyped-def]
    """An operator built without a GPU access mode runs `legacy` (node names and TensileNodes), as these tests were
    written for; the tests of `dra` mode give OperatorApp theirs."""
    monkeypatch.setenv("TENSILE_GPU_ACCESS", "legacy")
