"""Floors of the backward's main kernel: its source with a part taken out (the dQ reductions, the elementwise
code, one of the GEMM groups, ...), each timed by the whole backward call beside the kernel as built. A floor's
numbers are wrong by design; only its time is read: what the kernel would take if that part cost nothing
(benchmarks/NOTES.md, METHOD.md's "count the floor first").

    python3 benchmarks/probe_bwd.py --d 128 [--causal] [--variants built,nored,noelem] [--json out.json]
                                    # default: every variant whose patterns the kernel has
    python3 benchmarks/probe_bwd.py --d 128 --extra '{"dq_bulk": true}' --variants built,nored,nofence,nostage
                                    # the edits on a kernel built with that spec.extra (here dQ's bulk reductions)

Every variant is compiled first in parallel processes (`--compile-one NAME`, the cubin cache shared on disk), then
timed in this one in interleaved rounds. Needs torch and a GPU.

    python3 benchmarks/probe_bwd.py --d 128 --phases [--extra JSON]

instead stamps the kernel as built with %clock64 at each phase of a q tile (PHASES: the loop's barrier, the next
tile's loads, S^T and dP^T, the elementwise code, dV / dK and dS^T's stores up to the dQ barrier, dQ's GEMM, the
reductions) and prints each phase's median cycles a tile over the blocks' warpgroups: where a tile's time goes in a
kernel whose two warpgroups walk in lockstep, latency as well as throughput (the floors above remove work; this
reads the time each phase holds the tile). Thread 0 of each warpgroup stores its stamps, a tile at a time.

    python3 benchmarks/probe_bwd.py --d 128 --example document --blocks [--variants built,tma,intile] [--drain]

stamps each block's life instead (its start, the q loop's start and end, the kernel's end, its SM and q tiles) and
prints the prologue, loop and epilogue cycles, a tile's cycles and a block's fixed cost by a line through (tiles,
cycles), and the gap between blocks on one SM: what a block with few q tiles (a window's, a document's) pays beside
its tiles; then the epilogue's timeline from the loop's end (summarize_epilogue): dq_ws's producer's last slab, its
bulk reduction's issue and read, dK / dV's barrier, staging, fence, copies' issue and reads, the end hand-off, and
with --drain the copies' writes; a row and a column pair for each variant named (the kernel as built by default).

    python3 benchmarks/probe_bwd.py --d 128 --causal --variants built,intile --rounds 0 --pairs 300

times each spec.extra variant against the kernel as built by pairs of single backward calls (bench.py's
paired_calls; with --blocks after the stamps).

On a persistent kernel (`--extra '{"bwd_persistent": 132}'`) --blocks stamps each item a block walks instead
(stamped_items_source): an item's prologue, loop and epilogue, the gap between a block's items, and the longest
block's walk over the median (what the static assignment's imbalance costs). `--example STEM` takes bench.py's
example (its mask, score and captured tensors) for any of these modes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from falower.backends.numba_cuda.emit_fa2_bwd import DKDV_LINE as STORES_LINE  # noqa: E402  (the stores' stamp)
from falower.backends.numba_cuda.emit_fa3_bwd import DKDV_ISSUED  # noqa: E402  (dkdv_in_tile's copies issued)
from falower.passes import NAMED_PIPELINES  # noqa: E402  (the backward pipeline a tile variant edits)

_GEMM_S = r"^\s*WG_S\(.*\n"
_GEMM_D = r"^\s*WG_D\(.*\n"
_GEMM_Q = r"^\s*WG_Q\(.*\n"
_DS_STORES = r"^\s*store_dst_wg\(smem_w,.*\n"
_NO_RED = (r"\b(qi|ql) < M(:| else)", r"\1 < -1\2")  # the dQ reductions' guard (vector or bulk) never true
_ELEM = (r"(s[01]), (p[01]) = elem_\w+\(lget\(x, (i(?: \+ 2)?)\), lget\(y, (i(?: \+ 2)?)\),.*",
         r"\1, \2 = lget(x, \3), lget(y, \4)")

# variants built from their own spec.extra: name -> (its keys, why); each times the kernel as built with them
EXTRA_VARIANTS: dict[str, tuple[dict, str]] = {
    "bulk": ({"dq_bulk": True}, "dQ staged, added by bulk reductions"),
    "red": ({"dq_bulk": False}, "dQ by the threads' vector reductions"),
    "dkl": ({"dk_after_dq": True}, "dK's GEMM in flight under dQ's reductions"),
    "nodkl": ({"dk_after_dq": False}, "dK's GEMM beside dV's before the barrier (dk_after_dq False, the order before "
              "the seventy-second session's default at D = 128)"),
    "pdp": ({"p_under_dp": True}, "P's exponentials under dP's GEMM"),
    "dkl_pdp": ({"dk_after_dq": True, "p_under_dp": True}, "both"),
    "pdv": ({"dv_under_dp": True}, "P's exponentials under dP's GEMM, dV's GEMM issued from P before dP's wait "
            "(dv_under_dp)"),
    "nois": ({"interior_split": False}, "one copy of the elementwise calls"),
    "noef": ({"exp_fold": False}, "the exponential's argument times log2 e"),
    "noisef": ({"interior_split": False, "exp_fold": False}, "both"),
    "late": ({"dq_late": True}, "dQ's reductions under the next tile's GEMMs"),
    "kvm": ({"kv_major": True}, "a head's kv tiles in consecutive blocks"),
    "nokvm": ({"kv_major": False}, "kv tile j of every head first"),
    "nov4": ({"grad_v4": False}, "a bias table's gradient added per element, not by 16-byte reductions"),
    "read": ({"read_v4": True}, "a bias table's entries by 16-byte loads, not gathered by each element"),
    "noread": ({"read_v4": False}, "a bias table's entries gathered by each element, not by 16-byte loads"),
    "early": ({"read_v4": "early"}, "a bias table's 16-byte loads of the tile issued before the S^T / dP^T wait"),
    "rlate": ({"read_v4": "late"}, "a bias table's 16-byte loads of each n8 tile in the element code, after the wait"),
    "binner": ({"bwd_batch_inner": True}, "the grid (batch, kv tiles, kv heads): a table read once for the batch rows"),
    **{f"kvg{g}": ({"kv_group": g}, f"kv tile j of {g} heads, then j + 1") for g in (2, 4, 8)},
    "lah": ({"list_ahead": True}, "a block list's next entry read a tile ahead"),
    "dkvb": ({"dkdv_bulk": True}, "dK and dV staged in shared memory and stored by bulk copies"),
    "nodkvb": ({"dkdv_bulk": False}, "dK and dV by the threads' direct stores"),
    "pers": ({"bwd_persistent": 132}, "132 persistent blocks, an item's loads under the last one's dK / dV copies"),
    "stsm": ({"dkdv_stsm": True}, "dK and dV staged by stmatrix"),
    "tma": ({"dkdv_tma": True}, "dK and dV staged as 16-row boxes, stored by TMA tensor copies"),
    "rows": ({"dkdv_tma": False, "dkdv_in_tile": False}, "dK and dV by a bulk copy a row (their store before "
             "dkdv_store_auto)"),
    "intile": ({"dkdv_in_tile": True}, "dK and dV staged as 16-row boxes in the last q tile under its dQ GEMM (V's "
               "rows, the other Q / dO buffer), stored by TMA tensor copies ahead of its dQ hand-off"),
    "ws": ({"dq_ws": True, "ws_loads": False}, "dQ handed to a producer warpgroup's bulk reductions, two slabs a "
           "warpgroup (the loads the consumers' own)"),
    "nows": ({"dq_ws": False}, "dQ by the consumers' own reductions (dq_ws off where \"auto\" turns it on)"),
    "ws1": ({"dq_ws": True, "ws_loads": False, "dq_ws_slabs": 1}, "... one slab a warpgroup"),
    "wsl": ({"dq_ws": True, "ws_loads": True}, "... and the next q tile's loads by two producer warps"),
    "sdpq": ({"sdp_ahead": "dq"}, "the next tile's S^T and dP^T issued beside dQ's GEMM (sdp_ahead 'dq')"),
    "sdpt": ({"sdp_ahead": "top"}, "the next tile's S^T and dP^T issued after dQ's hand-off (sdp_ahead 'top')"),
    "pp": ({"bwd_pingpong": True}, "the two consumer warpgroups out of lockstep: dQ by each one's own kv rows and slab, "
           "per-warpgroup barriers, S^T / dP^T issued in turns (bwd_pingpong)"),
    "dqalt": ({"dq_alternate": True}, "each q tile's whole dQ by one consumer warpgroup in turn (warpgroup t & 1 on "
              "tile t), the other going on to the next tile's S^T / dP^T with no barrier of both (dq_alternate)"),
    "nodqalt": ({"dq_alternate": False}, "dQ by both warpgroups on every tile (dq_alternate False, the order before the "
                "seventy-third session's default at D = 64)"),
    "sp": ({"stat_pairs": True}, "a column pair's LSE and Delta by one 8-byte shared load each (stat_pairs; 16 loads a "
           "thread and tile where the default takes 32)"),
    "norowdelta": ({"delta_per_row": False}, "dS as P (dP - Delta) c in every element, as before the seventy-first "
                   "session (delta_per_row False; the default folds c into fma(dP, c, -Delta c), -Delta c once a row)"),
    "norowlse": ({"lse_per_row": False}, "the LSE's guard and log2(e) in every element, as before the seventy-first "
                 "session (lse_per_row False; the default applies lse_row_fn once a row where the LSE is read)"),
    "gdist": ({"grad_dist": True}, "the slope gradient's distances recomputed as float(kv) - float(q) (grad_dist)"),
    "q128": ({"bwd_tiles": (128, 128)}, "128 x 128 tiles (q x kv; the default 64 x 128), its knobs' defaults there"),
    "q128wsl": ({"bwd_tiles": (128, 128), "dq_ws": True, "ws_loads": True}, "128 x 128 tiles with dq_ws and ws_loads"),
    # one consumer warpgroup a block, so that blocks sharing an SM run their phases out of step (no lockstep)
    "k64": ({"bwd_tiles": (64, 64)}, "64 x 64 tiles: one consumer warpgroup a block, its knobs' defaults there"),
    "k64ws": ({"bwd_tiles": (64, 64), "dq_ws": True, "ws_loads": False}, "64 x 64 tiles with dq_ws"),
    "k64wsl": ({"bwd_tiles": (64, 64), "dq_ws": True, "ws_loads": True}, "64 x 64 tiles with dq_ws and ws_loads"),
}
EXTRA = {name: keys for name, (keys, _) in EXTRA_VARIANTS.items()}

# name -> (what it removes, [(regex, replacement)]); every regex must match the kernel's source
VARIANTS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    **{name: (f"nothing: the kernel built with spec.extra {', '.join(f'{k} {v}' for k, v in keys.items())} ({why})",
              []) for name, (keys, why) in EXTRA_VARIANTS.items()},
    "built": ("nothing: the kernel as built", []),
    "empty": ("the whole q loop (left: Delta, dQ's conversion, K / V loads, dK / dV stores)",
              [(r"^([ \t]*)while qc <=? (?:nq|p_last):", r"\1while qc < -1:")]),
    "nored": ("the dQ reductions", [_NO_RED]),
    "noelem": ("the elementwise P / dS code (P = S, dS = dP)", [_ELEM]),
    "nodq": ("dQ's GEMM and its reductions", [(_GEMM_Q, ""), _NO_RED]),
    "nodkdv": ("the dV and dK GEMMs", [(_GEMM_D, "")]),
    "nosdp": ("the S^T and dP^T GEMMs", [(_GEMM_S, "")]),
    "gemms": ("everything but the GEMMs, loads and barriers (no elementwise, dS^T stores, reductions)",
              [_ELEM, (_DS_STORES, ""), _NO_RED]),
    "nowait": ("the wait before dQ's staging for the last tile's bulk reductions to have read it (races: timing only)",
               [(r"^[ \t]*bulk_wait_read0\(\)  # the last tile's reductions.*\n", "")]),
    "nofence": ("the proxy fence after dQ's staging (races: timing only)",
                [(r"^[ \t]*fence_proxy_async\(\)  # the staged rows.*\n", "")]),
    "nostage": ("dQ's staging stores (the bulk reductions then add stale rows: timing only)",
                [(r"^[ \t]*sts_v4_f32\(dqs_t.*\n", "")]),
    # two that move work rather than remove it, written for plain D = 128, N = 4k (64 q tiles, 64 dQ columns a warp)
    "rotate": ("nothing: each kv tile's walk starts at q tile 21 kj mod 64 (blocks running together add into different "
               "dQ rows; the numbers stay right)", [(r"\b(qc|qn__1) \* 64\b", r"((\1 + kj * 21) & 63) * 64")]),
    "oneop": ("dq_bulk's 16 row reductions of a warp made one of 4352 bytes by lane 0 (wrong rows: timing only)",
              [(r"if lane < 16 and ql < M else", "if lane == 0 and ql + 15 < M else"),
               (r"(bulk_reduce_add_f32\(dqg, [^\n]*), 256\)", r"\1, 4352)")]),
    "wsnored": ("dq_ws's bulk reductions (the producer hands each slab back unread: timing only)",
                [(r"^[ \t]*bulk_reduce_add_f32\(elem_addr\(dq32.*\n", "")]),
    "lrloop": ("nothing: ws_loads' statistics by the loop the thirty-ninth session built (range(ltid, 64, 64): its "
               "64-bit trip count spilled at the loaders' 24 registers; at block_q 128 the first row only)",
               [(r"^([ \t]*)qq = lq0 \+ ltid\n\1(smem_f\[.*)\bltid\] = (lse.*)\n\1(smem_f\[.*)\bltid\] = (delta.*)\n",
                 r"\1for lr in range(ltid, 64, 64):\n\1    qq = lq0 + lr\n\1    \2lr] = \3\n\1    \4lr] = \5\n")]),
    # dS's softmax scale c: the forty-first session's `dsfma` (dS as P fma(dP, c, -Delta c), measured 1.016 at D = 128
    # with -Delta c a column) and `nodsscale` (its floor: 0.980 at D = 64 in the seventy-first session) are gone:
    # the default now folds c so (from_ir_bwd._scaled_difference, -Delta c once a row), `norowdelta` times the old form
    # the LSE's guard for fully masked rows (`0 if lse == -inf else lse * log2 e`): FMUL, FSETP, FSEL a column a tile
    # in the element code under lse_per_row False (0.987 of its time at D = 64, the seventy-first session), which the
    # default now computes once a row in lse_row_fn (the floor then takes it from there: next to nothing)
    "nolseguard": ("the LSE's -inf guard (in lse_row_fn, or with lse_per_row False the element code; a fully masked row's "
                   "P then NaN: timing only)",
                   [(r"= \(lse == np\.float32\(-np\.inf\)\)", "= False")]),
    # a captured table's cost in the elementwise code (the bias table's backward)
    "nogred": ("the table gradient's 16-byte reductions (emit_fa3_bwd.v4_grads; wrong gradient: timing only)",
               [(r"\bif (gq\w*) < M and", r"if \1 < -1 and")]),
    "nogload": ("the elementwise code's reads of captured tables (each read as 0: timing only)",
                [(r"^([ \t]+)(v\d+) = np\.float32\(cap_\w+\[.*\]\)$", r"\1\2 = np.float32(0.0)")]),
    "nosync": ("the loop's first barrier (races: timing only)",
               [(r"^[ \t]*cuda\.syncthreads\(\)\n(?=[ \t]*if qn\w* <)", "")]),
}


def _extra_of(name: str, base: dict | None) -> dict | None:
    """The spec.extra a variant is built with: an EXTRA variant's own keys over --extra's; an edit's, --extra's."""
    return {**(base or {}), **EXTRA[name]} if name in EXTRA else base


def edited(source: str, name: str) -> str:
    out = source
    for pat, rep in VARIANTS[name][1]:
        new, n = re.subn(pat, rep, out, flags=re.M)
        if n == 0:
            raise SystemExit(f"probe_bwd: variant {name}: {pat!r} is not in the kernel's source")
        out = new
    return out


def default_variants(source: str) -> list[str]:
    """`--variants` left out: every floor whose patterns the kernel's source has and every knob variant, but not the
    other tiles' (q128: refused where block_q + D passes 192, as at the default D = 128)."""
    return [x for x in VARIANTS
            if (x in EXTRA and "bwd_tiles" not in EXTRA[x]) or (x not in EXTRA and applies(source, x))]


