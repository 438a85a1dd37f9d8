"""The automatic choice between the mma.sync kernel (emit_fa2) and the Hopper wgmma kernel (emit_fa3), on the CPU:
the rule (`emit_fa3.auto_extra`), and `falower.compile` taking it from the device's compute capability (faked
here: the runtime asks the driver, `runtime.device_cc`), the FALOWER_WGMMA override and `extra={"schedule":
...}`. Kernels are only emitted (no GPU, no Numba compile)."""

from __future__ import annotations

import pytest

import falower as fl
from falower.backends.numba_cuda import emit_fa3, runtime
from falower.backends.numba_cuda.from_ir import BackendError


def test_rule() -> None:
    rule = emit_fa3.auto_extra
    for D, mask, want in [(128, "none", True), (128, "static", True), (128, "table", True), (128, "list", True),
                          (64, "none", True), (64, "static", True), (64, "list", True), (96, "none", False)]:
        got = rule("f16", D, mask, (9, 0), {})
        assert (got is not None) == want, (D, mask, got)
        if got is not None and D == 128 and mask in ("none", "static", "list"):  # the warp-specialized kernel
            assert got == {"schedule": "wgmma-ws", "producer": "none"}
        elif got is not None:  # 128 rows a warpgroup at D = 64 without a mask or under a static one
            rows = {"wg_rows": 128} if D == 64 and mask in ("none", "static") else {}
            assert got == {"schedule": "wgmma", "overlap": D == 128, **rows}
    assert rule("bf16", 128, "none", (9, 0), {}) is not None
    assert rule("f32", 128, "none", (9, 0), {}) is None
    assert rule("f16", 128, "none", (8, 0), {}) is None  # not a Hopper GPU
    assert rule("f16", 128, "none", None, {}) is None  # no GPU (the simulator included): never silently
    assert rule("f16", 128, "none", (9, 0), {"FALOWER_WGMMA": "0"}) is None
    assert rule("f16", 64, "static", None, {"FALOWER_WGMMA": "1"}) is not None  # forced: wherever it can
    assert rule("f16", 96, "none", None, {"FALOWER_WGMMA": "1"}) is None
    ws = {"schedule": "wgmma-ws", "producer": "none"}  # FALOWER_WGMMA=ws: the warp-specialized kernel, lists too
    assert all(rule("f16", 128, m, (9, 0), {"FALOWER_WGMMA": "ws"}) == ws for m in ("none", "static", "list"))
    assert rule("f16", 64, "list", (9, 0), {"FALOWER_WGMMA": "ws"}) == {"schedule": "wgmma", "overlap": False}
    assert rule("f32", 128, "list", (9, 0), {"FALOWER_WGMMA": "ws"}) is None
    assert emit_fa3.tiles(128) == (128, 128) and emit_fa3.tiles(64) == (128, 64)
    assert emit_fa3.tiles(128, "list") == (128, 128) and emit_fa3.tiles(64, "list") == (128, 64)


@pytest.fixture
def hopper(monkeypatch, tmp_path):
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FALOWER_WGMMA", raising=False)
    monkeypatch.setattr(runtime, "device_cc", lambda: (9, 0))
    monkeypatch.setattr(runtime, "_has_gpu", lambda: False)  # emit only: nothing to compile for
    return monkeypatch


def _graph(causal: bool):
    return fl.attention(mask_mod=(lambda b, h, q, kv: q >= kv) if causal else None, name="sel", dtype="f16")


def _spec(c, D: int):
    return c.specialize("f16", D=D).spec


def test_compile_picks_wgmma_on_hopper(hopper) -> None:
    c = fl.compile(_graph(False))
    s = _spec(c, 128)
    assert s.extra == {"schedule": "wgmma-ws", "producer": "none"} and (s.block_q, s.block_k) == (128, 128)
    assert "wgmma_ss" in c.source and "mbar_" in c.source
    k = c.specialize("f16", D=128)
    assert c.lowered_of(k) is not c.lowered  # lowered again with the wgmma tiles: the IR says 128 x 128
    assert "tile.load" in fl.print_func(c.lowered_of(k)) and "f16[128,D]" in fl.print_func(c.lowered_of(k))
    s = _spec(c, 64)
    assert s.extra == {"schedule": "wgmma", "overlap": False, "wg_rows": 128} and (s.block_q, s.block_k) == (128, 64)
    assert c.lowered_of(c.specialize("f16", D=64)) is c.lowered


def test_d64_causal_takes_wgmma(hopper) -> None:
    """D = 64 under a mask: wgmma since its kernel runs two blocks per SM (it lost to mma.sync before), with 128
    rows a warpgroup under a static mask."""
    c = fl.compile(_graph(True))
    assert _spec(c, 64).extra == {"schedule": "wgmma", "overlap": False, "wg_rows": 128}
    assert _spec(c, 128).extra["schedule"] == "wgmma-ws"


def test_overrides(hopper) -> None:
    hopper.setenv("FALOWER_WGMMA", "0")
    assert _spec(fl.compile(_graph(False)), 128).extra == {}
    hopper.setenv("FALOWER_WGMMA", "1")
    hopper.setattr(runtime, "device_sm_count", lambda: None)
    assert _spec(fl.compile(_graph(True)), 64).extra["schedule"] == "wgmma"
    hopper.delenv("FALOWER_WGMMA")
    assert _spec(fl.compile(_graph(False), extra={"schedule": "mma"}), 128).extra == {"schedule": "mma"}
    s = _spec(fl.compile(_graph(True), extra={"schedule": "wgmma"}), 64)  # explicit: chosen where auto is not
    assert s.extra["schedule"] == "wgmma" and not s.extra["overlap"]
    s = _spec(fl.compile(_graph(True), extra={"schedule": "wgmma", "overlap": True}), 64)  # the overlap: 64 rows
    assert s.extra == {"schedule": "wgmma", "overlap": True}
    emit_fa3.validate_spec(s)
    s = _spec(fl.compile(_graph(False), extra={"schedule": "wgmma", "overlap": False}), 128)
    assert s.extra == {"schedule": "wgmma", "overlap": False} and s.block_k == 128  # the caller's knobs win


