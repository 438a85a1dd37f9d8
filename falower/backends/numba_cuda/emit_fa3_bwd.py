"""Emit Numba CUDA source for the FlashAttention backward's main kernel on Hopper's warpgroup MMA (issue 11).

`emit_fa3_backward(spec)` returns one Python module, like `emit_fa2_bwd.emit_fa2_backward`, from the same
`FA2BackwardSpec` (same kernel arguments, same device-function contract: elem_<branch>, tile_class_fn, the block
table, captured tables' gradients) and the same launch (grid `emit_fa2_bwd.bwd_grid`, 32 * num_warps threads, and
under dq_ws a producer warpgroup's 128 more). The Delta kernel and dQ's conversion are emit_fa2_bwd's (under dq_ws
in the slab order). What is new is the schedule (FA3's backward):

* one block per (b, kv head, kv tile) of `block_k` = 64 or 128 rows; `block_k // 64` warpgroups, warpgroup w
  owning kv rows 64 w .. 64 w + 63, so warp i (of all of them) owns kv rows 16 i .. 16 i + 15: exactly the rows
  and the accumulator layout of the mma.sync kernel's warps (wgmma's D fragment is, per warp, mma.sync's C
  fragment repeated along N), so its per-element code, captured-gradient reductions and stores apply unchanged;
* K and V in shared memory for the whole loop, Q and dO (and LSE, Delta) of the next (head, q tile) loaded by
  cp.async into the other buffer while the current one is computed (by two producer warps under ws_loads, the
  default at 64 x 128 tiles; else by the consumers); every tile in wgmma's 128 B-swizzled
  layout `[D // 64][rows][64]` (wgmma.py), at 1024-byte aligned addresses;
* S^T = K Q^T and dP^T = V dO^T: D/16 `wgmma m64n{block_q}k16` each, both operands K-major from descriptors;
* per element the IR's elem_<branch> turns (s, dp, lse, delta) into (P^T, dS^T, gradient contributions);
* dV += P^T dO and dK += dS^T Q: P^T and dS^T packed from the accumulators straight into the A registers of
  `wgmma m64n{D}k16` (block_q/16 k steps), dO and Q MN-major (trans-b): no trip through shared memory;
* dS^T to shared memory (the MN-major A layout of dQ's product), one barrier, then dQ = dS K by
  `wgmma m64n{D / cs}k16` from two descriptors (dS^T trans-a, K trans-b), block_k/16 k steps: warpgroup w takes
  the 64 q rows `w % (block_q / 64)` and the D / cs columns `w // (block_q / 64)` of them (cs = warpgroups per
  64 q rows); added into the f32 dQ accumulator with 16-byte vector reductions (lanes t and t ^ 1 swap halves),
  as the mma.sync kernel does, or (`dq_ws`) handed through slabs in shared memory to a producer warpgroup that adds
  each by one bulk reduction (FA3's dQ writer; the accumulator then in slab order, which the Delta kernel zeroes
  and the conversion reads: `dq_acc_rows`, `dq_ws_chunk`);
* dK and dV stay in registers over every q tile and head of the group and are written once.

The two consumer warpgroups run each phase at the same time (two block barriers a tile); `bwd_pingpong` (opt-in)
takes them out of lockstep: each one's dQ from its own kv rows, its own barriers, S^T / dP^T issued in turns;
`dq_alternate` (the default at D = 64) gives each q tile's whole dQ to one warpgroup in turn while the other goes
on (cuDNN's).

Selection: `spec.extra["bwd_schedule"] == "wgmma"` (emit_fa2_bwd's entry points dispatch here);
`falower.compile(graph, extra={"bwd_schedule": "wgmma"})` or `FALOWER_WGMMA_BWD=1` ask for it (`backward_extra`),
which also takes it by itself on compute capability 9.x at D = 64 and 128 (measured faster at both).
`resolve(spec)` is what the runtime builds: the spec itself, or, where this
kernel refuses it (`validate_spec`: a clear ValueError), the mma.sync spec, so an unsupported feature never gives
wrong numbers. Supported: f16/bf16, D = 64 or 128, block_q 64 or 128 (block_q + D <= 192: the four accumulators
in registers), block_k 64 or 128, GQA, every score function, tile classes from tile_class_fn or the block
table or the block lists of data masks (block_mask "list": each kv tile's non-empty (head, q tile) pairs, made
once per data by block_data.py, walked with no scan), captured tables' gradients (reduced per tile, or per element
by atomics). Refused (mma.sync runs): the deterministic mode (dq=separate, staged gradients), other head dims.

No 64-bit division or modulo by a run-time value (a subroutine call makes ptxas serialize every wgmma;
benchmarks/NOTES.md "wgmma"): the grid is 3-d (`grid`: (kv tiles, kv heads, batch) without a block mask,
(G kv tiles, head groups, batch) under a static one, (kv heads, batch, kv tiles) under block tables and lists) and
the (head, q tile) walk keeps two counters. Element code with a division of its own still runs, serialized.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Mapping, Optional

from .emit_fa2 import (
    _Code,
    bind_offsets,
    emit_bases,
    emit_persistent_next,
    emit_persistent_start,
    emit_tile_scan,
    zero_helper,
)
from .emit_fa2_bwd import (
    DKDV_LINE,
    PA,
    SA,
    STRIDES,
    _cap_args,
    _cap_names,
    _elem_call,
    _elem_pair_helper,
    _elem_quad_helper,
    _emit_dkdv_stores,
    _emit_dq_reductions,
    _emit_dq_swaps,
    _emit_grad_element,
    _emit_grad_hold,
    _emit_grad_hold_end,
    _emit_grad_hold_start,
    _emit_grad_tile_end,
    _flat_index,
    _grad_args,
    _grad_outs,
    _list_args,
    _module,
    _store_pairs_helper,
    emit_by_class,
    delta_read,
    held_grads,
    lse_read,
)
from .emit_fa3 import (
    ALIGN,
    _emit_load,
    _emit_load_inside,
    _emit_loader_setup,
    _emit_row_addresses,
    stage_rows_stsm_helper,
)
from .elem_split import split_elem
from .spec import FA2BackwardSpec

__all__ = ["ENV", "backward_extra", "emit_fa3_backward", "resolve", "smem_bytes", "threads", "uses_wgmma",
           "validate_spec"]

ENV = "FALOWER_WGMMA_BWD"  # "1": the wgmma backward wherever the spec allows it; "0": never

_WGMMA_IMPORTS = '''
from falower.backends.numba_cuda.wgmma import (
    desc_at,
    desc_hi,
    desc_word,
    fence_proxy_async,
    opaque_u32,
    wgmma_commit,
    wgmma_fence_regs,
    wgmma_rs,
    wgmma_ss,
    wgmma_wait_regs,
)
from falower.backends.numba_cuda.intrinsics import ldg_vec, prefetch_l2  # read_v4's
'''
_BULK_IMPORTS = '''
from falower.backends.numba_cuda.intrinsics import (
    bulk_commit,
    bulk_reduce_add_f32,
    bulk_store,
    bulk_wait_read0,
    sts_v4_f32,
    stsm_x4,
    syncwarp,
)
'''  # dq_bulk's and dkdv_bulk's
_TMA_IMPORTS = '''
from falower.backends.numba_cuda.intrinsics import (
    tensormap_acquire,
    tma_store_3d,
    warp_min,
)
'''  # dkdv_tma's
_WS_IMPORTS = '''
from falower.backends.numba_cuda.intrinsics import (
    bar_arrive,
    bar_sync,
    cp_async_mbar_arrive_noinc,
    launch_bounds,
    mbar_arrive,
    mbar_init,
    mbar_wait,
    setmaxnreg_dec,
    setmaxnreg_inc,
)
'''  # dq_ws's (and ws_loads')


def uses_wgmma(spec: FA2BackwardSpec) -> bool:
    """spec.extra["bwd_schedule"] == "wgmma": this module's kernel (emit_fa2_bwd dispatches on it)."""
    return spec.extra.get("bwd_schedule") == "wgmma"


def backward_extra(extra: Mapping, env: Optional[Mapping[str, str]] = None, dtype: Optional[str] = None,
                   head_dim: Optional[int] = None, cc: Optional[tuple[int, int]] = None) -> dict:
    """The spec.extra of a backward: `extra` itself when it says `bwd_schedule`; else the wgmma schedule when
    FALOWER_WGMMA_BWD=1, or by itself on compute capability 9.x (`cc`, from the driver; None without a GPU or
    in the simulator) for f16/bf16 at D = 64 and 128, where it was measured faster than mma.sync (H100, N = 4k,
    fwd + bwd with the wgmma forward: D = 128 280 vs 253 TFLOP/s plain, 292 vs 232 causal; D = 64 270 vs 225
    plain, 234 vs 190 causal; benchmarks/NOTES.md "Backward on wgmma"). FALOWER_WGMMA_BWD=0 never takes it. A
    spec the kernel refuses (deterministic mode) still falls back to mma.sync (`resolve`)."""
    env = os.environ if env is None else env
    out = dict(extra)
    flag = env.get(ENV, "")
    if "bwd_schedule" in out or flag == "0":
        return out
    if flag == "1" or (cc is not None and cc[0] == 9 and dtype in ("f16", "bf16") and head_dim in (64, 128)):
        out["bwd_schedule"] = "wgmma"
    return out


