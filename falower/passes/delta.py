"""delta: the softmax gradient's row sum over kv becomes a row sum over the head dim (FA2's Delta).

The softmax rule of autodiff computes, for P = softmax(X) and the cotangent dP of P,

    dX = P * (dP - rowsum(P * dP))

and under attention dP = G @ V^T, where G is the cotangent of O = P @ V. Then, row by row,

    rowsum(P * dP)_i = sum_j P_ij sum_d G_id V_jd = sum_d G_id sum_j P_ij V_jd = rowsum(G * O)_i

(seed 000, step 1). The pass proves the identity by matching the IR — the row sum multiplies P by a
matmul G @ V^T whose V is the very value the forward's O = P @ V contracts with — and rewrites an
[M, N] reduction into an [M, D] one that no longer needs P: Delta, computed once before the main loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value, replace_uses
from .attention import _is
from .base import Pass, register
from .rewrite import dce


@dataclass
class DeltaMatch:
    rowsum: Op  # reduce_sum (P * dP) over kv
    g: Value  # the cotangent of O
    o: Value  # O = P @ V, the forward's value contraction


def _as_pv_grad(dp: Value, p: Value, pv_by_operands: dict[tuple[int, int], Op]) -> Optional[tuple[Value, Value]]:
    """(G, O) when dP = G @ V^T and O = P @ V is in the function."""
    mm = _is(dp, "matmul")
    if mm is None or not mm.attrs.get("transpose_b") or mm.attrs.get("transpose_a"):
        return None
    g, v = mm.operands
    pv = pv_by_operands.get((id(p), id(_uncast(v))))
    return None if pv is None else (g, pv.results[0])


def _uncast(v: Value) -> Value:
    """V and a cast of V are the same matrix here (autodiff may contract in f32)."""
    while (c := _is(v, "cast")) is not None:
        v = c.operands[0]
    return v


def find_delta(func: Func) -> list[DeltaMatch]:
    """Every `reduce_sum(P * (G @ V^T))` over the last axis with O = P @ V in the same function."""
    pvs = {(id(op.operands[0]), id(_uncast(op.operands[1]))): op for op in func.body.ops
           if op.name == "matmul" and not op.attrs.get("transpose_a") and not op.attrs.get("transpose_b")}
    found = []
    for op in func.body.ops:
        if op.name != "reduce_sum" or op.attrs["axis"] != op.operands[0].type.rank - 1:
            continue
        mul = _is(op.operands[0], "mul")
        if mul is None:
            continue
        a, b = mul.operands
        for p, dp in ((a, b), (b, a)):
            go = _as_pv_grad(dp, p, pvs)
            if go is not None:
                found.append(DeltaMatch(op, *go))
                break
    return found


@register
@dataclass(frozen=True)
class Delta(Pass):
    """rowsum(P * dP) with dP = dO @ V^T and O = P @ V  =>  rowsum(dO * O): Delta, an [M, D] reduction.

    Requires: the joint function of autodiff (a softmax gradient under attention). Before/after (causal):

        %o = matmul %p, %v : f32[B,H,M,D]
        %dp = matmul %g, %v {transpose_b} : f32[B,H,M,N]
        %pdp = mul %p, %dp : f32[B,H,M,N]
        %r = reduce_sum %pdp {axis = 3} : f32[B,H,M,1]
    =>
        %go = mul %g, %o : f32[B,H,M,D]
        %delta = reduce_sum %go {axis = 3} : f32[B,H,M,1]
    """

    name = "delta"
    summary = "softmax gradient: rowsum(P * dP) over kv -> Delta = rowsum(dO * O) over the head dim (FA2)"

    def run(self, func: Func) -> Func:
        matches = find_delta(func)
        if not matches:
            has_rows = any(op.name == "reduce_sum" for op in func.body.ops)
            if has_rows:  # a backward function, but not one attention's: P used otherwise than in one P @ V
                raise self.fail("no softmax gradient under attention to rewrite: its row sums are not of "
                                "P * (dO @ V^T) with O = P @ V (the backward takes one softmax whose P feeds one "
                                "P @ V and nothing else: no dropout on P, no P used twice, no second softmax; a softmax "
                                "written out must be one autodiff recognizes: README 'Writing attention')")
            raise self.fail("no softmax gradient under attention to rewrite (it has no row sum): run autodiff "
                            "first")
        for m in matches:
            scratch = Block()
            b = Builder(scratch)
            go = b.emit("mul", m.g, m.o, name_hint="do_o")
            delta = b.emit("reduce_sum", go, axis=go.type.rank - 1, name_hint="delta")
            # right after O and G exist; the row sum it replaces depends on both, so it comes later
            deps = [x.owner for x in (m.g, m.o) if isinstance(x.owner, Op) and x.owner.parent is func.body]
            at = max((func.body.ops.index(op) for op in deps), default=-1) + 1
            for op in scratch.ops:
                op.parent = func.body
            func.body.ops[at:at] = scratch.ops
            replace_uses(func.body, m.rowsum.results[0], delta)
        dce(func)
        return func
