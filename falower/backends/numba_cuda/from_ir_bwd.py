"""From the final fa2-bwd IR to an `FA2BackwardSpec`: the IR side of the backward kernels.

The schedule comes from the IR: tile sizes, GQA's group, how dQ is made (`dq=atomic`: added tile by
tile from the kv-outer nest; `dq=separate`: a q-outer nest), how tiles are classified (`mask.classify`
on index intervals, or `mask.block_table` for masks that read data). The variant comes from the IR's
values, translated op by op into scalar device functions:

    elem_<branch>(s, dp, lse, delta, b, h, hk, q, kv, interior, *captures, *dims)
        -> (p, ds, contribution_0, index_0_0, ..., contribution_1, ...)

one per branch of the kv-outer loop body (`full` and `partial` tiles when the mask skips tiles, `all`
otherwise). `s` is the raw q.k product and `dp` the raw dO.v product of one element (the two score-sized
matrix products' entries), `lse` and `delta` the row's saved statistics; `p` is what the IR multiplies into
dV (P recomputed from LSE) and `ds` what it multiplies into dK and dQ (the score function's derivative and
the scale included): both are the IR's own values, emitted from autodiff's ops, so no variant is written by
hand. `contribution_i` and its indices are what the IR's i-th `tile.scatter_add` adds into a captured
table's gradient. Bounds (`where ... {bounds}`) are emitted as in the IR; `interior` (the tile lies inside
q < M and kv < N) lets them fold away where they cannot be false.

`tile_class_fn` is the IR's `mask.classify` region on index intervals and `mask_fn` the `mask.block_table`
predicate; both keep the IR's bounds conjunct (kv < N), so a ragged kv tile is never full, as in the IR.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np

from ...ir.core import Block, Func, Op, Value, backward_slice, uses
from ...ir.dims import cdiv, dim
from ...ir.printer import print_func
from ...ir.types import is_float
from ...passes.canonicalize import const_value
from ...passes.lse_cotangent import lse_cotangent_arg
from ...passes.online_softmax import LOG2E, structure_key  # LOG2E: the pass's, the backward's exponent folds
from .from_ir import (BackendError, _interval_fn, _is_const_dim, _literal, _live_lines, _ref, _ScalarEmitter,
                      cap_ref, range_captures, range_name, ranges_mismatch, table_mismatch, tanh_by_ex2)
from .spec import Capture, FA2BackwardSpec, GradSpec



@dataclass
class _Branch:
    """One body of the kv-outer loop: the values the kernel needs from it."""

    name: str  # "all", "full" or "partial"
    s: Value  # tile.matmul q, k^T
    dp: Value  # tile.matmul dO, v^T
    p: Value  # what dV = P^T dO multiplies
    ds: Value  # what dK = dS^T Q and dQ = dS K multiply
    lse: Value  # tile.load of lse
    delta: Value  # tile.load of delta
    scatters: list[Op]  # tile.scatter_add into captured tables' gradients, in order


@dataclass
class BackwardLowered:
    """What the backward IR fixes about its kernels, before the sizes of a call are known."""

    func: Func
    block_q: int
    block_k: int
    group: int
    dq: str  # "atomic" or "separate"
    block_mask: str  # "none", "static", "list" (static classes, visited from block lists) or "table"
    captures: list[Value]  # func args that are captured tensors, in signature order
    branches: list[_Branch]
    classify: Optional[Op]  # mask.classify of the kv-outer nest (static skipping)
    table: Optional[Op]  # mask.block_table (data masks)
    # (name, capture, reduced, n_index, span, grid): span (a, b) where a gradient added per element has its last
    # index a q + b kv + c and the others the tile's (`_index_span`), () otherwise; grid where its last two are q and
    # kv themselves (`_is_iota`) and the others the tile's
    grads: list[tuple[str, int, bool, int, tuple, bool]] = field(default_factory=list)
    grad_index: list[Optional[Value]] = field(default_factory=list)  # the last index of each spanned gradient
    grid_reads: dict[str, list[Op]] = field(default_factory=dict)  # branch -> its `_grid_reads`
    deterministic: bool = False
    q_branches: list[_Branch] = field(default_factory=list)  # the q-outer dQ nest's bodies (dq=separate)
    q_classify: Optional[Op] = None
    q_nest: Optional[Op] = None
    ranges: list[tuple[int, int, int]] = field(default_factory=list)  # mask.ranges: (capture, axis, granule)
    range_values: list[Value] = field(default_factory=list)  # their results, in that order

    @property
    def kv_nest(self) -> Op:
        return next(op for op in self.func.body.ops if op.name == "parallel_for"
                    and any(r.name == "dk" for r in op.results))


def list_captures(dq: str) -> tuple[Capture, ...]:
    """The backward's block lists (block_mask == "list", block_data.list_layout): the kv-outer kernel's q tiles
    per kv tile, and with dq=separate the q-outer dQ kernel's kv tiles per q tile."""
    out = (Capture("q_count", "i32", 1, derived=("q_count",)), Capture("q_tiles", "i32", 1, derived=("q_tiles",)))
    if dq == "separate":
        out += (Capture("kv_count", "i32", 1, derived=("kv_count",)), Capture("kv_tiles", "i32", 1, derived=("kv_tiles",)))
    return out


def _role_args(func: Func) -> dict[str, Value]:
    """q, k, v, lse and the forward's output and its cotangent by role: recompute names those two after the graph's
    result (`o` and `do`, `out0` and `dout0`: the saved output is the argument before `lse`)."""
    names = [a.name for a in func.args]
    roles = {a.name: a for a in func.args if a.name in ("q", "k", "v", "lse")}
    if "lse" in names and names.index("lse") > 0:
        o = func.args[names.index("lse") - 1]
        roles["o"] = o
        do = next((a for a in func.args if a.name == f"d{o.name}"), None)
        if do is not None:
            roles["do"] = do
    return roles


def _check_delta(func: Func, nests: list[Op], roles: dict[str, Value], cot: Optional[Value]) -> None:
    """Delta's nest as the kernels compute it: rowsum(dO * O) of the row's tiles, less the LSE's cotangent where the
    function takes one (passes/lse_cotangent.py; the runtime subtracts it after Delta's kernel). Nothing else may
    reach Delta: the kernels read no other argument there."""
    delta = next((op for op in nests if [r.name for r in op.results] == ["delta"]), None)
    if delta is None:
        raise BackendError("numba-cuda backend: needs the fa2-bwd IR's Delta nest (a parallel_for yielding delta)")
    y = delta.regions[0].terminator.operands[0]  # type: ignore[union-attr]
    if cot is not None:
        sub = y.owner if isinstance(y.owner, Op) and y.owner.name == "sub" else None
        un = sub.operands[1].owner if sub is not None and isinstance(sub.operands[1].owner, Op) else None
        ld = un.operands[0].owner if un is not None and un.name == "unsqueeze" else None
        if not (isinstance(ld, Op) and ld.name == "tile.load" and ld.operands[0] is cot):
            raise BackendError(f"numba-cuda backend: the function takes %{cot.name}, the LSE's cotangent, but Delta "
                               "is not rowsum(dO * O) less it (passes/lse_cotangent.py's form)")
        y = sub.operands[0]  # type: ignore[union-attr]
    read = {op.operands[0] for op in backward_slice(delta.regions[0], [y]) if op.name == "tile.load"}
    if read != {roles["do"], roles["o"]}:
        names = ", ".join(sorted("%" + (a.name or "?") for a in read))
        raise BackendError(f"numba-cuda backend: Delta reads {names or 'nothing'}, where its kernel computes "
                           "rowsum(dO * O)")


