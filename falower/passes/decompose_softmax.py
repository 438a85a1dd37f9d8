"""decompose-softmax: softmax becomes max, subtract, exp, sum and divide, with the fully-masked-row guards."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ..ir.builder import Builder
from ..ir.core import Func, Op, Value
from .base import Pass, register
from .raise_forms import raise_written_forms
from .rewrite import apply_patterns


def decompose(op: Op, b: Builder) -> Optional[Sequence[Value]]:
    if op.name != "softmax":
        return None
    x = op.operands[0]
    axis = op.attrs["axis"]
    dt = x.type.dtype
    m = b.emit("reduce_max", x, axis=axis, name_hint="m")
    neg_inf = b.const(-math.inf, x.type.with_shape(()))
    zero = b.const(0.0, x.type.with_shape(()))
    one = b.const(1.0, x.type.with_shape(()))
    # a row of -inf has max -inf; subtracting it would give NaN, so it subtracts 0 instead
    m_safe = b.emit("where", b.emit("eq", m, neg_inf), zero, m, name_hint="m_safe")
    e = b.emit("exp", b.emit("sub", x, m_safe), name_hint="e")
    l = b.emit("reduce_sum", e, axis=axis, name_hint="l")
    l_safe = b.emit("where", b.emit("eq", l, zero), one, l, name_hint="l_safe")
    p = b.emit("div", e, l_safe, name_hint="p")
    assert p.type.dtype == dt
    return [p]


@register
@dataclass(frozen=True)
class DecomposeSoftmax(Pass):
    """Softmax into its parts, so later passes can tile and rewrite each one.

    Requires: nothing (a graph without softmax is left as it is). A row whose entries are all -inf gives
    0, never NaN: the max is replaced by 0 before subtracting and an empty sum by 1 before dividing. A softmax
    written by hand (exp(x - max) / sum, or exp(x) / sum) is taken as the op first (raise_softmax.py), and so
    gets the guards too; before that, a constant factor on q or k moves onto the score product (raise_scale.py:
    matmul (mul %q, 0.25), %k {transpose_b} => mul (matmul %q, %k {transpose_b}), 0.25).

        %p = softmax %s {axis = 3} : f32[B,H,M,N]
    =>
        %m = reduce_max %s {axis = 3} : f32[B,H,M,1]
        %m_safe = where (eq %m, -inf), 0.0, %m
        %e = exp (sub %s, %m_safe) : f32[B,H,M,N]
        %l = reduce_sum %e {axis = 3} : f32[B,H,M,1]
        %p = div %e, (where (eq %l, 0.0), 1.0, %l) : f32[B,H,M,N]
    """

    name = "decompose-softmax"
    summary = "softmax -> reduce_max, sub, exp, reduce_sum, div (fully masked rows give 0)"
    removes = ("softmax",)

    def run(self, func: Func) -> Func:
        raise_written_forms(func)  # P cast before P @ V, (q * c) @ k^T, a softmax by hand: the ops (raise_forms.py)
        apply_patterns(func, [decompose])
        return func
