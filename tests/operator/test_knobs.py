"""A TrainingJob's knobs and annotations as the operator, the webhook and the hook read them; the training pod's
security context; a job no GPU can hold; the operator's command line. Kopf runs for real against the emulator
(tests/support/kube_emulator.py) where a scenario needs it."""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.operator_harness import (GIB, cluster, gpu_held_by_big, phase, pod_env, simulated_gpu,
                                            start_operator, trainingjob)
from tensile.knobs import MAX_SWAP_RATE, memory_text, parse_swap_rate, unreachable_budget_text
from tensile.trainingjob_spec import SpecError, parse_spec, unknown_annotations
from tensile_operator.placement import Booking, Candidate, Gpu, JointPlanner, Ledger, choose
from tensile_operator.pods import HOOK_SECURITY_CONTEXT, build_pod
from tensile_operator.validation import check, unreachable_budget
from tensile_operator.validation import warnings as admission_warnings
from tensile_hook.settings import HookSettings

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
RATE = "metadata.annotations.tensile.dev/max-swap-rate"
BUDGET = "metadata.annotations.tensile.dev/memory-budget"


def conditions(job: dict | None) -> dict[str, dict]:
    return {c["type"]: c for c in ((job or {}).get("status") or {}).get("conditions") or []}


# ---- 1. one rule for a swap rate ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [2, "2", "1.5", "nan", "inf", "-inf", 0, "0", "-0.5", True, "abc", [0.5]])
def test_a_swap_rate_the_hook_refuses_is_refused_in_the_spec_and_its_annotation(value):
    """`tensile.dev/max-swap-rate: 2` (or nan, inf) was admitted and placed, and the pod's hook then refused
    TENSILE_MAX_SWAP_RATE=2.0 and switched itself off: the job ran at its unscheduled peak on a GPU admitted by its
    scheduled one. TrainingJobs, the CLI and the hook now read a rate by one rule (tensile.knobs)."""
    spec = trainingjob("x")["spec"]
    for raw, annotations, field in ((spec | {"scheduling": {"maxSwapRate": value}}, None, "spec.scheduling.maxSwapRate"),
                                    (spec, {"tensile.dev/max-swap-rate": str(value)}, RATE)):
        with pytest.raises(SpecError) as info:
            parse_spec(raw, annotations)
        (problem,) = info.value.problems
        assert problem.field == field and "(0, 1]" in problem.message, problem
    with pytest.raises(ValueError, match=r"TENSILE_MAX_SWAP_RATE: .*\(0, 1\]"):
        HookSettings.from_env({"TENSILE_MAX_SWAP_RATE": str(value)})


@pytest.mark.parametrize("value", [0.5, 1, "1", "0.01", "1e-3"])
def test_a_swap_rate_in_0_1_is_taken_alike_by_the_spec_the_annotation_and_the_hook(value):
    spec = trainingjob("x")["spec"]
    rate = parse_spec(spec | {"scheduling": {"maxSwapRate": value}}).max_swap_rate
    assert rate == parse_spec(spec, {"tensile.dev/max-swap-rate": str(value)}).max_swap_rate == float(value)
    assert HookSettings.from_env({"TENSILE_MAX_SWAP_RATE": str(rate)}).max_swap_rate == rate  # the pod's env


def test_the_swap_rate_rule_lives_in_core_only():
    """No second copy: the hook's settings (and `tensile run`) read the rate by core's knob, whose rule is core's
    function for its variable and flag as for a TrainingJob."""
    import tensile_hook.settings as settings

    assert settings.MAX_SWAP_RATE is MAX_SWAP_RATE
    assert MAX_SWAP_RATE.parse is MAX_SWAP_RATE.parse_in_job is parse_swap_rate
    assert math.isclose(parse_swap_rate("0.25", "x"), 0.25)


