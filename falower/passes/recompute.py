"""recompute: the backward keeps LSE and O, not P; every [M, N] value it needs is computed again.

Naive autodiff hands the backward whatever the forward made: P and the scores, [B, H, M, N] each (seed 004
counts what storing and reading them costs). FlashAttention-2 keeps only O and the row statistic
LSE = m + log(l) (seed 001), because P can be recomputed from them (seed 000, step 0):

    P = exp(X - LSE)            X the score function (mask included), recomputed from q, k and the indices

This pass splits the joint function of autodiff at exactly that seam and returns the backward function:
its inputs are the forward's inputs, the saved O and LSE and the cotangents; its results the gradients.
Every forward value the backward read is replaced:
- P (the softmax's result)             by exp(X' - LSE), with X' a recomputed copy of the score function;
- O (P @ V, before its cast)           by the saved output O (cast back to f32);
- anything else computable from the inputs without the softmax's statistics (the scores, the mask, the
  repeated k and v of GQA, a scale) by a recomputed copy;
and anything else (m, l, or a value derived from them other than P) is refused by name. A fully masked
row has LSE = -inf and X' = -inf everywhere: LSE is replaced by 0 there, so P is exp(-inf) = 0, not NaN.

The forward itself is lowered on its own (fa2-fwd): it produces exactly this O and LSE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value, clone_op, uses
from ..ir.types import TensorType
from .attention import _is, decomposed_softmax
from .base import Pass, register
from .rewrite import dce


@dataclass
class Softmax:
    """The decomposed softmax of the forward (decompose-softmax's form)."""

    x: Value  # the scores it normalises
    p: Op
    stats: set[int]  # ids of m, m_safe, e, l, l_safe and the ops between them: what P is made of


def cotangents(func: Func) -> list[Value]:
    """The arguments autodiff added: `d<name>` for a result `<name>` of the function, and for the LSE result raise_lse
    took out of the results (`lse_result`)."""
    names = set(func.result_names) | ({func.attrs["lse_result"]} if "lse_result" in func.attrs else set())
    return [a for a in func.args if a.name and a.name.startswith("d") and a.name[1:] in names]


def backward_ops(func: Func, seeds: list[Value]) -> set[int]:
    """ids of the top-level ops that depend on the cotangents: the backward half of a joint function."""
    dep = {id(v) for v in seeds}
    out: set[int] = set()
    for op in func.body.ops:
        if any(id(v) in dep for v in op.operands):
            out.add(id(op))
            dep |= {id(r) for r in op.results}
    return out


def find_softmax(func: Func, forward: list[Op], fail) -> Softmax:
    maxes = [op for op in forward if op.name == "reduce_max"]
    if any(op.name == "softmax" for op in forward):
        raise fail("the forward still has a softmax op: run decompose-softmax first")
    if len(maxes) != 1:
        raise fail(f"needs one decomposed softmax in the forward, found {len(maxes)} row maxima")
    m = maxes[0]
    if m.attrs["axis"] != m.operands[0].type.rank - 1:
        raise fail(f"the softmax reduces axis {m.attrs['axis']} of {m.operands[0].type}, not the last (kv) axis: the "
                   "saved LSE is one per query row")
    m_safe, sub, e, l, l_safe, p = decomposed_softmax(m, uses(func), fail)
    stat_ops = [m, m_safe, sub, e, l, l_safe, p]
    guards = [_is(op.operands[0], "eq") for op in (m_safe, l_safe)]
    return Softmax(m.operands[0], p, {id(op) for op in stat_ops + guards if op is not None})


@register
@dataclass(frozen=True)
class Recompute(Pass):
    """The joint function => the backward function of FA2: inputs O and LSE instead of stored P.

    Requires: the joint function of autodiff with the softmax decomposed (autodiff, decompose-softmax);
    run delta before it, so that the softmax gradient reads O rather than needing P @ V; no input named like the
    forward's output or `lse` (the backward's own inputs). Every d<input> result is a gradient, also one that does
    not depend on the cotangent (a float table read only by the mask: a constant zero). Before/after:

        func @causal(%q, %k, %v, %do) -> (o, dq, dk, dv) {
          %x = where %mask, (div (matmul %q, %k {transpose_b}), %c), -inf
          ... %p = div %e, %l_safe ...  %o32 = matmul %p, %v ...
          %dv32 = matmul %p, %g {transpose_a}
    =>
        func @causal(%q, %k, %v, %o, %lse, %do) -> (dq, dk, dv) {
          %x = where %mask, (div (matmul %q, %k {transpose_b}), %c), -inf      recomputed
          %lse_row = unsqueeze %lse {axis = 3};  %p = exp (sub %x, where(%lse_row == -inf, 0, %lse_row))
          %dv32 = matmul %p, %g {transpose_a}
    """

    name = "recompute"
    summary = "joint function -> the FA2 backward: keep O and LSE, recompute P = exp(X - LSE) and the scores"

    def run(self, func: Func) -> Func:
        cots = cotangents(func)
        if not cots:
            raise self.fail("no cotangent inputs (d<output>): the graph is not a joint function; run autodiff first")
        bwd = backward_ops(func, cots)
        forward = [op for op in func.body.ops if id(op) not in bwd and op.name != "return"]
        sm = find_softmax(func, forward, self.fail)
        names = func.result_names
        rets = func.results
        inputs = {a.name for a in func.args if a not in cots}
        # a gradient is a result that depends on a cotangent, or one named d<input> that does not: a table read only
        # by a mask gets a constant zero gradient
        dep_results = [i for i, v in enumerate(rets) if isinstance(v.owner, Op) and id(v.owner) in bwd
                       or names[i][:1] == "d" and names[i][1:] in inputs]
        fwd_results = [i for i in range(len(rets)) if i not in dep_results]
        if len(fwd_results) != 1:
            raise self.fail(f"expected one forward output (the attention O), found {len(fwd_results)}")
        out = rets[fwd_results[0]]
        o32 = _pv_result(out)
        if o32 is None:
            raise self.fail("the forward output must be P @ V or a cast of it (O is saved for the backward)")

        if names[fwd_results[0]] == "lse":  # two arguments %lse, O and the LSE: the backend takes them by name
            raise self.fail("the forward's output is named 'lse', the name the backward gives its LSE input: rename "
                            "the result (result_names)")
        plain = [a for a in func.args if a not in cots]
        taken = [a.name for a in plain if a.name in (names[fwd_results[0]], "lse")]
        if taken:
            raise self.fail(f"an input is named %{taken[0]}, a name the backward gives its own input (the forward's "
                            f"output {names[fwd_results[0]]!r} and lse): rename the captured tensor")
        o_t, lse_t = out.type, TensorType(sm.x.type.dtype, sm.x.type.shape[:-1])
        arg_types = [a.type for a in plain] + [o_t, lse_t] + [a.type for a in cots]
        arg_names = [a.name for a in plain] + [names[fwd_results[0]], "lse"] + [a.name for a in cots]
        body = Block(arg_types, arg_names)
        b = Builder(body)
        vmap: dict[Value, Value] = dict(zip(plain, body.args))
        vmap.update(zip(cots, body.args[len(plain) + 2:]))
        o_in, lse_in = body.args[len(plain)], body.args[len(plain) + 1]

        def need(v: Value) -> Value:
            """The backward function's value for the forward value `v` (recomputed on first use)."""
            if v in vmap:
                return vmap[v]
            op = v.owner
            assert isinstance(op, Op)
            if op is sm.p:
                x = need(sm.x)
                row = b.emit("unsqueeze", lse_in, axis=lse_in.type.rank, name_hint="lse_row")
                inf = b.const(-math.inf, TensorType(row.type.dtype, ()))
                safe = b.emit("where", b.emit("eq", row, inf), b.const(0.0, TensorType(row.type.dtype, ())), row,
                              name_hint="lse_safe")
                vmap[v] = b.emit("exp", b.emit("sub", x, safe), name_hint="p")
            elif v is o32:
                vmap[v] = o_in if o_in.type == v.type else b.cast(o_in, v.type.dtype)
            elif id(op) in sm.stats:
                raise self.fail(f"the backward reads the softmax's {op.name} result %{v.name or '?'}: only P "
                                f"(recomputed from LSE) and O may cross from the forward")
            else:
                for operand in op.operands:
                    need(operand)
                body.append(clone_op(op, vmap))
            return vmap[v]

        for op in func.body.ops:
            if id(op) not in bwd or op.name == "return":
                continue
            for v in op.operands:
                if v not in vmap:
                    need(v)
            body.append(clone_op(op, vmap))
        grads = [need(rets[i]) for i in dep_results]
        b.ret(*grads)
        new = Func(func.name, body, dict(func.attrs))
        new.attrs["result_names"] = [names[i] for i in dep_results]
        dce(new)
        return new


def _pv_result(out: Value) -> Optional[Value]:
    """O before its cast: the result of P @ V."""
    cur = out
    while True:
        op = cur.owner
        if not isinstance(op, Op):
            return None
        if op.name == "matmul":
            return cur
        if op.name != "cast":
            return None
        cur = op.operands[0]