def consumer_threads(spec: FA2BackwardSpec) -> int:
    """One warpgroup per 64 kv rows (the same 32 * block_k / 16 threads as the mma.sync kernel's warps)."""
    return 128 * (spec.block_k // 64)


def threads(spec: FA2BackwardSpec) -> int:
    """The block: the consumer warpgroups and, under dq_ws, the producer warpgroup after them."""
    return consumer_threads(spec) + (128 if dq_ws(spec) else 0)


def dq_split(spec: FA2BackwardSpec) -> str:
    """How the warpgroups share dQ = dS K of a q tile (spec.extra["dq_split"]): "n" (default) warpgroups of one
    64-row group of q take D / cs columns each, over all block_k kv rows (one reduction per dQ element and
    block); "k" (block_q = 64) each warpgroup its own 64 kv rows (its own dS^T rows) and every column: no
    column offsets inside a swizzle atom (D = 64: n32 at +64 bytes under "n"), twice the reductions. bwd_pingpong
    takes "k" (each warpgroup then needs only its own dS^T rows)."""
    return "k" if bwd_pingpong(spec) else str(spec.extra.get("dq_split", "n"))


def bwd_pingpong(spec: FA2BackwardSpec) -> bool:
    """The two consumer warpgroups out of lockstep (spec.extra["bwd_pingpong"] True; default False, measured slower):
    no barrier a tile between them, and their S^T / dP^T GEMMs issued in turns, so one warpgroup's elementwise step,
    stores and hand-off run under the other's GEMMs (FlashAttention-3's forward ping-pong). What it takes:
    dq_split "k" (each warpgroup's dQ partial from its own 64 kv rows of dS^T and K, every column: no warpgroup
    reads the other's dS^T), handed by dq_ws through its own slab (a 64 x D f32 slab; at D = 128 one a warpgroup,
    `dq_ws_slabs`: two do not fit) to the producer, whose reductions then add both warpgroups' slabs into the same
    q tile (twice dq_split "n"'s bytes reduced), and ws_loads (Q, dO of the next tile requested by both warpgroups
    on LD_REQ, whose count makes the loaders wait for both, so a buffer is refilled once both released it; each
    waits the buffer's mbarrier itself, and neither can run two tiles ahead of the other: the loads it would wait
    for need the other's request). Per tile each warpgroup syncs only its own warpgroup (named barriers PP_WG + wg:
    the tile's top, where its last dQ GEMM has read its dS^T rows, and the dS^T stores before dQ's GEMM); the turns
    are two named barriers (FA3's warp scheduler barriers): warpgroup w waits on PP_TURN + w before issuing its
    S^T and dP^T and arrives on the other's after, warpgroup 1 arriving once before the loop (warpgroup 0 goes
    first) and warpgroup 0 waiting once after it (every arrival matched). Tiles 64 x 128 only (two warpgroups, one
    64-row q group); at D = 128 dQ's product and hand-off go in two column halves of 64 (64 x 128 f32 beside dK
    and dV exceed the 168 registers ptxas allocates under the launch bound: it serialized every wgmma, C7512).
    Not with sdp_ahead (the issue it moves is the turn's), dk_after_dq (its own waits), or dkdv_in_tile (it stages
    dK in the other Q / dO buffer, which the other warpgroup may still read: dkdv_store_auto then picks TMA or row
    copies).
    Why: at D = 64 a tile's tensor-core work is ~1280 of 3961 cycles, and in lockstep both warpgroups wait through
    the same barrier, elementwise step, hand-off and loop top (benchmarks/NOTES.md, sixty-first session).
    Measured (H200, 2026-12-03, probe_bwd.py `pp`, 300 pairs of whole backward calls, N = 4096): 1.084 / 1.024 of the
    default's time at D = 64 (plain / causal), 1.086 / 1.027 at D = 128. A second form, both partials summed in one
    slab (warpgroup 1 adding its own after warpgroup 0's store, the reductions' bytes as under dq_split "n"), read
    1.157 / 1.142 and 1.329 / 1.277: warpgroup 1's wait for warpgroup 0's partial put the two back in step (its
    "reductions" phase 815 cycles a tile against ~424), so this form stays (benchmarks/NOTES.md, seventieth session)."""
    return spec.extra.get("bwd_pingpong", False) is True and uses_wgmma(spec)


_DQ_ALTERNATE_REFUSES = ("bwd_pingpong", "sdp_ahead", "dq_bulk", "dq_late", "dkdv_in_tile", "bwd_persistent",
                         "dk_after_dq")


def dq_alternate(spec: FA2BackwardSpec) -> bool:
    """One consumer warpgroup computes a q tile's whole dQ, the two taking turns (spec.extra["dq_alternate"]; its
    "auto" below): on tile t of the walk (both warpgroups walk the same tiles; t counts them, `tn`) warpgroup t & 1
    issues dQ = dS K for the tile's 64 q rows and all D columns over all block_k = 128 kv rows (both warpgroups' dS^T
    rows), waits for it and hands the 64 x D f32 fragment to its own slab (dq_ws; one a warpgroup by default,
    `dq_ws_slabs`: the two warpgroups' slabs alternate as two slabs of one warpgroup do, and the bytes are the
    default's), while the other warpgroup skips dQ and goes straight on to the next tile's S^T and dP^T. The loop's
    top has no barrier (the default's waits there for both warpgroups' dQ GEMMs and hand-offs); dS^T's barrier after
    its stores stays, and before its dS^T stores the tile's dQ warpgroup waits on DS_FREE, on which the other arrived
    once its dQ GEMM of the last tile had read dS^T (the first tile skipped, the one after the walk matched: every
    arrival is waited for). dS^T's barrier is one of both warpgroups, not an arrival of the skipping one: with an
    arrival only, the skipping warpgroup ran a tile ahead and its DS_FREE arrival of tile t and its own wait of tile
    t + 2 made one generation without the other (the simulator's slowed warpgroups: dQ wrong, then a deadlock), and
    per-warpgroup barrier ids there made ptxas serialize every wgmma (C7520). The Q / dO buffers stay guarded by
    ws_loads' request barrier, which counts both warpgroups (each arrives at a tile's top, after it waited for the
    last tile's GEMMs). Why: ncu of cuDNN's D = 64 backward (the same 64 x 128 decomposition) shows it alternating dQ
    between its warpgroups so that the tensor cores have the other's next S^T / dP^T while one waits for dQ; our
    samples had 4.4% of all stall samples on dQ's wgmma wait and 2.4% on the HGMMA after the barrier before dQ, both
    warpgroups waiting at once. Takes 64 x 128 tiles, dq_split "n", dq_ws and ws_loads. dk_after_dq's "auto" (D =
    128) steps aside and dk_after_dq True is refused: with it (the dQ warpgroup's dK between dQ's halves, the
    other's after dS^T's barrier; that order is in 06b412a, taken out of `_emit_dq_alternate` since) the simulator
    read dQ wrong in 2 of ~7 runs of the causal D = 128 case under load (dq err 0.26-0.28, once 0.0097 against
    0.0086), a race not yet found; without it 7 of 7 read the default's dQ bitwise. At D = 128 the dQ warpgroup's
    product and hand-off go in two column halves of 64, each waited for and stored in turn (as bwd_pingpong's):
    ptxas (sm_90a, no wgmma serialized) spilled 60 / 40 bytes (plain / causal; 76 / 56 with the whole 64 x 128 f32
    fragment) against the default's 32 / 12; at D = 64 (one m64n64 product) the default's 36 / 28. Not with bwd_pingpong, sdp_ahead, dq_bulk, dq_late, a persistent kernel or
    dkdv_in_tile (it stages dK in the other Q / dO buffer, which the other warpgroup, up to a tile behind, may still
    read: dkdv_store_auto then picks TMA or row copies). spec.extra["dq_alternate"] takes True, False, or "auto",
    the default: on at D = 64 over 64 x 128 tiles with no mask or a static one, no captured table's gradient,
    dq_split "n", dq_ws and ws_loads, where no knob it refuses is asked for (`_dq_alternate_auto`). Measured (H200,
    2026-12-03, probe_bwd.py `dqalt` / `nodqalt`, 300 pairs of whole backward calls against the default before it):
    D = 64 **0.989 plain, 0.940 causal, 0.943 the 1024 window, 0.926 prefix LM** (dK / dV then by row copies:
    in_tile steps aside), but GQA (a group of 4 query heads a kv head) 1.008, and D = 128 1.067 plain (its spills),
    so not under GQA or at D = 128 (benchmarks/NOTES.md, seventy-third session)."""
    v = spec.extra.get("dq_alternate", "auto")
    return uses_wgmma(spec) and (v is True or (v == "auto" and _dq_alternate_auto(spec)))


def _dq_alternate_auto(spec: FA2BackwardSpec) -> bool:
    """dq_alternate's "auto": the measured shapes (D = 64, 64 x 128 tiles, no mask or a static one, no gradient of a
    captured table, no GQA group: measured slower there), on dq_ws and ws_loads with dq_split "n", where no knob it
    refuses is asked for."""
    return (spec.head_dim == 64 and (spec.block_q, spec.block_k) == (64, 128) and spec.group_size == 1
            and spec.block_mask in ("none", "static") and not spec.grads and not spec.deterministic
            and spec.dq == "atomic" and spec.extra.get("dq_split", "n") == "n" and ws_loads(spec)
            and not any(spec.extra.get(k, False) is True
                        for k in ("bwd_pingpong", "dq_bulk", "dq_late", "dkdv_in_tile", "dk_after_dq"))
            and spec.extra.get("sdp_ahead", False) is False and not persistent(spec))


# The knobs of this kernel (opt-in, but interior_split, dkdv_bulk, dq_ws, ws_loads, without a mask kv_major, and
# dkdv_tma / dkdv_in_tile where dkdv_store_auto picks them),
# each with the text it leaves in the emitted source: what tools and tests read to know a built kernel took it
# (p_under_dp falls back to the fused elementwise function where it cannot split); a tuple: any of its texts
# (kv_major's kv tile from the grid's x, a block's or a persistent walk's item's).
KNOB_MARKS = {"dq_bulk": "bulk_reduce_add_f32(dqg", "dk_after_dq": "WAIT_Q1(dqa, 0)", "p_under_dp": "WAIT_S1(sacc, 0)",
              "interior_split": "if interior:  # no bounds code", "dq_late": "if dq_at >= 0:",
              "kv_major": ("kj = cuda.blockIdx.x\n", "kj = it_x\n"), "list_ahead": "e_nx = ",
              "dkdv_bulk": "# (dkdv_bulk: staged in",
              "dkdv_stsm": "def stage_stsm(", "dkdv_tma": "dkv_bh, dkv_su + ", "dq_ws": "bar_arrive(DQ_FULL",
              "ws_loads": "bar_arrive(LD_REQ", "sdp_ahead": "# sdp_ahead: the next tile's S^T",
              "dkdv_in_tile": "# dkdv_in_tile: ", "bwd_pingpong": "bar_arrive(PP_TURN", "stat_pairs": "def elems2_",
              "dq_alternate": "bar_arrive(DS_FREE", "dv_under_dp": "WAIT_P1(pacc, 0)"}


def knobs_in(source: str) -> dict[str, bool]:
    """Which of KNOB_MARKS' knobs the kernel module `source` was emitted with."""
    return {knob: any(m in source for m in (mark if isinstance(mark, tuple) else (mark,)))
            for knob, mark in KNOB_MARKS.items()}


def stat_pairs(spec: FA2BackwardSpec) -> bool:
    """The element step's LSE and Delta of a thread's two adjacent q columns by one 8-byte shared load each
    (spec.extra["stat_pairs"] True; default False, measured slower): 16 loads a thread and tile at 64 x 128 where
    the per-column reads take 32 (the seventy-first session's local SASS of the D = 64 backward: 32 LDS of its
    ~246 interior instructions). Where the element code adds captured tables' gradients or reads tables by 16
    bytes, the per-column form stays. Measured (H200, 2026-12-03, probe_bwd.py `sp`, 300 pairs of whole backward
    calls): 1.124 / 1.093 of the default's time at D = 64 / 128, with 32 fewer instructions a thread and tile and
    the same registers; why is not known (an LLVM load in place of the inline asm gave ptxas the same SASS)."""
    return spec.extra.get("stat_pairs", False) is True


def dq_bulk(spec: FA2BackwardSpec) -> bool:
    """dQ's partial sums added by bulk reductions (spec.extra["dq_bulk"] True; default False, measured no faster):
    each warp stages its 16 rows of the tile's dQ fragment in shared memory (rows padded by 16 bytes: a warp's
    16-byte stores fall in distinct banks), and 16 of its lanes hand one row each to the copy engine
    (cp.reduce.async.bulk .add.f32) once the next tile's first GEMMs are issued. The default adds each thread's
    fragment by 16-byte vector reductions (red.global.add.v4.f32). Those took 36% of the plain D = 128 backward
    (benchmarks/probe_bwd.py: the floor without them), but the bulk form ran 0-3.5% slower there and 4-12% slower
    at D = 64, its rows handed over at once or under the next GEMMs (H200; its staging alone cost ~11%; NOTES "The
    backward against FlexAttention")."""
    return spec.extra.get("dq_bulk", False) is True


def dq_ws(spec: FA2BackwardSpec) -> bool:
    """dQ's partial sums handed to a producer warpgroup (spec.extra["dq_ws"]: True, False, or "auto", the default: on
    wherever ws_loads comes with it (ws_loads True, or its "auto" at `_ws_loads_shape`'s tiles) or dq_ws_slabs is
    asked; without ws_loads, on except under block lists and with a held gradient, where dq_ws alone measured
    slower, and with one consumer warpgroup, not measured):
    each consumer warpgroup writes its 64 x D / cs f32 fragment of a tile's dQ to one of its slabs in shared memory
    (`dq_ws_slabs`, alternating) as the registers lie (16-byte stores, thread-major: no lane swaps, no bank
    conflicts), fences for the async proxy and arrives on a named barrier; warp w of the producer warpgroup (after
    the consumers' warps) adds consumer warpgroup w's slab into dQ's f32 accumulator by one bulk reduction
    (cp.reduce.async.bulk .add.f32, 8-16 KB), waits until it has read the slab and hands it back (a second named
    barrier); after dK's and dV's stores a 0 word ends its walk (under dq_split "k", bwd_pingpong's, each
    warpgroup's slab is the whole 64 x D tile, and both are added into the same words). dq32 is then kept in the
    slabs' order, padded to whole q tiles (`dq_acc_rows`, `dq_ws_chunk`): the Delta kernel zeroes it and the conversion kernel reads it
    so. The producer warpgroup gives its registers to the consumers (`setmaxnreg`: 24 / 240 at two consumer
    warpgroups, from the launch's 168). Why: the consumers' 8 vector reductions a tile were 36% of the plain D = 128
    backward (probe_bwd `nored` 0.638 of its time, H200) and in lockstep nobody else had work; issued by the
    consumers themselves as bulk reductions (`dq_bulk`) they stayed in the tile's critical path (FlashAttention-3's
    split, benchmarks/NOTES.md "A plan for the backward against cuDNN"). Measured (H200, probe_bwd.py, 7-9 rounds,
    the whole backward call against the vector reductions): plain D = 128 0.881, GQA 0.838, prefix LM 0.893, the
    1024 window 0.915, causal 0.923, the softcap 0.923, the relative bias 0.958, plain D = 64 0.947; the document
    (block lists) 1.054 and ALiBi (its slope's gradient held across tiles) 1.133. With ws_loads (its "auto"), against
    the vector reductions' call (2026-11-29): GQA 0.799, prefix LM 0.814, the relative bias 0.853, ALiBi 0.874, the
    document 0.954, so "auto" takes those two with it."""
    v = spec.extra.get("dq_ws", "auto")
    loads = spec.extra.get("ws_loads", "auto")
    if v == "auto" and (loads is True or (loads == "auto" and _ws_loads_shape(spec))):
        v = True  # ws_loads asks for the producer warpgroup it runs on; with it every example measured faster
    if v == "auto" and "dq_ws_slabs" in spec.extra:
        v = True  # dq_ws_slabs asks for the slabs it sizes (under the rule below it silently did nothing)
    if v == "auto" and (spec.block_mask == "list" or held_grads(spec) or spec.block_k == 64):
        return False  # without ws_loads: measured slower (lists, a held gradient), or not measured (one warpgroup)
    return (uses_wgmma(spec) and (v is True or v == "auto") and spec.dq == "atomic" and not spec.deterministic
            and (dq_split(spec) == "n" or bwd_pingpong(spec)) and not dq_bulk(spec) and not dq_late(spec)
            and not persistent(spec))


def _ws_loads_shape(spec: FA2BackwardSpec) -> bool:
    """The tiles ws_loads was measured on: two consumer warpgroups over 64-row q tiles (block_k 128, block_q 64)."""
    return spec.block_k == 128 and spec.block_q == 64


def ws_loads(spec: FA2BackwardSpec) -> bool:
    """Q, dO and their LSE, Delta rows of the next q tile loaded by two warps of dq_ws's producer warpgroup
    (spec.extra["ws_loads"]: True, which turns dq_ws on unless it is False; False; or "auto", the default: on
    wherever dq_ws is, at the tiles it was measured on, `_ws_loads_shape`): at
    each tile's top the consumers name the next (head, q tile) in a shared word and arrive on a named barrier; the
    loader warps issue its cp.async copies into the other buffer (each thread's ending in
    cp.async.mbarrier.arrive.noinc on the buffer's mbarrier), write its LSE and Delta rows into shared memory and
    arrive; the consumers wait on that mbarrier (by the tile count's
    parity) before the tile's GEMMs. The block's first tile stays the consumers' own load. Why: the consumers'
    loads and the next tile's bookkeeping were 549 cycles of a 6665-cycle tile (probe_bwd --phases, plain D = 128,
    H200), issued in lockstep by both warpgroups, and their row addresses hold registers the consumers (at 240
    under dq_ws) spill for. Measured (H200, probe_bwd.py, 9 rounds, the whole backward call against dq_ws without
    it, 2026-11-29): plain D = 128 0.935, causal 0.904, the 1024 window 0.947, plain D = 64 0.986; the document
    0.954 of the vector reductions (its default before)."""
    v = spec.extra.get("ws_loads", "auto")
    return dq_ws(spec) and (v is True or (v == "auto" and _ws_loads_shape(spec)))


WS_LOADERS = 64  # ws_loads: two warps of the producer warpgroup
_AUTO_KNOBS = ("dq_ws", "ws_loads", "dk_after_dq", "dq_alternate")  # True, False or "auto" (the others: True or False)
_DQ_WS_REFUSES = "dq_split 'k' (but under bwd_pingpong), dq_bulk, dq_late or bwd_persistent"  # the knobs dq_ws() turns it off for
DQ_WS_REGS = (24, 240)  # dq_ws's setmaxnreg counts at two consumer warpgroups: 128 x 24 + 256 x 240 = 384 x 168
DQ_WS_BAR = 1  # dq_ws: the consumers' block barrier (bar.sync 1, their threads); then each slab's full and free ones


def dq_ws_slabs(spec: FA2BackwardSpec) -> int:
    """dq_ws's slabs a consumer warpgroup (spec.extra["dq_ws_slabs"], 1 or 2; default 2): with two, the warpgroup
    writes tile t + 1's dQ while the copy engine still reads tile t's. Asked, it turns dq_ws's "auto" on (as
    ws_loads True does); with dq_ws False or a knob dq_ws cannot run with, validate_spec refuses it. Under
    bwd_pingpong (64 x D slabs) the default is 1 at D = 128, where two a warpgroup exceed the shared memory; under
    dq_alternate (64 x D slabs, a warpgroup's written every other tile) it is 1: the two warpgroups' alternate."""
    return int(spec.extra.get("dq_ws_slabs", 1 if bwd_pingpong(spec) and spec.head_dim > 64 or dq_alternate(spec)
                              else 2))


def _dq_ws_slab_bytes(spec: FA2BackwardSpec) -> int:
    return 64 * (spec.head_dim // _col_splits(spec)) * 4


def dq_acc_rows(spec: FA2BackwardSpec, M: int) -> int:
    """Rows of dQ's f32 accumulator a (batch, head): M, or under dq_ws whole q tiles (its slabs cover them)."""
    return -(-M // spec.block_q) * spec.block_q if dq_ws(spec) else M


def dq_ws_chunk(spec: FA2BackwardSpec) -> list[str]:
    """The device function `dqws_rc(p)`: the (row, column) in its q tile of 16-byte chunk p of a tile's slabs (the
    chunk holds rows r and r + 8 at columns col and col + 1, in that order). A q tile's block_q x D f32 are its
    consumer warpgroups' slabs one after another (warpgroup w = its row group + RG x its column split, as the kernel
    numbers them; under dq_split "k", bwd_pingpong's, one slab, every warpgroup's added into it), each as the
    warpgroup's threads wrote it: [n8 tile][thread][4], a thread's 4 in wgmma's
    accumulator order (rows g, g + 8; columns 2t, 2t + 1)."""
    D, BQ = spec.head_dim, spec.block_q
    RG, CS = BQ // 64, _col_splits(spec)
    DC = D // CS
    return ["@device_function", "def dqws_rc(p):",
            f"    w = p // {16 * DC}",
            f"    dn = (p >> 7) % {DC // 8}",
            "    th = p & 127",
            (f"    r = (w % {RG}) * 64 + (th >> 5) * 16 + ((th & 31) >> 2)" if RG > 1
             else "    r = (th >> 5) * 16 + ((th & 31) >> 2)"),
            f"    col = {'(w // ' + str(RG) + ')' if RG > 1 else 'w'} * {DC} + dn * 8 + (th & 3) * 2",
            "    return r, col"]


def dkdv_bulk(spec: FA2BackwardSpec) -> bool:
    """dK and dV stored by the copy engine (spec.extra["dkdv_bulk"], default True; False keeps the direct stores): after
    one barrier (every warpgroup's last GEMMs have read K, V, Q, dO and dS^T) each warp stages its 16 rows of dK and
    of dV, 16-bit, in shared memory (rows 2 D + 16 bytes apart: a store's 32 lanes in 32 banks), and each of its 32
    lanes hands one row to a bulk copy (cp.async.bulk, a row of a kv head is contiguous in dK / dV); the block waits
    only until the copies have read shared memory. Why: the direct stores (64 4-byte stores a thread, each warp's
    covering 8 rows x 16 bytes) took the whole epilogue, 8.1-10.0k cycles a block (probe_bwd --blocks, H200: the
    document's, the 1024 window's, plain's), 11-17% of a window's or a document's block with its prologue. Measured
    (H200, probe_bwd.py, 9 rounds, the whole backward call against the direct stores): the 1024 window 0.965, the
    document 0.951, plain 0.974, causal 0.969 (D = 128), plain D = 64 0.963; the window's epilogue 8.1k -> 4.7k
    cycles a block."""
    return spec.extra.get("dkdv_bulk", True) is True


def dkdv_stsm(spec: FA2BackwardSpec) -> bool:
    """dkdv_bulk's staging by stmatrix (spec.extra["dkdv_stsm"] True; default False): each warp's 16 rows of dK and
    of dV by D / 16 stmatrix .x4 each (512 bytes an instruction) where the default stores a 4-byte pair at a time
    (D / 4 stores a thread and accumulator). Why: the window's epilogue, split by probe_bwd --blocks (H200), is 4.6k
    of its 4.7k cycles between the barrier and the copies' reads: the staging's stores 1.6k, its fence ~20, the
    copies' issue 2.9k (the copy engine takes a 256-byte copy about every 12 cycles an SM, whoever issues it:
    483477b's dkdv_lane0; staging and copying in the last tile before its dQ reductions, 06845e5's dkdv_early, was no
    better than this alone). Measured (H200, probe_bwd.py, 9 rounds, the whole backward call against the default):
    the 1024 window 0.969, the document 0.994, causal 0.989, plain 1.012, plain D = 64 1.007; the staging's stores
    1.6k -> 0.6k cycles a block, 0.8% of a window's; the rest of each ratio is ptxas scheduling the whole kernel
    anew and the calls' spread, so it stays opt-in."""
    return dkdv_bulk(spec) and spec.extra.get("dkdv_stsm", False) is True


def dkdv_tma(spec: FA2BackwardSpec) -> bool:
    """dkdv_bulk's rows by TMA tensor stores (spec.extra["dkdv_tma"] True; default "auto": dkdv_store_auto's): each
    warp stages its 16 rows of dK and of dV by stmatrix as D / 64 boxes each of 16 rows x 128 bytes in the 128-byte
    swizzle, and lane 0 hands each box to one cp.async.bulk.tensor through dK's or dV's tensor map (made per call
    as the forward's O map: tensor_maps.o_map_geometry over the kv heads' rows; rows past N are not written), 2 D /
    64 copies a warp where the default hands 32 rows to 32 bulk copies. Why: probe_bwd --blocks (H200) read the
    copies' issue at ~2.9k cycles of a window block's 4.7k-cycle epilogue, the copy engine taking a 256-byte copy
    about every 12 cycles an SM whoever issues it (483477b's dkdv_lane0). Not with a persistent kernel (its staging
    has a region of its own). Its boxes are staged by stmatrix whatever dkdv_stsm says (which then does nothing).
    Measured (H200, probe_bwd.py, 9 rounds, the whole backward call against a bulk copy a row): the 1024 window
    0.992, the document 0.987, plain 1.009; the window's copies' issue 2.9k -> 1.7k cycles a block, their reads
    0.1k -> 0.5k. The default where dkdv_store_auto says "tma" (D >= 128 with a mask: 0.97-0.98 of the row copies by
    150-300 pairs)."""
    v = spec.extra.get("dkdv_tma", "auto")
    want = v is True or v == "auto" and dkdv_store_auto(spec) == "tma"
    return uses_wgmma(spec) and dkdv_bulk(spec) and want and not persistent(spec) and not dkdv_in_tile(spec)


_DKDV_IN_TILE_REFUSES = ("dk_after_dq", "sdp_ahead", "dq_bulk", "dq_late", "bwd_persistent", "bwd_pingpong",
                         "dq_alternate")


def _knobs_on(spec: FA2BackwardSpec, knobs: tuple[str, ...]) -> list[str]:
    """Those of `knobs` the spec runs with: a persistent kernel, sdp_ahead and dk_after_dq (its "auto" too) as their
    rules decide, every other knob asked True (p_under_dp asked counts where its split would not take): the clash
    lists of dkdv_in_tile, sdp_ahead and dq_alternate."""
    ruled = {"bwd_persistent": persistent, "sdp_ahead": sdp_ahead, "dk_after_dq": dk_after_dq,
             "dq_alternate": dq_alternate}
    return [k for k in knobs if (bool(ruled[k](spec)) if k in ruled else spec.extra.get(k, False) is True)]


def _in_tile_clash(spec: FA2BackwardSpec) -> list[str]:
    """The knobs dkdv_in_tile cannot run beside (their own staging or order), as the spec sets them."""
    return _knobs_on(spec, _DKDV_IN_TILE_REFUSES) + ([] if dkdv_bulk(spec) else ["dkdv_bulk False"])


def dkdv_store_auto(spec: FA2BackwardSpec) -> str:
    """How dK and dV leave the block by default ("auto" of dkdv_in_tile and dkdv_tma): "in_tile", "tma" or "" (a
    bulk copy a row). Measured (H200, 2026-12-02, probe_bwd.py, 200-300 pairs of the whole backward call against
    a bulk copy a row; BENCHMARKS.md, sixty-seventh session): at D = 128 in_tile takes plain 0.991, GQA 0.960,
    causal 0.975 and tma 1.014, 1.014, 0.974, but on the masks whose walks are short or listed in_tile loses (the
    1024 window 1.046, the document 1.020) where tma gains (0.965, 0.976); at D = 64 in_tile takes causal 0.988 and
    the document 0.982 (tma 1.000, 0.988) and neither pays plain (1.006, 1.024). ALiBi (its slope's gradient held
    across tiles) read 1.002 / 1.005: either. So: D >= 128 unmasked in_tile, masked tma; D = 64 masked in_tile.
    Then the rule against the row copies (the same session's call D, 150 pairs): causal D = 128 0.975, plain 0.992,
    causal D = 64 0.988, the window 0.970, the document 0.976, prefix LM 0.990, the softcap 0.996, the window at
    D = 64 0.985, but the bias table **1.073** (in_tile) and ALiBi at D = 64 1.004: a captured table's gradient (its
    flush after the walk) keeps the row copies, and so does dkdv_stsm asked for (its staging is of the row copies;
    under the rule it did nothing, unseen until the GPU tests' knob check, sixty-ninth session). dk_after_dq's default
    (D = 128) refuses in_tile, so plain D = 128 leaves by row copies beside it (the pair measured 0.953 of in_tile's
    time, seventy-second session)."""
    if spec.grads or spec.extra.get("dkdv_stsm", False) is True:
        return ""
    if not uses_wgmma(spec) or persistent(spec) or _in_tile_clash(spec):
        return "tma" if uses_wgmma(spec) and not persistent(spec) and spec.head_dim >= 128 \
            and spec.block_mask != "none" and dkdv_bulk(spec) else ""
    if spec.head_dim >= 128:
        return "in_tile" if spec.block_mask == "none" else "tma"
    return "in_tile" if spec.block_mask != "none" else ""


def dkdv_in_tile(spec: FA2BackwardSpec) -> bool:
    """dK and dV staged and stored in the walk's last q tile, under its dQ GEMM (spec.extra["dkdv_in_tile"] True;
    default "auto": dkdv_store_auto's measured choice): once dQ's GEMM is committed, a wait_group 1 (every tile: under the last
    tile's test ptxas serialized every wgmma, C7514) finds dV's and dK's group done, and in the last tile each warp
    stages its 16 rows of each by stmatrix as dkdv_tma's 16-row boxes (128-byte swizzle) where nothing reads any
    more, without a barrier: dV into its own rows of V (only its warpgroup's dP^T read them, and the last tile's is
    done) and dK into the other Q / dO buffer (no next tile loads it); lane 0 then hands the 2 D / 64 boxes to TMA
    tensor stores through dkdv_tma's maps, ahead of the tile's dQ hand-off. After the loop every thread only waits
    for the copies' reads (a kv tile that walks no q tile stages its zeros there, after a barrier: the K, V copies
    of other threads land in V's rows until then). dkdv_tma with it does nothing (the same boxes), nor dkdv_stsm
    (the boxes are stmatrix's). Why: probe_bwd --blocks (H200, causal D = 128, sixty-second session) read a block's
    epilogue at 4.9k cycles: a barrier, 64 4-byte stores a thread, and 256 row copies whose issue took 2.9k, all
    after the loop and after the last tile's dQ slabs (2 x 16 KB) went to the same copy engine; a causal block's
    fixed cost (prologue, epilogue, gap: 9.3k) is 6% of it. Here the staging (16 stmatrix a thread, not 64 stores) runs under dQ's GEMM, the copies are 32
    tensor stores (dkdv_tma: the issue 2.9k -> 1.7k cycles, the reads 0.1k -> 0.5k), and dK / dV's 64 KB leave
    before the last slabs. Predicted before any GPU run: the causal D = 128 block's loop end to its end ~4.9k ->
    ~3k cycles (96 KB through the copy engine at dkdv_tma's ~29 bytes a cycle from the last tile's staging on),
    -1.2% of its ~155k, the backward call 0.985-0.995 of the default's; D = 64 (256 row copies of 128 bytes there
    against 16 boxes) 0.98-0.99. Measured (BENCHMARKS.md, sixty-seventh session): the causal D = 128 block's
    epilogue 5382 -> 906 cycles, the call 0.975 (D = 64: 0.988); the default where dkdv_store_auto says "in_tile".
    Not with dk_after_dq (dK is still in flight after dQ's GEMM), sdp_ahead (its
    next S^T / dP^T read V and the other buffer), dq_bulk, dq_late or a persistent kernel (their own staging and
    order): validate_spec refuses those."""
    v = spec.extra.get("dkdv_in_tile", "auto")
    if v == "auto":  # dkdv_tma set either way says how they leave
        return "dkdv_tma" not in spec.extra and dkdv_store_auto(spec) == "in_tile"
    return uses_wgmma(spec) and dkdv_bulk(spec) and v is True and not persistent(spec)


def dkdv_maps(spec: FA2BackwardSpec) -> bool:
    """Whether the kernel takes dK's and dV's tensor maps (dkdv_tma, dkdv_in_tile: their TMA tensor stores)."""
    return dkdv_tma(spec) or dkdv_in_tile(spec)


def persistent(spec: FA2BackwardSpec) -> int:
    """spec.extra["bwd_persistent"] = P blocks (0 or absent: off; measured slower): a persistent launch of
    min(P, items) blocks, each walking the items (b, kv head, kv tile) of the grid the kernel would launch, in rounds
    of P in serpentine order (emit_fa2.emit_persistent_next's: a block that took a round's heavy item takes a light
    one in the next). Between two items the last one's dK / dV rows are staged (dkdv_bulk, required) in a region of
    their own (`_layout`: 36-68 KB more shared memory, so D = 64's 64 x 128 kernel fits one block an SM, not two), and
    their bulk copies read them while the next item's K, V and first Q, dO load. Each thread waits for its copies
    before the next item's q loop, whose first barrier (or the epilogue's) orders every thread's wait before the
    staging is written again. Why:
    a block of a window or a document pays its prologue (3.4-4.9k cycles), its epilogue (4.7k with dkdv_bulk) and
    the SM's gap between blocks (0.7-1.8k) beside 9-18 tiles of 6.1-8.2k (probe_bwd --blocks, H200). Measured
    (H200, probe_bwd.py, 7 rounds, P = 132, the whole backward call against one block an item): the 1024 window 1.62,
    the document 1.69, plain 1.14 of the time, when ptxas spilled 364-456 bytes at D = 128 (12-40 without the item
    loop): LLVM had hoisted what each item derives from the thread's index out of the item loop. The indices are now
    made per item (`_emit_thread_indices`): 0 bytes plain, 16 the document, 116 the window and causal; not yet
    measured so."""
    p = spec.extra.get("bwd_persistent", 0)
    return p if isinstance(p, int) and not isinstance(p, bool) and p > 0 else 0


def _dkdv_stage_pitch(spec: FA2BackwardSpec) -> int:
    """Bytes between a warp's staged rows of dK / dV: D 16-bit columns and 16 bytes, so that row g + 1's word w sits
    4 banks after row g's: lanes (g, t) of a 4-byte store hit banks 4 g + t, all 32 distinct."""
    return spec.head_dim * 2 + 16


def list_ahead(spec: FA2BackwardSpec) -> bool:
    """Under block lists, the list's next entry read a tile ahead (spec.extra["list_ahead"] True; default False, not
    yet measured): the walk keeps entry p + 1 in a register (e_nx), so the next tile's Q / dO copies and LSE / Delta
    loads wait on no load of the list at the loop's top, where a plain or static walk's next pair is an add. Why:
    the list's load (an L2 hit at best, hundreds of cycles) sat between the loop's top and the next tile's copies,
    with only the loop's barrier (168-251 cycles in plain's phases) to hide it."""
    return spec.extra.get("list_ahead", False) is True and spec.block_mask == "list"


def interior_split(spec: FA2BackwardSpec) -> bool:
    """The tile's elementwise calls emitted twice (spec.extra["interior_split"], default True): under `if
    interior:` with a literal True, so the IR's bounds selects (q < M, kv < N) and their 64-bit compares fold
    away on every tile inside the sequence, and as written for the ragged ones. One copy left a plain D = 128
    thread 32 64-bit compares, 32 predicate ops and ~64 selects a tile on interior tiles too (local SASS)."""
    return spec.extra.get("interior_split", True) is not False


def p_under_dp(spec: FA2BackwardSpec) -> bool:
    """P computed while dP^T's GEMM is in flight (spec.extra["p_under_dp"] True; default False): S^T and dP^T
    committed as two groups, the first waited for alone, P from elem_split's P part, then dP^T's wait and the dS
    part. FlashAttention-3 runs its exponentials under the dP GEMM the same way. Only where every branch's
    elementwise function splits (elem_split: dS reads the score only through P) and no captured table has a
    gradient; elsewhere the kernel keeps the fused function. Measured no faster (H200, probe_bwd.py, 7 rounds):
    1.052 / 1.002 / 1.015 of the default's time (plain D = 128 / causal / D = 64); again on 2026-12-03 (300 pairs,
    the row values' element code): 1.042 / 1.038 (D = 64 / 128)."""
    asked = spec.extra.get("p_under_dp", False) is True or spec.extra.get("dv_under_dp", False) is True
    if not asked or spec.grads:
        return False
    return all(split_elem(spec.device_source, b) is not None for b in spec.branches)


def dv_under_dp(spec: FA2BackwardSpec) -> bool:
    """dV's GEMM issued from P^T before dP^T's wait (spec.extra["dv_under_dp"] True; default False), on
    p_under_dp's split (asking for it asks for the split; where the split does not take, the fused order stays):
    S^T's group waited for alone, the P part, dV += P^T dO issued and committed as its own group, then
    `wgmma.wait_group 1` for dP^T with dV's group in flight, the dS part, and dK's GEMM. dV's register A operands
    are P's packed exponentials, so ptxas cannot sink them past dP^T's wait, as it did under p_under_dp alone
    (26 of a thread's 32 MUFU.EX2 after the wait, thirty-fifth session). FlashAttention-3's backward and cuDNN's
    (its exponentials between dP's k steps, ncu, seventy-second session) run P under dP the same way. Measured
    slower (H200, 2026-12-03, probe_bwd.py `pdv`, 300 pairs of whole backward calls): 1.072 / 1.037 of the
    default's time at D = 64 (plain / causal), 1.070 / 1.080 at D = 128, with the same registers and spills as the
    default (ptxas sm_90a: 168, 36 / 36 bytes plain D = 64 / 128). So opt-in."""
    return spec.extra.get("dv_under_dp", False) is True and p_under_dp(spec)


SDP_AHEAD_CHOICES = (False, "dq", "top")
_SDP_AHEAD_REFUSES = ("p_under_dp", "dv_under_dp", "dk_after_dq", "dq_late", "dq_bulk", "bwd_persistent")


def sdp_ahead(spec: FA2BackwardSpec) -> str:
    """Where the next q tile's S^T and dP^T GEMMs are issued (spec.extra["sdp_ahead"]; default False: at that
    tile's top, after its barrier): "dq" right after this tile's dQ GEMM, so that they run under dQ's wait, its
    hand-off (or reductions) and the next tile's top; "top" after the hand-off, under the top only (dQ's fragment
    and S^T / dP^T not live together: D = 128's registers). The next tile's Q and dO are there by then: the
    consumers' own copies were waited at this tile's dS^T barrier, ws_loads' are waited on their mbarrier just
    before. Why: a tile's phases run in lockstep on both warpgroups and the tensor cores idle from dQ's GEMM to
    the next S^T (the wait, the hand-off, the loop top: ~600 of a ~5000-cycle tile at D = 128, thirty-fourth
    session's --phases). Measured slower (H200, probe_bwd.py, 9 rounds, the whole backward call against the
    default, 2026-12-01): "top" 1.063 / 1.039 at D = 64 (plain / causal), 1.096 / 1.047 at D = 128; "dq" 1.18 / 1.13
    at D = 64 and 2.58 at D = 128, where dQ's fragment and S^T / dP^T together spill and ptxas serializes the
    wgmmas. In lockstep, one warpgroup's early S^T / dP^T take the tensor cores from the other's dQ GEMM, which the
    next barrier waits for (benchmarks/NOTES.md, sixty-first session). Opt-in; returns "" when off."""
    v = spec.extra.get("sdp_ahead", False)
    return v if isinstance(v, str) and v in SDP_AHEAD_CHOICES else ""


def kv_major(spec: FA2BackwardSpec) -> bool:
    """The grid's order (spec.extra["kv_major"]; by default True without a block mask, False under one): (kv
    tiles, kv heads, batch), a (b, kv head)'s kv tiles in consecutive blocks, so the blocks running together share
    few heads; otherwise (kv heads, batch, kv tiles), kv tile j of every head in one wave, which reads every head's
    Q and dO and adds into every head's dQ rows each wave: 128 MB each at B = 4, H = 16, N = 4k, D = 128, past L2
    (ncu, H200: that main kernel read 2.27 TB/s from DRAM, L2 74% busy, 49% hits). FlashAttention-2's and -3's
    order. Measured (H200, probe_bwd.py, 9 rounds): the whole backward call 4.6% faster at D = 128, 8.1% at D = 64
    (plain); causal 5% slower, where the old order runs every head's heaviest kv tile (0) first and this one
    leaves heavy tiles for the last wave, so a mask keeps the old order (a static one in groups: kv_group)."""
    return spec.extra.get("kv_major", spec.block_mask == "none") is True and not batch_inner(spec)


SMEM_MAX = 227 * 1024  # a block's shared memory on sm_90
KV_GROUP_STATIC = 8  # kv_group's default under a static mask (tile classes from tile_class_fn)
KV_GROUP_MAX = 64  # the grid pads the kv heads to a multiple of G: more would launch mostly empty blocks


def kv_group(spec: FA2BackwardSpec) -> int:
    """Heads a group of the grid's cost order (spec.extra["kv_group"] G; 0 = off): blocks in groups of G kv heads,
    a group's kv tile 0 of each head first, then kv tile 1 of each, ... (x = G kj + the head's place in its group,
    y = the group, z = the batch row). Why: kv_major keeps a head's Q, dO and dQ rows in L2 but under causal leaves
    the last heads' heavy kv tiles to the tail (5-7% slower, H200); with G heads a wave (G ~ SMs / kv tiles) each
    wave starts on its heaviest tiles, and ~2G heads' rows are live. Takes precedence over kv_major; blocks past
    the last head (G not dividing the heads: under GQA with few kv heads, most of a group) exit at once, before any
    copy or barrier. Default KV_GROUP_STATIC under a static mask unless kv_major is asked for, else 0. Measured
    (H200, probe_bwd.py, 9 rounds, the whole backward call against the old order, D = 128 unless said): G = 8
    causal 0.994 (0.982 in another call), causal D = 64 0.910, ALiBi 0.986, the 1024 window 0.992; G = 4 0.991 /
    0.914 / 0.983 / 1.010; the document's block lists 1.012 (G = 8), so lists keep the old order."""
    default = KV_GROUP_STATIC if spec.block_mask == "static" and "kv_major" not in spec.extra else 0
    if batch_inner(spec):
        return 0
    g = spec.extra.get("kv_group", default)
    return g if isinstance(g, int) and not isinstance(g, bool) else 0


def batch_inner(spec: FA2BackwardSpec) -> bool:
    """The grid (batch, kv tiles, kv heads) (spec.extra["bwd_batch_inner"] True; opt-in, not measured yet): the B
    batch rows of one (kv tile, kv head) in consecutive blocks, so that they walk the q tiles together and a table
    with no batch index (the bias table's [h, q, kv]) is read from DRAM once, not once a batch row, and its gradient's
    B reductions into a word meet in L2 (the forward's batch_inner: DRAM 4.9 -> 2.8 GB; the backward's kv_major
    runs the batch rows 32 x 16 blocks apart). Takes precedence over kv_group and kv_major."""
    return spec.extra.get("bwd_batch_inner", False) is True


def _grid_order(spec: FA2BackwardSpec) -> tuple[tuple[str, str, str], list[tuple[str, str]], list[str]]:
    """The grid's order, one table for the launch and the kernel: its extents (x, y, z) as expressions in nk (kv
    tiles), HK (kv heads) and B (evaluated by `grid`, emitted by a persistent kernel's walk), an item's (x, y, z)
    decoded into kj, hk and b (templates in x, y, z, in the order emitted), and the kernel's comment on the order."""
    if batch_inner(spec):
        return (("B", "nk", "HK"), [("b", "{x}"), ("kj", "{y}"), ("hk", "{z}")],
                ["# grid (batch, kv tiles, kv heads): the batch rows of a (kv tile, kv head) together, reading a",
                 "# table with no batch index from DRAM once (bwd_batch_inner)"])
    if kv_group(spec):
        KG = kv_group(spec)
        return ((f"nk * {KG}", f"(HK + {KG - 1}) // {KG}", "B"),
                [("kj", f"{{x}} // {KG}"), ("hk", f"{{y}} * {KG} + {{x}} % {KG}"), ("b", "{z}")],
                [f"# grid ({KG} kv tiles, head groups, batch): kv tile j of a group's {KG} heads, then j + 1 "
                 "(cost order", "# within a group whose rows stay in L2; divisions by constants only)"])
    if kv_major(spec):
        return (("nk", "HK", "B"), [("kj", "{x}"), ("hk", "{y}"), ("b", "{z}")],
                ["# grid (kv tiles, kv heads, batch): a (b, kv head)'s kv tiles run together, so its Q, dO and dQ",
                 "# rows stay in L2 (kv tile 0 first: causal's heaviest); no run-time division (a call: ptxas would",
                 "# serialize every wgmma)"])
    return (("HK", "B", "nk"), [("hk", "{x}"), ("b", "{y}"), ("kj", "{z}")],
            ["# grid (kv heads, batch, kv tiles): kv tile 0 of every (b, kv head) first (causal: it sees the most q",
             "# tiles), and no run-time division (a call: ptxas would serialize every wgmma)"])


def grid(spec: FA2BackwardSpec, B: int, H: int, M: int, N: int) -> tuple[int, int, int]:
    """The launch grid (`_grid_order`'s extents): (kv heads, batch, kv tiles), (kv tiles, kv heads, batch) under
    kv_major, (G kv tiles, head groups, batch) under kv_group G; a persistent kernel's blocks (min(P, items), 1, 1)
    walk that grid's items."""
    dims = {"nk": -(-N // spec.block_k), "HK": H // spec.group_size, "B": B}
    g = tuple(int(eval(e, {"__builtins__": {}}, dims)) for e in _grid_order(spec)[0])  # our own expressions
    if persistent(spec):  # its blocks walk the items of g (x fastest)
        return (min(persistent(spec), g[0] * g[1] * g[2]), 1, 1)
    return g


def dq_late(spec: FA2BackwardSpec) -> bool:
    """dQ's vector reductions issued late (spec.extra["dq_late"] True; default False, measured slower): a tile's
    dQ fragment stays in registers (swapped, its row and column in dq_at, -1 for rows past M) until the next tile's
    S^T and dP^T GEMMs are issued, then its 16-byte reductions issue while the tensor cores run them; the last
    tile's after the loop. Why: the reductions were the tile's longest phase (2140 of 6665 cycles, probe_bwd.py
    --phases, H200), issued while the tensor cores idle between dQ's GEMM and the next tile's barrier, loads and
    S^T. Not with dq_bulk (which stages the fragment instead). Measured (H200, probe_bwd.py, 9 rounds): 1.119 /
    1.188 / 1.079 of the default's time (plain D = 128 / causal / D = 64): the 32 registers held over the loop top
    spill, and L2, busy either way, is what bounds the reductions. Again on 2026-12-03 (300 pairs): 1.495 / 1.621
    (D = 64 / 128)."""
    return spec.extra.get("dq_late", False) is True and not dq_bulk(spec)


def dk_after_dq(spec: FA2BackwardSpec) -> bool:
    """dK's GEMM issued after dQ's (spec.extra["dk_after_dq"]: True, False, or "auto", the default: on at D = 128
    over 64 x 128 tiles, with no block mask or a static one and no captured table's gradient, where nothing asked
    conflicts with it: `_dk_after_dq_auto`): dV += P^T dO and dS^T's stores, the barrier, dQ = dS K, then dK +=
    dS^T Q from dS's packed registers, and dQ's wait leaves dK in flight while dQ's hand-off issues (waited after
    it). FlashAttention-3's order (its bwd_step issues dQ before dK for the same reason); the other order issues dV
    and dK together before the barrier and waits for all three GEMMs before the hand-off. Measured (H200,
    probe_bwd.py, 7 rounds, 2026-11-29): 1.010 / 0.980 / 1.095 of the other order's time (plain D = 128 / causal /
    D = 64); on 2026-12-03's kernels (dq_ws's hand-off, the row values; 300 pairs of whole backward calls, `dkl`,
    its dK / dV stores then by dkdv_store_auto's rule without in_tile): **0.953 plain and 0.940 causal at D = 128**,
    1.002 plain at D = 64 (benchmarks/NOTES.md, seventy-second session). Not measured, so off under "auto": block
    lists and tables (the document), a captured table's gradient (its registers held across tiles), other tiles."""
    v = spec.extra.get("dk_after_dq", "auto")
    return v is True or (v == "auto" and _dk_after_dq_auto(spec))


def _dk_after_dq_auto(spec: FA2BackwardSpec) -> bool:
    """dk_after_dq's "auto": the measured shapes (D = 128, 64 x 128 tiles, no mask or a static one, no gradient of a
    captured table) where no knob asked for refuses it (bwd_pingpong, sdp_ahead, dkdv_in_tile True, a persistent
    kernel, dq_alternate)."""
    return (uses_wgmma(spec) and spec.head_dim == 128 and (spec.block_q, spec.block_k) == (64, 128)
            and spec.block_mask in ("none", "static") and not spec.grads and not spec.deterministic
            and spec.extra.get("bwd_pingpong", False) is not True and spec.extra.get("sdp_ahead", False) is False
            and spec.extra.get("dkdv_in_tile", "auto") is not True and not persistent(spec)
            and spec.extra.get("dq_alternate", False) is not True)


def _col_splits(spec: FA2BackwardSpec) -> int:
    """Warpgroups sharing one 64-row group of dQ (they split D): cs of _emit_kernel (dq_alternate: 1, the tile's
    dQ warpgroup takes every column)."""
    return 1 if dq_split(spec) == "k" or dq_alternate(spec) else (spec.block_k // 64) // (spec.block_q // 64)


def _dq_stage_pitch(spec: FA2BackwardSpec) -> int:
    """Bytes between a warp's staged dQ rows: its D / cs f32 columns and 16 bytes, so that row r + 1's 16-byte chunk
    j sits 4 banks after row r's. A store's 32 lanes (rows g and g + 8, two chunks each) then hit each 4-bank group
    4 times (rows r and r + 8 share one): 4 wavefronts for 512 bytes, the least there can be."""
    return (spec.head_dim // _col_splits(spec)) * 4 + 16


def _opaque(spec: FA2BackwardSpec) -> tuple[str, ...]:
    """spec.extra["opaque_desc"]: the operands whose descriptors are built inside the loop (wgmma.opaque_u32), a
    comma-separated subset of k, v, ds, kt; default none (LLVM hoists them: 2 registers each). ptxas's spills at
    D = 128 move either way (sm_90a, bytes none / all: plain 40 / 144, causal 52 / 0, alibi 36 / 0, gqa 68 / 16):
    an A/B for the GPU, not a settled choice."""
    return tuple(x for x in str(spec.extra.get("opaque_desc", "")).split(",") if x)


def grouped_grads(spec: FA2BackwardSpec) -> dict[int, tuple[int, int]]:
    """Gradient -> its span (a, b) where a per-element gradient's last index is a q + b kv + c (GradSpec.span; a
    relative bias's diagonals): a thread's elements at q columns q0 + t2 + 8 jj + e and kv rows kv_w + g + 8 r sit at
    index base + a (8 jj + e) + b 8 r, so those with the same offset share one entry; the thread sums them in
    registers (18 groups of its 64 elements for a relative bias at 64 x 128) and adds each group once, where every
    element added its own (8192 reductions a tile into 2N - 1 words a head, contending at L2 as ALiBi's did;
    benchmarks/NOTES.md "The relative bias's gradient"). spec.extra["grad_groups"] = False keeps the per-element
    adds (bench '-bgg')."""
    if spec.extra.get("grad_groups", True) is False:
        return {}
    return {i: g.span for i, g in enumerate(spec.grads) if g.span and not g.reduced}


def v4_grads(spec: FA2BackwardSpec) -> list[int]:
    """The per-element gradients whose last two indices are the element's q and kv (GradSpec.grid: a bias table
    [h, q, kv]). A thread holds kv rows g and g + 8 of q columns t2 + 8 jj + e, so the four lanes of one t2 whose
    rows g are 4 a .. 4 a + 3 hold, between them, four kv-consecutive entries of four (row half, column) pairs:
    two shuffle stages transpose them, and each lane adds one pair's four entries by one 16-byte reduction
    (red.global.add.v4.f32) where every element added its own (8192 reductions a 64 x 128 tile, B of them into each
    word: the bias table's backward ran at 80 TFLOP/s, 0.66x FlexAttention's; benchmarks/NOTES.md "The bias
    table's gradient by 16-byte reductions"). A call whose table does not cover M x N in rows of a multiple of
    four words (or is not 16-byte aligned) takes the per-element adds, clamped as the gather clamps (one uniform
    branch). spec.extra["grad_v4"] = False keeps the per-element adds."""
    if spec.extra.get("grad_v4", True) is False:
        return []
    return [i for i, g in enumerate(spec.grads) if g.grid and not g.reduced]


def read_v4(spec: FA2BackwardSpec, branch: str) -> list[tuple[int, int]]:
    """(capture, n_index) of each read of a captured f32 table at [the tile's..., q, kv] in the branch's element code
    (FA2BackwardSpec.grid_reads: a bias table), in elemg_<branch>'s order. Each element gathered its own entry, a
    4-byte load on the chain to its exponential with its clamps and index products (the bias table's backward:
    0.388 of its time with those reads taken out, probe_bwd.py's nogload); now a lane loads four kv-consecutive
    entries by one 16-byte load and the transpose of v4_grads (its own inverse) hands each lane its elements'
    values, behind one uniform test of the call's table (rows 16-byte aligned covering M x N; else each element's
    entry, clamped), the next tile's rows prefetched to L2 at each tile's top (without the prefetch the loads
    waited on HBM: 0.949 of the gathers' time at D = 128, 1.138 at D = 64; with it 0.776 and 0.909; H200, the whole
    backward call, benchmarks/NOTES.md "The bias table's backward"). spec.extra["read_v4"] = False keeps the
    gathers in the element code; the default (True or "early") issues the tile's loads before the wait for S^T and
    dP^T (read_early), "late" in the element code, each n8 tile's loads just before its elements."""
    if spec.extra.get("read_v4", True) is False:
        return []
    return [(cap, n) for br, cap, n in spec.grid_reads if br == branch]


def read_early(spec: FA2BackwardSpec) -> bool:
    """spec.extra["read_v4"] True (the default) or "early": every n8 tile's 16-byte loads of the grid reads issued
    right after the S^T and dP^T GEMMs, before their wait, so that the loads' L2 latency runs under the GEMMs (each
    loaded n8 tile waited on inside the element code; 4 registers a read and n8 tile held across the wait: 32 at
    block_q 64). Measured on the H200, the whole backward call against "late" (the loads in the element code):
    0.869 at D = 128 (despite ptxas's 528 bytes of spill stores against 148), 0.762 at D = 64 (benchmarks/NOTES.md,
    "The bias table's loads before the wait"). Where the branches read different tables, the loads stay late."""
    if spec.extra.get("read_v4", True) not in (True, "early"):
        return False
    reads = [tuple(read_v4(spec, b)) for b in spec.branches]
    return bool(reads[0]) and all(r == reads[0] for r in reads)


def _grid_covers(tq: str, tk: str) -> str:
    """A table's rows of a multiple of 4 words covering M x N (tq, tk its last two extents): then a lane's four
    kv-consecutive entries, from a multiple of 4 below N, lie inside one row. The uniform test of both the 16-byte
    reductions (gvec) and the 16-byte loads (rvec), beside each one's alignment."""
    return f"{tk} % 4 == 0 and {tk} >= N and {tq} >= M"


def _element_qkv(jj: int, e: int, r: int, tq: str, tk: str) -> tuple[str, str]:
    """Element (r, e) of n8 tile jj: its q column and kv row, clamped to a table's extents as a gather clamps (the
    per-element side of v4_grads and read_v4)."""
    return f"min(q0 + t2 + {8 * jj + e}, {tq} - 1)", f"min(kv0 + warp * 16 + {8 * r} + g, {tk} - 1)"


def _emit_grid_loads(c: _Code, spec: FA2BackwardSpec, j: int, cap: int, n: int, jj: int, out: str) -> None:
    """Grid read j's 16-byte load of n8 tile jj (this lane's pair's four kv-consecutive entries) into out0 .. out3,
    zeros past M or N (under rvec<cap>)."""
    table = _cap_names(spec)[cap]
    lead = [f"gl{j}_[{d}]" for d in range(n - 2)]
    c(f"gq = q0 + t2 + {8 * jj} + (g4 & 1)")
    c("if gq < M and gkv < N:")
    with c.indent():
        c(f"{', '.join(f'{out}{k}' for k in range(4))} = ldg_vec({table}, ({', '.join(lead + ['gq', 'gkv'])}))")
    c("else:")
    with c.indent():
        c(f"{', '.join(f'{out}{k}' for k in range(4))} = ZERO, ZERO, ZERO, ZERO")


def _emit_early_reads(c: _Code, spec: FA2BackwardSpec, caps: str) -> None:
    """read_early: the grid reads' leading indices and every n8 tile's 16-byte loads (te<j>_<jj>_<k>), issued while
    the S^T and dP^T GEMMs run."""
    branch = spec.branches[0]
    reads = read_v4(spec, branch)
    c("# read_v4 'early': the table's entries of the whole tile, loaded under the S^T and dP^T GEMMs")
    for j, (cap, n) in enumerate(reads):
        if n > 2:
            c(f"gl{j}_ = gtab{j}_{branch}_fn(b, h, hk, q0, kv0{caps})")
        c(f"if rvec{cap}:")
        with c.indent():
            for jj in range(spec.block_q // 8):
                _emit_grid_loads(c, spec, j, cap, n, jj, f"te{j}_{jj}_")
        c("else:")
        with c.indent():
            for jj in range(spec.block_q // 8):
                c(f"{', '.join(f'te{j}_{jj}_{k}' for k in range(4))} = ZERO, ZERO, ZERO, ZERO")


def _emit_grid_reads(c: _Code, spec: FA2BackwardSpec, branch: str, jj: int) -> list[str]:
    """The branch's grid reads (read_v4) of n8 tile jj into tv<j>_<2 r + e>; the names of element (r, e)'s values
    are tv<j>_<2 r + e> for j in order (returned as format strings in r, e)."""
    names = []
    early = read_early(spec)
    for j, (cap, n) in enumerate(read_v4(spec, branch)):
        table = _cap_names(spec)[cap]
        lead = [f"gl{j}_[{d}]" for d in range(n - 2)]
        tq, tk = f"{table}.shape[{n - 2}]", f"{table}.shape[{n - 1}]"
        tv = [f"tv{j}_{k}" for k in range(4)]
        c(f"if rvec{cap}:")
        with c.indent():
            src = f"te{j}_{jj}_" if early else "tl"
            if not early:
                _emit_grid_loads(c, spec, j, cap, n, jj, "tl")
            c(f"{', '.join(tv)} = {_transpose_helper(c)}({', '.join(f'{src}{k}' for k in range(4))}, g4)")
        c("else:")
        with c.indent():
            for r in range(2):
                for e in range(2):
                    c(f"{tv[2 * r + e]} = {table}[{', '.join(lead + list(_element_qkv(jj, e, r, tq, tk)))}]")
        names.append(f"tv{j}_{{}}")
    return names


def _emit_grid_prefetch(c: _Code, spec: FA2BackwardSpec, reads: list[tuple[int, int]], more: str, h: str, q0: str,
                        caps: str) -> None:
    """The next tile's rows of each grid read's table (read_v4) into L2, a 128-byte line a consumer thread, at the
    top of this tile: its 16-byte loads then wait on L2, not on HBM (the loads feed the exponentials: a tile's
    latency, not its bandwidth, is what they cost)."""
    NT = consumer_threads(spec)
    lines = spec.block_k // 32  # 128-byte lines of a table row's block_k f32 entries
    per = max(1, spec.block_q * lines // NT)
    for j, (cap, n) in enumerate(reads):
        table = _cap_names(spec)[cap]
        c(f"if rvec{cap} and {more}:  # read_v4: the next tile's table rows to L2")
        with c.indent():
            lead = []
            if n > 2:
                c(f"gp_ = gtab{j}_{spec.branches[0]}_fn(b, {h}, hk, {q0}, kv0{caps})")
                lead = [f"gp_[{d}]" for d in range(n - 2)]
            for k in range(per):
                x = f"(tid + {k * NT})" if k else "tid"
                c(f"prow = {q0} + ({x} >> {lines.bit_length() - 1})")
                c(f"pkv = kv0 + 32 * ({x} & {lines - 1})")
                c("if prow < M and pkv < N:")
                with c.indent():
                    c(f"prefetch_l2({table}, ({', '.join(lead + ['prow', 'pkv'])}))")


def _transpose_helper(c: _Code) -> str:
    """grid_transpose(x0, x1, x2, x3, i): among the four lanes 4 apart (i = (lane >> 2) & 3), lane i's xk becomes
    lane k's xi (two butterfly stages; its own inverse)."""
    return c.helper("grid_transpose", [
        "@device_function", "def grid_transpose(x0, x1, x2, x3, i):",
        "    lo = (i & 1) == 0",
        "    y0 = shfl_xor_f32(x1 if lo else x0, 4)",
        "    y1 = shfl_xor_f32(x3 if lo else x2, 4)",
        "    if lo:", "        x1 = y0", "        x3 = y1",
        "    else:", "        x0 = y0", "        x2 = y1",
        "    lo = (i & 2) == 0",
        "    y0 = shfl_xor_f32(x2 if lo else x0, 8)",
        "    y1 = shfl_xor_f32(x3 if lo else x1, 8)",
        "    if lo:", "        x2 = y0", "        x3 = y1",
        "    else:", "        x0 = y0", "        x1 = y1",
        "    return x0, x1, x2, x3"])


def _grid_shape(spec: FA2BackwardSpec, i: int) -> tuple[str, str, str]:
    """Gradient i's table (v4_grads): its name, its q extent and its kv extent (the last two dims)."""
    g = spec.grads[i]
    table = _cap_names(spec)[g.capture]
    return table, f"{table}.shape[{g.n_index - 2}]", f"{table}.shape[{g.n_index - 1}]"


def _emit_grid_lead(c: _Code, spec: FA2BackwardSpec, i: int) -> None:
    """glead<i>: the flat offset of gradient i's tile-invariant leading indices (clamped as the gather clamps),
    read from the first element's outputs."""
    g = spec.grads[i]
    table, tq, tk = _grid_shape(spec, i)
    expr = ""
    for j in range(g.n_index - 2):
        idx = f"min(max(gi{i}_{j}, 0), {table}.shape[{j}] - 1)"
        expr = idx if not expr else f"({expr}) * {table}.shape[{j}] + {idx}"
    c(f"glead{i} = ({expr}) * {tq} * {tk}" if expr else f"glead{i} = 0")


def _emit_grid_adds(c: _Code, spec: FA2BackwardSpec, i: int, jj: int) -> None:
    """Gradient i's four stashed contributions of n8 tile jj (gv<i>_<2 r + e>): one 16-byte reduction a lane after
    the transpose (v4_grads), or under gvec<i> False the four clamped per-element adds."""
    _, tq, tk = _grid_shape(spec, i)
    fn = _transpose_helper(c)
    v = [f"gv{i}_{k}" for k in range(4)]
    c(f"if gvec{i}:")
    with c.indent():
        c(f"gy0, gy1, gy2, gy3 = {fn}({', '.join(v)}, g4)")
        c(f"gq = q0 + t2 + {8 * jj} + (g4 & 1)")
        c("if gq < M and gkv < N and (gy0 != ZERO or gy1 != ZERO or gy2 != ZERO or gy3 != ZERO):")
        with c.indent():
            c(f"red_add_v4_f32(grad_{i}, glead{i} + gq * {tk} + gkv, gy0, gy1, gy2, gy3)")
    c("else:")
    with c.indent():
        for r in range(2):
            for e in range(2):
                qq, kk = _element_qkv(jj, e, r, tq, tk)
                c(f"if {v[2 * r + e]} != ZERO:")
                with c.indent():
                    c(f"cuda.atomic.add(grad_{i}, glead{i} + {qq} * {tk} + {kk}, {v[2 * r + e]})")


def _key(offset: int) -> str:
    """A group's name from its index offset (m3 for -3)."""
    return f"m{-offset}" if offset < 0 else str(offset)


def _layout(spec: FA2BackwardSpec) -> dict[str, int]:
    """Byte offsets from the 1024-byte aligned base: K, V, Q0, Q1, dO0, dO1, dS^T (each [cols // 64][rows][128 B]),
    then f32 LSE and Delta of the two q tiles (lse buffer i at ST + 4 * BQ * i, delta at ST + 4 * BQ * (2 + i)), then
    under dq_bulk each warp's staged rows of dQ (DQ); dkdv_bulk's staged rows of dK / dV in [STG, STG_END)."""
    D, BQ, BK = spec.head_dim, spec.block_q, spec.block_k
    kv, qt = BK * D * 2, BQ * D * 2
    lay = {"K": 0, "V": kv, "Q": 2 * kv, "DO": 2 * kv + 2 * qt, "DS": 2 * kv + 4 * qt, "kv": kv, "qt": qt}
    lay["ST"] = lay["DS"] + BK * BQ * 2
    lay["total"] = lay["ST"] + 16 * BQ
    if dq_bulk(spec):  # each warp's 16 staged rows of dQ (_dq_stage_pitch bytes apart)
        lay["DQ"] = lay["total"]
        lay["total"] = lay["DQ"] + (consumer_threads(spec) // 32) * 16 * _dq_stage_pitch(spec)
    if dq_ws(spec):  # each consumer warpgroup's slab of dQ (64 x D / cs f32), then a word each: the slab's tile
        lay["DQW"] = lay["total"]
        lay["DQSLOT"] = lay["DQW"] + (spec.block_k // 64) * dq_ws_slabs(spec) * _dq_ws_slab_bytes(spec)
        lay["total"] = lay["DQSLOT"] + 16
        if ws_loads(spec):  # the two buffers' mbarriers, then the request: its (1 + q head, or 0: none), its q0
            lay["MBAR"] = lay["total"]
            lay["REQ"] = lay["MBAR"] + 16
            lay["total"] = lay["REQ"] + 16
    # dkdv_bulk's staging: from the base (K, V, Q: free after the epilogue's barrier); a persistent kernel's must
    # survive the next item's loads, so it gets a region of its own (validate_spec refuses a spec it does not fit)
    lay["STG"], lay["STG_END"] = 0, lay["ST"]
    if persistent(spec):
        lay["STG"] = lay["total"]
        lay["total"] = lay["STG_END"] = lay["STG"] + consumer_threads(spec) * _dkdv_stage_pitch(spec)
    return lay


def smem_bytes(spec: FA2BackwardSpec) -> int:
    return _layout(spec)["total"] + ALIGN


def validate_spec(spec: FA2BackwardSpec) -> None:
    """Raise ValueError (saying what) where this kernel cannot build the spec; `resolve` then takes mma.sync."""
    D, BQ, BK = spec.head_dim, spec.block_q, spec.block_k
    if spec.path != "mma" or spec.dtype not in ("f16", "bf16"):
        raise ValueError(f"wgmma backward: f16 or bf16 on the tensor-core path only, got {spec.dtype} ({spec.path})")
    if D not in (64, 128):
        raise ValueError(f"wgmma backward: head_dim must be 64 or 128, got {D}")
    if BK not in (64, 128) or BQ not in (64, 128):
        raise ValueError(f"wgmma backward: block_q and block_k must be 64 or 128 (one warpgroup per 64 kv rows, "
                         f"dQ in m64 row groups), got {BQ}x{BK}")
    if BQ > BK:
        raise ValueError(f"wgmma backward: dQ's {BQ // 64} row groups of 64 need as many warpgroups "
                         f"(block_k // 64 = {BK // 64})")
    if BQ + D > 192:
        raise ValueError(f"wgmma backward: S^T, dP^T (block_q / 2 each) and dK, dV (D / 2 each) f32 registers a "
                         f"thread must stay <= 96 (block_q + D <= 192), got block_q = {BQ}, D = {D}")
    if spec.dq != "atomic" or spec.deterministic:
        raise ValueError("wgmma backward: the deterministic mode (dq=separate, gradients summed in a fixed order) "
                         "is not built on wgmma yet")
    if spec.block_mask not in ("none", "static", "table", "list"):
        raise ValueError(f"wgmma backward: unknown block_mask {spec.block_mask!r}")
    if spec.block_mask == "list" and not {"q_count", "q_tiles"} <= set(_list_args(spec)):
        raise ValueError("wgmma backward: block_mask='list' needs the block lists' q_count and q_tiles captures")
    for fn in [f"def elem_{b}(" for b in spec.branches]:
        if fn not in spec.device_source:
            raise ValueError(f"device_source must define {fn[4:-1]}")
    if spec.block_mask == "static" and "def tile_class_fn" not in spec.device_source:
        raise ValueError("block_mask='static' needs a tile_class_fn in device_source")
    g = spec.extra.get("kv_group", 0)
    if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g <= KV_GROUP_MAX:
        raise ValueError(f"wgmma backward: kv_group must be an int from 1 to {KV_GROUP_MAX} (or 0: off), got {g!r}")
    for knob in _AUTO_KNOBS:
        if spec.extra.get(knob, "auto") != "auto" and not isinstance(spec.extra[knob], bool):
            raise ValueError(f"wgmma backward: {knob} must be True, False or 'auto', got {spec.extra[knob]!r}")
    # a bool, not 1 or 0 (equal to True / False, but read by `is True`)
    v = spec.extra.get("sdp_ahead", False)
    if not any(v is c if isinstance(c, bool) else v == c for c in SDP_AHEAD_CHOICES):
        raise ValueError(f"wgmma backward: sdp_ahead must be False, 'dq' or 'top', got {v!r}")
    if sdp_ahead(spec):
        clash = _knobs_on(spec, _SDP_AHEAD_REFUSES)  # (dk_after_dq's "auto" steps aside for sdp_ahead)
        if clash:
            raise ValueError(f"wgmma backward: sdp_ahead issues the next tile's S^T and dP^T itself: not with "
                             f"{clash[0]}")
    for knob in (*KNOB_MARKS, "exp_fold", "grad_dist", "lse_per_row", "delta_per_row"):
        if knob not in (*_AUTO_KNOBS, "sdp_ahead") and not isinstance(spec.extra.get(knob, False), bool):
            raise ValueError(f"wgmma backward: {knob} must be True or False, got {spec.extra[knob]!r}")
    if dq_alternate(spec):
        knob = next(iter(_knobs_on(spec, _DQ_ALTERNATE_REFUSES)), None)  # (dk_after_dq's "auto" steps aside)
        clash = (f"block_q 64 and block_k 128 only (two consumer warpgroups, one 64-row q group), got {BQ}x{BK}"
                 if (BQ, BK) != (64, 128) else f"not with {knob}" if knob else
                 "not with dq_split 'k' (the tile's dQ warpgroup reads both warpgroups' dS^T rows: 'n')"
                 if dq_split(spec) != "n" else
                 f"it needs dq_ws and ws_loads: not with them False, {_DQ_WS_REFUSES}" if not ws_loads(spec) else "")
        if clash:
            raise ValueError(f"wgmma backward: dq_alternate gives each tile's whole dQ to one warpgroup in turn: "
                             f"{clash}")
    if bwd_pingpong(spec):
        clash = ("block_q 64 and block_k 128 only (two consumer warpgroups, one 64-row q group), got "
                 f"{BQ}x{BK}" if (BQ, BK) != (64, 128) else
                 "not with dq_split 'n' (each warpgroup's dQ from its own kv rows: 'k')"
                 if spec.extra.get("dq_split", "k") != "k" else "not with sdp_ahead" if sdp_ahead(spec) else
                 "not with dk_after_dq" if dk_after_dq(spec) else
                 f"it needs dq_ws and ws_loads: not with them False, {_DQ_WS_REFUSES}" if not ws_loads(spec) else "")
        if clash:
            raise ValueError(f"wgmma backward: bwd_pingpong runs each warpgroup on its own kv rows, loaders and "
                             f"barriers: {clash}")
    if dq_split(spec) not in ("n", "k") or (dq_split(spec) == "k" and BQ != 64):
        raise ValueError(f"wgmma backward: dq_split must be 'n', or 'k' with block_q = 64, got "
                         f"{dq_split(spec)!r} with block_q = {BQ}")
    if not set(spec.branches) <= {"all", "full", "partial"}:
        raise ValueError(f"wgmma backward: unknown branches {spec.branches}")
    if spec.num_warps * 32 != consumer_threads(spec):
        raise ValueError(f"wgmma backward: num_warps must be block_k // 16 = {BK // 16} (the consumer warps; the "
                         f"runtime launches threads(spec)), got {spec.num_warps}")
    if spec.extra.get("dq_ws_slabs", 2) not in (1, 2) or isinstance(spec.extra.get("dq_ws_slabs"), bool):
        raise ValueError(f"wgmma backward: dq_ws_slabs must be 1 or 2, got {spec.extra['dq_ws_slabs']!r}")
    if spec.extra.get("ws_loads", False) is True and not ws_loads(spec):
        raise ValueError(f"wgmma backward: ws_loads takes two warps of dq_ws's producer warpgroup: not with dq_ws "
                         f"False, {_DQ_WS_REFUSES}")
    if spec.extra.get("dq_ws", False) is True and not dq_ws(spec):
        raise ValueError(f"wgmma backward: dq_ws hands dQ to a producer warpgroup: not with {_DQ_WS_REFUSES}")
    if "dq_ws_slabs" in spec.extra and not dq_ws(spec):
        raise ValueError(f"wgmma backward: dq_ws_slabs sizes dq_ws's slabs: not with dq_ws False, {_DQ_WS_REFUSES}")
    p = spec.extra.get("bwd_persistent", 0)
    if isinstance(p, bool) or not isinstance(p, int) or p < 0:
        raise ValueError(f"wgmma backward: bwd_persistent must be a count of blocks (0: off), got {p!r}")
    if persistent(spec) and not dkdv_bulk(spec):
        raise ValueError("wgmma backward: bwd_persistent stages dK / dV for bulk copies: it needs dkdv_bulk")
    if spec.extra.get("dkdv_in_tile", False) is True:
        clash = _in_tile_clash(spec)
        if clash:
            raise ValueError(f"wgmma backward: dkdv_in_tile stages dK and dV in the last tile where nothing reads "
                             f"them any more: not with {clash[0]}")
    lay = _layout(spec)
    if dkdv_bulk(spec) and lay["STG"] + consumer_threads(spec) * _dkdv_stage_pitch(spec) > lay["STG_END"]:
        raise ValueError("wgmma backward: dkdv_bulk's staged rows do not fit the kernel's shared memory")
    if smem_bytes(spec) > SMEM_MAX:
        raise ValueError(f"wgmma backward: bwd_persistent's region for dK / dV's staged rows takes the shared memory "
                         f"to {smem_bytes(spec)} bytes, over 227 KB" if persistent(spec) else
                         f"wgmma backward: {smem_bytes(spec)} bytes of shared memory exceed 227 KB")


def resolve(spec: FA2BackwardSpec) -> tuple[FA2BackwardSpec, Optional[str]]:
    """(the spec to build, why wgmma was refused or None): a wgmma spec this kernel cannot build becomes the
    mma.sync spec (`bwd_schedule` dropped, the name marked), never an error and never wrong numbers."""
    if not uses_wgmma(spec):
        return spec, None
    try:
        validate_spec(spec)
    except ValueError as e:
        extra = {k: v for k, v in spec.extra.items() if k != "bwd_schedule"}
        return dataclasses.replace(spec, name=spec.name + "_mma", extra=extra), str(e)
    return spec, None


# --------------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------------


def _class_expr(spec: FA2BackwardSpec, hv: str, qv: str) -> str:
    """The class of (group head hv, q tile qv) against this block's kv tile (no division: two counters)."""
    BQ, BK, G = spec.block_q, spec.block_k, spec.group_size
    h = f"hk * {G} + {hv}" if G > 1 else "hk"
    if spec.block_mask == "static":
        return (f"tile_class_fn(b, {h}, ({qv}) * {BQ}, ({qv}) * {BQ} + {BQ - 1}, kv0, kv0 + {BK - 1}"
                f"{_cap_args(spec)})")
    if spec.block_mask == "table":
        return f"table[((b * H + {h}) * nq + {qv}) * nk + kj]"
    if spec.block_mask == "list":  # the pair's entry in this kv tile's list: partial (odd) or full
        return f"(1 if {_entry(spec, _pos(hv))} & 1 else 2)"
    return "2"


def _pos(hv: str) -> str:
    """Under block lists, the list position that goes with the pair (hv, qv): pc for (hc, qc), pn for (hn, qn)."""
    return "p" + hv[1:]


def _entry(spec: FA2BackwardSpec, pos: str, guarded: bool = False) -> str:
    """Entry `pos` of this kv tile's block list (q_row: the row's first entry); `guarded`: 0 at or past q_n."""
    e = f"{_list_args(spec)['q_tiles']}[q_row + {pos}]"
    return f"{e} if {pos} < q_n else 0" if guarded else e


def _more(spec: FA2BackwardSpec, hv: str, qv: str) -> str:
    """(hv, qv) is at or before the last non-empty pair (`_emit_pair_range`'s p_last under a block mask): the walk
    stops there instead of classifying every empty q tile after a window's end; under block lists, its position
    is inside the list."""
    if spec.block_mask == "list":
        return f"{_pos(hv)} < q_n"
    if spec.block_mask in ("static", "table"):
        return f"{hv} * nq + {qv} <= p_last" if spec.group_size > 1 else f"{qv} <= p_last"
    return f"{hv} < {spec.group_size}" if spec.group_size > 1 else f"{qv} < nq"


def _emit_pair_range(c: _Code, spec: FA2BackwardSpec) -> None:
    """hc, qc = the first non-empty (head of the group, q tile) pair, p_last the last one's number (hv * nq + qv),
    by a ballot over 32 pairs at a time (emit_fa2.emit_tile_scan: the block is whole warpgroups); without a block
    mask, pair 0 and the last. Under block lists (block_data.py: this kv tile's non-empty pairs, made once per
    data), the list's first entry: no scan."""
    G = spec.group_size
    if spec.block_mask == "list":
        a = _list_args(spec)
        c("# the (head, q tile) pairs this kv tile visits, listed once per data (block_data.py): no scan, no empty")
        c("# pair")
        c("q_row = (b * HK + hk) * nk + kj")
        c(f"q_n = {a['q_count']}[q_row]")
        c(f"q_row = q_row * (nq * {G})" if G > 1 else "q_row = q_row * nq")
        c("pc = 0")
        _emit_list_pair(c, spec, "hc", "qc")
        if list_ahead(spec):
            c(f"e_nx = {_entry(spec, '1', guarded=True)}  # the next entry, read a tile ahead")
        return
    if spec.block_mask not in ("static", "table"):
        c("hc = 0")
        c("qc = 0")
        return
    hv = (lambda j: f"({j}) // nq") if G > 1 else (lambda j: "0")
    emit_tile_scan(c, lambda j: _class_expr(spec, hv(j), f"({j}) % nq" if G > 1 else j), f"nq * {G}" if G > 1
                   else "nq", "p_first", "p_last")
    c("hc = p_first // nq" if G > 1 else "hc = 0")
    c("qc = p_first - hc * nq" if G > 1 else "qc = p_first")


def _emit_step(c: _Code, spec: FA2BackwardSpec, hv: str, qv: str) -> None:
    """(hv, qv) = the pair after it in (head, q tile) order; under block lists, the list's next entry."""
    if spec.block_mask == "list":
        p = _pos(hv)
        c(f"{p} += 1")
        if list_ahead(spec):
            _emit_list_pair(c, spec, hv, qv, "e_nx")
            c(f"e_nx = {_entry(spec, f'{p} + 1', guarded=True)}")
        else:
            _emit_list_pair(c, spec, hv, qv)
        return
    c(f"{qv} += 1")
    if spec.group_size > 1:
        c(f"if {qv} == nq:")
        with c.indent():
            c(f"{qv} = 0")
            c(f"{hv} += 1")


def _emit_list_pair(c: _Code, spec: FA2BackwardSpec, hv: str, qv: str, entry: Optional[str] = None) -> None:
    """(hv, qv) = the pair at the list position of hv (entries it * 2 + partial, it = hv * nq + qv ascending), or
    (0, 0) past the list's end; `entry` names a register already holding that entry (list_ahead). The head by
    subtraction (at most G turns), not a division by the run-time nq."""
    p = _pos(hv)
    c(f"{qv} = ({entry or _entry(spec, p)} >> 1) if {p} < q_n else 0")
    c(f"{hv} = 0")
    if spec.group_size > 1:
        c(f"while {qv} >= nq:")
        with c.indent():
            c(f"{qv} -= nq")
            c(f"{hv} += 1")


def _emit_skip_empty(c: _Code, spec: FA2BackwardSpec, hv: str, qv: str) -> None:
    if spec.block_mask in ("static", "table"):  # a list holds no empty pair
        c(f"while {_more(spec, hv, qv)} and {_class_expr(spec, hv, qv)} == 0:")
        with c.indent():
            _emit_step(c, spec, hv, qv)


def _emit_kernel(spec: FA2BackwardSpec) -> str:
    D, BQ, BK, G = spec.head_dim, spec.block_q, spec.block_k, spec.group_size
    NT = consumer_threads(spec)  # the threads that load and compute (dq_ws's producer warpgroup after them)
    NWG = BK // 64  # warpgroups
    WS = dq_ws(spec)
    WSL = ws_loads(spec)
    RG = BQ // 64  # dQ's 64-row groups
    KSPLIT = dq_split(spec) == "k"  # each warpgroup: its own kv rows, every column
    CS = _col_splits(spec)  # warpgroups sharing one row group (they split D)
    BULK = dq_bulk(spec)
    DKL = dk_after_dq(spec)
    LATE = dq_late(spec)
    PDP = p_under_dp(spec)
    AHEAD = sdp_ahead(spec)
    PP = bwd_pingpong(spec)
    ALT = dq_alternate(spec)
    PITCH = _dq_stage_pitch(spec)
    DC = D // CS  # dQ columns of one warpgroup
    # bwd_pingpong and dq_alternate at D = 128: dQ's product and hand-off in two column halves
    DQH = 2 if (PP or ALT) and DC > 64 else 1
    DQN = DC // DQH  # dQ's columns a product (N of its wgmma)
    KQ = 64 // 16 if KSPLIT else BK // 16  # k16 steps of dQ's product
    NJ = BQ // 8  # n8 tiles of S^T along q
    KS = D // 16  # k16 steps of K Q^T
    ND = D // 8
    lay = _layout(spec)
    KO, VO, QO, DOO, DSO, STO = lay["K"], lay["V"], lay["Q"], lay["DO"], lay["DS"], lay["ST"]
    TQ = lay["qt"]
    PERS = persistent(spec)
    pack = "pack_f16x2" if spec.dtype == "f16" else "pack_bf16x2"
    kind = spec.dtype
    table = ", table" if spec.block_mask == "table" else ""
    caps = _cap_args(spec)
    # the column offset of warpgroup column split cs = 1 inside K's [D // 64][BK][128 B] tile (cs <= 1 here)
    col1 = (DC // 64) * BK * 128 + (DC % 64) * 2

    c = _Code()
    items = contextlib.ExitStack()  # a persistent kernel's item loop, open from the item's start to its epilogue
    c(f'WG_S = wgmma_ss("{kind}", {BQ})  # S^T = K Q^T, dP^T = V dO^T: both operands K-major')
    c(f'WG_D = wgmma_rs("{kind}", {D}, 1)  # dV += P^T dO, dK += dS^T Q: A in registers, dO / Q MN-major')
    c(f'WG_Q = wgmma_ss("{kind}", {DQN}, 1, 1)  # dQ = dS K: dS^T MN-major (trans-a), K MN-major (trans-b)')
    c(f"FENCE_S = wgmma_fence_regs({BQ // 2})")
    c(f"WAIT_S = wgmma_wait_regs(0, {BQ // 2})")
    c(f"FENCE_D = wgmma_fence_regs({D // 2})")
    c(f"WAIT_D = wgmma_wait_regs(0, {D // 2})")
    c(f"FENCE_Q = wgmma_fence_regs({DQN // 2})")
    c(f"WAIT_Q = wgmma_wait_regs(0, {DQN // 2})")
    if DKL:
        c(f"WAIT_Q1 = wgmma_wait_regs(1, {DQN // 2})  # dQ's group done, dK's (issued after it) in flight")
    elif AHEAD == "dq":
        c(f"WAIT_QA = wgmma_wait_regs(1, {DC // 2})  # dQ's group done, the next tile's S^T / dP^T in flight")
    if PDP:
        c(f"WAIT_S1 = wgmma_wait_regs(1, {BQ // 2})  # S^T's group done, dP^T's (committed after it) in flight")
    DVE = dv_under_dp(spec)
    if DVE:
        c(f"WAIT_P1 = wgmma_wait_regs(1, {BQ // 2})  # dP^T's group done, dV's (committed after it) in flight")
    INTILE = dkdv_in_tile(spec)
    if INTILE:
        c(f"WAIT_D1 = wgmma_wait_regs(1, {D // 2})  # dV's and dK's group done, dQ's (committed after it) in flight")
    if WS and NWG > 1:
        c(f"SETMAXNREG_DEC = setmaxnreg_dec({DQ_WS_REGS[0]})  # dq_ws: the producer's registers to the consumers")
        c(f"SETMAXNREG_INC = setmaxnreg_inc({DQ_WS_REGS[1]})")
    if WS:
        NS = dq_ws_slabs(spec)
        c(f"DQ_FULL = {DQ_WS_BAR + 1}  # dq_ws's named barriers: DQ_FULL + {NS} w + s, warpgroup w's slab s written;")
        c(f"DQ_FREE = {DQ_WS_BAR + 1 + NWG * NS}  # DQ_FREE + {NS} w + s, read")
        if WSL:
            c(f"LD_REQ = {DQ_WS_BAR + 1 + 2 * NWG * NS}  # ws_loads: the next tile's request to the loader warps")
        if PP:
            c(f"PP_WG = {DQ_WS_BAR + 2 + 2 * NWG * NS}  # bwd_pingpong: PP_WG + w, warpgroup w's own barrier (128)")
            c(f"PP_TURN = {DQ_WS_BAR + 2 + 2 * NWG * NS + NWG}  # PP_TURN + w: the other warpgroup issued its S^T, "
              "dP^T: w's turn")
        if ALT:
            c(f"DS_FREE = {DQ_WS_BAR + 2 + 2 * NWG * NS}  # dq_alternate: the last tile's dQ GEMM has read dS^T (the "
              "other warpgroup waits)")
    c("HI_KM = desc_hi(16, 1024)  # K-major: 8-row groups 1024 bytes apart")
    c(f"HI_QT = desc_hi({BQ * 128}, 1024)  # Q, dO MN-major: 64-column blocks {BQ * 128} bytes apart")
    c(f"HI_KV = desc_hi({BK * 128}, 1024)  # dS^T, K MN-major: 64-column blocks {BK * 128} bytes apart")
    c()
    c("@kernel_jit")
    if WS and NWG > 1:
        c(f"@launch_bounds({threads(spec)}, 1)  # .maxntid (setmaxnreg needs it): every thread starts at "
          f"{65536 // threads(spec) // 8 * 8} registers")
    maps = ", dkmap, dvmap" if dkdv_maps(spec) else ""
    c(f"def {spec.name}(q, k, v, lse, do, delta, dq32, dk, dv, B, H, M, N, {STRIDES}{table}{_grad_args(spec)}"
      f"{maps}{caps}):")
    with c.indent():
        c(f'"""FA backward on wgmma: D={D}, tiles {BQ}x{BK}, {NWG} warpgroup(s) x 64 kv rows, {kind}."""')
        c("smem = cuda.shared.array(0, SMEM_DTYPE)")
        c("smem_w = cuda.shared.array(0, SMEM_U32)  # the same bytes as 32-bit words (dS^T stores)")
        c("smem_f = cuda.shared.array(0, SMEM_F32)  # ... and as f32 (lse, delta of the q tiles)")
        c("sb0 = smem_base(smem)")
        c(f"sb = sb0 + (({ALIGN} - (sb0 & {ALIGN - 1})) & {ALIGN - 1})  # 1024-byte aligned base")
        c("sbr = sb - sb0  # the aligned base as a byte offset into the arrays")
        if not PERS:  # a persistent kernel makes them per item
            _emit_thread_indices(c, per_item=False)
        if dkdv_maps(spec):
            c("dkmap_g = elem_addr(dkmap, (0,))  # dK's and dV's tensor maps in global memory "
              f"({'dkdv_in_tile' if INTILE else 'dkdv_tma'})")
            c("dvmap_g = elem_addr(dvmap, (0,))")
            c("if lane == 0:  # the lanes that store by them")
            with c.indent():
                c("tensormap_acquire(dkmap_g)")
                c("tensormap_acquire(dvmap_g)")
        c("__OFFSETS__")
        c(f"nq = (M + {BQ - 1}) // {BQ}")
        c(f"nk = (N + {BK - 1}) // {BK}")
        c(f"HK = H // {G}" if G > 1 else "HK = H")
        item = _emit_item_start(c, spec, items)
        _, decode, comment = _grid_order(spec)
        for line in comment:
            c(line)
        for name, expr in decode:
            c(f"{name} = {expr.format(x=item[0], y=item[1], z=item[2])}")
        if PERS:
            emit_persistent_next(c, None, ("it_gx", "it_gy"))
            _emit_thread_indices(c, per_item=True)
        if kv_group(spec):
            c("if hk >= HK:  # the last group's places past the heads (kv_group not dividing them)")
            with c.indent():
                c("continue" if PERS else "return")
        if WSL:
            c("if tid == 0:  # ws_loads: each Q / dO buffer's mbarrier, its loaders' copies and rows")
            with c.indent():
                for k in range(2):
                    c(f"mbar_init(sb + {lay['MBAR'] + 8 * k}, {2 * WS_LOADERS})")
            c(f"bar_sync(0, {threads(spec)})  # the mbarriers are initialised (the block's only barrier of all)")
        if WS:
            _emit_dq_producer(c, spec, lay)
        c(f"kv0 = kj * {BK}")
        c("kv_head = (b * HK + hk) * N")
        c()
        rstep = _emit_loader_setup(c, NT, D)
        c("# K and V of this kv tile, once")
        emit_bases(c, ("k", "v"), ("hk", "hk"))
        _emit_load(c, BK, rstep, D, f"sb + {KO}", "kv0", "N", "k", "kg", "k_sm")
        _emit_load(c, BK, rstep, D, f"sb + {VO}", "kv0", "N", "v", "vg", "v_sm")
        c()
        c("# the first and last non-empty (head of the group, q tile)")
        _emit_pair_range(c, spec)

        def load_q_tile(hv: str, q0v: str, bufv: str) -> None:
            c(f"hq = hk * {G} + {hv}" if G > 1 else "hq = hk")
            c("qh = (b * H + hq) * M")
            emit_bases(c, ("q", "do"), ("hq", "hq"))
            # a tile inside M from this (b, head)'s row addresses: an add a copy, not the row loads' 64-bit index
            # and bound (~7 instructions a copy)
            _emit_row_addresses(c, "q", "qg", "q_sm", rstep)
            _emit_row_addresses(c, "do", "dog", "do_sm", rstep)
            _emit_load_inside(c, BQ, rstep, D, f"sb + {QO} + {bufv} * {TQ}", q0v, "M", "q", "qg", "q_sm")
            _emit_load_inside(c, BQ, rstep, D, f"sb + {DOO} + {bufv} * {TQ}", q0v, "M", "do", "dog", "do_sm")

        c(f"if {_more(spec, 'hc', 'qc')}:")
        with c.indent():
            load_q_tile("hc", f"qc * {BQ}", "0")
            c(f"if tid < {BQ}:")
            with c.indent():
                c(f"qq = qc * {BQ} + tid")
                c(f"smem_f[((sbr + {STO}) >> 2) + tid] = {lse_read(spec, 'lse[qh + qq]')} if qq < M else ZERO")
                c(f"smem_f[((sbr + {STO}) >> 2) + {2 * BQ} + tid] = {delta_read(spec, 'delta[qh + qq]')} if qq < M else ZERO")
        c("cp_async_commit()")
        c()
        c("# dK and dV: rows g and g + 8 of this warp's 16 kv rows, in registers over every q tile; S^T, dP^T per")
        c("# tile; this warpgroup's dQ fragment of a tile")
        c(f"dkacc = cuda.local.array({D // 2}, np.float32)")
        c(f"dvacc = cuda.local.array({D // 2}, np.float32)")
        c(f"sacc = cuda.local.array({BQ // 2}, np.float32)")
        c(f"pacc = cuda.local.array({BQ // 2}, np.float32)")
        c(f"dqa = cuda.local.array({DQN // 2}, np.float32)")
        c(f"{zero_helper(c, D // 2)}(dvacc)")
        c(f"{zero_helper(c, D // 2)}(dkacc)")
        c("# descriptors' addresses of this warpgroup: its 64 kv rows of K and V (A of S^T, dP^T), its dQ row group")
        c("# of dS^T and column range of K (A and B of dQ)")
        c(f"k_wg = sb + {KO} + wg * {64 * 128}")
        c(f"v_wg = sb + {VO} + wg * {64 * 128}")
        c(f"rgw = wg % {RG}" if RG > 1 else "rgw = 0")
        c(("csw = wg" if RG == 1 else f"csw = wg // {RG}") if CS > 1 else "csw = 0")
        if KSPLIT:
            c("# dQ split over kv rows: this warpgroup's own 64 rows of dS^T and K, every column")
            c(f"ds_wg = sb + {DSO} + wg * {64 * 128}")
            c(f"kt_wg = sb + {KO} + wg * {64 * 128}")
        else:
            c(f"ds_wg = sb + {DSO} + rgw * {BK * 128}")
            c(f"kt_wg = sb + {KO} + csw * {col1}")
        c("# dS^T word offsets of this thread's rows r = warp * 16 + g (+ 8), at its 4 bytes of a 16-byte chunk;")
        c("# chunk j of a row r sits at chunk j ^ (r & 7) = j ^ g")
        c(f"dsw0 = (sbr + {DSO} + (warp * 16 + g) * 128 + 2 * t2) >> 2")
        c("dsw1 = dsw0 + 256")
        if BULK:
            c("odd = (lane & 1) == 1")
            c("dqg = np.uint64(0)  # the staged dQ row this lane hands over next (0: none)")
        if LATE:
            c("dq_at = -1  # the last tile's dQ fragment: its reductions' first index into dq32 (-1: none pending)")
        if WS:
            c("dqs = 0  # dq_ws: the slab this warpgroup writes next")
        if WSL:
            c("tn = 0  # ws_loads: tiles done (tile t > 0 waits its buffer's mbarrier at parity ((t - 1) >> 1) & 1)")
        c("buf = 0")
        c("nl = ZERO")
        c("nd = ZERO")
        HOLD = held_grads(spec)
        if HOLD:
            c("# the reduced gradients (a head's slope) held across tiles: one add a warp and index")
            _emit_grad_hold_start(c, spec)
        GROUPS = grouped_grads(spec)
        V4 = v4_grads(spec)
        RV = {b_: read_v4(spec, b_) for b_ in spec.branches}
        GRID = bool(V4) or any(RV.values())
        if GRID:
            c("g4 = (lane >> 2) & 3  # v4_grads / read_v4: this lane's place among the four lanes of its t2, 4 rows")
        for i in V4:
            _, tq, tk = _grid_shape(spec, i)
            c(f"gvec{i} = {_grid_covers(tq, tk)} and (elem_addr(grad_{i}, (0,)) & 15) == 0")
        for cap, n in sorted({x for v in RV.values() for x in v}):
            table = _cap_names(spec)[cap]
            cover = _grid_covers(f"{table}.shape[{n - 2}]", f"{table}.shape[{n - 1}]")
            c(f"rvec{cap} = rows_aligned16({table}) and {cover}  "
              "# (a row's last 16 bytes inside it: a sliced table's too)")

        def offset(i: int, jj: int, e: int, r: int) -> int:
            """Element (jj, e, r)'s index offset from the thread's base for grouped gradient i: its group."""
            a, bb = GROUPS[i]
            return a * (8 * jj + e) + bb * 8 * r

        # per grouped gradient: its groups, the distinct offsets of a thread's elements
        keys = {i: sorted({offset(i, jj, e, r) for jj in range(NJ) for e in range(2) for r in range(2)})
                for i in GROUPS}
        c("cp_async_wait0()  # K, V and the first Q, dO have landed")
        c("fence_proxy_async()  # ... visible to wgmma's async proxy (the loop's first barrier: to everyone)")
        which = _opaque(spec)

        def issue_sdp(qbv: str, obv: str) -> None:
            """S^T = K Q^T and dP^T = V dO^T of the tile whose Q and dO sit at qbv, obv (k_wl, v_wl set)."""
            c(f"# S^T = K Q^T and dP^T = V dO^T: {KS} + {KS} wgmma m64n{BQ}k16; k step s reads 16 columns of D:")
            c("# block s // 4, byte 32 * (s % 4)")
            c("FENCE_S(sacc, 0)")
            c("FENCE_S(pacc, 0)")
            c("# descriptors: a word a tile and operand, plus a k step's offset >> 4 (desc_at: one mov a wgmma where")
            c("# make_desc cost ~6 uniform instructions)")
            for nm, base in (("k", "k_wl"), ("q", qbv), ("v", "v_wl"), ("o", obv)):
                c(f"w_{nm} = desc_word(HI_KM, {base})")
            for acc, A, B in (("sacc", "w_k", "w_q"), ("pacc", "w_v", "w_o")):
                for ks in range(KS):
                    a = ((ks // 4) * BK * 128 + (ks % 4) * 32) >> 4
                    bq = ((ks // 4) * BQ * 128 + (ks % 4) * 32) >> 4
                    c(f"WG_S({acc}, 0, desc_at(HI_KM, {A} + {a}), desc_at(HI_KM, {B} + {bq}), {int(ks > 0)})")
                if PDP and acc == "sacc":
                    c("wgmma_commit()  # S^T's group, waited for before dP^T's")
            c("wgmma_commit()")

        def issue_ahead() -> None:
            """sdp_ahead: the next tile's (hn, qn) S^T and dP^T from the other buffer, once its Q and dO are there;
            past the last tile as well (a stale buffer's, never read): every path then reaches the loop's top with
            the one group in flight, where a conditional issue made ptxas serialize every wgmma (C7515)."""
            if WSL:
                c(f"if {_more(spec, 'hn', 'qn')}:  # sdp_ahead: the next tile's Q, dO from the loaders")
                with c.indent():
                    c(f"mbar_wait(sb + {lay['MBAR']} + (buf ^ 1) * 8, (tn >> 1) & 1)")
                    c("fence_proxy_async()  # their copies visible to wgmma's async proxy")
            c("# sdp_ahead: the next tile's S^T and dP^T, under this tile's end (past the last tile: unread)")
            issue_sdp(f"sb + {QO} + (buf ^ 1) * {TQ}", f"sb + {DOO} + (buf ^ 1) * {TQ}")

        if AHEAD:
            c("# sdp_ahead: the first tile's S^T and dP^T before the loop (with no tile: unread)")
            c("cuda.syncthreads()  # every consumer's copies of the first Q, dO")
            for nm in ("k", "v"):
                c(f"{nm}_wl = opaque_u32({nm}_wg)" if nm in which else f"{nm}_wl = {nm}_wg")
            issue_sdp(f"sb + {QO}", f"sb + {DOO}")
        if PERS:
            c("bulk_wait_read0()  # the last item's dK / dV copies (this thread's) have read their staging: the loop's")
            c("# first barrier (or the epilogue's, with no tile) orders every thread's wait before it is written again")
        if INTILE:
            c(f"dkv_in_loop = {_more(spec, 'hc', 'qc')}  # dkdv_in_tile: the walk's last tile stages dK and dV")
        if PP:
            c("cuda.syncthreads()  # bwd_pingpong: every consumer's K, V and first Q, dO copies and statistics; from")
            c("# here on each warpgroup waits only for itself, and for the other at its turns")
            c("if wg == 1:")
            with c.indent():
                c(f"bar_arrive(PP_TURN, {NT})  # bwd_pingpong: warpgroup 0 issues its S^T, dP^T first")
        if ALT:
            c("cuda.syncthreads()  # dq_alternate: every consumer's K, V and first Q, dO copies and statistics; from")
            c("# here on the warpgroups meet only at dS^T (its barrier, DS_FREE) and at ws_loads' requests")
        c(f"while {_more(spec, 'hc', 'qc')}:")
        with c.indent():
            c("hn = hc")
            c("qn = qc")
            if spec.block_mask == "list":
                c("pn = pc")
            _emit_step(c, spec, "hn", "qn")
            _emit_skip_empty(c, spec, "hn", "qn")
            c("# this tile's Q, dO landed before the last tile's dS^T barrier; here everyone is done with the other")
            c("# buffers and dS^T (their wgmmas waited). No fence here: its MEMBAR waited for the last tile's dQ")
            c("# reductions to reach L2 (ncu: 7% of the stall samples on the fence)")
            if WSL and not AHEAD:  # (sdp_ahead waited for them before issuing this tile's S^T, dP^T)
                c("if tn > 0:  # this tile's Q, dO, LSE, Delta from the loader warps (the first: our own loads)")
                with c.indent():
                    c(f"mbar_wait(sb + {lay['MBAR']} + buf * 8, ((tn - 1) >> 1) & 1)")
                    c("fence_proxy_async()  # their copies visible to wgmma's async proxy")
            if PP:
                c("bar_sync(PP_WG + wg, 128)  # bwd_pingpong: this warpgroup's last dQ GEMM has read its dS^T rows")
            elif ALT:
                c("dqwg = wg == (tn & 1)  # dq_alternate: this tile's dQ is this warpgroup's (no barrier here: the")
                c("# other buffer is guarded by LD_REQ's count of both warpgroups, dS^T by DS_FREE)")
            else:
                c("cuda.syncthreads()")
            if WSL:
                _emit_load_request(c, spec, lay, _more(spec, "hn", "qn"), f"hk * {G} + hn" if G > 1 else "hk",
                                   f"qn * {BQ}")
            else:
                c(f"if {_more(spec, 'hn', 'qn')}:")
                with c.indent():
                    load_q_tile("hn", f"qn * {BQ}", "(buf ^ 1)")
                    c(f"if tid < {BQ}:")
                    with c.indent():
                        c(f"qq = qn * {BQ} + tid")
                        c(f"nl = {lse_read(spec, 'lse[qh + qq]')} if qq < M else ZERO")
                        c(f"nd = {delta_read(spec, 'delta[qh + qq]')} if qq < M else ZERO")
                c("cp_async_commit()")
            _emit_grid_prefetch(c, spec, RV[spec.branches[0]], _more(spec, "hn", "qn"),
                                f"hk * {G} + hn" if G > 1 else "hk", f"qn * {BQ}", caps)
            c(f"h = hk * {G} + hc" if G > 1 else "h = hk")
            c(f"q0 = qc * {BQ}")
            c("q_head = (b * H + h) * M")
            c(f"interior = q0 + {BQ} <= M and kv0 + {BK} <= N")
            if len(spec.branches) > 1:
                c(f"cls = {_class_expr(spec, 'hc', 'qc')}")
            if which:
                c("# loop-invariant operands' addresses made opaque once a tile: their descriptors are built here,")
                c("# not hoisted out of the loop (2 registers each)")
            for nm in ("k", "v", "ds", "kt"):
                c(f"{nm}_wl = opaque_u32({nm}_wg)" if nm in which else f"{nm}_wl = {nm}_wg")
            c(f"qb = sb + {QO} + buf * {TQ}")
            c(f"ob = sb + {DOO} + buf * {TQ}")
            c(f"lse_f = ((sbr + {STO}) >> 2) + buf * {BQ}")
            c(f"dlt_f = lse_f + {2 * BQ}")
            c()
            if AHEAD:
                c("# (sdp_ahead: this tile's S^T and dP^T were issued before the loop or at the last tile's end)")
            else:
                if PP:
                    c(f"bar_sync(PP_TURN + wg, {NT})  # bwd_pingpong: the other warpgroup has issued its S^T, dP^T")
                issue_sdp("qb", "ob")
                if PP:
                    c(f"bar_arrive(PP_TURN + (wg ^ 1), {NT})  # bwd_pingpong: the other's turn")
            if BULK:
                c("# the last tile's staged dQ rows to the copy engine while S^T and dP^T are computed")
                _emit_dq_issue(c, DC, lay["DQ"], PITCH)
            if LATE:
                c("# the last tile's dQ reductions while S^T and dP^T are computed")
                _emit_dq_late_issue(c, DC // 8)
            if read_early(spec):
                if GRID:
                    c("gkv = kv0 + warp * 16 + (g & 4) + 8 * (g4 >> 1)  # read_v4: this lane's 4 kv rows' first")
                _emit_early_reads(c, spec, caps)
            if PDP:
                c("WAIT_S1(sacc, 0)  # S^T; dP^T's GEMM still in flight under P's exponentials")
            else:
                c("WAIT_S(sacc, 0)")
                c("WAIT_S(pacc, 0)")
            c()
            c("# per element: P and dS from the IR's elementwise code (sacc becomes P^T, pacc dS^T)")
            for i, gr in enumerate(spec.grads):
                if gr.reduced:
                    c(f"gsum{i} = ZERO")
            for i in GROUPS:  # the thread's base index (its first q column and kv row); its groups' sums
                c(f"gbase{i} = gidx{i}_fn(b, h, hk, q0 + t2, kv0 + warp * 16 + g{caps})")
                for k in keys[i]:
                    c(f"gd{i}_{_key(k)} = ZERO")
            if not spec.grads:
                c("kvr = kv0 + warp * 16 + g  # this thread's first kv row (the second is kvr + 8)")
            if GRID and not read_early(spec):
                c("gkv = kv0 + warp * 16 + (g & 4) + 8 * (g4 >> 1)  # v4_grads / read_v4: this lane's 4 kv rows' first")

            itr = ["interior"]  # the elementwise calls' interior argument: a literal in interior_split's copies

            def elementwise(branch: str) -> None:
                if not spec.grads and not RV[branch]:  # a helper call per (n8 tile, column) or column pair
                    if stat_pairs(spec):
                        fn = _elem_pair_helper(c, spec, branch)
                        for jj in range(NJ):
                            c(f"{fn}(sacc, pacc, ofs_{jj * 4}, ofs_{jj * 8}, sb0, lse_f, dlt_f, q0, t2, kvr, b, h, "
                              f"hk, {itr[0]}{caps})")
                        return
                    fn = _elem_quad_helper(c, spec, branch)
                    for jj in range(NJ):
                        for e in range(2):
                            c(f"{fn}(sacc, pacc, ofs_{jj * 4 + e}, ofs_{jj * 8 + e}, smem_f, lse_f, dlt_f, q0, t2, "
                              f"kvr, b, h, hk, {itr[0]}{caps})")
                    return
                outs_g = _grad_outs(spec)
                for j, (cap, n) in enumerate(RV[branch]):
                    if n > 2 and not read_early(spec):  # read j's leading indices (the tile's), once a tile
                        c(f"gl{j}_ = gtab{j}_{branch}_fn(b, h, hk, q0, kv0{caps})")
                for jj in range(NJ):
                    given = _emit_grid_reads(c, spec, branch, jj)
                    for e in range(2):
                        c(f"qi = q0 + {jj * 8 + e} + t2")
                        c(f"lq = lget(smem_f, lse_f + t2 + {jj * 8 + e})")
                        c(f"dq_ = lget(smem_f, dlt_f + t2 + {jj * 8 + e})")
                        for r in range(2):
                            i = 2 * r + e
                            outs = [SA(jj, i), PA(jj, i)] + [x for og in outs_g for x in og]
                            c(_elem_call(spec, branch, SA(jj, i), PA(jj, i), "lq", "dq_", "qi",
                                         f"kv0 + warp * 16 + {8 * r} + g", outs, itr[0],
                                         tuple(x.format(2 * r + e) for x in given)))
                            _emit_grad_element(c, spec, groups={
                                gi: f"gd{gi}_{_key(offset(gi, jj, e, r))}" for gi in GROUPS},
                                stash={gi: f"gv{gi}_{2 * r + e}" for gi in V4})
                            if jj == 0 and e == 0 and r == 0:
                                for gi in V4:
                                    _emit_grid_lead(c, spec, gi)
                    for gi in V4:
                        _emit_grid_adds(c, spec, gi, jj)

            def split_part(k: int, arrays: str, stats: str):
                """p_under_dp's part k for one branch: 0 P^T in sacc from S^T alone, 1 dS^T in pacc from P^T, dP^T."""
                def emit(branch: str) -> None:
                    fn = _elem_split_helpers(c, spec, branch)[k]
                    for jj in range(NJ):
                        for e in range(2):
                            c(f"{fn}({arrays}, ofs_{jj * 4 + e}, ofs_{jj * 8 + e}, smem_f, {stats}, q0, t2, kvr, b, h, "
                              f"hk, {itr[0]}{caps})")
                return emit

            def pack_one(name: str, v: str) -> str:
                """A helper packing one accumulator's k step (4 words of 2) for a register-A wgmma."""
                return c.helper(name, [
                    "@device_function", f"def {name}(x, i):",
                    *[f"    {v}{e} = {pack}(lget(x, i + {2 * e}), lget(x, i + {2 * e + 1}))" for e in range(4)],
                    f"    return {', '.join(f'{v}{e}' for e in range(4))}"])

            def emit_dv_issue() -> None:
                """dv_under_dp: dV += P^T dO from P^T's packed registers, its own group, before dP^T's wait."""
                c(f"# dV += P^T dO: {BQ // 16} wgmma m64n{D}k16 from P^T's packed registers, issued before dP^T's wait")
                c("# (they need every exponential first), in flight under the dS part")
                pp = pack_one("pack_p", "pa")
                c("FENCE_D(dvacc, 0)")
                c("t_o = desc_word(HI_QT, ob)")
                for kk in range(BQ // 16):
                    c(f"pa0, pa1, pa2, pa3 = {pp}(sacc, ofs_{kk * 8})")
                    c(f"WG_D(dvacc, 0, pa0, pa1, pa2, pa3, desc_at(HI_QT, t_o + {kk * 128}), 1)")
                c("wgmma_commit()  # dV's group")

            def by_class(emit) -> None:
                emit_by_class(c, spec.branches, emit)

            def by_interior(emit) -> None:
                """emit's calls once, or (interior_split) twice: interior tiles with a literal True, so the IR's
                bounds selects fold away, and the ragged ones as written."""
                if not interior_split(spec):
                    by_class(emit)
                    return
                c("if interior:  # no bounds code: the IR's bounds selects fold away")
                with c.indent():
                    itr[0] = "True"
                    by_class(emit)
                c("else:")
                with c.indent():
                    itr[0] = "interior"
                    by_class(emit)

            if PDP:
                by_interior(split_part(0, "sacc", "lse_f"))
                if DVE:
                    emit_dv_issue()
                    c("WAIT_P1(pacc, 0)  # dP^T; dV's group still in flight under dS")
                else:
                    c("WAIT_S(pacc, 0)  # dP^T")
                by_interior(split_part(1, "sacc, pacc", "lse_f, dlt_f"))
            else:
                by_interior(elementwise)
            if HOLD:
                _emit_grad_hold(c, spec)
            else:
                _emit_grad_tile_end(c, spec, warp_reduce=True)
            for i in GROUPS:  # each group's sum once, at its entry (clamped as the gather clamps)
                table = _cap_names(spec)[spec.grads[i].capture]
                last = spec.grads[i].n_index - 1
                for k in keys[i]:
                    c(f"if gd{i}_{_key(k)} != ZERO:")
                    with c.indent():
                        ent = f"min(max(gbase{i} + {k}, 0), {table}.shape[{last}] - 1)"
                        c(f"cuda.atomic.add(grad_{i}, {_flat_index(spec, i, last=ent)}, gd{i}_{_key(k)})")
            c()
            c(f"# dV += P^T dO and dK += dS^T Q: {BQ // 16} + {BQ // 16} wgmma m64n{D}k16, A packed from the")
            c("# accumulators (n8 tiles 2k, 2k + 1 are k step k), k step k reads q rows 16k .. 16k + 15 (2048 bytes on);")
            c("# dS^T's words to shared memory for dQ meanwhile")
            pk = c.helper("pack_pd", [
                "@device_function", "def pack_pd(x, y, i):",
                *[f"    {v}{e} = {pack}(lget({arr}, i + {2 * e}), lget({arr}, i + {2 * e + 1}))"
                  for v, arr in (("pa", "x"), ("da", "y")) for e in range(4)],
                "    return pa0, pa1, pa2, pa3, da0, da1, da2, da3"])
            st = c.helper("store_dst_wg", [
                "@device_function", "def store_dst_wg(smem_w, w0, w1, o0, o1, d0, d1, d2, d3):",
                "    smem_w[w0 + o0] = d0",
                "    smem_w[w1 + o0] = d1",
                "    smem_w[w0 + o1] = d2",
                "    smem_w[w1 + o1] = d3"])
            if ALT:
                c("if dqwg and tn > 0:")
                with c.indent():
                    c(f"bar_sync(DS_FREE, {NT})  # dq_alternate: the other warpgroup's dQ GEMM of the last tile "
                      "has read dS^T")
            if not DVE:
                c("FENCE_D(dvacc, 0)")
            if not DKL:
                c("FENCE_D(dkacc, 0)")
            if not DVE:
                c("t_o = desc_word(HI_QT, ob)")
            c("t_q = desc_word(HI_QT, qb)")
            # dk_after_dq keeps each k step's packed dS (da<k>_<e>) for dK's GEMM after dQ's
            da = [[f"da{kk}_{e}" if DKL else f"da{e}" for e in range(4)] for kk in range(BQ // 16)]
            for kk in range(BQ // 16):
                if DVE:  # (dV's GEMM was issued before dP^T's wait)
                    c(f"{', '.join(da[kk])} = {pack_one('pack_d', 'da')}(pacc, ofs_{kk * 8})")
                else:
                    c(f"pa0, pa1, pa2, pa3, {', '.join(da[kk])} = {pk}(sacc, pacc, ofs_{kk * 8})")
                    c(f"WG_D(dvacc, 0, pa0, pa1, pa2, pa3, desc_at(HI_QT, t_o + {kk * 128}), 1)")
                if not DKL:
                    c(f"WG_D(dkacc, 0, {', '.join(da[kk])}, desc_at(HI_QT, t_q + {kk * 128}), 1)")
                j0, j1 = 2 * kk, 2 * kk + 1  # n8 tiles (8 q columns: one 16-byte chunk) of this k step
                o0 = f"{(j0 // 8) * BK * 32} + (({j0 % 8} ^ g) << 2)"
                o1 = f"{(j1 // 8) * BK * 32} + (({j1 % 8} ^ g) << 2)"
                c(f"{st}(smem_w, dsw0, dsw1, {o0}, {o1}, {', '.join(da[kk])})")
            if not (DVE and DKL):  # (an empty group costs a dummy HGMMA ptxas adds)
                c("wgmma_commit()")
            c("cp_async_wait0()  # the next tile's Q, dO (issued at this tile's top) have landed")
            c("fence_proxy_async()  # they and dS^T's generic stores visible to wgmma")
            if PP:
                c("bar_sync(PP_WG + wg, 128)  # bwd_pingpong: this warpgroup's dS^T rows are complete (its dQ reads "
                  "only them)")
            else:
                c("cuda.syncthreads()  # dS^T is complete, and the next tile's Q, dO")
            c()
            if ALT:
                _emit_dq_alternate(c, spec, lay, KQ, DQH)
            elif DQH > 1:
                c(f"# dQ rows 0 .. 63 of this q tile, this warpgroup's 64 kv rows of dS^T and K: dS K in {DQH} column")
                c(f"# parts of {DQN} (bwd_pingpong: 64 x {DC} f32 beside dK and dV exceed the 168 registers ptxas has")
                c("# under the launch bound, and it serialized every wgmma, C7512), each waited and handed off in turn")
                c("w_ds = desc_word(HI_KV, ds_wl)")
                c("w_kt = desc_word(HI_KV, kt_wl)")
                for hh in range(DQH):
                    c(f"FENCE_Q(dqa, 0)  # columns {hh * DQN} .. {hh * DQN + DQN - 1}")
                    _emit_dq_gemm(c, KQ, hh * DQN // 64 * BK * 8)  # K's 64-column block: BK * 128 bytes on
                    c("WAIT_Q(dqa, 0)" + ("  # (dV and dK's wgmmas are done too: one wait for every group)" if hh == 0
                                          else ""))
                    _emit_dq_handoff(c, spec, lay, "(b * H + h) * nq + qc + 1", (hh, DQH))
            else:
                c(f"# dQ rows 64 rgw .. + 63, columns {DC} csw .. of this q tile: dS K, {KQ} wgmma m64n{DC}k16, k step")
                c("# k reads kv rows 16k .. 16k + 15 of dS^T and K (2048 bytes on)"
                  + (" of this warpgroup's 64" if KSPLIT else ""))
                c("FENCE_Q(dqa, 0)")
                c("w_ds = desc_word(HI_KV, ds_wl)")
                c("w_kt = desc_word(HI_KV, kt_wl)")
                _emit_dq_gemm(c, KQ)
                if AHEAD == "dq":
                    issue_ahead()
                if INTILE:
                    c("WAIT_D1(dvacc, 0)  # dkdv_in_tile: dV's and dK's group done; dQ's (committed after it) in flight")
                    c("WAIT_D1(dkacc, 0)")
                    c(f"if not ({_more(spec, 'hn', 'qn')}):  # dkdv_in_tile: the walk's last tile; dV and dK are final")
                    with c.indent():
                        _emit_dkdv_in_tile(c, spec, pack)
                if DKL:
                    c(f"# dK += dS^T Q: {BQ // 16} wgmma m64n{D}k16 from dS's packed registers, in flight while dQ's")
                    c("# reductions issue")
                    c("FENCE_D(dkacc, 0)")
                    for kk in range(BQ // 16):
                        c(f"WG_D(dkacc, 0, {', '.join(da[kk])}, desc_at(HI_QT, t_q + {kk * 128}), 1)")
                    c("wgmma_commit()")
                    c("WAIT_Q1(dqa, 0)  # dV's and dQ's groups done; dK's still in flight")
                elif AHEAD == "dq":
                    c("WAIT_QA(dqa, 0)  # dQ's group and every one before it (dV, dK) done; the next S^T, dP^T in flight")
                else:
                    c("WAIT_Q(dqa, 0)  # (dV and dK's wgmmas are done too: one wait for every group)")
                c("# lanes t and t ^ 1 swap halves: even lanes then hold 4 consecutive columns of row g, odd lanes of row")
                c("# g + 8, added by one 16-byte vector reduction")
                if BULK:
                    _emit_dq_bulk(c, DC, D, lay["DQ"], PITCH)
                elif WS:
                    _emit_dq_handoff(c, spec, lay, "(b * H + h) * nq + qc + 1")
                else:
                    c("odd = (lane & 1) == 1")
                    c("qi = q0 + rgw * 64 + (warp & 3) * 16 + g + (8 if odd else 0)")
                    c(f"qrow = (q_head + qi) * {D} + csw * {DC} + (t2 - 2 if odd else t2)")
                    if LATE:
                        _emit_dq_swaps(c, DC // 8)
                        c("dq_at = qrow if qi < M else -1  # added under the next tile's first GEMMs (dq_late)")
                    else:
                        _emit_dq_reductions(c, DC // 8)
            if DKL:
                c("WAIT_D(dkacc, 0)  # dK's GEMM (it read this tile's Q, whose buffer the tile after next refills)")
            if AHEAD == "top":
                issue_ahead()
            if not WSL:  # (ws_loads: the loader warps wrote them)
                c(f"if {_more(spec, 'hn', 'qn')} and tid < {BQ}:")
                with c.indent():
                    c(f"smem_f[((sbr + {STO}) >> 2) + (buf ^ 1) * {BQ} + tid] = nl")
                    c(f"smem_f[((sbr + {STO}) >> 2) + {2 * BQ} + (buf ^ 1) * {BQ} + tid] = nd")
            else:
                c("tn += 1")
            c("hc = hn")
            c("qc = qn")
            if spec.block_mask == "list":
                c("pc = pn")
            c("buf ^= 1")
        c()
        if ALT:
            c("if tn > 0 and wg == (tn & 1):")
            with c.indent():
                c(f"bar_sync(DS_FREE, {NT})  # dq_alternate: the last tile's dQ warpgroup's arrival (each one matched)")
        if PP:
            c("if wg == 0:")
            with c.indent():
                c(f"bar_sync(PP_TURN, {NT})  # bwd_pingpong: warpgroup 1's last arrival (each one matched)")
        if HOLD:
            _emit_grad_hold_end(c, spec)
        if WSL:
            c("if tn == 0:  # no tile: the loader warps' end (else the last tile's top asked for none)")
            with c.indent():
                _emit_load_request(c, spec, lay, None, "0", "0")
        c("cp_async_wait0()")
        if AHEAD:
            c("WAIT_S(sacc, 0)  # sdp_ahead's last issue (unread)")
            c("WAIT_S(pacc, 0)")
        if BULK:
            c("# the last tile's staged dQ rows, read before the block's shared memory goes")
            _emit_dq_issue(c, DC, lay["DQ"], PITCH)
            c("bulk_wait_read0()")
        if LATE:
            c("# the last tile's dQ reductions")
            _emit_dq_late_issue(c, DC // 8)
        c("WAIT_D(dvacc, 0)")
        c("WAIT_D(dkacc, 0)")
        if INTILE:
            c("if not dkv_in_loop:  # dkdv_in_tile: no tile walked; dK and dV (zeros) staged and stored here")
            with c.indent():
                c("cuda.syncthreads()  # every thread's K, V copies have landed (each waited for its own): no loop")
                c("# barrier ordered them before V's rows are written")
                _emit_dkdv_in_tile(c, spec, pack)
            c("bulk_wait_read0()  # the copies have read the staging rows: shared memory may go")
        elif dkdv_bulk(spec):
            _emit_dkdv_bulk(c, spec, pack)
        else:
            _emit_dkdv_stores(c, D, ND, pack)
        if WS:
            c("# no more slabs (after dK and dV, so that the producer adds the last one meanwhile): the producer's")
            c("# warp ends once it reads 0")
            _emit_dq_handoff(c, spec, lay, None)
        items.close()
        if PERS:
            c("bulk_wait_read0()  # the last item's copies have read the staging rows: shared memory may go")
    text = bind_offsets(c.text())
    if WS:  # the consumers' block barriers leave the producer warpgroup out
        text = text.replace("cuda.syncthreads()", f"bar_sync({DQ_WS_BAR}, {NT})")
    return text


def _emit_dq_producer(c: _Code, spec: FA2BackwardSpec, lay: dict) -> None:
    """dq_ws: the producer warpgroup's whole part (after the block's item is known, so that a block that returns
    early returns whole): warp w of it serves consumer warpgroup w's slabs in turn, lane 0 adding each into dq32 at
    the tile its word names (0: no more) by one bulk reduction, then handing it back once read; its other warps end
    at once."""
    D, BQ, NWG, NS = spec.head_dim, spec.block_q, spec.block_k // 64, dq_ws_slabs(spec)
    DC = D // _col_splits(spec)
    SLAB = _dq_ws_slab_bytes(spec)
    # warp w's slab: its warpgroup's part of the tile in slab order; under dq_split "k" (bwd_pingpong) every
    # warpgroup's slab is the whole tile, each added into the same words; under dq_alternate it is the whole tile of
    # the tiles the warpgroup took
    at = "" if dq_split(spec) == "k" or dq_alternate(spec) else f" + pw * {64 * DC}"
    c(f"if tid >= {consumer_threads(spec)}:  # the producer warpgroup (dq_ws): dQ's slabs to the copy engine")
    with c.indent():
        if NWG > 1:
            c("SETMAXNREG_DEC()")
        c(f"pw = warp - {consumer_threads(spec) // 32}")
        c(f"if pw < {NWG}:")
        with c.indent():
            c(f"pw_slab = sb + {lay['DQW']} + pw * {NS * SLAB}")
            c(f"pw_word = ((sbr + {lay['DQSLOT']}) >> 2) + pw * {NS}")
            for k in range(NS):
                c(f"bar_arrive(DQ_FREE + pw * {NS} + {k}, 160)  # slab {k} is free")
            c("ps = 0")
            c("while True:")
            with c.indent():
                c(f"bar_sync(DQ_FULL + pw * {NS} + ps, 160)  # the consumers' slab ps and its word are written")
                c("pw_tile = np.int64(smem_w[pw_word + ps])")
                c("if pw_tile == 0:")
                with c.indent():
                    c("break")
                c("if lane == 0:")
                with c.indent():
                    c(f"bulk_reduce_add_f32(elem_addr(dq32, ((pw_tile - 1) * {BQ * D}{at},)), "
                      f"pw_slab + ps * {SLAB}, {SLAB})")
                    c("bulk_commit()")
                    c("bulk_wait_read0()  # the copy engine has read the slab")
                c("syncwarp()")
                c(f"bar_arrive(DQ_FREE + pw * {NS} + ps, 160)")
                if NS > 1:
                    c("ps ^= 1")
        if ws_loads(spec):
            c(f"if pw >= {NWG} and pw < {NWG + WS_LOADERS // 32}:  # ws_loads' loader warps")
            with c.indent():
                _emit_loader(c, spec, lay)
        c("return")
    if NWG > 1:
        c("SETMAXNREG_INC()")


def _emit_dq_alternate(c: _Code, spec: FA2BackwardSpec, lay: dict, kq: int, parts: int) -> None:
    """dq_alternate, after a tile's dV and dK GEMMs, dS^T's stores and their barrier: the tile's dQ warpgroup (dqwg)
    issues dQ = dS K over all 128 kv rows and D columns, waits for it (with it every group before), lets the other
    warpgroup store the next tile's dS^T (DS_FREE) and hands the 64 x D fragment to its slab; the other waits only
    for its own dV and dK GEMMs (they read this tile's Q and dO, whose buffer its next request lets the loaders
    refill). Each branch waits for the groups it issued, so no wgmma's wait crosses the branch. `parts`: dQ's
    product and hand-off in that many column parts, each waited for and stored in turn (D = 128: 2, as
    bwd_pingpong's: the 64 x 128 f32 fragment beside dK, dV and dS's packed registers spilled 44 bytes more than the
    default, ptxas sm_90a). Never with dk_after_dq (dq_alternate refuses it)."""
    D, NT = spec.head_dim, consumer_threads(spec)
    DQN = D // parts
    c("if dqwg:")
    with c.indent():
        c(f"# dQ rows 0 .. 63, every column of this q tile: dS K over both warpgroups' kv rows, {kq} wgmma "
          f"m64n{DQN}k16 a part of")
        c(f"# {DQN} columns ({parts}), k step k reads kv rows 16k .. 16k + 15 of dS^T and K (2048 bytes on)")
        c("w_ds = desc_word(HI_KV, ds_wl)")
        c("w_kt = desc_word(HI_KV, kt_wl)")
        for hh in range(parts):
            c(f"FENCE_Q(dqa, 0)  # columns {hh * DQN} .. {hh * DQN + DQN - 1}")
            _emit_dq_gemm(c, kq, hh * DQN // 64 * spec.block_k * 8)  # K's 64-column block: block_k * 128 bytes on
            c("WAIT_Q(dqa, 0)  # (every group before it is done too)")
            if hh == parts - 1:
                c(f"bar_arrive(DS_FREE, {NT})  # dq_alternate: dQ's GEMM has read dS^T; the other warpgroup may store "
                  "the next tile's")
            _emit_dq_handoff(c, spec, lay, "(b * H + h) * nq + qc + 1", (hh, parts))
    c("else:")
    with c.indent():
        c("WAIT_D(dvacc, 0)  # dV's and dK's GEMMs (they read this tile's dO and Q)")
        c("WAIT_D(dkacc, 0)")


def _emit_load_request(c: _Code, spec: FA2BackwardSpec, lay: dict, more: Optional[str], hq: str, q0: str) -> None:
    """ws_loads, the consumers at a tile's top (after its barrier: the other buffer is free): thread 0 names the
    next tile (1 + its q head hq and its first row q0 when `more` holds; 0 when it does not or `more` is None: the
    loaders' end) and every consumer arrives on LD_REQ. The word is written again only a tile later, after this
    thread waited for the buffer the loaders fill after reading it, so one word serves."""
    w = f"((sbr + {lay['REQ']}) >> 2)"
    c("if tid == 0:  # ws_loads: the next tile for the loader warps")
    with c.indent():
        c(f"smem_w[{w}] = ({hq}) + 1 if {more} else 0" if more is not None else f"smem_w[{w}] = 0")
        c(f"smem_w[{w} + 1] = {q0}")
    c(f"bar_arrive(LD_REQ, {consumer_threads(spec) + WS_LOADERS})")


def _emit_loader(c: _Code, spec: FA2BackwardSpec, lay: dict) -> None:
    """ws_loads' loader warps (64 threads): per request, the tile's Q and dO rows by cp.async into buffer lb (the
    consumers' own copies' swizzled layout and row helpers), each thread's copies then arriving on the buffer's
    mbarrier (noinc), its LSE / Delta rows (0 past M) into the buffer's statistics, and a second arrival once
    written; buffers alternate from 1 (the block's first tile is the consumers' own, in 0). A thread copies rows
    ltid / 8 + 8 i (8 apart: one swizzle term (row & 7) for all of them, as the row helpers assume) and 16-byte
    chunk ltid % 8 of each 64-column block (D / 64 passes)."""
    D, BQ = spec.head_dim, spec.block_q
    RSTEP = WS_LOADERS // 8
    QO, DOO, TQ, STO = lay["Q"], lay["DO"], lay["qt"], lay["ST"]
    c(f"ltid = tid - {consumer_threads(spec) + 32 * spec.block_k // 64}  # 0 .. {WS_LOADERS - 1}")
    c(f"ld_r0 = ltid >> 3  # rows ld_r0 + {RSTEP} i")
    c("lb = 1")
    c("while True:")
    with c.indent():
        c(f"bar_sync(LD_REQ, {consumer_threads(spec) + WS_LOADERS})  # the consumers named the next tile")
        c(f"lq = np.int32(smem_w[((sbr + {lay['REQ']}) >> 2)])")
        c("if lq == 0:")
        with c.indent():
            c("break")
        c(f"lq0 = np.int32(smem_w[((sbr + {lay['REQ']}) >> 2) + 1])")
        c("hq = lq - 1")
        c("qh = (b * H + hq) * M")
        for x, off in (("q", QO), ("do", DOO)):
            emit_bases(c, (x,), ("hq",))
            for h in range(D // 64):  # 64-column block h: chunk ltid % 8 of it
                c(f"ld_c = (ltid & 7) + {8 * h}")
                c("ld_x = ((ld_c & 7) ^ (ld_r0 & 7)) << 4")
                _emit_row_addresses(c, x, f"{x}g", f"{x}_sm", RSTEP)
                _emit_load_inside(c, BQ, RSTEP, D, f"sb + {off} + lb * {TQ}", "lq0", "M", x, f"{x}g", f"{x}_sm")
        c(f"cp_async_mbar_arrive_noinc(sb + {lay['MBAR']} + lb * 8)  # once this thread's copies land")
        # a thread's rows unrolled: range(ltid, BQ, 64) was Numba's 64-bit trip-count arithmetic, the most of
        # ~50 spill stores a tile at the loaders' 24 registers (ptxas, sm_90a, D = 128; 6 without it)
        for i in range(BQ // WS_LOADERS):
            lr = f"ltid + {i * WS_LOADERS}" if i else "ltid"
            c(f"qq = lq0 + {lr}")
            c(f"smem_f[((sbr + {STO}) >> 2) + lb * {BQ} + {lr}] = {lse_read(spec, 'lse[qh + qq]')} if qq < M else ZERO")
            c(f"smem_f[((sbr + {STO}) >> 2) + {2 * BQ} + lb * {BQ} + {lr}] = {delta_read(spec, 'delta[qh + qq]')} if qq < M else ZERO")
        c(f"mbar_arrive(sb + {lay['MBAR']} + lb * 8)")
        c("lb ^= 1")


def _emit_dq_handoff(c: _Code, spec: FA2BackwardSpec, lay: dict, tile: Optional[str],
                     part: tuple[int, int] = (0, 1)) -> None:
    """dq_ws, a consumer warpgroup: once its slab dqs is free, this tile's dQ fragment into it (D / cs / 8 16-byte
    stores a thread, thread-major) and the tile's number + 1 into its word (`tile`; None: 0, no more slabs), made
    visible to the copy engine, then the producer's warp told; with two slabs the next tile takes the other. At the
    end (None) it also waits for the other slab's last hand-back, which the producer gives once more than the
    warpgroup waited for it. `part` (k, n): the fragment in dqa is column part k of n (bwd_pingpong's dQ halves at
    D = 128): the first part waits for the slab, the last one tells the producer."""
    D, NS = spec.head_dim, dq_ws_slabs(spec)
    DC = D // _col_splits(spec)
    SLAB = _dq_ws_slab_bytes(spec)
    k, n = part
    N8 = DC // 8 // n  # n8 tiles of a part
    if k == 0:
        c(f"bar_sync(DQ_FREE + wg * {NS} + dqs, 160)  # the producer's warp has read this warpgroup's slab dqs")
    if tile is not None:
        if k == 0:
            c("# this warpgroup's dQ fragment as its registers lie: n8 tile dn's 4 floats of thread t at 2048 dn + "
              "16 t")
            c(f"dqw_t = sb + {lay['DQW']} + (wg * {NS} + dqs) * {SLAB} + (tid & 127) * 16")
        for j in range(N8):
            dn, o = k * N8 + j, f"ofs_{j * 4}"
            c(f"sts_v4_f32(dqw_t + {dn * 2048}, lget(dqa, {o}), lget(dqa, {o} + 1), lget(dqa, {o} + 2), "
              f"lget(dqa, {o} + 3))")
    if k < n - 1:
        return
    c("if (tid & 127) == 0:")
    with c.indent():
        c(f"smem_w[((sbr + {lay['DQSLOT']}) >> 2) + wg * {NS} + dqs] = {tile if tile is not None else 0}")
    if tile is not None:
        c("fence_proxy_async()  # the slab visible to the copy engine")
    c(f"bar_arrive(DQ_FULL + wg * {NS} + dqs, 160)")
    if NS > 1:
        if tile is not None:
            c("dqs ^= 1")
        else:
            c(f"bar_sync(DQ_FREE + wg * {NS} + (dqs ^ 1), 160)  # the other slab's last hand-back")


def _emit_thread_indices(c: _Code, per_item: bool) -> None:
    """The thread's index and its lane, warp, warpgroup and fragment row / column. A persistent kernel makes them
    again in each item from an opaque copy of threadIdx (and of the aligned base `sb`), so that LLVM cannot hoist what
    an item derives from them (row addresses, the epilogue's staging offsets) out of the item loop, where it would
    stay live across every q loop: 364-456 bytes of spills at D = 128 (ptxas, sm_90a) made once at the kernel's top,
    0-116 made per item."""
    c("tid = np.int32(opaque_u32(cuda.threadIdx.x))  # per item: see _emit_thread_indices" if per_item
      else "tid = cuda.threadIdx.x")
    c("lane = tid & 31")
    c("warp = tid >> 5")
    c("wg = tid >> 7")
    c("g = lane >> 2")
    c("t2 = (lane & 3) * 2")
    if per_item:
        c("sb = opaque_u32(sb)")


def _emit_item_start(c: _Code, spec: FA2BackwardSpec, stack: contextlib.ExitStack) -> tuple[str, str, str]:
    """The item's grid coordinates (x, y, z) as kernel expressions: blockIdx's; persistent, the block's first item
    (it_x, it_y, it_z: block c takes item c, x fastest) and the `while` over its items opened on `stack` (its body
    the rest of the kernel; the caller closes it after the epilogue)."""
    if not persistent(spec):
        return "cuda.blockIdx.x", "cuda.blockIdx.y", "cuda.blockIdx.z"
    gx, gy, gz = _grid_order(spec)[0]
    c(f"# persistent: this block walks items of the grid ({gx}, {gy}, {gz}), x fastest, in rounds of gridDim.x")
    c(f"it_gx = {gx}")
    c(f"it_gy = {gy}")
    emit_persistent_start(c, None, ("it_gx", "it_gy"))
    c(f"while it_z < {gz}:")
    stack.enter_context(c.indent())
    return "it_x", "it_y", "it_z"


def _emit_dkdv_bulk(c: _Code, spec: FA2BackwardSpec, pack: str) -> None:
    """dkdv_bulk's epilogue: this warp's 16 rows of dK (staging rows 0-15) and of dV (16-31) packed to 16 bits in
    shared memory from `_layout`'s STG on (K's, V's and Q's bytes, free after the barrier; a persistent kernel's
    region of its own), then lane l hands staging row l to a bulk copy into its row of dK or dV (rows past N: none);
    the kernel ends once they have read it (a persistent kernel waits before the next item's q loop instead)."""
    D = spec.head_dim
    PK = _dkdv_stage_pitch(spec)
    stg = _layout(spec)["STG"]
    c(DKDV_LINE)
    c("# (dkdv_bulk: staged in shared memory and handed to the copy engine, a row a lane)")
    c("cuda.syncthreads()  # every warpgroup's last GEMMs have read K, V, Q, dO, dS^T: the staging (or the next item's")
    c("# loads) may overwrite them")
    if dkdv_tma(spec):
        _emit_dkdv_boxes(c, spec, pack)
        return
    c(f"dkv_s = sb + {stg} + warp * {32 * PK}  # this warp's 32 staging rows: dK's 16, then dV's 16")
    if dkdv_stsm(spec):
        c(f"dkv_a = dkv_s + ((lane >> 3) & 1) * {8 * PK} + (lane & 7) * {PK} + (lane >> 4) * 16  # the row of its "
          "stmatrix")
        c("# matrix this lane addresses: rows 8 ((lane >> 3) & 1) .. + 7, chunk 2 k + (lane >> 4) of instruction k")
        st = _stage_stsm_helper(c, D, pack)
        for t, acc in enumerate(("dkacc", "dvacc")):
            c(f"{st}(dkv_a + {16 * t * PK}, {acc}, ofs_0, ofs_2)")
    else:
        c(f"dkv_w = ((sbr + {stg} + warp * {32 * PK} + g * {PK}) >> 2) + (lane & 3)  # row g's word of its columns")
        sw = _store_pairs_helper(c, D // 8, pack)  # the direct stores' helper, into shared memory's words
        for t, acc in enumerate(("dkacc", "dvacc")):
            for r in range(2):
                c(f"{sw}(smem_w, dkv_w + {((16 * t + 8 * r) * PK) // 4}, {acc}, ofs_{2 * r})")
    c("fence_proxy_async()  # dK's and dV's staged rows visible to the copy engine")
    c("syncwarp()")
    c("kvi = kv0 + warp * 16 + (lane & 15)")
    c("if kvi < N:")
    with c.indent():
        c(f"dkv_g = elem_addr(dk, (((kv_head + kvi) * {D}) >> 1,)) if lane < 16 else "
          f"elem_addr(dv, (((kv_head + kvi) * {D}) >> 1,))")
        c(f"bulk_store(dkv_g, dkv_s + lane * {PK}, {2 * D})")
        c("bulk_commit()")
    if not persistent(spec):
        c("bulk_wait_read0()  # the copies have read the staging rows: shared memory may go")


DKDV_BOX = 16 * 128  # dkdv_tma's box: a warp's 16 rows of 64 16-bit columns (128 bytes, the swizzle's span)


def _dkdv_box_bytes(spec: FA2BackwardSpec) -> int:
    """dkdv_tma's staging a warp: dK's D / 64 boxes, then dV's."""
    return 2 * (spec.head_dim // 64) * DKDV_BOX


def _emit_dkdv_boxes(c: _Code, spec: FA2BackwardSpec, pack: str) -> None:
    """dkdv_tma's staging and copies (after _emit_dkdv_bulk's barrier): this warp's boxes from the aligned base (K's,
    V's and Q's bytes; each box 1024-byte aligned, as the swizzle's pattern wants), by stmatrix, then lane 0's tensor
    stores at (column 64 hb, the warp's first kv row, b * HK + hk) of dK's and dV's maps, their operands through
    redux (uniform registers for the copy); the kernel ends once they have read the boxes."""
    D = spec.head_dim
    WB = _dkdv_box_bytes(spec)
    stg = _layout(spec)["STG"]
    c(f"dkv_s = sb + {stg} + warp * {WB}  # this warp's boxes: dK's {D // 64}, then dV's, 16 rows x 128 bytes each")
    st = stage_rows_stsm_helper(c, D, pack, DKDV_BOX, scaled=False)  # the forward's O staging, without 1 / l
    for t, acc in enumerate(("dkacc", "dvacc")):
        c(f"{st}(dkv_s + {t * (D // 64) * DKDV_BOX}, lane, {acc}, ofs_0, ofs_2)")
    c("fence_proxy_async()  # dK's and dV's staged rows visible to the copy engine")
    c("syncwarp()")
    c("dkv_q = warp_min(np.int32(kv0 + warp * 16))  # the warp's first kv row: rows past N are not written")
    c("dkv_bh = warp_min(np.int32(b * HK + hk))  # its (b, kv head) slice")
    c("dkv_su = warp_min(np.int32(dkv_s))")
    c("if lane == 0:")
    with c.indent():
        for t, m in enumerate(("dkmap_g", "dvmap_g")):
            for hb in range(D // 64):
                c(f"tma_store_3d({m}, {hb * 64}, dkv_q, dkv_bh, dkv_su + {(t * (D // 64) + hb) * DKDV_BOX})")
        c("bulk_commit()")
    c("bulk_wait_read0()  # the copies have read the staging rows: shared memory may go")


DKDV_ISSUED = "# (dK's and dV's copies issued: their reads are waited for after the loop)"  # dkdv_in_tile's


def _emit_dkdv_in_tile(c: _Code, spec: FA2BackwardSpec, pack: str) -> None:
    """dkdv_in_tile's staging and copies (in the walk's last tile once dV's and dK's GEMMs are waited for, or after
    the loop with no tile): this warp's D / 64 boxes of dV into its own rows of V ([D / 64][block_k][128 B], box hb
    at V + hb block_k 128 + 2048 warp: only this warpgroup's dP^T read them) and of dK into the other buffer's Q
    tile (warps 0 .. block_q / 16 - 1) or dO tile (the rest), 2048 bytes a box, by stmatrix in the 128-byte
    swizzle; lane 0's tensor stores at (64 hb, the warp's first kv row, b * HK + hk) of dK's and dV's maps, their
    operands through redux (uniform registers). No barrier: each region is free for this warp alone. Their reads
    are waited for after the loop."""
    D, BQ, BK = spec.head_dim, spec.block_q, spec.block_k
    lay = _layout(spec)
    NB = D // 64  # boxes a warp and accumulator
    P = BQ // 16  # warps whose dK boxes fill one Q (or dO) tile of the other buffer
    assert (BK // 16) <= 2 * P and lay["qt"] == P * NB * DKDV_BOX, (BQ, BK, D)
    c(DKDV_LINE)
    c("# dkdv_in_tile: staged as 16-row boxes where nothing reads any more, stored by TMA tensor copies")
    c("# (dkdv_bulk: staged in shared memory and handed to the copy engine, a box a tensor store)")
    c(f"dv_s = sb + {lay['V']} + warp * {DKDV_BOX}  # dV's boxes: this warp's own rows of V, {BK * 128} bytes apart")
    to = f"(buf ^ 1) * {lay['qt']} + warp * {NB * DKDV_BOX}"
    if BK // 16 <= P:
        c(f"dk_s = sb + {lay['Q']} + {to}  # dK's boxes: the other buffer's Q tile (no next tile loads it)")
    else:
        c(f"dk_s = sb + ({lay['Q']} if warp < {P} else {lay['DO'] - P * NB * DKDV_BOX}) + {to}  # dK's boxes: the "
          "other buffer's Q or dO tile (no next tile loads it)")
    st = stage_rows_stsm_helper(c, 64, pack, DKDV_BOX, scaled=False)  # one 64-column box a call
    for acc, base, step in (("dkacc", "dk_s", DKDV_BOX), ("dvacc", "dv_s", BK * 128)):
        for hb in range(NB):
            c(f"{st}({base} + {hb * step}, lane, {acc}, ofs_{32 * hb}, ofs_{32 * hb + 2})")
    c("fence_proxy_async()  # dK's and dV's staged rows visible to the copy engine")
    c("syncwarp()")
    c("dkv_q = warp_min(np.int32(kv0 + warp * 16))  # the warp's first kv row: rows past N are not written")
    c("dkv_bh = warp_min(np.int32(b * HK + hk))  # its (b, kv head) slice")
    c("dk_su = warp_min(np.int32(dk_s))")
    c("dv_su = warp_min(np.int32(dv_s))")
    c("if lane == 0:")
    with c.indent():
        for m, su, step in (("dkmap_g", "dk_su", DKDV_BOX), ("dvmap_g", "dv_su", BK * 128)):
            for hb in range(NB):
                c(f"tma_store_3d({m}, {hb * 64}, dkv_q, dkv_bh, {su} + {hb * step})")
        c("bulk_commit()")
    c(DKDV_ISSUED)


def _stage_stsm_helper(c: _Code, D: int, pack: str) -> str:
    """`stage_stsm(at, x, i0, i1)`: a warp's 16 rows of an accumulator's fragment (rows g and g + 8 of each thread at
    offsets i0 and i1 of x), packed, into staging rows at `at` (this lane's row address, dkdv_stsm) by D / 16
    stmatrix .x4: instruction k stores 16-byte chunks 2k and 2k + 1 of the 16 rows, matrix m rows 8 (m & 1) .. + 7
    of chunk 2 k + (m >> 1), a lane's word m its own (row g + 8 (m & 1), columns 2t, 2t + 1 of that chunk), as the
    forward's stage_rows_stsm."""
    w = "{p}(lget(x, {i} + {o}), lget(x, {i} + {o} + 1))"
    return c.helper("stage_stsm", [
        "@device_function", "def stage_stsm(at, x, i0, i1):",
        *[f"    stsm_x4(at + {32 * k}, " + ", ".join(w.format(p=pack, i=i, o=8 * k + d) for d, i in
                                                ((0, "i0"), (0, "i1"), (4, "i0"), (4, "i1"))) + ")"
          for k in range(D // 16)]])


def _elem_split_helpers(c: _Code, spec: FA2BackwardSpec, branch: str) -> tuple[str, str]:
    """p_under_dp's per-(n8 tile, column) steps, each on this thread's two kv rows in place as _elem_quad_helper's:
    `elemsp_<branch>(x, i, col, smem_f, lse_f, q0, t2, kvr, b, h, hk, interior, *captures)` S^T -> P^T, and
    `elemsd_<branch>(x, y, i, col, smem_f, lse_f, dlt_f, ...)` dP^T -> dS^T from P^T; the split functions with them."""
    caps = _cap_args(spec)
    split = split_elem(spec.device_source, branch)
    assert split is not None, branch  # p_under_dp(spec) checked every branch
    c.helper(f"elem_split_{branch}", split.split("\n"))
    head = "    qi = q0 + col + t2", "    lq = lget(smem_f, lse_f + t2 + col)"
    p = c.helper(f"elemsp_{branch}", [
        "@device_function",
        f"def elemsp_{branch}(x, i, col, smem_f, lse_f, q0, t2, kvr, b, h, hk, interior{caps}):", *head,
        f"    lset(x, i, elemp_{branch}(lget(x, i), lq, b, h, hk, qi, kvr, interior{caps}))",
        f"    lset(x, i + 2, elemp_{branch}(lget(x, i + 2), lq, b, h, hk, qi, kvr + 8, interior{caps}))"])
    d = c.helper(f"elemsd_{branch}", [
        "@device_function",
        f"def elemsd_{branch}(x, y, i, col, smem_f, lse_f, dlt_f, q0, t2, kvr, b, h, hk, interior{caps}):", *head,
        "    dq_ = lget(smem_f, dlt_f + t2 + col)",
        f"    lset(y, i, elemds_{branch}(lget(x, i), lget(y, i), dq_, lq, b, h, hk, qi, kvr, interior{caps}))",
        f"    lset(y, i + 2, elemds_{branch}(lget(x, i + 2), lget(y, i + 2), dq_, lq, b, h, hk, qi, kvr + 8, "
        f"interior{caps}))"])
    return p, d


def _emit_dq_bulk(c: _Code, DC: int, D: int, DQO: int, PITCH: int) -> None:
    """dq_bulk: this warp's 16 rows of dQ (its DC columns) staged for bulk reductions, one row a lane (dqg: its
    address, issued by _emit_dq_issue under the next tile's first GEMMs or after the loop). The lanes swap halves as
    the vector reductions did (even lanes then hold 4 consecutive columns of row g, odd lanes of row g + 8: one
    16-byte store each). The rows' reductions, issued early in this tile, have read the staging rows (waited here)
    before they are written again."""
    c("# lanes t and t ^ 1 swap halves: a thread then holds 4 consecutive columns of one row a chunk")
    c(f"# dQ's staging: this warp's 16 rows ({PITCH} bytes apart), each thread's row (g, or g + 8 on odd lanes) and")
    c("# first column; lane l < 16 hands row l to the bulk reduction (addresses made here, not held over the loop)")
    c(f"dqs_w = sb + {DQO} + warp * {16 * PITCH}")
    c(f"dqs_t = dqs_w + (g + (8 if odd else 0)) * {PITCH} + (t2 - 2 if odd else t2) * 4")
    _emit_dq_swaps(c, DC // 8)
    c("bulk_wait_read0()  # the last tile's reductions (lanes < 16) have read the staged rows")
    c("syncwarp()")
    for dn in range(DC // 8):
        o = f"ofs_{dn * 4}"
        c(f"sts_v4_f32(dqs_t + {dn * 32}, lget(dqa, {o}), lget(dqa, {o} + 1), lget(dqa, {o} + 2), lget(dqa, {o} + 3))")
    c("fence_proxy_async()  # the staged rows visible to the copy engine")
    c("syncwarp()")
    c("# the row this lane hands over (lanes < 16, rows inside M; else none): issued by _emit_dq_issue once the next")
    c("# tile's first GEMMs are under way, so that its issue loop is off the tile's critical path")
    c("ql = q0 + rgw * 64 + (warp & 3) * 16 + lane")
    c(f"dqg = elem_addr(dq32, ((q_head + ql) * {D} + csw * {DC},)) if lane < 16 and ql < M else np.uint64(0)")


def _emit_dq_gemm(c: _Code, kq: int, kt0: int = 0) -> None:
    """dQ = dS K's `kq` k steps (k step kk reads kv rows 16 kk .. + 15 of dS^T and K, 2048 bytes on) and their
    commit; `kt0`: K's columns' offset in the descriptor's 16-byte units (bwd_pingpong's second column half at
    D = 128)."""
    for kk in range(kq):
        c(f"WG_Q(dqa, 0, desc_at(HI_KV, w_ds + {kk * 128}), desc_at(HI_KV, w_kt + {kk * 128 + kt0}), {int(kk > 0)})")
    c("wgmma_commit()")


def _emit_dq_late_issue(c: _Code, n8: int) -> None:
    """dq_late: the pending tile's dQ fragment (dqa, swapped) added into dq32 at dq_at by 16-byte vector
    reductions, and none left pending."""
    _emit_dq_reductions(c, n8, at="dq_at", guard="dq_at >= 0", swap=False)
    c("dq_at = -1")


def _emit_dq_issue(c: _Code, DC: int, DQO: int, PITCH: int) -> None:
    """dq_bulk: the staged row of this lane (dqg, 0 for none) handed to a bulk reduction, and dqg cleared."""
    c("if dqg != 0:")
    with c.indent():
        c(f"bulk_reduce_add_f32(dqg, sb + {DQO} + warp * {16 * PITCH} + lane * {PITCH}, {DC * 4})")
        c("bulk_commit()")
    c("dqg = np.uint64(0)")


def emit_fa3_backward(spec: FA2BackwardSpec) -> str:
    """Numba CUDA source of the wgmma backward's main kernel `spec.name` (a whole module)."""
    validate_spec(spec)
    src = _module(spec, _emit_kernel(spec))
    marker = "\n# ---- the variant's device functions"
    imports = _WGMMA_IMPORTS + (_BULK_IMPORTS if dq_bulk(spec) or dkdv_bulk(spec) or dq_ws(spec) else "")
    imports += _TMA_IMPORTS if dkdv_maps(spec) else ""
    imports += _WS_IMPORTS if dq_ws(spec) else ""
    return src.replace(marker, imports + marker, 1).replace(
        "emit_fa2_bwd -- do not edit.", "emit_fa3_bwd -- do not edit.")
