"""benchmarks/timeline.py's stamping of the ws kernel's source (the GPU run itself needs torch and a GPU): the
stamps go where its summary reads them, the signature takes the buffer, and a kernel without the anchors is
refused with a one-line reason."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

import falower as fl
from falower.backends.numba_cuda import emit_fa3_ws
from falower.backends.numba_cuda.from_ir import analyse, build_spec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
timeline = pytest.importorskip("timeline")


def _ws(stem: str = "causal", **extra):
    g = runpy.run_path(str(ROOT / "examples" / f"{stem}.py"))["graph"]
    spec = build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": 128}, "f16", "mma", None,
                      {"schedule": "wgmma-ws", "producer": "none", **extra})
    return spec, emit_fa3_ws.emit_fa3_ws_forward(spec)


def test_the_stamps_go_in_order():
    spec, src = _ws()
    out = timeline.stamped_source(src, spec.name)
    compile(out, "stamped", "exec")
    assert f"def {spec.name}(" in out and ", tl_buf):" in out
    assert "from falower.backends.numba_cuda.intrinsics import global_timer, sm_id" in out
    at = [out.index(f"{v} = global_timer()") for v in ("tl_t0", "tl_t1", "tl_t2", "tl_t3")]
    assert at == sorted(at)
    assert out.index("tl_t1 = global_timer()") > out.index("# this warpgroup's Q has landed")
    assert out.index("tl_t2 = global_timer()") < out.index("cp_async_wait0()  # every copy was waited for")
    assert out.rstrip().endswith("tl_buf[tl_i + 5] = np.uint64(kv_last - kv_first + 1)")


def test_a_kernel_without_the_anchors_is_refused():
    spec, src = _ws()
    with pytest.raises(SystemExit, match="anchors not found"):
        timeline.stamped_source(src.replace("# this warpgroup's Q has landed", "#"), spec.name)


def test_the_summary_reads_the_stamps():
    """Two SMs, two blocks each of two warpgroups: prologue 1 us, 2 us a tile plus 0.5 fixed, epilogue 1.5 us, a
    0.25 us gap between an SM's blocks."""
    rows, t = [], 0.0
    for sm in (0, 1):
        t = 0.0
        for tiles in (3, 5):
            for _ in range(2):
                q, le = t + 1000, t + 1000 + 500 + 2000 * tiles
                rows.append([t, q, le, le + 1500, sm, tiles])
            t = le + 1500 + 250
    s = timeline.summarize(np.array(rows, dtype=np.float64) + [1e6, 1e6, 1e6, 1e6, 0, 0])
    assert s["prologue_us"] == pytest.approx(1.0) and s["epilogue_us"] == pytest.approx(1.5)
    assert s["loop_us_per_tile"] == pytest.approx(2.0) and s["loop_fixed_us"] == pytest.approx(0.5)
    assert s["sm_gap_us"] == pytest.approx(0.25)
    assert s["item_cost_tiles"] == pytest.approx((1.0 + 0.5 + 1.5 + 0.25) / 2.0)


def test_the_persistent_stamps_go_in_order():
    """An item's record: its Q landed (before its kv loop), its loop's end (the top of the item loop, before the
    next item's loads), then after its epilogue, written before the loop breaks."""
    spec, src = _ws(persistent=132)
    out = timeline.stamped_persistent_source(src, spec.name)
    compile(out, "stamped", "exec")
    assert ", tl_buf):" in out
    top = out.index("    while True:\n        tl_le = global_timer()")
    rec = out.index("        if cur_ok and (tid & 127) == 0 and tl_k < ")
    assert top < rec < out.index("            break") < out.index("        tl_q = global_timer()")
    assert out.index("# this warpgroup's Q has landed") < out.index("        tl_q = global_timer()")
    with pytest.raises(SystemExit, match="anchors not found"):
        timeline.stamped_persistent_source(src.replace("    while True:", "    while 1:"), spec.name)


