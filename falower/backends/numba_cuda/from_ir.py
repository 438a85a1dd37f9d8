"""From the final fa2-fwd IR to an `FA2ForwardSpec`: the IR side of the Numba CUDA backend.

The schedule comes from the IR (tile sizes, exp2 domain, GQA group, how tiles are classified); the
variant comes from its regions, translated op by op into Python source of three scalar device functions:
`score_fn` (the fused score function without its mask), `mask_fn` (the mask predicate) and
`tile_class_fn` (the same predicate evaluated on index intervals, as `mask.classify` defines it). The
kv-bounds conjunct that tile added is dropped: bounds are the kernel's job (spec.py).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

from ...errors import FalowerError
from ...ir.core import Block, Func, Op, Value, backward_slice
from ...ir.dims import Const, Dim, dim
from ...ir.intervals import uses_data
from ...ir.printer import print_func
from ...ir.value_ranges import ValueRanges, dim_range
from ...ir.types import int_range, is_float
from ...passes.mask_tiles import predicate_region, split_mask
from ...passes.online_softmax import check_fa2_body, structure_key
from .spec import Capture, FA2ForwardSpec


class BackendError(FalowerError):
    """The IR is not in a form the numba-cuda backend can emit."""


def _first_line(e: Exception) -> str:
    """An emitter's refusal as one line (its first): the errors below say it on one line with where it was made."""
    return (str(e).strip().splitlines() or ["(no message)"])[0]


def unbuildable(e: ValueError, head_dim: int, path: str, spec=None) -> BackendError:
    """The error for a schedule the emitter refuses (its validate_spec's ValueError: tile sizes, head dim, shared
    memory), with the tiles where the spec was made: what compile and `falower opt --print-kernel` both say."""
    tiles = f"tiles {spec.block_q}x{spec.block_k}, " if spec is not None else ""
    return BackendError(f"numba-cuda backend: {_first_line(e)} ({tiles}D = {head_dim}, {path} path; choose tiles with "
                        "tile{bq=..,bk=..})")


def unbuildable_backward(e: ValueError, spec, path: str) -> BackendError:
    """The error for a backward schedule the emitter refuses (its ValueError), with the backward's tiles (its own,
    not the forward's tile{} choice): what compile and `falower opt -p fa2-bwd --print-kernel` both say."""
    return BackendError(f"numba-cuda backend: {_first_line(e)} (backward tiles {spec.block_q}x{spec.block_k}, D = "
                        f"{spec.head_dim}, {path} path)")


@dataclass
class Lowered:
    """What the IR fixes about the kernel, before the sizes of a call are known."""

    func: Func
    fused: Op  # a fused score op of the kv loop (masked form)
    score: Value  # the unmasked score inside fused's region
    conj: list[Value]  # the user's mask conjuncts (bounds dropped)
    block_q: int
    block_k: int
    group: int
    exp2: bool
    block_mask: str
    captures: list[Value]  # func args in the fused op's capture order
    dims_used: set[str]  # dims the device functions read
    runtime_dims: list[str]  # those passed at run time as scalar arguments (all but D: no recompiles per size)
    ranges: list[tuple[int, int, int]] = field(default_factory=list)  # mask.ranges: (capture, axis, granule)
    runs: list[tuple[int, int]] = field(default_factory=list)  # run tables the row bounds read: (capture, axis)
    lazy_rescale: float = 0.0  # online-softmax{lazy=T}'s threshold (0: the max moves on every tile)
    ragged_q_first: bool = False  # tile{ragged_q=first}: q0 = qi * bq - (cdiv(M, bq) * bq - M)
    kv_parts: int = 1  # split-kv{parts=P}: the parallel_for's leading part index (1: no split)
    part_dtype: str = ""  # split-kv's parts' O dtype (the kernel stores them in the input's)


def analyse(func: Func) -> Lowered:
    pf = [op for op in func.body.ops if op.name == "parallel_for"]
    if len(pf) != 1:
        raise BackendError("numba-cuda backend: needs the fa2-fwd IR (one parallel_for over (b, h, q-tile)); "
                           "lower with pipeline fa2-fwd first")
    par = pf[0]
    parts, part_dtype = _split_parts(func, par)
    lead = 1 if parts > 1 else 0  # the part index before (b, h, qi)
    if len(par.attrs["bounds"]) != 3 + lead or len(par.results) != 2:
        raise BackendError("numba-cuda backend: expected parallel_for (b, h, qi) with outputs O and LSE "
                           "(the fa1 order and graphs without online-softmax are not emitted)")
    form = check_fa2_body(par.regions[0], lambda msg: BackendError(
        f"numba-cuda backend: {msg} (its kernels compute online-softmax's loop, whatever a dump says it is)"),
        whole_range=parts == 1)
    fused_ops = [op for op in par.walk() if op.name == "fused"]
    if not fused_ops:
        raise BackendError("numba-cuda backend: no fused score function in the kv loop")
    _check_template(func, par, fused_ops)
    for f in fused_ops:  # the kernels take the exponential's base and the lazy threshold from the score function
        said = (bool(f.attrs.get("exp2")), float(f.attrs.get("lazy_rescale", 0.0)))
        if said != (form.exp2, form.lazy):
            raise BackendError(f"numba-cuda backend: the score function says exp2={said[0]}, lazy_rescale={said[1]:g} "
                               f"where the kv loop's online softmax is exp2={form.exp2}, lazy={form.lazy:g}")
    fused = fused_ops[-1]  # the masked (partial-tile) form when mask-tiles ran
    region = fused.regions[0]
    score, conj = split_mask(region)
    conj = [c for c in conj if not _is_bounds(c)]
    tl = next(op for op in par.regions[0].ops if op.name == "tile.load")
    block_q = tl.results[0].type.shape[0].value  # type: ignore[union-attr]
    ragged_first = _q_start_form(tl.operands[3], par.regions[0].args[2 + lead], block_q, tl.operands[0])
    roles = list(fused.attrs["roles"])
    kv_arg = fused.operands[roles.index("kv")]
    block_k = kv_arg.type.shape[1].value  # type: ignore[union-attr]
    group = 1
    for op in par.regions[0].ops:
        if op.name == "floordiv" and op.operands[0] is par.regions[0].args[1 + lead]:
            group = int(op.operands[1].owner.attrs["value"])  # type: ignore[union-attr]
    names = [op.name for op in func.walk()]
    block_mask = "table" if "mask.block_table" in names else "static" if "mask.kv_range" in names else "none"
    if conj and block_mask == "none":
        block_mask = "table" if uses_data(predicate_region(fused, conj)) else "static"
    caps = [v for v, r in zip(fused.operands, roles) if r == "cap"]
    cap_args = [_func_arg(func, v) for v in caps]
    ranges = []
    for op in func.body.ops:  # run-time data bounded per granule: tables the runtime makes (block_data.py)
        if op.name == "mask.ranges":
            src = _func_arg(func, op.operands[0])
            if src not in cap_args:
                raise BackendError(f"numba-cuda backend: mask.ranges of %{src.name}, which the score function "
                                   "does not read")
            ranges.append((cap_args.index(src), int(op.attrs["axis"]), int(op.attrs["granule"])))
    _check_mask_ops(func, par, fused_ops, block_q, block_k, ranges, lead)
    if block_mask == "static" and any(g > 1 for _, _, g in ranges):
        # tables read along q or kv (document ids): tiles classified from the range tables once per data by
        # the list kernel, visited from the list. Tables read at one point per tile (start[b], window[h]:
        # granule 1) stay with the in-kernel scan, which costs no extra launch when their data changes
        # (a decoding step's offsets)
        block_mask = "list"
    dims: set[str] = set()
    for op in backward_slice(region, [score, *conj]) + hoisted_ops(fused):
        v = op.attrs.get("value")
        if isinstance(v, Dim):
            dims |= v.symbols()
    from .row_bounds import runs_wanted

    # run tables only where block data is made per data anyway (block lists): a dense block table's kernels
    # take the caller's captures alone
    runs = runs_wanted(predicate_region(fused, conj)) if conj and block_mask == "list" else []
    return Lowered(func, fused, score, conj, block_q, block_k, group, form.exp2, block_mask,
                   cap_args, dims, sorted(dims - {"D"}), ranges, runs, form.lazy, ragged_first, parts, part_dtype)


def _check_template(func: Func, par: Op, fused_ops: list[Op]) -> None:
    """What the kernels take from their own template rather than from the IR, asked of the IR (which may be a
    hand-edited dump; a review's finds: each edit ran with other numbers than the IR's): Q, K and V are the tiles of
    the first three arguments, K's and V's at the kv tile's first row; S = Q K^T feeds each score function; the full
    tiles' score function (mask-tiles' unmasked copy) computes the masked one's score; the tile classes' tests are
    mask-tiles' (0: empty, skipped; 2: full)."""
    def fail(msg: str) -> BackendError:
        return BackendError(f"numba-cuda backend: {msg} (its kernels compute this from their own template)")

    def load_of(v: Value, arg: int) -> Optional[Op]:
        op = v.owner
        return op if isinstance(op, Op) and op.name == "tile.load" and op.operands[0] is func.args[arg] else None

    q_load = next(op for op in par.regions[0].ops if op.name == "tile.load")
    if q_load.operands[0] is not func.args[0]:
        raise fail(f"the q tile loads %{q_load.operands[0].name}, not the first argument (q)")
    for f in fused_ops:
        roles = list(f.attrs["roles"])
        s = f.operands[roles.index("s")].owner
        kv = f.operands[roles.index("kv")].owner if "kv" in roles else None
        k_load = load_of(s.operands[1], 1) if isinstance(s, Op) and s.name == "tile.matmul" else None
        if k_load is None or s.operands[0] is not q_load.results[0] or not s.attrs.get("transpose_b") \
                or s.attrs.get("transpose_a"):
            raise fail("the score function's S is not Q K^T of the q tile and a tile of the second argument (k)")
        k0 = kv.operands[0] if isinstance(kv, Op) and kv.name == "tile.iota" else None
        if k0 is not None and k_load.operands[3] is not k0:
            raise fail("the k tile is not loaded at the kv tile's first row (the kv index's start)")
    for op in par.walk():  # P @ V: the one product without transpose_b
        if op.name == "tile.matmul" and not op.attrs.get("transpose_b"):
            v_load = load_of(op.operands[1], 2)
            if v_load is None:
                raise fail("P @ V's V is not a tile of the third argument (v)")
            if k0 is not None and v_load.parent is k_load.parent and v_load.operands[3] is not k0:
                raise fail("the v tile is not loaded at the kv tile's first row")
    if len(fused_ops) == 2:
        (full, _), (masked, _) = (split_mask(f.regions[0]) for f in fused_ops)
        if list(fused_ops[0].attrs["roles"]) != list(fused_ops[1].attrs["roles"]) or \
                structure_key(full, fused_ops[0].regions[0], {}) != structure_key(masked, fused_ops[1].regions[0], {}):
            raise fail("the full tiles' score function does not compute the partial tiles' score (mask-tiles' copy)")

    def is_class(v: Value) -> bool:  # mask.classify's, or a block table's entry as mask-tiles reads it (cast to i32)
        op = v.owner
        src = op.operands[0].owner if isinstance(op, Op) and op.name == "cast" else None
        return isinstance(op, Op) and (op.name == "mask.classify" or isinstance(src, Op) and src.name == "tile.load"
                                       and isinstance(src.operands[0].owner, Op)
                                       and src.operands[0].owner.name == "mask.block_table")

    for op in par.walk():
        if any(is_class(x) for x in op.operands) and op.name != "eq":
            raise fail(f"a tile class is read by {op.name}: mask-tiles' tests are == 0 (empty) and == 2 (full)")
        if op.name == "eq" and is_class(op.operands[0]):
            c = op.operands[1].owner
            cv = c.attrs.get("value") if isinstance(c, Op) and c.name == "const" else None
            if cv not in (0, 2):
                raise fail(f"a tile class is compared with {cv!r}: mask-tiles' tests are == 0 (empty) and == 2 (full)")
            for user in (u for u in par.walk() if u.name == "if" and u.operands[0] is op.results[0]):
                then = user.regions[0]
                through = any(y.owner is not None and isinstance(y.owner, Block) for y in then.terminator.operands)
                fused_then = any(x.name == "fused" for x in then.ops)
                if (cv == 0) != through or (cv == 2) != fused_then:
                    raise fail("a tile class's branch is not mask-tiles' (== 0: the state passed through; == 2: the "
                               "unmasked score function)")


