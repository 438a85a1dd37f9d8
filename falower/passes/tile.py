"""tile{bq,bk,order}: split the query and key/value axes into tiles.

The result is still an exact softmax: for each q tile the kv axis is visited three times (row max, row
sum, then P @ V), recomputing the score tile each time. That is the honest tiled form of the decomposed
graph; online-softmax then merges the three loops into one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value
from ..ir.dims import Dim, cdiv
from ..ir.types import TensorType, scalar, tensor
from .attention import Attention, find_attention, retype_block
from .base import Pass, register
from .canonicalize import const_value

ORDERS = ("fa2", "fa1")
RAGGED_Q = ("last", "first")


@dataclass
class ScoreTile:
    """What the loops need to recompute one score tile."""

    att: Attention
    fused: Op
    bq: int
    bk: int
    captures: list[Value]

    def kv_index(self, b: Builder, kj: Value) -> Value:
        return b.emit("mul", kj, b.const(self.bk), name_hint="k0")

    def emit(self, b: Builder, bi: Value, h: Value, hk: Value, qt: Value, qidx: Value, k0: Value,
             bounds: bool = True) -> Value:
        """The score tile x[bq, bk] for the q tile `qt` and the kv tile starting at `k0`."""
        kt = b.tile_load(self.att.k, [bi, hk, (k0, self.bk), ":"], name_hint="kt")
        s = b.tile_matmul(qt, kt, transpose_b=True, name_hint="s")
        kvidx = b.tile_iota(k0, 1, [1, self.bk], name_hint="kv_idx")
        return emit_score(b, self, s, bi, h, qidx, kvidx, bounds)


def emit_score(b: Builder, st: ScoreTile, s: Value, bi: Value, h: Value, qidx: Value, kvidx: Value,
               bounds: bool = True) -> Value:
    """The fused score function on tiles; columns past the end of the kv axis get -inf (`bounds`)."""
    region = st.fused.regions[0]
    roles = st.fused.attrs["roles"]
    by_role = {"s": s, "b": bi, "h": h, "q": qidx, "kv": kvidx}
    operands, types, caps = [], [], iter(st.captures)
    for role, old in zip(roles, st.fused.operands):
        v = by_role[role] if role != "cap" else next(caps)
        operands.append(v)
        types.append(v.type)
    new_region = retype_block(region, types)
    out_t = new_region.terminator.operands[0].type  # type: ignore[union-attr]
    roles = list(roles)
    if bounds and "kv" not in roles:
        # the bounds mask needs the kv index even when the score function does not read it
        pos = roles.index("cap") if "cap" in roles else len(roles)
        roles.insert(pos, "kv")
        operands.insert(pos, kvidx)
        new_region.args.insert(pos, Value(kvidx.type, "kv", new_region, pos))
        for i, a in enumerate(new_region.args):
            a.index = i
    if bounds:
        new_region = _with_kv_bounds(new_region, roles, st.att.k.type.shape[2])
        out_t = new_region.terminator.operands[0].type  # type: ignore[union-attr]
    (x,) = b.op("fused", operands, [out_t], {"roles": tuple(roles)}, [new_region], names=["x"]).results
    return x


def _with_kv_bounds(region: Block, roles: list[str], n: Dim) -> Block:
    """Append `where(kv < N, x, -inf) {bounds}` to a tiled score region (adding a kv argument if needed); N is
    K's length, whatever its dim is named."""
    if "kv" not in roles:
        raise AssertionError("tiled score regions always take kv")
    kv = region.args[roles.index("kv")]
    term = region.ops.pop()
    b = Builder(region)
    x = term.operands[0]
    n = b.const(n)
    inb = b.op("lt", [kv, n], [TensorType("bool", kv.type.shape)], {"bounds": True}, names=["in_bounds"]).result
    ninf = b.const(-math.inf, scalar(x.type.dtype))
    y = b.op("where", [inb, x, ninf], [TensorType(x.type.dtype, (x.type.shape[0], kv.type.shape[1]))
                                        if x.type.rank == 2 else x.type], {"bounds": True}).result
    b.op("yield", [y], [])
    return region


