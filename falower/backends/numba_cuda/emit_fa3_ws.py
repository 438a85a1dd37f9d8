"""Emit Numba CUDA source for the warp-specialized FlashAttention forward on Hopper's wgmma (issue 11, FA3's schedule).

`emit_fa3_ws_forward(spec)` returns one Python module from the same `FA2ForwardSpec` and kernel arguments as
emit_fa3 / emit_fa2, built from their pieces by import (the variant's device functions, tile range / next tile /
tile class under every block mask kind, the masked score, the per-row score / softmax / rescale / store helpers,
emit_fa3's swizzled cp.async tile loads, its P V issue over the packed P array and its P packing). The kernel's
repeated work is in device functions compiled once (S = Q K^T, each ring load, the next tile of a static block
mask: benchmarks/NOTES.md, "Compile time", round 5). What is new is the schedule:

* two consumer warpgroups (64 query rows each, block_q = 128) and a producer: by default one producer warp
  (288 threads, the warp after the consumers), or a producer warpgroup (`extra["producer"] = "warpgroup"`, 384
  threads, warpgroup 0) that hands registers to the consumers by `setmaxnreg` (40 / 232, or `producer_regs`).
  ptxas ignores setmaxnreg in a relocatable compile (C7504), which every linker makes, so such a kernel's PTX goes
  to the driver, which compiles it as a whole program at load (runtime.whole_program_ptx; measured on the H100:
  no C7504, 116 bytes of spills at 40 / 232 at D = 128, none at 56 / 224);
* registers: the SM allocates registers to warps in groups of 4, so a 9-warp block (288 threads) is sized like 12
  warps: 12 x 32 x 168 = 64512 fits the 65536, 176 does not. The producer-warp kernel is capped at 168
  (`MAX_REGS_WARP`, ptxas -maxrregcount through intrinsics.max_registers); at 224 every launch failed on the H100
  with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (701). At 168, D = 128 spills (plain 180 bytes, causal 208) and ptxas
  serializes the wgmmas for lack of registers (C7512): the softmax of S_j (64 registers) runs while
  P_{j-1} V_{j-1} holds O (64) and P (32). `registers_fit` is the rule; tests/backend check every emitted kernel;
* no producer (`extra["producer"] = "none"`): 256 threads, the two consumer warpgroups, no register cap (8 warps x
  255 fit: 214 at D = 128, no spills, no C75xx). Each warpgroup loads its own 64 Q rows (own Q tile and barrier);
  warpgroup 0 streams K, warpgroup 1 V through the ring, `stages` - 1 tiles ahead (3 stages by default where they
  fit: 230512 bytes at D = 128 with 128 x 128 tiles), each load a cp.async ending in
  `cp.async.mbarrier.arrive.noinc` on the stage's full barrier (128 arrivals) and issued only after the stage's
  empty barrier completed (both warpgroups released it). The roles follow the ping-pong: warpgroup 0 refills
  K_(j-1)'s stage right after its S_j is done, when warpgroup 1's S_(j-1) (issued before it) is done too; warpgroup
  1, a turn behind, refills V_(j-1)'s stage after its own P_(j-1) V_(j-1), which warpgroup 0 finished first. So
  neither waits on the other in the common case. A block list's loader walks its own cursor (lkv_pos);
* the producer issues every load with cp.async: Q once, then K_j and V_j of each visited kv tile into a ring of
  `stages` (2, or 3) shared-memory stages. Each load ends with `cp.async.mbarrier.arrive.noinc` on the stage's
  full barrier (full_k[s], full_v[s]: one arrival per producer thread once its copies have landed); before
  refilling a stage it waits on the stage's empty barrier (empty_k[s], empty_v[s]: one arrival per consumer thread);
* consumers wait on the full barriers by phase parity (`mbarrier.try_wait.parity`), make the copies visible to the
  async proxy (`fence.proxy.async`) and issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} together (emit_fa3's overlap:
  the softmax of tile j runs while P_{j-1} V_{j-1} does); K_j's stage is released once S_j is done, V_{j-1}'s once
  P_{j-1} V_{j-1} is;
* ping-pong: each consumer warpgroup issues its wgmmas only in its turn, `bar.sync 1 + w, 256` (w = 0, 1), and hands
  the turn over right after issuing (`bar.arrive 2 - w, 256`), so one warpgroup's softmax runs while the other's
  wgmmas occupy the tensor cores (warpgroup 1 starts: warpgroup 2 arrives once on barrier 1 first). No block-wide
  barrier after the set-up.

Built when `spec.extra["schedule"] == "wgmma-ws"` (emit_fa2 and emit_fa3 dispatch here). Knobs in spec.extra:
"producer" ("warp"; "warpgroup", "none"), "stages" (2, "none": 3 where it fits; 3 fits at D = 128 with 128 x 128
tiles: 225 KB), "pingpong" (True), "regs" ((40, 232): the producer warpgroup's setmaxnreg counts), "walk" (True:
under a static mask with row bounds the kv loop walks [kv_first, kv_last], each tile's class from where it lies;
emit_fa2.walks_range). block_q 128 (two consumer warpgroups) or 192 (three: FlashAttention-3's D = 64 tile, so
far D = 64 on the persistent producer warpgroup with TMA loads, no mask, a static one or a block list; the turns
rotate 0 -> 1 -> 2 -> 0, each warpgroup handing over to the next's barrier, and the producer keeps 32 registers,
the consumers 160; D = 64's automatic choice where the tiles' work allows, emit_fa3.wide_tiles_pay: plain 1.17-1.20x emit_fa3's
128 x 64 kernel, H200 2026-11-29); D = 64 or 128; f16/bf16; sm_90a only.

A score that reads a [q, kv] tile of a table (a bias[h, q, kv]: emit_fa2.has_tile_table) gets the tile in shared
memory under producer "none" (`table_tiles`): each consumer warpgroup copies its 64 rows of tile j + 1 by cp.async
right after its softmax read tile j (after a named barrier of its 128 threads), and waits for them on its own
mbarrier before the next softmax; 16-byte chunks swizzled by (row & 3) << 1 so a half-warp's 8-byte reads hit
distinct banks. 64 KB at 128 x 128: K / V keep 2 stages at D = 128.

Persistent (`extra["persistent"]` = blocks): with producer "none" the consumers load the next item's Q and first
tiles in front of their epilogue; with a producer warpgroup the producer runs the ring across items and refills Q
once both consumer warpgroups are past an item's last S (the q_empty mbarrier), and stages O through a buffer of
its own where it fits; by default two Q buffers in that room instead (`q_double`: item k's Q loads once item
k - 2's epilogue has staged its O through it, each warp's rows then stored by two TMA tensor copies: `bulk_store`,
`tma_store`), and
under a static mask the next item's kv range scanned by the producer and handed over with its ticket
(`range_shared`). Items in a static serpentine order (`item_order` "grid"
or "cost"), or, with the producer warpgroup, from a global counter ("dynamic"). With the producer warpgroup and the counter it is the D = 128
default on Hopper (emit_fa3.auto_extra, `persistent_pays`): once its producer copied K / V from kept row addresses,
its masked tiles ran as fast as plain ones and it led one block an item on every example timed (benchmarks/NOTES.md,
"The producer's copies"); under a block list too, its producer reading each item's list a tile ahead of its copies.

Under the persistent kernel with two Q buffers, one producer thread loads Q, K and V by TMA tensor copies
(`tma_loads`, the default since the twenty-eighth session); without it the producer's threads each issue
2 * block_k * D / (16 x threads) 16-byte copies a kv tile. Not here yet: intra-warpgroup overlap
of the O rescale with the next S (FA3 does it by keeping the softmax one tile behind).
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable, Optional

from .emit_fa2 import (
    _HEADER,
    _Code,
    _cap_args,
    _device_functions,
    _emit_list_ahead,
    _emit_need_mask,
    _emit_next_tile,
    _emit_tile_range,
    _grid_axes,
    _signature,
    _spec_comment,
    _tile_class_expr,
    emit_bases,
    q_start,
    emit_persistent_index,
    list_row_expr,
    item_order,
    uses_work_counter,
    _emit_item_carry,
    emit_persistent_next,
    emit_persistent_start,
    emit_program_index,
    emit_fragment_helpers,
    emit_masked_rows,
    small_scores,
    softmax_call,
    emit_masked_score,
    emit_row_bounds,
    has_row_bounds,
    has_tile_table,
    row_bounds_read_data,
    row_gather_shift,
    row_gather_signs,
    row_gather_step,
    pair_slice_offsets,
    pair_slice_starts,
    rows_helper,
    score_row_calls,
    walks_range,
    col_step,
    folded_scale,
    raw_is_s,
    wgmma_thread_rows,
    emit_tile_scan,
)
try:  # the score functions' per-CTA values (score-licm), where emit_fa2 has them
    from .emit_fa2 import _score_args
except ImportError:  # pragma: no cover - before score-licm lands
    from .emit_fa2 import _cap_args as _score_args
from .emit_fa3 import (
    ALIGN,
    KV_PARTS_MAX,
    _WGMMA_IMPORTS,
    _emit_epilogue,
    _emit_row_inv,
    _emit_staged_epilogue,
    _lse_line,
    _emit_load,
    _emit_load_inside,
    _emit_loader_setup,
    _emit_pv,
    _emit_row_addresses,
    _pack_pa_helper,
    copy_rows_helper,
    emit_staged_stores,
    stage_row_helper,
    stage_rows_stsm_helper,
)
from .emit_fa3 import SMEM_PER_SM
from .emit_fa3 import grid as _fa3_grid
from .emit_fa3 import validate_spec as _fa3_validate
from .spec import FA2ForwardSpec
from .ssa_names import ssa_rename
from .tensor_maps import O_BOX_ROWS

__all__ = ["SCHEDULE", "early_loads", "emit_fa3_ws_forward", "grid", "half_tiles", "register_cap", "registers_fit",
           "smem_bytes", "threads_per_block", "uses_ws", "validate_spec"]

SCHEDULE = "wgmma-ws"
ROWS = wgmma_thread_rows()  # a consumer thread's two rows of its warpgroup's 64 (emit_fa3's 64-row layout)
# 288 threads (a producer warp + two consumer warpgroups) are 9 warps, and the SM allocates registers to warps in
# groups of 4: the block is sized like 12 warps, 12 x 32 x 168 = 64512 <= 65536 (176: 67584). 224 made every launch
# fail on the H100 (CUresult 701, CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, 2026-11-23); ptxas sizes a `.maxntid 288`
# kernel at 168 for the same reason.
MAX_REGS_WARP = 168
REGISTER_FILE = 65536  # 32-bit registers an SM (and at most a block) on sm_90
MAX_REGS_THREAD = 255  # ptxas's cap with neither launch bounds nor -maxrregcount
PRODUCERS = ("warp", "warpgroup", "none")  # spec.extra["producer"]
# named barriers (0 is __syncthreads), two consumer warpgroups: 1, 2 the ping-pong's turns; 3 + cw a consumer
# warpgroup's table tile; 5 + cw its staged epilogue; 7 + cw its Q rows free for a persistent kernel's next item;
# 9 + cw its run of the table (`slice_barrier`). Three (block_q 192): the turns 1-3, the epilogue's 7-9
# (`epilogue_barrier`) and the table's runs at 10-12; the other two families' features are refused there
# (validate_spec). 15: every consumer warpgroup once at the start (col_mma's shared block)
Q_FREE_BARRIER = 7
COL_BARRIER = 15  # every consumer warpgroup, once at the start: col_mma's shared K block is written (col_shared)
SMEM_LIMIT = 227 * 1024  # per block on the H100 (228 KiB an SM, 1 KiB reserved per block)

_WS_IMPORTS = '''
from falower.backends.numba_cuda.intrinsics import (
    max_registers,
    warp_uniform,
    bar_arrive,
    bar_sync,
    bulk_commit,
    bulk_store,
    bulk_wait_read0,
    cp_async_mbar_arrive_noinc,
    fence_proxy_async_smem,
    mbar_arrive,
    mbar_arrive_expect_tx,
    mbar_init,
    mbar_wait,
    setmaxnreg_dec,
    setmaxnreg_inc,
    syncwarp,
    tensormap_acquire,
    tensormap_prefetch,
    tma_load_4d,
    tma_load_4d_hint,
    l2_evict_first,
    l2_evict_last,
    tma_store_3d,
    tma_store_3d_hint,
)
'''


def staged_epilogue(spec: FA2ForwardSpec) -> bool:
    """Whether a warpgroup stores O through its own Q tile in shared memory (no producer, not persistent: its 64
    rows x D are one contiguous 64 * D * 2 bytes, free once its last S is done) by 16-byte coalesced stores
    (emit_fa3._emit_staged_epilogue), where the fragment layout gives 4-byte stores each touching 8 rows.
    spec.extra["staged_epilogue"] = False keeps the direct stores (bench '-nose'). The persistent kernel with a
    producer warpgroup stages through a buffer of its own (`_layout`'s "o", 64 rows of D a warpgroup) where it fits
    beside the ring: its direct stores took 2.8 us an item against the staged 1.3 (timeline.py, H100 2026-11-27)."""
    if spec.extra.get("staged_epilogue", True) is False:
        return False
    if persistent(spec) and producer(spec) == "warpgroup":
        return _layout(spec)["o"] > 0
    return producer(spec) == "none" and not persistent(spec)


def early_loads(spec: FA2ForwardSpec) -> tuple[int, int]:
    """(K, V): how many of the first S - 1 ring tiles warpgroup 0 (K) and 1 (V) load before waiting for their Q rows;
    the rest they load right after it. Why: a guess that the prologue was bound by the SM's share of L2 bandwidth
    (benchmarks/NOTES.md, "The ring's first tiles after the wait for Q": measured, no gain; kept to measure).
    spec.extra["early_loads"] = "KV", two digits (bench '-elKV'); default all S - 1 before (the kernel as it was).
    Only where the consumers load one item a block: validate_spec refuses a split with a producer or in a
    persistent kernel, whose loads it would leave out."""
    S = stages(spec)
    raw = spec.extra.get("early_loads", f"{S - 1}{S - 1}")
    text = f"{raw:02d}" if isinstance(raw, int) and not isinstance(raw, bool) else str(raw)  # bench's -el01 is 1
    if len(text) != 2 or not text.isdigit() or max(int(text[0]), int(text[1])) > S - 1:
        raise ValueError(f"wgmma-ws: early_loads is two digits (K, V), each at most stages - 1 = {S - 1}, "
                         f"got {text!r}")
    return int(text[0]), int(text[1])


def half_tiles(spec: FA2ForwardSpec) -> bool:
    """Whether a consumer warpgroup multiplies only the column half of a kv tile that its own 64 rows keep.

    Why: a ragged mask's partial tiles are where a variant loses to plain attention (benchmarks/NOTES.md, "What
    128 x 128 tiles allow": a document mask keeps 0.68 of each visited 128 x 128 tile, a 1024-wide window 0.89);
    at 64 rows x 64 columns they keep 0.81 and 0.94. A mask with row bounds (row_bounds.py) gives the interval
    hull of the warpgroup's rows once per item (`row_hull`, a warp's redux over its warpgroup's 64 rows); a tile
    half outside it is masked in every row the warpgroup stores, so S = Q K^T multiplies only the other half of K
    (`half_mode`; a tile neither half of which it keeps takes one, all masked) and P V skips the half's k steps
    (P = 0 there). The skipped half's scores (stale registers, or S's) are what the partial tile's mask (a select,
    not an add) replaces by -inf. Producer "none", not
    persistent, no table tiles, block_k a multiple of 32 (a half is whole P V k steps and 8-row swizzle groups).
    Off by default, asked for by `extra["half_tiles"]` = True (bench '-half') or "pv" ('-halfpv'): measured on the
    H100 (benchmarks/NOTES.md, "Half tiles"), the m64n64 halves cost the full tiles more than the skipped halves
    save (causal -2%, prefix LM -4%, document -3%) and P V by halves alone moved causal +2.5%, the 1024 window
    +1.5% and the document -3%: these partial tiles are not bound by the tensor pipe."""
    return (producer(spec) == "none" and not persistent(spec) and not table_tiles(spec) and has_row_bounds(spec)
            and spec.block_k % 32 == 0 and spec.extra.get("half_tiles", False) in (True, "pv"))


def half_mode(spec: FA2ForwardSpec) -> str:
    """"" (whole tiles), "s" (`half_tiles`: S and P V by halves; every S as two m64n(BK/2) halves, since ptxas
    serializes every wgmma where S mixes m64nBK and m64n(BK/2): C7511) or "pv" (`extra["half_tiles"] = "pv"`: S
    whole, only P V by halves; bench '-halfpv')."""
    if not half_tiles(spec):
        return ""
    return "pv" if spec.extra.get("half_tiles") == "pv" else "s"


def col_mma(spec: FA2ForwardSpec) -> bool:
    """Whether S = Q K^T carries a column step's term (emit_fa2.col_step: ALiBi's x = s + w kv + r(q)) as one more
    k step, so the softmax's elementwise code is plain attention's.

    Why: at D = 64 ALiBi's one FFMA an element (w o, o the column's offset) sat on the warpgroup's softmax path,
    0.83-0.86 of plain's TFLOP/s where causal ran 0.88-0.91 (benchmarks/NOTES.md, "ALiBi's column term in S = Q
    K^T"; measured +2-5% against the FFMA, H200 2026-11-30). The term is rank one along a tile: A's k step
    (registers, every row the same) holds w / scale split into three 16-bit parts in columns 0-2, B's (a K block
    written once) the column's offset j = 0 .. block_k - 1 in the same three columns, zeros to 15: the product adds
    w j to S in fp32 (error ~1e-5 in the exponent: the offsets are tile-local,
    benchmarks/alibi_in_product_precision.py), and softmax_row's row offset r(q) + w kv0 is taken at the tile's
    first column. 1/4 more of QK^T's tensor work at D = 64. Where the step is steep (|w / scale| >
    emit_fa2.COL_STEP_MAX) the item's A words are zero and every tile takes the masked path's exact scores
    (col_steep). Default at D = 64 and 128 (D = 128: +1.6% in 6 of 9 paired rounds and +4.4% in 12 of 15, H200
    2026-11-30, the shared block below); `extra["col_mma"]` True / False asks for it or keeps the FFMA (bench
    '-cm' / '-nocm'). Not with half tiles (a half's product would need its own extra step). Where a block a
    warpgroup would push the persistent kernel's O buffer out (D = 128, 128 x 128 tiles: the second Q buffer, and
    with it the TMA loads and stores), one block serves them all (`col_shared`); where not even that fits, validate_spec
    refuses."""
    ask = spec.extra.get("col_mma", "auto")
    if ask is False or not col_step(spec) or half_tiles(spec):
        return False
    return ask is True or (spec.head_dim in (64, 128) and col_blocks_fit(spec))


def _blocks_keep_o(spec: FA2ForwardSpec, blocks: int) -> bool:
    """Whether `blocks` K blocks of col_mma (block_k x 128 bytes each) leave the layout its O buffer (or second Q
    buffer). Only the persistent producer-warpgroup kernel has that buffer (the others' stages are what the blocks
    may cost)."""
    if not (persistent(spec) and producer(spec) == "warpgroup"):
        return True
    return bool(_layout(spec, cx=blocks)["o"]) or not _layout(spec, cx=0)["o"]


def col_shared(spec: FA2ForwardSpec) -> bool:
    """col_mma's K block one for all consumer warpgroups (written by all of them once, under a barrier of theirs,
    `COL_BARRIER`), where a block each would push the O buffer out; a block each otherwise (each warpgroup's own
    barrier, no wait on the others at the kernel's start)."""
    return not _blocks_keep_o(spec, consumer_wgs(spec))


def col_blocks_fit(spec: FA2ForwardSpec) -> bool:
    """Whether col_mma's K block(s) fit beside the O buffer: a block each, or one shared (`col_shared`)."""
    return _blocks_keep_o(spec, 1)


def gather_early(spec: FA2ForwardSpec) -> bool:
    """Where a thread's row pair shares its table loads (emit_fa2.row_gather_shift), read a tile's entries before
    the waits for K and S (`score_pair_load`), so that their L2 latency runs beside the products, not in the
    softmax's turn; they then hold 2 NJ + 2 registers across the wait. The relative bias at D = 128 +11% (NOTES,
    "The relative bias's row pairs"). spec.extra["gather_early"] = False reads them after (bench '-noge')."""
    return spec.extra.get("gather_early", True) is not False and row_gather_shift(spec) is not None \
        and not table_tiles(spec)


SLICE_ENTRIES = 256  # a consumer warpgroup's run of the table for one kv tile, f32 (64 + block_k - 1 used)
# under slice_pairs, the run's copy shifted by one: entry e at SLICE_SHIFTED + 1 + e of the buffer. 271 is 15 banks
# (mod 32) past the run: for each pair a warp's lanes read 7 pairs of the run (14 words) and 7 of the copy (14
# words), and at 271 the copy's 14 banks lie across from the run's, so no bank holds two words a warp reads and its
# LDS.64 is one wavefront (tests/backend/test_col_step.py counts them). At 261 (5 mod 32, b2f549f, as measured on
# 2026-11-30) they met in 8 banks: two wavefronts an 8-byte load, the 34 the 4-byte loads took (four, 68, if the
# hardware serves 8-byte loads a half-warp at a time; two at 271)
SLICE_SHIFTED = SLICE_ENTRIES + 14


def slice_barrier(spec: FA2ForwardSpec) -> int:
    """The named barrier (+ cw) after which a consumer warpgroup's run of the table is in shared memory: 9 + cw with
    two consumer warpgroups, 10 + cw with three (whose staged epilogue takes 7 + cw: `epilogue_barrier`) or one."""
    return 9 if consumer_wgs(spec) == 2 else 10


def slice_stride(spec: FA2ForwardSpec) -> int:
    """The f32 entries of one buffer of a warpgroup's run (`row_slice`): SLICE_ENTRIES, and under `slice_pairs`
    the shifted copy after them (SLICE_SHIFTED + 1 + SLICE_ENTRIES, rounded up to 8 bytes)."""
    return SLICE_SHIFTED + 1 + SLICE_ENTRIES + 1 if slice_pairs(spec) else SLICE_ENTRIES


def slice_bytes(spec: FA2ForwardSpec) -> int:
    """Shared memory of the runs of the table (`row_slice`): two buffers (`slice_stride`) a consumer warpgroup."""
    return consumer_wgs(spec) * 2 * slice_stride(spec) * 4


def row_slice(spec: FA2ForwardSpec) -> bool:
    """Where a row pair's table entries are read ahead of the waits (`gather_early`: the relative bias), whether
    each consumer warpgroup instead copies the one run of the table its 64 rows read for the tile (their last index
    a q + k kv + r with a, k = +-1: 64 + 127 entries) into shared memory, two entries a thread loaded before the
    waits and stored after S's, and the rows read their 34 entries from there (`score_pair_slice`, constant
    offsets) where they took 34 global loads (extra["row_slice"], default on; False keeps the loads, bench
    '-noslice'). The run's entries are clamped into the table as the gather clamps each index, so every tile may
    read it. Two buffers a warpgroup (a running parity): a warp still reading tile j's run has not passed tile
    j + 1's barrier, before which no warp writes tile j + 2's. Persistent producer-warpgroup kernel, 128 x 128
    tiles (or 192 x 128: three consumer warpgroups, each its own run). Measured (H200 2026-11-28): the kv loop 3825 -> 3317 cycles a tile (timeline; with the loads replaced
    by a constant, 3177; plain 2866), 471 -> 518 TFLOP/s, faster in 8 of 11 paired rounds (1.080)."""
    return spec.extra.get("row_slice", True) is not False and gather_early(spec) and producer(spec) == "warpgroup" \
        and bool(persistent(spec)) and spec.block_q in (128, 192) and spec.block_k == 128 \
        and row_gather_step(spec) is not None


def slice_rows(spec: FA2ForwardSpec) -> bool:
    """Under `row_slice`, whether a thread's two loads of a tile's run come from the run's row address, kept for the
    item (from_ir's `slice_row_fn`: the address of the entry at last index 0, il at the tile's first column, the
    last axis's length and stride), a clamp and an address each (`slice_load`), where `gather_slice_fn` computed the
    clamped two-dimensional index every tile. Why: the two loads were ~40 SASS instructions a tile, ~25 of them on
    the vector pipes, and the loop with them replaced by constants ran 3317 -> 3173 cycles a tile (H200,
    2026-11-28, benchmarks/NOTES.md "The bias table's floors"). Measured against gather_slice_fn (H200, 2026-11-28,
    15 paired rounds): the relative bias 1.035, faster in 13 of 15 (521 against 502 TFLOP/s). On by default;
    `extra["slice_rows"] = False` keeps gather_slice_fn (bench '-noslr')."""
    return (row_slice(spec) and "def slice_row_fn(" in spec.device_source
            and spec.extra.get("slice_rows", True) is not False)


def slice_pairs(spec: FA2ForwardSpec) -> bool:
    """Under `row_slice`, whether a thread reads its 34 entries of the run as 17 pairs, one 8-byte shared load each
    (lds_v2_f32), where it took 34 4-byte loads. Its entries are 17 pairs of neighbours (a column pair's two, k kv
    one apart), but a pair starts at an odd entry in half the rows (the row's parity moves the run by one), so each
    buffer also holds the run shifted by one entry (SLICE_SHIFTED), stored beside it (two more stores a thread and
    tile), and a thread whose pairs start odd reads that copy. Why it was tried: the relative bias's warp path is
    latency-bound, ~2.4 cycles of the tile an instruction it adds (benchmarks/NOTES.md, "What ncu counts"): -17
    loads a tile, predicted ~+1%. Measured (H200, 2026-11-30, 500 pairs): **0.833 of the 4-byte loads at D = 128
    and 0.896 at D = 64** (local SASS: the 34 LDS became 17 LDS.64, but the D = 128 consumers' spills grew from 2 to
    8 stores and 2 to 11 loads, some in the kv loop: a pair's two registers must be an aligned pair). Since then
    (2026-12-02, local ptxas and nvdisasm only, not yet timed): the copy lies in other banks than the run's
    (SLICE_SHIFTED: each 8-byte load one wavefront, where they took two, the 34 4-byte loads' count), and the
    consumers take 232 registers (the producer 40: `registers`), at which ptxas spills 8 bytes outside the kv
    loop (none in it; the 4-byte loads' kernel 16, in its masked tiles' path). Off until timed;
    `extra["slice_pairs"]` = True asks for it (bench '-slp')."""
    return row_slice(spec) and spec.extra.get("slice_pairs", False) is not False


def slice_ahead(spec: FA2ForwardSpec) -> bool:
    """Under `slice_rows`, whether the run's loads for the next tile are issued during this one (two registers held
    across a tile; an item's first tile's at its start), so that no load's latency stands between the top of the
    loop and the run's store after S's wait. Measured against `slice_rows` alone (H200, 2026-11-28, 15 paired
    rounds): 0.925 of it on the relative bias, faster in 3 of 15 (the loop 3346 -> 3368 cycles a tile, and the
    registers it holds). Off; `extra["slice_ahead"]` = True asks for it (bench '-sla')."""
    return slice_rows(spec) and spec.extra.get("slice_ahead", False) is not False


def slice_ptrs(spec: FA2ForwardSpec) -> bool:
    """Under `slice_rows` (not `slice_ahead`), whether a thread's two loads of a tile's run come from a running
    address, its entry e's (`rp_a`, e + 128's a stride on), and the warpgroup's run's first entry `rp_u` (the same
    in its threads, through redux), both moved on by a tile each visited tile (`slice_ptr_step`), and skip
    slice_load's clamp where the whole run lies in the row (`slice_load_rp`: 0 <= rp_u < sl_n - 255, one unsigned
    compare, a branch the warpgroup takes as one); elsewhere they are slice_load's own, so every entry read is the
    one it reads. Why: the relative bias's loop top rebuilt the run's row address from h and clamped e in 64 bits
    each tile, ~77 cycles a tile on a warpgroup's own chain (local SASS, benchmarks/NOTES.md "The relative bias's kv
    loop in SASS"). Local SASS (ptxas 13.0, the relative bias at D = 128, 128x128w12-wsg-p132-iod): the loop's top
    to S's first wgmma 91 -> 50 instructions where the run is unclamped, but the consumers spill 64 bytes where
    they spilled 16, 5 local loads and stores a tile in the kv loop's unmasked path (the row sums, an item
    constant): any value held across the loop did so (a running per-thread index, the address per thread or
    through redux), its rebuild from h what ptxas chose at the register cap. Measured (H200, 2026-12-03, bench.py
    --examples relative_bias,plain --ex-configs auto-slrp,auto-slrp-pr40,auto-pr40 --rounds 3 --pairs 200): the
    relative bias 0.975 of its default by 200 pairs (with 40 producer registers 0.973; those registers alone 0.993),
    plain unchanged (1.000): the spills cost more than the loop's top saved. So off; `extra["slice_ptrs"]` = True
    asks for it (bench '-slrp')."""
    return slice_rows(spec) and not slice_ahead(spec) and spec.extra.get("slice_ptrs", False) is not False


def slice_ptr_step(spec: FA2ForwardSpec) -> Optional[int]:
    """Under `slice_ptrs`, the visited tile's move from one visit to the next where it is always the same: +1, or -1
    under kv_reverse (the running entry and address then move by a constant); None where it varies (kv_reverse
    "second", a static mask's search or a block list skipping tiles), where each tile's come from the item's at
    tile 0 and tile_at's position."""
    if kv_last_second(spec) or not (spec.block_mask == "none" or walks_range(spec)):
        return None
    return -1 if kv_reverse(spec) else 1


def slice_in_s(spec: FA2ForwardSpec) -> bool:
    """Under `row_slice`, whether a tile's run is stored and synced while S is in flight (after S's and the P V's
    issue, before the wait for S) rather than after S's wait, where the store and the warpgroup's barrier stood
    between S's end and the softmax. The 34 shared loads stay after the wait (before it they were 34 registers more
    beside S, O and P: the consumers spilled 316 bytes). Measured (H200, 2026-11-30, 9 paired rounds): 0.990 of the
    default at D = 64 and 0.959 at D = 128 (no gain; why the store and barrier in S's shadow cost as much as after
    it is not established). Off; `extra["slice_in_s"]` = True asks for it (bench '-sis')."""
    return row_slice(spec) and spec.extra.get("slice_in_s", False) is not False


def slice_edge(spec: FA2ForwardSpec) -> bool:
    """Under `row_slice`, whether the boundary tile (kv0 + block_k > N: need_mask) also takes its score's entries
    from the warpgroup's run in shared memory (`gl`, score_pair_slice: read on every tile, the run stored on every
    tile) through score_row_pair_given, then sets the elements at kv >= N to -inf (`mask_past_n`), where
    masked_score_row gathered each element's entry from global memory (64-bit addresses, two clamps an element)
    while P's registers are pinned. The same entries (the run is clamped into the table as the gather clamps each
    index) and the same arithmetic (score_gathered_fn's fma on the entry is score_raw_fn's on the gathered one), so
    the same bits. Why: that path set the consumers' register peak (~219 of 224) and their only spills (16 bytes)
    though it never runs at N = 4096 (benchmarks/NOTES.md, "The relative bias's consumer registers, mapped"). Only
    where the masked path is masked_score_row's kv >= N alone: no mask_mod, no column step, no row bounds, no
    padding rows, no half tiles, no softcap, the scale folded with score_raw_fn. Measured (H200, 2026-12-03, 200
    call pairs against the default, N = 4096): 0.968 at D = 128 and 0.980 at D = 64, with `slice_ptrs` 0.991 at
    D = 128; plain 1.000. The spill left, and the interior path's schedule moved (ptxas interleaves the row sums
    with the exponentials where the default interleaves the bias's FFMAs), which the boundary path never running
    does not make free. Off; `extra["slice_edge"]` = True asks for it (bench '-sle')."""
    return (row_slice(spec) and spec.extra.get("slice_edge", False) is not False and not spec.has_mask
            and not col_step(spec) and not has_row_bounds(spec) and not row_bounds_read_data(spec)
            and not skips_padding_rows(spec) and not half_mode(spec) and small_scores(spec) is None
            and bool(folded_scale(spec)) and not raw_is_s(spec))


def slice_start(spec: FA2ForwardSpec) -> int:
    """The run's first index relative to il(q_wg, kv0), the index at the warpgroup's first row and the tile's first
    column: min(0, 63 a) + min(0, (block_k - 1) k)."""
    a, k = row_gather_signs(spec)
    return min(0, 63 * a) + min(0, (spec.block_k - 1) * k)


def kv_reverse(spec: FA2ForwardSpec) -> bool:
    """Whether an item's kv tiles are visited from kv_last down to kv_first (extra["kv_reverse"], off by default;
    bench '-rev'): the loops keep their counter j from kv_first up, and each tile's position is kv_first + kv_last
    - j wherever one is read (the producer's TMA coordinate, the consumers' kv0, their tile class, the score's
    table reads). Why: under causal the diagonal tile comes first, and a score that grows toward the diagonal
    (ALiBi) finds its row max there, so O is not rescaled on the tiles after it (the rescale is 146 cycles of
    ALiBi's 3312 a tile, 76 of causal's 2988: timeline --replace, H200 2026-11-28). The persistent producer-warpgroup
    kernel with TMA loads, without a mask or walking its range (`walks_range`: no tile inside the range is
    skipped), without half tiles. Measured (H200 2026-11-28, two calls): ALiBi's loop 3312 -> 3218 cycles a tile,
    faster in 12 of 20 paired rounds (~+2%); causal slower in 16 of 20 (~-2.5%). extra["kv_reverse"] = "second"
    (bench '-rev2') visits kv_last second, after kv_last - 1 (`kv_last_second`): ALiBi's default (auto_kv_reverse);
    True (the last tile first) is asked for only."""
    asked = spec.extra.get("kv_reverse", False)
    if asked not in (False, True, "second"):
        raise ValueError(f"wgmma-ws: extra kv_reverse is True, False or 'second' (the last tile second), not {asked!r}")
    return bool(asked) and producer(spec) == "warpgroup" and bool(persistent(spec)) \
        and tma_loads(spec) and (spec.block_mask == "none" or walks_range(spec)) and not half_mode(spec)


def auto_kv_reverse(spec: FA2ForwardSpec) -> object:
    """The automatic choice's kv order (falower.compile sets extra["kv_reverse"] unless the caller did): "second"
    for a score with a column step (ALiBi, emit_fa2.col_step) under a mask the kernel walks (causal), where the
    kernel can take it (measured under causal; a window or prefix mask with ALiBi takes it too); False elsewhere.
    Measured on the H200 (2026-11-28, paired against the forward order): ALiBi
    reversed faster in 23 of 35 rounds over three calls (~+2%), its kernel 510 -> 496 us by the timeline, the same
    with "second" (its loop 3312 -> 3201 cycles a tile, its first tile unchanged where the reversed order's grew by
    ~500); causal gained nothing either way (0.97-0.995 paired), and keeps the forward order."""
    if not (col_step(spec) and spec.block_mask == "static" and walks_range(spec)):
        return False
    import dataclasses

    return "second" if kv_reverse(dataclasses.replace(spec, extra={**spec.extra, "kv_reverse": "second"})) else False


def kv_last_second(spec: FA2ForwardSpec) -> bool:
    """Whether kv_reverse visits an item's last tile second: kv_last - 1, kv_last, kv_last - 2, ... kv_first. Why:
    the reversed order put causal's masked diagonal tile first, beside the item before's carried P V and epilogue
    (its first tile 3935 -> 4478 cycles, causal ~-2.5% paired); second, a full tile leads as in the forward order,
    and ALiBi's row max still stands after two tiles, where the forward order moves it on every tile."""
    return kv_reverse(spec) and spec.extra.get("kv_reverse") == "second"


def tile_at(spec: FA2ForwardSpec, j: str) -> str:
    """Tile j's position in the kv range: j itself, or under kv_reverse the mirror kv_first + kv_last - j (with
    `kv_last_second` the range's first two visits swapped: kv_last - 1, then kv_last)."""
    if kv_last_second(spec):
        return (f"(kv_first + kv_last - {j} if {j} > kv_first + 1 or kv_last == kv_first "
                f"else kv_last - 1 + {j} - kv_first)")
    return f"(kv_first + kv_last - {j})" if kv_reverse(spec) else j


def persistent_pays(spec: FA2ForwardSpec, small_grid: bool = False) -> bool:
    """Whether the automatic choice keeps its persistent producer-warpgroup form for this spec (falower.compile;
    emit_fa3.auto_extra chose it by mask and D alone): not where the score reads a row pair's table entries ahead
    of the waits (`gather_early`, a relative bias) and the producer copies by its threads, since those registers
    held across the waits do not fit the consumers' 192 (220 bytes spilled; 301 against 453 TFLOP/s one block an
    item, H100 2026-11-27). Under tma_loads the consumers have 224 (local ptxas: 64 bytes spilled) and the
    persistent form won: 490 against 438 TFLOP/s, faster in 11 of 11 paired rounds (H200 2026-11-28). At D = 64
    only with three consumer warpgroups (192-row tiles): two ran 0.939 of emit_fa3's 128 x 64 kernel (H200
    2026-11-29, plain N = 4k, seven interleaved rounds; three 1.169), except on a small grid (`small_grid`:
    falower.compile's "two" tiling, emit_fa3.two_rounds_pay, where two won over three; and its "decode" tiling, one
    consumer warpgroup for at most 64 rows, where emit_fa3's 128 x 64 kernel had no split-kv parts)."""
    if persistent(spec) and spec.head_dim == 64 and consumer_wgs(spec) != 3 and not small_grid:
        return False
    return not (persistent(spec) and producer(spec) == "warpgroup" and gather_early(spec) and not tma_loads(spec))


def uses_ws(spec: FA2ForwardSpec) -> bool:
    return spec.extra.get("schedule") == SCHEDULE


def stages(spec: FA2ForwardSpec) -> int:
    """spec.extra["stages"]; by default 2, and for producer "none" 3 where they fit in shared memory (the loads
    are issued S - 1 tiles ahead: with 2 stages, one)."""
    if "stages" in spec.extra:
        return int(spec.extra["stages"])
    if producer(spec) == "none" and _layout(spec, 3)["total"] + ALIGN <= SMEM_LIMIT:
        return 3
    return 2


def table_tiles(spec: FA2ForwardSpec) -> bool:
    """The score reads a [q, kv] tile of a table (emit_fa2.has_tile_table) and this kernel copies it into shared
    memory a kv tile ahead: each consumer warpgroup its own 64 rows, by cp.async right after its softmax read the
    previous tile, so the softmax reads shared memory instead of waiting on L2 (`extra["table_tiles"]`, default
    on; producer "none" only). Its 64 KB (128 x 128 f32) leave 2 K / V stages at D = 128."""
    return has_tile_table(spec) and producer(spec) == "none" and bool(spec.extra.get("table_tiles", True))


def skips_padding_rows(spec: FA2ForwardSpec) -> bool:
    """Whether the consumers leave the score function out for their rows past M: decoding's tiles on the persistent
    kernel (64 rows, often 1 of them a query's) whose score gathers a [q, kv] table's entries (a bias[h, q, kv]:
    its loads, clamped to the table's last row, are the score's cost), not as table tiles, and not on the softcap's
    paths (their warp votes need every lane). A padding row's scores are never stored: its P V, softmax and
    epilogue run on its raw scores (finite: its Q rows are zero). `extra["skip_padding"] = False` keeps every row
    (bench '-nosp')."""
    return (spec.block_q == 64 and bool(persistent(spec)) and has_tile_table(spec) and not table_tiles(spec)
            and small_scores(spec) is None and spec.extra.get("skip_padding", True) is not False)


def skips_padding_softmax(spec: FA2ForwardSpec) -> bool:
    """Whether a warp skips the online softmax of its 8 rows (g of one half of its 16) where all are past M (or
    before 0): decoding's 64-row tiles on the persistent producer kernel, whose one query row leaves warp 0's second
    half and warps 1-3 all padding. Their P is zeroed and their O left unscaled instead (rows never stored). Why: the
    stamped timeline put decoding's kv loop at ~2450-2560 cycles a tile, 380-480 of them waiting for K (H200,
    M = 1, D = 128, benchmarks/NOTES.md "Decoding's chain"); one consumer warpgroup runs S, then its softmax beside
    P V, and the softmax's 64 exponentials a thread (8 cycles a warp's each on MUFU) are longer than P V, so a
    tile is S + softmax; half the exponentials leave P V the longer. `extra["skip_padding"] = False` keeps every row
    (bench '-nosp'), as for skips_padding_rows."""
    return (spec.block_q == 64 and bool(persistent(spec)) and producer(spec) == "warpgroup"
            and spec.extra.get("skip_padding", True) is not False)


def pingpong(spec: FA2ForwardSpec) -> bool:
    return bool(spec.extra.get("pingpong", True)) and spec.block_q > 64  # (one consumer warpgroup: no turns)


LIST_PRODUCER_REGS = 88  # a persistent kernel's producer registers under a block list without tma_loads


def registers(spec: FA2ForwardSpec) -> tuple[int, int]:
    """(producer, consumer) registers a thread after setmaxnreg: extra["regs"], or extra["producer_regs"] = p with
    the consumers at the most the block's launch allocation leaves them (128 p + 256 c <= 384 x 168, c a multiple
    of 8; bench '-prP'; a persistent kernel: p = 120, 88 under a block list, 56 under tma_loads, 40 there under
    slice_pairs), or (40, 232).
    Measured through the driver's whole-program compile (the only one that keeps setmaxnreg): at 40 the producer's
    code spills (116 bytes at D = 128, benchmarks/NOTES.md "setmaxnreg")."""
    if "producer_regs" in spec.extra or ("regs" not in spec.extra and persistent(spec)):
        # persistent: the producer walks items too and needs 120 (at 56 / 224 the kernel spilled 280 bytes, at
        # 112 / 192 32; 120 / 192 none: ptxas and the H100's driver alike, probe_setmaxnreg.py --persistent)
        # tma_loads: one producer thread copies, with no row addresses kept: 56, the consumers at 224 (local ptxas
        # 13.0, 2026-11-28: causal spills none, the document 8 bytes, 136 at pr88's 208; at 40 the producer's item
        # walk spills 32 bytes under causal, at 24 128 under the document)
        # without tma_loads under a block list: 88, the consumers at 208 (their list walk spilled 116 bytes at
        # 120 / 192, and ran slower than one block an item there: 215 against 229 TFLOP/s, H100 2026-11-27)
        # three consumer warpgroups (block_q 192): 32 / 160, FlashAttention-3's split (local ptxas 13.0: plain D = 64
        # spills none there, causal 120 bytes in the producer; at 56 / 152 both spill 32 bytes and ptxas
        # serializes the consumers' wgmmas, C7512)
        # slice_pairs on two consumer warpgroups: 40 / 232, where the pairs' registers (aligned pairs, LDS.64)
        # spilled 32 bytes at 224, 5 local loads of them in the kv loop's unmasked path; at 232 the consumers spill 4
        # bytes an item, outside the kv loop, and the producer none (local ptxas 13.5, the relative bias at D = 128)
        p = int(spec.extra.get("producer_regs", (32 if consumer_wgs(spec) == 3 else 40 if slice_pairs(spec) else 56)
                               if tma_loads(spec) else LIST_PRODUCER_REGS if spec.block_mask == "list" else 120))
        consumers = threads_per_block(spec) - 128
        return p, min(256, (threads_per_block(spec) * register_cap(spec) - 128 * p) // consumers // 8 * 8)
    p, c = spec.extra.get("regs", (40, 232))
    return int(p), int(c)


def _launch_registers_suffice(spec: FA2ForwardSpec) -> bool:
    """Whether every thread already starts at the most it could hold: one consumer warpgroup and one block an SM
    (256 threads at 255 registers), where setmaxnreg moves nothing the consumers need."""
    return consumer_wgs(spec) == 1 and blocks_per_sm(spec) == 1


def uses_setmaxnreg(spec: FA2ForwardSpec) -> bool:
    """Whether the producer warpgroup gives registers to the consumers (setmaxnreg, `registers`).
    `extra["setmaxnreg"]` = False leaves both at the launch's allocation where that suffices
    (`_launch_registers_suffice`; bench '-nosmr'). Why ask: decoding's stamps put the consumers' setmaxnreg.inc
    at ~0.26 us of a block's ~1.0-1.3 us to its first item (one tick of %globaltimer, it turned out: with "dec"
    below the mark reads the same). Measured slower (H200, 2026-12-01, `split_parts.py --set early --rounds 5`,
    CUDA graphs): 1.05-1.18x the time at M = 1-64 in clusters (the kv loop 1.41-1.79 us a tile against
    1.28-1.54; without setmaxnreg the kernel is linked, not compiled whole by the driver: why its loop slowed
    was not read), 0.97-0.99x on the merge kernel at 8k. On by default."""
    if producer(spec) != "warpgroup":
        return False
    return spec.extra.get("setmaxnreg", True) is not False or not _launch_registers_suffice(spec)


def consumers_raise_registers(spec: FA2ForwardSpec) -> bool:
    """Whether the consumers' setmaxnreg.inc is emitted beside the producer's dec. `extra["setmaxnreg"]` = "dec"
    keeps only the producer's dec where the launch's registers suffice (`_launch_registers_suffice`; ptxas 13.0:
    decoding's kernel uses 255 and spills nothing either way; bench '-smrdec'), so
    that no consumer waits on the producer's dec before its first item. Measured the same (H200, 2026-12-01,
    `split_parts.py --set early --rounds 5`): 0.94-1.03 of the default's time, median 1.00; the stamps' 0.26 us
    "to the registers" is one tick of %globaltimer, with the inc or without. Not the default."""
    if not uses_setmaxnreg(spec):
        return False
    return spec.extra.get("setmaxnreg", True) != "dec" or not _launch_registers_suffice(spec)


def producer(spec: FA2ForwardSpec) -> str:
    """spec.extra["producer"]: "warp" (default), "warpgroup" or "none" (see the module docstring)."""
    return str(spec.extra.get("producer", "warp"))


def consumer_wgs(spec: FA2ForwardSpec) -> int:
    """Consumer warpgroups: one a 64 query rows (2 at block_q = 128; 3 at 192, FlashAttention-3's D = 64 tile; 1 at
    64, decoding's tiles)."""
    return spec.block_q // 64


def epilogue_barrier(spec: FA2ForwardSpec) -> int:
    """The first named barrier of the staged epilogue's family (+ cw): after the turns' (1 .. N) and N more, 5 at
    two consumer warpgroups (where 3 + cw is the table tile's), 7 at three and 3 at one (no turns). The table run's
    family moves to 10 + cw at three and one (`slice_barrier`); the other two (the table tile's 3 + cw, Q free's
    7 + cw) are laid out for two: their features (producer "none", one Q buffer, table tiles) are refused at three
    and one (validate_spec), and the consumer's emitter asserts as much."""
    return 1 + 2 * consumer_wgs(spec)


def producer_threads(spec: FA2ForwardSpec) -> int:
    return {"warp": 32, "warpgroup": 128, "none": 0}[producer(spec)]


def threads_per_block(spec: FA2ForwardSpec) -> int:
    """The producer's threads and one consumer warpgroup per 64 query rows."""
    return producer_threads(spec) + 128 * (spec.block_q // 64)


def registers_fit(threads: int, regs: int) -> bool:
    """Whether a block of `threads` threads at `regs` registers a thread can launch on one SM: registers go to warps
    in units of 256 (8 a thread) and warps are allocated in groups of 4, so 288 threads (9 warps) take 12 warps'
    worth. The H100 refused 288 x 224 (CUresult 701) that the plain product 288 x 224 = 64512 would allow."""
    return _allocated_warps(threads) * 32 * (-(-regs // 8) * 8) <= REGISTER_FILE


def _allocated_warps(threads: int) -> int:
    """The warps the SM sizes a block's registers for: its warps rounded up to a multiple of 4."""
    return -(-(-(-threads // 32)) // 4) * 4


def blocks_per_sm(spec: FA2ForwardSpec) -> int:
    """The blocks an SM holds at once on decoding's 64-row tiles (`extra["blocks_per_sm"]`, 1 or 2; bench '-b2'):
    the launch bounds' minimum blocks, which halve a thread's registers and the shared memory a block may take, so
    that two items' chains of S, softmax and P V run side by side on one SM's tensor cores, where one chain leaves
    them idle while its softmax and waits run (one consumer warpgroup; the producer warpgroup's kernel only:
    setmaxnreg moves registers within the block's own half). Measured: 0.92-1.00x at B = 8 and 1.27-1.43x slower
    at B = 4 (H200, benchmarks/NOTES.md "Decoding's chain stamped"): a knob, not a default. The other tiles keep
    one block an SM (the knob is then emit_fa3's, whose kernels read it too)."""
    if spec.block_q != 64:
        return 1
    n = spec.extra.get("blocks_per_sm", 1)
    if n not in (1, 2) or isinstance(n, bool):
        raise ValueError(f"extra blocks_per_sm must be 1 or 2 on decoding's 64-row tiles, got {n!r}")
    return int(n)


def smem_limit(spec: FA2ForwardSpec) -> int:
    """The dynamic and static shared memory a block may take: SMEM_LIMIT, or the SM's 228 KiB shared by
    blocks_per_sm blocks (1 KiB reserved each)."""
    n = blocks_per_sm(spec)
    return SMEM_LIMIT if n == 1 else SMEM_PER_SM // n - 1024


def register_cap(spec: FA2ForwardSpec) -> int:
    """The registers a thread the emitted kernel may use: its -maxrregcount, else what launch bounds (threads,
    blocks_per_sm) leave (65536 / (threads x blocks) in the 4-warp granularity, down to a multiple of 8), else
    ptxas's 255."""
    threads = threads_per_block(spec)
    if producer(spec) == "warp":
        return MAX_REGS_WARP
    if producer(spec) == "warpgroup":
        per_block = REGISTER_FILE // blocks_per_sm(spec)
        return min(MAX_REGS_THREAD, per_block // (_allocated_warps(threads) * 32) // 8 * 8)
    return MAX_REGS_THREAD  # producer "none": 256 threads, 8 x 32 x 256 = 65536


def persistent(spec: FA2ForwardSpec) -> int:
    """spec.extra["persistent"]: the blocks of a persistent launch (0: one block a q tile). Each block walks work
    items (q tile, head, batch) in `emit_persistent_next`'s serpentine order and, before the epilogue of one, loads
    the next one's Q and its first K / V tiles, so a block's start (its Q and first tiles' latency, the barriers,
    the tile scan) overlaps the previous item's last P V and its stores. With producer "none" the consumers issue
    those loads themselves (in front of their epilogue); with producer "warpgroup" the producer walks the items'
    tiles as one stream through the ring and loads each item's Q as soon as both consumer warpgroups are past the
    previous item's last S (the q_empty mbarrier), while they do its last P V and epilogue (benchmarks/NOTES.md,
    "The persistent producer kernel timed"). Static ranges only with the producer."""
    return int(spec.extra.get("persistent", 0))


def list_head_shared(spec: FA2ForwardSpec) -> bool:
    """Whether the ticket's handover also carries the item's block-list head: its count and its first, second and
    last entries, read by producer thread 0 while the previous item's copies are in flight and written beside the
    ticket in `tick` (slots 2 + 4 ip ..), so that no thread starts an item on two dependent global reads of the
    list (kv_count, then kv_tiles). Why: a document item is ~5 kv tiles, and its consumers' start waited on those
    reads (benchmarks/NOTES.md, "The list's head beside the ticket"). Block lists on the persistent
    producer-warpgroup kernel with item_order "dynamic"; `extra["list_head"] = False` reads the list as before
    (bench '-nolh')."""
    return (spec.block_mask == "list" and bool(persistent(spec)) and producer(spec) == "warpgroup"
            and uses_work_counter(spec) and spec.extra.get("list_head", True) is not False)


def _q_double_asked(spec: FA2ForwardSpec) -> bool:
    """q_double unless extra["q_double"] says otherwise. The softcap (its two tanh paths, epilogue_in_s off) once
    kept one buffer (-5% with two, H100 2026-11-28, one call of 7 rounds); with two it now also loads by TMA
    (tma_loads, its consumers at 224 registers: local ptxas spills 48 -> 0 bytes) and measured 400 against 385
    TFLOP/s for one buffer (H200 2026-11-28, 11 rounds, within the spread), so it takes two like every example."""
    asked = spec.extra.get("q_double", True)
    return (bool(persistent(spec)) and producer(spec) == "warpgroup"
            and spec.extra.get("staged_epilogue", True) is not False and asked is not False)


def q_double(spec: FA2ForwardSpec) -> bool:
    """Whether the persistent producer kernel has two Q buffers, item k's Q in buffer k & 1, each warpgroup's 64
    rows a [D // 64][64][128 B] tile of its own (the layout of producer "none"), and stages an item's O through
    its own rows of that item's buffer (the O buffer's room is the second Q buffer: the same shared memory). The
    producer loads item k's Q once item k - 2's epilogue is done (its buffer's q_empty barrier), not once item k - 1's
    last S is: so the next item's Q and first tiles load while the item before still runs, where with one buffer
    they loaded in the gap between the two. Why: the timeline put that gap (an item's end to the next one's Q) at
    ~1 us an item without a mask, whose items are ~32 tiles, and the masks' items are 5-17 (2026-11-27). Measured
    with `range_shared` against neither (H100 2026-11-28, 7 rounds): plain +3%, causal +3%, ALiBi +4%, the 1024
    window +14%, the document +4% (q_double alone there); the softcap then -5%, which since takes two like every
    example (`_q_double_asked`). `extra["q_double"] = False` keeps one Q buffer and the O buffer (bench '-noqd');
    True ('-qd') is the default."""
    return _layout(spec)["q1"] > 0


def bulk_pitch(D: int) -> int:
    """The bytes between staged O rows under `bulk_store`: a row of D 16-bit values and 16 bytes, so that the 8 rows
    a warp's fragment store touches (4 words each) start 4 banks apart and meet all 32 banks once."""
    return 2 * D + 16


def _bulk_asked(spec: FA2ForwardSpec) -> bool:
    """`bulk_store` but for its room (the wider Q tiles, which `_layout` decides: it asks this)."""
    return (_q_double_asked(spec) and _epilogue_in_s_asked(spec) and spec.block_q in (128, 192)
            and spec.extra.get("bulk_store", True) is not False)


def bulk_store(spec: FA2ForwardSpec) -> bool:
    """Whether the kept epilogue (`epilogue_in_s` with `q_double`) stores O by bulk copies: each warp stages its own
    16 rows unswizzled (`bulk_pitch` bytes a row, in the kept item's Q tile, which has the room for it) and its
    lane 0 issues one `cp.async.bulk` shared-to-global copy a row (O's rows of D are contiguous), 16 unrolled where
    every row is inside O, their operands made uniform by redux (the copy takes uniform registers: per-lane
    operands made ptxas loop over the lanes); the kept item's Q buffer is released once the copies have read their
    rows, at the next tile's S or the item's end. No barrier among the warpgroup's warps after the staging, no read
    back, no stores in a thread's instructions.
    Why: the timeline put the kept epilogue at 1800-2400 cycles an item in a consumer warpgroup's turn (with the
    producer warpgroup storing O instead, the consumers' part fell to 1295 cycles, but the producer's next loads
    came late and every example but the softcap lost 1-9%). Measured against the threads' stores (H200,
    2026-11-28, two calls of 9 and 11 rounds): plain +2.0 / +4.8%, causal +5.5 / +4.3%, ALiBi +0.8 / +6.1%, the
    document +4.0 / +4.1%, the 1024 window -2.3 / -0.2%. `extra["bulk_store"] = False` keeps the stores (bench
    '-nobk')."""
    return _bulk_asked(spec) and q_double(spec) and (_tma_asked(spec) or _layout(spec)["qwg"] > 64 * spec.head_dim * 2)


def _tma_asked(spec: FA2ForwardSpec) -> bool:
    return _bulk_asked(spec) and spec.dtype in ("f16", "bf16") and spec.extra.get("tma_store", True) is not False


AUTO_EX2_POLY = 8  # of a thread's row's 32 exponentials in a 128-wide kv tile
AUTO_EX2_POLY_WIDE = 4  # the same on D = 64's 192 x 128 tiles (three consumer warpgroups)


def auto_ex2_poly(spec: FA2ForwardSpec) -> int:
    """The automatic choice's share of the softmax's exponentials on the FMA pipe (emit_fa2.ex2_poly_count; falower.
    compile sets extra["ex2_poly"] unless the caller did): where the score takes a MUFU operation of its own an
    element (tanh.approx, the IR's tanh_approx) beside the exponential's, AUTO_EX2_POLY on the D = 128 kernel that
    loads by TMA (tma_loads: the producer's one thread leaves the issue slots to the consumers) and
    AUTO_EX2_POLY_WIDE on D = 64's 192 x 128 tiles; 0 elsewhere.
    Measured on the H200 (2026-11-28, paired rounds against ex2_poly 0): softcap_approx +4.5% (8 of 9 rounds
    faster) and +3.7% (7 of 11); plain -7%, the relative bias -6%, the exact softcap (tanh by ex2 and rcp, or the
    FMA pipe's polynomial on small tiles) -2%, which keep none. At D = 64 (192 x 128, 2026-11-29, 7 paired rounds):
    softcap_approx xp4 +4.2% (5 of 7 faster), xp8 +2.0%, xp12 +0.7%; plain xp4 -1.6%, xp8 -10%; the exact softcap
    xp4 -3.6%. Half D = 128's tensor work an element leaves the FMA pipe less room beside it."""
    if not (uses_ws(spec) and tma_loads(spec) and spec.block_k == 128) or "tanh_approx_f32(" not in spec.device_source:
        return 0
    if spec.head_dim == 128:
        return AUTO_EX2_POLY
    return AUTO_EX2_POLY_WIDE if spec.head_dim == 64 and spec.block_q == 192 else 0


def tma_loads(spec: FA2ForwardSpec) -> bool:
    """Whether the producer warpgroup loads Q, K and V by TMA tensor copies (`extra["tma_loads"]`, on by default
    wherever the kernel has two Q buffers, which only the persistent producer-warpgroup kernel has; False keeps the
    16-byte copies, bench '-notmal'). Its thread 0 waits for a stage to be free, announces the tile's bytes on the
    stage's full barrier (`mbarrier.expect_tx`, count 1) and issues one `cp.async.bulk.tensor.4d` a 64-column block
    through K's or V's map (`qmap, kmap, vmap` after `omap`; any 16-byte strides, GQA by the kv head's coordinate,
    rows past N zeros), where 128 threads issued 2 x 128 16-byte cp.async a tile; each item's Q likewise (four
    copies), the other producer threads arriving on its barrier (so none falls an item behind the ticket handover).
    Why: the producer's copies shared the SM's issue slots with the consumers' softmax, and one thread's copies let
    the producer give up registers to the consumers (56 / 224: the document's spills 136 -> 8 bytes). Measured on
    the H200 against the 16-byte copies in four calls (5, 9, 11 and 13 rounds, 2026-11-28, benchmarks/NOTES.md "Q,
    K and V by TMA loads made the default"), medians: plain +11%, +0.3%, +6%, +9%; the document +5%, +1.5%, +3%,
    +9%; causal and ALiBi within the noise either way (-5% to +5%)."""
    return spec.extra.get("tma_loads", True) is not False and spec.dtype in ("f16", "bf16") and q_double(spec)


def map_prefetch(spec: FA2ForwardSpec) -> bool:
    """Under `tma_loads`, whether the copying thread prefetches Q's, K's and V's tensor maps (prefetch.tensormap)
    before it acquires them, so that the three maps' fetches overlap where each acquire could wait for its own (as
    FlashAttention-3 prefetches its maps at entry). Why: a decoding block took 0.77-1.0 us from its entry to its first
    item's state (timeline.py `entry_to_first_item_us`, H200), before its Q could be asked for. Measured slower
    (H200, 2026-11-30, `split_parts.py --set maps`, CUDA graphs): decoding's calls 1.02-1.19x the time without at
    B = 1-8 (the cold caches' 1.02-1.16x), a small prefill grid 1.14x: the prefetch delays the acquires it was to
    speed. Off; `extra["map_prefetch"]` = True asks for it (split_parts 'mp')."""
    return tma_loads(spec) and spec.extra.get("map_prefetch", False) is not False


def l2_hints(spec: FA2ForwardSpec) -> bool:
    """Under `tma_loads`, whether the producer's copies carry L2 eviction priorities (`.L2::cache_hint`): Q's lines
    evict first (each Q tile is read once), K's and V's last (every q tile of the head reads them), and O's tensor
    stores (tma_store) first. Why: ncu read causal's D = 128 kernel taking ~370 MB from DRAM where Q, K, V and O are
    268 MB (plain: ~260), so K and V were read from DRAM again (benchmarks/NOTES.md, "where causal's 0.1 goes").
    Measured (H200, 2026-11-30, 9 paired rounds): causal's DRAM throughput 16.4% -> 15.2% over the same 465-469 us, so
    the hints hardly move those bytes, and the time did not move: causal 0.988 / 1.007 of the default at D = 128 / 64,
    ALiBi 0.983 / 0.982. Off; `extra["l2_hints"]` = True asks for it (bench '-l2h')."""
    return tma_loads(spec) and spec.extra.get("l2_hints", False) is not False


def stmatrix_staging(spec: FA2ForwardSpec) -> bool:
    """Under `tma_store`, whether each warp stages its 16 rows of O for the kept epilogue by stmatrix (emit_fa3.
    stage_rows_stsm_helper: D / 16 instructions a thread) where stage_row_z_box stored a 32-bit word at a time (D / 4
    STS a thread). Why: the staging is ~580 of the kept epilogue's ~880 cycles an item (timeline, H200,
    2026-11-28): ~2% of causal's items, ~5% of the document's. Measured (H200, 2026-11-28): the kept epilogue 880 ->
    796 cycles an item under causal, 912 -> 810 under the document (its staging 601 -> 505, 626 -> 540); paired over
    15 rounds plain 1.005, causal 1.019, ALiBi 1.013, the document 1.009 (each faster in 8 of 15: ~0.2-0.5% of an
    item's time, under the rounds' spread). On by default; `extra["stmatrix"] = False` stages a word at a time
    (bench '-nostsm')."""
    return tma_store(spec) and spec.extra.get("stmatrix", True) is not False


def tma_store(spec: FA2ForwardSpec) -> bool:
    """Whether `bulk_store`'s copies are TMA tensor copies: each warp stages its 16 rows of O in the 128-byte swizzle
    (two boxes of 64 columns at D = 128, the Q tile's own layout, so the Q tiles keep their 64 rows of D) and its
    lane 0 stores them by one `cp.async.bulk.tensor` a box through O's tensor map (`omap`, tensor_maps.py), which
    writes no row past M; the kernel takes the map after `work` (emit_fa2.uses_o_map).
    Why: the timeline put the kept epilogue at ~2300 cycles (H200, 2026-11-28, causal, D = 128, N = 4096), ~1500
    of them after the rows were staged: lane 0 issuing its 16 row copies. `extra["tma_store"] = False` keeps the row
    copies (bench '-notma')."""
    return _tma_asked(spec) and q_double(spec)


def range_shared(spec: FA2ForwardSpec) -> bool:
    """Whether the ticket's handover also carries the item's kv range and its full tiles (kv_first, kv_last,
    kf_first, kf_last), scanned by the producer's first warp while the previous item's last copies are in flight
    and written beside the ticket in `tick` (slots 2 + 4 ip ..), so that no consumer scans at an item's start. Why:
    the timeline put the consumers' time from one item's end to the next one's first S at ~1.4 us under causal and
    window masks against ~0.4 us without a mask (2026-11-27), the scan (`emit_tile_scan`: tile_class_fn a lane,
    then five warp reductions) in the consumers' path while the tensor cores wait. Static masks the kernel walks
    (`walks_range`) on the persistent producer-warpgroup kernel with item_order "dynamic";
    `extra["range_shared"] = False` scans in every warp as before (bench '-nors')."""
    return (spec.block_mask == "static" and walks_range(spec) and bool(persistent(spec))
            and producer(spec) == "warpgroup" and uses_work_counter(spec)
            and spec.extra.get("range_shared", True) is not False)


def _handed_over(spec: FA2ForwardSpec) -> tuple[str, ...]:
    """The four values beside each ticket in `tick`, as the producer's thread 0 holds them before the handover:
    the list head (list_head_shared) or the kv range (range_shared); none otherwise."""
    if list_head_shared(spec):
        return ("hn_n", "hn_0", "hn_1", "hn_l")
    if range_shared(spec):
        return ("hr_0", "hr_1", "hr_2", "hr_3")
    return ()


def _emit_next_ticket_item(c: _Code, spec: FA2ForwardSpec, ticket: str) -> None:
    """qt_hx, h_hx, b_hx: the item of the next ticket (`ticket`, tk_next as this thread has it), carried from the
    current item's coordinates as every thread carries them at the handover (the producer's look-aheads)."""
    c(f"hx_x = it_x + {ticket} - it_t  # the next ticket's item, carried from this one's")
    c("hx_y = it_y")
    c("hx_z = it_z")
    _emit_item_carry(c, spec, "hx")
    emit_persistent_index(c, spec, "hx", "_hx")


def _emit_range_prefetch(c: _Code, spec: FA2ForwardSpec) -> None:
    """The producer's first warp (`range_shared`): hr_0 .. hr_3 = kv_first, kv_last, kf_first, kf_last of the
    item of ticket tk_next (thread 0's, to the warp by a shuffle), its coordinates carried from the current item's
    as every thread carries them at the handover, by the same scan the item's warps ran themselves."""
    BQ, BK = spec.block_q, spec.block_k
    _emit_next_ticket_item(c, spec, "warp_uniform(tk_next)")
    c(f"q_lo_hx = {q_start(spec, 'qt_hx')}")
    c(f"q_hi_hx = min(q_lo_hx + {BQ}, M) - 1")
    c(f"nk_hx = (N + {BK - 1}) // {BK}")
    emit_tile_scan(c, lambda j: _tile_class_expr(spec, j, "_hx"), "nk_hx", "hr_0", "hr_1", True, True,
                   full_range=True, full=("hr_2", "hr_3"))


def epilogue_in_s(spec: FA2ForwardSpec) -> bool:
    """Whether an item's last P V goes with the next item's first tile (as P_{j-1} V_{j-1} goes with S_j inside an
    item: the ring's V stage and P's registers carry over) and its epilogue follows that tile's softmax, instead of
    the item's end waiting for its last P V behind the other warpgroup's turn and storing O before the next item's
    first S is issued. The LSE and 1 / l are written at the item's end (they need no O), the row's 1 / l and the
    item's rows kept per thread in shared memory (ep_f, ep_i: no registers held across the next item's tile); an
    item with no kv tile and the block's last item flush the kept epilogue where they are. Why: the timeline put a
    document item's epilogue at ~2 us, 1.1 tile-times of its ~5 (benchmarks/NOTES.md, "The last P V with the next
    item"). The persistent producer-warpgroup kernel with its staged epilogue and ping-pong turns, no half tiles.
    Not by default where the consumers' registers are already full and ptxas (13.0, sm_90a, the driver's whole
    program compile) then spills in the kv loop: the softcap's two tanh paths (`small_scores`: 164 bytes against
    48, -7% on the H100, 2026-11-27). A block list spilled 96-120 bytes with it (the document -15%) while its walk
    was 64-bit, none since it is 32-bit (emit_fa2._emit_list_ahead). `extra["epilogue_in_s"]` False keeps the
    epilogue at the item's end (bench '-noes'), True asks for it there too ('-es')."""
    return _epilogue_in_s_asked(spec) and staged_epilogue(spec)


def fused_merge(spec: FA2ForwardSpec) -> bool:
    """Whether split-kv's LSE merge runs in the kernel itself (FlashDecoding's last block): each consumer warpgroup,
    after its part's O and LSE are stored, fenced, counts its rows' parts done (an int32 a warpgroup's rows,
    `arrivals`, that only grows: the count mod P), and the last of the P merges them all from L2
    (lse_merge.fused_merge_unit) into the call's O and LSE (o_fin, lse_fin), so no merge launch follows. Where the
    item's O leaves by the threads' own stores (the staged epilogue in the item's Q buffer, q_double; no TMA or bulk
    copies, not carried to the next item: decoding's 64-row tiles) and D is a multiple of 8, asked for by
    `extra["fused_merge"]` (bench '-fm'; elsewhere the knob is ignored: the merge kernel runs). Off by default:
    right on the GPU (its tests, bit for bit against Numba's path and the relaunch, call after call) but slower
    than the merge kernel (H200 2026-11-30, CUDA graphs,
    benchmarks/NOTES.md "The merge in the kernel"): decoding M = 1 15.7 against 14.8 us at D = 128 and 13.2 against
    12.1 at D = 64, N = 8k; M = 64 27.5 against 16.2. Each part's fence waits for its stores, the count and the last
    part's reads of the others run after the kernel's critical path, and at M = 64 one warpgroup a q tile reads all
    16 parts' 64 rows (256 KB) where the merge kernel spreads them over 64 blocks. True under `cluster_merge` too,
    whose kernel takes the same arguments (o_fin, lse_fin; its `arrivals` unused) and merges inside the cluster (by
    the parts' pushes, `cluster_push`, or by a cluster barrier)."""
    return (_merge_in_kernel_fits(spec) and bool(spec.extra.get("fused_merge", False))) or cluster_merge(spec)


def _merge_in_kernel_fits(spec: FA2ForwardSpec) -> bool:
    """The kernels whose item's O leaves by the threads' own stores after a staged epilogue in the item's Q buffer
    (q_double; no TMA or bulk copies, nothing carried to the next item): decoding's 64-row tiles, D a multiple of 8,
    in parts. fused_merge and cluster_merge merge there."""
    return (spec.kv_parts > 1 and bool(persistent(spec)) and producer(spec) == "warpgroup" and q_double(spec)
            and not epilogue_in_s(spec) and not tma_store(spec) and not bulk_store(spec) and spec.head_dim % 8 == 0)


CLUSTER_MAX_PARTS = 8  # the portable cluster size (16 needs the non-portable attribute: 7 such clusters fit at once)


def cluster_merge(spec: FA2ForwardSpec) -> bool:
    """Whether split-kv's merge runs inside a cluster: the P parts of a q tile are the P blocks of one cluster
    (launched so: runtime._launcher's `cluster`; the grid one block an item, `grid`, so block c's item, its own
    first, is part c % P of q tile c // P, and no block takes a second), each stores its part's O and LSE as
    fused_merge's parts do, one cluster barrier (release / acquire at cluster scope) makes them visible to the
    cluster, and the cluster's blocks merge the q tile's rows between them (rank kvp takes every P-th 16-byte
    chunk of each warpgroup's rows) into the call's O and LSE: no merge launch, no count, no last block reading
    every part alone. Where P divides 64 the parts push their rows to the rank that merges them instead
    (`cluster_push`: no barrier after the merge, no remote reads). P in 2 .. CLUSTER_MAX_PARTS, where fused_merge's
    kernel fits (`_merge_in_kernel_fits`), first items the blocks' own, the parts the grid's fastest axis (so a
    cluster's P neighbouring blocks are one q tile's parts: not under `heads_first` or item_order "cost"). By
    default at P = emit_fa3.KV_PARTS_CLUSTER (8: 1.04-1.12x the merge kernel's calls, benchmarks/NOTES.md "The merge
    inside a cluster"), and at 2 or 4 where the compiler finds the grid within the SMs (decoding's rows; a small
    prefill grid's 4 within half:
    compiler._cluster_small_grid sets cluster_merge True); where a call's grid has more clusters than the device
    holds at once, its plan takes the kernel without them (FA2ForwardKernel.plan: leftover clusters waited a
    round, 1.4-1.7x slower). `extra["cluster_merge"]` True at any P from 2, launched whatever the device holds at
    once (bench '-clm'), False never ('-noclm'). The simulator has no clusters: the runtime's Numba path (numpy
    inputs, the simulator) runs the kernel without it (FA2ForwardKernel.without_cluster)."""
    from .emit_fa3 import KV_PARTS_CLUSTER

    asked = spec.extra.get("cluster_merge", "auto")
    if not (asked is True or asked is False or (isinstance(asked, str) and asked == "auto")):
        raise ValueError(f"extra cluster_merge must be True, False or 'auto', got {asked!r}")
    if asked is False or not (_merge_in_kernel_fits(spec) and 2 <= spec.kv_parts <= CLUSTER_MAX_PARTS
                              and _grid_axes(spec)[0][1] == "qt_part"
                              and (own_first_item(spec) or not uses_work_counter(spec))):
        return False
    return asked is True or spec.kv_parts == KV_PARTS_CLUSTER


def cluster_push(spec: FA2ForwardSpec) -> bool:
    """Whether cluster_merge's parts push their rows to the block that merges them, one way, in place of two
    cluster barriers around remote reads: rank r of the cluster merges rows r 64 / P .. (r + 1) 64 / P - 1 of each
    consumer warpgroup's 64; every block, its rows staged, sends each of its rows below M to the rank that merges it
    (its 16-byte chunks by st.async into that block's other Q buffer, unused by a block's only item, at the sender's
    part's slot; its LSE into `cl_rl`), each store's bytes counted on the receiving warpgroup's mbarrier (`cl_bar`),
    and merges its own rows from its own shared memory once that barrier has the bytes of its rows from all P parts
    (lse_merge.pushed_merge_unit). A block waits for nobody's reads, and no block leaves while bytes are still on the
    way to it: each waits for its own. The cluster's one barrier is split: every thread arrives at the kernel's
    start, after the receiving barriers' init; a consumer waits on it before its first push, a producer thread at
    its end. Needs the block's only item (cluster_merge's grid: one block an item; a second item would load its Q
    into the buffer the pushes land in), P dividing 64 (2, 4, 8: the parts' slots then fill the Q buffer exactly)
    and D / 8 a power of two (the chunks' shifts); `extra["cluster_push"] = False` keeps the two barriers (bench /
    split_parts 'pull'). Measured: benchmarks/NOTES.md "Decoding's cluster merge by pushes"."""
    asked = spec.extra.get("cluster_push", True)
    if not (asked is True or asked is False):
        raise ValueError(f"extra cluster_push must be True or False, got {asked!r}")
    per_row = spec.head_dim // 8
    return asked and cluster_merge(spec) and 64 % spec.kv_parts == 0 and per_row & (per_row - 1) == 0


def _emit_fused_merge(c: _Code, spec: FA2ForwardSpec, epi: int) -> None:
    """fused_merge's count and merge, after the warpgroup's staged epilogue stored its rows of the part."""
    P, D, NWC = spec.kv_parts, spec.head_dim, consumer_wgs(spec)
    c("# split-kv's merge in the kernel (fused_merge): the last of the q tile's parts to finish merges them all")
    c("fence_acq_rel_gpu()  # this thread's O and LSE of the part reach the GPU before the count below")
    c(f"bar_sync({epi} + cw, 128)  # every thread of the warpgroup has stored and fenced")
    c("if (ctid & 127) == 0:")
    with c.indent():
        c("fence_acq_rel_gpu()  # (the warpgroup's stores, seen through the barrier, before the count)")
        c(f"fm[cw] = cuda.atomic.add(arrivals, ((b * H + h) * nq + qt) * {NWC} + cw, 1)  # these rows' parts "
          "counted before this one")
        c("fence_acq_rel_gpu()")
    c(f"bar_sync({epi} + cw, 128)")
    c(f"if (fm[cw] & {P - 1}) == {P - 1}:  # the last of the {P} parts (the count only grows: mod P, never reset)")
    with c.indent():
        c("fence_acq_rel_gpu()  # the parts counted before this one are visible")
        c(f"for ei in range({64 * D // 8 // 128}):  # the warpgroup's 64 rows in 16-byte chunks")
        with c.indent():
            c("mc = (ctid & 127) + ei * 128")
            c(f"mr = mc // {D // 8}")
            c("mq = q_lo + cw * 64 + mr")
            c("if 0 <= mq < M:")
            with c.indent():
                c(f"merge_unit(o, lse, o_fin, lse_fin, B * H * M, {D}, (b * H + h) * M + mq, mc - mr * {D // 8})")


def _staged_chunk(D: int) -> str:
    """The shared byte address of chunk mn (16 bytes) of row mr of the warpgroup's rows staged in its Q tile (q_wg,
    the staged epilogue's 128-byte swizzle): what the cluster's merges read, remotely or before pushing it."""
    return f"q_wg + mr * {2 * D} + ((mn ^ (mr & 7)) << 4)"


def _emit_cluster_merge(c: _Code, spec: FA2ForwardSpec) -> None:
    """cluster_merge's barriers and merge, after the warpgroup's staged epilogue left its rows of the part in its Q
    buffer and their LSEs in cl_lse: the block's only item (`grid`), so every consumer thread of the cluster's blocks
    reaches each barrier once, and the producer warpgroup, which waits for nothing of the consumers' after it, exits
    (a cluster barrier waits for the threads that have not exited). The second barrier keeps every block's shared
    memory until its peers have read it."""
    P, D = spec.kv_parts, spec.head_dim
    chunks = 64 * D // 8  # a warpgroup's rows in 16-byte chunks
    c(f"# split-kv's merge in the cluster (cluster_merge): the q tile's {P} parts are this cluster's blocks, this")
    c("# one rank kvp; after the barrier every block's staged rows and LSEs are visible to the cluster, and rank")
    c(f"# kvp merges every {P}-th chunk of each warpgroup's rows from the {P} blocks' shared memory")
    c("cluster_sync()  # every thread of the cluster has staged its rows (release / acquire, cluster scope)")
    c(f"for ei in range({-(-chunks // (128 * P))}):")
    with c.indent():
        c(f"mc = (ctid & 127) + (ei * {P} + kvp) * 128")
        c(f"mr = mc // {D // 8}")
        c("mq = q_lo + cw * 64 + mr")
        c(f"if mc < {chunks} and 0 <= mq < M:")
        with c.indent():
            c(f"mn = mc - mr * {D // 8}")
            c(f"merge_unit(cl_lse_s + 4 * (cw * 64 + mr), {_staged_chunk(D)}, o_fin, lse_fin, {D}, "
              "(b * H + h) * M + mq, mn)")
    c("cluster_sync()  # no block leaves while another still reads its shared memory")


def _emit_cluster_push(c: _Code, spec: FA2ForwardSpec, lay: dict[str, int]) -> None:
    """cluster_push's pushes, then this block's merge of its own rows, after the warpgroup's staged epilogue left its
    rows of the part in its Q buffer (q_wg, 128-byte swizzle) and their LSEs in cl_lse."""
    P, D, QWG = spec.kv_parts, spec.head_dim, lay["qwg"]
    per_row = D // 8  # a row's 16-byte chunks
    chunks, rpr = 64 * per_row, 64 // P  # a warpgroup's chunks; the rows a rank merges of each warpgroup
    cpr = rpr * per_row  # their chunks
    c(f"# split-kv's merge in the cluster, pushed (cluster_push): rank r merges rows r {rpr} .. r {rpr} + {rpr - 1} "
      "of each")
    c(f"# warpgroup's 64; each block sends its rows below M there, each chunk to its part's slot of {cpr} chunks")
    c("cluster_wait()  # every block of the cluster has initialised its receiving barriers (arrived at its start)")
    c(f"cl_rx = sb + ((qk + 1) & 1) * {lay['q1']} + cw * {QWG}  # the rows pushed to this warpgroup: the other Q "
      "buffer (a block's only item uses this one)")
    c(f"for ei in range({chunks // 128}):")
    with c.indent():
        c("mc = (ctid & 127) + ei * 128")
        c(f"mr = mc >> {per_row.bit_length() - 1}  # the chunk's row in the warpgroup's 64")
        c("if q_lo + cw * 64 + mr < M:")
        with c.indent():
            c(f"mn = mc & {per_row - 1}")
            c(f"pw0, pw1, pw2, pw3 = lds_v4_u32({_staged_chunk(D)})")
            c(f"pd = mr >> {rpr.bit_length() - 1}  # the rank that merges the row")
            c("pb = mapa_shared(cl_bar_s + cw * 8, pd)  # its warpgroup's barrier")
            c(f"st_async_v4_u32(mapa_shared(cl_rx + (kvp * {cpr} + mc - pd * {cpr}) * 16, pd), pw0, pw1, pw2, pw3, pb)")
            c("if mn == 0:")
            with c.indent():
                c(f"st_async_f32(mapa_shared(cl_rl_s + 4 * (cw * 64 + kvp * {rpr} + mr - pd * {rpr}), pd), "
                  "cl_lse[cw * 64 + mr], pb)")
    c(f"mv = min(max(M - (q_lo + cw * 64 + kvp * {rpr}), 0), {rpr})  # this rank's rows of the warpgroup below M")
    c("if mv > 0:")
    with c.indent():
        c("if (ctid & 127) == 0:")
        with c.indent():
            c(f"mbar_arrive_expect_tx(cl_bar_s + cw * 8, mv * {P * (2 * D + 4)})  # their bytes from the {P} parts")
        c("mbar_wait_cluster(cl_bar_s + cw * 8, 0)")
        c(f"for ei in range({-(-cpr // 128)}):")
        with c.indent():
            c("ml = (ctid & 127) + ei * 128")
            c(f"mr = ml >> {per_row.bit_length() - 1}  # the row among this rank's")
            c(f"mq = q_lo + cw * 64 + kvp * {rpr} + mr")
            c(f"if ml < {cpr} and mq < M:")
            with c.indent():
                c(f"merge_unit(cl_rl, {rpr}, cw * 64 + mr, cl_rx + ml * 16, {cpr * 16}, o_fin, lse_fin, {D}, "
                  f"(b * H + h) * M + mq, ml & {per_row - 1})")


def _epilogue_in_s_asked(spec: FA2ForwardSpec) -> bool:
    """`epilogue_in_s` but for its room (the O buffer, which `_layout` decides: it asks this)."""
    asked = spec.extra.get("epilogue_in_s", small_scores(spec) is None)
    return (bool(persistent(spec)) and producer(spec) == "warpgroup" and pingpong(spec) and not half_tiles(spec)
            and asked is not False)


def bounds_in_s(spec: FA2ForwardSpec) -> bool:
    """Whether the consumers read their rows' bounds (row bounds from captured data: a document mask's ids and run
    table, `row_bounds_read_data`) in the shadow of the item's first S, between its issue and its wait, rather
    than before the kv loop, where the clamps that use them stalled the warpgroup one L2 round trip before it
    could issue S (an item's start, ~5 tiles an item under the document mask). The persistent producer-warpgroup
    kernel (no half tiles); `extra["bounds_in_s"] = False` reads them before the loop (bench '-nobs')."""
    return (row_bounds_read_data(spec) and bool(persistent(spec)) and producer(spec) == "warpgroup"
            and not half_tiles(spec) and spec.extra.get("bounds_in_s", True) is not False)


def _emit_head_prefetch(c: _Code, spec: FA2ForwardSpec) -> None:
    """Producer thread 0 (`list_head_shared`): hn_n, hn_0, hn_1, hn_l = the block-list head of the item of ticket
    tk_next, its coordinates carried from the current item's (it_x, it_y, it_z at ticket it_t) as every thread
    carries them at the handover. Where it is emitted (before the item loop, and after an item's last copies) the
    reads' latency runs while the consumers still work on the item before."""
    from .emit_fa2 import _list_names

    kc, kt = _list_names(spec)
    BK = spec.block_k
    _emit_next_ticket_item(c, spec, "tk_next")
    c(f"hn_r = {list_row_expr(spec, 'b_hx', 'h_hx', 'qt_hx')}")
    c(f"hn_n = {kc}[hn_r]")
    c(f"hn_r = hn_r * ((N + {BK - 1}) // {BK})")
    c(f"hn_0 = {kt}[hn_r] if hn_n > 0 else 0")
    c(f"hn_1 = {kt}[hn_r + 1] if hn_n > 1 else 0")
    c(f"hn_l = {kt}[hn_r + hn_n - 1] if hn_n > 0 else 0")


def grid(spec: FA2ForwardSpec, B: int, H: int, M: int, N: int) -> tuple[int, int, int]:
    """The launch grid: a persistent kernel's blocks (no more than its items), else one block an item. Under
    cluster_merge one block an item whatever their count: a cluster's blocks are one q tile's parts."""
    if cluster_merge(spec):
        return (-(-M // spec.block_q) * spec.kv_parts * B * H, 1, 1)
    if persistent(spec):
        return (min(persistent(spec), -(-M // spec.block_q) * spec.kv_parts * B * H), 1, 1)
    return _fa3_grid(spec, B, H, M, N)


def _layout(spec: FA2ForwardSpec, S: int | None = None, cx: Optional[int] = None) -> dict[str, int]:
    """Byte offsets from the 1024-byte aligned base: Q [D // 64][block_q][128 B] (producer "none": one
    [D // 64][64][128 B] tile per consumer warpgroup, each loads its own), then per stage s K_s and V_s
    ([D // 64][block_k][128 B] each), the score's table tile (table_tiles), the persistent producer kernel's O
    buffer (two warpgroups' 64 rows of D, where it fits; under `q_double` the second Q buffer "q1" instead, both
    Q buffers in the per-warpgroup layout), col_mma's K blocks ("cx": [block_k][128 B], one a consumer warpgroup
    or one for all of them, `col_shared`), then the mbarriers: Q's (one, one per warpgroup, or one per Q buffer),
    full_k[s], full_v[s], empty_k[s], empty_v[s], table_full, q_empty (one per Q buffer under q_double),
    item_full."""
    D, BQ, BK = spec.head_dim, spec.block_q, spec.block_k
    S = stages(spec) if S is None else S
    tile = BK * D * 2
    two_q = _q_double_asked(spec)
    table = BQ * BK * 4 if table_tiles(spec) else 0  # the score's table tile, f32, one buffer (tb)
    q = 8 * (BQ // 64 if producer(spec) == "none" else 2 if two_q else 1)
    tf = 8 * (BQ // 64) if table else 0  # the table tile's full barrier, one per consumer warpgroup
    qe = (16 if two_q else 8) if persistent(spec) and producer(spec) != "none" else 0  # Q free for the next item
    itf = (16 if two_q else 8) if uses_work_counter(spec) else 0  # the next ticket is in `tick` ("dynamic")
    barrier_bytes = q + 32 * S + tf + qe + itf
    # a consumer warpgroup's Q tile under q_double: 64 rows of D, or (bulk_store) the room to stage its O at
    # bulk_pitch bytes a row, rounded up to the 1024 bytes the next tile's 128-byte swizzle asks; the first that
    # fits with the O buffer
    pad = two_q and _bulk_asked(spec) and not _tma_asked(spec)
    # col_mma's K blocks, one a consumer warpgroup or one shared (`cx`: as if that many blocks)
    if cx is None:
        cx = (1 if col_shared(spec) else consumer_wgs(spec)) if col_mma(spec) else 0
    cxb = cx * BK * 128
    for qwg in ([-(-64 * bulk_pitch(D) // 1024) * 1024] if pad else []) + [64 * D * 2]:
        kv = BQ // 64 * qwg if two_q else BQ * D * 2
        o_at = kv + 2 * S * tile + table
        # the persistent producer kernel's O staging buffer (`staged_epilogue`), where it fits under SMEM_LIMIT
        o_buf = kv if (persistent(spec) and producer(spec) == "warpgroup"
                       and spec.extra.get("staged_epilogue", True) is not False) else 0
        # (with room for epilogue_in_s's static arrays, which need the buffer: asked here, it would ask this layout)
        if o_at + o_buf + cxb + barrier_bytes + ALIGN + (kept_bytes(spec) if o_buf else 0) \
                + (slice_bytes(spec) if row_slice(spec) else 0) <= smem_limit(spec):
            break
    else:
        o_buf = 0
    bars = o_at + o_buf + cxb
    return {"tile": tile, "qwg": qwg, "kv": kv, "tb": kv + 2 * S * tile, "o": o_at if o_buf else 0,
            "cx": o_at + o_buf if cxb else 0,
            "q1": o_at if o_buf and two_q else 0, "bars": bars, "full_k": q, "full_v": q + 8 * S,
            "empty_k": q + 16 * S, "empty_v": q + 24 * S, "table_full": q + 32 * S, "q_empty": q + 32 * S + tf,
            "item_full": q + 32 * S + tf + qe, "total": bars + barrier_bytes}


def smem_bytes(spec: FA2ForwardSpec) -> int:
    """The dynamic shared memory a block asks for (the kernel's static arrays come on top: `static_bytes`)."""
    return _layout(spec)["total"] + ALIGN


def kept_f32(spec: FA2ForwardSpec) -> int:
    """epilogue_in_s's ep_f: a consumer thread's two rows' 1 / l."""
    return 128 * consumer_wgs(spec) * 2


def kept_i64(spec: FA2ForwardSpec) -> int:
    """epilogue_in_s's ep_i: a consumer warpgroup's kept item (q_head, or its (b, h) under tma_store; q_lo)."""
    return 2 * consumer_wgs(spec)


def kept_bytes(spec: FA2ForwardSpec) -> int:
    """epilogue_in_s's static shared arrays, ep_f and ep_i (2080 bytes at two consumer warpgroups)."""
    return 4 * kept_f32(spec) + 8 * kept_i64(spec)


BOX_BYTES = O_BOX_ROWS * 128  # a warp's box of O under tma_store: 16 rows of 64 16-bit columns


def emit_straddling_box(c: _Code, D: int) -> None:
    """Under ragged_q_first, a warp's staged box of O whose first row ob_q lies before row 0: a TMA store takes no
    negative coordinate (the H200 raised CUDA_ERROR_ILLEGAL_INSTRUCTION for one, 2026-11-29, where the loads' zero
    fill took them), so a box wholly before 0 is not stored and one that straddles row 0 (q_pad not a multiple of
    16) is stored by the warp's lanes: each of its 16 x D / 8 chunks of 16 bytes from the box's 128-byte swizzle
    (chunk c of box row r at r * 128 + ((c ^ (r & 7)) << 4)) to O's row ob_q + r where that is a row of O.
    Only the first q tile of a (b, h) has such a box."""
    c(f"if ob_q < 0 and ob_q > -{O_BOX_ROWS}:  # the box straddles row 0: its rows from 0 by the lanes")
    with c.indent():
        for hb in range(D // 64):
            c(f"for sbx in range({O_BOX_ROWS * 8 // 32}):")
            with c.indent():
                c("sch = lane + sbx * 32")
                c("sr = sch >> 3  # the box's row")
                c("sq = ob_q + sr")
                c("if sq >= 0 and sq < M:")
                with c.indent():
                    c(f"sw0, sw1, sw2, sw3 = lds_v4_u32(ob_s + {hb * BOX_BYTES} + sr * 128 + "
                      "(((sch & 7) ^ (sr & 7)) << 4))")
                    c(f"stg_v4_u32(o, (ob_bh * M + sq) * {D // 2} + {hb * 32} + (sch & 7) * 4, sw0, sw1, sw2, sw3)")


def tick_words(spec: FA2ForwardSpec) -> int:
    """The int32 words of `tick` (item_order "dynamic"): two tickets, and beside each four words where the handover
    carries them (`_handed_over`: a block list's head, or a static mask's kv range)."""
    return 10 if _handed_over(spec) else 2


def static_bytes(spec: FA2ForwardSpec) -> int:
    """The kernel's static shared arrays: the tickets and list heads (`tick`), the kept epilogue's state, the
    consumer warpgroups' runs of the table (row_slice), the merge's LSEs (cluster_merge: `cl_lse`; under
    cluster_push also the pushed ones, `cl_rl`, and their barriers, `cl_bar`) or counts (fused_merge: `fm`)."""
    tick = 4 * tick_words(spec) if uses_work_counter(spec) else 0
    merge = 4 * consumer_wgs(spec) * (64 if cluster_merge(spec) else 1) if fused_merge(spec) else 0
    merge += (4 * 64 + 8) * consumer_wgs(spec) if cluster_push(spec) else 0  # cl_rl, cl_bar
    return tick + (kept_bytes(spec) if epilogue_in_s(spec) else 0) + (slice_bytes(spec) if row_slice(spec) else 0) \
        + merge


def validate_spec(spec: FA2ForwardSpec) -> None:
    """emit_fa3's checks (dtype, D, tiles, masks, captures) on the spec as the wgmma kernel would take it, then this
    schedule's own."""
    import dataclasses

    _fa3_validate(dataclasses.replace(spec, extra={**spec.extra, "schedule": "wgmma"}, ragged_q_first=False,
                                      kv_parts=1))
    if spec.block_q not in (64, 128, 192):
        raise ValueError(f"wgmma-ws: block_q must be 64, 128 or 192 (one, two or three consumer warpgroups), got "
                         f"{spec.block_q}")
    bps = blocks_per_sm(spec)
    if bps > 1:
        if producer(spec) != "warpgroup":
            raise ValueError(f"wgmma-ws: blocks_per_sm {bps} needs producer 'warpgroup' (launch bounds and "
                             f"setmaxnreg), got {producer(spec)!r}")
        one = dataclasses.replace(spec, extra={**spec.extra, "blocks_per_sm": 1})
        need = smem_bytes(one) + static_bytes(one)
        if need > smem_limit(spec):  # (the layout would drop its second Q buffer to fit, and the TMA loads with it)
            raise ValueError(f"wgmma-ws: blocks_per_sm {bps}: the kernel's {need} bytes of shared memory "
                             f"({stages(spec)} stages of {spec.block_k} x {spec.head_dim}) exceed {smem_limit(spec)}, "
                             f"an SM's share for {bps} blocks")
    if spec.block_q == 64:  # one consumer warpgroup: decoding's tiles (emit_fa3.DECODE_TILES)
        why = [w for w, bad in [
            ("a persistent kernel", not persistent(spec)), ("a producer warpgroup", producer(spec) != "warpgroup"),
            ("TMA loads", not tma_loads(spec)), ("no table tiles", table_tiles(spec))] if bad]
        if why:
            raise ValueError(f"wgmma-ws: one consumer warpgroup (block_q 64) needs {', '.join(why)}")
    if spec.block_q == 192:  # three consumer warpgroups: so far the persistent producer warpgroup's form only
        why = [w for w, bad in [
            ("D = 64", spec.head_dim != 64), ("a persistent kernel", not persistent(spec)),
            ("a producer warpgroup", producer(spec) != "warpgroup"), ("TMA loads", not tma_loads(spec)),
            ("no mask, a static one or a block list", spec.block_mask not in ("none", "static", "list")),
            # (a run of the table in shared memory, row_slice, issues neither)
            ("no table prefetch", "def score_prefetch_fn(" in spec.device_source and not row_slice(spec)),
            ("no early gathers", gather_early(spec) and not row_slice(spec)),
            # S alone is block_k / 2 of the consumers' 160 registers (ptxas: C7602 at 256)
            (f"block_k <= 128 (got {spec.block_k})", spec.block_k > 128)] if bad]
        if why:
            raise ValueError(f"wgmma-ws: three consumer warpgroups (block_q 192) need {', '.join(why)}")
    if spec.ragged_q_first:  # rows before 0: zeros by the TMA loads, clipped by the TMA stores, guarded elsewhere
        why = [w for w, bad in [
            ("a persistent kernel with a producer warpgroup", not (persistent(spec) and producer(spec) == "warpgroup")),
            ("TMA loads", not tma_loads(spec)), ("TMA stores of O", not tma_store(spec)),
            ("no mask or a static one", spec.block_mask not in ("none", "static")),
            ("no table tiles, row slices or half tiles", table_tiles(spec) or row_slice(spec) or half_tiles(spec))]
            if bad]
        if why:
            raise ValueError(f"wgmma-ws: tile{{ragged_q=first}} (q tiles starting before row 0) needs {', '.join(why)}")
    why = split_refusals(spec)
    if why:
        raise ValueError(f"wgmma-ws: split-kv's {spec.kv_parts} parts need {', '.join(why)}")
    if spec.extra.get("col_mma") is True and not col_mma(spec):
        raise ValueError("wgmma-ws: col_mma (the column step's term in S = Q K^T) needs a score with a column step "
                         "(ALiBi's s + w kv + r(q): emit_fa2.col_step) and no half tiles")
    if col_mma(spec) and not col_blocks_fit(spec):
        raise ValueError(f"wgmma-ws: col_mma's K block ({spec.block_k * 128 // 1024} KB) does not fit beside the O "
                         f"buffer at D = {spec.head_dim} with {spec.block_q} x {spec.block_k} tiles")
    if stages(spec) not in (2, 3, 4):
        raise ValueError(f"wgmma-ws: stages must be 2, 3 or 4, got {stages(spec)}")
    if producer(spec) not in PRODUCERS:
        raise ValueError(f"wgmma-ws: producer must be one of {PRODUCERS}, got {producer(spec)!r}")
    p, c = registers(spec)
    for n in (p, c):
        if n % 8 or not 24 <= n <= 256:
            raise ValueError(f"wgmma-ws: setmaxnreg counts are multiples of 8 in [24, 256], got {(p, c)}")
    if producer(spec) == "warpgroup" and 128 * p + (threads_per_block(spec) - 128) * c \
            > threads_per_block(spec) * register_cap(spec):
        # setmaxnreg moves registers inside the block's launch allocation (384 x 168 = 64512, not the SM's 65536):
        # a consumer's inc past what the producer's dec freed waits for ever (the H100 hung at (80, 216))
        raise ValueError(f"wgmma-ws: registers {(p, c)} exceed the block's {threads_per_block(spec)} x "
                         f"{register_cap(spec)} allocated at launch")
    if persistent(spec) < 0:
        raise ValueError(f"wgmma-ws: persistent must be a number of blocks >= 1 (0: off), got {persistent(spec)}")
    if persistent(spec) and (producer(spec) == "warp" or table_tiles(spec)):
        raise ValueError("wgmma-ws: persistent needs producer 'none' or 'warpgroup' and no table tiles (its "
                         "per-item state is not carried across items there)")
    if early_loads(spec) != (stages(spec) - 1,) * 2 and (persistent(spec) or producer(spec) != "none"):
        raise ValueError("wgmma-ws: early_loads splits the consumers' own loads of a block's one item: not with a "
                         "producer or a persistent kernel")
    if producer(spec) == "warpgroup" and not p <= register_cap(spec) <= c:
        raise ValueError(f"wgmma-ws: setmaxnreg takes the producer down and the consumers up from the "
                         f"{register_cap(spec)} registers of the launch: got {(p, c)}")
    if "regs" in spec.extra and "producer_regs" in spec.extra:
        raise ValueError("wgmma-ws: give regs or producer_regs, not both")
    if uses_work_counter(spec) and not (persistent(spec) and producer(spec) == "warpgroup"):
        raise ValueError("wgmma-ws: item_order 'dynamic' needs persistent and producer 'warpgroup' (its producer "
                         "takes the items from the counter and hands them to the consumers)")
    if item_order(spec) != "grid" and not persistent(spec):
        raise ValueError(f"wgmma-ws: item_order {item_order(spec)!r} orders a persistent kernel's items: one block "
                         "an item runs in the hardware's order (set persistent)")
    if persistent(spec) and producer(spec) == "warpgroup" and half_tiles(spec):
        raise ValueError("wgmma-ws: persistent with a producer warpgroup takes whole tiles: no half tiles")
    if not registers_fit(threads_per_block(spec), register_cap(spec)):
        raise ValueError(f"wgmma-ws: {threads_per_block(spec)} threads x {register_cap(spec)} registers do not fit "
                         f"the SM's {REGISTER_FILE} (warps allocated in groups of 4): the launch would fail (701)")
    if smem_bytes(spec) + static_bytes(spec) > smem_limit(spec):
        raise ValueError(f"wgmma-ws: {smem_bytes(spec) + static_bytes(spec)} bytes of shared memory exceed "
                         f"{smem_limit(spec)} ({stages(spec)} stages of {spec.block_k} x {spec.head_dim}, "
                         f"{blocks_per_sm(spec)} block(s) an SM)")


def _emit_load_warp(c: _Code, rows: int, D: int, sdst: str, row0: str, nrows: str, garr: str, base: str,
                    rs: str) -> None:
    """One warp's cp.async of rows row0 .. row0 + rows - 1 of `garr` into the swizzled [D // 64][rows][64] tile at
    shared byte address sdst (rows >= nrows zero-filled): lane l copies rows l % 8 + 8 m (so the swizzle term
    row & 7 is the lane's own constant) and 16-byte chunks l // 8 + 4 i; the chunks' shared offsets pw_<i> and the
    row's global offset are set up once (`_emit_warp_loader_setup`)."""
    CH = D // 8
    c(f"pw_row = {row0} + pw_r")
    c(f"pw_g = {base} + pw_row * {rs} + pw_c * 8")
    c(f"pw_s = {sdst} + pw_r * 128")
    for m in range(rows // 8):
        c(f"if pw_row + {8 * m} < {nrows}:")
        with c.indent():
            for i in range(CH // 4):
                c(f"cp_async16_s(pw_s + pw_{i} + {m * 1024 + 0}, {garr}, pw_g + {8 * m} * {rs} + {32 * i}, 16)")
        c("else:")
        with c.indent():
            for i in range(CH // 4):
                c(f"cp_async16_s(pw_s + pw_{i} + {m * 1024}, {garr}, {base}, 0)")


def _emit_warp_loader_setup(c: _Code, D: int, rows_of: dict[str, int]) -> None:
    """Per-lane constants of `_emit_load_warp`: pw_r (row in 8), pw_c (first chunk), and per chunk i the byte offset
    of chunk pw_c + 4 i inside a row of the swizzled tile, for a tile of `rows` rows (column block stride
    rows * 128: Q and the K/V tiles differ only when block_q != block_k, so each tile height gets its own)."""
    c("pw_r = ptid & 7")
    c("pw_c = ptid >> 3")
    for tag, rows in rows_of.items():
        for i in range(D // 32):
            c(f"pw{tag}_{i} = ((pw_c + {4 * i}) >> 3) * {rows * 128} + ((((pw_c + {4 * i}) & 7) ^ pw_r) << 4)")


def _emit_item_loop_start(c: _Code, spec: FA2ForwardSpec, item_state: Callable[[_Code], None],
                          lay: Optional[dict[str, int]] = None, producer_side: bool = False) -> None:
    """The head of a persistent block's loop over its items, as the producer warpgroup and the consumers walk it
    alike (the same items in the same order): the first item, `while True:`, the item's state, out past the last.
    Leaves the code one level in; `_emit_item_loop_end` closes it. The producer's side waits at the top for both
    consumer warpgroups to be past the last item's last S (q_empty) before it loads the next item's Q.

    item_order "dynamic": producer thread 0 draws tickets from the global counter (`work[0]`), one item ahead;
    at the top of each item, once q_empty says every consumer thread has read the last ticket, it writes the next
    into `tick[ip]` and arrives on item_full, on which all 384 threads wait and read it (two slots and one phase
    an item: a thread cannot be two items behind, since the producer's next write waits for the consumers' q_empty
    and their kv loop for every producer thread's loads). Under `q_double` the producer's next write waits only for
    the buffer of the item before last, and the first two for nothing: two item_full barriers then, one a slot,
    each's parity flipping every second ticket (both from the item count, pq or qk); the write into a slot waits
    for the buffer freed after the slot's last item's successor's Q has landed, which every producer thread's
    copies complete, so no thread is a phase behind on a slot's barrier. The ticket, an item's index in the grid's
    order, moves (it_x, it_y, it_z) by the difference from the last one: `emit_persistent_next`'s carry, no
    division."""
    dynamic = uses_work_counter(spec)
    HEAD = list_head_shared(spec)
    RANGE = range_shared(spec)
    BESIDE = _handed_over(spec)
    if dynamic:
        c("it_x = 0  # the tickets carry (it_x, it_y, it_z) from item 0")
        c("it_y = 0")
        c("it_z = 0")
        c("it_t = 0")
        if not q_double(spec):  # (with it the item count, pq or qk, gives the slot and the parity)
            c("ip = 0  # the ticket's slot in tick and the parity of item_full's phase")
        if producer_side:
            for v in BESIDE:
                c(f"{v} = 0  # " + ("the next item's list head: thread 0's (list_head_shared)" if HEAD else
                                    "the next item's kv range: the first warp's (range_shared)"))
            c("if tid == 0:")
            with c.indent():
                c("tk_next = cuda.blockIdx.x  # the block's first item: its own (own_first_item)" if own_first_item(spec)
                  else "tk_next = cuda.atomic.add(work, 0, 1)  # the block's first item")
                if HEAD:
                    _emit_head_prefetch(c, spec)
            c("else:")
            with c.indent():
                c("tk_next = 0")
            if RANGE:
                c("if role == 0:  # the first item's kv range")
                with c.indent():
                    _emit_range_prefetch(c, spec)
    else:
        emit_persistent_start(c, spec)
    c("while True:")
    c.level += 1
    if producer_side and q_double(spec):
        c(f"mbar_wait(bars + {lay['q_empty']} + (pq & 1) * 8, ((pq >> 1) & 1) ^ 1)  # the consumer warpgroups are "
          "done with this Q buffer's last item (its epilogue)")
    elif producer_side:
        c(f"mbar_wait(bars + {lay['q_empty']}, qe_phase ^ 1)  # the consumer warpgroups are past the last item's "
          "last S")
        c("qe_phase ^= 1")
    if dynamic:
        if q_double(spec):  # ticket k: slot k & 1, its barrier's parity (k >> 1) & 1; k the items so far
            cnt = "pq" if producer_side else "qk"
            c(f"ip = {cnt} & 1  # the ticket's slot in tick and its item_full barrier")
        if producer_side:
            c("if tid == 0:  # every thread has read the last ticket: hand over the next")
            with c.indent():
                c("tick[ip] = tk_next")
                for k, v in enumerate(BESIDE):
                    c(f"tick[{2 + k} + 4 * ip] = {v}")
                c(f"mbar_arrive(bars + {lay['item_full']}" + (" + ip * 8)" if q_double(spec) else ")"))
        c(f"mbar_wait(bars + {lay['item_full']}" + (f" + ip * 8, ({cnt} >> 1) & 1)" if q_double(spec) else ", ip)"))
        c("tk = tick[ip]")
        if BESIDE:
            what = "the item's list head (list_head_shared)" if HEAD else "the item's kv range (range_shared)"
            for k, v in enumerate(("kv_hn", "kv_h0", "kv_h1", "kv_hl") if HEAD else
                                  ("kv_r0", "kv_r1", "kv_r2", "kv_r3")):
                c(f"{v} = tick[{2 + k} + 4 * ip]" + (f"  # {what}" if k == 0 else ""))
        if not q_double(spec):
            c("ip ^= 1")
        c("it_x += tk - it_t  # the grid's order: the carry of emit_persistent_next")
        c("it_t = tk")
        _emit_item_carry(c, spec)
    item_state(c)
    c("if not it_ok:")
    with c.indent():
        if producer_side and spec.kv_parts > 1 and not fused_merge(spec):
            c("griddep_launch_dependents()  # split-kv's merge, launched to depend on this grid, may be placed as the "
              "last items end (it waits for the parts)")
        c("break")
    if dynamic and producer_side:
        c("if tid == 0:")
        with c.indent():
            c("tk_next = cuda.atomic.add(work, 0, 1)" + (" + cuda.gridDim.x" if own_first_item(spec) else "")
              + "  # the next item's ticket, drawn while this one loads")


def own_first_item(spec: FA2ForwardSpec) -> bool:
    """item_order "dynamic": whether block c's first item is item c, and the counter's tickets the items after the
    first round (drawn + gridDim.x), where every ticket came from the counter. Why: a block draws its next ticket
    while its item loads, one item ahead, so on a grid of about as many items as blocks a block that started early
    took a second ticket before a late block drew its first, ran two items back to back while an SM idled. Measured
    (H200, 2026-11-30, kernels in CUDA graphs, GPU time): B = 1, H = 8, N = 2k at D = 128 (128 items on 132 blocks)
    57.5 -> 32.2 us (1.79x; 0.96x cuDNN's time after, 0.54x before), 16 parts of decoding (128 items) 33.7 -> 29.0;
    the other small grids 0.96-1.00 of the drawn first tickets (one capture each), B = 4, H = 16, N = 4k 1.009
    plain and 1.012 causal (one do_bench each). `extra["own_first_item"]` = False draws every ticket from the counter
    (bench '-noofi')."""
    return uses_work_counter(spec) and spec.extra.get("own_first_item", True) is not False


def early_first_item(spec: FA2ForwardSpec) -> bool:
    """Whether producer thread 0 issues the block's first item (its own: own_first_item) at the block's entry: right
    after it initialised the barriers (and a proxy fence), it acquires the three maps and sends the item's Q and its
    first `stages` K and V tiles, before the block's barrier, the producer's setmaxnreg and the ticket's handover;
    its loop then skips what went out (Q at pq = 0, the first `early` tiles). Why: a decoding block took ~1.0-1.3 us
    from its entry to its first item (timeline.py on an H200, 2026-12-01: 0.26 to the block's barrier, 0.26 to the
    consumers' registers, 0.5-0.8 to the ticket, the maps' acquires in it), and only then asked for Q, while its
    whole kv share (two tiles at B = 2, N = 1k) is a few loads. The first item's tiles must be the kv range in order
    (no mask: no tile skipped, no range scanned or handed over). Measured (H200, 2026-12-01, `split_parts.py --set
    early --rounds 5`, CUDA graphs, three calls): no faster, 0.98-1.08x the loop's time in two calls, 0.98-1.07x in
    the first. Q landed 0.26 us after the item's state and K 85 cycles after Q, but the consumers reached their
    first line 0.8-1.0 us after the block's barrier, with their setmaxnreg.inc or without (one tick without the
    early copies), so the first S started no sooner and the kernel ended as before. Off; `extra["early_first_item"]`
    = True asks for it (bench '-efi')."""
    return (spec.extra.get("early_first_item", False) is True and own_first_item(spec) and tma_loads(spec)
            and q_double(spec) and producer(spec) == "warpgroup" and not spec.has_mask and spec.block_mask != "list"
            and not list_head_shared(spec) and not range_shared(spec) and not l2_hints(spec)
            and not map_prefetch(spec))


def _emit_item_loop_end(c: _Code, spec: FA2ForwardSpec, producer_side: bool = False) -> None:
    """The tail of `_emit_item_loop_start`'s loop: the next item, one level out. Item order "dynamic", on the
    producer's side: thread 0 counts its block done after the loop, and the last block done zeroes the counter for
    the next launch (every block has drawn its last ticket by then: it counts itself done only after it)."""
    if not uses_work_counter(spec):
        emit_persistent_next(c, spec)
    c.level -= 1
    if uses_work_counter(spec) and producer_side:
        c("if tid == 0:")
        with c.indent():
            c("if cuda.atomic.add(work, 1, 1) == cuda.gridDim.x - 1:  # the last block done: zero for the next launch")
            with c.indent():
                c("work[0] = 0")
                c("work[1] = 0")


def _emit_q_tma(c: _Code, spec: FA2ForwardSpec, lay: dict[str, int], buf: str, tload: str, hint: bool) -> None:
    """Q of the item by TMA into Q buffer `buf` (q_double), announced on its barrier: thread 0's arrival."""
    D, BQ = spec.head_dim, spec.block_q
    c(f"q_buf = sb + {buf} * {lay['q1']}  # buffer {buf}")
    c(f"mbar_arrive_expect_tx(q_bar, {BQ * D * 2})")
    for w in range(BQ // 64):
        for hb in range(D // 64):
            c(f"{tload}(q_buf + {w * lay['qwg'] + hb * 64 * 128}, qmap_g, {hb * 64}, q_lo + {w * 64}, h, b, "
              f"q_bar{', q_pol' if hint else ''})")


def _emit_kv_tma(c: _Code, spec: FA2ForwardSpec, lay: dict[str, int], j: str, tload: str, hint: bool,
                 wait: bool) -> None:
    """Visit `j`'s K and V by TMA into the stage at k_dst / sbar, each announced on its full barrier; `wait`: after
    the consumers are done with the stage (not at entry, where every stage is free)."""
    D, BK, T = spec.head_dim, spec.block_k, lay["tile"]
    for x, off, what in (("k", "", "K"), ("v", f" + {T}", "V")):
        if wait:
            c(f"mbar_wait(sbar + {lay['empty_' + x]}, phase ^ 1)  # the consumer warpgroups are done with "
              f"this stage's {what}")
        c(f"mbar_arrive_expect_tx(sbar + {lay['full_' + x]}, {T})  # the tile's bytes complete its phase")
        for hb in range(D // 64):
            c(f"{tload}(k_dst{off} + {hb * BK * 128}, {x}map_g, {hb * 64}, {tile_at(spec, j)} * "
              f"{BK}, hk, b, sbar + {lay['full_' + x]}{', kv_pol' if hint else ''})")


def _emit_early_first_item(c: _Code, spec: FA2ForwardSpec, lay: dict[str, int],
                           item_state: Callable[[_Code], None]) -> None:
    """early_first_item, in producer thread 0 right after the barriers' init: the maps acquired, the block's own
    item's state, its Q into buffer 0 and its first visits' K and V into stages 0, 1, .. (counted in `early`)."""
    c("fence_proxy_async_smem()  # the barriers' init seen by the TMA copies that complete on them")
    for x in "qkv":
        c(f"{x}map_g = elem_addr({x}map, (0,))")
        c(f"tensormap_acquire({x}map_g)")
    c("it_x = cuda.blockIdx.x  # the block's first item: its own (own_first_item), sent before the block's barrier")
    c("it_y = 0")
    c("it_z = 0")
    _emit_item_carry(c, spec)
    item_state(c)
    c("if it_ok:")
    with c.indent():
        c("q_bar = bars")
        _emit_q_tma(c, spec, lay, "0", "tma_load_4d", False)
        c("j = kv_first")
        c(f"while j <= kv_last and early < {stages(spec)}:  # the ring's stages, each free")
        with c.indent():
            c(f"k_dst = sb + {lay['kv']} + early * {2 * lay['tile']}")
            c("sbar = bars + early * 8")
            _emit_kv_tma(c, spec, lay, "j", "tma_load_4d", False, wait=False)
            c("j += 1")
            c("early += 1")


def _emit_producer(c: _Code, spec: FA2ForwardSpec, lay: dict[str, int],
                   item_state: Optional[Callable[[_Code], None]] = None) -> None:
    """The producer: Q, then each visited kv tile's K and V into the ring. `item_state` (a persistent kernel): the
    same for each of the block's items in turn, the ring's stage and phase carried across them, each item's Q once
    both consumer warpgroups are past the previous item's last S (the q_empty barrier), so the next item's Q and
    first tiles load while the consumers finish the item before (its last P V and epilogue)."""
    D, BQ, BK, S = spec.head_dim, spec.block_q, spec.block_k, stages(spec)
    PERSIST = item_state is not None
    T, KV = lay["tile"], lay["kv"]
    WARP = producer(spec) == "warp"
    TMAL = tma_loads(spec)
    if WARP:
        c(f"ptid = tid - {threads_per_block(spec) - 32}  # the producer warp's lane")
        _emit_warp_loader_setup(c, D, {"q": BQ, "k": BK})

        def load(rows, sdst, row0, nrows, garr, base, rs, tag):
            for i in range(D // 32):
                c(f"pw_{i} = pw{tag}_{i}")
            _emit_load_warp(c, rows, D, sdst, row0, nrows, garr, base, rs)
    else:
        if uses_setmaxnreg(spec):
            c(f"SETMAXNREG_DEC()  # producer: {registers(spec)[0]} registers")
        rstep = 0 if TMAL else _emit_loader_setup(c, 128, D)  # TMA: no thread keeps row addresses

        def load(rows, sdst, row0, nrows, garr, base, rs, tag):
            if garr == "q":
                _emit_load(c, rows, rstep, D, sdst, row0, nrows, garr, base, rs)
            else:  # K, V: a tile inside N from the kept row addresses (an add a copy, not ~8 integer instructions)
                _emit_load_inside(c, rows, rstep, D, sdst, row0, nrows, garr, base, rs)
    HINT = l2_hints(spec)
    tload = "tma_load_4d_hint" if HINT else "tma_load_4d"  # l2_hints: the same copy with its policy last
    if TMAL:
        for x in "qkv":
            c(f"{x}map_g = elem_addr({x}map, (0,))  # {x.upper()}'s tensor map in global memory (tma_loads)")
        if not early_first_item(spec):  # (there thread 0 acquired them at entry)
            c("if tid == 0:  # the thread that copies Q, K and V")
            with c.indent():
                if map_prefetch(spec):
                    for x in "qkv":
                        c(f"tensormap_prefetch({x}map_g)" + ("  # the three maps' fetches at once (map_prefetch)"
                                                              if x == "q" else ""))
                for x in "qkv":
                    c(f"tensormap_acquire({x}map_g)")
        if HINT:
            c("q_pol = l2_evict_first()  # Q is read once: its lines go first (l2_hints)")
            c("kv_pol = l2_evict_last()  # K and V are read by every q tile of the head: theirs last")
    c("stage = 0")
    c("phase = 0")
    QD = q_double(spec)
    if PERSIST:
        c("pq = 0  # the producer's items: item pq's Q in buffer pq & 1 (q_double)" if QD else "qe_phase = 0")
        _emit_item_loop_start(c, spec, item_state, lay, producer_side=True)
    if TMAL:  # q_double: each consumer warpgroup's 64 rows, a copy a 64-column block (rows past M zeros)
        c("q_bar = bars + (pq & 1) * 8")
        c("if tid == 0:  # Q by TMA: its barrier completes when the item's Q bytes and every producer thread are in")
        with c.indent():
            if early_first_item(spec):
                c("if pq != 0:  # (the first item's Q and thread 0's arrival went out at entry: early_first_item)")
            with c.indent() if early_first_item(spec) else contextlib.nullcontext():
                _emit_q_tma(c, spec, lay, "(pq & 1)", tload, HINT)
        c("else:  # the other producer threads are past the item's ticket: none can fall an item behind, where its")
        with c.indent():  # wait on the next ticket would alias a phase and its read race thread 0's next write
            c("mbar_arrive(q_bar)")
        c("pq += 1")
    elif QD:  # each consumer warpgroup's 64 rows a tile of their own in the item's buffer
        c(f"# Q; its barrier completes when the {producer_threads(spec)} producer threads' copies have landed")
        c(f"q_dst = sb + {lay['q1']}  # buffer 1")
        _emit_q_tiles_load(c, D, rstep, lay["qwg"])
        c("cp_async_mbar_arrive_noinc(bars + (pq & 1) * 8)")
        c("pq += 1")
    else:
        c(f"# Q; its barrier completes when the {producer_threads(spec)} producer threads' copies have landed")
        load(BQ, "sb", "q_lo", "M", "q", "qg", "q_sm", "q")
        c("cp_async_mbar_arrive_noinc(bars)")
    if not (WARP or TMAL):
        # this thread's chunk of row 0 of the item's (b, head) slices of K and V, the bytes a row and between its
        # rows: the kv loop's copies then add to them (the index arithmetic of `_emit_load` cost the producer ~250
        # instructions a warp a tile, half of them on the FMA pipe the consumers' softmax uses; NOTES)
        _emit_row_addresses(c, "k", "kg", "k_sm", rstep)
        _emit_row_addresses(c, "v", "vg", "v_sm", rstep)
    c("j = kv_first")
    LIST = spec.block_mask == "list"
    if LIST:  # a block list: the next entry read a tile ahead, so no copy waits on a global read of the list
        _emit_list_ahead(c, spec, head=list_head_shared(spec))
    c("while j <= kv_last:")
    with c.indent():
        _emit_next_tile(c, spec, "j", "jn", ahead=LIST)
        c(f"k_dst = sb + {KV} + stage * {2 * T}")
        c("sbar = bars + stage * 8")
        if TMAL:
            c("if tid == 0:  # K and V by TMA, a copy a 64-column block of the tile's rows (rows past N: zeros)")
            with c.indent():
                if early_first_item(spec):
                    c("if early > 0:  # this tile went out at entry (early_first_item)")
                    with c.indent():
                        c("early -= 1")
                    c("else:")
                with c.indent() if early_first_item(spec) else contextlib.nullcontext():
                    _emit_kv_tma(c, spec, lay, "j", tload, HINT, wait=True)
        else:
            c(f"mbar_wait(sbar + {lay['empty_k']}, phase ^ 1)  # the consumer warpgroups are done with this stage's "
              "K")
            load(BK, "k_dst", f"j * {BK}", "N", "k", "kg", "k_sm", "k")
            c(f"cp_async_mbar_arrive_noinc(sbar + {lay['full_k']})")
            c(f"mbar_wait(sbar + {lay['empty_v']}, phase ^ 1)  # ... and with its V")
            load(BK, f"k_dst + {T}", f"j * {BK}", "N", "v", "vg", "v_sm", "k")
            c(f"cp_async_mbar_arrive_noinc(sbar + {lay['full_v']})")
        c("j = jn")
        _emit_next_stage(c, S)
    if PERSIST:
        if list_head_shared(spec):
            c("if tid == 0:  # the next item's list head, read while this item's last copies land")
            with c.indent():
                _emit_head_prefetch(c, spec)
        if range_shared(spec):
            c("if role == 0:  # the next item's kv range, scanned while this item's last copies land")
            with c.indent():
                _emit_range_prefetch(c, spec)
        _emit_item_loop_end(c, spec, producer_side=True)
    c("cp_async_wait0()  # leave no copy in flight")
    if cluster_push(spec):
        c("cluster_wait()  # (every thread that arrives on the cluster's barrier waits on it once)")


def _emit_q_tiles_load(c: _Code, D: int, rstep: int, qwg: int) -> None:
    """`q_double`'s Q copy: rows q_lo .. q_lo + 127 into the two consumer warpgroups' [D // 64][64][128 B] tiles of
    the item's buffer (rows 64 on in the second, `qwg` bytes on), by one helper call from one set of row
    addresses as the one-tile copy (`_emit_load`), the buffer's base added on one of two branches: a base computed
    from pq made ptxas hoist the copies' row offsets out of the item loop and spill 500 bytes in the producer of the
    kernel without a mask (ptxas 13.0, 120 registers)."""
    n, h = 128 // rstep, 64 // rstep  # rows a thread, in each tile
    jump = qwg - 64 * 128  # a row past the first tile: from where the first tile's layout puts it
    c(f"ld_s = (ld_c >> 3) * {64 * 128} + ld_r0 * 128 + ld_x")
    c("ld_row = q_lo + ld_r0")
    c("ld_g = qg + ld_row * q_sm + ld_c * 8")
    c("ld_safe = qg + ld_c * 8")
    fn = rows_helper(c, f"load_q_tiles_{n}", n, rstep, 128, (h, jump))
    c("if pq & 1:  # a constant base on each path: a computed one made ptxas spill (ptxas 13.0)")
    with c.indent():
        c(f"{fn}(ld_s + q_dst, q, ld_g, ld_safe, q_sm, ld_row, M)")
    c("else:")
    with c.indent():
        c(f"{fn}(ld_s + sb, q, ld_g, ld_safe, q_sm, ld_row, M)")


def _emit_score_prefetch(c: _Code, spec: FA2ForwardSpec, nxt: str) -> None:
    """Where the score gathers a table per element (a bias[h, q, kv], a relative bias): the entries of the next
    visited kv tile into L2 (prefetch.global.L2, no registers held), before this tile's wait for K, so the
    softmax does not wait on DRAM for them. Thread t of the two consumer warpgroups takes row t % 128 and
    32-column chunks 32 (t // 128) + 64 i: 128-byte lines of a row-major table; a table read along a diagonal
    (relative bias) gets the lines its tile touches too. Beyond the last tile it prefetches the last again.
    `extra["prefetch_tiles"]` (default 1) prefetches that many tiles ahead instead (to measure). `nxt`: the next
    visit's loop counter, mapped to its position by tile_at after the clamp (under kv_reverse the tiles ahead
    lie below)."""
    if "def score_prefetch_fn(" not in spec.device_source:
        return
    BK = spec.block_k
    ahead = int(spec.extra.get("prefetch_tiles", 1))  # tiles ahead (static ranges only; a block list: the next)
    step = nxt if ahead == 1 or spec.block_mask == "list" else f"{nxt} + {ahead - 1}"
    at = tile_at(spec, f"min({step}, kv_last)")  # the visit's position (kv_reverse: mirrored, kv_first at the end)
    c(f"pf_kv = {at} * {BK} + ((tid >> 7) & 1) * 32  # a later tile's gathers into L2")
    for i in range(max(1, BK // 64)):
        c(f"score_prefetch_fn(b, h, q_lo + (tid & 127), pf_kv + {64 * i}{_score_args(spec)})")


def _emit_next(c: _Code, spec: FA2ForwardSpec, cur: str, out: str) -> None:
    """out = the next visited kv tile after cur: `_emit_next_tile`, but under a static block mask through one device
    function `next_tile` (its `while` over tile_class_fn was written out five times: the consumer's loop and each
    loader step, ~40 Numba IR statements a copy; benchmarks/NOTES.md, "Compile time", round 5); cur + 1 where the
    kernel walks the range (`walks_range`)."""
    if spec.block_mask != "static" or walks_range(spec):
        _emit_next_tile(c, spec, cur, out)
        return
    caps = _cap_args(spec)
    fn = c.helper("next_tile", [
        "@device_function", f"def next_tile(j, kv_last, b, h, q_lo, q_hi, N{caps}):",
        "    jn = j + 1",
        f"    while jn <= kv_last and {_tile_class_expr(spec, 'jn')} == 0:",
        "        jn += 1",
        "    return jn"])
    c(f"{out} = {fn}({cur}, kv_last, b, h, q_lo, q_hi, N{caps})")


def _emit_loader_next(c: _Code, spec: FA2ForwardSpec) -> None:
    """ljn = the visited kv tile after lj: `_emit_next` on the loader's own cursor (a block list's position
    lkv_pos, not the consumer's kv_pos: the same threads walk the list twice, S - 1 tiles apart)."""
    tmp = _Code()
    tmp.level = c.level
    tmp.helpers = c.helpers
    _emit_next(tmp, spec, "lj", "ljn")
    for line in tmp.lines:
        c.lines.append(re.sub(r"\bkv_(pos|cls)\b", r"lkv_\1", line))


def _emit_loader_step(c: _Code, spec: FA2ForwardSpec, lay: dict[str, int], kind: str | None) -> None:
    """Producer "none": this warpgroup's next ring load, tile lj into stage lstage, if any is left: wait until both
    warpgroups have released the stage (its empty barrier), cp.async the tile (K by warpgroup 0, V by warpgroup 1;
    kind "k" / "v" where the caller knows which, None for a branch on cw) and let the copies' completion arrive
    on the stage's full barrier (`cp.async.mbarrier.arrive.noinc`, 128 arrivals)."""
    D, BK, S, T = spec.head_dim, spec.block_k, stages(spec), lay["tile"]
    rstep = 128 // (D // 8)
    c("if lj <= kv_last:")
    with c.indent():
        c("mbar_wait(l_empty + lstage * 8, lphase ^ 1)  # both warpgroups are done with this stage's tile")
        c(f"l_dst = l_dst0 + lstage * {2 * T}")
        # the tile's address arithmetic and its row loads in one device function (six sites: ~30 Numba IR
        # statements each written out)
        body = _Code()
        body.helpers = c.helpers
        body.level = 1
        _emit_load(body, BK, rstep, D, "l_dst", f"lj * {BK}", "N", "arr", "g0", "sm")
        fn = c.helper("ring_tile", ["@device_function", "def ring_tile(l_dst, arr, g0, sm, lj, N, ld_c, ld_r0, ld_x):"]
                      + body.lines)
        args = {"k": ("k", "kg", "k_sm"), "v": ("v", "vg", "v_sm")}
        c(f"if (lj + 1) * {BK} <= N:  # a tile wholly inside N: from the kept row addresses (l_at)")
        with c.indent():
            c(f"{copy_rows_helper(c, BK // rstep, rstep)}(l_dst + (ld_c >> 3) * {BK * 128} + ld_r0 * 128 + ld_x, "
              f"l_at + np.uint64(lj * {BK}) * l_rb, l_rs)")
        c("elif cw == 0:" if kind is None else "else:")
        if kind is None:
            with c.indent():
                c(f"{fn}(l_dst, {', '.join(args['k'])}, lj, N, ld_c, ld_r0, ld_x)")
            c("else:")
            with c.indent():
                c(f"{fn}(l_dst, {', '.join(args['v'])}, lj, N, ld_c, ld_r0, ld_x)")
        else:
            with c.indent():
                c(f"{fn}(l_dst, {', '.join(args[kind])}, lj, N, ld_c, ld_r0, ld_x)")
        c("cp_async_mbar_arrive_noinc(l_full + lstage * 8)")
        _emit_loader_next(c, spec)
        c("lj = ljn")
        _emit_next_stage(c, S, "l")


def _emit_next_stage(c: _Code, S: int, prefix: str = "") -> None:
    """The ring's next stage (`{prefix}stage`), and its phase's flip where the ring wraps round (`{prefix}phase`):
    the loaders' and the consumers' walks over the S stages."""
    c(f"{prefix}stage += 1")
    c(f"if {prefix}stage == {S}:")
    with c.indent():
        c(f"{prefix}stage = 0")
        c(f"{prefix}phase ^= 1")


def _emit_table_tile_setup(c: _Code, spec: FA2ForwardSpec, lay: dict[str, int]) -> Callable[[str], None]:
    """Producer "none" with `table_tiles`: the per-thread state of the table tile's copies (this warpgroup's buffer
    t_wg and barrier t_full, tile_on from tile_ok_fn, the row address t_src and stride t_rs of this thread's column
    chunk t_cc, its swizzled shared address t_dst), and the first tile's copy. Returns copy(jt), which emits the
    copy of tile jt: from the kept addresses where the tile lies inside the table (an add and a cp.async a chunk),
    else through tile_chunk_fn (clamped rows, zeros past a row's end)."""
    BK = spec.block_k
    caps = _score_args(spec)
    lg = (BK // 4).bit_length() - 1
    rows_fn = c.helper("table_rows", [
        "@device_function", f"def table_rows(t_wg, wtid, b, h, q0, kv0{caps}):",
        f"    for i in range({BK // 8}):  # 64 rows x {BK // 4} 16-byte chunks, 128 threads: a warp copies a row",
        "        ci = wtid + 128 * i",
        f"        row = ci >> {lg}",
        f"        cc = ci & {BK // 4 - 1}",
        f"        tile_chunk_fn(t_wg + np.uint32(row * {BK * 4}) + np.uint32((cc ^ (((row & 3) << 1) & {BK // 4 - 1})) "
        f"<< 4), b, h, q0 + row, kv0 + cc * 4{caps})"])
    RSTEP = 128 // (BK // 4)  # rows between a thread's successive chunks: its column chunk and row & 3 stay
    fast_fn = c.helper("table_rows_at", [
        "@device_function", "def table_rows_at(t_dst, t_src, t_rs, kv0):",
        "    src = t_src + np.uint64(kv0 * 4)",
        f"    for i in range({BK // 8}):  # a tile inside the table: from the kept row addresses",
        f"        cp_async16_a(t_dst + np.uint32(i * {RSTEP * BK * 4}), src + np.uint64(i) * t_rs, 16)"])
    c("# the score's table: this warpgroup's 64 rows of its [q, kv] tile in shared memory, copied a kv tile ahead")
    c(f"t_wg = sb + {lay['tb']} + cw * {64 * BK * 4}")
    c(f"t_full = bars + {lay['table_full']} + cw * 8")
    c(f"tile_on = tile_ok_fn(b, h, N{caps})  # else (rows off 16-byte alignment, a short table) the gathers")
    c("tphase = 0")
    c(f"t_r0 = wtid >> {lg}  # this thread copies column chunk t_cc of rows t_r0 + {RSTEP} i")
    c(f"t_cc = wtid & {BK // 4 - 1}")
    c(f"t_dst = t_wg + np.uint32(t_r0 * {BK * 4}) + np.uint32((t_cc ^ (((t_r0 & 3) << 1) & {BK // 4 - 1})) << 4)")
    c(f"t_src, t_rs, t_rows, t_cols = tile_geom_fn(b, h, q_lo + cw * 64 + t_r0{caps})")
    c("t_src = t_src + np.uint64(t_cc * 16)")
    c(f"t_rs = np.uint64(t_rs * {RSTEP})")
    c("t_in = q_lo + cw * 64 + 64 <= t_rows  # every row of this warpgroup's tiles inside the table")

    def copy(jt: str) -> None:
        c(f"if t_in and ({jt} + 1) * {BK} <= t_cols:")
        with c.indent():
            c(f"{fast_fn}(t_dst, t_src, t_rs, {jt} * {BK})")
        c("else:  # rows or columns past the table's end: clamped rows, zeros past the row")
        with c.indent():
            c(f"{rows_fn}(t_wg, wtid, b, h, q_lo + cw * 64, {jt} * {BK}{caps})")

    c("if tile_on:")
    with c.indent():
        copy("kv_first")
        c("cp_async_mbar_arrive_noinc(t_full)")
    return copy


def _emit_row_hull(c: _Code, spec: FA2ForwardSpec) -> None:
    """hw_lo, hw_hi: the hull of the kv intervals its warpgroup's rows keep (`half_tiles`), the same in every
    thread of the warpgroup: each warp bounds all 64 rows (a lane two of them), then redux.sync min / max, whose
    result ptxas knows is warp-uniform (the S issue branches on it around wgmma). Rows past M, and rows that keep
    nothing, add nothing; a row whose bounds are not exact (a run table of ids that come back) covers [0, N)."""
    caps = _cap_args(spec)
    fn = c.helper("row_hull", [
        "@device_function", f"def row_hull(b, h, q, M, N{caps}):",
        "    # one row's kept kv interval, clamped to [0, N]; (N + 1, -1) where it keeps nothing or lies past M",
        f"    lo, hi, ex = row_bounds_fn(b, h, q{caps})",
        "    lo = min(max(lo, 0), N)",
        "    hi = min(max(hi, 0), N)",
        "    if q >= M or (ex and lo >= hi):",
        "        return np.int32(N + 1), np.int32(-1)",
        "    if not ex:",
        "        return np.int32(0), np.int32(N)",
        "    return np.int32(lo), np.int32(hi)"])
    c("# half tiles: the kv hull of this warpgroup's 64 rows, once per item (each warp bounds all 64)")
    c("hr = q_lo + cw * 64 + g + (lane & 3) * 8")
    c(f"hw_lo, hw_hi = {fn}(b, h, hr, M, N{caps})")
    c(f"hw_lo2, hw_hi2 = {fn}(b, h, hr + 32, M, N{caps})")
    c("hw_lo = warp_min(min(hw_lo, hw_lo2))")
    c("hw_hi = warp_max(max(hw_hi, hw_hi2))")


def _emit_col_block(c: _Code, spec: FA2ForwardSpec, cx: int, pack: str) -> None:
    """col_mma's K block, once before the consumer's first item: [block_k][128 B] at `cx` (this warpgroup's own, or
    one for all under `col_shared`), row j holding j in columns 0-2 and zeros in 3-15 (the k step's 32 bytes, chunks 0
    and 1 swizzled as a K tile's rows; the rest of the row is never read); then `cx_d`, its descriptor's word."""
    BK = spec.block_k
    SH = col_shared(spec)
    n = 128 * consumer_wgs(spec) if SH else 128  # the threads that write it, a row each
    who = "ctid" if SH else "(ctid & 127)"
    if SH:
        c("# S's column term (col_mma): K's extra k step, one block for every consumer warpgroup, row j = the column's")
        c("# offset in its kv tile, holding j in columns 0-2 and zeros to 15 (chunks 0 and 1 of a K tile's swizzled "
          "row)")
    else:
        c("# S's column term (col_mma): K's extra k step, this warpgroup's own block, row j = the column's offset in "
          "its kv")
        c("# tile, holding j in columns 0-2 and zeros to 15 (chunks 0 and 1 of a K tile's swizzled row)")
    c(f"cx_s = sb + {cx}" + ("" if SH else f" + cw * {BK * 128}"))
    for i in range(-(-BK // n)):
        guard = BK - n * i < n
        if guard:
            c(f"if {who} + {n * i} < {BK}:")
            c.level += 1
        c(f"cx_r = {who} + {n * i}")
        c("cx_j = np.float32(cx_r)")
        c("cx_a = cx_s + cx_r * 128")
        c("cx_0 = cx_a + ((cx_r & 7) << 4)  # chunk 0: columns 0-7")
        c(f"sts_u32(cx_0, {pack}(cx_j, cx_j))")
        c(f"sts_u32(cx_0 + 4, {pack}(cx_j, ZERO))")
        c("sts_u32(cx_0 + 8, np.uint32(0))")
        c("sts_u32(cx_0 + 12, np.uint32(0))")
        c("cx_1 = cx_a + ((1 ^ (cx_r & 7)) << 4)  # chunk 1: columns 8-15")
        for w in range(4):
            c(f"sts_u32(cx_1 + {4 * w}, np.uint32(0))")
        if guard:
            c.level -= 1
    c("fence_proxy_async()  # the rows are visible to wgmma's async proxy")
    if SH:
        c(f"bar_sync({COL_BARRIER}, {n})  # ... all of them, by every consumer warpgroup: each one's first S reads the "
          "block")
    else:
        c(f"bar_sync({epilogue_barrier(spec)} + cw, 128)  # ... all of them: the warpgroup's first S reads the block")
    c("cx_d = desc_word(HI_QK, cx_s)  # its descriptor's word (K-major, as K's)")


def _emit_col_words(c: _Code, spec: FA2ForwardSpec) -> None:
    """col_mma's A words for the item's (b, h): `cx_w`, this thread's register of the k step's A fragment (columns 2t,
    2t + 1 of rows g and g + 8, every row the same): w / scale split into three 16-bit parts in columns 0-2, or zero
    where the step is steep (emit_fa2.COL_STEP_MAX: the row helpers then take each element's exact score)."""
    to_f32 = "f16_to_f32" if spec.dtype == "f16" else "bf16_to_f32"
    pack = "pack_f16x2" if spec.dtype == "f16" else "pack_bf16x2"
    fn = c.helper("col_words", [
        "@device_function",
        "def col_words(cs, t):",
        "    # cs = hi + mid + lo, each a 16-bit value: rounded, and the rest rounded again (the first two differences",
        "    # are exact in f32)",
        f"    hi = {to_f32}(np.uint16({pack}(cs, ZERO) & np.uint32(0xFFFF)))",
        "    r1 = cs - hi",
        f"    mid = {to_f32}(np.uint16({pack}(r1, ZERO) & np.uint32(0xFFFF)))",
        "    lo = r1 - mid",
        "    if t == 0:",
        f"        return {pack}(hi, mid)  # columns 0, 1",
        "    if t == 1:",
        f"        return {pack}(lo, ZERO)  # columns 2, 3",
        "    return np.uint32(0)"])
    caps = _score_args(spec)
    c(f"cx_w = np.uint32(0) if col_steep else {fn}(score_col_fn(b, h{caps}), lane & 3)  # the item's column step "
      "w / scale (col_mma); 0 where steep (col_steep: _emit_tile_range)")


def _emit_consumer(c: _Code, spec: FA2ForwardSpec, lay: dict[str, int],
                   item_state: Optional[Callable[[_Code], None]] = None) -> None:
    """The consumer warpgroups. `item_state` (persistent kernels): emits the state of the item it_x, it_y, it_z
    (qt, h, b, their bases and kv tile range), which the kernel's prologue emitted once otherwise."""
    D, BQ, BK, S = spec.head_dim, spec.block_q, spec.block_k, stages(spec)
    PERSIST = item_state is not None
    T, KV = lay["tile"], lay["kv"]
    KS, KK = D // 16, BK // 16
    pack = "pack_f16x2" if spec.dtype == "f16" else "pack_bf16x2"
    caps = _score_args(spec)
    PP = pingpong(spec)
    NONE = producer(spec) == "none"
    NWC = consumer_wgs(spec)
    EPI = epilogue_barrier(spec)
    TURN_NEXT = "2 - cw" if NWC == 2 else "pp_next"  # the barrier of the next warpgroup's turn
    if consumers_raise_registers(spec):
        c(f"SETMAXNREG_INC()  # consumers: {registers(spec)[1]} registers")
    if producer(spec) == "warpgroup":
        c("ctid = tid - 128")
    else:
        c("ctid = tid  # the consumer warpgroups are warpgroups 0 and 1 (wgmma's warpgroups are aligned)")
    c("lane = tid & 31")
    c(f"warp = ctid >> 5  # consumer warp 0..{4 * NWC - 1}: rows 16 warp .. 16 warp + 15 of the q tile")
    c(f"cw = {'(role - 4)' if producer(spec) == 'warpgroup' else 'role'} >> 2  # consumer warpgroup "
      f"{', '.join(map(str, range(NWC)))} (warp-uniform)")
    c("g = lane >> 2")
    c("t2 = (lane & 3) * 2")
    QD = q_double(spec)
    if NONE:
        QCB = 64 * 128
        c(f"q_wg = sb + cw * {64 * D * 2}  # this warpgroup's own [D // 64][64][128 B] Q tile")
    elif QD:
        QCB = 64 * 128  # q_wg, this warpgroup's own [D // 64][64][128 B] tile in the item's Q buffer: per item
    else:
        QCB = BQ * 128
        c(f"q_wg = sb + cw * {64 * 128}  # this warpgroup's 64 rows inside each column block of Q")
    if PP:
        c(f"if cw == {NWC - 1}:")
        with c.indent():
            c("bar_arrive(1, 256)  # warpgroup 0 issues first")
        if NWC > 2:  # the turns rotate: warpgroup cw hands over to cw + 1, the last to 0 (no % at run time)
            c(f"pp_next = cw + 2 if cw < {NWC - 1} else 1  # the next warpgroup's turn barrier")
    c(f"acc = cuda.local.array({D // 2}, np.float32)")
    c(f"sc = cuda.local.array({BK // 2}, np.float32)")
    CM = col_mma(spec)
    if CM:
        _emit_col_block(c, spec, lay["cx"], pack)

    DEFER = epilogue_in_s(spec)
    BULK = bulk_store(spec)
    TMA = tma_store(spec)
    QWG = lay["qwg"]  # a consumer warpgroup's Q tile in a buffer (q_double), bytes
    if TMA:
        c("omap_g = elem_addr(omap, (0,))  # O's tensor map in global memory (tma_store)")
        c("if lane == 0:  # the lanes that store O by it")
        with c.indent():
            c("tensormap_acquire(omap_g)")
        if l2_hints(spec):
            c("o_pol = l2_evict_first()  # O is written once: its lines go first (l2_hints)")

    def zero_acc() -> None:
        c(f"for i in range({D // 2}):")
        with c.indent():
            c("acc[i] = ZERO")

    def zero_state() -> None:
        for t in ROWS:
            c(f"m_{t.k} = NEG_INF")
            c(f"l_{t.k} = ZERO")
        if not DEFER:  # else after the kept epilogue: the item before's last P V is still to add to O
            zero_acc()

    if not PERSIST:
        zero_state()
    c(f"pa = cuda.local.array({BK // 4}, np.uint32)  # P packed: the A words of P V, 4 per k16 step")
    if NONE:
        CH = D // 8
        c("# no producer: each warpgroup loads its own Q rows, then warpgroup 0 streams K, warpgroup 1 V through the")
        c(f"# ring, {S - 1} tile(s) ahead of its use; wgmma never waits on a copy this thread is still issuing")
        c("wtid = ctid & 127")
        c(f"ld_r0 = wtid // {CH}")
        c(f"ld_c = wtid % {CH}")
        c("ld_x = ((ld_c & 7) ^ (ld_r0 & 7)) << 4")
        c(f"l_full = bars + {lay['full_k']} + cw * {8 * S}  # full_k[] for warpgroup 0, full_v[] for 1")
        c(f"l_empty = bars + {lay['empty_k']} + cw * {8 * S}")
        c(f"l_dst0 = sb + {KV} + cw * {T}  # stage 0's K (V)")

        def row_address() -> None:
            c("# this thread's chunk of row 0 of its (b, head) slice of K (V), the bytes a row and between its "
              "rows: a")
            c("# tile inside N then costs an add a copy (the row loads' 64-bit index and bound: ~8 instructions a "
              "copy)")
            c("l_at = elem_addr(k, (kg + ld_r0 * k_sm + ld_c * 8,)) if cw == 0 else elem_addr(v, (vg + ld_r0 * "
              "v_sm + ld_c * 8,))")

        if not PERSIST:  # a persistent kernel's item sets it (item_loads)
            row_address()
        c("l_rb = np.uint64((k_sm if cw == 0 else v_sm) * 2)")
        c(f"l_rs = l_rb * np.uint64({128 // CH})")

        def item_loads() -> None:
            """The item's Q rows of this warpgroup and the first S - 1 tiles of its ring."""
            if PERSIST:
                row_address()
                # a warp's wait returns when its own part of the warpgroup's S is done, and a warp copies Q rows of
                # the other three warps' parts (ld_r0 + 16 i): the whole warpgroup must be past its last S first
                assert NWC == 2, "this barrier's family is laid out for two consumer warpgroups"
                c(f"bar_sync({Q_FREE_BARRIER} + cw, 128)  # every warp of this warpgroup has read the item's Q rows")
                c("if it_ok:  # the previous item's S wgmmas are done: its Q rows are free")
            with c.indent() if PERSIST else contextlib.nullcontext():
                _emit_load(c, 64, 128 // CH, D, "q_wg", "q_lo + cw * 64", "M", "q", "qg", "q_sm")
                c("cp_async_mbar_arrive_noinc(bars + cw * 8)")
            c("lj = kv_first  # the loader's cursor: the next tile to load, its stage and phase")
            if not PERSIST:
                c("lstage = 0")
                c("lphase = 0")
            if spec.block_mask == "list":
                c("lkv_pos = 0")
            ring_loads(early=True)

        def ring_loads(early: bool) -> None:
            """The first S - 1 tiles of this warpgroup's ring: those `early_loads` puts before the wait for Q
            (early), or the rest, right after it."""
            ek, ev = early_loads(spec)
            for i in range(S - 1):
                k_now, v_now = (i < ek) == early, (i < ev) == early
                if k_now and v_now:
                    _emit_loader_step(c, spec, lay, None)
                elif k_now or v_now:
                    c(f"if cw == {0 if k_now else 1}:  # {'K' if k_now else 'V'}_{i} "
                      f"{'before' if early else 'after'} the wait for Q (early_loads)")
                    with c.indent():
                        _emit_loader_step(c, spec, lay, "k" if k_now else "v")
    TT = table_tiles(spec)
    HOIST = row_bounds_read_data(spec)
    PAD = skips_padding_rows(spec)  # the score only for rows below M (decoding's bias table)
    PADS = skips_padding_softmax(spec)  # no softmax for a warp's 8 rows all past M (decoding's tiles)
    LATE = bounds_in_s(spec)
    HALF = half_mode(spec)
    H2 = BK // 2
    EARLY = gather_early(spec)
    RS = row_slice(spec)
    SLR, SLA, SIS = slice_rows(spec), slice_ahead(spec), slice_in_s(spec)
    SPTR = slice_ptrs(spec)
    SLE = slice_edge(spec)
    mask_past_n_fn = c.helper("mask_past_n", [
        "@device_function",
        "def mask_past_n(x, i, kv, N):",
        "    # a row's elements at columns kv + 8 jj (+ 1) at or past N to -inf (slice_edge: masked_score_fn's",
        "    # kv >= N, after score_row_pair_given's scores)",
        f"    for jj in range({BK // 8}):",
        "        e = i + jj * 4",
        "        k = kv + jj * 8",
        "        if k >= N:",
        "            lset(x, e, NEG_INF)",
        "        if k + 1 >= N:",
        "            lset(x, e + 1, NEG_INF)"]) if SLE else ""
    slice_load_fn = c.helper("slice_load", [
        "@device_function",
        "def slice_load(sl_a, e, sl_n, sl_s):",
        "    # a thread's two entries of a tile's run (slice_rows): e and e + 128 from the run's row, clamped into it",
        "    # as gather_slice_fn clamps its index",
        "    e0 = np.uint64(min(max(e, np.int32(0)), sl_n - np.int32(1)))",
        "    e1 = np.uint64(min(max(e + np.int32(128), np.int32(0)), sl_n - np.int32(1)))",
        "    return ldg_f32_a(sl_a + e0 * np.uint64(sl_s)), ldg_f32_a(sl_a + e1 * np.uint64(sl_s))"]) if SLR else ""
    slice_load_rp_fn = c.helper("slice_load_rp", [
        "@device_function",
        "def slice_load_rp(p, u, lane, sl_a, sl_n, sl_s):",
        "    # a thread's two entries of a tile's run (slice_ptrs), u + lane at address p and u + lane + 128: read as",
        "    # they lie where the warpgroup's whole run u .. u + 255 is in the row (one test for its threads), else",
        "    # clamped by slice_load",
        "    if np.uint32(u) < np.uint32(max(np.int32(sl_n - np.int32(255)), np.int32(0))):",
        "        return ldg_f32_a(p), ldg_f32_a(p + np.int64(128) * sl_s)",
        f"    return {slice_load_fn}(sl_a, np.int32(u + lane), sl_n, sl_s)"]) if SPTR else ""
    RP_STEP = slice_ptr_step(spec) if SPTR else None
    RP_K = row_gather_signs(spec)[1] * BK if SPTR else 0  # a tile's move of the run's entries

    def run_loads(j: str) -> str:
        """slice_load's call for the run of visited tile j (its first column's entry: k kv0 past sl_e)."""
        return f"{slice_load_fn}(sl_a, sl_e + {row_gather_signs(spec)[1]} * {tile_at(spec, j)} * {BK}, sl_n, sl_s)"

    def run_ptrs_start() -> None:
        """slice_ptrs' state for the item: the warpgroup's run's first entry rp_u (through redux: ptxas then knows
        it uniform and keeps it in a uniform register) and this thread's entry's address rp_a, at the item's first
        visited tile (slice_ptr_step), or at tile 0 where the tiles' move varies."""
        at = tile_at(spec, "j") if RP_STEP is not None else "0"
        c(f"rp_u = warp_min(np.int32(sl_i + np.int32({slice_start(spec)}) + {RP_K} * {at}))  # the warpgroup's run's "
          "first entry (slice_ptrs)")
        c("rp_a = np.int64(sl_a) + np.int64(rp_u + np.int32(ctid & 127)) * sl_s  # this thread's entry's address, "
          "wherever it lies")
        c(f"rp_st = np.int64({RP_K * (RP_STEP or 1)}) * sl_s  # a tile's move of the address")

    def run_ptr_loads() -> None:
        """Tile j's run by slice_load_rp: at the running entry and address, then both moved on a tile, or at tile
        0's plus tile_at's position times a tile's move."""
        if RP_STEP is not None:
            c(f"sv0, sv1 = {slice_load_rp_fn}(rp_a, rp_u, ctid & 127, sl_a, sl_n, sl_s)")
            c(f"rp_u = np.int32(rp_u + np.int32({RP_K * RP_STEP}))  # the next visited tile's (slice_ptr_step)")
            c("rp_a += rp_st")
            return
        c(f"rp_t = np.int32({tile_at(spec, 'j')})  # the visited tile's position: tiles may be skipped")
        c(f"sv0, sv1 = {slice_load_rp_fn}(rp_a + np.int64(rp_t) * rp_st, np.int32(rp_u + np.int32({RP_K}) * rp_t), "
          "ctid & 127, sl_a, sl_n, sl_s)")

    def item_start(qphase: str) -> Optional[Callable[[str], None]]:
        """Wait for the item's Q; then the per-item state the kv loop reads. Returns the table tile's copy
        (`_emit_table_tile_setup`; not in persistent kernels)."""
        if NONE:
            c(f"mbar_wait(bars + cw * 8, {qphase})  # this warpgroup's Q has landed")
            if not PERSIST:
                ring_loads(early=False)
        elif QD:  # (q_wg, this warpgroup's own Q tile in the item's buffer: made from qk at each tile's S)
            c("mbar_wait(bars + (qk & 1) * 8, (qk >> 1) & 1)  # Q has landed")
        else:
            c(f"mbar_wait(bars, {qphase})  # Q has landed")
        copy = _emit_table_tile_setup(c, spec, lay) if TT else None
        if CM:
            _emit_col_words(c, spec)
        if LATE:  # read in the item's first S's shadow (bounds_in_s); defined on every path for Numba
            for t in ROWS:
                c(f"rb_lo{t.off} = np.int32(0)")
                c(f"rb_hi{t.off} = np.int32(0)")
                c(f"rb_ex{t.off} = False")
        elif HOIST:
            emit_row_bounds(c, spec)
        c("j = kv_first")
        if SLR:
            c(f"sl_a, sl_i, sl_n, sl_s = slice_row_fn(b, h, q_lo + cw * 64, 0{caps})  # the run's row (slice_rows)")
            c(f"sl_e = sl_i + np.int32({slice_start(spec)}) + np.int32(ctid & 127)  # this thread's first entry at "
              "column 0")
            if SPTR:
                run_ptrs_start()
        if SLA:
            c(f"sv0n, sv1n = {run_loads('kv_first')}  # the item's first tile's run")
        if not PERSIST:
            c("stage = 0")
            c("phase = 0")
            c("pstage = 0  # the stage and phase of tile j - 1 (its V is read by P_{j-1} V_{j-1})")
            c("pphase = 0")
        if HALF:
            c("phs = 3  # the halves tile j - 1 kept (read once have_prev)")
        if DEFER:  # the item before's last P V, if any, goes with this item's first tile
            c("fresh = True  # the item's first tile is next")
        else:
            c("have_prev = False")
        return copy

    def kept_epilogue(release_now: bool = False) -> None:
        """The kept item's epilogue (epilogue_in_s), its last P V done: O times the kept 1 / l staged through the
        warpgroup's O buffer and stored to the kept rows. O is not zeroed after it: the item now running starts O
        with its first P V (scale-d 0), and a row with 1 / l = 0 stages zeros whatever O holds. Under `bulk_store`
        each warp stages its own 16 rows and its lane 0 stores them (`tma_store`: swizzled, two tensor copies at
        D = 128; else unswizzled, one bulk copy a row), and the kept item's Q buffer is released once those copies
        have read it (`bulk_release`: here if `release_now`, else at the next tile's S or the item's end)."""
        def stage() -> str:  # a row's words, one STS each (an item with no tile: O = 0, not O's leftovers)
            return stage_row_helper(c, D, pack, zero_masked=True, box_bytes=BOX_BYTES if TMA else 0)

        if QD:  # the kept item is the one before this (qk counts it done)
            c(f"o_wg = sb + ((qk - 1) & 1) * {lay['q1']} + cw * {QWG}  # this warpgroup's own Q tile in "
              "the kept item's buffer")
        else:
            c(f"o_wg = sb + {lay['o']} + cw * {64 * 2 * D}  # this warpgroup's 64 rows of O in shared memory")

        def read_kept_item() -> None:
            c("ep_head = ep_i[cw * 2]  # the kept item's (b, h) slice" + ("" if TMA else "'s first row") +
              ": read before the barrier below, after")
            c("ep_lo = ep_i[cw * 2 + 1]  # which this warpgroup's threads may write the next item's")

        if BULK:  # no barrier after the staging: read before the first
            read_kept_item()
        c(f"bar_sync({EPI} + cw, 128)  # every warp of this warpgroup is done with the last item's O rows")
        if BULK:
            # each warp stages its own 16 rows: by TMA as D / 64 boxes of 16 rows x 128 bytes in the 128-byte swizzle,
            # else unswizzled at `pitch` bytes a row, one bulk copy a row
            wbytes, pitch = 16 * 2 * D, bulk_pitch(D)
            if stmatrix_staging(spec):  # the warp's 16 rows by D / 16 stmatrix
                assert len(ROWS) == 2 and ROWS[0].acc == ROWS[1].acc, ROWS
                stsm = stage_rows_stsm_helper(c, D, pack, BOX_BYTES)
                c(f"{stsm}(o_wg + (warp & 3) * {wbytes}, lane, {ROWS[0].acc}, {ROWS[0].ofs}, {ROWS[1].ofs}, "
                  f"ep_f[ctid * 2 + {ROWS[0].k}], ep_f[ctid * 2 + {ROWS[1].k}])")
            else:
                for t in ROWS:
                    if TMA:
                        c(f"lr = {t.off} + g  # the row in the warp's 16: its boxes' row")
                        c(f"{stage()}(o_wg + (warp & 3) * {wbytes} + lr * 128 + 2 * t2, np.uint32(lr & 7), {t.acc}, "
                          f"{t.ofs}, ep_f[ctid * 2 + {t.k}])")
                    else:
                        c(f"lr = (warp & 3) * 16 + {t.off} + g  # the row in the warpgroup's 64, {pitch} bytes a row")
                        c(f"{stage()}(o_wg + lr * {pitch} + 2 * t2, np.uint32(0), {t.acc}, {t.ofs}, "
                          f"ep_f[ctid * 2 + {t.k}])")
            c("fence_proxy_async()  # the staged rows are visible to the copies (the async proxy)")
            c("syncwarp()  # this warp's 16 rows are staged")
            c("# lane 0 copies the warp's rows; the copies' operands through redux, which ptxas knows are uniform (a")
            c("# copy takes uniform registers: per-lane operands made ptxas loop over the lanes)")
            if TMA:
                c("ob_q = warp_min(np.int32(ep_lo + cw * 64 + (warp & 3) * 16))  # the warp's first row in its slice")
                c("ob_bh = warp_min(np.int32(ep_head))")
                c(f"ob_s = warp_min(np.int32(o_wg + (warp & 3) * {wbytes}))")
            else:
                c("ob_q = ep_lo + cw * 64 + (warp & 3) * 16")
                c("ob_row = warp_min(np.int32(ep_head + ob_q))  # O's row of the warp's first")
                c("ob_n = warp_min(np.int32(min(16, M - ob_q)))  # its rows inside O")
                c(f"ob_s = warp_min(np.int32(o_wg + (warp & 3) * {16 * pitch}))")
            if TMA and spec.ragged_q_first:
                emit_straddling_box(c, D)
            c("if ob_q >= 0 and lane == 0:" if TMA and spec.ragged_q_first else "if lane == 0:")
            with c.indent():
                if TMA:
                    store, pol = ("tma_store_3d_hint", ", o_pol") if l2_hints(spec) else ("tma_store_3d", "")
                    for hb in range(D // 64):
                        c(f"{store}(omap_g, {hb * 64}, ob_q, ob_bh, ob_s + {hb * BOX_BYTES}{pol})  # rows past M are "
                          "not written")
                else:
                    c("ob_g = elem_addr(o, (ob_row * " + str(D // 2) + ",))")
                    for head, rows in (("if ob_n == 16:  # every row inside O: 16 copies, unrolled, no predicates",
                                        "16"), ("else:  # O's last rows", "ob_n")):
                        c(head)
                        with c.indent():
                            c(f"for r in range({rows}):")
                            with c.indent():
                                c(f"bulk_store(ob_g + np.uint64(r * {2 * D}), ob_s + r * {pitch}, {2 * D})")
                c("bulk_commit()")
            c("ob_pend = True")
            if release_now:
                bulk_release()
            c("ep_pend = False")
            return
        read_kept_item()
        for t in ROWS:
            c(f"lr = (warp & 3) * 16 + {t.off} + g  # the row in the warpgroup's 64")
            c(f"{stage()}(o_wg + lr * {2 * D} + 2 * t2, np.uint32(lr & 7), {t.acc}, {t.ofs}, ep_f[ctid * 2 + {t.k}])")
        c(f"bar_sync({EPI} + cw, 128)  # the warpgroup's rows are in shared memory")
        emit_staged_stores(c, D, 64, "ep_lo + cw * 64", "ctid & 127", "o_wg", head="ep_head")
        if QD:
            c(f"mbar_arrive(bars + {lay['q_empty']} + ((qk - 1) & 1) * 8)  # this thread is done with the kept "
              "item's Q buffer: the producer may load an item into it")
        c("ep_pend = False")

    def bulk_release() -> None:
        """`bulk_store`: once this warp's bulk copies of the kept item's O have read their rows, every thread
        releases the kept item's Q buffer (its q_empty barrier) to the producer."""
        c("if ob_pend:  # the kept item's O is in flight to global memory from its Q buffer")
        with c.indent():
            c("bulk_wait_read0()  # this thread's bulk copies have read shared memory (none: at once)")
            c("syncwarp()  # ... and every lane's of this warp")
            c(f"mbar_arrive(bars + {lay['q_empty']} + ((qk - 1) & 1) * 8)  # the producer may load an item into "
              "the kept item's Q buffer")
            c("ob_pend = False")

    def pv(vbase: str) -> None:
        """O += P_{j-1} V_{j-1}; with half tiles only the k steps of the halves tile j - 1 kept (phs)."""
        if not HALF:
            _emit_pv(c, KK, D, vbase, scale_d="pv_sd" if DEFER else "")
            return
        c("if phs == 3:")
        with c.indent():
            _emit_pv(c, KK, D, vbase)
        for hv in (2, 1):
            c(f"elif phs == {hv}:" if hv == 2 else "else:")
            with c.indent():
                _emit_pv(c, KK, D, vbase, steps=range((hv - 1) * KK // 2, hv * KK // 2), name=f"pv_half{hv - 1}")

    def last_pv() -> None:
        c("if have_prev:  # the last tile's P V")
        with c.indent():
            c(f"mbar_wait(bars + {lay['full_v']} + pstage * 8, pphase)")
            c("fence_proxy_async()")
            c(f"pv_base = sb + {KV + T} + pstage * {2 * T}")
            pv("pv_base")
            c("WAIT_O(acc, 0)")
            if PERSIST:  # the ring goes on into the next item: its loader will refill this stage
                c(f"mbar_arrive(bars + {lay['empty_v']} + pstage * 8)  # this thread is done with the last V")

    if PERSIST and not NONE:
        # a producer warpgroup loads every item's Q and tiles, running ahead across items: the consumers take the
        # items one after another, and free Q for the next item once both warpgroups are past their last S
        c("stage = 0  # the ring's stage and phase carry from item to item: the producer runs ahead across them")
        c("phase = 0")
        c("pstage = 0")
        c("pphase = 0")
        c("qk = 0  # the items done: item qk's Q in buffer qk & 1 (q_double)" if QD else "qphase = 0")
        for t in ROWS:  # defined on every path (Numba's bytecode analysis asks it)
            c(f"m_{t.k} = NEG_INF")
            c(f"l_{t.k} = ZERO")
        if RS:
            c("sl_par = 0  # which of the warpgroup's two runs of the table the next tile writes (row_slice)")
        if DEFER:
            c("ep_pend = False  # an item's last P V and epilogue wait for the next item's first tile (epilogue_in_s)")
            c("have_prev = False  # a P V to issue with the next S: carried from item to item")
            c("pv_sd = 1  # that P V's first k step adds to O (1) or starts it (0)")
            if BULK:
                c("ob_pend = False  # the kept item's O is being stored from its Q buffer (bulk_store)")
            zero_acc()
        _emit_item_loop_start(c, spec, item_state, lay)
        zero_state()

        def flush_at_empty_item() -> None:
            c("if ep_pend and kv_last < kv_first:  # no kv tile here to carry the item before's last P V")
            with c.indent():
                last_pv()
                c("have_prev = False")
                kept_epilogue(release_now=True)

        if DEFER and not QD:
            flush_at_empty_item()
        copy = item_start("qphase")
        if DEFER and QD:  # after the item's Q, as the simulator ran it (conservative: the buffer this frees lets
            # the producer hand over ticket qk + 1 into ticket qk - 1's slot, whose every reader has already waited
            # for it, the producer threads before their copies of Q(qk - 1); the phase aliasing the simulator found
            # came from one item_full barrier for both slots, now one a slot)
            flush_at_empty_item()
    elif PERSIST:
        c("stage = 0  # the ring's stage and phase carry from item to item: the loader runs ahead across them")
        c("phase = 0")
        c("lstage = 0")
        c("lphase = 0")
        c("pstage = 0")
        c("pphase = 0")
        c("qphase = 0")
        c("have_prev = False")
        c("cur_ok = False  # an item is in flight: its last P V and epilogue are still to do")
        c("eq_head = 0")
        c("eq_lo = 0")
        for t in ROWS:  # defined on every path into the epilogue (Numba's bytecode analysis asks it)
            c(f"m_{t.k} = NEG_INF")
            c(f"l_{t.k} = ZERO")
        emit_persistent_start(c, spec)
        c("while True:")
        c.level += 1
        c("# the next item's state, Q and first tiles, issued before this item's last P V and epilogue")
        item_state(c)
        c("if not it_ok:")
        with c.indent():
            c("kv_last = kv_first - 1  # nothing to load")
        item_loads()
        c("if cur_ok:")
        with c.indent():
            last_pv()
            # the item's rows: q_head / q_lo already hold the next item's
            _emit_epilogue(c, D, [t._replace(row=t.row.replace("q_lo", "eq_lo")) for t in ROWS], head="eq_head")
        c("if not it_ok:")
        with c.indent():
            c("break")
        c("cur_ok = True")
        emit_persistent_next(c, spec)
        zero_state()
        copy = item_start("qphase")
        c("qphase ^= 1")
    else:
        if NONE:
            item_loads()
        copy = item_start("0")
        if HALF:
            _emit_row_hull(c, spec)
    if spec.block_mask == "list":  # the next entry loaded a tile ahead: no list load waits at the loop's top
        _emit_list_ahead(c, spec, head=list_head_shared(spec))
    c("while j <= kv_last:")
    with c.indent():
        if spec.block_mask == "list":
            _emit_next_tile(c, spec, "j", "jn", ahead=True)
        else:
            _emit_next(c, spec, "j", "jn")
        if TT:
            c("if not tile_on:")
            with c.indent():
                _emit_score_prefetch(c, spec, "jn")
        elif not RS:  # (a run of the table is two loads a thread, issued below ahead of the waits)
            _emit_score_prefetch(c, spec, "jn")
        c(f"k_base = sb + {KV} + stage * {2 * T}")
        if QD:  # from the item count each tile: held across the item it cost the document's consumers spills
            c(f"q_wg = sb + (qk & 1) * {lay['q1']} + cw * {QWG}  # this warpgroup's own Q tile in the item's "
              "buffer")
        c(f"pv_base = sb + {KV + T} + pstage * {2 * T}")
        if RS:
            c("# this warpgroup's run of the table for the tile (row_slice), two entries a thread, loaded before the")
            c("# waits for K and S and stored " + ("while S is in flight (slice_in_s)" if SIS else "once S is done"))
            if SLA:  # loaded a tile ahead: this tile's came with the last one (or the item's start)
                c("sv0 = sv0n")
                c("sv1 = sv1n")
                c(f"sv0n, sv1n = {run_loads('min(jn, kv_last)')}  # the next tile's")
            elif SPTR:
                run_ptr_loads()
            elif SLR:
                c(f"sv0, sv1 = {run_loads('j')}")
            else:
                for n in (0, 1):
                    c(f"sv{n} = gather_slice_fn(b, h, q_lo + cw * 64, {tile_at(spec, 'j')} * {BK}, "
                      f"{slice_start(spec) + 128 * n} + (ctid & 127){caps})")
        elif EARLY:
            c("# the score's table entries for this tile, read before the waits for K and S: their latency (an L2")
            c("# read a tile: its columns move on by 128) runs beside the products, not in the softmax's turn")
            c(f"gl = score_pair_load(b, h, {ROWS[0].row}, {tile_at(spec, 'j')} * {BK} + t2{caps})")
        c(f"mbar_wait(bars + {lay['full_k']} + stage * 8, phase)  # K_j has landed")
        c("if have_prev:")
        with c.indent():
            c(f"mbar_wait(bars + {lay['full_v']} + pstage * 8, pphase)  # V_(j-1) has landed")
        c("fence_proxy_async()  # the copies are visible to wgmma's async proxy")
        if PP:
            c("bar_sync(1 + cw, 256)  # this warpgroup's turn on the tensor cores")
        c(f"# S = Q K^T: {KS} wgmma m64n{BK}k16; k step s reads 16 columns: block s // 4, byte 32 * (s % 4)")

        def qk_lines(name: str, fence: str, parts: tuple[tuple[str, int, int], ...], note: tuple[str, ...] = ()
                     ) -> list[str]:
            """The device function `name`: S's wgmmas, one k step a call, for each part (the wgmma, its first
            accumulator, its first kv row: K's rows at row0 x 128 bytes on in each column block), then commit."""
            out = ["@device_function", f"def {name}(sc, q_wg, dk{', cx_w, cx_d' if CM else ''}):", *note,
                   f"    {fence}"]
            for wg, acc0, row0 in parts:
                for ks in range(KS):
                    qa = f"q_wg + {(ks // 4) * QCB + (ks % 4) * 32}"
                    ka = ((ks // 4) * BK * 128 + row0 * 128 + (ks % 4) * 32) >> 4
                    out.append(f"    {wg}(sc, {acc0}, make_desc(HI_QK, {qa}), desc_at(HI_QK, dk + {ka}), "
                               f"{0 if ks == 0 else 1})")
                if CM:  # the column term: A from registers (every row w's parts), B K's extra block (col_mma)
                    out.append(f"    WG_SX(sc, {acc0}, cx_w, cx_w, np.uint32(0), np.uint32(0), "
                               f"desc_at(HI_QK, cx_d + {(row0 * 128) >> 4}), 1)")
            return out + ["    wgmma_commit()"]

        qk = c.helper('qk_wgmma', qk_lines("qk_wgmma", "FENCE_S(sc, 0)", (("WG_S", 0, 0),)))

        def slice_store() -> None:
            """The warpgroup's run of the table for tile j into shared memory (row_slice): after S's wait, or in its
            shadow (slice_in_s)."""
            c(f"sla = (cw * 2 + sl_par) * {slice_stride(spec)}  # this tile's buffer of the warpgroup's two")
            c("rsl[np.uint32(sla + (ctid & 127))] = sv0")
            c("rsl[np.uint32(sla + 128 + (ctid & 127))] = sv1")
            if slice_pairs(spec):
                c(f"rsl[np.uint32(sla + {SLICE_SHIFTED + 1} + (ctid & 127))] = sv0  # the copy shifted by one "
                  "(slice_pairs)")
                c(f"rsl[np.uint32(sla + {SLICE_SHIFTED + 1 + 128} + (ctid & 127))] = sv1")
            c(f"bar_sync({slice_barrier(spec)} + cw, 128)  # the warpgroup's run of the table is in shared memory")
            c("sl_par ^= 1")

        def slice_read() -> None:
            """The thread's 34 entries out of the run, after S's wait: read in its shadow they were 34 more registers
            live beside S, O and P, and the consumers spilled (sass_local.py)."""
            _, lo_off = pair_slice_offsets(spec)
            a, k = row_gather_signs(spec)
            c(f"# the thread's least entry: row (warp & 3) 16 + g of the warpgroup's, column t2 (a = {a}, k = {k})")
            base = f"sla + {a} * ((warp & 3) * 16 + g) + {k} * t2 + {lo_off - slice_start(spec)}"
            if not slice_pairs(spec):
                c(f"gl = score_pair_slice(rsl, {base})")
                return
            c(f"sl_b = {base}")
            c(f"sl_b += ((sl_b + {pair_slice_starts(spec)[1]}) & 1) * {SLICE_SHIFTED + 1}  # its pairs start odd: "
              "the shifted copy's (slice_pairs)")
            c("gl = score_pair_slice2(rsl_s + np.uint32(sl_b * 4))")

        def issue_and_wait(call: str, wait: str, wait1: str, ofs: int) -> None:
            """S's issue (`call`), the P V of tile j - 1 beside it, and the wait for S (`wait` / `wait1`, on the
            accumulators at sc[ofs:]); the table's run stored before the wait under slice_in_s."""
            c(call)
            c("# one branch from the P V issue to the wait for S: split in two, ptxas sees a path where S is still "
              "in")
            c("# flight while the softmax writes its registers, and serializes every wgmma (C7513)")
            c("if have_prev:")
            with c.indent():
                c("# O += P_{j-1} V_{j-1} runs while this tile's softmax does")
                pv("pv_base")
                if PP:
                    c(f"bar_arrive({TURN_NEXT}, 256)  # the {'other' if NWC == 2 else 'next'} warpgroup's turn")
                if LATE and DEFER:  # the item's first tile carries the item before's last P V (epilogue_in_s)
                    c("if fresh:  # the item's first tile: its rows' bounds read while S is in flight")
                    with c.indent():
                        emit_row_bounds(c, spec, raw="_raw")
                if SIS:
                    slice_store()
                c(f"{wait1}(sc, {ofs})")
            c("else:")
            with c.indent():
                if PP:
                    c(f"bar_arrive({TURN_NEXT}, 256)")
                if LATE:
                    c("# the item's first tile: its rows' bounds read while S is in flight (bounds_in_s)")
                    emit_row_bounds(c, spec, raw="_raw")
                if SIS:
                    slice_store()
                c(f"{wait}(sc, {ofs})")

        full = f"{qk}(sc, q_wg, desc_word(HI_QK, k_base){', cx_w, cx_d' if CM else ''})"
        if HALF:
            c(f"kv0h = j * {BK}")
            c(f"hs = (1 if kv0h < hw_hi and kv0h + {H2} > hw_lo else 0) | (2 if kv0h + {H2} < hw_hi and kv0h + {BK} > "
              f"hw_lo else 0)  # the halves of tile j this warpgroup's rows keep")
            c("if hs == 0:")
            with c.indent():
                c("hs = 1  # no row here keeps tile j: one half, all masked (its P V adds zero)")
        if HALF != "s":
            issue_and_wait(f"{full}  # one device function: 8 call sites of 64 accumulators; K's descriptors a word "
                           "plus offset >> 4", "WAIT_S", "WAIT_S1", 0)
        else:
            def half_lines(name: str, halves: tuple[int, ...], fence: str) -> list[str]:
                note = (f"    # S's columns of half {' and '.join(map(str, halves))}: m64n{H2}k16 on K's rows there "
                        f"({H2} x 128 bytes on in each column block)",)
                return qk_lines(name, fence, tuple(("WG_SH", h * H2 // 2, h * H2) for h in halves), note)

            c(f"# each path issues S and waits for it itself, and a whole tile is two m64n{H2} halves: a path that")
            c(f"# issued one shape and waited on another's registers, or m64n{BK} beside m64n{H2} on S at all, made")
            c("# ptxas serialize every wgmma (C7511 / C7515)")
            c("if hs == 3:")
            with c.indent():
                both = c.helper("qk_halves", half_lines("qk_halves", (0, 1), "FENCE_S(sc, 0)"))
                issue_and_wait(f"{both}(sc, q_wg, desc_word(HI_QK, k_base))", "WAIT_S", "WAIT_S1", 0)
            for hv in (2, 1):
                half = hv - 1
                fn = c.helper(f"qk_half{half}", half_lines(f"qk_half{half}", (half,),
                                                           f"FENCE_SH(sc, {half * H2 // 2})"))
                c(f"elif hs == {hv}:" if hv == 2 else "else:")
                with c.indent():
                    issue_and_wait(f"{fn}(sc, q_wg, desc_word(HI_QK, k_base))", "WAIT_SH", "WAIT_SH1", half * H2 // 2)
        c(f"mbar_arrive(bars + {lay['empty_k']} + stage * 8)  # this thread is done with K_j")
        if BULK:  # the kept item's O went out a tile ago: its bulk copies have long read their rows
            bulk_release()
        if NONE:
            c(f"if cw == 0:  # K_(j + {S - 1}) into K_(j - 1)'s stage: warpgroup 1 released it when its S_(j-1) was "
              "done, before this S_j")
            with c.indent():
                _emit_loader_step(c, spec, lay, "k")
        c()
        if RS:
            if not SIS:
                slice_store()
            slice_read()
        _emit_need_mask(c, spec, tile_at(spec, "j"))
        if HALF:
            c("if hs != 3:")
            with c.indent():
                c("need_mask = True  # the skipped half's scores (stale registers, or S) to -inf: its P is 0")
        c("# scores (log2 domain); mask arithmetic only on partial or ragged tiles")
        if TT:
            c("if tile_on:")
            with c.indent():
                c("mbar_wait(t_full, tphase)  # this warpgroup's rows of the table tile have landed")
                c("tphase ^= 1")
        def score_rows(fn: str, tail: str = "") -> None:
            """The thread's two rows of S through `fn`; `tail` adds arguments after N (per row, {r}: its offset)."""
            if fn == "score_row":
                for line in score_row_calls(spec, ROWS, given="gl" if EARLY else "", below_m=PAD):
                    c(line)
                return
            for t in ROWS:
                c(f"{fn}({t.sc}, {t.ofs}, b, h, {t.row}, kv0 + t2, N{caps}{tail.format(r=t.off)})")

        table_row = (f", t_wg + np.uint32(((warp & 3) * 16 + {{r}} + g) * {BK * 4}), "
                     f"np.uint32(((g & 3) << 1) & {BK // 4 - 1})")  # the row in the table tile, its swizzle
        c("if need_mask:")
        with c.indent():
            if SLE:  # the run's entries (gl), then kv >= N to -inf: no per-element gathers (slice_edge)
                calls = score_row_calls(spec, ROWS, given="gl")
                assert len(calls) == 1 and calls[0].startswith("score_row_pair_given("), calls
                c(calls[0] + "  # the boundary tile's entries from the run (slice_edge)")
                for t in ROWS:
                    c(f"{mask_past_n_fn}({t.sc}, {t.ofs}, kv0 + t2, N)")
            else:
                emit_masked_rows(c, spec, HOIST, below_m=PAD)
        c("else:")
        with c.indent():
            if TT:
                c("if tile_on:")
                with c.indent():
                    score_rows("score_row_tile", table_row)
                c("else:")
                with c.indent():
                    score_rows("score_row")
            else:
                score_rows("score_row")
        if TT:
            c("if tile_on:")
            with c.indent():
                assert NWC == 2, "this barrier's family is laid out for two consumer warpgroups"
                c("bar_sync(3 + cw, 128)  # the warpgroup has read the tile: refill it with the next one's rows")
                c("if jn <= kv_last:")
                with c.indent():
                    copy("jn")
                c("cp_async_mbar_arrive_noinc(t_full)")
        c("# online softmax: new row max (quad shuffles), exponentiate; then rescale O")
        if PADS:
            assert len(ROWS) == 2 and NWC == 1, ROWS
            clear = c.helper("clear_row", [
                "@device_function", "def clear_row(x, i):", "    # P of rows past M: zeros (their S may hold -inf)",
                f"    for jj in range({BK // 8}):", "        lset(x, i + jj * 4, ZERO)",
                "        lset(x, i + jj * 4 + 1, ZERO)"])
        for t in ROWS:
            kv = "kv0" if CM else "kv0 + t2"  # col_mma: S holds the column term from the tile's first column on
            if PADS:  # the warp's 8 rows of this half: q_lo + 16 warp + off + g, g = 0 .. 7
                c(f"if q_lo + warp * 16 + {t.off} <= q_hi and q_lo + warp * 16 + {t.off + 7} >= 0:  # a row of the "
                  "warp's 8 is below M (skips_padding_softmax)")
            with c.indent() if PADS else contextlib.nullcontext():
                c(f"m_{t.k}, alpha_{t.k}, rs = {softmax_call(spec, t.sc, t.ofs, f'm_{t.k}', t.row, kv)}")
                c(f"l_{t.k} = l_{t.k} * alpha_{t.k} + rs")
            if PADS:
                c("else:  # all 8 rows padding: no exponentials, O kept (alpha 1), P zero")
                with c.indent():
                    c(f"alpha_{t.k} = ONE")
                    c(f"{clear}({t.sc}, {t.ofs})")
        c("# the wait for P_{j-1} V_{j-1} on every path, not under `if have_prev`: ptxas cannot tie this branch to")
        c("# the one that issued it, sees a path where O += P V is in flight while scale_row writes O and the pack")
        c("# below writes P (both inputs of that wgmma), and serializes every wgmma (C7513, and C7517: a wait it")
        c("# injects itself); with nothing committed the wait returns at once")
        c("WAIT_O(acc, 0)  # P_{j-1} V_{j-1} is done: O can be rescaled, the P registers reused")
        c("if have_prev:")
        with c.indent():
            c(f"mbar_arrive(bars + {lay['empty_v']} + pstage * 8)  # this thread is done with V_(j-1)")
        if NONE:
            c(f"if cw == 1:  # V_(j + {S - 1}) into V_(j - 1)'s stage: warpgroup 0, a turn ahead, has released it")
            with c.indent():
                _emit_loader_step(c, spec, lay, "v")
        if DEFER:  # P first: S is then dead, and the kept epilogue has O beside P's registers only
            c("# P to 16-bit pairs: n8 tiles 2k, 2k + 1 of S are the A fragment of k step k")
            c(f"{_pack_pa_helper(c, KK, pack)}(pa, sc)")
            c("pv_sd = 0 if fresh else 1  # the item's first P V starts O from zero (wgmma's scale-d): O")
            c("# is not zeroed at the item's start, where the item before's last P V may still be adding to it")
            c("if ep_pend:  # the item before's epilogue: its last P V ran beside this tile's S (epilogue_in_s)")
            with c.indent():
                kept_epilogue()
        for t in ROWS:
            c(f"scale_row({t.acc}, {t.ofs}, alpha_{t.k})")
        if not DEFER:
            c("# P to 16-bit pairs: n8 tiles 2k, 2k + 1 of S are the A fragment of k step k")
            c(f"{_pack_pa_helper(c, KK, pack)}(pa, sc)")
        c("have_prev = True")
        if DEFER:
            c("fresh = False")
        if HALF:
            c("phs = hs")
        c("pstage = stage")
        c("pphase = phase")
        c("j = jn")
        _emit_next_stage(c, S)
    if PERSIST and not NONE:
        if QD:  # its Q buffer is freed after its epilogue, whose O is staged there
            c("# this thread is past the item's last S")
        else:
            c(f"mbar_arrive(bars + {lay['q_empty']})  # this thread is past the item's last S: the producer may "
              "refill Q")
        if DEFER:
            c("# the last P V and O's epilogue go with the next item's first tile (epilogue_in_s): the LSE now, 1 / l")
            c("# and the item's rows kept in shared memory; P's registers and the V stage (pstage) carry over")
            for t in ROWS:
                _emit_row_inv(c, t.k)
                c(f"qi = {t.row}")
                c("if 0 <= qi < M and t2 == 0:  # rows before 0 (ragged_q_first) and past M: padding")
                with c.indent():
                    c(_lse_line(t.k, "q_head"))
                c(f"ep_f[ctid * 2 + {t.k}] = inv")
            c((f"ep_i[cw * 2] = {'(kvp * B + b)' if spec.kv_parts > 1 else 'b'} * H + h  # O's (b, h) slice for its "
               "map (tma_store); " if TMA else
               "ep_i[cw * 2] = q_head  # ") + "every thread of the warpgroup writes the same")
            c("ep_i[cw * 2 + 1] = q_lo")
            if BULK:  # an item of one tile: its kept epilogue's copies are still in flight
                bulk_release()
            c("ep_pend = True")
            c("qk += 1" if QD else "qphase ^= 1")
            _emit_item_loop_end(c, spec)
            c("if ep_pend:  # the block's last item")
            with c.indent():
                last_pv()
                kept_epilogue(release_now=True)  # no thread leaves with its bulk copies still reading
            return
        last_pv()
        c()
        if QD:  # through the warpgroup's own Q tile, then that Q buffer is free
            c(f"q_wg = sb + (qk & 1) * {lay['q1']} + cw * {QWG}  # this warpgroup's own Q tile in the item's buffer "
              "(set again: an item with no kv tile never ran the loop that sets it)")
            _emit_staged_epilogue(c, D, pack, wgmma_thread_rows(), 64, "q_lo + cw * 64", "ctid & 127",
                                  f"bar_sync({EPI} + cw, 128)  # the warpgroup's rows are in shared memory",
                                  f"bar_sync({EPI} + cw, 128)  # every warp of this warpgroup is past its last S: "
                                  "its Q tile is free",
                                  lse_shared="cl_lse[cw * 64 + lr]" if cluster_merge(spec) else "")
            if cluster_push(spec):  # the staged rows leave this buffer for the blocks that merge them
                _emit_cluster_push(c, spec, lay)
            elif cluster_merge(spec):  # the cluster reads the staged rows out of this buffer first
                _emit_cluster_merge(c, spec)
            c(f"mbar_arrive(bars + {lay['q_empty']} + (qk & 1) * 8)  # this thread is done with the item's Q "
              "buffer: the producer may load an item into it")
            if fused_merge(spec) and not cluster_merge(spec):
                _emit_fused_merge(c, spec, EPI)
        elif staged_epilogue(spec):  # through the warpgroup's own O buffer: the producer is refilling Q
            c(f"o_wg = sb + {lay['o']} + cw * {64 * 2 * D}  # this warpgroup's 64 rows of O in shared memory")
            _emit_staged_epilogue(c, D, pack, wgmma_thread_rows(), 64, "q_lo + cw * 64", "ctid & 127",
                                  f"bar_sync({EPI} + cw, 128)  # the warpgroup's rows are in shared memory",
                                  f"bar_sync({EPI} + cw, 128)  # every warp of this warpgroup is done with the last "
                                  "item's O rows", base="o_wg")
        else:
            _emit_epilogue(c, D)
        c("qk += 1" if QD else "qphase ^= 1")
        _emit_item_loop_end(c, spec)
        return
    if PERSIST:
        c("eq_head = q_head  # the item's output rows, for its epilogue after the next item's loads")
        c("eq_lo = q_lo")
        c.level -= 1
        c("cp_async_wait0()  # every copy was waited for through its full barrier; leave none in flight")
        return
    last_pv()
    if NONE:
        c("cp_async_wait0()  # every copy was waited for through its full barrier; leave none in flight")
    c()
    if staged_epilogue(spec):
        _emit_staged_epilogue(c, D, pack, wgmma_thread_rows(), 64, "q_lo + cw * 64", "ctid & 127",
                              f"bar_sync({EPI} + cw, 128)  # the warpgroup's rows are in shared memory",
                              f"bar_sync({EPI} + cw, 128)  # every warp of this warpgroup is past its last S: its Q "
                              "tile is free")
    else:
        _emit_epilogue(c, D)


def _emit_kv_share(c: _Code, spec: FA2ForwardSpec) -> None:
    """split-kv's share of the item's kv range (passes/split_kv.py `_share`): part kvp of P takes tiles
    kv_first + floor(kvp n / P) to kv_first + floor((kvp + 1) n / P) - 1 of its q tile's n = kv_last - kv_first + 1
    (none where that is empty: the item then stores O = 0 and LSE = -inf, weight 0 in the merge). The full tiles
    (kf_first, kf_last) stay the q tile's: a tile's class is where it lies, whichever part visits it."""
    sh = spec.kv_parts.bit_length() - 1
    c("kv_cnt = max(kv_last - kv_first + 1, 0)  # the q tile's kv tiles, in P shares (split-kv)")
    c(f"kv_last = kv_first + (((kvp + 1) * kv_cnt) >> {sh}) - 1")
    c(f"kv_first = kv_first + ((kvp * kv_cnt) >> {sh})")


def split_refusals(spec: FA2ForwardSpec) -> list[str]:
    """What split-kv's parts (spec.kv_parts > 1) need of this kernel and the spec lacks: the persistent producer
    warpgroup kernel (its items decode the part: `_grid_axes`), no mask or a static one (a block list's or table's
    items are read per (b, h, q tile) elsewhere), a power of two parts (the decode and the shares by shifts: a
    64-bit division is a call, which serializes every wgmma)."""
    P = spec.kv_parts
    return [w for w, bad in [
        ("a persistent kernel with a producer warpgroup", not (persistent(spec) and producer(spec) == "warpgroup")),
        (f"no mask or a static one (got {spec.block_mask})", spec.block_mask not in ("none", "static")),
        (f"a power of two parts, at most {KV_PARTS_MAX} (got {P})", P & (P - 1) or P > KV_PARTS_MAX)] if bad] \
        if P > 1 else []


def _emit_kernel(spec: FA2ForwardSpec) -> str:
    D, BQ, BK, G, S = spec.head_dim, spec.block_q, spec.block_k, spec.group_size, stages(spec)
    NJ, ND = BK // 8, D // 8
    mma = "mma_f16" if spec.dtype == "f16" else "mma_bf16"
    pack = "pack_f16x2" if spec.dtype == "f16" else "pack_bf16x2"
    lay = _layout(spec)
    threads = threads_per_block(spec)
    consumers = threads - producer_threads(spec)
    p_regs, c_regs = registers(spec)
    WARP = producer(spec) == "warp"
    NONE = producer(spec) == "none"

    c = _Code()
    c(f'WG_S = wgmma_ss("{spec.dtype}", {BK})  # S = Q K^T: both operands K-major in shared memory')
    c(f'WG_O = wgmma_rs("{spec.dtype}", {D}, 1)  # O += P V: P in registers, V MN-major (trans-b)')
    if col_mma(spec):
        c(f'WG_SX = wgmma_rs("{spec.dtype}", {BK})  # S\'s column term (col_mma): A from registers, K\'s extra block')
    if half_mode(spec) == "s":
        c(f'WG_SH = wgmma_ss("{spec.dtype}", {BK // 2})  # half of S (half_tiles): m64n{BK // 2}')
        c(f"FENCE_SH = wgmma_fence_regs({BK // 4})")
        c(f"WAIT_SH = wgmma_wait_regs(0, {BK // 4})")
        c(f"WAIT_SH1 = wgmma_wait_regs(1, {BK // 4})")
    c(f"FENCE_S = wgmma_fence_regs({BK // 2})")
    c(f"WAIT_S = wgmma_wait_regs(0, {BK // 2})")
    c(f"WAIT_S1 = wgmma_wait_regs(1, {BK // 2})  # S done, the P V issued after it may still run")
    c(f"FENCE_O = wgmma_fence_regs({D // 2})")
    c(f"WAIT_O = wgmma_wait_regs(0, {D // 2})")
    c("HI_QK = desc_hi(16, 1024)  # K-major: 8-row groups 1024 bytes apart")
    c(f"HI_V = desc_hi({BK * 128}, 1024)  # MN-major: 64-column blocks {BK * 128} bytes apart, 8-row groups 1024")
    if uses_setmaxnreg(spec):
        c(f"SETMAXNREG_DEC = setmaxnreg_dec({p_regs})")
        c(f"SETMAXNREG_INC = setmaxnreg_inc({c_regs})")
    c()
    emit_masked_score(c, spec)
    emit_fragment_helpers(c, spec, NJ, ND, mma, pack, col_in_s=col_mma(spec))
    c("@kernel_jit")
    if WARP:  # -maxrregcount, no launch bounds: the same 168 (see MAX_REGS_WARP), and no .maxntid to require
        c(f"@max_registers({MAX_REGS_WARP})  # {threads} threads ({-(-threads // 128) * 4} warps' worth: groups of 4) x "
          f"{MAX_REGS_WARP} registers fit the SM's 65536")
    elif NONE:
        c(f"# {threads} threads: no register cap needed, 8 warps x 32 x 255 registers fit the SM's 65536")
    else:
        c(f"@launch_bounds({threads}, {blocks_per_sm(spec)})  # .maxntid (setmaxnreg needs it): every thread "
          f"starts at {(REGISTER_FILE // blocks_per_sm(spec) // threads) // 8 * 8} registers")
    c(f"def {spec.name}({_signature(spec)}):")
    with c.indent():
        c(f'"""FA forward on wgmma, warp-specialized: D={D}, block {BQ}x{BK}, 1 producer + {BQ // 64} consumer '
          f'warpgroups, {S} stages, {spec.dtype}."""'.replace(
              "1 producer +", "no producer (the consumers load)," if NONE else f"a producer {producer(spec)} +"))
        c("smem = cuda.shared.array(0, SMEM_DTYPE)")
        if epilogue_in_s(spec):
            c(f"ep_f = cuda.shared.array({kept_f32(spec)}, np.float32)  # a consumer thread's kept 1 / l, a row "
              "each (epilogue_in_s)")
            c(f"ep_i = cuda.shared.array({kept_i64(spec)}, np.int64)  # a consumer warpgroup's kept item: q_head, "
              "q_lo")
        if row_slice(spec):
            pairs = slice_pairs(spec)
            c(f"rsl = cuda.shared.array({slice_bytes(spec) // 4}, np.float32{', alignment=8' if pairs else ''})  # "
              "the consumer warpgroups' runs of the table, two each (row_slice)"
              + (", with their shifted copies (slice_pairs)" if pairs else ""))
        if cluster_merge(spec):
            c(f"cl_lse = cuda.shared.array({64 * consumer_wgs(spec)}, np.float32)  # the part's LSE of each row "
              "(cluster_merge)")
        if cluster_push(spec):
            c(f"cl_rl = cuda.shared.array({64 * consumer_wgs(spec)}, np.float32)  # the parts' LSEs of the rows "
              "this block merges, pushed (cluster_push)")
            c(f"cl_bar = cuda.shared.array({consumer_wgs(spec)}, np.int64)  # each consumer warpgroup's barrier of "
              "those pushes")
        elif fused_merge(spec):
            c(f"fm = cuda.shared.array({consumer_wgs(spec)}, np.int32)  # each consumer warpgroup's count of its "
              "rows' parts (fused_merge)")
        if uses_work_counter(spec):
            c(f"tick = cuda.shared.array({tick_words(spec)}, np.int32)  # the items' tickets "
              "from the producer (item_order dynamic)" + (", then their list heads" if list_head_shared(spec) else ""))
        c("sb0 = smem_base(smem)")
        c(f"sb = sb0 + (({ALIGN} - (sb0 & {ALIGN - 1})) & {ALIGN - 1})  # 1024-byte aligned base")
        if slice_pairs(spec):
            c("rsl_s = smem_base(rsl)  # the runs' shared byte address (slice_pairs' 8-byte loads)")
        if cluster_merge(spec):
            c("cl_lse_s = smem_base(cl_lse)  # its shared byte address (the same in every block of the cluster)")
        if cluster_push(spec):
            c("cl_rl_s = smem_base(cl_rl)  # (the same in every block of the cluster)")
            c("cl_bar_s = smem_base(cl_bar)")
        c("tid = cuda.threadIdx.x")
        c("__OFFSETS__")
        c(f"nq = (M + {BQ - 1}) // {BQ}")

        def item_state(c: _Code) -> None:
            if persistent(spec):
                emit_persistent_index(c, spec)
            else:
                emit_program_index(c, spec)
            c(f"hk = h // {G}" if G > 1 else "hk = h")
            if spec.kv_parts > 1:  # O and LSE of the part: workspaces [P B, H, M, D] and [P B, H, M]
                c("q_head = ((kvp * B + b) * H + h) * M  # the part's slice of the workspaces (split-kv)")
            else:
                c("q_head = (b * H + h) * M")
            emit_bases(c)
            _emit_tile_range(c, spec, uniform=True, head=list_head_shared(spec), shared=range_shared(spec))
            if spec.kv_parts > 1:
                _emit_kv_share(c, spec)

        if not persistent(spec):
            item_state(c)
        c(f"bars = sb + {lay['bars']}  # mbarriers: Q, full_k[{S}], full_v[{S}], empty_k[{S}], empty_v[{S}]")
        loaders = 128 if NONE else producer_threads(spec)  # producer "none": one warpgroup fills each ring
        if tma_loads(spec):
            loaders = 1  # one thread's expect_tx; the copies' bytes complete the phase
        if early_first_item(spec):
            c("early = 0  # the first item's K / V tiles producer thread 0 sent at entry (early_first_item)")
        c("if tid == 0:")
        with c.indent():
            if NONE:
                for w in range(BQ // 64):
                    c(f"mbar_init(bars + {8 * w}, 128)  # warpgroup {w}'s Q")
            else:
                for w in range(2 if q_double(spec) else 1):
                    c(f"mbar_init(bars + {8 * w}, {producer_threads(spec)})  # Q buffer {w}'s" if q_double(spec)
                      else f"mbar_init(bars, {producer_threads(spec)})")
            if table_tiles(spec):
                for w in range(BQ // 64):
                    c(f"mbar_init(bars + {lay['table_full'] + 8 * w}, 128)  # warpgroup {w}'s table tile")
            if persistent(spec) and not NONE:
                for w in range(2 if q_double(spec) else 1):
                    c(f"mbar_init(bars + {lay['q_empty'] + 8 * w}, {consumers})  # Q " +
                      (f"buffer {w} free for the producer's next item in it" if q_double(spec) else
                       "free for the producer's next item"))
            if uses_work_counter(spec):
                for w in range(2 if q_double(spec) else 1):
                    c(f"mbar_init(bars + {lay['item_full'] + 8 * w}, 1)  # the next item's ticket is in tick" +
                      (f"[{w}]" if q_double(spec) else ""))

            for s in range(S):
                c(f"mbar_init(bars + {lay['full_k'] + 8 * s}, {loaders})")
                c(f"mbar_init(bars + {lay['full_v'] + 8 * s}, {loaders})")
                c(f"mbar_init(bars + {lay['empty_k'] + 8 * s}, {consumers})")
                c(f"mbar_init(bars + {lay['empty_v'] + 8 * s}, {consumers})")
            if cluster_push(spec):
                for w in range(consumer_wgs(spec)):
                    c(f"mbar_init(cl_bar_s + {8 * w}, 1)  # warpgroup {w}'s rows pushed by the cluster's parts")
                c("fence_mbar_init_cluster()  # the cluster sees them initialised through this thread's arrival")
            if early_first_item(spec):
                _emit_early_first_item(c, spec, lay, item_state)
        c("cuda.syncthreads()  # the barriers are initialised (the only block-wide barrier)")
        if cluster_push(spec):
            c("cluster_arrive_relaxed()  # the cluster's one barrier: waited for before the first push")
        c("role = warp_uniform(tid >> 5)  # the warp's index, provably the same in its lanes (wgmma in a branch on "
          "tid is serialized: C7518)")
        if NONE:
            _emit_consumer(c, spec, lay, item_state if persistent(spec) else None)
        elif WARP:
            c(f"if role >= {consumers // 32}:")
            with c.indent():
                _emit_producer(c, spec, lay)
            c("else:")
            with c.indent():
                _emit_consumer(c, spec, lay)
        else:
            per_item = item_state if persistent(spec) else None
            c("if role < 4:")
            with c.indent():
                _emit_producer(c, spec, lay, per_item)
            c("else:")
            with c.indent():
                _emit_consumer(c, spec, lay, per_item)
    text = c.text()
    used = sorted({int(n) for n in re.findall(r"\bofs_(\d+)\b", text)})
    ind = re.search(r"^( *)__OFFSETS__$", text, re.M).group(1)
    defs = "\n".join(f"{ind}ofs_{n} = np.int64({n})" for n in used)
    return re.sub(r"^ *__OFFSETS__$", lambda m: defs, text, count=1, flags=re.M)


def emit_fa3_ws_forward(spec: FA2ForwardSpec) -> str:
    """Numba CUDA source of the warp-specialized wgmma forward kernel `spec.name` (a whole module)."""
    validate_spec(spec)
    header = _HEADER.format(spec_repr=_spec_comment(spec) + f" schedule={SCHEDULE}").replace(
        "emit_fa2 -- do not edit.", "emit_fa3_ws -- do not edit.")
    code = _device_functions(spec) + "\n\n" + ssa_rename(_emit_kernel(spec))
    sync, unit = ("cluster_arrive_relaxed, cluster_wait, fence_mbar_init_cluster, mapa_shared, mbar_wait_cluster, "
                  "st_async_f32, st_async_v4_u32", "pushed_merge_unit") if cluster_push(spec) else \
        ("cluster_sync", "cluster_merge_unit") if cluster_merge(spec) else \
        ("fence_acq_rel_gpu", "fused_merge_unit")  # the merge's barriers and remote writes, or its count's fence
    split = "" if spec.kv_parts == 1 else (
        f"from falower.backends.numba_cuda.intrinsics import {sync}\n"
        f"from falower.backends.numba_cuda.lse_merge import {unit}\n\n"
        f"merge_unit = {unit}({spec.kv_parts}, {spec.dtype!r})  # split-kv's merge of a row's 8 elements\n"
        if fused_merge(spec) else "from falower.backends.numba_cuda.intrinsics import griddep_launch_dependents\n")
    return header + _WGMMA_IMPORTS + _WS_IMPORTS + split + "\n\n" + code