def _check_mask_ops(func: Func, par: Op, fused_ops: list[Op], block_q: int, block_k: int,
                    ranges: list[tuple[int, int, int]], lead: int) -> None:
    """mask-tiles' ops as mask-tiles makes them, asked of the IR (which may be a hand-edited dump). The kernels
    classify tiles, find a q tile's kv range and fill a block table from the score function's mask (tile_class_fn,
    mask_fn: the masked score function's conjuncts), on their own tiles, indices and captures, while the
    interpreter takes `mask.kv_range`'s, `mask.classify`'s and `mask.block_table`'s regions, attributes and
    operands as the definition: an edited predicate (causal's kv <= q made kv >= q) ran the kernels' classes
    against other numbers in the IR. So each mask op must hold:
    - mask-tiles' copy of the masked score function's predicate: `predicate_region` of its conjuncts (the kv bound
      included), compared by structure (`structure_key`: ops, attributes, result types, constants by value, region
      arguments by position); the kv bound itself is `kv < N` (the kernels' bound);
    - bq, bk the loop's tiles; a table's m, n the q and k lengths, its type [B, H, cdiv(M, bq), cdiv(N, bk)];
    - operands b, h (the program's), q0 (the q tile's first row: what tile.load of q reads), k0 (the kv index's
      start) or nkv (the constant N), then the score function's captures in its order, then for `ranges = [[c,
      axis, granule], ...]` the mask.ranges of capture c with that axis and granule, as the kernels build them
      (`ranges`); a table is read at [b, h, qi, kj] and cast to i32 (mask-tiles' form, the kernels' index);
    - and the full tiles' score function has no mask (the kernels apply none there).

    What is not comparable, and why it need not be: the range tables' region arguments (interval arithmetic reads
    them through `ranges`, no op of the region does), so `ranges` and the operands are compared instead; values
    score-licm hoisted out of the score function (roles cta, row, col): it hoists the score's ops, never the
    mask's, so a mask that reads one is refused, its predicate not being the region's alone; dead ops of a
    predicate and names. Two predicates equal as functions but written differently are refused (mask-tiles writes
    copies of one block, score-licm and canonicalize leave the mask's ops as they are)."""
    def fail(msg: str) -> BackendError:
        return BackendError(f"numba-cuda backend: {msg} (its kernels compute this from their own template)")

    if len(fused_ops) == 2 and split_mask(fused_ops[0].regions[0])[1]:
        raise fail("the full tiles' score function has a mask (mask-tiles' copy drops it: the kernels apply none on "
                   "full tiles)")
    fused = fused_ops[-1]
    region = fused.regions[0]
    roles = list(fused.attrs["roles"])
    conj = split_mask(region)[1]
    N = func.args[1].type.shape[2]
    for c in conj:
        op = c.owner
        if isinstance(op, Op) and op.attrs.get("bounds") and not (
                op.name == "lt" and "kv" in roles and op.operands[0] is region.args[roles.index("kv")]
                and _is_const_dim(op.operands[1], N)):
            raise fail(f"the score function's kv bound is not kv < {N} (the kernels bound kv by k's length)")
    ops = [op for op in func.walk() if op.name in ("mask.kv_range", "mask.classify", "mask.block_table",
                                                   "mask.q_range")]
    if not ops:
        return
    for op in ops:
        if op.name == "mask.q_range" or sum(o.name == op.name for o in ops) > 1:
            what = "a mask.q_range" if op.name == "mask.q_range" else f"more than one {op.name}"
            raise fail(f"the forward IR has {what}; mask-tiles makes one kv range and one tile class a q tile")
    if not conj:
        raise fail(f"{ops[0].name} classifies tiles but the score function has no mask")
    allowed = {a for a, r in zip(region.args, roles) if r in ("b", "h", "q", "kv", "cap")}
    for op in backward_slice(region, conj):
        hoisted = [a for a in op.operands if a.owner is region and a not in allowed]
        if hoisted:
            raise fail(f"the score function's mask reads {_ref(hoisted[0])} (role "
                       f"{roles[region.args.index(hoisted[0])]}), which mask-tiles' predicate cannot take")
    want = predicate_region(fused, conj)
    want_key = structure_key(want.terminator.operands[0], want, {})  # type: ignore[union-attr]
    caps = [v for v, r in zip(fused.operands, roles) if r == "cap"]
    body = par.regions[0]
    bi, h, qi = body.args[lead: lead + 3]
    q0 = next(op for op in body.ops if op.name == "tile.load").operands[3]
    kv = fused.operands[roles.index("kv")].owner
    k0 = kv.operands[0] if isinstance(kv, Op) and kv.name == "tile.iota" else None
    for op in ops:
        nm = op.name
        if (op.attrs.get("bq"), op.attrs.get("bk")) != (block_q, block_k):
            raise fail(f"{nm}'s tiles bq = {op.attrs.get('bq')}, bk = {op.attrs.get('bk')} are not the kv loop's "
                       f"{block_q} x {block_k}")
        reg = op.regions[0]
        term = reg.terminator
        if term is None or len(term.operands) != 1 or structure_key(term.operands[0], reg, {}) != want_key:
            raise fail(f"{nm}'s predicate is not the score function's mask (mask-tiles' copy of its conjuncts, the kv "
                       "bound included)")
        spec = [tuple(e) for e in op.attrs.get("ranges", ())]
        fixed = 0 if nm == "mask.block_table" else 4
        got_caps = op.operands[fixed:len(op.operands) - len(spec)]
        if len(got_caps) != len(caps) or any(a is not b for a, b in zip(got_caps, caps)):
            raise fail(f"{nm} reads captures ({', '.join(_ref(v) for v in got_caps)}) where the score function reads "
                       f"({', '.join(_ref(v) for v in caps)}), in that order")
        why = ranges_mismatch(op, fixed)
        if why:
            raise fail(why)
        if nm == "mask.block_table":
            _check_block_table(op, fail, func, block_q, block_k, (bi, h, qi), par)
            continue
        if sorted(spec) != sorted(ranges):
            raise fail(f"{nm}'s ranges {[list(e) for e in spec]} are not the mask.ranges tables the kernels build "
                       f"{[list(e) for e in ranges]}")
        wants = (("b", bi, "the program's batch index"), ("h", h, "the program's head"),
                 ("q0", q0, "the q tile's first row"), ("k0", k0, "the kv tile's first row"))
        for i, (what, v, where) in enumerate(wants[:3] if nm == "mask.kv_range" else wants):
            if op.operands[i] is not v:
                raise fail(f"{nm}'s {what} is {_ref(op.operands[i])}, not {where}" + (f" {_ref(v)}" if v else ""))
        if nm == "mask.kv_range" and not _is_const_dim(op.operands[3], N):
            raise fail(f"mask.kv_range's nkv is {_ref(op.operands[3])}, not the constant N (k's length {N})")


def _is_const_dim(v: Value, d: Dim) -> bool:
    """Whether v is a constant whose value is the size d."""
    op = v.owner
    val = op.attrs.get("value") if isinstance(op, Op) and op.name == "const" else None
    return isinstance(val, (int, Dim)) and not isinstance(val, bool) and dim(val) == dim(d)


def table_mismatch(op: Op, q: Value, k: Value, block_q: int, block_k: int) -> str:
    """Why mask.block_table `op` is not the table of q's and k's sizes on block_q x block_k tiles that the kernels
    build (m, n the q and k lengths, its type [B, H, cdiv(M, bq), cdiv(N, bk)]); "" where it is."""
    from ...ir.dims import cdiv

    B, H, M = q.type.shape[:3]
    N = k.type.shape[2]
    if dim(op.attrs.get("m", M)) != dim(M) or dim(op.attrs.get("n", N)) != dim(N):
        return f"mask.block_table's m = {op.attrs.get('m')}, n = {op.attrs.get('n')} are not q's and k's lengths " \
               f"{M}, {N}"
    want = (dim(B), dim(H), cdiv(dim(M), block_q), cdiv(dim(N), block_k))
    if tuple(dim(d) for d in op.results[0].type.shape) != want:
        return f"mask.block_table's type is {op.results[0].type}, not [B, H, cdiv(M, {block_q}), cdiv(N, {block_k})] " \
               "of q's and k's sizes"
    return ""


def _check_block_table(op: Op, fail, func: Func, block_q: int, block_k: int, tile: tuple, par: Op) -> None:
    """mask-tiles' dense table (`table_mismatch`), read once a kv tile at [b, h, qi, kj] (`tile`: the program's b, h,
    qi) and cast to i32, the class the kv loop tests."""
    why = table_mismatch(op, func.args[0], func.args[1], block_q, block_k)
    if why:
        raise fail(why)
    for use in (u for u in par.walk() if op.results[0] in u.operands):
        loop = use.parent.parent if use.parent is not None else None
        kj = loop.regions[0].args[0] if isinstance(loop, Op) and loop.name == "for" else None
        at = list(use.operands[1:])
        casts = [u for u in par.walk() if use.results and use.results[0] in u.operands]
        if use.name != "tile.load" or use.operands[0] is not op.results[0] or kj is None or len(at) != 4 \
                or any(a is not b for a, b in zip(at, (*tile, kj))) or len(casts) != 1 or casts[0].name != "cast" \
                or casts[0].results[0].type.dtype != "i32":
            raise fail("a tile class is not read from mask.block_table at [b, h, qi, kj] and cast to i32 (the kernels "
                       "read the table they build so)")


def _ref(v: Value) -> str:
    """A value as a refusal names it: %name, or what it is where the dump numbered it (a parsed %12 has no name)."""
    if v.name:
        return f"%{v.name}"
    op = v.owner
    return f"a {op.name}" if isinstance(op, Op) else "an unnamed argument"


def ranges_mismatch(op: Op, fixed: int) -> str:
    """Why a mask op's `ranges = [[c, axis, granule], ...]` is not its range-table operands' (each the mask.ranges
    of the op's capture c with that axis and granule: the tables the runtime builds from the mask.ranges ops, while
    the interpreter reads each with the entry's axis and granule); "" where it is. `fixed`: the operands before the
    captures (4: b, h and two indices)."""
    spec = [tuple(e) for e in op.attrs.get("ranges", ())]
    caps = op.operands[fixed:len(op.operands) - len(spec)]
    for (c, axis, g), t in zip(spec, op.operands[len(op.operands) - len(spec):] if spec else []):
        src = t.owner
        if not (isinstance(src, Op) and src.name == "mask.ranges" and 0 <= c < len(caps) and src.operands[0] is caps[c]
                and (src.attrs.get("axis"), src.attrs.get("granule")) == (axis, g)):
            cap = _ref(caps[c]) if 0 <= c < len(caps) else f"capture {c}"
            return f"{op.name}'s ranges entry [{c}, {axis}, {g}] reads {_ref(t)}, not mask.ranges of {cap} with " \
                   f"axis {axis}, granule {g}"
    return ""


