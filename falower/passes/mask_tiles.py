"""mask-tiles: classify (q tile, kv tile) pairs as empty, partial or full, and act on it.

From the mask in the score function (the `where(pred, x, -inf)` wrapped around it, the kv bounds
included) the pass builds a predicate region over scalar (b, h, q, kv) and:
- for masks of indices only (causal, sliding window, prefix-LM), evaluates it by interval arithmetic
  over each tile's index ranges (falower/ir/intervals.py): `mask.kv_range` gives the first and last kv
  tile that is not empty for the q tile, so empty tiles are never visited and the loop bounds become
  functions of the q tile; inside, `mask.classify` picks the full tile path (no mask arithmetic) or the
  partial one (mask per element), and skips an empty tile in the middle;
- for masks that read data (document ids), emits `mask.block_table`, a step before the kernel that
  classifies every tile pair exactly from the data at run time; the loop reads its class from the table.

A class means one thing everywhere (`Interpreter.block_classes`): it is taken over the rows 0 <= q < M of the q
tile (tile{ragged_q=first} starts the first tile before row 0; rows outside produce no output) and all bk
columns of the kv tile with the predicate as written, the kv bound `kv < N` included. A ragged last kv tile
is therefore never full, and the full-tile branch, which drops the whole predicate (bounds too), only ever runs
on tiles where every column is in bounds and kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value, backward_slice, clone_block
from ..ir.dims import BinDim, Const, Dim, cdiv, dim
from ..ir.intervals import uses_data
from ..ir.ops import OPS, OpTypeError
from ..ir.types import TensorType, scalar
from .attention import _is, the_parallel_for
from .canonicalize import is_const
from .base import Pass, register
from .tile import is_ragged_q_start
from .rewrite import dce, region_dce

I32 = scalar("i32")


def split_mask(region: Block) -> tuple[Value, list[Value]]:
    """(the unmasked score, the mask conjuncts): peel `where(c, x, -inf)` off the region's result."""
    s_arg = region.args[0]
    y = region.terminator.operands[0]  # type: ignore[union-attr]
    conj: list[Value] = []
    while True:
        w = _is(y, "where")
        if w is None or not is_const(w.operands[2], -math.inf) or _depends_on(w.operands[0], s_arg):
            break
        conj.append(w.operands[0])
        y = w.operands[1]
    return y, conj


def _depends_on(v: Value, target: Value) -> bool:
    stack, seen = [v], set()
    while stack:
        x = stack.pop()
        if x is target:
            return True
        op = x.owner
        if isinstance(op, Op) and id(op) not in seen:
            seen.add(id(op))
            stack.extend(op.operands)
    return False


def predicate_region(fused: Op, conj: list[Value]) -> Block:
    """A closed region (b, h, q, kv: i32 scalars, captured tensors) -> bool, the AND of the conjuncts."""
    region = fused.regions[0]
    roles = list(fused.attrs["roles"])
    caps = [a for a, r in zip(region.args, roles) if r == "cap"]
    index = {a: ("b", "h", "q", "kv").index(r) for a, r in zip(region.args, roles) if r in ("b", "h", "q", "kv")}
    pred, b, keep = build_predicate(region, conj, index, caps)
    b.op("yield", [keep], [])
    return pred


def build_predicate(src: Block, conj: list[Value], index: dict[Value, int], caps: list[Value]
                    ) -> tuple[Block, Builder, Value]:
    """The conjuncts' computation in `src`, copied as scalar code into a new predicate block over
    (b, h, q, kv, captured tensors...): `index` maps the values of `src` that are the b, h, q or kv index to
    0..3. Returns the block (not yet terminated), a builder at its end and the AND of the conjuncts."""
    pred = Block([I32] * 4 + [c.type for c in caps], ["b", "h", "q", "kv"] + [c.name for c in caps])
    vmap: dict[Value, Value] = {v: pred.args[i] for v, i in index.items()}
    vmap.update(zip(caps, pred.args[4:]))
    b = Builder(pred)
    for op in backward_slice(src, conj):
        if all(r in vmap for r in op.results):
            continue  # an index (an iota of a whole-tensor graph)
        operands = [vmap[v] for v in op.operands]
        if op.name == "const":
            types = [r.type for r in op.results]
        else:
            try:
                types = OPS[op.name].infer([v.type for v in operands], dict(op.attrs))  # type: ignore[misc]
            except OpTypeError as e:
                raise AssertionError(f"mask predicate: {op.name}: {e}") from None
        nop = b.op(op.name, operands, types, dict(op.attrs), names=[r.name for r in op.results])
        for r, nr in zip(op.results, nop.results):
            vmap[r] = nr
    keep = vmap[conj[-1]]
    for c in reversed(conj[:-1]):
        keep = b.emit("and", keep, vmap[c], name_hint="keep")
    return pred, b, keep