def test_the_persistent_summary_reads_the_stamps():
    """Two warpgroups of two items each (3 and 5 tiles): 2 us a tile plus 0.5 fixed, epilogue 1 us, 0.75 us from
    an item's loop end to the next one's Q."""
    t = np.zeros((2, timeline.ITEMS, 5))
    for wg in range(2):
        now = 1e6
        for k, tiles in enumerate((3, 5)):
            le = now + 500 + 2000 * tiles
            t[wg, k] = [now, le, le + 1000, 0, tiles]
            now = le + 750
    s = timeline.summarize_persistent(t)
    assert s["items"] == 4 and s["epilogue_us"] == pytest.approx(1.0)
    assert s["loop_us_per_tile"] == pytest.approx(2.0) and s["loop_fixed_us"] == pytest.approx(0.5)
    assert s["loop_end_to_next_q_us"] == pytest.approx(0.75)
    assert s["item_cost_tiles"] == pytest.approx((0.75 + 0.5) / 2.0)


@pytest.mark.parametrize("stem", ["plain", "causal", "document"])
def test_the_phase_stamps_go_in_order(stem):
    """--phases: a %clock64 stamp at entry, one at each anchor of timeline.PHASES in order (before or after its
    line, as the table says) and one at the end, each exactly once, in every kind of kernel the bench times."""
    spec, src = _ws(stem)
    out = timeline.stamped_phases_source(src, spec.name)
    compile(out, "stamped", "exec")
    assert "import clock64, global_timer, sm_id" in out and ", tl_buf):" in out
    n = len(timeline.PHASES) + 2
    at = [out.index(f"tl_c{i} = clock64()") for i in range(n)]
    assert at == sorted(at) and all(out.count(f"tl_c{i} = clock64()") == 1 for i in range(n))
    for i, (_, anchor, where) in enumerate(timeline.PHASES, start=1):
        line = out.index(anchor)
        assert (at[i] > line) if where == "after" else (at[i] < line), (i, anchor)
    with pytest.raises(SystemExit, match="phase anchors not found"):
        timeline.stamped_phases_source(src.replace("# the warpgroup's rows are in shared memory", "#"), spec.name)


def test_the_phase_summary_reads_the_stamps():
    """Warpgroups at 1.5 GHz: each phase's cycles come back in us, the loop a tile over the tile count."""
    n = len(timeline.PHASES) + 2
    spans = [300, 600, 150, 1500, 0, 450, 900, 1200]  # cycles of set-up .. stores; the loop's is set per row
    rows = []
    for w, tiles in enumerate((4, 8, 8, 16)):
        cyc = list(spans)
        cyc[4] = 3000 * tiles
        clocks = np.concatenate([[1e9], 1e9 + np.cumsum(cyc)])
        g0 = 5e6 + 1e5 * w
        rows.append([*clocks, g0, g0 + (clocks[-1] - clocks[0]) / 1.5, w, tiles])
    s = timeline.summarize_phases(np.array(rows, dtype=np.float64))
    assert s["sm_ghz"] == pytest.approx(1.5)
    assert s["set-up_us"] == pytest.approx(0.2) and s["Q wait_us"] == pytest.approx(1.0)
    assert s["stores_us"] == pytest.approx(0.8)
    assert s["loop_us_per_tile"] == pytest.approx(2.0)
    assert len([k for k in s if k.endswith("_us")]) == n - 1  # one span a phase, the stores last


def test_the_phase_summary_of_a_small_launch():
    """No warpgroup long enough for the timer's steps not to matter (a small --n): the clock comes from the pooled
    cycles over the pooled time, not NaN."""
    n = len(timeline.PHASES) + 2
    rows = []
    for w in range(4):
        clocks = 1e9 + np.concatenate([[0], np.cumsum([300] * (n - 1))])
        rows.append([*clocks, 5e6 + w * 1e4, 5e6 + w * 1e4 + (clocks[-1] - clocks[0]) / 2.0, w, 1])
    s = timeline.summarize_phases(np.array(rows, dtype=np.float64))
    assert s["sm_ghz"] == pytest.approx(2.0) and s["set-up_us"] == pytest.approx(0.15)


