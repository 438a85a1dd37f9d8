"""A cast of a product's f32 operand to the other operand's f16 / bf16, taken into the product: what torch code does
when P is cast before P @ V.

`p = softmax(s).to(q.dtype); o = p @ v` (torch's softmax of f16 scores is f16 itself) rounds P to f16 for the product,
which is what the kernels' tensor cores do anyway. fuse wants the softmax to feed P @ V directly, so the forward
refused the form ('the softmax result must feed a matmul P @ V'), and delta did not find dV = P^T dO. The product says
it instead (`operand_dtype`, which the native interpreter rounds both operands to):

    %p16 = cast %p {to = "f16"} : f16[B,H,M,N];  %o = matmul %p16, %v : f32[B,H,M,D]
    =>  %o = matmul %p, %v {operand_dtype = "f16"} : f32[B,H,M,D]

The raise itself keeps the numbers at every precision: native rounds P to f16 in both, f64 in neither. (A softmax
written by hand and normalized after the product, `(e.to(f16) @ v) / l`, then becomes softmax(x) @ v by
raise_softmax, which rounds P = e / l where the written form rounded e: in f16 an unnormalized e overflows past a
score of ~11 without the max subtracted, P does not.) decompose-softmax, autodiff and --check's reference run it
first (raise_forms.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..ir.builder import Builder
from ..ir.core import Func, Op, Value
from ..ir.ops import TENSOR_CORE_DTYPES
from .rewrite import apply_patterns, dce


def _narrowed(v: Value, to: str) -> Optional[Value]:
    """x where v = cast(x: f32) to `to`, else None."""
    op = v.owner
    if isinstance(op, Op) and op.name == "cast" and op.operands[0].type.dtype == "f32" and v.type.dtype == to:
        return op.operands[0]
    return None


def _pattern(op: Op, b: Builder) -> Optional[Sequence[Value]]:
    if op.name != "matmul" or "operand_dtype" in op.attrs:
        return None
    a, c = op.operands
    for i, (x, other) in enumerate(((a, c), (c, a))):
        to = other.type.dtype
        wide = _narrowed(x, to) if to in TENSOR_CORE_DTYPES else None
        if wide is not None:
            operands = [wide, other] if i == 0 else [other, wide]
            attrs = {**op.attrs, "operand_dtype": to}
            return [b.op("matmul", operands, [op.results[0].type], attrs).results[0]]
    return None


def raise_operand_cast(func: Func) -> bool:
    """Every product of an f32 value cast to the other operand's f16 / bf16, taken as the product of the f32 value
    with `operand_dtype`; True if any was."""
    changed = apply_patterns(func, [_pattern], max_rounds=1)
    if changed:
        dce(func)
    return changed
