"""Where a q tile's time goes in the warp-specialized forward (no producer: the automatic kernel at D = 128): the
kernel's source with %globaltimer stamps added, launched once on the GPU, and per block and consumer warpgroup the
time from its start until its Q has landed (prologue), its kv loop, its epilogue, and the gap on its SM until the
next block starts there. A line fitted through loop time against kv tiles gives the per-tile time and the loop's
fixed cost (the ping-pong's ramp and tail); the per-item cost is that plus the prologue, the epilogue and the gap
(benchmarks/NOTES.md: the variants' fits had it at ~1.4 tile-times).

    python3 benchmarks/timeline.py causal --d 128 --n 4096 [--m 1] [--config 128x128w8-wsn] [--json out.json]

With a persistent config (`--config 128x128w8-wsn-p132`) the stamps are an item's instead: its Q landed, its kv
loop's end, its epilogue's end; the summary's `loop_end_to_next_q_us` is what one item's end costs the next item
(what the persistent kernel was built to hide), `item_cost_tiles` that plus the loop's fixed cost, in tile-times.
The persistent kernel with a producer warpgroup (`--config 128x128w8-wsg-p132-iod`) is stamped in its consumers
(`summarize_producer`: the wait for Q after the item's state, the loop, the epilogue, the time between items) and
launched as falower launches it (the driver's whole-program compile, which keeps setmaxnreg). Where that kernel
carries an item's last P V and epilogue into the next item's first tile (emit_fa3_ws.epilogue_in_s, its default but
for the softcap), the stamp "epilogue" spans only the item's end (its LSE): the epilogue itself is inside the next
item's loop, and `item_cost_tiles` (the fit) is what compares with a kernel without it.

The stamps cost a few instructions a warpgroup; the timed kernel is otherwise the one the bench times. Needs torch
and a GPU (or the CUDA simulator, tiny shapes: NUMBA_ENABLE_CUDASIM=1 ... --n 256 --b 1 --h 2 --d 64).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_required import require_gpu  # noqa: E402

FIELDS = ("start", "q_landed", "loop_end", "end", "sm", "tiles")


def _with_timer_import(text: str, names: str = "global_timer, sm_id") -> str:
    """A stamped module's source with the intrinsics its stamps call imported."""
    return text.replace("\nimport math\n", "\nimport math\nfrom falower.backends.numba_cuda.intrinsics import "
                        f"{names}\n", 1)


def _kernel_body(source: str, name: str) -> tuple[list[str], int, int, list[str]]:
    """(the module's lines, the kernel's `def` line, the line after the kernel, the kernel's body without trailing
    blank lines); a kernel that returns early is refused, since stamps written at its end would be lost."""
    lines = source.split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"def {name}("))
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), len(lines))
    body = lines[start + 1:end]
    while body and not body[-1].strip():
        body.pop()
    if any(ln.strip().startswith("return") for ln in body):
        raise SystemExit("timeline: the kernel returns early; its stamps would be lost")
    return lines, start, end, body


def _loop_line(tiles: np.ndarray, loops: np.ndarray) -> tuple[float, float]:
    """The line through (kv tiles, loop time) of the items that visit some: us a tile and the loop's fixed cost
    (with a single tile count, the median time a tile and no fixed cost)."""
    busy = tiles > 0
    if len(np.unique(tiles[busy])) > 1:
        slope, icpt = np.polyfit(tiles[busy], loops[busy], 1)
        return float(slope), float(icpt)
    return float(np.median(loops[busy] / tiles[busy])), 0.0


def stamped_source(source: str, name: str) -> str:
    """The ws kernel's module with the stamps: t0 at entry, t1 when the warpgroup's Q has landed, t2 after the kv
    loop, t3 at the end; thread 0 of each consumer warpgroup writes them, its SM and its tile count to tl_buf."""
    lines, start, end, body = _kernel_body(source, name)
    out: list[str] = []
    after = "# this warpgroup's Q has landed"  # tl_t1 goes after this line, tl_t2 before the next one
    before = "cp_async_wait0()  # every copy was waited for"
    found = set()
    for i, ln in enumerate(lines[:start + 1]):
        out.append(ln.replace("):", ", tl_buf):") if i == start else ln)
    for j, ln in enumerate(body):
        ind = ln[:len(ln) - len(ln.lstrip())]
        if before in ln:
            out.append(f"{ind}tl_t2 = global_timer()")
            found.add("tl_t2")
        out.append(ln)
        if j == 0:  # the docstring
            out.append(f"{ind}tl_t0 = global_timer()")
        if after in ln:
            out.append(f"{ind}tl_t1 = global_timer()")
            found.add("tl_t1")
    if found != {"tl_t1", "tl_t2"}:
        raise SystemExit(f"timeline: anchors not found in the kernel: {{'tl_t1', 'tl_t2'}} - {found}")
    out += ["    tl_t3 = global_timer()",
            "    if (tid & 127) == 0:",
            "        tl_i = (((cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y) * cuda.gridDim.x + cuda.blockIdx.x)"
            " * 2 + (tid >> 7)) * 6",
            "        tl_buf[tl_i] = tl_t0",
            "        tl_buf[tl_i + 1] = tl_t1",
            "        tl_buf[tl_i + 2] = tl_t2",
            "        tl_buf[tl_i + 3] = tl_t3",
            "        tl_buf[tl_i + 4] = np.uint64(sm_id())",
            "        tl_buf[tl_i + 5] = np.uint64(kv_last - kv_first + 1)"]
    out += lines[end:]
    text = "\n".join(out)
    return _with_timer_import(text)


