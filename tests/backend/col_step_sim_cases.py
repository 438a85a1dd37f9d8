"""Simulator cases for test_col_step_simulator.py: scores whose index arithmetic is taken along a row by constant
offsets from the thread's first column, on each tensor-core kernel, through falower.compile against the reference
interpreter in float64, run in a subprocess with NUMBA_ENABLE_CUDASIM=1. One JSON line per case.

- ALiBi, s + w kv + r(q), by its column step (emit_fa2.col_step);
- the relative bias, rel[h, q - kv + N - 1], by a row's index and constant offsets (emit_fa2.row_gather), M > N
  so that some rows' indices leave the table (those rows keep the clamped gather); a thread's rows g and g + 8
  share their loads (emit_fa2.row_gather_shift: -1 here), and the calls of the pair's helpers are counted, so a
  case shows it took both the shared loads and, for a pair with a row outside the table, the rows' own paths.
- the relative bias's runs of the table from a running address (emit_fa3_ws.slice_ptrs): O and LSE against the
  same call with every run clamped, bit for bit, at sizes where runs are read both ways, in each kv order and under
  a mask whose kv loop skips a tile.

The slopes are steep and of both signs (1.5 and -0.75 a unit of distance: a row's offset r(q) + w kv0 moves the
exponent by up to ~200 between tiles, and a negative slope makes far keys the largest scores), so a row offset
applied to the wrong row, tile or thread moves O by far more than the tolerance.

Usage: NUMBA_ENABLE_CUDASIM=1 python col_step_sim_cases.py [case-id ...]
"""

from __future__ import annotations

import os
import sys

sys.setswitchinterval(5e-4)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from sim_script import against_reference, count_calls, example_graph, random_qkv, run_main, tiled_pipeline  # noqa: E402,E501

import falower as fl  # noqa: E402
from falower.ir import dim  # noqa: E402

slopes = fl.capture("slopes", "f32", "H")
N = dim("N")
rel_bias = fl.capture("rel_bias", "f32", ["H", N * 2 - 1])


def _alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _gap(b, h, q_idx, kv_idx):
    """Two intervals a row with all of kv tile 1 (128 .. 255) between them: the kv loop skips that tile."""
    return (kv_idx < 100) | (kv_idx >= 256)


def _relative_bias(score, b, h, q_idx, kv_idx):
    """examples/relative_bias.py's score."""
    return score + rel_bias[h, q_idx - kv_idx + (N - 1)]


def _bands(b, h, q_idx, kv_idx):
    """No row bounds (two intervals a row): partial tiles go through masked_col_score_fn per element."""
    return (kv_idx < 20) | ((kv_idx >= 40) & (kv_idx <= q_idx + 30))


PWG = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 1, "item_order": "dynamic"}  # the persistent
# producer-warpgroup kernel (Q, K and V by TMA), one block: the "pwg" cases' extra, each with its own knobs after it

