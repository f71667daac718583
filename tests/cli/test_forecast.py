"""`tensile forecast` as a user meets it: JSON fields, table, plot, saved workloads, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.docs_tables import documented_keys

from tensile.cli import main
from tensile.commands import CANNOT_FIT
from tensile.recompute import NATIVE_CREATORS
from tensile.zoo import ZOO

MODELS = str(Path(__file__).parents[1] / "support" / "tracing_models.py")
MLP = "examples/tiny_mlp.py:build"
KIB, MIB = 1 << 10, 1 << 20


def run_json(capsys, *args: str) -> dict:
    assert main(["forecast", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_promised_fields(capsys):
    out = run_json(capsys, "--model", MLP, "--batch-size", "8")
    for key in ("model", "batch_size", "device", "ops", "vanilla_peak_bytes", "peak_op_index", "peak_phase", "bytes_by_role",
                "scheduled_peak_bytes", "msr", "predicted_eor", "predicted_iteration_seconds", "latency_source"):
        assert key in out
    assert out["latency_source"] in ("prior", "calibrated") and out["predicted_iteration_seconds"] > 0
    assert out["scheduled_peak_bytes"] <= out["vanilla_peak_bytes"]
    assert out["device"] == "cuda" and out["batch_size"] == 8 and out["ops"] > 10
    assert sum(out["bytes_by_role"].values()) == out["vanilla_peak_bytes"]


def test_save_then_forecast_from_the_file_gives_the_same_answer(capsys, tmp_path):
    saved = tmp_path / "mlp.json.gz"
    first = run_json(capsys, "--model", MLP, "--device", "cpu", "--save", str(saved))
    second = run_json(capsys, "--workload", str(saved))
    for key in ("vanilla_peak_bytes", "peak_op_index", "signature", "ops", "bytes_by_role"):
        assert first[key] == second[key]


def test_table_and_plot(capsys, tmp_path):
    plot = tmp_path / "timeline.png"
    assert main(["forecast", "--model", MLP, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "vanilla peak" in out and "optimizer_state" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_reserved_peaks_stand_beside_the_allocated_ones(capsys):
    """The caching allocator's segments hold at least what the tensors do, vanilla and under a budget's plan; the
    allocated peaks do not depend on the allocator's settings; the table shows both."""
    planned = ("--model", MLP, "--batch-size", "64", "--memory-budget", "0.9", "--plan-events", "all")
    default = run_json(capsys, *planned)
    expandable = run_json(capsys, *planned, "--expandable-segments")
    for out, flag in ((default, False), (expandable, True)):
        assert out["expandable_segments"] is flag and out["fits"] and out["plan_events"] > 0
        assert out["reserved_peak_bytes"] >= out["vanilla_peak_bytes"]
        assert out["scheduled_reserved_peak_bytes"] >= out["scheduled_peak_bytes"]
    for key in ("vanilla_peak_bytes", "scheduled_peak_bytes", "plan_events"):
        assert default[key] == expandable[key]
    assert main(["forecast", "--model", MLP, "--batch-size", "64"]) == 0
    table = capsys.readouterr().out
    assert "MiB allocated," in table and "MiB reserved" in table and "cuBLAS workspaces" in table


