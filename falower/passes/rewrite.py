"""Local rewrites are patterns: a function that looks at one op and returns replacement values or None.

`apply_patterns` runs a list of patterns to a fixpoint. A pattern builds its new ops with the Builder it
is given; the driver splices them in before the op it replaces and redirects every use.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..ir.builder import Builder
from ..ir.core import Block, Func, Op, Value, replace_uses

Pattern = Callable[[Op, Builder], Optional[Sequence[Value]]]


def apply_patterns(func: Func, patterns: Sequence[Pattern], max_rounds: int = 50) -> bool:
    """Rewrite `func` in place until no pattern applies; True if anything changed."""
    changed_any = False
    for _ in range(max_rounds):
        if not _round(func, func.body, patterns):
            return changed_any
        changed_any = True
    return changed_any


def _round(func: Func, blk: Block, patterns: Sequence[Pattern]) -> bool:
    changed = False
    i = 0
    while i < len(blk.ops):
        op = blk.ops[i]
        for r in op.regions:
            changed |= _round(func, r, patterns)
        for pat in patterns:
            scratch = Block()
            new = pat(op, Builder(scratch))
            if new is None:
                continue
            new = list(new)
            if len(new) != len(op.results):
                raise AssertionError(f"pattern {pat.__name__} returned {len(new)} values for {op.name}")
            for nop in scratch.ops:
                nop.parent = blk
            blk.ops[i:i + 1] = scratch.ops + [op]
            i += len(scratch.ops)
            for old, nv in zip(op.results, new):
                if nv.name is None and old.name is not None and nv.owner in scratch.ops:
                    nv.name = old.name
                replace_uses(func.body, old, nv)
            del blk.ops[i]
            i -= 1
            changed = True
            break
        i += 1
    return changed


def dce(func: Func) -> bool:
    """Remove ops none of whose results is used (every op here is pure)."""
    changed = False
    while True:
        used: set[Value] = set()
        for op in func.walk():
            used.update(op.operands)
        removed = _dce_block(func.body, used)
        if not removed:
            return changed
        changed = True


def region_dce(blk: Block) -> None:
    """`dce` on one region (a fused score's) rather than a whole Func: what a rewrite of the region leaves behind
    (mask_tiles' unmasked copy, score_licm's hoisting); its yield, which has no result, stays."""
    while _dce_block(blk, {v for top in blk.ops for op in top.walk() for v in op.operands}):
        pass


def _dce_block(blk: Block, used: set[Value]) -> bool:
    removed = False
    keep = []
    for op in blk.ops:
        for r in op.regions:
            removed |= _dce_block(r, used)
        if op.results and not any(r in used for r in op.results):
            removed = True
            continue
        keep.append(op)
    blk.ops = keep
    return removed


def _key(op: Op) -> Optional[tuple]:
    if op.regions or not op.results:
        return None
    attrs = tuple(sorted((k, repr(v)) for k, v in op.attrs.items()))
    return (op.name, tuple(id(v) for v in op.operands), attrs, tuple(str(r.type) for r in op.results))


def cse(func: Func) -> bool:
    """Common subexpression elimination; regions see the expressions of the blocks around them."""
    return _cse_block(func, func.body, {}, isolated=False)


def _cse_block(func: Func, blk: Block, seen: dict, isolated: bool) -> bool:
    from ..ir.ops import OPS

    scope = {} if isolated else dict(seen)
    changed = False
    for op in list(blk.ops):
        for r in op.regions:
            changed |= _cse_block(func, r, scope, OPS[op.name].isolated)
        k = _key(op)
        if k is None:
            continue
        prev = scope.get(k)
        if prev is None:
            scope[k] = op
            continue
        for old, nv in zip(op.results, prev.results):
            replace_uses(func.body, old, nv)
        blk.ops.remove(op)
        changed = True
    return changed
