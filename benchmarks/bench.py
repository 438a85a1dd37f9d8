#!/usr/bin/env python3
"""FA2 forward and backward on the GPU: check, then time falower against SDPA (FLASH, CUDNN) and Flex.

Competitors: torch SDPA's FLASH (FlashAttention-2) and CUDNN backends, and FlexAttention (torch.compile).

Sweep (the FlashAttention-2 paper's): D = 64, 128; N = 1k .. 16k; B * N = 16k tokens; H * D = 2048;
causal and not; fp16. FLOPs of the forward = 4 * B * H * N * N * D, halved for causal; of forward +
backward 3.5x that (the backward's five N x N x D products to the forward's two). Times are medians of
triton.testing.do_bench (CUDA events); TFLOP/s = FLOPs / time.

What is timed:
  forward          "ours <config>" the bare forward kernel, relaunched into one O as a call launches it
                   (FA2ForwardKernel.relaunch: the driver's launch, no checks or allocation; prepare's Numba
                   launch took longer on the host than a small grid's kernel):
                   by default three configs side by side: the mma.sync kernel (128x64w4), the Hopper wgmma
                   kernel (emit_fa3; 128x128w8-wg at D = 128, 128x64w8-wg at D = 64) and "auto", what
                   falower.compile(graph) picks by itself (wgmma on an H100 where emit_fa3.auto_extra says so);
                   "ours+call" the whole Python call c.forward(q, k, v) of "auto" (checks, allocation, launch);
                   FLASH / CUDNN: torch SDPA with that backend; Flex: torch.compile(flex_attention).
  forward+backward "ours <tiles>" the forward and backward kernels on prepared buffers
                   (FA2ForwardKernel.prepare, then FA2BackwardKernel.prepare(q, k, v, o, lse, do));
                   "ours+call" c.forward(...) then c.backward(...); "autograd" o, _ = c(q, k, v) on tensors
                   that require grad, then o.backward(do); FLASH / CUDNN / Flex: o = attention(...),
                   o.backward(do) (gradients set to None between runs, as do_bench does).
  examples         every variant of examples/ at N = 4k (score_mod / mask_mod / captured tensors, GQA) against
                   FlexAttention with the same score_mod and mask_mod (block mask built once, outside the
                   timing, as a Flex user does); falower by its calls (c.forward, c.backward), captured float
                   tensors' gradients included (and Flex once more without them, as "no-dcap"); Flex's
                   create_block_mask time is reported beside it. FLOPs count only the pairs the mask keeps.
                   The forward is falower.compile's own choice ("fwd kernel": mma or wgmma); where that is
                   wgmma, the mma.sync kernel is timed beside it ("fwd mma", extra={"schedule": "mma"}).

    python benchmarks/bench.py --precompile        # the full sweep, checks first
    python benchmarks/bench.py --quick             # N = 1k, 4k; examples at the first D only
    python benchmarks/bench.py --fwd               # forward only (what bench_fwd.py did)
    python benchmarks/bench.py --bwd --no-examples # forward+backward only, plain and causal
    python benchmarks/bench.py --configs 64x64w4,128x64w8 --n 4096
    python benchmarks/bench.py --fwd --d 128 --configs 128x64w4,128x128w8-wg-noov,128x128w8-wg,auto
                                                    # wgmma knobs (what bench_fa3.py timed, now folded in here)
    python benchmarks/bench.py --bwd-pipeline 'autodiff,...,tile-bwd{bq=64,bk=128,dq=atomic},canonicalize'
    python benchmarks/bench.py --bwd --no-examples --bwd-wgmma --n 4096
                                                    # the backward on wgmma (emit_fa3_bwd) beside mma.sync: each
                                                    # tile config once more with '-bwg' (same forward)
    python benchmarks/bench.py --fwd --d 64 --no-sdpa --examples plain,causal --ex-n 2048 --batch 1 --heads 8 \
        --ex-configs auto-nosg --rounds 3 --pairs 300 --clocks --round-ms 1000
                                                    # a small grid's A / B: D = 64's 128-row tiles against its
                                                    # 192-row ones, by pairs and by time at each one's own clock
    FALOWER_WGMMA_BWD=1 python benchmarks/bench.py --bwd --examples alibi,causal --no-sdpa
                                                    # the examples' backward on wgmma (their calls)

A row that fails (a backend refusing a shape, a kernel that does not build) is logged and left NaN; the
sweep goes on. --quick with --precompile took 4.5 minutes on an H100 (Flex compiles most of it); the full
sweep takes longer than one 10-minute device command: split it (--d 64, --d 128; --no-examples). Prints short tables last; writes bench.log, results.json and results.md to $OUT
(default ./bench_out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import runpy
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    import torch  # noqa: E402
except ImportError:  # make_kernel alone works without torch (PTX inspection on a CPU machine)
    torch = None

import falower as fl  # noqa: E402
from falower.backends.numba_cuda import FA2ForwardKernel, FA2ForwardSpec  # noqa: E402,F401

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_required import require_gpu  # noqa: E402

LOG2E = 1.4426950408889634
OUT = Path(os.environ.get("OUT", "./bench_out"))
NAN = float("nan")


def log(*args) -> None:
    line = " ".join(str(a) for a in args)
    print(line, flush=True)
    with open(OUT / "bench.log", "a") as f:
        f.write(line + "\n")


# ------------------------------------------------------------------------------------------------
# The kernels under test, as a user gets them: falower.attention, lowered and compiled by falower.compile.
# ------------------------------------------------------------------------------------------------


AUTO = ("auto",)  # the config of falower.compile(graph) as a user calls it: its own tiles and schedule choice


def parse_config(text: str) -> tuple:
    """'128x64w8' -> (128, 64, 8, {}) = (block_q, block_k, num_warps, spec.extra): the mma.sync kernel.
    'auto' -> AUTO: falower.compile's defaults (on an H100 the wgmma kernel where it is chosen, emit_fa3.auto_extra);
    'auto-<suffixes>' -> ("auto", extra): those defaults with the suffixes' extras (examples' --ex-configs).
    Suffixes set extras: '-wg' the Hopper wgmma kernel (emit_fa3; num_warps unused: one warpgroup per 64 rows),
    '-ov' / '-noov' its softmax / P V overlap on / off (default: on at D = 128), '-qs' / '-qr' Q in shared memory
    / registers, '-2b' two barriers per kv tile (K and V waited for separately), '-hgN' block order in groups of
    N (b, h) pairs, '-wskip' / '-nowskip' per-warp skipping of masked rows in partial tiles on / off (default
    off; '-ws' / '-nows' until the warp-specialized kernel took '-ws'), '-ws' the warp-specialized wgmma kernel
    (emit_fa3_ws: a producer warp and two consumer warpgroups in ping-pong; num_warps unused), '-wsn' the same
    without the producer (256 threads: warpgroup 0 loads K, warpgroup 1 V; extra producer "none"), '-stN' their
    ring of N K/V stages (default 2; '-wsn': 3 where they fit); '-pfN' the score gathers' L2 prefetch N kv tiles
    ahead (default 1); '-pN' the '-wsn' kernel persistent, N blocks (extra persistent; 0: one block a q tile),
    '-ioc' its items heaviest first over the whole launch (extra item_order "cost"), '-iod' from a global counter
    in the grid's order (item_order "dynamic": producer warpgroup only);
    '-xpN' N of a thread's row of exponentials in a tile by the FMA pipe's polynomial (extra ex2_poly); '-nott'
    their score's table read by gathers, not in tiles through shared memory (extra table_tiles); '-nopp' their
    consumer warpgroups without ping-pong turns (extra pingpong); '-nowalk' their kv loop searching and
    classifying tiles by tile_class_fn under every static mask (extra walk); '-nocs' the score's per-element
    score_raw_fn where it has a column step (extra col_step: ALiBi), '-cm' / '-nocm' the warp-specialized kernel's
    column term of that step in S = Q K^T or by FFMA (extra col_mma; default on at D = 64 and 128); '-nokb' a partial
    tile's row under exact row bounds masked by two compares an element, not a word of bits (extra keep_bits);
    '-norg' its clamped gather per element where a row's entries lie at constant offsets (extra row_gather:
    relative bias), '-norp' each row its own loads where a thread's rows g and g + 8 could share them (extra
    row_pairs), '-noge' the '-wsn' kernel's shared entries read after the waits for K and S, not before (extra
    gather_early); '-noslice' / '-slice' those entries not from each consumer warpgroup's run of the table in shared
    memory, or from it (extra row_slice; default on); '-slr' / '-noslr' that run's loads from its row address kept for
    the item, or by the clamped index every tile (extra slice_rows; default on), '-sla' those loads a tile ahead (extra
    slice_ahead), '-slrp' those loads at a running address, clamped only where the warpgroup's run leaves the row (extra
    slice_ptrs), '-sis' the run stored and read while S is in flight (extra slice_in_s), '-slp' its entries by
    pairs from the run and its copy shifted by one, not by 4-byte loads (extra slice_pairs); '-l2h' the producer's TMA
    loads with L2 eviction priorities (extra l2_hints), '-c32' the kv loop's need_mask as one 32-bit compare against the
    item's full tiles inside N (extra class32); '-kvpN' split-kv's parts, N a power of two (extra kv_parts; 1: no
    split; default 'auto': emit_fa3.auto_kv_parts on a small grid), '-noofi' every item's ticket from the counter,
    the first round's too (extra own_first_item); '-efi' / '-noefi' the block's first item sent by its thread 0 at
    the block's entry, or from the producer's loop (extra early_first_item; default off); '-nosmr' no setmaxnreg
    where one consumer warpgroup already holds the most registers (extra setmaxnreg; '-smrdec' the producer's dec
    only); '-nodec' a call of at most 64 query rows on the persistent kernel's 128-row q tiles, not decoding's 64
    (extra decode_tiles); '-fm' split-kv's merge in the kernel itself (the q tile's last part, on decoding's tiles),
    not as a kernel of its own (extra fused_merge); '-clm' the q tile's parts as one cluster's blocks, merged there
    (extra cluster_merge; default at 8 parts), '-noclm' never, '-pull' the cluster's merge by its two barriers and
    reads of the other blocks' rows, not by their pushes (extra cluster_push); '-nosp' the score and the softmax for
    every row of decoding's q tile, not only those below M (extra skip_padding);
    '-nosg' D = 64's 192-row tiles on a small grid too (extra small_grid: False); '-nolh' the persistent producer
    kernel's items starting on their block list's global reads, not on its head
    handed over with the ticket (extra list_head), '-rev' its kv tiles from the last down (extra kv_reverse; '-rev2' the
    last one second, ALiBi's default; '-norev' from the first up), '-nobs' its consumers reading their rows' bounds from
    data before the kv loop, not while the item's first S runs (extra bounds_in_s), '-noes' / '-es' an item's last P V
    and epilogue at its own end / with the next item's first tile (extra epilogue_in_s; by default with it except
    under the softcap's tanh); '-stsm' / '-nostsm' the kept epilogue's rows of O staged by stmatrix, or a word
    at a time (extra stmatrix; default on); '-half' the '-wsn' kernel's half tiles where a warpgroup's rows keep one
    column half of a tile (extra half_tiles: masks with row bounds), '-halfpv' only P V by halves; '-ltanh' libdevice's
    tanhf where the kernels' tanh is 1 - 2 / (1 + 2**y) (extra tanh: the softcap); '-nots' that tanh on every tile, not
    the FMA pipe's polynomial where a tile's scores are in its range (extra tanh_small); '-notiny' not the shorter
    polynomial where they are within a quarter of the cap (extra tanh_tiny); '-nose' / '-se' O stored from the fragments
    / through shared memory (extra staged_epilogue: the '-wsn' kernel's default is through shared memory, emit_fa3's at
    D = 64 from the fragments); '-r128' / '-r64' emit_fa3's warpgroups own 128 / 64 query rows each (extra wg_rows),
    '-bN' its launch bounds for N blocks an SM (the '-wsg' kernel too: 1 or 2), '-dbkN' decoding's kv tiles N wide
    (extra decode_block_k: 64 or 128); '-tree' the softmax's row max and sum over four chains (extra
    tree_softmax); '-eager' the pipeline's online-softmax without lazy=8 (the row max, and O's rescale, move on every kv
    tile); the backward: '-bwg' its main kernel on wgmma (emit_fa3_bwd, extra bwd_schedule; without it a tile config
    keeps the mma.sync backward, also under FALOWER_WGMMA_BWD=1), '-bdqk' that kernel with dq_split "k", '-bop' with its
    descriptors built inside the loop (opaque_desc), '-bgt' with a reduced gradient (ALiBi's slope) added once a tile,
    not held across tiles (extra hold_grads), '-bgg' with a per-element gradient (the relative bias's) added per
    element, not summed a group of a thread's elements at the same entry first (extra grad_groups), '-bnov4' with a
    per-element gradient at [.., q, kv] (the bias table's) added per element, not four kv-consecutive entries by one
    16-byte reduction (extra grad_v4), '-bnoread' with such a table's entries gathered by each element, not by
    16-byte loads (extra read_v4), '-brlate' with those loads in the element code, not all a tile's issued before the
    wait for S^T and dP^T (read_v4 "late"), '-bbulk' dQ staged
    in shared memory and added by bulk reductions, not by each thread's vector reductions (extra dq_bulk), '-bdkl' /
    '-bnodkl' dK's GEMM issued after dQ's, in flight while dQ's hand-off issues, or not (extra dk_after_dq; default
    on at D = 128), '-bpdp' P computed while dP's GEMM is in flight (extra p_under_dp), '-bpdv' and dV's GEMM issued from P before dP's wait (dv_under_dp), '-bnois' its elementwise calls in one copy, not a second for interior tiles
    without bounds code (extra interior_split), '-bnoef' its exponential's argument times log2 e, not log2 e folded into
    the argument's constants (extra exp_fold), '-bdql' its dQ reductions issued under the next tile's S^T / dP^T GEMMs,
    not before the next tile's barrier (extra dq_late), '-bkvm' / '-bnokvm' its grid with a head's kv tiles in
    consecutive blocks, or kv tile j of every head first (extra kv_major; default: the first without a block mask),
    '-bkvgN' its grid in groups of N kv heads, kv tile j of each then j + 1 (extra kv_group; default 8 under a static
    mask), '-blah' a block list's next entry read a tile ahead (extra list_ahead), '-bws' / '-bnows' dQ handed to a
    producer warpgroup's bulk reductions or kept on the consumers' vector reductions (extra dq_ws; default "auto": the
    first, but without ws_loads under block lists and with a held gradient), '-bwsl' / '-bnowsl' the next q tile's loads
    by two producer warps or by the consumers (extra ws_loads; default "auto": the first wherever dq_ws runs at 64 x 128
    tiles; asked for, it brings dq_ws unless '-bnows'), '-bdkit' its dK and dV staged and stored by TMA in the walk's
    last q tile under its dQ GEMM (extra dkdv_in_tile), '-bdqa' each q tile's whole dQ by one consumer warpgroup in
    turn, the other going on to the next tile (extra dq_alternate; 64 x 128 tiles with dq_ws and ws_loads; the
    default at D = 64), '-bnodqa' without it."""
    if text == "auto":
        return AUTO
    head, *opts = text.split("-")
    if head == "auto":  # the automatic choice with knobs ('auto-nocm'): ("auto", extra)
        return ("auto", _parse_options(opts, text))
    tiles, warps = head.split("w")
    bq, bk = tiles.split("x")
    return (int(bq), int(bk), int(warps), _parse_options(opts, head))


def _parse_options(opts: list[str], text: str) -> dict:
    """A config's '-' suffixes as spec.extra (`text`, the config, names it in the error for an unknown one)."""
    extra = {}
    for o in opts:
        num = re.fullmatch(r"([a-z]+)(\d+)", o)
        if o in _FLAGS:
            extra.update(_FLAGS[o])
        elif num and num[1] in _NUMBERS:
            extra[_NUMBERS[num[1]]] = int(num[2])
        else:
            raise ValueError(f"unknown config option {o!r} in {text!r}")
    return extra


# The config options in the order config_tag writes them (the scripts and BENCHMARKS.md name configs by their
# tags): a numeric option (its prefix, the extra it sets to the number), or a group of flags (suffix, the extras it
# sets), of which the tag takes the first whose extras the config has.
CONFIG_OPTIONS: list = [
    (("wg", {"schedule": "wgmma"}), ("wsn", {"schedule": "wgmma-ws", "producer": "none"}),
     ("wsg", {"schedule": "wgmma-ws", "producer": "warpgroup"}), ("ws", {"schedule": "wgmma-ws"})),
    ("st", "stages"),
    (("ov", {"overlap": True}), ("noov", {"overlap": False})),
    (("qr", {"q_in_regs": True}), ("qs", {"q_in_regs": False})),
    (("2b", {"one_barrier": False}),),
    ("hg", "head_group"),
    ("pf", "prefetch_tiles"),
    ("xp", "ex2_poly"),
    ("bkvg", "kv_group"),
    ("p", "persistent"),
    (("ioc", {"item_order": "cost"}), ("iod", {"item_order": "dynamic"})),
    (("nott", {"table_tiles": False}),),
    (("nopp", {"pingpong": False}),),
    (("nowalk", {"walk": False}),),
    (("nocs", {"col_step": False}),),
    (("cm", {"col_mma": True}), ("nocm", {"col_mma": False})),
    (("nokb", {"keep_bits": False}),),
    (("norg", {"row_gather": False}),),
    (("norp", {"row_pairs": False}),),
    (("nots", {"tanh_small": False}),),
    (("notiny", {"tanh_tiny": False}),),
    (("noge", {"gather_early": False}),),
    (("slice", {"row_slice": True}), ("noslice", {"row_slice": False})),
    (("slr", {"slice_rows": True}), ("noslr", {"slice_rows": False})),
    (("slp", {"slice_pairs": True}), ("noslp", {"slice_pairs": False})),
    (("sla", {"slice_ahead": True}),),
    (("slrp", {"slice_ptrs": True}),),
    (("sis", {"slice_in_s": True}),),
    (("sle", {"slice_edge": True}),),
    (("rev", {"kv_reverse": True}), ("rev2", {"kv_reverse": "second"}), ("norev", {"kv_reverse": False})),
    (("nolh", {"list_head": False}),),
    (("nors", {"range_shared": False}),),
    (("noqd", {"q_double": False}), ("qd", {"q_double": True})),
    (("nobk", {"bulk_store": False}), ("bk", {"bulk_store": True})),
    (("notma", {"tma_store": False}),),
    (("stsm", {"stmatrix": True}), ("nostsm", {"stmatrix": False})),
    (("tmal", {"tma_loads": True}), ("notmal", {"tma_loads": False})),
    (("l2h", {"l2_hints": True}),),
    (("c32", {"class32": True}),),
    (("nosg", {"small_grid": False}),),
    ("kvp", "kv_parts"),
    (("noofi", {"own_first_item": False}),),
    (("efi", {"early_first_item": True}), ("noefi", {"early_first_item": False})),
    (("nosmr", {"setmaxnreg": False}), ("smrdec", {"setmaxnreg": "dec"})),
    (("nodec", {"decode_tiles": False}),),
    (("fm", {"fused_merge": True}),),
    (("clm", {"cluster_merge": True}), ("noclm", {"cluster_merge": False})),
    (("pull", {"cluster_push": False}),),
    (("nosp", {"skip_padding": False}),),
    (("nobs", {"bounds_in_s": False}),),
    (("noes", {"epilogue_in_s": False}), ("es", {"epilogue_in_s": True})),
    (("half", {"half_tiles": True}), ("halfpv", {"half_tiles": "pv"})),
    (("ltanh", {"tanh": "libdevice"}),),
    (("se", {"staged_epilogue": True}), ("nose", {"staged_epilogue": False})),
    ("el", "early_loads"),
    ("pr", "producer_regs"),
    ("r", "wg_rows"),
    (("tree", {"tree_softmax": True}), ("notree", {"tree_softmax": False})),
    (("eager", {"eager": True}),),
    ("b", "blocks_per_sm"),
    ("dbk", "decode_block_k"),
    (("wskip", {"warp_skip": True}), ("nowskip", {"warp_skip": False})),
    (("bdqk", {"bwd_schedule": "wgmma", "dq_split": "k"}),
     ("bop", {"bwd_schedule": "wgmma", "opaque_desc": "k,v,ds,kt"}), ("bwg", {"bwd_schedule": "wgmma"})),
    (("bgt", {"hold_grads": False}),),
    (("bgg", {"grad_groups": False}),),
    (("bnov4", {"grad_v4": False}),),
    (("bnoread", {"read_v4": False}), ("brlate", {"read_v4": "late"})),
    (("bbulk", {"dq_bulk": True}),),
    (("bdkl", {"dk_after_dq": True}), ("bnodkl", {"dk_after_dq": False})),
    (("bpdp", {"p_under_dp": True}), ("bpdv", {"dv_under_dp": True})),
    (("bnois", {"interior_split": False}),),
    (("bdql", {"dq_late": True}),),
    (("bkvm", {"kv_major": True}), ("bnokvm", {"kv_major": False})),
    (("bnoef", {"exp_fold": False}),),
    (("blah", {"list_ahead": True}),),
    (("bws", {"dq_ws": True}), ("bnows", {"dq_ws": False})),
    (("bwsl", {"ws_loads": True}), ("bnowsl", {"ws_loads": False})),
    (("bdkit", {"dkdv_in_tile": True}),),
    (("bdqa", {"dq_alternate": True}), ("bnodqa", {"dq_alternate": False})),
]
_FLAGS = {suffix: ex for opt in CONFIG_OPTIONS if isinstance(opt[0], tuple) for suffix, ex in opt}
_NUMBERS = {opt[0]: opt[1] for opt in CONFIG_OPTIONS if isinstance(opt[0], str)}


def config_tag(cfg: tuple) -> str:
    if cfg == AUTO:
        return "auto"
    if cfg[0] == "auto":  # ("auto", extra): the automatic choice with knobs
        return "auto" + _options_tag(cfg[1])
    bq, bk, nw, *rest = cfg
    return f"{bq}x{bk}w{nw}" + _options_tag(rest[0] if rest else {})


def _options_tag(extra: dict) -> str:
    """spec.extra as a config's '-' suffixes, in CONFIG_OPTIONS' order."""
    tag = ""
    for opt in CONFIG_OPTIONS:
        if isinstance(opt[0], str):
            if opt[1] in extra:
                tag += f"-{opt[0]}{extra[opt[1]]}"
            continue
        suffix = next((sfx for sfx, ex in opt if all(k in extra and extra[k] == v for k, v in ex.items())), None)
        if suffix is not None:
            tag += f"-{suffix}"
    return tag


def _bwd_only(cfg: tuple) -> bool:
    """A '-bwg' twin: the same forward as the config before it, only its backward differs."""
    return cfg != AUTO and len(cfg) > 3 and cfg[3].get("bwd_schedule") == "wgmma"


def with_wgmma_backward(configs: list) -> list:
    """--bwd-wgmma: each tile config, then the same config with the backward on wgmma ('-bwg')."""
    out = []
    for cfg in configs:
        out.append(cfg)
        if cfg != AUTO and (cfg[3] if len(cfg) > 3 else {}).get("bwd_schedule") is None:
            out.append((*cfg[:3], {**(cfg[3] if len(cfg) > 3 else {}), "bwd_schedule": "wgmma"}))
    return out


DEFAULT_CONFIG = {64: (128, 64, 4), 128: (128, 64, 4)}  # mma.sync (benchmarks/NOTES.md)
# emit_fa3's kernel and tiles (emit_fa3.tiles: 128 x 128 at D = 128, 128 x 64 at D = 64; 8 = two warpgroups' warps;
# D = 64's automatic choice is mostly the persistent kernel on 192 x 128 tiles since 2026-11-29: 'auto' times it)
WGMMA_CONFIG = {64: (128, 64, 8, {"schedule": "wgmma"}), 128: (128, 128, 8, {"schedule": "wgmma"})}


def default_configs(D: int) -> list:
    """Without --configs: mma.sync, wgmma and what falower.compile picks by itself, side by side."""
    return [DEFAULT_CONFIG[D], WGMMA_CONFIG[D], AUTO]


PIPELINE = "decompose-softmax,canonicalize,fuse,tile{{bq={bq},bk={bk}}},online-softmax{{exp2=true}},mask-tiles,canonicalize"

_COMPILED: dict = {}


def make_compiled(D: int, causal: bool, dtype: str = "f16", config: tuple | None = None,
                  bwd_pipeline: Optional[str] = None):
    """plain or causal attention written with falower.attention, lowered by the FA2 pipeline (forward tile
    sizes from `config`; the backward by `bwd_pipeline`, default fa2-bwd) and compiled by falower.compile.
    A tile config without '-wg' is the mma.sync kernel (extra schedule "mma": never the automatic choice);
    AUTO is falower.compile(graph) with its defaults."""
    import falower as fl

    config = config or DEFAULT_CONFIG[D]
    key = (D, causal, dtype, config_tag(config), bwd_pipeline)
    if key not in _COMPILED:
        mask = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx) if causal else None
        graph = fl.attention(mask_mod=mask, name="causal" if causal else "plain", dtype=dtype)
        if config == AUTO or config[0] == "auto":  # ("auto", extra): the automatic choice with knobs
            _COMPILED[key] = fl.compile(graph, "numba-cuda", backward=bwd_pipeline,
                                        extra=None if config == AUTO else dict(config[1]))
            return _COMPILED[key]
        bq, bk, nw = config[:3]
        extra = {"schedule": "mma", "bwd_schedule": "mma", **(config[3] if len(config) > 3 else {})}
        _COMPILED[key] = fl.compile(graph, "numba-cuda", pipeline=PIPELINE.format(bq=bq, bk=bk), path="mma",
                                    num_warps=nw, extra=extra, backward=bwd_pipeline)
    return _COMPILED[key]


def make_kernel(D: int, causal: bool, dtype: str = "f16", config: tuple | None = None, n: int | None = None,
                bh: tuple[int, int] | None = None):
    """The forward kernel under test (an FA2ForwardKernel): the one a call of sequence length `n` (and batch and
    heads `bh`) runs (at D = 64 falower.compile chooses its tiles by the call's sizes; None: its reference length,
    and the lengths alone)."""
    sizes = ({"M": n, "N": n} if n else {}) | ({"B": bh[0], "H": bh[1]} if bh else {})
    return make_compiled(D, causal, dtype, config).specialize(dtype, D=D, **sizes)


# ------------------------------------------------------------------------------------------------
# References and competitors
# ------------------------------------------------------------------------------------------------


def sdpa(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel(be):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


_FLEX: Any = None


def flex_attention():
    """torch.compile(flex_attention), once; every shape and mod compiles once (the cache limit raised so
    the sweep's shapes never fall back to the slow eager path)."""
    global _FLEX
    if _FLEX is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention as fa

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
        if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 4096)
        _FLEX = torch.compile(fa, dynamic=False)
    return _FLEX


def block_mask_for(mask_mod, B, H, N, per_batch: bool = False):
    from torch.nn.attention.flex_attention import create_block_mask

    if mask_mod is None:
        return None
    return create_block_mask(mask_mod, B if per_batch else None, None, N, N, device="cuda")


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def reference64(q, k, v, causal):
    q64, k64, v64 = q.double(), k.double(), v.double()
    s = (q64 @ k64.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        M, N = s.shape[-2:]
        s = s.masked_fill(torch.ones(M, N, dtype=torch.bool, device=q.device).tril().logical_not(), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v64, lse


def naive_lowprec(q, k, v, causal):
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        M, N = s.shape[-2:]
        s = s.masked_fill(torch.ones(M, N, dtype=torch.bool, device=q.device).tril().logical_not(), -math.inf)
    return torch.softmax(s, dim=-1).to(v.dtype) @ v


def check(D, causal, config, dtype=None):
    """FA error rule at N = 1000 (ragged) and a relative error; returns a dict. Every kernel where the call's sizes
    choose the kernel (D = 64): N = 1000's by its lengths, the one this call's B = 2, H = 4 takes (a small grid's
    128-row tiles), and the reference length's, each on the same ragged inputs (the worst is reported)."""
    dtype = dtype or torch.float16
    torch.manual_seed(0)
    B, H, N = 2, 4, 1000
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
    name = "f16" if dtype == torch.float16 else "bf16"
    kern = make_kernel(D, causal, name, config, n=N)
    t0 = time.time()
    o, lse = kern(q, k, v)
    torch.cuda.synchronize()
    first = time.time() - t0
    outs, seen = [(o, lse)], [kern]
    for other in (make_kernel(D, causal, name, config, n=N, bh=(B, H)), make_kernel(D, causal, name, config)):
        if all(other is not x for x in seen):
            seen.append(other)
            outs.append(other(q, k, v))
    ref, ref_lse = reference64(q, k, v, causal)
    err = max((o.double() - ref).abs().max().item() for o, _ in outs)
    naive = (naive_lowprec(q, k, v, causal).double() - ref).abs().max().item()
    rel = max(((o.double() - ref).norm() / ref.norm()).item() for o, _ in outs)
    lse_err = max((lse.double() - ref_lse).abs().max().item() for _, lse in outs)
    ok = err <= 2 * naive + 1e-5 and lse_err < 1e-3 and not any(torch.isnan(o).any().item() for o, _ in outs)
    return {"what": "fwd", "D": D, "causal": causal, "config": config, "max_err": err, "naive_err": naive,
            "rel_err": rel, "lse_err": lse_err, "ok": ok, "first_call_s": first}


def check_bwd(D, causal, config, bwd_pipeline=None):
    """FlashAttention-2's gradient rule at N = 1000: each of dq, dk, dv within 3x the error of naive fp16
    attention's autograd (plus 1e-4 of the gradient's size), both against float64 autograd."""
    torch.manual_seed(1)
    B, H, N = 2, 4, 1000
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(4))
    c = make_compiled(D, causal, "f16", config, bwd_pipeline)
    t0 = time.time()
    o, lse = c.forward(q, k, v)
    grads = c.backward(q, k, v, o, lse, do)
    torch.cuda.synchronize()
    first = time.time() - t0
    ref_in = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    reference64(*ref_in, causal)[0].backward(do.double())
    low_in = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    naive_lowprec(*low_in, causal).backward(do)
    out = {"what": "bwd", "D": D, "causal": causal, "config": config, "first_call_s": first, "ok": True}
    for name, got, ref, low in zip(("dq", "dk", "dv"), grads, ref_in, low_in):
        err = (got.double() - ref.grad).abs().max().item()
        naive = (low.grad.double() - ref.grad).abs().max().item()
        ok = err <= 3 * naive + 1e-4 * max(1.0, ref.grad.abs().max().item()) and not torch.isnan(got).any().item()
        out[f"{name}_err"], out[f"{name}_naive"] = err, naive
        out["ok"] = out["ok"] and ok
    return out


# ------------------------------------------------------------------------------------------------
# The examples' variants, for falower (examples/<stem>.py) and for FlexAttention (the same maths in torch)
# ------------------------------------------------------------------------------------------------


@dataclass
class Variant:
    stem: str
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    captures: dict = field(default_factory=dict)  # by the falower graph's argument names
    group: int = 1  # query heads per kv head (GQA)
    scale: Optional[float] = None
    per_batch: bool = False  # the mask reads b (block mask per batch)


DOCUMENTS = 8  # the document example's documents a row (--documents)
SHAPE = {"B": 0, "H": 0}  # --batch / --heads: 0 keeps the sweep's B * N = 16k tokens and H * D = 2048
CLOCKS: list = []  # --clocks: [the running clocks.ClockSampler]
EX_N = [4096]  # --ex-n: the examples' sequence length


def batch_heads(D: int, N: int) -> tuple[int, int]:
    """(B, H) of a timed call: the FlashAttention-2 paper's sweep (B * N = 16k tokens, H * D = 2048), or --batch /
    --heads (a small grid: B = 1, H = 8 at N = 1k is 64 q tiles of 128 rows for 132 SMs)."""
    return SHAPE["B"] or max(1, 16384 // N), SHAPE["H"] or 2048 // D


def variant(stem: str, B: int, H: int, N: int, D: int, M: int = 0) -> Variant:
    """examples/<stem>.py written as FlexAttention score_mod / mask_mod, with its captured tensors; `M` the query
    rows where they are not N (the bias table's rows: [H, M, N])."""
    dev = "cuda"
    if stem == "plain":
        return Variant(stem)
    if stem == "causal":
        return Variant(stem, mask_mod=causal_mask)
    if stem == "naive_tensor_code":  # 0.125 whatever the head dim, as the example is written
        return Variant(stem, scale=0.125)
    if stem == "gqa":
        return Variant(stem, group=4)
    if stem == "alibi":
        slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=dev, dtype=torch.float32) / H)
        return Variant(stem, score_mod=lambda s, b, h, q, kv: s + slopes[h] * (kv - q), mask_mod=causal_mask,
                       captures={"slopes": slopes})
    gen = torch.Generator(device=dev).manual_seed(0)  # the same captured values every time it is built
    if stem == "bias":
        bias = torch.randn(H, M or N, N, device=dev, dtype=torch.float32, generator=gen)
        return Variant(stem, score_mod=lambda s, b, h, q, kv: s + bias[h, q, kv], captures={"bias": bias})
    if stem == "relative_bias":
        rel = torch.randn(H, 2 * N - 1, device=dev, dtype=torch.float32, generator=gen)
        return Variant(stem, score_mod=lambda s, b, h, q, kv: s + rel[h, q - kv + (N - 1)],
                       captures={"rel_bias": rel})
    if stem == "softcap":
        return Variant(stem, score_mod=lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0))
    if stem == "sliding_window":
        return Variant(stem, mask_mod=lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 48))
    if stem == "softcap_approx":  # tanh.approx.f32 on both sides (FlashAttention's softcap)
        tanh = flex_tanh_approx()
        return Variant(stem, score_mod=lambda s, b, h, q, kv: 30.0 * tanh(s / 30.0))
    if stem in BENCH_GRAPHS:  # a bench-only variant: the same mask_mod for falower and Flex
        return Variant(stem, mask_mod=BENCH_GRAPHS[stem])
    if stem == "prefix_lm":
        return Variant(stem, mask_mod=lambda b, h, q, kv: (kv <= q) | (kv < 32))
    if stem == "document":  # documents of random lengths (DOCUMENTS per row), the last 1/16 of a row padding
        ids = torch.sort(torch.randint(0, DOCUMENTS, (B, N), generator=gen, device=dev), dim=-1).values
        ids[:, N - N // 16:] = -1
        doc = ids.to(dev, torch.int32)
        return Variant(stem, mask_mod=lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (doc[b, q] >= 0),
                       captures={"doc_id": doc}, per_batch=True)
    raise KeyError(f"no FlexAttention version of example {stem!r}")


def _window(width: int) -> Callable:
    def sliding_window(b, h, q_idx, kv_idx):
        dist = q_idx - kv_idx
        return (dist >= 0) & (dist < width)
    return sliding_window


# Variants the bench builds itself (not files in examples/): issue 12's measured configuration of the sliding
# window, 1024 wide (the example's 48 keeps 1% of the pairs: every CTA visits two tiles)
BENCH_GRAPHS = {"sliding_window_1024": _window(1024)}
# ... and score_mods: the softcap example with the hardware's tanh (fl.tanh(approx=True), op tanh_approx)
BENCH_SCORE_GRAPHS = {"softcap_approx": lambda s, b, h, q, kv: 30.0 * fl.tanh(s / 30.0, approx=True)}


_FLEX_TANH: list = []


def flex_tanh_approx() -> Callable:
    """tanh.approx.f32 inside a Flex score_mod: attention-gym's recipe (a custom op that inductor lowers to one
    inline-asm instruction), so falower's tanh_approx is timed against Flex running the same instruction."""
    if not _FLEX_TANH:
        from functools import partial

        from torch._inductor.lowering import make_pointwise, register_lowering
        from torch._inductor.virtualized import ops

        @torch.library.custom_op("falower_bench::tanh_approx", mutates_args=())
        def tanh_approx(x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x)

        @tanh_approx.register_fake
        def _(x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x)

        def lowering(x):
            return make_pointwise(partial(ops.inline_asm_elementwise, asm="tanh.approx.f32 $0, $1;"))(x)

        register_lowering(torch.ops.falower_bench.tanh_approx)(lowering)

        # its derivative from its output, 1 - tanh^2 (attention-gym's _TanhApprox): without one, Flex's backward
        # could not trace the score_mod ("RuntimeError when making fake tensor call", 2026-11-29); not yet run
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(output)

        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            return grad * (1 - t * t)

        tanh_approx.register_autograd(backward, setup_context=setup_context)
        _FLEX_TANH.append(tanh_approx)
    return _FLEX_TANH[0]


def example_graph(stem: str):
    import falower as fl

    if stem in BENCH_GRAPHS:
        return fl.attention(mask_mod=BENCH_GRAPHS[stem], name=stem)
    if stem in BENCH_SCORE_GRAPHS:
        return fl.attention(score_mod=BENCH_SCORE_GRAPHS[stem], name=stem)
    return next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))