# id: (mask, M, N, D, tile (bq, bk), spec.extra); the kernel is the extra's (none: mma.sync, the simulator's
# automatic choice). Ragged last q and kv tiles everywhere; M != N where the mask allows it. The relative bias
# cases: mask "relbias" (none: the example itself).
CASES = {
    # the warp-specialized kernel walking causal's range: full, partial (exact row bounds) and ragged tiles; at
    # D = 64 the column term rides in S = Q K^T (emit_fa3_ws.col_mma)
    "ws-causal": ("causal", 130, 130, 64, (128, 32), {"schedule": "wgmma-ws", "producer": "none"}),
    # ... with the column term by FFMA (col_mma off)
    "ws-causal-nocm": ("causal", 130, 130, 64, (128, 32), {"schedule": "wgmma-ws", "producer": "none",
                                                           "col_mma": False}),
    # ... with steep slopes (SLOPES: |w| / scale past emit_fa2.COL_STEP_MAX): the item's A words are zero and every
    # tile goes through the masked path's exact scores (col_steep)
    "ws-causal-steep": ("causal", 130, 130, 64, (128, 32), {"schedule": "wgmma-ws", "producer": "none"}),
    # the same kernel under a mask with no row bounds (masked_col_score_fn), rows that see only the first band
    "ws-bands": ("bands", 40, 100, 64, (128, 32), {"schedule": "wgmma-ws", "producer": "none"}),
    # emit_fa3, one warpgroup a 128 rows (two halves a thread, the second half's rows from wrow)
    "fa3-r128-causal": ("causal", 70, 75, 64, (128, 32), {"schedule": "wgmma", "wg_rows": 128}),
    # the mma.sync kernel without a mask: only the ragged kv tile is masked
    "mma-plain": ("none", 33, 50, 32, (64, 32), {}),
    # ... and emit_fa3, with steep slopes (SLOPES): every tile through the masked path (col_steep)
    "mma-plain-steep": ("none", 33, 50, 32, (64, 32), {}),
    # the mma.sync kernel skipping a warp's masked rows (warp_skip: its own need_mask), one head steep, one not
    "mma-causal-wskip-steep": ("causal", 100, 90, 32, (64, 32), {"warp_skip": True}),
    "fa3-r128-causal-steep": ("causal", 70, 75, 64, (128, 32), {"schedule": "wgmma", "wg_rows": 128}),
    # the persistent producer kernel with each item's kv tiles from the last down, the last one second (emit_fa3_ws.
    # kv_reverse "second", ALiBi's default: kv_last - 1, kv_last, then down): q tile 2 visits 1, 2, 0. (True, the
    # plain mirror, is the tail of this order; its GPU cases are test_wgmma_ws_gpu's extra23 and extra24)
    "pwg-persist-causal-rev2": ("causal", 300, 390, 64, (128, 128), {**PWG, "kv_reverse": "second"}),
    # the relative bias (one head): rows q >= N + kv read past the table (clamped), the others at constant offsets
    "ws-relbias": ("relbias", 128, 100, 64, (128, 32), {"schedule": "wgmma-ws", "producer": "none"}),
    "fa3-r128-relbias": ("relbias", 70, 45, 64, (128, 32), {"schedule": "wgmma", "wg_rows": 128}),
    "mma-relbias": ("relbias", 40, 33, 32, (64, 32), {}),
    # the persistent producer kernel as the relative bias takes it by default at D = 128 (Q, K and V by TMA
    # loads, two Q buffers), each warpgroup's run of the table in shared memory (emit_fa3_ws.row_slice): its
    # entries clamped as the gather clamps them, so rows outside the table read it too (the pairs' fallback never
    # runs), loaded from the run's row kept for the item (slice_rows); two items on one block, each with rows
    # outside the table, kv tile 1 ragged
    "pwg-persist-relbias-slice": ("relbias", 150, 140, 64, (128, 128), dict(PWG)),
    # ... on three consumer warpgroups (192 x 128 tiles at D = 64, each warpgroup its own run, its barrier 10 + cw):
    # two items, rows outside the table in both, M > N
    "pwg3-persist-relbias-slice": ("relbias", 250, 140, 64, (192, 128), dict(PWG)),
    # ... with each tile's run stored and synced while S is in flight (slice_in_s), a kv tile plus one
    "pwg3-persist-relbias-sis-slice": ("relbias", 250, 129, 64, (192, 128), {**PWG, "slice_in_s": True}),
    # ... with the entries by pairs from the run and its copy shifted by one (slice_pairs; the default reads them
    # one at a time from the run alone)
    "pwg-persist-relbias-slp-slice": ("relbias", 150, 140, 64, (128, 128), {**PWG, "slice_pairs": True}),
    # ... with the item's epilogue at its own end (epilogue_in_s off: the run's parity starts outside that state),
    # the run's loads a tile ahead (slice_ahead: an item's first tile's at its start, the next item's after the last)
    "pwg-persist-relbias-noes-slice": ("relbias", 150, 140, 64, (128, 128), {**PWG, "epilogue_in_s": False,
                                                                               "slice_ahead": True}),
    # ... with the run's loads from a running address and entry, clamped only where the warpgroup's run leaves the
    # row (slice_ptrs): q tile 0's first warpgroup reads tile 0 unclamped, every other tile clamped
    "pwg-persist-relbias-slrp-slice": ("relbias", 150, 140, 64, (128, 128), {**PWG, "slice_ptrs": True}),
    # ... on three consumer warpgroups, a kv tile plus one (N = 129: the table 257 entries, one run unclamped)
    "pwg3-persist-relbias-slrp-slice": ("relbias", 250, 129, 64, (192, 128), {**PWG, "slice_ptrs": True}),
    # ... two kv tiles less one (N = 255) under M < N: runs unclamped in both tiles, and clamped at either end
    "pwg-persist-relbias-slrp-m127-slice": ("relbias", 127, 255, 64, (128, 128), {**PWG, "slice_ptrs": True}),
    # ... the kv tiles from the last down (kv_reverse: 2, 1, 0, the running state moved by -1 a tile), and the last
    # one second (kv_reverse "second": 1, 2, 0, the state from tile_at's position)
    "pwg-persist-relbias-slrp-rev-slice": ("relbias", 130, 260, 64, (128, 128), {**PWG, "slice_ptrs": True,
                                                                                 "kv_reverse": True}),
    "pwg-persist-relbias-slrp-rev2-slice": ("relbias", 130, 260, 64, (128, 128), {**PWG, "slice_ptrs": True,
                                                                                  "kv_reverse": "second"}),
    # ... under a mask whose rows keep two intervals (no row bounds, so no walk): kv tile 1 is empty and skipped
    # (0, 2), the state from tile_at's position
    "pwg-persist-relbias-gap-slrp": ("relbias-gap", 130, 300, 64, (128, 128), {**PWG, "slice_ptrs": True}),
    # ... with the boundary tile's entries from the run too, then kv >= N to -inf (slice_edge): the last kv tile
    # ragged (140: 12 columns; 129: one), M != N, rows whose indices leave the table; O and LSE bit for bit those
    # of the same call without it (masked_score_row's per-element gathers)
    "pwg-persist-relbias-sle-slice": ("relbias", 150, 140, 64, (128, 128), {**PWG, "slice_edge": True}),
    "pwg3-persist-relbias-sle-slice": ("relbias", 250, 129, 64, (192, 128), {**PWG, "slice_edge": True}),
    "pwg-persist-relbias-sle-m127-slice": ("relbias", 127, 255, 64, (128, 128), {**PWG, "slice_edge": True}),
    # ... with the entries read from global memory ahead of the waits (row_slice off), and the kept epilogue's rows
    # of O staged a word at a time (stmatrix off: the other cases stage them by stmatrix, the default)
    "pwg-persist-relbias": ("relbias", 150, 140, 64, (128, 128), {**PWG, "row_slice": False, "stmatrix": False}),
    # D = 64's automatic kernel for ALiBi: three consumer warpgroups on 192 x 128 tiles, each its own extra K block
    # (col_mma), two items a block, M != N, the last q and kv tiles ragged
    "pwg3-persist-causal": ("causal", 250, 300, 64, (192, 128), dict(PWG)),
    # D = 128 on the persistent kernel's 128 x 128 tiles with the product (its default there too): one K block for
    # both consumer warpgroups (col_shared: a block each would take the second Q buffer's room), under barrier 15
    "pwg-persist-causal-d128-cm": ("causal", 150, 140, 128, (128, 128), dict(PWG)),
    # ... at sizes where bugs hide: a kv tile plus one (the second kv tile holds one column: the K block's rows 1 ..
    # 127 meet only masked columns) under one ragged q tile of 130 rows, the third warpgroup's rows past M; and two
    # rows against two columns
    "pwg3-persist-causal-130x129": ("causal", 130, 129, 64, (192, 128), dict(PWG)),
    "pwg3-persist-causal-2x2": ("causal", 2, 2, 64, (192, 128), dict(PWG)),
    # ... one head steep and one not, items of both on one block: each item's own A words and col_steep
    "pwg3-persist-causal-steep": ("causal", 250, 300, 64, (192, 128), dict(PWG)),
}
# the slopes a case takes where not [1.5, -0.75]
SLOPES = {"ws-causal-steep": [1.0e5, -2.0e4], "mma-plain-steep": [-300.0, 40.0], "fa3-r128-causal-steep": [50.0, -1e3],
          "mma-causal-wskip-steep": [0.5, 60.0], "pwg3-persist-causal-steep": [1.5, 40.0]}
