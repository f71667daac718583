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
