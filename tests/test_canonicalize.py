"""canonicalize keeps the IR's meaning: constant folding evaluates as the float64 reference does."""

from __future__ import annotations

import math

import numpy as np

import falower as fl
from falower.ir import interpret, new_func
from falower.ir.types import tensor


def _scaled(c1: float, c2: float):
    f, b, (x,) = new_func("k", [("x", tensor("f32", "N"))])
    k = b.emit("mul", b.const(c1, tensor("f32")), b.const(c2, tensor("f32")))
    b.ret(b.emit("mul", x, k))
    return f


def test_folding_keeps_the_float64_meaning() -> None:
    # 0.1 * log2(e) folded in float32 was 0.14426951110363007, 5e-8 relative off the float64 product; the LSE of
    # an ALiBi x exp2 forward moved by 1.3e-7 and --check (tolerance 1e-7) failed after canonicalize.
    f = _scaled(0.1, 1 / math.log(2))
    g = fl.run_pipeline(f, "canonicalize")
    assert sum(op.name == "mul" for op in g.walk()) == 1  # the constants' product was folded
    x = np.array([1.0, -3.0, 1e3])
    (want,) = interpret(f, [x], "f64")
    (got,) = interpret(g, [x], "f64")
    np.testing.assert_array_equal(got, want)
    # the native interpreter rounds the folded constant to float32 at its use: within an ulp of the product
    (nat_want,) = interpret(f, [x], "native")
    (nat_got,) = interpret(g, [x], "native")
    np.testing.assert_allclose(nat_got, nat_want, rtol=2.5e-7)
