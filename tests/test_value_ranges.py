"""ir/value_ranges.py: the static ranges of integer values that decide where a kernel wraps i32 arithmetic as the
IR does. Sound (every value an interpretation computes lies inside its range) and useful (the indices' usual
arithmetic needs no wrap), checked on the examples' lowered IR and on random index expressions by hypothesis."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import falower as fl
from falower.ir.dims import dim
from falower.ir.interp import Interpreter
from falower.ir.value_ranges import SIZE_MAX, ValueRanges, dim_range
from falower.passes import PassManager, parse_pipeline
from falower.passes.check import bind_dims, random_inputs

PIPELINE = "decompose-softmax,canonicalize,fuse,tile{bq=16,bk=16},online-softmax{exp2=true},mask-tiles,score-licm," \
           "canonicalize"
I32_WRAPS = ("add", "sub", "mul", "neg", "abs", "floordiv", "shl")


class _Recorder(Interpreter):
    """The interpreter, keeping each integer result's least and greatest value, and whether an add / sub / mul ...
    wrapped (its i32 result differs from the same op in int64)."""

    def __init__(self):
        super().__init__("native")
        self.seen: dict = {}
        self.wrapped: set = set()

    def op(self, op, env):
        out = super().op(op, env)
        for r, x in zip(op.results, out):
            a = np.asarray(x)
            if a.size and a.dtype.kind in "iu":
                lo, hi = int(a.min()), int(a.max())
                old = self.seen.get(r)
                self.seen[r] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        if op.name in I32_WRAPS and op.results[0].type.dtype == "i32":
            xs = [np.asarray(env[v]).astype(np.int64) for v in op.operands]
            exact = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
                     "neg": lambda a: -a, "abs": np.abs, "floordiv": lambda a, b: a // np.where(b == 0, 1, b),
                     "shl": lambda a, b: a << b}[op.name](*xs)
            if not np.array_equal(np.broadcast_to(exact, np.shape(out[0])), np.asarray(out[0]).astype(np.int64)):
                self.wrapped.add(op)
        return out


def _lowered(graph):
    return PassManager(parse_pipeline(PIPELINE)).run(graph)


def _check_sound(graph, sizes: dict, captures=None, runtime: tuple = ()) -> tuple[ValueRanges, _Recorder, object]:
    """Interpret the lowered graph, then: every integer result inside its static range; every op that wrapped
    called one that can leave i32 (the kernel wraps it). `runtime`: sizes the ranges do not know (kernels' run-time
    dims: any value up to SIZE_MAX)."""
    low = _lowered(graph)
    env = bind_dims(graph, sizes)
    inputs = random_inputs(graph, env, seed=1)
    for i, c in enumerate(captures or []):
        if 3 + i < len(inputs):  # (a random expression may not read w)
            inputs[3 + i] = c
    rec = _Recorder()
    rec.run(low, inputs, env)
    vr = ValueRanges({k: v for k, v in env.items() if k not in runtime})
    assert rec.seen, "nothing recorded"
    for v, (lo, hi) in rec.seen.items():
        r = vr(v)
        assert r[0] <= lo and hi <= r[1], (v.name, v.owner.name if hasattr(v.owner, "name") else "", (lo, hi), r)
    for op in rec.wrapped:
        lo, hi = vr.raw(op)
        assert not (-2 ** 31 <= lo and hi <= 2 ** 31 - 1), (op.name, (lo, hi))
    return vr, rec, low


SIZES = {"B": 1, "H": 2, "M": 37, "N": 41, "D": 8}


@pytest.mark.parametrize("stem", ["causal", "relative_bias", "sliding_window", "document", "alibi", "prefix_lm"])
def test_the_examples_indices_need_no_wrap(stem: str) -> None:
    """Every example's i32 arithmetic stays inside i32 for sizes up to SIZE_MAX: the kernels add no code for it
    (their sources are unchanged by the analysis), and the ranges hold every value the interpreter computes."""
    import runpy
    from pathlib import Path

    g = runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / f"{stem}.py"))["graph"]
    for runtime in ((), ("M", "N", "B", "H")):
        vr, rec, low = _check_sound(g, SIZES, runtime=runtime)
        ops = [op for op in low.walk() if op.name in I32_WRAPS and op.results[0].type.dtype == "i32"]
        assert ops, "no index arithmetic in the lowered IR"
        for op in ops:
            lo, hi = vr.raw(op)
            assert -2 ** 31 <= lo and hi <= 2 ** 31 - 1, (stem, op.name, op.results[0].name, (lo, hi))


def test_products_and_captured_values_can_leave_i32() -> None:
    """q * 2^25 leaves i32 past q = 63, kv + w with a captured w at any w: both called so, and the interpreter's
    values wrap where the ranges say they may (M = 100)."""
    w = fl.capture("w", "i32", "")
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + (q * 33554432).to("f32") * 2.0 ** -31,
                     mask_mod=lambda b, h, q, kv: kv + w >= q, name="wraps")
    vr, rec, low = _check_sound(g, {**SIZES, "M": 100}, [np.array(2 ** 31 - 1, np.int32)])
    names = {op.name for op in rec.wrapped}
    assert names == {"mul", "add"}, names  # both wrapped in the interpretation, both can leave by the ranges
    leave = [op for op in low.walk() if op.name in ("mul", "add") and op.results[0].type.dtype == "i32"
             and not (-2 ** 31 <= vr.raw(op)[0] and vr.raw(op)[1] <= 2 ** 31 - 1)]
    assert {op.name for op in leave} >= {"mul", "add"}


def test_size_ranges() -> None:
    assert dim_range(dim("N") * 2 - 1, {"N": 10}) == (19.0, 19.0)
    assert dim_range(dim("N") * 2 - 1, {}) == (1.0, 2.0 * SIZE_MAX - 1)
    assert dim_range(fl.ir.dims.cdiv(dim("M"), 128), {}) == (1.0, float(-(-SIZE_MAX // 128)))
    assert dim_range(dim("M") - dim("N"), {"M": 5}) == (5.0 - SIZE_MAX, 4.0)


_LEAVES = st.sampled_from(["q", "kv", "h", "c_small", "c_big", "n", "w"])


def _expr(depth: int):
    if depth == 0:
        return _LEAVES
    sub = _expr(depth - 1)
    return st.one_of(_LEAVES,
                     st.tuples(st.sampled_from(["add", "sub", "mul", "min", "max"]), sub, sub),
                     st.tuples(st.sampled_from(["neg", "abs", "div7", "mod5"]), sub))


def _build(e, q, kv, h, w):
    if isinstance(e, str):  # constants as traced values (q * 0 + c), not Python ints
        return {"q": q, "kv": kv, "h": h, "w": q * 0 + w, "c_small": q * 0 + 3, "c_big": q * 0 + (1 << 29),
                "n": kv * 0 + 41}[e]
    op, *xs = e
    a = [_build(x, q, kv, h, w) for x in xs]
    if op == "add":
        return a[0] + a[1]
    if op == "sub":
        return a[0] - a[1]
    if op == "mul":
        return a[0] * a[1]
    if op == "min":
        return fl.minimum(a[0], a[1])
    if op == "max":
        return fl.maximum(a[0], a[1])
    if op == "neg":
        return -a[0]
    if op == "abs":
        return a[0].abs()
    if op == "div7":
        return a[0] // 7
    return a[0] % 5


@settings(max_examples=40, deadline=None)
@given(e=_expr(3), wv=st.sampled_from([0, 5, 2 ** 31 - 1, -2 ** 31, 123456789]))
def test_random_index_expressions_are_sound(e, wv) -> None:
    """Random i32 expressions over q, kv, h, constants (one near 2^29), N and a captured w, in a score and a mask:
    every value the interpreter computes in the lowered IR lies in its static range, and every op whose result
    wrapped is one the ranges say can leave i32 (so the kernels wrap it too)."""
    w = fl.capture("w", "i32", "")
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + _build(e, q, kv, h, w).to("f32") * 1e-9,
                     mask_mod=lambda b, h, q, kv: (_build(e, q, kv, h, w) % 3 != 1) | (kv == 0), name="rand")
    _check_sound(g, SIZES, [np.array(wv, np.int32)])


def test_a_long_chain_needs_no_deep_recursion() -> None:
    """A score of 200 chained integer adds (each the next's operand): the ranges are computed without recursing
    once per op (the first version hit Python's recursion limit there, where the passes did not)."""
    import sys

    def score(s, b, h, q, kv):
        x = q - kv
        for _ in range(200):
            x = x + 1
        return s + x.to("f32") * 0.001

    low = _lowered(fl.attention(score_mod=score, name="deep"))
    last = [op for op in low.walk() if op.name == "add" and op.results[0].type.dtype == "i32"][-1]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # far below the chain's length
    try:
        r = ValueRanges({"M": 37, "N": 41})(last.results[0])
    finally:
        sys.setrecursionlimit(limit)
    assert -48 + 200 <= r[0] and r[1] <= 47 + 200, r  # (q + 200, regrouped by score-licm; q to its tile's end)


def test_a_float_rounded_to_a_whole_number_before_the_cast() -> None:
    """0.99999999 is 1.0 in f32: the cast gives 1 and + (2^31 - 1) wraps in the native interpretation; the float's
    range is widened by its rounding (intervals.settle), so the add is called one that can leave i32."""
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + ((kv.to("f32") * 1e-30 + 0.99999999).to("i32")
                                                         + 2147483647).to("f32") * 1e-9, name="rounded")
    _check_sound(g, SIZES)