def test_the_webhook_refuses_a_swap_rate_above_one_in_an_annotation(forecaster):
    spec = trainingjob("x", "vgg16", 1)["spec"]
    for value in ("2", "nan", "inf"):
        problems = asyncio.run(check(spec, {"tensile.dev/max-swap-rate": value}, [], forecaster, wait=0))
        assert [p.field for p in problems] == [RATE], problems


# ---- 2, 3, 8. a queued job's knobs -----------------------------------------------------------------------------

@pytest.mark.cluster
def test_a_queued_jobs_budget_lowered_out_of_reach_fails_it_as_at_creation(tmp_path, forecaster):
    """Lowering a queued job's memory-budget below what any plan reaches placed it at once (reserving 1 KiB for
    vgg16 beside a running job: an over-committed GPU); the same budget in the spec at creation fails the job with
    BudgetUnreachable. Now the annotation goes through the same check, and the message names the annotation."""
    async def scenario() -> None:
        async with gpu_held_by_big(tmp_path, forecaster) as (c, app):
            await c.apply(trainingjob("waiting", "vgg16", 1, memoryBudget="3Gi"))
            await c.wait(lambda: phase(c.job("waiting")) == "Queued", 60, "waiting queued")
            await c.annotate("waiting", {"tensile.dev/memory-budget": "1Ki"})
            await c.wait(lambda: phase(c.job("waiting")) in ("Failed", "Admitted", "Running"), 20, "the new budget answered")
            status = c.job("waiting")["status"]
            assert status["phase"] == "Failed", status
            assert status["message"].startswith(BUDGET + ": 1 KiB is below the lowest peak"), status["message"]
            assert conditions(c.job("waiting"))["Forecasted"]["reason"] == "BudgetUnreachable"
            assert conditions(c.job("waiting"))["KnobsApplied"]["status"] == "False"
            assert set(app.capacity.ledger.bookings) == {"default/big"}
            assert all(p["metadata"]["ownerReferences"][0]["name"] == "big" for p in c.pods())

    asyncio.run(scenario())


@pytest.mark.cluster
def test_a_fixed_annotation_on_a_queued_job_clears_its_invalid_annotation_condition(tmp_path, forecaster):
    """max-swap-rate `abc`, then `0.5`, on a queued job: KnobsApplied=False/InvalidAnnotation stayed, also after it ran."""
    async def scenario() -> None:
        async with gpu_held_by_big(tmp_path, forecaster) as (c, app):
            await c.apply(trainingjob("waiting", None, profile="p", memoryBudget="3Gi"))
            await c.wait(lambda: phase(c.job("waiting")) == "Queued", 20, "waiting queued")
            await c.annotate("waiting", {"tensile.dev/max-swap-rate": "abc"})
            await c.wait(lambda: conditions(c.job("waiting")).get("KnobsApplied", {}).get("reason") == "InvalidAnnotation",
                         10, "the bad value named")
            assert RATE in conditions(c.job("waiting"))["KnobsApplied"]["message"]
            await c.annotate("waiting", {"tensile.dev/max-swap-rate": "0.5"})
            await c.wait(lambda: conditions(c.job("waiting")).get("KnobsApplied", {}).get("status") == "True", 10, "the fix taken")
            await c.delete("big")
            await c.wait(lambda: phase(c.job("waiting")) == "Admitted" and c.pods(), 20, "waiting placed")
            pod = next(p for p in c.pods() if p["metadata"]["ownerReferences"][0]["name"] == "waiting")
            assert pod_env(pod)["TENSILE_MAX_SWAP_RATE"] == "0.5"
            await c.set_pod_status(pod, {"phase": "Running"})
            await c.wait(lambda: phase(c.job("waiting")) == "Running", 10, "waiting running")
            assert conditions(c.job("waiting"))["KnobsApplied"]["status"] == "True"

    asyncio.run(scenario())


