"""online-softmax{exp2}: the central rewrite. Three kv passes (max, sum, P @ V) become one loop.

Requires: the tiled three-pass softmax that tile produces (run tile first); in each q tile:

    %m   = for kj iter_args(%mi = -inf)  { yield max(%mi, rowmax(X)) }
    %m_safe = where(%m == -inf, 0, %m)
    %l   = for kj iter_args(%li = 0)     { yield %li + rowsum(exp(X - %m_safe)) }
    %l_safe = where(%l == 0, 1, %l)
    %acc = for kj iter_args(%ai = 0)     { yield %ai + (exp(X - %m_safe) / %l_safe) @ Vt }

where X is the same score tile computation in all three loops. Rewritten (seed 000, steps 1-2) =>

    %m, %l, %acc = for kj iter_args(%mi = -inf, %li = 0, %ai = 0) {
      %mn = max(%mi, rowmax(X));  %mn_safe = where(%mn == -inf, 0, %mn)
      %c  = exp(%mi - %mn_safe)                   the correction of everything seen so far
      %p  = exp(X - %mn_safe)
      yield %mn, %li * %c + rowsum(%p), %ai * %c + %p @ Vt
    }
    %o = %acc / where(%l == 0, 1, %l)             one division, after the loop (FA2)
    %lse = %m + log(%l)                           a new output, for the backward

With lazy=T (T > 0, in the exponent's base: log2 units under exp2) the running max moves only when a tile's
max exceeds it by more than T (FlashAttention-4's conditional rescaling):

      %mc = max(%mi, rowmax(X));  %mn = where(%mc > %mi + T, %mc, %mi)

so p <= base^T (2^8 = 256 for T = 8: within f16 and the f32 sums) and on every tile that keeps the max the
correction is exp(0) = 1 exactly: the kernels skip O's rescale there (a multiply by one), which is most tiles
after the first. The numbers are those of the eager update up to rounding (O = acc / l with the same m in both).

A row whose every score is -inf keeps m = -inf, l = 0: O = 0 and LSE = -inf, never NaN. With exp2=true
the loop works in base 2: X is multiplied by log2(e) inside the score function (the backend folds it into
the scale) and LSE is converted back to natural log. For tile{order=fa1} the kv loop is moved outside
the q loop with O, l and m written back every step (FlashAttention-1, seed 003 Algorithm 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value, backward_slice, clone_op, replace_uses
from ..ir.dims import Const
from ..ir.types import TensorType, scalar
from .attention import _guard, _is, the_parallel_for
from .canonicalize import is_const
from .mask_tiles import _kv_length
from .base import Pass, register
from .rewrite import dce

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass
class ThreePass:
    loop_m: Op
    loop_l: Op
    loop_acc: Op
    m_safe: Op
    l_safe: Op
    x_c: Value  # the score tile in the P @ V loop
    p_div: Op
    pv: Op
    vt: Value


def _yield_of(loop: Op) -> list[Value]:
    return list(loop.regions[0].terminator.operands)  # type: ignore[union-attr]


def structure_key(v: Value, body: Block, memo: dict) -> object:
    """A structural key of how `v` is computed inside `body` (loop-iv and outer values by identity, constants by
    value)."""
    if v in memo:
        return memo[v]
    if isinstance(v.owner, Block):
        k: object = ("arg", v.index) if v.owner is body else ("outer", id(v))
    elif v.owner.name == "const":  # by value wherever it is defined (cse shares one with a value score-licm hoisted)
        k = ("const", repr(v.owner.attrs["value"]), str(v.type))
    elif v.owner.parent is not body:
        k = ("outer", id(v))
    else:
        op = v.owner
        regions = tuple(_region_key(r) for r in op.regions)
        k = (op.name, tuple(sorted((a, repr(b)) for a, b in op.attrs.items())), v.index, str(v.type),
             tuple(structure_key(o, body, memo) for o in op.operands), regions)
    memo[v] = k
    return k


def _region_key(r: Block) -> object:
    memo: dict = {}
    term = r.terminator
    return tuple(structure_key(o, r, memo) for o in term.operands) if term else ()


def _match(block: Block, who: str, fail) -> Optional[ThreePass]:
    loops = [op for op in block.ops if op.name == "for" and len(op.operands) == 3]
    for lm in loops:
        (ym,) = _yield_of(lm)
        mx = _is(ym, "max")
        body_m = lm.regions[0]
        if mx is None or mx.operands[0] is not body_m.args[1] or not _is(mx.operands[1], "reduce_max"):
            continue
        if not is_const(lm.operands[2], -math.inf):
            continue
        x_a = _is(mx.operands[1], "reduce_max").operands[0]  # type: ignore[union-attr]
        m_safe = next((u for u in block.ops if u.name == "where" and _guard(u.result, -math.inf, 0.0, lm.result)), None)
        if m_safe is None:
            raise fail("the row-max loop is not followed by its -inf guard")
        ll = next((op for op in loops if op is not lm and _sum_loop(op, m_safe.result)), None)
        if ll is None:
            raise fail("found the row-max loop but no row-sum loop of exp(x - max) after it")
        l_safe = next((u for u in block.ops if u.name == "where" and _guard(u.result, 0.0, 1.0, ll.result)), None)
        if l_safe is None:
            raise fail("the row-sum loop is not followed by its zero guard")
        la = next((op for op in loops if op not in (lm, ll) and _pv_loop(op, m_safe.result, l_safe.result)), None)
        if la is None:
            raise fail("found the max and sum loops but no loop accumulating (exp(x - max) / sum) @ V")
        (ya,) = _yield_of(la)
        add = _is(ya, "add")
        pv = _is(add.operands[1], "tile.matmul")  # type: ignore[union-attr]
        p_div = _is(pv.operands[0], "div")  # type: ignore[union-attr]
        x_c = _is(p_div.operands[0], "exp").operands[0].owner.operands[0]  # type: ignore[union-attr]
        x_b = _is(_is(_yield_of(ll)[0], "add").operands[1], "reduce_sum").operands[0]  # type: ignore[union-attr]
        x_b = _is(x_b, "exp").operands[0].owner.operands[0]  # type: ignore[union-attr]
        ka = structure_key(x_a, body_m, {})
        if ka != structure_key(x_b, ll.regions[0], {}) or ka != structure_key(x_c, la.regions[0], {}):
            raise fail("the three kv loops compute different score tiles; online softmax needs one score function")
        if not (lm.operands[0] is ll.operands[0] is la.operands[0] and lm.operands[1] is ll.operands[1] is la.operands[1]):
            raise fail("the three kv loops have different bounds")
        for loop, what in ((ll, "row-sum"), (la, "accumulator")):  # the merged loop starts both at 0
            if not is_const(loop.operands[2], 0.0):
                raise fail(f"the {what} loop does not start at 0: its sum is not the softmax's")
        return ThreePass(lm, ll, la, m_safe, l_safe, x_c, p_div, pv, pv.operands[1])  # type: ignore[union-attr]
    return None


def _accumulated(op: Op) -> Optional[Value]:
    """The term a one-iter_arg loop adds each step (it yields iter_arg + term), or None."""
    (y,) = _yield_of(op)
    add = _is(y, "add")
    if add is None or add.operands[0] is not op.regions[0].args[1]:
        return None
    return add.operands[1]


def _is_exp_minus(v: Optional[Value], m_safe: Value) -> bool:
    """v == exp(x - m_safe)"""
    e = _is(v, "exp") if v is not None else None
    sub = _is(e.operands[0], "sub") if e else None
    return sub is not None and sub.operands[1] is m_safe


def _sum_loop(op: Op, m_safe: Value) -> bool:
    rs = _is(t, "reduce_sum") if (t := _accumulated(op)) is not None else None
    return rs is not None and _is_exp_minus(rs.operands[0], m_safe)


def _pv_loop(op: Op, m_safe: Value, l_safe: Value) -> bool:
    mm = _is(t, "tile.matmul") if (t := _accumulated(op)) is not None else None
    div = _is(mm.operands[0], "div") if mm else None
    return div is not None and div.operands[1] is l_safe and _is_exp_minus(div.operands[0], m_safe)


def _scale_region(b: Builder, x_op: Op) -> None:
    """exp2 domain: multiply the fused score function's result by log2(e) inside its region."""
    from .mask_tiles import split_mask

    region = x_op.regions[0]
    core, conj = split_mask(region)
    term = region.ops.pop()
    wheres = []  # the mask wrappers, outermost first: -inf stays -inf, so the scale goes inside them
    y = term.operands[0]
    while y is not core:
        w = y.owner
        wheres.append(w)
        y = w.operands[1]
    rb = Builder(region)
    out = rb.emit("mul", core, rb.const(LOG2E, scalar(core.type.dtype)), name_hint="x_log2")
    for w in reversed(wheres):
        out = rb.op("where", [w.operands[0], out, w.operands[2]], [w.results[0].type], dict(w.attrs)).result
    rb.op("yield", [out], [])
    x_op.attrs["exp2"] = True


