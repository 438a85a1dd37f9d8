"""benchmarks/probe_bwd.py's edits of the wgmma backward's source (the GPU run itself needs torch and a GPU): every
floor's pattern is found in the kernel it is written for and leaves valid Python, a pattern the kernel lacks is
refused with a one-line reason, the phase stamps go in the loop in order, and their summary reads them right."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")
import falower as fl  # noqa: E402
from falower.backends.numba_cuda import emit_fa3_bwd  # noqa: E402
from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
probe = pytest.importorskip("probe_bwd")

BULK_ONLY = {"oneop", "nowait", "nofence", "nostage"}  # floors of the dq_bulk kernel's staging and issue
# of the dq_ws kernel's (wsnored) and ws_loads' (lrloop): the default where they apply; the others edit the vector
# reductions'
WS_ONLY = {"wsnored", "lrloop"}
TABLE_ONLY = {"nogred", "nogload"}  # a captured table's read and gradient: the bias table's


def _source(stem, D: int = 128, **extra) -> tuple[str, str]:
    """(the kernel's name, the wgmma backward's module) of examples/<stem>.py, or of `stem` itself if a graph."""
    g = stem if isinstance(stem, fl.ir.Func) else \
        next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.ir.Func))
    c = fl.compile(g, "numba-cuda")
    spec = build_backward_spec(analyse_backward(c.lowered_backward), {"D": D}, "f16", "mma", None,
                               {"bwd_schedule": "wgmma", **extra})
    return spec.name, emit_fa3_bwd.emit_fa3_backward(spec)


@pytest.mark.parametrize("stem", ["plain", "causal"])
def test_every_floor_edits_its_kernel(stem):
    _, src = _source(stem, dq_ws=False)
    _, bulk = _source(stem, dq_bulk=True)
    _, ws = _source(stem)
    for name in probe.VARIANTS:
        if name in probe.EXTRA or (name == "rotate" and stem != "plain") or name in TABLE_ONLY:
            continue
        base = bulk if name in BULK_ONLY else ws if name in WS_ONLY else src
        out = probe.edited(base, name)
        compile(out, name, "exec")
        assert out != base or name == "built", name
    assert "bulk_reduce_add_f32(elem_addr(dq32" in ws and "bulk_reduce_add_f32(elem_addr(dq32" not in probe.edited(
        ws, "wsnored")
    # the reductions' floor takes the guard of either form of dQ's adds
    assert "if qi < -1:" in probe.edited(src, "nored") and "ql < -1 else" in probe.edited(bulk, "nored")


def test_the_bias_tables_floors_edit_its_kernel():
    """nogred and nogload, the bias table's gradient reductions and its entries' reads, edit only a kernel with a
    captured table's per-element read and grid gradient: the bias table's (with their 16-byte forms)."""
    _, bias = _source("bias")
    _, plain = _source("plain")
    for name in TABLE_ONLY:
        out = probe.edited(bias, name)
        compile(out, name, "exec")
        assert out != bias and not probe.applies(plain, name), name
    assert "if gq < -1 and gkv < N" in probe.edited(bias, "nogred")
    assert "= np.float32(cap_bias[" not in probe.edited(bias, "nogload")


def test_the_default_variants_are_those_the_kernel_has():
    """`--variants` left out: every floor whose patterns the kernel has (the staging's only on the dq_bulk kernel),
    never rotate (written for one shape), and the spec.extra ones."""
    _, src = _source("plain", dq_ws=False)
    _, bulk = _source("plain", dq_bulk=True)
    _, ws = _source("plain")
    red_names = {x for x in probe.VARIANTS if probe.applies(src, x)}
    bulk_names = {x for x in probe.VARIANTS if probe.applies(bulk, x)}
    assert not red_names & BULK_ONLY and BULK_ONLY <= bulk_names
    assert not (red_names | bulk_names) & WS_ONLY and WS_ONLY <= {x for x in probe.VARIANTS if probe.applies(ws, x)}
    assert "rotate" not in red_names | bulk_names and {"built", "nored", "noelem", "gemms"} <= red_names & bulk_names
    default = probe.default_variants(ws)  # what a run without --variants times: no other tiles' variants
    assert {"built", "nows", "wsl", "lrloop"} <= set(default) and not {"q128", "q128wsl", "rotate"} & set(default)


def test_a_pattern_the_kernel_lacks_is_refused():
    _, src = _source("plain")
    with pytest.raises(SystemExit, match="variant nostage: .* is not in the kernel's source"):
        probe.edited(src, "nostage")  # the default kernel stages nothing


@pytest.mark.parametrize("stem, D, extra", [("causal", 128, {}), ("alibi", 64, {}),
                                            ("plain", 64, {"bwd_pingpong": True}), ("causal", 128, {"bwd_pingpong": True}),
                                            ("plain", 64, {"dq_alternate": True}), ("causal", 128, {"dq_alternate": True})])
def test_the_phase_stamps_go_in_order(stem, D, extra):
    name, src = _source(stem, D, **extra)
    out = probe.stamped_source(src, name)
    compile(out, "stamped", "exec")
    assert re.search(rf"def {name}\(.*, tl_buf\):", out)
    assert "from falower.backends.numba_cuda.intrinsics import clock64" in out
    loop = out.index("    while qc <")
    at = [out.index(f"tl_buf[tl_i + {k}] = tl_c") for k in range(len(probe.PHASES) + 1)]
    assert loop < at[0] and at == sorted(at)
    for k, anchor in enumerate(probe.phase_anchors(src), start=1):  # each stamp on the lines right after its anchor
        between = out[at[k]:out.index(anchor, at[k])] if anchor == "hc = hn" else out[out.rindex(anchor, 0, at[k]):at[k]]
        assert between.count("\n") <= 3, (anchor, between)
    assert out.index("tl_n += 1") > at[-1]


def test_a_kernel_without_the_anchors_is_refused():
    name, src = _source("plain")
    with pytest.raises(SystemExit, match="phase anchors not found"):
        probe.stamped_source(re.sub(r"WAIT_Q(1?)\(dqa, 0\)", r"WAIT_Q\1(dqa,0)", src), name)


def test_the_phase_summary():
    """Two warpgroups' stamps with known spans: each phase's cycles, the tail to the next tile, the whole tile; a
    warpgroup's unstamped tiles (zeros: a shorter walk) are not read."""
    n = len(probe.PHASES) + 1
    t = np.zeros((2, probe.TILES, n), np.uint64)
    spans = np.arange(1, n) * 10  # phase i takes 10 i cycles
    for w, tiles in ((0, probe.TILES), (1, 5)):
        start = 1000
        for k in range(tiles):
            t[w, k] = start + np.concatenate([[0], np.cumsum(spans)])
            start += int(spans.sum()) + 7  # 7 cycles from the last stamp to the next tile's first
    got = probe.summarize_phases(t)
    assert [got[nm] for nm, _ in probe.PHASES] == list(spans.astype(float))
    assert got["next tile"] == 7 and got["tile"] == spans.sum() + 7
    assert got["tiles read"] == (probe.TILES - 1) + 4


def _stores(lines: list[str], field: str) -> list[int]:
    """The lines where thread 0 stores block field `field` (the clock read two lines above each)."""
    return [i for i, ln in enumerate(lines) if ln.strip() == f"tl_buf[tb_i + {probe.BLOCK_FIELDS.index(field)}] = tb_c"]


def _prod_stores(lines: list[str], field: str) -> list[int]:
    k = len(probe.BLOCK_FIELDS) + probe.PROD_FIELDS.index(field)
    return [i for i, ln in enumerate(lines) if ln.strip().startswith(f"tl_buf[tq_i + {k}] = ")]


def _line(lines: list[str], text: str, start: int = 0) -> int:
    return next(i for i in range(start, len(lines)) if lines[i].strip().startswith(text))


@pytest.mark.parametrize("stem", ["plain", "causal", "document"])
def test_the_block_stamps_go_around_the_loop(stem):
    """--blocks: thread 0 stores each stamp as it takes it (tl_buf[block * RECORD + field]): the start after the
    thread's index, the loop's start just before its `while` (a range, a scan's last pair, a block list's), a tile
    counted at the loop's top, the loop's end before the first line after it, the stores' start (every later field
    too, which the epilogue's own stamps then overwrite), dkdv_bulk's barrier, the staging's stores and fence, its
    copies' issue and the wait for their reads, the kernel's end after dq_ws's end hand-off, then its SM and tiles.
    The producer warps' lane 0 (dq_ws, the default here) stamps its slabs: the hand-over after the full barrier
    (kept for a slab, not for the end word), its reduction's issue, return and read, the end word and the count after
    its walk. The phase stamps take the list's loop (its `hc = hn` SSA-renamed) too. The row copies asked for (the
    default where a table has a gradient; probe_bwd's rows variant), whatever dkdv_store_auto picks here."""
    name, src = _source(stem, dkdv_tma=False, dkdv_in_tile=False)
    assert ("while pc < q_n:" in src) == (stem == "document")  # the document's loop walks its block list
    assert "bar_arrive(DQ_FULL" in src  # dq_ws's producer
    out = probe.stamped_blocks_source(src, name)
    compile(out, "stamped", "exec")
    assert re.search(rf"def {name}\(.*, tl_buf\):", out) and "import clock64, sm_id" in out
    lines = out[out.index(f"def {name}("):].split("\n")
    at = {f: _stores(lines, f) for f in probe.BLOCK_FIELDS[1:11]}
    assert all(len(v) == 1 for k, v in at.items() if k not in ("barrier", "staged", "fenced", "issued", "read")), at
    first = lambda f: at[f][0]  # noqa: E731
    assert lines[first("start") - 4].strip() == "tid = cuda.threadIdx.x"
    assert lines[first("start") - 3].strip().startswith("tb_i = ((cuda.blockIdx.z") and \
        lines[first("start") - 3].strip().endswith(f"* {probe.RECORD}")
    assert re.match(probe._LOOP, lines[first("loop") + 1]) and lines[first("loop") + 2].strip() == "tb_n += 1"
    after = lines[first("after") + 1].strip()  # the first line after the loop (ws_loads: its loaders' end)
    assert after == "cp_async_wait0()" or after.startswith("if tn == 0:  # no tile: the loader warps' end"), after
    stores = first("stores")
    later = ("barrier", "staged", "fenced", "issued", "read")
    assert [at[f][0] for f in later] == [stores + 1 + i for i in range(5)]
    assert lines[stores + 6].strip() == probe.STORES_LINE  # the stores' start, every later field with it
    bar, staged, fenced, issued, read = (at[f][1] for f in ("barrier", "staged", "fenced", "issued", "read"))
    assert lines[bar - 3].strip().startswith(probe.block_barrier(src) + probe.BULK_BARRIER)  # the barrier passed
    assert lines[staged + 1].strip() == probe.BULK_FENCE and lines[fenced - 3].strip() == probe.BULK_FENCE
    assert lines[issued + 1].strip().startswith(probe.BULK_WAIT) and lines[read - 3].strip().startswith(probe.BULK_WAIT)
    # after dK's and dV's copies' reads, dq_ws's end hand-off: its other slab's last hand-back
    assert "the other slab's last hand-back" in lines[first("end") - 3]
    assert stores < bar < staged < fenced < issued < read < first("end")
    assert lines[first("end") + 2].strip() == "tl_buf[tb_i] = np.uint64(sm_id())"
    assert lines[first("end") + 3].strip() == f"tl_buf[tb_i + {probe.BLOCK_FIELDS.index('tiles')}] = np.uint64(tb_n)"
    assert "bulk_wait0" not in out and f"tb_i + {probe.BLOCK_FIELDS.index('drained')}]" not in out
    # the producer's slab loop
    p = {f: _prod_stores(lines, f) for f in probe.PROD_FIELDS}
    assert all(len(v) == 1 for k, v in p.items() if k != "drained") and not p["drained"], p
    full_bar, end_test = _line(lines, probe.PROD_FULL), _line(lines, probe.PROD_END_TEST)
    assert lines[full_bar + 1].strip() == "tq_x = clock64()" and lines[end_test + 1].strip() == "break"
    assert lines[end_test + 2].strip() == "tq_k += 1" and p["full"][0] == end_test + 4
    assert lines[p["issue"][0] + 1].strip().startswith(probe.PROD_ISSUE)
    assert lines[p["issued"][0] - 1].strip() == "bulk_commit()" and lines[p["read"][0] - 1].strip() == probe.PROD_READ
    walk = _line(lines, "while True:", _line(lines, probe.PROD_START))
    assert lines[walk - 1].strip() == "ps = 0" and p["end"][0] > p["read"][0] and p["slabs"][0] == p["end"][0] + 1
    assert len(re.match(r"\s*", lines[p["end"][0] - 1])[0]) == len(re.match(r"\s*", lines[walk])[0])  # after it
    assert "tl_buf[tq_i + 18] = tq_x" in out and lines[_line(lines, probe.PROD_START) - 3].strip().startswith(
        "tq_i = tb_i + pw * 7")
    if stem == "document":
        compile(probe.stamped_source(src, name), "phases", "exec")


def test_the_block_stamps_drain():
    """--drain: after its end, thread 0 waits for its bulk copies' writes and stamps `drained`; each producer warp's
    lane 0 the same after its walk (bulk_wait0 imported)."""
    name, src = _source("causal")
    out = probe.stamped_blocks_source(src, name, drain=True)
    compile(out, "drained", "exec")
    lines = out[out.index(f"def {name}("):].split("\n")
    assert "import clock64, sm_id, bulk_wait0" in out and out.count("bulk_wait0()") == 2
    d = probe.BLOCK_FIELDS.index("drained")
    assert [ln.strip() for ln in lines[-4:] if ln.strip()][-2:] == ["bulk_wait0()", f"tl_buf[tb_i + {d}] = clock64()"]
    (pd,) = _prod_stores(lines, "drained")
    assert lines[pd - 1].strip() == "bulk_wait0()" and _prod_stores(lines, "slabs") == [pd - 2]


def test_the_block_stamps_take_the_direct_stores():
    """--blocks on the kernel with dkdv_bulk off (and dq_ws off): the stores' stamp (every later field with it)
    before the threads' direct stores, the end after them; no producer."""
    name, src = _source("causal", dkdv_bulk=False, dq_ws=False)
    lines = probe.stamped_blocks_source(src, name).split("\n")
    (stores,) = _stores(lines, "stores")
    for f in ("barrier", "staged", "fenced", "issued", "read"):
        assert _stores(lines, f) == [stores + 1 + ("barrier", "staged", "fenced", "issued", "read").index(f)], f
    assert lines[stores + 6].strip() == probe.STORES_LINE
    (end,) = _stores(lines, "end")
    assert "store_pairs(dv" in lines[end - 3] and "tq_i" not in "\n".join(lines)


def test_the_block_stamps_take_dkdv_in_tile():
    """--blocks on dkdv_in_tile's kernel: its stores' start, staging, fence and copies' issue stamped in the walk's
    last tile (under its `if not (...)`) and again in the walk of no tile after the loop; the reads after the loop's
    wait; no barrier stamp (it has none: the barrier reads the stores' start)."""
    name, src = _source("causal", dq_ws="auto", dkdv_in_tile=True)
    out = probe.stamped_blocks_source(src, name, drain=True)
    compile(out, "in_tile", "exec")
    lines = out[out.index(f"def {name}("):].split("\n")
    (after,) = _stores(lines, "after")
    last = next(i for i, ln in enumerate(lines) if "# dkdv_in_tile: the walk's last tile" in ln)
    zero = _line(lines, "if not dkv_in_loop:")
    s = _stores(lines, "stores")
    assert len(s) == 2 and last < s[0] < after < zero < s[1]
    for f in ("staged", "fenced", "issued"):
        at = _stores(lines, f)
        k = ("barrier", "staged", "fenced", "issued", "read").index(f) + 1
        assert len(at) == 4 and at[0] == s[0] + k and at[2] == s[1] + k
        assert s[0] < at[1] < after and s[1] < at[3], (f, at)  # ... overwritten in the tile, and after the loop
    issued = _stores(lines, "issued")
    assert lines[issued[1] - 3].strip() == probe.DKDV_ISSUED and lines[issued[3] - 3].strip() == probe.DKDV_ISSUED
    read = _stores(lines, "read")
    assert len(read) == 3 and lines[read[2] - 3].strip().startswith(probe.BULK_WAIT) and zero < read[2]
    assert _stores(lines, "barrier") == [s[0] + 1, s[1] + 1]  # only the stores' start's


def test_the_stamps_refuse_a_persistent_kernel():
    """A persistent kernel's blocks walk many items: a block's stamps and --phases say so instead of stamping one;
    the items' stamps refuse a kernel that walks none."""
    name, src = _source("causal", bwd_persistent=4)
    for fn in (probe.stamped_blocks_source, probe.stamped_source):
        with pytest.raises(SystemExit, match="persistent"):
            fn(src, name)
    name, src = _source("causal")
    with pytest.raises(SystemExit, match="walks no items"):
        probe.stamped_items_source(src, name)


@pytest.mark.parametrize("stem", ["causal", "document"])
def test_the_item_stamps_go_around_each_item(stem):
    """--blocks on a persistent kernel: the counter before the item walk, an item's start after its thread index
    (a skipped place's `continue` then leaves before writing), its q loop's start and end, the stores' start, its end after its copies'
    issue inside the walk; thread 0 writes the seven fields of its first ITEMS items, then counts the item."""
    name, src = _source(stem, bwd_persistent=4)
    out = probe.stamped_items_source(src, name)
    compile(out, "items", "exec")
    body = out[out.index(f"def {name}("):]
    lines = body.split("\n")
    at = {k: next(i for i, ln in enumerate(lines) if ln.strip() == k)
          for k in ("tb_k = 0", "tb_0 = clock64()", "tb_1 = clock64()", "tb_n += 1", "tb_2 = clock64()",
                    "tb_s = clock64()", "tb_3 = clock64()", "tb_k += 1")}
    assert sorted(at.values()) == list(at.values())
    assert lines[at["tb_k = 0"] + 1].strip().startswith(probe._ITEM_LOOP)
    assert lines[at["tb_0 = clock64()"] - 1].strip().startswith("tid = ")
    assert re.match(probe._LOOP, lines[at["tb_1 = clock64()"] + 1])
    assert lines[at["tb_s = clock64()"] + 1].strip() == probe.STORES_LINE
    walk = re.match(r"\s*", lines[at["tb_k = 0"] + 1])[0]
    inside = len(walk) + 4
    for k in ("tb_0 = clock64()", "tb_3 = clock64()", "tb_k += 1"):  # in the item walk's body
        assert len(re.match(r"\s*", lines[at[k]])[0]) == inside, k
    assert "bulk_wait_read0()  # the last item's copies" in lines[at["tb_k += 1"] + 1]  # after the walk
    assert body.count("tl_buf[tb_i + ") == len(probe.ITEM_FIELDS)
    assert f"tb_k < {probe.ITEMS}:" in body


def test_the_item_summary():
    """Items with known stamps on two blocks: the prologue, loop and epilogue medians, a tile's cycles and an item's
    fixed cost by the line through (tiles, item cycles), the gap between a block's items, the longest walk over the
    median; items not written (zeros) are not read."""
    F, K = len(probe.ITEM_FIELDS), probe.ITEMS
    t = np.zeros((2, K, F), np.uint64)
    for b, tiles in enumerate(((2, 4, 6), (4, 4))):
        c = 1000
        for k, n in enumerate(tiles):
            c0, c1 = c, c + 300
            c2 = c1 + 1000 * n
            c3 = c2 + 200
            t[b, k] = (b, c0, c1, c2, c3 - 150, c3, n)
            c = c3 + 50
    got = probe.summarize_items(t.reshape(-1))
    assert got["items read"] == 5 and got["items a block"] == 2.5
    assert (got["prologue"], got["loop"], got["epilogue"], got["of it stores"]) == (300, 4000, 200, 150)
    assert got["tile (fit)"] == pytest.approx(1000) and got["fixed (fit)"] == pytest.approx(500)
    assert got["gap"] == 50
    walks = [3 * 500 + 12000 + 2 * 50, 2 * 500 + 8000 + 50]
    assert got["longest walk / median"] == pytest.approx(max(walks) / np.median(walks))
    assert got["fixed share"] == pytest.approx(5 * 500 / (5 * 500 + 20000))


def _record(**fields) -> np.ndarray:
    """One block's RECORD words: BLOCK_FIELDS by name, producer warp w's PROD_FIELDS as p<w>_<field>."""
    r = np.zeros(probe.RECORD, np.uint64)
    for k, v in fields.items():
        if k[0] == "p" and k[1].isdigit():
            w, f = int(k[1]), k[3:]
            r[len(probe.BLOCK_FIELDS) + w * len(probe.PROD_FIELDS) + probe.PROD_FIELDS.index(f)] = v
        else:
            r[probe.BLOCK_FIELDS.index(k)] = v
    return r


def test_the_block_summary():
    """Blocks with known stamps: the prologue, loop and epilogue medians, a tile's cycles and the fixed cost by the
    line through (tiles, block cycles), the gap between blocks on one SM, the fixed share, the SMs' spans and how busy
    they were; blocks that wrote nothing (zeros) are not read."""
    rows, t = [], {0: 100, 1: 100}
    for i, n in enumerate((4, 8, 12, 16)):
        sm = i % 2
        c0 = t[sm]
        c1, c2 = c0 + 300, c0 + 300 + 1000 * n
        c3 = c2 + 200
        rows.append(_record(sm=sm, start=c0, loop=c1, after=c2, stores=c3 - 150, barrier=c3 - 120, staged=c3 - 100,
                            fenced=c3 - 70, issued=c3 - 40, read=c3 - 15, end=c3, tiles=n))
        t[sm] = c3 + 50  # 50 cycles between a block's end and the SM's next block
    rows.append(np.zeros(probe.RECORD, np.uint64))  # a block that returned early
    got = probe.summarize_blocks(np.array(rows).reshape(-1))
    assert got["blocks read"] == 4 and got["prologue"] == 300 and got["epilogue"] == 200 and got["of it stores"] == 150
    assert (got["barrier"], got["staging"], got["fence"], got["issue"], got["copies' reads"], got["end hand-off"]) == \
        (30, 20, 30, 30, 25, 15)
    assert got["tile (fit)"] == pytest.approx(1000) and got["fixed (fit)"] == pytest.approx(500)
    assert got["gap"] == 50 and got["tiles"] == 10 and got["overlapping"] == 0
    assert got["fixed share"] == pytest.approx(4 * 500 / (4 * 500 + 1000 * 40))
    # SM 0 ran the 4- and 12-tile blocks (4500 + 50 + 12500 cycles), SM 1 the 8- and 16-tile ones (8500 + 50 + 16500)
    assert (got["SM span"], got["longest SM span"]) == (21050, 25050)
    assert got["SM busy share"] == pytest.approx((17000 + 25000) / (2 * 25050))
    rows[2] = _record(sm=0, start=200, loop=500, after=8500, stores=8600, barrier=8600, staged=8600, fenced=8600,
                      issued=8600, read=8600, end=8700, tiles=8)  # beside block 0 on its SM: no gap is read
    got = probe.summarize_blocks(np.array(rows).reshape(-1))
    assert got["overlapping"] == 1 and np.isnan(got["gap"])


def test_the_tables_print(capsys, monkeypatch):
    """--blocks' tables (a row a variant, then the timeline's mean / median columns a variant) and --pairs' ratios
    (bench.paired_calls faked: variant b 2% faster than a in every pair) from summaries of known records."""
    import argparse

    import bench

    rows = np.array([_record(start=1, loop=10, after=1000, stores=1010, barrier=1020, staged=1100, fenced=1110,
                             issued=1500, read=1600, end=1700, tiles=3, p0_slabs=3, p0_full=990, p0_issue=995,
                             p0_issued=999, p0_read=1400, p0_end=1650)]).reshape(-1)
    one = {**probe.summarize_blocks(rows), "timeline": probe.summarize_epilogue(rows)}
    probe.print_blocks({"built": one, "intile": one},
                       argparse.Namespace(d=128, n=4096, example="", causal=True, drain=False))
    out = capsys.readouterr().out
    assert "| variant | blocks read | prologue |" in out and "| intile | 1 | 9 |" in out
    assert "| built mean | built median | intile mean | intile median |" in out
    assert "| dK / dV: copies issued | 500 | 500 | 500 | 500 |" in out and "| last dQ reduction: read | 400 |" in out
    monkeypatch.setattr(bench, "paired_calls", lambda a, b, n: [(a(), b())] * n)
    got = probe.time_pairs(lambda: 1.0, {"intile": lambda: 0.98}, 10)
    assert got["intile"]["median"] == pytest.approx(0.98) and got["intile"]["n"] == 10
    assert (got["intile"]["base ms"], got["intile"]["ms"]) == (1.0, 0.98)


def test_the_epilogue_summary():
    """summarize_epilogue: each event's mean and median cycles from the loop's end; a producer event the later of
    the warps that added slabs (a warp with none, or a block whose walk had none, left out); --drain's events only
    where stamped; the spans (copies' issue to read, the last reduction's issue to read, the copies' issue less that
    read: negative when issued before it)."""
    rows = []
    for k, (a, lag) in enumerate(((1000, 0), (3000, 100))):  # two blocks, the loop ending at a
        rows.append(_record(start=1, loop=10, after=a, stores=a + 10, barrier=a + 20, staged=a + 120 + lag,
                            fenced=a + 130 + lag, issued=a + 400 + lag, read=a + 600 + lag, end=a + 900 + lag,
                            tiles=3, p0_slabs=3, p0_full=a - 50, p0_issue=a - 40, p0_issued=a - 30,
                            p0_read=a + 500 + lag, p0_end=a + 800, p1_slabs=3, p1_full=a - 60, p1_issue=a - 20,
                            p1_issued=a - 10, p1_read=a + 450, p1_end=a + 850, p1_drained=a + 2000))
    rows.append(_record(start=1, loop=10, after=50, stores=60, barrier=60, staged=70, fenced=80, issued=90, read=95,
                        end=100, tiles=0))  # a walk of no tile: no slabs, its producer events not read
    got = probe.summarize_epilogue(np.array(rows).reshape(-1))
    ev = lambda x: got[x]  # noqa: E731
    assert ev("dK / dV: copies issued") == (pytest.approx((400 + 500 + 40) / 3), 400)
    assert ev("last dQ reduction: issue") == (-20, -20) and ev("last dQ reduction: issued") == (-10, -10)
    assert ev("last dQ reduction: read") == (550, 550) and ev("the producer's end word") == (850, 850)
    assert ev("last slab handed to the producer") == (-50, -50)
    assert ev("last dQ reduction: written (--drain)") == (2000, 2000)
    assert "dK / dV: thread 0's copies written (--drain)" not in got
    assert ev("span: dK / dV copies, issued to read") == (135, 200)
    assert ev("span: last dQ reduction, issue to read") == (570, 570)
    assert ev("span: dK / dV copies' issue start - last reduction read") == (-370, -370)


def test_the_stamps_take_gqa_loops():
    """The q loop over a GQA group's heads (no mask: `while hc < G`; a static mask: `hc * nq + qc <= p_last`)."""
    causal_gqa = fl.attention(score_mod=lambda s, b, h, q, kv: s + 0.5 * (kv - q),
                              mask_mod=lambda b, h, q, kv: q >= kv, group_size=2, name="causal_gqa")
    for stem, loop in (("gqa", "while hc < 4:"), (causal_gqa, "while hc * nq + qc <= p_last:")):
        name, src = _source(stem)
        assert loop in src
        compile(probe.stamped_blocks_source(src, name), "blocks", "exec")
        compile(probe.stamped_source(src, name), "phases", "exec")


@pytest.mark.slow
def test_the_stamped_kernel_runs_in_the_simulator(tmp_path):
    """The --blocks source (with --drain's waits) launched in the CUDA simulator in place of the main kernel
    (wgmma_bwd_sim_cases.STAMPED: 2 kv tiles, one walking 2 q tiles, the other none; the default kernel with dq_ws and
    ws_loads, and with dkdv_in_tile): the gradients stay the IR's, every block writes its record, its stamps come in
    the epilogue's order (dkdv_in_tile's staging and issue inside the last tile, before the loop's end), each
    producer warp of a block that walked tiles added one slab a tile and stamped its last one in order, a walk of no
    tile has no slabs, and both summaries read the records."""
    sys.path.insert(0, str(ROOT / "tests" / "backend"))
    from simulated import collect, spawn
    from wgmma_bwd_sim_cases import STAMPED

    got = collect(spawn("wgmma_bwd_sim_cases.py", tmp_path, list(STAMPED)))
    F, P = probe.BLOCK_FIELDS.index, len(probe.BLOCK_FIELDS)
    for cid in STAMPED:
        r = got.get(cid)
        assert r is not None and "error" not in r, r
        for g in r["grads"].values():
            assert not g["nan"] and g["err"] <= 3e-2 * max(1.0, g["scale"]), (cid, g)
        t = np.array(r["stamps"], np.uint64).reshape(-1, probe.RECORD).astype(np.int64)
        t = t[t[:, F("end")] > 0]
        assert len(t) == 2 and sorted(t[:, F("tiles")]) == [0, 2], t[:, F("tiles")]
        for row in t:
            c = {f: row[F(f)] for f in probe.BLOCK_FIELDS}
            walked = c["tiles"] > 0
            epi = ["stores", "barrier", "staged", "fenced", "issued"]
            if cid.endswith("intile") and walked:  # in the last tile; the reads after the loop
                order = ["start", "loop", *epi, "after", "read", "end", "drained"]
            else:
                order = ["start", "loop", "after", *epi, "read", "end", "drained"]
            assert [c[f] for f in order] == sorted(c[f] for f in order), (cid, c)
            for w in range(probe.PRODUCERS):
                p = {f: row[P + w * len(probe.PROD_FIELDS) + i] for i, f in enumerate(probe.PROD_FIELDS)}
                assert p["slabs"] == c["tiles"], (cid, w, p)
                if walked:
                    order = ["full", "issue", "issued", "read", "end", "drained"]
                    assert c["loop"] < p["full"] and [p[f] for f in order] == sorted(p[f] for f in order), (cid, p)
        stamps = np.array(r["stamps"], np.uint64)
        assert probe.summarize_blocks(stamps)["blocks read"] == 2
        line = probe.summarize_epilogue(stamps)
        assert {"last dQ reduction: read", "dK / dV: copies read", "last dQ reduction: written (--drain)"} <= set(line)