@register
@dataclass(frozen=True)
class Tile(Pass):
    """Tile the q axis (parallel) and the kv axis (sequential); ragged last tiles are padded and masked.

    Requires: a fused attention graph (run fuse first). Options: bq, bk (tile sizes), order = fa2 (q tiles
    outer in a parallel loop over (b, h, q-tile); the default) or fa1 (a parallel loop over (b, h), q tiles
    in a sequential loop, O written back into a loop-carried tensor; online-softmax then moves the kv loop
    outside, which is FlashAttention-1's Algorithm 1). GQA: k and v are loaded at kv head h // group, with
    no copies. ragged_q = last (the default: q tile i holds rows i * bq ..) or first: the tiles end at row M,
    q tile i starts at i * bq - q_pad (q_pad = cdiv(M, bq) * bq - M), so the tile M leaves short is the first
    one; its rows below 0, like the last tile's rows past M otherwise, load zeros and produce no output.
    Why: under causal-like masks the last q tile visits the most kv tiles, so its padding costs the most (D =
    64's 192-row tiles at M = 4k: 128 padded rows over 32 kv tiles, 5.5% of the visited work; first, 1 kv tile).

        %x = fused %s, ... : f32[B,H,M,N]
        %m = reduce_max %x ...; ... %o = matmul %p, %v : f32[B,H,M,D]
    =>
        %o = parallel_for (%b, %h, %qi) in (B, H, cdiv(M, 64)) : f16[B,H,M,D] {
          %q0 = mul %qi, 64                     // ragged_q=first: %q0 = sub (mul %qi, 64), %q_pad,
                                                //   %q_pad = const cdiv(M, 64)*64-M
          %qt = tile.load %q[%b, %h, %q0 : 64, :] : f16[64,D]
          %m = for %kj = ... iter_args(%mi = -inf) { ... yield max(%mi, rowmax(x)) }       // row max
          %l = for %kj = ... iter_args(%li = 0.0) { ... yield %li + rowsum(exp(x - m)) }   // row sum
          %acc = for %kj = ... iter_args(%ai = 0.0) { ... yield %ai + (exp(x - m) / l) @ vt }
          tile.yield (cast %acc) into [%b, %h, %q0 : 64, :]
        }
    """

    name = "tile"
    summary = "parallel loop over (b, h, q-tile), sequential loops over kv tiles (three-pass exact softmax)"
    bq: int = 64
    bk: int = 64
    order: str = "fa2"
    ragged_q: str = "last"

    def __post_init__(self) -> None:
        if self.bq < 1 or self.bk < 1:
            raise ValueError("tile sizes must be positive")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.ragged_q not in RAGGED_Q:
            raise ValueError(f"ragged_q must be one of {', '.join(RAGGED_Q)}, got {self.ragged_q!r}")

    removes = ("matmul", "softmax")

    def run(self, func: Func) -> Func:
        if any(op.name == "parallel_for" for op in func.body.ops):
            raise self.fail("the graph is already tiled")
        att = find_attention(func, self.name)
        fused = att.x.owner
        if not isinstance(fused, Op) or fused.name != "fused":
            raise self.fail("the score function is not fused: run fuse first")
        captures = [v for v, r in zip(fused.operands, fused.attrs["roles"]) if r == "cap"]
        st = ScoreTile(att, fused, self.bq, self.bk, captures)
        out_t = att.out_chain[-1].results[0].type if att.out_chain else att.pv.results[0].type
        ret_names = func.result_names
        body = Block(list(a.type for a in func.args), [a.name for a in func.args])
        vmap = dict(zip(func.args, body.args))
        st.att = _remap(att, vmap)
        st.captures = [vmap[c] for c in captures]
        b = Builder(body)
        if self.order == "fa2":
            B, H, M = att.q.type.shape[:3]
            (o,) = b.parallel_for([B, H, cdiv(M, self.bq)], ["b", "h", "qi"], [out_t],
                                  lambda pb, ivs: [self._q_tile(pb, st, ivs[0], ivs[1], ivs[2], out_t)],
                                  result_names=["o"])
        else:
            (o,) = b.parallel_for([att.q.type.shape[0], att.q.type.shape[1]], ["b", "h"], [out_t],
                                  lambda pb, ivs: [self._fa1_head(pb, st, ivs[0], ivs[1], out_t)], result_names=["o"])
        b.ret(o)
        func.body = body
        func.attrs["result_names"] = tuple(ret_names)
        return func

    # ------------------------------------------------------------------------------ the q tile
    def _q_start(self, b: Builder, st: ScoreTile, qi: Value) -> Value:
        """Row of q tile qi's first row: qi * bq, less q_pad where the ragged tile is the first."""
        if self.ragged_q == "last":
            return b.emit("mul", qi, b.const(self.bq), name_hint="q0")
        pad = b.const(q_pad(st.att.q.type.shape[2], self.bq), name_hint="q_pad")
        return b.emit("sub", b.emit("mul", qi, b.const(self.bq)), pad, name_hint="q0")

    def _q_tile(self, b: Builder, st: ScoreTile, bi: Value, h: Value, qi: Value, out_t: TensorType):
        q0 = self._q_start(b, st, qi)
        out = self._three_pass(b, st, bi, h, q0)
        return out, [bi, h, (q0, self.bq), ":"]

    def _fa1_head(self, b: Builder, st: ScoreTile, bi: Value, h: Value, out_t: TensorType):
        M, D = st.att.q.type.shape[2], out_t.shape[3]
        o_t = TensorType(out_t.dtype, (M, D))
        o0 = b.const(0.0, o_t, name_hint="o_init")

        def q_loop(lb: Builder, qi: Value, it: list[Value]):
            q0 = self._q_start(lb, st, qi)
            ot = self._three_pass(lb, st, bi, h, q0)
            return [lb.tile_insert(it[0], ot, [(q0, self.bq), ":"], name_hint="o_next")]

        (o_bh,) = b.for_loop(b.const(0), b.const(cdiv(M, self.bq)), [o0], q_loop, iv_name="qi",
                             iter_names=["o_acc"], result_names=["o_bh"], attrs={"order": "fa1"})
        return o_bh, [bi, h, ":", ":"]

    def _three_pass(self, b: Builder, st: ScoreTile, bi: Value, h: Value, q0: Value) -> Value:
        att = st.att
        bq = self.bq
        hk = b.emit("floordiv", h, b.const(att.group), name_hint="hk") if att.group > 1 else h
        qt = b.tile_load(att.q, [bi, h, (q0, bq), ":"], name_hint="qt")
        qidx = b.tile_iota(q0, 0, [bq, 1], name_hint="q_idx")
        zero, nk = b.const(0), b.const(cdiv(att.k.type.shape[2], self.bk), name_hint="nk")
        f32 = att.x.type.dtype  # the scores' float type: f32, or f64 for f64 inputs
        row = tensor(f32, bq, 1)
        D = att.v.type.shape[3]

        def score(lb: Builder, kj: Value) -> Value:
            return st.emit(lb, bi, h, hk, qt, qidx, st.kv_index(lb, kj))

        def max_body(lb: Builder, kj: Value, it: list[Value]):
            x = score(lb, kj)
            return [lb.emit("max", it[0], lb.emit("reduce_max", x, axis=1), name_hint="m_next")]

        (m,) = b.for_loop(zero, nk, [b.const(-math.inf, row)], max_body, iter_names=["m_i"], result_names=["m"])
        m_safe = _guard(b, m, -math.inf, 0.0, "m_safe")

        def sum_body(lb: Builder, kj: Value, it: list[Value]):
            x = score(lb, kj)
            e = lb.emit("exp", lb.emit("sub", x, m_safe), name_hint="e")
            return [lb.emit("add", it[0], lb.emit("reduce_sum", e, axis=1), name_hint="l_next")]

        (l,) = b.for_loop(zero, nk, [b.const(0.0, row)], sum_body, iter_names=["l_i"], result_names=["l"])
        l_safe = _guard(b, l, 0.0, 1.0, "l_safe")

        def pv_body(lb: Builder, kj: Value, it: list[Value]):
            k0 = st.kv_index(lb, kj)
            x = st.emit(lb, bi, h, hk, qt, qidx, k0)
            e = lb.emit("exp", lb.emit("sub", x, m_safe), name_hint="e")
            p = lb.emit("div", e, l_safe, name_hint="p")
            vt = lb.tile_load(att.v, [bi, hk, (k0, self.bk), ":"], name_hint="vt")
            pv = lb.tile_matmul(p, vt, name_hint="pv")
            return [lb.emit("add", it[0], pv, name_hint="acc_next")]

        (acc,) = b.for_loop(zero, nk, [b.const(0.0, tensor(f32, bq, D))], pv_body, iter_names=["acc_i"],
                            result_names=["acc"])
        return apply_chain(b, att.out_chain, acc)


