"""Packed GQA decoding on the numba-cuda backend in the CUDA simulator (pack_gqa_sim_cases.py): falower.compile's
automatic choice runs the call through the packed graph on decoding's 64-row q tiles, and the numbers are the GQA
graph's (float64 reference), for masks that read the query head (h % 2) or row (causal, a window)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from pack_gqa_sim_cases import CASES  # noqa: E402
from simulated import assert_forward_close, collect, spawn  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect(spawn("pack_gqa_sim_cases.py", tmp_path_factory.mktemp("kernels")))


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_gqa_decoding_matches_the_reference(results, case):
    r = results.get(case)
    assert_forward_close(r)
    assert r["block_q"] == 64 and r["packed"].endswith("_packed"), r
    assert r["lse_inf_ok"], r