def test_no_gpu_or_other_gpus_keep_mma_sync(hopper) -> None:
    hopper.setattr(runtime, "device_cc", lambda: None)
    assert _spec(fl.compile(_graph(False)), 128).extra == {}
    hopper.setattr(runtime, "device_cc", lambda: (8, 0))
    assert _spec(fl.compile(_graph(False)), 128).extra == {}


def test_unsupported_specs_fall_back(hopper) -> None:
    """Tiles the wgmma kernel cannot run (the caller's pipeline): mma.sync, no error; f32 stays on simt."""
    pipe = "decompose-softmax,canonicalize,fuse,tile{bq=32,bk=16},online-softmax{exp2=true},mask-tiles,canonicalize"
    c = fl.compile(_graph(False), pipeline=pipe)
    s = _spec(c, 128)
    assert s.extra == {} and (s.block_q, s.block_k) == (32, 16)
    c = fl.compile(_graph(False))
    assert c.specialize("f32", D=64).spec.path == "simt"
    assert _spec(c, 96).extra == {}


def test_caller_tiles_of_64_rows_keep_64_rows_a_warpgroup(hopper) -> None:
    """The caller's pipeline with 64-row q tiles at D = 64: the wgmma kernel with one warpgroup of 64 rows (not 128
    rows a warpgroup, which those tiles cannot hold, and not a fall back to mma.sync); asked for explicitly too."""
    pipe = "decompose-softmax,canonicalize,fuse,tile{bq=64,bk=32},online-softmax{exp2=true},mask-tiles,canonicalize"
    for extra in (None, {"schedule": "wgmma"}):
        s = _spec(fl.compile(_graph(True), pipeline=pipe, extra=extra), 64)
        assert s.extra == {"schedule": "wgmma", "overlap": False} and (s.block_q, s.block_k) == (64, 32), s.extra

    with pytest.raises(BackendError, match="per 128 query rows, 1-4 of them; got block_q=64"):  # asked: an error
        _spec(fl.compile(_graph(True), pipeline=pipe, extra={"schedule": "wgmma", "wg_rows": 128}), 64)


def test_launch_bounds_where_blocks_fit(hopper) -> None:
    """D = 64 (49 KB of shared memory a block): one warpgroup of 128 rows, built for three blocks per SM (launch
    bounds under @kernel_jit: 168 registers a thread); two warpgroups of 64 rows for two (the document mask's
    block lists, whose hoisted row bounds spill at 168). D = 128 (193 KB) for one, with no bounds."""
    c = fl.compile(_graph(False))
    k64, k128 = c.specialize("f16", D=64), c.specialize("f16", D=128)
    assert emit_fa3.blocks_per_sm(k64.spec) == 3 and emit_fa3.blocks_per_sm(k128.spec) == 1
    assert "@kernel_jit\n@launch_bounds(128, 3)" in k64.source
    assert "@launch_bounds" not in k128.source
    k = fl.compile(_graph(False), extra={"schedule": "wgmma", "wg_rows": 64}).specialize("f16", D=64)
    assert emit_fa3.blocks_per_sm(k.spec) == 2 and "@kernel_jit\n@launch_bounds(256, 2)" in k.source
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent.parent
    doc = runpy.run_path(str(root / "examples" / "document.py"))["graph"]
    forced = fl.compile(doc, extra={"schedule": "wgmma", "wg_rows": 128}).specialize("f16", D=64)
    assert emit_fa3.blocks_per_sm(forced.spec) == 2 and "@launch_bounds(128, 2)" in forced.source
    # two warpgroups of 128 rows (256 threads): one block, not three blocks of 85 registers a thread
    import dataclasses

    wide = dataclasses.replace(k64.spec, block_q=256)
    assert emit_fa3.threads_per_block(wide) == 256 and emit_fa3.blocks_per_sm(wide) == 1


def test_specialized_kernel_falls_back_to_wgmma(hopper) -> None:
    """A spec the warp-specialized kernel refuses (4 stages of 128 x 128 at D = 128 exceed shared memory) is
    built by the non-specialized wgmma kernel, not by mma.sync and not as an error."""
    c = fl.compile(_graph(True), extra={"stages": 4})
    s = _spec(c, 128)
    assert s.extra["schedule"] == "wgmma" and s.extra["overlap"] and s.extra["stages"] == 4


def test_fallback_from_the_specialized_kernel_keeps_64_rows_on_wide_tiles(hopper) -> None:
    """The bias table at D = 64 takes the warp-specialized kernel on 128 x 128 tiles; where that kernel refuses the
    spec (stages past shared memory), the plain wgmma kernel on the same tiles keeps 64 rows a warpgroup: 128 rows
    would hold 256 accumulator registers a thread."""
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent.parent
    g = runpy.run_path(str(root / "examples" / "bias.py"))["graph"]
    s = _spec(fl.compile(g, extra={"stages": 6}), 64)
    assert s.extra["schedule"] == "wgmma" and "wg_rows" not in s.extra and (s.block_q, s.block_k) == (128, 128)
    assert emit_fa3.wide_rows_fit(128, 64, 64) and not emit_fa3.wide_rows_fit(128, 128, 64)
    assert not emit_fa3.wide_rows_fit(64, 64, 64)


