"""Two Q buffers on the persistent producer kernel (emit_fa3_ws.q_double): item k's Q in buffer k & 1, each
consumer warpgroup's 64 rows a tile of their own there, the item's O staged through those rows, and the buffer
freed for item k + 2 after the item's epilogue, so the producer loads the next item's Q while the item before runs.
Emitted sources only (no Numba); the numbers: test_ws_persistent_simulator.py's producer-warpgroup cases (causal
items of 1, 2 and 3 tiles, an inf in one head's V, the document's empty item) and its slowed warp on the producer
kernel, test_ws_range_walk_simulator.py's windows (with `bulk_store` and without) and the
GPU's examples."""

from __future__ import annotations

import dataclasses
import re
import runpy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import make_spec  # noqa: E402

from falower.backends.numba_cuda import emit_fa3_ws  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PERSIST = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 5, "item_order": "dynamic"}


ROW_LOADS = {"tma_loads": False}  # the producer's 128 threads copy Q, K and V by 16-byte cp.async ('-notmal')


def _spec(extra=None, D=128):
    return dataclasses.replace(make_spec("causal", D, block_q=128, block_k=128, num_warps=8),
                               extra={**PERSIST, **(extra or {})})


def _parts(src: str) -> tuple[str, str]:
    """(the producer's branch, the consumers')."""
    start = src.index("SETMAXNREG_DEC()")
    cons = src.index("SETMAXNREG_INC()", start)
    return src[start:cons], src[cons:]


def test_which_kernels_take_it_and_its_shared_memory():
    assert emit_fa3_ws.q_double(_spec()) and emit_fa3_ws.q_double(_spec(D=64))
    assert not emit_fa3_ws.q_double(_spec({"q_double": False}))  # '-noqd'
    assert not emit_fa3_ws.q_double(_spec({"staged_epilogue": False}))  # no room kept for a second buffer
    assert not emit_fa3_ws.q_double(_spec({"persistent": 0, "item_order": "grid"}))  # one block an item
    assert not emit_fa3_ws.q_double(_spec({"producer": "none"}))  # the consumers load their own Q
    for D in (64, 128):
        nobk = {"bulk_store": False}  # the tiles 64 rows of D (bulk_store's are 16 bytes a row wider)
        on, off = emit_fa3_ws._layout(_spec(nobk, D=D)), emit_fa3_ws._layout(_spec({"q_double": False}, D=D))
        # the second buffer takes the O buffer's room; one more Q, q_empty and item_full barrier each
        assert on["q1"] == off["o"] == on["o"] > 0 and on["q1"] >= 128 * D * 2
        assert emit_fa3_ws.smem_bytes(_spec(nobk, D=D)) - emit_fa3_ws.smem_bytes(_spec({"q_double": False}, D=D)) \
            == 24
        wide = emit_fa3_ws._layout(_spec(D=D))  # four tiles wider, the ring after the first buffer
        assert wide["total"] - on["total"] == 4 * (wide["qwg"] - 128 * D) and wide["q1"] == wide["o"] > 0
        assert on["total"] + emit_fa3_ws.ALIGN + emit_fa3_ws.static_bytes(_spec(D=D)) <= emit_fa3_ws.SMEM_LIMIT