def analyse_backward(func: Func) -> BackwardLowered:
    """Read the fa2-bwd IR (tile-bwd's output) into a BackwardLowered, or refuse with what is missing."""
    roles = _role_args(func)
    missing = [n for n in ("q", "k", "v", "o", "lse", "do") if n not in roles]
    if missing:
        raise BackendError(f"numba-cuda backend: the backward function needs arguments {', '.join(missing)} "
                           "(lower with pipeline fa2-bwd)")
    nests = [op for op in func.body.ops if op.name == "parallel_for"]
    kv_nest = next((op for op in nests if any(r.name == "dk" for r in op.results)), None)
    if len(nests) < 2 or kv_nest is None:
        raise BackendError("numba-cuda backend: needs the fa2-bwd IR (a Delta nest and a kv-outer nest making dk, "
                           "dv); lower with pipeline fa2-bwd first")
    body = kv_nest.regions[0]
    loops = [op for op in body.ops if op.name == "for"]
    if len(loops) != 1:
        raise BackendError("numba-cuda backend: the kv-outer nest must hold one loop over q tiles")
    loop = loops[0]
    k_load = next(op for op in body.ops if op.name == "tile.load" and op.operands[0] is roles["k"])
    block_k = int(k_load.results[0].type.shape[0].value)  # type: ignore[union-attr]
    group = 1
    for op in loop.regions[0].ops:
        if op.name == "mul" and op.operands[0] is body.args[1] and op.operands[1].owner.name == "const":
            group = int(op.operands[1].owner.attrs["value"])  # type: ignore[union-attr]
    bodies = _bodies(loop.regions[0])
    branches = [_branch(name, blk, roles) for name, blk in bodies]
    block_q = int(branches[0].lse.type.shape[0].value)  # type: ignore[union-attr]
    classify = next((op for op in loop.walk() if op.name == "mask.classify"), None)
    table = next((op for op in func.body.ops if op.name == "mask.block_table"), None)
    block_mask = "table" if table is not None else "static" if classify is not None else "none"
    dq = "atomic" if any(op.name == "tile.atomic_add" for op in kv_nest.walk()) else "separate"
    deterministic = any(op.name == "scatter_add" for op in kv_nest.walk())
    cot = lse_cotangent_arg(func)
    _check_delta(func, nests, roles, cot)
    captures = [a for a in func.args if a not in roles.values() and a is not cot]
    low = BackwardLowered(func, block_q, block_k, group, dq, block_mask, captures, branches, classify, table,
                          deterministic=deterministic)
    low.grads, low.grad_index = _grads(func, kv_nest, branches[0], captures)
    low.grid_reads = {br.name: _grid_reads(br, captures) for br in branches}
    for op in func.body.ops:  # range tables: derived captures the runtime makes from the data (block_data.py)
        if op.name == "mask.ranges":
            if op.operands[0] not in captures:
                raise BackendError("numba-cuda backend: mask.ranges of a value that is not a captured input")
            low.ranges.append((captures.index(op.operands[0]), int(op.attrs["axis"]), int(op.attrs["granule"])))
            low.range_values.append(op.results[0])
    if block_mask == "static" and any(g > 1 for _, _, g in low.ranges):
        # tables read along q or kv (document ids), as the forward: each kv tile's q tiles (and the dQ kernel's
        # kv tiles) listed once per data by the list kernel (block_data.py), visited with no scan
        # (extra={"bwd_block_list": False} keeps the scan, for comparing the two)
        low.block_mask = "list"
    if dq == "separate":
        q_nest = next((op for op in nests if any(r.name == "dq" for r in op.results)), None)
        q_loops = [op for op in q_nest.regions[0].ops if op.name == "for"] if q_nest is not None else []
        if len(q_loops) != 1:
            raise BackendError("numba-cuda backend: dq=separate needs a q-outer nest with one loop over kv tiles")
        low.q_branches = [_branch(name, blk, roles, want_p=False) for name, blk in _bodies(q_loops[0].regions[0])]
        low.q_classify = next((op for op in q_loops[0].walk() if op.name == "mask.classify"), None)
        low.q_nest = q_nest
    _check_mask_ops(low, roles)
    return low


