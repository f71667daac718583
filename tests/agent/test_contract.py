"""The agent contract (tensile.agent_contract): shapes, validation, body limits, and that both sides agree."""

from __future__ import annotations

import dataclasses
import gzip
import subprocess
import sys

import pytest

from tensile import agent_contract as c


def test_hook_side_imports_no_web_or_kubernetes():
    code = ("import sys, tensile.agent_client, tensile.agent_contract\n"
            "bad = [m for m in ('fastapi', 'pydantic', 'starlette', 'kopf', 'kubernetes', 'uvicorn', 'prometheus_client') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("model", "contract"), [
    ("RegisterIn", c.RegisterRequest), ("RegisterOut", c.RegisterResponse), ("PlanOut", c.PlanResponse),
    ("MeasurementsIn", c.Measurements), ("MeasurementsOut", c.MeasurementsResponse), ("KnobsIn", c.Knobs),
])
def test_pydantic_models_mirror_the_contract(model, contract):
    from tensile_agent import app

    assert set(getattr(app, model).model_fields) == {f.name for f in dataclasses.fields(contract)}


def test_register_request_round_trip_and_errors():
    request = c.RegisterRequest.from_dict({"job": "a", "signature": "abcdef0123", "max_swap_rate": 0.5})
    assert request.namespace == "default" and request.recompute is True and request.activations_only is False
    assert c.RegisterRequest.from_dict(request.to_dict()) == request
    for body, field in [
        ({"job": "a"}, "workload"),
        ({"job": "-bad", "signature": "abcdef01"}, "job"),
        ({"job": "a", "signature": "abcdef01", "max_swap_rate": 0}, "max_swap_rate"),
        ({"job": "a", "signature": "abcdef01", "memory_budget_bytes": -1}, "memory_budget_bytes"),
        ({"job": "a", "signature": "abcdef01", "token": "short"}, "token"),
        ({"job": "a", "signature": "abcdef01", "colour": "red", "max_swap_rate": 2}, "max_swap_rate"),
        ({"job": "a", "signature": "NOT-HEX"}, "signature"),
        ({"signature": "abcdef01"}, "job"),
        ({"job": "a", "signature": "abcdef01", "activations_only": "yes"}, "activations_only"),
    ]:
        with pytest.raises(c.ContractError) as info:
            c.RegisterRequest.from_dict(body)
        assert info.value.field == field, body


def test_the_allocator_settings_are_checked_naming_the_field():
    """What the hook says of its process's caching allocator: optional (an older hook sends none), and a workspace
    size is an amount of memory, capped as every other."""
    request = c.RegisterRequest.from_dict({"job": "a", "signature": "abcdef01"})
    assert (request.expandable_segments, request.cublas_workspace_bytes) == (None, None)
    told = {"job": "a", "signature": "abcdef01", "expandable_segments": False, "cublas_workspace_bytes": 8 * 2**20}
    assert c.RegisterRequest.from_dict(c.RegisterRequest.from_dict(told).to_dict()) == c.RegisterRequest.from_dict(told)
    for field, value, says in [("expandable_segments", "yes", "true or false"),
                               ("cublas_workspace_bytes", -1, "integer >= 0"),
                               ("cublas_workspace_bytes", 1.5, "integer >= 0"),
                               ("cublas_workspace_bytes", 2**62 + 1, "up to 2^62 bytes")]:
        with pytest.raises(c.ContractError) as info:
            c.RegisterRequest.from_dict({"job": "a", "signature": "abcdef01", field: value})
        assert info.value.field == field and says in info.value.message, (field, value)


