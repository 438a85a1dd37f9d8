"""A mask that keeps one interval of kv per query row, as that interval: `row_bounds_fn(b, h, q, *captures)`.

Why: on a partial tile the kernels evaluated `mask_fn(b, h, q, kv)` and `kv < N` for every element, in Numba's
64-bit integers (causal: a 64-bit compare; a sliding window: a 64-bit subtraction and two compares; then the
select), about twice the plain score's per-element work on those tiles. Most masks people write (causal, sliding
windows, prefix LM, chunked causal) keep, for a fixed row, every kv in one interval [lo(q), hi(q)). When the
predicate region says so, the row's bounds are computed once per row and tile, made relative to the tile's first
column and clamped to 32 bits, and each element costs two compares of a constant against them
(emit_fa2.emit_fragment_helpers' `masked_score_row`).

The analysis (`row_bounds_lines`) reads the predicate region of mask-tiles (b, h, q, kv and the captured tables
-> bool) op by op. A value that does not read kv is emitted as scalar code, as in mask_fn. A value that reads kv
must be affine in it with coefficient -1, 0 or 1 (kv, q - kv, kv + c, casts between integer types); a comparison
of two such values with a nonzero kv coefficient is a half-line or a point of kv; `and` intersects (and ANDs the
conditions that do not read kv); `or` of two intervals unbounded on the same side is their hull, which is then
their union. An equality of a table gathered at kv with the same table gathered at q (the other indices the
same: `doc[b, q] == doc[b, kv]`) is the run of equal entries around q, read from a run table the runtime makes
per data (`runs_wanted`, block_data.run_table; block lists only), exact where the ids do not come back. Anything
else (another gather indexed by kv, `ne`, `not` of a kv test, a coefficient of 2) gives no bounds, and the
kernels keep evaluating mask_fn per element. The bounds are exact, not a cover: lo <= kv < hi
holds exactly when mask_fn is true (tests/backend/test_row_bounds.py checks that pointwise, by hypothesis over
random affine masks too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from ...ir.core import Block, Op, Value

__all__ = ["row_bounds_lines", "run_name", "runs_wanted"]


@dataclass
class _Affine:
    """coef * kv + rest (rest a scalar expression that does not read kv)."""

    coef: int
    rest: str


@dataclass
class _Interval:
    """kv in [max(lo...), min(hi...)) and every cond (expressions that do not read kv) true."""

    lo: list[str] = field(default_factory=list)
    hi: list[str] = field(default_factory=list)
    cond: list[str] = field(default_factory=list)
    exact: list[str] = field(default_factory=list)  # run-time conditions under which lo, hi are exact (runs)


def _bound(coef: int, rest: str, cmp: str) -> Optional[_Interval]:
    """`coef * kv + rest  cmp  0` as an interval of kv (coef = +-1)."""
    if coef == -1:  # -kv + r cmp 0  <=>  kv cmp' r
        r = rest
        return {"lt": _Interval(lo=[f"({r}) + 1"]), "le": _Interval(lo=[f"({r})"]),
                "gt": _Interval(hi=[f"({r})"]), "ge": _Interval(hi=[f"({r}) + 1"]),
                "eq": _Interval(lo=[f"({r})"], hi=[f"({r}) + 1"])}.get(cmp)
    r = f"-({rest})"  # kv + rest cmp 0  <=>  kv cmp -rest
    return {"lt": _Interval(hi=[r]), "le": _Interval(hi=[f"{r} + 1"]), "gt": _Interval(lo=[f"{r} + 1"]),
            "ge": _Interval(lo=[r]), "eq": _Interval(lo=[r], hi=[f"{r} + 1"])}.get(cmp)


def _fold(fn: str, xs: list[str]) -> str:
    out = xs[0]
    for x in xs[1:]:
        out = f"{fn}({out}, {x})"
    return out


def runs_wanted(pred: Block) -> list[tuple[int, int]]:
    """The (table, axis) pairs whose run table (`run_table`, made per data by block_data.py) the row bounds
    read: tables are positions among the predicate's captured tables (pred.args[4:])."""
    want: list[tuple[int, int]] = []
    return want if _walk(pred, {}, "", {}, want) is not None else []


def run_name(table: str, axis: int) -> str:
    """The kernel argument of a captured table's run table along `axis`."""
    return f"{table}_runs_{axis}"