def test_an_unreachable_budget_is_named_where_it_was_set_in_kib_when_small(forecaster):
    """The webhook said 'spec.memoryBudget: 0 MiB is below ...' for `tensile.dev/memory-budget: 1Ki`."""
    spec = trainingjob("x", "vgg16", 1)["spec"]
    (problem,) = asyncio.run(check(spec, {"tensile.dev/memory-budget": "1Ki"}, [], forecaster, wait=120))
    assert problem.field == BUDGET and problem.message.startswith("1 KiB is below the lowest peak"), problem
    (problem,) = asyncio.run(check(spec | {"memoryBudget": 1000}, None, [], forecaster))
    assert problem.field == "spec.memoryBudget" and problem.message.startswith("1,000 bytes is below"), problem
    job = parse_spec(spec, {"tensile.dev/memory-budget": "64Gi"})
    forecast = forecaster.cached(job.workload, job.scope)
    assert forecast is not None  # else unreachable_budget has nothing to compare with and says None whatever the budget
    assert unreachable_budget(job, forecast) is None


def test_an_unreachable_budget_reads_the_same_from_the_operator_and_tensile_local():
    """One text, the fix in it: a rate below 1 (tensile local plans at the job's own) is named as a second way out."""
    rate_field = "tensile.dev/max-swap-rate"
    at_rate = unreachable_budget_text(1024, int(9.1 * MIB), 0.5, rate_field)
    assert at_rate == ("1 KiB is below the lowest peak any plan reaches at tensile.dev/max-swap-rate 0.5, 9.1 MiB: raise it to "
                       "at least that (e.g. 10Mi), raise tensile.dev/max-swap-rate or reduce spec.workload.batchSize"), at_rate
    for rate in (None, 1.0):  # the operator's forecast plans at full rate
        text = unreachable_budget_text(3 * MIB, 5 * MIB, rate, rate_field)
        assert rate_field not in text and text.endswith("(e.g. 5Mi) or reduce spec.workload.batchSize"), text


def test_memory_amounts_below_a_mib_are_not_shown_as_zero():
    assert memory_text(1024) == "1 KiB" and memory_text(1000) == "1,000 bytes" and memory_text(0) == "0 bytes"
    assert memory_text(512 * 1024) == "512 KiB" and memory_text(3 * MIB) == "3 MiB" and memory_text(16 * GIB) == "16,384 MiB"
    assert memory_text(9.1 * MIB) == "9.1 MiB" and memory_text(100.4 * MIB) == "100 MiB"  # not '9 MiB', which a 9Mi budget would miss


# ---- 4. misspelt annotations -----------------------------------------------------------------------------------

def test_a_misspelt_tensile_annotation_is_recorded_not_ignored():
    spec = parse_spec(trainingjob("x")["spec"], {"tensile.dev/memory-budgett": "1Gi", "example.com/x": "y"})
    assert spec.memory_budget is None and spec.unknown_annotations == ("tensile.dev/memory-budgett",)
    assert unknown_annotations({"tensile.dev/memory-budget": "1Gi", "operator.tensile.dev/last-handled-configuration": "{}"}) == []
    (warning,) = admission_warnings({"tensile.dev/memory-budgett": "1Gi"})
    assert "tensile.dev/memory-budgett (did you mean tensile.dev/memory-budget?)" in warning
    assert "tensile.dev/max-swap-rate" in warning  # the known ones