def test_a_table_tile_takes_the_specialized_kernel_at_d64(hopper) -> None:
    """A score reading a [q, kv] tile of a table (bias[h, q, kv]) takes the warp-specialized kernel on 128 x 128
    tiles at D = 64 too, where it copies the tile into shared memory; a per-head table read along a diagonal
    (relative bias) does not."""
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent.parent
    assert emit_fa3.auto_extra("f16", 64, "none", (9, 0), {}, table_tile=True) == {"schedule": "wgmma-ws",
                                                                                  "producer": "none"}
    assert emit_fa3.tiles(64, "none", True) == (128, 128) and emit_fa3.tiles(64, "none", False) == (128, 64)
    for stem, ws in (("bias", True), ("relative_bias", False)):
        g = next(v for v in runpy.run_path(str(root / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))
        s = _spec(fl.compile(g), 64)
        assert (s.extra.get("schedule") == "wgmma-ws") == ws, (stem, s.extra)
        assert (s.block_q, s.block_k) == ((128, 128) if ws else (128, 64))


def test_rule_persistent_where_the_sm_count_is_known() -> None:
    """D = 128 without a table tile, on a GPU whose SM count the driver gave: the persistent producer-warpgroup
    kernel, one block an SM, items from the counter (under a block list with an 88-register producer); at D = 64
    the same kernel without a mask or under a static one (on 192-row tiles: three consumer warpgroups); table
    tiles, D = 64's block lists and tables and no SM count (the simulator) keep what they took."""
    rule = emit_fa3.auto_extra
    want = {"schedule": "wgmma-ws", "producer": "warpgroup", "item_order": "dynamic", "persistent": 132}
    for mask in ("none", "static"):
        assert rule("f16", 128, mask, (9, 0), {}, sm_count=132) == want
        assert rule("bf16", 128, mask, (9, 0), {}, sm_count=114) == {**want, "persistent": 114}
        assert rule("f16", 128, mask, (9, 0), {}, sm_count=None) == emit_fa3.WS_EXTRA
        assert rule("f16", 128, mask, (9, 0), {}, table_tile=True, sm_count=132) == emit_fa3.WS_EXTRA
    assert rule("f16", 128, "list", (9, 0), {}, sm_count=132) == want
    assert rule("f16", 128, "list", (9, 0), {}, sm_count=None) == emit_fa3.WS_EXTRA
    for mask in ("none", "static"):
        assert rule("f16", 64, mask, (9, 0), {}, sm_count=132) == want
        assert rule("f16", 64, mask, (9, 0), {}, sm_count=None)["schedule"] == "wgmma"
    for mask in ("list", "table"):  # a list's documents are data: short ones would lose on 192-row tiles
        assert rule("f16", 64, mask, (9, 0), {}, sm_count=132)["schedule"] == "wgmma"
    # a table tile under a static mask (bias[h, q, kv] and causal): three warpgroups refuse its prefetch, so it is
    # not offered (else every call size would key its own copy of the one kernel it falls back to)
    assert rule("f16", 64, "static", (9, 0), {}, table_tile=True, sm_count=132)["schedule"] == "wgmma"
    assert rule("f16", 64, "none", (9, 0), {}, table_tile=True, sm_count=132) == emit_fa3.WS_EXTRA
    assert emit_fa3.tiles(64, "static", persistent=True) == emit_fa3.WIDE_TILES == (192, 128)
    assert emit_fa3.tiles(128, "static", persistent=True) == (128, 128)
    assert rule("f16", 128, "none", (8, 0), {}, sm_count=132) is None
    assert rule("f16", 128, "none", (9, 0), {"FALOWER_WGMMA": "ws"}, sm_count=132) == emit_fa3.WS_EXTRA


def test_compile_takes_the_persistent_kernel_and_falls_back(hopper) -> None:
    """falower.compile with an SM count from the driver: the persistent kernel at D = 128 (its spec valid), one
    block an item where the caller's knobs make it invalid (early_loads splits the consumers' own loads), and
    the caller's own schedule untouched."""
    from falower.backends.numba_cuda import emit_fa3_ws

    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    for causal in (False, True):
        s = _spec(fl.compile(_graph(causal)), 128)
        assert s.extra == {**emit_fa3.PERSIST_EXTRA, "persistent": 132}, s.extra
        emit_fa3.validate_spec(s)
        assert emit_fa3_ws.uses_work_counter(s) and emit_fa3_ws.grid(s, 2, 3, 4096, 4096) == (132, 1, 1)
    s = _spec(fl.compile(_graph(True), extra={"early_loads": "10"}), 128)
    assert s.extra == {**emit_fa3.WS_EXTRA, "early_loads": "10"}, s.extra
    emit_fa3.validate_spec(s)
    hopper.setattr(runtime, "device_sm_count", lambda: None)
    assert _spec(fl.compile(_graph(True)), 64).extra["schedule"] == "wgmma"
    assert _spec(fl.compile(_graph(True), extra={"schedule": "wgmma-ws"}), 128).extra == {"schedule": "wgmma-ws"}


def test_compile_takes_the_persistent_kernel_under_a_block_list(hopper) -> None:
    """The document mask (a block list) through falower.compile with an SM count: the persistent producer kernel
    loading Q, K and V by TMA, its producer at 56 registers and the consumers at 224; without tma_loads the
    producer at 88 and the consumers at 208 (their list walk spilled at 120 / 192); the caller's own registers
    win."""
    import runpy
    from pathlib import Path

    from falower.backends.numba_cuda import emit_fa3_ws

    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    g = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "document.py"))["graph"]
    s = fl.compile(g).specialize("f16", D=128).spec
    assert s.block_mask == "list" and s.extra == {**emit_fa3.PERSIST_EXTRA, "persistent": 132}
    emit_fa3.validate_spec(s)
    assert emit_fa3_ws.tma_loads(s) and emit_fa3_ws.registers(s) == (56, 224) and emit_fa3_ws.uses_work_counter(s)
    rows = fl.compile(g, extra={"tma_loads": False}).specialize("f16", D=128).spec
    assert not emit_fa3_ws.tma_loads(rows) and emit_fa3_ws.registers(rows) == (88, 208)
    mine = fl.compile(g, extra={"producer_regs": 120}).specialize("f16", D=128).spec
    assert emit_fa3_ws.registers(mine) == (120, 192)