@pytest.mark.parametrize("D", [64, 128])
def test_the_producer_loads_item_k_into_buffer_k_and_1(D):
    spec = _spec(ROW_LOADS, D=D)
    q1, qe, itf = (emit_fa3_ws._layout(spec)[k] for k in ("q1", "q_empty", "item_full"))
    prod, _ = _parts(emit_fa3_ws.emit_fa3_ws_forward(spec))
    item = prod[prod.index("while True:"):]
    # the buffer of the item before last freed (its epilogue done) before this item's ticket is handed over
    wait = item.index(f"mbar_wait(bars + {qe} + (pq & 1) * 8, ((pq >> 1) & 1) ^ 1)")
    assert wait < item.index("ip = pq & 1") < item.index("tick[ip] = tk_next") < \
        item.index(f"mbar_arrive(bars + {itf} + ip * 8)")
    # a barrier a slot, each's parity from the item count: ticket k in slot k & 1, parity (k >> 1) & 1
    assert f"mbar_wait(bars + {itf} + ip * 8, (pq >> 1) & 1)" in item and "ip ^= 1" not in item
    # each consumer warpgroup's 64 rows a [D // 64][64][128 B] tile: two 64-row loads into the item's buffer
    # one set of row addresses from buffer 0's tile offsets, the buffer's base added on each of two paths (a base
    # computed from pq made ptxas spill in the producer)
    assert f"q_dst = sb + {q1}  # buffer 1" in item
    loads = re.findall(r"ld_s(?:__\d+)? = ([^\n]*)", item[:item.index("while j <= kv_last:")])
    assert loads == ["(ld_c >> 3) * 8192 + ld_r0 * 128 + ld_x"], loads
    n = 128 // (128 // (D // 8))  # a thread's rows: 128 threads, D / 8 chunks a row
    assert re.search(rf"if pq & 1:[^\n]*\n\s*load_q_tiles_{n}\(ld_s \+ q_dst, q, ld_g, ld_safe, q_sm, ld_row, M\)\n"
                     rf"\s*else:\n\s*load_q_tiles_{n}\(ld_s \+ sb, ", item)
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    helper = src[src.index(f"def load_q_tiles_{n}("):]
    helper = helper[:helper.index("@device_function")]
    # the second half of a thread's rows into the second tile: its rows 64 on, 64 * D * 2 bytes from the first's
    jump = emit_fa3_ws._layout(spec)["qwg"] - 64 * 128
    at = f"s + dr * 128 + (it // {n // 2}) * {jump}" if jump else "s + dr * 128"
    assert helper.count(f"cp_async16_s({at}, garr, ") == 2, helper
    arrive = item.index("cp_async_mbar_arrive_noinc(bars + (pq & 1) * 8)")
    assert arrive < item.index("pq += 1") < item.index("while j <= kv_last:")
    assert "qe_phase" not in prod


@pytest.mark.parametrize("D", [64, 128])
def test_the_consumers_read_and_free_the_items_buffer(D):
    spec = _spec(D=D)
    assert emit_fa3_ws.epilogue_in_s(spec)
    q1, qe = (emit_fa3_ws._layout(spec)[k] for k in ("q1", "q_empty"))
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    _, cons = _parts(src)
    # S reads this warpgroup's own tile: its column blocks 64 rows (8192 bytes) apart
    if D == 128:
        assert "make_desc(HI_QK, q_wg + 8192)" in src and "q_wg + 16384" not in src
    item = cons[cons.index("while True:"):]
    itf = emit_fa3_ws._layout(spec)["item_full"]
    slot = rf"ip(__\d+)? = qk & 1  #[^\n]*\n\s*"
    assert re.search(slot + rf"mbar_wait\(bars \+ {itf} \+ ip(__\d+)? \* 8, \(qk >> 1\) & 1\)", item)
    landed = item.index("mbar_wait(bars + (qk & 1) * 8, (qk >> 1) & 1)  # Q has landed")
    loop = item.index("while j <= kv_last")
    assert landed < loop
    # q_wg made from the item count at each tile's S (not held across the item: registers)
    q_at = item.index(f"q_wg = sb + (qk & 1) * {q1} + cw * {emit_fa3_ws._layout(spec)['qwg']}", loop)
    assert q_at < item.index("qk_wgmma(sc, q_wg", loop)
    assert len(re.findall(r"\bq_wg(__\d+)? = ", cons)) == 1
    # an item with no tile flushes the item before's epilogue only once its own Q has landed
    assert landed < item.index("if ep_pend and kv_last")
    # no release at the last S: the buffer holds the item's O until its (kept) epilogue has stored it
    end = item.index("# this thread is past the item's last S")
    assert f"mbar_arrive(bars + {qe} + (qk & 1)" not in item[end:item.index("qk += 1", end)]
    # without bulk_store: each kept epilogue frees the kept item's buffer after reading its rows back and storing
    # them (with it: test_the_kept_epilogue_stores_o_by_bulk_copies)
    nobk = _spec({"bulk_store": False}, D=D)
    q1, qe = (emit_fa3_ws._layout(nobk)[k] for k in ("q1", "q_empty"))
    _, cons = _parts(emit_fa3_ws.emit_fa3_ws_forward(nobk))
    kept = [m.start() for m in re.finditer(r"o_wg(__\d+)? = sb \+ \(\(qk - 1\) & 1\) \* " + str(q1), cons)]
    frees = [m.start() for m in re.finditer(re.escape(f"mbar_arrive(bars + {qe} + ((qk - 1) & 1) * 8)"), cons)]
    assert len(kept) == len(frees) == 3  # an empty item's flush, the first tile's, the block's last item's
    for k, f in zip(kept, frees):
        assert k < cons.index("stg_v4_u32(", k) < f  # freed after its rows were read back and stored