@pytest.mark.parametrize("stem", ["plain", "causal"])
def test_the_producer_kernels_stamps_go_in_order(stem):
    """The persistent kernel with a producer warpgroup, stamped in its consumers: per item the start after its
    state, Q landed, loop end (q_empty), the record before `qphase ^= 1`; the waits for K and V bracketed by
    %clock64 inside the kv loop; the kv range read by the names the consumers' loop uses."""
    spec, src = _ws(stem, producer="warpgroup", persistent=132, item_order="dynamic")
    out = timeline.stamped_producer_source(src, spec.name)
    compile(out, "stamped", "exec")
    assert ", tl_buf):" in out and "import clock64, global_timer, sm_id" in out
    consumers = out.index("SETMAXNREG_INC()")
    marks = ["tl_s = global_timer()\n", "tl_q = global_timer()", "tl_c0 = clock64()", "tl_wk += clock64() - tl_c0",
             "tl_wk0 = clock64() - tl_c0", "tl_wv += clock64() - tl_c0", "tl_c2 = clock64()",
             "tl_eb += clock64() - tl_c2", "tl_es += clock64() - tl_c2", "tl_er += clock64() - tl_c2",
             "tl_ep += clock64() - tl_c2", "tl_c1 = clock64() - tl_cq", "tl_le = global_timer()",
             "tl_buf[tl_i + 8] = np.uint64(tl_cle - tl_cq)", "tl_buf[tl_i + 9] = np.uint64(tl_wk0)",
             "tl_buf[tl_i + 11] = np.uint64(tl_ep)", "tl_buf[tl_i + 13] = np.uint64(tl_es)",
             "tl_buf[tl_i + 14] = np.uint64(tl_er)", "tl_buf[tl_i + 15] = np.uint64(tl_ec)"]
    at = [out.index(m, consumers) for m in marks]
    assert at == sorted(at), marks
    assert out.index("# K_j has landed", consumers) < at[3] and out.index("# Q has landed", consumers) < at[1]
    # inside the kept epilogue: after its first barrier, after its rows are staged (the bulk copies' warp sync)
    eb, es = out.index("tl_eb += clock64() - tl_c2"), out.index("tl_es += clock64() - tl_c2")
    assert out.rindex("is done with the last item's O rows", 0, eb) > out.rindex("tl_c2 = clock64()", 0, eb)
    assert out.rindex("this warp's 16 rows are staged", 0, es) > eb
    er = out.index("tl_er += clock64() - tl_c2")  # after the copies' redux, before the copies (tma_store)
    ec = out.index("tl_ec += clock64() - tl_c2")  # after lane 0 issued and committed the copies
    assert es < out.rindex("= warp_min(np.int32(o_wg", 0, er) < er < out.index("tma_store_3d(", er) < \
        out.index("bulk_commit()", er) < ec < out.index("tl_ep += clock64() - tl_c2")
    assert out[out.rindex("\n", 0, ec):ec].count(" ") > out[out.rindex("\n", 0, er):er].count(" ")  # in lane 0's branch
    # the block's own start and end, inside it (one level below its `if`): a tile that skips it adds nothing
    head = out.index("if ep_pend:  # the item before's epilogue", consumers)
    c2, ep = out.index("tl_c2 = clock64()", consumers), out.index("tl_ep += clock64() - tl_c2")
    depth = head - out.rindex("\n", 0, head) - 1
    assert head < c2 and out.index("\n", head) + 1 + depth + 4 == c2, out[head:c2 + 20]
    assert out[out.rindex("\n", 0, ep) + 1:ep] == " " * (depth + 4)
    loop = out[consumers:]
    first = loop[loop.index("\n", loop.index("# Q has landed")):]
    j0 = first.split("j = ", 1)[1].split("\n", 1)[0]
    assert f"tl_nt = " in out and f" - {j0} + 1" in out
    # the ping-pong's turn barrier bracketed, a tile; recorded after the kept epilogue's marks
    turn = out.index("# this warpgroup's turn on the tensor cores", consumers)
    assert out.rindex("tl_c3 = clock64()", 0, turn) > out.rindex("\n", 0, turn) - 200
    assert out.index("tl_wt += clock64() - tl_c3", turn) < out.index("\n", out.index("\n", turn) + 1)
    assert out.index("tl_buf[tl_i + 16] = np.uint64(tl_wt)") > at[-1]
    # the prologue: the entry, past the block's barrier after the barriers' init, the consumers' registers raised
    e1 = out.index("tl_e1 = global_timer()")
    assert out.index("tl_e0 = global_timer()") < out.index("cuda.syncthreads()  # the barriers are initialised") < e1
    assert e1 < out.index("SETMAXNREG_INC()") < out.index("tl_e2 = global_timer()") < out.index("tl_s = global_timer()")
    assert out.index("tl_buf[tl_i + 18] = tl_e1") < out.index("tl_buf[tl_i + 19] = tl_e2")
    with pytest.raises(SystemExit, match="anchors not found"):
        timeline.stamped_producer_source(src.replace("# K_j has landed", "#"), spec.name)