def test_compile_keeps_one_block_an_item_for_a_relative_bias_only_without_tma_loads(hopper) -> None:
    """A relative bias (a row pair's table entries read ahead of the waits) takes the persistent kernel where its
    producer loads by TMA (consumers at 224 registers: measured faster, emit_fa3_ws.persistent_pays), and stays on
    one block an item where the producer's threads copy (consumers at 192: spilled and slower); ALiBi, whose slope
    is a row's, is persistent either way."""
    import dataclasses
    import runpy
    from pathlib import Path

    from falower.backends.numba_cuda import emit_fa3_ws
    from falower.passes import NAMED_PIPELINES

    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    ex = Path(__file__).resolve().parents[2] / "examples"
    rel_g = runpy.run_path(str(ex / "relative_bias.py"))["graph"]
    rel = fl.compile(rel_g).specialize("f16", D=128).spec
    assert rel.extra.get("persistent") == 132 and emit_fa3_ws.gather_early(rel) and emit_fa3_ws.tma_loads(rel)
    assert emit_fa3_ws.persistent_pays(rel) and emit_fa3_ws.registers(rel) == (56, 224) and emit_fa3_ws.row_slice(rel)
    # its entries by pairs (slice_pairs): the consumers at 232, where the pairs' aligned registers spill in the kv
    # loop at 224; producer_regs still decides where given
    pairs = dataclasses.replace(rel, extra={**rel.extra, "slice_pairs": True})
    assert emit_fa3_ws.slice_pairs(pairs) and emit_fa3_ws.registers(pairs) == (40, 232)
    emit_fa3_ws.validate_spec(pairs)
    assert emit_fa3_ws.registers(dataclasses.replace(pairs, extra={**pairs.extra, "producer_regs": 56})) == (56, 224)
    copies = fl.compile(rel_g, extra={"tma_loads": False}).specialize("f16", D=128).spec
    assert copies.extra == {**emit_fa3.WS_EXTRA, "tma_loads": False}, copies.extra
    assert not emit_fa3_ws.persistent_pays(dataclasses.replace(rel, extra={**rel.extra, "tma_loads": False}))
    alibi = fl.compile(runpy.run_path(str(ex / "alibi.py"))["graph"]).specialize("f16", D=128).spec
    assert alibi.extra.get("persistent") == 132 and emit_fa3_ws.persistent_pays(alibi)
    # the caller's own persistence is the caller's: kept (the knobs win), not a silent fall back to mma.sync
    mine = {"producer": "warpgroup", "persistent": 66, "item_order": "dynamic"}
    own = fl.compile(rel_g, extra=mine).specialize("f16", D=128).spec
    assert own.extra == {"schedule": "wgmma-ws", **mine}, own.extra


def test_compile_puts_a_share_of_the_exponentials_on_the_fma_pipe_beside_tanh_approx(hopper) -> None:
    """A score with tanh.approx (a MUFU operation an element beside the exponential's) takes ex2_poly 8 on the D =
    128 kernel that loads by TMA (emit_fa3_ws.auto_ex2_poly, measured faster) and 4 on D = 64's 192-row tiles; the
    exact tanh, plain attention, D = 64's 128 x 64 tiles and the caller's own ex2_poly do not."""
    from falower.backends.numba_cuda import emit_fa3_ws
    from falower.backends.numba_cuda.emit_fa2 import ex2_poly_count

    hopper.setattr(runtime, "device_sm_count", lambda: 132)

    def softcap(approx: bool):
        return fl.attention(score_mod=lambda s, b, h, q, kv: 30.0 * fl.tanh(s / 30.0, approx=approx),
                            name=f"softcap_{approx}", dtype="f16")

    for dtype in ("f16", "bf16"):
        spec = fl.compile(softcap(True)).specialize(dtype, D=128).spec
        assert spec.extra.get("ex2_poly") == emit_fa3_ws.AUTO_EX2_POLY == ex2_poly_count(spec) == 8, spec.extra
        assert emit_fa3_ws.tma_loads(spec) and spec.extra.get("persistent") == 132
        assert f"{ex2_poly_count(spec)} of the row's 32 exponentials on the FMA pipe" in \
            fl.compile(softcap(True)).specialize(dtype, D=128).source
    wide = _spec(fl.compile(softcap(True)), 64)  # no sizes: the reference length's 192 x 128 tiles
    assert wide.block_q == 192 and wide.extra["ex2_poly"] == emit_fa3_ws.AUTO_EX2_POLY_WIDE == ex2_poly_count(wide) == 4
    narrow = fl.compile(softcap(True)).specialize("f16", D=64, M=512, N=512).spec
    assert narrow.block_q == 128 and "ex2_poly" not in narrow.extra
    assert "ex2_poly" not in _spec(fl.compile(softcap(False)), 64).extra
    assert "ex2_poly" not in _spec(fl.compile(softcap(False)), 128).extra
    assert "ex2_poly" not in _spec(fl.compile(_graph(False)), 128).extra
    assert _spec(fl.compile(softcap(True), extra={"ex2_poly": 0}), 128).extra["ex2_poly"] == 0
    # without TMA loads (the producer's threads copy) none
    assert "ex2_poly" not in _spec(fl.compile(softcap(True), extra={"tma_loads": False}), 128).extra