# --phases: (name, anchor, where) -- a %clock64 stamp after (or before) the first kernel line holding the anchor, in
# order; the span a phase names runs from the stamp before it. Cycles inside one block are exact where %globaltimer
# moves in 0.26 us steps; two %globaltimer stamps a warpgroup give the SM clock to convert them.
PHASES = (
    ("set-up", "cuda.syncthreads()  # the barriers are initialised", "after"),
    ("Q issued", "cp_async_mbar_arrive_noinc(bars + cw * 8)", "after"),
    ("ring issued", "# this warpgroup's Q has landed", "before"),
    ("Q wait", "# this warpgroup's Q has landed", "after"),
    ("kv loop", "cp_async_wait0()  # every copy was waited for", "before"),
    ("last S barrier", "# every warp of this warpgroup is past its last S", "after"),
    ("O staged", "# the warpgroup's rows are in shared memory", "after"),
)


def stamped_phases_source(source: str, name: str) -> str:
    """The ws kernel's module with a %clock64 stamp at entry, at each PHASES anchor and at the end, and %globaltimer
    at entry and end; thread 0 of each consumer warpgroup writes them, its SM and its tile count to tl_buf."""
    lines, start, end, body = _kernel_body(source, name)
    out = [ln.replace("):", ", tl_buf):") if i == start else ln for i, ln in enumerate(lines[:start + 1])]
    todo = list(enumerate(PHASES, start=1))
    for j, ln in enumerate(body):
        ind = ln[:len(ln) - len(ln.lstrip())]
        while todo and todo[0][1][1] in ln and todo[0][1][2] == "before":
            out.append(f"{ind}tl_c{todo.pop(0)[0]} = clock64()")
        out.append(ln)
        if j == 0:  # the docstring
            out += [f"{ind}tl_g0 = global_timer()", f"{ind}tl_c0 = clock64()"]
        while todo and todo[0][1][1] in ln and todo[0][1][2] == "after":
            out.append(f"{ind}tl_c{todo.pop(0)[0]} = clock64()")
    if todo:
        raise SystemExit(f"timeline: phase anchors not found in the kernel: {[p[1][1] for p in todo]}")
    n = len(PHASES) + 2
    width = n + 4
    out += [f"    tl_c{n - 1} = clock64()",
            "    tl_g1 = global_timer()",
            "    if (tid & 127) == 0:",
            "        tl_i = (((cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y) * cuda.gridDim.x + cuda.blockIdx.x)"
            f" * 2 + (tid >> 7)) * {width}"]
    out += [f"        tl_buf[tl_i + {i}] = tl_c{i}" for i in range(n)]
    out += [f"        tl_buf[tl_i + {n}] = tl_g0",
            f"        tl_buf[tl_i + {n + 1}] = tl_g1",
            f"        tl_buf[tl_i + {n + 2}] = np.uint64(sm_id())",
            f"        tl_buf[tl_i + {n + 3}] = np.uint64(kv_last - kv_first + 1)"]
    out += lines[end:]
    return _with_timer_import("\n".join(out), "clock64, global_timer, sm_id")


def summarize_phases(t: np.ndarray) -> dict:
    """Per phase the median span over the warpgroups, in us at the SM clock (the median over warpgroups of their
    cycles over their %globaltimer span, taken where that span is long enough for the timer's steps not to
    matter), and the same for the loop a tile (the loop phase over the tile count)."""
    n = len(PHASES) + 2
    t = t[t[:, n + 1] > 0]
    cycles = t[:, 1:n] - t[:, 0:n - 1]
    ns = t[:, n + 1] - t[:, n]
    long = ns > 20_000  # spans of many timer steps; where there are none (a small launch), the pooled ratio
    ghz = float(np.median((t[long, n - 1] - t[long, 0]) / ns[long])) if long.any() else \
        float((t[:, n - 1] - t[:, 0]).sum() / max(ns.sum(), 1.0))
    names = ["set-up", *[p[0] for p in PHASES[1:]], "stores"]
    spans = {f"{nm}_us": float(np.median(cycles[:, i])) / ghz / 1e3 for i, nm in enumerate(names)}
    tiles = t[:, n + 3]
    busy = tiles > 0
    loop_i = names.index("kv loop")
    per_tile = float(np.median(cycles[busy, loop_i] / tiles[busy])) / ghz / 1e3
    return {"warpgroups": int(len(t)), "sm_ghz": ghz, **spans, "loop_us_per_tile": per_tile,
            "mean_tiles": float(tiles.mean())}


ITEMS = 32  # a persistent block's items stamped (2048 items on 132 blocks: 16)
ITEM_FIELDS = ("q_landed", "loop_end", "end", "sm", "tiles")