def test_a_cuda_forecast_holds_the_cublas_workspaces_of_its_gpu(capsys, monkeypatch):
    """An MLP multiplies matrices in its forward and its backward pass: two cuBLAS workspaces (the training thread's
    and the autograd engine's), 32 MiB each on an H100, 8 MiB + 128 KiB on an A6000, or what CUBLAS_WORKSPACE_CONFIG
    says; counted in allocated and reserved, never in the tensors' peak, and none on the CPU."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    h100 = run_json(capsys, "--model", MLP, "--gpu", "h100")
    a6000 = run_json(capsys, "--model", MLP, "--gpu", "a6000")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    configured = run_json(capsys, "--model", MLP, "--gpu", "h100")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    none = run_json(capsys, "--model", MLP, "--gpu", "h100")
    cpu = run_json(capsys, "--model", MLP, "--device", "cpu")
    assert h100["cublas_workspace_bytes"] == 64 * MIB
    assert a6000["cublas_workspace_bytes"] == 2 * (8 * MIB + 128 * KIB)
    assert configured["cublas_workspace_bytes"] == 2 * 128 * KIB
    assert cpu["cublas_workspace_bytes"] == none["cublas_workspace_bytes"] == 0
    for out in (h100, a6000, configured, none):
        assert out["vanilla_peak_bytes"] == h100["vanilla_peak_bytes"]
        assert out["reserved_peak_bytes"] >= out["allocated_peak_bytes"]
        assert out["allocated_peak_bytes"] >= out["vanilla_peak_bytes"] + out["cublas_workspace_bytes"]
        assert out["scheduled_allocated_peak_bytes"] >= out["scheduled_peak_bytes"] + out["cublas_workspace_bytes"]
    # 32 MiB workspaces take segments of their own (10 MiB or more: their size) and keep them: the rest is laid out
    # as without them
    assert h100["reserved_peak_bytes"] - none["reserved_peak_bytes"] == 64 * MIB


def test_a_cpu_forecast_reserves_what_it_allocates(capsys):
    """PyTorch's CPU allocator caches nothing: the reserved peaks are the allocated ones."""
    out = run_json(capsys, "--model", MLP, "--batch-size", "64", "--device", "cpu")
    assert out["reserved_peak_bytes"] == out["allocated_peak_bytes"] == out["vanilla_peak_bytes"]
    assert out["scheduled_reserved_peak_bytes"] == out["scheduled_peak_bytes"]


def test_batch_size_scales_activations_not_parameters(capsys):
    small = run_json(capsys, "--model", MLP, "--batch-size", "64", "--optimizer", "sgd")
    large = run_json(capsys, "--model", MLP, "--batch-size", "4096", "--optimizer", "sgd")
    assert small["bytes_by_role"]["param"] == large["bytes_by_role"]["param"]
    assert large["vanilla_peak_bytes"] > small["vanilla_peak_bytes"] * 2