def example_stems() -> list[str]:
    return sorted(p.stem for p in (ROOT / "examples").glob("*.py")) + list(BENCH_GRAPHS) + list(BENCH_SCORE_GRAPHS)


def example_compiled(stem: str, schedule: Optional[str] = None, **extra):
    """examples/<stem>.py by falower.compile: its own choice of kernel, or extra={"schedule": schedule}
    ("mma": the mma.sync kernel, to time beside the automatic choice), plus any other `extra`."""
    import falower as fl

    key = ("example", stem, schedule, tuple(sorted(extra.items())))
    if key not in _COMPILED:
        g = example_graph(stem)
        opts = {**({"schedule": schedule} if schedule else {}), **extra}
        _COMPILED[key] = fl.compile(g, "numba-cuda", extra=opts or None)
    return _COMPILED[key]


def example_compiled_config(stem: str, cfg: tuple):
    """examples/<stem>.py under one tile config of --ex-configs ('128x64w8-wsn': the default pipeline with those
    tiles, that kernel), to time beside the automatic choice."""
    import falower as fl
    from falower.passes import NAMED_PIPELINES

    key = ("example-config", stem, config_tag(cfg))
    if cfg[0] == "auto":  # the automatic choice, with knobs ('auto-nocm') or without (AUTO, 'auto')
        knobs = cfg[1] if len(cfg) > 1 else {}
        if knobs.get("eager"):
            raise ValueError("'-eager' changes the pipeline, which the automatic choice keeps: give a tile config "
                             "(e.g. 128x128w8-wsn-eager)")
        return example_compiled(stem, **knobs)
    if key not in _COMPILED:
        bq, bk, nw = cfg[:3]
        text = re.sub(r"\btile\{[^}]*\}", f"tile{{bq={bq},bk={bk}}}", NAMED_PIPELINES["fa2-fwd"], count=1)
        extra = {"schedule": "mma", **(cfg[3] if len(cfg) > 3 else {})}
        if extra.pop("eager", None):
            text = text.replace("online-softmax{exp2=true,lazy=8}", "online-softmax{exp2=true}")
        _COMPILED[key] = fl.compile(example_graph(stem), "numba-cuda", pipeline=text, path="mma", num_warps=nw,
                                    extra=extra)
    return _COMPILED[key]