def stamped_persistent_source(source: str, name: str) -> str:
    """The persistent ws kernel's module with stamps an item: when the warpgroup's Q has landed, when its kv loop
    ended (the top of the item loop, where the next item's loads are issued), and after its epilogue; thread 0 of
    each consumer warpgroup writes them, its SM and the item's tiles to tl_buf[block, warpgroup, item]."""
    lines, start, _, _ = _kernel_body(source, name)
    out: list[str] = []
    found = set()
    rec = [f"        if cur_ok and (tid & 127) == 0 and tl_k < {ITEMS}:",
           f"            tl_i = ((cuda.blockIdx.x * 2 + (tid >> 7)) * {ITEMS} + tl_k) * 5",
           "            tl_buf[tl_i] = tl_q",
           "            tl_buf[tl_i + 1] = tl_le",
           "            tl_buf[tl_i + 2] = global_timer()",
           "            tl_buf[tl_i + 3] = np.uint64(sm_id())",
           "            tl_buf[tl_i + 4] = np.uint64(tl_nt)",
           "        if cur_ok:",
           "            tl_k += 1"]
    for i, ln in enumerate(lines):
        if i == start:
            ln = ln.replace("):", ", tl_buf):")
        if i > start and ln == "        if not it_ok:" and lines[i + 1].strip() == "break":
            out += rec
            found.add("record")
        out.append(ln)
        if i > start and ln.strip().startswith("cur_ok = False"):
            out += ["    tl_k = 0", "    tl_q = global_timer()", "    tl_le = tl_q", "    tl_nt = 0"]
            found.add("init")
        if i > start and ln == "    while True:":
            out.append("        tl_le = global_timer()")
            found.add("loop_end")
        if i > start and "# this warpgroup's Q has landed" in ln:
            out += ["        tl_q = global_timer()", "        tl_nt = kv_last - kv_first + 1"]
            found.add("q")
    if found != {"record", "init", "loop_end", "q"}:
        raise SystemExit(f"timeline: anchors not found in the persistent kernel: {found}")
    return _with_timer_import("\n".join(out))


def summarize_persistent(t: np.ndarray) -> dict:
    """t [blocks x 2 warpgroups, ITEMS, 5]: the loop's line through (tiles, time), the epilogue, and the time from
    one item's loop end to the next one's Q landed (what the persistent kernel was built to hide)."""
    loops, tiles, epis, between = [], [], [], []
    for wg in t:
        wg = wg[wg[:, 2] > 0]
        loops += list((wg[:, 1] - wg[:, 0]) / 1e3)
        tiles += list(wg[:, 4])
        epis += list((wg[:, 2] - wg[:, 1]) / 1e3)
        between += list((wg[1:, 0] - wg[:-1, 1]) / 1e3)
    tiles = np.array(tiles)
    slope, icpt = _loop_line(tiles, np.array(loops))
    gap = float(np.median(between))
    return {"items": int(len(loops)), "loop_us_per_tile": slope, "loop_fixed_us": icpt,
            "epilogue_us": float(np.median(epis)), "loop_end_to_next_q_us": gap,
            "item_cost_tiles": (gap + icpt) / slope if slope > 0 else float("nan"),
            "mean_tiles": float(tiles.mean())}


PRODUCER_FIELDS = ("start", "q_landed", "loop_end", "end", "sm", "tiles", "k_wait_cycles", "v_wait_cycles",
                   "loop_cycles", "k0_wait_cycles", "first_tile_cycles", "kept_epilogue_cycles", "kept_barrier_cycles",
                   "kept_staged_cycles", "kept_redux_cycles", "kept_issued_cycles", "turn_wait_cycles", "entry",
                   "entry_synced", "entry_regs")
# inside the kept epilogue's block: the line after which its barrier has been passed, its rows are staged,
# (bulk_store) the copies' operands are made uniform (their redux: the copies follow), and lane 0 (thread 0 stamps)
# has issued and committed the copies
KEPT_MARKS = (("tl_eb", ("is done with the last item's O rows",)),
              ("tl_es", ("this warp's 16 rows are staged", "the warpgroup's rows are in shared memory")),
              ("tl_er", ("= warp_min(np.int32(o_wg",)),
              ("tl_ec", ("bulk_commit()",)))
KEPT_VARS = tuple(v for v, _ in KEPT_MARKS)