def applies(source: str, name: str) -> bool:
    """Whether every pattern of variant `name` is in the kernel's source (rotate only where asked for by name)."""
    return name != "rotate" and all(re.search(pat, source, flags=re.M) for pat, _ in VARIANTS[name][1])


def setup(D: int, causal: bool, B: int, H: int, N: int, extra: dict | None = None, example: str = ""):
    """(compiled, its backward kernel, the kernel's arguments): plain or causal attention, or with `example`
    bench.py's example of that name with its captured tensors (the kernel's captures as a call makes them: the
    user's, the sizes, then the block data derived from them)."""
    import torch

    import falower as fl

    torch.manual_seed(0)
    extra = dict(extra or {})
    tiles = extra.pop("bwd_tiles", None)  # (block_q, block_k): the backward pipeline's tile-bwd, not a spec knob
    backward = None
    if tiles is not None:
        backward = NAMED_PIPELINES["fa2-bwd"].replace("tile-bwd{bq=64,bk=128", f"tile-bwd{{bq={tiles[0]},bk={tiles[1]}")
        if backward == NAMED_PIPELINES["fa2-bwd"] and tuple(tiles) != (64, 128):
            raise SystemExit("probe_bwd: fa2-bwd's tile-bwd{bq=64,bk=128 ...} is not in the pipeline: bwd_tiles "
                             "would time the default tiles")
    extra = extra or None
    if example:
        import bench

        var = bench.variant(example, B, H, N, D)
        c = fl.compile(bench.example_graph(example), "numba-cuda", extra=extra, backward=backward)
        q, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(2))
        k, v = (torch.randn(B, H // var.group, N, D, device="cuda", dtype=torch.float16) for _ in range(2))
        user = [var.captures[a.name] for a in c.func.args[3:]]
    else:
        mask = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx) if causal else None
        c = fl.compile(fl.attention(mask_mod=mask, name="causal" if causal else "plain", dtype="f16"), "numba-cuda",
                       extra=extra, backward=backward)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(4))
        user = []
    o, lse = c.forward(q, k, v, *user)
    c.backward(q, k, v, o, lse, do, *user)  # builds the call: which inputs are captures, the block data
    kern, _ = c._backward_kernel_and_dims((q, k, v, *user))
    arrays, caps = next(iter(c._bwd_calls.values())).arguments((q, k, v, o, lse, do, *user))
    return c, kern, (*arrays, *caps)


