"""Simulator cases for test_wgmma_bwd_simulator.py: the wgmma backward (emit_fa3_bwd.py) through falower.compile on
tiny ragged shapes, against the backward function's own IR interpreted in float64 (as bwd_sim_cases.py does), run
in a subprocess with NUMBA_ENABLE_CUDASIM=1. One JSON line per case.

The kernels are fed the reference's O and LSE and a random dO; the gradients must be the IR's program: tile classes,
bounds and captured tables' gradients included. wgmma's smallest tiles (64 x 64: one warpgroup) keep the
simulator's time down; cases run the fa2-bwd shape (64 x 128: two warpgroups, dQ's columns split between them, or
with dq_split "k" its kv rows) and the 128 x 128 shape (dQ's rows split). bf16 goes in as raw uint16 bits (numpy
has no bfloat16). Specs the kernel refuses are test_wgmma_bwd_simulator.py's CPU tests (resolve).

Usage: NUMBA_ENABLE_CUDASIM=1 python wgmma_bwd_sim_cases.py [case-id ...]
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from pathlib import Path

sys.setswitchinterval(5e-4)

import numpy as np  # noqa: E402
from sim_script import example_graph, run_main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
BWD = "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize,tile-bwd{{bq={bq},bk={bk},dq={dq}}},canonicalize"
FWD = "decompose-softmax,canonicalize,fuse,tile{bq=64,bk=64},online-softmax{exp2=true},mask-tiles,canonicalize"
# dq_ws (on by default where it measured faster) only where a case asks for it: its producer warpgroup's threads
# would double a one-warpgroup case's time in the simulator; its own cases run it beside the features it touches,
# and the GPU tests run the default kernels
SIM_EXTRA = {"dq_ws": False}

# id: (example, dtype, B, H, HKV, M, N, D, block_q, block_k[, spec.extra beyond bwd_schedule])
CASES = {
    "causal-f16-d64-20x19": ("causal", "f16", 1, 2, 2, 20, 19, 64, 64, 64),
    "alibi-f16-d64-65x63": ("alibi", "f16", 1, 2, 2, 65, 63, 64, 64, 64),  # the slopes' gradient, 2 q tiles
    # the slopes' gradient held across a block's tiles (emit_fa2_bwd.held_grads) where the slope's head changes
    # inside the block's walk: a group of 2 query heads a kv head, 2 q tiles each (the knob's per-tile adds, '-bgt',
    # are the kernel before it: their emitted code is checked on the CPU, test_reduced_gradients_are_held_...)
    "alibi_gqa-f16-d64-65x63": ("alibi_gqa", "f16", 1, 4, 2, 65, 63, 64, 64, 64),
    "gqa-bf16-d64-20x19": ("gqa", "bf16", 1, 2, 1, 20, 19, 64, 64, 64),  # group of 2: one block walks 2 heads
    # the softcap: dS = P fma(dP, c, -Delta c) (1 - t^2), its cap and 1 / (cap sqrt(D)) folded into c
    # (from_ir_bwd._scaled_difference), -Delta c by delta_row_fn where the kernel reads Delta
    "softcap-f16-d64-20x19": ("softcap", "f16", 1, 2, 2, 20, 19, 64, 64, 64),
    # stat_pairs: a column pair's LSE and Delta by one 8-byte shared load each, on the default kernel's tiles
    # (64 x 128, dq_ws and ws_loads: the loaders' statistics in both buffers, 3 ragged q tiles) and under a static
    # mask's two branches; each also run without the knob (SAME_AS_DEFAULT: the gradients bitwise the same)
    "causal-f16-d64-150x130-2wg-wsl-sp": ("causal", "f16", 1, 1, 1, 150, 130, 64, 64, 128,
                                          {"dq_ws": True, "ws_loads": True, "stat_pairs": True}),
    "softcap-bf16-d128-20x19-sp": ("softcap", "bf16", 1, 2, 2, 20, 19, 128, 64, 64, {"stat_pairs": True}),
    # fa2-bwd's shape: two warpgroups, dQ's 64 columns split between them (n32 from +64 bytes in K's rows)
    "sliding_window-f16-d64-63x130-2wg": ("sliding_window", "f16", 1, 1, 1, 63, 130, 64, 64, 128),
    "relative_bias-f16-d128-20x19": ("relative_bias", "f16", 1, 2, 2, 20, 19, 128, 64, 64),  # per-element grads
    # the relative bias's gradient summed by entry in registers first (emit_fa3_bwd.grouped_grads): 3 q tiles of
    # 64 x 128, M > N (rows past the table's ends clamp into its first and last entries)
    "relative_bias-f16-d64-130x70-2wg": ("relative_bias", "f16", 1, 1, 1, 130, 70, 64, 64, 128),
    # the same under a causal mask: the groups' adds in both the full and the partial tiles' code
    "relative_bias_causal-f16-d64-130x130": ("relative_bias_causal", "f16", 1, 1, 1, 130, 130, 64, 64, 64),
    # the bias table's gradient [h, q, kv] (emit_fa3_bwd.v4_grads): rows of 4k words, so four lanes' kv-consecutive
    # entries go by one 16-byte reduction after a transpose by shuffles; 2 batch rows add into the same words, 2
    # ragged q tiles; N = 67 (rows of 67 words: not 16-byte aligned) takes the per-element adds instead. Both with
    # the table's entries read the same way (read_v4: 16-byte loads and the transpose, the next tile's rows
    # prefetched; at N = 67 each element's entry)
    "bias-f16-d64-70x68-2wg": ("bias", "f16", 2, 1, 1, 70, 68, 64, 64, 128),
    "bias-bf16-d64-20x67": ("bias", "bf16", 1, 2, 2, 20, 67, 64, 64, 64),
    # ... a [B, H, M, N] table under GQA (2 query heads a kv head) and a causal mask: the full and the partial tiles'
    # code each read and add by 16 bytes, the leading indices (b, h) the tile's (h changing inside a kv head's
    # walk), M != N; one warpgroup (2 of them at 2 batch rows and 3 kv tiles took 55 s)
    "bias4d_gqa_causal-f16-d64-70x68": ("bias4d_gqa_causal", "f16", 1, 4, 2, 70, 68, 64, 64, 64),
    # two tables' gradients returned in the function's order, not the scatters' (both by 16-byte forms)
    "two_tables-f16-d64-70x68": ("two_tables", "f16", 1, 2, 2, 70, 68, 64, 64, 64),
    # a narrowing cast in the table's index and the mask (i8: rows 128-199 wrap), 4 q tiles; an i32 product wrapping
    # past kv = 63
    "bias_i8-f16-d64-200x68": ("bias_i8", "f16", 1, 1, 1, 200, 68, 64, 64, 64),
    # the grid with the batch rows of a (kv tile, kv head) in consecutive blocks (bwd_batch_inner, asked for): 2 batch
    # rows, 2 kv tiles, 2 kv heads
    "bias-f16-d64-20x130-binner": ("bias", "f16", 2, 2, 2, 20, 130, 64, 64, 64, {"bwd_batch_inner": True}),
    # read_v4 "late" (asked for; the default issues them before the S^T and dP^T wait): each n8 tile's loads in the
    # element code, both sides of rvec0
    "bias-f16-d64-70x68-2wg-late": ("bias", "f16", 1, 1, 1, 70, 68, 64, 64, 128, {"read_v4": "late"}),
    "bias-bf16-d64-20x67-late": ("bias", "bf16", 1, 1, 1, 20, 67, 64, 64, 64, {"read_v4": "late"}),
    "prefix_lm-bf16-d64-100x65-128x128": ("prefix_lm", "bf16", 1, 1, 1, 100, 65, 64, 128, 128),  # dQ's rows split
    "causal-bf16-d128-40x130-2wg-dqk": ("causal", "bf16", 1, 1, 1, 40, 130, 128, 64, 128, {"dq_split": "k"}),
    # dQ's rows staged for bulk reductions (dq_bulk, asked for): one warpgroup, 2 q tiles (the staging rows written
    # again only after the last tile's reductions read them)
    "causal-f16-d64-65x63-bulk": ("causal", "f16", 1, 1, 1, 65, 63, 64, 64, 64, {"dq_bulk": True}),
    # the window's q tiles of a kv tile found by a ballot (emit_fa3_bwd._emit_pair_range): kv tile 0 sees q tiles 0-2
    # of 4, kv tile 1 q tiles 2-3; the walk ends at the last, not at nq (ending one early fails it: dq err 1.95)
    "sliding_window-f16-d64-200x130": ("sliding_window", "f16", 1, 1, 1, 200, 130, 64, 64, 128),
    # interior tiles (q and kv rows 0-127) beside ragged ones: the elementwise code's one copy (interior_split off)
    # and the exponential's argument unfolded (exp_fold off); the default's two copies run in the cases above; the
    # slope gradient's distances recomputed for it (grad_dist), as float(kv) - float(q)
    "alibi-f16-d64-130x130-nois-noef-gd": ("alibi", "f16", 1, 1, 1, 130, 130, 64, 64, 64,
                                           {"interior_split": False, "exp_fold": False, "grad_dist": True}),
    # the grid with a head's kv tiles in consecutive blocks (kv_major, the default without a mask): 2 batch rows, a
    # GQA group of 2, 3 kv tiles, one ragged q tile (M = 70 and two q tiles took 68 s: cut for CI time, 2026-11-29);
    # dK and dV by TMA tensor stores (dkdv_tma, asked for: the last kv tile's rows past N not written, the (b, kv
    # head) slice by the map's third coordinate)
    "gqa-bf16-d64-20x130": ("gqa", "bf16", 2, 2, 1, 20, 130, 64, 64, 64, {"dkdv_tma": True}),
    # the grid in groups of 2 kv heads (kv_group), 3 heads, walked by a persistent launch (bwd_persistent) of 2
    # blocks: 12 places (3 kv tiles x 2 groups of 2 heads), the last group's second place skipped (9 real items),
    # one item's staged dK / dV copied while the next one's K, V and first Q, dO load (2 batch rows, 24 places, took
    # 29 s: one row since 2026-11-29, for CI time)
    "causal-f16-d64-70x130-kvg2-pers": ("causal", "f16", 1, 3, 3, 70, 130, 64, 64, 64,
                                        {"kv_group": 2, "bwd_persistent": 2}),
    # a data mask's block lists (block_mask "list": each kv tile's non-empty (head, q tile) pairs, made once per data
    # by the list kernel): 2 batch rows of sorted document ids with padding (fully masked rows), 3 x 2 tiles, on the
    # default kernel (64 x 128 tiles, dq_ws and ws_loads by "auto"; 2 heads at 64 x 64 without them took 44 s)
    "document-f16-d64-130x130": ("document", "f16", 2, 1, 1, 130, 130, 64, 64, 128, {"dq_ws": "auto"}),
    # ... under GQA (a list entry's head of the group decoded from it * 2 + partial), M != N; dK and dV by TMA tensor
    # stores (dkdv_tma, asked for) into 2 kv heads' slices of their maps
    "document_gqa-bf16-d64-100x130": ("document_gqa", "bf16", 1, 4, 2, 100, 130, 64, 64, 64, {"dkdv_tma": True}),
    # dQ's slabs handed to a producer warpgroup (dq_ws, asked for): two consumer warpgroups splitting dQ's columns
    # (slabs of 64 x 32), 3 ragged q tiles (two slabs a warpgroup, one written twice; the accumulator in slab order,
    # padded to whole tiles, zeroed by the Delta kernel and read back by the conversion; many heads: the GPU tests)
    "causal-f16-d64-130x130-2wg-dqws": ("causal", "f16", 1, 1, 1, 130, 130, 64, 64, 128,
                                        {"dq_ws": True, "ws_loads": False}),
    # ... with dQ's rows split between the warpgroups (128 x 128) and one slab a warpgroup (two alternate by default),
    # and with one consumer warpgroup (no setmaxnreg) under a block list
    "prefix_lm-bf16-d64-100x65-128x128-dqws": ("prefix_lm", "bf16", 1, 1, 1, 100, 65, 64, 128, 128,
                                               {"dq_ws": True, "dq_ws_slabs": 1}),
    "document-f16-d64-130x130-dqws": ("document", "f16", 1, 1, 1, 130, 130, 64, 64, 64, {"dq_ws": True}),
    # Q, dO, LSE and Delta of the next q tile loaded by two producer warps (ws_loads): 4 q tiles a kv tile (tiles 1
    # and 3 in buffer 1, its mbarrier completing at parity 0 then 1), the last one ragged, one ragged kv tile; at
    # D = 128, where a row holds two 64-column blocks (a loader thread copies a chunk of each: its rows 4 apart had
    # broken the swizzle there, dq err 1.79, a review's find; D = 64 is the same code's one pass)
    "causal-bf16-d128-200x70-2wg-wsl": ("causal", "bf16", 1, 1, 1, 200, 70, 128, 64, 128,
                                        {"dq_ws": True, "ws_loads": True}),
    # the next q tile's S^T and dP^T issued at this tile's end (sdp_ahead): after dQ's hand-off on the loader warps'
    # buffers (each issue waits its buffer's mbarrier: 4 tiles, both parities), and beside dQ's GEMM on the
    # consumers' own loads; the last tile's issue reads a stale buffer that nothing uses (scaling the next tile's
    # Q by the wrong buffer, (buf ^ 1) -> buf, fails it: dq err ~1)
    # ... with dK's GEMM beside dV's (dk_after_dq False, the order before the seventy-second session), its gradients
    # bitwise the default's (dK after dQ: SAME_AS_DEFAULT)
    "causal-bf16-d128-200x70-2wg-wsl-nodkl": ("causal", "bf16", 1, 1, 1, 200, 70, 128, 64, 128,
                                              {"dq_ws": True, "ws_loads": True, "dk_after_dq": False}),
    # dk_after_dq's default at D = 128 (64 x 128 tiles, dq_ws and ws_loads by "auto": the default kernel) beyond
    # causal: plain (dK and dV by row copies, in_tile refusing it), GQA (a kv head's walk over 2 query heads) and a
    # static window (dK / dV by TMA tensor stores), each with a ragged last q tile
    "plain-f16-d128-130x140-2wg-dkl": ("plain", "f16", 1, 1, 1, 130, 140, 128, 64, 128, {"dq_ws": "auto"}),
    "gqa-bf16-d128-20x130-2wg-dkl": ("gqa", "bf16", 1, 2, 1, 20, 130, 128, 64, 128, {"dq_ws": "auto"}),
    "sliding_window-f16-d128-200x130-2wg-dkl": ("sliding_window", "f16", 1, 1, 1, 200, 130, 128, 64, 128,
                                                {"dq_ws": "auto"}),
    "causal-bf16-d128-200x70-2wg-wsl-sdpt": ("causal", "bf16", 1, 1, 1, 200, 70, 128, 64, 128,
                                             {"dq_ws": True, "ws_loads": True, "sdp_ahead": "top"}),
    "causal-f16-d64-130x130-2wg-dqws-sdpq": ("causal", "f16", 1, 1, 1, 130, 130, 64, 64, 128,
                                             {"dq_ws": True, "ws_loads": False, "sdp_ahead": "dq"}),
    # dK and dV staged and stored in the walk's last tile under its dQ GEMM (dkdv_in_tile, asked for): D = 128 on the
    # default kernel's tiles (dq_ws, ws_loads), 4 q tiles (the last in buffer 1: dK's boxes in buffer 0's Q and dO
    # tiles, dV's in V's rows), kv rows past N; each also run with the knob off (SAME_AS_DEFAULT: dK, dV and dQ
    # bitwise the default kernel's)
    "causal-bf16-d128-200x70-2wg-wsl-intile": ("causal", "bf16", 1, 1, 1, 200, 70, 128, 64, 128,
                                               {"dq_ws": True, "ws_loads": True, "dkdv_in_tile": True}),
    # ... one warpgroup (its 4 warps' dK boxes in buffer 1's Q tile), 2 batch rows and heads (the maps' third
    # coordinate), one q tile, and kv tiles 1 and 2 walking none (their zeros staged after the loop, after a barrier:
    # without it another thread's K, V copies landed in V's rows under the staging, a race the simulator names)
    "causal-f16-d64-20x130-intile": ("causal", "f16", 2, 2, 2, 20, 130, 64, 64, 64, {"dkdv_in_tile": True}),
    # the two consumer warpgroups out of lockstep (bwd_pingpong): dQ by each warpgroup's own kv rows (dq_split "k")
    # through its own 64 x D slab, both slabs added into the same q tile; per-warpgroup barriers, S^T / dP^T issued in
    # turns; the loader warps serving both. M != N, ragged q and kv tiles (3 q tiles: both buffers, the last ragged;
    # 2 kv tiles, the second ragged); D = 128 (one slab a warpgroup: two do not fit) with 4 q tiles under causal
    # (both mbarrier parities); a document's block lists (2 batch rows, fully masked rows). Each also run with the
    # knob off (DKDV_AS_DEFAULT: dK and dV bitwise, dQ within the tolerance: its adds come in another order)
    "plain-f16-d64-150x140-2wg-pp": ("plain", "f16", 1, 1, 1, 150, 140, 64, 64, 128,
                                     {"dq_ws": "auto", "bwd_pingpong": True}),
    "causal-bf16-d128-200x70-2wg-pp": ("causal", "bf16", 1, 1, 1, 200, 70, 128, 64, 128,
                                       {"dq_ws": "auto", "bwd_pingpong": True}),
    "document-f16-d64-130x130-pp": ("document", "f16", 2, 1, 1, 130, 130, 64, 64, 128,
                                    {"dq_ws": "auto", "bwd_pingpong": True}),
    # ... ALiBi under GQA (its slope's gradient held across tiles, the head changing inside the walk: 2 heads x 2
    # q tiles, M != N)
    "alibi_gqa-f16-d64-65x63-2wg-pp": ("alibi_gqa", "f16", 1, 4, 2, 65, 63, 64, 64, 128,
                                       {"dq_ws": "auto", "bwd_pingpong": True}),
    # each q tile's whole dQ (64 x D) by one warpgroup in turn (dq_alternate), the other going on with no barrier of
    # both: causal with 3 q tiles (odd: warpgroup 0 takes two, its 64 x D slab written twice), the last ragged, kv rows
    # past N, and a kv tile walking one q tile (warpgroup 1 takes none: its DS_FREE wait after the loop matches the
    # arrival); D = 128 (dQ in two column halves; dk_after_dq's "auto" steps aside: with it dQ read wrong here under
    # load, a race not yet found);
    # plain with both kv tiles walking 3 q tiles. Each also run with the knob off (DKDV_AS_DEFAULT)
    "causal-f16-d64-150x130-2wg-dqa": ("causal", "f16", 1, 1, 1, 150, 130, 64, 64, 128,
                                       {"dq_ws": "auto", "dq_alternate": True}),
    "causal-bf16-d128-150x70-2wg-dqa": ("causal", "bf16", 1, 1, 1, 150, 70, 128, 64, 128,
                                        {"dq_ws": "auto", "dq_alternate": True}),
    "plain-f16-d64-150x140-2wg-dqa": ("plain", "f16", 1, 1, 1, 150, 140, 64, 64, 128,
                                      {"dq_ws": "auto", "dq_alternate": True}),
    # dV's GEMM issued from P before dP^T's wait (dv_under_dp, on p_under_dp's split): D = 128 with dk_after_dq's
    # default (dK's GEMM after dQ's, so the dS^T stores commit no group), 3 ragged q tiles; D = 64 (dK's GEMM beside
    # the dS^T stores), kv rows past N. Each also run with the knob off (SAME_AS_DEFAULT: gradients bitwise the fused
    # order's)
    "causal-bf16-d128-150x70-2wg-dve": ("causal", "bf16", 1, 1, 1, 150, 70, 128, 64, 128,
                                        {"dq_ws": "auto", "dv_under_dp": True}),
    "plain-f16-d64-70x130-2wg-dve": ("plain", "f16", 1, 1, 1, 70, 130, 64, 64, 128,
                                     {"dq_ws": "auto", "dv_under_dp": True}),
}
# case -> (warpgroup, seconds): each of that warpgroup's emulated shared-memory operand reads (wgmma's, ldmatrix's)
# sleeps first, in the case's own call only. Each is a bwd_pingpong or dq_alternate case above run again with one
# whole warpgroup slowed: the other runs ahead of it through the loads it requests, its slabs and its turns, or
# (dq_alternate) up to dS^T's barrier and DS_FREE (DS_FREE's wait made an arrival read dq err 0.71 here; dS^T's
# barrier an arrival of the skipping warpgroup only, dq err 0.26 and deadlocks under load); the simulator's threads
# otherwise run close to lockstep
SLOW_WARPGROUP = {"plain-f16-d64-150x140-2wg-pp-slowwg0": (0, 0.01),
                  "causal-bf16-d128-200x70-2wg-pp-slowwg1": (1, 0.01),
                  "plain-f16-d64-150x140-2wg-dqa-slowwg0": (0, 0.01),
                  "causal-f16-d64-150x130-2wg-dqa-slowwg1": (1, 0.01),
                  "causal-bf16-d128-150x70-2wg-dqa-slowwg0": (0, 0.01)}
CASES.update({case: CASES[case.rsplit("-slowwg", 1)[0]] for case in SLOW_WARPGROUP})
# cases whose dK and dV must be bitwise those of the same kernel with these spec.extra changes, and dQ within the
# error rule's tolerance of its dQ (run_case runs both)
DKDV_AS_DEFAULT = {k: {"bwd_pingpong": False} for k in CASES if "-pp" in k}
DKDV_AS_DEFAULT.update({k: {"dq_alternate": False} for k in CASES if "-dqa" in k})
# run (also) with warp 1 of each warpgroup slowed (FALOWER_SIM_SLOW_WARP, seconds): a warpgroup that ran ahead of
# what it waits for reads stale shared memory there
SLOW_WARP_CASES = ("plain-f16-d64-150x140-2wg-pp", "causal-f16-d64-150x130-2wg-dqa")
SLOW_WARP_SECONDS = 0.05
# cases whose gradients must be bitwise those of the same kernel with these spec.extra changes (run_case runs both)
SAME_AS_DEFAULT = {"causal-bf16-d128-200x70-2wg-wsl-intile": {"dkdv_in_tile": False},
                   "causal-bf16-d128-200x70-2wg-wsl-nodkl": {"dk_after_dq": True},
                   "causal-f16-d64-20x130-intile": {"dkdv_in_tile": False},
                   "causal-f16-d64-150x130-2wg-wsl-sp": {"stat_pairs": False},
                   "softcap-bf16-d128-20x19-sp": {"stat_pairs": False},
                   "causal-bf16-d128-150x70-2wg-dve": {"dv_under_dp": False},
                   "plain-f16-d64-70x130-2wg-dve": {"dv_under_dp": False}}
# cases run with benchmarks/probe_bwd.py's --blocks stamps (stamped_blocks_source, --drain's waits too) in place of
# the main kernel: tests/test_probe_bwd_tool.py reads their gradients and stamps. 2 kv tiles, one walking 2 ragged q
# tiles, the other none (its zeros), on the default kernel (dq_ws and ws_loads at 64 x 128) and with dkdv_in_tile
STAMPED = {
    "stamped-causal-bf16-d128-70x200": ("causal", "bf16", 1, 1, 1, 70, 200, 128, 64, 128, {"dq_ws": "auto"}),
    "stamped-causal-bf16-d128-70x200-intile": ("causal", "bf16", 1, 1, 1, 70, 200, 128, 64, 128,
                                               {"dq_ws": "auto", "dkdv_in_tile": True}),
}


def _alibi_gqa():
    """ALiBi under GQA: the slope is the query head's, so it changes inside a kv head's walk."""
    import falower as fl

    slopes = fl.capture("slopes", "f32", "H")
    return fl.attention(score_mod=lambda s, b, h, q, kv: s + slopes[h] * (kv - q), mask_mod=lambda b, h, q, kv: q >= kv,
                        group_size=2, name="alibi_gqa")


def _relative_bias_causal():
    """The relative bias under a causal mask: full and partial tiles, two elementwise branches."""
    import falower as fl
    from falower.ir import dim

    N = dim("N")
    rel = fl.capture("rel_bias", "f32", ["H", N * 2 - 1])
    return fl.attention(score_mod=lambda s, b, h, q, kv: s + rel[h, q - kv + (N - 1)],
                        mask_mod=lambda b, h, q, kv: q >= kv, name="relative_bias_causal")


def _document_gqa():
    """The document mask under GQA: a kv head's list walks the pairs of both query heads of its group."""
    import falower as fl

    doc_id = fl.capture("doc_id", "i32", "B,N")
    return fl.attention(mask_mod=lambda b, h, q, kv: (doc_id[b, q] == doc_id[b, kv]) & (doc_id[b, q] >= 0),
                        group_size=2, name="document_gqa")


