"""Index arithmetic taken along a row, on every tensor-core forward kernel: ALiBi by its column step
(emit_fa2.col_step) and the relative bias by a row's index and constant offsets (emit_fa2.row_gather; M > N, so
some rows' indices leave the table and keep the clamped gather). ALiBi runs on the warp-specialized kernel under
causal (walking its range) and under a mask without row bounds, on emit_fa3 with 128 rows a warpgroup, and on the
mma.sync kernel without a mask; all through falower.compile in the CUDA simulator against the float64 reference
(col_step_sim_cases.py: steep slopes and tables, ragged tiles, M != N). A row offset left out of the row max, or
taken at the tile's first column instead of the thread's, fails these cases (checked by hand: NaN and O off by 2)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from col_step_sim_cases import CASES, PAIRS, SLOPES  # noqa: E402
from simulated import FORWARD_O_TOL, collect, spawn  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect(spawn("col_step_sim_cases.py", tmp_path_factory.mktemp("kernels")))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_column_step_matches_the_reference(results, case):
    r = results.get(case)
    assert r is not None and "error" not in r, r
    assert r["taken"], r  # the kernel took the path under test
    want = CASES[case][5].get("schedule", "mma")
    assert r["schedule"] == want, r
    assert r["tma_loads"] == (CASES[case][5].get("producer") == "warpgroup"), r
    assert r["kv_reverse"] == bool(CASES[case][5].get("kv_reverse")), r  # the kv tiles from the last down
    # the column term in S = Q K^T: the warp-specialized kernel's default at D = 64 and 128 (emit_fa3_ws.col_mma)
    ws = want == "wgmma-ws" and CASES[case][3] in (64, 128) and not CASES[case][0].startswith("relbias")
    assert r["col_mma"] == r["col_words"] == CASES[case][5].get("col_mma", ws), r
    # the kept epilogue's rows of O by stmatrix (the persistent producer kernel's default) or a word at a time
    stsm, words = r["calls"]["stage_rows_stsm"], r["calls"]["stage_row_z_box"]
    assert (stsm > 0 and words == 0) if r["stmatrix"] else stsm == 0, r
    if CASES[case][5].get("stmatrix") is False:
        assert words > 0, r
    mask, M, N, _, (bq, bk), extra = CASES[case]
    if mask == "causal" and extra.get("schedule") == "wgmma-ws" and case not in SLOPES:
        # the order the last q tile's first row visits (a steep step's rows take no row offset: not recorded)
        q0 = ((M - 1) // bq) * bq
        tiles = list(range(0, min(min(M - 1, q0 + bq - 1), N - 1) // bk + 1))
        order = {False: tiles, True: tiles[::-1],
                 "second": tiles[-2:] + tiles[-3::-1] if len(tiles) > 1 else tiles}[extra.get("kv_reverse", False)]
        assert r["visits"] == [bk * t for t in order], (r["visits"], order)
    assert not r["nan"], r
    assert r["o_err"] <= FORWARD_O_TOL[r["dtype"]], r
    # steep slopes (SLOPES: |w| / scale past emit_fa2.COL_STEP_MAX, each element's exact score) put LSE at up to
    # ~1e6, where f32 is spaced ~0.1: 1e-3 of max(1, |LSE|) (a term added twice, from the wrong column, or split as
    # the step splits it is off by 1e-2 of it or more: 0.29 at LSE ~1 before the exact path)
    assert r["lse_rel"] <= 1e-3 if case in SLOPES else r["lse_err"] <= 1e-3, r
    assert r["lse_inf_ok"], r


@pytest.mark.parametrize("case", sorted(PAIRS))
def test_a_threads_row_pair_shares_its_table_loads(results, case):
    """The pair's shared loads ran (score_row_pair_given's calls beyond those that fell back to two score_row
    calls), and so did the fallback, for a pair with a row outside the table; O matched above. A shared entry
    taken from the wrong n8 tile (a shift's sign flipped) moves O far past the tolerance (checked by hand)."""
    r = results.get(case)
    assert r is not None and "error" not in r, r
    assert r["shift"] == PAIRS[case], r
    pairs, rows = r["calls"]["score_row_pair_given"], r["calls"]["score_row"]
    extra = CASES[case][5]
    if case.endswith("-slice"):  # the run of the table is clamped as the gather is: every pair reads it
        # its entries by 4-byte loads (the default), or by pairs from the run and its shifted copy (slice_pairs)
        by = "score_pair_slice2" if extra.get("slice_pairs", False) else "score_pair_slice"
        other = "score_pair_slice" if by == "score_pair_slice2" else "score_pair_slice2"
        assert pairs > 0 and rows == 0 and r["calls"][by] > 0 and r["calls"][other] == 0 and not r["early"], r
        assert r["slice_pairs"] == (by == "score_pair_slice2"), r
        # its loads from the row kept for the item (slice_rows, the default), a tile ahead where asked
        assert r["calls"]["slice_load"] > 0 and r["calls"]["gather_slice_fn"] == 0, r
        assert r["slice_ahead"] == bool(extra.get("slice_ahead")), r
        assert r["slice_in_s"] == bool(extra.get("slice_in_s")), r
        return
    assert rows > 0 and rows % 2 == 0 and pairs > rows // 2 and r["calls"]["score_pair_slice"] == 0, r
    assert r["calls"]["score_pair_slice2"] == 0, r
    assert r["early"] == (extra.get("schedule") == "wgmma-ws" and extra.get("gather_early") is not False), r


def test_alibi_has_no_row_pairs(results):
    assert all(results[c]["shift"] is None and results[c]["calls"]["score_row_pair_given"] == 0
               for c in CASES if not CASES[c][0].startswith("relbias") and c in results), results



@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c][5].get("slice_ptrs")))
def test_the_runs_from_a_running_address_read_the_clamped_runs_entries(results, case):
    """slice_ptrs: O and LSE bit for bit those of the same call with every run clamped (slice_load), with runs both
    read unclamped and clamped (slice_load_rp's calls beyond its slice_load calls, and those); the running state
    moved by a constant where the order allows (+1, -1 under kv_reverse), from tile_at's position elsewhere."""
    r = results.get(case)
    assert r is not None and "error" not in r, r
    assert r["slice_ptrs"] and r["same_without_knob"] is True and r["shift"] == -1, r
    rp, clamped = r["calls"]["slice_load_rp"], r["calls"]["slice_load"]
    assert rp > clamped > 0 and r["calls"]["gather_slice_fn"] == 0, r
    mask, extra = CASES[case][0], CASES[case][5]
    step = None if mask != "relbias" else {True: -1, "second": None}.get(extra.get("kv_reverse", False), 1)
    assert r["slice_ptr_step"] == step, r
    if mask == "relbias-gap":  # two q tiles, two warpgroups, kv tiles 0 and 2 (1 skipped), 128 threads each
        assert rp == 2 * 2 * 2 * 128, r


@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c][5].get("slice_edge")))
def test_the_boundary_tile_from_the_run_is_bit_identical(results, case):
    """slice_edge: the boundary (ragged) kv tile takes its entries from the warpgroup's run (score_row_pair_given,
    then kv >= N to -inf by mask_past_n) where masked_score_row gathered each from global memory: O and LSE bit for
    bit those of the same call without it."""
    r = results.get(case)
    assert r is not None and "error" not in r, r
    assert r["slice_edge"] and r["same_without_knob"] is True, r
    assert r["calls"]["mask_past_n"] > 0 and r["calls"]["masked_score_row"] == 0, r