def stamped_producer_source(source: str, name: str, warpgroups: int = 2) -> str:
    """The persistent kernel with a producer warpgroup, stamped in its consumers an item: once the item's state is
    known (its ticket read, its kv range scanned), when its Q has landed, when its last S is done (q_empty), and
    after its epilogue (%globaltimer, 256 ns steps on the H100); and by %clock64, the cycles its kv loop spent in
    the waits for K and for V to land (summed over its tiles), its first tile's wait for K alone (where the ring
    had not loaded ahead across the item's start), the loop's cycles, its first tile's (from Q landed) and, under
    epilogue_in_s, the kept epilogue's block in the loop (from its first line to its last: the tiles that skip it
    add nothing), and inside it the cycles to its first barrier passed, to its rows staged, (bulk_store) to its
    copies' operands made uniform and to lane 0's copies issued (KEPT_MARKS), and the cycles the ping-pong's turn
    barrier held it (summed over its tiles: the other warpgroups' turns on the tensor cores); thread 0 of each
    consumer warpgroup writes them, its SM and the item's tiles to tl_buf[block, warpgroup, item]
    (PRODUCER_FIELDS); `warpgroups`, the kernel's consumer warpgroups (3 at block_q 192)."""
    lines, start, _, _ = _kernel_body(source, name)
    # the consumers' first line: their setmaxnreg, or where the kernel has none (setmaxnreg off) their thread index
    consumers = next(i for i in range(start, len(lines)) if "SETMAXNREG_INC()" in lines[i]
                     or lines[i].strip() == "ctid = tid - 128")
    out: list[str] = []
    found = set()

    def ind(ln: str) -> str:
        return ln[:len(ln) - len(ln.lstrip())]

    NF = len(PRODUCER_FIELDS)
    # the kept epilogue inside the kv loop (epilogue_in_s): its block's first line, and the line after the block
    kept_at = next((i for i in range(consumers, len(lines)) if "if ep_pend:  # the item before's epilogue" in lines[i]),
                   None)
    kept_end = None
    if kept_at is not None:
        depth = len(ind(lines[kept_at]))
        kept_end = next(i for i in range(kept_at + 1, len(lines))
                        if lines[i].strip() and len(ind(lines[i])) <= depth)
    for i, ln in enumerate(lines):
        if i == start:
            ln = ln.replace("):", ", tl_buf):")
        if i > start and ln.strip().startswith("smem = cuda.shared.array(0") and "entry" not in found:
            out.append(f"{ind(ln)}tl_e0 = global_timer()  # the block's entry")
            found.add("entry")
        if i < consumers and ln.strip().startswith("cuda.syncthreads()  # the barriers are initialised"):
            out += [ln, f"{ind(ln)}tl_e1 = global_timer()  # past the barriers' init and the block's barrier"]
            found.add("synced")
            continue
        for tag, anchor in (("k", "# K_j has landed"), ("v", "# V_(j-1) has landed")):
            if ln is not None and i > consumers and anchor in ln and "record" not in found:  # the kv loop
                out += [f"{ind(ln)}tl_c0 = clock64()", ln, f"{ind(ln)}tl_w{tag} += clock64() - tl_c0"]
                if tag == "k":  # the item's first tile's wait for K: what the ring had not loaded ahead
                    out += [f"{ind(ln)}if tl_f:", f"{ind(ln)}    tl_wk0 = clock64() - tl_c0", f"{ind(ln)}tl_f = False"]
                found.add(f"wait_{tag}")
                ln = None
        if ln is not None and i > consumers and "# this warpgroup's turn on the tensor cores" in ln \
                and "record" not in found:  # the ping-pong's wait for this warpgroup's turn, a tile
            out += [f"{ind(ln)}tl_c3 = clock64()", ln, f"{ind(ln)}tl_wt += clock64() - tl_c3"]
            found.add("turn")
            ln = None
        if ln is None:
            continue
        # inside the block (its first and after its last line): the tiles that skip it add nothing
        if kept_at is not None and i == kept_at + 1:
            out.append(f"{ind(ln)}tl_c2 = clock64()")
            found.add("kept")
        if i == kept_end:
            out.append(f"{ind(lines[kept_at + 1])}tl_ep += clock64() - tl_c2")
        marks = [v for v, anchors in KEPT_MARKS if any(a in ln for a in anchors)] if kept_at is not None and \
            kept_at < i < kept_end else []
        if i > consumers and ln.strip() in ("qphase ^= 1", "qk += 1") and "record" not in found:
            sp = ind(ln)
            out += [f"{sp}if (tid & 127) == 0 and tl_k < {ITEMS}:",
                    f"{sp}    tl_i = ((cuda.blockIdx.x * {warpgroups} + ((tid >> 7) - 1)) * {ITEMS} + tl_k) * {NF}",
                    f"{sp}    tl_buf[tl_i] = tl_s",
                    f"{sp}    tl_buf[tl_i + 1] = tl_q",
                    f"{sp}    tl_buf[tl_i + 2] = tl_le",
                    f"{sp}    tl_buf[tl_i + 3] = global_timer()",
                    f"{sp}    tl_buf[tl_i + 4] = np.uint64(sm_id())",
                    f"{sp}    tl_buf[tl_i + 5] = np.uint64(tl_nt)",
                    f"{sp}    tl_buf[tl_i + 6] = np.uint64(tl_wk)",
                    f"{sp}    tl_buf[tl_i + 7] = np.uint64(tl_wv)",
                    f"{sp}    tl_buf[tl_i + 8] = np.uint64(tl_cle - tl_cq)",
                    f"{sp}    tl_buf[tl_i + 9] = np.uint64(tl_wk0)",
                    f"{sp}    tl_buf[tl_i + 10] = np.uint64(tl_c1)",
                    f"{sp}    tl_buf[tl_i + 11] = np.uint64(tl_ep)",
                    *(f"{sp}    tl_buf[tl_i + {12 + n}] = np.uint64({v})" for n, v in enumerate(KEPT_VARS)),
                    f"{sp}    tl_buf[tl_i + {12 + len(KEPT_VARS)}] = np.uint64(tl_wt)",
                    f"{sp}    tl_buf[tl_i + {13 + len(KEPT_VARS)}] = tl_e0",
                    f"{sp}    tl_buf[tl_i + {14 + len(KEPT_VARS)}] = tl_e1",
                    f"{sp}    tl_buf[tl_i + {15 + len(KEPT_VARS)}] = tl_e2",
                    f"{sp}tl_k += 1"]
            found.add("record")
        out.append(ln)
        for v in marks:
            out.append(f"{ind(ln)}{v} += clock64() - tl_c2")
            found.add(v)
        if i == consumers:
            sp = ind(ln)
            out += [f"{sp}tl_e2 = global_timer()  # the consumers' registers raised", f"{sp}tl_k = 0",
                    f"{sp}tl_s = global_timer()", f"{sp}tl_q = tl_s", f"{sp}tl_le = tl_s",
                    f"{sp}tl_nt = 0", f"{sp}tl_wk = np.uint64(0)", f"{sp}tl_wv = tl_wk", f"{sp}tl_wk0 = tl_wk",
                    f"{sp}tl_f = False", f"{sp}tl_c1 = tl_wk", f"{sp}tl_f1 = False", f"{sp}tl_ep = tl_wk",
                    f"{sp}tl_c2 = tl_wk", *(f"{sp}{v} = tl_wk" for v in KEPT_VARS), f"{sp}tl_wt = tl_wk",
                    f"{sp}tl_c3 = tl_wk",
                    f"{sp}tl_cq = clock64()",
                    f"{sp}tl_cle = tl_cq"]
            found.add("init")
        if i > consumers and ln.strip() == "break" and "start" not in found:
            sp = ind(lines[i - 1])
            out += [f"{sp}tl_s = global_timer()", f"{sp}tl_wk = np.uint64(0)", f"{sp}tl_wv = tl_wk",
                    f"{sp}tl_wt = tl_wk"]
            found.add("start")
        if i > consumers and "# Q has landed" in ln and "q" not in found:
            sp = ind(ln)
            # the kv range by the names the loop below reads (ssa_names renames the consumers' copies)
            first = next(x.strip()[4:] for x in lines[i + 1:] if x.strip().startswith("j = "))
            last = next(x.strip()[len("while j <= "):-1] for x in lines[i + 1:] if x.strip().startswith("while j <= "))
            out += [f"{sp}tl_q = global_timer()", f"{sp}tl_cq = clock64()", f"{sp}tl_nt = {last} - {first} + 1",
                    f"{sp}tl_wk0 = np.uint64(0)", f"{sp}tl_f = True", f"{sp}tl_c1 = np.uint64(0)",
                    f"{sp}tl_f1 = True", f"{sp}tl_ep = np.uint64(0)", *(f"{sp}{v} = tl_ep" for v in KEPT_VARS)]
            found.add("q")
        if i > consumers and ln.strip() == "pstage = stage" and "first" not in found:  # the kv loop's tile end
            sp = ind(ln)
            out += [f"{sp}if tl_f1:  # the item's first tile (with the item before's kept epilogue)",
                    f"{sp}    tl_c1 = clock64() - tl_cq", f"{sp}tl_f1 = False"]
            found.add("first")
        if i > consumers and "past the item's last S" in ln and "loop_end" not in found:
            out += [f"{ind(ln)}tl_le = global_timer()", f"{ind(ln)}tl_cle = clock64()"]
            found.add("loop_end")
    if "kept" in found and not {"tl_eb", "tl_es"} <= found:
        raise SystemExit(f"timeline: the kept epilogue's barrier or staging not found: {found}")
    if found - {"kept", "turn", *KEPT_VARS} != {"record", "init", "start", "q", "loop_end", "wait_k", "wait_v",
                                                 "first", "entry", "synced"}:
        raise SystemExit(f"timeline: anchors not found in the producer kernel: {found}")
    return _with_timer_import("\n".join(out), "clock64, global_timer, sm_id")


