"""A traced mod means what the user's Python means (a review's findings, each failing before its fix): constant
indices counted from the end, bool with i8 promoted to i8, integer powers kept integers, logical ops with Python
scalars, torch's NaN-ignoring fmax / fmin refused, a score_mod that ignores the score refused, and one-line errors
(not bare TypeErrors) for the operators and methods a tracer cannot or does not take."""

from __future__ import annotations

import math

import numpy as np
import pytest

import falower as fl
from falower.errors import FalowerError
from falower.ir import interpret

I = fl.tensor("i32", "N")


def test_a_negative_constant_index_counts_from_the_end() -> None:
    bias = fl.capture("bias", "f32", "K")
    g = fl.trace(lambda i: bias[-1] + i * 0.0, name="g", i=I)
    (y,) = interpret(g, [np.zeros(2, np.int32), np.array([10.0, 20.0, 30.0], np.float32)])
    np.testing.assert_array_equal(y, [30.0, 30.0])  # Python's bias[-1]; the clamp gave bias[0]
    t2 = fl.capture("t2", "f32", "R,K")
    g = fl.trace(lambda i: t2[-1][i] + t2[i % 2, -2], name="g2", i=I)
    t = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    i = np.arange(3, dtype=np.int32)
    (y,) = interpret(g, [i, t])
    np.testing.assert_array_equal(y, t[-1][i] + t[i % 2, -2])


def test_a_constant_index_past_a_known_extent_is_refused() -> None:
    tab = fl.capture("tab", "f32", [3])
    with pytest.raises(FalowerError, match="index 3 is out of range for axis 0 of size 3"):
        fl.trace(lambda i: tab[3] + i * 0.0, name="g", i=I)
    g = fl.trace(lambda i: tab[np.int64(-3)] + i * 0.0, name="g", i=I)  # a numpy int index is a Python int
    (y,) = interpret(g, [np.zeros(1, np.int32), np.array([1.0, 2.0, 3.0], np.float32)])
    assert y[0] == 1.0


@pytest.mark.parametrize("expr", ["(i >= 1) == f[i]", "f[i] == (i >= 1)", "(i >= 1) | f[i]", "f[i] & (i >= 1)",
                                  "(i >= 1) ^ f[i]"])
def test_bool_with_i8_is_i8_in_either_order(expr: str) -> None:
    f = fl.capture("f", "i8", "N")
    g = fl.trace(lambda i: eval(expr, {"f": f, "i": i}), name="g", i=I)
    i, flags = np.array([0, 1, 2], np.int32), np.array([0, 2, 1], np.int8)
    (y,) = interpret(g, [i, flags])
    want = eval(expr, {"f": flags, "i": i})
    np.testing.assert_array_equal(np.asarray(y, np.int64), np.asarray(want, np.int64))


def test_an_integer_to_a_constant_power_stays_an_integer() -> None:
    g = fl.trace(lambda d: (d ** 2 <= 16785408) & (d ** 0 == 1) & (d.pow(3) == d * d * d), name="g", d=I)
    d = np.array([4096, 4097, -3], np.int32)
    for precision in ("f64", "native"):
        (y,) = interpret(g, [d], precision=precision)
        np.testing.assert_array_equal(y, [True, False, True])  # f32's 4097 ** 2 rounded to 16785408
    assert not any(op.name == "pow" for op in g.walk())
    tab = fl.capture("tab", "f32", "K")
    fl.trace(lambda i: tab[i ** 2 % 3], name="g3", i=I)  # an integer index, not 'gather indices must be integers'


def test_logical_ops_take_python_scalars_as_truth_values() -> None:
    i = np.array([0, -1], np.int32)
    g = fl.trace(lambda x: (x >= 0).logical_and(2), name="g", x=I)
    np.testing.assert_array_equal(interpret(g, [i])[0], [True, False])
    g = fl.trace(lambda x: (x >= 0).logical_or(0), name="g", x=I)
    np.testing.assert_array_equal(interpret(g, [i])[0], [True, False])