# phase name, the line its stamp goes after (a substring of the emitted kernel's line inside the q loop); the first
# stamp is taken at the loop's top, before these
PHASES = (
    ("barrier", "cuda.syncthreads()"),  # the loop's first barrier: the other warpgroup's last tile
    ("loads", "FENCE_S(pacc, 0)"),  # the next tile's Q / dO copies issued, the tile's bookkeeping
    ("S^T dP^T", "WAIT_S(pacc, 0)"),  # the two GEMMs issued and waited for
    ("elementwise", "FENCE_D(dvacc, 0)"),  # P and dS (and captured tables' gradients)
    ("dV dK, dS^T", "cuda.syncthreads()  # dS^T is complete"),  # their issue, dS^T's stores, the copies' wait, barrier
    ("dQ GEMM", "WAIT_Q(dqa, 0)"),  # dQ = dS K issued and waited for (dV / dK's wait with it; dk_after_dq: WAIT_Q1)
    ("reductions", "hc = hn"),  # dQ's reductions (or staging), the next tile's statistics: stamped before this line
)
TILES = 64  # q tiles stamped a block (the first 64 of its walk)


def block_barrier(source: str) -> str:
    """The consumers' block barrier as this kernel writes it: cuda.syncthreads(), or under dq_ws a named barrier of
    their threads (emit_fa3_bwd.DQ_WS_BAR), which leaves the producer warpgroup out."""
    named = re.search(r"bar_sync\(1, \d+\)", source)
    return named.group() if "cuda.syncthreads()" not in source and named is not None else "cuda.syncthreads()"


# bwd_pingpong's barriers, each its warpgroup's own, where PHASES' "barrier" and "dV dK, dS^T" end (its "loads" phase
# then holds the wait for its turn to issue S^T and dP^T; at D = 128 "dQ GEMM" its first column half, "reductions"
# the second with the hand-offs)
PP_ANCHORS = {0: "bar_sync(PP_WG + wg, 128)  # bwd_pingpong: this warpgroup's last dQ GEMM",
              4: "bar_sync(PP_WG + wg, 128)  # bwd_pingpong: this warpgroup's dS^T rows"}
# dq_alternate's loop has no barrier at its top ("barrier" then ends at its dQ turn's test, after the loaders' mbarrier
# wait) and its dQ in one warpgroup's branch: "dQ GEMM" holds the whole branch (dQ and its hand-off on the tile's dQ
# warpgroup; dK and the waits on the other), "reductions" only the tile count's step
ALT_ANCHORS = {0: "dqwg = wg == (tn & 1)", 5: "tn += 1"}


def phase_anchors(source: str) -> list[str]:
    """PHASES' anchors as this kernel writes them (its block barrier: `block_barrier`; bwd_pingpong's: PP_ANCHORS;
    dq_alternate's: ALT_ANCHORS)."""
    anchors = [a.replace("cuda.syncthreads()", block_barrier(source)) for _, a in PHASES]
    if "WAIT_Q1(dqa, 0)" in source:  # dk_after_dq: dQ's wait leaves dK's group in flight
        anchors = [a.replace("WAIT_Q(dqa, 0)", "WAIT_Q1(dqa, 0)") for a in anchors]
    if "bar_arrive(PP_TURN" in source:
        anchors = [PP_ANCHORS.get(i, a) for i, a in enumerate(anchors)]
    if "bar_arrive(DS_FREE" in source:
        anchors = [ALT_ANCHORS.get(i, a) for i, a in enumerate(anchors)]
    return anchors


