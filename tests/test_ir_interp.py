"""The reference interpreter: the definition of what ops mean, checked on small hand-made cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

import falower as fl
from falower.errors import ShapeError
from falower.ir import interpret, new_func, parse_func
from falower.ir.interp import round_bf16
from falower.ir.types import tensor


def test_softmax_of_a_fully_masked_row_is_zero() -> None:
    f, b, (x,) = new_func("sm", [("x", tensor("f32", "M", "N"))])
    b.ret(b.emit("softmax", x, axis=1))
    rows = np.array([[0.0, 1.0, 2.0], [-np.inf, -np.inf, -np.inf], [-np.inf, 0.0, -np.inf]])
    for precision in ("f64", "native"):
        (p,) = interpret(f, [rows], precision)
        assert not np.isnan(p).any()
        np.testing.assert_array_equal(p[1], 0.0)
        np.testing.assert_array_equal(p[2], [0.0, 1.0, 0.0])
        np.testing.assert_allclose(p[0], np.exp([0, 1, 2]) / np.exp([0, 1, 2]).sum(), rtol=1e-6)


def test_decomposed_softmax_of_a_fully_masked_row_is_zero() -> None:
    f, b, (x,) = new_func("sm", [("x", tensor("f32", "M", "N"))])
    b.ret(b.emit("softmax", x, axis=1))
    g = fl.run_pipeline(f, "decompose-softmax,canonicalize")
    (p,) = interpret(g, [np.full((2, 4), -np.inf)], "native")
    np.testing.assert_array_equal(p, 0.0)


def test_gather_clamps_indices() -> None:
    f, b, (t, i) = new_func("g", [("t", tensor("f32", "N")), ("i", tensor("i32", "K"))])
    b.ret(b.emit("gather", t, i))
    (out,) = interpret(f, [np.array([10.0, 20.0, 30.0]), np.array([-5, 0, 1, 2, 3, 99], dtype=np.int32)])
    np.testing.assert_array_equal(out, [10, 10, 20, 30, 30, 30])


def test_gather_broadcasts_indices() -> None:
    f, b, (t, i, j) = new_func("g", [("t", tensor("f32", "H", "N")), ("i", tensor("i32", "H", 1)),
                                     ("j", tensor("i32", 1, "K"))])
    b.ret(b.emit("gather", t, i, j))
    table = np.arange(6, dtype=np.float64).reshape(2, 3)
    (out,) = interpret(f, [table, np.array([[0], [1]], np.int32), np.array([[2, 0]], np.int32)])
    np.testing.assert_array_equal(out, [[2, 0], [5, 3]])


def test_bf16_rounding() -> None:
    one_ulp = 2.0 ** -7  # bf16 has 8 significant bits
    x = np.array([1.0, 1.0 + one_ulp / 2, 1.0 + one_ulp * 1.5, 1.0 + one_ulp * 0.75, 3.14159265, -2.0 ** -130, np.nan],
                 dtype=np.float32)
    r = round_bf16(x)
    assert r[0] == 1.0
    assert r[1] == 1.0  # a tie rounds to even
    assert r[2] == 1.0 + 2 * one_ulp  # a tie rounds to even (up)
    assert r[3] == 1.0 + one_ulp
    assert r[4] == np.float32(3.140625)
    assert np.isnan(r[6])
    assert np.all(r[:6].view(np.uint32) & 0xFFFF == 0)


def test_bf16_values_are_stored_rounded_in_native_precision() -> None:
    f, b, (x, y) = new_func("add", [("x", tensor("bf16", "N")), ("y", tensor("bf16", "N"))])
    b.ret(b.emit("add", x, y))
    xs, ys = np.array([1.0, 256.0]), np.array([2.0 ** -9, 1.0])
    (native,) = interpret(f, [xs, ys], "native")
    (exact,) = interpret(f, [xs, ys], "f64")
    np.testing.assert_array_equal(native, [1.0, 256.0])  # bf16 cannot hold 1 + 2^-9 nor 257
    np.testing.assert_array_equal(exact, [1.0 + 2.0 ** -9, 257.0])


def test_f16_native_rounds_and_f64_does_not() -> None:
    f, b, (x,) = new_func("id", [("x", tensor("f16", "N"))])
    b.ret(b.emit("mul", x, x))
    (native,) = interpret(f, [np.array([1.0 + 2.0 ** -11])], "native")
    assert native.dtype == np.float16
    (exact,) = interpret(f, [np.array([1.0 + 2.0 ** -11])], "f64")
    assert exact.dtype == np.float64 and exact[0] == (1.0 + 2.0 ** -11) ** 2


def test_native_f64_products_accumulate_in_f64() -> None:
    """A product of f64 matrices is exact to f64 rounding in native precision (it was summed in float32)."""
    f, b, (x, y) = new_func("mm", [("x", tensor("f64", "M", "K")), ("y", tensor("f64", "K", "N"))])
    b.ret(b.emit("matmul", x, y))
    rng = np.random.default_rng(0)
    xs, ys = rng.standard_normal((5, 33)), rng.standard_normal((33, 7))
    (native,) = interpret(f, [xs, ys], "native")
    assert native.dtype == np.float64
    np.testing.assert_allclose(native, xs @ ys, rtol=1e-14, atol=1e-14)


TILED = """func @tiled(%x: f32[M,4]) -> (out0: f32[M,4]) {
  %o = parallel_for (%i) in (cdiv(M, 8)) : f32[M,4] {
    %c8 = const 8 : i32
    %q0 = mul %i, %c8 : i32
    %t = tile.load %x[%q0 : 8, :] : f32[8,4]
    %one = const 1.0 : f32
    %t1 = add %t, %one : f32[8,4]
    tile.yield %t1 into [%q0 : 8, :]
  }
  return %o
}
"""


def test_tile_load_pads_ragged_tiles_with_zeros() -> None:
    g = parse_func(TILED)
    x = np.arange(13 * 4, dtype=np.float64).reshape(13, 4)
    (out,) = interpret(g, [x])
    np.testing.assert_array_equal(out, x + 1)  # 13 rows: the second tile is ragged (5 of 8 rows)

    # the padding itself: yield the ragged tile whole into a result with room for every tile row
    text = TILED.replace("-> (out0: f32[M,4])", "-> (out0: f32[cdiv(M, 8)*8,4])") \
        .replace(": f32[M,4] {", ": f32[cdiv(M, 8)*8,4] {")
    h = parse_func(text)
    (padded,) = interpret(h, [x])
    assert padded.shape == (16, 4)
    np.testing.assert_array_equal(padded[:13], x + 1)
    np.testing.assert_array_equal(padded[13:], 1.0)  # zero padding, plus one


def test_for_loop_carries_state() -> None:
    text = """func @sum(%x: f32[4]) -> (out0: f32[4]) {
  %lo = const 0 : i32
  %hi = const 5 : i32
  %r = for %k = %lo to %hi iter_args(%acc = %x) : f32[4] {
    %kf = cast %k {to = "f32"} : f32
    %n = add %acc, %kf : f32[4]
    yield %n
  }
  return %r
}
"""
    (out,) = interpret(parse_func(text), [np.zeros(4)])
    np.testing.assert_array_equal(out, 0 + 1 + 2 + 3 + 4)


def test_if_picks_a_branch() -> None:
    text = """func @pick(%c: bool, %x: f32[2]) -> (out0: f32[2]) {
  %r = if %c : f32[2] {
    yield %x
  } else {
    %n = neg %x : f32[2]
    yield %n
  }
  return %r
}
"""
    g = parse_func(text)
    x = np.array([1.0, -2.0])
    np.testing.assert_array_equal(interpret(g, [np.bool_(True), x])[0], x)
    np.testing.assert_array_equal(interpret(g, [np.bool_(False), x])[0], -x)


def test_integer_ops_and_casts() -> None:
    f, b, (x, y) = new_func("ints", [("x", tensor("i32", "N")), ("y", tensor("i32", "N"))])
    b.ret(b.emit("floordiv", x, y), b.emit("mod", x, y), b.emit("and", x, y), b.emit("cast", b.emit("neg", x), to="f32"))
    xs, ys = np.array([7, -7, 5], np.int32), np.array([2, 2, 3], np.int32)
    fd, md, an, cf = interpret(f, [xs, ys], "native")
    np.testing.assert_array_equal(fd, [3, -4, 1])
    np.testing.assert_array_equal(md, [1, 1, 2])
    np.testing.assert_array_equal(an, [2, 0, 1])  # bitwise on ints: -7 & 2 == 0
    assert cf.dtype == np.float32 and list(cf) == [-7.0, 7.0, -5.0]


def test_a_float_cast_to_an_integer_truncates_and_saturates() -> None:
    """cast's definition (ir/ops.py): toward zero, saturated to the type's range, NaN to 0, as PTX's cvt.rzi; numpy's
    own astype gave INT_MIN past the range on x86, which no kernel computes. i32 and i8, f32 and f64 sources."""
    xs = [3.7, -3.7, 3e9, -3e9, np.inf, -np.inf, np.nan, 2147483520.0, 300.0, -300.0, 127.9]
    for src in ("f32", "f64"):
        f, b, (x,) = new_func("c", [("x", tensor(src, "N"))])
        b.ret(b.emit("cast", x, to="i32"), b.emit("cast", x, to="i8"))
        i32, i8 = interpret(f, [np.array(xs, np.float32 if src == "f32" else np.float64)], "native")
        top, bottom = 2 ** 31 - 1, -2 ** 31
        assert list(i32) == [3, -3, top, bottom, top, bottom, 0, 2147483520, 300, -300, 127], (src, list(i32))
        assert list(i8) == [3, -3, 127, -128, 127, -128, 0, 127, 127, -128, 127], (src, list(i8))


def test_shapes_bind_from_inputs_and_mismatches_are_shape_errors() -> None:
    g = fl.attention(name="plain")
    q = np.zeros((1, 2, 3, 4))
    k = np.zeros((1, 2, 5, 4))
    (o,) = interpret(g, [q, k, k])
    assert o.shape == (1, 2, 3, 4)
    with pytest.raises(ShapeError, match="dimension D = 4 but the input has size 8"):
        interpret(g, [q, np.zeros((1, 2, 5, 8)), k])
    with pytest.raises(ShapeError, match="must have rank 4"):
        interpret(g, [q, k[0], k])
    with pytest.raises(ShapeError, match="takes 3 inputs"):
        interpret(g, [q, k])


def test_symbolic_constants_evaluate_with_the_bound_dims() -> None:
    f, b, (x,) = new_func("n", [("x", tensor("f32", "N"))])
    n = b.const(fl.ir.dim("N") * 2 - 1)
    b.ret(b.emit("cast", n, to="f32"))
    (out,) = interpret(f, [np.zeros(6)])
    assert float(out) == 11.0


def test_erf_and_sigmoid() -> None:
    f, b, (x,) = new_func("u", [("x", tensor("f64", "N"))])
    b.ret(b.emit("erf", x), b.emit("sigmoid", x))
    xs = np.array([-1.0, 0.0, 0.5])
    e, s = interpret(f, [xs])
    np.testing.assert_allclose(e, [math.erf(v) for v in xs])
    np.testing.assert_allclose(s, 1 / (1 + np.exp(-xs)))


# --------------------------------------------------------------------- the adjoints' ops (autodiff)
def test_scatter_add_adds_at_clamped_indices_and_repeats_add_up() -> None:
    """scatter_add is gather's adjoint: np.add.at with gather's clamping, updates broadcast with indices."""
    f, b, (t, u, i) = new_func("s", [("t", tensor("f32", "N")), ("u", tensor("f32", "K")), ("i", tensor("i32", "K"))])
    b.ret(b.emit("scatter_add", t, u, i))
    idx = np.array([-5, 0, 1, 2, 3, 99, 1], dtype=np.int32)
    upd = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    for precision in ("f64", "native"):
        (out,) = interpret(f, [np.array([100.0, 200.0, 300.0]), upd, idx], precision)
        np.testing.assert_array_equal(out, [100 + 1 + 2, 200 + 4 + 64, 300 + 8 + 16 + 32])


def test_scatter_add_broadcasts_updates_with_indices() -> None:
    f, b, (t, u, i, j) = new_func("s", [("t", tensor("f32", "H", "N")), ("u", tensor("f32", 1, 1)),
                                        ("i", tensor("i32", "H", 1)), ("j", tensor("i32", 1, "K"))])
    b.ret(b.emit("scatter_add", t, u, i, j))
    (out,) = interpret(f, [np.zeros((2, 3)), np.array([[1.5]]), np.array([[0], [1]], np.int32),
                           np.array([[2, 0, 2]], np.int32)])
    np.testing.assert_array_equal(out, [[1.5, 0, 3.0], [1.5, 0, 3.0]])


def test_group_sum_sums_consecutive_runs_and_undoes_repeat_interleave() -> None:
    f, b, (x,) = new_func("g", [("x", tensor("f32", "B", "HKV", "N"))])
    r = b.emit("repeat_interleave", x, axis=1, repeats=3)
    b.ret(b.emit("group_sum", r, axis=1, size=3), b.emit("group_sum", x, axis=2, size=2))
    assert str(f.results[0].type) == "f32[B,HKV,N]"  # (HKV*3) // 3 = HKV
    assert str(f.results[1].type) == "f32[B,HKV,fdiv(N, 2)]"
    x0 = np.arange(2 * 2 * 4, dtype=np.float64).reshape(2, 2, 4)
    s3, s2 = interpret(f, [x0])
    np.testing.assert_array_equal(s3, 3 * x0)
    np.testing.assert_array_equal(s2, x0[..., 0::2] + x0[..., 1::2])


def test_group_sum_refuses_a_size_that_does_not_divide() -> None:
    f, b, (x,) = new_func("g", [("x", tensor("f32", "N"))])
    b.ret(b.emit("group_sum", x, axis=0, size=2))
    with pytest.raises(ShapeError, match="not a multiple of 2"):
        interpret(f, [np.zeros(5)])


def test_unsqueeze_inserts_an_axis_squeeze_drops() -> None:
    f, b, (x,) = new_func("u", [("x", tensor("f32", "M", "N"))])
    u = b.emit("unsqueeze", x, axis=1)
    assert str(u.type) == "f32[M,1,N]"
    b.ret(u, b.emit("squeeze", u, axis=1))
    u0, s0 = interpret(f, [np.ones((2, 3))])
    assert u0.shape == (2, 1, 3) and s0.shape == (2, 3)


def test_consts_made_once_a_run_are_read_only_and_outputs_are_the_callers() -> None:
    """The interpreter makes a const or iota once a run (not on every pass through a loop) and read-only, so that
    an op writing into one in place raises instead of changing it for the next use; what a run returns is the
    caller's to write into, a const returned as is included."""
    from falower.ir.interp import Interpreter

    f, b, (x,) = new_func("c", [("x", tensor("f32", "N"))])
    c = b.const(2.0, tensor("f32", "N"))
    b.ret(b.emit("mul", x, c), c)
    it = Interpreter("f64")
    y, c0 = it.run(f, [np.arange(3.0)])
    np.testing.assert_array_equal(y, [0.0, 2.0, 4.0])
    c0[:] = 7.0  # the caller's copy
    assert not it._made[id(c.owner)][1].flags.writeable
    with pytest.raises(ValueError):
        it._made[id(c.owner)][1][0] = 1.0
    y, c1 = it.run(f, [np.arange(3.0)])
    np.testing.assert_array_equal(c1, 2.0)
    np.testing.assert_array_equal(y, [0.0, 2.0, 4.0])
