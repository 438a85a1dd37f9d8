"""The softcap's tanh by the FMA pipe's polynomial on tiles whose scores lie in its range, tanh_ex2 elsewhere
(emit_fa2.small_scores), on the two wgmma forward kernels through falower.compile in the CUDA simulator against
the float64 reference (tanh_small_sim_cases.py: ragged tiles, M != N, some query rows scaled out of the range; the
persistent producer kernel in the softcap's default form too). Each case must have taken both paths. The mma.sync
kernel's call site is the same `score_row_calls` lines (test_tanh_small.py checks its branch; the helpers themselves
run there as Python against score_row)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import assert_forward_close, collect, spawn  # noqa: E402
from tanh_small_sim_cases import CASES  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect(spawn("tanh_small_sim_cases.py", tmp_path_factory.mktemp("kernels")))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_small_tanh_matches_the_reference(results, case):
    r = results.get(case)
    assert_forward_close(r)
    assert r["schedule"] == CASES[case][4].get("schedule", "mma"), r
    assert r["bound"] is not None and r["bound"] > 0, r
    assert r["calls"]["score_row_small"] > 0 and r["calls"]["score_row"] > 0, r  # both paths ran
    if CASES[case][4].get("persistent"):  # the softcap's default: two Q buffers, TMA loads, its epilogue at the end
        assert r["form"] == [True, True, False], r
