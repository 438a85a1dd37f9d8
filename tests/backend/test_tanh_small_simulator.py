"""The softcap's tanh by the FMA pipe's polynomial on tiles whose scores lie in its range, tanh_ex2 elsewhere
(emit_fa2.small_scores), on the two wgmma forward kernels through falower.compile in the CUDA simulator against
the float64 reference (tanh_small_sim_cases.py: ragged tiles, M != N, some query rows scaled out of the range; the
persistent producer kernel in the softcap's default form too, and in tanh.approx's with ex2_poly). Each softcap case
must have taken all three paths (tanh_tiny, tanh_small, tanh_ex2). The mma.sync kernel's call site is the same
`score_row_calls` lines (test_tanh_small.py checks its branch; the helpers themselves run there as Python against
score_row)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import assert_forward_close, collect, spawn  # noqa: E402
from tanh_small_sim_cases import APPROX_CASES, CASES  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect(spawn("tanh_small_sim_cases.py", tmp_path_factory.mktemp("kernels")))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_small_tanh_matches_the_reference(results, case):
    r = results.get(case)
    assert_forward_close(r)
    assert r["schedule"] == CASES[case][4].get("schedule", "mma"), r
    assert r["bound"] is not None and r["bound"] > 0, r
    assert r["tiny_bound"] is not None and 0 < r["tiny_bound"] < r["bound"], r
    assert r["calls"]["score_row_small"] > 0 and r["calls"]["score_row"] > 0, r  # all three paths ran
    assert r["calls"]["score_row_tiny"] > 0, r
    if CASES[case][4].get("persistent"):  # the softcap's default: two Q buffers, TMA loads, its epilogue at the end
        assert r["form"] == [True, True, False], r


@pytest.mark.parametrize("case", sorted(APPROX_CASES))
def test_tanh_approx_with_exponentials_on_the_fma_pipe(results, case):
    """The softcap with tanh.approx in the automatic choice's form at D = 128: ex2_poly took 8 of each softmax
    row's 32 exponentials (8 calls to 25 of ex2 with alpha's), and O and the LSE match the reference."""
    r = results.get(case)
    assert_forward_close(r)
    assert r["bound"] is None and r["calls"]["score_row_small"] == r["calls"]["score_row_tiny"] == 0, r  # no
    # polynomial path for tanh.approx
    n = APPROX_CASES[case][4]["ex2_poly"]
    assert r["calls"]["ex2_poly"] > 0 and r["calls"]["ex2_poly"] * (32 - n + 1) == r["calls"]["ex2"] * n, r
    assert r["form"] == [True, True, True], r  # two Q buffers, TMA loads, the epilogue in the next item's S
