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


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("extra", [{}, {"persistent": 5, "item_order": "dynamic"}], ids=["one-item", "persistent"])
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
        assert re.search(rf"copy_rows_\d+\([^\n]*{arr}_at \+ np\.uint64\(j \* 128\) \* {arr}_rb, {arr}_rs\)", loop), arr
    assert loop.count("if j * 128 + 128 <= N:") == 2  # K's and V's copies each take the test
    assert loop.count("load_swz_rows_") == 2  # ... and fall back to the index path on the ragged tile only
    assert "load_swz_rows_" in body[:body.index("while j <= kv_last:")]  # Q keeps the index path


def test_producer_warp_keeps_its_lane_layout():
    """The one-warp producer copies by its own lane layout (`_emit_load_warp`): no kept addresses there."""
    spec = dataclasses.replace(make_spec("causal", 128, block_q=128, block_k=128, num_warps=8),
                               extra={"schedule": "wgmma-ws", "producer": "warp"})
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    assert "k_at = elem_addr" not in src and "pw_g = " in src


def test_persistent_producer_walks_each_items_block_list():
    """A block list (the document mask) on the persistent kernel with the producer warpgroup: the producer reads
    each item's list (its count, then entry after entry, a tile ahead of the copies) as it loads, the consumers
    walk the same list for the tiles' classes, and an item with no entry loads no K / V. Correct on the H100
    (test_document_mask_gpu.py) and in the simulator (test_ws_persistent_simulator.py's document case, an
    all-padding item among its items); the automatic choice at D = 128 with an 88-register producer
    (test_wgmma_select.py)."""
    import runpy

    import falower as fl

    ex = Path(__file__).resolve().parents[2] / "examples"
    g = runpy.run_path(str(ex / "document.py"))["graph"]
    extra = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 5, "item_order": "dynamic"}
    kern = fl.compile(g, extra=extra).specialize("f16", D=128)
    spec = kern.spec
    assert spec.block_mask == "list" and emit_fa3_ws.uses_work_counter(spec)
    emit_fa3_ws.validate_spec(spec)
    body = _producer_body(kern.source)
    item = body[body.index("while True:"):]
    assert re.search(r"^\s*kv_n = \w+\[kv_row\]", item, re.M) and "kv_pos = 0" in item  # each item's list, anew
    loop = item[item.index("while j <= kv_last:"):]
    assert "kv_cur = " in item[:item.index("while j <= kv_last:")]  # the first two entries read before the loop
    # entry after entry, each read a tile ahead of its copies; each tile's K and V copied
    assert re.search(r"kv_nx = \w+\[kv_at\]", loop) and "copy_rows_" in loop
    assert "kv_last = (" in item and "if kv_n > 0 else -1" in item  # an empty list: the loop does not run
