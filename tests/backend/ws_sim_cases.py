"""Simulator cases for test_fa3_ws_simulator.py: the warp-specialization intrinsics (mbarriers, cp.async completion
on an mbarrier, named barriers, setmaxnreg; intrinsics.py) in a producer/consumer ring, and the warp-specialized
wgmma forward (emit_fa3_ws.py) on tiny ragged shapes against the float64 reference. Run in a subprocess with
NUMBA_ENABLE_CUDASIM=1 (tests/backend/simulated.py). One JSON line per case.

Usage: NUMBA_ENABLE_CUDASIM=1 python ws_sim_cases.py [case-id ...]
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.setswitchinterval(5e-4)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from sim_script import against_reference, case_rng, count_calls, example_graph, random_qkv, run_main, tiled_pipeline  # noqa: E402,E501

# id: (variant, dtype, D, B, H, M, N, group_size, block_q, block_k, spec.extra)
CASES = {
    "ws-plain-f16-d64-ragged": ("plain", "f16", 64, 1, 1, 70, 45, 1, 128, 16, {"stages": 2}),
    # (the producer warp at D = 128 with GQA and bf16 with 3 stages were cut for CI time: GQA, bf16 and 3 stages
    # run in the no-producer cases below, the producer warp in its D = 64 and causal D = 128 cases)
    "ws-causal-f16-d128": ("causal", "f16", 128, 1, 1, 90, 85, 1, 128, 32, {}),
    # a producer warpgroup with setmaxnreg (40 / 232) instead of the producer warp
    # (two batch rows on a grid with the batch innermost, as from_ir asks for a bias with no batch axis:
    # spec.batch_inner, taken out of the extras by run_case)
    "ws-bias-f16-d64-pwg": ("bias", "f16", 64, 2, 1, 50, 40, 1, 128, 16, {"producer": "warpgroup",
                                                                          "batch_inner": True}),
    # no producer: warpgroup 0 streams K, warpgroup 1 V through the ring (3 stages by default, 2 asked)
    "ws-none-plain-f16-d64-ragged": ("plain", "f16", 64, 1, 1, 70, 45, 1, 128, 16, {"producer": "none"}),
    "ws-none-causal-bf16-d64-2stages": ("causal", "bf16", 64, 1, 1, 75, 70, 1, 128, 16,
                                        {"producer": "none", "stages": 2}),
    # the bias read from a [q, kv] tile of the table copied into shared memory a kv tile ahead (from_ir's device
    # source: tile_chunk_fn, score_pair_vals_fn; `ir_source`, taken out of the extras by run_case); rows of N = 72
    # are 16-byte aligned (the last kv tile ragged), of N = 71 not (the kernel keeps the per-element gathers)
    "ws-none-bias-tile-f16-d64": ("bias", "f16", 64, 1, 1, 70, 72, 1, 128, 32, {"producer": "none",
                                                                               "ir_source": True}),
    "ws-none-bias-gather-f16-d64": ("bias", "f16", 64, 1, 1, 70, 71, 1, 128, 32, {"producer": "none",
                                                                                 "ir_source": True}),
    "ws-none-plain-f16-d128-gqa": ("plain", "f16", 128, 1, 2, 40, 50, 2, 128, 16, {"producer": "none"}),
    "ws-none-causal-f16-d128": ("causal", "f16", 128, 1, 1, 90, 85, 1, 128, 32, {"producer": "none"}),
    "ws-none-causal-f16-d128-2stages": ("causal", "f16", 128, 1, 1, 130, 140, 1, 128, 32,
                                        {"producer": "none", "stages": 2}),
    # online-softmax{lazy=T} (spec.lazy_rescale, taken out of the extras by run_case): T = 0.5 makes the max move
    # and stay across kv tiles, so O's rescale both runs and is skipped (skips_unit_rescale: this kernel only)
    # (two heads: under a block mask the grid is (heads, q tiles, batch), emit_fa2.grid_3d)
    "ws-none-causal-f16-d64-lazy": ("causal", "f16", 64, 1, 2, 70, 90, 1, 128, 16,
                                    {"producer": "none", "lazy_rescale": 0.5}),
    # the ring's first tiles split around the wait for Q (early_loads "10": K_0 before it, V_0 and both second
    # tiles after), 3 stages, ragged tiles both ways
    "ws-none-causal-f16-d64-early10": ("causal", "f16", 64, 1, 1, 70, 90, 1, 128, 16,
                                       {"producer": "none", "early_loads": "10"}),
}
# Persistent (extra persistent = blocks; test_ws_persistent_simulator.py): each block walks several (q tile, head,
# batch) items in serpentine order, the next item's Q and first tiles loaded before the epilogue of the one before;
# the ring's stage and phase and the Q barrier's parity carry across items, so every item after the first reuses
# stages the one before filled (its last V's stage included)
PERSIST_CASES = {
    # (the producer-less persistent kernel, 8 items on 3 blocks (3, 3, 2), the batch innermost: cut for CI time,
    # 2026-11-29 (16 s); that kernel is a default nowhere, and test_wgmma_ws_gpu.py runs it at D = 128 and 64)
    # (GQA, bf16, D = 128, 2 stages, without a block mask, 4 items on 2 blocks: cut for CI time, 2026-11-29; the
    # producer-less persistent kernel is a default nowhere, and test_wgmma_ws_gpu.py runs it at D = 128 and 64)
    # a producer warpgroup walks the items and their tiles as one stream, each item's Q once both consumer
    # warpgroups are past the last item's last S (q_empty): 8 items on 3 blocks (3, 3, 2), 3 kv tiles an item, a
    # ragged q tile, M != N, the batch innermost (GQA bf16 at D = 128 on 2
    # blocks passed too, o_err 3.3e-3; cut for CI time: the GPU cases run D = 128); the items from a global
    # counter (item_order "dynamic"): the producer's tickets handed to the consumers, the counter zeroed again by
    # the last block (the static orders "grid" and "cost": this case by hand, passed with "cost", o_err 1.0e-3;
    # in CI test_block_order's walks; every order on the GPU)
    "ws-pwg-causal-f16-d64-persist": ("causal", "f16", 64, 2, 2, 130, 40, 1, 128, 16,
                                      {"producer": "warpgroup", "persistent": 3, "batch_inner": True,
                                       "item_order": "dynamic"}),
    # an item's last P V and epilogue go with the next item's first tile (emit_fa3_ws.epilogue_in_s): 128 x 128
    # causal tiles make items of 1, 2 and 3 kv tiles (the last ragged), 6 items on one block, heads alternating,
    # so a one-tile item's P V (the item's first, which starts O from zero) is carried into the next item and the
    # last item's flushed. Head 0's V holds an inf ("poison_head", taken out of the extras by run_case): its O is
    # not finite, and head 1's items, each after one of head 0's on the block, must not inherit it through O's
    # registers (o_err is head 1's; "poisoned" says head 0's O is not all finite)
    # (its O stored by one bulk copy a row, emit_fa3_ws.bulk_store without tma_store, its Q, K and V loaded by TMA;
    # the slowed case below and the D = 128 one store by TMA tensor copies)
    "ws-pwg-causal-f16-d64-bk128-persist": ("causal", "f16", 64, 1, 2, 300, 300, 1, 128, 128,
                                            {"producer": "warpgroup", "persistent": 1, "item_order": "dynamic",
                                             "poison_head": 0, "tma_store": False}),
    # O by TMA tensor copies at D = 128 (emit_fa3_ws.tma_store): two 64-column boxes a warp, M = 200 ragged inside
    # a warp's 16 rows (the copy writes rows 192-199 of the box at 192 and none past M, which would be the next
    # head's) and boxes wholly past M (rows 208-255 of q tile 1); 4 items on one block, heads alternating; Q, K
    # and V by the producer's 16-byte copies (tma_loads off: the cases above and below load by TMA)
    "ws-pwg-causal-f16-d128-bk128-persist-tma": ("causal", "f16", 128, 1, 2, 200, 200, 1, 128, 128,
                                                 {"producer": "warpgroup", "persistent": 1, "item_order": "dynamic",
                                                  "tma_loads": False}),
    # Q, K and V by TMA loads too (emit_fa3_ws.tma_loads: one producer thread, expect_tx on the stages' full barriers):
    # GQA (kv head h // 2 by the map's coordinate: heads 0-1 read kv head 0, heads 2-3 kv head 1), N = 200 (the last
    # tile's rows past N zeros), M != N
    "ws-pwg-causal-f16-d128-bk128-persist-tmal": ("causal", "f16", 128, 1, 4, 150, 200, 2, 128, 128,
                                                  {"producer": "warpgroup", "persistent": 1, "item_order": "dynamic",
                                                   "tma_loads": True}),
    # ... the kv tiles from the last down (emit_fa3_ws.kv_reverse): the ragged last tile of N first, M != N, bf16
    # (masks walking their range: WALK_CASES' -rev cases)
    "ws-pwg-plain-bf16-d64-bk128-persist-rev": ("plain", "bf16", 64, 1, 1, 150, 300, 1, 128, 128,
                                                {"producer": "warpgroup", "persistent": 1, "item_order": "dynamic",
                                                 "kv_reverse": True, "early_first_item": True}),
}
# (early_first_item, asked for in that case, the three-warpgroup "ws3-pwg-plain-f16-d64-193" and the ragged-first
# "ws-pwg-bias-f16-d64-130x150-rqf": the block's own first item, its Q and first K / V tiles (the last first under
# kv_reverse), sent by thread 0 before the block's barrier, which the loop then skips)
# Three consumer warpgroups (block_q 192, emit_fa3_ws.consumer_wgs: the turns rotate 0 -> 1 -> 2 -> 0, the
# epilogue's named barriers move to 7 + cw, the producer keeps 32 registers): a tile plus one row both ways and two
# heads on two blocks, causal with its diagonal tiles, bf16 with 128-column tiles and M != N, and one row
PERSIST_CASES.update({
    "ws3-pwg-plain-f16-d64-193": ("plain", "f16", 64, 1, 2, 193, 193, 1, 192, 128,
                                  {"producer": "warpgroup", "persistent": 2, "item_order": "dynamic",
                                   "early_first_item": True}),
    "ws3-pwg-causal-f16-d64-193": ("causal", "f16", 64, 1, 2, 193, 193, 1, 192, 64,
                                   {"producer": "warpgroup", "persistent": 2, "item_order": "dynamic"}),
    "ws3-pwg-causal-bf16-d64-bk128": ("causal", "bf16", 64, 1, 1, 191, 300, 1, 192, 128,
                                      {"producer": "warpgroup", "persistent": 1, "item_order": "dynamic"}),
    "ws3-pwg-plain-f16-d64-1x1": ("plain", "f16", 64, 1, 1, 1, 1, 1, 192, 32,
                                  {"producer": "warpgroup", "persistent": 1, "item_order": "dynamic"}),
})
# The short q tile first (tile{ragged_q=first}, spec.ragged_q_first): q tile qt starts at qt * 192 - q_pad, its rows
# before 0 zeros by the TMA loads, clipped by the TMA stores (a warp's 16-row box straddling row 0 at M = 300: rows
# -4 .. 11) and never given an LSE; the tiles' classes from their rows at 0 and after. A tile plus one (q_pad 191:
# the first tile holds one row), M > N under causal (rows past N keep every column), plain with M != N
PERSIST_CASES.update({
    "ws3-pwg-causal-f16-d64-193-rqf": ("causal", "f16", 64, 1, 2, 193, 193, 1, 192, 128,
                                       {"producer": "warpgroup", "persistent": 2, "item_order": "dynamic",
                                        "ragged_q_first": True}),
    "ws3-pwg-causal-bf16-d64-300x191-rqf": ("causal", "bf16", 64, 1, 1, 300, 191, 1, 192, 128,
                                            {"producer": "warpgroup", "persistent": 1, "item_order": "dynamic",
                                             "ragged_q_first": True}),
    # ... with L2 eviction priorities on the TMA loads and O's tensor stores (l2_hints; the simulator has no L2:
    # the hinted copies must move the same bytes), the straddling box's stores among them, and the maps prefetched
    # (map_prefetch: a prefetch of anything but a map raises)
    "ws3-pwg-causal-f16-d64-130x100-rqf-l2h-mp": ("causal", "f16", 64, 1, 1, 130, 100, 1, 192, 128,
                                               {"producer": "warpgroup", "persistent": 1, "item_order": "dynamic",
                                                "ragged_q_first": True, "l2_hints": True,
                                                "map_prefetch": True}),
    "ws3-pwg-plain-f16-d64-200x77-rqf": ("plain", "f16", 64, 2, 1, 200, 77, 1, 192, 128,
                                         {"producer": "warpgroup", "persistent": 2, "item_order": "dynamic",
                                          "ragged_q_first": True}),
    # two consumer warpgroups at D = 128 (a caller's own pipeline can ask for it): two 64-column boxes a warp, the
    # straddling one stored by the lanes box by box (q_pad 84); the bias table gathered at rows before 0 (clamped)
    "ws-pwg-causal-f16-d128-300-rqf": ("causal", "f16", 128, 1, 2, 300, 300, 1, 128, 128,
                                       {"producer": "warpgroup", "persistent": 2, "item_order": "dynamic",
                                        "ragged_q_first": True}),
    "ws-pwg-bias-f16-d64-130x150-rqf": ("bias", "f16", 64, 1, 2, 130, 150, 1, 128, 128,
                                        {"producer": "warpgroup", "persistent": 2, "item_order": "dynamic",
                                         "ragged_q_first": True, "early_first_item": True}),
})
# Run with warp 1 of each warpgroup slowed (FALOWER_SIM_SLOW_WARP, wgmma.py), where a warp that runs ahead of its
# warpgroup must not rewrite shared memory another warp's part of S still reads: the persistent kernel's next Q rows
# (two items of whole q tiles on one block), and the staged epilogue at D = 128, whose rows of 256 bytes span two
# warps' rows of the Q tile (the default kernel at D = 128; o_err 0.29 without the warpgroup's barrier)
SLOW_WARP_CASES = {
    # (the producer-less persistent kernel's next Q rows, slowed: cut for CI time, 2026-11-29; that kernel is a default
    # nowhere, and the producer warpgroup's persistent cases below are slowed through the same item boundary)
    "ws-none-plain-f16-d128-staged-slow": ("plain", "f16", 128, 1, 1, 128, 32, 1, 128, 16, {"producer": "none"}),
    # the producer warpgroup refilling Q for the block's next item while a slowed consumer warp may still read it,
    # and handing over each item's ticket (item_order "dynamic") while a slowed warp may not have read the last
    "ws-pwg-plain-f16-d64-persist-slow": ("plain", "f16", 64, 1, 2, 128, 32, 1, 128, 16,
                                          {"producer": "warpgroup", "persistent": 1, "item_order": "dynamic"}),
    # ... and each item's Q buffer reused two items on (q_double), its O stored by bulk copies that must have read
    # their rows before the buffer is released (bulk_store: 6 items of 1-3 kv tiles on one block; with the release
    # moved before the copies' wait, o_err 3.2 here, and the case without a slowed warp passed)
    "ws-pwg-causal-f16-d64-bk128-persist-slow": ("causal", "f16", 64, 1, 2, 300, 300, 1, 128, 128,
                                                 {"producer": "warpgroup", "persistent": 1, "item_order": "dynamic"}),
}
SLOW_WARP_SECONDS = 0.2
# The document example through falower.compile on the persistent kernel (a block list): q tile 1 of batch row 1 is
# all padding (doc_id -1), an item with no kv tile, between items that have some. The producer warpgroup walking
# each item's list a tile ahead, the items from the counter (the D = 128 default on the H100; the same case with
# producer "none" passed by hand, 2026-11-27, o_err 6.1e-4, cut for CI time); and on three consumer warpgroups
# (192 x 128 tiles: batch row 1's second q tile, rows 192-199, all padding). id: (M, N, blocks, producer, tiles)
COMPILED_CASES = {"ws-pwg-document-persist": (130, 130, 3, "warpgroup", (128, 32)),
                  "ws3-pwg-document-persist": (200, 200, 3, "warpgroup", (192, 128)),
                  # ... with each item's epilogue at its own end (epilogue_in_s off, the softcap's default): the item
                  # with no kv tile stages its zeros through its own Q tile, whose address the kv loop it never ran
                  # would have set (it took the item before's, in the other Q buffer)
                  "ws-pwg-document-persist-noes": (130, 130, 3, "warpgroup", (128, 32), {"epilogue_in_s": False})}
RING_CASES = {"ring-2stages": (2, 7, 2), "ring-3stages": (3, 5, 2), "ring-3wg": (2, 5, 3)}  # (stages, tiles, consumer
# warpgroups: three take turns 0 -> 1 -> 2 -> 0, emit_fa3_ws at block_q 192)
# Static masks with row bounds through falower.compile, where the ws kernel walks [kv_first, kv_last] and takes a
# tile's class from where it lies (emit_fa2.walks_range): causal on the persistent kernel (items whose ranges
# differ; q tile 1's full tiles 0-3 next to partial tile 4, which is not ragged, and a ragged last kv tile), a
# window whose first visited tile has rows that see none of it, and a mask whose rows' intervals are apart (kv in
# [40 q, 40 q + 2), M != N): empty tiles inside the range, walked as masked ones. id: (example or mask, B, H, M, N,
# extra)
WALK_CASES = {
    "walk-causal-persist": ("causal", 1, 2, 200, 200, {"persistent": 3}),  # 4 items on 3 blocks (2 rows: 29 s)
    # need_mask as one 32-bit compare against the item's full tiles inside N (emit_fa2.class32): M > N, so rows past
    # N keep every column and the ragged last kv tile (96 .. 127 of N = 100) is full by the mask, masked by N alone;
    # the range scanned in the kernel (one block an item) and handed over by the producer (persistent)
    "walk-causal-c32": ("causal", 1, 1, 130, 100, {"class32": True}),
    "walk-causal-persist-pwg-c32": ("causal", 1, 1, 130, 100, {"producer": "warpgroup", "persistent": 2,
                                                              "item_order": "dynamic", "class32": True}),
    # a window on the persistent producer kernel (the D = 128 default on the H100): each item's range scanned by the
    # producer and handed over with its ticket (emit_fa3_ws.range_shared), two Q buffers (q_double); 48 wide over
    # 32-wide tiles, partial tiles at both ends of each range and full ones between, 4 items on 3 blocks (causal
    # there: the same cases passed, 2026-11-28, cut for CI time; PERSIST_CASES' causal ones take q_double)
    "walk-window-persist-pwg": ("sliding_window", 1, 2, 256, 256, {"producer": "warpgroup", "persistent": 3,
                                                                   "item_order": "dynamic"}),
    # (the kept epilogue's O stored by bulk copies, emit_fa3_ws.bulk_store: each kept item's Q buffer released a
    # tile later or at the item's end, the block's last at its flush) ... and by the threads' own stores
    "walk-window-persist-nobk": ("sliding_window", 1, 2, 256, 256, {"producer": "warpgroup", "persistent": 3,
                                                                    "item_order": "dynamic", "bulk_store": False}),
    # ... and with each item's kv tiles from the last down (emit_fa3_ws.kv_reverse): the diagonal tile first, the
    # window's far edge last; causal on 2 blocks, M != N
    "walk-window-persist-pwg-rev": ("sliding_window", 1, 2, 256, 256, {"producer": "warpgroup", "persistent": 3,
                                                                       "item_order": "dynamic", "kv_reverse": True}),
    "walk-causal-persist-pwg-rev": ("causal", 1, 2, 200, 230, {"producer": "warpgroup", "persistent": 2,
                                                               "item_order": "dynamic", "kv_reverse": True}),
    "walk-window": ("sliding_window", 1, 2, 130, 130, {}),
    "walk-gaps": ("gaps", 1, 1, 5, 170, {}),
}

# Half tiles (emit_fa3_ws.half_tiles, extra half_tiles: off by default): a warpgroup multiplies only the column half of a kv tile its 64 rows keep,
# through falower.compile on the ws kernel. id: (example, B, H, M, N, D, block_k). The helpers each path calls are
# counted (HALF_PATHS), so a case shows it took them: the 48-wide window's far tiles keep only their upper half
# (hull starts 17 columns into a 32-wide tile), the ragged last row (M = 200: rows to 199) and last column (N)
# leave only the lower half, tiles no row of a warpgroup keeps take one all-masked half; D = 128 reads K's halves
# in both of its 64-column blocks; the document's ids change inside tiles and have a padding run (its hull from
# the row bounds the kernel reads before the loop; P V by halves, S whole)
# ('-pv': extra half_tiles "pv", S whole and only P V by halves)
HALF_CASES = {
    "half-window-d128": ("sliding_window", 1, 1, 200, 170, 128, 32, {"half_tiles": True}),
    "half-document-d64-pv": ("document", 1, 1, 200, 200, 64, 64, {"half_tiles": "pv"}),
}
HALF_PATHS = ("qk_halves", "qk_half0", "qk_half1", "pv_wgmma", "pv_half0", "pv_half1")


def _doc_ids(B: int, N: int) -> np.ndarray:
    """Sorted document ids whose boundaries fall inside tiles (at 40, 100, 105), a padding run (-1) at 180 .. 189
    and a last document after it; batch row 1 is one document and a padding tail."""
    doc = np.zeros((B, N), dtype=np.int32)
    for b in range(B):
        if b % 2 == 0:
            for lo, hi, d in ((40, 100, 1), (100, 105, 2), (105, 180, 3), (180, 190, -1), (190, N, 4)):
                doc[b, lo:hi] = d
        else:
            doc[b, N - 37:] = -1
    return doc


def run_half_case(case_id: str) -> dict:
    """A mask with row bounds on the ws kernel with half tiles (asked for in the case's extra), against the reference interpreter in
    float64, with the calls of each S / P V helper counted (the simulator calls the kernel's module globals)."""
    import falower as fl
    from falower.backends.numba_cuda.emit_fa3_ws import half_mode
    from falower.passes.check import Reference, bind_dims

    t0 = time.perf_counter()
    what, B, H, M, N, D, bk, extra = HALF_CASES[case_id]
    g = example_graph(what)
    env = bind_dims(g, {"B": B, "H": H, "M": M, "N": N, "D": D})
    q, k, v = random_qkv(np.random.default_rng(5), B, H, M, N, D)
    inputs = [q, k, v] + ([_doc_ids(B, N)] if what == "document" else [])  # one table of N ids (M == N)
    ref = Reference.build(g, env, inputs=[x.astype(np.float64) if i < 3 else x for i, x in enumerate(inputs)])
    c = fl.compile(g, "numba-cuda", pipeline=tiled_pipeline(128, bk), path="mma",
                   extra={"schedule": "wgmma-ws", "producer": "none", **extra})
    kern = c.kernel(*inputs)
    counts = count_calls(kern, HALF_PATHS)
    o, lse = c(*inputs)
    return {"id": case_id, "dtype": "f16", "half_mode": half_mode(kern.spec), "block_mask": kern.spec.block_mask,
            "calls": counts, "seconds": round(time.perf_counter() - t0, 1), **against_reference(o, lse, ref.outputs["o"], ref.outputs["lse"])}


def _gaps(b, h, q_idx, kv_idx):
    """Row q keeps kv in [40 q, 40 q + 2): one interval a row (row bounds), 40 apart."""
    d = kv_idx - q_idx * 40
    return (d >= 0) & (d < 2)


def ring_kernel_source() -> str:
    """A producer warpgroup streams `tiles` tiles (8 16-bit words a thread) through a ring of `stages` shared
    buffers (cp.async + cp_async_mbar_arrive_noinc on full[s]; waits on empty[s]); __NW__ consumer warpgroups wait on
    full[s], sum the tile, release it (one arrival per consumer thread on empty[s]) and take turns through named
    barriers 1 .. __NW__ (FA3's ping-pong; with three, warpgroup cw hands over to cw + 1 and the last to 0), writing
    the turn order to `order`."""
    return '''
import numpy as np
from numba import cuda, types
from falower.backends.numba_cuda.intrinsics import (bar_arrive, bar_sync, cp_async16_s, cp_async_mbar_arrive_noinc,
    kernel_jit, launch_bounds, mbar_arrive, mbar_init, mbar_wait, setmaxnreg_dec, setmaxnreg_inc, smem_base)

DEC = setmaxnreg_dec(40)
INC = setmaxnreg_inc(232)
STAGES = __STAGES__
TILE = 1024  # 16-bit words a tile: 128 producer threads x 8
NW = __NW__


@kernel_jit
@launch_bounds(128 + 128 * NW, 1)
def ring(src, tiles, sums, order):
    smem = cuda.shared.array(0, types.uint16)
    sb = smem_base(smem)
    tid = cuda.threadIdx.x
    bars = sb + STAGES * TILE * 2  # full[s] at bars + 8 s, empty[s] at bars + 8 (STAGES + s), turn counter after
    if tid == 0:
        for s in range(STAGES):
            mbar_init(bars + 8 * s, 128)
            mbar_init(bars + 8 * (STAGES + s), 128 * NW)
        smem[STAGES * TILE + 4 * STAGES * 2 + 2] = 0
    cuda.syncthreads()
    if tid < 128:
        DEC()
        stage = 0
        phase = 0
        for i in range(tiles):
            mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1)
            cp_async16_s(sb + stage * TILE * 2 + tid * 16, src, i * TILE + tid * 8, 16)
            cp_async_mbar_arrive_noinc(bars + 8 * stage)
            stage += 1
            if stage == STAGES:
                stage = 0
                phase ^= 1
    else:
        INC()
        ctid = tid - 128
        cw = ctid >> 7
        if cw == NW - 1:
            bar_arrive(1, 256)
        stage = 0
        phase = 0
        for i in range(tiles):
            mbar_wait(bars + 8 * stage, phase)
            bar_sync(1 + cw, 256)
            if (ctid & 127) == 0:
                order[NW * i + cw] = smem[STAGES * TILE + 4 * STAGES * 2 + 2] + cw * 100
                smem[STAGES * TILE + 4 * STAGES * 2 + 2] += 1
            bar_arrive(cw + 2 if cw < NW - 1 else 1, 256)
            acc = 0
            for e in range(8):
                acc += smem[stage * TILE + (ctid & 127) * 8 + e]
            sums[i * 128 * NW + ctid] = acc
            mbar_arrive(bars + 8 * (STAGES + stage))  # every consumer thread: its own reads are done
            stage += 1
            if stage == STAGES:
                stage = 0
                phase ^= 1
'''


def run_ring_case(case_id: str) -> dict:
    from falower.backends.numba_cuda.runtime import load_source

    stages, tiles, nw = RING_CASES[case_id]
    src_text = ring_kernel_source().replace("__STAGES__", str(stages)).replace("__NW__", str(nw))
    ring = load_source(src_text, f"ws_ring_{stages}_{nw}").ring
    rng = np.random.default_rng(stages)
    src = rng.integers(0, 100, size=tiles * 1024, dtype=np.uint16)
    sums = np.zeros(tiles * 128 * nw, dtype=np.int64)
    order = np.zeros(nw * tiles, dtype=np.int64)
    smem = stages * 2048 + 8 * 2 * stages + 16
    ring[1, 128 + 128 * nw, 0, smem](src, tiles, sums, order)
    want = src.reshape(tiles, 128, 8).sum(axis=2).astype(np.int64)
    got = sums.reshape(tiles, nw, 128)
    return {"id": case_id, "sums_ok": all(np.array_equal(got[:, w], want) for w in range(nw)),
            "order_ok": order.tolist() == [nw * i + cw * 101 for i in range(tiles) for cw in range(nw)],
            "order": order.tolist()}


def run_case(case_id: str) -> dict:
    from fa3_sim_cases import launch_args
    from variants import as_float, make_spec, random_captures, random_inputs, reference

    from falower.backends.numba_cuda import emit_fa3_ws
    from falower.backends.numba_cuda.runtime import load_source

    variant, dtype, D, B, H, M, N, G, bq, bk, extra = {**CASES, **PERSIST_CASES, **SLOW_WARP_CASES}[case_id]
    rng = case_rng(case_id)
    spec = make_spec(variant, D, dtype, path="mma", block_q=bq, block_k=bk, num_warps=8, group_size=G,
                     name=f"ws_{case_id.replace('-', '_')}")
    extra = dict(extra)
    poison = extra.pop("poison_head", None)
    spec = dataclasses.replace(spec, batch_inner=extra.pop("batch_inner", False),
                               lazy_rescale=extra.pop("lazy_rescale", 0.0),
                               ragged_q_first=extra.pop("ragged_q_first", False),
                               extra={"schedule": "wgmma-ws", **{k: v for k, v in extra.items() if k != "ir_source"}})
    if extra.get("ir_source"):  # the example's own device source, as from_ir writes it (same score as the variant)
        import runpy

        import falower as fl
        from falower.backends.numba_cuda.from_ir import analyse, build_spec

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        g = next(v for v in runpy.run_path(os.path.join(root, "examples", f"{variant}.py")).values()
                 if isinstance(v, fl.Func))
        ir = build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": D}, dtype, "mma", None)
        spec = dataclasses.replace(spec, device_source=ir.device_source, batch_inner=ir.batch_inner,
                                   score_scale=ir.score_scale)
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    kern = getattr(load_source(src, spec.name), spec.name)
    q, k, v = random_inputs(rng, dtype, B, H, M, N, D, G)
    if poison is not None:  # an inf in one head's V (row 5): its O is not finite, the other heads' must be exact
        v[:, poison // G, 5, :] = np.inf
    caps = random_captures(rng, variant, B, H, M, N)
    args, o, lse = launch_args(spec, q, k, v, caps)
    t0 = time.time()
    kern[emit_fa3_ws.grid(spec, B, H, M, N), emit_fa3_ws.threads_per_block(spec), 0,
         emit_fa3_ws.smem_bytes(spec)](*args)
    seconds = time.time() - t0
    qf, kf, vf = (as_float(x, dtype) for x in (q, k, v))
    ro, rl = reference(qf, kf, vf, variant, caps, G)
    if dtype == "f16":
        of = o.view(np.float16).astype(np.float64).reshape(B, H, M, D)
    else:
        of = (o.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64).reshape(B, H, M, D)
    lse = lse.reshape(B, H, M)
    masked = ~np.isfinite(rl)
    keep = np.ones(H, dtype=bool)
    if poison is not None:
        keep[poison] = False
    return {
        "id": case_id,
        "dtype": dtype,
        **({"poisoned": bool(not np.isfinite(of[:, poison]).all())} if poison is not None else {}),
        "o_err": float(np.abs(of[:, keep] - ro[:, keep]).max()),
        "lse_err": float(np.abs(lse[~masked] - rl[~masked]).max()) if (~masked).any() else 0.0,
        "nan": bool(np.isnan(of[:, keep]).any() or np.isnan(lse[:, keep]).any()),
        "seconds": round(seconds, 1),
        "kv_reverse": emit_fa3_ws.kv_reverse(spec),
        "early_first": emit_fa3_ws.early_first_item(spec) and "fence_proxy_async_smem()" in src,
        "ragged_first": f"{bq} - ((M + {bq - 1}) // {bq} * {bq} - M))" in src,  # q tiles start q_pad rows earlier
        # item_order "dynamic": the counter the last block leaves zeroed for the next launch
        **({"work_left": [int(x) for x in args[18]]} if extra.get("item_order") == "dynamic" else {}),
    }


def run_compiled_case(case_id: str) -> dict:
    """examples/document.py compiled by falower.compile onto the persistent ws kernel (D = 64, the case's tiles),
    against the reference interpreter in float64."""
    import falower as fl
    from falower.passes.check import Reference, bind_dims

    M, N, blocks, prod, (bq, bk), *more = COMPILED_CASES[case_id]
    g = example_graph("document")
    B, H, D = 2, 2, 64
    env = bind_dims(g, {"B": B, "H": H, "M": M, "N": N, "D": D})
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, B, H, M, N, D)
    doc = np.sort(rng.integers(0, 4, size=(B, max(M, N)))).astype(np.int32)
    doc[1, 128:] = -1  # batch row 1's second q tile: padding only, nothing to visit
    doc[0, 5] = -1  # one padding row inside a tile
    inputs = [q, k, v, doc]
    ref = Reference.build(g, env, inputs=[x.astype(np.float64) if i < 3 else x for i, x in enumerate(inputs)])
    c = fl.compile(g, "numba-cuda", pipeline=tiled_pipeline(bq, bk), path="mma",
                   extra={"schedule": "wgmma-ws", "producer": prod, "persistent": blocks,
                          **({"item_order": "dynamic"} if prod == "warpgroup" else {}), **(more[0] if more else {})})
    from falower.backends.numba_cuda.emit_fa3_ws import list_head_shared

    spec = c.kernel(*inputs).spec
    o, lse = c(*inputs)
    return {"id": case_id, "dtype": "f16", "block_mask": spec.block_mask, "persistent": spec.extra.get("persistent"),
            "producer": spec.extra.get("producer"), "list_head": list_head_shared(spec),
            **against_reference(o, lse, ref.outputs["o"], ref.outputs["lse"])}


def run_walk_case(case_id: str) -> dict:
    """A static mask with row bounds through falower.compile on the ws kernel (D = 64, 128 x 32 tiles), against
    the reference interpreter in float64; says whether the kernel walked the range (emit_fa2.walks_range)."""
    import falower as fl
    from falower.backends.numba_cuda.emit_fa2 import walks_range
    from falower.passes.check import Reference, bind_dims

    what, B, H, M, N, extra = WALK_CASES[case_id]
    g = fl.attention(mask_mod=_gaps, name="gaps") if what == "gaps" else example_graph(what)
    D = 64
    env = bind_dims(g, {"B": B, "H": H, "M": M, "N": N, "D": D})
    q, k, v = random_qkv(np.random.default_rng(11), B, H, M, N, D)
    ref = Reference.build(g, env, inputs=[x.astype(np.float64) for x in (q, k, v)])
    c = fl.compile(g, "numba-cuda", pipeline=tiled_pipeline(128, 32), path="mma",
                   extra={"schedule": "wgmma-ws", "producer": "none", **extra})
    kern = c.kernel(q, k, v)
    o, lse = c(q, k, v)
    from falower.backends.numba_cuda import emit_fa3_ws

    paths = {name: getattr(emit_fa3_ws, name)(kern.spec) for name in ("range_shared", "q_double", "bulk_store",
                                                                          "kv_reverse")}
    return {"id": case_id, "dtype": "f16", "walks": walks_range(kern.spec) and "kf_first" in kern.source, **paths,
            **against_reference(o, lse, ref.outputs["o"], ref.outputs["lse"])}


def main(ids) -> None:
    run_main(ids or [*RING_CASES, *CASES], lambda cid: (
        run_ring_case(cid) if cid in RING_CASES else run_compiled_case(cid) if cid in COMPILED_CASES
        else run_walk_case(cid) if cid in WALK_CASES else run_half_case(cid) if cid in HALF_CASES
        else run_case(cid)))


if __name__ == "__main__":
    main(sys.argv[1:])
