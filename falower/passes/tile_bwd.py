"""tile-bwd{bq,bk}: the backward function tiled in FlashAttention-2's order (seed 000, step 2).

Input: the backward function `recompute` makes (inputs q, k, v, captures, O, LSE, dO; whole tensors). The
pass gives every value an iteration space by dataflow: R if it varies along the query rows (q, O, dO, LSE,
the q index), C if along the kv rows (k, v, the kv index), H if along the query heads; a score-shaped
value is R and C. Matmuls then fall in three kinds: contracting the head dim (S = Q K^T, dP = dO V^T: a
tile product), contracting R (dV = P^T dO, dK = dS^T Q: summed over q tiles) or contracting C (dQ = dS K:
summed over kv tiles). From that, three loop nests:

    %delta = parallel_for (b, h, q-tile)      row reductions that need no kv (Delta = rowsum(dO * O)),
                                              computed once, before the main loop (FA2's preprocessing)
    %dk, %dv = parallel_for (b, kv-head, kv-tile) {
        for q tiles (and, under GQA, the query heads of the group) iter_args(dK, dV) {
          recompute S, P = exp(X - LSE) for the tile; dV += P^T dO; dP = dO V^T; dS = ...; dK += dS^T Q
        } }
    %dq = parallel_for (b, h, q-tile) { for kv tiles iter_args(dQ) { ...; dQ += dS K } }

dQ is computed by its own loop nest with q tiles outer (`dq=separate`, as the Triton tutorial does) or
added tile by tile from the kv-outer nest into an f32 accumulator (`dq=atomic`, FlashAttention-2's choice:
five products instead of seven). The kv-outer nest sums dK and dV of a kv head over the group's query
heads, so GQA needs no atomics. Gradients of captured tables (autodiff's scatter_add) are added per tile
into accumulators of the kv-outer nest (`tile.scatter_add`), or, with `deterministic=true`, into a copy
per kv tile that is summed in a fixed order after the nest (memory: B * kv heads * kv tiles copies).
Padded positions of ragged tiles are masked in the IR, not by the kernel's grace: the recomputed scores
get `where(q < M and kv < N, x, -inf) {bounds}`, so P, and with it every contribution of a padded row or
column, is 0. A captured table's gradient is added at its own indices, which a padded position can share with a
real one: its update must be 0 where P is (a multiple of P, as autodiff makes it), and is checked to be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import PassError
from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value, backward_slice, clone_block, replace_uses
from ..ir.intervals import uses_data
from ..ir.dims import Dim, cdiv, dim
from ..ir.ops import OPS, OpTypeError
from ..ir.types import TensorType, is_float, scalar
from .attention import _is, refuse_whole_captures
from .canonicalize import const_value, is_const
from .mask_tiles import add_ranges, build_predicate, range_plan
from .base import Pass, register
from .rewrite import dce

R, C, H = "R", "C", "H"
Space = frozenset
I32 = scalar("i32")


@dataclass
class BackwardPlan:
    """What the analysis of a backward function found."""

    space: dict[Value, frozenset]
    M: Dim
    N: Dim
    heads: Dim  # query heads
    kv_heads: Dim
    batch: Dim  # Q's batch dim, whatever it is named
    group: int
    acc_kind: dict[int, str]  # id(matmul) -> "R" (summed over q tiles) or "C" (summed over kv tiles)
    pre: set[int]  # ids of row reductions computed before the main loops
    post: set[int]  # ids of ops after an accumulation (casts, group sums)
    probs: set[int] = field(default_factory=set)  # ids of the recomputed P = exp(X - LSE): X gets the bounds
    scatters: list[Op] = field(default_factory=list)  # captured tables' gradients (scatter_add), in order
    scatter_path: set[int] = field(default_factory=set)  # ids of the ops computing their updates per tile
    conj: list[Value] = field(default_factory=list)  # the mask's conjuncts (bool, of indices and captures)
    labels: dict[int, str] = field(default_factory=dict)  # id(summing op) -> the gradient it makes (dv, dq)
    pred: Optional[Block] = None  # the mask as a scalar predicate (b, h, q, kv, captures), kv bound included
    pred_caps: list[Value] = field(default_factory=list)  # the captured tables it reads
    range_tables: list[Value] = field(default_factory=list)  # their mask.ranges tables (data=ranges)
    range_spec: list = field(default_factory=list)  # the mask ops' `ranges` attribute

    def label(self, op: Op) -> str:
        """A readable name for a sum over tiles: the result it becomes (dv, dk, dq, d<capture>) + 32 for f32."""
        return self.labels.get(id(op)) or op.results[0].name or "acc"


def _acc_dtype(values) -> str:
    """Sums accumulate in f32, or in f64 when what they sum is f64 (gradcheck's precision all the way)."""
    return "f64" if any(v.type.dtype == "f64" for v in values) else "f32"


def _root(v: Value) -> Value:
    while isinstance(v.owner, Op) and v.owner.name in ("cast", "repeat_interleave"):
        v = v.owner.operands[0]
    return v


def _axes(space: frozenset) -> tuple[Optional[str], Optional[str]]:
    """What axes 2 and 3 of a rank-4 value of this space run over (None: the head dim, or size 1)."""
    if R in space and C in space:
        return R, C
    if R in space:
        return R, None
    if C in space:
        return C, None
    return None, None


@register
@dataclass(frozen=True)
class TileBwd(Pass):
    """Tile the backward: Delta first, kv tiles outer for dK and dV, q tiles outer for dQ.

    Requires: the backward function of recompute (run autodiff, decompose-softmax, delta, recompute); each
    captured table's gradient (scatter_add) adds a multiple of the recomputed P (`_zero_where_p_is`).
    Options: bq, bk (tile sizes); dq = separate (a second loop nest with q tiles outer) or atomic (added
    from the kv-outer nest); skip (tile skipping from the mask, default true); deterministic (no atomics: dq
    separate, captured tables' gradients reduced in a fixed order); data (masks that read captured tables:
    "table", one dense mask.block_table, or "ranges", mask.ranges with q_range / kv_range / classify, as in
    mask-tiles).

        %p = exp (sub %x, %lse_safe) : f32[B,H,M,N]
        %dv32 = matmul %p, %g {transpose_a} : f32[B,H,N,D]
        %ds = ... : f32[B,H,M,N];  %dq32 = matmul %ds, %kf;  %dk32 = matmul %ds, %qf {transpose_a}
    =>
        %delta = parallel_for (%b, %h, %qi) in (B, H, cdiv(M, 64)) { ... reduce_sum (mul %gt, %ot) ... }
        %dk, %dv = parallel_for (%b, %hk, %kj) in (B, H, cdiv(N, 64)) {
          %dk_acc, %dv_acc = for %it = 0 to cdiv(M, 64) iter_args(...) {
            ... %p = exp (sub %x, %lse_safe) : f32[64,64]
            yield add(%dk_i, tile.matmul %ds, %qt {transpose_a}), add(%dv_i, tile.matmul %p, %gt {transpose_a})
          } ... }
        %dq = parallel_for (%b, %h, %qi) in (B, H, cdiv(M, 64)) { for %kj ... { ... tile.matmul %ds, %kt } }
    """

    name = "tile-bwd"
    summary = "tile the backward: Delta preprocessing, kv-outer loop for dK/dV (q inner), q-outer loop for dQ"
    bq: int = 64
    bk: int = 64
    dq: str = "separate"
    skip: bool = True
    data: str = "ranges"  # masks reading captured data: "ranges" (mask.ranges, else the table) or "table"
    deterministic: bool = False

    removes = ("matmul",)

    def __post_init__(self) -> None:
        if self.bq < 1 or self.bk < 1:
            raise ValueError("tile sizes must be positive")
        if self.dq not in ("separate", "atomic"):
            raise ValueError(f"dq must be 'separate' (a q-outer loop nest) or 'atomic' (added from the kv-outer "
                             f"loop), got {self.dq!r}")
        if self.deterministic and self.dq == "atomic":
            raise ValueError("deterministic=true needs dq=separate: atomic adds sum in no fixed order")

    # ------------------------------------------------------------------------------ analysis
    def analyse(self, func: Func) -> BackwardPlan:
        if any(op.name == "parallel_for" for op in func.body.ops):
            raise self.fail("the graph is already tiled")
        _scalar_sums_as_scatters(func)
        if any(op.name == "softmax" for op in func.walk()):
            raise self.fail("the graph has a softmax: this is not the backward function (run autodiff, "
                            "decompose-softmax, delta and recompute first)")
        if any(op.name == "reduce_max" for op in func.body.ops):
            raise self.fail("the backward still computes the softmax's row max: run recompute first (P from the "
                            "saved LSE, no reduction over the kv axis)")
        args = set(func.args)
        for op in func.body.ops:  # (the backward's own products each read a gradient or P: two inputs is Q K)
            if op.name == "matmul" and not op.attrs.get("transpose_b") and not op.attrs.get("transpose_a") \
                    and all(_root(v) in args for v in op.operands):
                raise self.fail(f"the score product reads %{_root(op.operands[1]).name} as [..., D, N] (q @ k): "
                                "the backward kernels take k as [B, H, N, D] and the score as q @ k^T "
                                "(matmul with transpose_b), as fuse does for the forward")
        scores = [op for op in func.body.ops if op.name == "matmul" and op.attrs.get("transpose_b")
                  and not op.attrs.get("transpose_a") and op.results[0].type.rank == 4]
        if not scores:
            raise self.fail("no score product Q K^T (matmul with transpose_b): not a backward function")
        space: dict[Value, frozenset] = {}
        rows, cols = set(), set()
        for mm in scores:
            rows.add(_root(mm.operands[0]))
            cols.add(_root(mm.operands[1]))
        if rows & cols:
            raise self.fail("the same input is contracted as a query and as a key")
        M, N = scores[0].results[0].type.shape[2], scores[0].results[0].type.shape[3]
        q_like = next(iter(rows))
        # a table a gather reads (a bias [B, H, M, N] has o's leading dims too): whole, never a row tile
        tables = {op.operands[0] for op in func.walk() if op.name == "gather"}
        for a in func.args:
            t = a.type
            like_q = t.rank == 4 and a not in cols and t.shape[2] == M and t.shape[:2] == q_like.type.shape[:2]
            if a in tables and a not in rows and a not in cols:
                space[a] = Space()  # a captured table, read whole through gathers
            elif a in rows or like_q:
                space[a] = Space({R, H})
            elif a in cols:
                space[a] = Space({C})
            elif t.rank == 3 and t.shape[2] == M:
                space[a] = Space({R, H})  # LSE
            else:
                space[a] = Space()  # a captured table, read whole through gathers
        refuse_whole_captures(func, {a for a in func.args if space[a]}, self.fail, scores[0].operands[0].type.shape[3])
        group = 1
        users: dict[int, list[Op]] = {}
        for op in func.body.ops:
            for v in op.operands:
                users.setdefault(id(v), []).append(op)
        scatters: list[Op] = []
        scatter_path: set[int] = set()
        acc_kind: dict[int, str] = {}
        pre: set[int] = set()
        post: set[int] = set()
        probs: set[int] = set()
        accumulated: set[Value] = set()
        for op in func.body.ops:
            if op.name == "return":
                continue
            ins = [space[v] for v in op.operands]
            s: frozenset = Space().union(*ins) if ins else Space()
            n = op.name
            if n == "iota":
                s = Space({[None, H, R, C][op.attrs["axis"]]} - {None})
            elif n == "repeat_interleave":
                if op.attrs["axis"] != 1:
                    raise self.fail("only head repetition (repeat_interleave along axis 1, GQA) is supported")
                group = op.attrs["repeats"]
            elif n == "matmul":
                ax = 2 if op.attrs.get("transpose_a") else 3
                contracted = _axes(ins[0])[ax - 2]
                s = s - {contracted} if contracted else s
                if contracted:
                    acc_kind[id(op)] = contracted
                    if contracted == C:
                        s = s | {H}
            elif n in ("reduce_sum", "reduce_max"):
                axis, rank = op.attrs["axis"], op.operands[0].type.rank
                over_tiles = rank != 4 or axis < 2 or _axes(ins[0])[axis - 2] is not None
                if over_tiles and n == "reduce_sum" and _feeds_scatter(op, users):
                    scatter_path.add(id(op))  # a captured table's gradient, summed tile by tile
                elif over_tiles:
                    raise self.fail(f"a {n} over the batch, head, query or kv axis in the backward (axis {axis} "
                                    f"of {op.operands[0].type}) that is neither a captured tensor's gradient in a "
                                    f"form it takes (a sum that only adds into the gradient) nor the softmax "
                                    f"gradient's row sum (delta rewrites that one: run it first); a score function "
                                    f"that reduces the scores (not elementwise) has no tiled backward")
                elif R in s and C not in s:
                    pre.add(id(op))
            elif n == "scatter_add":
                scatters.append(op)
                s = Space()
            elif n == "exp" and _is_prob(op, space):
                probs.add(id(op))
            if any(v in accumulated for v in op.operands) and n != "scatter_add":
                if not all(v in accumulated or not (space[v] & {R, C}) for v in op.operands):
                    raise self.fail(f"{n} mixes an accumulated gradient with per-tile values")
                post.add(id(op))
                accumulated |= set(op.results)
            if id(op) in acc_kind or n == "scatter_add":
                accumulated |= set(op.results)
            for r in op.results:
                space[r] = s
        memo: dict[Value, bool] = {}
        for sc in scatters:
            if not _zero_where_p_is(sc.operands[1], probs, memo):
                raise self.fail(f"captured-table gradient %{sc.results[0].name or '?'} adds (scatter_add) a term "
                                "that is not 0 where the recomputed P is (a multiple of P, as autodiff makes it): "
                                "ragged tiles would add it on their padded rows and columns, empty tiles skip it")
        for v in func.results:
            if v not in accumulated and const_value(v) is None:
                raise self.fail(f"result %{v.name or '?'} is not a sum over tiles (no dV = P^T dO, dK, dQ "
                                f"product found for it)")
        _row_moves_into_pre(func, pre, users, space)
        heads = q_like.type.shape[1]
        kv_heads = next(iter(cols)).type.shape[1]
        plan = BackwardPlan(space, M, N, heads, kv_heads, q_like.type.shape[0], group, acc_kind, pre, post, probs,
                            scatters, scatter_path)
        for v, name in zip(func.results, func.result_names):  # name each sum after the result it becomes
            x = v
            while isinstance(x.owner, Op) and id(x.owner) in post and x.owner.operands:
                x = next((o for o in x.owner.operands if o in accumulated), x.owner.operands[0])
            if isinstance(x.owner, Op) and (id(x.owner) in acc_kind or x.owner.name == "scatter_add"):
                plan.labels[id(x.owner)] = name if x.type.dtype == v.type.dtype else f"{name}32"
        if self.skip:
            self._find_mask(func, plan)
        return plan

    def _find_mask(self, func: Func, plan: BackwardPlan) -> None:
        """The mask on the recomputed scores: `where(c, x, -inf)` peeled off X, where c reads only indices
        and captured tables. Its scalar predicate is what mask-tiles classifies tiles with (the kv bound
        added, as tile adds it in the forward), so both directions share one meaning of a tile class."""
        probs = [op for op in func.body.ops if id(op) in plan.probs]
        if len(probs) != 1:
            return
        x = probs[0].operands[0].owner.operands[0]  # type: ignore[union-attr]
        conj: list[Value] = []
        while (w := _is(x, "where")) is not None and is_const(w.operands[2], -math.inf) and \
                _index_only(w.operands[0], func):
            conj.append(w.operands[0])
            x = w.operands[1]
        if not conj:
            return
        caps = [a for a in func.args if not plan.space[a] and _reads(conj, a, func)]
        iotas = {op.results[0]: op.attrs["axis"] for op in backward_slice(func.body, conj) if op.name == "iota"}
        pred, pb, keep = build_predicate(func.body, conj, iotas, caps)
        inb = pb.op("lt", [pred.args[3], pb.const(plan.N)], [scalar("bool")], {"bounds": True},
                    names=["in_bounds"]).results[0]
        pb.op("yield", [pb.emit("and", keep, inb, name_hint="keep")], [])
        plan.conj, plan.pred, plan.pred_caps = conj, pred, caps

    # -------------------------------------------------------------------------------- lowering
    def run(self, func: Func) -> Func:
        plan = self.analyse(func)
        names = func.result_names
        body = Block([a.type for a in func.args], [a.name for a in func.args])
        argmap = dict(zip(func.args, body.args))
        b = Builder(body)
        stored = self._preprocess(func, plan, b, argmap)
        table = None
        if self.data not in ("table", "ranges"):
            raise self.fail(f"data must be table or ranges, got {self.data!r}")
        rplan = range_plan(plan.pred) if plan.pred is not None and uses_data(plan.pred) and self.data == "ranges" \
            else None
        if rplan is not None:  # run-time data bounded per granule: tiles classified like a static mask's
            caps = [argmap[c] for c in plan.pred_caps]
            plan.range_tables, plan.range_spec = add_ranges(b, caps, rplan, math.gcd(self.bq, self.bk))
            for t in plan.range_tables:
                plan.pred.add_arg(t.type, t.name)  # type: ignore[union-attr]
        elif plan.pred is not None and uses_data(plan.pred):  # classes from the data, once, for both nests
            tbl_t = TensorType("i8", (plan.batch, plan.heads, cdiv(plan.M, self.bq), cdiv(plan.N, self.bk)))
            (table,) = b.op("mask.block_table", [argmap[c] for c in plan.pred_caps], [tbl_t],
                            {"bq": self.bq, "bk": self.bk, "m": plan.M, "n": plan.N},
                            [clone_block(plan.pred, {})], names=["block_class"]).results
        # a constant gradient (a float table read only by the mask: zero) is made once, outside the nests
        outs: dict[Value, Value] = {v: b.op("const", [], [v.type], dict(v.owner.attrs), names=[v.name]).results[0]
                                    for v in func.results if const_value(v) is not None}
        c_results = [v for v in func.results if C in plan.space[v] and v not in outs]
        r_results = [v for v in func.results if R in plan.space[v] and C not in plan.space[v]]
        table_results = [v for v in func.results if v not in c_results and v not in r_results
                         and v not in outs]  # captured tables' gradients
        if not c_results:
            raise self.fail("no gradient of k or v: the kv-outer loop nest has nothing to compute")
        if self.dq == "atomic":  # one nest: dQ's tiles are added into an accumulator
            outs.update(self._kv_nest(func, plan, b, argmap, stored, c_results, table, r_results + table_results))
        else:
            outs.update(self._kv_nest(func, plan, b, argmap, stored, c_results, table, table_results))
            if r_results:
                outs.update(zip(r_results, self._q_nest(func, plan, b, argmap, stored, r_results, table)))
        b.ret(*[outs[v] for v in func.results])
        new = Func(func.name, body, dict(func.attrs))
        new.attrs["result_names"] = tuple(names)
        return new

    def _preprocess(self, func: Func, plan: BackwardPlan, b: Builder, argmap) -> dict[Value, Value]:
        """Row reductions (Delta) in a q-tile nest of their own; returns original value -> stored tensor."""
        pre = [op for op in func.body.ops if id(op) in plan.pre]
        if not pre:
            return {}
        acc = _acc_dtype(r.results[0] for r in pre)
        types = [TensorType(acc, r.results[0].type.shape) for r in pre]

        def nest(pb: Builder, ivs: list[Value]):
            bi, h, qi = ivs
            q0 = pb.emit("mul", qi, pb.const(self.bq), name_hint="q0")
            ctx = _Ctx(self, plan, argmap, {}, bi=bi, h=h, hk=None, q0=q0, k0=None)
            ctx.scopes = [(Space({R, H}), pb, {})]
            tiles = [ctx.emit(op.results[0]) for op in pre]
            tiles = [t if t.type.dtype == acc else pb.cast(t, acc) for t in tiles]
            return [(t, [bi, h, (q0, self.bq), ":"]) for t in tiles]

        results = b.parallel_for([plan.batch, plan.heads, cdiv(plan.M, self.bq)], ["b", "h", "qi"], types, nest,
                                 result_names=[_row_name(op) for op in pre])
        return {op.results[0]: r for op, r in zip(pre, results)}

    def _kv_nest(self, func, plan: BackwardPlan, b: Builder, argmap, stored, results: list[Value],
                 table: Optional[Value], atomic_results: list[Value]) -> dict[Value, Value]:
        """dK, dV (and with dq=atomic dQ, added tile by tile into an accumulator of the nest)."""
        G, bq, bk = plan.group, self.bq, self.bk
        accs = [op for op in func.body.ops if plan.acc_kind.get(id(op)) == R]
        atomics = [op for op in func.body.ops if plan.acc_kind.get(id(op)) == C] \
            if any(C not in plan.space[v] and R in plan.space[v] for v in atomic_results) else []
        chains = _scatter_chains(plan.scatters)  # one accumulator per captured table's gradient

        def nest(pb: Builder, ivs: list[Value], acc_args: tuple = ()):
            bi, hk, kj = ivs
            k0 = pb.emit("mul", kj, pb.const(bk), name_hint="k0")
            fixed = Space({C}) if G > 1 else Space({C, H})
            ctx = _Ctx(self, plan, argmap, stored, bi=bi, h=hk if G == 1 else None, hk=hk, q0=None, k0=k0)
            ctx.scopes = [(fixed, pb, {})]
            nq = pb.const(cdiv(plan.M, bq), name_hint="nq")
            lo, hi = pb.const(0), nq
            if G > 1:
                hi = pb.emit("mul", nq, pb.const(G), name_hint="n_inner")
            elif plan.pred is not None and table is None:  # the q tiles that can see this kv tile
                lo, hi = pb.op("mask.q_range", [bi, hk, k0, pb.const(plan.M), *ctx.caps()], [I32, I32],
                               ctx.mask_attrs(), [clone_block(plan.pred, {})], names=["q_lo", "q_hi"]).results
            pos: dict[str, Value] = {}

            def position(lb: Builder, it: Value) -> None:
                if G > 1:
                    ctx.h = lb.emit("add", lb.emit("mul", hk, lb.const(G)), lb.emit("floordiv", it, nq), name_hint="h")
                    pos["qi"] = lb.emit("mod", it, nq, name_hint="qi")
                else:
                    pos["qi"] = it
                ctx.q0 = lb.emit("mul", pos["qi"], lb.const(bq), name_hint="q0")

            def cls_of(lb: Builder) -> Value:
                return ctx.tile_class(lb, table, pos["qi"], kj)

            ctx.atomics = list(zip(atomics, acc_args))
            if self.deterministic:  # each iteration sums its own copy of the table, summed in order afterwards
                ctx.scatter_accs = {id(op): i for i, chain in enumerate(chains) for op in chain}
                tables = [pb.const(0.0, TensorType(_acc_dtype([c[-1].results[0]]), c[-1].results[0].type.shape),
                                   name_hint=f"{plan.label(c[-1])}_0") for c in chains]
            else:
                ctx.scatter_accs = {id(op): acc for chain, acc in zip(chains, acc_args[len(atomics):]) for op in chain}
                tables = []
            out = self._loop(ctx, pb, lo, hi, accs, "it" if G > 1 else "qi", position, cls_of, tables)
            sums, parts = out[:len(accs)], out[len(accs):]
            ctx.finished = dict(zip([op.results[0] for op in accs], sums))
            tiles = [(ctx.emit_post(v), [bi, hk, (k0, bk), ":"]) for v in results]
            return tiles + [(t, [bi, hk, kj] + [":"] * t.type.rank) for t in parts]

        part_chains = chains if self.deterministic else []
        part_types = [TensorType(_acc_dtype([c[-1].results[0]]),
                                 (plan.batch, plan.kv_heads, cdiv(plan.N, bk)) + c[-1].results[0].type.shape)
                      for c in part_chains]
        sums_of = atomics + ([] if self.deterministic else [chain[-1] for chain in chains])
        acc_types = [TensorType(_acc_dtype([op.results[0]]), op.results[0].type.shape) for op in sums_of]
        got = b.parallel_for([plan.batch, plan.kv_heads, cdiv(plan.N, bk)], ["b", "hk", "kj"],
                             [v.type for v in results] + part_types, nest,
                             [v.name for v in results] + [f"{plan.label(c[-1])}_parts" for c in part_chains],
                             list(zip(acc_types, [f"{plan.label(op)}_acc" for op in sums_of])))
        n_stored = len(results) + len(part_types)
        outs = dict(zip(results, got[:len(results)]))
        # after the nest: the f32 sums through the ops that followed them (dQ's cast, a table's cast)
        whole = dict(zip([op.results[0] for op in sums_of], got[n_stored:]))
        for chain, parts in zip(part_chains, got[len(results):n_stored]):
            t = parts
            for axis in (0, 1, 2):  # over b, the kv heads and the kv tiles, in that fixed order
                t = b.emit("reduce_sum", t, axis=axis, name_hint=f"{plan.label(chain[-1])}_sum")
            for _ in range(3):
                t = b.emit("squeeze", t, axis=0)
            whole[chain[-1].results[0]] = t
        for v in atomic_results:
            outs[v] = _clone_post(b, v, whole, plan)
        return outs

    def _q_nest(self, func, plan: BackwardPlan, b: Builder, argmap, stored, results: list[Value],
                table: Optional[Value]) -> list[Value]:
        bq, bk = self.bq, self.bk
        accs = [op for op in func.body.ops if plan.acc_kind.get(id(op)) == C]

        def nest(pb: Builder, ivs: list[Value]):
            bi, h, qi = ivs
            q0 = pb.emit("mul", qi, pb.const(bq), name_hint="q0")
            hk = pb.emit("floordiv", h, pb.const(plan.group), name_hint="hk") if plan.group > 1 else h
            ctx = _Ctx(self, plan, argmap, stored, bi=bi, h=h, hk=hk, q0=q0, k0=None)
            ctx.scopes = [(Space({R, H}), pb, {})]
            lo, hi = pb.const(0), pb.const(cdiv(plan.N, bk), name_hint="nk")
            if plan.pred is not None and table is None:  # the kv tiles this q tile can see
                lo, hi = pb.op("mask.kv_range", [bi, h, q0, pb.const(plan.N), *ctx.caps()], [I32, I32],
                               ctx.mask_attrs(), [clone_block(plan.pred, {})], names=["kv_lo", "kv_hi"]).results
            pos: dict[str, Value] = {}

            def position(lb: Builder, kj: Value) -> None:
                pos["kj"] = kj
                ctx.k0 = lb.emit("mul", kj, lb.const(bk), name_hint="k0")

            def cls_of(lb: Builder) -> Value:
                return ctx.tile_class(lb, table, qi, pos["kj"])

            sums = self._loop(ctx, pb, lo, hi, accs, "kj", position, cls_of)
            ctx.finished = dict(zip([op.results[0] for op in accs], sums))
            return [(ctx.emit_post(v), [bi, h, (q0, bq), ":"]) for v in results]

        return b.parallel_for([plan.batch, plan.heads, cdiv(plan.M, bq)], ["b", "h", "qi"], [v.type for v in results],
                              nest, result_names=[v.name for v in results])

    def _loop(self, ctx: "_Ctx", pb: Builder, lo: Value, hi: Value, accs: list[Op], iv: str, position, cls_of,
              tables: Optional[list[Value]] = None):
        """The inner loop over tiles, summing each accumulated product (and, deterministic, carrying this
        iteration's copy of each captured table's gradient). With a mask, each tile's class decides: empty
        tiles are skipped, full ones run without the mask (and without the kv bound), partial ones with it."""
        tables = tables or []
        inits = [pb.const(0.0, TensorType(_acc_dtype([op.results[0]]), ctx.tile_shape(op.results[0]))) for op in accs]
        inits += tables
        names = [ctx.plan.label(op) for op in accs] + [t.name or "table" for t in tables]

        def body(bb: Builder, full: bool) -> list[Value]:
            ctx.scopes.append((Space({R, C, H}), bb, {}))
            ctx.full = full
            nxt = [bb.emit("add", st, ctx.emit_product(op), name_hint=f"{n}_next")
                   for st, op, n in zip(ctx.state, accs, names)]
            carried = list(ctx.state[len(accs):])
            for op, acc in ctx.atomics:  # dQ += dS K for this q tile, into the nest's accumulator
                part = ctx.emit_product(op)
                bb.op("tile.atomic_add", [acc, part, ctx.bi, ctx.h, ctx.q0], [],
                      {"slice": ("i", "i", self.bq, ":")})
            for op in [x for x in ctx.plan.scatters if id(x) in ctx.scatter_accs]:  # (the kv-outer nest only)
                # this tile's share of a captured table's gradient
                upd = ctx.emit(op.operands[1])
                idx = [ctx.emit(i) for i in op.operands[2:]]
                where = ctx.scatter_accs[id(op)]
                acc = (carried[where] if isinstance(where, int) else where).type.dtype
                upd = upd if upd.type.dtype == acc else bb.cast(upd, acc)
                if isinstance(where, int):  # deterministic: into this iteration's own copy
                    carried[where] = bb.emit("scatter_add", carried[where], upd, *idx, name_hint="table_next")
                else:
                    bb.op("tile.scatter_add", [where, upd, *idx], [], {})
            ctx.scopes.pop()
            return nxt + carried

        def inner(lb: Builder, i: Value, state: list[Value]) -> list[Value]:
            position(lb, i)
            ctx.state = state
            if ctx.plan.pred is None:
                return body(lb, False)
            cls = cls_of(lb)
            empty = lb.emit("eq", cls, lb.const(0), name_hint="empty_tile")
            full = lb.emit("eq", cls, lb.const(2), name_hint="full_tile")
            types = [x.type for x in state]
            nxt = [f"{n}_next" for n in names]
            return lb.if_(empty, types, lambda sb: state,
                          lambda sb: sb.if_(full, types, lambda fb: body(fb, True), lambda mb: body(mb, False),
                                            result_names=nxt), result_names=nxt)

        return pb.for_loop(lo, hi, inits, inner, iv_name=iv, iter_names=[f"{n}_i" for n in names],
                           result_names=names)


def _clone_post(b: Builder, v: Value, done: dict[Value, Value], plan: BackwardPlan) -> Value:
    """A result computed from whole accumulated sums at the top level (dQ's cast after its atomic sum)."""
    if v in done:
        return done[v]
    op = v.owner
    assert isinstance(op, Op)
    if op.name == "const":
        out = b.const(op.attrs["value"], v.type, name_hint=v.name)
    else:
        if any(x not in done and id(x.owner) not in plan.post and not _is(x, "const") for x in op.operands):
            raise PassError(f"pass tile-bwd: {op.name} combines a summed gradient with a value of the loops")
        operands = [_clone_post(b, x, done, plan) for x in op.operands]
        out = b.op(op.name, operands, [v.type], dict(op.attrs), names=[v.name]).results[0]
    done[v] = out
    return out


def _total_sum(v: Value) -> Optional[Value]:
    """The rank-4 [1,1,1,1] reduce_sum whose squeezes v is (autodiff's sum of a score-sized value over every axis)."""
    x = v
    while isinstance(x.owner, Op) and x.owner.name == "squeeze":
        x = x.owner.operands[0]
    if x is v or x.type.rank != 4 or not (isinstance(x.owner, Op) and x.owner.name == "reduce_sum"):
        return None
    return x


def _argument_scalar(v: Value) -> bool:
    """A rank-0 value computed by elementwise ops from the function's arguments, their entries at constant indices
    and constants alone (exp(t), 1 / t[0])."""
    op = v.owner
    if not isinstance(op, Op):
        return v.type.rank == 0
    if v.type.rank == 0 and op.name == "gather":  # an entry of a captured table at constant indices (t[0])
        return not isinstance(op.operands[0].owner, Op) and all(_argument_scalar(x) for x in op.operands[1:])
    return v.type.rank == 0 and (op.name == "const" or OPS[op.name].kind == "elementwise" and all(
        _argument_scalar(x) for x in op.operands))


def _linear(v: Value) -> bool:
    """v is a linear combination of total sums: sums, neg, add / sub of two, a product or quotient by an argument
    scalar (`s / t`'s gradient is -sum(...), `s * exp(t)`'s sum(...) * exp(t), a scalar read twice the add of two)."""
    op = v.owner
    if v.type.rank != 0 or not isinstance(op, Op):
        return False
    if _total_sum(v) is not None:
        return True
    if op.name == "neg":
        return _linear(op.operands[0])
    if op.name in ("add", "sub"):
        return all(_linear(x) for x in op.operands)
    if op.name == "mul":
        a, c = op.operands
        return _linear(a) and _argument_scalar(c) or _linear(c) and _argument_scalar(a)
    if op.name == "div":
        return _linear(op.operands[0]) and _argument_scalar(op.operands[1])
    return False


def _leaves(v: Value) -> list[Value]:
    """The total sums (`_total_sum`) a `_linear` combination v adds up."""
    x = _total_sum(v)
    if x is not None:
        return [x]
    op = v.owner
    assert isinstance(op, Op)
    return [y for o in op.operands if _linear(o) for y in _leaves(o)]


def _sum_chain(x: Value) -> Optional[tuple[Value, list[int]]]:
    """(the score-sized value, the axes) where the total sum x is reduce_sums alone over it, else None."""
    axes = []
    while isinstance(x.owner, Op) and x.owner.name == "reduce_sum":
        axes.append(x.owner.attrs["axis"])
        x = x.owner.operands[0]
    return (x, axes[::-1]) if axes and x.type.rank == 4 else None


def _emit_linear(b: Builder, v: Value, leaf: Optional[Value] = None) -> Value:
    """`_linear`'s combination taken before the sums: the same ops on the [1,1,1,1] sums, or, with `leaf`, on the
    one sum's score-sized operand (a single sum: neg, products and quotients by argument scalars commute with it)."""
    x = _total_sum(v)
    if x is not None:
        return leaf if leaf is not None else x
    op = v.owner
    assert isinstance(op, Op)
    if op.name == "neg":
        return b.emit("neg", _emit_linear(b, op.operands[0], leaf))
    if op.name in ("add", "sub"):
        return b.emit(op.name, *(_emit_linear(b, y, leaf) for y in op.operands))
    a, c = op.operands
    if op.name == "mul" and not _linear(a):
        a, c = c, a
    return b.emit(op.name, _emit_linear(b, a, leaf), c)


def _emit_combination(b: Builder, z: Value) -> Value:
    """The [1,1,1,1] value the scatter adds for the combination z: for one sum over a score-sized value, the
    combination applied to that value, then its sums (the kernels read a scatter's value per element: `s / t`'s
    -sum(x) as sum(-x)); for several, the combination of the sums (right in the IR; the kernels refuse it)."""
    leaves = _leaves(z)
    chain = _sum_chain(leaves[0]) if len(leaves) == 1 else None
    if chain is None:
        return _emit_linear(b, z)
    e = _emit_linear(b, z, chain[0])
    for axis in chain[1]:
        e = b.emit("reduce_sum", e, axis=axis)
    return e


def _row_moves_into_pre(func: Func, pre: set[int], users: dict[int, list[Op]], space: dict) -> None:
    """A row reduction's one use that is elementwise on rows (no kv axis) and reads nothing else of the backward
    (Delta - dlse: the LSE's cotangent, passes/lse_cotangent.py) is made in the preprocessing nest in its place, so
    the main loops read the moved row as they read Delta, the form the kernels take (with_lse_cotangent's)."""
    for op in list(func.body.ops):
        if id(op) not in pre:
            continue
        use = users.get(id(op.results[0]), [])
        if len(use) != 1 or use[0].name not in ("sub", "add") or C in space[use[0].results[0]]:
            continue
        other = [v for v in use[0].operands if v is not op.results[0]]
        if len(other) == 1 and not (C in space[other[0]]) and _from_args_only(other[0], func):
            pre.discard(id(op))
            pre.add(id(use[0]))


def _from_args_only(v: Value, func: Func) -> bool:
    """v is a function argument, or unsqueezes / casts of one."""
    while isinstance(v.owner, Op) and v.owner.name in ("unsqueeze", "cast"):
        v = v.owner.operands[0]
    return v in func.args


def _row_name(op: Op) -> str:
    """The preprocessing nest's result for a row value: `delta` for Delta and for Delta moved by the LSE's
    cotangent (what with_lse_cotangent and the backend look for), else the value's own name."""
    if op.name in ("sub", "add"):
        return "delta"
    return op.results[0].name or "delta"


def _scalar_sums_as_scatters(func: Func) -> None:
    """A captured scalar's gradient (autodiff's sum over every axis, squeezed to rank 0) becomes a one-slot
    scatter_add (into f32[1] at index 0) squeezed to rank 0: the same sum, in the form whose per-tile accumulation
    the kv-outer nest already does for gathered tables (a 0-d temperature, a softcap). Where the gradient is a
    linear combination of such sums (`_linear`: `s / t`, `s - t`, `s * exp(t)`, a scalar read twice), the
    combination is taken on the sums' [1,1,1,1] values before the one scatter, so the kernels add one accumulator a
    scalar; casts to the result's dtype stay after it."""
    body = func.body
    for r in func.results:
        if r.type.rank != 0 or not is_float(r.type.dtype):
            continue
        z = r
        while isinstance(z.owner, Op) and z.owner.name == "cast":
            z = z.owner.operands[0]
        if not _linear(z):
            continue
        at = body.ops.index(z.owner)
        tail, body.ops = body.ops[at:], body.ops[:at]
        b = Builder(body)
        x = _emit_combination(b, z)
        zeros = b.const(0.0, TensorType(x.type.dtype, (dim(1),)), name_hint="slot")
        table = b.emit("scatter_add", zeros, x, b.const(0, I32), name_hint=f"{z.name or 'd'}_slot")
        y = b.emit("squeeze", table, axis=0, name_hint=z.name)
        body.ops.extend(tail)
        replace_uses(body, z, y)
    for sc in [op for op in body.ops if op.name == "scatter_add"]:
        u = sc.operands[1]  # an entry of a captured table read at a constant index (t[0]): its update is a total sum
        if u.type.rank == 0 and is_float(u.type.dtype) and _linear(u):
            at = body.ops.index(sc)
            tail, body.ops = body.ops[at:], body.ops[:at]
            sc.operands[1] = _emit_combination(Builder(body), u)
            body.ops.extend(tail)
    dce(func)  # the squeezes and the rank-0 combination are dead now


def _feeds_scatter(op: Op, users: dict[int, list[Op]]) -> bool:
    """Whether every use of `op`'s result ends, through elementwise ops and reductions, in the updates of a
    scatter_add: then a sum over tiles is the accumulation the scatter does anyway."""
    stack, seen = [op], set()
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        for u in users.get(id(cur.results[0]), []):
            if u.name == "scatter_add":
                if u.operands[1] is not cur.results[0]:
                    return False
            elif u.name in ("reduce_sum", "squeeze", "unsqueeze", "cast") or OPS[u.name].kind == "elementwise":
                stack.append(u)
            else:
                return False
    return True


def _scatter_chains(scatters: list[Op]) -> list[list[Op]]:
    """scatter_adds into the same table (one adds into the other's result) share one accumulator."""
    chains: list[list[Op]] = []
    owner: dict[int, list[Op]] = {}
    for op in scatters:
        prev = op.operands[0].owner
        chain = owner.get(id(prev)) if isinstance(prev, Op) else None
        if chain is None:
            chain = []
            chains.append(chain)
        chain.append(op)
        owner[id(op)] = chain
    return chains


def _index_only(v: Value, func: Func) -> bool:
    """A boolean computed from indices and captured tables only (a mask), not from q, k or the scores."""
    if v.type.dtype != "bool":
        return False
    for op in backward_slice(func.body, [v]):
        for x in op.operands:
            if isinstance(x.owner, Block) and is_float(x.type.dtype) and op.name != "gather":
                return False
        if op.name == "matmul":
            return False
    return True


def _reads(roots: list[Value], arg: Value, func: Func) -> bool:
    return any(arg in op.operands for op in backward_slice(func.body, roots))


def _zero_where_p_is(v: Value, probs: set[int], memo: dict[Value, bool]) -> bool:
    """Whether v is 0 wherever the recomputed P is, by its ops: P itself, a constant 0, a product with such a value,
    a quotient of one, a sum, difference or select of two, and the negations, casts, sums and reshapes of one.
    Autodiff makes a captured table's gradient so (dS = P * (dP - Delta) times the score's derivative, selected or
    guarded); the tiles rely on it: P is 0 on a ragged tile's padded rows and columns (its X is masked by the bounds)
    and on an empty tile, so a scatter's update there must be too."""
    if v in memo:
        return memo[v]
    op = v.owner
    if not isinstance(op, Op):
        out = False
    elif id(op) in probs:
        out = True
    elif op.name == "const":
        out = is_const(v, 0.0)
    elif op.name == "mul":
        out = any(_zero_where_p_is(x, probs, memo) for x in op.operands)
    elif op.name in ("div", "neg", "cast", "reduce_sum", "squeeze", "unsqueeze", "broadcast_to"):
        out = _zero_where_p_is(op.operands[0], probs, memo)
    elif op.name in ("add", "sub"):
        out = all(_zero_where_p_is(x, probs, memo) for x in op.operands)
    elif op.name == "where":
        out = all(_zero_where_p_is(x, probs, memo) for x in op.operands[1:])
    else:
        out = False
    memo[v] = out
    return out


def _is_prob(op: Op, space: dict[Value, frozenset]) -> bool:
    """exp(X - LSE): the recomputed P (its subtrahend is the saved row statistic, broadcast)."""
    sub = op.operands[0].owner
    if not isinstance(sub, Op) or sub.name != "sub":
        return False
    x, stat = sub.operands
    return {R, C} <= space.get(x, Space()) and C not in space.get(stat, Space())


class _Ctx:
    """Emits the tile form of whole-tensor values inside one loop nest, each in the outermost scope whose
    fixed indices it depends on (a value of the kv rows once per kv tile, a score tile per tile pair)."""

    def __init__(self, tb: TileBwd, plan: BackwardPlan, argmap, stored, *, bi, h, hk, q0, k0):
        self.tb, self.plan, self.argmap, self.stored = tb, plan, argmap, stored
        self.bi, self.h, self.hk, self.q0, self.k0 = bi, h, hk, q0, k0
        self.scopes: list[tuple[frozenset, Builder, dict]] = []
        self.finished: dict[Value, Value] = {}
        self.full = False  # emitting a full tile: the mask and the kv bound are dropped
        self.state: list[Value] = []
        self.atomics: list[tuple[Op, Value]] = []  # (product, accumulator) added tile by tile (dq=atomic)
        # id(scatter_add) -> the accumulator of its table's gradient, or (deterministic) its loop state's index
        self.scatter_accs: dict[int, Any] = {}

    def caps(self) -> list[Value]:
        return [self.argmap[c] for c in self.plan.pred_caps] + self.plan.range_tables

    def mask_attrs(self) -> dict:
        ranges = {"ranges": self.plan.range_spec} if self.plan.range_spec else {}
        return {"bq": self.tb.bq, "bk": self.tb.bk, **ranges}

    def tile_class(self, b: Builder, table: Optional[Value], qi: Value, kj: Value) -> Value:
        """This tile pair's class: from the block table (data masks) or by interval analysis."""
        if table is not None:
            c8 = b.tile_load(table, [self.bi, self.h, qi, kj], name_hint="cls8")
            return b.emit("cast", c8, to="i32", name_hint="cls")
        assert self.plan.pred is not None
        return b.op("mask.classify", [self.bi, self.h, self.q0, self.k0, *self.caps()], [I32],
                    self.mask_attrs(), [clone_block(self.plan.pred, {})], names=["cls"]).results[0]

    def tile_shape(self, v: Value) -> tuple:
        s, t = self.plan.space[v], v.type
        a2, a3 = _axes(s)
        size = {R: self.tb.bq, C: self.tb.bk}
        return tuple(dim(d) for d in (size[a2] if a2 else t.shape[2], size[a3] if a3 else t.shape[3]))

    def _scope(self, v: Value) -> tuple[Builder, dict]:
        need = self.plan.space[v] & {R, C, H}
        for fixed, bld, memo in self.scopes:
            if need <= fixed:
                return bld, memo
        return self.scopes[-1][1], self.scopes[-1][2]

    def _lookup(self, v: Value) -> Optional[Value]:
        for _, _, memo in self.scopes:
            if v in memo:
                return memo[v]
        return None

    def emit(self, v: Value) -> Value:
        got = self._lookup(v)
        if got is not None:
            return got
        if v in self.stored:
            bld, memo = self._scope(v)
            memo[v] = bld.tile_load(self.stored[v], [self.bi, self.h, (self.q0, self.tb.bq), ":"],
                                    name_hint=v.name)
            return memo[v]
        bld, memo = self._scope(v)
        memo[v] = self._emit_new(v, bld)
        return memo[v]

    def _emit_new(self, v: Value, b: Builder) -> Value:
        op = v.owner
        if not isinstance(op, Op):  # a function argument
            a = self.argmap[v]
            s = self.plan.space[v]
            if R in s:
                idx = [self.bi, self.h, (self.q0, self.tb.bq)] + [":"] * (v.type.rank - 3)
                return b.tile_load(a, idx, name_hint=f"{v.name}_t")
            if C in s:
                return b.tile_load(a, [self.bi, self.hk, (self.k0, self.tb.bk), ":"], name_hint=f"{v.name}_t")
            return a  # a captured table, whole
        n = op.name
        if n == "iota":
            axis = op.attrs["axis"]
            if axis == 0:
                return self.bi
            if axis == 1:
                return self.h
            if axis == 2:
                return b.tile_iota(self.q0, 0, [self.tb.bq, 1], name_hint=v.name or "q_idx")
            return b.tile_iota(self.k0, 1, [1, self.tb.bk], name_hint=v.name or "kv_idx")
        if n == "repeat_interleave":
            return self.emit(op.operands[0])
        if n == "const":
            if v.type.rank and any(d != dim(1) for d in v.type.shape):
                raise self.tb.fail(f"a constant of shape {v.type} cannot be tiled (canonicalize first)")
            return b.const(op.attrs["value"], TensorType(v.type.dtype, ()), name_hint=v.name)
        if n == "where" and self.full and op.operands[0] in self.plan.conj:
            return self.emit(op.operands[1])  # a full tile keeps every score: no mask arithmetic
        if n == "matmul":
            if id(op) in self.plan.acc_kind:
                raise self.tb.fail("an accumulated product is used before the sum over tiles is complete")
            return b.tile_matmul(self.emit(op.operands[0]), self.emit(op.operands[1]), name_hint=v.name, **op.attrs)
        if id(op) in self.plan.probs:
            operands = [self._bounded_prob_arg(b, op)]
        else:
            operands = [self.emit(x) for x in op.operands]
        attrs = dict(op.attrs)
        if id(op) in self.plan.scatter_path and op.operands[0].type.rank == 4 and attrs["axis"] < 2:
            return operands[0]  # a sum over b or h: the accumulator adds up the iterations (b, h) already
        if n in ("reduce_sum", "reduce_max", "squeeze", "unsqueeze") and op.operands[0].type.rank >= 3:
            attrs["axis"] = attrs["axis"] - 2
        try:
            types = OPS[n].infer([x.type for x in operands], attrs)  # type: ignore[misc]
        except OpTypeError as e:
            raise self.tb.fail(f"cannot move {n} to tiles: {e}") from None
        return b.op(n, operands, types, attrs, names=[v.name]).results[0]

    def _bounded_prob_arg(self, b: Builder, op: Op) -> Value:
        """X - LSE with X = -inf past the last row or column: padded positions get P = 0."""
        sub = op.operands[0].owner
        assert isinstance(sub, Op)
        x = self.emit(sub.operands[0])
        stat = self.emit(sub.operands[1])
        qi = b.tile_iota(self.q0, 0, [self.tb.bq, 1], name_hint="q_row")
        inb = b.emit("lt", qi, b.const(self.plan.M), name_hint="row_in_bounds")
        if not self.full:  # a full tile is never ragged along kv (its class includes the kv bound)
            ki = b.tile_iota(self.k0, 1, [1, self.tb.bk], name_hint="kv_col")
            inb = b.emit("and", inb, b.emit("lt", ki, b.const(self.plan.N)), name_hint="in_bounds")
        xb = b.op("where", [inb, x, b.const(-math.inf, scalar(x.type.dtype))], [x.type], {"bounds": True},
                  names=["x_in"]).results[0]
        return b.emit("sub", xb, stat, name_hint=sub.results[0].name)

    def emit_product(self, op: Op) -> Value:
        """One tile's term of an accumulated product (dV += P^T dO and the like)."""
        return self.scopes[-1][1].tile_matmul(self.emit(op.operands[0]), self.emit(op.operands[1]),
                                              name_hint=f"{self.plan.label(op)}_t", **op.attrs)

    def emit_post(self, v: Value) -> Value:
        """A result after its sum over tiles: the sum itself, then casts (and GQA's group sum, which the
        loop over the group's heads already did)."""
        if v in self.finished:
            return self.finished[v]
        op = v.owner
        assert isinstance(op, Op)
        if op.name == "group_sum":
            return self.emit_post(op.operands[0])
        operands = [self.emit_post(x) if x in self.finished or id(x.owner) in self.plan.post  # type: ignore[arg-type]
                    else self.emit(x) for x in op.operands]
        b = self.scopes[0][1]
        types = OPS[op.name].infer([x.type for x in operands], dict(op.attrs))  # type: ignore[misc]
        out = b.op(op.name, operands, types, dict(op.attrs), names=[v.name]).results[0]
        self.finished[v] = out
        return out