def test_torch_fmax_fmin_are_refused_not_mapped_to_maximum() -> None:
    from falower.torch_mods import _TORCH_IMPLS

    for name in ("fmax", "fmin"):
        with pytest.raises(FalowerError, match=f"torch.{name} ignores NaN"):
            fl.trace(lambda x, y: _TORCH_IMPLS[name](x, y), name="g", x=fl.tensor("f32", "N"),
                     y=fl.tensor("f32", "N"))


@pytest.mark.parametrize("mod", [lambda s, b, h, q, kv: kv * 0.5, lambda s, b, h, q, kv: s.new_zeros(()),
                                 lambda s, b, h, q, kv: (q - kv) * 1.0])
def test_a_score_mod_that_ignores_the_score_is_refused_in_words(mod) -> None:
    with pytest.raises(FalowerError, match=r"score_mod must return a score per \(b, h, q_idx, kv_idx\)"):
        fl.attention(score_mod=mod)


def test_reflected_shifts_divmod_pos_and_torch_methods_trace() -> None:
    g = fl.trace(lambda x: (1 << (x & 3)) + (256 >> (x & 3)) + (+x) + divmod(x, 4)[0] + divmod(7, x | 1)[1]
                 + x.add(2).sub(1, alpha=2).mul(3).remainder(5).floor_divide(2) + x.div(2, rounding_mode="floor")
                 + x.eq(1).int() + x.ge(0).bitwise_and(x.lt(5)).int() + x.neg().relu() + x.sgn(), name="g", x=I)
    x = np.array([-7, -1, 0, 1, 2, 3, 9], np.int32)
    (y,) = interpret(g, [x])
    want = [(1 << (v & 3)) + (256 >> (v & 3)) + v + v // 4 + 7 % (v | 1) + (((v + 2 - 2) * 3) % 5) // 2 + v // 2
            + int(v == 1) + int(0 <= v < 5) + max(-v, 0) + int(np.sign(v)) for v in x.tolist()]
    np.testing.assert_array_equal(y, want)
    w = fl.capture("w", "i32", "")
    g = fl.trace(lambda x: (w << 1) + (+w) - x, name="gw", x=I)
    np.testing.assert_array_equal(interpret(g, [x, np.int32(5)])[0], 15 - x)


