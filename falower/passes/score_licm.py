"""score-licm: a score function that costs nothing it need not (issue 12).

The fused score region runs once per element of every score tile. Three rewrites make that per-element
work smaller, and the IR after the pass shows what moved. All three touch the score's ops only: the mask's
(its conjuncts and what they read) stay as mask-tiles copied them into its mask ops, which the interpreter
runs and the backends compare with the score function's mask op for op:

1. Scale and log2(e) folded (rounding only). Chains of multiplications and divisions by values that are the
   same for every element (the scale 1/sqrt(D), online-softmax's log2(e), a soft-cap constant, a per-head
   slope) become one multiplication by their product, computed once; a multiplication of a sum by such a
   factor is distributed over the sum when both terms absorb it, and a division by one becomes a
   multiplication by its reciprocal:

       x = (s / sqrt(D) + slope * d) * log2(e)   =>   x = s * (log2(e) / sqrt(D)) + (slope * log2(e)) * d

   Numeric effect: each fold replaces two roundings by two others (the factor's and the product's); the
   result moves by at most a few units in the last place of the largest term (f32: |dx| <= 4 * 2^-24 *
   (|s * scale| + |slope * d|) * log2(e) per fold); in float64 by the same number of 2^-53.

2. Index arithmetic strength-reduced (exact). `cast(kv - q)` to f32 or f64, where one side reads only kv and
   the other only q and both are small indices (q, kv, sizes and constants below 2^22, sums of up to four),
   becomes `cast(kv) - cast(q)`: both parts and their difference are integers below 2^24, exactly
   representable in f32, so the value is bit-for-bit the same (for M, N <= 2^22, far beyond any sequence the
   kernels run). Not to f16 / bf16, not for i8 (which wraps), not for products or captured values (whose
   magnitude nothing bounds). The conversion of q is then per row, that of kv per column, where it was one
   int-to-float conversion per element.

3. Loop-invariant code motion out of the region. Every op of the score (not of the mask, which mask-tiles
   and the backends' classifiers read as it stands) that does not read the score `s` and does not read both
   q and kv moves out of the fused op to the outermost block where its operands exist, and comes back in as
   a new operand with a role that says how often it is computed:

       cta   one value per (b, h) program: before the kv loop (a slope `slopes[h]`, the folded scale)
       row   one value per query row of the tile: before the kv loop, [bq, 1] (cast(q))
       col   one value per key column of a kv tile: in the kv loop, outside the score function, [1, bk]

   The region then holds only the per-element arithmetic. Before/after (ALiBi, fa2-fwd):

       %x = fused %s, %h, %q_idx, %kv_idx, %slopes {roles = ["s", "h", "q", "kv", "cap"]} {
         %14 = div %s_1, %sqrt_d;  %15 = gather %slopes_3, %h_3;  %16 = sub %kv_2, %q_3;  %17 = cast %16
         %18 = mul %15, %17;  %19 = add %14, %18;  %x_log2 = mul %19, 1.4426950408889634
       }
   =>
       %scale = div 1.4426950408889634, sqrt(cast D) : f32               (before the kv loop: once per CTA)
       %cta = mul (gather %slopes, %h), 1.4426950408889634 : f32         (the slope, loaded once per CTA)
       %q_f = cast %q_idx {to = "f32"} : f32[128,1]                      (once per row)
       %kv_f = cast %kv_idx {to = "f32"} : f32[1,64]                     (in the kv loop: once per column)
       %x = fused %s, %h, %q_idx, %kv_idx, %slopes, %kv_f, %q_f, %scale, %cta
              {roles = ["s", "h", "q", "kv", "cap", "col", "row", "cta", "cta"]} {
         %16 = sub %kv_f_1, %q_f_1;  %17 = mul %s_1, %scale_1;  %18 = mul %16, %cta_1;  %x_log2 = add %17, %18
       }

Requires: fused score ops inside a tiled graph (tile; run after online-softmax and mask-tiles so that every
copy of the score function is rewritten). Without a parallel_for it fails; with no fused op (the backward,
where autodiff has inlined the score function) it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value, backward_slice, clone_op, replace_uses
from ..ir.dims import Dim
from ..ir.types import is_float, is_int, scalar
from ..ir.value_ranges import dim_range
from .base import Pass, register
from .mask_tiles import split_mask
from .rewrite import apply_patterns, region_dce

INVARIANT_ROLES = ("b", "h", "cap", "cta")  # one value per (b, h) program
ROLE_DEPS = {"s": {"s"}, "q": {"q"}, "row": {"q"}, "kv": {"kv"}, "col": {"kv"}}


# ------------------------------------------------------------------------------------ dependencies
class _Deps:
    """Which element-varying inputs (s, q, kv) a value of one region depends on."""

    def __init__(self, region: Block, roles: Sequence[str]):
        self.arg = {a: frozenset(ROLE_DEPS.get(r, ())) for a, r in zip(region.args, roles)}
        self.memo: dict[Value, frozenset] = {}

    def __call__(self, v: Value) -> frozenset:
        if v in self.arg:
            return self.arg[v]
        got = self.memo.get(v)
        if got is None:
            op = v.owner
            got = frozenset().union(*(self(o) for o in op.operands)) if isinstance(op, Op) and op.operands \
                else frozenset()
            self.memo[v] = got
        return got

    def invariant(self, v: Value) -> bool:
        return not self(v)


def _uses_in(block: Block) -> dict[Value, int]:
    n: dict[Value, int] = {}
    for op in block.ops:
        for v in op.operands:
            n[v] = n.get(v, 0) + 1
    return n


# ------------------------------------------------------------------------------------ 1. folding
def _fold_patterns(deps: _Deps, region: Block):
    """Patterns that merge invariant factors; `deps` is rebuilt by the caller between rounds."""

    def factor(v: Value, dtype: str) -> bool:
        return deps.invariant(v) and v.type.rank == 0 and v.type.dtype == dtype

    def split(op: Op) -> Optional[tuple[Value, Value]]:
        """(x, k) for mul(x, k) / mul(k, x) / div(x, k) with k an invariant scalar and x not invariant."""
        if op.name not in ("mul", "div") or not is_float(op.results[0].type.dtype):
            return None
        a, b = op.operands
        dt = op.results[0].type.dtype
        if factor(b, dt) and not deps.invariant(a):
            return a, b
        if op.name == "mul" and factor(a, dt) and not deps.invariant(b):
            return b, a
        return None

    def single_use(v: Value) -> bool:
        return _uses_in(region).get(v, 0) == 1

    def merge(op: Op, b: Builder):
        """(x op1 k1) op2 k2 => x * (k1 op k2): one multiply per element."""
        outer = split(op)
        if outer is None:
            return None
        inner_v, k2 = outer
        inner = inner_v.owner
        if not isinstance(inner, Op) or not single_use(inner_v):
            return None
        got = split(inner)
        if got is None:
            return None
        x, k1 = got
        if inner.name == "mul" and op.name == "mul":
            k = b.emit("mul", k1, k2)
        elif inner.name == "div" and op.name == "mul":
            k = b.emit("div", k2, k1)
        elif inner.name == "mul" and op.name == "div":
            k = b.emit("div", k1, k2)
        else:  # (x / k1) / k2
            k = b.emit("div", b.const(1.0, scalar(k1.type.dtype)), b.emit("mul", k1, k2))
        return [b.emit("mul", x, k)]

    def reciprocal(op: Op, b: Builder):
        """x / k => x * (1 / k): a division per element is a multiply by a value computed once."""
        if op.name != "div":
            return None
        got = split(op)
        if got is None:
            return None
        x, k = got
        if isinstance(x.owner, Op) and split(x.owner) is not None and single_use(x):
            return None  # merge handles it
        return [b.emit("mul", x, b.emit("div", b.const(1.0, scalar(k.type.dtype)), k))]

    def absorbs(v: Value, dtype: str) -> bool:
        if deps.invariant(v):
            return True
        op = v.owner
        return isinstance(op, Op) and single_use(v) and split(op) is not None

    def distribute(op: Op, b: Builder):
        """(u +- w) * k => u*k +- w*k when u and w each absorb k (an invariant or a scaled value)."""
        got = split(op)
        if got is None or op.name != "mul":
            return None
        y, k = got
        add = y.owner
        if not isinstance(add, Op) or add.name not in ("add", "sub") or not single_use(y):
            return None
        u, w = add.operands
        dt = op.results[0].type.dtype
        if u.type.dtype != dt or not (absorbs(u, dt) and absorbs(w, dt)):
            return None
        return [b.emit(add.name, b.emit("mul", u, k), b.emit("mul", w, k))]

    return [merge, distribute], [reciprocal]


# ----------------------------------------------------------------------------- 2. index casts
# the largest sequence for which score-licm's cast split is exact in f32: a sum of up to four terms each below
# 2^22 (the indices, sizes and small constants `_small_index` takes) stays below 2^24
SPLIT_CAST_MAX_SIZE = 2 ** 22


def _small_index(v: Value, index_args: set, depth: int = 0) -> bool:
    """v an integer below SPLIT_CAST_MAX_SIZE in magnitude, sums of up to four terms included: q or kv themselves
    (index_args), a size, an int constant below it, unsqueezed, broadcast or widened (not cast to i8, which
    wraps); not a captured value, a product or a gather (whose magnitude nothing bounds)."""
    if v in index_args:
        return True
    op = v.owner
    if not isinstance(op, Op) or not is_int(v.type.dtype) or v.type.dtype == "i8":
        return False
    if op.name in ("unsqueeze", "broadcast_to") or (op.name == "cast" and is_int(op.operands[0].type.dtype)):
        return _small_index(op.operands[0], index_args, depth)
    if op.name == "const":
        x = op.attrs["value"]
        if isinstance(x, Dim):  # a size expression: below the bound for sizes below it (N - 1, not N * 2^20 + 1)
            lo, hi = dim_range(x, {}, SPLIT_CAST_MAX_SIZE)
            return max(abs(lo), abs(hi)) <= SPLIT_CAST_MAX_SIZE
        return isinstance(x, int) and not isinstance(x, bool) and abs(x) < SPLIT_CAST_MAX_SIZE
    if op.name in ("add", "sub", "neg") and depth < 2:
        return all(_small_index(o, index_args, depth + 1) for o in op.operands)
    return False


def _split_cast(deps: _Deps, region: Block, roles: Sequence[str] = ()):
    index_args = {a for a, r in zip(region.args, roles) if r in ("q", "kv")}

    def pattern(op: Op, b: Builder):
        """cast(a +- c) to f32 or f64, a reading only q and c only kv (or the reverse) => cast(a) +- cast(c);
        only where both are small indices (`_small_index`: then a, c and a +- c are exact in f32, so the value is
        the same to the bit). Not to f16 / bf16 (exact integers only to 2048 / 256) and not for i8 (its
        difference wraps): a review found bf16 `(kv - q).to('bf16')` 2.8 off at N = 600, and f32 sums of
        products past 2^24 0.87 off."""
        if op.name != "cast" or op.attrs["to"] not in ("f32", "f64"):
            return None
        src = op.operands[0].owner
        if not isinstance(src, Op) or src.name not in ("add", "sub") or not is_int(op.operands[0].type.dtype):
            return None
        a, c = src.operands
        da, dc = deps(a), deps(c)
        if "s" in da | dc or not da or not dc or da == dc or len(da) > 1 or len(dc) > 1:
            return None
        if op.operands[0].type.dtype == "i8" or not (_small_index(a, index_args) and _small_index(c, index_args)):
            return None
        to = op.attrs["to"]
        return [b.emit(src.name, b.emit("cast", a, to=to), b.emit("cast", c, to=to))]

    def regroup(op: Op, b: Builder):
        """Integer index sums regrouped by what they read: (q - kv) + c => (q + c) - kv, so the part that
        reads only q (with the invariants) is one per-row value. Exact: i32 addition wraps, so it is
        associative and commutative."""
        if op.name not in ("add", "sub") or not is_int(op.results[0].type.dtype) or deps(op.results[0]) != {"q", "kv"}:
            return None
        terms: list[tuple[int, Value]] = []

        def flatten(v: Value, sign: int, top: bool) -> None:
            o = v.owner
            if isinstance(o, Op) and o.name in ("add", "sub") and (top or single(v)) and len(deps(v)) == 2:
                flatten(o.operands[0], sign, False)
                flatten(o.operands[1], sign if o.name == "add" else -sign, False)
            else:
                terms.append((sign, v))

        uses = _uses_in(region)

        def single(v: Value) -> bool:
            return uses.get(v, 0) == 1

        flatten(op.results[0], 1, True)
        if len(terms) <= 2:
            return None
        rows = [(s, v) for s, v in terms if deps(v) <= {"q"}]
        cols = [(s, v) for s, v in terms if deps(v) == {"kv"}]
        if len(rows) + len(cols) != len(terms) or not cols:
            return None

        def total(group: list[tuple[int, Value]]) -> tuple[int, Value]:
            # the first positive term starts the sum (no negation needed when there is one)
            group = sorted(group, key=lambda t: -t[0])
            sign, acc = group[0]
            for s, v in group[1:]:
                acc = b.emit("add" if s == sign else "sub", acc, v)
            return sign, acc

        sr, r = total(rows)
        sc, c = total(cols)
        if sr == 1:
            return [b.emit("add" if sc == 1 else "sub", r, c)]
        if sc == 1:
            return [b.emit("sub", c, r)]
        return None

    return [pattern, regroup]


def _rewrite_region(region: Block, roles: Sequence[str], make) -> bool:
    """Run the patterns `make(deps, region)` to a fixpoint on an isolated region, on the score's ops only: the
    mask's (the backward slice of its conjuncts) stay as mask-tiles copied them into mask.kv_range / classify /
    block_table, which the interpreter runs and the backends compare with the score function's mask by structure
    (from_ir._check_mask_ops). A regrouped sum there (q + (q + kv) => (q + q) + kv) or a split cast made the two
    differ, and the kernels refused a mask they ran before."""
    changed = False
    for _ in range(50):
        deps = _Deps(region, roles)
        tmp = Func("region", region)
        mask_ids = _mask_op_ids(region)  # once a round, not once a pattern
        patterns = [_score_only(p, mask_ids) for p in make(deps, region)]
        if not apply_patterns(tmp, patterns, max_rounds=1):
            break
        changed = True
        region_dce(region)
    return changed


def _unshare_mask(region: Block) -> None:
    """Give the score its own copy of the ops it shares with the mask (`(kv - q).float()` read by both a mask
    `(kv - q).float() * 0.5 < 3.0` and an ALiBi-like score, once canonicalize's CSE made them one): the rewrites
    leave the mask's ops as they are, and a shared op would keep the partial tiles' score unrewritten where the
    full tiles' copy (mask-tiles', without the mask) is rewritten, two score functions the backends refuse
    (from_ir._check_template: the kernels compute one score for both). Constants stay shared."""
    core = split_mask(region)[0]
    mask_ids = _mask_op_ids(region)
    score_ids = {id(op) for op in backward_slice(region, [core])}
    shared = [op for op in region.ops if id(op) in mask_ids and id(op) in score_ids and op.name != "const"]
    if not shared:
        return
    vmap: dict[Value, Value] = {}
    for op in shared:  # in order: a copy reads the copies of the shared ops before it
        new = clone_op(op, vmap)
        new.parent = region
        region.ops.insert(region.ops.index(op) + 1, new)
    for op in region.ops:
        if id(op) in score_ids and id(op) not in mask_ids:
            op.operands = [vmap.get(v, v) for v in op.operands]


def _mask_op_ids(region: Block) -> set:
    """The ids of the mask's ops in a fused score region (its conjuncts and what they read): what every rewrite of
    this pass leaves as mask-tiles copied it."""
    return {id(op) for op in backward_slice(region, split_mask(region)[1])}


def _score_only(pattern, mask_ops: set):
    """`pattern`, declining the ops whose ids are in `mask_ops`."""
    def on_score(op: Op, b: Builder):
        return None if id(op) in mask_ops else pattern(op, b)

    on_score.__name__ = getattr(pattern, "__name__", "pattern")
    return on_score


# ------------------------------------------------------------------------------------- 3. LICM
def _levels(fused: Op, top: Block) -> list[tuple[Block, Op]]:
    """(block, the op in it that contains `fused`) from the innermost block out to `top`."""
    out = []
    anchor = fused
    while True:
        blk = anchor.parent
        assert blk is not None
        out.append((blk, anchor))
        if blk is top:
            return out
        anchor = blk.parent  # type: ignore[assignment]
        assert anchor is not None


def _def_level(v: Value, levels: list[tuple[Block, Op]]) -> int:
    """The innermost level at which `v` is defined (len(levels) - 1 when it comes from outside them all)."""
    blk = v.owner if isinstance(v.owner, Block) else v.owner.parent
    for i, (b, _) in enumerate(levels):
        if b is blk:
            return i
    return len(levels) - 1


def _hoist(fused: Op, top: Block) -> bool:
    region = fused.regions[0]
    roles = list(fused.attrs["roles"])
    deps = _Deps(region, roles)
    core = split_mask(region)[0]
    keep_inside = _mask_op_ids(region)  # the mask stays as mask-tiles left it
    score_ops = {id(op) for op in backward_slice(region, [core])}
    movable = [op for op in region.ops
               if id(op) in score_ops and id(op) not in keep_inside and op.name != "const"
               and not op.regions and "s" not in deps(op.results[0]) and len(deps(op.results[0])) < 2]
    if not movable:
        return False
    moving = {id(op) for op in movable}
    # the values that leave: moved results read by an op that stays (or the terminator)
    roots = []
    for op in region.ops:
        if id(op) in moving:
            continue
        for v in op.operands:
            if isinstance(v.owner, Op) and id(v.owner) in moving and v not in roots:
                roots.append(v)
    if not roots:
        return False
    levels = _levels(fused, top)
    outer = dict(zip(region.args, fused.operands))  # region argument -> the value outside
    vmap: dict[Value, Value] = dict(outer)
    level_of: dict[Value, int] = {}
    need = {id(op) for op in backward_slice(region, roots)}
    for op in region.ops:
        if id(op) not in need:
            continue
        if op.name == "const":
            lvl = len(levels) - 1
        else:
            lvl = min([level_of.get(vmap[o], _def_level(vmap[o], levels)) for o in op.operands] or [len(levels) - 1])
        new = clone_op(op, vmap)
        blk, anchor = levels[lvl]
        new.parent = blk
        blk.ops.insert(blk.ops.index(anchor), new)
        for r in new.results:
            level_of[r] = lvl
    for v in roots:
        d = deps(v)
        role = "row" if d == {"q"} else "col" if d == {"kv"} else "cta"
        outside = vmap[v]
        if outside.name is None:
            outside.name = _name_of(v, role, region, roles)
        arg = region.add_arg(v.type, outside.name)
        replace_uses(region, v, arg)
        fused.operands.append(outside)
        roles.append(role)
    fused.attrs["roles"] = tuple(roles)
    region_dce(region)
    return True


def _name_of(v: Value, role: str, region: Block, roles: Sequence[str]) -> str:
    """A readable name for a hoisted value: `q_f` / `kv_f` for an index as a float, `scale` for the factor
    of the score, else its role."""
    op = v.owner
    role_of = dict(zip(region.args, roles))
    if op.name == "cast" and role_of.get(op.operands[0]) in ("q", "kv"):
        return f"{role_of[op.operands[0]]}_f"
    s_arg = region.args[roles.index("s")] if "s" in roles else None
    for user in region.ops:
        if user.name == "mul" and v in user.operands and s_arg in user.operands:
            return "scale"
    return role if v.name is None else f"{role}_{v.name}"


def optimise_fused(fused: Op, top: Block) -> bool:
    """Fold, strength-reduce and hoist one fused score op inside `top` (a parallel_for body)."""
    region = fused.regions[0]
    roles = list(fused.attrs["roles"])
    _unshare_mask(region)
    changed = _rewrite_region(region, roles, lambda d, r: _split_cast(d, r, roles))
    changed |= _rewrite_region(region, roles, lambda d, r: _fold_patterns(d, r)[0])
    changed |= _rewrite_region(region, roles, lambda d, r: _fold_patterns(d, r)[1])  # after the merges
    changed |= _hoist(fused, top)
    return changed


@register
@dataclass(frozen=True)
class ScoreLICM(Pass):
    __doc__ = __doc__

    name = "score-licm"
    summary = "score function: hoist per-CTA / per-row / per-column code out of it, fold scale and log2(e)"

    def run(self, func: Func) -> Func:
        pars = [op for op in func.body.ops if op.name == "parallel_for"]
        if not pars:
            raise self.fail("needs a tiled graph (a parallel_for over tiles): run tile (and online-softmax, "
                            "mask-tiles) first")
        for par in pars:
            for fused in [op for op in par.walk() if op.name == "fused"]:
                optimise_fused(fused, par.regions[0])
        return func


__all__ = ["ScoreLICM", "optimise_fused"]
