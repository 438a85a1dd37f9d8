"""Tables read by column pairs and grids with the batch innermost (from_ir.pair_gathers, batch_shared_table):
which scores qualify, and what the emitted kernels do with them. The numbers are the simulator's
(test_compile_simulator.py: pairs-* cases; the warp-specialized kernel's bias case on the batch-inner grid) and
the GPU suite's (test_examples_gpu.py: an aligned and a misaligned table)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import numpy as np
import pytest

import falower as fl
from falower.backends.numba_cuda.emit_fa2 import emit_fa2_forward, grid
from falower.backends.numba_cuda.from_ir import analyse, build_spec

ROOT = Path(__file__).resolve().parent.parent.parent


def _spec(g, extra=None):
    return build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": 64}, "f16", "mma", None, extra)


def _example(stem: str):
    return next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))


@pytest.mark.parametrize("stem,pairs,inner", [("bias", True, True), ("relative_bias", False, True),
                                              ("alibi", False, False), ("document", False, False),
                                              ("plain", False, False), ("softcap", False, False)])
def test_which_examples_qualify(stem: str, pairs: bool, inner: bool) -> None:
    spec = _spec(_example(stem))
    assert ("def score_pair_fn(" in spec.device_source) == pairs
    assert spec.batch_inner == inner


def test_a_batch_axis_keeps_the_grid_and_still_pairs() -> None:
    bias = fl.capture("bias", "f32", "B,H,M,N")
    spec = _spec(fl.attention(score_mod=lambda s, b, h, q, kv: s + bias[b, h, q, kv], name="bias4"))
    assert "def score_pair_fn(" in spec.device_source and not spec.batch_inner


@pytest.mark.parametrize("index", ["shifted", "transposed", "offset_by_q", "i32"])
def test_what_does_not_pair(index: str) -> None:
    """Pairs need kv itself on the last axis, nothing else changing along the row, and an f32 table."""
    if index == "i32":
        tab = fl.capture("tab", "i32", "H,M,N")
        mod = lambda s, b, h, q, kv: s + tab[h, q, kv] * 0.5  # noqa: E731
    else:
        tab = fl.capture("tab", "f32", "H,M,N" if index != "transposed" else "H,N,M")
        mod = {"shifted": lambda s, b, h, q, kv: s + tab[h, q, kv + 1],
               "transposed": lambda s, b, h, q, kv: s + tab[h, kv, q],
               "offset_by_q": lambda s, b, h, q, kv: s + tab[h, q, q + kv]}[index]
    spec = _spec(fl.attention(score_mod=mod, name=f"probe_{index}"))
    assert "def score_pair_fn(" not in spec.device_source
    assert spec.batch_inner  # a per-element table with no batch axis all the same


def test_the_kernel_reads_pairs_once_per_row_check() -> None:
    """score_row branches on pairs_ok_fn once per row, then reads each pair by ld_pair; the grid and the block
    index put the batch innermost."""
    spec = _spec(_example("bias"))
    src = emit_fa2_forward(spec)
    row = src[src.index("def score_row("):src.index("def masked_score_row(")]
    assert row.count("pairs_ok_fn(") == 1 and "score_pair_fn(" in row and "score_raw_fn(" in row  # folded scale
    pair_fn = spec.device_source[spec.device_source.index("def score_pair_fn("):]
    pair_fn = pair_fn[:pair_fn.index("\n\n")]
    assert pair_fn.count("ld_pair(") == 1 and "cap_bias[" not in pair_fn
    assert "1.4426950" not in pair_fn  # x of x * log2(e): the factor goes into the exponent
    assert re.search(r"h = bh // B\n\s*b = bh - h \* B", src)
    simt = build_spec(analyse(fl.lower(_example("bias"), "fa2-fwd")), {"D": 64}, "f32", "simt", None)
    assert grid(simt, 3, 2, 100, 100) == (-(-100 // simt.block_q), 3, 2)  # (q tiles, B, H)


def test_ld_pair_reaches_an_8_byte_load() -> None:
    """The pair is one ld.global.v2.f32 in the PTX (NVVM, no GPU needed)."""
    pytest.importorskip("numba")
    c = fl.compile(_example("bias"), "numba-cuda")
    q = np.zeros((1, 2, 64, 64), np.float16)
    ptx = c.kernel(q, q, q, np.zeros((2, 64, 64), np.float32)).ptx(cc=(9, 0))
    assert re.search(r"ld\.global\.v2\.f32", ptx)


def _ws_spec(g, **extra):
    import dataclasses

    spec = _spec(g)
    return dataclasses.replace(spec, head_dim=128, block_q=128, block_k=128, num_warps=8,
                               extra={"schedule": "wgmma-ws", "producer": "none", **extra})


@pytest.mark.parametrize("which,tiles", [("bias", True), ("bias4", True), ("offset_by_q", False),
                                         ("relative_bias", False)])
def test_which_tables_copy_in_tiles(which: str, tiles: bool) -> None:
    """A [q, kv] tile of one table (q itself before kv, the axes before fixed for the program) copies into shared
    memory (from_ir.tile_gather: tile_ok_fn, tile_chunk_fn, score_pair_vals_fn)."""
    tab = fl.capture("tab", "f32", "B,H,M,N" if which == "bias4" else "H,M,N")
    g = {"bias": lambda: _example("bias"), "relative_bias": lambda: _example("relative_bias"),
         "bias4": lambda: fl.attention(score_mod=lambda s, b, h, q, kv: s + tab[b, h, q, kv], name="t4"),
         "offset_by_q": lambda: fl.attention(score_mod=lambda s, b, h, q, kv: s + tab[h, q, q + kv], name="tq")}[which]()
    src = _spec(g).device_source
    assert all((f"def {fn}(" in src) == tiles
               for fn in ("tile_ok_fn", "tile_chunk_fn", "tile_geom_fn", "score_pair_vals_fn"))


def test_the_ws_kernel_copies_the_tile_ahead() -> None:
    """The warp-specialized kernel (no producer) gives the table tile 64 KB of shared memory, which leaves 2 K / V
    stages at D = 128 and still fits; each warpgroup waits for its rows, reads them, releases them (a named
    barrier of its 128 threads) and copies the next tile's. `table_tiles: False` keeps the gathers."""
    from falower.backends.numba_cuda import emit_fa3_ws

    spec = _ws_spec(_example("bias"))
    assert emit_fa3_ws.table_tiles(spec) and emit_fa3_ws.stages(spec) == 2
    assert emit_fa3_ws.smem_bytes(spec) <= emit_fa3_ws.SMEM_LIMIT
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    loop = src[src.index("while j <= kv_last:", src.index("tile_on = tile_ok_fn(")):]
    for needle in ("mbar_wait(t_full, tphase)", "score_row_tile(", "bar_sync(3 + cw, 128)", "table_rows(",
                   "table_rows_at("):
        assert needle in loop, needle
    assert loop.index("mbar_wait(t_full") < loop.index("score_row_tile(") < loop.index("bar_sync(3 + cw, 128)")
    off = _ws_spec(_example("bias"), table_tiles=False)
    assert not emit_fa3_ws.table_tiles(off) and emit_fa3_ws.stages(off) == 3
    assert "score_row_tile(" not in emit_fa3_ws.emit_fa3_ws_forward(off).split("@kernel_jit")[1]
