"""Static ranges of integer values: where the IR's i32 arithmetic can wrap, so that a kernel wraps there too.

The interpreter's i32 arithmetic wraps around (two's complement); a kernel's integer code is Numba's int64, which
does not. Wrapping every i32 result in the kernels would cost instructions in every score and mask; instead a
kernel wraps only the results this analysis cannot keep inside i32 (a product or sum with a captured value, a
cast of an i64 ...), and the indices' usual arithmetic (q - kv, kv - q + N - 1) stays as it is.

`ValueRanges(env)(v)` follows v up to what defines it: a loop's index from its bounds, a fused or mask op's
region argument from the op's operands (a mask's q and kv over the tile it classifies), tile.iota from its start
and extent, a size from `env` (a size not in env is any value in 1 .. SIZE_MAX = 2^24), elementwise ops by
intervals.op_interval; data (gathers, loads, captured values, the function's arguments, loop-carried values) take
their dtype's whole range. Sound for every run with those sizes: every value v takes lies inside.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

from .core import Block, Op, Value
from .dims import BinDim, Const, Dim, Sym
from .intervals import UNKNOWN, Interval, op_interval, settle
from .ops import ELEMENTWISE
from .types import int_range, is_float, is_int

# a size not known at compile time is at most this: the kernels refuse larger inputs (runtime.check_sizes), so
# that the indices' usual arithmetic (q + N - 1, a relative bias's row; kv - 40 q, a strided mask) stays inside i32
# without a wrap. 2^24 = 16,777,216 tokens: also where an index stops being exact in f32 (ALiBi's float(kv - q))
SIZE_MAX = 2 ** 24
_VIEWS = ("unsqueeze", "squeeze")


def dim_range(d: Dim, env: Mapping[str, int], size_max: int = SIZE_MAX) -> Interval:
    """A size expression's least and greatest value, its symbols from env or else in 1 .. size_max (SIZE_MAX, the
    kernels' bound; the IR's own sizes are i32's: canonicalize folds size arithmetic only where 2^31 - 1 keeps it
    inside i32)."""
    if isinstance(d, Const):
        return (float(d.value), float(d.value))
    if isinstance(d, Sym):
        return (float(env[d.name]),) * 2 if d.name in env else (1.0, float(size_max))  # type: ignore[return-value]
    if isinstance(d, BinDim):
        a, b = dim_range(d.lhs, env, size_max), dim_range(d.rhs, env, size_max)
        if d.op == "+":
            return a[0] + b[0], a[1] + b[1]
        if d.op == "-":
            return a[0] - b[1], a[1] - b[0]
        if d.op == "*":
            p = [x * y for x in a for y in b]
            return min(p), max(p)
        if d.op in ("fdiv", "cdiv") and b[0] > 0:  # monotone in a, decreasing in b > 0
            f = (lambda x, y: x // y) if d.op == "fdiv" else (lambda x, y: -(-x // y))
            p = [f(x, y) for x in a for y in b]
            return min(p), max(p)
        if d.op in ("min", "max"):
            g = min if d.op == "min" else max
            return g(a[0], b[0]), g(a[1], b[1])
    try:
        v = float(d.eval(env))
        return v, v
    except Exception:
        return UNKNOWN


class ValueRanges:
    """The static ranges of one function's values at sizes env, memoized; `seed` fixes a value's range where the
    caller knows it better (a closed predicate region's b, h, q, kv, which no op defines)."""

    def __init__(self, env: Mapping[str, int], seeds: Optional[Mapping[Value, Interval]] = None):
        self.env = dict(env)
        self.memo: dict[Value, Interval] = dict(seeds or {})

    def seed(self, v: Value, r: Interval) -> None:
        self.memo[v] = r

    def __call__(self, v: Value) -> Interval:
        if v in self.memo:
            return self.memo[v]
        stack = [v]  # what v depends on first, without recursion (a score of a few hundred ops is a deep chain)
        while stack:
            top = stack[-1]
            if top in self.memo:
                stack.pop()
                continue
            missing = [d for d in self._deps(top) if d not in self.memo]
            if missing:
                stack.extend(missing)
                if len(stack) > 1_000_000:
                    raise RecursionError("value_ranges: a dependence cycle")
                continue
            stack.pop()
            self.memo[top] = self._settled(top)
        return self.memo[v]

    def _deps(self, v: Value) -> list[Value]:
        """The values `_range(v)` reads (every one of them before v, so that reading them recurses no deeper)."""
        owner = v.owner
        if isinstance(owner, Op):
            return list(owner.operands) if owner.name != "const" else []
        if isinstance(owner, Block) and isinstance(owner.parent, Op):
            op = owner.parent
            i = owner.args.index(v)
            if op.name == "for" and i == 0:
                return list(op.operands[:2])
            if op.name == "fused" and len(owner.args) == len(op.operands):
                return [op.operands[i]]
            if op.name.startswith("mask.") and i < 4 and op.name != "mask.block_table":
                return list(op.operands[:4])
        return []

    def _settled(self, v: Value) -> Interval:
        r = self._range(v)
        if is_int(v.type.dtype):  # what the type holds: past its range the value wrapped (the whole range)
            lo, hi = int_range(v.type.dtype)
            if not (lo <= r[0] and r[1] <= hi):
                r = (float(lo), float(hi))
        elif v.type.dtype == "bool":
            r = (max(r[0], 0.0), min(r[1], 1.0)) if r[0] <= r[1] and 0 <= r[0] and r[1] <= 1 else (0.0, 1.0)
        return r

    def raw(self, op: Op) -> Interval:
        """An elementwise op's result range before its type wraps it (op_interval over the operands' ranges):
        outside int_range the IR's result wrapped, which the kernel must then do too."""
        return op_interval(op, [self(o) for o in op.operands], self.env)

    @staticmethod
    def _whole(v: Value) -> Interval:
        if is_int(v.type.dtype):
            lo, hi = int_range(v.type.dtype)
            return float(lo), float(hi)
        return (0.0, 1.0) if v.type.dtype == "bool" else UNKNOWN

    def _range(self, v: Value) -> Interval:
        owner = v.owner
        if isinstance(owner, Block):
            return self._arg(v, owner)
        if not isinstance(owner, Op):
            return self._whole(v)
        op = owner
        n = op.name
        if n == "const":
            c = op.attrs["value"]
            if isinstance(c, Dim):
                return dim_range(c, self.env)
            if isinstance(c, (bool, int, float)):
                return settle(op, (float(c), float(c))) if is_float(v.type.dtype) else (float(c), float(c))
            return self._whole(v)
        if n == "tile.iota":
            start = self(op.operands[0])
            extent = dim_range(v.type.shape[op.attrs["axis"]], self.env)
            return start[0], start[1] + extent[1] - 1
        if n in _VIEWS and len(op.operands) == 1:
            return self(op.operands[0])
        if n == "mask.kv_range":  # first and past-last kv tile: 0 .. cdiv(nkv, bk)
            return 0.0, float(math.ceil(self(op.operands[3])[1] / op.attrs["bk"]))
        if n == "mask.q_range":
            return 0.0, float(math.ceil(self(op.operands[3])[1] / op.attrs["bq"]))
        if n in ELEMENTWISE and n != "gather":  # a float result widened by its rounding (0.99999999 is 1 in f32)
            return settle(op, self.raw(op)) if is_float(v.type.dtype) else self.raw(op)
        return self._whole(v)

    def _arg(self, v: Value, block: Block) -> Interval:
        op = block.parent
        i = block.args.index(v)
        if op is None:
            return self._whole(v)
        if op.name == "parallel_for" and i < len(op.attrs.get("bounds", ())):
            hi = dim_range(_as_dim(op.attrs["bounds"][i]), self.env)[1]
            return 0.0, hi - 1
        if op.name == "for" and i == 0:  # the index: lo .. hi - 1
            return self(op.operands[0])[0], self(op.operands[1])[1] - 1
        if op.name == "fused" and len(block.args) == len(op.operands):
            return self(op.operands[i])
        if op.name.startswith("mask.") and i < 4:
            return self._mask_arg(op, i, v)
        return self._whole(v)  # a captured value, a loop's carried value

    def _mask_arg(self, op: Op, i: int, v: Value) -> Interval:
        """A mask region's b, h, q or kv over the tiles the op asks about (interp.py's op_mask_*)."""
        bq, bk = op.attrs.get("bq", 1), op.attrs.get("bk", 1)
        if i < 2:  # b, h: the op's own where it takes them
            return self(op.operands[i]) if op.name != "mask.block_table" else self._whole(v)
        x = self(op.operands[2]) if op.name != "mask.block_table" else None
        y = self(op.operands[3]) if op.name != "mask.block_table" else None
        if op.name == "mask.classify":  # q0, k0: rows q0 .. q0 + bq - 1, columns k0 .. k0 + bk - 1
            r = x if i == 2 else y
            return r[0], r[1] + (bq if i == 2 else bk) - 1
        if op.name == "mask.kv_range":  # q0, nkv
            return (x[0], x[1] + bq - 1) if i == 2 else (0.0, math.ceil(y[1] / bk) * bk - 1)
        if op.name == "mask.q_range":  # k0, nq rows
            return (0.0, math.ceil(y[1] / bq) * bq - 1) if i == 2 else (x[0], x[1] + bk - 1)
        return 0.0, float(SIZE_MAX)  # mask.block_table: indices of the tensor's own extents


def _as_dim(b: object) -> Dim:
    from .dims import dim

    return b if isinstance(b, Dim) else dim(b)  # type: ignore[arg-type]
