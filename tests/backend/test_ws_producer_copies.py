"""The producer warpgroup's K / V copies (emit_fa3_ws._emit_producer): a tile inside N from the row addresses kept
per item (`copy_rows_<n>`: an add a copy), the index path (`load_swz_rows_<n>`: a compare and 64-bit index
arithmetic a row) only for a ragged last tile and for Q. On the H100 the index path cost the persistent kernel's
producer ~250 instructions a warp a tile, most on the FMA pipe its consumers' softmax needs (benchmarks/NOTES.md,
"The producer's copies"). Emitted sources only (no Numba); the simulator cases run both paths' numbers."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import make_spec  # noqa: E402

from falower.backends.numba_cuda import emit_fa3_ws  # noqa: E402


def _producer_body(src: str) -> str:
    """The producer's branch of the kernel: from its setmaxnreg down to the consumers'."""
    start = src.index("SETMAXNREG_DEC()")
    return src[start:src.index("SETMAXNREG_INC()", start)]


def _item_starts(src: str) -> tuple[str, str, str]:
    """(the producer's item loop, its part before the kv loop, the consumers' item loop before their kv loop)."""
    body = _producer_body(src)
    item = body[body.index("while True:"):]
    consumer = src[src.index("SETMAXNREG_INC()"):]
    citem = consumer[consumer.index("while True:"):re.search(r"while j <= kv_last(__\d+)?:", consumer).start()]
    return item, item[:item.index("while j <= kv_last:")], citem


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("extra", [{}, {"persistent": 5, "item_order": "dynamic", "tma_loads": False}],
                         ids=["one-item", "persistent"])
def test_producer_warpgroup_copies_k_and_v_from_kept_addresses(D, extra):
    spec = dataclasses.replace(make_spec("causal", D, block_q=128, block_k=128, num_warps=8),
                               extra={"schedule": "wgmma-ws", "producer": "warpgroup", **extra})
    emit_fa3_ws.validate_spec(spec)
    body = _producer_body(emit_fa3_ws.emit_fa3_ws_forward(spec))
    loop = body[body.index("while j <= kv_last:"):]
    for arr in ("k", "v"):
        assert re.search(rf"^\s*{arr}_at = elem_addr\({arr}, ", body, re.M), arr  # kept once per item
        assert body.index(f"{arr}_at = elem_addr") < body.index("while j <= kv_last:")
        # inside N: the kept address moved by the tile's rows; else the index path with its per-row bound
        assert re.search(rf"copy_rows_\d+x\d+\([^\n]*{arr}_at \+ np\.uint64\(j \* 128\) \* {arr}_rb, {arr}_rs\)", loop), arr
    assert loop.count("if j * 128 + 128 <= N:") == 2  # K's and V's copies each take the test
    assert loop.count("load_swz_rows_") == 2  # ... and fall back to the index path on the ragged tile only
    assert re.search(r"load_(swz_rows|q_tiles)_", body[:body.index("while j <= kv_last:")])  # Q: the index path


def test_producer_warp_keeps_its_lane_layout():
    """The one-warp producer copies by its own lane layout (`_emit_load_warp`): no kept addresses there."""
    spec = dataclasses.replace(make_spec("causal", 128, block_q=128, block_k=128, num_warps=8),
                               extra={"schedule": "wgmma-ws", "producer": "warp"})
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    assert "k_at = elem_addr" not in src and "pw_g = " in src


@pytest.mark.parametrize("tma", [True, False], ids=["tma-loads", "row-copies"])
@pytest.mark.parametrize("head", [True, False], ids=["list-head", "nolh"])
def test_persistent_producer_walks_each_items_block_list(head, tma):
    """A block list (the document mask) on the persistent kernel with the producer warpgroup: the producer reads
    each item's list (its count, then entry after entry, a tile ahead of the copies) as it loads, the consumers
    walk the same list for the tiles' classes, and an item with no entry loads no K / V. Correct on the H100
    (test_document_mask_gpu.py) and in the simulator (test_ws_persistent_simulator.py's document case, an
    all-padding item among its items); the automatic choice at D = 128 (test_wgmma_select.py). Its copies are
    one thread's TMA loads by default, the producer's 16-byte copies under '-notmal'. By default
    (`list_head_shared`) the list's head (count, first, second and last entries) comes with the ticket in shared
    memory, read by producer thread 0 before the handover; '-nolh' reads it from the list at each item's start."""
    import runpy

    import falower as fl

    ex = Path(__file__).resolve().parents[2] / "examples"
    g = runpy.run_path(str(ex / "document.py"))["graph"]
    extra = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 5, "item_order": "dynamic",
             **({} if head else {"list_head": False}), **({} if tma else {"tma_loads": False})}
    kern = fl.compile(g, extra=extra).specialize("f16", D=128)
    spec = kern.spec
    assert spec.block_mask == "list" and emit_fa3_ws.uses_work_counter(spec)
    assert emit_fa3_ws.list_head_shared(spec) == head
    emit_fa3_ws.validate_spec(spec)
    src = kern.source
    body = _producer_body(src)
    item, pstart, citem = _item_starts(src)
    for part in (pstart, citem):  # an item's start, producer's and consumers'
        if head:  # no global read of the list before the loop: the head comes from tick
            assert re.search(r"^\s*kv_n(__\d+)? = kv_hn", part, re.M)
            assert re.search(r"tick\[2 \+ 4 \* ip(__\d+)?\]", part)
            assert not re.search(r"cap_\d+_kv_(count|tiles)\[", part)
        else:
            assert re.search(r"^\s*kv_n(__\d+)? = \w+\[kv_row(__\d+)?\]", part, re.M) and "tick[2" not in part
    # the head is written beside the ticket by thread 0 from reads made before the handover
    assert ("tick[2 + 4 * ip] = hn_n" in body) == head
    if head:  # ... read again after each item's last copies, for the next ticket
        tail = item[item.index("while j <= kv_last:"):]
        assert re.search(r"hn_n = \w+\[hn_r", tail)
    assert "kv_pos = 0" in item  # each item's list, anew
    loop = item[item.index("while j <= kv_last:"):]
    assert "kv_cur = " in item[:item.index("while j <= kv_last:")]  # the first two entries read before the loop
    # entry after entry, each read a tile ahead of its copies; each tile's K and V copied
    assert re.search(r"kv_nx = np\.int32\(\w+\[kv_at\]", loop)  # a 32-bit walk
    assert emit_fa3_ws.tma_loads(spec) == tma and ("copy_rows_" in loop) != tma and ("tma_load_4d(" in loop) == tma
    assert "kv_last = (" in item and "if kv_n > 0 else -1" in item  # an empty list: the loop does not run