def mask_density(var: Variant, B: int, N: int) -> float:
    """Fraction of (q, kv) pairs the mask keeps (1 without a mask): the FLOPs that count."""
    if var.mask_mod is None:
        return 1.0
    b = torch.arange(B if var.per_batch else 1, device="cuda")[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device="cuda")
    idx = torch.arange(N, device="cuda")
    keep = var.mask_mod(b, h, idx[None, None, :, None], idx[None, None, None, :])
    return keep.float().mean().item()


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def bench(fn, warmup=25, rep=100, grad_to_none=None):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def clocked(fn: Callable, *a, **kw) -> tuple[Any, float]:
    """(fn(*a, **kw), the mean SM clock in MHz while it ran: --clocks' sampler, NaN without it)."""
    t0 = time.time()
    out = fn(*a, **kw)
    return out, CLOCKS[0].window(t0, time.time())[0] if CLOCKS else NAN


def measure(row: dict, key: str, flops: float, make_fn: Callable, grad_to_none=None) -> bool:
    """row[key] = TFLOP/s of the function make_fn() returns (with --clocks, row[key + " MHz"] its SM clock); a
    failure anywhere is logged (with its traceback when BENCH_TRACEBACK is set), the row goes on. Returns whether it
    worked."""
    try:
        fn = make_fn()
        ms, mhz = clocked(bench, fn, grad_to_none=grad_to_none)
        row[key] = flops / ms / 1e9
        if CLOCKS:
            row[f"{key} MHz"] = mhz
        return True
    except Exception as exc:  # a backend may refuse a shape; the backward kernel may not exist yet
        row[key] = NAN
        log(f"  {key} failed: {type(exc).__name__}: {first_line(exc)}")
        if os.environ.get("BENCH_TRACEBACK"):
            log(traceback.format_exc())
        return False


def leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def time_row(args, D: int, causal: bool, N: int, configs: list) -> dict:
    B, H = batch_heads(D, N)
    flops = 4 * B * H * N * N * D / (2 if causal else 1)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(4))
    row = {"D": D, "N": N, "B": B, "H": H, "causal": causal}
    block_mask = block_mask_for(causal_mask if causal else None, B, H, N) if not args.no_flex else None
    if args.fwd:
        if not args.no_sdpa:
            for be in ("flash", "cudnn"):
                measure(row, f"fwd {be}", flops, lambda be=be: lambda: sdpa(q, k, v, causal, be))
        if not args.no_flex:
            measure(row, "fwd flex", flops, lambda: lambda: flex_attention()(q, k, v, block_mask=block_mask))
        for cfg in [x for x in configs if not _bwd_only(x)]:
            def prepared(cfg=cfg):
                launch, _ = make_kernel(D, causal, "f16", cfg, n=N, bh=(B, H)).relaunch(q, k, v)
                return launch

            measure(row, f"fwd ours {config_tag(cfg)}", flops, prepared)
        c = make_compiled(D, causal, "f16", AUTO if AUTO in configs else configs[0], args.bwd_pipeline)
        measure(row, "fwd ours+call", flops, lambda: lambda: c.forward(q, k, v))
    if args.bwd:
        f2 = 3.5 * flops
        ql, kl, vl = leaves(q, k, v)
        if not args.no_sdpa:
            for be in ("flash", "cudnn"):
                measure(row, f"bwd {be}", f2, lambda be=be: lambda: sdpa(ql, kl, vl, causal, be).backward(do),
                        grad_to_none=[ql, kl, vl])
        if not args.no_flex:
            measure(row, "bwd flex", f2, lambda: lambda: flex_attention()(ql, kl, vl, block_mask=block_mask).backward(do),
                    grad_to_none=[ql, kl, vl])
        for cfg in configs:
            def prepared_bwd(cfg=cfg):
                c = make_compiled(D, causal, "f16", cfg, args.bwd_pipeline)
                fwd_launch, fwd_finish = c.kernel(q, k, v).prepare(q, k, v)
                fwd_launch()
                o, lse = fwd_finish()
                kern = c.backward_kernel(q, k, v)
                sizes = {"B": B, "H": H, "M": N, "N": N, "D": D}  # what c.backward passes after the captures
                bwd_launch, _ = kern.prepare(q, k, v, o, lse, do, *(sizes[d] for d in kern.spec.dims))

                def both():
                    fwd_launch()
                    bwd_launch()
                return both

            measure(row, f"bwd ours {config_tag(cfg)}", f2, prepared_bwd)
        c = make_compiled(D, causal, "f16", configs[0], args.bwd_pipeline)

        def call():
            o, lse = c.forward(q, k, v)
            c.backward(q, k, v, o, lse, do)

        measure(row, "bwd ours+call", f2, lambda: call)
        measure(row, "bwd autograd", f2, lambda: lambda: c(ql, kl, vl)[0].backward(do), grad_to_none=[ql, kl, vl])
    return row


# Flex's own kernel choice can ask for more shared memory than the H100 has with a captured f32 table in the
# score_mod (bias, relative_bias at D = 64: 245760 > 232448 bytes); then smaller blocks / fewer stages.
FLEX_OPTIONS = [None, {"num_stages": 1},
                {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64,
                 "BLOCK_N2": 32}]


