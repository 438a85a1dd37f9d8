"""The scale folded into the exponent (emit_fa2.folded_scale): where the score is nothing but `s * c`, the
tensor-core kernels keep raw s, take the row max on it and exponentiate `ex2(fma(s, c, -m))`. Which variants
qualify, and that the emitted helpers say so; the numbers are the simulator's and the GPU suite's (every
example through the same helpers)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

import falower as fl
from falower.backends.numba_cuda.emit_fa2 import emit_fa2_forward, folded_scale
from falower.backends.numba_cuda.from_ir import analyse, build_spec

ROOT = Path(__file__).resolve().parent.parent.parent


def _spec(stem: str, path: str = "mma"):
    g = next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))
    return build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": 64}, "f16" if path == "mma" else "f32", path, None)


@pytest.mark.parametrize("stem,folded", [("plain", True), ("causal", True), ("document", True),
                                         ("sliding_window", True), ("prefix_lm", True), ("alibi", False),
                                         ("softcap", False), ("bias", False), ("relative_bias", False)])
def test_which_scores_fold(stem: str, folded: bool) -> None:
    spec = _spec(stem)
    got = folded_scale(spec)
    assert (got is not None) == folded, (stem, got)
    src = emit_fa2_forward(spec)
    softmax = src[src.index("def softmax_row("):src.index("def scale_row(")]
    assert ("cuda.fma(" in softmax) == folded
    score_row = src[src.index("def score_row("):src.index("def masked_score_row(")]
    assert ("score_fn(" not in score_row) == folded  # raw scores stay in the registers


def test_the_simt_path_keeps_its_own_softmax() -> None:
    assert folded_scale(_spec("plain", "simt")) is None
