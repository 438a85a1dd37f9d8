"""The scale folded into the exponent (emit_fa2.folded_scale): where the exp2 score is x * c with c > 0 (x = s for
plain attention and every mask-only variant, x = score_raw_fn for a bias or softcap), the tensor-core kernels keep
x, take the row max on it and exponentiate `ex2(fma(x, c, -m))`. Which variants qualify, and that the emitted
helpers say so; the numbers are the simulator's and the GPU suite's (every example through the same helpers)."""

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


@pytest.mark.parametrize("stem,folded,raw", [("plain", True, False), ("causal", True, False),
                                             ("document", True, False), ("sliding_window", True, False),
                                             ("prefix_lm", True, False), ("alibi", True, True),
                                             ("softcap", True, True), ("bias", True, True),
                                             ("relative_bias", True, True)])
def test_which_scores_fold(stem: str, folded: bool, raw: bool) -> None:
    spec = _spec(stem)
    got = folded_scale(spec)
    assert (got is not None) == folded, (stem, got)
    assert ("def score_raw_fn(" in spec.device_source) == raw
    src = emit_fa2_forward(spec)
    softmax = src[src.index("def softmax_row("):src.index("def scale_row(")]
    assert ("cuda.fma(" in softmax) == folded
    score_row = src[src.index("def score_row("):src.index("def masked_score_row(")]
    assert ("score_fn(" not in score_row) == folded  # x stays in the registers, never the scaled score
    step = "def score_col_fn(" in spec.device_source  # ALiBi: x by its column step (test_col_step.py)
    assert ("score_raw_fn(" in score_row) == (raw and not step)
    assert ("score_col_fn(" in score_row) == step


def test_the_simt_path_keeps_its_own_softmax() -> None:
    assert folded_scale(_spec("plain", "simt")) is None


def test_the_factor_is_the_scores_own() -> None:
    """score_fn == score_raw_fn * score_scale, evaluated in float64 on the emitted functions (softcap: tanh; ALiBi:
    x = s + d * (slope log2(e) / c), the slope through cta_fn), with cuda.fma as a * b + c."""
    import math
    import types

    import numpy as np

    from falower.backends.numba_cuda.intrinsics import tanh_ex2_steps

    rng = np.random.default_rng(0)
    for stem in ("softcap", "bias", "alibi", "relative_bias"):
        spec = _spec(stem)
        ns = {"np": np, "math": math, "cuda": types.SimpleNamespace(fma=lambda a, b, c: a * b + c),
              "tanh_ex2_f32": tanh_ex2_steps}
        exec(spec.device_source, ns)
        caps = {"bias": (rng.standard_normal((2, 8, 8)).astype(np.float32),),
                "alibi": (np.array([0.5, 0.25], np.float32),),
                "relative_bias": (rng.standard_normal((2, 15)).astype(np.float32), 8)}.get(stem, ())
        hz = (ns["cta_fn"](0, 1, *caps),) if "cta_fn" in ns else ()
        for s in (-3.0, 0.0, 0.5, 40.0):
            want = ns["score_fn"](np.float32(s), 0, 1, 6, 3, *caps, *hz)
            got = ns["score_raw_fn"](np.float32(s), 0, 1, 6, 3, *caps, *hz) * spec.score_scale
            assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want))), (stem, s, got, want)
