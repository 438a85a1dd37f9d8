"""pack-gqa: a GQA graph rewritten so that each kv head's G query heads are the rows of one attention problem
(FlashAttention-2's seqlenq_ngroups_swapped, FlashAttention-3's pack_gqa).

Why: with few query rows (decoding: M = 1) each (b, h) is a q tile of M rows, mostly padding, and the G query heads
of a kv head each read that head's K and V: G times the traffic, and G times the q tiles (H200, 2026-11-30: GQA
decoding with 32 query heads over 8 took 1.8-2.7x the time of 8 heads on the same K / V, benchmarks/NOTES.md).
Packed, q [B, HKV*G, M, D] is read as [B, HKV, M*G, D] (row r of kv head j is query head j*G + r // M, query row
r % M: the same memory where heads follow rows, `reshape` without a copy, and always at M = 1), K and V are not
repeated, and O and LSE come back as [B, HKV, M*G, ...], the caller's [B, HKV*G, M, ...] the same way.

This is a rewrite of the calling convention, not a pipeline pass: the packed function takes the reshaped q, so
falower.compile applies it at a call (compiler.CompiledAttention.packed_for) where the rows are few, and lowers the
packed graph with its own pipeline; the IR after every pass is the packed graph's.

Requires (`pack_gqa` raises PassError naming the one that fails):
  - q, k, v first, q [B, HKV*G, M, D], k and v [B, HKV, N, D], each of k and v used once, by
    `repeat_interleave {axis = 1, repeats = G}` with the same G > 1, and q once, as the first operand of the score's
    matmul (a gather of q would index the packed rows);
  - no captured tensor with the query heads' or rows' size in its shape (it could be read by broadcast against
    them); the score and mask may read the query head and row (%h, %q_idx): the packed graph computes them from
    the packed row r of kv head j, h = j G + r // M and q_idx = r % M (at M = 1: j G + r and 0);
  - graph-level ops only (the graph as written, before any pass).

Before / after (examples/gqa.py, abridged):

    func @gqa(%q: f16[B,HKV*4,M,D], %k: f16[B,HKV,N,D], %v: f16[B,HKV,N,D]) -> (o: f16[B,HKV*4,M,D]) {
      %0 = repeat_interleave %k {axis = 1, repeats = 4} : f16[B,HKV*4,N,D]
      %2 = matmul %q, %0 {transpose_b} : f32[B,HKV*4,M,N]  ...

    =>

    func @gqa_packed(%q: f16[B,HKV,M*4,D], %k: f16[B,HKV,N,D], %v: f16[B,HKV,N,D]) -> (o: f16[B,HKV,M*4,D]) {
      %2 = matmul %q, %k {transpose_b} : f32[B,HKV,M*4,N]  ...
"""

from __future__ import annotations

from ..errors import PassError
from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value, uses
from ..ir.dims import Const, Dim
from ..ir.ops import OPS, OpTypeError
from ..ir.types import TensorType, is_float


PACK_MAX_QUERY_ROWS = 64  # the most query rows a head (M) a call packs, whatever G: a q tile of M rows is padding
# from its row M on, and packed the G heads' rows fill it (M * G rows a kv head), on 128-row tiles where decoding's
# 64-row ones ran. Measured (H200 2026-11-30, whole calls in CUDA graphs, benchmarks/NOTES.md): M * G <= 64
# (decoding) 1.81-3.21x; past one q tile (M = 16-64, G = 4-8, N = 8k-32k) 1.08-3.67x; M = 96 1.04x, within a
# measurement's noise, so not past decoding's rows (emit_fa3.DECODE_MAX_ROWS)


def _fail(why: str) -> PassError:
    return PassError(f"pack-gqa: {why}")


def group_of(func: Func) -> int:
    """G where `func` repeats k and v over heads by G > 1 (a GQA graph), else 1."""
    if len(func.args) < 3:
        return 1
    users = uses(func)
    reps = set()
    for kv in func.args[1:3]:
        ops = users.get(kv, [])
        if len(ops) != 1 or ops[0].name != "repeat_interleave" or ops[0].attrs.get("axis") != 1:
            return 1
        reps.add(ops[0].attrs.get("repeats"))
    return reps.pop() if len(reps) == 1 and isinstance(next(iter(reps)), int) and max(reps) > 1 else 1


def score_reads_query_index(func: Func) -> bool:
    """Whether the score (not only the mask) of a GQA graph reads the query head or row (ALiBi's slopes[h] and kv -
    q): a value computed from their iotas that reaches a float other than as the condition of a mask's select
    (`where(keep, s, -inf)`; any other `where` is the score's, evaluated per element). Packed, those
    reads become the rebuilt h = j G + r // M and q_idx = r % M, which the kernels evaluate in the score function,
    per element (an integer division and a gather an element: packed ALiBi decoding ran 0.43-0.58x the unpacked
    call, H200 2026-11-30, benchmarks/NOTES.md); a mask's reads cost a row's bounds once a tile (packed causal
    decoding behind the cache's offset 1.5-2.4x the unpacked call). So falower.compile packs only graphs where this
    is False."""
    tainted: set[Value] = set()
    for op in func.walk():
        if op.name == "iota" and op.result.type.rank == 4 and op.attrs.get("axis") in (1, 2):
            tainted.add(op.result)
            continue
        reads = [i for i, x in enumerate(op.operands) if x in tainted]
        if not reads or reads == [0] and _is_mask_select(op):
            continue  # (a mask: the condition selects the score, it does not enter it)
        for r in op.results:
            if is_float(r.type.dtype):
                return True
            tainted.add(r)
    return False