def _split_parts(func: Func, par: Op) -> tuple[int, str]:
    """(P, the parts' O dtype) of split-kv's form (a parallel_for (part, b, h, qi) in (P, ...) yielding o_parts and
    lse_parts, then falower.ir.lse_merge's ops), or (1, "") for the unsplit forward. The kernel runs the
    parallel_for with the part index in its work items and the runtime launches the merge after it
    (lse_merge.py: the same formula, tested against the interpreter's)."""
    if [r.name for r in par.results] != ["o_parts", "lse_parts"]:
        return 1, ""
    bound = par.attrs["bounds"][0]
    if isinstance(bound, int) and not isinstance(bound, bool):  # a parsed dump's constant dims are ints
        bound = Const(bound)
    if len(par.attrs["bounds"]) != 4 or not isinstance(bound, Const):
        raise BackendError("numba-cuda backend: split-kv's parallel_for needs a constant part count first, got "
                           f"bounds {par.attrs['bounds']}")
    merge = [op.name for op in func.body.ops[func.body.ops.index(par) + 1:]]
    if "reduce_max" not in merge or "log" not in merge:
        raise BackendError("numba-cuda backend: split-kv's parts are not followed by the LSE merge "
                           "(falower.ir.lse_merge)")
    return int(bound.value), par.results[0].type.dtype


def _q_start_form(q0: Value, qi: Value, bq: int, q: Value) -> bool:
    """Whether the q tile's first row is tile{ragged_q=first}'s qi * bq - q_pad (True) or tile's qi * bq (False);
    any other start is refused: the kernels compute one of those two."""
    from ...passes.tile import is_q_tile_start, is_ragged_q_start

    if is_ragged_q_start(q0, qi, bq, q.type.shape[2]):
        return True
    if is_q_tile_start(q0, qi, bq):
        return False
    raise BackendError(f"numba-cuda backend: the q tile's first row must be qi * {bq} or qi * {bq} - q_pad "
                       "(tile{ragged_q=first}); this graph computes it otherwise")


def _is_bounds(v: Value) -> bool:
    op = v.owner
    return isinstance(op, Op) and bool(op.attrs.get("bounds"))


def _func_arg(func: Func, v: Value) -> Value:
    """A fused op's capture operand is a func argument (possibly through the parallel_for's scope)."""
    if isinstance(v.owner, Block) and v.owner is func.body:
        return v
    raise BackendError("numba-cuda backend: captured tensors must be graph inputs (or mask.ranges of one)")


def range_name(table: str, axis: int, granule: int) -> str:
    """The kernel argument of a captured table's `mask.ranges` (one per table, axis and granule)."""
    return f"{table}_ranges_{axis}_{granule}"


def range_captures(tables: list[Value], ranges: list[tuple[int, int, int]], first: int) -> tuple[Capture, ...]:
    """The derived captures of `ranges` ((capture index, axis, granule) into `tables`, which are the spec's
    captures from index `first`): int32 for bool tables (the IR's i8), the table's dtype otherwise."""
    out = []
    for c, axis, g in ranges:
        t = tables[c]
        dt = "i32" if t.type.dtype in ("bool", "i8") else t.type.dtype
        out.append(Capture(range_name(t.name or f"cap{c}", axis, g), dt, t.type.rank + 1,
                           derived=("ranges", first + c, axis, g)))
    return tuple(out)


def run_captures(tables: list[Value], runs: list[tuple[int, int]], first: int) -> tuple[Capture, ...]:
    """The derived captures of `runs` ((capture index, axis) into `tables`, the spec's captures from `first`):
    int32 [*table.shape, 2] run bounds (block_data.run_table)."""
    from .row_bounds import run_name

    return tuple(Capture(run_name(tables[c].name or f"cap{c}", axis), "i32", tables[c].type.rank + 1,
                         derived=("runs", first + c, axis)) for c, axis in runs)


LIST_CAPTURES = (Capture("kv_count", "i32", 1, derived=("kv_count",)),
                 Capture("kv_tiles", "i32", 1, derived=("kv_tiles",)))


# ------------------------------------------------------------------------------------ scalar code
# tanh(x) = 1 - 2 / (1 + 2**(TWO_LOG2E x)): the factor `tanh_by_ex2` merges into tanh_ex2_f32's argument. Here, not
# in intrinsics.py, so that building a spec (a warm process's path to its cached cubins) imports no Numba
TWO_LOG2E = 2.8853900817779268
_UNARY = {"exp": "exp_f32({})", "exp2": "exp2_f32({})", "log": "log_f32({})",
          "log2": "log2_f32({})", "tanh": "tanh_f32({})", "tanh_approx": "tanh_approx_f32({})",
          "erf": "erf_f32({})", "sqrt": "sqrt_f32({})",
          "sigmoid": "(np.float32(1.0) / (np.float32(1.0) + exp_f32(-{})))", "neg": "(-{})", "abs": "abs({})",
          "sin": "sin_f32({})", "cos": "cos_f32({})", "tan": "tan_f32({})", "log1p": "log1p_f32({})",
          "expm1": "expm1_f32({})", "rsqrt": "(np.float32(1.0) / sqrt_f32({}))",
          "floor": "floor_f32({})", "ceil": "ceil_f32({})",  # (math.floor: an int64, undefined at inf and NaN)
          "round": "rint_f32({})"}  # f32 intrinsics: Numba's math.sin and round() compute in f64
_BINARY = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "div": "({} / {})", "pow": "pow_f32({}, {})",
           "max": "max({}, {})", "min": "min({}, {})", "floordiv": "({} // {})", "mod": "({} % {})",
           "shl": "({} << {})", "shr": "({} >> {})", "eq": "({} == {})", "ne": "({} != {})", "lt": "({} < {})",
           "le": "({} <= {})", "gt": "({} > {})", "ge": "({} >= {})"}


def dim_expr(d: Dim, env: Mapping[str, int]) -> str:
    """A dim as Python: symbols known at compile time (D) become numbers, the others the scalar
    arguments `dim_<name>` the kernel passes to its device functions."""
    from ...ir.dims import BinDim, Const, Sym

    if not (d.symbols() - env.keys()):
        return str(d.eval(env))
    if isinstance(d, Const):
        return str(d.value)
    if isinstance(d, Sym):
        return f"dim_{d.name}"
    assert isinstance(d, BinDim)
    a, b = dim_expr(d.lhs, env), dim_expr(d.rhs, env)
    return {"+": f"({a} + {b})", "-": f"({a} - {b})", "*": f"({a} * {b})", "fdiv": f"({a} // {b})",
            "cdiv": f"(-(-{a} // {b}))", "min": f"min({a}, {b})", "max": f"max({a}, {b})"}[d.op]


def _literal(value, dtype: str, env: Mapping[str, int]) -> str:
    if isinstance(value, Dim):
        if value.symbols() - env.keys():
            e = dim_expr(value, env)
            return f"np.float32({e})" if is_float(dtype) else e
        value = value.eval(env)
    if dtype == "bool":
        return "True" if value else "False"
    if is_float(dtype):
        v = float(value)
        if math.isinf(v):
            return "np.float32(np.inf)" if v > 0 else "np.float32(-np.inf)"
        if math.isnan(v):  # (repr gives `nan`, a name the module does not have)
            return "np.float32(np.nan)"
        return f"np.float32({v!r})"
    return str(int(value))


def clamped_index(table: str, axis: int, index: str) -> str:
    """`index` clamped into `table`'s axis as gather clamps it, in 32 bits (the IR's indices are i32; a table dim
    is below 2^31): two 32-bit min / max where Numba's 64-bit ints cost two instructions each, per element of a
    score that gathers; unsigned, so the element address needs no wraparound."""
    return f"np.uint32(min(max(np.int32({index}), np.int32(0)), np.int32({table}.shape[{axis}] - 1)))"


def column_pair(lines: list[str]) -> tuple[list[str], list[str]]:
    """A score's lines for columns kv and kv + 1: the first with s as s0, the second renamed throughout (v<N> ->
    w<N>, s -> s1, kv -> kv1); NVVM shares what does not depend on kv."""
    import re

    first = [re.sub(r"\bs\b", "s0", ln) for ln in lines]
    second = [re.sub(r"\bs\b", "s1", re.sub(r"\bkv\b", "kv1", second_name(ln))) for ln in lines]
    return first, second


def second_name(text: str) -> str:
    """The second column's names in `text` (v<N> -> w<N>: column_pair)."""
    import re

    return re.sub(r"\bv(\d+)\b", r"w\1", text)


# the integer ops whose exact result can leave i32 with operands inside it (and, or, xor, shr, min, max, mod and
# sign cannot; a narrowing cast is i8's)
I32_WRAPS = ("add", "sub", "mul", "neg", "abs", "floordiv", "shl")


def _inside_i32(r: tuple[float, float]) -> bool:
    return -2 ** 31 <= r[0] and r[1] <= 2 ** 31 - 1


def _wrapped(e: str, dtype: str) -> str:
    """Expression e (a Python / Numba int64) wrapped to the i8 or i32 two's complement, as the IR's integers wrap
    (int(): an np.int8 / np.int32 operand would overflow in the simulator's numpy)."""
    half = 128 if dtype == "i8" else 2147483648
    return f"(((int({e}) + {half}) & {2 * half - 1}) - {half})"


def _size_leaves_i32(op: Op, env: Mapping[str, int]) -> bool:
    """An i32 constant of a size expression that can leave i32 (`M * 201326592`): the IR's const wraps it."""
    v = op.attrs.get("value") if op.name == "const" else None
    return isinstance(v, Dim) and not _inside_i32(dim_range(v, env))


