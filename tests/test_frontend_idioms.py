"""Idioms peer code uses that the frontend must take (issue 7, item 3): torch's common unary maths, == and !=
between masks, a float raised to a traced tensor, rows of a 2-D capture, captured scalars, and a clear error
for Python's math functions on traced tensors."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import falower as fl
from falower.ir import interpret
from falower.passes import PassManager, parse_pipeline
from falower.passes.check import Reference
from falower.passes.cost import cost_of

SHAPES = {"B": 2, "H": 3, "M": 21, "N": 19, "D": 4}
UNARY = {"sin": np.sin, "cos": np.cos, "tan": np.tan, "log1p": np.log1p, "expm1": np.expm1,
         "rsqrt": lambda a: 1 / np.sqrt(a), "floor": np.floor, "ceil": np.ceil, "round": np.round, "sign": np.sign,
         "exp": np.exp, "tanh": np.tanh, "sqrt": np.sqrt, "abs": np.abs, "log2": np.log2}


def through_fa2(g: fl.Func, shapes=None) -> None:
    pm = PassManager(parse_pipeline("fa2-fwd"), check=True, shapes=shapes)
    pm.run(g)
    assert all(r.check == "ok" for r in pm.records), [(r.name, r.check) for r in pm.records]


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_maths_means_numpy(name: str) -> None:
    fn = getattr(fl, name)
    # a positive argument keeps log1p, rsqrt and sqrt real; 0.37 * s + 0.6 has halves and integers too
    g = fl.attention(score_mod=lambda s, b, h, q, kv: fn(abs(s) * 0.37 + 0.6) + s, name=f"u_{name}")
    ref = Reference.build(g, SHAPES)
    q, k, v = ref.inputs
    s = q @ np.swapaxes(k, -1, -2) / 2.0
    x = UNARY[name](np.abs(s) * 0.37 + 0.6) + s
    p = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(ref.outputs["o"], (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-10, atol=1e-12)
    through_fa2(g)


def test_round_is_half_to_even_as_torch() -> None:
    g = fl.trace(lambda x: fl.round(x), name="r", x=fl.tensor("f32", "N"))
    (y,) = interpret(g, [np.array([0.5, 1.5, 2.5, -0.5, -1.5, 0.49])])
    np.testing.assert_array_equal(y, [0.0, 2.0, 2.0, -0.0, -2.0, 0.0])


def test_sign_of_integers_stays_integer() -> None:
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + fl.sign(q - kv) * 0.5, name="signed")
    assert any(op.name == "sign" and op.results[0].type.dtype == "i32" for op in g.walk())
    through_fa2(g)


def test_sin_cos_positional_score_through_the_pipeline() -> None:
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + fl.sin(q * 0.1) * fl.cos(kv * 0.2), name="trig")
    through_fa2(g)


def test_masks_compare_with_masks() -> None:
    g = fl.attention(mask_mod=lambda b, h, q, kv: ((q >= kv) == (q < 12)) | ((kv % 2 == 0) != (q % 3 == 0)),
                     name="boolcmp")
    ref = Reference.build(g, SHAPES)
    qi, ki = np.arange(21)[:, None], np.arange(19)[None, :]
    keep = ((qi >= ki) == (qi < 12)) | ((ki % 2 == 0) != (qi % 3 == 0))
    q, k, v = ref.inputs
    s = np.where(keep, q @ np.swapaxes(k, -1, -2) / 2.0, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(ref.outputs["o"], (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-10)
    through_fa2(g)


def test_a_float_raised_to_a_traced_tensor_is_alibi() -> None:
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + 2.0 ** -(h + 1) * (kv - q), name="alibi_pow")
    ref = Reference.build(g, SHAPES)
    q, k, v = ref.inputs
    slopes = 2.0 ** -(np.arange(3) + 1.0)
    s = q @ np.swapaxes(k, -1, -2) / 2.0 + slopes[None, :, None, None] * (np.arange(19)[None, :] - np.arange(21)[:, None])
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(ref.outputs["o"], (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-10)
    through_fa2(g)


def test_rows_of_a_captured_table() -> None:
    means = fl.capture("means", "f32", "H,N")
    col = fl.capture("col", "f32", "H,1")
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + means[h][kv] + col[h], name="rows")
    same = fl.attention(score_mod=lambda s, b, h, q, kv: s + means[h, kv] + col[h, 0], name="rows")
    ref = Reference.build(same, SHAPES)
    (o,) = interpret(g, ref.inputs)
    np.testing.assert_allclose(o, ref.outputs["o"], rtol=1e-12)
    through_fa2(g)


def test_a_row_used_before_it_is_indexed_fully_is_refused() -> None:
    means = fl.capture("means", "f32", "H,N")
    with pytest.raises(fl.FalowerError, match=r"has dims \[N\] left: index it fully"):
        fl.attention(score_mod=lambda s, b, h, q, kv: s + means[h], name="bad_row")


def test_python_math_on_a_traced_tensor_names_the_falower_function() -> None:
    with pytest.raises(fl.FalowerError, match=r"math\.erf cannot take a traced tensor .*use fl\.erf\(x\)"):
        fl.attention(score_mod=lambda s, b, h, q, kv: math.erf(s), name="m1")
    with pytest.raises(fl.FalowerError, match=r"math\.exp cannot take a traced tensor .*use fl\.exp\(x\)"):
        fl.attention(score_mod=lambda s, b, h, q, kv: s * math.exp(q), name="m2")


def window_graph() -> fl.Func:
    window = fl.capture("window", "i32", "")
    temp = fl.capture("temp", "f32", "")
    return fl.attention(score_mod=lambda s, b, h, q, kv: s * temp,
                        mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < window), name="captured_window")


def test_captured_scalars_are_graph_inputs_of_rank_0() -> None:
    g = window_graph()
    assert [(a.name, str(a.type)) for a in g.args[3:]] == [("temp", "f32"), ("window", "i32")]
    ref = Reference.build(g, SHAPES)
    q, k, v, temp, window = ref.inputs
    qi, ki = np.arange(21)[:, None], np.arange(19)[None, :]
    s = np.where((qi >= ki) & (qi - ki < window), q @ np.swapaxes(k, -1, -2) / 2.0 * temp, -np.inf)
    m = np.where(np.isneginf(s.max(-1, keepdims=True)), 0, s.max(-1, keepdims=True))
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    np.testing.assert_allclose(ref.outputs["o"], (p / np.where(l == 0, 1, l)) @ v, rtol=1e-10)


@pytest.mark.parametrize("shapes", [SHAPES, {"B": 1, "H": 2, "M": 130, "N": 67, "D": 4}, None])
def test_captured_scalars_through_fa2_fwd(shapes) -> None:
    through_fa2(window_graph(), shapes)


def test_a_captured_window_still_skips_tiles() -> None:
    out = fl.lower(window_graph(), "fa2-fwd")
    dims = dict(B=1, H=8, M=4096, N=4096, D=64)
    narrow = cost_of(out, dims, data={"window": np.array(256, dtype=np.int32)})
    wide = cost_of(out, dims, data={"window": np.array(4096, dtype=np.int32)})
    assert narrow.flops * 4 < wide.flops  # a 256-wide band visits a few tiles per row, causal half of all


# ----------------------------------------------------------------------------- Python a trace cannot follow
_TABLE = np.ones(4, np.float32)
_T = fl.capture("t", "f32", "H")


@pytest.mark.parametrize("mod,says", [
    (lambda s, b, h, q, kv: s + list(q)[0], "cannot be iterated"),  # once: an endless walk of clamped gathers
    (lambda s, b, h, q, kv: s + list(_T)[0], "cannot be iterated"),
    (lambda s, b, h, q, kv: s + len(q), "len()"),
    (lambda s, b, h, q, kv: round(s), "falower.round"),
    (lambda s, b, h, q, kv: s + _TABLE[h], "falower.capture"),
    (lambda s, b, h, q, kv: np.where(q > kv, s, 0.0), "numpy does not trace"),
], ids=["iter", "iter_capture", "len", "round", "numpy_table", "np_where"])
def test_python_a_trace_cannot_follow_says_what_to_use(mod, says: str) -> None:
    with pytest.raises(fl.FalowerError, match=re.escape(says)):
        fl.attention(score_mod=mod)


@pytest.mark.parametrize("kw,says", [
    (dict(head_dim=0), "head_dim"), (dict(head_dim=-64), "head_dim"), (dict(head_dim=64.5), "head_dim"),
    (dict(group_size=2.5), "group_size"), (dict(group_size="2"), "group_size"), (dict(group_size=0), "group_size"),
    (dict(scale="a"), "scale"), (dict(scale=float("nan")), "scale"), (dict(scale=math.inf), "scale"),
    (dict(score_mod=3), "score_mod"), (dict(mask_mod="causal"), "mask_mod"), (dict(name=123), "name"),
])
def test_attention_names_a_bad_argument(kw: dict, says: str) -> None:
    with pytest.raises(fl.FalowerError, match=f"attention's {says}"):
        fl.attention(**kw)


def test_an_integer_constant_must_fit_its_dtype() -> None:
    """2**40 in an i32 mask once wrapped to 0 in the interpreter (q - kv < 0: a different mask, silently)."""
    from falower.ir.verifier import verify

    with pytest.raises(fl.FalowerError, match="integer constant 1099511627776 does not fit i32"):
        fl.attention(mask_mod=lambda b, h, q, kv: q - kv < 2 ** 40)
    with pytest.raises(fl.FalowerError, match="integer constant 300 does not fit i8"):
        verify(fl.parse_func("func @f(%x: i8[N]) -> (out0: i8[N]) {\n  %0 = const 300 : i8\n"
                             "  %1 = add %x, %0 : i8[N]\n  return %1\n}\n"))
    fl.attention(mask_mod=lambda b, h, q, kv: q - kv < 2 ** 31 - 1)  # the largest i32 is fine


def test_a_dimension_on_the_left_of_an_index() -> None:
    """N - kv and N + q in a score_mod (a review found them a TypeError: the Dim refused the traced index
    instead of leaving it to the index's reflected operator); their numbers are the same as kv's on the left."""
    import numpy as np

    from falower.ir import dim
    from falower.passes.check import Reference

    N = dim("N")
    left = fl.attention(score_mod=lambda s, b, h, q, kv: s + (N - kv).to("f32") * 0.01 + (N + q).to("f32") * 0.001
                        + (kv * 2).to("f32") * 0.001, name="left")
    right = fl.attention(score_mod=lambda s, b, h, q, kv: s + (-kv + N).to("f32") * 0.01 + (q + N).to("f32") * 0.001
                         + (kv * 2).to("f32") * 0.001, name="right")
    env = {"B": 1, "H": 1, "M": 5, "N": 7, "D": 4}
    a = Reference.build(left, env, seed=1)
    b = Reference.build(right, env, seed=1)
    np.testing.assert_allclose(a.outputs["o"], b.outputs["o"], rtol=0, atol=1e-12)
    fl.lower(left, "fa2-fwd")
    with pytest.raises(TypeError):
        N - 1.5  # not a dimension, not a traced tensor: Python's own error


def test_free_functions_take_a_capture() -> None:
    """fl.exp(temperature) and fl.maximum(w, w) with captures themselves raised 'expected a symbolic tensor, got
    Capture' where temperature.exp() worked (a review helper)."""
    import numpy as np

    from falower.ir import interpret

    t = fl.capture("t", "f32", "")
    w = fl.capture("w", "i32", "")
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s * fl.exp(t) + fl.maximum(w, kv).to("f32") * 0.1, name="caps")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 3, 4)) for _ in range(3))
    o = interpret(g, [q, k, v, np.array(0.5, np.float32), np.array(1, np.int32)])[0]
    s = q[0, 0] @ k[0, 0].T / 2.0 * np.exp(0.5) + np.maximum(1, np.arange(3))[None, :] * 0.1
    p = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(o[0, 0], (p / p.sum(1, keepdims=True)) @ v[0, 0], rtol=1e-6)
