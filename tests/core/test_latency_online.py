"""EWMA correction while a job runs, and `tensile calibrate --quick` end to end."""

from __future__ import annotations

import warnings

import pytest

from tensile.cli import main
from tensile.latency import LatencyEWMA, UncalibratedWarning, assign_latencies, iteration_seconds
from tensile.latency.device import cpu_key
from tensile.latency.store import load_model, model_path
from tensile.workload import Op, Workload


def workload(latencies: list[float], shapes=None) -> Workload:
    shapes = shapes or [((64, 64),)] * len(latencies)
    ops = [Op(i, "aten.relu.default", "forward", (), (), shapes=s, latency=t) for i, (t, s) in enumerate(zip(latencies, shapes))]
    return Workload("w", 1, "cpu", {}, ops)


def test_ewma_moves_toward_measurements_by_alpha():
    w = workload([1.0], [((8,),)])
    ewma = LatencyEWMA(w, alpha=0.5)
    assert ewma.corrected_sum() == 1.0  # nothing measured yet: the prediction
    ewma.observe(0, 3.0)
    assert ewma.latency(0) == 3.0  # the first measurement replaces the prediction
    ewma.observe(0, 1.0)
    assert ewma.latency(0) == pytest.approx(2.0)
    for _ in range(30):
        ewma.observe(0, 5.0)
    assert ewma.latency(0) == pytest.approx(5.0, rel=1e-6)


def test_same_shape_ops_share_an_average_and_family_ratio_corrects_unmeasured_ops():
    w = workload([1.0, 1.0, 2.0], [((8,),), ((8,),), ((16,),)])
    ewma = LatencyEWMA(w, alpha=1.0)
    ewma.observe(w.ops[0], 1.5)
    assert ewma.latency(1) == 1.5  # same family, name and shape as op 0
    assert ewma.latency(2) == pytest.approx(3.0)  # unmeasured: prediction x family ratio 1.5
    assert ewma.corrected_sum() == pytest.approx(6.0) and ewma.predicted_sum() == 4.0


def test_corrected_sum_drives_the_replan_rule_and_apply_writes_latencies():
    w = workload([1e-3] * 10)
    ewma = LatencyEWMA(w, alpha=0.3)
    s = ewma.predicted_sum()
    for _ in range(5):
        ewma.observe_iteration([2e-3] * 10)
    s_new = ewma.corrected_sum()
    assert abs(s_new - s) / s > 0.5  # well past a typical threshold: re-plan
    ewma.apply(w)
    assert iteration_seconds(w) == pytest.approx(s_new)
    with pytest.raises(ValueError, match="expected 10"):
        ewma.observe_iteration([1.0])
    with pytest.raises(ValueError):
        LatencyEWMA(w, alpha=0.0)


@pytest.mark.slow
def test_quick_calibrate_end_to_end(tmp_path, traced):
    assert main(["calibrate", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    path = model_path(cpu_key(), tmp_path)
    assert path.exists() and path.stat().st_size < 5 * 1024**2
    model = load_model(path)
    assert model.kind == "cpu" and model.families and model.roofline.flops_per_second > 0
    # one thread: timed on the process CPU clock, with the machine's load recorded
    assert model.meta["clock"] == "cpu" and model.meta["load_average"]["max"] >= 0 and model.view_ops
    w = traced("resnet50", 1, device="cpu")
    w = Workload(w.model, w.batch_size, w.device, w.tensors, [Op(**{f: getattr(o, f) for f in o.__slots__}) for o in w.ops])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedWarning)
        assert assign_latencies(w, "cpu", tmp_path) == "calibrated"
    assert all(op.latency > 0 for op in w.ops)
    assert 0.01 < iteration_seconds(w) < 100


def test_quick_calibrate_never_replaces_the_default_model(tmp_path, monkeypatch, capsys):
    """A quick model predicts worse than the prior: without --out it must not land where forecasts read."""
    monkeypatch.setenv("TENSILE_HOME", str(tmp_path))
    assert main(["calibrate", "--quick", "--threads", "1"]) != 0
    assert "--quick needs --out DIR" in capsys.readouterr().err
    assert not (tmp_path / "latency").exists()