def summarize_producer(t: np.ndarray) -> dict:
    """t [blocks x consumer warpgroups, ITEMS, fields] (PRODUCER_FIELDS): medians in us of the wait for Q after the
    item's state (`q_wait_us`), the loop's line through (tiles, time), the last P V and epilogue, and the time from one
    item's end to the next one's state (`between_us`: the ticket, the carry and the tile scan), and the per-item
    cost those make in tile-times; `kernel_us` from the first stamp to the last."""
    qw, loops, tiles, epis, between = [], [], [], [], []
    t0, t1 = np.inf, 0.0
    for wg in t:
        wg = wg[wg[:, 3] > 0]
        if not len(wg):
            continue
        t0, t1 = min(t0, wg[:, 0].min()), max(t1, wg[:, 3].max())
        qw += list((wg[:, 1] - wg[:, 0]) / 1e3)
        loops += list((wg[:, 2] - wg[:, 1]) / 1e3)
        tiles += list(wg[:, 5])
        epis += list((wg[:, 3] - wg[:, 2]) / 1e3)
        between += list((wg[1:, 0] - wg[:-1, 3]) / 1e3)
    tiles_a = np.array(tiles)
    slope, icpt = _loop_line(tiles_a, np.array(loops))
    med = {k: float(np.median(v)) if v else float("nan") for k, v in
           (("q_wait_us", qw), ("epilogue_us", epis), ("between_us", between))}
    per_item = med["q_wait_us"] + icpt + med["epilogue_us"] + med["between_us"]
    rows = t.reshape(-1, t.shape[-1])
    rows = rows[(rows[:, 3] > 0) & (rows[:, 5] > 0)]
    waits = {}
    if t.shape[-1] >= 9 and len(rows):  # %clock64 cycles: the kv loop's waits for K and V, a tile and a share
        for name, col in (("k", 6), ("v", 7)):
            waits[f"{name}_wait_cycles_per_tile"] = float(np.median(rows[:, col] / rows[:, 5]))
            waits[f"{name}_wait_share"] = float(rows[:, col].sum() / max(rows[:, 8].sum(), 1.0))
        waits["loop_cycles_per_tile"] = float(np.median(rows[:, 8] / rows[:, 5]))
    if t.shape[-1] >= 10 and len(rows):  # the first tile's wait for K, in cycles: the ring's refill at an item
        waits["k0_wait_cycles"] = float(np.median(rows[:, 9]))
    if t.shape[-1] >= 12 and len(rows):  # the first tile from Q landed (the kept epilogue in it), and that epilogue
        waits["first_tile_cycles"] = float(np.median(rows[:, 10]))
        kept = rows[:, 11] > 0
        waits["kept_epilogue_cycles"] = float(np.median(rows[kept, 11])) if kept.any() else 0.0
        if t.shape[-1] >= 15:  # inside it: to its first barrier passed, its rows staged, its copies' redux done and
            # (16 fields) lane 0's copies issued
            for col, name in enumerate(PRODUCER_FIELDS[12:min(t.shape[-1], 16)], 12):
                waits[name] = float(np.median(rows[kept, col])) if kept.any() else 0.0
    if t.shape[-1] >= 17 and len(rows):  # the ping-pong's turn waits (0 without turns), a tile and a share
        waits["turn_wait_cycles_per_tile"] = float(np.median(rows[:, 16] / rows[:, 5]))
        waits["turn_wait_share"] = float(rows[:, 16].sum() / max(rows[:, 8].sum(), 1.0))
    if t.shape[-1] >= 18:  # the block's entry: to its first item's state, and the kernel from the first entry
        firsts = [wg[0] for wg in t if wg[0, 3] > 0]
        if firsts:
            waits["entry_to_first_item_us"] = float(np.median([(f[0] - f[17]) / 1e3 for f in firsts]))
            waits["entry_spread_us"] = float((max(f[17] for f in firsts) - min(f[17] for f in firsts)) / 1e3)
            waits["kernel_from_entry_us"] = float((t1 - min(f[17] for f in firsts)) / 1e3)
            if t.shape[-1] >= 20:  # inside that: to the block's barrier after the barriers' init, to the consumers'
                # registers raised (setmaxnreg), then to the first item's state (its ticket from the producer)
                for name, a, b in (("entry_to_synced_us", 17, 18), ("synced_to_regs_us", 18, 19),
                                   ("regs_to_first_item_us", 19, 0)):
                    waits[name] = float(np.median([(f[b] - f[a]) / 1e3 for f in firsts]))
    return {"items": int(len(loops)), "kernel_us": float((t1 - t0) / 1e3), **med, "loop_us_per_tile": slope,
            "loop_fixed_us": icpt, "item_cost_tiles": per_item / slope if slope > 0 else float("nan"),
            "mean_tiles": float(tiles_a.mean()) if len(tiles_a) else float("nan"), **waits}