def _check_mask_ops(low: BackwardLowered, roles: dict[str, Value]) -> None:
    """tile-bwd's mask ops as tile-bwd makes them, asked of the IR (which may be a hand-edited dump). The kernels
    classify tiles by the IR's own `mask.classify` regions (tile_class_fn, tile_class_q_fn) and `mask.block_table`
    predicate (mask_fn), but on their own tiles and indices, and they find a tile's range by scanning those classes,
    not from `mask.q_range` / `mask.kv_range`, which the interpreter takes as the loops' bounds. So: each nest's
    range op holds its classify's predicate (compared by structure, `structure_key`), attributes and captures, with
    b, h, the k tile's first row (q_range) or the q tile's (kv_range) as its classify's and the constant M or N, and
    its loop runs from the range's first tile to its past-last (else from 0 to every tile); each mask op's bq, bk
    are the kernels' tiles (a table's m, n the q and k lengths); classify's b, h, q0, k0 are the branch's q tile's
    (b, head, first row) and k tile's first row; a table's class is read at [b, h, qi, kj] of those tiles and cast
    to i32; a class is tested as tile-bwd tests it (== 0: the state passed through; == 2: the full branch).

    Not compared: the regions against the score's mask in the branches (the kernels run the IR's own partial-branch
    element code and the IR's own classify, so they agree with the IR whatever the predicate is)."""
    def fail(msg: str) -> BackendError:
        return BackendError(f"numba-cuda backend: {msg} (its kernels compute this from their own template)")

    def load_of(v: Value) -> Optional[Op]:
        op = v.owner
        while isinstance(op, Op) and op.name == "cast":
            op = op.operands[0].owner
        return op if isinstance(op, Op) and op.name == "tile.load" else None

    def key(op: Op) -> object:
        reg = op.regions[0]
        term = reg.terminator
        return structure_key(term.operands[0], reg, {}) if term is not None and len(term.operands) == 1 else None

    def tile_of(v: Value, index: Value, size: int) -> bool:  # v = index * size (q0 = qi * bq, k0 = kj * bk)
        op = v.owner
        return isinstance(op, Op) and op.name == "mul" and any(
            a is index and isinstance(c.owner, Op) and c.owner.name == "const" and c.owner.attrs.get("value") == size
            for a, c in (op.operands, op.operands[::-1]))

    M, N = roles["q"].type.shape[2], roles["k"].type.shape[2]
    tiles = (low.block_q, low.block_k)
    if low.table is not None:
        t = low.table
        if (t.attrs.get("bq"), t.attrs.get("bk")) != tiles:
            raise fail(f"mask.block_table's tiles bq = {t.attrs.get('bq')}, bk = {t.attrs.get('bk')} are not the "
                       f"kernels' {tiles[0]} x {tiles[1]}")
        why = table_mismatch(t, roles["q"], roles["k"], low.block_q, low.block_k)
        if why:
            raise fail(why)
    nests = [(low.kv_nest, low.branches, low.classify, "mask.q_range")]
    if low.q_nest is not None:
        nests.append((low.q_nest, low.q_branches, low.q_classify, "mask.kv_range"))
    for nest, branches, classify, range_name_ in nests:
        loop = next(op for op in nest.regions[0].ops if op.name == "for")
        lbody = loop.regions[0]
        q_load, k_load = load_of(branches[0].s.owner.operands[0]), load_of(branches[0].s.owner.operands[1])
        if q_load is None or k_load is None:
            raise fail("the backward's S is not Q K^T of a q tile and a k tile")
        b, h, q0, k0 = q_load.operands[1], q_load.operands[2], q_load.operands[3], k_load.operands[3]
        ranges = [op for op in nest.walk() if op.name in ("mask.q_range", "mask.kv_range")]
        classes = [op for op in nest.walk() if op.name == "mask.classify"]
        if len(classes) > 1 or len(ranges) > 1 or any(r.name != range_name_ for r in ranges):
            raise fail(f"a loop nest has {', '.join(op.name for op in classes + ranges)}: tile-bwd makes one "
                       f"{range_name_} and one mask.classify a nest")
        if classify is not None:
            if (classify.attrs.get("bq"), classify.attrs.get("bk")) != tiles:
                raise fail(f"mask.classify's tiles bq = {classify.attrs.get('bq')}, bk = {classify.attrs.get('bk')} "
                           f"are not the kernels' {tiles[0]} x {tiles[1]}")
            for what, got, want in zip(("b", "h", "q0", "k0"), classify.operands[:4], (b, h, q0, k0)):
                if got is not want:
                    raise fail(f"mask.classify's {what} is {_ref(got)}, not the tile's {_ref(want)} (the q tile's b, "
                               "head and first row, the k tile's first row)")
            why = ranges_mismatch(classify, 4)
            if why:
                raise fail(why)
        for rng in ranges:
            if classify is None:
                raise fail(f"{rng.name} bounds a loop whose tiles are not classified (no mask.classify): the kernels "
                           "visit every tile")
            if key(rng) is None or key(rng) != key(classify):
                raise fail(f"{rng.name}'s predicate is not its loop's mask.classify's (tile-bwd's one predicate)")
            if dict(rng.attrs) != dict(classify.attrs):
                raise fail(f"{rng.name}'s attributes are not its loop's mask.classify's")
            caps, want_caps = rng.operands[4:], classify.operands[4:]
            if len(caps) != len(want_caps) or any(x is not y for x, y in zip(caps, want_caps)):
                raise fail(f"{rng.name}'s captures are not its loop's mask.classify's")
            fixed = (classify.operands[0], classify.operands[1], k0 if rng.name == "mask.q_range" else q0)
            for what, got, want in zip(("b", "h", "k0" if rng.name == "mask.q_range" else "q0"), rng.operands, fixed):
                if got is not want:
                    raise fail(f"{rng.name}'s {what} is {_ref(got)}, not its loop's mask.classify's {_ref(want)}")
            length = M if rng.name == "mask.q_range" else N
            if not _is_const_dim(rng.operands[3], length):
                raise fail(f"{rng.name}'s fourth operand is {_ref(rng.operands[3])}, not the constant {length}")
            if loop.operands[0] is not rng.results[0] or loop.operands[1] is not rng.results[1]:
                raise fail(f"the loop does not run from {rng.name}'s first tile to its past-last (the kernels visit "
                           "the tiles its mask.classify does not find empty)")
        if not ranges:
            count = cdiv(dim(M), low.block_q) * low.group if range_name_ == "mask.q_range" and low.group > 1 else \
                cdiv(dim(M), low.block_q) if range_name_ == "mask.q_range" else cdiv(dim(N), low.block_k)
            if not (_is_const_dim(loop.operands[0], 0) and _is_const_dim(loop.operands[1], count)):
                raise fail(f"the loop does not run over every tile (0 to {count}) or over a {range_name_}'s")
        # the class: classify's, or the table's entry at the tile pair, and tile-bwd's two tests of it
        cls: Optional[Value] = classify.results[0] if classify is not None else None
        if low.table is not None:
            reads = [op for op in nest.walk() if low.table.results[0] in op.operands]
            if len(reads) != 1 or reads[0].name != "tile.load" or len(reads[0].operands) != 5:
                raise fail("mask.block_table is not read once a loop nest, at one tile pair")
            idx = reads[0].operands[1:]
            casts = [op for op in loop.walk() if reads[0].results[0] in op.operands]
            if idx[0] is not b or idx[1] is not h or not tile_of(q0, idx[2], low.block_q) \
                    or not tile_of(k0, idx[3], low.block_k) or len(casts) != 1 or casts[0].name != "cast" \
                    or casts[0].results[0].type.dtype != "i32":
                raise fail("a tile class is not read from mask.block_table at [b, h, qi, kj] of the q and k tiles and "
                           "cast to i32 (the kernels read the table they build so)")
            cls = casts[0].results[0]
        if cls is None:
            continue
        tests = {}
        for op in loop.walk():
            if cls in op.operands:
                c = op.operands[1].owner if op.name == "eq" and op.operands[0] is cls else None
                cv = c.attrs.get("value") if isinstance(c, Op) and c.name == "const" else None
                if cv not in (0, 2) or cv in tests:
                    raise fail(f"a tile class is read by {op.name}" + (f" with {cv!r}" if op.name == "eq" else "") +
                               ": tile-bwd's tests are == 0 (empty) and == 2 (full), once each")
                tests[cv] = op.results[0]
        ifs = [op for op in lbody.ops if op.name == "if"]
        inner = next((op for op in ifs[0].regions[1].ops if op.name == "if"), None) if ifs else None
        term = ifs[0].regions[0].terminator if ifs else None
        state = lbody.args[1:]
        through = term is not None and len(term.operands) == len(state) and all(
            y is a for y, a in zip(term.operands, state))
        if len(tests) != 2 or ifs[0].operands[0] is not tests[0] or not through or inner is None \
                or inner.operands[0] is not tests[2]:
            raise fail("the tile classes' branches are not tile-bwd's (if == 0: the state passed through; else "
                       "if == 2: the full tiles' body)")


def _bodies(loop_body: Block) -> list[tuple[str, Block]]:
    """The kv-outer loop's bodies: one (`all`), or the full and partial branches under the tile class."""
    ifs = [op for op in loop_body.ops if op.name == "if"]
    if not ifs:
        return [("all", loop_body)]
    outer = ifs[0]  # if %empty_tile {yield unchanged} else {if %full_tile {full} else {partial}}
    inner = next((op for op in outer.regions[1].ops if op.name == "if"), None)
    if inner is None:
        return [("partial", outer.regions[1])]
    return [("full", inner.regions[0]), ("partial", inner.regions[1])]


def _branch(name: str, blk: Block, roles: dict[str, Value], want_p: bool = True) -> _Branch:
    def load_of(arr: Value) -> Optional[Value]:
        for op in _blocks_up(blk):
            if op.name == "tile.load" and op.operands[0] is arr:
                return op.results[0]
        return None

    def root_load(v: Value) -> Optional[Value]:
        op = v.owner
        while isinstance(op, Op) and op.name == "cast":
            v = op.operands[0]
            op = v.owner
        return op.operands[0] if isinstance(op, Op) and op.name == "tile.load" else None

    mms = [op for op in blk.ops if op.name == "tile.matmul"]
    s = dp = p = ds = None
    for mm in mms:
        a, b = (root_load(x) for x in mm.operands)
        ta, tb = bool(mm.attrs.get("transpose_a")), bool(mm.attrs.get("transpose_b"))
        if tb and a is roles["q"] and b is roles["k"]:
            s = mm.results[0]
        elif tb and a is roles["do"] and b is roles["v"]:
            dp = mm.results[0]
        elif ta and b is roles["do"]:
            p = mm.operands[0]
        elif ta and b is roles["q"]:
            ds = mm.operands[0]
        elif not ta and not tb and b is roles["k"] and not want_p:
            ds = mm.operands[0]
    lse = load_of(roles["lse"])
    delta = next((op.results[0] for op in _blocks_up(blk) if op.name == "tile.load"
                  and op.operands[0].name == "delta"), None)
    if want_p and None in (s, dp, p, ds, lse, delta):
        raise BackendError(f"numba-cuda backend: the {name} branch of the backward loop does not have FA2's five "
                           "products (S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ += dS K)")
    if not want_p and None in (s, dp, ds, lse, delta):
        raise BackendError(f"numba-cuda backend: the {name} branch of the dQ loop does not have S = Q K^T, "
                           "dP = dO V^T and dQ += dS K")
    scatters = [op for op in blk.ops if op.name in ("tile.scatter_add", "scatter_add")]
    return _Branch(name, s, dp, p if want_p else ds, ds, lse, delta, scatters)  # type: ignore[arg-type]