def measure_flex(row: dict, key: str, flops: float, call: Callable, grad_to_none=None) -> bool:
    """measure() of call(kernel_options) with FLEX_OPTIONS in turn until one compiles; notes which."""
    for opts in FLEX_OPTIONS:
        if measure(row, key, flops, lambda: lambda: call(opts), grad_to_none):
            if opts is not None:
                row[f"{key} options"] = opts
                log(f"  {key}: ran with kernel_options={opts}")
            return True
    return False


def time_example(args, stem: str, D: int, N: int = 4096) -> dict:
    B, H = batch_heads(D, N)
    var = variant(stem, B, H, N, D)
    torch.manual_seed(0)
    q = torch.randn(B, H, N, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, H // var.group, N, D, device="cuda", dtype=torch.float16) for _ in range(2))
    do = torch.randn_like(q)
    density = mask_density(var, B, N)
    flops = 4 * B * H * N * N * D * density
    row = {"example": stem, "D": D, "N": N, "B": B, "H": H, "density": density}
    block_mask = block_mask_for(var.mask_mod, B, H, N, var.per_batch)
    if var.mask_mod is not None:  # what Flex leaves out of its timing: a new mask (new document ids) costs this
        try:
            row["flex mask ms"] = bench(lambda: block_mask_for(var.mask_mod, B, H, N, var.per_batch), 5, 20)
        except Exception as exc:
            log(f"  {stem}: create_block_mask failed: {type(exc).__name__}: {str(exc)[:120]}")

    def flex(qq, kk, vv, score_mod, opts):
        return flex_attention()(qq, kk, vv, score_mod=score_mod, block_mask=block_mask, scale=var.scale,
                                enable_gqa=var.group > 1, kernel_options=opts)

    c = example_compiled(stem)
    caps = [var.captures[a.name] for a in c.func.args[3:]]
    grad_caps = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in caps]
    floats = [x for x in grad_caps if x.requires_grad]
    if args.fwd:
        measure_flex(row, "fwd flex", flops, lambda opts: flex(q, k, v, var.score_mod, opts))
        measure(row, "fwd ours+call", flops, lambda: lambda: c.forward(q, k, v, *caps))
        row["fwd kernel"] = c.kernel(q, k, v, *caps).spec.extra.get("schedule", "mma")
        if row["fwd kernel"] != "mma":  # the automatic choice took wgmma: mma.sync beside it
            cm = example_compiled(stem, "mma")
            measure(row, "fwd mma+call", flops, lambda: lambda: cm.forward(q, k, v, *caps))
        o_auto = c.forward(q, k, v, *caps)[0].float()
        for cfg in args.ex_configs:  # other kernels for the same variant, by their calls
            tag = config_tag(cfg)
            cc, diff = config_matching(stem, cfg, (q, k, v, *caps), o_auto)
            if diff == diff:
                row[f"fwd {tag} diff"] = diff
            if cc is not None:
                measure(row, f"fwd {tag}+call", flops, lambda cc=cc: lambda: cc.forward(q, k, v, *caps))
        kern, env = c._kernel_and_dims((q, k, v, *caps))
        blocks = c.block_data(kern)
        if blocks is not None:  # data-dependent mask (issue 12): range tables and block list, made once per ids
            # tensor and reused by the timed calls above; what new ids cost (Flex's "flex mask ms" counterpart)
            made = [*caps, *c.runtime_sizes(kern, env)]
            row["ours mask ms"] = bench(lambda: blocks._make(made, (B, H, N, N), q), 5, 20)
            log(f"  {stem}: block data for new ids {row['ours mask ms']:.3f} ms "
                f"(flex create_block_mask {row.get('flex mask ms', NAN):.3f} ms)")
    if args.bwd:
        f2 = 3.5 * flops
        ql, kl, vl = leaves(q, k, v)
        if floats:  # Flex's mods close over their tensors: a second variant's, as leaves that require grad
            sub = variant(stem, B, H, N, D)
            sub_leaves = [x.requires_grad_(True) for x in sub.captures.values() if x.is_floating_point()]
            measure_flex(row, "bwd flex", f2, lambda opts: flex(ql, kl, vl, sub.score_mod, opts).backward(do),
                         grad_to_none=[ql, kl, vl, *sub_leaves])
        # without captured tensors' gradients (fixed slopes or bias; falower always computes them)
        measure_flex(row, "bwd flex nodcap" if floats else "bwd flex", f2,
                     lambda opts: flex(ql, kl, vl, var.score_mod, opts).backward(do), grad_to_none=[ql, kl, vl])

        def call():
            o, lse = c.forward(q, k, v, *caps)
            c.backward(q, k, v, o, lse, do, *caps)

        measure(row, "bwd ours+call", f2, lambda: call)
        # the backward alone (2.5 of the forward's FLOPs), on the forward's o and lse
        o_b, lse_b = c.forward(q, k, v, *caps)
        measure(row, "bwd only", 2.5 * flops, lambda: lambda: c.backward(q, k, v, o_b, lse_b, do, *caps))
        for cfg in args.ex_configs if not args.fwd else ():  # --bwd alone: other configs' backward (A / B)
            tag = config_tag(cfg)
            cc = example_compiled_config(stem, cfg)
            if measure(row, f"bwd only {tag}", 2.5 * flops,
                       lambda cc=cc: lambda: cc.backward(q, k, v, o_b, lse_b, do, *caps)):
                log(f"  {stem}: backward alone {row['bwd only']:.0f} TFLOP/s, {row[f'bwd only {tag}']:.0f} under {tag}")
        if c.backward_kernel(q, k, v, *caps).spec.block_mask == "list":  # issue 12: beside the scan it replaced
            scan = example_compiled(stem, bwd_block_list=False)
            measure(row, "bwd only scan", 2.5 * flops, lambda: lambda: scan.backward(q, k, v, o_b, lse_b, do, *caps))
            mma = example_compiled(stem, bwd_schedule="mma")  # the mma.sync backward over the same lists
            measure(row, "bwd only mma", 2.5 * flops, lambda: lambda: mma.backward(q, k, v, o_b, lse_b, do, *caps))
            log(f"  {stem}: backward alone {row.get('bwd only', NAN):.0f} TFLOP/s over its block lists, "
                f"{row.get('bwd only scan', NAN):.0f} scanning the range tables, "
                f"{row.get('bwd only mma', NAN):.0f} on mma.sync over the lists")
        measure(row, "bwd autograd", f2, lambda: lambda: c(ql, kl, vl, *grad_caps)[0].backward(do),
                grad_to_none=[ql, kl, vl, *floats])
    # sanity, not a check: falower against Flex (both fp16), relative to the output's size
    try:
        o_ours = c.forward(q, k, v, *caps)[0]
        o_flex = flex(q, k, v, var.score_mod, row.get("fwd flex options"))
        row["o diff vs flex"] = ((o_ours.float() - o_flex.float()).abs().max() / o_flex.float().abs().max()).item()
    except Exception as exc:
        row["o diff vs flex"] = NAN
        log(f"  {stem}: comparison with flex failed: {type(exc).__name__}: {str(exc)[:120]}")
    return row


def rounds_summary(times: dict, flops: dict, plain: str = "plain", clocks: Optional[dict] = None) -> list[dict]:
    """Per example: TFLOP/s of falower's whole call and of Flex, each the median over the rounds, their spread
    ((max - min) / median), and the two ratios the issue asks about taken round by round (falower over plain
    falower, falower over Flex) as median, min and max. times[(stem, who)] = one time in ms per round, who "ours"
    or "flex"; a round where a needed time is missing drops out of that ratio. With `clocks` (the same keys: each
    timing's SM clock in MHz, --clocks) also each row's median clock and its ratio to plain by cycles (the time
    ratio times plain's clock over the row's, round by round): what the pairs read, where both run at one clock."""
    import statistics

    def tflops(stem: str, who: str) -> list[float]:
        if who == "flex":  # "causal -wsg-p132": another kernel for causal, against causal's Flex twin
            stem = stem.split(" ")[0]
        return [flops[stem] / t / 1e9 for t in times.get((stem, who), [])]

    def ratios(a: list[float], b: list[float]) -> list[float]:
        return [x / y for x, y in zip(a, b) if x == x and y == y and y > 0]

    def stats(xs: list[float]) -> dict:
        xs = [x for x in xs if x == x]  # a round whose call failed (NaN) drops out
        if not xs:
            return {"median": NAN, "min": NAN, "max": NAN}
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    out = []
    ours_plain = tflops(plain, "ours")
    for stem in flops:
        ours, flex = tflops(stem, "ours"), tflops(stem, "flex")
        o, f = stats(ours), stats(flex)
        base = stem.split(" ")[0]
        paired = ratios(ours, tflops(base, "ours")) if base != stem else []
        out.append({"example": stem, "rounds": sum(1 for x in ours if x == x), "ours": o["median"],
                    "ours spread": (o["max"] - o["min"]) / o["median"] if o["median"] == o["median"] else NAN,
                    "flex": f["median"],
                    "of plain": stats(ratios(ours, ours_plain)) if ours_plain else stats([]),
                    "over flex": stats(ratios(ours, flex)),
                    # an --ex-configs row against its example's default kernel, round by round, and the rounds
                    # it was the faster in: a paired reading, where the two rows' medians each carry the drift
                    "of default": {**stats(paired), "wins": sum(1 for x in paired if x > 1), "n": len(paired)}})
        if clocks is not None:
            mine, plains = clocks.get((stem, "ours"), []), clocks.get((plain, "ours"), [])
            out[-1]["MHz"] = stats(mine)["median"]
            by_cycles = [x / y * fp / fm for x, y, fp, fm in zip(ours, ours_plain, plains, mine) if y > 0 and fm > 0]
            out[-1]["of plain by cycles"] = stats(by_cycles)  # a round with a NaN time or clock drops out
    return out


def paired_calls(fa: Callable, fb: Callable, pairs: int) -> list[tuple[float, float]]:
    """`pairs` pairs of single calls, a and b back to back (the order alternating pair by pair), each after L2 is
    flushed (do_bench's 256 MB write) and timed by its own events: [(ms of a, ms of b)]. Why: rounds of do_bench
    put ~0.1 s between two calls' timings, and the H200's clocks drift by more than that: two rows of one kernel
    read 1.042 [0.89, 1.12] apart over 13 rounds (forty-sixth session, call A). Calls a millisecond apart share
    the clock, so their ratio is the kernels' own in cycles. At the power cap a kernel run alone settles at a clock
    of its own (ALiBi ~6% above causal, forty-seventh session): its time alone is the cycles at that clock, which
    --clocks reads. Each call is timed whole, its host work included where the GPU waits for it (the flush before
    it gives the host ~0.1 ms to start), as do_bench times it."""
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    fa(), fb()  # warm (the rounds ran them already; a first call's allocations stay out)
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(pairs)]
    for i in range(pairs):
        order = ((fa, 0), (fb, 2)) if i % 2 == 0 else ((fb, 2), (fa, 0))
        for fn, e in order:
            cache.zero_()
            ev[i][e].record()
            fn()
            ev[i][e + 1].record()
    torch.cuda.synchronize()
    return [(e[0].elapsed_time(e[1]), e[2].elapsed_time(e[3])) for e in ev]