def test_kv_reverse_is_asked_for_and_mirrors_every_tile_position(hopper) -> None:
    """extra kv_reverse (off by default): the persistent producer kernel visits an item's kv tiles from kv_last
    down, its loop counter unchanged and each tile's position mirrored where one is read: the producer's TMA
    coordinate and the consumers' kv0 (their class and scores); refused under a block list or without TMA loads."""
    import runpy
    from pathlib import Path

    from falower.backends.numba_cuda import emit_fa3_ws
    from falower.passes import NAMED_PIPELINES

    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    ex = Path(__file__).resolve().parents[2] / "examples"
    alibi = runpy.run_path(str(ex / "alibi.py"))["graph"]
    assert not emit_fa3_ws.kv_reverse(fl.compile(alibi, extra={"kv_reverse": False}).specialize("f16", D=128).spec)
    kern = fl.compile(alibi, extra={"kv_reverse": True}).specialize("f16", D=128)
    assert emit_fa3_ws.kv_reverse(kern.spec) and kern.spec.extra.get("persistent") == 132
    src = kern.source
    assert src.count("(kv_first__") >= 2 and "kv0 = (kv_first" in src, src  # the consumers' kv0, mirrored
    producer = src[:src.index("SETMAXNREG_INC()")]
    assert "tma_load_4d(k_dst + 0, kmap_g, 0, (kv_first" in producer, producer[-3000:]
    assert "j = kv_first" in producer and "while j <= kv_last" in producer  # the loop itself unchanged
    copies = fl.compile(alibi, extra={"kv_reverse": True, "tma_loads": False}).specialize("f16", D=128).spec
    assert not emit_fa3_ws.kv_reverse(copies)
    doc = runpy.run_path(str(ex / "document.py"))["graph"]
    assert not emit_fa3_ws.kv_reverse(fl.compile(doc, extra={"kv_reverse": True}).specialize("f16", D=128).spec)


def test_kv_reverse_second_visits_every_tile_once_the_last_one_second(hopper) -> None:
    """extra kv_reverse "second": the positions tile_at gives for j = kv_first .. kv_last are a permutation of the
    range, kv_last - 1 first and kv_last second where the range has two tiles or more, then down to kv_first; the
    kernel reads that expression; an unknown value is refused by name."""
    import runpy
    from pathlib import Path

    from falower.backends.numba_cuda import emit_fa3_ws

    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    alibi = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "alibi.py"))["graph"]
    kern = fl.compile(alibi, extra={"kv_reverse": "second"}).specialize("f16", D=128)
    assert emit_fa3_ws.kv_reverse(kern.spec) and emit_fa3_ws.kv_last_second(kern.spec)
    expr = emit_fa3_ws.tile_at(kern.spec, "j")
    assert "else kv_last" in kern.source and "kv_last - 1 + j" in kern.source  # the producer's and consumers' j
    for first in range(0, 4):
        for last in range(first, first + 6):
            order = [eval(expr, {"j": j, "kv_first": first, "kv_last": last}) for j in range(first, last + 1)]
            assert sorted(order) == list(range(first, last + 1)), (first, last, order)
            want = [last] if last == first else [last - 1, last] + list(range(last - 2, first - 1, -1))
            assert order == want, (first, last, order)
    mirror = fl.compile(alibi, extra={"kv_reverse": True}).specialize("f16", D=128).spec
    assert not emit_fa3_ws.kv_last_second(mirror)
    expr = emit_fa3_ws.tile_at(mirror, "j")  # True: the plain mirror, kv_last first
    assert [eval(expr, {"j": j, "kv_first": 2, "kv_last": 6}) for j in range(2, 7)] == [6, 5, 4, 3, 2]
    # the automatic choice: "second" for ALiBi under causal (a column step, a walked range), shown in spec.extra;
    # not for causal alone, ALiBi without its mask, or where the kernel cannot take it (16-byte copies)
    assert fl.compile(alibi).specialize("f16", D=128).spec.extra["kv_reverse"] == "second"
    assert fl.compile(alibi).specialize("f16", D=64).spec.extra["kv_reverse"] == "second"  # 192-row tiles too
    hopper.setattr(runtime, "device_sm_count", lambda: None)
    assert "kv_reverse" not in fl.compile(alibi).specialize("f16", D=64).spec.extra  # not the persistent kernel
    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    ex = Path(__file__).resolve().parents[2] / "examples"
    causal = runpy.run_path(str(ex / "causal.py"))["graph"]
    assert "kv_reverse" not in fl.compile(causal).specialize("f16", D=128).spec.extra
    slopes = fl.capture("slopes", "f32", "H")
    unmasked = fl.attention(score_mod=lambda s, b, h, q, kv: s + slopes[h] * (kv - q), name="alibi_nomask")
    assert "kv_reverse" not in fl.compile(unmasked).specialize("f16", D=128).spec.extra
    assert "kv_reverse" not in fl.compile(alibi, extra={"tma_loads": False}).specialize("f16", D=128).spec.extra
    with pytest.raises(BackendError, match="kv_reverse is True, False or 'second'"):
        fl.compile(alibi, extra={"kv_reverse": "first"}).specialize("f16", D=128)