# the cases whose rows share their loads, and the shift of row q + 8's entries from row q's (in n8 tiles); each
# has pairs inside the table and pairs with a row outside it. The other shift (+1, a table read at q + kv) and the
# mapping of every entry are checked bit for bit on the helpers as Python (test_col_step.py, hypothesis)
PAIRS = {"ws-relbias": -1, "fa3-r128-relbias": -1, "mma-relbias": -1, "pwg-persist-relbias": -1,
         "pwg-persist-relbias-slice": -1, "pwg-persist-relbias-noes-slice": -1, "pwg3-persist-relbias-slice": -1,
         "pwg3-persist-relbias-sis-slice": -1, "pwg-persist-relbias-slp-slice": -1,
         **{c: -1 for c in CASES if "-sle" in c},
         **{c: -1 for c in CASES if "-slrp" in c and c.endswith("-slice")}}


def _record_visits(kern, q0: int) -> list:
    """The kv0 of each tile the first row q0 of the last q tile visits (head 0), in its order: under col_step the
    softmax takes the row's offset from score_raw_fn(0, b, h, q, kv0 + t2) once a tile (col_mma: at kv0 in every
    lane), lane 0's call at kv0 itself (the simulator calls the kernel's module globals, one thread's calls in its
    own order)."""
    glb = kern._kernel.fn.__globals__
    seen: list = []
    raw = glb.get("score_raw_fn")
    if raw is None:
        return seen

    def call(s, b, h, q, kv, *rest):
        if s == 0 and int(h) == 0 and int(q) == q0 and int(kv) % 8 == 0 \
                and glb["cuda"].threadIdx.x % 32 == 0:  # the simulator's cuda, swapped in for the launch
            seen.append(int(kv))
        return raw(s, b, h, q, kv, *rest)

    glb["score_raw_fn"] = call
    return seen


