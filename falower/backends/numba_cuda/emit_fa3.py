"""Emit Numba CUDA source for a FlashAttention forward kernel on Hopper's warpgroup MMA (issue 11).

`emit_fa3_forward(spec)` returns one Python module, like `emit_fa2.emit_fa2_forward`, from the same
`FA2ForwardSpec` (same kernel arguments, same device-function contract: score_fn, mask_fn, tile_class_fn, the
block table), and reuses emit_fa2's pieces rather than copying them: the variant's device functions, the kv-tile
range and classification under a block mask, the masked score, and the per-row score / online-softmax / rescale /
store helpers (the wgmma accumulator of m64nN is, per warp, mma.sync's C fragment repeated along N, so those
helpers apply to one m16 fragment per warp unchanged). What is new is the schedule:

* one warpgroup (4 warps, 128 threads) per 64 query rows, `block_q // 64` warpgroups per block; or per 128 rows
  (`wg_rows`: the default at D = 64 without a mask or under a static one), each thread holding two 64-row halves
  whose S and P V wgmmas overlap the other half's softmax;
* Q, K and V in shared memory in wgmma's 128 B-swizzled layout, `[D // 64][rows][64]` 16-bit elements, row r's
  16-byte chunk c at `r * 128 + ((c ^ (r & 7)) << 4)` of its 64-column block, from a 1024-byte aligned base
  (wgmma.py describes the descriptors); K and V double-buffered by 16-byte cp.async with zero fill past N;
* S = Q K^T: D/16 `wgmma m64n{block_k}k16` from two descriptors (both operands K-major);
* P packed to 16-bit pairs from the S accumulators straight into the A registers of
  O += P V: block_k/16 `wgmma m64n{D}k16` with V MN-major (trans-b), no trip through shared memory;
* online softmax in the exp2 domain, one division at the end, LSE in natural log (as emit_fa2).

Built when `spec.extra["schedule"] == "wgmma"` (emit_fa2's entry points dispatch here). `falower.compile` sets it
by itself on compute capability 9.x where `auto_extra` says so (D = 128 under a block table, D = 64 under block
lists and narrow windows, and wherever the driver gives no SM count; elsewhere the warp-specialized
kernel of emit_fa3_ws, persistent, at D = 64 on 192-row tiles), with the tiles of `tiles` (the graph lowered again
with tile{bq=128,bk=128} at D = 128), or when asked:
`falower.compile(graph, extra={"schedule": "wgmma"})`; `FALOWER_WGMMA=0` / `extra={"schedule": "mma"}` keep
mma.sync. Only for compute capability 9.0 (sm_90a) and f16/bf16, D = 64 or 128; every block mask kind (static
classification, the block table, the per-q-tile block list of data-dependent masks) through emit_fa2's pieces.

Launch: grid `grid(spec, B, H, M, N)` = (q tiles, H, B), under a block mask (H, q tiles, B) so the heaviest q tiles
of a batch's heads go first (emit_fa2.grid_3d; no run-time division in the kernel: a 64-bit division is a
subroutine call, and any call makes ptxas serialize every wgmma: benchmarks/NOTES.md, "wgmma"),
`threads_per_block(spec)` threads, `smem_bytes(spec)` bytes of dynamic shared memory (raise the 48 KB limit).

Not here: producer/consumer warpgroups and setmaxnreg (emit_fa3_ws.py has them), TMA. With 64 rows a warpgroup
the schedule waits for each product before using it unless `overlap` is on (D = 128).
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional

from .emit_fa2 import (
    _HEADER,
    _Code,
    _device_functions,
    _emit_need_mask,
    _emit_next_tile,
    _emit_tile_range,
    _score_args,
    _tile_class_expr,
    _signature,
    _spec_comment,
    carries_class,
    emit_bases,
    emit_program_index,
    emit_fragment_helpers,
    emit_masked_rows,
    softmax_call,
    emit_masked_score,
    emit_row_bounds,
    grid_3d,
    row_bounds_read_data,
    rows_helper,
    score_row_calls,
    wgmma_thread_rows,
)
from .spec import FA2ForwardSpec
from .ssa_names import ssa_rename

__all__ = ["auto_extra", "blocks_per_sm", "emit_fa3_forward", "grid", "recommended_schedule", "smem_bytes",
           "threads_per_block", "tiles",
           "validate_spec"]

ALIGN = 1024  # 128 B-swizzle atoms at 1024-byte aligned shared addresses

_WGMMA_IMPORTS = '''
from falower.backends.numba_cuda.intrinsics import launch_bounds, lds_v4_u32, stg_v4_u32, sts_u32, stsm_x4
from falower.backends.numba_cuda.wgmma import (
    desc_at,
    desc_hi,
    desc_word,
    fence_proxy_async,
    make_desc,
    rcp_approx,
    wgmma_commit,
    wgmma_fence_regs,
    wgmma_rs,
    wgmma_ss,
    wgmma_wait_regs,
)
'''


ENV = "FALOWER_WGMMA"  # "0": never chosen automatically; "1": chosen wherever the spec allows it (also with no GPU)
WS_EXTRA = {"schedule": "wgmma-ws", "producer": "none"}  # the warp-specialized kernel the automatic choice takes
# ... and, at D = 128 without a table tile on a GPU whose SM count is known, its persistent form: a producer
# warpgroup, one block an SM, the items from a global counter (extra persistent = the SM count)
PERSIST_EXTRA = {"schedule": "wgmma-ws", "producer": "warpgroup", "item_order": "dynamic"}


def auto_extra(dtype: str, head_dim: int, block_mask: str, cc: Optional[tuple[int, int]],
               env: Optional[Mapping[str, str]] = None, table_tile: bool = False,
               sm_count: Optional[int] = None) -> Optional[dict]:
    """The automatic choice of the Hopper kernel: the spec.extra to build it with, or None for mma.sync.

    Rule (measured on the H100, benchmarks/NOTES.md "wgmma"): the device's compute capability is 9.x (`cc`,
    which the runtime asks of the driver; None where there is no GPU, the simulator included), f16 or bf16,
    and D = 128 or 64. At D = 128 without a mask, under a static block mask or a block list, the
    warp-specialized schedule with no producer warp (emit_fa3_ws.py, `producer: "none"`: the two warpgroups
    load a 3-stage mbarrier ring themselves and take turns on the tensor cores): plain 444 vs 409 TFLOP/s for
    this module's kernel at N = 4k (FLASH 341: 1.30x; Flex 452), causal 363 vs 330 (FLASH 304, Flex 359); block
    lists (data-dependent masks): document 173 vs 144 on mma.sync (Flex 193; H100 2026-11-23, with the row bounds
    of row_bounds.py), 227 on 128 x 128 tiles since (`tiles`; Flex 192). Block tables (masks the
    range analysis cannot bound) keep this module's kernel (not measured on the other), and a spec emit_fa3_ws
    refuses falls back to it (compiler.py). At D = 64, this module's kernel under any mask (two blocks per SM
    since `blocks_per_sm`: causal 282 vs 263 on mma.sync at N = 4k, 208 vs 178 at N = 1k; document 97 vs 71,
    alibi 207 vs 181, sliding window 19 vs 20), with one warpgroup per 128 rows where `plain_extra` says.
    At D = 128 without a table tile, and where the device's SM count is known (`sm_count`, from the
    driver: not in the simulator), that kernel's persistent form (`PERSIST_EXTRA`): a producer warpgroup copies
    K and V for two consumer warpgroups, one block an SM walks items drawn from a global counter, so an item's
    start and epilogue hide under the next one's loads. Whole call, N = 4k, interleaved rounds against the
    one-block-an-item kernel (H100 2026-11-27, benchmarks/NOTES.md "The producer's copies"): plain 563 vs 525,
    causal 518 vs 473, prefix LM 545 vs 472, ALiBi 495 vs 450, sliding window 1024 428 vs 370, softcap 401 vs 364.
    Under a block list the same kernel: the document mask 244 vs 231 and 229 vs 217 in two calls (H100
    2026-11-27, NOTES "Block lists on the persistent kernel"; its producer's registers: emit_fa3_ws.registers).
    A score that reads a [q, kv] tile of a table (`table_tile`: from_ir.reads_table_tile, a bias[h, q, kv]) takes
    the warp-specialized kernel at D = 64 too, on 128 x 128 tiles (`tiles`), which copies the table's tile into
    shared memory a kv tile ahead: bias 204 vs 189 on this module's kernel (Flex's own config failed; H100
    2026-11-24). At D = 64 without a mask or under a static one, with an SM count, the persistent kernel on
    `WIDE_TILES` (192 x 128: three consumer warpgroups in turns) where `wide_tiles_pay` (falower.compile counts
    both tilings' work at the call's lengths) and validate_spec allow; else this module's kernel (measured in
    `wide_tiles_pay`). Not under a block list, which that kernel takes when asked: the document mask ran 1.036x
    this module's kernel with ~8 documents a row (8 of 9 rounds, H200 2026-11-29), but the cost model, given the
    ids, counts 192 x 128 tiles 1.27x the work of 128 x 64 ones with 32 documents a row (1.10x with 8): shorter
    documents would lose, and a list's documents are data the choice cannot see.
    `FALOWER_WGMMA=0` turns it off, `FALOWER_WGMMA=1` takes it wherever the spec allows (also without a GPU:
    the simulator), `FALOWER_WGMMA=ws` the warp-specialized kernel at D = 128 under every mask kind, block
    tables too (to measure it there). The knobs: the softmax / P V overlap at D = 128 (v2: +4-6% there, -1 to
    -4% at D = 64). The caller still checks the spec with `validate_spec` and keeps mma.sync where it fails; the
    tiles are the caller's too (`tiles`)."""
    env = os.environ if env is None else env
    flag = env.get(ENV, "")
    if flag == "0" or dtype not in ("f16", "bf16") or head_dim not in (64, 128):
        return None
    if flag == "ws" and head_dim == 128:  # measuring: the warp-specialized kernel for every mask kind
        return dict(WS_EXTRA)
    if flag not in ("1", "ws") and (cc is None or cc[0] != 9):
        return None
    if head_dim == 128 and block_mask in ("none", "static", "list") and not table_tile and sm_count:
        return {**PERSIST_EXTRA, "persistent": int(sm_count)}
    if head_dim == 128 and block_mask in ("none", "static", "list"):  # the 256-thread warp-specialized kernel
        return dict(WS_EXTRA)
    if table_tile and block_mask == "none":  # D = 64: a [q, kv] table tile through shared memory (emit_fa3_ws)
        return dict(WS_EXTRA)
    if head_dim == 64 and block_mask in ("none", "static") and not table_tile and sm_count:  # 3 consumer warpgroups
        return {**PERSIST_EXTRA, "persistent": int(sm_count)}
    return plain_extra(head_dim, block_mask)


