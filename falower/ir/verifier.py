"""The verifier: types, shapes, SSA dominance, region rules and what is legal at each level.

Every failure names the op and shows the IR around it, so a broken pass is found at the pass that broke it.
"""

from __future__ import annotations

from typing import Iterable, Optional

from ..errors import VerifyError
from .core import Block, Func, Op, Value
from .dims import BinDim, Const, Dim
from .ops import OPS, OpTypeError, TERMINATORS
from .printer import Printer
from .types import TensorType, is_float, scalar

I32 = scalar("i32")
BOOL = scalar("bool")

# what may appear inside a fused (elementwise) region
_FUSABLE_KINDS = ("elementwise", "data")
_FUSABLE_DATA = ("const", "gather")


class _Fail(Exception):
    def __init__(self, op: Optional[Op], msg: str):
        super().__init__(msg)
        self.op, self.msg = op, msg


def _context(func: Func, op: Optional[Op], radius: int = 3) -> str:
    p = Printer()
    text = p.func(func).rstrip("\n").split("\n")
    if op is None or op not in p.op_lines:
        return "\n".join(text[: 2 * radius + 1])
    i = p.op_lines[op]
    lo, hi = max(0, i - radius), min(len(text), i + radius + 1)
    return "\n".join(("> " if j == i else "  ") + text[j] for j in range(lo, hi))


def _dim_problem(d: Dim) -> Optional[str]:
    """Why a dim can never be a size (a negative literal, a division by a zero constant), or None."""
    if isinstance(d, Const) and d.value < 0:
        return "a size cannot be negative"
    stack = [d]
    while stack:
        e = stack.pop()
        if isinstance(e, BinDim):
            if e.op in ("fdiv", "cdiv") and e.rhs == Const(0):
                return f"{e} divides by zero"
            stack += [e.lhs, e.rhs]
    return None


def _check_dims(values: Iterable[Value], op: Optional[Op], what: str) -> None:
    for k, v in enumerate(values):
        for d in v.type.shape:
            why = _dim_problem(d)
            if why is not None:
                name = f"%{v.name}" if v.name else f"{what} {k}"
                raise _Fail(op, f"{name}: {v.type} has dimension {d}: {why}")


FUSED_ROLES = ("s", "b", "h", "q", "kv", "cap", "row", "col", "cta")  # fuse's, tile's and score-licm's
_IOTA_AXIS = {"b": 0, "h": 1, "q": 2, "kv": 3}  # an index operand's iota axis at the graph level
_TILE_IOTA_AXIS = {"q": 0, "kv": 1}  # and in a tile ([bq, 1] rows, [1, bk] columns)


def verify(func: Func, forbidden: Iterable[str] = ()) -> None:
    """Raise VerifyError if `func` breaks a rule; `forbidden` names ops a pass already removed."""
    v = _Verifier(set(forbidden))
    try:
        v.func(func)
    except _Fail as e:
        where = f"'{e.op.name}'" if e.op is not None else f"func @{func.name}"
        try:
            ctx = _context(func, e.op)
        except Exception:  # the IR may be too broken to print
            ctx = "(IR could not be printed)"
        raise VerifyError(f"verifier: {where}: {e.msg}\n{ctx}") from None