def row_bounds_lines(pred: Block, env: Mapping[str, int], sig_caps: str, cap_names: Mapping[Value, str],
                     run_names: Optional[Mapping[tuple[int, int], str]] = None,
                     seeds: Optional[Mapping[Value, tuple[float, float]]] = None) -> Optional[list[str]]:
    """The source of `row_bounds_fn(b, h, q{sig_caps})` -> (lo, hi, exact): where exact is true,
    pred(b, h, q, kv) == (lo <= kv < hi) for every kv (lo may be negative, hi past N: the caller clamps);
    where it is false (run tables of data whose equal values are not contiguous) the caller evaluates the
    mask itself. None where the predicate is not one interval of kv per row by the module docstring's rules.
    `run_names`: the argument names of the run tables `runs_wanted` asked for. `seeds`: the static ranges of the
    region's b, h, q, kv (from_ir.predicate_seeds), which decide where the IR's i32 arithmetic can wrap: an affine
    step in kv that can leave i32 gives no bounds (the bounds' arithmetic is exact, the IR's would wrap)."""
    return _walk(pred, env, sig_caps, dict(cap_names), None, dict(run_names or {}), seeds)


def _walk(pred: Block, env: Mapping[str, int], sig_caps: str, cap_names: dict, want: Optional[list],
          run_names: Optional[dict] = None, seeds: Optional[Mapping[Value, tuple[float, float]]] = None
          ) -> Optional[list[str]]:
    """row_bounds_lines' analysis; with `want` a list, only collects the run tables it needs into it (without the
    wrap test, which needs the sizes: a run table asked for and then not read costs its build, not a wrong bound)."""
    from .from_ir import _ScalarEmitter, cap_ref

    e = _ScalarEmitter(env, cap_names)
    for a, rng in (seeds or {}).items():
        e.ranges.seed(a, rng)
    tables = list(pred.args[4:])
    if want is None:
        for a, nm in zip(pred.args, ["b", "h", "q", "kv"] + [cap_ref(v, n) for v, n in cap_names.items()]):
            e.names[a] = nm
    q, kv = pred.args[2], pred.args[3]
    aff: dict[Value, _Affine] = {kv: _Affine(1, "0")}
    ivs: dict[Value, _Interval] = {}
    cols: dict[Value, Op] = {}  # gathers of a table at kv along one axis (other indices not reading kv)
    k = 0

    def reads_kv(v: Value) -> bool:
        return v in aff or v in ivs or v in cols

    def affine(v: Value) -> Optional[_Affine]:
        if v in aff:
            return aff[v]
        if reads_kv(v) or v.type.dtype in ("bool", "f16", "bf16", "f32", "f64"):
            return None
        return _Affine(0, "0" if want is not None else e.name(v))

    def interval(v: Value) -> Optional[_Interval]:
        if v in ivs:
            return ivs[v]
        if reads_kv(v) or v.type.dtype != "bool":
            return None
        return _Interval(cond=["True" if want is not None else e.name(v)])

    def same_run(col: Op, row: Value) -> Optional[tuple[int, int]]:
        """(table position, axis) when `row` is the same table gathered at q where `col` has kv: then
        {kv : T[.., kv, ..] == T[.., q, ..]} is the run of equal entries around q, when runs are contiguous."""
        op = row.owner
        if not isinstance(op, Op) or op.name != "gather" or op.operands[0] is not col.operands[0]:
            return None
        axis = [i for i, v in enumerate(col.operands[1:]) if v is kv][0]
        for i, (a, b) in enumerate(zip(op.operands[1:], col.operands[1:])):
            if (i == axis and a is not q) or (i != axis and a is not b):
                return None
        return tables.index(col.operands[0]), axis

    for op in pred.ops:
        if op.name == "yield":
            res = interval(op.operands[0])
            if res is None or want is not None:
                return None if res is None else []
            lines = [f"def row_bounds_fn(b, h, q{sig_caps}):"] + e.lines
            lo = _fold("max", res.lo) if res.lo else "0"
            hi = _fold("min", res.hi) if res.hi else str(1 << 40)
            lines += [f"    lo = {lo}", f"    hi = {hi}"]
            if res.cond:
                lines.append(f"    hi = hi if ({' and '.join(res.cond)}) else lo")
            return lines + [f"    return lo, hi, {' and '.join(res.exact) or 'True'}"]
        if not any(reads_kv(v) for v in op.operands):
            if want is None:
                e.emit_ops([op])  # a value of the row: scalar code, as mask_fn has it
            continue
        n, r = op.name, op.results[0]
        if n == "gather":
            idx = op.operands[1:]
            at_kv = [i for i, v in enumerate(idx) if v is kv]
            if (op.operands[0] not in tables or len(at_kv) != 1 or any(reads_kv(v) for v in idx if v is not kv)
                    or op.operands[0].type.dtype not in ("i32", "i64", "i8", "bool")):
                return None  # float tables: NaN == NaN is false, runs would keep it
            cols[r] = op
        elif n in ("add", "sub", "neg") and want is None and (r.type.dtype != "i32" or e.leaves_i32(op)):
            return None  # the IR's sum wraps (i8, or i32 past its range) where the bounds' arithmetic would not
        elif n in ("add", "sub"):
            x, y = affine(op.operands[0]), affine(op.operands[1])
            if x is None or y is None:
                return None
            coef = x.coef + y.coef if n == "add" else x.coef - y.coef
            if coef not in (-1, 0, 1):
                return None
            aff[r] = _Affine(coef, f"({x.rest} {'+' if n == 'add' else '-'} {y.rest})")
        elif n == "neg":
            x = affine(op.operands[0])
            if x is None:
                return None
            aff[r] = _Affine(-x.coef, f"(-{x.rest})")
        elif n == "cast" and r.type.dtype == "i32" and op.operands[0] in aff:
            aff[r] = aff[op.operands[0]]  # integer to i32 keeps every value (i8 to i32, i32 to itself)
        elif n == "eq" and any(v in cols for v in op.operands):
            col, row = op.operands if op.operands[0] in cols else op.operands[::-1]
            tab = None if col not in cols or reads_kv(row) else same_run(cols[col], row)
            if tab is None:
                return None
            if want is not None:
                if tab not in want:
                    want.append(tab)
                ivs[r] = _Interval(lo=["0"], hi=["0"], exact=["True"])  # the shape emission gives it
                continue
            if tab not in run_names:  # type: ignore[operator]
                return None  # not asked for (runs_wanted saw the whole predicate fail)
            g = cols[col]
            t = e.name(g.operands[0])
            clamp = [f"min(max({e.name(v) if v is not kv else 'q'}, 0), {t}.shape[{d}] - 1)"
                     for d, v in enumerate(g.operands[1:])]
            runs = run_names[tab]  # type: ignore[index]
            k += 1
            e.lines += [f"    run{k}_lo = {runs}[{', '.join(clamp)}, 0]", f"    run{k}_hi = {runs}[{', '.join(clamp)}, 1]"]
            ivs[r] = _Interval(lo=[f"run{k}_lo"], hi=[f"run{k}_hi"], exact=[f"run{k}_lo >= 0"])
        elif n in ("lt", "le", "gt", "ge", "eq"):
            x, y = affine(op.operands[0]), affine(op.operands[1])
            if x is None or y is None or x.coef - y.coef not in (-1, 1):
                return None
            iv = _bound(x.coef - y.coef, f"{x.rest} - {y.rest}", n)
            if iv is None:
                return None
            ivs[r] = iv
        elif n == "and" and r.type.dtype == "bool":
            x, y = interval(op.operands[0]), interval(op.operands[1])
            if x is None or y is None:
                return None
            ivs[r] = _Interval(x.lo + y.lo, x.hi + y.hi, x.cond + y.cond, x.exact + y.exact)
        elif n == "or" and r.type.dtype == "bool":
            x, y = interval(op.operands[0]), interval(op.operands[1])
            if x is None or y is None or x.cond or y.cond or x.exact or y.exact:
                return None
            if not x.lo and not y.lo and x.hi and y.hi:  # [., a) | [., b) = [., max(a, b))
                ivs[r] = _Interval(hi=[f"max({_fold('min', x.hi)}, {_fold('min', y.hi)})"])
            elif not x.hi and not y.hi and x.lo and y.lo:  # [a, .) | [b, .) = [min(a, b), .)
                ivs[r] = _Interval(lo=[f"min({_fold('max', x.lo)}, {_fold('max', y.lo)})"])
            else:
                return None
        else:
            return None
    return None
