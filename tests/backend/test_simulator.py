"""Both kernel schedules in the CUDA simulator (no GPU), against a float64 numpy reference.

The simulator must be switched on before numba.cuda is imported, so the cases run in one subprocess
(sim_cases.py) and this module only reads its JSON lines: the rest of the pytest process is untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import run_cases  # noqa: E402
from sim_cases import CASES  # noqa: E402

TOL = {"f16": 4e-3, "bf16": 3e-2, "f32": 1e-5}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases("sim_cases.py", tmp_path_factory.mktemp("kernels"))


@pytest.mark.slow
@pytest.mark.parametrize("case_id", list(CASES))
def test_simulator_case(results, case_id):
    r = results[case_id]
    assert not r["nan"], r
    assert r["o_err"] <= TOL[r["dtype"]], r
    assert r["lse_err"] <= 1e-4, r
    assert r["lse_inf_where_expected"], r
    assert r["masked_ok"], r
    if "masked-rows" in case_id:
        assert r["masked_rows"] > 0