def q_pad(M, bq: int):
    """tile{ragged_q=first}'s shift of the q tiles: the rows the last tile would pad, cdiv(M, bq) * bq - M."""
    return cdiv(M, bq) * bq - M


def _const_is_expr(v: Value, want) -> bool:
    """Whether `v` is a const of value `want`, an int or a dim expression compared as printed (canonicalize.is_const
    takes numbers only)."""
    c = const_value(v)
    return c is not None and str(c) == str(want)


def is_q_tile_start(q0: Value, qi: Value, bq: int) -> bool:
    """Whether `q0` is `Tile`'s first row of q tile `qi` with the last tile short: qi * bq."""
    op = q0.owner
    return isinstance(op, Op) and op.name == "mul" and op.operands[0] is qi and _const_is_expr(op.operands[1], bq)


def is_ragged_q_start(q0: Value, qi: Value, bq: int, M) -> bool:
    """Whether `q0` is tile{ragged_q=first}'s first row of q tile `qi`: qi * bq - q_pad(M, bq), exactly as `Tile`
    writes it (mask-tiles and the backend recognise the shifted tiles by this)."""
    op = q0.owner
    return isinstance(op, Op) and op.name == "sub" and is_q_tile_start(op.operands[0], qi, bq) \
        and _const_is_expr(op.operands[1], q_pad(M, bq))


def _guard(b: Builder, v: Value, when: float, repl: float, name: str) -> Value:
    dt = scalar(v.type.dtype)
    return b.emit("where", b.emit("eq", v, b.const(when, dt)), b.const(repl, dt), v, name_hint=name)


def apply_chain(b: Builder, chain: list[Op], v: Value) -> Value:
    """Apply the graph's output ops (a cast) to a tile."""
    for op in chain:
        v = b.emit(op.name, v, **op.attrs)
    return v


def _remap(att: Attention, vmap: dict) -> Attention:
    import dataclasses

    return dataclasses.replace(att, q=vmap[att.q], k=vmap[att.k], v=vmap[att.v])
