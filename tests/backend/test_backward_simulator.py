"""The FA2 backward kernels of every example, both paths, in the CUDA simulator: no GPU needed. The cases
run in two subprocesses (the simulator must be on before numba.cuda is imported; two cores on CI)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import collect, spawn  # noqa: E402
from bwd_sim_cases import CASES, F64_CASES, STRIDED_CASES, case_id  # noqa: E402

IDS = [case_id(c) for c in CASES]
F64_IDS = [f"f64-{dq}" for dq in F64_CASES]
STRIDED_IDS = [f"strided-{s}-{p}" for s, p in STRIDED_CASES]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    extra = F64_IDS + STRIDED_IDS
    halves = [IDS[0::2] + extra[0::2], IDS[1::2] + extra[1::2]]  # two processes: CI has two cores
    procs = [spawn("bwd_sim_cases.py", tmp_path_factory.mktemp("kernels"), ids) for ids in halves]
    out = {}
    for p in procs:
        out.update(collect(p))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case_id", IDS)
def test_backward_kernels_match_the_ir(results, case_id):
    r = results[case_id]
    assert "error" not in r, r.get("error")
    assert set(r["grads"]) >= {"dq", "dk", "dv"}
    for name, g in r["grads"].items():
        assert g["shape_ok"] and not g["nan"], (name, g)
        # f16 outputs and f16 P, dS operands of the products: a few half-precision ulps of the largest value
        assert g["err"] <= 4e-3 * max(1.0, g["scale"]), (name, g)
    assert r["masked_dq_zero"], r
    if case_id.startswith("document"):
        assert r["masked_rows"] > 0  # padding tokens: rows with nothing to attend to, gradient zero
    if case_id.startswith("temp_"):
        assert set(r["grads"]) == {"dq", "dk", "dv", "dtemp"}  # the temperature's gradient from the kernels too
    if case_id.startswith(("alibi", "relative_bias", "bias")):
        assert len(r["grads"]) == 4  # the captured table's gradient comes out of the kernel too
    if case_id.startswith("two_tables"):
        assert set(r["grads"]) == {"dq", "dk", "dv", "db1", "db2"}  # each right in shape and value above
    if case_id.endswith("-det"):
        assert r["same_bits"], r  # deterministic: no atomics, the same bits on every run


@pytest.mark.slow
@pytest.mark.parametrize("case_id", F64_IDS)
def test_f64_kernels_are_double_precision(results, case_id):
    """f64 inputs (gradcheck's) run the SIMT kernels in double precision: forward and gradients equal the
    IR's float64 values to ~1e-13 (an f32 step anywhere would show as ~1e-7)."""
    r = results[case_id]
    assert "error" not in r, r.get("error")
    assert r["dtypes"] == ["float64"], r
    assert len(r["errs"]) == 6, r  # o, lse, dq, dk, dv and the captured slopes' or temperature's gradient
    for name, err in r["errs"].items():
        assert err <= 1e-12, (name, r)


@pytest.mark.slow
@pytest.mark.parametrize("case_id", STRIDED_IDS)
def test_strided_views_need_no_copy(results, case_id):
    """[B, H, N, D] views of [B, N, H, D] arrays run through the kernels by their strides: the forward and dK,
    dV equal the contiguous run's bits; dQ (f32 atomic adds in any order) and tables' gradients within rounding."""
    r = results[case_id]
    assert "error" not in r, r.get("error")
    assert r["fwd_equal"], r
    assert r["diffs"]["dk"] == 0 and r["diffs"]["dv"] == 0, r
    assert all(d <= 1e-3 for d in r["diffs"].values()), r
