"""split-kv{parts=P}: each q tile's kv loop split into P parts that run as work items of their own, then merged
by their LSE (FlashDecoding's split-kv; the same merge as context parallelism's, falower.ir.lse_merge).

Why: a grid of (b, h, q tile) items leaves SMs idle where it is small against the GPU (decoding, few heads) or
where its last round is partial (plain attention at B = 4, H = 16, N = 4k: 2048 items on 132 SMs, the blocks idle
3.2% at the end, benchmarks/NOTES.md). Parts along kv multiply the items by P, each a shorter loop, at the cost of
an O and an LSE a part and the merge. The numba-cuda backend emits this form on its persistent warp-specialized
kernel (the part in the work item's index, each part's O through the kernel's own epilogue, so in the inputs'
dtype: `part_dtype`), and falower.compile lowers with it by itself on a grid that fills at most half of the
GPU's SMs (compiler._kv_parts).

The pass class says what it requires and shows the rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value, clone_op, replace_uses
from ..ir.dims import Const, dim
from ..ir.lse_merge import build_lse_merge
from ..ir.types import TensorType, scalar
from .base import Pass, register
from .online_softmax import check_fa2_body, f32_source
from .rewrite import dce


MAX_PARTS = 1024  # the IR's parts are whole arrays: 1e8 parts ran --check for minutes; 1024 covers 1024 GPUs' shares


@register
@dataclass(frozen=True)
class SplitKV(Pass):
    """Each q tile's kv range in `parts` shares, each a work item writing an f32 O and an LSE; the LSE merge
    (falower.ir.lse_merge) after the loop nest. parts=1 leaves the function as it is.

    Requires: the fa2-fwd form that online-softmax leaves (one parallel_for over (b, h, q tile) with outputs O and
    LSE, one kv loop `for %kj = %kv_lo to %kv_hi` in its body, O yielded as the cast of its f32 acc / l). The loop
    must be online-softmax's own, since the merge takes each part's O and LSE for a softmax's over its share: it
    runs from tile 0 to cdiv(N, bk) or over mask.kv_range's tiles, and its (m, l, acc), O and LSE are what
    online-softmax makes (online_softmax.check_fa2_body); a dump edited otherwise is refused, not split into other
    numbers. Before / after (P = 2, abridged):

        %o, %lse = parallel_for (%b, %h, %qi) in (B, H, cdiv(M, 128)) : f16[B,H,M,D], f32[B,H,M] {
          %m, %l, %acc = for %kj = %kv_lo to %kv_hi iter_args(...) { ... }
          ... %o_tile = div %acc, %l_safe ... %lse_tile_1 = squeeze ...
          %33 = cast %o_tile {to = "f16"} : f16[128,D]
          tile.yield %33 into [%b, %h, %q0 : 128, :], %lse_tile_1 into [%b, %h, %q0 : 128]
        }

    =>

        %o_parts, %lse_parts = parallel_for (%part, %b, %h, %qi) in (2, B, H, cdiv(M, 128))
                                   : f32[2,B,H,M,D], f32[2,B,H,M] {
          %kv_count = max (sub %kv_hi, %kv_lo), 0
          %kv_part_lo = add %kv_lo, (floordiv (mul %part, %kv_count), 2)
          %kv_part_hi = add %kv_lo, (floordiv (mul (add %part, 1), %kv_count), 2)
          %m, %l, %acc = for %kj = %kv_part_lo to %kv_part_hi iter_args(...) { ... }
          tile.yield %o_tile into [%part, %b, %h, %q0 : 128, :], %lse_tile_1 into [%part, %b, %h, %q0 : 128]
        }
        %lse_max = reduce_max %lse_parts {axis = 0} ... (build_lse_merge) ... %o = cast %o_merged {to = "f16"}

    `part_dtype` f16 / bf16: each part's O is stored rounded to it (FlashDecoding and FA3 keep f32 parts; the
    numba-cuda kernel stores its parts through O's own epilogue, in the input's dtype, so the IR says so and
    --check checks what runs: about twice the output's rounding), and the merge widens them to f32.

    The parts are shares of each q tile's own kv range that differ by one tile at most: the range is the tile's
    non-empty kv tiles where mask-tiles found one (mask.kv_range), every kv tile under a dense block table or no
    mask. A causal q tile's parts are then as long as each other. A part with no tile (P more than the tiles) is
    empty: LSE -inf, O 0, weight 0 in the merge. O's tile must be the kv loop's acc / l: the merge is linear in each
    part's O, so an op after P @ V (tanh(P @ V)) is refused, not merged wrongly.
    """

    name = "split-kv"
    summary = "each q tile's kv range in P work items of their own, merged by their LSE"
    parts: int = 2
    part_dtype: str = "f32"

    def run(self, func: Func) -> Func:
        if not 1 <= self.parts <= MAX_PARTS:
            raise self.fail(f"parts must be 1 to {MAX_PARTS}, got {self.parts} (a part past the q tile's kv tiles "
                            "is empty; the kernels take up to 16)")
        if self.part_dtype not in ("f32", "f16", "bf16"):
            raise self.fail(f"part_dtype must be f32, f16 or bf16, got {self.part_dtype!r}")
        if self.parts == 1:
            return func
        pfs = [op for op in func.body.ops if op.name == "parallel_for"]
        if len(pfs) != 1:
            raise self.fail(f"needs one parallel_for over (b, h, q tile), found {len(pfs)} (run the fa2-fwd "
                            "pipeline first)")
        par = pfs[0]
        if any(op.name == "reduce_max" for op in func.body.ops) and len(par.attrs["bounds"]) == 4:
            raise self.fail("the forward is already split in parts (an LSE merge follows its loop nest): split-kv "
                            "runs once")
        if len(par.attrs["bounds"]) != 3 or len(par.results) != 2 or par.attrs.get("accumulators"):
            raise self.fail("needs the forward's parallel_for (b, h, q tile) with outputs O and LSE; got "
                            f"{len(par.attrs['bounds'])} bounds and {len(par.results)} outputs")
        body = par.regions[0]
        loops = [op for op in body.ops if op.name == "for"]
        if len(loops) != 1 or len(loops[0].results) != 3:
            raise self.fail("needs one kv loop carrying (m, l, acc) in the q tile's body (run online-softmax "
                            "first; the fa1 order keeps its kv loop outside)")
        loop = loops[0]
        term = body.terminator
        assert term is not None and term.name == "tile.yield"
        o_spec, lse_spec = term.attrs["slices"]
        n_o = sum(1 for s in o_spec if s != ":")
        o_tile, o_idx = term.operands[0], term.operands[1:1 + n_o]
        lse_tile, lse_idx = term.operands[1 + n_o], term.operands[2 + n_o:]
        o32 = f32_source(o_tile)
        if o32 is None:
            raise self.fail(f"O's tile is {o_tile.type}, not the cast of an f32 tile: the parts would be merged "
                            "from rounded values")
        div = o32.owner
        if not (isinstance(div, Op) and div.name == "div" and div.operands[0] is loop.results[2]):
            raise self.fail("O's tile is not the kv loop's acc / l (an op after P @ V, such as tanh(P @ V)): the "
                            "merge is linear in each part's O, so it cannot run before that op")
        if lse_tile.type.dtype != "f32":
            raise self.fail(f"LSE's tile is {lse_tile.type}, not f32")
        check_fa2_body(body, self.fail)  # the parts' O and LSE merge into the softmax's only then (as the backend)

        P = self.parts
        blk = Block([scalar("i32")] * 4, ["part"] + [a.name for a in body.args])
        part = blk.args[0]
        vmap: dict[Value, Value] = dict(zip(body.args, blk.args[1:]))
        for op in body.ops[:-1]:
            if op is loop:
                lo, hi = _share(Builder(blk), vmap.get(loop.operands[0], loop.operands[0]),
                                vmap.get(loop.operands[1], loop.operands[1]), part, P)
                new = clone_op(op, vmap)
                new.operands[0:2] = [lo, hi]
                blk.append(new)
            else:
                blk.append(clone_op(op, vmap))
        o_part = vmap.get(o32, o32)
        if self.part_dtype != "f32":  # the part's O rounded as the kernel stores it (the merge reads it widened)
            o_part = Builder(blk).cast(o_part, self.part_dtype)
        out = [o_part, part, *(vmap.get(v, v) for v in o_idx),
               vmap.get(lse_tile, lse_tile), part, *(vmap.get(v, v) for v in lse_idx)]
        Builder(blk).op("tile.yield", out, [], {"slices": (("i", *o_spec), ("i", *lse_spec))})
        o_t, lse_t = (r.type for r in par.results)
        split = Op("parallel_for", [], [TensorType(self.part_dtype, (Const(P), *o_t.shape)),
                                        TensorType("f32", (Const(P), *lse_t.shape))],
                   {"bounds": (dim(P), *par.attrs["bounds"])}, [blk], ["o_parts", "lse_parts"])

        merge = Block()
        mb = Builder(merge)
        o_parts = split.results[0] if self.part_dtype == "f32" else mb.cast(split.results[0], "f32")
        o, lse = build_lse_merge(mb, o_parts, split.results[1])
        o = mb.cast(o, o_t.dtype)
        at = func.body.ops.index(par)
        func.body.ops[at:at + 1] = [split, *merge.ops]
        for op in [split, *merge.ops]:
            op.parent = func.body
        replace_uses(func.body, par.results[0], o)
        replace_uses(func.body, par.results[1], lse)
        dce(func)  # the f16 cast of O's tile, which the parts no longer yield
        return func


def _share(b: Builder, lo: Value, hi: Value, part: Value, parts: int) -> tuple[Value, Value]:
    """The part's kv tiles [lo_p, hi_p) of [lo, hi): lo + floor(p n / P) to lo + floor((p + 1) n / P), n = hi - lo
    (0 where negative). The shares differ by one tile at most, so no part idles while another has two more tiles
    than it (shares of cdiv(n, P) left 2, 2, 1, 0 of 5 tiles in 4 parts)."""
    count = b.emit("max", b.emit("sub", hi, lo), b.const(0), name_hint="kv_count")
    P = b.const(parts)
    part_lo = b.emit("add", lo, b.emit("floordiv", b.emit("mul", part, count), P), name_hint="kv_part_lo")
    nxt = b.emit("add", part, b.const(1))
    part_hi = b.emit("add", lo, b.emit("floordiv", b.emit("mul", nxt, count), P), name_hint="kv_part_hi")
    return part_lo, part_hi


__all__ = ["SplitKV"]