class _ScalarEmitter:
    """Python source computing one region's values per element (all its ops are elementwise)."""

    def __init__(self, env: Mapping[str, int], cap_names: dict[Value, str]):
        self.env = env
        self.cap_names = cap_names
        self.names: dict[Value, str] = {}
        self.consts: dict[Value, object] = {}
        self.factors: dict[Value, tuple[str, float]] = {}
        self.lines: list[str] = []
        self.n = 0
        self.prefetch = False  # gathers become prefetch_l2 of the element (score_prefetch_fn)
        self.contract = False  # f32 a * b + c as one cuda.fma where the product has no other use (the forward's score)
        self.uses: dict[Value, int] = {}
        self.mul_ops: dict[Value, Op] = {}
        self.col_step = ""  # x's step per column where x = s + w kv + r(q) (_score_factor, _kv_coef)
        self.tanh_ex2 = False  # f32 tanh as intrinsics.tanh_ex2_f32 (`tanh_by_ex2`), not libdevice's
        self.ranges = ValueRanges(env)  # where the IR's i32 results can wrap (`expr`); callers seed closed regions

    def name(self, v: Value) -> str:
        return self.names[v]

    def emit(self, region: Block, roots: list[Value]) -> None:
        """One line per op; ops of constants are folded here, where every dim is known, and constant
        factors are merged (s / sqrt(D) * log2(e) becomes one multiply per score)."""
        self.emit_ops(backward_slice(region, roots))

    def emit_ops(self, ops: list[Op]) -> None:
        for op in ops:
            for v in op.operands:
                self.uses[v] = self.uses.get(v, 0) + 1
        for op in ops:
            r = op.results[0]
            folded = self.fold(op)
            if folded is not None:
                self.consts[r] = folded
                self.names[r] = _literal(folded.item(), r.type.dtype, self.env)
                continue
            if op.name == "mul":
                self.mul_ops[r] = op
            expr = self.scaled_expr(op)
            if expr is None:
                expr = self.fma_expr(op) or self.expr(op)
            self.names[r] = self.line(expr)

    def line(self, expr: str) -> str:
        """A new name v<n> for expr, its line emitted."""
        nm = f"v{self.n}"
        self.n += 1
        self.lines.append(f"    {nm} = {expr}")
        return nm

    def fold(self, op: Op):
        import numpy as np

        from ...ir.interp import Interpreter

        if op.name == "const":
            v = op.attrs["value"]
            if isinstance(v, Dim):
                if v.symbols() - self.env.keys():
                    return None  # a size known only at run time
                v = v.eval(self.env)
            return Interpreter("native").store(np.asarray(v), op.results[0].type)
        if op.name in ("gather",) or not op.operands or any(v not in self.consts for v in op.operands):
            return None
        it = Interpreter("native")
        with np.errstate(all="ignore"):
            y = it.store(it.elementwise(op.name, op, [self.consts[v] for v in op.operands], op.results[0].type),
                         op.results[0].type)
        return y if y.size == 1 else None

    def product(self, v: Value) -> Optional[tuple[str, str]]:
        """(a, b) where v = a * b is an f32 product with no other use, which an add may fuse (contract)."""
        if not self.contract or v.type.dtype != "f32" or self.uses.get(v, 0) != 1:
            return None
        if v in self.factors:  # a product by a merged constant
            base, c = self.factors[v]
            return base, f"np.float32({c!r})"
        op = self.mul_ops.get(v)
        return (self.name(op.operands[0]), self.name(op.operands[1])) if op is not None else None

    def fma_expr(self, op: Op) -> Optional[str]:
        """f32 add(a * b, c) as cuda.fma(a, b, c): one FFMA where NVVM keeps Numba's multiply and add apart."""
        if op.name != "add" or op.results[0].type.dtype != "f32":
            return None
        x, y = op.operands
        for p, other in ((x, y), (y, x)):
            ab = self.product(p)
            if ab is not None and other.type.dtype == "f32":
                return f"cuda.fma({ab[0]}, {ab[1]}, {self.name(other)})"
        return None

    def scaled_expr(self, op: Op) -> Optional[str]:
        """x * c, x / c and (x * c1) * c2 as one multiply by a folded float32 constant."""
        import numpy as np

        if op.name not in ("mul", "div") or not is_float(op.results[0].type.dtype):
            return None
        a, b = op.operands
        if b in self.consts:
            x, c = a, float(self.consts[b])
        elif a in self.consts and op.name == "mul":
            x, c = b, float(self.consts[a])
        else:
            return None
        if op.name == "div":
            if c == 0:
                return None
            c = 1.0 / c
        base, f = self.factors.get(x, (self.name(x), 1.0))
        total = float(f * c) if op.results[0].type.dtype == "f64" else float(np.float32(f * c))
        self.factors[op.results[0]] = (base, total)
        return f"({base} * np.float32({total!r}))"

    def expr(self, op: Op) -> str:
        """The op's scalar expression, its integers as the IR's: an i8 result wrapped to 8 bits, as the IR's (and
        numpy's) i8 arithmetic wraps where Numba's int64 would widen (a cast of q to i8 read rows past 127 as
        themselves); an i32 result wrapped to 32 bits where its static range (ir/value_ranges.py) can leave i32
        (`q * 33554432`, a sum with a captured value), not where it cannot (q - kv: no code added); a float cast to
        an integer saturated, NaN to 0 (the cast's definition, ir/ops.py)."""
        e = self._expr(op)
        rt = op.results[0].type.dtype if op.results else ""
        if op.name in ("shl", "shr") and rt in ("i8", "i32"):
            lo, hi = self.ranges(op.operands[1])
            if not (0 <= lo and hi <= 63):  # numpy's: a count past the type's bits (or negative) shifts everything
                x, c = (self.name(v) for v in op.operands)  # out; int64's shift is undefined past 63 and below 0
                out = "0" if op.name == "shl" else f"(-1 if {x} < 0 else 0)"
                e = f"({e} if 0 <= {c} <= 63 else {out})"
        if op.name in ("floordiv", "mod") and rt in ("i8", "i32"):
            lo, hi = self.ranges(op.operands[1])
            if lo <= 0 <= hi:  # an integer divided by 0 is 0, as numpy's (Python's // raises, Numba's is unchecked)
                e = f"({e} if {self.name(op.operands[1])} != 0 else 0)"
        if op.name == "cast" and rt in ("i8", "i32") and is_float(op.operands[0].type.dtype):
            lo, hi = int_range(rt)
            x = self.name(op.operands[0])  # (the comparisons first: int() of NaN or inf raises in the simulator)
            e = f"({lo} if {x} <= {lo} else ({hi} if {x} >= {hi} else (int({x}) if {x} == {x} else 0)))"
        if rt == "i8" and op.name != "const" or \
                rt == "i32" and (op.name in I32_WRAPS and self.leaves_i32(op) or _size_leaves_i32(op, self.env)):
            return _wrapped(e, rt)
        return e

    def leaves_i32(self, op: Op) -> bool:
        """Whether op's exact result can lie outside i32 for the values its operands can take."""
        return not _inside_i32(self.ranges.raw(op))

    def _expr(self, op: Op) -> str:
        import numpy as np

        x = [self.name(v) for v in op.operands]
        n, rt = op.name, op.results[0].type.dtype
        if n == "const":
            return _literal(op.attrs["value"], rt, self.env)
        if n == "sign":  # -1, 0 or 1 in the operand's own type; a float's NaN (and -0.0) itself, as numpy's
            if is_float(rt):
                t = "np.float64" if rt == "f64" else "np.float32"
                return f"({t}(1.0) if {x[0]} > 0 else ({t}(-1.0) if {x[0]} < 0 else {x[0]}))"
            return f"(({x[0]} > 0) - ({x[0]} < 0))"
        if n in ("max", "min") and is_float(rt):  # NaN if either is, as numpy's maximum / minimum (Python's max and
            a, b = x  # CUDA's fmaxf, which Numba's max lowers to, return the other operand)
            return f"({a} if {a} != {a} else ({b} if {b} != {b} else {n}({a}, {b})))"
        if n == "tanh" and self.tanh_ex2 and rt == "f32":  # 2 log2(e) merged into the argument's constant factor
            base, f = self.factors.get(op.operands[0], (x[0], 1.0))
            return f"tanh_ex2_f32(({base} * np.float32({float(np.float32(f * TWO_LOG2E))!r})))"
        if n in _UNARY:
            return _UNARY[n].format(*x)
        if n in _BINARY:
            return _BINARY[n].format(*x)
        if n in ("and", "or", "xor", "not"):
            is_bool = op.operands[0].type.dtype == "bool"
            if n == "not":
                return f"(not {x[0]})" if is_bool else f"(~{x[0]})"
            sym = {"and": ("and", "&"), "or": ("or", "|"), "xor": ("!=", "^")}[n][0 if is_bool else 1]
            return f"({x[0]} {sym} {x[1]})"
        if n == "where":
            return f"({x[1]} if {x[0]} else {x[2]})"
        if n == "cast":
            to = op.attrs["to"]
            if is_float(to):
                if op.operands[0].type.dtype == "i32":  # the IR's i32: a 32-bit conversion (s64 is slower)
                    return f"np.float32(np.int32({x[0]}))"
                return f"np.float32({x[0]})"
            if to == "bool":
                return f"({x[0]} != 0)"
            return f"int({x[0]})"
        if n == "gather":
            table = x[0]
            idx = ", ".join(clamped_index(table, d, i) for d, i in enumerate(x[1:]))
            val = f"prefetch_l2({table}, ({idx},))" if self.prefetch else f"{table}[{idx}]"
            return f"np.float32({val})" if is_float(rt) else val
        raise BackendError(f"numba-cuda backend: no scalar form for op {n}")


def _live_lines(lines: list[str], result: str) -> list[str]:
    """Drop assignments nothing reads (a factor merged into a later multiply leaves its own line)."""
    import re

    keep: list[str] = []
    used = set(re.findall(r"\bv\d+\b", result))
    for line in reversed(lines):
        target = line.strip().split(" = ", 1)[0]
        if target in used:
            keep.append(line)
            used |= set(re.findall(r"\bv\d+\b", line.split(" = ", 1)[1]))
    return keep[::-1]


def _role_names(fused: Op, region: Block, cap_names: dict[Value, str]) -> dict[Value, str]:
    out: dict[Value, str] = {}
    caps = iter(cap_names.items())
    for a, r in zip(region.args, fused.attrs["roles"]):
        if r in ("cta", "row", "col"):
            continue  # hoisted by score-licm: named by device_source
        out[a] = cap_ref(*next(caps)) if r == "cap" else r
    return out


HOISTED_ROLES = ("cta", "row", "col")


def hoisted_ops(fused: Op) -> list[Op]:
    """The ops outside `fused` that compute its hoisted operands (roles cta, row, col: score-licm), in order,
    back to the operands with the base roles (s, b, h, q, kv, cap)."""
    roles = list(fused.attrs["roles"])
    leaves = {v for v, r in zip(fused.operands, roles) if r not in HOISTED_ROLES}
    seen: set[int] = set()
    out: list[Op] = []

    def visit(v: Value) -> None:
        op = v.owner
        if v in leaves or not isinstance(op, Op) or id(op) in seen:
            return
        seen.add(id(op))
        if op.regions or op.name.startswith("tile.") or op.name in ("for", "if", "parallel_for"):
            raise BackendError(f"numba-cuda backend: a hoisted score value is computed by {op.name}, which the "
                               "scalar device code cannot express")
        for o in op.operands:
            visit(o)
        out.append(op)

    for v, r in zip(fused.operands, roles):
        if r in HOISTED_ROLES:
            visit(v)
    return out


def _emit_hoisted(low: "Lowered", env: Mapping[str, int], cap_names: dict[Value, str], sig_caps: str
                  ) -> tuple[list[str], dict[Value, str], list[str]]:
    """The device code of the values score-licm hoisted out of the score function.

    Per-CTA values (role cta) that are not constants become `cta_fn(b, h, *captures)`, which the kernels call
    once, before the kv loop, and pass on as the tuple `hz` (a load such as `slopes[h]` once per program).
    Per-row and per-column values (roles row, col) are written at the top of `score_fn` from q and kv: pure
    arithmetic of values fixed for the kv loop (q) or for a tile's column (kv), which NVVM computes once per
    row (hoisted out of the loop) and once per column (shared by the thread's rows).
    Returns (cta_fn's lines or [], the region arguments' names, score_fn's leading lines, the constant region
    arguments' values)."""
    fused = low.fused
    roles = list(fused.attrs["roles"])
    region = fused.regions[0]
    base = {"s": "s", "b": "b", "h": "h", "q": "q", "kv": "kv"}
    caps = iter(cap_names.items())
    leaf_names: dict[Value, str] = {}
    for v, r in zip(fused.operands, roles):
        if r == "cap":
            leaf_names[v] = cap_ref(*next(caps))
        elif r in base:
            leaf_names[v] = base[r]
    ops = hoisted_ops(fused)
    cta_roots = [v for v, r in zip(fused.operands, roles) if r == "cta"]
    # the per-CTA slice first: it must not read q or kv
    e = _ScalarEmitter(env, cap_names)
    e.names.update(leaf_names)
    cta_ops = [op for op in ops if not _reads(op, [v for v, r in zip(fused.operands, roles) if r in ("q", "kv")])]
    e.emit_ops(cta_ops)
    names: dict[Value, str] = {}
    cta_lines: list[str] = []
    returned: list[str] = []
    for v in cta_roots:
        if v in e.consts:  # a constant (the folded scale): a literal, folded where every dim is known
            names[v] = e.name(v)
        else:
            names[v] = f"hz[{len(returned)}]"
            returned.append(e.name(v))
    if returned:
        cta_lines = [f"def cta_fn(b, h{sig_caps}):"]
        cta_lines += _live_lines(e.lines, " ".join(returned))
        cta_lines.append(f"    return ({', '.join(returned)},)")
    # rows and columns: written into score_fn (reading the cta values through hz)
    re_ = _ScalarEmitter(env, cap_names)
    re_.names.update(leaf_names)
    for v in cta_roots:
        re_.names[v] = names[v]
        if v in e.consts:
            re_.consts[v] = e.consts[v]
    re_.n = 1000  # distinct from the region's v<N>
    rest_roots = [v for v, r in zip(fused.operands, roles) if r in ("row", "col")]
    re_.emit_ops([op for op in ops if all(r not in re_.names for r in op.results)])  # unused lines drop below
    for v in rest_roots:
        names[v] = re_.name(v)
    lines = _live_lines(re_.lines, " ".join(names[v] for v in rest_roots)) if rest_roots else []
    arg_names = {a: names[v] for a, v, r in zip(region.args, fused.operands, roles) if r in HOISTED_ROLES}
    consts = {a: e.consts[v] for a, v, r in zip(region.args, fused.operands, roles) if r == "cta" and v in e.consts}
    return cta_lines, arg_names, lines, consts