@pytest.mark.parametrize("body,words", [
    (lambda x: math.trunc(x), "math.trunc cannot take a traced tensor"),
    (lambda x: [0.0, 1.0][x], "cannot be a Python int"),
    (lambda x: x.item(), "no method 'item'"),
    (lambda x: x.to("f32") // 2.0, "// and % take integers"),
    (lambda x: x.to("f32") % 2.0, "// and % take integers"),
    (lambda x: 0 <= x < 5, "chained comparison"),
    (lambda x: x * math.log(2.0) + math.exp(x), "one of math.log, math.exp on this line"),
])
def test_what_a_tracer_cannot_take_is_one_line_in_words(body, words: str) -> None:
    with pytest.raises(FalowerError, match=words):
        fl.trace(body, name="g", x=I)


def test_setitem_is_refused_in_words() -> None:
    def body(x):
        x[x > 0] = 0
        return x
    with pytest.raises(FalowerError, match="immutable"):
        fl.trace(body, name="g", x=I)


def test_hasattr_still_reads_a_missing_method_as_absent() -> None:
    seen = {}

    def body(x):
        seen["has"] = hasattr(x, "index_fill"), hasattr(x, "__array_interface__")
        return x + 1
    fl.trace(body, name="g", x=I)
    assert seen["has"] == (False, False)


def test_a_mask_made_an_integer_by_an_i8_operand_says_so() -> None:
    keep = fl.capture("keep", "i8", "B,N")
    with pytest.raises(FalowerError, match="mask_mod must return a bool tensor, not i8: compare it"):
        fl.attention(mask_mod=lambda b, h, q, kv: (q >= kv) & keep[b, kv])
    fl.attention(mask_mod=lambda b, h, q, kv: (q >= kv) & (keep[b, kv] != 0))  # as the message says


def test_a_partly_indexed_rows_ndim_says_to_index_it_fully() -> None:
    """`T[d].ndim` raised inside the property (the row has no value yet), which the missing-method error then called
    'no method ndim'; it now says what its shape says."""
    t = fl.capture("T", "f32", "R,K")
    with pytest.raises(FalowerError, match="index it fully"):
        fl.trace(lambda d: t[d].ndim + d, name="g", d=I)


QKV = dict(q=fl.tensor("f16", "B,H,M,D"), k=fl.tensor("f16", "B,H,N,D"), v=fl.tensor("f16", "B,H,N,D"))


@pytest.mark.parametrize("form", ["q.shape[-1] ** -0.5", "1 / q.shape[-1] ** 0.5"])
def test_the_scale_written_from_a_symbolic_head_dim_traces(form: str) -> None:
    """`s * q.shape[-1] ** -0.5` raised a bare TypeError (a Dim had no ** or /): a symbolic size in float arithmetic is a
    traced f32 scalar while tracing, a number when the size is constant; the graph lowers and means the same."""
    from falower.passes.check import Reference

    g = fl.trace(lambda q, k, v: (fl.softmax(q @ k.mT * eval(form, {"q": q}), -1) @ v).to("f16"), name="scaled",
                 result_names=("o",), **QKV)
    fl.lower(g, "fa2-fwd")
    r = Reference.build(g, {"B": 1, "H": 2, "M": 9, "N": 11, "D": 16})
    q, k, v = r.inputs
    s = q @ np.swapaxes(k, -1, -2) / 4.0
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(r.outputs["o"], (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-12)


def test_a_symbolic_size_where_a_number_is_needed_says_so() -> None:
    with pytest.raises(FalowerError, match=r"the size D is symbolic and float\(\) needs its value"):
        fl.trace(lambda q, k, v: (fl.softmax(q @ k.mT / math.sqrt(q.shape[-1]), -1) @ v), name="g", **QKV)
    assert math.sqrt(fl.ir.dim(64)) == 8.0 and fl.ir.dim(64) ** -0.5 == 0.125


def test_masked_fill_is_a_where() -> None:
    g = fl.trace(lambda x: x.to("f32").masked_fill(x > 2, float("-inf")), name="mf", x=I)
    (y,) = interpret(g, [np.arange(5, dtype=np.int32)])
    np.testing.assert_array_equal(y, [0.0, 1.0, 2.0, -np.inf, -np.inf])


def test_squeeze_unsqueeze_and_reductions_without_keepdim() -> None:
    """torch's squeeze / unsqueeze and keepdim=False (a one-line 'no method squeeze' before) mean what torch's do; a
    squeeze of a dim that is not 1 and an unsqueeze past the rank are refused in one line."""
    X = fl.tensor("f32", "M,N")
    g = fl.trace(lambda x: (x - x.amax(-1, keepdim=False).unsqueeze(1)).sum(dim=1, keepdim=False), name="g", x=X)
    x = np.random.default_rng(0).standard_normal((3, 5))
    (y,) = interpret(g, [x], "f64")
    np.testing.assert_allclose(y, (x - x.max(-1, keepdims=True)).sum(-1), rtol=1e-12)
    assert y.shape == (3,)
    g = fl.trace(lambda x: x.unsqueeze(0).unsqueeze(-1).squeeze(0).squeeze(2), name="g", x=X)
    (y,) = interpret(g, [x], "f64")
    np.testing.assert_array_equal(y, x)
    with pytest.raises(FalowerError, match=r"squeeze\(0\): dim 0 of f32\[M,N\] has the symbolic size M, which may "):
        fl.trace(lambda x: x.squeeze(0), name="g", x=X)
    g = fl.trace(lambda x: x.squeeze(-1) * 2.0, name="g", x=fl.tensor("f32", "M,4"))  # torch: a size-4 dim stays
    (y,) = interpret(g, [x[:, :4]], "f64")
    np.testing.assert_array_equal(y, 2 * x[:, :4])
    with pytest.raises(FalowerError, match="relu of a bool tensor"):
        fl.trace(lambda x: (x > 0).relu(), name="g", x=X)
    with pytest.raises(FalowerError, match=r"unsqueeze\(3\): dim is out of range for a tensor of rank 2 \(-3 to 2\)"):
        fl.trace(lambda x: x.unsqueeze(3), name="g", x=X)