def stamped_source(source: str, name: str) -> str:
    """The backward's module with %clock64 stamps at the top of its q loop and after each PHASES anchor; thread 0 of
    each warpgroup stores them to tl_buf[((block * 2 + warpgroup) * TILES + tile) * (len(PHASES) + 1) + i] for
    its first TILES tiles. Raises SystemExit naming an anchor the kernel lacks."""
    _one_item_a_block(source)
    lines, start = _with_buffer(source, name)
    loop = _loop_line(lines, start)
    ind = re.match(r"\s*", lines[loop + 1])[0]
    n = len(PHASES) + 1
    out = lines[:loop]
    out += [f"{ind[:-4]}tl_n = 0"]
    out += [lines[loop], f"{ind}tl_i = (((cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y) * cuda.gridDim.x + "
            f"cuda.blockIdx.x) * 2 + (tid >> 7)) * {TILES * n} + tl_n * {n}",
            f"{ind}tl_w = (tid & 127) == 0 and tl_n < {TILES}"]
    out += _stamp(ind, 0)
    todo = list(enumerate(phase_anchors(source), start=1))
    for ln in lines[loop + 1:]:
        if todo and todo[0][1] == "hc = hn" and re.fullmatch(r"hc = hn(__\d+)?", ln.strip()):  # SSA-renamed too
            out += _stamp(ind, todo.pop(0)[0])
            out += [f"{ind}tl_n += 1"]
        out.append(ln)
        while todo and todo[0][1] != "hc = hn" and todo[0][1] in ln:
            out += _stamp(re.match(r"\s*", ln)[0], todo.pop(0)[0])
    if todo:
        raise SystemExit(f"probe_bwd: phase anchors not found in the kernel: {[p[1] for p in todo]}")
    return _with_imports(out, "clock64")


def _with_buffer(source: str, name: str) -> tuple[list[str], int]:
    """The module's lines with kernel `name` taking the stamps' buffer (tl_buf) last, and its def line's index."""
    lines = source.split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"def {name}("))
    lines[start] = lines[start].replace("):", ", tl_buf):")
    return lines, start


def _with_imports(lines: list[str], names: str) -> str:
    """The module's text with the stamps' intrinsics imported after its `import math`."""
    imports = f"from falower.backends.numba_cuda.intrinsics import {names}"
    return "\n".join(lines).replace("\nimport math\n", f"\nimport math\n{imports}\n", 1)


# the q loop: a range, a scan's last pair or a block list, each also over a GQA group's heads
_LOOP = r"\s+while (qc < nq|qc <= p_last|pc < q_n|hc < \d+|hc \* nq \+ qc <= p_last):"


def _loop_line(lines: list[str], start: int) -> int:
    at = next((i for i in range(start, len(lines)) if re.match(_LOOP, lines[i])), None)
    if at is None:
        raise SystemExit("probe_bwd: the kernel's q loop (while qc < nq, qc <= p_last, pc < q_n or their GQA forms) "
                         "is not in its source")
    return at


BLOCK_FIELDS = ("sm", "start", "loop", "after", "stores", "barrier", "staged", "fenced", "issued", "read", "end",
                "tiles", "drained")  # thread 0 writes these
# under dq_ws, lane 0 of each producer warp that adds a consumer warpgroup's slabs (at most 2) writes these after
# them: its slabs, then its last slab's full barrier passed, its bulk reduction's issue, the issue's return, its
# read of the slab waited for, the end word's barrier passed, and (--drain) its reductions' writes done
PROD_FIELDS = ("slabs", "full", "issue", "issued", "read", "end", "drained")
PRODUCERS = 2
RECORD = len(BLOCK_FIELDS) + PRODUCERS * len(PROD_FIELDS)  # a block's words in tl_buf
# the epilogue's lines the barrier, staged, fenced, issued and read stamps follow or precede (the direct stores have
# none: all then read the stores' start); dkdv_in_tile's are in the walk's last tile (and after the loop for a walk
# of no tile), its copies' issue closed by DKDV_ISSUED
BULK_BARRIER = "  # every warpgroup's last GEMMs have read"  # after the kernel's block barrier (block_barrier)
BULK_FENCE = "fence_proxy_async()  # dK's and dV's staged rows visible to the copy engine"
BULK_WAIT = "bulk_wait_read0()  # the copies have read the staging rows"
# dq_ws's producer: its slab loop's lines (emit_fa3_bwd._emit_dq_producer)
PROD_START = "pw_slab = "  # its first line: the warp's slabs
PROD_FULL = "bar_sync(DQ_FULL + pw * "  # a slab (or the end word) handed over
PROD_END_TEST = "if pw_tile == 0:"  # ... the end word: the loop's break
PROD_ISSUE = "bulk_reduce_add_f32(elem_addr(dq32"  # lane 0's bulk reduction of the slab into dQ's accumulator
PROD_READ = "bulk_wait_read0()  # the copy engine has read the slab"


def _one_item_a_block(source: str) -> None:
    """The stamps are a block's (one item's): a persistent kernel's blocks walk many (stamped_items_source)."""
    if _ITEM_LOOP in source:
        raise SystemExit("probe_bwd: --phases and a block's stamps take one item a block; this kernel is persistent "
                         "(bwd_persistent): --blocks stamps its items")


def _end_of(lines: list[str], at: int, indent: str) -> int:
    """One past the last non-blank line of the block opened at line `at` (its lines indented past `indent`)."""
    end = next((i for i in range(at + 1, len(lines)) if lines[i].strip()
                and len(re.match(r"\s*", lines[i])[0]) <= len(indent)), len(lines))
    while not lines[end - 1].strip():
        end -= 1
    return end


def _stamps_to_stores(lines: list[str], first: int, end: int) -> tuple[list[str], int, str]:
    """An item's lines from after line `first` (the thread's index) to the dK / dV stores' first line, stamped: tb_0
    (the start), tb_1 (the q loop's start), tb_n (its tiles), tb_2 (its end), tb_s (the stores' start). Returns them,
    the stores' line and the stamps' indent (the q loop's)."""
    loop = _loop_line(lines, first)
    ind = re.match(r"\s*", lines[loop])[0]
    body = re.match(r"\s*", lines[loop + 1])[0]
    after = next(i for i in range(loop + 1, end) if lines[i].strip() and len(re.match(r"\s*", lines[i])[0]) <= len(ind))
    stores = next(i for i in range(after, end) if lines[i].strip() == STORES_LINE)
    out = [f"{ind}tb_0 = clock64()", f"{ind}tb_n = 0"] + lines[first + 1:loop]
    out += [f"{ind}tb_1 = clock64()", lines[loop], f"{body}tb_n += 1"] + lines[loop + 1:after] + [f"{ind}tb_2 = clock64()"]
    return out + lines[after:stores] + [f"{ind}tb_s = clock64()"], stores, ind