def range_plan(pred: Block) -> Optional[list[tuple[int, int]]]:
    """(capture index, axis) for each captured table the predicate gathers from, when `mask.ranges` tables
    let interval arithmetic bound every gather; None when they cannot (the dense `mask.block_table` then).

    Each gather must read a captured table directly with indices that read no data, and at most one of its
    indices may vary inside a tile (read q or kv): that axis is the one the range table summarises. A gather
    whose indices are all fixed per tile (`window[h]`) gets axis 0 with granule 1, its exact values."""
    deps: dict[Value, set] = {a: {i} for i, a in enumerate(pred.args)}
    caps = {a: i for i, a in enumerate(pred.args[4:])}
    axes: dict[int, int] = {}
    for op in pred.ops:
        d: set = set().union(*(deps.get(v, set()) for v in op.operands)) if op.operands else set()
        if op.name == "gather":
            table, idx = op.operands[0], op.operands[1:]
            if table not in caps or any("data" in deps.get(i, set()) or deps.get(i, set()) & set(range(4, 4 + len(caps)))
                                        for i in idx):
                return None
            varying = [n for n, i in enumerate(idx) if deps.get(i, set()) & {2, 3}]
            if len(varying) > 1:
                return None
            axis = varying[0] if varying else -1
            c = caps[table]
            if axes.setdefault(c, axis) != axis:
                return None  # one table read along two axes: one range table cannot bound both
            d = d | {"data"}
        for r in op.results:
            deps[r] = d
    return [(c, a) for c, a in axes.items()]


def add_ranges(b: Builder, caps: list[Value], plan: list[tuple[int, int]], granule: int
               ) -> tuple[list[Value], list[list[int]]]:
    """Emit one `mask.ranges` per (capture, axis) of `plan`; returns the range tables and the `ranges`
    attribute of the mask ops that read them."""
    tables, spec = [], []
    for c, axis in plan:
        g = granule if axis >= 0 else 1
        a = max(axis, 0)
        name = f"{caps[c].name}_ranges" if caps[c].name else None
        (t,) = b.op("mask.ranges", [caps[c]], OPS["mask.ranges"].infer([caps[c].type], {"axis": a, "granule": g}),
                    {"axis": a, "granule": g}, names=[name]).results  # type: ignore[misc]
        tables.append(t)
        spec.append([c, a, g])
    return tables, spec


def unmasked(fused: Op, score: Value) -> Block:
    """A copy of the fused region that yields the score without the mask."""
    vmap: dict[Value, Value] = {}
    new = clone_block(fused.regions[0], vmap)
    term = new.terminator
    assert term is not None
    term.operands = [vmap[score]]
    region_dce(new)
    return new