def run_case(case_id: str) -> dict:
    from falower.backends.numba_cuda.emit_fa2 import col_step, row_gather, row_gather_shift
    from falower.backends.numba_cuda.emit_fa3_ws import (col_mma, kv_reverse, slice_ahead, slice_in_s, slice_pairs,
                                                         slice_edge, slice_ptr_step, slice_ptrs, stmatrix_staging,
                                                         tma_loads)
    from falower.passes.check import Reference, bind_dims

    mask, M, N, D, (bq, bk), extra = CASES[case_id]
    B, H = 1, 1 if mask.startswith("relbias") else 2
    rng = np.random.default_rng(5)
    if mask.startswith("relbias"):
        g = example_graph("relative_bias") if mask == "relbias" else fl.attention(
            score_mod=_relative_bias, mask_mod={"relbias-gap": _gap}[mask], name=mask.replace("-", "_"))
        sl = (rng.standard_normal((H, 2 * N - 1)) * 3).astype(np.float32)  # the table, steep
        taken = row_gather
    else:
        mask_mod = {"causal": _causal, "bands": _bands, "none": None}[mask]
        g = fl.attention(score_mod=_alibi, mask_mod=mask_mod, name=f"alibi_{mask}")
        sl = np.array(SLOPES.get(case_id, [1.5, -0.75]), np.float32)
        taken = col_step
    env = bind_dims(g, {"B": B, "H": H, "M": M, "N": N, "D": D})
    q, k, v = random_qkv(rng, B, H, M, N, D)
    ref = Reference.build(g, env, inputs=[*(x.astype(np.float64) for x in (q, k, v)), sl.astype(np.float64)])
    c = fl.compile(g, "numba-cuda", pipeline=tiled_pipeline(bq, bk), path="mma", extra=extra)
    kern = c.kernel(q, k, v, sl)
    calls = count_calls(kern, ("score_row_pair_given", "score_row", "score_pair_slice", "score_pair_slice2",
                               "gather_slice_fn",
                               "slice_load", "slice_load_rp", "stage_rows_stsm", "stage_row_z_box",
                               "mask_past_n", "masked_score_row"))
    visits = _record_visits(kern, ((M - 1) // bq) * bq)
    o, lse = c(q, k, v, sl)
    # each bit-for-bit knob the case asks for, against the same call without it: slice_ptrs against every run clamped
    # (slice_load), slice_edge against the boundary tile by masked_score_row's gathers; None where none is asked
    same = None
    for knob in ("slice_ptrs", "slice_edge"):
        if extra.get(knob):
            o2, lse2 = fl.compile(g, "numba-cuda", pipeline=tiled_pipeline(bq, bk), path="mma",
                                  extra={**extra, knob: False})(q, k, v, sl)
            same = same is not False and bool(np.array_equal(np.asarray(o), np.asarray(o2), equal_nan=True)
                                              and np.array_equal(np.asarray(lse), np.asarray(lse2), equal_nan=True))
    fn = "score_col_fn(" if taken is col_step else "gather_row_fn("
    return {"id": case_id, "dtype": "f16", "taken": taken(kern.spec) and fn in kern.source,
            "schedule": kern.spec.extra.get("schedule", "mma"), "shift": row_gather_shift(kern.spec),
            "early": "gl = score_pair_load(" in kern.source, "calls": calls,
            "tma_loads": kern.spec.extra.get("schedule") == "wgmma-ws" and tma_loads(kern.spec),
            "kv_reverse": kern.spec.extra.get("schedule") == "wgmma-ws" and kv_reverse(kern.spec),
            "slice_ahead": kern.spec.extra.get("schedule") == "wgmma-ws" and slice_ahead(kern.spec),
            "slice_in_s": kern.spec.extra.get("schedule") == "wgmma-ws" and slice_in_s(kern.spec),
            "slice_pairs": kern.spec.extra.get("schedule") == "wgmma-ws" and slice_pairs(kern.spec),
            "slice_ptrs": kern.spec.extra.get("schedule") == "wgmma-ws" and slice_ptrs(kern.spec),
            "slice_edge": kern.spec.extra.get("schedule") == "wgmma-ws" and slice_edge(kern.spec),
            "slice_ptr_step": kern.spec.extra.get("schedule") == "wgmma-ws" and slice_ptrs(kern.spec)
            and slice_ptr_step(kern.spec),
            "stmatrix": kern.spec.extra.get("schedule") == "wgmma-ws" and stmatrix_staging(kern.spec),
            "col_mma": kern.spec.extra.get("schedule") == "wgmma-ws" and col_mma(kern.spec),
            "col_words": "WG_SX(sc" in kern.source,
            "visits": visits, "lse_rel": _lse_rel(lse, ref.outputs["lse"]), "same_without_knob": same,
            **against_reference(o, lse, ref.outputs["o"], ref.outputs["lse"])}


def _lse_rel(lse, want) -> float:
    """The largest LSE error over the kept rows relative to max(1, |LSE|): steep slopes put LSE at ~1e6, where f32's
    own spacing is ~0.1."""
    fin = np.isfinite(want)
    got = np.asarray(lse, np.float64)[fin]
    return float(np.max(np.abs(got - want[fin]) / np.maximum(1.0, np.abs(want[fin])))) if fin.any() else 0.0


def main(ids) -> None:
    run_main(ids or list(CASES), run_case)


if __name__ == "__main__":
    main(sys.argv[1:])