def plain_extra(head_dim: int, block_mask: str = "none") -> dict:
    """spec.extra of this module's (non-specialized) kernel: the softmax / P V overlap at D = 128 only; at D = 64
    without a mask or under a static one, one warpgroup per 128 rows (`wg_rows`), three blocks an SM
    (`blocks_per_sm`): plain 402 vs 391 TFLOP/s for two warpgroups of 64 rows, causal 366 vs 340, prefix LM 360
    vs 320, sliding window 1024 309 vs 274 (Flex 398 / 349 / 352 / 286; H100 N = 4k, 2026-11-24). Block lists
    (the document mask: 174 vs 193, its hoisted row bounds spill there) and block tables keep 64 rows."""
    extra = {"schedule": "wgmma", "overlap": head_dim == 128}
    if head_dim == 64 and block_mask in ("none", "static"):
        extra["wg_rows"] = 128
    return extra


def tiles(head_dim: int, block_mask: str = "none", table_tile: bool = False,
          persistent: bool = False, two: bool = False, decode: bool = False) -> tuple[int, int]:
    """block_q x block_k of the automatic choice: 128 x 128 at D = 128 (400 vs 383 TFLOP/s for 128 x 64 at
    N = 4k), block lists included since the row bounds and the ws kernel's copies (the document mask, 8 documents
    a row at N = 4k: 227 vs 204 on 128 x 64, twice in one call, H100 2026-11-24; 135 vs 173 before them);
    128 x 64 at D = 64 (349 vs 293 for 128 x 128: 255 registers with 128-wide S), except for a score that
    reads a table tile (`auto_extra`: 128 x 128 on the warp-specialized kernel) and the persistent kernel
    (`persistent`, D = 64: `WIDE_TILES`, three consumer warpgroups; `two`: on a small grid, `TWO_TILES`, two;
    `decode`: a call of at most 64 query rows, DECODE_TILES, one)."""
    if persistent and decode:
        return DECODE_TILES
    if head_dim == 64 and persistent:
        return TWO_TILES if two else WIDE_TILES
    if head_dim == 64 and table_tile and block_mask == "none":
        return (128, 128)
    return (128, 128) if head_dim == 128 else (128, 64)


WIDE_TILES = (192, 128)  # D = 64's persistent kernel: three consumer warpgroups of 64 rows (FlashAttention-3's tile)
TWO_TILES = (128, 128)  # ... the same kernel with two consumer warpgroups: a small grid's (two_rounds_pay)
DECODE_TILES = (64, 128)  # the persistent kernel with one consumer warpgroup: decoding's (M <= 64: a 128-row q tile
# would run its second warpgroup's wgmmas on padding)
DECODE_MAX_ROWS = 64
DECODE_TILE_RATE = 0.72  # a 64-row q tile's kv step against a 128-row tile's (one consumer warpgroup, whose softmax
# no second warpgroup overlaps: 1.1 against 1.6 us at D = 128, 1.0 against 1.4 at D = 64, H200; decode_tiles_pay)
SPLIT_MERGE_STEPS = 2.5  # split-kv's merge, with its launch, in 128-row kv steps (~4 us)
DECODE_PREFILL_MIN_KV_TILES = 2  # the fewest kv tiles a longer call's 64-row q tiles visit on average to take them
WIDE_MIN_WORK_RATIO = 0.85  # the least (128 x 64 tiles' visited FLOPs) / (WIDE_TILES') that takes them (below)
WIDE_REFERENCE_N = 4096  # the longest length at which falower.compile counts both tilings' work (and where no size)
WIDE_MIN_N = 1024  # the shortest kv length (rounded up to 64) that takes them: shorter items cannot pay their fixed
# costs


def wide_tiles_pay(narrow_flops: float, wide_flops: float, n: int = WIDE_REFERENCE_N) -> bool:
    """Whether D = 64 takes the three-warpgroup kernel's 192 x 128 tiles over emit_fa3's 128 x 64, given the FLOPs
    each tiling visits at a call's sequence lengths and its kv length `n` (falower.compile: rounded up to multiples
    of 64, at most WIDE_REFERENCE_N; the cost model counts the tiles a static mask leaves, as the kernels visit them).

    Why a work ratio: the wide kernel does ~1.2x the work a second (H200 2026-11-29, N = 4k, five interleaved
    rounds against 128 x 64: plain 1.198 at a work ratio of 0.974, causal 1.137 at 0.920, ALiBi 1.069, the softcap
    1.094, prefix LM 1.138, GQA 1.187, the naive code 1.162), but a mask's edges cost it more: a row's band of 49
    columns (`sliding_window`) is 0.600 as much work on 128 x 64 tiles and ran 0.787 as fast; the 1024 window
    (0.879) 1.003; causal at N = 1k (0.753 there) 0.92 as fast, at N = 2k (0.898) 1.05. So the choice is made per
    call size (FlashAttention-3 takes 192 x 128 at D = 64 whatever N). With the short q tile first
    (tile{ragged_q=first}, falower.compile's where it counts less work) causal's ratio at 1k is 0.893 and the wide
    tiles ran 1.02x there (2026-11-29), so causal takes them from 1k.

    Why a least kv length: an item's fixed costs (Q's load, the pipeline's fill, O's epilogue by three warpgroups)
    are spread over n / 128 kv tiles. Plain at a work ratio of 0.889 ran 0.92 as fast as 128 x 64 at N = 512 (four
    kv tiles an item: ~1.04x the work a second), 0.99 at 1k (~1.11x), and 1.15 at 2k (0.97: ~1.19x) (H200
    2026-11-29, one call, the per-size dispatch's first run). So N < WIDE_MIN_N keeps 128 x 64."""
    return n >= WIDE_MIN_N and narrow_flops >= WIDE_MIN_WORK_RATIO * wide_flops