def test_d64_takes_192_row_tiles_where_the_work_allows(hopper) -> None:
    """At D = 64 with an SM count, falower.compile takes the persistent kernel on 192 x 128 tiles (three consumer
    warpgroups) without a mask or under a static one whose visited work those tiles do not grow past
    emit_fa3.WIDE_MIN_WORK_RATIO at N = 4k (plain, causal, a 1024 window, a relative bias through its runs of the
    table); a 48-wide window (0.60 as much work on 128 x 64 tiles), the document's block list (its documents'
    lengths are data) and a caller's own tiles keep emit_fa3's kernel; the compiled object shows the IR of the
    tiles it took."""
    import runpy
    from pathlib import Path

    from falower.backends.numba_cuda import emit_fa3_ws
    from falower.passes import NAMED_PIPELINES

    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    ex = Path(__file__).resolve().parents[2] / "examples"

    def example(stem: str) -> fl.Func:
        return next(v for v in runpy.run_path(str(ex / f"{stem}.py")).values() if isinstance(v, fl.Func))

    def window(w: int) -> fl.Func:
        return fl.attention(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < w), name=f"win{w}", dtype="f16")

    for g in (_graph(False), _graph(True), window(1024), example("prefix_lm"), example("gqa"),
              example("relative_bias")):
        c = fl.compile(g)
        kern = c.specialize("f16", D=64)
        s = kern.spec
        assert (s.block_q, s.block_k) == (192, 128) and emit_fa3_ws.consumer_wgs(s) == 3, (g.name, s.extra)
        assert {k: s.extra[k] for k in emit_fa3.PERSIST_EXTRA} == emit_fa3.PERSIST_EXTRA
        emit_fa3.validate_spec(s)
        assert c.lowered_of(kern) is not c.lowered and "192" in fl.print_func(c.lowered_of(kern))
    for g in (window(48), example("sliding_window"), example("document")):
        s = fl.compile(g).specialize("f16", D=64).spec
        assert (s.block_q, s.block_k) == (128, 64) and s.extra["schedule"] == "wgmma", (g.name, s.extra)
    # the caller's tiles: the two-warpgroup persistent kernel is not taken at D = 64 (emit_fa3_ws.persistent_pays)
    own = fl.compile(_graph(True), pipeline=NAMED_PIPELINES["fa2-fwd"].replace("tile{bq=128,bk=64}",
                                                                               "tile{bq=128,bk=128}"))
    s = own.specialize("f16", D=64).spec
    assert (s.block_q, s.block_k) == (128, 128) and s.extra["schedule"] == "wgmma", s.extra
    assert emit_fa3.wide_tiles_pay(0.85, 1.0) and not emit_fa3.wide_tiles_pay(0.84, 1.0)
    assert emit_fa3.wide_tiles_pay(1.0, 1.0, 1024) and not emit_fa3.wide_tiles_pay(1.0, 1.0, 960)


def test_d64_chooses_its_tiles_by_the_call_sizes(hopper) -> None:
    """The 192-row tiles are chosen per call from its sequence lengths (rounded up to multiples of 64, at most
    emit_fa3.WIDE_REFERENCE_N): causal keeps 128 x 64 at N = 256 and 512 (too few kv tiles an item), and takes
    192 x 128 from 1k, where with the short q tile first (tile{ragged_q=first}) the wider tiles visit 1.12x the
    work (1.33x with it last: measured 0.92 as fast there); plain from a kv length of 1k (at 512 its 0.889 work
    ratio ran 0.92 as fast: too few kv tiles an item). Both kernels live side by side in one compiled object, each
    built once; a size that gives no sequence lengths takes the reference's. (At most 64 query rows take decoding's
    64-row tiles, test_split_kv_kernel.py.)"""
    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    causal, plain = fl.compile(_graph(True)), fl.compile(_graph(False))

    def rows(c, n: int, m: int | None = None) -> int:
        return c.specialize("f16", D=64, M=n if m is None else m, N=n).spec.block_q

    assert [rows(causal, n) for n in (17, 256, 512, 1000, 1024, 1500, 4096, 65536)] == [64, 128, 128, 192, 192, 192,
                                                                                          192, 192]  # 17: decoding's
    assert [rows(plain, n) for n in (17, 256, 512, 960, 1000, 4096)] == [64, 128, 128, 128, 192, 192]
    assert rows(plain, 1000, m=256) == 128 and rows(plain, 256, m=4096) == 128  # M's padding; N's fixed costs
    assert rows(causal, 4096, m=640) == 128  # M's own bucket: causal rows of a short q over a long kv
    assert causal.specialize("f16", D=64).spec.block_q == 192  # no sizes: N = WIDE_REFERENCE_N
    a, b = causal.specialize("f16", D=64, M=500, N=500), causal.specialize("f16", D=64, M=510, N=510)
    assert a is b and a is not causal.specialize("f16", D=64, M=4096, N=4096)
    assert {k[-1] for k in causal._kernels} == {("tiles", "decode"), ("tiles", "narrow"), ("tiles", "wide")}
    # the caller's own schedule keeps one kernel for every size
    own = fl.compile(_graph(True), extra={"schedule": "wgmma"})
    assert own.specialize("f16", D=64, M=1000, N=1000) is own.specialize("f16", D=64, M=4096, N=4096)


