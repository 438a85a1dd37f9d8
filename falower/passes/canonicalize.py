"""canonicalize: constant folding, algebraic identities, CSE and DCE. Never needed for correctness."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..ir.builder import Builder
from ..ir.core import Func, Op, Value
from ..ir.dims import Dim, binop, dim
from ..ir.interp import Interpreter
from ..ir.ops import ELEMENTWISE
from ..ir.types import is_float
from .base import Pass, register
from .rewrite import apply_patterns, cse, dce


def const_value(v: Value):
    """The constant behind a value, or None."""
    op = v.owner
    if isinstance(op, Op) and op.name == "const":
        return op.attrs["value"]
    return None


def is_const(v: Value, x: float) -> bool:
    c = const_value(v)
    return c is not None and not isinstance(c, Dim) and not isinstance(c, bool) and float(c) == x


_DIM_OPS = {"add": "+", "sub": "-", "mul": "*", "floordiv": "fdiv", "max": "max", "min": "min"}


def _folds_exactly(name: str, vals: list) -> bool:
    """Whether an i32 op of size constants is the size expression's value: add, sub and mul always (the i32
    result wraps as the expression's value does); min, max and floordiv only where each operand stays inside i32
    for every size up to 2^31 - 1 (min(wrap(N * 2^30), 7) is not wrap(min(N * 2^30, 7))), and floordiv not by a
    divisor that can be 0 (the IR's // 0 is 0; a size expression's fdiv by 0 raises)."""
    from ..ir.value_ranges import dim_range

    if name in ("add", "sub", "mul"):
        return True
    ranges = [dim_range(dim(v), {}, 2 ** 31 - 1) for v in vals]
    if any(not (-2 ** 31 <= lo and hi <= 2 ** 31 - 1) for lo, hi in ranges):
        return False
    return not (name == "floordiv" and ranges[1][0] <= 0 <= ranges[1][1])


def _add_identity(v: Value) -> bool:
    """v is a constant 0 that adding leaves every value as it was: an integer 0, or a float -0.0 (x + 0.0 turns
    -0.0 into +0.0, which 1 / x tells apart)."""
    if not is_const(v, 0.0):
        return False
    return not is_float(v.type.dtype) or math.copysign(1.0, float(const_value(v))) < 0


def fold_constants(op: Op, b: Builder) -> Optional[Sequence[Value]]:
    """An elementwise op of constants is a constant (symbolic dims fold into dim expressions). Folded as the
    float64 interpreter evaluates the op, so the IR's meaning (the float64 reference --check holds every pass
    to) is unchanged: folding `0.1 * log2(e)` in float32 moved an LSE by 1.3e-7."""
    if op.name not in ELEMENTWISE or not op.operands:
        return None
    vals = [const_value(v) for v in op.operands]
    if any(v is None for v in vals):
        return None
    rt = op.results[0].type
    if any(isinstance(v, Dim) for v in vals):
        if op.name in _DIM_OPS and rt.dtype == "i32" and rt.is_scalar and _folds_exactly(op.name, vals):
            return [b.const(binop(_DIM_OPS[op.name], dim(vals[0]), dim(vals[1])), rt)]
        return None
    it = Interpreter("f64")
    with np.errstate(all="ignore"):
        y = it.store(it.elementwise(op.name, op, [np.asarray(v) for v in vals], rt), rt)
    value = y.item() if y.size == 1 else None
    if value is None:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    return [b.const(value, rt)]


def identities(op: Op, b: Builder) -> Optional[Sequence[Value]]:
    """x*1, 1*x, x+0, 0+x, x-0, x/1, same-dtype casts: the operand itself, when its type is the result's."""
    rt = op.results[0].type if op.results else None
    n, xs = op.name, op.operands
    cand: Optional[Value] = None
    if n == "mul":
        cand = xs[0] if is_const(xs[1], 1.0) else xs[1] if is_const(xs[0], 1.0) else None
    elif n == "add":  # (a float x + 0.0 is +0.0 at x = -0.0: only + (-0.0) is the identity there)
        zero = _add_identity
        cand = xs[0] if zero(xs[1]) else xs[1] if zero(xs[0]) else None
    elif n in ("sub", "div"):
        cand = xs[0] if is_const(xs[1], 0.0 if n == "sub" else 1.0) else None
    elif n == "cast" and xs[0].type.dtype == op.attrs["to"]:
        cand = xs[0]
    elif n == "where":
        c = const_value(xs[0])
        if isinstance(c, bool):
            cand = xs[1] if c else xs[2]
    if cand is not None and cand.type == rt:
        return [cand]
    return None


def squeeze_pairs(op: Op, b: Builder) -> Optional[Sequence[Value]]:
    """unsqueeze(squeeze(x, a), a) and squeeze(unsqueeze(x, a), a): x (a row max taken with keepdim=False and
    unsqueezed back is the keepdim=True one)."""
    inner = op.operands[0].owner if op.name in ("squeeze", "unsqueeze") else None
    pair = {"squeeze": "unsqueeze", "unsqueeze": "squeeze"}.get(op.name)
    if isinstance(inner, Op) and inner.name == pair and inner.attrs["axis"] == op.attrs["axis"]:
        return [inner.operands[0]]
    return None


PATTERNS = [fold_constants, identities, squeeze_pairs]


@register
@dataclass(frozen=True)
class Canonicalize(Pass):
    """Constant folding, identities, CSE and DCE, to a fixpoint.

    Requires: nothing. Before/after:

        %0 = const 2 : i32                      %1 = mul %x, %y : f32
        %1 = mul %x, %y : f32           =>      return %1
        %2 = mul %x, %y : f32
        %3 = add %2, ... (unused)
        return %1
    """

    name = "canonicalize"
    summary = "constant folding, algebraic identities, CSE and DCE"

    def run(self, func: Func) -> Func:
        for _ in range(20):
            changed = apply_patterns(func, PATTERNS)
            changed |= cse(func)
            changed |= dce(func)
            if not changed:
                break
        return func