def _blocks_up(blk: Block):
    """The ops of `blk` and of the blocks around it (loads of the q tile may sit outside the branch)."""
    while blk is not None:
        yield from blk.ops
        parent = blk.parent
        blk = parent.parent if parent is not None else None


def _index_span(v: Value) -> Optional[tuple[int, int]]:
    """(a, b) where the tile-sized integer index v is a q + b kv + c: q and kv the tile's iotas, c the same for
    every element of the tile (rank 0: a head's, a size); None where it is not (a gather of q, a product of q
    and kv, ...). A relative bias's rel[h, q - kv + N - 1] has (1, -1)."""
    op = v.owner
    if v.type.rank == 0 or not isinstance(op, Op):
        return (0, 0) if v.type.rank == 0 else None
    if op.name == "tile.iota":
        return (1, 0) if op.attrs["axis"] == 0 else (0, 1)
    if op.name == "const":
        return (0, 0)
    if op.name in ("unsqueeze", "broadcast_to") or _widening_int_cast(op):
        return _index_span(op.operands[0])
    if op.name in ("add", "sub"):
        x, y = (_index_span(o) for o in op.operands)
        if x is None or y is None:
            return None
        sign = 1 if op.name == "add" else -1
        return (x[0] + sign * y[0], x[1] + sign * y[1])
    if op.name == "neg":
        x = _index_span(op.operands[0])
        return None if x is None else (-x[0], -x[1])
    if op.name == "mul":
        x, y = (_index_span(o) for o in op.operands)
        for u, w, o in ((x, y, op.operands[1]), (y, x, op.operands[0])):
            if u is not None and w == (0, 0) and isinstance(o.owner, Op) and o.owner.name == "const" \
                    and isinstance(o.owner.attrs["value"], int):
                return (u[0] * o.owner.attrs["value"], u[1] * o.owner.attrs["value"])
        return None
    return None


def _is_iota(v: Value, axis: int) -> bool:
    """Whether the integer index v is the tile's q (axis 0) or kv (axis 1) index itself, unsqueezed, broadcast or
    cast between integer types on the way."""
    op = v.owner
    while isinstance(op, Op) and (op.name in ("unsqueeze", "broadcast_to") or _widening_int_cast(op)):
        v = op.operands[0]
        op = v.owner
    return isinstance(op, Op) and op.name == "tile.iota" and op.attrs["axis"] == axis


def _grid_index(idx: Sequence[Value]) -> bool:
    """A table's indices [the tile's..., q, kv]: the last two the element's q and kv themselves (`_is_iota`), the
    others the same for the whole tile (a bias table's [h, q, kv]); GradSpec.grid and `_grid_reads` both ask."""
    return len(idx) >= 2 and _is_iota(idx[-2], 0) and _is_iota(idx[-1], 1) and all(i.type.rank == 0 for i in idx[:-2])


def _widening_int_cast(op: Op) -> bool:
    """A cast between integer types that keeps every value: not to i8, which wraps q = 128 to -128."""
    to, src = op.results[0].type.dtype, op.operands[0].type.dtype if op.operands else ""
    return op.name == "cast" and not is_float(to) and not is_float(src) and to != "bool" \
        and (to != "i8" or src == "i8")


def _grid_reads(br: _Branch, captures: list[Value]) -> list[Op]:
    """The gathers of a captured f32 table at [the tile's indices..., q, kv] (`_is_iota`; a bias table) that the
    branch's element code reads, in a fixed order: the wgmma backward loads them 16 bytes a lane and hands the
    values to elemg_<branch> (emit_fa3_bwd.read_v4), where the element code gathered each alone."""
    out: list[Op] = []
    seen: set[int] = set()
    stack = [br.p, br.ds] + [sc.operands[1] for sc in br.scatters]
    stop = {id(br.s), id(br.dp), id(br.lse), id(br.delta)}
    while stack:
        v = stack.pop()
        op = v.owner
        if id(v) in seen or id(v) in stop or not isinstance(op, Op):
            continue
        seen.add(id(v))
        tab, idx = (op.operands[0], op.operands[1:]) if op.operands else (None, [])
        if op.name == "gather" and tab in captures and tab.type.dtype == "f32" and len(idx) == tab.type.rank \
                and _grid_index(idx):
            if op not in out:
                out.append(op)
            continue
        stack.extend(reversed(op.operands))
    return out


def ordered_scatters(func: Func, nest: Op, branch: _Branch) -> list[tuple[Op, str]]:
    """The branch's scatters into captured tables' gradients with the gradient each feeds, in the order the backward
    function returns those gradients (the kernels' gradients, their elem_<branch> outputs and the runtime's results
    all follow it; the IR's scatter order is the score's, which may differ: s + b1[...] + b2[...] scatters db2 first).
    A scatter's gradient: tile.scatter_add's accumulator is the nest's (its result's name); scatter_add's chain
    (deterministic) ends at the loop's table, the tables in the order of the function's gradients."""
    accs = nest.regions[0].args[len(nest.attrs["bounds"]):]
    grad_results = [n for n, v in zip(func.result_names[3:], func.results[3:])  # (a constant one has no scatter)
                    if const_value(v) is None]
    roots: list[Value] = []
    named = []
    for sc in branch.scatters:
        acc = sc.operands[0]
        if sc.name == "scatter_add":  # deterministic: follow the chain of scatters to the loop's table
            while isinstance(acc.owner, Op) and acc.owner.name == "scatter_add":
                acc = acc.owner.operands[0]
            if acc not in roots:
                roots.append(acc)
            name = _deterministic_result(func, nest, acc)
            if name is None and roots.index(acc) >= len(grad_results):
                raise BackendError("numba-cuda backend: the deterministic backward's tables do not map one to one onto "
                                   "the captured gradients (a table read at more than one place); the reference "
                                   "backend runs it")
            name = name or grad_results[roots.index(acc)]
        else:
            name = _result_name(func, nest.results[len(nest.results) - len(accs) + accs.index(acc)])
        named.append((sc, name))
    order = list(func.result_names)
    return sorted(named, key=lambda x: order.index(x[1]) if x[1] in order else len(order))