def _reads(op: Op, targets: list[Value]) -> bool:
    stack, seen = list(op.operands), set()
    while stack:
        v = stack.pop()
        if any(v is t for t in targets):
            return True
        o = v.owner
        if isinstance(o, Op) and id(o) not in seen:
            seen.add(id(o))
            stack.extend(o.operands)
    return False


def cap_ref(v: Value, name: str) -> str:
    """How the device functions read a captured value: a table by its name, a 0-d capture as `name[0]` (it
    arrives as a 1-element device array, so a 0-d CUDA tensor reaches the kernel without a read-back)."""
    return f"{name}[0]" if v.type.rank == 0 else name


def tanh_by_ex2(path: str, extra: Optional[Mapping]) -> bool:
    """Whether the kernels compute the IR's tanh as intrinsics.tanh_ex2_f32, 1 - 2 / (1 + 2**(2 log2(e) x)): the
    tensor-core kernels, whose f16 / bf16 scores carry errors far above its absolute ~2**-22 and whose softcap was
    bound by libdevice's ~16 instructions an element (benchmarks/NOTES.md, "The softcap's tanh by ex2 and rcp").
    extra["tanh"] = "libdevice" keeps libdevice's tanhf (2 ulp; bench '-ltanh'); the SIMT kernels (f32, f64) always
    do."""
    how = (extra or {}).get("tanh", "ex2")
    if how not in ("ex2", "libdevice"):
        raise BackendError(f"numba-cuda backend: extra['tanh'] must be 'ex2' or 'libdevice', got {how!r}")
    return path == "mma" and how == "ex2"


def device_source(low: Lowered, env: Mapping[str, int], info: Optional[dict] = None, tanh_ex2: bool = False) -> str:
    """The device functions of the spec's contract (spec.py). `info`, where given, receives "score_scale": the
    score's last constant factor c > 0 where the exp2 score is c * x (0.0 otherwise), which the tensor-core kernels
    fold into the exponent (score_raw_fn returns x where x is not s itself). `tanh_ex2`: `tanh_by_ex2`."""
    from .row_bounds import row_bounds_lines, run_name

    cap_names = {v: f"cap_{v.name}" for v in low.captures}
    # every device function takes every kernel capture: the caller's, the sizes, then the derived ones
    derived = [f"rng_{range_name(low.captures[c].name or f'cap{c}', a, g)}" for c, a, g in low.ranges]
    run_names = {(c, a): f"rng_{run_name(low.captures[c].name or f'cap{c}', a)}" for c, a in low.runs}
    derived += list(run_names.values())
    derived += ["blk_kv_count", "blk_kv_tiles"] if low.block_mask == "list" else []
    sig_caps = "".join(f", {n}" for n in cap_names.values()) + "".join(f", dim_{d}" for d in low.runtime_dims) \
        + "".join(f", {n}" for n in derived)
    region = low.fused.regions[0]
    out = []
    cta_lines, hoisted, lead, hoisted_consts = _emit_hoisted(low, env, cap_names, sig_caps)
    if cta_lines:
        out += cta_lines + [""]
    e = _ScalarEmitter(env, cap_names)
    e.contract = True
    e.tanh_ex2 = tanh_ex2
    e.names.update(_role_names(low.fused, region, cap_names))
    e.names.update(hoisted)
    e.consts.update(hoisted_consts)  # a folded scale is a constant factor (merged, and known to _score_factor)
    e.emit(region, [low.score])
    hz = ", hz" if cta_lines else ""
    out.append(f"def score_fn(s, b, h, q, kv{sig_caps}{hz}):")
    body = _live_lines(e.lines, e.name(low.score))
    used = " ".join(body) + " " + e.name(low.score)
    out += [ln for ln in _live_lines(lead, used)] + body
    out.append(f"    return np.float32({e.name(low.score)})")
    root, scale, raw_lines = _score_factor(e, low)
    if info is not None:
        info["score_scale"] = scale
    body_x = body + raw_lines  # the score's lines and those of x (x * c = the score)
    raw: list[str] = []
    if scale and root != "s":  # the score before its constant factor, which the kernels fold into ex2's FFMA
        raw = _live_lines([ln for ln in _live_lines(lead, used)] + body_x, root)
        out += ["", f"def score_raw_fn(s, b, h, q, kv{sig_caps}{hz}):", *raw, f"    return np.float32({root})"]
        if e.col_step:  # x = s + w kv + r(q): the step of x from one column to the next, once per program
            out += ["", f"def score_col_fn(b, h{sig_caps}{hz}):", f"    return np.float32({e.col_step})"]
        out += _small_score_lines(raw, root, sig_caps, hz)
    gathers = [op for op in backward_slice(region, [low.score]) if op.name == "gather"]
    pair_lines = _score_pair_lines(region, gathers, e, lead, body_x, low, sig_caps, hz, root)
    if pair_lines:  # two adjacent columns' table entries by one 8-byte load
        out += [""] + pair_lines
    row_gather = _row_gather(low, e, gathers) if raw and not pair_lines else None
    if row_gather:  # a relative bias: the row's entries at constant offsets from one index a row
        rg_lines = _row_gather_lines(*row_gather, e, raw, root, sig_caps, hz)
        out += [""] + rg_lines if rg_lines else []
    if gathers:  # the score reads tables per element: the kernels prefetch the next kv tile's entries into L2
        pf = _ScalarEmitter(env, cap_names)
        pf.prefetch = True
        pf.names.update(e.names)
        pf.emit(region, [low.score])
        wanted = " ".join(pf.name(op.results[0]) for op in gathers)
        body = _live_lines(pf.lines, wanted)
        used = " ".join(body) + " " + wanted
        out.append("")
        out.append(f"def score_prefetch_fn(b, h, q, kv{sig_caps}{hz}):")
        out.append("    s = np.float32(0)")
        out += [ln for ln in _live_lines(lead, used)] + body
        out.append("    return 0")
    if low.conj:
        pred = predicate_region(low.fused, low.conj)
        pe = _ScalarEmitter(env, cap_names)
        for a, nm in zip(pred.args, ["b", "h", "q", "kv"] + [cap_ref(v, n) for v, n in cap_names.items()]):
            pe.names[a] = nm
        seeds = predicate_seeds(pred, low.fused, pe.ranges)
        for a, r in seeds.items():
            pe.ranges.seed(a, r)
        res = pred.terminator.operands[0]  # type: ignore[union-attr]
        pe.emit(pred, [res])
        out.append("")
        out.append(f"def mask_fn(b, h, q, kv{sig_caps}):")
        out += _live_lines(pe.lines, pe.name(res))
        out.append(f"    return {pe.name(res)}")
        bounds = row_bounds_lines(pred, env, sig_caps, cap_names, run_names, seeds)
        if bounds is not None:  # one kv interval per row: partial tiles compare against it (row_bounds.py)
            out += [""] + bounds
        if low.block_mask in ("static", "list"):
            out.append("")
            ranges = {4 + c: (derived[j], a, g) for j, (c, a, g) in enumerate(low.ranges)}
            out += _interval_fn(pred, env, sig_caps, ranges, seeds)
    return "\n".join(out) + "\n"


def predicate_seeds(pred: Block, fused: Op, ranges: ValueRanges) -> dict[Value, tuple[float, float]]:
    """The static ranges of a closed predicate region's b, h, q and kv (predicate_region's, which no op defines):
    those of the fused op's operands in those roles (an index the score does not read: any i32 index)."""
    roles = list(fused.attrs["roles"])
    out = {}
    for a, role in zip(pred.args[:4], ("b", "h", "q", "kv")):
        v = next((o for o, r in zip(fused.operands, roles) if r == role), None)
        out[a] = ranges(v) if v is not None else (0.0, float(2 ** 31 - 1))
    return out


def reads_table_tile(low: "Lowered") -> bool:
    """Whether the score reads a [q, kv] tile of one table (`tile_gather`), which the warp-specialized kernel
    copies into shared memory: the automatic kernel choice takes it at D = 64 too (emit_fa3.auto_extra)."""
    region = low.fused.regions[0]
    roles = list(low.fused.attrs["roles"])
    gathers = [op for op in backward_slice(region, [low.score]) if op.name == "gather"]
    pairs = pair_gathers(region, gathers, roles, {a for a, r in zip(region.args, roles) if r == "cap"})
    return tile_gather(region, pairs, roles) is not None


def _score_factor(e: "_ScalarEmitter", low: "Lowered") -> tuple[str, float, list[str]]:
    """(x, c, lines) where the exp2-domain score is x * c with c a finite constant > 0, `lines` computing x where
    it is new; else (score, 0.0, []). max(x) c == max(x c) for c > 0, so the kernels may take the row max on x and
    exponentiate ex2(x c - m) by one FFMA. Two forms: the emitter merged the score's last constant factors
    (`(s / sqrt(D) + bias) * log2(e)`: x = s * 0.125 + bias, c = log2(e)); or the score is s * c + u * w with w
    fixed for the program (ALiBi's `s * scale + d * slope`): x = s + u * (w / c), one FFMA, the division by c
    once per program where NVVM hoists w / c out of the loop."""
    name = e.name(low.score)
    if not low.exp2 or low.score.type.dtype != "f32":
        return name, 0.0, []
    base, c = e.factors.get(low.score, (name, 0.0))
    if 0.0 < c < float("inf"):
        return base, float(c), []
    op = low.score.owner
    if not isinstance(op, Op) or op.name != "add":
        return name, 0.0, []
    region = low.fused.regions[0]
    fixed = {a for a, r in zip(region.args, low.fused.attrs["roles"]) if r == "cta"}
    for p, other in (op.operands, op.operands[::-1]):
        base, c = e.factors.get(p, ("", 0.0))
        if not (0.0 < c < float("inf")) or e.uses.get(p, 0) != 1 or other.type.dtype != "f32":
            continue
        inv = f"np.float32({float(1.0 / c)!r})"
        mul = e.mul_ops.get(other)
        u_w = [(u, w) for u, w in ((mul.operands[0], mul.operands[1]), (mul.operands[1], mul.operands[0]))
               if w in fixed or w in e.consts] if mul is not None else []
        nm = f"v{e.n}"
        e.n += 1
        if u_w:
            u, w = u_w[0]
            line = f"    {nm} = cuda.fma({e.name(u)}, ({e.name(w)} * {inv}), {base})"
            k = _kv_coef(low, u, e) if base == "s" else None
            if k:  # x = s + (k kv + r) w': per column k w' (score_col_fn), the rest per row (module docstring)
                e.col_step = f"(np.float32({e.name(w)} * {inv}) * np.float32({k!r}))"
        else:
            line = f"    {nm} = cuda.fma({e.name(other)}, {inv}, {base})"
        return nm, float(c), [line]
    return name, 0.0, []


