"""fuse: the elementwise score function between the two contractions becomes one `fused` region."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value, replace_uses
from ..ir.dims import dim
from ..ir.ops import OPS
from .attention import find_attention
from .base import Pass, register
from .rewrite import dce

ROLE_BY_AXIS = {0: "b", 1: "h", 2: "q", 3: "kv"}


@register
@dataclass(frozen=True)
class Fuse(Pass):
    """Collect the score function (scale, bias, ALiBi, softcap, masks, any elementwise composition) into
    one `fused` op whose region is a closed function of the scores, the indices and captured tensors.

    Requires: a decomposed attention graph (see passes/attention.py): one q @ k^T whose result reaches the
    softmax through elementwise ops, gathers, index iotas and constants only.

        %s = matmul %q, %k {transpose_b} : f32[B,H,M,N]
        %0 = mul %s, %scale : f32[B,H,M,N]
        %1 = ge %q_idx, %kv_idx : bool[1,1,M,N]
        %x = where %1, %0, %ninf : f32[B,H,M,N]
    =>
        %x = fused %s, %q_idx, %kv_idx {roles = ["s", "q", "kv"]} : f32[B,H,M,N] {
        ^(%s_1: f32[B,H,M,N], %q: i32[1,1,M,1], %kv: i32[1,1,1,N]):
          ... the same ops ...
          yield %x_1
        }

    After tiling the same region runs on [bq, bk] tiles: S and P are never whole tensors.
    """

    name = "fuse"
    summary = "the elementwise score function between the two contractions -> one fused region"

    def run(self, func: Func) -> Func:
        if any(op.name == "parallel_for" for op in func.body.ops):  # (after split-kv, the LSE merge's reduce_max
            raise self.fail("the graph is already tiled: fuse runs before tile (as fa2-fwd has it)")  # read as one)
        att = find_attention(func, self.name)
        x_op = att.x.owner
        if isinstance(x_op, Op) and x_op.name == "fused":
            return func  # already fused
        s = att.qk.result
        leaves: list[tuple[Value, str]] = [(s, "s")]
        ops: list[Op] = []
        seen: set[int] = set()

        def visit(v: Value) -> None:
            if any(v is l for l, _ in leaves):
                return
            op = v.owner
            if not isinstance(op, Op):  # a graph input: a captured table, or a captured scalar (0-d)
                if v.owner is not func.body:
                    raise self.fail(f"the score function reads %{v.name}, which is not a captured tensor")
                leaves.append((v, "cap"))
                return
            if op.name == "iota":
                axis = op.attrs["axis"]
                t = op.results[0].type
                if t.rank != 4 or axis not in ROLE_BY_AXIS:
                    raise self.fail(f"index iota along axis {axis} of {t} is not b, h, q or kv")
                if t.shape[axis] != att.x.type.shape[axis] or any(d != dim(1) for i, d in enumerate(t.shape) if i != axis):
                    raise self.fail(f"index iota along axis {axis} of {t}: an index of the scores {att.x.type} runs "
                                    f"along its axis over the whole extent {att.x.type.shape[axis]}, 1 elsewhere")
                leaves.append((v, ROLE_BY_AXIS[axis]))
                return
            if id(op) in seen:
                return
            if not (OPS[op.name].kind == "elementwise" or op.name in ("const", "gather")):
                raise self.fail(f"the score function uses {op.name}, which is not elementwise "
                                f"(only elementwise ops, gathers and index iotas can be fused)")
            seen.add(id(op))
            for o in op.operands:
                visit(o)
            ops.append(op)  # post-order: operands first

        visit(att.x)
        order = [l for l in leaves]
        # a stable order of region arguments: s, b, h, q, kv, then captured tensors as in the signature
        rank = {"s": 0, "b": 1, "h": 2, "q": 3, "kv": 4, "cap": 5}
        order.sort(key=lambda lr: (rank[lr[1]], func.args.index(lr[0]) if lr[1] == "cap" else 0))
        names = {"s": "s", "b": "b", "h": "h", "q": "q", "kv": "kv"}
        region = Block([v.type for v, _ in order], [names.get(r, v.name) for v, r in order])
        vmap = {v: a for (v, _), a in zip(order, region.args)}
        rb = Builder(region)
        for op in ops:
            nop = rb.op(op.name, [vmap[o] for o in op.operands], [r.type for r in op.results], dict(op.attrs),
                        names=[r.name for r in op.results])
            for r, nr in zip(op.results, nop.results):
                vmap[r] = nr
        rb.op("yield", [vmap[att.x]], [])
        fused = Op("fused", [v for v, _ in order], [att.x.type], {"roles": tuple(r for _, r in order)}, [region],
                   ["x"])
        idx = func.body.ops.index(att.m)
        fused.parent = func.body
        func.body.ops.insert(idx, fused)
        operands = list(fused.operands)
        replace_uses(func.body, att.x, fused.result)
        fused.operands = operands  # (a bare q @ k^T is its own score: the fused op still reads it, not itself)
        # the fused op's operands must stay defined: keep them, drop what nobody uses any more
        dce(func)
        _hoist_before_use(func.body)
        return func


def _hoist_before_use(block: Block) -> None:
    """Keep definitions before uses after inserting the fused op (a stable topological order)."""
    ordered: list[Op] = []
    placed: set[int] = set()

    def place(op: Op) -> None:
        if id(op) in placed:
            return
        for v in op.operands:
            d = v.owner
            if isinstance(d, Op) and d.parent is block:
                place(d)
        placed.add(id(op))
        ordered.append(op)

    for op in list(block.ops):
        place(op)
    block.ops = ordered