def test_the_producer_summary_reads_the_stamps():
    """Two warpgroups of two items (3 and 5 tiles): Q waited 0.25 us after the state, 2 us a tile plus 0.5 fixed,
    epilogue 1 us, 0.75 us between items; K waits 100 cycles a tile, V 50, the loop 2000 cycles a tile; the blocks
    entered 0.8 and 1.2 us before their first item's state, passed their barrier 0.3 us after entry and raised the
    consumers' registers 0.2 us after that."""
    t = np.zeros((2, timeline.ITEMS, len(timeline.PRODUCER_FIELDS)))
    for wg in range(2):
        now = 1e6
        for k, tiles in enumerate((3, 5)):
            q = now + 250
            le = q + 500 + 2000 * tiles
            t[wg, k] = [now, q, le, le + 1000, 0, tiles, 100 * tiles, 50 * tiles, 2000 * tiles, 300 + 100 * k,
                        4000 + 1000 * k, 1500 * k, 400 * k, 900 * k, 1100 * k, 1300 * k, 500 * tiles,
                        1e6 - 800 - 400 * wg, 1e6 - 500 - 400 * wg, 1e6 - 300 - 400 * wg]
            now = le + 1000 + 750
    s = timeline.summarize_producer(t)
    assert s["items"] == 4 and s["q_wait_us"] == pytest.approx(0.25) and s["epilogue_us"] == pytest.approx(1.0)
    assert s["loop_us_per_tile"] == pytest.approx(2.0) and s["loop_fixed_us"] == pytest.approx(0.5)
    assert s["between_us"] == pytest.approx(0.75)
    assert s["item_cost_tiles"] == pytest.approx((0.25 + 0.5 + 1.0 + 0.75) / 2.0)
    assert s["k_wait_cycles_per_tile"] == pytest.approx(100) and s["v_wait_cycles_per_tile"] == pytest.approx(50)
    assert s["k_wait_share"] == pytest.approx(0.05) and s["loop_cycles_per_tile"] == pytest.approx(2000)
    assert s["k0_wait_cycles"] == pytest.approx(350)
    # the first tile from Q landed; the kept epilogue's median over the items that had one (each block's second)
    assert s["first_tile_cycles"] == pytest.approx(4500) and s["kept_epilogue_cycles"] == pytest.approx(1500)
    assert s["kept_barrier_cycles"] == pytest.approx(400) and s["kept_staged_cycles"] == pytest.approx(900)
    assert s["kept_redux_cycles"] == pytest.approx(1100) and s["kept_issued_cycles"] == pytest.approx(1300)
    assert s["turn_wait_cycles_per_tile"] == pytest.approx(500) and s["turn_wait_share"] == pytest.approx(0.25)
    assert s["entry_to_first_item_us"] == pytest.approx(1.0) and s["entry_spread_us"] == pytest.approx(0.4)
    assert s["kernel_from_entry_us"] == pytest.approx(21.45)  # the last item's end, 20.25 us after the first state
    assert s["entry_to_synced_us"] == pytest.approx(0.3) and s["synced_to_regs_us"] == pytest.approx(0.2)
    assert s["regs_to_first_item_us"] == pytest.approx(0.5)  # 0.3 and 0.7: the median