@pytest.mark.cluster
def test_a_misspelt_annotation_gets_the_job_a_condition_until_it_is_fixed(tmp_path, forecaster):
    async def scenario() -> None:
        async with gpu_held_by_big(tmp_path, forecaster) as (c, app):
            manifest = trainingjob("waiting", None, profile="p", memoryBudget="3Gi")
            manifest["metadata"]["annotations"] = {"tensile.dev/memory-budgett": "512Mi"}
            await c.apply(manifest)
            await c.wait(lambda: phase(c.job("waiting")) == "Queued"
                         and "UnknownAnnotations" in conditions(c.job("waiting")), 20, "waiting queued, the name noted")
            noted = conditions(c.job("waiting"))["UnknownAnnotations"]
            assert noted["status"] == "True" and "did you mean tensile.dev/memory-budget?" in noted["message"], noted
            # another misspelt name only (no knob changed): still said
            await c.annotate("waiting", {"tensile.dev/max-swap-rat": "0.5"})
            await c.wait(lambda: "tensile.dev/max-swap-rat " in conditions(c.job("waiting"))["UnknownAnnotations"]["message"],
                         10, "the second name noted")
            # fixed: the budget is taken (the job fits beside big now) and the condition goes False
            await c.annotate("waiting", {"tensile.dev/memory-budgett": None, "tensile.dev/max-swap-rat": None,
                                         "tensile.dev/memory-budget": "512Mi"})
            await c.wait(lambda: phase(c.job("waiting")) == "Admitted"
                         and conditions(c.job("waiting"))["UnknownAnnotations"]["status"] == "False", 20, "fixed and placed")
            assert phase(c.job("big")) == "Admitted"  # never failed for it

    asyncio.run(scenario())


# ---- 5. PodSecurity "restricted" -------------------------------------------------------------------------------