@register
@dataclass(frozen=True)
class OnlineSoftmax(Pass):
    __doc__ = __doc__

    name = "online-softmax"
    summary = "three kv passes -> one loop with loop-carried (m, l, acc), deferred normalisation, LSE output"
    exp2: bool = False
    lazy: float = 0.0

    def run(self, func: Func) -> Func:
        if not (self.lazy >= 0 and math.isfinite(self.lazy)):
            raise self.fail(f"lazy={self.lazy}: the rescale threshold must be a finite number >= 0 (0: rescale every tile)")
        top = 15.0 if self.exp2 else 15.0 * LN2  # p <= base^T must stay below f16's largest value, 65504 < 2^16
        if self.lazy > top:
            raise self.fail(f"lazy={self.lazy}: p could reach {'2' if self.exp2 else 'e'}^{self.lazy}, past f16's "
                            f"largest value 65504 (at most {top:.4g} here; FlashAttention-4 uses 8 in log2 units)")
        par = the_parallel_for(func, self.fail, "run tile first")
        body = par.regions[0]
        fa1 = next((op for op in body.ops if op.name == "for" and op.attrs.get("order") == "fa1"), None)
        block = fa1.regions[0] if fa1 is not None else body
        tp = _match(block, self.name, self.fail)
        if tp is None:
            raise self.fail("no row-max loop (for ... yield max(m, rowmax(x))) found: this is not a tiled softmax")
        if fa1 is None:
            lse_tile = self._merge(block, tp)
            self._add_lse_output(func, par, lse_tile)
        else:
            if self.lazy:
                raise self.fail("lazy rescaling needs the FA2 order (tile{order=fa1} writes m back every kv step)")
            if "lse_result" in func.attrs:
                raise self.fail(f"@{func.name} returns its softmax's LSE ({func.attrs['lse_result']}), which the FA1 "
                                "order does not compute (it keeps m and l in main memory): lower it in the FA2 order")
            self._fa1(func, par, fa1, tp)
        dce(func)
        return func

    # ------------------------------------------------------------------------------ FA2 merge
    def _update(self, b: Builder, x: Value, vt: Value, mi: Value, li: Value, ai: Value):
        ex = "exp2" if self.exp2 else "exp"
        row_t = scalar(x.type.dtype)  # the scores' float type: f32, or f64 for f64 inputs
        mn = b.emit("max", mi, b.emit("reduce_max", x, axis=1), name_hint="m_max" if self.lazy else "m_new")
        if self.lazy:  # the max moves only past mi + T (mi = -inf: any finite max moves it)
            moved = b.emit("gt", mn, b.emit("add", mi, b.const(float(self.lazy), row_t)), name_hint="m_moved")
            mn = b.emit("where", moved, mn, mi, name_hint="m_new")
        mn_safe = b.emit("where", b.emit("eq", mn, b.const(-math.inf, row_t)), b.const(0.0, row_t), mn,
                         name_hint="m_new_safe")
        c = b.emit(ex, b.emit("sub", mi, mn_safe), name_hint="corr")
        p = b.emit(ex, b.emit("sub", x, mn_safe), name_hint="p")
        ln = b.emit("add", b.emit("mul", li, c), b.emit("reduce_sum", p, axis=1), name_hint="l_new")
        pv = b.tile_matmul(p, vt, name_hint="pv")
        an = b.emit("add", b.emit("mul", ai, c), pv, name_hint="acc_new")
        return mn, ln, an

    def _epilogue(self, b: Builder, m: Value, l: Value, acc: Value) -> tuple[Value, Value]:
        """After the loop: O's tile acc / l (one division, 0 on a row with no key) and LSE's tile m + log(l)."""
        row_t = scalar(l.type.dtype)
        l_safe = b.emit("where", b.emit("eq", l, b.const(0.0, row_t)), b.const(1.0, row_t), l, name_hint="l_safe")
        o = b.emit("div", acc, l_safe, name_hint="o_tile")
        if self.exp2:
            lse = b.emit("mul", b.emit("add", m, b.emit("log2", l)), b.const(LN2, row_t), name_hint="lse_tile")
        else:
            lse = b.emit("add", m, b.emit("log", l), name_hint="lse_tile")
        return o, b.emit("squeeze", lse, axis=1, name_hint="lse_tile")

    def _merge(self, block: Block, tp: ThreePass) -> Value:
        la = tp.loop_acc
        body_c = la.regions[0]
        lm, ll = tp.loop_m, tp.loop_l
        inits = [lm.operands[2], ll.operands[2], la.operands[2]]

        def body(lb: Builder, kj: Value, it: list[Value]):
            vmap: dict[Value, Value] = {body_c.args[0]: kj}
            for op in backward_slice(body_c, [tp.x_c, tp.vt]):
                nop = clone_op(op, vmap)
                lb.block.append(nop)
                if self.exp2 and op is tp.x_c.owner:
                    _scale_region(lb, nop)
                if self.lazy and op is tp.x_c.owner:
                    nop.attrs["lazy_rescale"] = float(self.lazy)  # the backend's cue (from_ir reads it)
            return self._update(lb, vmap[tp.x_c], vmap[tp.vt], *it)

        scratch = Block()
        sb = Builder(scratch)
        m, l, acc = sb.for_loop(la.operands[0], la.operands[1], inits, body, iter_names=["m_i", "l_i", "acc_i"],
                                result_names=["m", "l", "acc"])
        o, lse = self._epilogue(sb, m, l, acc)
        # splice in place of the accumulate loop; the other two loops die with their users
        idx = block.ops.index(la)
        for op in scratch.ops:
            op.parent = block
        block.ops[idx + 1:idx + 1] = scratch.ops
        replace_uses(block, la.results[0], o)
        block.ops.remove(la)
        return lse

    def _add_lse_output(self, func: Func, par: Op, lse_tile: Value) -> None:
        body = par.regions[0]
        term = body.terminator
        assert term is not None
        out_spec = term.attrs["slices"][0]
        idx_ops = term.operands[1:1 + sum(1 for s in out_spec if s != ":")]
        # LSE rows: the same (b, h, q0 : bq) as O without the head-dim axis
        lse_spec = tuple(out_spec[:-1])
        term.operands = list(term.operands) + [lse_tile] + list(idx_ops)
        term.attrs["slices"] = tuple(term.attrs["slices"]) + (lse_spec,)
        o_t = par.results[0].type
        lse_t = TensorType(lse_tile.type.dtype, o_t.shape[:-1])
        new_par = Op("parallel_for", [], [r.type for r in par.results] + [lse_t], dict(par.attrs), [body],
                     [r.name for r in par.results] + ["lse"])
        i = func.body.ops.index(par)
        new_par.parent = func.body
        func.body.ops[i] = new_par
        for old, nv in zip(par.results, new_par.results):
            replace_uses(func.body, old, nv)
        ret = func.body.terminator
        assert ret is not None
        ret.operands = list(ret.operands) + [new_par.results[-1]]
        # named as the graph's own LSE result where it returned one (raise_lse.py), which it now is
        name = func.attrs.pop("lse_result", "lse")
        func.attrs["result_names"] = tuple(func.result_names[: len(ret.operands) - 1]) + (name,)

    # ------------------------------------------------------------------------------ FA1 order
    def _fa1(self, func: Func, par: Op, qloop: Op, tp: ThreePass) -> None:
        """Loop interchange: kv tiles outside, q tiles inside, O, l, m carried in main memory."""
        body = par.regions[0]
        qbody = qloop.regions[0]
        _hoist_invariants(body, qloop)
        la = tp.loop_acc
        body_c = la.regions[0]
        slice_ops = backward_slice(body_c, [tp.x_c, tp.vt])
        # which ops of the kv loop body depend on the q tile (must stay inside), which only on kj
        q_dependent: set[Value] = set(qbody.ops[i].results[0] for i in range(len(qbody.ops))
                                      if qbody.ops[i].results) | set(qbody.args)
        o_t = par.results[0].type
        M, D = o_t.shape[2], o_t.shape[3]
        load = next((op for op in qbody.ops if op.name == "tile.load"), None)
        if load is None:
            raise self.fail("the q loop loads no Q tile of its own (fa1's loop interchange needs Q's tile load "
                            "inside the q loop)")
        bq = load.results[0].type.shape[0]
        bqv = bq.value if isinstance(bq, Const) else 64
        b = Builder(Block())
        scratch = b.block
        f32 = tp.x_c.type.dtype  # the scores' float type: f32, or f64 for f64 inputs
        O0 = b.const(0.0, TensorType(f32, (M, D)), name_hint="O_init")
        l0 = b.const(0.0, TensorType(f32, (M, Const(1))), name_hint="l_init")
        m0 = b.const(-math.inf, TensorType(f32, (M, Const(1))), name_hint="m_init")
        ex = "exp2" if self.exp2 else "exp"

        def kv_body(kb: Builder, kj: Value, it: list[Value]):
            vmap: dict[Value, Value] = {body_c.args[0]: kj}
            inner_ops = []
            for op in slice_ops:
                if _uses_q(op, q_dependent, slice_ops):
                    inner_ops.append(op)
                else:
                    kb.block.append(clone_op(op, vmap))

            def q_body(qb: Builder, qi: Value, st: list[Value]):
                O, l, m = st
                qmap = dict(vmap)
                qmap[qbody.args[0]] = qi
                for op in qbody.ops:
                    if op is qloop or op.name == "for" or op is tp.m_safe or op is tp.l_safe:
                        continue
                    if op.name in ("tile.insert", "yield") or op in _after(qbody, tp):
                        continue
                    if all(v in qmap or not (isinstance(v.owner, Op) and v.owner.parent is qbody) for v in op.operands):
                        qb.block.append(clone_op(op, qmap))
                for op in inner_ops:
                    nop = clone_op(op, qmap)
                    qb.block.append(nop)
                    if self.exp2 and op is tp.x_c.owner:
                        _scale_region(qb, nop)
                x, vt = qmap[tp.x_c], qmap[tp.vt]
                q0 = qmap[_q0(qbody)]
                Ot = qb.tile_load(O, [(q0, bqv), ":"], name_hint="O_i")
                lt = qb.tile_load(l, [(q0, bqv), ":"], name_hint="l_i")
                mt = qb.tile_load(m, [(q0, bqv), ":"], name_hint="m_i")
                row = scalar(f32)
                mij = qb.emit("reduce_max", x, axis=1, name_hint="m_ij")
                mij_s = qb.emit("where", qb.emit("eq", mij, qb.const(-math.inf, row)), qb.const(0.0, row), mij)
                p = qb.emit(ex, qb.emit("sub", x, mij_s), name_hint="p_ij")
                lij = qb.emit("reduce_sum", p, axis=1, name_hint="l_ij")
                mn = qb.emit("max", mt, mij, name_hint="m_new")
                mn_s = qb.emit("where", qb.emit("eq", mn, qb.const(-math.inf, row)), qb.const(0.0, row), mn)
                a = qb.emit(ex, qb.emit("sub", mt, mn_s), name_hint="alpha")
                bb = qb.emit(ex, qb.emit("sub", mij_s, mn_s), name_hint="beta")
                bb = qb.emit("where", qb.emit("eq", mij, qb.const(-math.inf, row)), qb.const(0.0, row), bb)
                ln = qb.emit("add", qb.emit("mul", a, lt), qb.emit("mul", bb, lij), name_hint="l_new")
                ln_s = qb.emit("where", qb.emit("eq", ln, qb.const(0.0, row)), qb.const(1.0, row), ln)
                num = qb.emit("add", qb.emit("mul", qb.emit("mul", lt, a), Ot),
                              qb.emit("mul", bb, qb.tile_matmul(p, vt)))
                On = qb.emit("div", num, ln_s, name_hint="O_new")
                return [qb.tile_insert(O, On, [(q0, bqv), ":"], name_hint="O_next"),
                        qb.tile_insert(l, ln, [(q0, bqv), ":"], name_hint="l_next"),
                        qb.tile_insert(m, mn, [(q0, bqv), ":"], name_hint="m_next")]

            return kb.for_loop(qloop.operands[0], qloop.operands[1], list(it), q_body, iv_name="qi",
                               iter_names=["O_c", "l_c", "m_c"], result_names=["O_k", "l_k", "m_k"])

        O, l, m = b.for_loop(la.operands[0], la.operands[1], [O0, l0, m0], kv_body, iter_names=["O_hbm", "l_hbm", "m_hbm"],
                             result_names=["O", "l", "m"])
        from .tile import apply_chain

        chain = _chain_after(qbody, la)
        o = apply_chain(b, chain, O)
        row = scalar(f32)
        if self.exp2:
            lse = b.emit("mul", b.emit("add", m, b.emit("log2", l)), b.const(LN2, row))
        else:
            lse = b.emit("add", m, b.emit("log", l))
        lse = b.emit("squeeze", lse, axis=1, name_hint="lse_bh")
        term = body.terminator
        assert term is not None
        bi, h = term.operands[1], term.operands[2]
        Builder(scratch).op("tile.yield", [o, bi, h, lse, bi, h], [], {"slices": (("i", "i", ":", ":"), ("i", "i", ":"))})
        # the parallel_for body keeps what the q loop used from outside (b, h, hk) and gets the new nest
        keep = [op for op in body.ops if op is not qloop and op is not term]
        for op in scratch.ops:
            op.parent = body
        body.ops = keep + scratch.ops
        self._retype_par(func, par, TensorType(f32, o_t.shape[:-1]))

    def _retype_par(self, func: Func, par: Op, lse_t: TensorType) -> None:
        body = par.regions[0]
        new_par = Op("parallel_for", [], [par.results[0].type, lse_t], dict(par.attrs), [body],
                     [par.results[0].name, "lse"])
        i = func.body.ops.index(par)
        new_par.parent = func.body
        func.body.ops[i] = new_par
        replace_uses(func.body, par.results[0], new_par.results[0])
        ret = func.body.terminator
        assert ret is not None
        ret.operands = [new_par.results[0], new_par.results[1]]
        func.attrs["result_names"] = (func.result_names[0], "lse")


