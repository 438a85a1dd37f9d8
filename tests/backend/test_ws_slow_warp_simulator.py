"""The warp-specialized forward in the CUDA simulator with warp 1 of each warpgroup slowed (FALOWER_SIM_SLOW_WARP,
wgmma.py): the emulated threads otherwise run near lockstep, while on the GPU a warp's wgmma wait returns when its
own part of the warpgroup's product is done. A kernel that rewrites shared memory another warp's part still reads
(the producer warpgroup's Q buffer released before its O's copies have read it; the staged epilogue's rows at
D = 128, o_err 0.29; the producer-less persistent kernel's next Q rows, o_err 1.16 without its barrier, a case cut
for CI time on 2026-11-29: that kernel is a default nowhere) reads wrong numbers here every time (ws_sim_cases.py's SLOW_WARP_CASES, one subprocess; the warp sleeps 0.2 s a read: at 0.05 s, or on one
head, the released buffer's race passed unseen, 2026-11-28)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import assert_forward_close, collect, spawn  # noqa: E402
from ws_sim_cases import SLOW_WARP_CASES, SLOW_WARP_SECONDS  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect(spawn("ws_sim_cases.py", tmp_path_factory.mktemp("kernels"), [*SLOW_WARP_CASES],
                         {"FALOWER_SIM_SLOW_WARP": str(SLOW_WARP_SECONDS)}))


@pytest.mark.parametrize("case", sorted(SLOW_WARP_CASES))
def test_slow_warp_simulator(results, case):
    r = results.get(case)
    assert_forward_close(r)