def test_unknown_model_lists_the_known_ones(capsys):
    assert main(["forecast", "--model", "resnet5000"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'resnet5000'" in err and all(name in err for name in ZOO)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", f"{MODELS}:not_a_module"], "item 1"),
        (["--model", "nowhere.py:build"], "does not exist"),
        (["--model", MLP, "--batch-size", "0"], "--batch-size"),
        (["--model", f"{MODELS}:item_in_loss"], "--live"),
        (["--model", MLP, "--micro-batches", "0"], "--micro-batches must be a positive integer (was 0)"),
        (["--model", MLP, "--micro-batches", "-1"], "--micro-batches must be a positive integer (was -1)"),
        (["--model", MLP, "--memory-budget", "1.5"], "fractions of the vanilla peak must be in (0, 1]"),
        (["--workload", "w.json", "--batch-size", "8", "--dtype", "bfloat16"], "--batch-size, --dtype: how to trace --model"),
        (["--workload", "w.json", "--device", "cpu"], "--device: how to trace --model"),  # was ignored in silence
    ],
)
def test_user_errors_exit_2_with_a_message(capsys, args, message):
    assert main(["forecast", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_malformed_workload_file_exits_without_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "tensile.workload", "version": 1, "model": "m", "batch_size": "x"}))
    result = subprocess.run(
        [sys.executable, "-m", "tensile.cli", "forecast", "--workload", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "field 'batch_size'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model", list(ZOO))
def test_every_zoo_model_forecasts(traced, model):
    workload = traced(model, 1)
    assert workload.model == model and len(workload.ops) > 100
    assert any(t.role == "activation" for t in workload.tensors.values())
    assert any(t.reuses is not None for t in workload.tensors.values())


@pytest.mark.slow
def test_a_fresh_process_forecasts_a_transformers_model():
    """timm and transformers import torchvision, whose C++ ops do not load here: the zoo copes."""
    result = subprocess.run(
        [sys.executable, "-m", "tensile.cli", "forecast", "--model", "gpt2", "--batch-size", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "gpt2"


@pytest.mark.slow
def test_memory_budget_and_saved_plan(capsys, tmp_path):
    plan_path = tmp_path / "plan.json"
    # every event kind: at batch 4 activation swaps alone (CUDA's default) do not reach 0.7 of the vanilla peak
    out = run_json(capsys, "--model", "resnet50", "--batch-size", "4", "--memory-budget", "0.7", "--plan-events", "all",
                   "--save-plan", str(plan_path))
    assert out["memory_budget_bytes"] == int(0.7 * out["vanilla_peak_bytes"])
    assert out["msr"] > 0.2 and out["scheduled_peak_bytes"] < out["vanilla_peak_bytes"]
    plan = json.loads(plan_path.read_text())
    assert len(plan["events"]) == out["plan_events"] > 0
    assert {"kind", "tensor", "trigger", "delay"} <= set(plan["events"][0])
    assert plan["signature"] == out["signature"]
    assert plan["memory_budget_bytes"] == out["memory_budget_bytes"]  # `tensile run --plan` keeps to it (was null)


def test_save_and_save_plan_make_their_folders_as_plot_does(capsys, tmp_path):
    workload, plan = tmp_path / "new" / "w.json", tmp_path / "other" / "p.json"
    run_json(capsys, "--model", MLP, "--batch-size", "2", "--save", str(workload), "--save-plan", str(plan))
    assert json.loads(workload.read_text())["model"] == MLP and "events" in json.loads(plan.read_text())


@pytest.mark.parametrize("option", ["--save", "--save-plan", "--plot"])
def test_an_output_path_that_cannot_be_written_is_refused_before_tracing(capsys, tmp_path, monkeypatch, option):
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr("tensile.forecast.trace_workload", lambda *a: pytest.fail("traced before the check"))
    assert main(["forecast", "--model", MLP, option, str(tmp_path / "afile" / "out")]) == 2
    assert f"{option} {tmp_path}/afile/out: {tmp_path}/afile is a file, not a folder" in " ".join(capsys.readouterr().err.split())


def test_a_model_file_imports_a_module_beside_it_as_python_would(capsys, tmp_path):
    """`python wrap.py` finds a module in wrap.py's folder; loading wrap.py for a forecast did not."""
    (tmp_path / "beside_wrap_model.py").write_text(Path(MLP.partition(":")[0]).read_text())
    (tmp_path / "wrap.py").write_text("from beside_wrap_model import build\n")
    out = run_json(capsys, "--model", f"{tmp_path}/wrap.py:build", "--batch-size", "2")
    assert out["vanilla_peak_bytes"] > 0
    assert str(tmp_path) not in sys.path  # only while it loads


def test_an_import_error_in_a_model_file_names_the_file(capsys, tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_for_tensile\n")
    assert main(["forecast", "--model", f"{tmp_path}/broken.py:build"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"importing '{tmp_path}/broken.py' failed" in err and "no_such_module_for_tensile" in err


def test_bad_memory_budget_names_the_option(capsys):
    assert main(["forecast", "--model", MLP, "--memory-budget", "lots"]) == 2
    assert "--memory-budget" in capsys.readouterr().err


@pytest.mark.slow
def test_cuda_plans_keep_to_activation_swaps_unless_told(capsys, tmp_path):
    """On CUDA the hook plans what its native path carries by default (activation swaps, recomputes of
    convolutions and batch norms): the forecast and the plan it saves do the same, and --plan-events all lifts
    it, as TENSILE_PLAN_EVENTS does."""
    from tensile.workload_io import load_workload

    saved, auto_plan, all_plan = tmp_path / "w.json", tmp_path / "auto.json", tmp_path / "all.json"
    auto = run_json(capsys, "--model", "resnet50", "--batch-size", "4", "--save", str(saved), "--save-plan", str(auto_plan))
    every = run_json(capsys, "--workload", str(saved), "--plan-events", "all", "--save-plan", str(all_plan))
    assert auto["activations_only"] and not every["activations_only"]
    workload = load_workload(saved)
    tensors, ops = workload.tensors, workload.ops
    persistent = ("param", "optimizer_state", "input")

    def beyond_activations(path: Path) -> list[dict]:
        return [e for e in json.loads(path.read_text())["events"] if tensors[e["tensor"]].role in persistent
                or (e["kind"] == "recompute" and ops[tensors[e["tensor"]].created_by].name not in NATIVE_CREATORS)]

    assert auto["plan_events"] > 0 and beyond_activations(auto_plan) == []
    recomputed = [e for e in json.loads(auto_plan.read_text())["events"] if e["kind"] == "recompute"]
    assert {ops[tensors[e["tensor"]].created_by].name for e in recomputed} == NATIVE_CREATORS
    assert beyond_activations(all_plan)
    assert every["scheduled_peak_bytes"] < auto["scheduled_peak_bytes"]
    # a budget between the two: "cannot fit ... even with every legal swap and recomputation" was not true of auto
    between = str((auto["scheduled_peak_bytes"] + every["scheduled_peak_bytes"]) // 2)
    assert main(["forecast", "--workload", str(saved), "--memory-budget", between, "--json"]) == CANNOT_FIT
    kept = json.loads(capsys.readouterr().out)
    assert kept["plan_message"].startswith("cannot fit") and "(native events only: --plan-events" in kept["plan_message"]
    assert run_json(capsys, "--workload", str(saved), "--memory-budget", between, "--plan-events", "all")["plan_message"].startswith("fits")


def test_the_json_keys_are_the_documented_ones(capsys):
    """docs/local-mode.md lists each key of `tensile forecast --json` in a table: none missing, none extra."""
    documented = documented_keys("`tensile forecast ... --json` prints")
    assert set(run_json(capsys, "--model", MLP, "--batch-size", "8")) == documented


def test_an_error_in_the_users_model_code_is_one_line_naming_their_file_and_line(capsys, tmp_path):
    """The user's mistake, not Tensile's: their exception, function, file and line, and no traceback through Tensile's
    modules; `--debug` shows the whole traceback."""
    model = tmp_path / "mistake.py"
    model.write_text("def build(batch_size):\n    sizes = {}\n    return sizes['hidden']\n")
    assert main(["forecast", "--model", f"{model}:build"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--model {model}:build: KeyError: 'hidden' (in build, {model}:3;" in err and "Traceback" not in err, err
    assert main(["--debug", "forecast", "--model", f"{model}:build"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "tensile/forecast.py" in err and f"{model}\", line 3" in err, err


def test_an_error_in_the_users_loss_is_theirs_too(capsys, tmp_path):
    """Raised while the trace runs their loss: still their file and line, not the tracer's."""
    model = tmp_path / "loss.py"
    model.write_text(Path(MLP.partition(":")[0]).read_text()
                     + "\n\ndef broken(batch_size):\n    model, batch, _, make_optimizer = build(batch_size)\n"
                       "    def loss_fn(model, batch):\n        raise ValueError('no labels in this batch')\n"
                       "    return model, batch, loss_fn, make_optimizer\n")
    assert main(["forecast", "--model", f"{model}:broken"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "ValueError: no labels in this batch (in loss_fn, " in err and "Traceback" not in err, err


@pytest.mark.parametrize("budget", ["2", "1000000"])
def test_a_byte_budget_under_1_mib_is_refused_with_the_fix(capsys, budget):
    """`--memory-budget 2` meant 2 GiB, not 2 bytes: it planned for 2 bytes in silence."""
    assert main(["forecast", "--model", MLP, "--memory-budget", budget]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--memory-budget: '{budget}' is {int(budget):,} bytes, less than 1 MiB" in err and f"{budget}GiB" in err, err


def test_version_is_the_packages(capsys):
    import tensile

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"tensile {tensile.__version__}"


@pytest.mark.parametrize("command", [[], ["forecast"], ["run"], ["simulate"], ["local"], ["agent"], ["operator"],
                                     ["calibrate"], ["install-hook"]])
def test_help_imports_no_torch(command):
    """Help answers at once: torch (seconds to import) waits until a command needs it."""
    probe = ("import sys\nfrom tensile.cli import main\ntry:\n    main(sys.argv[1:] + ['--help'])\nexcept SystemExit:\n"
             "    pass\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("False"), (done.stdout[-500:], done.stderr[-2000:])