@pytest.mark.parametrize("late", [True, False], ids=["in-s", "nobs"])
def test_document_row_bounds_read_in_the_first_s(late):
    """The consumers of the persistent producer kernel read their rows' bounds from the document ids (three global
    loads a row) between the item's first S issue and its wait (`bounds_in_s`), not before the kv loop, where
    their clamps held the warpgroup one L2 round trip before its S. '-nobs' keeps them before the loop. The
    numbers: test_ws_persistent_simulator.py's document case (its partial tiles read the bounds) and the GPU's
    test_document_mask_gpu.py."""
    import runpy

    import falower as fl

    ex = Path(__file__).resolve().parents[2] / "examples"
    g = runpy.run_path(str(ex / "document.py"))["graph"]
    extra = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 5, "item_order": "dynamic",
             **({} if late else {"bounds_in_s": False})}
    kern = fl.compile(g, extra=extra).specialize("f16", D=128)
    assert emit_fa3_ws.bounds_in_s(kern.spec) == late
    consumer = kern.source[kern.source.index("SETMAXNREG_INC()"):]
    loop_at = re.search(r"while j <= kv_last(__\d+)?:", consumer).start()
    calls = [m.start() for m in re.finditer(r"= row_bounds_fn\(", consumer)]
    if late:
        # rows g and g + 8 in each branch of the tile's issue (with or without a P V beside S: with
        # epilogue_in_s an item's first tile may carry the item before's last P V, then under j == kv_first)
        assert len(calls) == (4 if emit_fa3_ws.epilogue_in_s(kern.spec) else 2)
        first_s = consumer.index("qk_wgmma(", loop_at)
        softmax = consumer.index("softmax_row(", first_s)
        assert all(first_s < at < softmax for at in calls)  # after S's issue, before its wait and softmax
        for at in calls:  # each before its branch's wait for S
            assert consumer.index("WAIT_S", at) < softmax
        assert re.search(r"rb_lo0_raw, rb_hi0_raw, rb_ex0 = row_bounds_fn", consumer)  # 32-bit after the clamp
    else:
        assert len(calls) == 2 and all(at < loop_at for at in calls)  # rows g and g + 8, before the loop