def _direct_launch(dispatcher, argtypes: tuple, smem: int, args: tuple, grid: tuple, threads: int,
                   cluster: int = 0) -> None:
    """Launch a stamped kernel as falower's direct launches do (runtime.DirectKernel: a kernel whose PTX uses
    setmaxnreg goes to the driver whole-program, which Numba's own launch would not do); `cluster` > 1: in clusters
    of that many blocks (a cluster-merge kernel's launch)."""
    import hashlib

    from falower.backends.numba_cuda.runtime import ArgBuffer, DirectKernel, _launcher

    ident = "timeline-" + hashlib.sha1(repr((argtypes, id(dispatcher))).encode()).hexdigest()
    dk = DirectKernel(lambda: dispatcher, lambda: argtypes, smem, ident)
    buf = ArgBuffer(dk.layout)
    for i, a in enumerate(args):
        cai = getattr(a, "__cuda_array_interface__", None)
        if cai is not None:
            buf.array(i, tuple(cai["shape"]), cai["data"][0])
        else:
            buf.scalar(i, a)
    _launcher(dk.function(0), grid, threads, smem, buf, cluster=cluster)(0)


def argument_twin(kern):
    """(the kernel whose Numba path prepares `kern`'s arguments, the width of `kern`'s clusters). A kernel that
    merges split-kv's parts in a cluster (emit_fa3_ws.cluster_merge) takes fused_merge's arguments (o_fin, lse_fin,
    arrivals), and Numba launches no clusters, so its arguments come from its fused twin's path (cluster_merge off,
    fused_merge on: the same argument list); the stamped kernel is then launched in its clusters, one block an item,
    and its items' epilogue stamps include the merge (which ends before the item's record). Any other kernel is its
    own twin (width 0)."""
    import dataclasses

    from falower.backends.numba_cuda.emit_fa2 import cluster_parts
    from falower.backends.numba_cuda.runtime import FA2ForwardKernel

    width = cluster_parts(kern.spec)
    if not width:
        return kern, 0
    s = kern.spec
    twin = FA2ForwardKernel(dataclasses.replace(s, extra={**s.extra, "cluster_merge": False, "fused_merge": True}))
    if twin.argtypes() != kern.argtypes():
        raise SystemExit(f"timeline: {s.name}'s fused twin takes other arguments; cannot stamp its clusters")
    return twin, width


