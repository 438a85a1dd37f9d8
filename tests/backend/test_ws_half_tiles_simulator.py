"""Half tiles in the warp-specialized forward (emit_fa3_ws.half_tiles): a consumer warpgroup multiplies only the
column half of a kv tile that its own 64 rows keep. Run through falower.compile in the CUDA simulator against the
float64 reference with each S / P V helper's calls counted (ws_sim_cases.py's HALF_CASES: a 48-wide window at
D = 128 with ragged M and N, a document mask whose ids change inside tiles, the P-V-only mode); and the emitted
source: which kernels take half tiles when asked (extra half_tiles; off by default: measured no gain on the
H100), and that the others are unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import FORWARD_O_TOL, collect, spawn  # noqa: E402
from ws_sim_cases import HALF_CASES  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect(spawn("ws_sim_cases.py", tmp_path_factory.mktemp("kernels"), [*HALF_CASES]))


@pytest.mark.parametrize("case", sorted(HALF_CASES))
def test_half_tiles_match_the_reference(results, case):
    r = results.get(case)
    assert r is not None and "error" not in r, r
    assert not r["nan"], r
    assert r["o_err"] <= FORWARD_O_TOL[r["dtype"]] and r["lse_err"] <= 1e-3, r
    assert r["lse_inf_ok"], r  # the document's padding rows keep LSE = -inf


@pytest.mark.parametrize("case", sorted(HALF_CASES))
def test_every_half_path_ran(results, case):
    """Whole tiles, the lower half only and the upper half only, for S and for P V (counted per thread call)."""
    r = results.get(case)
    assert r is not None and "error" not in r, r
    n = r["calls"]
    assert n["pv_wgmma"] > 0 and n["pv_half0"] > 0 and n["pv_half1"] > 0, n
    if HALF_CASES[case][-1].get("half_tiles") == "pv":
        assert r["half_mode"] == "pv" and n["qk_halves"] == n["qk_half0"] == n["qk_half1"] == 0, r
    else:
        assert r["half_mode"] == "s" and n["qk_halves"] > 0 and n["qk_half0"] > 0 and n["qk_half1"] > 0, r


def _spec_and_source(example: str, **extra):
    import runpy

    import falower as fl

    g = runpy.run_path(str(HERE.parents[1] / "examples" / f"{example}.py"))["graph"]
    c = fl.compile(g, "numba-cuda", extra={"schedule": "wgmma-ws", "producer": "none", **extra})
    k = c.specialize("f16", D=128)
    return k.spec, k.source


@pytest.mark.parametrize("example", ["causal", "sliding_window", "prefix_lm", "document", "alibi"])
def test_masks_with_row_bounds_take_half_tiles(example):
    from falower.backends.numba_cuda.emit_fa3_ws import half_mode

    spec, src = _spec_and_source(example, half_tiles=True)
    assert half_mode(spec) == "s"
    body = src.split("while j <= kv_last:", 1)[1]
    assert "row_hull(" in src and "warp_min(" in src and "warp_max(" in src
    # every S is m64n64 halves (m64n128 beside m64n64 made ptxas serialize the wgmmas)
    assert "qk_halves(sc" in body and "qk_wgmma(" not in body and "wgmma_ss(\"f16\", 128)" not in src.split("def ")[0]
    assert "pv_half0(" in body and "pv_half1(" in body


@pytest.mark.parametrize("example,extra", [("plain", {"half_tiles": True}), ("bias", {"half_tiles": True}),
                                           ("causal", {}), ("document", {}),
                                           ("causal", {"persistent": 4, "half_tiles": True})])
def test_whole_tiles_elsewhere(example, extra):
    """No row bounds (plain, a bias table), the knob not asked for (the default), or a persistent kernel: whole
    tiles, as before."""
    from falower.backends.numba_cuda.emit_fa3_ws import half_mode

    spec, src = _spec_and_source(example, **extra)
    assert half_mode(spec) == ""
    assert "row_hull(" not in src and "qk_half" not in src and "pv_half" not in src and "hs ==" not in src


def test_pv_mode_keeps_whole_s():
    from falower.backends.numba_cuda.emit_fa3_ws import half_mode

    spec, src = _spec_and_source("document", half_tiles="pv")
    assert half_mode(spec) == "pv"
    body = src.split("while j <= kv_last:", 1)[1]
    assert "qk_wgmma(sc" in body and "qk_half" not in src and "pv_half1(" in body