def test_the_epilogue_at_the_items_end_stages_through_its_own_tile():
    """The softcap keeps its epilogue at the item's end (epilogue_in_s off) with two Q buffers by default (and Q,
    K and V by TMA): it stages O through the warpgroup's own tile of the item's buffer (q_wg), which is then freed;
    '-noqd' keeps one buffer."""
    import falower as fl

    g = runpy.run_path(str(EXAMPLES / "softcap.py"))["graph"]
    spec = fl.compile(g, extra=PERSIST).specialize("f16", D=128).spec  # its default
    assert emit_fa3_ws.q_double(spec) and not emit_fa3_ws.epilogue_in_s(spec) and emit_fa3_ws.tma_loads(spec)
    assert not emit_fa3_ws.q_double(fl.compile(g, extra={**PERSIST, "q_double": False}).specialize("f16", D=128).spec)
    qe = emit_fa3_ws._layout(spec)["q_empty"]
    _, cons = _parts(emit_fa3_ws.emit_fa3_ws_forward(spec))
    end = cons.index("# this thread is past the item's last S")
    tail = cons[end:cons.index("qk += 1", end)]
    # through the item's own tile, its address set again here: an item with no kv tile never ran the loop that
    # sets q_wg (it took the item before's buffer: ws_sim_cases' ws-pwg-document-persist-noes)
    name = re.search(r"stage_row\((q_wg(?:__\d+)?) \+ lr(__\d+)? \* 256", tail).group(1)
    assert re.search(rf"{name} = sb \+ \(qk & 1\) \* \d+ \+ cw \* \d+", tail), tail
    assert tail.index("stg_v4_u32(") < tail.index(f"mbar_arrive(bars + {qe} + (qk & 1) * 8)")


def test_off_it_is_the_kernel_before():
    src = emit_fa3_ws.emit_fa3_ws_forward(_spec({"q_double": False}))
    assert "qk" not in re.findall(r"\b\w+\b", src) and "q_dst" not in src and "ip ^= 1" in src
    assert "qe_phase ^= 1" in src and "q_wg = sb + cw * 8192" in src


ROWS = {"tma_store": False}  # bulk_store by one copy a row ('-notma')


def _release_chain(cons: str, qe: int) -> None:
    """Every release of the kept item's Q buffer waits for this thread's copies to have read, then the warp's,
    then arrives."""
    arrive = re.escape(f"mbar_arrive(bars + {qe} + ((qk - 1) & 1) * 8)")
    for m in re.finditer(arrive, cons):
        before = cons[:m.start()]
        assert before.rindex("bulk_wait_read0()") > before.rindex("if ob_pend")
        assert before.rindex("syncwarp()") > before.rindex("bulk_wait_read0()")
    assert len(re.findall(arrive, cons)) == len(re.findall(r"bulk_wait_read0\(\)", cons)) >= 3