def _grads(func: Func, nest: Op, branch: _Branch, captures: list[Value]
           ) -> tuple[list[tuple[str, int, bool, int, tuple, bool]], list[Optional[Value]]]:
    """(gradient name, capture index, reduced over the tile, number of indices, span, grid) per scatter into a captured
    table's gradient: tile.scatter_add into an accumulator of the nest (atomic), or scatter_add into the loop's
    copy of the table (deterministic: tables in the order of the gradients the function returns); and the last
    index of each spanned one. Span: `_index_span` of the last index where the others are the tile's, so a thread's
    elements at the same offset from its first element share one entry (emit_fa3_bwd.grouped_grads sums them in
    registers). Grid: the last two indices are the element's q and kv and the others the tile's (a bias table), so
    kv-consecutive elements add into consecutive words (emit_fa3_bwd.v4_grads)."""
    out = []
    last: list[Optional[Value]] = []
    for sc, name in ordered_scatters(func, nest, branch):
        table_name = name[1:] if name.startswith("d") else name
        cap = next((i for i, c in enumerate(captures) if c.name == table_name), None)
        if cap is None:
            raise BackendError(f"numba-cuda backend: gradient {name} is not a captured table's")
        value, idx = sc.operands[1], sc.operands[2:]
        reduced = value.type.rank > 0 and all(int(n.value) == 1 for n in value.type.shape)  # type: ignore
        reduced = reduced and all(i.type.rank == 0 for i in idx)
        spans = [_index_span(i) for i in idx]
        span: tuple = ()
        if not reduced and idx and spans[-1] not in (None, (0, 0)) and all(x == (0, 0) for x in spans[:-1]):
            span = spans[-1]  # type: ignore[assignment]
        grid = not reduced and _grid_index(idx)
        out.append((name, cap, reduced, len(idx), span, grid))
        last.append(idx[-1] if span else None)
    return out, last


def _deterministic_result(func: Func, nest: Op, table: Value) -> Optional[str]:
    """The result a deterministic backward's loop table becomes: the q loop's carried table (a block argument of
    the `for` in the nest), that loop's result, the nest's result it is yielded into (its per-kv-tile parts), then
    the function's sums, squeezes and casts of those parts to a returned value. None where the IR is not of that
    form. (The scatters' order is the score's: s + b1[...] + b2[...] adds into db2's table first, and taking the
    tables in that order swapped the two gradients, or read one table's indices in the other's, a review found.)"""
    blk = table.owner
    loop = blk.parent if isinstance(blk, Block) else None
    if not isinstance(loop, Op) or loop.name != "for" or loop.parent is not nest.regions[0]:
        return None
    v = loop.results[blk.args.index(table) - 1]
    term = nest.regions[0].terminator
    if term is None or term.name != "tile.yield":
        return None
    pos = 0
    for j, spec in enumerate(term.attrs.get("slices", ())):
        if term.operands[pos] is v:
            break
        pos += 1 + sum(1 for x in spec if x != ":")
    else:
        return None
    v = nest.results[j]
    body = list(func.body.ops)
    while v not in func.results:
        users = [op for op in body if any(o is v for o in op.operands)]
        if len(users) != 1 or users[0].name not in ("reduce_sum", "squeeze", "cast") or \
                len(users[0].results) != 1:
            return None
        v = users[0].results[0]
    return next(n for n, x in zip(func.result_names, func.results) if x is v)


def _result_name(func: Func, v: Value) -> str:
    """The result `v` becomes, directly or squeezed (a captured scalar's gradient is a one-slot table)."""
    for name, x in zip(func.result_names, func.results):
        while x is not v and isinstance(x.owner, Op) and x.owner.name == "squeeze":
            x = x.owner.operands[0]
        if x is v:
            return name
    for name, x in zip(func.result_names, func.results):  # why not: a cast to the table's dtype, or a sum
        y, cast = x, False
        while y is not v and isinstance(y.owner, Op) and y.owner.name in ("squeeze", "cast"):
            cast = cast or y.owner.name == "cast"
            y = y.owner.operands[0]
        if y is v and cast:
            raise BackendError(f"numba-cuda backend: gradient {name} is of a {x.type.dtype} captured table: the "
                               "kernels add captured tables' gradients in f32 (capture the table as f32); the "
                               "reference backend runs it")
    raise BackendError("numba-cuda backend: a captured table's gradient is not one scatter's accumulator but a sum of "
                       "several (the table read at more than one place or index form, e.g. bias[h, q, kv] and "
                       "bias[h, kv, q], or cap[h] twice in cap[h] * tanh(s / cap[h])): the kernels add one scatter a "
                       "table; the reference backend runs it")


# ------------------------------------------------------------------------------------ scalar code
class _ElementEmitter(_ScalarEmitter):
    """Scalar code for one element of the score-sized tile values, across the nest's blocks."""

    def __init__(self, env: Mapping[str, int], names: dict[Value, str], exp_fold: bool = True):
        super().__init__(env, {})
        self.names.update(names)
        self.exp_fold = exp_fold  # the exponential's log2(e) pushed into its argument's constants (`log2e`)
        self.log2e_names: dict[Value, str] = {}

    def value(self, v: Value) -> str:
        if v in self.names:
            return self.names[v]
        op = v.owner
        if not isinstance(op, Op):
            raise BackendError(f"numba-cuda backend: no scalar for block argument %{v.name} in the backward")
        if op.name == "unsqueeze":
            nm = self.value(op.operands[0])
            self.names[v] = nm
            return nm
        if op.name == "where" and op.attrs.get("bounds"):
            c, x, y = (self.value(o) for o in op.operands)
            self.names[v] = nm = self.line(f"{x} if interior else ({x} if {c} else {y})")
            return nm
        for o in op.operands:
            self.value(o)
        if op.name == "reduce_sum":
            raise BackendError("numba-cuda backend: a captured gradient adds sums of several terms (a captured scalar "
                               "or table read at more than one place, e.g. t twice in t * tanh(s / t)): the kernels "
                               "add one sum a table; the reference backend runs it")
        if op.name in ("tile.load", "tile.matmul", "reduce_sum", "reduce_max") or op.regions:
            raise BackendError(f"numba-cuda backend: the backward's elementwise code reads {op.name} "
                               f"(%{v.name}), which has no per-element form")
        folded = self.fold(op)
        if folded is not None:
            self.consts[v] = folded
            self.names[v] = _lit(folded, v)
            return self.names[v]
        expr = self.scaled_expr(op) or self.expr(op)
        if op.name == "exp":  # the fast exponential, as the forward's softmax: 2^(x log2 e) by ex2.approx
            x = op.operands[0]
            arg = self.log2e(x) if self.exp_fold and x.type.dtype == "f32" else f"{self.names[x]} * LOG2E"
            expr = f"ex2({arg})"
        self.names[v] = nm = self.line(expr)
        return nm

    def log2e(self, v: Value, t: Optional[str] = None) -> str:
        """A name for v log2(e) (+ t, a name), the factor pushed down through sums, differences and selects into
        v's constants and constant factors, and the addend into the products as FMAs: exp(s c - lse) becomes
        ex2(fma(s, c log2 e, -lse log2 e)), one FFMA an element (the per-column -lse log2 e shared by a thread's
        two rows), where (s c - lse) log2 e was a multiply, a subtract and a multiply (FlashAttention's form, and
        the forward's: `emit_fa2.folded_scale`); a select takes the sum into both its arms, so on an interior
        tile, where a bounds select folds away, nothing stands between the product and the FMA. The unscaled
        values stay emitted; `_live_lines` drops those nothing else reads."""
        key = (v, t)
        if key in self.log2e_names:
            return self.log2e_names[key]
        op = v.owner
        plus = "" if t is None else f" + {t}"
        if v in self.consts:
            out = f"({_literal(float(np.float32(float(self.consts[v]) * LOG2E)), 'f32', {})}{plus})"
        elif v in self.factors:
            base, f = self.factors[v]
            fl = f"np.float32({float(np.float32(f * LOG2E))!r})"
            out = f"({base} * {fl})" if t is None else f"cuda.fma({base}, {fl}, {t})"
        elif isinstance(op, Op) and op.name == "add" and all(o.type.dtype == "f32" for o in op.operands):
            out = self.log2e(op.operands[0], self.log2e(op.operands[1], t))
        elif isinstance(op, Op) and op.name == "sub" and all(o.type.dtype == "f32" for o in op.operands):
            out = self.log2e(op.operands[0], self.line(f"-{self.log2e(op.operands[1])}" if t is None else
                                                       f"{t} - {self.log2e(op.operands[1])}"))
        elif isinstance(op, Op) and op.name == "where" and op.operands[1].type.dtype == "f32":
            c = self.names[op.operands[0]]
            x, y = self.log2e(op.operands[1], t), self.log2e(op.operands[2], t)
            out = f"({x} if interior else ({x} if {c} else {y}))" if op.attrs.get("bounds") else \
                f"({x} if {c} else {y})"
        else:
            out = f"({self.names[v]} * LOG2E)" if t is None else f"cuda.fma({self.names[v]}, LOG2E, {t})"
        self.log2e_names[key] = nm = out if re.fullmatch(r"v\d+", out) else self.line(out)
        return nm


