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


def _ws(stem: str = "causal"):
    g = runpy.run_path(str(ROOT / "examples" / f"{stem}.py"))["graph"]
    spec = build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": 128}, "f16", "mma", None,
                      {"schedule": "wgmma-ws", "producer": "none"})
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