def test_d64_takes_two_warpgroups_on_a_small_grid(hopper) -> None:
    """With the call's batch and heads known, D = 64's persistent kernel takes 128 x 128 tiles (two consumer
    warpgroups) where its q tiles finish before the 192-row ones would (emit_fa3.two_rounds_pay: B = 1, H = 8 at
    N = 1k-4k; causal only where they fit one round, to 2k); larger grids keep the 192-row tiles; lengths alone, or
    `small_grid: False`, keep them too; where the work rule says 128 x 64 (N = 512), that stands. (At N = 512-1k this
    grid now takes decoding's 64-row tiles, emit_fa3.decode_tiles_pay: the tiles beside them are read here with
    decode_tiles False.)"""
    from falower.backends.numba_cuda import emit_fa3_ws

    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    for causal in (False, True):
        c = fl.compile(_graph(causal))
        nodec = fl.compile(_graph(causal), extra={"decode_tiles": False})

        def spec(b: int, h: int, n: int, cc=c):
            return cc.specialize("f16", B=b, H=h, M=n, N=n, D=64).spec

        for n in (512, 1000, 1024):
            assert spec(1, 8, n).block_q == 64, (causal, n)
        for n in (1000, 1024, 2048) + (() if causal else (4096,)):
            s = spec(1, 8, n, nodec)
            assert (s.block_q, s.block_k) == emit_fa3.TWO_TILES and emit_fa3_ws.consumer_wgs(s) == 2, (causal, n)
            assert s.extra["persistent"] == 132 and s.extra["producer"] == "warpgroup"
            emit_fa3.validate_spec(s)
        for b, h, n in ((2, 16, 2048), (4, 16, 2048), (1, 32, 4096), (4, 32, 4096)) + (
                ((1, 8, 4096), (2, 8, 2048)) if causal else ()):  # causal: 256 q tiles of 128 rows, two rounds
            assert spec(b, h, n).block_q == 192, (causal, b, h, n)
        assert (spec(1, 8, 512, nodec).block_q, spec(1, 8, 512, nodec).block_k) == (128, 64)  # the work rule's
        assert c.specialize("f16", M=2048, N=2048, D=64).spec.block_q == 192  # no B, H: the lengths' answer
        kept = fl.compile(_graph(causal), extra={"small_grid": False})
        assert kept.specialize("f16", B=1, H=8, M=2048, N=2048, D=64).spec.block_q == 192
        # one kernel for the "two" tiling
        assert spec(1, 8, 2048) is (spec(1, 4, 4096) if causal else spec(1, 8, 4096))
    # GQA's heads are HKV * 4: counted through the expression
    gqa = fl.compile(fl.attention(name="gqa", group_size=4))
    assert gqa._heads({"B": 1, "HKV": 2, "M": 2048, "N": 2048, "D": 64}) == 8
    assert gqa.specialize("f16", B=1, HKV=2, M=2048, N=2048, D=64).spec.block_q == 128
    # a falsy small_grid keeps 192 rows; the caller's block count is the rounds' (128 causal q tiles: two rounds
    # of 66 blocks, under a mask not the small grid's)
    assert fl.compile(_graph(False), extra={"small_grid": 0}).specialize(
        "f16", B=1, H=8, M=2048, N=2048, D=64).spec.block_q == 192
    assert fl.compile(_graph(True), extra={"persistent": 66})._d64_tiling(
        "f16", "mma", {"B": 1, "H": 4, "M": 4096, "N": 4096, "D": 64}) == "wide"
    assert fl.compile(_graph(True))._d64_tiling("f16", "mma", {"B": 1, "H": 4, "M": 4096, "N": 4096, "D": 64}) == "two"
    # the rule: rounds of one item an SM, a 192-row round 1.2 rounds of 128-row items
    assert emit_fa3.two_rounds_pay(64, 48, 132) and emit_fa3.two_rounds_pay(256, 176, 132)
    assert not emit_fa3.two_rounds_pay(512, 352, 132) and not emit_fa3.two_rounds_pay(4096, 2816, 132)
    assert emit_fa3.two_rounds_pay(128, 88, 132, uniform=False) and not emit_fa3.two_rounds_pay(256, 176, 132, False)


def test_d64_small_grid_tiles_fall_back_to_192_rows(hopper) -> None:
    """Where the kernel builder refused the two-warpgroup tiles, the next try is the same persistent kernel on 192
    rows (not emit_fa3's 128 x 64): a refusal stands in for a future knob the 128-row form cannot take."""
    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    real = emit_fa3.validate_spec

    def refuse_two(spec):
        if spec.head_dim == 64 and spec.block_q == 128 and spec.extra.get("persistent"):
            raise ValueError("refused for the test")
        return real(spec)

    hopper.setattr(emit_fa3, "validate_spec", refuse_two)
    s = fl.compile(_graph(False)).specialize("f16", B=1, H=8, M=2048, N=2048, D=64).spec
    assert (s.block_q, s.block_k) == (192, 128) and s.extra["persistent"] == 132


def test_the_compile_line_names_tiles_and_schedule(hopper) -> None:
    """The progress line of a slow build names the kernel's tiles and schedule, so a user sees which of D = 64's two
    kernels a call's sizes built."""
    from falower.backends.numba_cuda.runtime import _label

    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    c = fl.compile(_graph(True))
    wide, narrow = (c.specialize("f16", D=64, M=n, N=n).spec for n in (4096, 500))
    assert _label(wide, "forward").endswith("(forward, f16, D=64, 192x128 wgmma-ws, short q tile first)")
    assert _label(narrow, "forward").endswith("(forward, f16, D=64, 128x64 wgmma)")