@register
@dataclass(frozen=True)
class MaskTiles(Pass):
    """Skip empty tiles, drop the mask on full tiles, evaluate it only on partial ones.

    Requires: the FA2 online-softmax loop (tile, online-softmax); graphs in the fa1 order or without a mask
    are returned unchanged. Option data: how a mask that reads captured tables is classified, "table" (the
    exact dense `mask.block_table`) or "ranges" (`%doc_ranges = mask.ranges %doc {axis = 1, granule = 64}`
    before the loop nest, then the kv_range / classify below with `ranges = [[0, 1, 64]]`; masks whose gathers
    the ranges cannot bound keep the table). Before/after (causal):

        %m, %l, %acc = for %kj = %0 to %nk iter_args(...) {
          %x = fused %s, %q_idx, %kv_idx {...} { ... where(q >= kv, ..., -inf) ... }
    =>
        %lo, %hi = mask.kv_range %b, %h, %q0, %nkv {bq = 64, bk = 64} : i32, i32 { predicate }
        %m, %l, %acc = for %kj = %lo to %hi iter_args(...) {
          %cls = mask.classify %b, %h, %q0, %k0 {bq = 64, bk = 64} : i32 { predicate }
          ... if %cls == 0: skip; %x = if %cls == 2 { score, no mask } else { score with mask } ...
    """

    name = "mask-tiles"
    summary = "classify tile pairs empty/partial/full: skip empty tiles, mask only partial ones"
    data: str = "ranges"  # masks reading captured data: "ranges" (mask.ranges, else the table) or "table"

    def run(self, func: Func) -> Func:
        par = the_parallel_for(func, self.fail, "run tile and online-softmax first")
        body = par.regions[0]
        loop = next((op for op in body.ops if op.name == "for" and len(op.operands) == 5), None)
        if loop is None:
            if any(op.name == "for" and op.attrs.get("order") == "fa1" for op in func.walk()) or \
                    any(op.name == "for" for op in body.ops):
                return func  # fa1 order: the kv loop is outside the q loop; tile skipping is for fa2
            raise self.fail("no online-softmax kv loop (for with m, l, acc) found: run online-softmax first")
        if any(op.name in ("mask.classify", "mask.kv_range") for op in func.walk()):
            return func  # already done (its score function is split off then)
        lbody = loop.regions[0]
        fused = next((op for op in lbody.ops if op.name == "fused"), None)
        if fused is None:
            raise self.fail("the kv loop has no fused score function")
        score, conj = split_mask(fused.regions[0])
        if not conj:
            return func
        roles = list(fused.attrs["roles"])
        caps = [v for v, r in zip(fused.operands, roles) if r == "cap"]
        pred = predicate_region(fused, conj)
        bi, h = body.args[0], body.args[1]
        term = body.terminator
        q0 = term.operands[3]  # type: ignore[union-attr]  # tile.yield %o into [%b, %h, %q0 : bq, :]
        bq = term.attrs["slices"][0][2]  # type: ignore[union-attr]
        kv_arg = fused.operands[roles.index("kv")]
        k0 = kv_arg.owner.operands[0]  # type: ignore[union-attr]  # tile.iota %k0
        bk = kv_arg.type.shape[1].value  # type: ignore[union-attr]
        attrs = {"bq": bq, "bk": bk}
        n_kv = _kv_length(loop, self.fail)
        if self.data not in ("table", "ranges"):
            raise self.fail(f"data must be table or ranges, got {self.data!r}")
        data = uses_data(pred)
        if data and is_ragged_q_start(q0, body.args[2], bq, par.results[0].type.shape[2]):
            raise self.fail("a mask that reads captured tables is classified per q tile of rows i * bq (a block "
                            "table or range tables); tile{ragged_q=first} starts its tiles elsewhere: tile with "
                            "ragged_q=last")
        plan = range_plan(pred) if data and self.data == "ranges" else None
        pre = Builder(Block())
        kj = lbody.args[0]
        if plan is not None:  # run-time data bounded per granule: classified like a static mask
            gb = Builder(Block())
            tables, spec = add_ranges(gb, caps, plan, math.gcd(bq, bk))
            _insert_before(func.body, par, gb.block.ops)
            attrs["ranges"] = spec
            caps = caps + tables
            for t in tables:
                pred.add_arg(t.type, t.name)
            data = False
        if data:
            q_t = par.results[0].type
            B, H, M = q_t.shape[0], q_t.shape[1], q_t.shape[2]
            tbl_t = TensorType("i8", (B, H, cdiv(M, bq), cdiv(n_kv, bk)))
            tb = Builder(Block())
            (tbl,) = tb.op("mask.block_table", caps, [tbl_t], {**attrs, "m": M, "n": n_kv},
                           [_copy(pred)], names=["block_class"]).results
            _insert_before(func.body, par, tb.block.ops)
            qi = body.args[2]
            cb = Builder(Block())
            c8 = cb.tile_load(tbl, [bi, h, qi, kj], name_hint="cls8")
            cls = cb.emit("cast", c8, to="i32", name_hint="cls")
        else:
            nkv = pre.const(n_kv, name_hint="nkv")
            lo, hi = pre.op("mask.kv_range", [bi, h, q0, nkv, *caps], [I32, I32], attrs, [_copy(pred)],
                            names=["kv_lo", "kv_hi"]).results
            _insert_before(body, loop, pre.block.ops)
            loop.operands[0], loop.operands[1] = lo, hi
            cb = Builder(Block())
            (cls,) = cb.op("mask.classify", [bi, h, q0, k0, *caps], [I32], attrs, [_copy(pred)], names=["cls"]).results
        self._branch(loop, fused, score, cb, cls, k0)
        dce(func)
        return func

    def _branch(self, loop: Op, fused: Op, score: Value, cb: Builder, cls: Value, k0: Value) -> None:
        lbody = loop.regions[0]
        term = lbody.terminator
        assert term is not None
        # the class is known once k0 is: everything before (and including) k0's definition stays in front
        k0_pos = lbody.ops.index(k0.owner) if isinstance(k0.owner, Op) and k0.owner.parent is lbody else -1
        head = lbody.ops[: k0_pos + 1]
        rest = lbody.ops[k0_pos + 1: -1]
        b = Builder(Block())
        for op in cb.block.ops:
            b.block.append(op)
        two, zero = b.const(2), b.const(0)
        is_full = b.emit("eq", cls, two, name_hint="full_tile")
        is_empty = b.emit("eq", cls, zero, name_hint="empty_tile")
        iters = list(lbody.args[1:])

        def visit(vb: Builder):
            vmap: dict[Value, Value] = {}
            from ..ir.core import clone_op

            for op in rest:
                if op is fused:
                    region_full = unmasked(fused, score)
                    out_t = fused.results[0].type

                    def full(fb: Builder):
                        return fb.op("fused", [vmap.get(v, v) for v in fused.operands], [out_t],
                                     dict(fused.attrs), [region_full], names=["x"]).results

                    def partial(pb: Builder):
                        nop = clone_op(fused, vmap)
                        pb.block.append(nop)
                        return nop.results

                    (x,) = vb.if_(is_full, [out_t], full, partial, result_names=["x"])
                    vmap[fused.results[0]] = x
                    continue
                vb.block.append(clone_op(op, vmap))
            return [vmap.get(v, v) for v in term.operands]

        outs = b.if_(is_empty, [v.type for v in iters], lambda sb: iters, visit,
                     result_names=[f"{a.name}_next" if a.name else None for a in iters])
        b.op("yield", outs, [])
        for op in b.block.ops:
            op.parent = lbody
        lbody.ops = head + b.block.ops