def test_the_allocator_cap_is_checked_naming_the_field():
    """The cap the hook set on its process's caching allocator: optional (no cap, or an older hook), and an amount of
    memory, capped as every other."""
    assert c.RegisterRequest.from_dict({"job": "a", "signature": "abcdef01"}).allocator_cap_bytes is None
    told = {"job": "a", "signature": "abcdef01", "allocator_cap_bytes": 12 * 2**30}
    assert c.RegisterRequest.from_dict(c.RegisterRequest.from_dict(told).to_dict()).allocator_cap_bytes == 12 * 2**30
    for value, says in [(-1, "integer >= 0"), ("12GiB", "integer >= 0"), (True, "integer >= 0"),
                        (2**62 + 1, "up to 2^62 bytes")]:
        with pytest.raises(c.ContractError) as info:
            c.RegisterRequest.from_dict({"job": "a", "signature": "abcdef01", "allocator_cap_bytes": value})
        assert info.value.field == "allocator_cap_bytes" and says in info.value.message, value


def test_job_ref_parses_operator_keys():
    assert c.JobRef.parse("team-a/bert").key == "team-a/bert"
    assert c.JobRef.parse("local") == c.JobRef("default", "local")
    assert c.job_path(c.JobRef("ns", "j"), "plan") == "/v1/jobs/ns/j/plan"
    with pytest.raises(c.ContractError):
        c.JobRef.parse("ns/a/b")


def test_measurements_validation_and_folding():
    m = c.Measurements.from_iterations(
        [{"peak_bytes": 10, "seconds": 0.2, "stall_seconds": 0.01, "swap_out_bytes": 5, "swap_in_bytes": 4, "recompute_bytes": 1, "plan_version": 3},
         {"peak_bytes": 30, "seconds": 0.4, "stall_seconds": 0.02, "swap_out_bytes": 5, "swap_in_bytes": 4, "recompute_bytes": 1, "plan_version": 3}],
        op_latencies=[[0, 0.001]])
    assert (m.iterations, m.peak_bytes, m.swap_out_bytes, m.plan_version) == (2, 30, 10, 3)
    assert m.iteration_seconds == pytest.approx(0.3)
    for bad in ({"op_latencies": [[-1, 0.1]]}, {"op_latencies": [[0, float("nan")]]}, {"iterations": 0},
                {"stall_seconds": -1}, {"peak_bytes": True}):
        with pytest.raises(c.ContractError):
            c.Measurements.from_dict(bad)
    with pytest.raises(c.ContractError) as info:  # the unknown field is ignored: the bad known one is what is named
        c.Measurements.from_dict({"unknown": 1, "iterations": 0})
    assert info.value.field == "iterations"


def test_measurements_keep_the_peak_measured_under_a_plan_apart():
    """The recorded first iterations run at the vanilla peak and a native CPU iteration nothing observed reports
    the forecast (peak_source planned): only planned iterations with a measured peak make planned_peak_bytes."""
    iterations = [{"mode": "recording", "peak_bytes": 90, "peak_source": "measured"},
                  {"mode": "planned", "peak_bytes": 60, "peak_source": "measured", "plan_version": 1},
                  {"mode": "planned", "peak_bytes": 70, "peak_source": "planned", "plan_version": 1},
                  {"mode": "guarded", "peak_bytes": 80, "peak_source": "measured"}]
    m = c.Measurements.from_iterations(iterations)
    assert (m.peak_bytes, m.planned_peak_bytes) == (90, 60)
    assert c.Measurements.from_dict(m.to_dict()) == m
    assert c.Measurements.from_iterations([iterations[0], iterations[2]]).planned_peak_bytes is None


def test_measurements_from_an_older_hook_without_the_planned_peak_still_validate():
    m = c.Measurements.from_dict({"plan_version": 1, "iterations": 2, "peak_bytes": 10, "iteration_seconds": 0.1})
    assert m.peak_bytes == 10 and m.planned_peak_bytes is None
    for bad in (-1, True, 1.5, "10"):
        with pytest.raises(c.ContractError) as info:
            c.Measurements.from_dict({"planned_peak_bytes": bad})
        assert info.value.field == "planned_peak_bytes", bad