def stamped_blocks_source(source: str, name: str, drain: bool = False) -> str:
    """The backward's module with %clock64 stamps of each block's life, each stored by thread 0 when taken into
    tl_buf[block * RECORD + i] (BLOCK_FIELDS' order): its start, the q loop's start (K, V and the first Q, dO
    landed: the prologue), the loop's end, the start of dK's and dV's stores, under dkdv_bulk the end of its barrier,
    of the staging's stores, of its proxy fence, of the copies' issue and of the wait for their reads (dkdv_in_tile:
    the first four in the walk's last tile), and the kernel's end (after dq_ws's end hand-off), with its SM and its
    count of q tiles (written at the end: blocks that return early, kv_group's places past the heads, leave `end`
    0). Under dq_ws lane 0 of each producer warp that adds slabs writes PROD_FIELDS after them: its last slab's
    hand-over, its bulk reduction's issue and return, the wait for its read, and the end word's arrival, each
    overwritten slab by slab. `drain`: thread 0, and each producer warp's lane 0 after its walk, then wait for
    their own bulk copies' writes (bulk_wait0) and stamp `drained` (the block then ends later: its gap is not
    read)."""
    _one_item_a_block(source)
    lines, start = _with_buffer(source, name)
    end = _end_of(lines, start, "")
    first = next(i for i in range(start, end) if lines[i].strip() == "tid = cuda.threadIdx.x")
    loop = _loop_line(lines, first)
    ind = re.match(r"\s*", lines[loop])[0]
    body = re.match(r"\s*", lines[loop + 1])[0]
    after = next(i for i in range(loop + 1, end) if lines[i].strip() and len(re.match(r"\s*", lines[i])[0]) <= len(ind))
    F, P = BLOCK_FIELDS.index, len(BLOCK_FIELDS)
    barrier = block_barrier(source) + BULK_BARRIER
    issued_line = any(ln.strip() == DKDV_ISSUED for ln in lines[first:end])
    if not any(ln.strip() == STORES_LINE for ln in lines[first:end]):
        raise SystemExit(f"probe_bwd: the dK / dV epilogue's first line ({STORES_LINE!r}) is not in the kernel")

    def put(at: str, *fields: str) -> list[str]:  # one clock read, stored by thread 0 into each field
        return [f"{at}tb_c = clock64()", f"{at}if tid == 0:"] + [f"{at}    tl_buf[tb_i + {F(f)}] = tb_c"
                                                                 for f in fields]

    def prod(at: str, field: str, value: str = "clock64()") -> list[str]:  # lane 0 of a producer warp
        return [f"{at}tl_buf[tq_i + {P + PROD_FIELDS.index(field)}] = {value}"]

    out = lines[:first + 1] + [f"{ind}tb_i = ((cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y) * cuda.gridDim.x "
                               f"+ cuda.blockIdx.x) * {RECORD}"] + put(ind, "start") + [f"{ind}tb_n = 0"]
    walk_start = walk_end = break_at = None  # the producer's slab loop, its end; the indent after its break
    for i in range(first + 1, end):
        ln = lines[i]
        s_, at = ln.strip(), re.match(r"\s*", ln)[0]
        if i == walk_end:  # after the producer's slab loop: its end word's arrival, its slabs (lane 0's)
            w = re.match(r"\s*", lines[walk_start])[0]
            out += [f"{w}if lane == 0:"] + prod(w + "    ", "end", "tq_x")
            out += prod(w + "    ", "slabs", "np.uint64(tq_k)")
            if drain:
                out += [f"{w}    bulk_wait0()"] + prod(w + "    ", "drained")
            walk_end = None
        if break_at is not None and (not s_ or len(at) <= len(break_at)):  # the slab's (not the end word's)
            out += [f"{break_at}tq_k += 1", f"{break_at}if lane == 0:"] + prod(break_at + "    ", "full", "tq_x")
            break_at = None
        if i == loop:
            out += put(ind, "loop") + [ln, f"{body}tb_n += 1"]
            continue
        if i == after:
            out += put(ind, "after")
        if s_ == STORES_LINE:  # the later stamps overwrite what this epilogue has
            out += put(at, "stores", "barrier", "staged", "fenced", "issued", "read")
        if s_ == BULK_FENCE:
            out += put(at, "staged")
        if s_.startswith(BULK_WAIT) and not issued_line:
            out += put(at, "issued")
        if s_.startswith(PROD_START):
            out += [f"{at}tq_i = tb_i + pw * {len(PROD_FIELDS)}  # this producer warp's stamps (lane 0's)",
                    f"{at}tq_k = 0", f"{at}tq_x = clock64()"]
        if s_.startswith(PROD_ISSUE):
            out += prod(at, "issue")
        out.append(ln)
        if s_.startswith(barrier):
            out += put(at, "barrier")
        if s_ == BULK_FENCE:
            out += put(at, "fenced")
        if s_ == DKDV_ISSUED:
            out += put(at, "issued")
        if s_.startswith(BULK_WAIT):
            out += put(at, "read")
        if s_.startswith(PROD_FULL):
            out.append(f"{at}tq_x = clock64()")
        if s_ == PROD_END_TEST:
            break_at = at
        if s_ == "bulk_commit()" and lines[i - 1].strip().startswith(PROD_ISSUE):  # the reduction's commit
            out += prod(at, "issued")
        if s_ == PROD_READ:
            out += prod(at, "read")
        if s_ == "while True:" and lines[i - 1].strip() == "ps = 0":  # the producer's slab loop
            walk_start, walk_end = i, _end_of(lines, i, at)
    out += put(ind, "end") + [f"{ind}if tid == 0:", f"{ind}    tl_buf[tb_i] = np.uint64(sm_id())",
                              f"{ind}    tl_buf[tb_i + {F('tiles')}] = np.uint64(tb_n)"]
    if drain:
        out += [f"{ind}if tid == 0:", f"{ind}    bulk_wait0()", f"{ind}    tl_buf[tb_i + {F('drained')}] = clock64()"]
    out += lines[end:]
    return _with_imports(out, "clock64, sm_id" + (", bulk_wait0" if drain else ""))


ITEM_FIELDS = ("sm", "start", "loop", "after", "stores", "end", "tiles")  # a persistent kernel's item (thread 0's)
ITEMS = 64  # items stamped a block (its first 64)
_ITEM_LOOP = "while it_z < "  # a persistent kernel's walk over its items (emit_fa3_bwd._emit_item_start)


def stamped_items_source(source: str, name: str) -> str:
    """A persistent backward's module with %clock64 stamps of each item a block walks: its start (after the item's
    thread index, past its decode), its q loop's start (its K, V and first Q, dO landed, the last item's copies'
    reads waited for), the loop's end, the dK / dV stores' start and the item's end (its staging and copies issued);
    thread 0 writes them with its SM and q tiles to tl_buf[(block * ITEMS + k) * 7 + i] (ITEM_FIELDS' order) for
    its first ITEMS real items (a skipped place, `continue`, writes nothing)."""
    lines, start = _with_buffer(source, name)
    walk = next((i for i in range(start, len(lines)) if lines[i].strip().startswith(_ITEM_LOOP)), None)
    if walk is None:
        raise SystemExit("probe_bwd: this kernel walks no items (not bwd_persistent): use --blocks' one-item form")
    wind = re.match(r"\s*", lines[walk])[0]
    end = _end_of(lines, walk, wind)
    first = next(i for i in range(walk, end) if lines[i].strip().startswith("tid = "))
    stamped, stores, ind = _stamps_to_stores(lines, first, end)
    out = lines[:walk] + [f"{wind}tb_k = 0"] + lines[walk:first + 1] + stamped
    out += lines[stores:end] + [f"{ind}tb_3 = clock64()", f"{ind}if tid == 0 and tb_k < {ITEMS}:",
                                f"{ind}    tb_i = (cuda.blockIdx.x * {ITEMS} + tb_k) * {len(ITEM_FIELDS)}"]
    out += [f"{ind}    tl_buf[tb_i + {k}] = {v}" for k, v in
            enumerate(("np.uint64(sm_id())", "tb_0", "tb_1", "tb_2", "tb_s", "tb_3", "np.uint64(tb_n)"))]
    out += [f"{ind}tb_k += 1"] + lines[end:]
    return _with_imports(out, "clock64, sm_id")