def test_the_hook_init_container_passes_pod_security_restricted():
    """Restricted requires, on every container: allowPrivilegeEscalation false, capabilities.drop [ALL], runAsNonRoot,
    and seccompProfile RuntimeDefault (or Localhost) unless the pod sets them. The init container had none."""
    body = trainingjob("x", None, profile="p", memoryBudget="1Gi")
    body["metadata"] |= {"namespace": "default", "uid": "u-x"}
    body["spec"]["template"]["spec"]["initContainers"] = [{"name": "tensile-hook", "image": "mine"}, {"name": "setup", "image": "s"}]
    pod = build_pod(body, "node-a", "GPU-a0", None, GIB, None, None)
    inits = pod["spec"]["initContainers"]
    assert [c["name"] for c in inits] == ["tensile-hook", "setup"]
    ours = inits[0]["securityContext"]
    assert ours["allowPrivilegeEscalation"] is False and ours["capabilities"]["drop"] == ["ALL"]
    assert ours["runAsNonRoot"] is True and ours["seccompProfile"]["type"] == "RuntimeDefault"
    assert ours["readOnlyRootFilesystem"] is True  # it writes only to the shared emptyDir
    assert not set(ours.get("capabilities", {}).get("add") or ()) and "privileged" not in ours and "runAsUser" not in ours
    assert ours is not HOOK_SECURITY_CONTEXT  # each pod its own copy
    # runAsNonRoot needs an image whose user the kubelet can check is not root: a numeric, non-zero USER
    users = re.findall(r"^USER\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) > 0, users


def test_a_pod_caps_its_cuda_memory_and_expands_segments_beside_the_users_allocator_setting():
    """TENSILE_MEMORY_CAP carries the admitted size to the hook's sitecustomize; PYTORCH_CUDA_ALLOC_CONF gains
    expandable segments merged with the container's own setting, and an explicit choice of the user's stands."""
    body = trainingjob("x", None, profile="p", memoryBudget="1Gi")
    body["metadata"] |= {"namespace": "default", "uid": "u-x"}
    first, second, third = ({"name": n, "image": "i"} for n in ("first", "second", "third"))
    second["env"] = [{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "max_split_size_mb:128"}]
    third["env"] = [{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:False"}]
    body["spec"]["template"]["spec"]["containers"] = [first, second, third]
    pod = build_pod(body, "node-a", "GPU-a0", None, "t", GIB, None, None, memory_cap=GIB + 512 * MIB)
    envs = [{e["name"]: e["value"] for e in c["env"]} for c in pod["spec"]["containers"]]
    assert [env["TENSILE_MEMORY_CAP"] for env in envs] == [str(GIB + 512 * MIB)] * 3
    assert [env["PYTORCH_CUDA_ALLOC_CONF"] for env in envs] == [
        "expandable_segments:True", "max_split_size_mb:128,expandable_segments:True", "expandable_segments:False"]
    assert [e["name"] for e in pod["spec"]["containers"][1]["env"]].count("PYTORCH_CUDA_ALLOC_CONF") == 1


def test_a_pods_cap_counts_its_gpus_context_apart_and_its_caching_allocator_gets_the_rest():
    """The cap the hook sets limits only the caching allocator; the CUDA context is held beside it. The pod says which
    part of its admitted size its GPU's context is (TENSILE_CONTEXT_BYTES), so the allocator is capped at the rest
    and the process, context included, holds no more than it was admitted with. A job whose GPU is gone by then is
    given the default context, on top of what it was booked with."""
    from tests.support.recording_cuda import RecordingCuda

    from tensile.devices import DEFAULT_CONTEXT_BYTES
    from tensile_hook.memory_cap import cap_memory
    from tensile_operator.pod_creation import admitted_size, context_of

    gpu = Gpu(node="node-a", uuid="GPU-a0", name="g", memory_bytes=10 * GIB, capacity_bytes=10 * GIB,
              context_bytes=GIB // 2)
    booking = Booking("default/x", gpu.uuid, gpu.node, 2 * GIB, budget_bytes=2 * GIB)  # by its budget: no slack
    assert (admitted_size(booking, gpu), context_of(gpu)) == (2 * GIB + GIB // 2, GIB // 2)
    assert (admitted_size(booking, None), context_of(None)) == (2 * GIB + DEFAULT_CONTEXT_BYTES, DEFAULT_CONTEXT_BYTES)
    body = trainingjob("x", None, profile="p", memoryBudget="2Gi")
    body["metadata"] |= {"namespace": "default", "uid": "u-x"}
    pod = build_pod(body, "node-a", "GPU-a0", None, 2 * GIB, None, None, memory_cap=admitted_size(booking, gpu),
                    context_bytes=context_of(gpu))
    env = pod_env(pod)
    assert (env["TENSILE_MEMORY_CAP"], env["TENSILE_CONTEXT_BYTES"]) == (str(2 * GIB + GIB // 2), str(GIB // 2))
    cuda = RecordingCuda(total=10 * GIB)
    cap = cap_memory(cuda, env)
    assert cap is not None and cap.allocator_bytes == 2 * GIB
    assert cuda.calls[-1] == ("set_per_process_memory_fraction", 0.2, 0, 0)


# ---- 6. a job no GPU can hold ----------------------------------------------------------------------------------

def test_a_job_larger_than_every_gpu_is_said_to_fit_none_even_alone(forecaster):
    """Its shortfall counted the jobs on the GPU ("15,697 MiB short even at every job's lowest reachable peak"), so
    nothing said it cannot fit even on an empty GPU."""
    small = Gpu("node-a", "GPU-a0", "Simulated GPU", 4 * GIB, 4 * GIB, simulated=True)
    larger = Gpu("node-b", "GPU-b0", "Simulated GPU", 6 * GIB, 6 * GIB, context_bytes=256 * MIB, simulated=True)
    ledger = Ledger()
    ledger.book(Booking("default/running", small.uuid, small.node, 3 * GIB))
    spec = parse_spec(trainingjob("x", "vgg16", 1)["spec"])
    decision = choose([small, larger], ledger, Candidate("default/huge", None, 8 * GIB, spec.selector), JointPlanner())
    assert decision.gpu is None and decision.too_large, decision
    assert decision.reason.startswith("does not fit even alone on the largest GPU (node-b/GPU-b0: 5,888 MiB free of 6,144 MiB")
    assert "8,192 MiB" in decision.reason and decision.reason.endswith("waits for a larger GPU")
    assert decision.shortfall_bytes == 8 * GIB - (6 * GIB - 256 * MIB)
    forecast = asyncio.run(forecaster.forecast(spec.workload, spec.scope))
    assert forecast is not None
    tiny = Gpu("node-c", "GPU-c0", "Simulated GPU", forecast.min_peak_bytes - MIB, forecast.min_peak_bytes - MIB, simulated=True)
    decision = choose([tiny], Ledger(), Candidate("default/vgg", forecast, None, spec.selector), JointPlanner())
    assert decision.too_large and "even at its lowest reachable peak" in decision.reason, decision
    # room taken by others only: the usual shortfall, not "even alone"
    decision = choose([small], ledger, Candidate("default/mid", None, 2 * GIB, spec.selector), JointPlanner())
    assert decision.gpu is None and not decision.too_large and "short" in decision.reason


@pytest.mark.cluster
def test_a_job_no_gpu_can_hold_stays_queued_saying_so_until_a_larger_gpu_joins(tmp_path, forecaster):
    async def scenario() -> None:
        async with gpu_held_by_big(tmp_path, forecaster) as (c, app):
            await c.apply(trainingjob("huge", None, profile="q", memoryBudget="6Gi"))
            await c.wait(lambda: phase(c.job("huge")) == "Queued" and "Admitted" in conditions(c.job("huge")), 20, "huge queued")
            admitted = conditions(c.job("huge"))["Admitted"]
            assert admitted["status"] == "False" and admitted["reason"] == "NoGpuLargeEnough", admitted
            assert "does not fit even alone on the largest GPU" in admitted["message"]
            assert "lower spec.memoryBudget" in admitted["message"]
            assert c.job("huge")["status"]["message"].endswith("waits for a larger GPU")
            await c.publish_node("node-b", [simulated_gpu("GPU-b0", 8)])
            await c.wait(lambda: phase(c.job("huge")) == "Admitted", 20, "placed on the larger GPU")
            assert c.job("huge")["status"]["placement"]["gpu"] == "GPU-b0"

    asyncio.run(scenario())


# ---- 7. the operator's command line ----------------------------------------------------------------------------

def _cli(args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    environ |= {"HOME": str(tmp_path)} | (env or {})
    # not from the repository root: its operator/ folder would shadow the standard library's `operator`
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token"), reason="runs in a pod")
def test_the_operator_without_credentials_prints_one_line_naming_the_fix(tmp_path):
    """It printed a 54-line traceback from Kopf's start-up handler."""
    done = _cli(["-m", "tensile.cli", "operator", "--metrics-port", "0"], tmp_path)
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no Kubernetes credentials" in lines[0] and "set KUBECONFIG" in lines[0], done.stderr
    bad = tmp_path / "kubeconfig"
    bad.write_text("clusters: [")
    done = _cli(["-m", "tensile_operator.main", "--metrics-port", "0"], tmp_path, {"KUBECONFIG": str(bad)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "fix $KUBECONFIG" in lines[0], done


@pytest.mark.slow
def test_python_m_tensile_operator_main_takes_the_options_and_help(tmp_path):
    """The form docs/operator.md gives ignored --help and started the operator."""
    done = _cli(["-m", "tensile_operator.main", "--help"], tmp_path)
    assert done.returncode == 0 and "--metrics-port" in done.stdout and "--standalone" in done.stdout, done


# ---- 9. the examples say where they run ------------------------------------------------------------------------

def test_the_file_model_example_says_it_is_for_local_mode_which_the_webhook_agrees_with(forecaster):
    """Its comment said the model file could be in "the operator's image for a cluster", but the webhook refuses
    every FILE.py:FUNC model."""
    path = ROOT / "examples" / "trainingjob-mlp-wide.yaml"
    comment = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    assert "operator's image" not in comment and "tensile local" in comment and "refuses" in comment, comment
    spec = yaml.safe_load(path.read_text())["spec"]
    problems = asyncio.run(check(spec, None, [], forecaster))
    assert [p.field for p in problems] == ["spec.workload.model"] and "cannot read" in problems[0].message