def _kv_coef(low: "Lowered", v: Value, e: "_ScalarEmitter", zero: bool = False,
             along: str = "kv") -> Optional[float]:
    """k where the score region's value v is k * kv + r, k a constant and r reading neither kv nor s (ALiBi's
    distance cast(kv) - cast(q): k = 1); None where v is not of that form. Integer kv is exact in f32 (kv < 2^24),
    so the column's part of v * w is k * w * kv: the kernels add k * w times the column's offset from the thread's
    first column per element, and the rest once per row and tile (emit_fa2.col_step). `zero`: k = 0 (v does not
    change along a row) is an answer too. `along="q"`: the same down a column (k * q + r, r reading neither q nor
    s; the hoisted per-row values followed back to q), which _row_gather's row pairs ask of a gather's index."""
    region = low.fused.regions[0]
    roles = dict(zip(region.args, low.fused.attrs["roles"]))
    kv_idx = [o for o, r in zip(low.fused.operands, low.fused.attrs["roles"]) if r == along]
    hoisted, fixed = ("col", "kv") if along == "kv" else ("row", "q")
    memo: dict[Value, Optional[float]] = {}

    def coef(x: Value) -> Optional[float]:
        if x in memo:
            return memo[x]
        memo[x] = out = _coef(x)
        return out

    def const(x: Value) -> Optional[float]:
        if x in e.consts:
            return float(e.consts[x])
        op = x.owner
        val = op.attrs.get("value") if isinstance(op, Op) and op.name == "const" else None
        return float(val) if isinstance(val, (int, float)) else None

    def _coef(x: Value) -> Optional[float]:
        if const(x) is not None:
            return 0.0
        if kv_idx and x is kv_idx[0]:
            return 1.0
        if x in roles:
            r = roles[x]
            if r == fixed:
                return 1.0
            if r == hoisted:  # a hoisted per-column (row) value: the same form outside the region, back to kv_idx
                return coef(low.fused.operands[region.args.index(x)])
            return None if r == "s" else 0.0  # (along kv) q, row, cta, b, h, cap: the same along a row
        op = x.owner
        if not isinstance(op, Op):
            return 0.0  # outside the region, under a per-column value: a loop's index other than kv's
        if op.regions:
            return None
        cs = [coef(o) for o in op.operands]
        if any(k is None for k in cs):
            return None
        if all(k == 0.0 for k in cs):
            return 0.0
        src = op.operands[0].type.dtype if op.operands else ""
        if x.type.dtype in ("i8", "i32") and op.name in I32_WRAPS and (x.type.dtype == "i8" or e.leaves_i32(op)):
            return None  # it wraps: not linear in kv (its first column wrapped, the steps would not be)
        if op.name == "cast" and (x.type.dtype == "f32" and src in ("f32", "i32", "i64")
                                  or x.type.dtype in ("i32", "i64") and src in ("i32", "i64")):
            return cs[0]  # an integer index is exact in f32 (below 2^24); a float to an integer is not linear
        if op.name in ("add", "sub") and x.type.dtype in ("f32", "i32"):
            return cs[0] + cs[1] if op.name == "add" else cs[0] - cs[1]
        if op.name == "neg":
            return -cs[0]
        if op.name == "mul":
            a, b = op.operands
            for k, other in ((cs[0], b), (cs[1], a)):
                if k != 0.0 and const(other) is not None:
                    return k * const(other)
        return None

    k = coef(v)
    return k if k is not None and (k != 0.0 or zero) and math.isfinite(k) else None


def _row_gather(low: "Lowered", e: "_ScalarEmitter", gathers: list[Op]) -> Optional[tuple[Op, int, Optional[int]]]:
    """(gather, k, shift) where the score's one gather that changes along a row reads a f32 table at indices that
    do not, but for the last, which is k * kv + r with k = +-1 (a relative bias `rel[h, q - kv + N - 1]`): a
    thread's row then reads table[i.., il + k o] at the constant offsets o of its columns from il, the index at its
    first column (emit_fa2.row_gather); None otherwise. `shift` (-1, 1, or None): where the leading indices do
    not change down a column and the last is a q + k kv + r' with a k = shift (the relative bias: -1), row q + 8's
    entry at column kv + o is row q's at kv + o + 8 shift, so a thread's rows g and g + 8 share their loads
    (emit_fa2.row_gather_shift). (A table read at kv alone is no gather here: score-licm hoists it per column.)"""
    region = low.fused.regions[0]
    roles = list(low.fused.attrs["roles"])
    kv_args = {a for a, r in zip(region.args, roles) if r in ("kv", "col")}
    dep = _kv_dependent(region, kv_args)
    along = [op for op in gathers if any(i in dep for i in op.operands[1:])]
    if len(along) != 1:
        return None
    op = along[0]
    table, *idx = op.operands
    if table not in region.args or roles[region.args.index(table)] != "cap":
        return None
    if op.results[0].type.dtype != "f32" or any(_kv_coef(low, i, e, zero=True) != 0.0 for i in idx[:-1]):
        return None
    k = _kv_coef(low, idx[-1], e)
    if k not in (1.0, -1.0):
        return None
    a = _kv_coef(low, idx[-1], e, zero=True, along="q")
    lead_q = [_kv_coef(low, i, e, zero=True, along="q") for i in idx[:-1]]
    shift = int(a * k) if a is not None and a * k in (-1.0, 1.0) and all(c == 0.0 for c in lead_q) else None
    return op, int(k), shift


def _row_gather_lines(op: Op, k: int, shift: Optional[int], e: "_ScalarEmitter", lines: list[str], root: str,
                      sig_caps: str, hz: str) -> list[str]:
    """`gather_row_fn(b, h, q, kv, span, ...)` -> (ok, the table's indices at column kv: the leading ones clamped as
    gather clamps them, the last as is, 64-bit unsigned), ok where columns kv .. kv + span all index inside the
    table unclamped; `gather_elem_fn(gr, o, ...)` the entry at column kv + o; `score_gathered_fn(s, g, b, h, q, kv,
    ...)` score_raw_fn with the entry g given. `lines`: score_raw_fn's (the gather's line among them)."""
    table = e.name(op.operands[0])
    names = [e.name(i) for i in op.operands[1:]]
    g = e.name(op.results[0])
    head = f"    {g} = "
    if sum(ln.startswith(head) for ln in lines) != 1:
        return []
    given = [f"{head}np.float32(g)" if ln.startswith(head) else ln for ln in lines]
    r = len(names)
    last = f"np.int32({table}.shape[{r - 1}] - 1)"
    ok = f"(il >= 0) & (il <= {last} - span)" if k == 1 else f"(il >= span) & (il <= {last})"
    lead = [clamped_index(table, d, n) for d, n in enumerate(names[:-1])]
    step = "+" if k == 1 else "-"
    elem = ", ".join([f"gr[{d + 1}]" for d in range(r - 1)] + [f"gr[{r}] {step} np.uint64(o)"])
    marker = [] if shift is None else [f"ROW_GATHER_SHIFT = {shift}  # row q + 8 at column kv + o reads row q's "
                                        "entry at kv + o + 8 ROW_GATHER_SHIFT",
                                        f"ROW_GATHER_STEP = {k}  # column kv + o reads the entry at il + o "
                                        "ROW_GATHER_STEP",
                                        ""]
    # (with a shift: the entry at il(q, kv) + e, both indices clamped as gather clamps them; a warpgroup's rows read
    # a tile's entries from one run of the table, which emit_fa3_ws.row_slice copies into shared memory this way)
    slice_fn = [] if shift is None else [
        f"def gather_slice_fn(b, h, q, kv, e{sig_caps}{hz}):",
        *_live_lines(lines, " ".join(names)),
        f"    il = np.int32({names[-1]}) + np.int32(e)",
        f"    return np.float32({table}[{', '.join(lead + [clamped_index(table, r - 1, 'il')])}])",
        "",
        # the same run from a row address kept for the item: (the address of the entry at last index 0, il(q, kv),
        # the last axis's length and byte stride), so a tile's two loads are a clamp and an address each
        f"def slice_row_fn(b, h, q, kv{sig_caps}{hz}):",
        *_live_lines(lines, " ".join(names)),
        f"    return (elem_addr({table}, ({', '.join(lead + ['np.uint32(0)'])},)), np.int32({names[-1]}), "
        f"np.int32({table}.shape[{r - 1}]), np.int64({table}.strides[{r - 1}]))",
        ""]
    return marker + slice_fn + [f"def gather_row_fn(b, h, q, kv, span{sig_caps}{hz}):",
            *_live_lines(lines, " ".join(names)),
            f"    il = np.int32({names[-1]})",
            f"    return ({ok}, {''.join(x + ', ' for x in lead)}np.uint64(il))",
            "",
            f"def gather_elem_fn(gr, o{sig_caps}):",
            f"    return np.float32({table}[{elem}])",
            "",
            f"def score_gathered_fn(s, g, b, h, q, kv{sig_caps}{hz}):",
            *_live_lines(given, root),
            f"    return np.float32({root})"]


# tanh_small_f32's and tanh_tiny_f32's ranges and coefficients, from tanh_polys (no Numba: a warm process builds its
# specs without importing intrinsics, tests/gpu/test_cubin_cache_gpu.py)
from .tanh_polys import TANH_SMALL_Y, TANH_TINY_POLY, TANH_TINY_Y, folded  # noqa: E402


def _small_score_lines(raw: list[str], root: str, sig_caps: str, hz: str) -> list[str]:
    """Where every tanh of score_raw_fn's lines is tanh_ex2_f32 of s times a constant K (the softcap, c tanh(s /
    c)): `SCORE_SMALL_S`, the |s| under which each such argument lies in tanh_small_f32's range (|s K| <=
    TANH_SMALL_Y), and `score_raw_small_fn`, score_raw_fn with tanh_small_f32, the FMA pipe's polynomial, for a
    tile whose scores all lie there (emit_fa2.small_scores); the same for tanh_tiny_f32's narrower range
    (`SCORE_TINY_S`, `score_raw_tiny_fn`: emit_fa2.tiny_scores); [] otherwise."""
    import re

    import numpy as np

    text = "\n".join(raw)
    calls = re.findall(r"tanh_ex2_f32\(\((\w+) \* np\.float32\(([^()]+)\)\)\)", text)
    if not calls or text.count("tanh_ex2_f32(") != len(calls) or any(base != "s" for base, _ in calls):
        return []
    k = max(abs(float(c)) for _, c in calls)
    if not math.isfinite(k) or k == 0.0:
        return []
    out = []
    for tier, y in (("small", TANH_SMALL_Y), ("tiny", TANH_TINY_Y)):
        bound = float(np.float32(y / k * (1.0 - 2.0 ** -20)))  # f32 s * K rounds up by at most an ulp
        body = [ln.replace("tanh_ex2_f32(", f"tanh_{tier}_f32(") for ln in raw]
        coeffs = folded(TANH_TINY_POLY, float(np.float32(calls[0][1]))) if tier == "tiny" and len(calls) == 1 \
            else None
        if coeffs is not None:  # one tanh: its argument's multiply folded into the coefficients (one instruction)
            call = f"tanh_ex2_f32((s * np.float32({calls[0][1]})))"
            body = [ln.replace(call, "tanh_tiny_folded_fn(s)") for ln in raw]
            horner = [f"    p = cuda.fma(u, np.float32({coeffs[-1]!r}), np.float32({coeffs[-2]!r}))",
                      *[f"    p = cuda.fma(p, u, np.float32({c!r}))" for c in coeffs[-3::-1]]]
            out += ["", "def tanh_tiny_folded_fn(s):",
                    f"    # tanh_tiny_f32(s * {calls[0][1]}) with the factor in its coefficients: s R'(s^2), R'_i = "
                    "K^(2i+1) R_i", "    u = s * s", *horner, "    return s * p"]
        out += ["", f"SCORE_{tier.upper()}_S = {bound!r}  # |s| <= this: every tanh's argument |s K| <= "
                f"TANH_{tier.upper()}_Y", "", f"def score_raw_{tier}_fn(s, b, h, q, kv{sig_caps}{hz}):",
                *body, f"    return np.float32({root})"]
    return out