# ------------------------------------------------------------------------------ the FA2 loop, recognised again
def lazy_max_threshold(op: Op) -> Optional[float]:
    """T where `op` is online-softmax{lazy=T}'s select where(gt(m_max, add(m_i, T)), m_max, m_i), else None (by
    structure: names may be gone after later passes)."""
    if op.name != "where" or not isinstance(op.operands[0].owner, Op) or op.operands[0].owner.name != "gt":
        return None  # (a region argument's owner is its Block: a score's where on a condition it was given)
    gt = op.operands[0].owner
    add = gt.operands[1].owner
    if not (gt.operands[0] is op.operands[1] and isinstance(add, Op) and add.name == "add"
            and add.operands[0] is op.operands[2] and isinstance(add.operands[1].owner, Op)):
        return None
    return add.operands[1].owner.attrs.get("value")


def check_fa2_loop(loop: Op, o_tile: Value, lse_tile: Value, fail) -> "OnlineSoftmax":
    """Raise `fail(msg)` unless the kv loop `loop` and the f32 O and LSE tiles after it are what online-softmax
    makes in the FA2 order: its `_update` and `_epilogue`, with the exp2 and lazy options the IR shows, built again
    and compared by structure. The loop carries (m, l, acc) from (-inf, 0, 0); a step (where mask-tiles' branch
    does not pass the three through an empty tile unchanged) makes m_new = max(m, rowmax(x)) (lazy=T: moved only
    past m + T), p = exp(x - m_new) (0 for m_new = -inf), l * exp(m - m_new) + rowsum(p) and
    acc * exp(m - m_new) + p @ V; nothing else in the loop reads the three; O = acc / where(l == 0, 1, l) and
    LSE = m + log(l) ((m + log2(l)) * ln 2 under exp2). A pass that takes the loop's numbers for the softmax's
    (split-kv merges its parts by their LSE) asks this of its input, which may be a hand-edited dump. Returns the
    form it found (exp2, lazy)."""
    body = loop.regions[0]
    carried = list(body.args[1:])
    if len(carried) != 3 or not all(is_const(v, c) for v, c in zip(loop.operands[2:], (-math.inf, 0.0, 0.0))):
        raise fail("the kv loop's (m, l, acc) does not start at (-inf, 0, 0)")
    blk, through = body, []  # through: the yields of mask-tiles' empty-tile branches (the state unchanged)
    while True:
        ys = list(blk.terminator.operands)  # type: ignore[union-attr]
        branch = ys[0].owner if ys else None
        if not (isinstance(branch, Op) and branch.name == "if" and branch.parent is blk
                and len(ys) == len(branch.results) and all(y is r for y, r in zip(ys, branch.results))):
            break
        same = [r for r in branch.regions if all(y is c for y, c in zip(r.terminator.operands, carried))]
        if len(branch.regions) != 2 or len(same) != 1:
            raise fail("the kv loop's branch does not pass (m, l, acc) through one side unchanged (mask-tiles' "
                       "empty tile) and update them on the other")
        through.append(same[0].terminator)
        blk = next(r for r in branch.regions if r is not same[0])
    add = _is(ys[2], "add") if len(ys) == 3 else None
    pv = _is(add.operands[1], "tile.matmul") if add is not None else None
    p = pv.operands[0].owner if pv is not None else None
    sub = _is(p.operands[0], "sub") if isinstance(p, Op) and p.name in ("exp", "exp2") else None
    if sub is None:
        raise fail("the kv loop's acc is not acc * exp(m - m_new) + exp(x - m_new) @ V")
    x, vt = sub.operands[0], pv.operands[1]  # type: ignore[union-attr]
    lazy = lazy_max_threshold(ys[0].owner) if isinstance(ys[0].owner, Op) else None
    lazy = float(lazy) if isinstance(lazy, (int, float)) and not isinstance(lazy, bool) else 0.0
    form = OnlineSoftmax(exp2=p.name == "exp2", lazy=lazy)  # type: ignore[union-attr]
    leaves = {x: ("x",), vt: ("vt",), **{c: (n,) for c, n in zip(carried, ("m", "l", "acc"))}}
    scratch = Block()
    want = form._update(Builder(scratch), x, vt, *carried)
    got_memo, want_memo = dict(leaves), dict(leaves)
    for got, w, what in zip(ys, want, ("running max is not max(m, rowmax(x))" + (f", moved only past m + {lazy:g}"
                                                                              if lazy else ""),
                                       "l is not l * exp(m - m_new) + rowsum(exp(x - m_new))",
                                       "acc is not acc * exp(m - m_new) + exp(x - m_new) @ V")):
        if structure_key(got, blk, got_memo) != structure_key(w, scratch, want_memo):
            raise fail(f"the kv loop's {what} (online-softmax's update)")
    update: set[int] = set()  # the ops compared: the only ones that may read the running (m, l, acc)
    stack = list(ys)
    while stack:
        op = stack.pop().owner
        if isinstance(op, Op) and op.parent is blk and id(op) not in update:
            update.add(id(op))
            stack.extend(v for v in op.operands if v not in leaves)
    update |= {id(t) for t in through}
    for op in loop.walk():
        if op is not loop and id(op) not in update and any(v is c for v in op.operands for c in carried):
            raise fail(f"{op.name} in the kv loop reads the running (m, l, acc) outside online-softmax's update")
    m, l, acc = loop.results
    scratch = Block()
    o_want, lse_want = form._epilogue(Builder(scratch), m, l, acc)
    ends = {m: ("m",), l: ("l",), acc: ("acc",)}
    outer = loop.parent
    if structure_key(o_tile, outer, dict(ends)) != structure_key(o_want, scratch, dict(ends)):
        raise fail("O's tile is not the kv loop's acc / where(l == 0, 1, l)")
    if structure_key(lse_tile, outer, dict(ends)) != structure_key(lse_want, scratch, dict(ends)):
        raise fail("LSE's tile is not the kv loop's " + ("(m + log2(l)) * ln 2 (its exp2 base)" if form.exp2
                                                         else "m + log(l)"))
    return form


