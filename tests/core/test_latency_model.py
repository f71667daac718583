"""The learned correction: training, the model file, and what happens when the file is missing or bad."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

from tensile.errors import TensileUserError
from tensile.latency import QuickCalibrationWarning, UncalibratedWarning, assign_latencies, iteration_seconds, predict_iteration_seconds
from tensile.latency.device import cpu_key
from tensile.latency.families import feature_count
from tensile.latency.mlp import FamilyMLP
from tensile.latency.prior import Roofline
from tensile.latency.store import LatencyModel, load_model, model_path, save_model
from tensile.latency.train import fit_mlp
from tensile.workload import Op, TensorInfo, Workload

ROOF = Roofline(5e10, 1e10, 3e-6, {"forward": 1e-5, "backward": 1e-5, "optimizer": 2e-5})


def small_workload() -> Workload:
    ops = [
        Op(0, "aten.convolution.default", "forward", (0, 1), (2,), shapes=((2, 3, 32, 32), (16, 3, 3, 3)),
           dtypes=("float32", "float32"), params=(None, 1, 1, 1, 1, 1, 1, False, 0, 0, 1), flops=2.6e7, bytes_moved=90_000),
        Op(1, "aten.relu_.default", "forward", (2,), (), shapes=((2, 16, 32, 32),), dtypes=("float32",), bytes_moved=262_144),
        Op(2, "aten.view.default", "forward", (2,), (), shapes=((2, 16, 32, 32),), dtypes=("float32",), params=(2, -1),
           bytes_moved=262_144),
        Op(3, "aten.mm.default", "backward", (2,), (3,), shapes=((2, 16384), (16384, 10)), dtypes=("float32",) * 2,
           flops=655_360, bytes_moved=790_000),
        Op(4, "aten.add_.Tensor", "optimizer", (1,), (), shapes=((16, 3, 3, 3), (16, 3, 3, 3)), dtypes=("float32",) * 2,
           params=(1.0,), bytes_moved=5184),
        Op(5, "aten.nll_loss_forward.default", "forward", (3,), (), shapes=((2, 10), (2,)), bytes_moved=100),
    ]
    tensors = {i: TensorInfo(i, 1024, "activation", "float32") for i in range(4)}
    return Workload("tiny", 2, "cpu", tensors, ops)


def synthetic_model(key: str) -> LatencyModel:
    """A model whose conv and elementwise MLPs apply a constant correction of x2 (zero weights, bias log 2)."""
    families = {}
    for family in ("conv", "elementwise"):
        n = feature_count(family)
        rng = np.random.default_rng(0)
        layers = [(rng.normal(size=(8, n)) * 0.0, np.zeros(8)), (np.zeros((1, 8)), np.array([np.log(2.0)]))]
        families[family] = FamilyMLP(rng.normal(size=n), np.ones(n) + rng.uniform(size=n), layers, samples=64)
    return LatencyModel(key, "test cpu", "cpu", ROOF, families, view_seconds=1e-6, meta={"threads": 1})


@pytest.mark.slow
def test_training_recovers_a_known_function():
    rng = np.random.default_rng(1)
    x = rng.uniform(-2, 2, size=(600, 4))
    truth = lambda x: 0.8 * x[:, 0] - 0.5 * x[:, 1] ** 2 + 0.3 * x[:, 0] * x[:, 2]  # noqa: E731 - x[:, 3] is noise-free junk
    mlp = fit_mlp(x[:500], truth(x[:500]), steps=1500)
    predicted = mlp.log_correction(x[500:])
    residual = predicted - truth(x[500:])
    assert np.sqrt(np.mean(residual**2)) < 0.1 * np.std(truth(x[500:]))


def test_save_load_round_trip(tmp_path):
    model = synthetic_model("cpu-test")
    path = save_model(model, tmp_path)
    assert path == model_path("cpu-test", tmp_path) and path.stat().st_size < 5 * 1024**2
    loaded = load_model(path, expect_key="cpu-test")
    assert loaded.roofline == model.roofline and loaded.view_seconds == model.view_seconds
    x = np.random.default_rng(2).normal(size=(40, feature_count("matmul")))
    trained = fit_mlp(x, x[:, 0] - x[:, 1], hidden=(8, 8, 8), steps=100)
    model.families["matmul"] = trained
    path = save_model(model, tmp_path)
    reloaded = load_model(path).families["matmul"]
    np.testing.assert_allclose(reloaded.log_correction(x), trained.log_correction(x), rtol=1e-4, atol=1e-5)


def test_calibrated_model_applies_its_correction(tmp_path):
    save_model(synthetic_model(cpu_key()), tmp_path)
    workload = small_workload()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedWarning)
        assert assign_latencies(workload, "cpu", tmp_path) == "calibrated"
    conv, relu, view, mm, add, nll = workload.ops
    base = max(conv.flops / ROOF.flops_per_second, conv.bytes_moved / ROOF.bytes_per_second) + ROOF.op_overhead
    assert conv.latency == pytest.approx(2 * base + 1e-5, rel=0.05)  # learned x2, plus the forward gap
    assert view.latency == pytest.approx(1e-6 + 1e-5)  # the measured view constant
    assert nll.latency == pytest.approx(ROOF.op_overhead + 100 / 1e10 + 1e-5)  # no family: the prior
    assert iteration_seconds(workload) == pytest.approx(sum(op.latency for op in workload.ops))


def test_a_quick_grid_model_is_used_and_said_to_be_rough(tmp_path):
    """A model of `tensile calibrate --quick` (made for tests) priced ResNet-50 at 9.7 s and 91.7 s an iteration
    (0.65 s measured) while the forecast called its latencies "calibrated": it now says how rough they are."""
    model = synthetic_model(cpu_key())
    model.meta["grid"] = "quick"
    save_model(model, tmp_path)
    with pytest.warns(QuickCalibrationWarning, match="calibrate --device cpu"):
        assert assign_latencies(small_workload(), "cpu", tmp_path) == "calibrated"


def test_an_op_calibration_measured_is_predicted_by_its_measurement(tmp_path):
    """VGG-16's Adam ops on its FC weight are the same at every batch size: what calibration measured for the
    exact key is the prediction (with the phase's gap in an iteration); other ops keep the MLP / prior."""
    from tensile.latency.online import op_key

    model = synthetic_model(cpu_key())
    workload = small_workload()
    conv, relu, view, mm, add, nll = workload.ops
    model.measured_ops = {op_key(add): 0.25, op_key(relu): 0.5}
    save_model(model, tmp_path)
    assert load_model(model_path(cpu_key(), tmp_path)).measured_ops == model.measured_ops
    assign_latencies(workload, "cpu", tmp_path)
    assert add.latency == pytest.approx(0.25 + 2e-5) and relu.latency == pytest.approx(0.5 + 1e-5)
    base = max(conv.flops / ROOF.flops_per_second, conv.bytes_moved / ROOF.bytes_per_second) + ROOF.op_overhead
    assert conv.latency == pytest.approx(2 * base + 1e-5, rel=0.05)


def test_features_see_the_bytes_the_preceding_op_moved():
    """The same add after a 64 MB op and after a tiny one: different features, and iteration order decides."""
    from tensile.latency.families import features
    from tensile.latency.prior import preceding_bytes

    ops = small_workload().ops
    # a view is priced after the op right before it; the mm after the view finds the relu's bytes in the caches
    assert preceding_bytes(ops) == [0.0, 90_000.0, 262_144.0, 262_144.0, 790_000.0, 5184.0]
    add = ops[4]
    after_big, after_small = features(add, "elementwise", 0.0, 64e6), features(add, "elementwise", 0.0, 64.0)
    assert len(after_big) == feature_count("elementwise") and after_big != after_small


def test_features_see_the_bytes_the_whole_iteration_moves():
    """The same add in a whole model and in a small probe: different features; predicting a workload's ops
    gives each the bytes of all of them (views move none), unless told per op."""
    from tensile.latency.families import features
    from tensile.latency.prior import effective_bytes, iteration_bytes

    ops = small_workload().ops
    assert iteration_bytes(ops) == sum(effective_bytes(o) for o in ops) == iteration_bytes([*ops[:2], *ops[3:]])
    assert iteration_bytes(ops) >= 90_000.0 + 262_144.0 + 790_000.0 + 5184.0
    add = ops[4]
    in_model, in_probe = features(add, "elementwise", 0.0, 0.0, 4e9), features(add, "elementwise", 0.0, 0.0, 4e6)
    assert len(in_model) == feature_count("elementwise") and in_model[:-2] == in_probe[:-2] and in_model != in_probe


def test_missing_model_falls_back_to_prior_with_a_warning(tmp_path):
    workload = small_workload()
    with pytest.warns(UncalibratedWarning, match="tensile calibrate"):
        seconds, source = predict_iteration_seconds(workload, "cpu", tmp_path)
    assert source == "prior" and seconds > 0 and all(op.latency > 0 for op in workload.ops)
    with pytest.warns(UncalibratedWarning, match="tensile calibrate --device cuda"):
        assert assign_latencies(workload, "h100", tmp_path) == "prior"


@pytest.mark.parametrize("damage", ["garbage", "truncated", "json", "version", "shapes", "device"])
def test_bad_model_file_is_an_error_naming_it(tmp_path, damage):
    path = save_model(synthetic_model(cpu_key()), tmp_path)
    data = json.loads(gzip.decompress(path.read_bytes()))
    if damage == "garbage":
        path.write_bytes(b"\x00not a model")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "json":
        path.write_bytes(gzip.compress(b"{not json"))
    else:
        if damage == "version":
            data["version"] = 999
        elif damage == "shapes":
            data["families"]["conv"]["layers"][0]["weight"] = [[1.0, 2.0]]
        elif damage == "device":
            data["device_key"] = "cpu-some-other-processor"
        path.write_bytes(gzip.compress(json.dumps(data).encode()))
    with pytest.raises(TensileUserError, match=str(path)):
        assign_latencies(small_workload(), "cpu", tmp_path)


def test_unknown_device_is_a_user_error(tmp_path):
    with pytest.raises(TensileUserError, match="unknown latency device"):
        assign_latencies(small_workload(), "tpu", tmp_path)


def test_prediction_needs_no_torch(tmp_path):
    """Predicting (prior and calibrated) imports numpy only: the planner side runs without torch."""
    save_model(synthetic_model(cpu_key()), tmp_path)
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from tests.core.test_latency_model import small_workload\n"
        "from tensile.latency import assign_latencies\n"
        f"print(assign_latencies(small_workload(), 'cpu', {str(tmp_path)!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "calibrated"


def _measured(ops_seconds, phase_seconds):
    from tensile.latency.calibrate import Measured
    from tensile.latency.measure import StepTiming
    from tensile.latency.probes import Probe

    ops = [o for o, _ in ops_seconds]
    return Measured(Probe("head", ()), StepTiming(ops, [s for _, s in ops_seconds], sum(phase_seconds.values()), 0.0,
                                                  phase_seconds))


def test_gap_fit_is_led_by_many_cheap_ops_not_one_noisy_big_op():
    """Gap 10 us per op: a probe of 1000 1-us ops shows it; a probe with one 1 s op timed 5% off must not
    move it (its residual of 50 ms over 3 ops would be a 17 ms 'gap')."""
    from tensile.latency.calibrate import fit_phases

    def ops(n, phase):
        return [Op(i, "aten.add.Tensor", phase, (), (), shapes=((4,),)) for i in range(n)]

    many = _measured([(o, 1e-6) for o in ops(1000, "forward")], {"forward": 1000 * 11e-6})
    noisy = _measured([(o, s) for o, s in zip(ops(3, "forward"), (1.0, 1e-6, 1e-6))], {"forward": 1.05 + 3e-5})
    gaps = fit_phases([many, noisy])[0]
    assert gaps["forward"] == pytest.approx(10e-6, rel=0.05)
    assert gaps["backward"] == 0.0


def test_training_samples_are_deduplicated_by_op_key():
    from tensile.latency.calibrate import deduplicated

    a = Op(0, "aten.add.Tensor", "forward", (), (), shapes=((8, 8), (8, 8)))
    b = Op(1, "aten.add.Tensor", "forward", (), (), shapes=((8, 8), (8, 8)))
    c = Op(2, "aten.add.Tensor", "forward", (), (), shapes=((16, 8), (16, 8)))
    ops, seconds, utils, _, _ = deduplicated([a, b, c, a], [1.0, 3.0, 5.0, 100.0], [0.0, 0.0, 0.5, 0.0], [0.0] * 4,
                                             [1e6] * 4)
    assert len(ops) == 2 and sorted(seconds) == [3.0, 5.0] and sorted(utils) == [0.0, 0.5]
    # after a 64 MB op the same add is another sample (it refills the caches that op evicted)
    ops, seconds, _, preceding, _ = deduplicated([a, b, a], [1.0, 3.0, 9.0], [0.0] * 3, [0.0, 0.0, 64e6], [1e6] * 3)
    assert sorted(seconds) == [2.0, 9.0] and sorted(preceding) == [0.0, 64e6]
    # and so is the same add in an iteration that moves 1 GB (a whole model) rather than 1 MB (a probe)
    ops, seconds, *_, iteration = deduplicated([a, b, a], [1.0, 3.0, 9.0], [0.0] * 3, [0.0] * 3, [1e6, 1e6, 1e9])
    assert sorted(seconds) == [2.0, 9.0] and sorted(iteration) == [1e6, 1e9]


def test_phase_fit_recovers_scale_and_gap():
    """Bare phase time = 0.8 x (ops timed one by one) + 12 us per op: both come back; predictions in an
    iteration use them, an op's own time (include_gaps=False) does not."""
    from tensile.latency.calibrate import fit_phases
    from tensile.latency.predict import predict_seconds

    probes = []
    for n, each in ((2000, 2e-6), (50, 4e-3), (400, 1e-4), (10, 2e-2)):
        ops = [Op(i, "aten.add.Tensor", "backward", (), (), shapes=((4,),)) for i in range(n)]
        probes.append(_measured([(o, each) for o in ops], {"backward": 0.8 * n * each + 12e-6 * n}))
    gaps, scales = fit_phases(probes)
    assert scales["backward"] == pytest.approx(0.8, rel=0.02) and gaps["backward"] == pytest.approx(12e-6, rel=0.05)
    assert scales["forward"] == 1.0 and gaps["forward"] == 0.0
    model = synthetic_model(cpu_key())
    model.roofline = Roofline(ROOF.flops_per_second, ROOF.bytes_per_second, ROOF.op_overhead, gaps, scales)
    add = Op(0, "aten.add.Tensor", "backward", (), (), shapes=((1 << 16,),), dtypes=("float32",), bytes_moved=3 << 18)
    alone = predict_seconds([add], model, include_gaps=False)[0]
    assert predict_seconds([add], model)[0] == pytest.approx(0.8 * alone + 12e-6)


def test_robust_timing_rejects_the_slow_outliers_a_shared_machine_adds():
    """Neighbours only ever add time: a repeat far above the fastest is dropped, the rest's median kept."""
    from tensile.latency.measure import outliers, robust_seconds, settled

    samples = [3.47, 24.46, 3.91, 3.48, 3.69]  # a VGG-16 iteration on the busy 2-core machine
    assert outliers(samples) == [1]
    assert robust_seconds(samples) == pytest.approx(3.585)
    assert robust_seconds([2.0]) == 2.0
    assert settled([1.0, 1.1]) and not settled([1.0, 1.5]) and not settled([1.0])
    with pytest.raises(ValueError):
        robust_seconds([])


def test_disagreeing_repeats_are_measured_again_up_to_a_cap():
    from tensile.latency.measure import repeat_until_settled

    values = iter([1.0, 5.0, 9.0, 1.05, 1.0])
    assert repeat_until_settled(lambda: next(values), repeats=2) == [1.0, 5.0, 9.0, 1.05]
    wild = iter(float(10**i) for i in range(20))
    assert len(repeat_until_settled(lambda: next(wild), repeats=3, max_extra=2)) == 5


def test_single_thread_cpu_timing_does_not_count_time_spent_descheduled():
    """The process CPU clock: a 50 ms sleep (as a preemption by a neighbour) adds ~nothing to it."""
    import time

    import torch

    from tensile.latency.measure import host_clock, uses_cpu_clock

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        clock = host_clock("cpu")
        assert uses_cpu_clock("cpu") and not uses_cpu_clock("cuda")
        t0 = clock()
        time.sleep(0.05)
        assert clock() - t0 < 0.02
        torch.set_num_threads(2)
        assert host_clock("cpu") is time.perf_counter  # threads' CPU times would add up
    finally:
        torch.set_num_threads(threads)


def test_cheap_ops_are_timed_in_batches_that_change_the_step_only_once(monkeypatch):
    """Every op is batched here (BATCH_BELOW raised): repeats of an in-place op write into copies, so the
    parameters, state and gradients change once, as in training, and each op is recorded once."""
    import torch

    from tensile.latency import measure

    monkeypatch.setattr(measure, "BATCH_BELOW", 1.0)
    param, grads = torch.ones(64), [torch.full((8,), 2.0), torch.full((8,), 3.0)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        recorder = measure.TimingRecorder("cpu")
        with recorder:
            param.add_(1.0)
            torch._foreach_mul_(grads, 0.5)
            y = param.view(8, 8)
        times = recorder.finish()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(param, torch.full((64,), 2.0)) and y.shape == (8, 8)
    assert torch.equal(grads[0], torch.full((8,), 1.0)) and torch.equal(grads[1], torch.full((8,), 1.5))
    assert len(times) == len(recorder.ops) == 3 and all(t > 0 for t in times)


def test_a_batch_repeats_the_op_until_it_is_long_enough_and_reports_the_mean():
    import torch

    from tensile.latency.measure import BATCH_TARGET, MAX_BATCH, batched_seconds

    class Op:  # a 2 us op on a fake clock
        _schema = torch.ops.aten.add.Tensor._schema

        def __init__(self) -> None:
            self.calls, self.now = 0, 0.0

        def __call__(self, *args, **kwargs):
            self.calls += 1
            self.now += 2e-6

    op = Op()
    assert batched_seconds(op, (torch.ones(1), torch.ones(1)), {}, 5e-6, lambda: op.now) == pytest.approx(2e-6)
    assert op.calls == round(BATCH_TARGET / 5e-6)  # sized from the op's first, slower, run
    op.calls = 0
    batched_seconds(op, (torch.ones(1), torch.ones(1)), {}, 1e-9, lambda: op.now)
    assert op.calls == MAX_BATCH


def test_scratch_arguments_copy_only_what_the_op_writes():
    import torch

    from tensile.latency.measure import scratch_arguments

    a, b = torch.ones(4), torch.ones(4)
    args, _ = scratch_arguments(torch.ops.aten.add_.Tensor, (a, b), {})
    assert args[0] is not a and torch.equal(args[0], a) and args[1] is b
    lists, _ = scratch_arguments(torch.ops.aten._foreach_add_.List, ([a], [b]), {})
    assert lists[0][0] is not a and lists[1][0] is b
    out = torch.empty(4)
    _, kwargs = scratch_arguments(torch.ops.aten.add.out, (a, b), {"out": out})
    assert kwargs["out"] is not out
    same = (a, b)
    assert scratch_arguments(torch.ops.aten.add.Tensor, same, {})[0] is same


def test_view_ops_are_priced_by_name(tmp_path):
    from tensile.latency.calibrate import view_table
    from tensile.latency.predict import predict_seconds

    def op(name):
        return Op(0, f"aten.{name}.default", "forward", (), (), shapes=((4, 4),))

    table = view_table([op("view"), op("view"), op("as_strided"), op("view")], [1e-6, 2e-6, 5e-6, 9e-6])
    assert table == {"as_strided": 5e-6, "view": 2e-6}
    model = synthetic_model(cpu_key())
    model.view_ops = table
    loaded = load_model(save_model(model, tmp_path))
    assert loaded.view_ops == table
    seconds = predict_seconds([op("view"), op("as_strided"), op("t")], loaded, include_gaps=False)
    np.testing.assert_allclose(seconds, [2e-6, 5e-6, model.view_seconds])


def test_a_view_after_a_big_op_is_priced_by_what_ran_before_it():
    """Five or more samples of one name after ops of one size class get their own price; fewer, or a class
    never measured, fall back to the name's median."""
    from tensile.latency.calibrate import view_table
    from tensile.latency.predict import predict_seconds
    from tensile.latency.prior import view_key

    def op(name, moved=0):
        return Op(0, f"aten.{name}.default", "forward", (), (), shapes=((4, 4),), bytes_moved=moved)

    views = [op("view")] * 10 + [op("detach")] * 3
    preceding = [64.0] * 5 + [4e8] * 5 + [4e8] * 3
    seconds = [1e-6] * 5 + [7e-6] * 5 + [5e-6] * 3
    table = view_table(views, seconds, preceding)
    assert table[view_key(op("view"), 64.0)] == 1e-6 and table[view_key(op("view"), 4e8)] == 7e-6
    assert table["view"] == pytest.approx(4e-6) and view_key(op("detach"), 4e8) not in table
    model = synthetic_model(cpu_key())
    model.view_ops = table
    big, small = op("convolution", moved=400_000_000), op("relu", moved=64)
    # one iteration: a view after a big op, one after a small op, a view after a class never measured
    ops = [big, op("view"), small, op("view"), op("relu", moved=4_000_000), op("view"), big, op("detach")]
    seconds = predict_seconds(ops, model, include_gaps=False)
    np.testing.assert_allclose(seconds[[1, 3, 5, 7]], [7e-6, 1e-6, 4e-6, 5e-6])


def test_phase_fit_prefers_whole_model_iterations_over_small_probes():
    """Small probes' bare phases carry per-step host cost (x1.5 here); the zoo models' iterations (x1.0,
    2 us gap) are what jobs run, so with enough of them the fit follows them."""
    from tensile.latency.calibrate import MIN_WHOLE_MODELS, Measured, fit_phases
    from tensile.latency.measure import StepTiming
    from tensile.latency.probes import Probe

    def probe(kind, n, each, bare):
        ops = [Op(i, "aten.add.Tensor", "optimizer", (), (), shapes=((4,),)) for i in range(n)]
        return Measured(Probe(kind, (("model", "m"),) if kind == "zoo" else ()),
                        StepTiming(ops, [each] * n, bare, 0.0, {"optimizer": bare}))

    small = [probe("head", 20, 1e-5, 1.5 * 20 * 1e-5) for _ in range(10)]
    sizes = ((300, 1e-3), (900, 1e-5), (1500, 2e-4), (3000, 5e-5))[:MIN_WHOLE_MODELS]
    whole = [probe("zoo", n, each, n * each + n * 2e-6) for n, each in sizes]
    gaps, scales = fit_phases(small + whole)
    assert scales["optimizer"] == pytest.approx(1.0, abs=0.01) and gaps["optimizer"] == pytest.approx(2e-6, rel=0.1)
    gaps, scales = fit_phases(small)  # without them the probes' x1.5 is fitted, in gap or scale
    assert scales["optimizer"] * 20 * 1e-5 + gaps["optimizer"] * 20 == pytest.approx(1.5 * 20 * 1e-5, rel=0.01)


def test_a_small_family_averages_more_members():
    """Few samples: nine members (a small fit varies more from seed to seed, and costs seconds); many: three."""
    from tensile.latency.train import ENSEMBLE_MEMBERS, SMALL_FAMILY_MEMBERS, SMALL_FAMILY_SAMPLES, fit_ensemble

    x = np.random.default_rng(4).normal(size=(30, feature_count("softmax")))
    assert len(fit_ensemble(x, 0.3 * x[:, 1], steps=5).members) == SMALL_FAMILY_MEMBERS
    x = np.random.default_rng(5).normal(size=(SMALL_FAMILY_SAMPLES, feature_count("softmax")))
    assert len(fit_ensemble(x, 0.3 * x[:, 1], steps=5).members) == ENSEMBLE_MEMBERS < SMALL_FAMILY_MEMBERS


def test_family_ensemble_averages_its_members_and_round_trips(tmp_path):
    from tensile.latency.mlp import FamilyEnsemble
    from tensile.latency.train import fit_ensemble

    x = np.random.default_rng(3).normal(size=(60, feature_count("pool")))
    ensemble = fit_ensemble(x, 0.5 * x[:, 0], members=2, steps=60)
    a, b = (m.log_correction(x) for m in ensemble.members)
    assert not np.allclose(a, b)  # different seeds
    np.testing.assert_allclose(ensemble.log_correction(x), (a + b) / 2)
    model = synthetic_model("cpu-test")
    model.families["pool"] = ensemble
    loaded = load_model(save_model(model, tmp_path)).families
    assert isinstance(loaded["pool"], FamilyEnsemble) and len(loaded["pool"].members) == 2
    np.testing.assert_allclose(loaded["pool"].log_correction(x), ensemble.log_correction(x), rtol=1e-4, atol=1e-5)
    assert len(loaded["conv"].members) == 1  # a single MLP's dict reads as a one-member ensemble


@pytest.mark.slow
def test_a_zoo_model_is_measured_in_a_fresh_process_as_its_trace_records_it():
    """Calibration's zoo path: the model trains in a spawned process of its own (a fresh heap, as a job's), and
    what comes back is the iteration a trace of the same job records, every op timed."""
    from tensile.forecast import trace_workload
    from tensile.latency.calibrate import measure_probes
    from tensile.latency.probes import zoo_probes

    probe = zoo_probes(batches=(1,), models=("resnet50",))[0]
    [measured] = measure_probes([probe], "cpu", timed=1, plain=1)
    traced = trace_workload("resnet50", 1, foreach=probe.foreach, device="cpu")  # the device it is measured on
    assert measured.probe == probe
    assert [op.name for op in measured.timing.ops] == [op.name for op in traced.ops]
    assert len(measured.timing.seconds) == len(traced.ops) and all(s > 0 for s in measured.timing.seconds)
    assert measured.timing.iteration_seconds > 0 and set(measured.timing.phase_seconds) == {"forward", "backward", "optimizer"}


def test_time_spent_alongside_calibration_does_not_count_against_its_budget(monkeypatch):
    """A benchmark times its held-out probes between calibration's (`on_probe`): calibration's budget is for its
    own probes, so that time must not make it stop early. A fake clock makes the accounting exact."""
    from tensile.latency import calibrate as calibration
    from tensile.latency.probes import make_grid

    clock = [0.0]
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])

    def measure(probe: object, *args: object) -> object:  # each probe takes one second of the fake clock
        clock[0] += 1.0
        return probe

    monkeypatch.setattr(calibration, "measure_probe", measure)
    probes = [p for p in make_grid("quick", seed=0, device_type="cpu") if p.kind != "zoo"][:5]
    seen: list = []

    def alongside(probe: object) -> None:  # a hundred seconds of the caller's own work
        seen.append(probe)
        clock[0] += 100.0

    assert calibration.measure_probes(probes, "cpu", budget_s=4.5, on_probe=alongside) == probes
    assert seen == probes
    # its own probes still stop it: past 2.5 s of them, the fourth is not measured
    clock[0] = 0.0
    assert calibration.measure_probes(probes, "cpu", budget_s=2.5, on_probe=alongside) == probes[:3]
