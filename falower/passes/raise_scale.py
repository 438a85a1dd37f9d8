"""A constant factor on a product's operand moved onto the product: (q * c) @ k^T becomes (q @ k^T) * c.

Much attention code scales q (or k) before the score product (`q = q * self.scale`). fuse takes q, k and v as the
graph's inputs and the scale as part of the score function, so the forward refused those graphs ('q must be a graph
input ... computed by mul'). decompose-softmax, which starts the forward pipelines, moves such a factor first:

    %qs = mul %q, 0.25 : f16[B,H,M,D];  %s = matmul %qs, %k {transpose_b}
    =>  %s0 = matmul %q, %k {transpose_b};  %s = mul %s0, 0.25

The same product in exact arithmetic; the factor now multiplies f32 scores where it multiplied the f16 inputs (exact
for a power of two; otherwise one rounding moves, well inside f16's error).
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..ir.builder import Builder
from ..ir.core import Func, Op, Value
from ..ir.types import is_float
from .canonicalize import const_value
from .rewrite import apply_patterns, dce


def _scaled_input(v: Value) -> Optional[tuple[Value, float]]:
    """(x, c) where v = x * c or c * x with x a graph input (q, k: a block argument) and c a scalar float constant."""
    op = v.owner
    if not isinstance(op, Op) or op.name != "mul":
        return None
    for x, c in (op.operands, op.operands[::-1]):
        cv = const_value(c)
        if not isinstance(x.owner, Op) and c.type.rank == 0 and isinstance(cv, float) and x.type.dtype == v.type.dtype:
            return x, cv
    return None


def _score_products(func: Func) -> set[int]:
    """The products whose result a softmax reads, through elementwise ops: q @ k^T (a joint function's backward
    products read other values and stay as they are)."""
    out: set[int] = set()
    for sm in [op for op in func.walk() if op.name == "softmax"]:
        stack, seen = [sm.operands[0]], set()
        while stack:
            v = stack.pop()
            op = v.owner
            if not isinstance(op, Op) or id(op) in seen:
                continue
            seen.add(id(op))
            if op.name == "matmul":
                out.add(id(op))
            elif op.name in ("where", "cast", "mul", "add", "sub", "div", "neg", "tanh", "tanh_approx", "exp", "fused"):
                stack.extend(op.operands)
    return out


def _pattern(op: Op, b: Builder, scores: set[int]) -> Optional[Sequence[Value]]:
    if op.name != "matmul" or id(op) not in scores or not op.attrs.get("transpose_b") \
            or not is_float(op.results[0].type.dtype):
        return None  # the score product q @ k^T only (a factor on v scales O: fuse says so)
    operands, factor = list(op.operands), 1.0
    for i, v in enumerate(op.operands):  # q's and k's factors both (q * a) @ (k * b)^T = (q @ k^T) * (a b)
        found = _scaled_input(v)
        if found is not None:
            operands[i], factor = found[0], factor * found[1]
    if operands == list(op.operands):
        return None
    s = b.op("matmul", operands, [op.results[0].type], dict(op.attrs)).results[0]
    return [b.emit("mul", s, b.const(factor, op.results[0].type.with_shape(())))]


def raise_scale(func: Func) -> bool:
    """Every constant factor on a graph input that a score product (q @ k^T, read by a softmax) reads, moved onto the
    product; True if any was."""
    scores = _score_products(func)
    if not scores:
        return False
    changed = apply_patterns(func, [lambda op, b: _pattern(op, b, scores)], max_rounds=1)
    if changed:
        dce(func)
    return changed
