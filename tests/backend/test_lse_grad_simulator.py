"""The backward kernels with the LSE's cotangent (lse_grad_sim_cases.py, in the CUDA simulator): every gradient the
IR's with Delta - dlse, within f16's error, and moved by dlse (not the gradients without it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lse_grad_sim_cases import CASES  # noqa: E402
from simulated import collect, spawn  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect(spawn("lse_grad_sim_cases.py", tmp_path_factory.mktemp("kernels")))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_lse_cotangent_moves_the_gradients_as_the_ir(results, case):
    r = results.get(case)
    assert r is not None and "error" not in r, r
    for name, g in r["grads"].items():
        assert g["err"] <= 4e-3 * max(1.0, g["scale"]), (name, g)
        if name == "dv":  # dV = P^T dO does not read Delta
            assert g["moved"] == 0, (name, g)
        else:  # dQ, dK and the tables' gradients do (dS = P (dP - Delta + dlse))
            assert g["moved"] > 0.1 * g["scale"], (name, g)