def _bias4d_gqa_causal():
    """A per-batch bias table [B, H, M, N] under GQA and a causal mask: two leading indices (the batch row and the
    query head, which changes inside a kv head's walk) and two elementwise branches, each with its grid read."""
    import falower as fl

    bias = fl.capture("bias4", "f32", "B,H,M,N")
    return fl.attention(score_mod=lambda s, b, h, q, kv: s + bias[b, h, q, kv], mask_mod=lambda b, h, q, kv: q >= kv,
                        group_size=2, name="bias4d_gqa_causal")


def _two_tables():
    """Two bias tables, the score reading b1 before b2: the IR scatters db2 first, the function returns db1 first
    (the kernels once returned them in the scatters' order, so each table got the other's gradient)."""
    import falower as fl

    b1 = fl.capture("b1", "f32", "H,M,N")
    b2 = fl.capture("b2", "f32", "M,N")
    return fl.attention(score_mod=lambda s, b, h, q, kv: s + b1[h, q, kv] * 0.5 + b2[q, kv], name="two_tables")


def _bias_i8():
    """A bias read at q cast to i8 and a mask on it: rows past 127 wrap to negative, so the table's row is clamped
    to 0 and the mask drops them. The kernels once read q itself (the element code's int() and the grid form took
    the cast as the identity) and classified tiles of rows 128-191 as full (the cast's interval passed through).
    And an i32 product that wraps past kv = 63 (kv * 2^25), which the element code wraps as the IR does
    (value_ranges.py): the score's term falls from ~1 to ~-1 there, where Numba's int64 would carry on to ~1.05."""
    import falower as fl

    bias = fl.capture("bias", "f32", "H,M,N")
    return fl.attention(score_mod=lambda s, b, h, q, kv: s + bias[h, q.to("i8"), kv]
                        + (kv * 33554432).to("f32") * 2.0 ** -31,
                        mask_mod=lambda b, h, q, kv: (q.to("i8") >= 0) | (kv < 8), name="bias_i8")