def test_a_floor_experiment_replaces_every_occurrence_or_says_why_not():
    src = "a = load(x)\nb = load(x)\n"
    assert timeline.replaced_source(src, ["load(x)::ONE"]) == "a = ONE\nb = ONE\n"
    assert timeline.replaced_source(src, []) == src
    with pytest.raises(SystemExit, match="OLD is not in the kernel"):
        timeline.replaced_source(src, ["store(x)::ONE"])
    with pytest.raises(SystemExit, match="no '::'"):
        timeline.replaced_source(src, ["load(x)"])


def test_three_consumer_warpgroups_are_stamped_where_the_records_allow():
    """The persistent producer warpgroup's records are a block's warpgroups in turn, three at block_q 192 (its
    index counts them); the other stampings pair two a block, and refuse three with the reason."""
    import dataclasses

    spec, _ = _ws()
    assert timeline.check_stampable(spec, False) == 2
    wide = dataclasses.replace(spec, block_q=192)
    assert timeline.check_stampable(wide, True) == 3
    with pytest.raises(SystemExit, match="3 consumer warpgroups \\(block_q 192\\); these stamps are laid out for two"):
        timeline.check_stampable(wide, False)
    g = runpy.run_path(str(ROOT / "examples" / "causal.py"))["graph"]
    s3 = build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": 64}, "f16", "mma", None,
                    {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 132, "item_order": "dynamic"})
    s3 = dataclasses.replace(s3, block_q=192)
    emit_fa3_ws.validate_spec(s3)
    out = timeline.stamped_producer_source(emit_fa3_ws.emit_fa3_ws_forward(s3), s3.name, 3)
    compile(out, "stamped", "exec")
    assert "tl_i = ((cuda.blockIdx.x * 3 + ((tid >> 7) - 1))" in out


def test_a_cluster_kernel_is_stamped_with_its_merge_and_its_fused_twins_arguments(hopper):
    """A kernel that merges split-kv's parts in a cluster (decoding's 8 parts at B = 1, H = 8, N = 1k) is stamped
    as itself, not as its form without clusters: its arguments come from its fused twin (the same argument list,
    which Numba's path prepares), it is launched in clusters of its parts, and its consumers' record of an item
    comes after the cluster's merge (the wait for the parts' pushes and the merge itself: cluster_push; both cluster
    barriers under cluster_push False), so the item's epilogue stamp includes it. A kernel without clusters is its
    own twin."""
    c = fl.compile(runpy.run_path(str(ROOT / "examples" / "plain.py"))["graph"], "numba-cuda")
    kern = c.specialize("f16", B=1, H=8, M=1, N=1024, D=128)
    twin, width = timeline.argument_twin(kern)
    assert width == 8 and twin is not kern and twin.argtypes() == kern.argtypes()
    assert emit_fa3_ws.fused_merge(twin.spec) and not emit_fa3_ws.cluster_merge(twin.spec)
    out = timeline.stamped_producer_source(kern.source, kern.spec.name, emit_fa3_ws.consumer_wgs(kern.spec))
    compile(out, "stamped", "exec")
    end = out.index("tl_buf[tl_i + 3] = global_timer()")
    assert "cluster_sync()" not in out and out.index("mbar_wait_cluster(") < out.rindex("merge_unit(", 0, end)
    pulled = fl.compile(runpy.run_path(str(ROOT / "examples" / "plain.py"))["graph"], "numba-cuda",
                        extra={"cluster_push": False}).specialize("f16", B=1, H=8, M=1, N=1024, D=128)
    out = timeline.stamped_producer_source(pulled.source, pulled.spec.name, emit_fa3_ws.consumer_wgs(pulled.spec))
    syncs = [i for i in range(len(out)) if out.startswith("cluster_sync()", i)]
    assert len(syncs) == 2 and syncs[-1] < out.index("tl_buf[tl_i + 3] = global_timer()")
    plain = c.specialize("f16", B=1, H=8, M=4096, N=4096, D=128)
    assert timeline.argument_twin(plain) == (plain, 0)
