"""The LSE merge kernel in the CUDA simulator against the interpreter's lse_merge_func (lse_merge_sim_cases.py):
O in f32, f16 and bf16 within the output's rounding, LSE within f32's, rows no part saw at LSE -inf and O 0, no NaN.
The argument checks run here without a kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lse_merge_sim_cases import CASES  # noqa: E402
from simulated import collect, spawn  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect(spawn("lse_merge_sim_cases.py", tmp_path_factory.mktemp("kernels")))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_merge_kernel_matches_the_interpreter(results, case):
    r = results.get(case)
    assert r is not None and "error" not in r, r
    P, B, H, M, D, dt = CASES[case]
    assert r["shape"] == [B, H, M, D] and r["out_dtype"] == {"f32": "float32", "f16": "float16", "bf16": "float32"}[dt]
    assert not r["nan"] and r["unseen_ok"], r
    assert r["o_err"] <= r["tol"] and r["lse_err"] <= 1e-5, r


def test_a_nan_or_inf_part_merges_to_nan_as_the_ir(results):
    r = results["nan-parts"]
    assert "error" not in r, r
    assert r["want_nan_rows"] == 2 and r["lse_nan_same"] and r["o_nan_same"], r
    assert r["lse_err"] <= 1e-5 and r["o_err"] <= 1e-5, r


def test_the_merge_says_what_is_wrong_with_its_arguments():
    from falower.backends.numba_cuda.lse_merge import lse_merge

    o, lse = np.zeros((2, 3, 8), np.float32), np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"lse_merge: o_parts \(2, 3, 8\) must be lse_parts \(2, 4\)"):
        lse_merge(o, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="lse_merge: the parts must be f32, got O float16"):
        lse_merge(o.astype(np.float16), lse)
    with pytest.raises(ValueError, match="lse_merge: out_dtype must be f32, f16 or bf16, got 'f64'"):
        lse_merge(o, lse, "f64")
    with pytest.raises(ValueError, match=r"lse_merge: o_parts \(2, 3, 0\) has no parts or an empty last axis"):
        lse_merge(np.zeros((2, 3, 0), np.float32), lse)
