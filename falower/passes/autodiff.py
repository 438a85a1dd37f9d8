"""autodiff: reverse-mode differentiation of a graph into its joint forward + backward function.

One derivative rule per op, in one table (`RULES`, keyed by op name), the way JAX keeps one rule per
primitive. A rule gets the op, the adjoint `g` of its result and which operands need a gradient, and returns
one contribution per operand (None: no gradient). The driver walks the forward ops in reverse, sums the
contributions of every use of a value, sums them over broadcast axes back to the value's shape, and ends
with the gradients of the arguments cast to their types.

Adjoints are computed in f32 (f64 for f64 values). An adjoint has its value's rank, each dim equal to the
value's or 1 (reduce_sum's rule just passes `g` on: broadcasting does the rest); `full` materialises one
where an op needs the whole shape (matmul, repeat_interleave, scatter_add).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value
from ..ir.dims import Const, Dim, Sym
from ..ir.types import TensorType, is_float
from .base import Pass, register
from .raise_forms import raise_written_forms

Rule = Callable[["Backward", Op, Value, tuple[bool, ...]], Sequence[Optional[Value]]]


# ------------------------------------------------------------------------------------ naming convention
def cotangent_names(func: Func) -> list[str]:
    """The joint function's extra arguments: `d<result>` for every floating-point result (`do`), then `d<lse>` for an
    LSE result raise_lse took out of the results (its name in the attrs' `lse_result`)."""
    lse = [f"d{func.attrs['lse_result']}"] if "lse_result" in func.attrs else []
    return ["d" + n for v, n in zip(func.results, func.result_names) if is_float(v.type.dtype)] + lse


def gradient_names(func: Func) -> list[str]:
    """The joint function's extra results: `d<argument>` for every floating-point argument (`dq`, `dk`, ...)."""
    return ["d" + _arg_name(a, i) for i, a in enumerate(func.args) if is_float(a.type.dtype)]


def _arg_name(a: Value, i: int) -> str:
    return a.name if a.name and not a.name.isdigit() else f"arg{i}"


def is_joint_of(joint: Func, primal: Func) -> bool:
    """Whether `joint` has the signature autodiff gives `primal`: its arguments, then one cotangent per float
    result; its results, then one gradient per float argument (an LSE result, taken out of the results by
    raise_lse, has its cotangent and no result)."""
    n = len(primal.args)
    args, extra = joint.args[:n], joint.args[n:]
    if len(joint.args) <= n or [a.type for a in args] != [a.type for a in primal.args]:
        return False
    results = primal.result_names
    if results and joint.attrs.get("lse_result") == results[-1] and "lse_result" not in primal.attrs:
        results = results[:-1]
    names = results + gradient_names(primal)
    return [a.name for a in extra] == cotangent_names(primal) and joint.result_names == names


# ------------------------------------------------------------------------------------------ analyses
def _inputs(op: Op) -> list[Value]:
    """What an op reads: its operands, and the outer values its regions use (a parallel_for reads q, k, v)."""
    out = list(op.operands)
    defined: set[Value] = set()
    for inner in op.walk():
        for r in inner.regions:
            defined.update(r.args)
        if inner is not op:
            defined.update(inner.results)
    for inner in op.walk():
        if inner is not op:
            out += [v for v in inner.operands if v not in defined]
    return out


def _active(func: Func, ops: Sequence[Op]) -> set[Value]:
    """Float values that depend on a float argument: the only values that can have a gradient."""
    active = {a for a in func.args if is_float(a.type.dtype)}
    for op in ops:
        if any(v in active for v in _inputs(op)):
            active.update(r for r in op.results if is_float(r.type.dtype))
    return active


def _needed(ops: Sequence[Op], roots: Sequence[Value], active: set[Value]) -> set[Value]:
    """Active values a float result depends on: the ones whose adjoint the backward computes."""
    needed = {v for v in roots if v in active}
    for op in reversed(ops):
        if any(r in needed for r in op.results):
            needed.update(v for v in _inputs(op) if v in active)
    return needed


# ops whose result is finite even where an operand is infinite (exp(-inf) = 0; an exp that overflows to +inf
# makes the forward itself infinite, so its gradient is lost anyway)
# ops finite at a mask's -inf (exp(-inf) = 0, tanh(-inf) = -1, ...); not floor, ceil and round, which keep it
_FINITE = ("exp", "exp2", "expm1", "tanh", "tanh_approx", "sigmoid", "erf", "softmax", "sin", "cos", "sign", "rsqrt")


def _may_be_infinite(ops: Sequence[Op]) -> set[Value]:
    """Values that can hold +-inf by construction: a mask's -inf constant, an entry of a captured float table, and
    what they flow into."""
    inf: set[Value] = set()
    for op in ops:
        if not op.results or not is_float(op.results[0].type.dtype):
            continue
        n = op.name
        if n == "const":
            v = op.attrs["value"]
            hit = isinstance(v, float) and math.isinf(v)
        elif n in _FINITE:
            hit = False
        elif n == "where":
            hit = any(v in inf for v in op.operands[1:])
        elif n == "gather":  # a captured float table may hold -inf itself (an additive mask, as HF models pass)
            hit = op.operands[0] in inf or not isinstance(op.operands[0].owner, Op)
        else:
            hit = any(v in inf for v in op.operands)
        if hit:
            inf.update(op.results)
    return inf


def _positive_constant(v: Value) -> bool:
    """v is computed from positive constants and sizes alone (no data) by ops that keep them positive."""
    op = v.owner
    if not isinstance(op, Op):
        return False
    if op.name == "const":
        c = op.attrs["value"]
        if isinstance(c, Const):
            c = c.value
        return isinstance(c, Sym) or (not isinstance(c, bool) and isinstance(c, (int, float)) and c > 0)
    return op.name in ("cast", "sqrt", "mul", "add", "div", "exp", "exp2") and \
        all(_positive_constant(x) for x in op.operands)


# ---------------------------------------------------------------------------------------------- driver
def adjoint_dtype(t: TensorType) -> str:
    return "f64" if t.dtype == "f64" else "f32"


class Backward:
    """The state of one differentiation: the builder of the backward ops, the adjoints so far, and small
    helpers the rules share (primal values cast to the adjoint dtype, scalar constants, broadcasting)."""

    def __init__(self, builder: Builder, infinite: set[Value]):
        self.b = builder
        self.adj: dict[Value, Value] = {}
        self.infinite = infinite
        self._consts: dict[tuple[Any, str], Value] = {}
        self._casts: dict[tuple[Value, str], Value] = {}
        self.lse: Optional[tuple[Op, Value]] = None  # (the softmax, the cotangent of its LSE result) (raise_lse.py)

    # ----------------------------------------------------------------------------------- building
    def emit(self, name: str, *operands: Value, **attrs: Any) -> Value:
        return self.b.emit(name, *operands, **attrs)

    def const(self, x: float, dtype: str) -> Value:
        key = (x, dtype)
        if key not in self._consts:
            self._consts[key] = self.b.const(float(x), TensorType(dtype, ()))
        return self._consts[key]

    def cast(self, v: Value, dtype: str) -> Value:
        if v.type.dtype == dtype:
            return v
        key = (v, dtype)
        if key not in self._casts:
            self._casts[key] = self.emit("cast", v, to=dtype)
        return self._casts[key]

    def p(self, v: Value, g: Value) -> Value:
        """A primal value in the dtype of the adjoint `g` (f16 inputs are read as f32)."""
        return self.cast(v, g.type.dtype)

    def times(self, g: Value, factor: Value, primal: Value) -> Value:
        """g * factor; where `primal` may be infinite (a masked score), 0 wherever g is 0, never 0 * inf = NaN."""
        prod = self.emit("mul", g, factor)
        if primal not in self.infinite or g.type.rank == 0:  # (a scalar's cotangent: no masked entry, see below)
            return prod
        zero = self.const(0.0, g.type.dtype)
        return self.emit("where", self.emit("eq", g, zero), zero, prod)

    def zero_where_g_is(self, g: Value, x: Value) -> Value:
        """x, but 0 wherever the cotangent g is 0: a rule whose local derivative can be infinite at a finite input
        (sqrt and log at 0, a division by 0, rsqrt, pow below 1 at 0) gives a masked entry, a padded row or an entry
        nobody reads no gradient, never 0 * inf = NaN (sqrt(max(s, 0)) at a masked s = 0: torch masks after its
        score_mod's backward the same way)."""
        if g.type.rank == 0:  # a scalar's cotangent (a learned temperature's sum) is no masked entry: no guard, so
            return x  # tile-bwd can take its gradient as the linear combination of sums it is (s * t ** 2)
        zero = self.const(0.0, g.type.dtype)
        return self.emit("where", self.emit("eq", g, zero), zero, x)

    def over(self, g: Value, d: Value) -> Value:
        """g / d, 0 where g is 0 (`zero_where_g_is`); a d that is positive by construction (a positive constant, the
        scale's sqrt(D) of a size) needs no guard."""
        q = self.emit("div", g, d)
        return q if _positive_constant(d) else self.zero_where_g_is(g, q)

    def matmul(self, a: Value, b: Value, ta: bool, tb: bool, dtype: str) -> Value:
        out = {"out_dtype": dtype} if dtype != "f32" else {}
        return self.emit("matmul", a, b, transpose_a=ta, transpose_b=tb, **out)

    # -------------------------------------------------------------------------------- broadcasting
    def unbroadcast(self, g: Value, shape: tuple[Dim, ...]) -> Value:
        """Sum `g` over the axes a value of `shape` was broadcast along; the result has rank len(shape)."""
        extra = g.type.rank - len(shape)
        for i, d in enumerate(g.type.shape):
            summed = i < extra or shape[i - extra] == Const(1)
            if summed and d != Const(1):
                g = self.emit("reduce_sum", g, axis=i)
        for _ in range(max(extra, 0)):
            g = self.emit("squeeze", g, axis=0)
        while g.type.rank < len(shape):
            g = self.emit("unsqueeze", g, axis=0)
        return g

    def full(self, g: Value, shape: tuple[Dim, ...]) -> Value:
        """`g` materialised at `shape` (an adjoint may be 1 along axes its value has in full)."""
        if g.type.shape == tuple(shape):
            return g
        return self.emit("add", g, self.b.const(0.0, TensorType(g.type.dtype, tuple(shape))))

    def accumulate(self, v: Value, contribution: Value) -> None:
        c = self.cast(self.unbroadcast(contribution, v.type.shape), adjoint_dtype(v.type))
        prev = self.adj.get(v)
        self.adj[v] = c if prev is None else self.emit("add", prev, c)


# ------------------------------------------------------------------------------------------------ rules
RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
    def deco(f: Rule) -> Rule:
        for n in names:
            RULES[n] = f
        return f
    return deco


def _unary(f: Callable[["Backward", Value, Value, Value], Optional[Value]]) -> Rule:
    """A rule for y = f(x) from `f(bw, g, x, y)`, the contribution to x."""
    def r(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
        if not want[0]:
            return [None]
        return [f(bw, g, bw.p(op.operands[0], g), bw.p(op.result, g))]
    return r


def _c(bw: Backward, x: float, like: Value) -> Value:
    return bw.const(x, like.type.dtype)


RULES.update({
    "neg": _unary(lambda bw, g, x, y: bw.emit("neg", g)),
    "exp": _unary(lambda bw, g, x, y: bw.times(g, y, y)),
    "exp2": _unary(lambda bw, g, x, y: bw.emit("mul", bw.times(g, y, y), _c(bw, math.log(2.0), g))),
    "log": _unary(lambda bw, g, x, y: bw.over(g, x)),
    "log2": _unary(lambda bw, g, x, y: bw.over(g, bw.emit("mul", x, _c(bw, math.log(2.0), g)))),
    "tanh": _unary(lambda bw, g, x, y: bw.emit("mul", g, bw.emit("sub", _c(bw, 1.0, g), bw.emit("mul", y, y)))),
    # 1 - y^2 of the forward's own (approximate) y, as FlashAttention's fast softcap backward
    "tanh_approx": _unary(lambda bw, g, x, y: bw.emit("mul", g, bw.emit("sub", _c(bw, 1.0, g), bw.emit("mul", y, y)))),
    "sqrt": _unary(lambda bw, g, x, y: bw.over(g, bw.emit("mul", y, _c(bw, 2.0, g)))),
    "sigmoid": _unary(lambda bw, g, x, y: bw.emit("mul", g, bw.emit("mul", y, bw.emit("sub", _c(bw, 1.0, g), y)))),
    "erf": _unary(lambda bw, g, x, y: bw.emit("mul", g, bw.emit(
        "mul", bw.emit("exp", bw.emit("neg", bw.emit("mul", x, x))), _c(bw, 2.0 / math.sqrt(math.pi), g)))),
    # the ops another branch adds (sin, cos, ...): the table is keyed by name, so these wait for them
    "sin": _unary(lambda bw, g, x, y: bw.emit("mul", g, bw.emit("cos", x))),
    "cos": _unary(lambda bw, g, x, y: bw.emit("neg", bw.emit("mul", g, bw.emit("sin", x)))),
    "tan": _unary(lambda bw, g, x, y: bw.emit("mul", g, bw.emit("add", _c(bw, 1.0, g), bw.emit("mul", y, y)))),
    "log1p": _unary(lambda bw, g, x, y: bw.over(g, bw.emit("add", x, _c(bw, 1.0, g)))),
    "expm1": _unary(lambda bw, g, x, y: bw.times(g, bw.emit("add", y, _c(bw, 1.0, g)), y)),
    "rsqrt": _unary(lambda bw, g, x, y: bw.zero_where_g_is(g, bw.emit("mul", g, bw.emit(
        "mul", bw.emit("mul", y, bw.emit("mul", y, y)), _c(bw, -0.5, g))))),
    # piecewise constant: no contribution (an argument reached only through them gets a zero gradient)
    "sign": _unary(lambda bw, g, x, y: None),
    "floor": _unary(lambda bw, g, x, y: None),
    "ceil": _unary(lambda bw, g, x, y: None),
    "round": _unary(lambda bw, g, x, y: None),
    "cast": _unary(lambda bw, g, x, y: g),  # float to float; the driver casts g to the operand's adjoint dtype
})


@rule("abs")
def _abs(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    """g * sign(x): 0 at x = 0, as torch and JAX."""
    x = op.operands[0]
    zero = bw.const(0.0, x.type.dtype)
    gz = _c(bw, 0.0, g)
    pos = bw.emit("where", bw.emit("gt", x, zero), g, gz)
    return [bw.emit("where", bw.emit("lt", x, zero), bw.emit("neg", g), pos)]


@rule("add")
def _add(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    return [g, g]


@rule("sub")
def _sub(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    db = bw.emit("neg", bw.unbroadcast(g, op.operands[1].type.shape)) if want[1] else None
    return [g, db]


@rule("mul")
def _mul(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    a, b = op.operands
    return [bw.times(g, bw.p(b, g), b) if want[0] else None,
            bw.times(g, bw.p(a, g), a) if want[1] else None]


@rule("div")
def _div(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    """y = a / b: da = g / b, db = -(g * y) / b."""
    a, b = op.operands
    bb = bw.p(b, g)
    da = bw.over(g, bb) if want[0] else None
    db = None
    if want[1]:
        t = bw.over(bw.times(g, bw.p(op.result, g), op.result), bb)
        db = bw.emit("neg", bw.unbroadcast(t, b.type.shape))
    return [da, db]


@rule("pow")
def _pow(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    """y = a ** b: da = g * b * a ** (b - 1), 0 where b = 0 (a ** 0 is the constant 1, also at a = 0: JAX's and
    torch's); db = g * y * log(a), 0 where a = 0 (as JAX); both 0 where g is 0 (a ** b's slope is infinite at a = 0
    for b < 1)."""
    a, b = bw.p(op.operands[0], g), bw.p(op.operands[1], g)
    da = db = None
    if want[0]:
        zero = _c(bw, 0.0, g)
        slope = bw.emit("mul", b, bw.emit("pow", a, bw.emit("sub", b, _c(bw, 1.0, g))))
        slope = bw.emit("where", bw.emit("eq", b, zero), zero, slope)
        da = bw.zero_where_g_is(g, bw.times(g, slope, op.operands[0]))
    if want[1]:
        zero = _c(bw, 0.0, g)
        ylog = bw.emit("mul", bw.p(op.result, g), bw.emit("log", a))
        db = bw.times(g, bw.emit("where", bw.emit("eq", a, zero), zero, ylog), op.result)
    return [da, db]


def _chooser(first: str, second: str) -> Rule:
    """max (gt, lt) and min (lt, gt): g goes to the operand chosen; ties split it evenly, as JAX and torch."""
    def r(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
        a, b = op.operands
        zero = _c(bw, 0.0, g)
        tie = bw.emit("where", bw.emit("eq", a, b), bw.emit("mul", g, _c(bw, 0.5, g)), zero)
        return [bw.emit("where", bw.emit(first, a, b), g, tie) if want[0] else None,
                bw.emit("where", bw.emit(second, a, b), g, tie) if want[1] else None]
    return r


RULES["max"] = _chooser("gt", "lt")
RULES["min"] = _chooser("lt", "gt")


@rule("where")
def _where(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    """g goes where the condition holds to a, elsewhere to b: selected, never multiplied (a masked -inf
    branch gets nothing and costs no NaN)."""
    c = op.operands[0]
    zero = _c(bw, 0.0, g)
    return [None, bw.emit("where", c, g, zero) if want[1] else None,
            bw.emit("where", c, zero, g) if want[2] else None]


@rule("matmul")
def _matmul(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    """y = A B with A = a or a^T, B = b or b^T (the transpose flags): dA = g B^T, dB = A^T g, each written as
    one matmul with flags (no transposed copies): dV = P^T dO is `matmul %p, %do {transpose_a}`."""
    a, b = op.operands
    ta, tb = bool(op.attrs.get("transpose_a")), bool(op.attrs.get("transpose_b"))
    g = bw.full(g, op.result.type.shape)
    dt = g.type.dtype
    da = db = None
    if want[0]:
        da = bw.matmul(b, g, tb, True, dt) if ta else bw.matmul(g, b, False, not tb, dt)
    if want[1]:
        db = bw.matmul(g, a, True, ta, dt) if tb else bw.matmul(a, g, not ta, False, dt)
    return [da, db]


@rule("reduce_sum")
def _reduce_sum(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    return [g]  # [.., 1, ..] broadcasts over the summed axis


@rule("reduce_max")
def _reduce_max(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    """g goes to the positions equal to the max; ties share it evenly (as JAX). A row of -inf (fully
    masked) ties everywhere and gets g / N, which decompose-softmax's guard has already made 0."""
    x, m = op.operands[0], op.result
    hit = bw.emit("eq", x, m)
    count = bw.emit("reduce_sum", bw.cast(hit, g.type.dtype), axis=op.attrs["axis"])
    return [bw.emit("where", hit, bw.emit("div", g, count), _c(bw, 0.0, g))]


@rule("softmax")
def _softmax(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    """dx = p * (g - rowsum(p * g)), in exactly these four ops (the recomputation and Delta rewrites match
    them): `pg = mul p, g; r = reduce_sum pg {axis}; t = sub g, r; dx = mul p, t`. A fully masked row has
    p = 0, so dx = 0 there. Where the graph returns this softmax's LSE too, its cotangent dlse moves the row sum:
    dx = p * (g - (rowsum(p * g) - dlse)) (passes/lse_cotangent.py), `r` then `sub r, unsqueeze(dlse)`."""
    p = bw.p(op.result, g)
    pg = bw.emit("mul", p, g)
    r = bw.emit("reduce_sum", pg, axis=op.attrs["axis"])
    if bw.lse is not None and bw.lse[0] is op:
        r = bw.emit("sub", r, bw.emit("unsqueeze", bw.cast(bw.lse[1], r.type.dtype), axis=op.attrs["axis"]),
                    name_hint="delta_moved")
    t = bw.emit("sub", g, r)
    return [bw.emit("mul", p, t)]


@rule("squeeze")
def _squeeze(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    return [bw.emit("unsqueeze", g, axis=op.attrs["axis"])]


@rule("unsqueeze")
def _unsqueeze(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    return [bw.emit("squeeze", g, axis=op.attrs["axis"])]


@rule("gather")
def _gather(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    """The table's gradient is g scatter-added into zeros at the same (clamped) indices; indices get none."""
    table, idx = op.operands[0], op.operands[1:]
    if not want[0]:
        return [None] * len(op.operands)
    zeros = bw.b.const(0.0, TensorType(g.type.dtype, table.type.shape))
    return [bw.emit("scatter_add", zeros, g, *idx)] + [None] * len(idx)


@rule("scatter_add")
def _scatter_add(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    table, idx = op.operands[0], op.operands[2:]
    d_upd = bw.emit("gather", bw.full(g, table.type.shape), *idx) if want[1] else None
    return [g if want[0] else None, d_upd] + [None] * len(idx)


@rule("repeat_interleave")
def _repeat_interleave(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    """GQA: a kv head's gradient is the sum over the query heads of its group."""
    g = bw.full(g, op.result.type.shape)
    return [bw.emit("group_sum", g, axis=op.attrs["axis"], size=op.attrs["repeats"])]


@rule("group_sum")
def _group_sum(bw: Backward, op: Op, g: Value, want: tuple[bool, ...]) -> list[Optional[Value]]:
    g = bw.full(g, op.result.type.shape)
    return [bw.emit("repeat_interleave", g, axis=op.attrs["axis"], repeats=op.attrs["size"])]


# -------------------------------------------------------------------------------------------------- pass
_NOT_GRAPH_LEVEL = " (autodiff works on whole tensors: run it before fuse and tile)"


@register
@dataclass(frozen=True)
class Autodiff(Pass):
    """Reverse-mode autodiff: the graph becomes its joint forward + backward function, ordinary IR.

    Requires: a graph-level function (whole tensors: before or after decompose-softmax, not after fuse or
    tile) with at least one floating-point result, and a derivative rule in `RULES` for every op on a path
    from a float argument to a float result (masks, comparisons and index arithmetic need none).

    The joint function takes the arguments, then one cotangent `d<result>` per float result (of the
    result's type); it returns the results, then `d<argument>` for every float argument, of its type
    (computed in f32, cast at the end; an argument no result depends on gets zeros). The forward ops are
    kept exactly as given (dead ones too: canonicalize removes those), the backward ops follow them, and
    no backward op is dead. Fully masked rows give zero gradients, never NaN: `where` selects rather than
    multiplies, and a product with a value that can be infinite (a masked score) is guarded where g = 0.
    Ties of reduce_max, max and min share the gradient evenly.

        func @f(%s: f32[M,N], %v: f16[N,D]) -> (o: f32[M,D]) {
          %p = softmax %s {axis = 1} : f32[M,N]
          %o = matmul %p, %v : f32[M,D]
          return %o
        }
    =>
        func @f(%s: f32[M,N], %v: f16[N,D], %do: f32[M,D]) -> (o: f32[M,D], ds: f32[M,N], dv: f16[N,D]) {
          %p = softmax %s {axis = 1} : f32[M,N]
          %o = matmul %p, %v : f32[M,D]
          %0 = matmul %do, %v {transpose_b} : f32[M,N]
          %1 = matmul %p, %do {transpose_a} : f32[N,D]
          %2 = mul %p, %0 : f32[M,N]
          %3 = reduce_sum %2 {axis = 1} : f32[M,1]
          %4 = sub %0, %3 : f32[M,N]
          %ds = mul %p, %4 : f32[M,N]
          %dv = cast %1 {to = "f16"} : f16[N,D]
          return %o, %ds, %dv
        }
    """

    name = "autodiff"
    summary = "reverse-mode autodiff -> the joint forward + backward function (d<result> in, d<argument> out)"

    def run(self, func: Func) -> Func:
        # P cast before P @ V and a softmax written by hand differentiate as the ops (raise_forms.py)
        raise_written_forms(func, guarded=False, scale=False)
        lse_name = func.attrs.get("lse_result")  # an LSE result (raise_lse.py): the softmax rule takes its cotangent
        body = func.body
        results, names = func.results, func.result_names
        roots = [v for v in results if is_float(v.type.dtype)]
        if not roots:
            raise self.fail(f"@{func.name} has no floating-point result to differentiate")
        cot_names, grad_names = cotangent_names(func), gradient_names(func)
        taken = {a.name for a in func.args}
        if set(grad_names) & set(names) and set(cot_names) & taken:
            raise self.fail(f"@{func.name} is already a joint function (it takes "
                            f"{sorted(set(cot_names) & taken)[0]} and returns {sorted(set(grad_names) & set(names))[0]}): "
                            "autodiff runs once")
        for n in cot_names:
            if n in taken:
                raise self.fail(f"the cotangent argument %{n} would have the name of an argument of @{func.name}")
        for n in grad_names:
            if n in names or n == lse_name:  # the LSE result is out of the results (raise_lse), not out of its name
                raise self.fail(f"the gradient result {n} would have the name of a result of @{func.name}")
        forward = body.ops[:-1]
        body.ops = list(forward)  # the return is rebuilt at the end
        active = _active(func, forward)
        needed = _needed(forward, roots, active)
        bw = Backward(Builder(body), _may_be_infinite(forward))
        for v, n in zip(roots, cot_names):
            ct = body.add_arg(v.type, n)
            if v in needed:
                bw.accumulate(v, ct)
        if lse_name is not None:
            sm = next((op for op in forward if op.name == "softmax"), None)
            if sm is None:
                raise self.fail(f"@{func.name} returns its softmax's LSE ({lse_name}) but has no softmax op left: run "
                                "autodiff before decompose-softmax")
            x, axis = sm.operands[0], sm.attrs["axis"]
            bw.lse = (sm, body.add_arg(TensorType(x.type.dtype, x.type.shape[:axis] + x.type.shape[axis + 1:]),
                                       cot_names[-1]))
        for op in reversed(forward):
            g = next((bw.adj[r] for r in op.results if r in bw.adj), None)
            if g is None:
                continue
            fn = RULES.get(op.name)
            if fn is None or len(op.results) != 1:
                hint = _NOT_GRAPH_LEVEL if op.regions else ""
                raise self.fail(f"no derivative rule for op '{op.name}'{hint}")
            want = tuple(v in needed for v in op.operands)
            for v, w, c in zip(op.operands, want, fn(bw, op, g, want)):
                if w and c is not None:
                    bw.accumulate(v, c)
        grads = [self._gradient(bw, a, n) for a, n in
                 zip([a for a in func.args if is_float(a.type.dtype)], grad_names)]
        Builder(body).ret(*results, *grads)
        func.attrs["result_names"] = tuple(names) + tuple(grad_names)
        _drop_dead(body, len(forward))
        return func

    @staticmethod
    def _gradient(bw: Backward, arg: Value, name: str) -> Value:
        g = bw.adj.get(arg)
        if g is None:
            return bw.b.const(0.0, arg.type, name_hint=name)
        g = bw.full(bw.unbroadcast(g, arg.type.shape), arg.type.shape)
        out = bw.emit("cast", g, to=arg.type.dtype) if g.type.dtype != arg.type.dtype else g
        if out.name is None and isinstance(out.owner, Op):
            out.name = name
        return out


def _drop_dead(body: Block, start: int) -> None:
    """Remove the backward ops (those from index `start` on) that nothing uses; the forward stays as given."""
    while True:
        used: set[Value] = set()
        for op in body.ops:
            for inner in op.walk():
                used.update(inner.operands)
        keep = [op for i, op in enumerate(body.ops)
                if i < start or not op.results or any(r in used for r in op.results)]
        if len(keep) == len(body.ops):
            return
        body.ops = keep


__all__ = ["Autodiff", "RULES", "Backward", "adjoint_dtype", "cotangent_names", "gradient_names", "is_joint_of"]