class _Verifier:
    def __init__(self, forbidden: set[str]):
        self.forbidden = forbidden

    def func(self, f: Func) -> None:
        self.block(f.body, visible=set(), parent=None, isolated=True, in_tile=False, in_loop=False, in_fused=False)
        term = f.body.terminator
        if term is None or term.name != "return":
            raise _Fail(term, "a func body must end in return")
        names = f.attrs.get("result_names")
        if names is not None and len(names) != len(term.operands):
            raise _Fail(term, f"{len(names)} result names for {len(term.operands)} results")
        dup = sorted({n for n in names or () if n and list(names).count(n) > 1})
        if dup:
            raise _Fail(term, f"result name {dup[0]!r} given to more than one result")
        lse = f.attrs.get("lse_result")  # the softmax's LSE, a result once online-softmax runs (passes/raise_lse.py)
        if lse is not None and (not isinstance(lse, str) or not lse.isidentifier() or lse in f.result_names):
            raise _Fail(term, f"lse_result must name the LSE result the function will have, an identifier that no "
                              f"result has; got {lse!r}")

    def block(self, blk: Block, visible: set[Value], parent: Optional[Op], isolated: bool,
              in_tile: bool, in_loop: bool, in_fused: bool) -> None:
        scope = set() if isolated else set(visible)
        scope.update(blk.args)
        _check_dims(blk.args, parent, "argument")
        if not blk.ops:
            raise _Fail(parent, "a region must end in a terminator")
        expected = "return" if parent is None else "tile.yield" if parent.name == "parallel_for" else "yield"
        last_op = blk.ops[-1]
        if last_op.name in TERMINATORS and last_op.name != expected:
            where = "a func body" if parent is None else f"a {parent.name} region"
            raise _Fail(last_op, f"{last_op.name} cannot end {where}, which ends in {expected}")
        for i, op in enumerate(blk.ops):
            last = i == len(blk.ops) - 1
            if op.name in TERMINATORS and not last:
                raise _Fail(op, "a terminator must be the last op of its region")
            if last and op.name not in TERMINATORS:
                raise _Fail(op, "the last op of a region must be a terminator (yield, tile.yield or return)")
            for v in op.operands:
                if v not in scope:
                    why = "is defined in an enclosing region, but this region is isolated" if v in visible and isolated \
                        else "is used before it is defined (or is not visible here)"
                    raise _Fail(op, f"operand {v.name or '?'}: {v.type} {why}")
            # regions first: a broken body is reported where it breaks, not as a wrong loop type
            if op.name in OPS:
                new_tile = in_tile or op.name == "parallel_for"
                new_loop = in_loop or op.name in ("for", "parallel_for")
                new_fused = in_fused or op.name == "fused"
                for r in op.regions:
                    self.block(r, scope, op, OPS[op.name].isolated, new_tile, new_loop, new_fused)
            _check_dims(op.results, op, "result")
            self.op(op, parent, in_tile, in_loop, in_fused)
            scope.update(op.results)

    def op(self, op: Op, parent: Optional[Op], in_tile: bool, in_loop: bool, in_fused: bool) -> None:
        d = OPS.get(op.name)
        if d is None:
            raise _Fail(op, f"unknown op {op.name!r}")
        if op.name in self.forbidden:
            raise _Fail(op, f"{op.name} is not legal at this level (an earlier pass lowered it away)")
        if d.level == "graph" and op.name not in ("return",) and in_loop:
            raise _Fail(op, f"{op.name} works on whole tensors and is not legal inside a loop")
        if d.level == "tile" and not in_tile:
            raise _Fail(op, f"{op.name} is a tile op and is only legal inside a parallel_for")
        if in_fused and op.name != "yield" and not (d.kind == "elementwise" or op.name in _FUSABLE_DATA):
            raise _Fail(op, f"{op.name} is not elementwise and cannot be inside a fused region")
        if len(op.regions) != d.num_regions:
            raise _Fail(op, f"has {len(op.regions)} regions, expected {d.num_regions}")
        if d.infer is not None:
            attrs = dict(op.attrs)
            if op.name in ("const", "iota", "tile.iota"):
                if len(op.results) != 1:
                    raise _Fail(op, "has one result")
                attrs["type"] = op.results[0].type
            try:
                got = d.infer([v.type for v in op.operands], attrs)
            except OpTypeError as e:
                raise _Fail(op, str(e)) from None
            want = [r.type for r in op.results]
            if got != want:
                raise _Fail(op, f"result type is {', '.join(map(str, want))} but the operands give "
                                f"{', '.join(map(str, got))}")
        check = getattr(self, "op_" + op.name.replace(".", "_"), None)  # rules beyond types (where it may add)
        if check is not None:
            check(op, parent)

    # ------------------------------------------------------------------------- structured ops
    @staticmethod
    def _yield_types(op: Op, blk: Block, want: list[TensorType], what: str) -> None:
        term = blk.terminator  # its kind was checked when the region was walked (block())
        assert term is not None
        got = [v.type for v in term.operands]
        if got != want:
            raise _Fail(term, f"yields ({', '.join(map(str, got))}) but {what} needs ({', '.join(map(str, want))})")

    def op_for(self, op: Op, parent) -> None:
        if len(op.operands) < 2:
            raise _Fail(op, "needs lower and upper bounds")
        if op.operands[0].type != I32 or op.operands[1].type != I32:
            raise _Fail(op, "loop bounds must be i32 scalars")
        inits = [v.type for v in op.operands[2:]]
        blk = op.regions[0]
        if [a.type for a in blk.args] != [I32] + inits:
            raise _Fail(op, "block arguments must be the i32 induction variable and one per iter_arg")
        if [r.type for r in op.results] != inits:
            raise _Fail(op, "results must have the iter_args' types")
        self._yield_types(op, blk, inits, "a for body")

    def op_if(self, op: Op, parent) -> None:
        if len(op.operands) != 1 or op.operands[0].type != BOOL:
            raise _Fail(op, "the condition must be a bool scalar")
        want = [r.type for r in op.results]
        for blk, what in zip(op.regions, ("the then-branch", "the else-branch")):
            if blk.args:
                raise _Fail(op, f"{what} takes no arguments")
            self._yield_types(op, blk, want, what)

    def op_fused(self, op: Op, parent) -> None:
        blk = op.regions[0]
        if [a.type for a in blk.args] != [v.type for v in op.operands]:
            raise _Fail(op, "region arguments must match the operands one to one")
        self._yield_types(op, blk, [r.type for r in op.results], "a fused region")
        roles = op.attrs.get("roles")
        if roles is not None and len(roles) != len(op.operands):
            raise _Fail(op, f"{len(roles)} roles for {len(op.operands)} operands")
        for role, v in zip(roles or (), op.operands):
            if role not in FUSED_ROLES:
                raise _Fail(op, f"unknown role {role!r} (roles are {', '.join(FUSED_ROLES)})")
            if role == "s" and not is_float(v.type.dtype):
                raise _Fail(op, f"the score operand (role s) must be a float, got {v.type}")
            d = v.owner if isinstance(v.owner, Op) else None
            want = {"iota": _IOTA_AXIS, "tile.iota": _TILE_IOTA_AXIS}.get(d.name if d else "", {}).get(role)
            if role in _IOTA_AXIS and d is not None and d.name in ("iota", "tile.iota") and want != d.attrs.get("axis"):
                raise _Fail(op, f"operand %{v.name} of role {role} is an index along axis {d.attrs.get('axis')}, "
                                f"not the {role} axis")

    def _predicate(self, op: Op, n_fixed: int) -> None:
        blk = op.regions[0]
        if len(blk.args) < 4 or any(a.type != I32 for a in blk.args[:4]):
            raise _Fail(op, "the predicate takes i32 scalars (b, h, q, kv) then the captured tensors")
        caps_ops = op.operands[n_fixed:]
        if [a.type for a in blk.args[4:]] != [v.type for v in caps_ops]:
            raise _Fail(op, "captured tensor operands must match the predicate's arguments")
        self._ranges(op, blk.args[4:])
        self._yield_types(op, blk, [BOOL], "a mask predicate")
        for k in ("bq", "bk"):
            if not isinstance(op.attrs.get(k), int) or op.attrs[k] < 1:
                raise _Fail(op, f"needs a positive int attribute {k}")

    def _ranges(self, op: Op, caps) -> None:
        """`ranges = [[capture index, axis, granule], ...]`: the last operands are those captures' mask.ranges
        tables, in that order; a range table is never itself the table of another."""
        spec = op.attrs.get("ranges", ())
        first = len(caps) - len(spec)
        for j, entry in enumerate(spec):
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(isinstance(e, int) for e in entry)):
                raise _Fail(op, f"ranges entries are [capture index, axis, granule], got {entry!r}")
            c, axis, g = entry
            if not 0 <= c < first:
                raise _Fail(op, f"ranges names capture {c}, but there are {first} captured tables before the ranges")
            try:
                (want,) = OPS["mask.ranges"].infer([caps[c].type], {"axis": axis, "granule": g})  # type: ignore[misc]
            except OpTypeError as e:
                raise _Fail(op, f"ranges entry {entry}: {e}") from None
            if caps[first + j].type.dtype != want.dtype or caps[first + j].type.rank != want.rank:
                raise _Fail(op, f"range table {j} must be {want} for capture {c}, got {caps[first + j].type}")

    def op_mask_ranges(self, op: Op, parent) -> None:
        if len(op.results) != 1:
            raise _Fail(op, "gives one range table")

    def op_mask_classify(self, op: Op, parent) -> None:
        if len(op.operands) < 4 or any(v.type != I32 for v in op.operands[:4]):
            raise _Fail(op, "operands are b, h, q0, k0 (i32 scalars) then the captured tensors")
        if [r.type for r in op.results] != [I32]:
            raise _Fail(op, "gives one i32 class")
        self._predicate(op, 4)

    def op_mask_kv_range(self, op: Op, parent) -> None:
        if len(op.operands) < 4 or any(v.type != I32 for v in op.operands[:4]):
            raise _Fail(op, "operands are b, h, q0, nkv (i32 scalars) then the captured tensors")
        if [r.type for r in op.results] != [I32, I32]:
            raise _Fail(op, "gives the i32 first and past-last kv tile")
        self._predicate(op, 4)

    def op_tile_scatter_add(self, op: Op, parent) -> None:
        self.op_tile_atomic_add(op, parent)

    def op_tile_atomic_add(self, op: Op, parent) -> None:
        acc = op.operands[0]
        owner = acc.owner
        pf = owner.parent if isinstance(owner, Block) else None
        if pf is None or pf.name != "parallel_for" or acc.index < len(pf.attrs["bounds"]):
            raise _Fail(op, "adds into an accumulator argument of an enclosing parallel_for")

    def op_mask_q_range(self, op: Op, parent) -> None:
        if len(op.operands) < 4 or any(v.type != I32 for v in op.operands[:4]):
            raise _Fail(op, "operands are b, h, k0, nq (i32 scalars) then the captured tensors")
        if [r.type for r in op.results] != [I32, I32]:
            raise _Fail(op, "gives the i32 first and past-last q tile")
        self._predicate(op, 4)

    def op_mask_block_table(self, op: Op, parent) -> None:
        if len(op.results) != 1 or op.results[0].type.dtype != "i8" or op.results[0].type.rank != 4:
            raise _Fail(op, "gives one i8 table [B, H, q tiles, kv tiles]")
        self._predicate(op, 0)

    def op_parallel_for(self, op: Op, parent) -> None:
        bounds = op.attrs.get("bounds")
        for b in bounds or ():
            why = _dim_problem(b) if isinstance(b, Dim) else \
                "a bound cannot be negative" if isinstance(b, int) and b < 0 else None
            if why is not None:
                raise _Fail(op, f"bound {b}: {why}")
        blk = op.regions[0]
        n_acc = op.attrs.get("accumulators", 0)
        if not isinstance(n_acc, int) or not 0 <= n_acc <= len(op.results):
            raise _Fail(op, f"accumulators must be a count of its results, got {n_acc!r}")
        if not bounds or len(blk.args) != len(bounds) + n_acc or any(a.type != I32 for a in blk.args[:len(bounds)]):
            raise _Fail(op, "needs one i32 induction variable per bound (then one argument per accumulator)")
        stored = op.results[:len(op.results) - n_acc]
        for a, r in zip(blk.args[len(bounds):], op.results[len(stored):]):
            if a.type != r.type:
                raise _Fail(op, f"accumulator {a.name or '?'}: {a.type} must have its result's type {r.type}")
        if op.operands:
            raise _Fail(op, "takes no operands")
        term = blk.terminator  # a tile.yield: block() checked the region's terminator kind
        assert term is not None
        specs = term.attrs.get("slices", ())
        if len(specs) != len(stored):
            acc_note = f" (besides {n_acc} accumulators)" if n_acc else ""
            raise _Fail(term, f"yields {len(specs)} tiles for {len(stored)} results{acc_note}")
        pos = 0
        for spec, res in zip(specs, stored):
            k = sum(1 for s in spec if s != ":")
            tile, idx = term.operands[pos], term.operands[pos + 1: pos + 1 + k]
            pos += 1 + k
            try:
                (want,) = OPS["tile.load"].infer([res.type] + [v.type for v in idx], {"slice": spec})  # type: ignore[misc]
            except OpTypeError as e:
                raise _Fail(term, str(e)) from None
            if tile.type != want:
                raise _Fail(term, f"tile {tile.type} does not fit slice {want} of result {res.type}")
        if pos != len(term.operands):
            raise _Fail(term, "operands do not match its slices")