def _uses_q(op: Op, q_dependent: set[Value], slice_ops: list[Op]) -> bool:
    """True if `op` (in the kv loop body) depends on a q-tile value, directly or through its operands."""
    seen: set[int] = set()
    stack = list(op.operands)
    while stack:
        v = stack.pop()
        if v in q_dependent:
            return True
        d = v.owner
        if isinstance(d, Op) and d in slice_ops and id(d) not in seen:
            seen.add(id(d))
            stack.extend(d.operands)
    return False


def _after(qbody: Block, tp: ThreePass) -> list[Op]:
    """Ops of the q-loop body that come after the three kv loops (the output chain and the insert)."""
    i = qbody.ops.index(tp.loop_acc)
    return qbody.ops[i:]


def _chain_after(qbody: Block, la: Op) -> list[Op]:
    chain = []
    cur = la.results[0]
    for op in qbody.ops[qbody.ops.index(la) + 1:]:
        if op.operands and op.operands[0] is cur and op.name not in ("tile.insert", "yield") and len(op.operands) == 1:
            chain.append(op)
            cur = op.results[0]
    return chain


def _q0(qbody: Block) -> Value:
    """The q tile's first row, where the q tile's load reads (qi * bq, or tile{ragged_q=first}'s qi * bq - q_pad)."""
    for op in qbody.ops:
        if op.name == "tile.load" and isinstance(op.attrs["slice"][2], int):
            return op.operands[3]  # tile.load %q[%b, %h, %q0 : bq, :]
    raise AssertionError("no q tile load in the q loop")