def paired_summary(ratios: list[float], seed: int = 0) -> dict:
    """The median of per-pair ratios and a 90% bootstrap interval of that median (1000 resamples): the interval is
    how far the median itself could move, not the pairs' spread."""
    import random
    import statistics

    if not ratios:
        return {"median": NAN, "lo": NAN, "hi": NAN, "n": 0, "p05": NAN, "p95": NAN}
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(1000))
    xs = sorted(ratios)
    return {"median": statistics.median(ratios), "lo": meds[50], "hi": meds[949], "n": len(ratios),
            "p05": xs[int(0.05 * (len(xs) - 1))], "p95": xs[int(0.95 * (len(xs) - 1))]}  # the pairs' own spread


def time_examples_paired(calls: dict, flops: dict, pairs: int) -> dict:
    """--pairs: each row against plain falower (plain against itself: the method's own noise, A/A), each default
    row against its Flex twin, and each --ex-configs row against its example's default, by `paired_calls`: {(row,
    "of plain" | "over flex" | "of default"): paired_summary of TFLOP/s ratios}."""
    out = {}
    for stem in flops:
        base = stem.split(" ")[0]
        against = [("of plain", ("plain", "ours"))]
        against.append(("over flex", (stem, "flex")) if base == stem else ("of default", (base, "ours")))
        for what, other in against:
            if (stem, "ours") not in calls or other not in calls:
                continue
            try:
                ts = paired_calls(calls[(stem, "ours")], calls[other], pairs)
            except Exception as exc:
                log(f"  pairs: {stem} {what} failed: {type(exc).__name__}: {first_line(exc)}")
                continue
            f_other = flops[other[0]] if other[1] == "ours" else flops[stem]  # Flex's twin: the same kept pairs
            out[(stem, what)] = {**paired_summary([flops[stem] / f_other * tb / ta for ta, tb in ts]),
                                 "ms": ts}  # each pair's two times (results.json)
        log(f"  pairs: {stem} done")
    return out


