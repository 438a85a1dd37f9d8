"""A softmax written by hand, found and made the softmax op: what decompose-softmax and autodiff do first.

Users write attention as tensor code, and many write the softmax out: `e = exp(s - s.amax(-1)); p = e / e.sum(-1)`,
or without the max, or with decompose-softmax's own guards (an IR dump fed back to fa2-fwd). fuse, delta and recompute match
the softmax op's decomposition, guards included, so these forms were refused ('reduce_max is not followed by the max
guard', 'no softmax gradient'). `raise_softmax` replaces each one by `softmax x {axis}`:

    %m = reduce_max %x {axis = 3};  %e = exp (sub %x, %m);  %l = reduce_sum %e {axis = 3};  %p = div %e, %l
    =>  %p = softmax %x {axis = 3}

Also e * (1 / l), exp2 in place of exp (softmax(x ln 2)), and the rows normalized after the product: (e @ v) / l
becomes softmax(x) @ v.

The same numbers wherever a row has a finite entry; a row that is -inf everywhere (a fully masked one) gives 0 as the
softmax op defines it, where the hand-written form gives NaN (exp(-inf + inf)), and a form without the max subtraction
no longer overflows exp.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from ..ir.builder import Builder
from ..ir.core import Func, Op, Value
from .attention import _guard, _is
from .canonicalize import is_const, squeeze_pairs
from .rewrite import apply_patterns, dce


def _unguarded(v: Value, cmp_value: float, repl: float) -> Value:
    """v's inner value where v = where(inner == cmp_value, repl, inner) (decompose-softmax's guards, attention's
    `_guard`), else v."""
    w = _is(v, "where")
    return w.operands[2] if w is not None and _guard(v, cmp_value, repl, w.operands[2]) else v


def _exp_of_row(e: Value, axis: int) -> Optional[tuple[Value, bool]]:
    """(x, base 2) where e = exp(x - max(x, axis)) or exp2(...) (the max guarded or not), or e = exp(x) / exp2(x);
    else None."""
    ex = _is(e, "exp") or _is(e, "exp2")
    if ex is None:
        return None
    arg, two = ex.operands[0], ex.name == "exp2"
    sub = _is(arg, "sub")
    if sub is not None:
        x, m = sub.operands
        rm = _is(_unguarded(m, -math.inf, 0.0), "reduce_max")
        if rm is not None and rm.operands[0] is x and rm.attrs["axis"] == axis:
            return x, two
    return arg, two


def _row_sum_of(den: Value, e: Value) -> Optional[Op]:
    """The reduce_sum of e that `den` is (guarded or not)."""
    rs = _is(_unguarded(den, 0.0, 1.0), "reduce_sum")
    return rs if rs is not None and rs.operands[0] is e else None


def _softmax_of(b: Builder, e: Value, axis: int, like: Value) -> Optional[Value]:
    """softmax(x) (or softmax(x ln 2) for base 2) where e is `_exp_of_row`'s, typed as `like`; else None."""
    found = _exp_of_row(e, axis)
    if found is None:
        return None
    x, two = found
    if x.type.shape != like.type.shape or x.type.dtype != like.type.dtype:
        return None
    if two:  # 2^y / sum 2^y = softmax(y ln 2)
        x = b.emit("mul", x, b.const(math.log(2.0), x.type.with_shape(())))
    return b.emit("softmax", x, axis=axis)


def _softmax_pattern(op: Op, b: Builder, guarded: bool = True) -> Optional[Sequence[Value]]:
    """div(e, sum(e, axis)) with e = exp(x - max(x, axis)) or exp(x), sums and maxima guarded (`guarded`) or not."""
    if op.name != "div":
        return None
    e, den = op.operands
    if not guarded and _unguarded(den, 0.0, 1.0) is not den:
        return None  # decompose-softmax's own form: autodiff has its rules (and softmax may be lowered away)
    rs = _row_sum_of(den, e)
    if rs is None:
        return None
    p = _softmax_of(b, e, rs.attrs["axis"], op.results[0])
    return None if p is None else [p]


def _reciprocal_pattern(op: Op, b: Builder) -> Optional[Sequence[Value]]:
    """e * (1 / sum(e)) (either order): the same softmax as e / sum(e)."""
    if op.name != "mul":
        return None
    for e, r in (op.operands, op.operands[::-1]):
        inv = _is(r, "div")
        if inv is not None and is_const(inv.operands[0], 1.0):
            rs = _row_sum_of(inv.operands[1], e)
            if rs is not None:
                p = _softmax_of(b, e, rs.attrs["axis"], op.results[0])
                if p is not None:
                    return [p]
    return None


def _normalized_after_pv_pattern(op: Op, b: Builder) -> Optional[Sequence[Value]]:
    """(e @ v) / sum(e) with the sum over e's last axis: softmax(x) @ v, the row sums dividing O's rows."""
    if op.name != "div":
        return None
    pv, den = op.operands
    mm = _is(pv, "matmul")
    if mm is None or mm.attrs.get("transpose_a"):
        return None
    e = mm.operands[0]
    rs = _row_sum_of(den, e)
    if rs is None or rs.attrs["axis"] != e.type.rank - 1:
        return None
    p = _softmax_of(b, e, rs.attrs["axis"], e)
    if p is None:
        return None
    out = b.emit("matmul", p, mm.operands[1], **mm.attrs)
    return [out] if out.type == op.results[0].type else None


def raise_softmax(func: Func, guarded: bool = True) -> bool:
    """Every hand-written softmax of `func` made the softmax op (module docstring); with `guarded` False, not
    decompose-softmax's own guarded form (autodiff: its rules take that one, after the op is lowered away). True if
    any was."""
    changed = apply_patterns(func, [squeeze_pairs, lambda op, b: _softmax_pattern(op, b, guarded),
                                    _reciprocal_pattern, _normalized_after_pv_pattern])
    if changed:
        dce(func)
    return changed