def _hoist_invariants(outer: Block, loop: Op) -> None:
    """Move ops of `loop`'s body that do not depend on its iteration in front of the loop."""
    body = loop.regions[0]
    variant: set[Value] = set(body.args)
    stay, move = [], []
    for op in body.ops:
        if op.regions or op.name in ("yield",) or any(v in variant for v in op.operands):
            variant.update(op.results)
            stay.append(op)
        else:
            move.append(op)
    i = outer.ops.index(loop)
    for op in move:
        op.parent = outer
    outer.ops[i:i] = move
    body.ops = stay


def f32_source(tile: Value) -> Value | None:
    """The f32 tile whose cast `tile` is (or `tile` itself where it is f32)."""
    if tile.type.dtype == "f32":
        return tile
    op = tile.owner
    if isinstance(op, Op) and op.name == "cast" and op.operands[0].type.dtype == "f32":
        return op.operands[0]
    return None


def check_kv_range(loop: Op, fail) -> None:
    """The kv loop runs over the q tile's kv tiles (the range split-kv's parts share): tile's 0 to cdiv(N, bk) or
    mask-tiles' mask.kv_range (the kernels compute that range themselves, whatever bounds a dump gives the loop)."""
    lo, hi = loop.operands[0], loop.operands[1]
    rng = lo.owner
    if isinstance(rng, Op) and rng.name == "mask.kv_range":
        if lo is not rng.results[0] or hi is not rng.results[1]:
            raise fail("the kv loop does not run from mask.kv_range's first tile to its last (the range the parts "
                       "share)")
        return
    if not is_const(lo, 0):
        raise fail("the kv loop does not start at tile 0 or at mask.kv_range's first tile (the range the parts share)")
    _kv_length(loop, fail)  # to cdiv(N, bk)


