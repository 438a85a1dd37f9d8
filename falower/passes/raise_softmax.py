"""A softmax written by hand, found and made the softmax op: what decompose-softmax and autodiff do first.

Users write attention as tensor code, and many write the softmax out: `e = exp(s - s.amax(-1)); p = e / e.sum(-1)`,
or without the max, or with decompose-softmax's own guards (an IR dump fed back to fa2-fwd). fuse, delta and recompute match
the softmax op's decomposition, guards included, so these forms were refused ('reduce_max is not followed by the max
guard', 'no softmax gradient'). `raise_softmax` replaces each one by `softmax x {axis}`:

    %m = reduce_max %x {axis = 3};  %e = exp (sub %x, %m);  %l = reduce_sum %e {axis = 3};  %p = div %e, %l
    =>  %p = softmax %x {axis = 3}

The same numbers wherever a row has a finite entry; a row that is -inf everywhere (a fully masked one) gives 0 as the
softmax op defines it, where the hand-written form gives NaN (exp(-inf + inf)), and a form without the max subtraction
no longer overflows exp.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from ..ir.builder import Builder
from ..ir.core import Func, Op, Value
from .canonicalize import is_const
from .rewrite import apply_patterns, dce


def _is(v: Value, name: str) -> Optional[Op]:
    return v.owner if isinstance(v.owner, Op) and v.owner.name == name else None


def _unguarded(v: Value, cmp_value: float, repl: float) -> Value:
    """v's inner value where v = where(inner == cmp_value, repl, inner) (decompose-softmax's guards), else v."""
    w = _is(v, "where")
    if w is None:
        return v
    c, a, inner = w.operands
    eq = _is(c, "eq")
    if eq is not None and eq.operands[0] is inner and is_const(eq.operands[1], cmp_value) and is_const(a, repl):
        return inner
    return v


def _exp_of_row(e: Value, axis: int) -> Optional[Value]:
    """x where e = exp(x - max(x, axis)) (the max guarded or not) or e = exp(x); else None."""
    ex = _is(e, "exp")
    if ex is None:
        return None
    arg = ex.operands[0]
    sub = _is(arg, "sub")
    if sub is not None:
        x, m = sub.operands
        rm = _is(_unguarded(m, -math.inf, 0.0), "reduce_max")
        if rm is not None and rm.operands[0] is x and rm.attrs["axis"] == axis:
            return x
    return arg


def _softmax_pattern(op: Op, b: Builder, guarded: bool = True) -> Optional[Sequence[Value]]:
    """div(e, sum(e, axis)) with e = exp(x - max(x, axis)) or exp(x), sums and maxima guarded (`guarded`) or not."""
    if op.name != "div":
        return None
    e, den = op.operands
    if not guarded and _unguarded(den, 0.0, 1.0) is not den:
        return None  # decompose-softmax's own form: autodiff has its rules (and softmax may be lowered away)
    rs = _is(_unguarded(den, 0.0, 1.0), "reduce_sum")
    if rs is None or rs.operands[0] is not e:
        return None
    axis = rs.attrs["axis"]
    x = _exp_of_row(e, axis)
    if x is None or x.type.shape != op.results[0].type.shape or x.type.dtype != op.results[0].type.dtype:
        return None
    return [b.emit("softmax", x, axis=axis)]


def raise_softmax(func: Func, guarded: bool = True) -> bool:
    """Every hand-written softmax of `func` made the softmax op (module docstring); with `guarded` False, not
    decompose-softmax's own guarded form (autodiff: its rules take that one, after the op is lowered away). True if
    any was."""
    changed = apply_patterns(func, [lambda op, b: _softmax_pattern(op, b, guarded)])
    if changed:
        dce(func)
    return changed