def test_measurements_carry_the_out_of_memory_retries_of_their_iterations():
    """The retries the hook's guard made of out-of-memory errors are summed over the iterations a post covers, survive
    the round trip, are checked as a count, and are 0 in an older hook's body, which has none."""
    m = c.Measurements.from_iterations([{"peak_bytes": 10, "out_of_memory_retries": 2}, {"peak_bytes": 20},
                                        {"peak_bytes": 30, "out_of_memory_retries": 1}])
    assert m.out_of_memory_retries == 3
    assert c.Measurements.from_dict(m.to_dict()) == m
    assert c.Measurements.from_dict({"iterations": 2, "peak_bytes": 10}).out_of_memory_retries == 0
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(c.ContractError) as info:
            c.Measurements.from_dict({"out_of_memory_retries": bad})
        assert info.value.field == "out_of_memory_retries", bad


def test_knobs_take_operator_names():
    knobs = c.Knobs.from_dict({"maxSwapRate": 0.25, "memoryBudgetBytes": 1000, "recompute": False})
    assert knobs.to_dict() == {"max_swap_rate": 0.25, "memory_budget_bytes": 1000, "recompute": False}
    with pytest.raises(c.ContractError):
        c.Knobs.from_dict({"maxSwapRate": 2})


def test_body_encoding_caps_and_gzip_bomb():
    raw, headers = c.encode_body({"x": "a" * 100_000})
    assert headers["Content-Encoding"] == "gzip"
    assert c.decode_body(raw, "gzip") == b'{"x":"' + b"a" * 100_000 + b'"}'
    bomb = gzip.compress(b"\0" * (20 * 1024**2))
    with pytest.raises(c.BodyTooLarge):
        c.decode_body(bomb, "gzip", cap=1024**2)
    with pytest.raises(c.ContractError):
        c.decode_body(b"not gzip", "gzip")
    with pytest.raises(c.ContractError):
        c.decode_body(b"x", "br")
    with pytest.raises(c.BodyTooLarge):
        c.decode_body(b"x" * 11, None, cap=10)
    assert c.body_cap("POST", "/v1/jobs") == c.MAX_REGISTER_BYTES
    assert c.body_cap("POST", "/v1/jobs/a/b/measurements") == c.MAX_MEASUREMENT_BYTES
    assert c.body_cap("PATCH", "/v1/jobs/a/b/knobs") == c.MAX_SMALL_BYTES


def test_unknown_request_fields_are_ignored_and_named_as_kubernetes_warns():
    """A newer hook's new field reached an older agent as a refusal (422) and the hook planned alone; the API
    server's default (fieldValidation=Warn) ignores it and answers a Warning header. Known fields are still checked."""
    unknown: list[str] = []
    request = c.RegisterRequest.from_dict({"job": "a", "signature": "abcdef01", "zeta": 1, "colour": "red"}, unknown)
    assert request == c.RegisterRequest(job="a", signature="abcdef01") and unknown == ["colour", "zeta"]
    unknown = []
    assert c.Measurements.from_dict({"peak_bytes": 5, "new_figure": 1.5}, unknown).peak_bytes == 5 and unknown == ["new_figure"]
    unknown = []
    assert c.Knobs.from_dict({"maxSwapRate": 0.5, "priority": 3}, unknown) == c.Knobs(max_swap_rate=0.5) and unknown == ["priority"]
    assert c.Knobs.from_dict({"priority": 3}) == c.Knobs()  # without a list: ignored all the same
    with pytest.raises(c.ContractError) as info:  # a caller's own knobs: its typo, refused
        c.strict_knobs({"max_swap_rat": 0.5})
    assert info.value.field == "max_swap_rat" and "max_swap_rate" in str(info.value)
    assert c.unknown_field_warning("x") == '299 - "unknown field \\"x\\""'
    odd = c.unknown_field_warning('é"\n' + "y" * 500)
    assert odd.isascii() and "\n" not in odd and "\r" not in odd and len(odd) < 200  # a valid header, whatever the name
    from tensile.agent_client import agent_warnings

    assert agent_warnings([c.unknown_field_warning("x"), "not a warning"]) == ['unknown field "x"', "not a warning"]
