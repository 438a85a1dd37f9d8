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


@pytest.mark.parametrize("stem, D", [("causal", 128), ("alibi", 64)])
def test_the_phase_stamps_go_in_order(stem, D):
    name, src = _source(stem, D)
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
        probe.stamped_source(src.replace("WAIT_Q(dqa, 0)", "WAIT_Q(dqa,0)"), name)


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


@pytest.mark.parametrize("stem", ["plain", "causal", "document"])
def test_the_block_stamps_go_around_the_loop(stem):
    """--blocks: the start after the thread's index, the loop's start just before its `while` (a range, a scan's
    last pair, a block list's), a tile counted at the loop's top, the loop's end on the first line after it, the
    stores' start, dkdv_bulk's barrier, the staging's stores and fence, its copies' issue, the kernel's end after its
    last store; thread 0 writes the eleven fields once. The phase stamps take the list's loop
    (its `hc = hn` SSA-renamed) too."""
    name, src = _source(stem)
    assert ("while pc < q_n:" in src) == (stem == "document")  # the document's loop walks its block list
    out = probe.stamped_blocks_source(src, name)
    compile(out, "stamped", "exec")
    assert re.search(rf"def {name}\(.*, tl_buf\):", out) and "import clock64, sm_id" in out
    body = out[out.index(f"def {name}("):]
    lines = body.split("\n")
    at = {k: next(i for i, ln in enumerate(lines) if ln.strip() == k)
          for k in ("tb_0 = clock64()", "tb_1 = clock64()", "tb_n += 1", "tb_2 = clock64()", "tb_s = clock64()",
                    "tb_b = clock64()", "tb_g = clock64()", "tb_f = clock64()", "tb_w = clock64()", "tb_3 = clock64()")}
    assert lines[at["tb_0 = clock64()"] - 1].strip() == "tid = cuda.threadIdx.x"
    assert re.match(probe._LOOP, lines[at["tb_1 = clock64()"] + 1])
    assert at["tb_n += 1"] == at["tb_1 = clock64()"] + 2
    after = lines[at["tb_2 = clock64()"] + 1].strip()  # the first line after the loop (ws_loads: its loaders' end)
    assert after == "cp_async_wait0()" or after.startswith("if tn == 0:  # no tile: the loader warps' end"), after
    assert lines[at["tb_s = clock64()"] + 1].strip() == probe.STORES_LINE  # the stores' start
    barrier = lines[at["tb_b = clock64()"] - 1].strip()  # dkdv_bulk's barrier passed (a named one under dq_ws)
    assert barrier.startswith(probe.block_barrier(src) + probe.BULK_BARRIER), barrier
    assert lines[at["tb_g = clock64()"] + 1].strip() == probe.BULK_FENCE  # the staging's stores before its fence
    assert at["tb_f = clock64()"] == at["tb_g = clock64()"] + 2  # ... the fence alone between
    assert lines[at["tb_w = clock64()"] + 1].strip().startswith(probe.BULK_WAIT)  # the copies issued, not waited
    # after dK's and dV's copies (and under dq_ws the producer's end: its other slab's last hand-back)
    assert "bulk_wait_read0()  # the copies" in lines[at["tb_3 = clock64()"] - 1] or \
        "the other slab's last hand-back" in lines[at["tb_3 = clock64()"] - 1]
    assert sorted(at.values()) == list(at.values())
    assert body.count("tl_buf[tb_i + ") == len(probe.BLOCK_FIELDS)
    if stem == "document":
        compile(probe.stamped_source(src, name), "phases", "exec")


def test_the_block_stamps_take_the_direct_stores():
    """--blocks on the kernel with dkdv_bulk off: the stores' stamp before the threads' direct stores, the end after
    them."""
    name, src = _source("causal", dkdv_bulk=False, dq_ws=False)
    lines = probe.stamped_blocks_source(src, name).split("\n")
    at = {k: next(i for i, ln in enumerate(lines) if ln.strip() == k)
          for k in ("tb_s = clock64()", "tb_3 = clock64()")}
    assert [ln.strip() for ln in lines[at["tb_s = clock64()"] + 1:at["tb_s = clock64()"] + 5]] == [
        "tb_b = tb_s", "tb_g = tb_s", "tb_f = tb_s", "tb_w = tb_s"]  # no barrier, fence or copies: all read tb_s
    assert lines[at["tb_s = clock64()"] + 5].strip() == probe.STORES_LINE
    assert "store_pairs(dv" in lines[at["tb_3 = clock64()"] - 1]


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


def test_the_block_summary():
    """Blocks with known stamps: the prologue, loop and epilogue medians, a tile's cycles and the fixed cost by the
    line through (tiles, block cycles), the gap between blocks on one SM, the fixed share, the SMs' spans and how busy
    they were; blocks that wrote
    nothing (zeros) are not read."""
    rows, t = [], {0: 100, 1: 100}
    for i, n in enumerate((4, 8, 12, 16)):
        sm = i % 2
        c0 = t[sm]
        c1, c2 = c0 + 300, c0 + 300 + 1000 * n
        c3 = c2 + 200
        rows.append((sm, c0, c1, c2, c3 - 150, c3 - 120, c3 - 100, c3 - 70, c3 - 40, c3, n))
        t[sm] = c3 + 50  # 50 cycles between a block's end and the SM's next block
    rows.append((0,) * len(probe.BLOCK_FIELDS))  # a block that returned early
    got = probe.summarize_blocks(np.array(rows, np.uint64).reshape(-1))
    assert got["blocks read"] == 4 and got["prologue"] == 300 and got["epilogue"] == 200 and got["of it stores"] == 150
    assert (got["barrier"], got["staging"], got["fence"], got["issue"], got["copies' reads"]) == (30, 20, 30, 30, 40)
    assert got["tile (fit)"] == pytest.approx(1000) and got["fixed (fit)"] == pytest.approx(500)
    assert got["gap"] == 50 and got["tiles"] == 10 and got["overlapping"] == 0
    assert got["fixed share"] == pytest.approx(4 * 500 / (4 * 500 + 1000 * 40))
    # SM 0 ran the 4- and 12-tile blocks (4500 + 50 + 12500 cycles), SM 1 the 8- and 16-tile ones (8500 + 50 + 16500)
    assert (got["SM span"], got["longest SM span"]) == (21050, 25050)
    assert got["SM busy share"] == pytest.approx((17000 + 25000) / (2 * 25050))
    rows[2] = (0, 200, 500, 8500, 8600, 8600, 8600, 8600, 8600, 8700, 8)  # a block that ran beside block 0 on its SM: no gap is read
    got = probe.summarize_blocks(np.array(rows, np.uint64).reshape(-1))
    assert got["overlapping"] == 1 and np.isnan(got["gap"])


def test_the_stamps_take_gqa_loops():
    """The q loop over a GQA group's heads (no mask: `while hc < G`; a static mask: `hc * nq + qc <= p_last`)."""
    causal_gqa = fl.attention(score_mod=lambda s, b, h, q, kv: s + 0.5 * (kv - q),
                              mask_mod=lambda b, h, q, kv: q >= kv, group_size=2, name="causal_gqa")
    for stem, loop in (("gqa", "while hc < 4:"), (causal_gqa, "while hc * nq + qc <= p_last:")):
        name, src = _source(stem)
        assert loop in src
        compile(probe.stamped_blocks_source(src, name), "blocks", "exec")
        compile(probe.stamped_source(src, name), "phases", "exec")
