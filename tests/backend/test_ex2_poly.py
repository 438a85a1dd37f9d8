"""ex2_poly (intrinsics.py): 2**x on the FMA pipe, which softmax_row uses for spec.extra["ex2_poly"] of a row's
exponentials. Its float32 steps (ex2_poly_f32, the simulator's version) against float64 exp2 over the range the
softmax feeds it, the exact values the softmax relies on, and the PTX's constants against those steps'."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from falower.backends.numba_cuda import intrinsics as I

sys.path.insert(0, str(Path(__file__).resolve().parent))


def test_relative_error_over_the_softmax_range():
    rng = np.random.default_rng(0)
    # scores minus the row max: <= 0, and up to the lazy rescale's threshold (8) above it; f near +-1/2 too
    xs = np.concatenate([rng.uniform(-125, 8.5, 20000), np.arange(-125, 9) + 0.5, np.arange(-124, 9) - 0.4999])
    got = np.array([I.ex2_poly_f32(x) for x in xs.astype(np.float32)], dtype=np.float64)
    want = np.exp2(xs.astype(np.float32).astype(np.float64))
    assert np.max(np.abs(got / want - 1)) < 1.02e-4  # below f16's half ulp (2.4e-4): P is rounded to it
    # below 2**-125 (where MUFU's ex2.approx.ftz flushes to 0 from 2**-126): something in [0, 2**-124]
    tiny = np.array([I.ex2_poly_f32(x) for x in np.linspace(-127, -125, 401).astype(np.float32)], np.float64)
    assert np.all((tiny >= 0) & (tiny <= 2.0 ** -124))


@pytest.mark.parametrize("x, want", [(-np.inf, 0.0), (-127.0, 0.0), (-1e30, 0.0), (0.0, 1.0), (1.0, 2.0),
                                     (-1.0, 0.5), (8.0, 256.0), (-126.0, 2.0 ** -126)])
def test_exact_values(x, want):
    """A masked score (-inf, clamped to -127) gives exactly 0, so a fully masked row's sum stays 0 (O = 0,
    LSE = -inf); integers give their power of two exactly (the cubic's constant term is 1)."""
    assert I.ex2_poly_f32(np.float32(x)) == np.float32(want)


def test_ptx_constants_are_the_steps():
    ptx = I.EX2_POLY_PTX
    hexes = [int(h, 16) for h in re.findall(r"0f([0-9A-F]{8})", ptx)]
    as_f32 = [float(np.array([h], dtype=np.uint32).view(np.float32)[0]) for h in hexes]
    assert as_f32 == [-127.0, I.EX2_SHIFT, I.EX2_SHIFT, np.float32(I.EX2_POLY[2]), np.float32(I.EX2_POLY[1]),
                      np.float32(I.EX2_POLY[0]), 1.0]
    assert "add.rn.f32" in ptx and "sub.rn.f32" in ptx  # no contraction into an FMA: the shift must round
    assert "ex2" not in ptx.replace("ex2_poly", "")


def test_softmax_row_takes_the_count():
    """softmax_row writes ex2_poly for that many of a row's exponentials and refuses a count past the row."""
    import dataclasses

    from variants import make_spec

    from falower.backends.numba_cuda import emit_fa3

    spec = make_spec("causal", 64, "f16", path="mma", block_q=128, block_k=64, num_warps=4)
    for n in (0, 5, 16):
        src = emit_fa3.emit_fa3_forward(dataclasses.replace(spec, extra={"wg_rows": 128, "ex2_poly": n}))
        body = src[src.index("def softmax_row("):]
        body = body[:body.index("\n\n")]
        assert body.count("ex2_poly(") == n
        if n:  # written out: the rest by MUFU, and alpha's
            assert body.count(" ex2(") == 16 - n + 1
    with pytest.raises(ValueError, match="ex2_poly: 17"):
        emit_fa3.emit_fa3_forward(dataclasses.replace(spec, extra={"wg_rows": 128, "ex2_poly": 17}))