TEST_GRAPHS = {"alibi_gqa": _alibi_gqa, "relative_bias_causal": _relative_bias_causal, "document_gqa": _document_gqa,
               "bias4d_gqa_causal": _bias4d_gqa_causal, "two_tables": _two_tables, "bias_i8": _bias_i8}


def _bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """Inputs as the kernel takes them: f16 arrays, or bf16 as raw uint16 bits (round to nearest even)."""
    if dtype == "f16":
        return x.astype(np.float16)
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _float(x: np.ndarray, dtype: str) -> np.ndarray:
    x = np.asarray(x)
    if dtype == "bf16" or x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _poison_new_device_arrays() -> None:
    """The simulator's cuda.device_array made with every byte 0xFF (NaN, or -1) instead of whatever the host's
    allocator returned (often zeros): an output the kernel should write and does not (dK / dV of a kv tile that sees
    no q tile) then reads NaN here, as torch.empty's reused memory would on the GPU."""
    from numba import cuda

    if getattr(cuda.device_array, "poisoned", False):
        return
    made = cuda.device_array

    def device_array(shape, dtype=np.float64, *args, **kwargs):
        a = made(shape, dtype, *args, **kwargs)
        host = np.empty(a.shape, a.dtype)
        host.view(np.uint8).fill(0xFF)
        a.copy_to_device(host)
        return a

    device_array.poisoned = True
    cuda.device_array = device_array


