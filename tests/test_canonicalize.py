"""canonicalize keeps the IR's meaning: constant folding evaluates as the float64 reference does."""

from __future__ import annotations

import math

import numpy as np
import pytest

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


# ------------------------------------------------------------------------------- random constant expressions
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

UNARY = ["exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "sin", "cos", "log1p", "expm1", "rsqrt", "neg",
         "abs", "floor", "round"]
BINARY = ["add", "sub", "mul", "max", "min", "div"]
_F32 = tensor("f32")


def _exprs():
    leaf = st.one_of(st.just(("x",)), st.floats(-8, 8, allow_nan=False, width=64).map(lambda v: ("c", v)))
    return st.recursive(leaf, lambda inner: st.one_of(
        st.tuples(st.sampled_from(UNARY), inner).map(lambda t: ("u", *t)),
        st.tuples(st.sampled_from(BINARY), inner, inner).map(lambda t: ("b", *t))), max_leaves=6)


def _build(tree):
    f, b, (x,) = new_func("k", [("x", tensor("f32", "N"))])

    def emit(t):
        if t[0] == "x":
            return x
        if t[0] == "c":
            return b.const(t[1], _F32)
        if t[0] == "u":
            return b.emit(t[1], emit(t[2]))
        return b.emit(t[1], emit(t[2]), emit(t[3]))

    y = emit(tree)
    if y.type.is_scalar:  # an expression of constants only: add the input so the result has x's shape
        y = b.emit("add", x, y)
    b.ret(y)
    return f


@settings(max_examples=60, deadline=None)
@given(tree=_exprs())
def test_canonicalize_keeps_every_expressions_float64_value(tree) -> None:
    """Whatever canonicalize folds, the float64 interpretation is the same numbers (NaN where NaN, inf where inf)."""
    f = _build(tree)
    g = fl.run_pipeline(f, "canonicalize")
    x = np.array([0.5, -1.25, 3.0, 0.0])
    with np.errstate(all="ignore"):
        (want,) = interpret(f, [x], "f64")
        (got,) = interpret(g, [x], "f64")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-13, atol=0)


@pytest.mark.parametrize("op, c", [("min", 7), ("max", -7), ("floordiv", 3), ("floordiv", 0), ("add", 5)])
def test_size_constants_fold_only_where_the_i32_op_is_the_expressions(op: str, c: int) -> None:
    """min / max / floordiv of a size constant that can leave i32 (N * 2^30 wraps to 0 at N = 4) are not the size
    expression's value (min(0, 7) is 0, min(N * 2^30, 7) is 7), and floordiv by 0 is 0 in the IR where a size
    expression's fdiv by 0 raised: canonicalize folds those no more; add still folds (wrapping commutes with it)."""
    from falower.ir.dims import dim
    from falower.ir.types import scalar

    def build():
        f, b, (x,) = new_func("f", [("x", tensor("f32", "N"))])
        y = b.emit(op, b.const(dim("N") * 2 ** 30, scalar("i32")), b.const(c, scalar("i32")))
        b.ret(b.emit("add", x, b.cast(y, "f32")))
        return f

    x = np.zeros(4)
    want = interpret(build(), [x])[0]
    got = interpret(fl.run_pipeline(build(), "canonicalize"), [x])[0]
    np.testing.assert_array_equal(got, want)
    folded = fl.run_pipeline(build(), "canonicalize")
    assert any(o.name == op and o.results[0].type.dtype == "i32" for o in folded.walk()) == (op != "add")


def test_adding_zero_keeps_negative_zero() -> None:
    """x + 0.0 is +0.0 at x = -0.0 (1 / x: inf, not -inf): canonicalize drops only + (-0.0), and x + 0 on ints."""
    f, b, (x,) = new_func("z", [("x", tensor("f32", "N"))])
    b.ret(b.emit("div", b.const(1.0, fl.ir.types.scalar("f32")), b.emit("add", x, b.const(0.0, fl.ir.types.scalar("f32")))))
    xs = np.array([-0.0, 2.0], np.float32)
    want = interpret(f, [xs], "native")[0]
    got = interpret(fl.run_pipeline(f, "canonicalize"), [xs], "native")[0]
    np.testing.assert_array_equal(got, want)
    assert want[0] == np.inf