def replaced_source(source: str, replace: list[str]) -> str:
    """The kernel's source with each 'OLD::NEW' of `replace` applied (every occurrence; OLD must occur): a floor
    experiment, e.g. a score's table loads replaced by a constant, to time what the loads cost. Its numbers are
    wrong by design; only its stamps are read."""
    for r in replace:
        old, sep, new = r.partition("::")
        if not sep or old not in source:
            raise SystemExit(f"timeline: --replace {r!r}: " + ("no '::'" if not sep else "OLD is not in the kernel"))
        source = source.replace(old, new)
    return source


def check_stampable(spec, with_producer: bool) -> int:
    """The kernel's consumer warpgroups a block (emit_fa3_ws.consumer_wgs), which the persistent producer
    warpgroup's stamps take as they come (three at block_q 192); the other stampings' records and summaries pair two
    a block, so anything else there is refused with a reason rather than read wrong."""
    if not with_producer and spec.block_q != 128:
        raise SystemExit(f"timeline: {spec.name} has {spec.block_q // 64} consumer warpgroups (block_q "
                         f"{spec.block_q}); these stamps are laid out for two (block_q 128)")
    return spec.block_q // 64


def run(stem: str, D: int, N: int, B: int, H: int, config: str, phases: bool = False,
        replace: list[str] | None = None, M: int = 0) -> np.ndarray:
    """One stamped launch of the example's forward: an array [blocks x 2 warpgroups, 6] of FIELDS (with `phases`,
    stamped_phases_source's record a warpgroup; the persistent producer warpgroup's kernel, [blocks x its consumer
    warpgroups, ITEMS, PRODUCER_FIELDS]); `replace` edits the kernel's source first (replaced_source); `M` query rows
    (0: N; decoding's M = 1 takes its 64-row tiles and split-kv's parts, stamped as the kernel's items)."""
    import torch

    import bench
    from falower.backends.numba_cuda.runtime import load_source

    M = M or N
    var = bench.variant(stem, B, H, N, D, M)
    dev = "cuda"
    q = torch.randn(B, H, M, D, device=dev, dtype=torch.float16)
    k, v = (torch.randn(B, H // var.group, N, D, device=dev, dtype=torch.float16) for _ in range(2))
    c = bench.example_compiled_config(stem, bench.parse_config(config)) if config else bench.example_compiled(stem)
    caps = [var.captures[a.name] for a in c.func.args[3:]]
    kern, env = c._kernel_and_dims((q, k, v, *caps))
    twin, width = argument_twin(kern)  # (a cluster kernel's arguments by its fused twin's Numba path)
    s = kern.spec
    caps = caps + c.runtime_sizes(kern, env)  # the sizes the score reads (N), as a call adds them
    from falower.backends.numba_cuda.block_data import BlockData, has_derived

    if has_derived(s):  # a block list and the range tables it is made from, as the compiled call derives them
        caps = caps + BlockData(s).derive(caps, (B, H, M, N), q)
    persist = int(s.extra.get("persistent", 0))
    with_producer = s.extra.get("producer") == "warpgroup" and persist > 0
    if s.extra.get("schedule") != "wgmma-ws" or (s.extra.get("producer") != "none" and not with_producer):
        raise SystemExit(f"timeline: {s.name} is not the warp-specialized kernel without a producer, nor the "
                         f"persistent one with a producer warpgroup ({s.extra})")
    nw = check_stampable(s, with_producer)
    if with_producer and phases:
        raise SystemExit("timeline: --phases stamps the kernel one block an item, not a persistent one")
    source = replaced_source(kern.source, replace or [])
    seen: dict = {}

    class Recorder:  # stands in for the kernel while prepare() builds the arguments
        def __getitem__(self, cfg):
            seen["cfg"] = cfg
            return lambda *a: seen.__setitem__("args", a)

    real, real_raise = twin._kernel, twin._raise_smem_limit
    twin._kernel, twin._raise_smem_limit = Recorder(), (lambda *a: None)
    try:
        launch, _ = twin.prepare(q, k, v, *caps)
        launch()
    finally:
        twin._kernel, twin._raise_smem_limit = real, real_raise
    grid, threads, _, smem = seen["cfg"]
    if width:  # one block an item in clusters (the plan's launch), the cluster kernel's own shared memory
        from falower.backends.numba_cuda.emit_fa2 import grid as launch_grid

        grid, threads, smem = launch_grid(s, B, H, M, N), kern.threads, kern.smem
    blocks = int(np.prod(grid))
    if phases and persist:
        raise SystemExit("timeline: --phases stamps the kernel one block an item, not a persistent one")
    if with_producer:
        from numba import cuda, types

        mod = load_source(stamped_producer_source(source, s.name, nw), s.name + "_ptimeline")
        tl = torch.zeros(blocks * nw * ITEMS * len(PRODUCER_FIELDS), dtype=torch.int64, device=dev)
        args = (*seen["args"], cuda.as_cuda_array(tl).view(np.uint64))
        argtypes = (*kern.argtypes(), types.Array(types.uint64, 1, "C"))
        for i in range(3):  # the last launch is the one read (the counter is zeroed by each launch's last block)
            if i == 2:  # a block's items vary from launch to launch: no stamps left from an earlier one
                torch.cuda.synchronize()
                tl.zero_()
            _direct_launch(getattr(mod, s.name), argtypes, smem, args, grid, threads, width)
        torch.cuda.synchronize()
        return tl.cpu().numpy().view(np.uint64).astype(np.float64).reshape(blocks * nw, ITEMS, len(PRODUCER_FIELDS))
    stamp = stamped_phases_source if phases else stamped_persistent_source if persist else stamped_source
    mod = load_source(stamp(source, s.name), s.name + ("_phases" if phases else "_timeline"))
    stamped = getattr(mod, s.name)
    width = len(PHASES) + 6 if phases else ITEMS * 5 if persist else 6
    tl = torch.zeros(blocks * 2 * width, dtype=torch.int64, device=dev)
    from numba import cuda

    args = (*seen["args"], cuda.as_cuda_array(tl).view(np.uint64))
    kern._raise_smem_limit(stamped, args, smem)
    for _ in range(3):  # the first launch compiles; the last is the one read
        stamped[grid, threads, 0, smem](*args)
    torch.cuda.synchronize()
    t = tl.cpu().numpy().view(np.uint64).astype(np.float64)
    return t.reshape(blocks * 2, ITEMS, 5) if persist else t.reshape(blocks * 2, width)


def summarize(t: np.ndarray) -> dict:
    """Medians in us, the loop's line through (tiles, time), and the per-item cost in tile-times."""
    t = t[t[:, 3] > 0]
    t0 = t[:, 0].min()
    start, ql, le, end = ((t[:, i] - t0) / 1e3 for i in range(4))
    sm, tiles = t[:, 4].astype(int), t[:, 5]
    blk_start, blk_end = start[0::2], np.maximum(end[0::2], end[1::2])
    blk_sm = sm[0::2]
    gaps = []
    for m in np.unique(blk_sm):
        idx = np.argsort(blk_start[blk_sm == m])
        s_m, e_m = blk_start[blk_sm == m][idx], blk_end[blk_sm == m][idx]
        gaps += list(s_m[1:] - e_m[:-1])
    slope, icpt = _loop_line(tiles, le - ql)
    pro, epi = float(np.median(ql - start)), float(np.median(end - le))
    gap = float(np.median(gaps)) if gaps else 0.0
    return {"warpgroups": int(len(t)), "kernel_us": float(end.max()), "prologue_us": pro,
            "loop_us_per_tile": slope, "loop_fixed_us": icpt, "epilogue_us": epi,
            "sm_gap_us": gap, "wg_skew_us": float(np.median(np.abs(end[0::2] - end[1::2]))),
            "item_cost_tiles": (pro + icpt + epi + gap) / slope if slope > 0 else float("nan"),
            "mean_tiles": float(tiles.mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stem")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--m", type=int, default=0, help="query rows (default: N; 1 for decoding)")
    ap.add_argument("--b", type=int, default=0, help="batch (default: 16384 // N, at least 1)")
    ap.add_argument("--h", type=int, default=0, help="heads (default: 2048 // D)")
    ap.add_argument("--config", default="", help="a bench tile config (default: the automatic choice)")
    ap.add_argument("--json", default="", help="write the raw stamps and the summary here")
    ap.add_argument("--phases", action="store_true",
                    help="the block's own spans by %%clock64: set-up, Q and ring issued, Q's wait, the loop, the "
                         "epilogue's barrier, staging and stores")
    ap.add_argument("--replace", action="append", default=[], metavar="OLD::NEW",
                    help="edit the kernel's source first, every occurrence (a floor experiment: its numbers are wrong)")
    a = ap.parse_args()
    require_gpu("timeline.py", simulator_ok=True)
    B, H = a.b or max(1, 16384 // a.n), a.h or 2048 // a.d
    t = run(a.stem, a.d, a.n, B, H, a.config, a.phases, a.replace, a.m)
    summary = {"stem": a.stem, "D": a.d, "M": a.m or a.n, "N": a.n, "B": B, "H": H,
               **({"replaced": len(a.replace)} if a.replace else {}),
               **(summarize_phases(t) if a.phases else summarize_producer(t) if t.ndim == 3 and t.shape[2] != 5
                  else summarize_persistent(t) if t.ndim == 3 else summarize(t))}
    print(json.dumps(summary), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "fields": FIELDS, "stamps": t.tolist()}))


if __name__ == "__main__":
    main()