@pytest.mark.parametrize("stem", ["causal", "sliding_window"])
@pytest.mark.parametrize("shared", [True, False], ids=["range-shared", "nors"])
def test_static_range_comes_with_the_ticket(stem, shared):
    """A static mask the persistent producer kernel walks (causal, a window): by default (`range_shared`) the
    producer's first warp scans the next ticket's item (kv_first, kv_last, kf_first, kf_last) after the item's
    last copies, thread 0 writes the four beside the ticket, and no warp scans at an item's start: each reads them
    from `tick` and takes them through a warp reduction (REDUX: uniform to ptxas). '-nors' scans in every warp.
    The numbers: test_ws_range_walk_simulator.py's window cases on the producer warpgroup (partial tiles at both
    ends of each range, full ones between) and the GPU's examples."""
    import runpy

    import falower as fl

    g = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / f"{stem}.py"))["graph"]
    extra = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 5, "item_order": "dynamic",
             **({} if shared else {"range_shared": False})}
    kern = fl.compile(g, extra=extra).specialize("f16", D=128)
    assert kern.spec.block_mask == "static" and emit_fa3_ws.range_shared(kern.spec) == shared
    src = kern.source
    body = _producer_body(src)
    item, pstart, citem = _item_starts(src)
    for part in (pstart, citem):  # an item's start, producer's and consumers'
        assert ("tile_class_fn(" in part) != shared
        if shared:
            for k, v in enumerate(("kv_first", "kv_last", "kf_first", "kf_last")):
                red = "warp_min" if k % 2 == 0 else "warp_max"
                assert re.search(rf"^\s*{v}(__\d+)? = np\.int64\({red}\(kv_r{k}(__\d+)?\)\)", part, re.M), v
                assert re.search(rf"kv_r{k}(__\d+)? = tick\[{2 + k} \+ 4 \* ip(__\d+)?\]", part), v
    assert f"tick = cuda.shared.array({10 if shared else 2}, np.int32)" in src
    if not shared:
        assert "hr_0" not in src
        return
    for k in range(4):  # thread 0 hands the range over beside the ticket
        assert f"tick[{2 + k} + 4 * ip] = hr_{k}" in body
    # scanned by the first warp for the block's first ticket, and after each item's last copies for the next
    scans = [m.start() for m in re.finditer(r"if role == 0:  # the (first|next) item's kv range", body)]
    assert len(scans) == 2 and scans[0] < body.index("while True:") < item.index("while j <= kv_last:") + \
        body.index("while True:") < scans[1]
    assert "warp_uniform(tk_next)" in body and re.search(r"tile_class_fn\(b_hx(__\d+)?, h_hx", body)
    assert re.search(r"^\s*hr_2 = np\.int64\(nk_hx(__\d+)?\)  # then every tile is masked", body, re.M)


def _persistent_source(stem: str, D: int, bq: int, **extra) -> str:
    """The persistent producer-warpgroup kernel's source for `stem` on bq x 128 tiles, with `extra` on top."""
    spec = dataclasses.replace(make_spec(stem, D, block_q=bq, block_k=128, num_warps=bq // 16 + 4),
                               extra={"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 132,
                                      "item_order": "dynamic", **extra})
    emit_fa3_ws.validate_spec(spec)
    return emit_fa3_ws.emit_fa3_ws_forward(spec)


@pytest.mark.parametrize("D,bq", [(128, 128), (64, 192)])
def test_l2_hints_order_the_copies_eviction(D, bq):
    """l2_hints (off by default): every TMA load of Q takes the evict-first policy and every K / V load the
    evict-last one (`.L2::cache_hint`), and O's tensor stores evict first; without the knob, or without TMA loads,
    no copy carries a hint."""
    def src(**extra):
        return _persistent_source("causal", D, bq, **extra)

    on = src(l2_hints=True)
    kernel = on[on.index("\ndef fa2_"):]
    loads = re.findall(r"tma_load_4d(_hint)?\((\w+)", kernel)
    q = [ln for ln in re.findall(r"tma_load_4d\w*\([^\n]*", kernel) if "qmap_g" in ln]
    kv = [ln for ln in re.findall(r"tma_load_4d\w*\([^\n]*", kernel) if "kmap_g" in ln or "vmap_g" in ln]
    assert loads and q and kv and all(h for h, _ in loads)
    assert all(ln.rstrip(")").endswith("q_pol") for ln in q) and all(ln.rstrip(")").endswith("kv_pol") for ln in kv)
    stores = re.findall(r"tma_store_3d\w*\([^\n]*", kernel)
    assert stores and all(ln.startswith("tma_store_3d_hint(") and "o_pol)" in ln for ln in stores)
    assert "q_pol = l2_evict_first()" in kernel and "kv_pol = l2_evict_last()" in kernel
    assert "o_pol = l2_evict_first()" in kernel
    for off in (src(), *([src(l2_hints=True, tma_loads=False)] if bq == 128 else [])):  # 192 rows need TMA
        assert "_hint(" not in off and "l2_evict" not in off[off.index("\ndef fa2_"):]


def test_map_prefetch_starts_every_map_before_the_first_acquire():
    """map_prefetch (off by default): the copying thread prefetches Q's, K's and V's maps, all three before the
    first acquire (so their fetches overlap), and still acquires each before any copy; off, or without TMA loads,
    no prefetch is emitted."""
    def src(**extra):
        return _persistent_source("plain", 128, 128, **extra)

    on = src(map_prefetch=True)
    kernel = on[on.index("\ndef fa2_"):]
    pre = [kernel.index(f"tensormap_prefetch({x}map_g)") for x in "qkv"]
    acq = [kernel.index(f"tensormap_acquire({x}map_g)") for x in "qkv"]
    assert max(pre) < min(acq) and max(acq) < kernel.index("tma_load_4d")
    assert kernel.count("tensormap_prefetch(") == 3
    for off in (src(), src(map_prefetch=True, tma_loads=False)):
        assert "tensormap_prefetch(" not in off[off.index("\ndef fa2_"):]
