"""The epilogue through shared memory (emit_fa3._emit_staged_epilogue; emit_fa3_ws.staged_epilogue,
emit_fa3.staged_epilogue): which kernels take it, and what the emitted source does. The numbers are the
simulator's (test_fa3_ws_simulator.py and test_ws_range_walk_simulator.py run the no-producer kernel, and
test_fa3_simulator.py emit_fa3 at D = 64 with 64 and 128 rows a warpgroup, with ragged rows past M; reading the
chunks without their swizzle, checked by hand, puts O off by 2.8) and the GPU suite's."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

import falower as fl
from falower.backends.numba_cuda import emit_fa3_ws
from falower.backends.numba_cuda.from_ir import analyse, build_spec

ROOT = Path(__file__).resolve().parent.parent.parent


def _source(extra: dict, stem: str = "causal", D: int = 128) -> str:
    g = next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))
    spec = build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": D}, "f16", "mma", None,
                      {"schedule": "wgmma-ws", **extra})
    return emit_fa3_ws.emit_fa3_ws_forward(spec)


def _epilogue(src: str) -> str:
    return src[src.index("# epilogue:"):]


@pytest.mark.parametrize("D", [64, 128])
def test_the_no_producer_kernel_stages_O(D):
    """Both rows of a thread into the warpgroup's Q tile, one named barrier of its 128 threads, then D / 16
    16-byte chunks a thread, each read at its swizzled place and stored where its row is inside M."""
    src = _source({"producer": "none"}, D=D)
    epi = re.sub(r"\b(lr|qi|ch|c16)__\d+\b", r"\1", _epilogue(src))  # the SSA renamer's suffixes
    assert epi.count("stage_row(q_wg + lr * ") == 2 and "store_row(" not in epi
    assert "bar_sync(5 + cw, 128)" in epi
    assert f"for ei in range({D // 16}):" in epi
    assert "lds_v4_u32(q_wg + lr * " in epi and "((c16 ^ (lr & 7)) << 4)" in epi
    assert "if 0 <= qi < M:" in epi and "stg_v4_u32(o, " in epi
    stage = src[src.index("def stage_row("):]
    assert "sts_u32(sa + ((np.uint32(dn) ^ sw) << np.uint32(4)), v)" in stage  # the same swizzle on the way in


@pytest.mark.parametrize("extra", [{"producer": "none", "staged_epilogue": False},
                                   {"producer": "none", "persistent": 2},
                                   {"producer": "warp"}])
def test_the_other_kernels_store_from_the_fragments(extra):
    """The knob off, the persistent kernel (whose Q tile holds the next item's rows by then) and the kernels with
    a producer (whose Q tiles interleave the warpgroups' rows) keep store_row."""
    epi = _epilogue(_source(extra))
    assert "store_row(" in epi and "stg_v4_u32(" not in epi


def _fa3_source(extra: dict, D: int, stem: str = "causal") -> str:
    from falower.backends.numba_cuda import emit_fa3

    g = next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))
    spec = build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": D}, "f16", "mma", None, {"schedule": "wgmma", **extra})
    return emit_fa3.emit_fa3_forward(spec)


@pytest.mark.parametrize("wg_rows,halves", [(128, 2), (64, 1)])
def test_emit_fa3_stages_O_at_D64(wg_rows, halves):
    """emit_fa3 at D = 64 where asked (a warpgroup's rows of Q are one column block): every row of the thread
    staged (four with 128 rows a warpgroup), the block's barrier, then wg_rows * 8 / 128 chunks a thread."""
    epi = re.sub(r"\b(lr|qi|ch|c16)__\d+\b", r"\1",
                 _epilogue(_fa3_source({"wg_rows": wg_rows, "staged_epilogue": True}, 64)))
    assert epi.count("stage_row(q_wg + lr * ") == 2 * halves and "store_row(" not in epi
    assert "cuda.syncthreads()" in epi and f"for ei in range({wg_rows * 8 // 128}):" in epi
    assert f"qi = q_lo + wg * {wg_rows} + lr" in epi


def test_emit_fa3_stores_from_the_fragments_unless_asked():
    """emit_fa3 stages O only where asked (measured: no gain at D = 64), and never at D = 128, where a
    warpgroup's rows of Q are split over two column blocks."""
    assert "store_row(" in _epilogue(_fa3_source({"wg_rows": 128}, 64))
    epi = _epilogue(_fa3_source({"staged_epilogue": True}, 128))
    assert "store_row(" in epi and "stg_v4_u32(" not in epi


@pytest.mark.parametrize("D", [64, 128])
def test_the_warpgroup_barrier_comes_before_the_staged_rows(D):
    """At D = 128 a staged row of 256 bytes covers rows of the Q tile that other warps' parts of S read, so the
    warpgroup's barrier goes first (without it the slowed-warp simulator case reads o_err 0.75); at D = 64 a warp's
    staged rows are its own and no barrier is added. Building it at D = 128 without one is refused."""
    from falower.backends.numba_cuda.emit_fa2 import _Code, wgmma_thread_rows
    from falower.backends.numba_cuda.emit_fa3 import _emit_staged_epilogue

    src = _source({"producer": "none"}, D=D)
    free = "its Q tile is free"
    if D == 64:
        assert free not in src
        return
    assert src.count(free) == 1 and src.index(free) < src.index("# epilogue:") < src.index("stage_row(q_wg")
    with pytest.raises(ValueError, match="needs the warpgroup's barrier"):
        _emit_staged_epilogue(_Code(), D, "pack_f16x2", wgmma_thread_rows(), 64, "q_lo", "tid & 127",
                              "bar_sync(5, 128)")
