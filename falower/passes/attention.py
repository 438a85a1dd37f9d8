"""Recognising attention in a graph: the shared precondition of fuse, tile and online-softmax.

After decompose-softmax an attention graph has this shape (names are what `find_attention` returns):

    s   = matmul q, k {transpose_b}            the score contraction over D
    x   = <elementwise ops of s, indices, captured tensors>      the score function
    m   = reduce_max x {axis = kv};  m_safe = where(m == -inf, 0, m)
    e   = exp(x - m_safe);  l = reduce_sum e {axis = kv};  l_safe = where(l == 0, 1, l)
    p   = div e, l_safe
    o   = matmul p, v                          the value contraction over kv
    out = <elementwise ops of o>               (a cast to the output dtype)

Each check that fails raises a PassError that says which part of this shape is missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..errors import PassError
from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value, uses
from ..ir.dims import Dim
from ..ir.ops import OPS, OpTypeError
from .canonicalize import is_const


@dataclass
class Attention:
    qk: Op  # matmul q, k
    q: Value  # func argument
    k: Value  # func argument (the un-repeated one under GQA)
    v: Value
    group: int  # query heads per kv head
    x: Value  # the score function's result (what the softmax normalises)
    m: Op
    m_safe: Op
    e: Op
    l: Op
    l_safe: Op
    p: Op
    pv: Op
    out_chain: list[Op]  # elementwise ops from the pv result to the returned value
    ret_index: int


def _def(v: Value) -> Optional[Op]:
    return v.owner if isinstance(v.owner, Op) else None


def _is(v: Value, name: str) -> Optional[Op]:
    op = _def(v)
    return op if op is not None and op.name == name else None


def _guard(v: Value, cmp_value: float, repl: float, inner: Value) -> bool:
    """v == where(inner == cmp_value, repl, inner)"""
    w = _is(v, "where")
    if w is None:
        return False
    c, a, b = w.operands
    eq = _is(c, "eq")
    return eq is not None and b is inner and is_const(a, repl) and eq.operands[0] is inner and \
        is_const(eq.operands[1], cmp_value)


def _input(v: Value, who: str, fail) -> tuple[Value, int]:
    """A matmul operand must be a graph input, optionally repeated over heads (GQA)."""
    group = 1
    r = _is(v, "repeat_interleave")
    if r is not None:
        if r.attrs["axis"] != 1:
            raise fail(f"{who} is repeated along axis {r.attrs['axis']}; only head repetition (axis 1, GQA) is supported")
        group = r.attrs["repeats"]
        v = r.operands[0]
    if not isinstance(v.owner, Block) or v.owner.parent is not None:
        raise fail(f"{who} must be a graph input (optionally repeat_interleave'd over heads), "
                   f"but it is computed by {_def(v).name if _def(v) else '?'}")
    if v.type.rank != 4:
        raise fail(f"{who} must have rank 4 [B, H, seq, D], got {v.type}")
    return v, group


def find_attention(func: Func, who: str) -> Attention:
    """Find the one attention in `func` (see the module docstring); `who` names the pass asking."""

    def fail(msg: str) -> PassError:
        return PassError(f"pass {who}: {msg}")

    if any(op.name == "softmax" for op in func.walk()):
        raise fail("the graph still has a softmax op: run decompose-softmax first")
    ret = func.body.terminator
    assert ret is not None
    divs = [op for op in func.body.ops if op.name == "reduce_max"]
    if not divs:
        raise fail("no softmax found (no reduce_max): " + _what_reduces(func))
    if len(divs) > 1:
        raise fail(f"found {len(divs)} softmax-like reductions; one attention per graph is supported")
    m = divs[0]
    x = m.operands[0]
    axis = m.attrs["axis"]
    if x.type.rank != 4 or axis != 3:
        raise fail(f"the softmax reduces axis {axis} of {x.type}; only a softmax over the kv axis (the last "
                   f"axis of [B, H, M, N] scores) can be tiled")
    if x.type.dtype not in ("f32", "f64"):
        raise fail(f"the softmax's scores are {x.type.dtype}: the tiled softmax keeps its row max and sum in f32 "
                   f"or f64; compute the scores in f32 (q @ k^T gives f32) and cast after P @ V")
    users = uses(func)
    m_safe, sub, e, l, l_safe, p = decomposed_softmax(m, users, fail)
    pv = _single_user(users, p.result, "matmul")
    if pv is None or pv.operands[0] is not p.result or pv.attrs.get("transpose_a") or pv.attrs.get("transpose_b"):
        raise fail("the softmax result must feed a matmul P @ V (the value contraction over kv)")
    v, gv = _input(pv.operands[1], "v", fail)
    # the score function: walk up from x to the one matmul it depends on
    qk = _score_matmul(x, fail)
    if not qk.attrs.get("transpose_b") or qk.attrs.get("transpose_a"):
        raise fail("the score contraction must be q @ k^T (matmul with transpose_b)")
    q, gq = _input(qk.operands[0], "q", fail)
    k, gk = _input(qk.operands[1], "k", fail)
    refuse_whole_captures(func, {q, k, v}, fail)
    if gq != 1:
        raise fail("q must not be repeated")
    if gk != gv:
        raise fail(f"k and v are repeated differently over heads ({gk} vs {gv})")
    chain: list[Op] = []
    cur = pv.result
    while True:
        us = users.get(cur, [])
        if len(us) != 1:
            raise fail("the attention output must be used once (by the return or one elementwise op)")
        u = us[0]
        if u.name == "return":
            break
        if OPS[u.name].kind != "elementwise" or len(u.operands) != 1:
            raise fail(f"only unary elementwise ops (a cast) may follow P @ V, found {u.name}")
        chain.append(u)
        cur = u.result
    ret_index = ret.operands.index(cur)
    if len(ret.operands) != 1:
        raise fail("the graph must return only the attention output")
    return Attention(qk, q, k, v, gk, x, m, m_safe, e, l, l_safe, p, pv, chain, ret_index)


def refuse_whole_captures(func: Func, inputs: set, fail, head_dim: Optional[Dim] = None) -> None:
    """A captured tensor of rank >= 1 the graph uses whole (`where(keep, s, -inf)`, `s + bias` with bias [M, N]),
    not read by a gather at the element's indices: the tiled kernels read captured tables by index, so say how
    (the tiling passes once failed on it with a broadcast error or a KeyError). A [B, H, N, D] argument (D the
    products' head dim) used whole is an attention input transformed before its product (`v * 2`, `tanh(k)`)."""
    for op in func.walk():
        for i, v in enumerate(op.operands):
            if v in func.args and v not in inputs and v.type.rank >= 1 and not (op.name == "gather" and i == 0) \
                    and op.name != "fused":  # (a fused score function reads it through its region's gathers)
                if head_dim is not None and v.type.rank == 4 and v.type.shape[3] == head_dim:
                    raise fail(f"%{v.name} ({v.type}) reaches the products through {op.name}: the kernels read q, k "
                               f"and v as the products' operands; apply the {op.name} to %{v.name} before the call")
                raise fail(f"captured tensor %{v.name} ({v.type}) is used whole by {op.name}; the kernels read "
                           f"captured tables by index: write {v.name}[..., q_idx, kv_idx] (in a score_mod or mask_mod)")


def decomposed_softmax(m: Op, users: dict[Value, list[Op]], fail) -> tuple[Op, Op, Op, Op, Op, Op]:
    """From a row max `m = reduce_max x`, the rest of decompose-softmax's form: (m_safe, x - m_safe, e, l,
    l_safe, p = e / l_safe). `fail(msg)` makes the asking pass's error for the part that is missing."""
    x, axis = m.operands[0], m.attrs["axis"]
    m_safe = next((u for u in users.get(m.result, []) if u.name == "where" and _guard(u.result, -math.inf, 0.0, m.result)), None)
    if m_safe is None:
        raise fail("reduce_max is not followed by the max guard of a decomposed softmax: run decompose-softmax, or, "
                   "if it ran, this row max is not part of a softmax it recognizes (exp(x - max) / sum over one axis; "
                   "README 'Writing attention' lists the forms)")
    sub = next((u for u in users.get(x, []) if u.name == "sub" and u.operands == [x, m_safe.result]), None)
    e = _single_user(users, sub.result, "exp") if sub is not None else None
    if sub is None or e is None:
        raise fail("no exp(x - max) after the row max: the reduction is not part of a softmax")
    l = _single_user(users, e.result, "reduce_sum")
    if l is None or l.attrs["axis"] != axis:
        raise fail("no row sum of exp(x - max) over the same axis: the reduction is not part of a softmax")
    l_safe = next((u for u in users.get(l.result, []) if u.name == "where" and _guard(u.result, 0.0, 1.0, l.result)), None)
    p = next((u for u in users.get(e.result, []) if u.name == "div"), None)
    if l_safe is None or p is None or p.operands != [e.result, l_safe.result]:
        raise fail("exp(x - max) is not divided by its row sum: the reduction is not part of a softmax")
    return m_safe, sub, e, l, l_safe, p


def the_parallel_for(func: Func, fail, hint: str) -> Op:
    """The one parallel_for of a tiled graph; `fail(msg)` makes the calling pass's error."""
    pf = [op for op in func.body.ops if op.name == "parallel_for"]
    if len(pf) != 1:
        raise fail(f"needs a tiled graph (one parallel_for), found {len(pf)}: {hint}")
    if len(pf[0].attrs["bounds"]) > 3:  # split-kv's (part, b, h, q tile): its parts are merged after the nest
        raise fail(f"needs the parallel_for over (b, h, q tile), found one over {len(pf[0].attrs['bounds'])} axes "
                   "(split-kv's parts): run split-kv last")
    return pf[0]


def _what_reduces(func: Func) -> str:
    red = [op.name for op in func.walk() if op.name in ("reduce_sum", "reduce_max")]
    return f"the graph reduces with {', '.join(red)} but not as a softmax" if red else "the graph has no reduction"


def _single_user(users, v: Value, name: str) -> Optional[Op]:
    us = [u for u in users.get(v, []) if u.name == name]
    if len(us) != 1:
        return None
    return us[0]


def _score_matmul(x: Value, fail) -> Op:
    found: list[Op] = []
    seen: set[int] = set()
    stack = [x]
    while stack:
        v = stack.pop()
        op = _def(v)
        if op is None or id(op) in seen:
            continue
        seen.add(id(op))
        if op.name == "matmul":
            found.append(op)
            continue
        if op.name in ("reduce_max", "reduce_sum", "softmax"):
            raise fail(f"the score function uses {op.name}, which is not elementwise")
        stack.extend(op.operands)
    if len(found) != 1:
        raise fail(f"the scores must come from exactly one matmul q @ k^T, found {len(found)}")
    return found[0]


def retype_block(block: Block, arg_types: list, keep_types_of: tuple[str, ...] = ("const",)) -> Block:
    """A copy of an elementwise region with new argument types; every op's type is inferred again.

    This is what moves a score function from whole tensors ([B,H,M,N]) to tiles ([64,64]) or scalars.
    """
    new = Block(list(arg_types), [a.name for a in block.args])
    vmap: dict[Value, Value] = dict(zip(block.args, new.args))
    b = Builder(new)
    for op in block.ops:
        operands = [vmap[v] for v in op.operands]
        if op.name == "yield":
            b.op("yield", operands, [])
            continue
        if op.name in keep_types_of:
            nop = b.op(op.name, operands, [r.type for r in op.results], dict(op.attrs), names=[r.name for r in op.results])
        else:
            attrs = dict(op.attrs)
            try:
                types = OPS[op.name].infer([v.type for v in operands], attrs)  # type: ignore[misc]
            except OpTypeError as e:
                raise PassError(f"cannot move {op.name} to tiles: {e}") from None
            nop = b.op(op.name, operands, types, attrs, names=[r.name for r in op.results])
        for r, nr in zip(op.results, nop.results):
            vmap[r] = nr
    return new