def _stamped(kern) -> dict:
    """Point the backward kernel's main launch at probe_bwd's --blocks source (with --drain's waits), the stamps'
    buffer appended to its arguments; returns {"buf": the buffer}, filled in at the launch."""
    import importlib

    from numba import cuda

    from falower.backends.numba_cuda.runtime import load_source

    sys.path.insert(0, str(ROOT / "benchmarks"))
    probe = importlib.import_module("probe_bwd")
    name = kern.spec.name
    stamped = getattr(load_source(probe.stamped_blocks_source(kern.source, name, drain=True), name + "_sim_blocks"),
                      name)
    held: dict = {}

    class Launch:  # the dispatcher's [config](*args), the buffer last
        def __getitem__(self, cfg):
            held["buf"] = cuda.to_device(np.zeros(int(np.prod(cfg[0])) * probe.RECORD, np.uint64))
            launch = stamped[cfg]
            return lambda *a: launch(*a, held["buf"])

    kern._dispatchers["main"] = Launch()
    return held


@contextlib.contextmanager
def _slowed_warpgroup(wg: int, seconds: float):
    """intrinsics.slow_warp (what each emulated shared-memory operand read calls first) sleeping `seconds` on the
    threads of warpgroup `wg` of every block, for the with block."""
    import threading

    from falower.backends.numba_cuda import intrinsics

    made = intrinsics.slow_warp

    def slow_warp() -> None:
        if threading.current_thread().thread_id // 128 == wg:
            time.sleep(seconds)

    intrinsics.slow_warp = slow_warp
    try:
        yield
    finally:
        intrinsics.slow_warp = made