def summarize_items(t, items: int = ITEMS) -> dict:
    """A persistent kernel's items (stamped_items_source): each one's prologue, loop and epilogue, medians over the
    items read; a tile's cycles and an item's fixed cost by the line through (tiles, item cycles); the gap from an
    item's end to its block's next item's start; and the blocks' spread: their walks' lengths (first start to last
    end) as the longest over the median, what a static assignment's imbalance costs."""
    import numpy as np

    t = np.asarray(t, dtype=np.float64).reshape(-1, items, len(ITEM_FIELDS))
    ok = t[:, :, ITEM_FIELDS.index("end")] > 0
    sm, c0, c1, c2, cs, c3, n = (t[:, :, i] for i in range(len(ITEM_FIELDS)))
    out = {"items read": int(ok.sum()), "items a block": float(np.median(ok.sum(1)[ok.any(1)])),
           "prologue": float(np.median((c1 - c0)[ok])), "loop": float(np.median((c2 - c1)[ok])),
           "epilogue": float(np.median((c3 - c2)[ok])), "of it stores": float(np.median((c3 - cs)[ok])),
           "tiles": float(np.median(n[ok]))}
    whole, tiles = (c3 - c0)[ok], n[ok]
    if len(set(tiles)) > 1:
        slope, icpt = np.polyfit(tiles, whole, 1)
        out["tile (fit)"], out["fixed (fit)"] = float(slope), float(icpt)
    else:
        out["tile (fit)"], out["fixed (fit)"] = float(np.median((c2 - c1)[ok] / np.maximum(tiles, 1))), float("nan")
    both = ok[:, 1:] & ok[:, :-1]
    out["gap"] = float(np.median((c0[:, 1:] - c3[:, :-1])[both])) if both.any() else float("nan")
    walks = [c3[b][ok[b]].max() - c0[b][ok[b]].min() for b in range(len(t)) if ok[b].any()]
    out["longest walk / median"] = float(max(walks) / np.median(walks)) if walks else float("nan")
    out["fixed share"] = float(np.sum((c1 - c0 + c3 - c2)[ok]) / np.sum(whole))
    return out


def summarize_blocks(t) -> dict:
    """Each block's prologue (start to the loop), loop and epilogue (the loop's end to the kernel's end; of it the
    stores, from the dK / dV epilogue's first line, which dkdv_in_tile takes in the walk's last tile, and of those
    under dkdv_bulk the barrier, the staging's stores, its proxy fence (thread 0's: it waits for that thread's
    outstanding memory operations), the copies' issue, the wait for their reads, and what follows it (dq_ws's end
    hand-off: the producer's last slab read); under the direct stores all but the last read 0 and the last holds
    the stores) in cycles, medians over the blocks that wrote; a tile's cycles and the block's fixed cost by a
    least-squares line through (tiles, block cycles); and the gap an SM spends between one block's end and its next
    block's start (NaN where blocks share an SM: "overlapping" counts those pairs)."""
    import numpy as np

    t = np.asarray(t, dtype=np.float64).reshape(-1, RECORD)
    t = t[t[:, BLOCK_FIELDS.index("end")] > 0]
    sm, c0, c1, c2, cs, cb, cg, cf, cw, cr, c3, n, _ = t[:, :len(BLOCK_FIELDS)].T
    out = {"blocks read": int(len(t)), "prologue": float(np.median(c1 - c0)), "loop": float(np.median(c2 - c1)),
           "epilogue": float(np.median(c3 - c2)), "of it stores": float(np.median(c3 - cs)),
           "barrier": float(np.median(cb - cs)), "staging": float(np.median(cg - cb)),
           "fence": float(np.median(cf - cg)), "issue": float(np.median(cw - cf)),
           "copies' reads": float(np.median(cr - cw)), "end hand-off": float(np.median(c3 - cr)),
           "tiles": float(np.median(n)), "tiles mean": float(np.mean(n))}
    whole = c3 - c0
    if len(set(n)) > 1:
        slope, icpt = np.polyfit(n, whole, 1)
        out["tile (fit)"], out["fixed (fit)"] = float(slope), float(icpt)
    else:
        out["tile (fit)"], out["fixed (fit)"] = float(np.median((c2 - c1) / np.maximum(n, 1))), float("nan")
    gaps, spans, busy = [], [], []
    for s in np.unique(sm):
        on = np.argsort(c0[sm == s])
        a, b = c0[sm == s][on], c3[sm == s][on]
        gaps += list(a[1:] - b[:-1])
        spans.append(b.max() - a[0])  # this SM's first block's start to its last one's end (one clock an SM)
        busy.append(np.sum(b - a))
    # a gap means something only where an SM runs one block at a time (D = 128); blocks sharing an SM overlap
    out["overlapping"] = int(sum(x < 0 for x in gaps))
    out["gap"] = float(np.median(gaps)) if gaps and not out["overlapping"] else float("nan")
    out["fixed share"] = float(np.sum(c1 - c0 + c3 - c2) / np.sum(whole))
    # the grid's tail and the SMs' balance: the longest SM span against the median one, and the share of the longest
    # span the SMs spent inside blocks (what the blocks' own cycles leave out of the kernel's time, less the launch)
    out["SM span"], out["longest SM span"] = float(np.median(spans)), float(np.max(spans))
    out["SM busy share"] = float(np.sum(busy) / (len(spans) * np.max(spans)))
    return out


# summarize_epilogue's events: (name, the record's field, whose: thread 0's "c" or the producer warps' "p")
EPILOGUE_EVENTS = (
    ("last slab handed to the producer", "full", "p"),
    ("last dQ reduction: issue", "issue", "p"),
    ("last dQ reduction: issued", "issued", "p"),
    ("last dQ reduction: read", "read", "p"),
    ("dK / dV: epilogue's first line", "stores", "c"),
    ("dK / dV: barrier passed", "barrier", "c"),
    ("dK / dV: staged", "staged", "c"),
    ("dK / dV: fenced", "fenced", "c"),
    ("dK / dV: copies issued", "issued", "c"),
    ("dK / dV: copies read", "read", "c"),
    ("the producer's end word", "end", "p"),
    ("block's end (thread 0)", "end", "c"),
    ("dK / dV: thread 0's copies written (--drain)", "drained", "c"),
    ("last dQ reduction: written (--drain)", "drained", "p"),
)


def summarize_epilogue(t) -> dict:
    """The epilogue's timeline, in cycles from the q loop's end (thread 0's clock and the producer warps' lane 0's:
    one SM's clock), mean and median over the blocks that wrote: {event: (mean, median)}, EPILOGUE_EVENTS' events
    (a producer event: the later of its warps that added slabs, over the blocks whose walk had some; drained ones
    only under --drain), then three spans: the dK / dV copies' issue to their reads, the last dQ reduction's issue
    to its read, and the start of the dK / dV copies' issue (their fence's end) less the last reduction's read (> 0:
    the copy engine had read the last slabs before the copies came; < 0: they queued behind the slabs still to read,
    the sixty-second session's guess for the default's 2.9k cycles of issue)."""
    import numpy as np

    t = np.asarray(t, dtype=np.float64).reshape(-1, RECORD)
    t = t[t[:, BLOCK_FIELDS.index("end")] > 0]
    c = {f: t[:, i] for i, f in enumerate(BLOCK_FIELDS)}
    prod = t[:, len(BLOCK_FIELDS):].reshape(len(t), PRODUCERS, len(PROD_FIELDS))
    has = prod[:, :, PROD_FIELDS.index("slabs")] > 0
    p = {f: np.where(has, prod[:, :, i], -np.inf).max(axis=1) for i, f in enumerate(PROD_FIELDS)}
    walked = has.any(axis=1)
    out = {}

    def add(name: str, x, keep) -> None:
        if keep.any():
            out[name] = (float(np.mean(x[keep])), float(np.median(x[keep])))

    with np.errstate(invalid="ignore"):  # (a walk without slabs: -inf less -inf, not read)
        for name, field, whose in EPILOGUE_EVENTS:
            x = (c if whose == "c" else p)[field]
            add(name, x - c["after"], (x > 0) & (walked if whose == "p" else True))
        add("span: dK / dV copies, issued to read", c["read"] - c["issued"], c["read"] > 0)
        add("span: last dQ reduction, issue to read", p["read"] - p["issue"], walked)
        add("span: dK / dV copies' issue start - last reduction read", c["fenced"] - p["read"],
            walked & (c["fenced"] > 0))
    return out