TWO_RATE = 1.25  # a 192-row item's time over a 128-row one's, as many rows a second as WIDE_TILES' item gives


def two_rounds_pay(items_two: int, items_wide: int, sm_count: int, uniform: bool = True) -> bool:
    """Whether D = 64's persistent kernel on TWO_TILES (two consumer warpgroups: `items_two` q tiles) finishes
    before the one on WIDE_TILES (three: `items_wide`) on `sm_count` SMs, by rounds of one item an SM: a round of
    wide items takes 192 / 128 / TWO_RATE = 1.2 rounds of 128-row ones. Under a mask (`uniform` False: the items'
    work differs, causal's from one tile to all) only where the 128-row items fit one round.

    Measured (H200 2026-11-30, bare kernels, seven interleaved rounds each, benchmarks/NOTES.md "Small grids"; the
    two-warpgroup kernel against the 192-row one): without a mask 1.13x / 1.10x / 1.14x at B = 1, H = 8, N = 1k /
    2k / 4k and 1.14x at B = 2, H = 8, N = 2k (one or two rounds); 0.997x at B = 1, H = 16, N = 4k and 0.86-0.96x
    on larger grids (an earlier call). Causal: 1.14x / 1.15x at B = 1, H = 8, N = 1k / 2k (one round), 0.987x at
    N = 4k and 0.960x at B = 2, H = 8, N = 2k (two rounds: the short items of the later rounds fill the SMs the
    long ones leave), 0.86-1.00x on larger grids. Why: with few items an item's length is the launch's, and a
    128-row item is shorter; with many rounds the three warpgroups' higher rate on the tensor cores wins (1.17x at
    B = 4, H = 32)."""
    def rounds(items: int) -> int:
        return -(-items // max(1, sm_count))

    if not uniform and items_two > sm_count:
        return False
    return rounds(items_two) * TWO_TILES[0] * TWO_RATE < rounds(items_wide) * WIDE_TILES[0]


def small_grid_steps(items: int, kv_tiles: float, sm_count: int, rate: float) -> float:
    """A small grid's time in 128-row kv steps, as decode_tiles_pay counts it: `items` q tiles of `kv_tiles` kv
    tiles each (on average under a mask) in auto_kv_parts' parts, the rounds of the `sm_count` blocks those parts
    make, each part's tiles at `rate` steps a tile, and the merge where there are parts."""
    parts = auto_kv_parts(items, int(kv_tiles), sm_count)
    rounds = -(-items * parts // max(1, sm_count))
    return rounds * kv_tiles / parts * rate + (SPLIT_MERGE_STEPS if parts > 1 else 0.0)


def decode_tiles_pay(items64: int, tiles64: float, items128: int, tiles128: float, sm_count: int) -> bool:
    """Whether a call of more than DECODE_MAX_ROWS query rows takes decoding's 64-row q tiles (DECODE_TILES, one
    consumer warpgroup) over 128-row ones: where small_grid_steps says its `items64` q tiles of `tiles64` kv tiles
    finish first (DECODE_TILE_RATE a tile) against the `items128` of `tiles128` (1 a tile). On a grid that fills
    half the SMs or less, twice the q tiles fill it where the 128-row grid would split (a merge) or idle; on a full
    grid the 64-row tiles' lower rate loses (compiler._decode_tiles does not count where the 128-row q tiles fill
    more than KV_SPLIT_MAX_FILL of the blocks: there the 64-row ones take two rounds at least, 1.44 steps a 128-row
    one's). The count is the 128 x 128 tiling's also at D = 64, where the call would take 192 x 128 or 128 x 64
    tiles, and counts the short q tile last. Not where the 64-row tiles visit fewer than DECODE_PREFILL_MIN_KV_TILES
    on average: there an item is its fixed costs (the 48-wide window's 1.5 ran 0.90-0.94x at D = 64, 1.04x at
    D = 128). Measured (H200, 2026-11-30, CUDA graphs, GPU time, 43 grids at D = 64 and 128, plain, causal and the
    48-wide window, B H = 1-16, N = 512-4k; benchmarks/NOTES.md "Small prefill grids on 64-row q tiles"):
    where the model picks the 64-row tiles they ran 0.97-1.32x (B = 1, H = 8, N = 1k: 1.15-1.29x; the 0.97 causal
    D = 128 at N = 2k, H = 4), and where it keeps the other tiles, forced 64-row tiles ran 0.68-1.06x."""
    return (tiles64 >= DECODE_PREFILL_MIN_KV_TILES
            and small_grid_steps(items64, tiles64, sm_count, DECODE_TILE_RATE)
            < small_grid_steps(items128, tiles128, sm_count, 1.0))


KV_PARTS_MAX = 16  # split-kv's most parts (a power of two: the kernel decodes and shares by shifts)
KV_PART_MIN_TILES = 4  # the fewest kv tiles a part keeps: an item's fixed cost is ~2 tiles (NOTES, "Counting the
# per-item cost"), and the merge reads every part's O again
KV_PART_MIN_TILES_DECODE = 2  # the same for decoding's 64-row q tiles (at most DECODE_MAX_ROWS rows: a kv tile is its
# 64 KB of K and V, not the tensor cores' time; a small prefill grid's: half a 128-row tile's work a kv tile): a
# decoding window's 8 kv tiles ran 1.15-1.22x faster in 4 parts than in the 2 that KV_PART_MIN_TILES allows, small
# prefill grids (B = 1, H = 1-2, N = 512-1k) 1.02-1.23x (H200 2026-11-30, benchmarks/NOTES.md "the longest item's
# parts", "Parts of two kv tiles")
KV_PARTS_CLUSTER = 8  # decoding's parts of one kv tile each where that makes at most this many, and the count at
# which split-kv's merge runs inside a cluster unasked (emit_fa3_ws.cluster_merge): measured (H200 2026-11-30, CUDA
# graphs, whole calls, B = 1, H = 8, M = 1 / 16, benchmarks/NOTES.md "The merge inside a cluster") 8 parts merged in
# a cluster 1.04-1.12x the count before (4 parts and the merge kernel at N = 1k, 8 at 2k-3k), 4 parts of one tile
# at N = 512 1.05-1.07x over 2 of two. (4 and 2 parts in a cluster read 0.89-0.97x the merge kernel's then, while a
# captured call still zeroed its counters in the graph; since, 4 parts 1.08-1.15x and decoding's 2 and 4 up to the
# SMs 1.03-1.15x: compiler._cluster_small_grid.) A call whose grid has more clusters than the device holds at once
# runs the merge kernel instead (FA2ForwardKernel.plan: B = 2, H = 8 decoding's 16 clusters of 8 on the H200's 15),
# or, up to KV_FEWER_PARTS_MAX_KEYS, half the parts in clusters of that half (compiler._fewer_parts_held)

KV_FEWER_PARTS_MAX_KEYS = {64: 1024, 128: 2048}  # by D, the longest cache for which decoding's q tiles take half
# of KV_PARTS_CLUSTER's parts, merged in clusters of that half, where the device holds too few of KV_PARTS_CLUSTER's
# clusters at once (compiler._fewer_parts_held). B = 2, H = 8 on the H200 (16 clusters of 8, 15 held), 4 parts in
# clusters of 4 against 8 by the merge kernel, caches in L2 / cold: D = 128 1.10 / 1.10x at N = 1k, 1.02 / 1.07x at
# 2k, 0.93 / 0.97x at 3k; D = 64 1.14 / 1.11x at 1k, 0.98 / 0.98x at 2k; GQA (D = 128) 1.04 / 1.17x at 2k, 0.91 /
# 1.04x at 4k (benchmarks/NOTES.md, fifty-sixth session)


KV_SPLIT_MAX_FILL = 0.5  # the largest share of the SMs an unsplit grid may fill and still take parts (below)


def auto_kv_parts(items: int, kv_tiles: int, sm_count: int, min_tiles: int = KV_PART_MIN_TILES) -> int:
    """split-kv's parts for a call whose grid is `items` q tiles (batch x heads x q tiles) of `kv_tiles` kv tiles
    each (its longest q tile's, under a mask: compiler._longest_kv_tiles), on the persistent kernel's `sm_count`
    blocks: 1 (no split) where the grid fills more than KV_SPLIT_MAX_FILL of the blocks; else the most parts, a power
    of two up to KV_PARTS_MAX, that still fit one round of the blocks (items x P <= sm_count) and leave each part
    `min_tiles` tiles (KV_PART_MIN_TILES; decoding's KV_PART_MIN_TILES_DECODE).

    Measured (H200 2026-11-30, each kernel and the merge captured in CUDA graphs, GPU time only; benchmarks/NOTES.md
    "split-kv on the GPU", "The merge 16 bytes a thread"): decoding's shapes (B = 1, H = 8, M = 1 or 64: 8 q tiles,
    N = 8k / 32k) 4.6-9.2x faster with 16 parts than without. The small prefill grid (B = 1, H = 8, N = 1k: 64 q
    tiles of 8 kv tiles) with two parts: 1.03-1.04x at D = 128 and 1.06-1.11x at D = 64 (three calls; the merge
    16 bytes a thread: 0.73-0.91x with the first merge), so a grid filling half the SMs splits; at N = 2k (128 q
    tiles: two parts make two rounds) 0.81-0.98x, so a fuller grid does not. A grid of 8 items leaves 124 SMs idle."""
    if items > KV_SPLIT_MAX_FILL * sm_count:
        return 1
    P = 1
    while 2 * P <= KV_PARTS_MAX and items * 2 * P <= sm_count and kv_tiles >= 2 * P * min_tiles:
        P *= 2
    return P


def recommended_schedule(head_dim: int) -> dict[str, int]:
    """Tile sizes for the wgmma forward: two warpgroups (128 query rows), `tiles(head_dim)`; num_warps is
    mma.sync's knob (8 = the two warpgroups' warps, for specs written by hand)."""
    bq, bk = tiles(head_dim)
    return {"block_q": bq, "block_k": bk, "num_warps": 8}


def wg_rows(spec: FA2ForwardSpec) -> int:
    """Query rows a warpgroup owns (spec.extra["wg_rows"]): 64 (one m64 wgmma row block; the default) or 128
    (two: each thread holds four rows, S and O of the second half in sc1 / acc1). With 128, a block of 128 rows
    is one warpgroup: the per-tile costs a thread pays (copies, descriptors, loop control, the block's barrier)
    are spread over twice the scores, and the second half's S = Q K^T runs while the first half's softmax does
    (FlexAttention's structure at D = 64: one warpgroup per 128 rows)."""
    return int(spec.extra.get("wg_rows", 64))


WIDE_ROWS_REGISTERS = 160  # S, O and P's words of 128 rows a warpgroup at D = 64, 64-wide kv tiles (measured)


def wide_rows_registers(block_k: int, head_dim: int) -> int:
    """A thread's accumulator registers with 128 rows a warpgroup: two halves of S (block_k / 2), O (D / 2) and P's
    16-bit pairs (block_k / 4)."""
    return 2 * (block_k // 2 + head_dim // 2 + block_k // 4)


def wide_rows_fit(block_q: int, block_k: int, head_dim: int) -> bool:
    """128 rows a warpgroup where it was measured to pay: 128-row multiples of q tiles whose accumulators fit
    WIDE_ROWS_REGISTERS (D = 64 with 64-wide kv tiles; 128-wide ones would hold 256 and spill)."""
    return block_q % 128 == 0 and wide_rows_registers(block_k, head_dim) <= WIDE_ROWS_REGISTERS


def threads_per_block(spec: FA2ForwardSpec) -> int:
    """One warpgroup per `wg_rows` query rows (spec.num_warps, chosen for mma.sync, is not used here)."""
    if spec.extra.get("schedule") == "wgmma-ws":  # the warp-specialized schedule: emit_fa3_ws.py
        from . import emit_fa3_ws

        return emit_fa3_ws.threads_per_block(spec)
    return 128 * (spec.block_q // wg_rows(spec))


def grid(spec: FA2ForwardSpec, B: int, H: int, M: int, N: int) -> tuple[int, int, int]:
    return grid_3d(spec, -(-M // spec.block_q), B, H)


def overlapped(spec: FA2ForwardSpec) -> bool:
    """spec.extra["overlap"]: issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} together and do tile j's softmax
    while the second runs (FA3's intra-warpgroup overlap). Needs a third V buffer: V_{j-1} is still read when
    the loads of tile j + 1 are issued."""
    return bool(spec.extra.get("overlap", False))


def _layout(spec: FA2ForwardSpec) -> dict[str, int]:
    """Byte offsets from the aligned base (each tile [D // 64][rows][128 B]): Q, then K0, V0, K1, V1; with
    overlap Q, K0, K1, V0, V1, V2."""
    D, BQ, BK = spec.head_dim, spec.block_q, spec.block_k
    tile = BK * D * 2
    n = 5 if overlapped(spec) else 4
    return {"q": 0, "kv": BQ * D * 2, "tile": tile, "total": BQ * D * 2 + n * tile}


def smem_bytes(spec: FA2ForwardSpec) -> int:
    if spec.extra.get("schedule") == "wgmma-ws":  # the warp-specialized schedule: emit_fa3_ws.py
        from . import emit_fa3_ws

        return emit_fa3_ws.smem_bytes(spec)
    return _layout(spec)["total"] + ALIGN


SMEM_PER_SM = 233472  # H100: 228 KiB of shared memory per SM, 1 KiB of it reserved per block


def blocks_per_sm(spec: FA2ForwardSpec) -> int:
    """Blocks per SM the kernel is built for: 2 where two fit in shared memory and the S and O accumulators
    (block_k / 2 + D / 2 f32 registers a thread) take at most half of the 128 registers two blocks of 256
    threads leave a thread: D = 64 with 64-wide kv tiles (49 KB a block, 64 accumulators), else 1. With 2,
    launch bounds cap registers at 128, which ptxas meets without spills for the plain and causal kernels;
    uncapped, the causal D = 64 kernel took 139 and ran one block per SM (213 TFLOP/s against 371 for the
    plain kernel at 101 registers, H100 N = 4k, 2026-11-23). 128-wide kv tiles at D = 64 spill under the cap."""
    if "blocks_per_sm" in spec.extra:  # asked for (measuring): launch bounds for that many blocks
        return int(spec.extra["blocks_per_sm"])
    threads = threads_per_block(spec)
    if wg_rows(spec) == 128:
        # 128 rows a warpgroup: S, O and P's words (160 registers at D = 64, 64-wide kv tiles) fit the 168 a
        # thread of three 128-thread blocks gets, without spills for the static masks (plain 402 vs 374 TFLOP/s
        # for two blocks, causal 366 vs 324: H100 N = 4k, 2026-11-24); row bounds read from tables and kept
        # across the loop (row_bounds_read_data: 12 registers more) spill there (the document mask: 174 vs 183)
        need = wide_rows_registers(spec.block_k, spec.head_dim)
        fits3 = 3 * (smem_bytes(spec) + 1024) <= SMEM_PER_SM
        if threads == 128 and need <= WIDE_ROWS_REGISTERS and not row_bounds_read_data(spec) and fits3:
            return 3
        return 2 if threads == 128 and 2 * (smem_bytes(spec) + 1024) <= SMEM_PER_SM else 1
    accumulators = spec.block_k // 2 + spec.head_dim // 2
    fits = 2 * (smem_bytes(spec) + 1024) <= SMEM_PER_SM and threads <= 256
    return 2 if fits and accumulators <= 64 else 1


def validate_spec(spec: FA2ForwardSpec) -> None:
    if spec.extra.get("schedule") == "wgmma-ws":  # the warp-specialized schedule checks this and its own
        from .emit_fa3_ws import validate_spec as validate_ws

        return validate_ws(spec)
    D, BQ, BK = spec.head_dim, spec.block_q, spec.block_k
    if spec.kv_parts > 1:
        raise ValueError(f"split-kv ({spec.kv_parts} parts) is emitted by the persistent warp-specialized wgmma "
                         "kernel only (schedule wgmma-ws)")
    if spec.path != "mma" or spec.dtype not in ("f16", "bf16"):
        raise ValueError(f"wgmma path: dtype must be f16 or bf16, got {spec.dtype}")
    if D not in (64, 128):
        raise ValueError(f"wgmma path: head_dim must be 64 or 128 for now, got {D}")
    if BK % 16 or not 16 <= BK <= 256:
        raise ValueError(f"wgmma path: block_k must be a multiple of 16 in [16, 256], got {BK}")
    if wg_rows(spec) not in (64, 128):
        raise ValueError(f"wgmma path: wg_rows (query rows a warpgroup) must be 64 or 128, got {wg_rows(spec)}")
    if BQ % wg_rows(spec) or not 64 <= BQ <= 256:
        raise ValueError(f"wgmma path: one warpgroup (4 warps) per {wg_rows(spec)} query rows, 1-4 of them; "
                         f"got block_q={BQ}")
    if wg_rows(spec) == 128 and overlapped(spec):
        raise ValueError("wgmma path: the softmax / P V overlap needs 64 rows a warpgroup (wg_rows=64)")
    if spec.block_mask == "list" and not {("kv_count",), ("kv_tiles",)} <= {c.derived for c in spec.captures}:
        raise ValueError("block_mask='list' needs the kv_count and kv_tiles captures")
    if "def score_fn" not in spec.device_source:
        raise ValueError("device_source must define score_fn")
    if spec.ragged_q_first:  # emit_fa3_ws.validate_spec checks its own, calling this without the flag
        raise ValueError("tile{ragged_q=first}: only the persistent wgmma-ws kernel starts q tiles before row 0 (its "
                         "TMA loads zero them, its stores skip them); tile with ragged_q=last for this kernel")
    if spec.has_mask and "def mask_fn" not in spec.device_source:
        raise ValueError("has_mask needs a mask_fn in device_source")
    if spec.block_mask in ("static", "list") and "def tile_class_fn" not in spec.device_source:
        raise ValueError(f"block_mask={spec.block_mask!r} needs a tile_class_fn in device_source")
    threads = threads_per_block(spec)
    if threads % (D // 8) or (threads // (D // 8)) % 8:
        raise ValueError("wgmma path: the block's threads must cover 8-row multiples of a tile in one sweep")
    if smem_bytes(spec) > 227 * 1024:
        raise ValueError(f"wgmma path: {smem_bytes(spec)} bytes of shared memory exceed 227 KB")


def _emit_loader_setup(c: _Code, threads: int, D: int) -> int:
    """Per-thread offsets of the tile copies: thread tid copies 16-byte chunk `tid % CH` of rows
    tid // CH + i * RSTEP (RSTEP a multiple of 8, so the swizzle term (row & 7) is the same for all of them)."""
    CH = D // 8
    c(f"ld_r0 = tid // {CH}")
    c(f"ld_c = tid % {CH}")
    c("ld_x = ((ld_c & 7) ^ (ld_r0 & 7)) << 4")
    return threads // CH


def _emit_load(c: _Code, rows: int, rstep: int, D: int, sdst: str, row0: str, nrows: str, garr: str, base: str,
               rs: str) -> None:
    """cp.async rows row0 .. row0 + rows - 1 of `garr` (row r at element base + r * rs) into the swizzled
    [D // 64][rows][64] tile at shared byte address sdst; rows >= nrows are zero-filled."""
    c(f"ld_s = {sdst} + (ld_c >> 3) * {rows * 128} + ld_r0 * 128 + ld_x")
    c(f"ld_row = {row0} + ld_r0")
    c(f"ld_g = {base} + ld_row * {rs} + ld_c * 8")
    c(f"ld_safe = {base} + ld_c * 8")
    # one device function per row count, shared by the Q, K and V loads: their branches (one per row) stay out
    # of the kernel's body (benchmarks/NOTES.md, "Compile time", lever 17)
    fn = rows_helper(c, f"load_swz_rows_{rows // rstep}x{rstep}", rows // rstep, rstep, 128)  # the step's in the body
    c(f"{fn}(ld_s, {garr}, ld_g, ld_safe, {rs}, ld_row, {nrows})")


def _emit_row_addresses(c: _Code, garr: str, base: str, rs: str, rstep: int) -> None:
    """Before the kv loop: `<garr>_at`, the byte address of this thread's chunk of row 0 of garr's (b, head) slice,
    and `<garr>_rb` / `<garr>_rs`, the bytes a row and between this thread's rows: a tile with every row inside
    (`_emit_load_inside`) then costs a multiply and an add a row instead of `_emit_load`'s 64-bit index
    arithmetic and a compare per row (~40 integer instructions a kv tile at D = 64)."""
    c(f"{garr}_at = elem_addr({garr}, ({base} + ld_r0 * {rs} + ld_c * 8,))")
    c(f"{garr}_rb = np.uint64({rs} * 2)")
    c(f"{garr}_rs = np.uint64({rs} * {2 * rstep})")


def copy_rows_helper(c: _Code, n: int, rstep: int) -> str:
    """`copy_rows_<n>x<rstep>(s, a, step)`: n 16-byte cp.async from global addresses a + i * step to shared
    s + i * rstep rows of 128 bytes (a thread's chunks of a tile wholly inside its array, from kept row
    addresses)."""
    name = f"copy_rows_{n}x{rstep}"  # the step is in the body: in the name too (Code.helper refuses a clash)
    return c.helper(name, [
        "@device_function", f"def {name}(s, a, step):",
        f"    for it in range({n}):",
        f"        cp_async16_a(s + it * {rstep * 128}, a + np.uint64(it) * step, 16)"])


def _emit_load_inside(c: _Code, rows: int, rstep: int, D: int, sdst: str, row0: str, nrows: str, garr: str,
                      base: str, rs: str) -> None:
    """`_emit_load` of a tile of K or V (the addresses of `_emit_row_addresses`): rows wholly inside take the
    copies from the kept addresses, a tile reaching past nrows the zero-filling path."""
    c(f"if {row0} + {rows} <= {nrows}:")
    with c.indent():
        c(f"{copy_rows_helper(c, rows // rstep, rstep)}({sdst} + (ld_c >> 3) * {rows * 128} + ld_r0 * 128 + ld_x, "
          f"{garr}_at + np.uint64({row0}) * {garr}_rb, {garr}_rs)")
    c("else:")
    with c.indent():
        _emit_load(c, rows, rstep, D, sdst, row0, nrows, garr, base, rs)


def _emit_pv(c: _Code, KK: int, D: int, vbase: str, half: str = "", steps: Optional[range] = None,
             name: str = "pv_wgmma", scale_d: str = "") -> None:
    """O += P V from the A words in `pa` and the V tile at shared address vbase (issued and committed), through
    the device function `pv_wgmma`: the loop and the overlapped schedule's last tile share one compiled copy (16
    wgmma call sites of 64 accumulators each were half of the kernel's LLVM IR; benchmarks/NOTES.md, "Compile
    time", lever 18). P travels as a constant-indexed uint32 array (registers, as the accumulators): 32 words as
    arguments would make Python pass them as a built list (more than 30 arguments), which Numba types as a
    chain of tuple concatenations. `steps`: only these k steps (emit_fa3_ws's half tiles, whose other kv rows
    have P = 0), in the device function `name`. `scale_d`: an expression for the first k step's scale-d (0: O =
    P V, the old O ignored; the device function `<name>_sd` takes it as its argument `sd`)."""
    steps = range(KK) if steps is None else steps
    if scale_d:
        name += "_sd"
    lines = ["@device_function", f"def {name}(acc, pa, dv{', sd' if scale_d else ''}):",
             f"    # O += P V: {len(steps)} wgmma m64n{D}k16, k step k reads kv rows 16k .. 16k + 15 (2048 bytes on: "
             "the",
             "    # descriptor word dv = desc_word(HI_V, V's address) plus 128)",
             "    FENCE_O(acc, 0)"]
    for kk in steps:
        pa = ", ".join(f"lget(pa, {4 * kk + i})" for i in range(4))
        sd = "sd" if scale_d and kk == steps[0] else "1"
        lines.append(f"    WG_O(acc, 0, {pa}, desc_at(HI_V, dv + {kk * 128}), {sd})")
    lines.append("    wgmma_commit()")
    c(f"{c.helper(name, lines)}(acc{half}, pa{half}, desc_word(HI_V, {vbase}){', ' + scale_d if scale_d else ''})")


def _pack_pa_helper(c: _Code, KK: int, pack: str) -> str:
    """`pack_pa(pa, x)`: P (the S accumulators x after the softmax) to 16-bit pairs, the A words of P V: k step k
    takes n8 tiles 2k and 2k + 1, pa[4k .. 4k + 3] = (x[8k], x[8k + 1]), (x[8k + 2], x[8k + 3]), (x[8k + 4],
    x[8k + 5]), (x[8k + 6], x[8k + 7]) (mma.sync's A fragment: the wgmma accumulator per warp is mma.sync's C
    fragment repeated along N)."""
    return c.helper("pack_pa", ["@device_function", "def pack_pa(pa, x):", f"    for w in range({4 * KK}):",
                                f"        lset(pa, w, {pack}(lget(x, 2 * w), lget(x, 2 * w + 1)))"])


def _emit_row_inv(c: _Code, r: int) -> None:
    """inv = 1 / the row's sum over the lane quad (0 for a fully masked row), and that sum in lt: both epilogues."""
    c(f"lt = l_{r} + shfl_xor_f32(l_{r}, 1)")
    c("lt = lt + shfl_xor_f32(lt, 2)")
    c("inv = ZERO if lt == ZERO else rcp_approx(lt)  # not ONE / lt: rcp.rn is a call (serializes wgmma)")


def _lse_line(r: int, head: str) -> str:
    """The row's LSE in natural log (-inf for a fully masked row), after `_emit_row_inv`."""
    return f"lse[{head} + qi] = NEG_INF if lt == ZERO else (m_{r} + math.log2(lt)) * LN2"


def _emit_epilogue(c: _Code, D: int, rows: Optional[list] = None, head: str = "q_head") -> None:
    """A warpgroup's epilogue (this kernel's and emit_fa3_ws's): each of the thread's rows (`wgmma_thread_rows`)
    normalised by its sum over the lane quad, stored, and its LSE; fully masked rows -> O = 0, LSE = -inf. `head`:
    the (b, h) slice's first row of O and LSE (a persistent kernel's item before the one q_head now holds)."""
    c("# epilogue: one division per row, LSE in natural log, fully masked rows -> O = 0, LSE = -inf")
    for t in rows or wgmma_thread_rows():
        _emit_row_inv(c, t.k)
        c(f"qi = {t.row}")
        c("if 0 <= qi < M:  # rows before 0 (ragged_q_first) and past M: padding")
        with c.indent():
            c(f"store_row(o, ({head} + qi) * {D // 2} + (t2 >> 1), {t.acc}, {t.ofs}, inv)")
            c("if t2 == 0:")
            with c.indent():
                c(_lse_line(t.k, head))


def staged_epilogue(spec: FA2ForwardSpec) -> bool:
    """Whether this kernel stores O through its warpgroups' Q tiles (`_emit_staged_epilogue`): only where asked
    (spec.extra["staged_epilogue"] = True, bench '-se'), and at D = 64, where a warpgroup's rows of Q are one
    contiguous WR * 128 bytes (one column block). Not the default: measured at D = 64 against the direct stores in
    one call (H100, benchmarks/NOTES.md "Counting the per-item cost"): plain -2%, GQA -4%, softcap_approx -1%,
    causal +1%, ALiBi +5%, inside the spread of the same kernel timed twice there (3-6%); three blocks an SM
    already hide one block's epilogue behind the others' loops."""
    return spec.head_dim == 64 and not overlapped(spec) and spec.extra.get("staged_epilogue") is True


def _emit_staged_epilogue(c: _Code, D: int, pack: str, rows: list, wr: int, first_row: str, wtid: str,
                          barrier: str, free_barrier: str = "", base: str = "q_wg", lse_shared: str = "") -> None:
    """A warpgroup's epilogue through shared memory (this kernel's at D = 64 and emit_fa3_ws's): each of the
    thread's rows normalised into the warpgroup's own Q tile at q_wg (`wr` rows of D, contiguous, free once the
    last S is done; its LSE as `_emit_epilogue` writes it), `barrier`, then the warpgroup's rows (the first
    `first_row`) to O by 16-byte chunks, `wtid` the thread in the warpgroup: coalesced, a warp's store is whole
    rows, where the fragment's own layout gives 4-byte stores each touching 8 rows. benchmarks/timeline.py measured
    that epilogue at ~1.5 us an item at D = 128 (NOTES, "Counting the per-item cost"). The 16-byte chunks are
    swizzled by the row (chunk ^ (row & 7)): the fragment's writes (8 rows a warp) and the chunks' reads (8
    chunks of a row a quarter-warp) are then free of bank conflicts. Above D = 64 a staged row of 2 D bytes spans
    rows of the Q tile's [D // 64][64][128 B] layout that other warps' parts of S read, and a warp's wgmma wait
    returns when its own part is done: `free_barrier` (the warpgroup's) goes first there. `base`: another buffer
    of `wr` rows of D to stage through (emit_fa3_ws's persistent producer kernel, whose Q tile is being refilled);
    its `free_barrier` then keeps a warp from staging over rows another is still storing from the last item.
    `lse_shared`: the rows stay where they are staged and each row's LSE goes to this shared element (of `lr`, the
    row in the warpgroup's), not to global memory (emit_fa3_ws.cluster_merge: the cluster's blocks read both)."""
    stage = stage_row_helper(c, D, pack)
    if D > 64:
        if not free_barrier:
            raise ValueError(f"staged epilogue at D = {D}: a warp's staged rows overlap other warps' Q rows; "
                             "it needs the warpgroup's barrier first")
        c(free_barrier)
    c("# epilogue: one division per row, LSE in natural log, fully masked rows -> O = 0, LSE = -inf; O through this")
    c("# warpgroup's Q tile in shared memory (its last S is done), then to global memory by 16-byte chunks")
    for t in rows:
        _emit_row_inv(c, t.k)
        c(f"lr = (warp & 3) * 16 + {t.off} + g  # the row in the warpgroup's {wr}")
        c(f"{stage}({base} + lr * {2 * D} + 2 * t2, np.uint32(lr & 7), {t.acc}, {t.ofs}, inv)")
        if lse_shared:
            c("if t2 == 0:")
            with c.indent():
                c(_lse_line(t.k, "q_head").replace("lse[q_head + qi]", lse_shared))
            continue
        c(f"qi = {t.row}")
        c("if 0 <= qi < M and t2 == 0:")
        with c.indent():
            c(_lse_line(t.k, "q_head"))
    c(barrier)
    if not lse_shared:
        emit_staged_stores(c, D, wr, first_row, wtid, base)


def stage_row_helper(c: _Code, D: int, pack: str, zero_masked: bool = False, box_bytes: int = 0) -> str:
    """The device function `stage_row` of the staged epilogues: a row's O pairs times inv, packed, into its
    swizzled row of a staging buffer. `zero_masked` (`stage_row_z`): a row with inv = 0 (fully masked, or an
    item with no kv tile) stages zeros whatever O holds, for an epilogue whose O was not zeroed at the item's
    start (emit_fa3_ws.epilogue_in_s: O may still hold the item before's, inf or NaN included). `box_bytes`
    (`_box`): the row is 128 bytes of each of D / 64 boxes `box_bytes` apart (a TMA copy's 64-column boxes)."""
    name = ("stage_row_z" if zero_masked else "stage_row") + ("_box" if box_bytes else "")
    value = f"{pack}(lget(x, e) * inv, lget(x, e + 1) * inv)"
    where = (f"sa + np.uint32((dn >> 3) * {box_bytes}) + ((np.uint32(dn & 7) ^ sw) << np.uint32(4))" if box_bytes
             else "sa + ((np.uint32(dn) ^ sw) << np.uint32(4))")
    lines = ["@device_function", f"def {name}(sa, sw, x, i, inv):",
             "    # a row's pairs (columns 8 dn + 2t, + 1) into its shared row at sa (byte 4t of chunk dn ^ sw" +
             ("; chunk dn % 8 ^ sw of box dn // 8)" if box_bytes else ")"),
             f"    for dn in range({D // 8}):",
             "        e = i + dn * 4",
             f"        v = {value} if inv != ZERO else np.uint32(0)" if zero_masked else f"        v = {value}",
             f"        sts_u32({where}, v)"]
    return c.helper(name, lines)


def stage_rows_stsm_helper(c: _Code, D: int, pack: str, box_bytes: int, scaled: bool = True) -> str:
    """The device function `stage_rows_stsm`: a warp's 16 rows of O (rows g and g + 8 of each thread, at offsets i0
    and i1 of x) times their 1 / l, packed, into the warp's D / 64 boxes at wb (16 rows of 128 bytes each,
    `box_bytes` apart, in the 128-byte swizzle: row r's chunk c at (c ^ (r & 7)) << 4), by D / 16 stmatrix .x4, where
    stage_row_z_box stores a word at a time (D / 4 STS a thread). Instruction k stores chunks 2k and 2k + 1 of rows
    0-7 and 8-15: matrix m is rows 8 (m & 1) .. + 7 of chunk 2k + (m >> 1), lane l gives row l & 7 of matrix l >> 3,
    and a lane's word m is its own (row g + 8 (m & 1), columns 2t, 2t + 1 of that chunk), as the accumulator's
    fragment holds it. A row with 1 / l = 0 stages zeros (as stage_row_z; a NaN 1 / l, a row a NaN score reached,
    stages NaN, as the IR's O). `scaled` False: `stage_rows_stsm_plain(wb,
    lane, x, i0, i1)`, the rows as they are (the backward's dK and dV: emit_fa3_bwd.dkdv_tma)."""
    if scaled:
        word = "{p}(lget(x, {i} + {o}) * {inv}, lget(x, {i} + {o} + 1) * {inv}) if {inv} != ZERO else np.uint32(0)"
    else:
        word = "{p}(lget(x, {i} + {o}), lget(x, {i} + {o} + 1))"
    name = "stage_rows_stsm" if scaled else "stage_rows_stsm_plain"
    lines = ["@device_function", f"def {name}(wb, lane, x, i0, i1{', inv0, inv1' if scaled else ''}):",
             "    r = np.uint32(lane & 7)  # the row of its matrix this lane gives the address of",
             "    m = np.uint32(lane >> 3)  # ... and the matrix: rows 8 (m & 1) .., chunk 2k + (m >> 1)",
             "    row = wb + ((m & np.uint32(1)) * np.uint32(8) + r) * np.uint32(128)",
             "    hi = m >> np.uint32(1)",
             f"    for k in range({D // 16}):",
             "        dn = np.uint32(2 * k) + hi",
             f"        at = row + (dn >> np.uint32(3)) * np.uint32({box_bytes}) "
             "+ (((dn & np.uint32(7)) ^ r) << np.uint32(4))",
             "        w0 = " + word.format(p=pack, i="i0", o="8 * k", inv="inv0"),
             "        w1 = " + word.format(p=pack, i="i1", o="8 * k", inv="inv1"),
             "        w2 = " + word.format(p=pack, i="i0", o="8 * k + 4", inv="inv0"),
             "        w3 = " + word.format(p=pack, i="i1", o="8 * k + 4", inv="inv1"),
             "        stsm_x4(at, w0, w1, w2, w3)"]
    return c.helper(name, lines)


def emit_staged_stores(c: _Code, D: int, wr: int, first_row: str, wtid: str, base: str,
                       head: str = "q_head") -> None:
    """The staged epilogue's second half: the `wr` staged rows of D at `base` (the first `first_row` of the
    slice at `head`) to O by 16-byte chunks, `wtid` the thread in the warpgroup."""
    CH = D // 8
    c(f"ew = {wtid}")
    c(f"for ei in range({wr * CH // 128}):")
    with c.indent():
        c("ch = ew + ei * 128")
        c(f"lr = ch // {CH}")
        c(f"c16 = ch % {CH}")
        c(f"qi = {first_row} + lr")
        c(f"w0, w1, w2, w3 = lds_v4_u32({base} + lr * {2 * D} + ((c16 ^ (lr & 7)) << 4))")
        c("if 0 <= qi < M:  # rows before 0 (ragged_q_first) and past M: padding")
        with c.indent():
            c(f"stg_v4_u32(o, ({head} + qi) * {D // 2} + c16 * 4, w0, w1, w2, w3)")


def _emit_kernel(spec: FA2ForwardSpec) -> str:
    D, BQ, BK, G = spec.head_dim, spec.block_q, spec.block_k, spec.group_size
    threads = threads_per_block(spec)
    NJ, ND = BK // 8, D // 8
    KS, KK = D // 16, BK // 16
    lay = _layout(spec)
    T, KVOFF = lay["tile"], lay["kv"]
    pack = "pack_f16x2" if spec.dtype == "f16" else "pack_bf16x2"
    mma = "mma_f16" if spec.dtype == "f16" else "mma_bf16"
    caps = _score_args(spec)  # the captures, and the per-CTA values when score-licm hoisted some
    OVL = overlapped(spec)
    WR = wg_rows(spec)
    HALVES = WR // 64
    ROWS = wgmma_thread_rows(HALVES)
    SUF = [""] + ["1"] * (HALVES - 1)  # the accumulator arrays' suffix of each 64-row half

    c = _Code()
    c(f'WG_S = wgmma_ss("{spec.dtype}", {BK})  # S = Q K^T: both operands K-major in shared memory')
    c(f'WG_O = wgmma_rs("{spec.dtype}", {D}, 1)  # O += P V: P in registers, V MN-major (trans-b)')
    c(f"FENCE_S = wgmma_fence_regs({BK // 2})")
    c(f"WAIT_S = wgmma_wait_regs(0, {BK // 2})")
    c(f"WAIT_S1 = wgmma_wait_regs(1, {BK // 2})  # S done, the P V issued after it may still run")
    c(f"FENCE_O = wgmma_fence_regs({D // 2})")
    c(f"WAIT_O = wgmma_wait_regs(0, {D // 2})")
    c("HI_QK = desc_hi(16, 1024)  # K-major: 8-row groups 1024 bytes apart")
    c(f"HI_V = desc_hi({BK * 128}, 1024)  # MN-major: 64-column blocks {BK * 128} bytes apart, 8-row groups 1024")
    c()
    emit_masked_score(c, spec)
    emit_fragment_helpers(c, spec, NJ, ND, mma, pack)
    c("@kernel_jit")
    if blocks_per_sm(spec) > 1:
        c(f"@launch_bounds({threads_per_block(spec)}, {blocks_per_sm(spec)})  # registers <= "
          f"{65536 // (blocks_per_sm(spec) * threads_per_block(spec))}: {blocks_per_sm(spec)} blocks per SM")
    c(f"def {spec.name}({_signature(spec)}):")
    with c.indent():
        c(f'"""FA forward on wgmma: D={D}, block {BQ}x{BK}, {BQ // WR} warpgroup(s) of {WR} rows, {spec.dtype}."""')
        c("smem = cuda.shared.array(0, SMEM_DTYPE)")
        c("sb0 = smem_base(smem)")
        c(f"sb = sb0 + (({ALIGN} - (sb0 & {ALIGN - 1})) & {ALIGN - 1})  # 1024-byte aligned base")
        c("tid = cuda.threadIdx.x")
        c("lane = tid & 31")
        c("warp = tid >> 5")
        c("wg = tid >> 7")
        c("g = lane >> 2")
        c("t2 = (lane & 3) * 2")
        c("__OFFSETS__")
        c(f"nq = (M + {BQ - 1}) // {BQ}")
        emit_program_index(c, spec)
        c(f"hk = h // {G}" if G > 1 else "hk = h")
        c("q_head = (b * H + h) * M")
        emit_bases(c)
        _emit_tile_range(c, spec, uniform=True)
        c()
        rstep = _emit_loader_setup(c, threads, D)
        c(f"sq = sb  # Q: [{D // 64}][{BQ}][128 B]")
        c(f"q_wg = sq + wg * {WR * 128}  # this warpgroup's {WR} rows inside each column block")
        if HALVES == 2:
            c("wrow = q_lo + wg * 128 + (warp & 3) * 16 + g  # this thread's first row")
        c("# prologue: Q and the first K and V tiles (one cp.async group)")
        _emit_load(c, BQ, rstep, D, "sq", "q_lo", "M", "q", "qg", "q_sm")
        c("if kv_first <= kv_last:")
        with c.indent():
            _emit_load(c, BK, rstep, D, f"sb + {KVOFF}", f"kv_first * {BK}", "N", "k", "kg", "k_sm")
            _emit_load(c, BK, rstep, D, f"sb + {KVOFF + (2 * T if OVL else T)}", f"kv_first * {BK}", "N", "v",
                       "vg", "v_sm")
        c("cp_async_commit()")
        _emit_row_addresses(c, "k", "kg", "k_sm", rstep)
        _emit_row_addresses(c, "v", "vg", "v_sm", rstep)
        c()
        c("# online-softmax state of this thread's rows g and g + 8 of its warp's 16" +
          (" in each 64-row half" if HALVES == 2 else "") + "; S and O accumulators in")
        c("# constant-indexed local arrays (registers)")
        for u in SUF:
            c(f"acc{u} = cuda.local.array({D // 2}, np.float32)")
            c(f"sc{u} = cuda.local.array({BK // 2}, np.float32)")
            c(f"pa{u} = cuda.local.array({BK // 4}, np.uint32)  # P packed: the A words of P V, 4 per k16 step")
        for t in ROWS:
            c(f"m_{t.k} = NEG_INF")
            c(f"l_{t.k} = ZERO")
        c(f"for i in range({D // 2}):")
        with c.indent():
            for u in SUF:
                c(f"acc{u}[i] = ZERO")
        HOIST = row_bounds_read_data(spec)
        if HOIST:
            emit_row_bounds(c, spec, ROWS)
        c("j = kv_first")
        c("buf = 0")
        if OVL:
            c("vbuf = 0")
            c("have_prev = False  # P_{j-1} V_{j-1} still to issue")
            c(f"pv_base = sb + {KVOFF + 2 * T}")
        if carries_class(spec):
            c(f"cls_j = {_tile_class_expr(spec, 'kv_first')} if kv_first <= kv_last else 0  # tile j's class")
        c("while j <= kv_last:")
        with c.indent():
            _emit_next_tile(c, spec, "j", "jn", carry="cls_n")
            c(f"k_base = sb + {KVOFF} + buf * {T}" if OVL else f"k_base = sb + {KVOFF} + buf * {2 * T}")
            if OVL:
                c(f"v_base = sb + {KVOFF + 2 * T} + vbuf * {T}")
                c(f"n_kbase = sb + {KVOFF + T} - buf * {T}")
                c("vn = vbuf + 1 if vbuf < 2 else 0  # three V buffers, no run-time division")
                c(f"n_vbase = sb + {KVOFF + 2 * T} + vn * {T}")
            else:
                c(f"v_base = k_base + {T}")
                c(f"n_kbase = sb + {KVOFF + 2 * T} - buf * {2 * T}  # the other buffer")
                c(f"n_vbase = n_kbase + {T}")
            c("cp_async_wait0()  # K_j and V_j have landed (this thread's copies)")
            c("fence_proxy_async()  # ... and are visible to wgmma's async proxy")
            c("cuda.syncthreads()  # ... for every thread; every warpgroup is done with the buffers loaded next")
            c("if jn <= kv_last:")
            with c.indent():
                _emit_load_inside(c, BK, rstep, D, "n_kbase", f"jn * {BK}", "N", "k", "kg", "k_sm")
                _emit_load_inside(c, BK, rstep, D, "n_vbase", f"jn * {BK}", "N", "v", "vg", "v_sm")
            c("cp_async_commit()")
            c()
            c(f"# S = Q K^T: {KS} wgmma m64n{BK}k16" + (" a half" if HALVES == 2 else "") +
              "; k step s reads 16 columns: block s // 4, byte 32 * (s % 4)")
            for u in SUF:
                c(f"FENCE_S(sc{u}, 0)")
            c("dk = desc_word(HI_QK, k_base)  # K's descriptors: this word plus a k step's offset >> 4")
            for hh, u in enumerate(SUF):
                for ks in range(KS):
                    qa = f"q_wg + {hh * 64 * 128 + (ks // 4) * BQ * 128 + (ks % 4) * 32}"
                    ka = ((ks // 4) * BK * 128 + (ks % 4) * 32) >> 4
                    c(f"WG_S(sc{u}, 0, make_desc(HI_QK, {qa}), desc_at(HI_QK, dk + {ka}), {0 if ks == 0 else 1})")
                c("wgmma_commit()")
            if OVL:
                c("if have_prev:")
                with c.indent():
                    c("# O += P_{j-1} V_{j-1} runs while this tile's softmax does")
                    _emit_pv(c, KK, D, "pv_base")
                    c("WAIT_S1(sc, 0)")
                c("else:")
                with c.indent():
                    c("WAIT_S(sc, 0)")
            elif HALVES == 2:
                c("WAIT_S1(sc, 0)  # the first half's S is done; the second half's may still run")
            else:
                c("WAIT_S(sc, 0)")
            c()
            _emit_need_mask(c, spec, "j", cls="cls_j")
            for hh, u in enumerate(SUF):
                rows = [t for t in ROWS if t.sc == f"sc{u}"]
                if hh == 1:
                    c("# the second half: its S (P V of the first half may still run)")
                    c("WAIT_S1(sc1, 0)")
                c("# scores (log2 domain); mask arithmetic only on partial or ragged tiles")
                c("if need_mask:")
                with c.indent():
                    emit_masked_rows(c, spec, HOIST, rows)
                c("else:")
                with c.indent():
                    for line in score_row_calls(spec, rows):
                        c(line)
                c("# online softmax: new row max (quad shuffles), exponentiate; then rescale O")
                for t in rows:
                    c(f"m_{t.k}, alpha_{t.k}, rs = {softmax_call(spec, t.sc, t.ofs, f'm_{t.k}', t.row, 'kv0 + t2')}")
                    c(f"l_{t.k} = l_{t.k} * alpha_{t.k} + rs")
                if OVL:
                    c("WAIT_O(acc, 0)  # P_{j-1} V_{j-1} is done: O can be rescaled, the P registers reused")
                for t in rows:
                    c(f"scale_row({t.acc}, {t.ofs}, alpha_{t.k})")
                c("# P to 16-bit pairs: n8 tiles 2k, 2k + 1 of S are the A fragment of k step k")
                c(f"{_pack_pa_helper(c, KK, pack)}(pa{u}, sc{u})")
                if OVL:
                    c("have_prev = True")
                    c("pv_base = v_base")
                    c("vbuf = vn")
                else:
                    _emit_pv(c, KK, D, "v_base", u)
            if not OVL:
                for u in SUF:
                    c(f"WAIT_O(acc{u}, 0)")
            c("j = jn")
            if carries_class(spec):
                c("cls_j = cls_n")
            c("buf ^= 1")
        if OVL:
            c("if have_prev:  # the last tile's P V")
            with c.indent():
                _emit_pv(c, KK, D, "pv_base")
                c("WAIT_O(acc, 0)")
        c()
        c("cp_async_wait0()")
        if staged_epilogue(spec):
            _emit_staged_epilogue(c, D, pack, ROWS, WR, f"q_lo + wg * {WR}", "tid & 127",
                                  "cuda.syncthreads()  # every warpgroup's rows are in shared memory")
        else:
            _emit_epilogue(c, D, ROWS)
    text = c.text()
    used = sorted({int(n) for n in re.findall(r"\bofs_(\d+)\b", text)})
    ind = re.search(r"^( *)__OFFSETS__$", text, re.M).group(1)
    defs = "\n".join(f"{ind}ofs_{n} = np.int64({n})" for n in used)
    return re.sub(r"^ *__OFFSETS__$", lambda m: defs, text, count=1, flags=re.M)


def emit_fa3_forward(spec: FA2ForwardSpec) -> str:
    """Numba CUDA source of the wgmma forward kernel `spec.name` (a whole module)."""
    if spec.extra.get("schedule") == "wgmma-ws":  # the warp-specialized schedule: emit_fa3_ws.py
        from . import emit_fa3_ws

        return emit_fa3_ws.emit_fa3_ws_forward(spec)
    validate_spec(spec)
    header = _HEADER.format(spec_repr=_spec_comment(spec) + " schedule=wgmma").replace(
        "emit_fa2 -- do not edit.", "emit_fa3 -- do not edit.")
    code = _device_functions(spec) + "\n\n" + ssa_rename(_emit_kernel(spec))
    return header + _WGMMA_IMPORTS + "\n\n" + code