def _kv_dependent(region: Block, kv_args: set) -> set:
    """The region's values computed from `kv_args` (kv and the hoisted per-column values: those that change
    along a row)."""
    dep = set(kv_args)
    for op in region.ops:
        if any(o in dep for o in op.operands):
            dep.update(op.results)
    return dep


def pair_gathers(region: Block, gathers: list[Op], roles: list[str], cap_args: set) -> list[Op]:
    """The gathers of a score that read a row's adjacent columns from adjacent elements: a captured table of a
    f32 indexed by kv itself on its last axis and by nothing that changes along the row elsewhere
    (`bias[h, q, kv]`). Two columns kv, kv + 1 (kv even) then cost one 8-byte load where the table is aligned
    for it (`pairs_aligned`): half the load instructions and half the L2 sectors of two 4-byte loads, whose
    warp-wide requests each use half of the 8 sectors they fetch (benchmarks/NOTES.md, the bias table)."""
    kv_args = {a for a, r in zip(region.args, roles) if r in ("kv", "col")}
    kv = [a for a, r in zip(region.args, roles) if r == "kv"]
    dep = _kv_dependent(region, kv_args)
    out = []
    for op in gathers:
        table, *idx = op.operands
        if table not in cap_args or table.type.rank == 0 or table.type.dtype != "f32":
            continue
        if kv and idx[-1] is kv[0] and not any(i in dep for i in idx[:-1]):
            out.append(op)
    return out


def batch_shared_table(low: "Lowered") -> bool:
    """Whether the score gathers per element (its indices read q or kv) from a table that no batch index
    selects (`bias[h, q, kv]`): then every batch row reads the same entries, and a grid with the batch
    innermost (spec.batch_inner) runs those rows together so the table comes from DRAM once, not once per row."""
    region = low.fused.regions[0]
    roles = list(low.fused.attrs["roles"])
    by_role = {r: [a for a, rr in zip(region.args, roles) if rr == r] for r in set(roles)}

    def hoisted_reads(a: Value, role: str) -> bool:  # a cta / row / col value computed from the b (q, kv) operand
        v = low.fused.operands[region.args.index(a)]
        base = [o for o, r in zip(low.fused.operands, roles) if r == role]
        return isinstance(v.owner, Op) and _reads(v.owner, base)

    hoisted = [a for a, r in zip(region.args, roles) if r in HOISTED_ROLES]
    b_args = set(by_role.get("b", [])) | {a for a in hoisted if hoisted_reads(a, "b")}
    qkv_args = set(by_role.get("q", []) + by_role.get("kv", [])) | {
        a for a in hoisted if hoisted_reads(a, "q") or hoisted_reads(a, "kv")}
    on_b, on_qkv = _kv_dependent(region, b_args), _kv_dependent(region, qkv_args)
    return any(op.name == "gather" and any(i in on_qkv for i in op.operands[1:])
               and not any(i in on_b for i in op.operands[1:]) for op in backward_slice(region, [low.score]))


def _score_pair_lines(region: Block, gathers: list[Op], e: "_ScalarEmitter", lead: list[str], body: list[str],
                      low: "Lowered", sig_caps: str, hz: str, root: str) -> list[str]:
    """`pairs_ok_fn` and `score_pair_fn(s0, s1, b, h, q, kv, ...)`: the scores of columns kv and kv + 1 (kv even)
    with each pair gather (`pair_gathers`) read by one `ld_pair`; [] where the score has none. The second
    column's code is the first's with its names renamed (v<N> -> w<N>, s -> s1, kv -> kv1): NVVM shares what
    does not depend on kv. Indices clamp as `gather` does (kv >= 0): the pair starts at min(kv, L - 2), column kv
    takes its second element where kv > L - 2, column kv + 1 always the second."""
    roles = list(low.fused.attrs["roles"])
    cap_args = {a for a, r in zip(region.args, roles) if r == "cap"}
    pairs = pair_gathers(region, gathers, roles, cap_args)
    if not pairs:
        return []
    used = " ".join(body) + " " + e.name(low.score)
    live = _live_lines([ln for ln in _live_lines(lead, used)] + body, root)  # root: the score, or x of x * c
    first, second = column_pair(live)
    tables = []
    for op in pairs:
        nm = e.name(op.results[0])
        k = nm[1:]
        table = e.name(op.operands[0])
        tables.append(table)
        r = op.operands[0].type.rank
        idx = [clamped_index(table, d, e.name(i)) for d, i in enumerate(op.operands[1:-1])]
        last = f"np.int32({table}.shape[{r - 1}] - 2)"
        start = f"np.uint32(min(kk{k}, {last}))"
        cast = "np.float32" if is_float(op.results[0].type.dtype) else ""
        mine = [f"    kk{k} = np.int32(kv)",
                f"    pr{k} = ld_pair({table}, ({', '.join(idx + [start])},))",
                f"    {nm} = {cast}(pr{k}[1] if kk{k} > {last} else pr{k}[0])"]
        first = [x for ln in first for x in (mine if ln.startswith(f"    {nm} = ") else [ln])]
        second = [f"    w{k} = {cast}(pr{k}[1])"
                  if ln.startswith(f"    w{k} = ") else ln for ln in second]
    tile = _tile_table_lines(region, pairs, roles, e, live, root, sig_caps, hz)
    ok = " & ".join(f"pairs_aligned({t}) & ({t}.shape[{op.operands[0].type.rank - 1}] >= 2)"
                    for t, op in zip(tables, pairs))
    return ([f"def pairs_ok_fn(b, h{sig_caps}{hz}):", f"    return {ok}", "",
             f"def score_pair_fn(s0, s1, b, h, q, kv{sig_caps}{hz}):", "    kv1 = kv + 1"]
            + first + second + [f"    return np.float32({root}), np.float32({second_name(root)})"] + tile)


def tile_gather(region: Block, pairs: list[Op], roles: list[str]) -> Optional[Op]:
    """The score's one pair gather that reads a [q, kv] tile of its table: q itself on the axis before kv's, the
    axes before it fixed for the program (b, h or constants: nothing that reads q or kv). A kernel can copy
    the tile's rows into shared memory ahead of its use (`tile_chunk_fn`) instead of loading it in the softmax."""
    if len(pairs) != 1:
        return None
    q = [a for a, r in zip(region.args, roles) if r == "q"]
    moving = _kv_dependent(region, {a for a, r in zip(region.args, roles) if r in ("q", "kv", "row", "col")})
    op = pairs[0]
    idx = op.operands[1:]
    if len(idx) < 2 or not q or idx[-2] is not q[0] or any(i in moving for i in idx[:-2]):
        return None
    return op


def _tile_table_lines(region: Block, pairs: list[Op], roles: list[str], e: "_ScalarEmitter", live: list[str],
                      res: str, sig_caps: str, hz: str) -> list[str]:
    """Where the score reads a [q, kv] tile of one table (`tile_gather`): `tile_ok_fn` (the table's rows
    16-byte aligned and at least N long: every 16-byte chunk a kernel copies is whole or past the end),
    `tile_chunk_fn(sdst, b, h, q, kv, ...)` (cp.async of table[.., q, kv : kv + 4] into shared memory at sdst, q
    clamped as gather clamps it, zeros past the row's end), `tile_geom_fn(b, h, q, ...)` (the address of row
    clamp(q)'s first entry, the row stride in bytes, the table's rows and columns: where a tile lies inside the
    table a kernel copies it from addresses it keeps, a few instructions a chunk) and `score_pair_vals_fn(s0, s1,
    g0, g1, b, h, q, kv, ...)`: score_pair_fn with the table's two entries given (`live`: the lines that compute
    `res`, the score or x of x * c). [] otherwise."""
    op = tile_gather(region, pairs, roles)
    if op is None:
        return []
    nm = e.name(op.results[0])
    table = e.name(op.operands[0])
    r = op.operands[0].type.rank
    lead_names = [e.name(i) for i in op.operands[1:-2]]
    need = _live_lines(live, " ".join(lead_names)) if lead_names else []
    idx = [clamped_index(table, d, n) for d, n in enumerate(lead_names + ["q"])]
    chunk = [f"def tile_chunk_fn(sdst, b, h, q, kv{sig_caps}{hz}):",
             *need,
             f"    nb = min(max(np.int32({table}.shape[{r - 1}]) - np.int32(kv), np.int32(0)), np.int32(4)) * 4",
             "    kc = np.uint32(kv) if nb > 0 else np.uint32(0)",
             f"    cp_async16_a(sdst, elem_addr({table}, ({', '.join(idx)}, kc)), nb)"]
    first, second = column_pair(live)
    w = second_name(nm)
    first = [f"    {nm} = g0" if ln.startswith(f"    {nm} = ") else ln for ln in first]
    second = [f"    {w} = g1" if ln.startswith(f"    {w} = ") else ln for ln in second]
    geom = [f"def tile_geom_fn(b, h, q{sig_caps}{hz}):", *need,
            f"    return (elem_addr({table}, ({', '.join(idx[:-1] + [idx[-1], 'np.uint32(0)'])},)), "
            f"np.int64({table}.strides[{r - 2}]), np.int32({table}.shape[{r - 2}]), np.int32({table}.shape[{r - 1}]))"]
    return ["", f"def tile_ok_fn(b, h, N{sig_caps}{hz}):",
            f"    return rows_aligned16({table}) & (np.int32({table}.shape[{r - 1}]) >= np.int32(N))", "", *chunk, "",
            *geom, "",
            f"def score_pair_vals_fn(s0, s1, g0, g1, b, h, q, kv{sig_caps}{hz}):", "    kv1 = kv + 1",
            *first, *second,
            f"    return np.float32({res}), np.float32({second_name(res)})"]