def test_the_kept_epilogue_stores_o_by_bulk_copies():
    """`bulk_store` (the default with epilogue_in_s) without tma_store: each warp stages its own 16 rows of the kept
    item's O into its Q tile at 2 D + 16 bytes a row (no swizzle, no barrier after), fences them for the async
    proxy, and its lane 0 issues one bulk copy a row (operands made uniform by redux); the kept item's Q buffer is
    released (q_empty) only after this thread's copies have read shared memory, at the next tile's S or the item's
    end, or at once where the kept epilogue is a flush. No read back and no 16-byte stores in the consumers."""
    spec = _spec({**ROWS, **ROW_LOADS})
    assert emit_fa3_ws.bulk_store(spec) and emit_fa3_ws.bulk_store(_spec(ROWS, D=64))
    assert not emit_fa3_ws.tma_store(spec) and emit_fa3_ws.tma_store(_spec())
    assert not emit_fa3_ws.bulk_store(_spec({"bulk_store": False}))  # '-nobk'
    assert not emit_fa3_ws.bulk_store(_spec({"q_double": False}))
    assert not emit_fa3_ws.bulk_store(_spec({"epilogue_in_s": False}))
    for D in (64, 128):
        lay, off = emit_fa3_ws._layout(_spec(ROWS, D=D)), emit_fa3_ws._layout(_spec({"bulk_store": False}, D=D))
        assert off["qwg"] == 64 * 2 * D and lay["qwg"] == -(-64 * (2 * D + 16) // 1024) * 1024
        assert lay["qwg"] % 1024 == 0 and lay["kv"] == 2 * lay["qwg"] and lay["q1"] % 1024 == 0
        assert lay["total"] + emit_fa3_ws.ALIGN + emit_fa3_ws.static_bytes(_spec(ROWS, D=D)) <= \
            emit_fa3_ws.SMEM_LIMIT
    lay = emit_fa3_ws._layout(spec)
    qe, qwg = lay["q_empty"], lay["qwg"]
    prod, cons = _parts(emit_fa3_ws.emit_fa3_ws_forward(spec))
    assert f"q_wg = sb + (qk & 1) * {lay['q1']} + cw * {qwg}" in cons
    assert f"ld_s + sb" in prod  # the producer's Q copy: the second warpgroup's tile qwg bytes on (its helper's jump)
    assert "lds_v4_u32(" not in cons and "stg_v4_u32(" not in cons
    kept = [m.start() for m in re.finditer(r"o_wg(__\d+)? = sb \+ \(\(qk - 1\) & 1\)", cons)]
    assert len(kept) == 3  # the item's first tile, an empty item's flush, the block's last item
    for k in kept:
        st = cons.index("stage_row_z(", k)
        assert "bar_sync(" not in cons[st:cons.index("bulk_store(", st)]  # the warp's own rows: no barrier after
        assert st < cons.index("fence_proxy_async()", st) < cons.index("syncwarp()", st) < \
            cons.index("if lane == 0:", st) < cons.index("bulk_store(", st) < cons.index("bulk_commit()", st)
    assert re.search(r"stage_row_z\(o_wg(__\d+)? \+ lr(__\d+)? \* 272 \+ 2 \* t2, np.uint32\(0\)", cons)
    assert "tma_store_3d(" not in cons and "omap" not in emit_fa3_ws.emit_fa3_ws_forward(spec)
    _release_chain(cons, qe)


@pytest.mark.parametrize("D", [64, 128])
def test_the_kept_epilogue_stores_o_by_tma_tensor_copies(D):
    """`tma_store` (the default): each warp stages its 16 rows in the 128-byte swizzle as D / 64 boxes of 16 rows x
    128 bytes (2048 bytes apart, its own 32 D bytes of the kept item's Q tile, which keeps 64 rows of D: no
    padding), and its lane 0 stores each box by one tensor copy through O's map (`omap`, after `work`; acquired
    once by each copying lane at the start) at (64 box, the warp's first row, the item's (b, h) slice), kept for
    the item in ep_i instead of its first flat row. The release chain is bulk_store's."""
    spec = _spec(D=D)
    assert emit_fa3_ws.tma_store(spec) and emit_fa3_ws.bulk_store(spec)
    assert not emit_fa3_ws.tma_store(_spec({"bulk_store": False}, D=D))
    lay = emit_fa3_ws._layout(spec)
    assert lay["qwg"] == 64 * 2 * D and lay["kv"] == 2 * lay["qwg"]
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    assert re.search(r"def \w+\(q, k, v, o, lse, .*, work, omap, qmap, kmap, vmap\):", src)  # Q, K, V's by TMA too
    prod, cons = _parts(src)
    assert "omap" not in prod
    assert cons.index("omap_g = elem_addr(omap, (0,))") < cons.index("tensormap_acquire(omap_g)") < \
        cons.index("tma_store_3d(")
    assert "ep_i[cw * 2] = b" in cons and "ep_i[cw * 2] = q_head" not in cons
    assert "bulk_store(" not in cons and "stg_v4_u32(" not in cons
    kept = [m.start() for m in re.finditer(r"o_wg(__\d+)? = sb \+ \(\(qk - 1\) & 1\)", cons)]
    assert len(kept) == 3
    for k in kept:  # the warp's 16 rows by D / 16 stmatrix (emit_fa3_ws.stmatrix_staging, the default)
        st = cons.index("stage_rows_stsm(", k)
        stores = cons[st:cons.index("bulk_commit()", st)]
        assert re.search(r"stage_rows_stsm\(o_wg(__\d+)? \+ \(warp & 3\) \* " + str(32 * D) +
                         r", lane, acc, ofs_0, ofs_2, ep_f\[ctid \* 2 \+ 0\], ep_f\[ctid \* 2 \+ 1\]\)", stores)
        assert "bar_sync(" not in stores and stores.index("fence_proxy_async()") < stores.index("syncwarp()") < \
            stores.index("if lane == 0:")
        copies = re.findall(r"tma_store_3d\(omap_g, (\d+), ob_q(?:__\d+)?, ob_bh(?:__\d+)?, ob_s(?:__\d+)? \+ (\d+)\)",
                            stores)
        assert copies == [(str(64 * b), str(2048 * b)) for b in range(D // 64)]
    helper = src[src.index("def stage_rows_stsm("):]
    assert helper.count("stsm_x4(") == 1 and f"for k in range({D // 16}):" in helper
    assert "(dn >> np.uint32(3)) * np.uint32(2048)" in helper  # column block dn // 8 in the next box
    _release_chain(cons, lay["q_empty"])
    # stmatrix off: each row's words one STS at a time, through the box helper
    words = emit_fa3_ws.emit_fa3_ws_forward(_spec({"stmatrix": False}, D=D))
    _, cons = _parts(words)
    assert "stage_rows_stsm" not in words and "(dn >> 3) * 2048" in words
    assert re.search(r"stage_row_z_box\(o_wg(__\d+)? \+ \(warp & 3\) \* " + str(32 * D) +
                     r" \+ lr(__\d+)? \* 128 \+ 2 \* t2, np.uint32\(lr(__\d+)? & 7\)", cons)


@pytest.mark.parametrize("D", [64, 128])
def test_the_producer_loads_q_k_and_v_by_tma(D):
    """`tma_loads` (on by default under two Q buffers): the kernel takes Q's, K's and V's maps after O's; the
    stages' full barriers count one arrival (thread 0's expect_tx, the bytes completing the phase), the Q buffers'
    the producer's 128 threads (thread 0's expect_tx and the others' arrivals, once past the item's ticket); thread
    0 alone acquires the maps once, and for each item announces the item's Q bytes and copies each consumer
    warpgroup's 64 rows a 64-column block at (64 b, q_lo + 64 w, h, b) into the item's buffer, then for each tile
    waits for a stage to be free, announces the tile's bytes and issues one copy a 64-column block at
    (64 b, j BK, hk, b). No thread keeps row addresses or issues 16-byte copies. The consumers are as without it."""
    assert not emit_fa3_ws.tma_loads(_spec({"tma_loads": False}, D=D))
    spec = _spec(D=D)
    assert emit_fa3_ws.tma_loads(spec) and emit_fa3_ws.tma_loads(_spec({"tma_loads": True}, D=D))
    # one copying thread: the producer at 56 registers, the consumers at 224 (120 / 192 without; an asked
    # producer_regs still holds)
    assert emit_fa3_ws.registers(spec) == (56, 224)
    assert emit_fa3_ws.registers(_spec({"tma_loads": False}, D=D)) == (120, 192)
    assert emit_fa3_ws.registers(_spec({"tma_loads": True, "producer_regs": 88}, D=D)) == (88, 208)
    lay, T = emit_fa3_ws._layout(spec), emit_fa3_ws._layout(spec)["tile"]
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    assert re.search(r"def \w+\(q, k, v, o, lse, .*, work, omap, qmap, kmap, vmap\):", src)
    for at in (lay["full_k"], lay["full_v"]):
        assert f"mbar_init(bars + {at}, 1)" in src
    for at in (0, 8):  # the Q buffers: thread 0's expect_tx and the other 127 producer threads' arrivals
        assert f"mbar_init(bars + {at}, 128)" in src
    prod, cons = _parts(src)
    items = prod.index("while True:")
    assert all(prod.index(f"tensormap_acquire({x}map_g)") < items for x in "qkv")
    q = prod[prod.index("q_bar = bars + (pq & 1) * 8", items):]
    assert q.index(f"q_buf = sb + (pq & 1) * {lay['q1']}") < q.index(f"mbar_arrive_expect_tx(q_bar, {128 * D * 2})")
    # the other producer threads arrive once past the item's ticket: none falls an item behind thread 0
    assert q.index("tma_load_4d(") < q.index("else:") < q.index("mbar_arrive(q_bar)") < q.index("pq += 1")
    for w in (0, 1):
        for hb in range(D // 64):
            assert f"tma_load_4d(q_buf + {w * lay['qwg'] + hb * 8192}, qmap_g, {hb * 64}, q_lo + {w * 64}, h, b, " \
                   "q_bar)" in q
    loop = prod[prod.index("while j <= kv_last:"):]
    body = loop[loop.index("if tid == 0:"):]
    for x, off in (("k", ""), ("v", f" + {T}")):
        wait = body.index(f"mbar_wait(sbar + {lay['empty_' + x]}, phase ^ 1)")
        expect = body.index(f"mbar_arrive_expect_tx(sbar + {lay['full_' + x]}, {T})")
        copies = [body.index(f"tma_load_4d(k_dst{off} + {hb * 128 * 128}, {x}map_g, {hb * 64}, j * 128, hk, b, "
                             f"sbar + {lay['full_' + x]})") for hb in range(D // 64)]
        assert wait < expect < min(copies)
    assert "cp_async_mbar_arrive_noinc(" not in prod and "k_at" not in prod and "load_q_tiles" not in prod
    base = _parts(emit_fa3_ws.emit_fa3_ws_forward(_spec(D=D)))[1]
    strip = lambda s: re.sub(r"__\d+", "", s)  # noqa: E731
    assert strip(cons.split("\n", 1)[1]) == strip(base.split("\n", 1)[1])  # the same code but its registers
