"""An item's last P V with the next item's first tile, its epilogue after that tile's softmax (emit_fa3_ws.
epilogue_in_s): where the persistent producer-warpgroup kernel takes it, and what its source then does. Emitted
sources only; the numbers are the simulator's (test_ws_persistent_simulator.py: items of 1, 2 and 3 tiles, an
item with no tile, an inf in one head's V that the next item must not inherit) and the GPU's."""

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

PERSIST = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 8, "item_order": "dynamic"}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _spec(extra=None, D=128):
    return dataclasses.replace(make_spec("causal", D, block_q=128, block_k=128, num_warps=8),
                               extra={**PERSIST, **(extra or {})})


def _consumer(src: str) -> str:
    return src[src.index("SETMAXNREG_INC()"):]


def _example_spec(stem: str, extra: dict):
    import falower as fl

    g = runpy.run_path(str(EXAMPLES / f"{stem}.py"))["graph"]
    return fl.compile(g, extra={**PERSIST, **extra}).specialize("f16", D=128).spec


def test_which_kernels_take_it():
    assert emit_fa3_ws.epilogue_in_s(_spec())  # the static masks' and plain's default kernel
    assert not emit_fa3_ws.epilogue_in_s(_spec({"epilogue_in_s": False}))  # '-noes'
    assert not emit_fa3_ws.epilogue_in_s(_spec({"staged_epilogue": False}))  # no O buffer to stage through
    assert not emit_fa3_ws.epilogue_in_s(_spec({"persistent": 0, "item_order": "grid"}))  # one block an item
    # a block list too (its walk 32-bit); not the softcap's two tanh paths (its consumers spill), unless asked
    doc = _example_spec("document", {"producer_regs": 88})
    assert doc.block_mask == "list" and emit_fa3_ws.epilogue_in_s(doc)
    assert not emit_fa3_ws.epilogue_in_s(_example_spec("softcap", {}))
    assert emit_fa3_ws.epilogue_in_s(_example_spec("softcap", {"epilogue_in_s": True}))
    assert emit_fa3_ws.epilogue_in_s(_example_spec("softcap", {"tanh_small": False}))


@pytest.mark.parametrize("D", [64, 128])
def test_the_item_end_keeps_its_last_p_v_for_the_next_item(D):
    src = _consumer(emit_fa3_ws.emit_fa3_ws_forward(_spec(D=D)))
    loop_at = src.index("while j <= kv_last")
    end = src.index("this thread is past the item's last S", loop_at)
    tail = src[end:src.index("if ep_pend:  # the block's last item")]
    # the item's end: the LSE (it needs no O) and 1 / l kept, no P V issued, no wait for one
    assert "lse[" in tail and "ep_f[ctid * 2 + 0] = inv" in tail and "ep_pend = True" in tail
    assert "pv_wgmma" not in tail and "WAIT_O" not in tail
    # O is zeroed before the item loop only; an item's first P V starts it (scale-d 0 while fresh)
    first_item = src.index("while True:")
    assert all(m.start() < first_item for m in re.finditer(r"acc\[i\] = ZERO", src))
    assert "pv_sd = 0 if fresh else 1" in src and re.search(r"pv_wgmma_sd\(acc, pa, [^\n]*, pv_sd\)", src)
    # the kept epilogue after the first tile's softmax and P's pack, before O's rescale; masked rows stage zeros
    body = src[loop_at:]
    kept = body.index("if ep_pend:  # the item before's epilogue")
    assert body.index("pack_pa(pa, sc)") < kept < body.index("scale_row(", kept)
    assert re.search(r"stage_row_z(_box)?\(|stage_rows_stsm\(", body[kept:])
    if "def stage_rows_stsm(" in src:  # by stmatrix (tma_store's default): a masked row's words are zeros too
        helper = src[src.index("def stage_rows_stsm("):]
        assert "if inv0 > ZERO else np.uint32(0)" in helper and "if inv1 > ZERO else np.uint32(0)" in helper


def test_off_it_is_the_kernel_before():
    src = emit_fa3_ws.emit_fa3_ws_forward(_spec({"epilogue_in_s": False}))
    assert "pv_sd" not in src and "ep_pend" not in src and "stage_row_z" not in src
    assert emit_fa3_ws.static_bytes(_spec()) - emit_fa3_ws.static_bytes(_spec({"epilogue_in_s": False})) == \
        emit_fa3_ws.kept_bytes(_spec()) == 2080