def _interval_fn(pred: Block, env: Mapping[str, int], sig_caps: str,
                 ranges: Optional[Mapping[int, tuple[str, int, int]]] = None,
                 seeds: Optional[Mapping[Value, tuple[float, float]]] = None) -> list[str]:
    """tile_class_fn: the predicate on index intervals (intervals.py semantics, as scalar code).

    `ranges` maps a region argument's position (a captured table) to (the argument name of its `mask.ranges`
    table, axis, granule): a gather from that table is bounded by the least and greatest entry of the granules
    its axis index covers (`RangeTable.lookup`); its other indices must be one point per tile. An i8 result, and an
    i32 one whose static range can leave i32 (ir/value_ranges.py, `seeds` the closed region's b, h, q, kv), takes
    its type's whole range past it, as the IR's wraps there."""
    static = ValueRanges(env, seeds)
    lines = [f"def tile_class_fn(b, h, q_lo, q_hi, kv_lo, kv_hi{sig_caps}):"]
    iv: dict[Value, tuple[str, str]] = {}
    for a, (lo, hi) in zip(pred.args, [("b", "b"), ("h", "h"), ("q_lo", "q_hi"), ("kv_lo", "kv_hi")]):
        iv[a] = (lo, hi)
    cap_names = [n.strip() for n in sig_caps.split(",") if n.strip()]
    table_names = dict(zip(pred.args[4:], cap_names))
    ranged = {pred.args[i]: r for i, r in (ranges or {}).items()}
    points: set[Value] = set()  # values that are one number (lo == hi): constants, sizes, captured scalars
    for a, nm in zip(pred.args[4:], cap_names):
        if a.type.rank == 0 and a.type.dtype in ("i32", "i8", "bool"):
            iv[a] = (f"int({nm}[0])", f"int({nm}[0])")  # a captured scalar (1-element array): known at run time, exact
            points.add(a)
    k = 0
    for op in pred.ops:
        if op.name == "yield":
            lo, hi = iv[op.operands[0]]
            lines += [f"    if {lo} == 1:", "        return 2", f"    if {hi} == 0:", "        return 0", "    return 1"]
            return lines
        lo, hi = f"i{k}_lo", f"i{k}_hi"
        if op.name == "gather" and op.operands[0] in ranged and all(v in iv for v in op.operands[1:]):
            k += 1
            lines += ["    " + t for t in _range_lookup(table_names[op.operands[0]], *ranged[op.operands[0]],
                                                        [iv[v] for v in op.operands[1:]], lo, hi)]
            iv[op.results[0]] = (lo, hi)
            continue
        if any(v not in iv for v in op.operands):  # a table or float scalar: this tile is partial (always safe)
            return lines[:1] + ["    return 1"]
        x = [iv[v] for v in op.operands]
        k += 1
        n = op.name
        rt = op.results[0].type.dtype
        if is_float(rt) and n != "const":  # float arithmetic: NaN (a table's, inf * 0) has no interval, and the
            return lines[:1] + ["    return 1"]  # GPU's max(0, NaN) is not numpy's: partial (always safe)
        wraps = (rt == "i8" and n != "cast") or (rt == "i32" and n in I32_WRAPS and not _inside_i32(static.raw(op)))
        if wraps and rt == "i32":  # the ends in Python's / Numba's int64: an int32 operand's own sum would wrap first
            x = [(f"int({a})", f"int({b})") for a, b in x]
        body: list[str]
        if n == "const":
            lit = _literal(op.attrs["value"], op.results[0].type.dtype, env)
            if op.results[0].type.dtype == "bool":
                lit = "1" if lit == "True" else "0"
            if op.results[0].type.dtype == "i32" and _size_leaves_i32(op, env):
                lit = _wrapped(lit, "i32")  # as the IR's const wraps
            body = [f"{lo} = {lit}", f"{hi} = {lit}"]
            points.add(op.results[0])
        elif n == "add":
            body = [f"{lo} = {x[0][0]} + {x[1][0]}", f"{hi} = {x[0][1]} + {x[1][1]}"]
        elif n == "sub":
            body = [f"{lo} = {x[0][0]} - {x[1][1]}", f"{hi} = {x[0][1]} - {x[1][0]}"]
        elif n == "neg":
            body = [f"{lo} = -{x[0][1]}", f"{hi} = -{x[0][0]}"]
        elif n == "mul":
            ps = [f"{a} * {b}" for a in x[0] for b in x[1]]
            body = [f"{lo} = min(min({ps[0]}, {ps[1]}), min({ps[2]}, {ps[3]}))",
                    f"{hi} = max(max({ps[0]}, {ps[1]}), max({ps[2]}, {ps[3]}))"]
        elif n in ("min", "max"):
            body = [f"{lo} = {n}({x[0][0]}, {x[1][0]})", f"{hi} = {n}({x[0][1]}, {x[1][1]})"]
        elif n == "abs":
            body = [f"{lo} = 0 if {x[0][0]} <= 0 <= {x[0][1]} else min(abs({x[0][0]}), abs({x[0][1]}))",
                    f"{hi} = max(abs({x[0][0]}), abs({x[0][1]}))"]
        elif n in ("floordiv", "mod") and op.operands[1] in points:
            # by one value a tile (a literal, a size such as pack_gqa's r // M and r % M, a captured scalar such as
            # a chunk length, arithmetic or casts of those): bounded where it is positive at run time, as intervals.py
            # bounds a positive point; where it is not, the whole tile is partial (intervals.py makes only that
            # value unknown: sound either way, this the coarser)
            c = x[1][0]
            lines.append(f"    if {c} <= 0:")
            lines.append("        return 1")
            if n == "floordiv":
                body = [f"{lo} = {x[0][0]} // {c}", f"{hi} = {x[0][1]} // {c}"]
            else:
                body = [f"same = {x[0][0]} // {c} == {x[0][1]} // {c}",
                        f"{lo} = {x[0][0]} % {c} if same else 0", f"{hi} = {x[0][1]} % {c} if same else {c} - 1"]
        elif n in ("lt", "le", "gt", "ge"):
            a, b = (x[0], x[1]) if n in ("lt", "le") else (x[1], x[0])
            strict = n in ("lt", "gt")
            if strict:  # a < b
                body = [f"{lo} = 1 if {a[1]} < {b[0]} else 0", f"{hi} = 0 if {a[0]} >= {b[1]} else 1"]
            else:  # a <= b
                body = [f"{lo} = 1 if {a[1]} <= {b[0]} else 0", f"{hi} = 0 if {a[0]} > {b[1]} else 1"]
        elif n in ("eq", "ne"):
            exact = f"({x[0][0]} == {x[0][1]} and {x[1][0]} == {x[1][1]} and {x[0][0]} == {x[1][0]})"
            disjoint = f"({x[0][1]} < {x[1][0]} or {x[1][1]} < {x[0][0]})"
            if n == "eq":
                body = [f"{lo} = 1 if {exact} else 0", f"{hi} = 0 if {disjoint} else 1"]
            else:
                body = [f"{lo} = 1 if {disjoint} else 0", f"{hi} = 0 if {exact} else 1"]
        elif n == "and" and op.operands[0].type.dtype == "bool":
            body = [f"{lo} = min({x[0][0]}, {x[1][0]})", f"{hi} = min({x[0][1]}, {x[1][1]})"]
        elif n == "or" and op.operands[0].type.dtype == "bool":
            body = [f"{lo} = max({x[0][0]}, {x[1][0]})", f"{hi} = max({x[0][1]}, {x[1][1]})"]
        elif n == "not" and op.operands[0].type.dtype == "bool":
            body = [f"{lo} = 1 - {x[0][1]}", f"{hi} = 1 - {x[0][0]}"]
        elif n == "where":
            c, a, b = x
            body = [f"{lo} = {a[0]} if {c[0]} == 1 else ({b[0]} if {c[1]} == 0 else min({a[0]}, {b[0]}))",
                    f"{hi} = {a[1]} if {c[0]} == 1 else ({b[1]} if {c[1]} == 0 else max({a[1]}, {b[1]}))"]
        elif n == "cast" and not is_float(op.attrs["to"]) and not is_float(op.operands[0].type.dtype):
            if op.attrs["to"] == "bool":
                body = [f"{lo} = 1 if ({x[0][0]} > 0 or {x[0][1]} < 0) else 0",
                        f"{hi} = 0 if ({x[0][0]} == 0 and {x[0][1]} == 0) else 1"]
            else:  # the same values where they fit the target; else it wraps: its whole range (ir/intervals.py)
                tlo, thi = int_range(op.attrs["to"])
                fits = f"({x[0][0]} >= {tlo} and {x[0][1]} <= {thi})"
                body = [f"{lo} = {x[0][0]} if {fits} else {tlo}", f"{hi} = {x[0][1]} if {fits} else {thi}"]
        else:  # not modelled: this tile is partial (always safe)
            return lines[:1] + ["    return 1"]
        lines += ["    " + s for s in body]
        if wraps:  # integer arithmetic wraps (the element code's, the IR's): past the type's range, its whole range
            tlo, thi = int_range(rt)  # (ir/intervals.py)
            lines.append(f"    if {lo} < {tlo} or {hi} > {thi}:")
            lines.append(f"        {lo}, {hi} = {tlo}, {thi}")
        iv[op.results[0]] = (lo, hi)
        if n in _POINT_PRESERVING and op.operands and all(v in points for v in op.operands):
            points.add(op.results[0])  # (lo and hi are the same arithmetic of the same numbers: one value)
    return lines[:1] + ["    return 1"]


_POINT_PRESERVING = ("cast", "add", "sub", "mul", "neg", "min", "max", "abs", "floordiv", "mod")


def _range_lookup(table: str, rng: str, axis: int, granule: int, idx: list[tuple[str, str]], lo: str, hi: str
                  ) -> list[str]:
    """Lines bounding `table[idx]` by its range table `rng` (`RangeTable.lookup`): indices clamped as gather
    clamps them; an index off the axis that is not one point in this tile makes the tile partial."""
    body, where = [], []
    for d, (a, b) in enumerate(idx):
        if d == axis:
            body += [f"{lo}_g0 = min(max({a}, 0), {table}.shape[{d}] - 1) // {granule}",
                     f"{lo}_g1 = min(max({b}, 0), {table}.shape[{d}] - 1) // {granule}"]
            where.append("{g}")
        else:
            body += [f"if {a} != {b}:", "    return 1"] if a != b else []
            body += [f"{lo}_p{d} = min(max({a}, 0), {table}.shape[{d}] - 1)"]
            where.append(f"{lo}_p{d}")
    at = ", ".join(where)
    first, each = at.format(g=f"{lo}_g0"), at.format(g=f"{lo}_gi")
    return body + [f"{lo} = {rng}[{first}, 0]", f"{hi} = {rng}[{first}, 1]",
                   f"for {lo}_gi in range({lo}_g0 + 1, {lo}_g1 + 1):  # a tile spanning several granules",
                   f"    {lo} = min({lo}, {rng}[{each}, 0])", f"    {hi} = max({hi}, {rng}[{each}, 1])"]


def build_spec(low: Lowered, env: Mapping[str, int], dtype: str, path: str, num_warps: Optional[int],
               extra: Optional[dict] = None) -> FA2ForwardSpec:
    D = int(env["D"])
    info: dict = {}
    src = device_source(low, env, info, tanh_by_ex2(path, extra))
    # a 0-d capture is a 1-element array (cap_ref); only the sizes are scalar arguments
    caps = tuple(Capture(v.name or f"cap{i}", v.type.dtype, max(v.type.rank, 1)) for i, v in enumerate(low.captures))
    caps += tuple(Capture(f"dim_{d}", "i32", 0) for d in low.runtime_dims)  # sizes, passed as scalars
    caps += range_captures(low.captures, low.ranges, 0)  # made by the runtime from the captures (block_data.py)
    caps += run_captures(low.captures, low.runs, 0)
    caps += LIST_CAPTURES if low.block_mask == "list" else ()
    bq, bk = low.block_q, low.block_k
    if path == "simt" and bq % 32:
        raise BackendError(f"numba-cuda backend: the SIMT path needs block_q a multiple of 32, got {bq}")
    # 4 warps measured best on the H100 (two m16 fragments each at bq = 128; benchmarks/NOTES.md)
    nw = num_warps or (max(1, min(4, bq // 16)) if path == "mma" else 1)
    key = f"{print_func(low.func)}|{sorted(env.items())}|{dtype}|{path}|{nw}|{sorted((extra or {}).items())}"
    name = "fa2_" + low.func.name.replace("-", "_") + "_" + hashlib.sha1(key.encode()).hexdigest()[:10]
    if low.kv_parts > 1 and low.part_dtype != dtype:
        raise BackendError(f"numba-cuda backend: split-kv's parts are {low.part_dtype} but the inputs are {dtype}: "
                           f"the kernel stores each part through O's epilogue (split-kv{{part_dtype={dtype}}})")
    return FA2ForwardSpec(name=name, head_dim=D, dtype=dtype, path=path, block_q=bq, block_k=bk, num_warps=nw,
                          group_size=low.group, exp2=low.exp2, captures=caps, device_source=src,
                          has_mask=bool(low.conj), block_mask=low.block_mask if low.conj else "none",
                          batch_inner=batch_shared_table(low), score_scale=info["score_scale"],
                          lazy_rescale=low.lazy_rescale, ragged_q_first=low.ragged_q_first, kv_parts=low.kv_parts,
                          extra=dict(extra or {}))