def test_the_short_q_tile_goes_first_where_the_cost_model_counts_less_work(hopper) -> None:
    """tile{ragged_q=first} on the persistent kernel's tiles where it visits less work (`_ragged_first_pays`):
    causal-like masks on D = 64's 192 x 128 tiles (the lowered IR the kernel came from says so, q_pad in its dump);
    not plain (the same work), not D = 128's 128 x 128 (the diagonal then crosses each q tile's kv tiles: the same
    work), not the 128 x 64 kernel; a caller's knob the kernel cannot start q tiles before row 0 with (no TMA
    stores) keeps the last tile short on the same persistent kernel, not a slower fallback."""
    from falower.ir import print_func

    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    causal, plain = fl.compile(_graph(True)), fl.compile(_graph(False))
    k = causal.specialize("f16", D=64, M=4096, N=4096)
    assert k.spec.block_q == 192 and k.spec.ragged_q_first
    assert "%q_pad = const cdiv(M, 192)*192-M" in print_func(causal.lowered_of(k))
    assert "q_lo = (qt * 192 - ((M + 191) // 192 * 192 - M))" in k.source and "max(q_lo_hx, 0)" in k.source
    assert not plain.specialize("f16", D=64, M=4096, N=4096).spec.ragged_q_first
    assert not causal.specialize("f16", D=128, M=4000, N=4000).spec.ragged_q_first
    assert not causal.specialize("f16", D=64, M=500, N=500).spec.ragged_q_first  # 128 x 64
    own = fl.compile(_graph(True), extra={"tma_store": False})
    big = own.specialize("f16", D=64, M=4096, N=4096).spec
    assert big.block_q == 192 and not big.ragged_q_first and big.extra.get("persistent") == 132, big.extra
    # ... and the per-size question counts the tiling that kernel runs: at 1k the last tile short is 1.33x 128 x 64's
    # work (the short tile first: 1.12x), so that caller keeps 128 x 64 there
    assert own.specialize("f16", D=64, M=1024, N=1024).spec.block_q == 128
    assert causal.specialize("f16", D=64, M=1024, N=1024).spec.block_q == 192


def test_a_pipeline_with_the_short_q_tile_first(hopper) -> None:
    """The caller's own pipeline with tile{ragged_q=first}: the persistent wgmma-ws kernel takes it (Hopper); the
    plain wgmma kernel and mma.sync refuse it with one line naming the option (emit_fa3's validation, so the
    automatic choice's fallbacks skip it rather than fail later)."""
    import dataclasses

    from falower.backends.numba_cuda import emit_fa3

    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    own = ("decompose-softmax,canonicalize,fuse,tile{bq=192,bk=128,ragged_q=first},online-softmax{exp2=true},"
           "mask-tiles,canonicalize")
    spec = fl.compile(_graph(True), pipeline=own).specialize("f16", D=64, M=1000, N=1000).spec
    assert spec.ragged_q_first and spec.block_q == 192 and spec.extra.get("persistent") == 132, spec.extra
    # 128-row tiles at D = 64, where the automatic choice's persistence is measured slower (persistent_pays): only
    # the persistent kernel runs IR whose q tiles start before row 0, so it is kept, not refused by the fallbacks
    two = fl.compile(_graph(True), pipeline=own.replace("bq=192", "bq=128")).specialize("f16", D=64, M=1000, N=1000)
    assert two.spec.ragged_q_first and two.spec.block_q == 128 and two.spec.extra.get("persistent") == 132
    plain = dataclasses.replace(spec, block_q=128, block_k=64, extra={"schedule": "wgmma"})
    with pytest.raises(ValueError, match=r"tile\{ragged_q=first\}: only the persistent wgmma-ws kernel"):
        emit_fa3.validate_spec(plain)
    hopper.setattr(runtime, "device_cc", lambda: (8, 0))  # no Hopper: mma.sync, which refuses it
    with pytest.raises(Exception, match=r"tile\{ragged_q=first\}: only the persistent wgmma-ws kernel"):
        fl.compile(_graph(True), pipeline=own.replace("bq=192,bk=128", "bq=128,bk=64")).specialize(
            "f16", D=64, M=300, N=300)


def test_a_knob_the_choice_refuses_is_told_once(hopper, capsys) -> None:
    """Where the automatic choice's kernel refuses the caller's own forward knobs (col_mma needs a column step, which
    plain attention has not) and another kernel form is built, a one-line note on stderr says so, once for the
    compiled call; a knob the choice takes, a refusal that is the choice's own (no knob) and a change of form the
    choice makes for cost say nothing."""
    hopper.setattr(runtime, "device_sm_count", lambda: 132)
    c = fl.compile(_graph(False), extra={"col_mma": True})
    for n in (4096, 4096, 1024):
        assert c.specialize("f16", D=128, N=n, M=n).spec.extra["schedule"] == "wgmma"  # not the ws kernel
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "[falower] note:" in line]
    assert len(notes) == 1, err
    assert "refused extra {'col_mma': True}" in notes[0] and "col_mma" in notes[0].split(":", 2)[2], notes[0]
    assert "built the wgmma kernel instead" in notes[0], notes[0]
    c = fl.compile(_graph(True), extra={"tma_loads": False})  # D = 64 causal's 192-row kernel needs TMA loads
    c.specialize("f16", D=64, N=4096, M=4096)
    assert "three consumer warpgroups (block_q 192) need TMA loads" in capsys.readouterr().err
    for extra, Ds in (({}, (64, 128)), ({"col_mma": False}, (64, 128)), ({"tma_loads": False}, (128,))):
        c = fl.compile(_graph(True), extra=extra)
        for D in Ds:
            c.specialize("f16", D=D, N=4096, M=4096)
        assert "[falower] note:" not in capsys.readouterr().err, extra