def _lit(folded, v: Value) -> str:
    return _literal(folded.item(), v.type.dtype, {})


def _strip_reductions(v: Value) -> Value:
    op = v.owner
    while isinstance(op, Op) and op.name == "reduce_sum":
        v = op.operands[0]
        op = v.owner
    return v


def _distance_sign(v: Value, names: Mapping[Value, str]) -> int:
    """+1 where v is float(kv - q) (an i32 difference of the element's indices cast to f32), -1 for float(q - kv),
    else 0."""
    op = v.owner
    if not (isinstance(op, Op) and op.name == "cast" and v.type.dtype == "f32"):
        return 0
    d = op.operands[0].owner
    if not (isinstance(d, Op) and d.name == "sub" and op.operands[0].type.dtype == "i32"):
        return 0
    pair = tuple(names.get(o) for o in d.operands)
    return 1 if pair == ("kv", "q") else -1 if pair == ("q", "kv") else 0


def _late_distances(e: "_ElementEmitter") -> None:
    """grad_dist: the distances float(kv - q) the score already read, given new names for the gradients'
    contributions, float(kv) - float(q) (exact while |kv|, |q| < 2^24, as the i32 difference's conversion is):
    the two forms are not one expression, so LLVM does not keep the score's 32 distances a thread live until the
    contributions (ALiBi's slope gradient dS (kv - q)), which ptxas spilled (benchmarks/NOTES.md, "The loader
    warps' spills"). Opt-in: ALiBi's D = 128 backward call measured 1.071 of the default's time with it (H200, 9
    rounds; NOTES "Knob tests by name"): two int -> float conversions an element cost more than the spills."""
    for v, sign in [(v, _distance_sign(v, e.names)) for v in e.names]:
        if sign:
            a, b = ("kv", "q") if sign > 0 else ("q", "kv")
            e.names[v] = e.line(f"np.float32(np.int32({a})) - np.float32(np.int32({b}))")


def _row_lse(br: _Branch, outs: Sequence[Value]) -> Optional[Value]:
    """The one value of the branch's element code that the LSE alone makes (with constants), where the rest reads
    the LSE only through it: FlashAttention's guarded row statistic, `0 if lse == -inf else lse`. None where there
    are none or several (the element code then reads the LSE as it is)."""
    only: dict[Value, Optional[bool]] = {}  # True: made of the LSE and constants; None: constants alone

    def of(v: Value) -> Optional[bool]:
        if v in only:
            return only[v]
        op = v.owner
        if v is br.lse:
            r: Optional[bool] = True
        elif not isinstance(op, Op) or op.name in ("tile.load", "tile.matmul", "tile.iota") or op.regions:
            r = False
        elif op.name == "const":
            r = None
        else:
            rs = [of(o) for o in op.operands]
            r = False if False in rs or not rs else (True if True in rs else None)
        only[v] = r
        return r

    seen: set[Value] = set()
    top: list[Value] = []
    stack = list(outs)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        op = v.owner
        if of(v):
            if v not in top:
                top.append(v)
            continue
        if isinstance(op, Op) and v not in (br.s, br.dp, br.delta):
            stack.extend(op.operands)
    return top[0] if len(top) == 1 and top[0] is not br.lse and top[0].type.dtype == "f32" else None


def _lse_row_fn(br: _Branch, w: Value, env: Mapping[str, int]) -> Optional[list[str]]:
    """lse_row_fn(lse): the branch's guarded row statistic w times log2(e) (`_row_lse`, `_ElementEmitter.log2e`), the
    part of the exponential's argument that depends on the q row alone, which the kernels compute once a row where
    they read the LSE (the loader warps' stores into shared memory) instead of in every element: an FMUL, FSETP
    and FSEL a column and tile (48 + 16 of the D = 64 backward's ~233 instructions a thread and tile; benchmarks/
    NOTES.md, seventy-first session). None where it would read a run-time size."""
    e = _ElementEmitter(env, {br.lse: "lse"})
    e.value(w)  # the select's condition named first, as the element code has it
    r = e.log2e(w)
    lines = ["def lse_row_fn(lse):", *_live_lines(e.lines, r), f"    return {r}"]
    return None if any(re.search(r"\bdim_\w+", ln) for ln in lines[1:]) else lines  # a run-time size: no argument


_Scaled = tuple[Value, list[tuple[Value, Value, bool]], float]


def _scaled_difference(low: BackwardLowered, br: _Branch, env: Mapping[str, int], use: Mapping[Value, list[Op]]
                       ) -> Optional[_Scaled]:
    """(y, chain, c): the branch's dS reached from y = dP - Delta through a chain of products, each read by the
    next alone (Delta by such y alone, in every branch: `_elem_fns` checks), whose constant factors multiply to c
    (the softmax scale; a softcap's cap and its inverse): dS = P (dP - Delta) c, or P (dP - Delta) cap (1 - t^2)
    / cap c, or a select of it with 0. Then (dP - Delta) c is one fma(dP, c, -Delta c) whose -Delta c is a value of
    the q row alone (delta_row_fn), and the constant products go: one FFMA an element where there were an FADD
    and an FMUL a constant. `chain`, from y up to dS: (value, the operand the chain continues in, whether the
    value is emitted as it is; a constant product is not: it takes that operand's name). None where dS is not of that
    form (a captured table's gradient reading dP - Delta or a product on the way, no difference, two of them).
    `use`: ir.core.uses of the function."""
    e = _ElementEmitter(env, _elem_names(low, br, br in low.q_branches))
    e.value(br.ds)  # folds the constants

    def only_use(v: Value, op: Op) -> bool:
        return [u for u in use.get(v, []) if u is not op] == [] and op in use.get(v, [])

    def is_difference(v: Value) -> bool:
        sub = v.owner
        return isinstance(sub, Op) and sub.name == "sub" and sub.operands[0] is br.dp and sub.operands[1] is br.delta

    seen: dict[Value, bool] = {}

    def reaches(v: Value) -> bool:  # whether v is made from a difference dP - Delta
        if v not in seen:
            op = v.owner
            seen[v] = False
            seen[v] = is_difference(v) or (isinstance(op, Op) and not op.regions and any(map(reaches, op.operands)))
        return seen[v]

    chain: list[tuple[Value, Value, bool]] = []
    c = 1.0
    v = br.ds
    while not is_difference(v):
        op = v.owner
        if not (isinstance(op, Op) and v.type.dtype == "f32") or v in e.consts:
            return None
        ks = [o in e.consts for o in op.operands]
        if op.name in ("mul", "div") and ks[1] != ks[0]:  # a constant product: its factor into c
            k = float(e.consts[op.operands[1 if ks[1] else 0]])
            if (op.name == "div" and not ks[1]) or not np.isfinite(k) or k == 0:
                return None
            c = c * k if op.name == "mul" else c / k
            nxt, keep = op.operands[0 if ks[1] else 1], False
        elif op.name == "mul" and not any(ks):  # P, a derivative: kept, the chain through the operand with y
            on = [o for o in op.operands if reaches(o)]
            if len(on) != 1:
                return None
            nxt, keep = on[0], True
        elif op.name == "where" and op.operands[2] in e.consts and float(e.consts[op.operands[2]]) == 0.0 \
                and not reaches(op.operands[0]):  # a mask's select with 0 (0 c = 0)
            nxt, keep = op.operands[1], True
        else:
            return None
        if not only_use(nxt, op):
            return None
        chain.append((v, nxt, keep))
        v = nxt
    c32 = float(np.float32(c))
    if v is br.ds or not np.isfinite(c32) or c32 == 0:
        return None
    return v, chain[::-1], c32