def check_fa2_body(body: Block, fail, whole_range: bool = True) -> "OnlineSoftmax":
    """The q tile's body of the fa2-fwd IR (or of split-kv's, `whole_range` False: a part's share of the range) as
    online-softmax and mask-tiles make it: one kv loop carrying (m, l, acc) over the q tile's kv tiles, O and LSE
    from it (check_fa2_loop). The numba-cuda backend, whose kernels compute this loop from their own template, asks
    it of the IR it is given, which may be a hand-edited dump. Returns the loop's form (exp2, lazy)."""
    loops = [op for op in body.ops if op.name == "for"]
    if len(loops) != 1 or len(loops[0].results) != 3:
        raise fail("needs one kv loop carrying (m, l, acc) in the q tile's body (online-softmax's FA2 order)")
    term = body.terminator
    if term is None or term.name != "tile.yield" or len(term.attrs.get("slices", ())) != 2:
        raise fail("the q tile's body does not yield O and LSE")
    n_o = sum(1 for x in term.attrs["slices"][0] if x != ":")
    o_tile = term.operands[0]
    o32 = o_tile if o_tile.type.dtype == "f64" else f32_source(o_tile)  # (f64 graphs compute O in f64)
    if o32 is None:
        src = o_tile.owner.operands[0].type if isinstance(o_tile.owner, Op) and o_tile.owner.name == "cast" else None
        raise fail(f"O's tile is {o_tile.type}" + (f", a cast of {src}: an f64 graph returns O in f64 (the kernels "
                                                   "store O in the inputs' dtype)" if src is not None and
                                                   src.dtype == "f64" else ", not the cast of an f32 tile"))
    if whole_range:
        check_kv_range(loops[0], fail)
    return check_fa2_loop(loops[0], o32, term.operands[1 + n_o], fail)
