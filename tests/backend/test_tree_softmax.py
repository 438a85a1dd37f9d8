"""emit_fa2.tree_softmax: the row max and sum over four chains by default only where it was measured faster (the
warp-specialized kernel at D = 128 with plain attention's elementwise code: x = s, or ALiBi's column term carried in
S; at D = 64 ALiBi's alone), one chain elsewhere, and the caller's `extra["tree_softmax"]` over both. The numbers of the
four-chain form are the simulator's (fa3_sim_cases' tree-causal-f16-d64) and the GPU suite's (test_examples_gpu.py at
D = 128)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

import falower as fl
from falower.backends.numba_cuda import emit_fa3_ws
from falower.backends.numba_cuda.from_ir import analyse, build_spec

ROOT = Path(__file__).resolve().parent.parent.parent
WS = {"schedule": "wgmma-ws", "producer": "warpgroup", "item_order": "dynamic", "persistent": 132}


def _softmax_row(stem: str, D: int, **extra) -> str:
    g = next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))
    spec = build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": D}, "f16", "mma", None, {**WS, **extra})
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    start = src.index("def softmax_row(")
    return src[start:src.index("\n@", start)]


def _chains(softmax_row: str) -> int:
    """4 where the row max runs over the four-chain array `mq`, 1 where over one running `mx`."""
    tree = "mq = cuda.local.array(4, np.float32)" in softmax_row
    one = "mx = max(mx, lget(x, i + jj * 4))" in softmax_row
    assert tree != one, softmax_row
    return 4 if tree else 1


@pytest.mark.parametrize("stem, D, chains", [
    ("plain", 128, 4), ("causal", 128, 4), ("document", 128, 4), ("alibi", 128, 4),  # x = s; ALiBi's term in S
    ("relative_bias", 128, 1), ("softcap", 128, 1), ("bias", 128, 1),  # the score's own elementwise work
    ("plain", 64, 1), ("causal", 64, 1), ("alibi", 64, 4),  # D = 64: slower for all but ALiBi (+0.7%)
])
def test_the_default_takes_four_chains_where_it_was_faster(stem: str, D: int, chains: int) -> None:
    assert _chains(_softmax_row(stem, D)) == chains


def test_the_callers_extra_wins_and_alibi_without_its_product_keeps_one_chain() -> None:
    assert _chains(_softmax_row("plain", 128, tree_softmax=False)) == 1
    assert _chains(_softmax_row("relative_bias", 128, tree_softmax=True)) == 4
    assert _chains(_softmax_row("plain", 64, tree_softmax=True)) == 4
    assert _chains(_softmax_row("alibi", 128, col_mma=False)) == 1  # the FFMA an element: not plain's code
    assert _chains(_softmax_row("alibi", 64, col_mma=False)) == 1
    # where it was not measured: one block an item, or no producer warpgroup
    assert _chains(_softmax_row("plain", 128, persistent=0, item_order="grid")) == 1
    assert _chains(_softmax_row("plain", 128, producer="none", persistent=0, item_order="grid")) == 1