def _is_mask_select(op: Op) -> bool:
    """`where(keep, s, -inf)`: the form a mask takes (the frontend's mask_mod, the mask analysis's conjuncts), the
    kept value a score, not a constant (`s + where(keep, 0, -inf)` stays the score's select, per element)."""
    if op.name != "where" or len(op.operands) != 3:
        return False
    kept, fill = op.operands[1].owner, op.operands[2].owner
    return (isinstance(fill, Op) and fill.name == "const" and fill.attrs.get("value") == float("-inf")
            and not (isinstance(kept, Op) and kept.name == "const"))


def pack_gqa(func: Func) -> tuple[Func, int]:
    """(the packed graph, G) for a GQA graph that meets the preconditions above; PassError otherwise."""
    G = group_of(func)
    if G == 1:
        raise _fail("k and v are not each repeated over heads once (repeat_interleave {axis = 1, repeats = G > 1}): "
                    "not a GQA graph")
    q, k, v = func.args[:3]
    if q.type.rank != 4 or k.type.rank != 4 or v.type.rank != 4:
        raise _fail(f"q, k, v must be [B, H, rows, D], got {q.type}, {k.type}, {v.type}")
    heads, rows, kv_heads = q.type.shape[1], q.type.shape[2], k.type.shape[1]
    if heads != kv_heads * G:
        raise _fail(f"q's heads {heads} are not k's {kv_heads} times the group {G}")
    users = uses(func)
    q_users = users.get(q, [])
    if len(q_users) != 1 or q_users[0].name != "matmul" or q_users[0].operands[0] is not q:
        raise _fail(f"q must be read only by the score's product q k^T, got {', '.join(o.name for o in q_users)}: "
                    "another read (a gather of q) would index the packed rows")
    for op in func.walk():
        if op.regions:
            raise _fail(f"{op.name} has regions: pack the graph as written, before any pass")
    for cap in func.args[3:]:
        if any(d in (heads, rows) for d in cap.type.shape):
            raise _fail(f"captured %{cap.name} {cap.type} has the query heads' or rows' size: it may be read by "
                        "broadcast against them")
    packed_rows = rows * G

    def packed(t: TensorType) -> TensorType:
        """A type over (b, h, q_idx, ...) with the heads' and rows' axes packed: [.., HKV*G, M, ..] -> [.., HKV,
        M*G, ..] (sizes 1 stay 1)."""
        if t.rank < 3 or (t.shape[1] != heads and t.shape[2] != rows):
            return t
        shape: list[Dim] = list(t.shape)
        if shape[1] == heads:
            shape[1] = kv_heads
        if shape[2] == rows:
            shape[2] = packed_rows
        return TensorType(t.dtype, tuple(shape))

    body = Block([packed(a.type) if i == 0 else a.type for i, a in enumerate(func.args)], [a.name for a in func.args])
    bld = Builder(body)
    vmap: dict[Value, Value] = dict(zip(func.args, body.args))
    made: dict[str, Value] = {}

    def row_parts(dtype: str) -> tuple[Value, Value]:
        """The packed row r (an iota along axis 2) and M, made once."""
        if "row" not in made:
            made["row"] = bld.op("iota", [], [TensorType(dtype, (Const(1), Const(1), packed_rows, Const(1)))],
                                 {"axis": 2}, names=["row"]).result
            made["rows"] = bld.const(rows, TensorType(dtype, ()), name_hint="rows")
        return made["row"], made["rows"]

    for op in func.body.ops:
        if op.name == "repeat_interleave" and op.operands[0] in (k, v):
            vmap[op.result] = vmap[op.operands[0]]
            continue
        if op.name == "iota" and op.result.type.rank == 4 and op.attrs.get("axis") in (1, 2):
            # the query head and row of packed row r of kv head j: h = j G + r // M, q_idx = r % M
            if not users.get(op.result):
                continue
            dt = op.result.type.dtype
            row, m = row_parts(dt)
            if op.attrs["axis"] == 2:
                vmap[op.result] = bld.emit("mod", row, m, name_hint=op.result.name or "q_idx")
                continue
            kvh = bld.op("iota", [], [TensorType(dt, (Const(1), kv_heads, Const(1), Const(1)))], {"axis": 1},
                         names=["h_kv"]).result
            first = bld.emit("mul", kvh, bld.const(G, TensorType(dt, ()), name_hint="group"), name_hint="h_first")
            within = bld.emit("floordiv", row, m, name_hint="h_in_group")
            vmap[op.result] = bld.emit("add", first, within, name_hint=op.result.name or "h")
            continue
        operands = [vmap[x] for x in op.operands]
        if op.name in ("const", "iota"):
            types = [packed(op.result.type)]
        elif op.name == "return":
            types = []
        else:
            try:
                types = OPS[op.name].infer([x.type for x in operands], dict(op.attrs))  # type: ignore[misc]
            except OpTypeError as e:
                raise _fail(f"{op.name} does not take the packed shapes: {e}") from None
            left = [t for t in types if t.rank >= 3 and (t.shape[1] == heads or t.shape[2] == rows)]
            if left:
                raise _fail(f"{op.name} gives {left[0]}: a query-head or -row axis the packing did not reach")
        new = bld.op(op.name, operands, types, dict(op.attrs), names=[r.name for r in op.results])
        for old, nv in zip(op.results, new.results):
            vmap[old] = nv
    return Func(f"{func.name}_packed", body, dict(func.attrs)), G
