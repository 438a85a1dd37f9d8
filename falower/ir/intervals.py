"""Interval semantics of mask predicates: what the tile classifier computes.

A predicate region maps scalar (b, h, q, kv, captured tables...) to a bool. Evaluated over a tile's index
ranges with interval arithmetic it answers "true for every element" (a full tile), "false for every
element" (an empty tile) or "don't know" (partial: evaluate the mask per element). The answer is
conservative: "don't know" is always safe. Values from captured tables are unknown, so a predicate that
reads data cannot be decided here; `uses_data` tells the mask analysis to classify those at run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .core import Block, Op, Value
from .types import int_range, is_float, is_int

Interval = tuple[float, float]

EMPTY, PARTIAL, FULL = 0, 1, 2
UNKNOWN: Interval = (-math.inf, math.inf)
_MONOTONE = ("exp", "exp2", "log", "log2", "tanh", "tanh_approx", "sigmoid", "erf", "sqrt", "log1p", "expm1", "floor", "ceil", "round",
             "sign")


def uses_data(block: Block) -> bool:
    """True when the predicate reads a captured table (a gather), so only run-time data decides it."""
    return any(op.name == "gather" for op in block.ops)


@dataclass(frozen=True)
class RangeTable:
    """What `mask.ranges` computes for one captured table: `minmax[..., j, ..., 0 / 1]` is the least / greatest
    entry of the table over positions j*granule .. (j+1)*granule - 1 of `axis` (the last granule may be
    short), every other index unchanged. A gather whose only varying index runs along `axis` takes its
    interval from the granules that index's interval covers: sound for any index expression, and exact up to
    the granule for sorted data such as document ids."""

    minmax: Any
    axis: int
    granule: int
    n: int  # the table's extent along `axis` (indices are clamped to it, as gather clamps them)

    def lookup(self, idx: Sequence[Interval]) -> Interval:
        n = self.n
        point = [i for d, i in enumerate(idx) if d != self.axis]
        if any(not (lo == hi and math.isfinite(lo)) for lo, hi in point):
            return UNKNOWN
        lo, hi = idx[self.axis]
        lo = int(min(max(lo, 0), n - 1)) if math.isfinite(lo) else 0  # gather clamps its indices
        hi = int(min(max(hi, 0), n - 1)) if math.isfinite(hi) else n - 1
        where = [int(min(max(p[0], 0), s - 1)) for p, s in zip(point, self._other_extents)]
        where.insert(self.axis, slice(lo // self.granule, hi // self.granule + 1))
        part = self.minmax[tuple(where)]
        lo, hi = float(part[..., 0].min()), float(part[..., 1].max())
        return UNKNOWN if math.isnan(lo) or math.isnan(hi) else (lo, hi)  # a NaN entry: no bounds

    @property
    def _other_extents(self) -> list[int]:
        return [int(s) for d, s in enumerate(self.minmax.shape[:-1]) if d != self.axis]


def range_tables(spec: Sequence[Sequence[int]], captures: Sequence[Any]) -> dict[int, RangeTable]:
    """The `ranges` attribute of a mask op ([[capture index, axis, granule], ...], one per range-table operand,
    which come last) with its operands `captures` (the captured tensors, then the range tables), as the
    `ranges` argument of `eval_interval` (keyed by region-argument position, after b, h, q, kv)."""
    first = len(captures) - len(spec)
    return {4 + int(c): RangeTable(np.asarray(captures[first + j]), int(axis), int(g), int(np.shape(captures[c])[axis]))
            for j, (c, axis, g) in enumerate(spec)}


def minmax_table(table: Any, axis: int, granule: int) -> Any:
    """`mask.ranges`: the least and greatest entry of each `granule` positions along `axis`, stacked on a new
    last axis of size 2 (the table's dtype; bool tables as their 0/1 values)."""
    a = np.asarray(table)
    a = a.astype(np.int8) if a.dtype == np.bool_ else a
    starts = np.arange(0, a.shape[axis], granule)
    lo = np.minimum.reduceat(a, starts, axis=axis)
    hi = np.maximum.reduceat(a, starts, axis=axis)
    return np.stack([lo, hi], axis=-1)


def _mul(a: Interval, b: Interval) -> Interval:
    if any(math.isinf(x) and y == 0 or math.isinf(y) and x == 0 for x in a for y in b):
        return UNKNOWN  # inf * 0 is NaN: no interval holds it (UNKNOWN stands for "any value, NaN included")
    prods = [x * y for x in a for y in b]
    return (min(prods), max(prods))


def _maybe_nan(x: Interval) -> bool:
    """UNKNOWN, which also stands for a value that may be NaN (data, inf * 0, inf - inf, log of a negative)."""
    return x[0] == -math.inf and x[1] == math.inf


def _bool(lo_true: bool, hi_true: bool) -> Interval:
    return (1 if lo_true else 0, 1 if hi_true else 0)


def _compare(name: str, a: Interval, b: Interval) -> Interval:
    if name == "lt":
        return _bool(a[1] < b[0], not a[0] >= b[1])
    if name == "le":
        return _bool(a[1] <= b[0], not a[0] > b[1])
    if name == "gt":
        return _compare("lt", b, a)
    if name == "ge":
        return _compare("le", b, a)
    exact_equal = a[0] == a[1] == b[0] == b[1]
    disjoint = a[1] < b[0] or b[1] < a[0]
    if name == "eq":
        return _bool(exact_equal, not disjoint)
    return _bool(disjoint, not exact_equal)  # ne


def eval_interval(block: Block, args: Sequence[Interval], env: Optional[Mapping[str, int]] = None,
                  ranges: Optional[Mapping[int, RangeTable]] = None) -> Interval:
    """Evaluate a predicate region on intervals; the result is a bool interval (0,0), (1,1) or (0,1).

    `env` gives the sizes of symbolic dims (a `const N` in the predicate); without it they are unknown.
    `ranges` maps a region argument's position (a captured table) to its `mask.ranges` table: a gather from
    it is bounded by the granules its varying index covers instead of being unknown.
    """
    vals: dict[Value, Interval] = dict(zip(block.args, args))
    ranged = {block.args[i]: t for i, t in (ranges or {}).items()}
    for op in block.ops:
        if op.name == "yield":
            return vals[op.operands[0]]
        x = [vals[v] for v in op.operands]
        if op.name == "gather" and op.operands[0] in ranged:
            r = ranged[op.operands[0]].lookup(x[1:])
        else:
            r = op_interval(op, x, env)
        vals[op.results[0]] = settle(op, r)
    raise ValueError("predicate region without yield")


def op_interval(op: Op, x: Sequence[Interval], env: Optional[Mapping[str, int]] = None) -> Interval:
    """One elementwise op's result interval from its operands', by exact arithmetic: not yet rounded to a float
    dtype nor wrapped to an integer one (`settle` does both; value_ranges.py reads whether an i32 result can leave
    its type from this). A gather, and any op not modelled, is data we cannot see: unknown (bools (0, 1))."""
    n = op.name
    dtype = op.results[0].type.dtype
    r: Interval
    if is_float(dtype) and n not in ("const", "where") and any(
            is_float(v.type.dtype) and _maybe_nan(i) for v, i in zip(op.operands, x)):
        return UNKNOWN  # NaN in, NaN possibly out: abs, exp, tanh, min and max of it are no bounded interval
    if n == "const":
        v = op.attrs["value"]
        if hasattr(v, "symbols"):
            try:
                v = v.eval(env or {})
            except Exception:
                v = None
        r = (float(v), float(v)) if v is not None else UNKNOWN
    elif n == "add":
        r = (x[0][0] + x[1][0], x[0][1] + x[1][1])
    elif n == "sub":
        r = (x[0][0] - x[1][1], x[0][1] - x[1][0])
    elif n == "mul":
        r = _mul(x[0], x[1])
    elif n == "neg":
        r = (-x[0][1], -x[0][0])
    elif n == "abs":
        lo, hi = x[0]
        r = (0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
    elif n in ("min", "max"):
        f = min if n == "min" else max
        r = (f(x[0][0], x[1][0]), f(x[0][1], x[1][1]))
    elif n == "floordiv" and x[1][0] == x[1][1] and x[1][0] > 0 and all(map(math.isfinite, x[0])):
        c = x[1][0]
        r = (x[0][0] // c, x[0][1] // c)
    elif n == "mod" and x[1][0] == x[1][1] and x[1][0] > 0 and all(map(math.isfinite, x[0])):
        c = x[1][0]
        r = (x[0][0] % c, x[0][1] % c) if x[0][0] // c == x[0][1] // c else (0.0, c - 1)
    elif n in ("lt", "le", "gt", "ge", "eq", "ne"):
        r = _compare(n, x[0], x[1])
    elif n == "and":
        r = (min(x[0][0], x[1][0]), min(x[0][1], x[1][1])) if _is_bool(x[0]) and _is_bool(x[1]) else UNKNOWN
    elif n == "or":
        r = (max(x[0][0], x[1][0]), max(x[0][1], x[1][1])) if _is_bool(x[0]) and _is_bool(x[1]) else UNKNOWN
    elif n == "not":  # logical on bool, bitwise on ints (~x = -x - 1), as the interpreter's np.invert
        r = ((1 - x[0][1], 1 - x[0][0]) if dtype == "bool" and _is_bool(x[0])
             else (-x[0][1] - 1, -x[0][0] - 1) if is_int(dtype) else UNKNOWN)
    elif n == "xor":  # logical on bool; bitwise xor on ints has no interval rule here
        if dtype != "bool":
            r = UNKNOWN
        else:
            r = (float(x[0][0] != x[1][0]),) * 2 if _exact(x[0]) and _exact(x[1]) else (0, 1)  # type: ignore
    elif n == "where":
        c, a, b = x
        r = a if c == (1, 1) else b if c == (0, 0) else (min(a[0], b[0]), max(a[1], b[1]))
    elif n == "cast":
        r = _cast(x[0], op.operands[0].type.dtype, op.attrs["to"])
    elif n in _MONOTONE:
        with np.errstate(all="ignore"):
            f = {"log1p": np.log1p, "expm1": np.expm1, "floor": np.floor, "ceil": np.ceil, "round": np.round,
                 "sign": np.sign,
                 "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "tanh": np.tanh,
                 # the definition's interval; a kernel's partial tiles evaluate the approximation, so a mask
                 # on tanh_approx may differ from the IR where a value is within its error of a threshold
                 "tanh_approx": np.tanh,
                 "sigmoid": lambda t: 1 / (1 + np.exp(-t)), "sqrt": np.sqrt,
                 "erf": lambda t: math.erf(t) if math.isfinite(t) else math.copysign(1.0, t)}[n]
            r = (float(f(x[0][0])), float(f(x[0][1])))
        if any(math.isnan(t) for t in r):
            r = UNKNOWN
    elif n == "rsqrt":  # decreasing
        with np.errstate(all="ignore"):
            r = (float(1 / np.sqrt(x[0][1])), float(1 / np.sqrt(x[0][0])))
        if any(math.isnan(t) for t in r):
            r = UNKNOWN
    elif n in ("sin", "cos"):
        r = (-1.0, 1.0)
    else:  # gather and anything not modelled: data we cannot see
        r = UNKNOWN if dtype != "bool" else (0, 1)
    if math.isnan(r[0]) or math.isnan(r[1]):  # (inf - inf at the ends)
        return UNKNOWN if dtype != "bool" else (0, 1)
    return r


def settle(op: Op, r: Interval) -> Interval:
    """op_interval's result as the op's dtype holds it: a bool (0, 1) unless decided, a float widened by its
    rounding, an integer past its type's range unknown (the interpreter's integers wrap around)."""
    n, dtype = op.name, op.results[0].type.dtype
    if dtype == "bool" and not _is_bool(r):
        return (0, 1)
    if is_float(dtype) and (n in _ROUNDED or n == "const"):
        return _widen(r, dtype, 8 if n in _MONOTONE or n == "rsqrt" else 2)
    if is_int(dtype) and not (int_range(dtype)[0] <= r[0] and r[1] <= int_range(dtype)[1]):
        return UNKNOWN
    return r


# Float results are rounded (the interpreter computes in f32 or f64 and stores each value in its dtype, a kernel in
# f32, and a constant is stored in its dtype): an arithmetic result's or a float constant's interval is widened
# outward by a few units of its dtype's precision, so that a value the exact endpoints put on one side of a comparison
# or an integer cast cannot land on the other side rounded (`q * 0.1 <= 19.2` keeps row 192 in f32, not in f64: its
# tile is partial, each precision decides per element). The interpreter's "low:" modes, which round every value to
# f16 or bf16, are references for graphs, not for the masks of lowered IR.
_ROUNDED = ("add", "sub", "mul", "floordiv", "mod", "rsqrt") + _MONOTONE
_EPS = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8, "f32": 2.0 ** -24, "f64": 2.0 ** -53}  # half an ulp, relative


_FMAX = {"f16": 65504.0, "bf16": 3.3895313892515355e38, "f32": 3.4028234663852886e38, "f64": 1.7976931348623157e308}


def _widen(r: Interval, dtype: str, ulps: int) -> Interval:
    """r widened by `ulps` half-ulps of dtype (relative, plus f32's least normal for results near zero); an end past
    the dtype's largest finite value may round to inf: it is inf (66000 cast to f16 is inf, a review found a mask
    `x.to('f16') < inf` called FULL)."""
    e = ulps * _EPS[dtype]
    lo = r[0] - abs(r[0]) * e - 1.2e-38 if math.isfinite(r[0]) else r[0]
    hi = r[1] + abs(r[1]) * e + 1.2e-38 if math.isfinite(r[1]) else r[1]
    top = _FMAX[dtype]
    return (-math.inf if lo < -top else lo), (math.inf if hi > top else hi)


def _cast(x: Interval, src: str, to: str) -> Interval:
    """A cast's interval, as the interpreter casts: to bool (nonzero), float to int by truncation toward zero
    saturated to the target's range (monotone, so its ends' truncations clamped; NaN's 0 lies between them), ints
    wrapping outside the target's range (unknown there), to a float rounded to nearest (monotone: the ends rounded,
    widened)."""
    if to == "bool":
        return (0, 0) if x == (0, 0) else (1, 1) if x[0] > 0 or x[1] < 0 else (0, 1)
    if is_float(to):
        return _widen(x, to, 2)
    lo, hi = int_range(to)
    if is_float(src):
        def sat(t: float) -> float:
            return float(lo) if t <= lo else float(hi) if t >= hi else float(math.trunc(t))
        if math.isnan(x[0]) or math.isnan(x[1]) or _maybe_nan(x):
            return float(lo), float(hi)  # (NaN casts to 0)
        return sat(x[0]), sat(x[1])
    if not all(map(math.isfinite, x)):
        return UNKNOWN
    return x if lo <= x[0] and x[1] <= hi else UNKNOWN


def _is_bool(x: Interval) -> bool:
    return x[0] in (0, 1) and x[1] in (0, 1)


def _exact(x: Interval) -> bool:
    return x[0] == x[1]


def _known(capture: object) -> Interval:
    """A captured scalar (0-d) is known exactly when the tiles are classified at run time; tables are not."""
    try:
        a = np.asarray(capture)
    except Exception:  # a device array: only its data is unknown here
        return UNKNOWN
    if a.ndim == 0 and a.dtype.kind in "iub":
        return (float(a), float(a))
    return UNKNOWN


def classify(block: Block, b: int, h: int, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int,
             captures: Sequence[object] = (), env: Optional[Mapping[str, int]] = None,
             ranges: Optional[Mapping[int, RangeTable]] = None) -> int:
    """EMPTY, PARTIAL or FULL for rows q_lo..q_hi and columns kv_lo..kv_hi (inclusive). Rows before 0 (a q tile of
    tile{ragged_q=first} starts there) produce no output and are not classified, as rows past M are not."""
    args: list[Interval] = [(b, b), (h, h), (max(q_lo, 0), q_hi), (kv_lo, kv_hi)] + [_known(c) for c in captures]
    lo, hi = eval_interval(block, args, env, ranges)
    if lo == hi == 1:
        return FULL
    if lo == hi == 0:
        return EMPTY
    return PARTIAL


def kv_range(block: Block, b: int, h: int, q0: int, bq: int, bk: int, nkv: int,
             captures: Sequence[object] = (), env: Optional[Mapping[str, int]] = None,
             ranges: Optional[Mapping[int, RangeTable]] = None) -> tuple[int, int]:
    """First and past-last kv tile that is not empty for the q tile at q0 (0, 0 when all are empty)."""
    nk = -(-nkv // bk)
    live = [kj for kj in range(nk)
            if classify(block, b, h, q0, q0 + bq - 1, kj * bk, kj * bk + bk - 1, captures, env, ranges) != EMPTY]
    return (live[0], live[-1] + 1) if live else (0, 0)


def q_range(block: Block, b: int, h: int, k0: int, bq: int, bk: int, nq_rows: int,
            captures: Sequence[object] = (), env: Optional[Mapping[str, int]] = None,
            ranges: Optional[Mapping[int, RangeTable]] = None) -> tuple[int, int]:
    """First and past-last q tile that is not empty for the kv tile at k0 (0, 0 when all are empty): the
    transpose of `kv_range`, for the backward's loop over q tiles inside a kv tile."""
    nq = -(-nq_rows // bq)
    live = [qi for qi in range(nq)
            if classify(block, b, h, qi * bq, qi * bq + bq - 1, k0, k0 + bk - 1, captures, env, ranges) != EMPTY]
    return (live[0], live[-1] + 1) if live else (0, 0)