def _delta_row_fn(c: float) -> list[str]:
    """delta_row_fn(delta): -Delta c, the dS scale's row part (`_scaled_difference`), once a row where a kernel
    reads Delta."""
    return ["def delta_row_fn(delta):", f"    return -(delta * np.float32({c!r}))"]


def _elem_fn(low: BackwardLowered, br: _Branch, env: Mapping[str, int], sig: str, dq_nest: bool = False,
             tanh_ex2: bool = False, exp_fold: bool = True, grad_dist: bool = False, given: bool = False,
             row_lse: Optional[Value] = None, scaled: Optional[_Scaled] = None) -> Optional[list[str]]:
    """elem_<branch> of the kv-outer nest: (p, ds, contributions...); elemq_<branch> of the q-outer dQ nest:
    (ds,). `tanh_ex2`: from_ir.tanh_by_ex2, as the forward's P; `exp_fold`: _ElementEmitter.log2e; `grad_dist`:
    `_late_distances` before the contributions; `given`: elemg_<branch>, the branch's grid reads (`_grid_reads`)
    taken as parameters tv0, tv1, ... instead of gathered; `row_lse` (the branch's `_row_lse`): its `lse`
    parameter is lse_row_fn's value, not the LSE; `scaled` (the branch's `_scaled_difference`): its `delta`,
    delta_row_fn's; None where the code would still read the LSE or Delta itself."""
    names = _elem_names(low, br, dq_nest)
    reads = low.grid_reads.get(br.name, []) if given else []
    names.update({op.results[0]: f"tv{j}" for j, op in enumerate(reads)})
    if row_lse is not None:
        names[br.lse] = "lse_unrowed"  # must not be read: checked below
    if scaled is not None:
        names[br.delta] = "delta_unrowed"
    e = _ElementEmitter(env, names, exp_fold)
    e.tanh_ex2 = tanh_ex2
    if row_lse is not None:
        e.log2e_names[(row_lse, None)] = "lse"
    if scaled is not None:
        y, chain, c = scaled
        e.names[y] = e.line(f"cuda.fma(dp, np.float32({c!r}), delta)")  # (dP - Delta) c
        for v, nxt, keep in chain:  # up to dS: the products kept, the constant ones named as their operand
            e.names[v] = e.value(v) if keep else e.names[nxt]
    outs = [e.value(br.ds)] if dq_nest else [e.value(br.p), e.value(br.ds)]
    if grad_dist and not dq_nest:
        _late_distances(e)
    for sc, _ in [] if dq_nest else ordered_scatters(low.func, low.kv_nest, br):
        outs.append(e.value(_strip_reductions(sc.operands[1])))
        outs += [e.value(i) for i in sc.operands[2:]]
    res = ", ".join(outs)
    fn = f"elemq_{br.name}" if dq_nest else f"elemg_{br.name}" if given else f"elem_{br.name}"
    tvs = "".join(f", tv{j}" for j in range(len(reads)))
    lines = [f"def {fn}(s, dp, lse, delta, b, h, hk, q, kv, interior{tvs}{sig}):"]
    lines += _live_lines(e.lines, res)
    if any(re.search(r"\b(lse|delta)_unrowed\b", ln) for ln in lines + [res]):  # the return too: an alias
        return None
    lines.append(f"    return {res}" if len(outs) > 1 else f"    return {res},")
    return lines


def _grad_index_fn(low: BackwardLowered, br: _Branch, env: Mapping[str, int], sig: str, i: int, v: Value
                   ) -> list[str]:
    """gidx<i>_fn(b, h, hk, q, kv, ...): the last index of spanned gradient i (GradSpec.span) at one element, which
    the wgmma backward evaluates at a thread's first q column and kv row: the base its groups' entries are offsets
    from."""
    e = _ElementEmitter(env, _elem_names(low, br, False))
    r = e.value(v)
    return [f"def gidx{i}_fn(b, h, hk, q, kv{sig}):", *_live_lines(e.lines, r), f"    return {r}"]


def _grid_lead_fn(low: BackwardLowered, br: _Branch, env: Mapping[str, int], sig: str, j: int, op: Op) -> list[str]:
    """gtab<j>_<branch>_fn(b, h, hk, q, kv, ...): grid read j's leading indices (the tile's: a head's), clamped as
    its gather clamps, as a tuple."""
    e = _ElementEmitter(env, _elem_names(low, br, False))
    tab = op.operands[0]
    cap = cap_ref(tab, f"cap_{tab.name}")
    lead = [f"min(max(np.int32({e.value(i)}), np.int32(0)), np.int32({cap}.shape[{d}] - 1))"
            for d, i in enumerate(op.operands[1:-2])]
    res = ", ".join(lead) + ("," if len(lead) == 1 else "")
    return [f"def gtab{j}_{br.name}_fn(b, h, hk, q, kv{sig}):", *_live_lines(e.lines, res), f"    return ({res})"]


def _elem_names(low: BackwardLowered, br: _Branch, dq_nest: bool) -> dict[Value, str]:
    """The scalar names of a branch's per-element inputs: s, dp, lse, delta, b, the heads, q, kv, the captures."""
    names: dict[Value, str] = {br.s: "s", br.dp: "dp", br.lse: "lse", br.delta: "delta"}
    nest = low.q_nest if dq_nest else low.kv_nest
    nest_args = nest.regions[0].args  # type: ignore[union-attr]
    names[nest_args[0]] = "b"
    names[nest_args[1]] = "h" if dq_nest else "hk"
    for c in low.captures:
        names[c] = cap_ref(c, f"cap_{c.name}")
    for op in _blocks_up(br.s.owner.parent):  # type: ignore[union-attr]
        if op.name == "tile.iota":
            names[op.results[0]] = "q" if op.attrs["axis"] == 0 else "kv"
        if op.name == "tile.load" and op.operands[0].name == "q":
            names.setdefault(op.operands[2], "h")  # the query head (hk * G + i under GQA)
        if op.name == "tile.load" and op.operands[0].name == "k":
            names.setdefault(op.operands[2], "hk")  # the kv head (h // G under GQA)
    return names


def _pred_source(region: Block, operands: list[Value], env: Mapping[str, int], name: str, sig: str,
                 cap_names: dict[Value, str]) -> list[str]:
    """mask_fn from a predicate region over (b, h, q, kv, captured tables...)."""
    e = _ScalarEmitter(env, {})
    for a, nm in zip(region.args, ["b", "h", "q", "kv"]):
        e.names[a] = nm
    for a, v in zip(region.args[4:], operands[4:]):
        e.names[a] = cap_ref(v, cap_names[v])
    res = region.terminator.operands[0]  # type: ignore[union-attr]
    e.emit(region, [res])
    return [f"def {name}(b, h, q, kv{sig}):"] + _live_lines(e.lines, e.name(res)) + [f"    return {e.name(res)}"]