def time_examples_rounds(stems: list, D: int, rounds: int, N: int = 4096, configs: tuple = (),
                         pairs: int = 0, round_ms: int = 25) -> list[dict]:
    """--rounds: every example's whole falower call and its Flex twin (the same mods and block mask), timed in
    `rounds` rounds, each round every call once (do_bench, `round_ms` / 5 ms warm-up, `round_ms` ms: --round-ms) in a
    fresh random order. The GPU's clocks drift across a run by more than the gaps issue 12 asks about (one kernel read
    3-8% apart in one call): interleaving spreads the drift over every call alike, and the ratios are taken within
    each round. At the power cap a kernel's clock settles over tens of milliseconds (benchmarks/clocks.py): 25 ms
    timings start at the clock the call before left, a second's take the kernel's own (--round-ms 1000, with
    --clocks to read it). Each of `configs` (--ex-configs) adds the example under that kernel as a row
    "<stem> <tag>", in the same rounds."""
    import random

    B, H = batch_heads(D, N)
    calls, flops, diffs = {}, {}, {}
    for stem in (["plain"] if "plain" not in stems else []) + list(stems):
        try:
            _rounds_calls(stem, B, H, N, D, calls, flops, diffs, configs)
        except Exception as exc:  # one example's set-up (a compile, memory) leaves the others' rounds
            log(f"  rounds: {stem} left out: {type(exc).__name__}: {first_line(exc)}")
            for key in [key for key in calls if key[0].split(" ")[0] == stem]:  # its config rows too
                calls.pop(key)
            for name in [name for name in flops if name.split(" ")[0] == stem]:
                flops.pop(name)
    times: dict = {key: [] for key in calls}
    mhz: dict = {key: [] for key in calls}  # --clocks: each timing's SM clock
    rng = random.Random(0)
    for r in range(rounds):
        order = list(calls)
        rng.shuffle(order)
        for key in order:
            try:
                ms, clock = clocked(bench, calls[key], max(1, round_ms // 5), round_ms)
                times[key].append(ms)
                mhz[key].append(clock)
            except Exception as exc:  # a failed call is a missing time in its round, not a lost table
                times[key].append(NAN)
                mhz[key].append(NAN)
                log(f"  rounds: {key} round {r + 1} failed: {type(exc).__name__}")
        log(f"  rounds: {r + 1} / {rounds} done")
    out = rounds_summary(times, flops, clocks=mhz if CLOCKS else None)
    by_pairs = time_examples_paired(calls, flops, pairs) if pairs else {}
    for row in out:
        row["D"], row["N"] = D, N
        for what in ("of plain", "over flex", "of default"):
            if (row["example"], what) in by_pairs:
                row[f"{what}, paired"] = by_pairs[(row["example"], what)]
        row["o diff vs flex"] = diffs.get(row["example"], NAN)  # sanity, not a check (both fp16)
        # each round's time in ms, ours and Flex's (results.json): any pairing can be taken again later
        row["round ms"] = {who: times.get((row["example"], who), []) for who in ("ours", "flex")}
    return out


def knobs_refused(knobs: dict, base, got: dict) -> str:
    """Why an 'auto-<knobs>' row's kernel (spec.extra `got`) is not the automatic choice's kernel (spec `base`)
    with the knobs, or "": the choice's form (schedule, producer, persistence) with the knobs fails validate_spec,
    and the kernel built is another form (the fallback; plain's 'auto-cm' timed emit_fa3's kernel as the knob's).
    The knobs are in `got` either way (the fallback's spec carries the caller's extras), so they cannot tell; nor
    can a change of form alone, which the choice also makes for cost after validation (persistent_pays: the
    relative bias at D = 128 under '-notmal' is one block an item by design). Backward knobs leave the forward as
    it is."""
    import dataclasses

    from falower.backends.numba_cuda import emit_fa3
    from falower.backends.numba_cuda.spec import KERNEL_FORM, forward_extra

    fwd = forward_extra(knobs)
    if not fwd or all(got.get(k) == base.extra.get(k) for k in KERNEL_FORM):
        return ""
    try:
        emit_fa3.validate_spec(dataclasses.replace(base, extra={**base.extra, **fwd}))
    except ValueError as exc:
        return f"{first_line(exc)} (ran {', '.join(f'{k} {got.get(k)}' for k in KERNEL_FORM)})"
    return ""


def config_matching(stem: str, cfg: tuple, inputs: tuple, o_auto) -> tuple[Optional[Any], float]:
    """examples/<stem>.py under tile config `cfg` (--ex-configs) and its output's largest difference from the
    automatic choice's `o_auto` on `inputs`; the compiled call is None (and the reason logged) where it failed or
    its output differs by more than 2e-2 of O's scale, or where it is the automatic choice with knobs ('auto-cm')
    whose kernel the knobs' own kernel refused (the choice fell back to another schedule: timing that row would
    time the fallback, not the knob): not timed. The difference is NaN where it failed."""
    tag = config_tag(cfg)
    try:
        cc = example_compiled_config(stem, cfg)
        if cfg[0] == "auto":
            why = knobs_refused(cfg[1], example_compiled(stem).kernel(*inputs).spec,
                                cc.kernel(*inputs).spec.extra)
            if why:
                log(f"  {stem} {tag}: the automatic choice refused {cfg[1]} and fell back: {why}; not timed")
                return None, NAN
        diff = (cc.forward(*inputs)[0].float() - o_auto).abs().max().item()
    except Exception as exc:
        log(f"  {stem} {tag} failed: {type(exc).__name__}: {first_line(exc)}")
        return None, NAN
    if not diff <= 2e-2 * max(1.0, o_auto.abs().max().item()):
        log(f"  {stem} {tag}: output differs from the automatic choice's by {diff:.2e}: not timed")
        return None, diff
    return cc, diff


def first_line(exc: BaseException) -> str:
    """An exception's first line, at most 160 characters: what the logs and tables say of a failure."""
    return str(exc).splitlines()[0][:160] if str(exc) else ""


def _rounds_calls(stem: str, B: int, H: int, N: int, D: int, calls: dict, flops: dict, diffs: dict,
                  configs: tuple = ()) -> None:
    """The example's whole falower call and its Flex twin (the first kernel options Flex compiles with, as
    measure_flex takes them) into `calls`, its kept FLOPs into `flops`, falower's output against Flex's into
    `diffs` (the config rows' too); each of `configs` whose output matches the automatic choice's as "<stem>
    <tag>"."""
    var = variant(stem, B, H, N, D)
    torch.manual_seed(0)
    q = torch.randn(B, H, N, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, H // var.group, N, D, device="cuda", dtype=torch.float16) for _ in range(2))
    flops[stem] = 4 * B * H * N * N * D * mask_density(var, B, N)
    c = example_compiled(stem)
    caps = [var.captures[a.name] for a in c.func.args[3:]]
    calls[(stem, "ours")] = (lambda c=c, q=q, k=k, v=v, caps=caps: c.forward(q, k, v, *caps))
    o_auto = c.forward(q, k, v, *caps)[0].float()
    kept = [stem]  # the rows whose output is compared with Flex's below
    for cfg in configs:
        name = f"{stem} {config_tag(cfg)}"
        cc, _ = config_matching(stem, cfg, (q, k, v, *caps), o_auto)
        if cc is None:
            continue
        calls[(name, "ours")] = (lambda cc=cc, q=q, k=k, v=v, caps=caps: cc.forward(q, k, v, *caps))
        flops[name] = flops[stem]
        kept.append(name)
    block_mask = block_mask_for(var.mask_mod, B, H, N, var.per_batch)
    for opts in FLEX_OPTIONS:  # the first kernel options Flex compiles with, as measure_flex takes them
        def fx(q=q, k=k, v=v, var=var, block_mask=block_mask, opts=opts):
            return flex_attention()(q, k, v, score_mod=var.score_mod, block_mask=block_mask, scale=var.scale,
                                    enable_gqa=var.group > 1, kernel_options=opts)
        try:
            fx()
            torch.cuda.synchronize()
        except Exception as exc:
            log(f"  rounds: {stem} Flex with {opts}: {type(exc).__name__}")
            continue
        calls[(stem, "flex")] = fx
        o_flex = fx().float()
        for name in kept:  # each config row's own output, not only the default's (a table's nan read as a NaN)
            o_ours = calls[(name, "ours")]()[0].float()
            diffs[name] = ((o_ours - o_flex).abs().max() / o_flex.abs().max()).item()
        break


def rounds_table(rows: list, dev: str, rounds: int) -> list[str]:
    md = [f"Examples at N = {rows[0].get('N', 4096) if rows else '-'}, D = {rows[0]['D'] if rows else '-'}, fp16, "
          f"{dev}: {rounds} interleaved rounds "
          "(every call once a round, in a random order); TFLOP/s of the kept pairs by the whole call, the median "
          "over rounds; ratios taken within each round, median [min, max]", "",
          "| example | falower | spread | of plain | Flex | falower / Flex | o diff | of default (rounds faster) |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, f, d = r["of plain"], r["over flex"], r.get("of default", {"n": 0})
        paired = (f"{d['median']:.3f} [{d['min']:.3f}, {d['max']:.3f}] ({d['wins']}/{d['n']})" if d["n"] else "-")
        md.append(f"| {r['example']} | {r['ours']:.0f} | {100 * r['ours spread']:.1f}% | {p['median']:.3f} "
                  f"[{p['min']:.3f}, {p['max']:.3f}] | {r['flex']:.0f} | {f['median']:.2f} "
                  f"[{f['min']:.2f}, {f['max']:.2f}] | {r['o diff vs flex']:.1e} | {paired} |")
    if any("MHz" in r for r in rows):
        md += ["", "The same rounds by the SM clock (--clocks: nvidia-smi every 20 ms during each timing); of plain by "
               "cycles = of plain x plain's clock / the row's, round by round (what a pair of calls at one clock "
               "reads):", "", "| example | MHz | of plain | of plain by cycles |", "|---|---|---|---|"]
        for r in rows:
            p, c = r["of plain"], r.get("of plain by cycles", {"median": NAN, "min": NAN, "max": NAN})
            md.append(f"| {r['example']} | {r.get('MHz', NAN):.0f} | {p['median']:.3f} | {c['median']:.3f} "
                      f"[{c['min']:.3f}, {c['max']:.3f}] |")
    n_pairs = next((r[k]["n"] for r in rows for k in ("of plain, paired", "over flex, paired", "of default, paired")
                    if k in r), 0)
    if n_pairs:
        md += ["", f"The same rows by call pairs (--pairs: {n_pairs} pairs of single calls "
               "back to back, L2 flushed before each; the median of the pairs' ratios [its 90% bootstrap interval] "
               "(the pairs' 5th-95th percentiles); plain against itself is the method's noise):", "",
               "| example | of plain, paired | over Flex, paired | of default, paired |", "|---|---|---|---|"]
        for r in rows:
            cells = []
            for what in ("of plain, paired", "over flex, paired", "of default, paired"):
                x = r.get(what)
                cells.append(f"{x['median']:.3f} [{x['lo']:.3f}, {x['hi']:.3f}] ({x['p05']:.3f}-{x['p95']:.3f})"
                             if x and x["n"] else "-")
            md.append(f"| {r['example']} | {' | '.join(cells)} |")
    return md


# ------------------------------------------------------------------------------------------------
# Precompiling in parallel processes
# ------------------------------------------------------------------------------------------------


def _worker_sizes(shape: dict, ex_n: int) -> None:
    """A spawned precompile worker's --batch / --heads and --ex-n (module state the spawn does not carry)."""
    SHAPE.update(shape)
    EX_N[0] = ex_n


def _compile_one(job) -> str:
    """Build and launch one kernel on tiny inputs (fills Numba's disk cache); never raises."""
    t0 = time.time()
    try:
        what, *rest = job
        if what in ("fwd", "bwd"):
            D, causal, cfg, bwd_pipeline = rest
            c = make_compiled(D, causal, "f16", cfg, bwd_pipeline)
            q = torch.randn(1, 1, 64, D, device="cuda", dtype=torch.float16)
            if what == "fwd":  # the kernel of a tiny call and the reference length's (D = 64 chooses by size, and
                c.kernel(q, q, q)(q, q, q)  # by the grid: the timed B and H at 1k and 4k)
                c.specialize("f16", D=D, M=4096, N=4096)(q, q, q)
                for n in (1024, 4096):
                    b, h = batch_heads(D, n)
                    c.specialize("f16", D=D, M=n, N=n, B=b, H=h)(q, q, q)
            else:  # the forward is another job: any o and lse compile the backward
                c.backward(q, q, q, q.clone(), torch.zeros(1, 1, 64, device="cuda"), q)
        else:
            stem, D, *cfg = rest
            c = example_compiled_config(stem, cfg[0]) if cfg else example_compiled(stem)
            H = 2048 // D
            var = variant(stem, 1, H, 64, D)
            q = torch.randn(1, H, 64, D, device="cuda", dtype=torch.float16)
            kv = torch.randn(1, H // var.group, 64, D, device="cuda", dtype=torch.float16)
            caps = [var.captures[a.name] for a in c.func.args[3:]]
            if what == "ex-fwd":
                c.forward(q, kv, kv, *caps)
                # the timed calls' kernel (--ex-n, --batch / --heads), by a whole call: a call may pass the kernel
                # more tables than the user captured (the relative bias's), which launching c.specialize(...)
                # directly would refuse
                n = EX_N[0]
                b4, h4 = batch_heads(D, n)
                var4 = variant(stem, b4, h4, n, D)
                q4 = torch.randn(b4, h4, n, D, device="cuda", dtype=torch.float16)
                kv4 = torch.randn(b4, h4 // var4.group, n, D, device="cuda", dtype=torch.float16)
                c.forward(q4, kv4, kv4, *[var4.captures[a.name] for a in c.func.args[3:]])
                if not cfg and c.kernel(q, kv, kv, *caps).spec.extra.get("schedule", "mma") != "mma":
                    example_compiled(stem, "mma").forward(q, kv, kv, *caps)
            else:
                lse = torch.zeros(1, H, 64, device="cuda")
                c.backward(q, kv, kv, q.clone(), lse, q, *caps)
                if c.backward_kernel(q, kv, kv, *caps).spec.block_mask == "list":  # the twins timed beside it
                    for twin in (example_compiled(stem, bwd_block_list=False),
                                 example_compiled(stem, bwd_schedule="mma")):
                        twin.backward(q, kv, kv, q.clone(), lse, q, *caps)
        torch.cuda.synchronize()
    except Exception as exc:
        return f"FAILED {job}: {type(exc).__name__}: {first_line(exc)}"
    return f"{job} {time.time() - t0:.1f}s"


def precompile(jobs) -> None:
    """Compile every kernel in parallel processes; Numba's disk cache (cache=True, next to the generated
    source) then lets this process load them instead of compiling one after another."""
    import concurrent.futures
    import multiprocessing

    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 4), mp_context=ctx,
                                                initializer=_worker_sizes, initargs=(dict(SHAPE), EX_N[0])) as ex:
        done = list(ex.map(_compile_one, jobs))
    for line in done:
        if line.startswith("FAILED"):
            log(f"  precompile {line}")
    log(f"precompiled {len(done)} kernels in {time.time() - t0:.1f}s")


# ------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------


def _f(x, digits=0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ratio(a, b) -> str:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return "-"
    return f"{a / b:.2f}"


def sweep_table(rows: list, phase: str, dev: str) -> list[str]:
    ours = list(dict.fromkeys(k for r in rows for k in r if k.startswith(f"{phase} ours ")))  # per-D configs
    extra = ["ours+call"] + (["autograd"] if phase == "bwd" else [])
    others = ["flash", "cudnn", "flex"]
    title = "forward" if phase == "fwd" else "forward + backward (FLOPs = 3.5 x forward)"
    # with the automatic config timed: its ratios to the others, and the best wgmma over the best mma.sync config
    auto = f"{phase} ours auto" in ours
    bwg = [k for k in ours if k.endswith(("-bwg", "-bdqk", "-bop"))]  # the backward on wgmma (emit_fa3_bwd)
    bmma = [k.rsplit("-", 1)[0] for k in bwg if k.rsplit("-", 1)[0] in ours]  # their twins on mma.sync
    wg = [k for k in ours if k.split()[-1].split("-")[1:2] == ["wg"] and k not in bwg]
    mma = [k for k in ours if k not in wg and k not in bwg and k != f"{phase} ours auto"]
    cmp = (["auto/FLASH", "auto/CUDNN", "auto/Flex"] if auto else []) + (["wg/mma"] if wg and mma else [])
    cmp += ["bwg/bmma", "bwg/FLASH"] if phase == "bwd" and bwg and bmma else []
    given = rows and (SHAPE["B"] or SHAPE["H"])
    shape = f" (B = {rows[0]['B']}, H = {rows[0]['H']}: --batch / --heads)" if given else ""
    md = [f"TFLOP/s, fp16 {title}, {dev}, {time.strftime('%Y-%m-%d', time.gmtime())}{shape}", "",
          "| D | causal | N | " + " | ".join(k[len(phase) + 1:] for k in ours) + " | " + " | ".join(extra)
          + " | FLASH | CUDNN | Flex | best/FLASH | best/CUDNN | best/Flex |" + "".join(f" {x} |" for x in cmp),
          "|" + "---|" * (3 + len(ours) + len(extra) + 6 + len(cmp))]

    def best_of(r, keys):
        finite = [r[k] for k in keys if not math.isnan(r.get(k, NAN))]
        return max(finite) if finite else NAN

    for r in rows:
        vals = [r.get(k, NAN) for k in ours]
        best = best_of(r, ours)
        ex = [r.get(f"{phase} ours+call", NAN)] + ([r.get("bwd autograd", NAN)] if phase == "bwd" else [])
        ref = [r.get(f"{phase} {o}", NAN) for o in others]
        more = [_ratio(r.get(f"{phase} ours auto", NAN), x) for x in ref] if auto else []
        more += [_ratio(best_of(r, wg), best_of(r, mma))] if wg and mma else []
        if phase == "bwd" and bwg and bmma:  # best fwd+bwd with the wgmma backward over the best with mma.sync's
            more += [_ratio(best_of(r, bwg), best_of(r, bmma)), _ratio(best_of(r, bwg), r.get("bwd flash", NAN))]
        md.append(f"| {r['D']} | {'y' if r['causal'] else 'n'} | {r['N']} | " + " | ".join(_f(x) for x in vals)
                  + " | " + " | ".join(_f(x) for x in ex) + " | " + " | ".join(_f(x) for x in ref) + " | "
                  + " | ".join(_ratio(best, x) for x in ref) + " |" + "".join(f" {x} |" for x in more))
    return md


def example_table(rows: list, dev: str) -> list[str]:
    """Flex no-dcap: Flex without the captured tensors' gradients (falower always computes them);
    mask ms: Flex's create_block_mask, outside its timings (falower classifies tiles inside each call).
    bwd ours: the backward alone; bwd scan: the same, its kv-outer kernel scanning range tables instead of
    visiting block lists (data-dependent masks only, issue 12); bwd mma: the backward on mma.sync over the same
    lists (what ran before the lists were walked on wgmma)."""
    md = [f"Examples at N = {rows[0].get('N', 4096) if rows else '-'}, TFLOP/s of the pairs the mask keeps, fp16, "
          f"{dev}; falower by its calls "
          "(fwd kernel: the automatic choice; fwd mma: the mma.sync kernel where that choice was wgmma)", "",
          "| example | D | keep | fwd kernel | fwd ours | fwd mma | ours/mma | fwd Flex | ours/Flex | f+b ours "
          "| f+b autograd | f+b Flex | ours/Flex | f+b Flex no-dcap | ours/no-dcap | Flex mask ms | o diff "
          "| bwd ours | bwd scan | bwd mma |",
          "|" + "---|" * 20]
    for r in rows:
        md.append(f"| {r['example']} | {r['D']} | {r['density']:.2f} | {r.get('fwd kernel', '-')} | "
                  f"{_f(r.get('fwd ours+call'))} | {_f(r.get('fwd mma+call'))} | "
                  f"{_ratio(r.get('fwd ours+call'), r.get('fwd mma+call'))} | "
                  f"{_f(r.get('fwd flex'))} | {_ratio(r.get('fwd ours+call'), r.get('fwd flex'))} | "
                  f"{_f(r.get('bwd ours+call'))} | {_f(r.get('bwd autograd'))} | {_f(r.get('bwd flex'))} | "
                  f"{_ratio(r.get('bwd ours+call'), r.get('bwd flex'))} | {_f(r.get('bwd flex nodcap'))} | "
                  f"{_ratio(r.get('bwd ours+call'), r.get('bwd flex nodcap'))} | {_f(r.get('flex mask ms'), 2)} | "
                  f"{r.get('o diff vs flex', NAN):.1e} | {_f(r.get('bwd only'))} | {_f(r.get('bwd only scan'))} | "
                  f"{_f(r.get('bwd only mma'))} |")
    tags = list(dict.fromkeys(k[4:-5] for r in rows for k in r if k.startswith("fwd ") and k.endswith("+call")
                              and k not in ("fwd ours+call", "fwd mma+call")))
    if tags:  # --ex-configs: the same variants under other kernels
        md += ["", "Forward under other kernels (--ex-configs), TFLOP/s of the kept pairs by the call, and over Flex", "",
               "| example | D | auto | " + " | ".join(tags) + " | Flex | " + " | ".join(f"{t}/Flex" for t in tags) + " |",
               "|" + "---|" * (4 + 2 * len(tags))]
        for r in rows:
            vals = [r.get(f"fwd {t}+call") for t in tags]
            md.append(f"| {r['example']} | {r['D']} | {_f(r.get('fwd ours+call'))} | " + " | ".join(_f(x) for x in vals)
                      + f" | {_f(r.get('fwd flex'))} | " + " | ".join(_ratio(x, r.get('fwd flex')) for x in vals) + " |")
    return md


# ------------------------------------------------------------------------------------------------


def main() -> None:
    global DOCUMENTS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 1k, 4k; examples at the first D only")
    ap.add_argument("--fwd", action="store_true", help="time the forward (default: forward and fwd+bwd)")
    ap.add_argument("--bwd", action="store_true", help="time forward+backward (default: forward and fwd+bwd)")
    ap.add_argument("--d", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="*", default=None)
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--configs", default="", help="comma-separated forward tile configs, e.g. 64x64w4,128x64w8")
    ap.add_argument("--bwd-pipeline", default=None, help="backward pipeline string (default fa2-bwd)")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-examples", action="store_true", help="skip the examples' variants at N = 4k")
    ap.add_argument("--examples", default="", help="comma-separated example names (default: all)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="time every example's forward and its Flex twin in this many interleaved rounds (ratios "
                         "to plain and to Flex taken round by round; --ex-configs join the rounds as "
                         "rows '<example> <tag>', each also over its example's default row round by round, with "
                         "the rounds it was faster in); with --fwd alone, instead of one example after another")
    ap.add_argument("--pairs", type=int, default=0,
                    help="with --rounds: also time each example against plain (plain against itself: the noise) "
                         "and each --ex-configs row against its default by this many pairs of single calls back to "
                         "back (bench.paired_calls; 200 takes ~1 s a row at N = 4k)")
    ap.add_argument("--ex-configs", default="",
                    help="comma-separated tile configs to time each example under too, e.g. 128x64w8-wsn,128x64w4")
    ap.add_argument("--round-ms", type=int, default=25,
                    help="with --rounds: each call's timing in a round, in ms of do_bench (default 25; 1000 lets "
                         "the clock settle at the kernel's own under the power cap: --clocks reads it)")
    ap.add_argument("--clocks", action="store_true",
                    help="sample the SM clock and power (nvidia-smi, every 20 ms) and give each timing's clock: the "
                         "rounds' rows their ratio to plain by cycles too (each kernel alone at the power cap runs "
                         "at its own clock; benchmarks/clocks.py)")
    ap.add_argument("--ex-n", type=int, default=4096,
                    help="the examples' sequence length (default 4096; with --batch / --heads a small grid's A / B "
                         "of kernels by --ex-configs and --pairs)")
    ap.add_argument("--batch", type=int, default=0, help="B of every timed call (default: 16k tokens / N)")
    ap.add_argument("--heads", type=int, default=0, help="H of every timed call (default: 2048 / D)")
    ap.add_argument("--documents", type=int, default=DOCUMENTS,
                    help="the document example's documents a row, of random lengths (default 8: ~512 tokens at "
                         "N = 4k; more, shorter documents leave more of a wide tile masked)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--precompile", action="store_true", help="compile all kernels in parallel first")
    ap.add_argument("--bwd-wgmma", action="store_true",
                    help="time each tile config once more with the backward on wgmma ('-bwg', emit_fa3_bwd)")
    args = ap.parse_args()
    if args.documents < 1:
        ap.error(f"--documents must be at least 1, got {args.documents}")
    DOCUMENTS = args.documents
    if args.ex_n < 1:
        ap.error(f"--ex-n must be at least 1, got {args.ex_n}")
    EX_N[0] = args.ex_n
    if args.round_ms < 1:
        ap.error(f"--round-ms must be at least 1, got {args.round_ms}")
    if args.batch < 0 or args.heads < 0:
        ap.error("--batch and --heads must be positive (0: the sweep's default)")
    SHAPE.update(B=args.batch, H=args.heads)
    if not args.fwd and not args.bwd:
        args.fwd = args.bwd = True
    args.ex_configs = [parse_config(c) for c in args.ex_configs.split(",") if c]
    OUT.mkdir(parents=True, exist_ok=True)
    Ns = args.n or ([1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384])
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    stems = [] if args.no_examples else (args.examples.split(",") if args.examples else example_stems())
    ex_ds = args.d[:1] if args.quick else args.d
    require_gpu("bench.py")  # (after the arguments' own checks)
    dev = torch.cuda.get_device_name()
    log(f"# bench {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} on {dev}; torch {torch.__version__}; "
        f"{'fwd ' if args.fwd else ''}{'fwd+bwd' if args.bwd else ''}")
    configs_for = {D: [parse_config(c) for c in args.configs.split(",")] if args.configs else default_configs(D)
                   for D in args.d}
    if args.bwd_wgmma:
        configs_for = {D: with_wgmma_backward(cfgs) for D, cfgs in configs_for.items()}

    if args.precompile:
        jobs = []  # backward kernels first (the slow ones); one per (D, causal): the forward tiles do not change it
        for D in args.d:
            for causal in causals:
                if args.bwd:
                    jobs.append(("bwd", D, causal, configs_for[D][0], args.bwd_pipeline))
                    jobs += [("bwd", D, causal, cfg, args.bwd_pipeline) for cfg in configs_for[D][1:]
                             if cfg != AUTO and len(cfg) > 3 and cfg[3].get("bwd_schedule") == "wgmma"]
        jobs += [("ex-bwd", stem, D) for stem in stems for D in ex_ds] if args.bwd else []
        jobs += [("fwd", D, causal, cfg, args.bwd_pipeline) for D in args.d for causal in causals
                 for cfg in configs_for[D] if not _bwd_only(cfg)]  # the fwd+bwd timing runs the forward kernel too
        jobs += [("ex-fwd", stem, D) for stem in stems for D in ex_ds]
        jobs += [("ex-fwd", stem, D, cfg) for stem in stems for D in ex_ds for cfg in args.ex_configs]
        precompile(jobs)

    checks = []
    if not args.no_check:
        for D in args.d:
            for causal in causals:
                cfgs = configs_for[D]
                bwg = [cfg for cfg in cfgs[1:] if cfg != AUTO and len(cfg) > 3 and cfg[3].get("bwd_schedule") == "wgmma"]
                todo = ([("fwd", cfg) for cfg in cfgs if not _bwd_only(cfg)] if args.fwd else [])
                todo += [("bwd", cfgs[0])] if args.bwd else []
                todo += [("bwd", cfg) for cfg in bwg] if args.bwd else []  # each wgmma backward checked too
                for what, cfg in todo:
                    try:
                        r = check(D, causal, cfg) if what == "fwd" else check_bwd(D, causal, cfg, args.bwd_pipeline)
                    except Exception as exc:
                        r = {"what": what, "D": D, "causal": causal, "config": cfg, "ok": False,
                             "error": f"{type(exc).__name__}: {first_line(exc)}"}
                        log(f"check {what} D={D} causal={causal} cfg={cfg}: FAILED TO RUN: {r['error']}")
                        checks.append(r)
                        continue
                    checks.append(r)
                    if what == "fwd":
                        log(f"check fwd D={D} causal={causal} cfg={cfg}: max_err {r['max_err']:.2e} naive "
                            f"{r['naive_err']:.2e} rel {r['rel_err']:.2e} lse {r['lse_err']:.2e} "
                            f"{'OK' if r['ok'] else 'FAIL'} (first call {r['first_call_s']:.1f}s)")
                    else:
                        log(f"check bwd D={D} causal={causal} cfg={config_tag(cfg)}: " + " ".join(
                            f"{n} {r[n + '_err']:.2e} (naive {r[n + '_naive']:.2e})" for n in ("dq", "dk", "dv"))
                            + f" {'OK' if r['ok'] else 'FAIL'} (first call {r['first_call_s']:.1f}s)")

    rows, ex_rows = [], []
    for D in args.d:
        for causal in causals:
            for N in Ns:
                try:
                    row = time_row(args, D, causal, N, configs_for[D])
                except Exception as exc:  # setup of the whole row (memory, say)
                    log(f"row D={D} causal={causal} N={N} failed: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                rows.append(row)
                log(json.dumps(row))
                torch.cuda.empty_cache()
    one_by_one = not (args.rounds and args.fwd and not args.bwd)
    for stem in stems if one_by_one else ():  # --rounds --fwd: the interleaved rounds below instead
        for D in ex_ds:
            try:
                row = time_example(args, stem, D, args.ex_n)
            except Exception as exc:
                log(f"example {stem} D={D} failed: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            ex_rows.append(row)
            log(json.dumps(row))
            torch.cuda.empty_cache()
    round_rows = []
    if args.rounds and stems and args.fwd:
        for D in ex_ds:
            try:
                round_rows += time_examples_rounds(stems, D, args.rounds, N=args.ex_n, configs=tuple(args.ex_configs),
                                                   pairs=args.pairs, round_ms=args.round_ms)
            except Exception as exc:
                log(f"rounds D={D} failed: {type(exc).__name__}: {str(exc)[:160]}")
    (OUT / "results.json").write_text(json.dumps({"device": dev, "torch": torch.__version__, "checks": checks,
                                                  "rows": rows, "examples": ex_rows, "rounds": round_rows},
                                                 indent=1, default=str))

    md = []
    if rows and args.fwd:
        md += sweep_table(rows, "fwd", dev) + [""]
    if rows and args.bwd:
        md += sweep_table(rows, "bwd", dev) + [""]
    if ex_rows:
        md += example_table(ex_rows, dev)
    for D in ex_ds:
        mine = [r for r in round_rows if r["D"] == D]
        if mine:
            md += [""] + rounds_table(mine, dev, args.rounds)
    (OUT / "results.md").write_text("\n".join(md) + "\n")
    log("\n".join(md))
    if checks and not all(c["ok"] for c in checks):
        log("SOME CHECKS FAILED")
        sys.exit(1)


def run_main() -> None:
    """main(), under --clocks' sampler where asked (a clear error where nvidia-smi is missing)."""
    if "--clocks" not in sys.argv[1:]:
        return main()
    from clocks import ClockSampler

    if not ClockSampler.available():
        raise SystemExit("bench: --clocks needs nvidia-smi on the PATH")
    with ClockSampler() as sampler:
        CLOCKS.append(sampler)
        main()


if __name__ == "__main__":
    run_main()