def _stamp(ind: str, k: int) -> list[str]:
    return [f"{ind}tl_c = clock64()", f"{ind}if tl_w:", f"{ind}    tl_buf[tl_i + {k}] = tl_c"]


def summarize_phases(t, tiles: int = TILES) -> dict:
    """Each phase's median cycles a tile over the warpgroups' stamped tiles (a tile's first stamp to the next tile's
    first is the whole tile; the tail after the last phase is "next tile")."""
    import numpy as np

    n = len(PHASES) + 1
    t = t.reshape(-1, tiles, n).astype(np.float64)
    out = {}
    whole = t[:, 1:, 0] - t[:, :-1, 0]
    ok = (t[:, 1:, 0] > 0) & (t[:, :-1, n - 1] > 0)
    for i, (nm, _) in enumerate(PHASES, start=1):
        d = (t[:, :-1, i] - t[:, :-1, i - 1])[ok]
        out[nm] = float(np.median(d))
    out["next tile"] = float(np.median((t[:, 1:, 0] - t[:, :-1, n - 1])[ok]))
    out["tile"] = float(np.median(whole[ok]))
    out["tiles read"] = int(ok.sum())
    return out


def run_phases(kern, args, source: str, blocks_mode: bool = False, drain: bool = False) -> dict:
    """One stamped launch of the backward's main kernel on the arguments its call would pass (prepare's, recorded):
    the phases of its q tiles, or with `blocks_mode` each block's life (stamped_blocks_source, `drain` its copies'
    writes waited for; the epilogue's timeline under "timeline": summarize_epilogue)."""
    import numpy as np
    import torch
    from numba import cuda

    from falower.backends.numba_cuda.runtime import load_source

    seen: dict = {}

    class Recorder:  # stands in for the main kernel while prepare() builds its arguments
        def __getitem__(self, cfg):
            seen["cfg"] = cfg
            return lambda *a: seen.__setitem__("args", a)

    real, real_raise = kern._dispatchers.get("main"), kern._raise_smem_limit
    kern._dispatchers["main"], kern._raise_smem_limit = Recorder(), (lambda *a: None)
    try:
        launch, _ = kern.prepare(*args)
        launch()
    finally:
        kern._dispatchers["main"], kern._raise_smem_limit = real, real_raise
    if real is None:
        kern._dispatchers.pop("main", None)
    grid, threads, _, smem = seen["cfg"]
    blocks = int(np.prod(grid))
    name = kern.spec.name
    walks = _ITEM_LOOP in source  # a persistent kernel: its items stamped, not its blocks
    if blocks_mode and walks:
        stamped = getattr(load_source(stamped_items_source(source, name), name + "_items"), name)
        tl = torch.zeros(blocks * ITEMS * len(ITEM_FIELDS), dtype=torch.int64, device="cuda")
    elif blocks_mode:
        stamped = getattr(load_source(stamped_blocks_source(source, name, drain), name + ("_drain" if drain else "")
                                      + "_blocks"), name)
        tl = torch.zeros(blocks * RECORD, dtype=torch.int64, device="cuda")
    else:
        stamped = getattr(load_source(stamped_source(source, name), name + "_phases"), name)
        tl = torch.zeros(blocks * 2 * TILES * (len(PHASES) + 1), dtype=torch.int64, device="cuda")
    targs = (*seen["args"], cuda.as_cuda_array(tl).view(np.uint64))
    kern._raise_smem_limit(stamped, targs, smem)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for i in range(3):  # the first launch compiles; the last is the one read (and timed)
        if i == 2:
            ev[0].record()
        stamped[grid, threads, 0, smem](*targs)
    ev[1].record()
    torch.cuda.synchronize()
    read = tl.cpu().numpy().view(np.uint64)
    if blocks_mode and walks:
        return summarize_items(read)
    if blocks_mode:
        out = summarize_blocks(read)
        out["kernel us"] = ev[0].elapsed_time(ev[1]) * 1e3  # the stamped launch, from the host's stream
        out["SM MHz"] = out["longest SM span"] / out["kernel us"]  # at most the clock: the launch's edges count
        out["timeline"] = summarize_epilogue(read)
        return out
    return summarize_phases(read)