def _insert_before(block: Block, anchor: Op, ops: list[Op]) -> None:
    """Move `ops` (built in a scratch block) into `block`, just before `anchor`."""
    i = block.ops.index(anchor)
    for op in ops:
        op.parent = block
    block.ops[i:i] = ops


def _copy(blk: Block) -> Block:
    return clone_block(blk, {})


def _kv_length(loop: Op, fail) -> Dim:
    """K's length, whatever its dim is named: tile's kv loop runs to `const cdiv(N, bk)`."""
    lo = loop.operands[0].owner
    if not (isinstance(lo, Op) and lo.name == "const" and lo.attrs.get("value") == 0):
        raise fail("the kv loop does not start at tile 0 (mask-tiles replaces its bounds with the mask's range)")
    bound = loop.operands[1].owner
    n = bound.attrs.get("value") if isinstance(bound, Op) and bound.name == "const" else None
    if isinstance(n, BinDim) and n.op == "cdiv":
        return n.lhs
    for op in loop.walk():  # concrete sizes fold cdiv(50, 64) to 1 (and cdiv(N, 1) is N): the kv bound's own
        if op.name == "lt" and op.attrs.get("bounds") and isinstance(op.operands[1].owner, Op) \
                and op.operands[1].owner.name == "const":  # compare names the length
            length = op.operands[1].owner.attrs["value"]
            bk = op.operands[0].type.shape[-1] if op.operands[0].type.rank else None
            if n is not None and isinstance(bk, Const) and dim(n) == cdiv(dim(length), bk.value):
                return dim(length)
            break  # a bound that is not cdiv(length, bk), or no constant at all (%qi): not tile's loop
    raise fail(f"the kv loop's bound is not tile's cdiv(kv length, bk) constant (got {n!r})")
