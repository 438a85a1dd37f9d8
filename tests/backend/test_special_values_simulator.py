"""The kernels at special values against the IR (special_values_sim_cases.py, in the CUDA simulator): NaN exactly
where the IR has it in O, LSE and the gradients, -inf LSE only where the IR has it, the rest within f16's error; a
dS past f16's range non-finite where the native IR's is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import collect, spawn  # noqa: E402
from special_values_sim_cases import CASES, NAN_ROWS, OVERFLOW_CASES, assert_as_native  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect(spawn("special_values_sim_cases.py", tmp_path_factory.mktemp("kernels")))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_special_values_match_the_ir(results, case):
    r = results.get(case)
    assert r is not None and "error" not in r, r
    want = NAN_ROWS.get(case, 1)  # the IR: the row that read the NaN entry is NaN (O and LSE)
    assert r["ref_nan_rows"] == want if want is not None else r["ref_nan_rows"] > 1, r
    assert r["o_nan_same"] and r["lse_nan_same"] and r["lse_ninf_same"], r
    assert r["o_err"] <= 4e-3 and r["lse_err"] <= 1e-3, r
    for name, g in r["grads"].items():
        assert g["nan_same"], (name, g)
        assert g["err"] <= 4e-3 * max(1.0, g["scale"]), (name, g)


@pytest.mark.slow
@pytest.mark.parametrize("case", OVERFLOW_CASES)
def test_a_gradient_past_f16s_range_is_inf_in_the_ir_as_in_the_kernels(results, case):
    """dS past 65504: the kernels' f16 products give inf / NaN in dq and dk; the native IR, whose products take
    their operands in f16 (operand_dtype), gives them at the same entries; the f64 reference is finite."""
    r = results.get(case)
    assert r is not None and "error" not in r, r
    assert_as_native(r, 8)