def use_variant(kern, source: str, name: str) -> None:
    """Point the backward kernel object at `name`'s source (its plans and direct kernels made anew)."""
    kern.source = edited(source, name)
    kern._dispatchers.pop("main", None)
    kern._direct.pop("main", None)
    kern._plans.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--example", default="", help="bench.py's example of this name (its mask, score and captured "
                    "tensors) instead of plain or causal attention; TFLOP/s then count every pair, masked or not")
    ap.add_argument("--variants", default="", help="comma-separated (default: every variant whose patterns the "
                    "kernel has, and the spec.extra ones)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default="")
    ap.add_argument("--extra", default="", help="spec.extra of the kernel the edits apply to (JSON)")
    ap.add_argument("--compile-one", default="")
    ap.add_argument("--phases", action="store_true", help="stamp the kernel's phases instead of timing variants")
    ap.add_argument("--blocks", action="store_true", help="stamp each block's prologue, loop and epilogue (and the "
                    "epilogue's timeline: the producer's last dQ reduction, dK / dV's staging, copies and reads) "
                    "instead of timing variants, for each of --variants (default: built)")
    ap.add_argument("--drain", action="store_true", help="--blocks: also wait for (and stamp) the bulk copies' "
                    "writes, thread 0's dK / dV copies and the producer's last dQ reductions (the blocks then end "
                    "later: the gap is not read)")
    ap.add_argument("--pairs", type=int, default=0, help="also time each spec.extra variant against the kernel as "
                    "built by N pairs of single backward calls back to back (bench.py's paired_calls: L2 flushed, "
                    "the order alternating), the median ratio with its 90%% bootstrap interval")
    a = ap.parse_args()
    from gpu_required import require_gpu

    require_gpu("probe_bwd.py")
    B, H = 4, 16 if a.d == 128 else 32
    base_extra = json.loads(a.extra) if a.extra else None
    if a.compile_one:
        c, kern, args = setup(a.d, a.causal, B, H, a.n, _extra_of(a.compile_one, base_extra), a.example)
        use_variant(kern, kern.source, a.compile_one)
        kern._direct_kernel("main")
        if a.blocks:  # the stamped kernel too (Numba's disk cache: the parent's launch finds it compiled)
            run_phases(kern, args, kern.source, blocks_mode=True, drain=a.drain)
        return
    c, kern, args = setup(a.d, a.causal, B, H, a.n, base_extra, a.example)
    source = kern.source
    if a.phases:
        ph = run_phases(kern, args, source)
        print(f"backward phases, D = {a.d}, N = {a.n}, causal = {a.causal}: median cycles a tile "
              f"({ph['tiles read']} tiles read)")
        print("| phase | cycles |")
        print("|---|---|")
        for nm in [p[0] for p in PHASES] + ["next tile", "tile"]:
            print(f"| {nm} | {ph[nm]:.0f} |")
        if a.json:
            Path(a.json).write_text(json.dumps(ph))
        return
    names = [x for x in a.variants.split(",") if x] or (["built"] if a.blocks else default_variants(source))
    if "rotate" in names and (a.n != 4096 or a.causal):
        raise SystemExit("probe_bwd: rotate is written for 64 q tiles of 64 rows without a mask "
                         "(--n 4096, no --causal)")
    if "oneop" in names and a.d != 128:
        raise SystemExit("probe_bwd: oneop is written for D = 128 (rows of 64 f32 a warpgroup)")
    for x in names:
        if x not in VARIANTS:
            raise SystemExit(f"probe_bwd: unknown variant {x!r} (known: {', '.join(VARIANTS)})")
        if x not in EXTRA:
            edited(source, x)  # fails early on a pattern the source lacks
    if a.pairs and not any(x in EXTRA for x in names):
        raise SystemExit("probe_bwd: --pairs times spec.extra variants (each its own kernel) against the kernel as "
                         "built: name one in --variants")
    if a.blocks or len(names) > 1:  # each variant compiled in a process of its own, at once (the cubin cache)
        base = [sys.executable, __file__, "--d", str(a.d), "--n", str(a.n)] + (["--causal"] if a.causal else []) \
            + (["--extra", a.extra] if a.extra else []) + (["--example", a.example] if a.example else []) \
            + (["--blocks"] if a.blocks else []) + (["--drain"] if a.drain else [])
        procs = [subprocess.Popen(base + ["--compile-one", x]) for x in names]
        if any(p.wait() for p in procs):
            raise SystemExit("probe_bwd: a variant failed to compile")
    others = {x: setup(a.d, a.causal, B, H, a.n, _extra_of(x, base_extra), a.example)[1] for x in names if x in EXTRA}
    from falower.backends.numba_cuda.emit_fa3_bwd import knobs_in

    for x, k in others.items():  # a knob the kernel cannot take (p_under_dp without a split) is said, not timed
        marks = knobs_in(k.source)  # a knob with no mark (grad_dist) is off where its kernel is the default's
        off = [n for n, v in EXTRA[x].items() if v is True and not marks.get(n, k.source != source)]
        if getattr(k, "wgmma_refused", None):  # a spec the wgmma kernel refuses: mma.sync would be timed
            raise SystemExit(f"probe_bwd: {x}: the wgmma backward refused this spec ({k.wgmma_refused})")
        if off:
            print(f"probe_bwd: {x}: {', '.join(off)} not in effect in this kernel (its fallback is timed)")
    report: dict = {"D": a.d, "N": a.n, "causal": a.causal, "example": a.example}
    if a.blocks:
        report["blocks"] = {x: run_phases(others.get(x, kern), args, others[x].source if x in others
                                          else edited(source, x), blocks_mode=True, drain=a.drain) for x in names}
        print_blocks(report["blocks"], a)
    elif a.rounds > 0:
        report["ms"] = time_rounds(kern, source, others, args, names, a.rounds)
        med = {x: sorted(t)[len(t) // 2] for x, t in report["ms"].items()}
        flops = 2.5 * 4 * B * H * a.n * a.n * a.d / (2 if a.causal else 1)
        print(f"backward floors, D = {a.d}, N = {a.n}, B = {B}, H = {H}, {a.example or f'causal = {a.causal}'}, "
              f"{a.rounds} rounds (the whole backward call: Delta, main, dQ's conversion)")
        print("| variant | removes | ms | TFLOP/s | of built |")
        print("|---|---|---|---|---|")
        for x in names:
            print(f"| {x} | {VARIANTS[x][0]} | {med[x]:.3f} | {flops / med[x] / 1e9:.0f} | "
                  f"{med[x] / med.get('built', med[x]):.3f} |")
    if a.pairs:
        use_variant(kern, source, "built")
        report["pairs"] = time_pairs(lambda: kern(*args), {x: (lambda k=k: k(*args)) for x, k in others.items()},
                                     a.pairs)
        print(f"paired calls, D = {a.d}, N = {a.n}, B = {B}, H = {H}, {a.example or f'causal = {a.causal}'}: "
              f"the whole backward call of each variant over the kernel as built, {a.pairs} pairs back to back (L2 "
              "flushed before each call, the order alternating)")
        print("| variant | time / built's | 90% interval | pairs p05 - p95 | built ms | variant ms |")
        print("|---|---|---|---|---|---|")
        for x, r in report["pairs"].items():
            print(f"| {x} | {r['median']:.4f} | [{r['lo']:.4f}, {r['hi']:.4f}] | {r['p05']:.4f} - {r['p95']:.4f} | "
                  f"{r['base ms']:.3f} | {r['ms']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(report))


def time_rounds(kern, source: str, others: dict, args, names: list[str], rounds: int) -> dict[str, list[float]]:
    """Each variant's whole backward call, median of 20 back to back, in `rounds` interleaved rounds: {name: ms}."""
    import torch

    def timed(fn, reps=20):
        for _ in range(3):
            fn()
        st = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
        st[0].record()
        for i in range(reps):
            fn()
            st[i + 1].record()
        torch.cuda.synchronize()
        return sorted(st[i].elapsed_time(st[i + 1]) for i in range(reps))[reps // 2]

    times: dict[str, list[float]] = {x: [] for x in names}
    for _ in range(rounds):
        for x in names:
            if x in EXTRA:
                times[x].append(timed(lambda: others[x](*args)))
                continue
            use_variant(kern, source, x)
            times[x].append(timed(lambda: kern(*args)))
    return times


def time_pairs(base, fns: dict, pairs: int) -> dict:
    """Each of `fns` against `base` by bench.paired_calls (`pairs` pairs of single calls back to back, L2 flushed
    before each, the order alternating): {name: bench.paired_summary of the time ratios (fn / base), with the
    pairs' median ms of each}."""
    import statistics

    import bench

    out = {}
    for x, fn in fns.items():
        ts = bench.paired_calls(base, fn, pairs)
        r = bench.paired_summary([b / a for a, b in ts if a > 0])
        r["base ms"] = statistics.median(a for a, _ in ts)
        r["ms"] = statistics.median(b for _, b in ts)
        out[x] = r
    return out


def print_blocks(results: dict, a) -> None:
    """--blocks' tables: each variant's block summary (summarize_blocks / summarize_items, a row each), then the
    epilogue's timeline (summarize_epilogue: mean / median cycles from the loop's end, a column pair each)."""
    first = next(iter(results.values()))
    what = "items" if "items read" in first else "blocks"  # a persistent kernel's items (stamped_items_source)
    print(f"backward {what}, D = {a.d}, N = {a.n}, {a.example or f'causal = {a.causal}'}: median cycles "
          f"a{'n item' if what == 'items' else ' block'}{' (--drain: the blocks end later)' if a.drain else ''}")
    keys = [k for k in first if k != "timeline"]
    print("| variant | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 1))
    shares = ("fixed share", "SM busy share")
    for x, bl in results.items():
        print(f"| {x} | " + " | ".join(f"{bl.get(k, float('nan')):.3f}" if k in shares
                                      else f"{bl.get(k, float('nan')):.0f}" for k in keys) + " |")
    if what == "items":
        return
    events = list(dict.fromkeys(e for bl in results.values() for e in bl["timeline"]))
    print(f"the epilogue's timeline: cycles from the q loop's end, mean / median over the {what} (thread 0's stamps "
          "and the producer warps' lane 0's; a producer event: the later warp's)")
    print("| event | " + " | ".join(f"{x} mean | {x} median" for x in results) + " |")
    print("|" + "---|" * (2 * len(results) + 1))
    for e in events:
        cells = [results[x]["timeline"].get(e) for x in results]
        print(f"| {e} | " + " | ".join("- | -" if v is None else f"{v[0]:.0f} | {v[1]:.0f}" for v in cells) + " |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