def _elem_fns(low: BackwardLowered, env: Mapping[str, int], sig: str, tanh_ex2: bool, exp_fold: bool,
              grad_dist: bool, lse_per_row: bool, delta_per_row: bool) -> list[str]:
    """Every branch's element functions (and grid reads' lead functions); with `lse_per_row`, lse_row_fn first and
    the element functions reading its value, where every branch of both nests has the same one (else none does:
    the kernels pass what lse_row_fn returns to all of them); with `delta_per_row` the same for delta_row_fn."""
    every = (*low.branches, *low.q_branches)
    use = uses(low.func)
    # each branch's row values by id (a _Branch is a dataclass: no hash)
    ws = {id(br): _row_lse(br, [br.p, br.ds]) for br in every} if lse_per_row and exp_fold else {}
    rows = [_lse_row_fn(br, ws[id(br)], env) if ws[id(br)] is not None else None for br in every] if ws else [None]
    hoist = rows[0] is not None and all(r == rows[0] for r in rows)
    scales = {id(br): _scaled_difference(low, br, env, use) for br in every} if delta_per_row else {}
    first = next(iter(scales.values()), None)
    hoist_d = first is not None and all(f is not None and f[2] == first[2] for f in scales.values())
    if hoist_d:  # Delta read by these differences alone (a nest may load it once for several branches)
        subs = {f[0].owner for f in scales.values() if f is not None}
        hoist_d = all(u in subs for br in every for u in use.get(br.delta, []))
    out: list[str] = (rows[0] or []) + [""] if hoist else []
    out += _delta_row_fn(first[2]) + [""] if hoist_d and first is not None else []

    def kw(br: _Branch) -> dict:
        return dict(tanh_ex2=tanh_ex2, exp_fold=exp_fold, row_lse=ws[id(br)] if hoist else None,
                    scaled=scales[id(br)] if hoist_d else None)

    for br in low.branches:
        fns = [_elem_fn(low, br, env, sig, grad_dist=grad_dist, **kw(br))]
        if low.grid_reads.get(br.name):
            fns.append(_elem_fn(low, br, env, sig, grad_dist=grad_dist, given=True, **kw(br)))
            for j, op in enumerate(low.grid_reads[br.name]):
                fns.append(_grid_lead_fn(low, br, env, sig, j, op))
        for fn in fns:
            if fn is None:  # a function still reads the LSE or Delta: neither row value for any
                return _elem_fns(low, env, sig, tanh_ex2, exp_fold, grad_dist, False, False)
            out += fn + [""]
    for br in low.q_branches:
        fn = _elem_fn(low, br, env, sig, dq_nest=True, **kw(br))
        if fn is None:
            return _elem_fns(low, env, sig, tanh_ex2, exp_fold, grad_dist, False, False)
        out += fn + [""]
    return out


def device_source(low: BackwardLowered, env: Mapping[str, int], tanh_ex2: bool = False, exp_fold: bool = True,
                  grad_dist: bool = False, lse_per_row: bool = True, delta_per_row: bool = True
                  ) -> tuple[str, list[str]]:
    """The variant's device functions and the run-time dims they read (scalar arguments dim_<name>). `tanh_ex2`:
    from_ir.tanh_by_ex2; `grad_dist`: _late_distances; `lse_per_row`, `delta_per_row`: lse_row_fn, delta_row_fn
    where the branches allow them (`_elem_fns`), which the kernels then apply to the LSE and Delta where they read
    them."""
    cap_names = {c: f"cap_{c.name}" for c in low.captures}
    sig = "".join(f", {n}" for n in cap_names.values()) + ", DIMS"
    for v, (c, a, g) in zip(low.range_values, low.ranges):  # after the sizes, as in the spec's captures
        cap_names[v] = f"rng_{range_name(low.captures[c].name or f'cap{c}', a, g)}"
        sig += f", {cap_names[v]}"
    if low.block_mask == "list":  # the block lists, last (the spec's derived captures' order)
        sig += "".join(f", blk_{c.name}" for c in list_captures(low.dq))
    out = _elem_fns(low, env, sig, tanh_ex2, exp_fold, grad_dist, lse_per_row, delta_per_row)
    for i, v in enumerate(low.grad_index):
        if v is not None:
            out += _grad_index_fn(low, low.branches[0], env, sig, i, v) + [""]
    for fn, op in (("tile_class_fn", low.classify), ("tile_class_q_fn", low.q_classify)):
        if op is None:
            continue
        region = op.regions[0]
        region_caps = [cap_names[v] for v in op.operands[4:]]
        spec_r = op.attrs.get("ranges", ())
        first = len(region_caps) - len(spec_r)
        ranges = {4 + int(c): (region_caps[first + j], int(a), int(g)) for j, (c, a, g) in enumerate(spec_r)}
        lines = _interval_fn(region, env, "".join(f", {n}" for n in region_caps), ranges)
        lines[0] = f"def {fn}(b, h, q_lo, q_hi, kv_lo, kv_hi{sig}):"
        out += lines + [""]
    if low.table is not None:
        op = low.table
        region = op.regions[0]
        out += _pred_source(region, [None] * 4 + list(op.operands), env, "mask_fn", sig, cap_names) + [""]  # type: ignore
    text = "\n".join(out)
    dims = sorted(set(re.findall(r"\bdim_(\w+)", text)))
    return text.replace(", DIMS", "".join(f", dim_{d}" for d in dims)), dims


def build_backward_spec(low: BackwardLowered, env: Mapping[str, int], dtype: str, path: str,
                        num_warps: Optional[int], extra: Optional[dict] = None) -> FA2BackwardSpec:
    D = int(env["D"])
    if low.block_mask == "list" and (extra or {}).get("bwd_block_list") is False:
        low = dataclasses.replace(low, block_mask="static")  # the in-kernel scan over the range tables (A/B)
    src, dims = device_source(low, env, tanh_by_ex2(path, extra), (extra or {}).get("exp_fold", True) is not False,
                              (extra or {}).get("grad_dist", False) is True,
                              (extra or {}).get("lse_per_row", True) is not False,
                              (extra or {}).get("delta_per_row", True) is not False)
    caps = tuple(Capture(v.name or f"cap{i}", v.type.dtype, max(v.type.rank, 1)) for i, v in enumerate(low.captures))
    caps += tuple(Capture(f"dim_{d}", "i32", 0) for d in dims)
    caps += range_captures(low.captures, low.ranges, 0)  # made by the runtime from the captures (block_data.py)
    caps += list_captures(low.dq) if low.block_mask == "list" else ()
    grads = tuple(GradSpec(*g) for g in low.grads)
    bq, bk = low.block_q, low.block_k
    nw = num_warps or (max(1, bk // 16) if path == "mma" else 1)
    key = f"{print_func(low.func)}|{sorted(env.items())}|{dtype}|{path}|{nw}|{sorted((extra or {}).items())}"
    name = "fa2bwd_" + low.func.name.replace("-", "_") + "_" + hashlib.sha1(key.encode()).hexdigest()[:10]
    branches = tuple(br.name for br in low.branches)
    return FA2BackwardSpec(name=name, head_dim=D, dtype=dtype, path=path, block_q=bq, block_k=bk, num_warps=nw,
                           group_size=low.group, captures=caps, device_source=src, branches=branches,
                           block_mask=low.block_mask, grads=grads, dims=tuple(dims), dq=low.dq,
                           q_branches=tuple(br.name for br in low.q_branches), deterministic=low.deterministic,
                           grid_reads=tuple((br, low.captures.index(op.operands[0]), op.operands[0].type.rank)
                                            for br, ops in low.grid_reads.items() for op in ops),
                           extra=dict(extra or {}))


__all__ = ["BackwardLowered", "analyse_backward", "build_backward_spec", "device_source"]