def run_case(case_id: str, extra_change: dict | None = None) -> dict:
    import falower as fl
    from falower.backends.numba_cuda.emit_fa3_bwd import (_dk_after_dq_auto, _dq_alternate_auto, dkdv_store_auto,
                                                          knobs_in)
    from falower.ir.interp import Interpreter
    from falower.passes.check import bind_dims, random_inputs

    _poison_new_device_arrays()
    stem, dtype, B, H, HKV, M, N, D, bq, bk, *rest = STAMPED[case_id] if case_id in STAMPED else CASES[case_id]
    rest = [{**(rest[0] if rest else {}), **(extra_change or {})}]
    g = TEST_GRAPHS[stem]() if stem in TEST_GRAPHS else example_graph(stem)
    env = bind_dims(g, {"B": B, "H": H, "HKV": HKV, "M": M, "N": N, "D": D})
    raw = random_inputs(g, env, seed=M * 1000 + N)
    ins = [_bits(x, dtype) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x for i, x in enumerate(raw)]
    as_f = [_float(x, dtype) if i < 3 else x for i, x in enumerate(ins)]  # the values the kernel sees
    bwd = BWD.format(bq=bq, bk=bk, dq="atomic")
    c = fl.compile(g, "numba-cuda", pipeline=FWD, backward=bwd,
                   extra={"bwd_schedule": "wgmma", **SIM_EXTRA, **(rest[0] if rest else {})})
    ref = fl.compile(g, "reference", pipeline=FWD, backward=bwd)
    o, lse = ref(*[x.astype(np.float32) if i < 3 else x for i, x in enumerate(as_f)])
    o, lse = _bits(o, dtype), lse.astype(np.float32)
    do = _bits(np.random.default_rng(5).standard_normal(o.shape), dtype)
    kern = c._backward_kernel_and_dims_for(dtype, D)
    stamps = _stamped(kern) if case_id in STAMPED else None
    t0 = time.time()
    caps = [*ins[3:], *(env[d.removeprefix("dim_")] for d in kern.spec.dims)]
    blocks = c.block_data(kern)  # range tables and block lists made from the data, as a call makes them
    if blocks is not None:
        caps += blocks.derive(caps, (B, H, M, N), ins[0])
    with _slowed_warpgroup(*SLOW_WARPGROUP[case_id]) if case_id in SLOW_WARPGROUP and extra_change is None \
            else contextlib.nullcontext():
        got = kern(ins[0], ins[1], ins[2], o, lse, do, *caps)
    seconds = time.time() - t0
    f = c.lowered_backward
    by = {a.name: x for a, x in zip(g.args, as_f)}
    by.update(o=_float(o, dtype), lse=lse, do=_float(do, dtype))
    want = Interpreter("f64").run(f, [by[a.name] for a in f.args])
    out = {"id": case_id, "dtype": dtype, "wgmma": kern.spec.extra.get("bwd_schedule") == "wgmma"
           and "wgmma_ss" in kern.source, "refused": kern.wgmma_refused, "grads": {}, "seconds": round(seconds, 1),
           # the knobs asked for, in effect (p_under_dp falls back to the fused function where it cannot split)
           "knobs": knobs_in(kern.source), "block_mask": kern.spec.block_mask,
           "dkdv_store_auto": dkdv_store_auto(kern.spec),  # how dK / dV leave unless a knob says
           "dk_after_dq_auto": _dk_after_dq_auto(kern.spec),  # dK's GEMM after dQ's unless asked (D = 128)
           "dq_alternate_auto": _dq_alternate_auto(kern.spec),  # dQ by one warpgroup a tile unless asked (D = 64)
           # exp_fold: the exponential's argument a name of its own (folded), not `x * LOG2E` in the call
           "exp_fold": re.search(r"ex2\(v\d+\)", kern.source) is not None,
           # grad_dist: the gradients' distances recomputed as float(kv) - float(q) (from_ir_bwd._late_distances)
           "grad_dist": re.search(r"= np\.float32\(np\.int32\((kv|q)\)\) - np\.float32", kern.source) is not None,
           "kv_group": re.search(r"kj = (cuda\.blockIdx\.x|it_x) // ", kern.source) is not None,
           "bwd_persistent": "while it_z < " in kern.source,
           "bwd_batch_inner": "b = cuda.blockIdx.x" in kern.source,
           # the table's gradient by 16-byte reductions and its entries by 16-byte loads (v4_grads, read_v4)
           "grad_v4": "red_add_v4_f32(grad_" in kern.source, "read_v4": "= ldg_vec(cap_" in kern.source}
    for name, a, b in zip(c.gradient_names(), got, want):
        a = _float(a, dtype) if name in ("dq", "dk", "dv") else np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        out["grads"][name] = {"err": float(np.max(np.abs(a - b))), "scale": float(np.max(np.abs(b))),
                              "nan": bool(np.isnan(a).any()), "shape_ok": a.shape == b.shape}
    masked = ~np.isfinite(lse)  # fully masked rows: the reference says dq = 0 there, the kernel must too
    out["masked_rows"] = int(masked.sum())
    out["masked_dq_zero"] = bool(np.all(_float(got[0], dtype)[masked] == 0))
    if stamps is not None:
        out["stamps"] = [int(x) for x in stamps["buf"].copy_to_host()]
    if case_id in SAME_AS_DEFAULT and extra_change is None:  # the same call on the kernel without the knob
        out["raw"] = [np.asarray(x).tobytes().hex() for x in got[:3]]
        other = run_case(case_id, SAME_AS_DEFAULT[case_id])
        out["same_as_default"] = {n: other["raw"][i] == out["raw"][i] for i, n in enumerate(("dq", "dk", "dv"))}
        out["default_knobs"] = other["knobs"]
        del out["raw"]
    elif case_id in DKDV_AS_DEFAULT and extra_change is None:  # dK, dV bitwise the kernel's without the knob
        other = run_case(case_id, DKDV_AS_DEFAULT[case_id])
        raw = [np.asarray(x).tobytes().hex() for x in got[:3]]
        out["same_as_default"] = {n: other["raw"][i] == raw[i] for i, n in ((1, "dk"), (2, "dv"))}
        out["dq_vs_default"] = float(np.max(np.abs(_float(got[0], dtype) - _float(other["dq"], dtype))))
        out["default_knobs"] = other["knobs"]
    elif extra_change is not None:
        out["raw"] = [np.asarray(x).tobytes().hex() for x in got[:3]]
        out["dq"] = np.asarray(got[0])
    return out


def main(ids) -> None:
    run_main(ids or list(CASES), run_case)  # (STAMPED's by id only)


if __name__ == "__main__":
    main(sys.argv[1:])
