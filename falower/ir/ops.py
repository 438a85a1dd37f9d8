"""The op set: one table that says, for every op, its operands, its result types and where it is legal.

Levels: "graph" ops work on whole tensors and may not appear inside loops; "tile" ops exist only inside a
`parallel_for`; "any" ops (elementwise, reductions, constants, control flow) are shape-generic and appear
at every level. `infer` computes result types from operand types and attributes, raising `OpTypeError`
with a short reason; the verifier adds the op's location.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .dims import Const, Dim, cdiv, dim
from .types import FLOAT_DTYPES, INT_DTYPES, TensorType, broadcast_shapes, int_range, is_float, is_int, scalar


class OpTypeError(Exception):
    """Raised by an op's type rule; the verifier turns it into a VerifyError naming the op."""


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: str  # elementwise, reduce, contraction, data, control, terminator, mask
    level: str  # graph, tile, any
    infer: Optional[Callable[[list[TensorType], dict[str, Any]], list[TensorType]]]
    num_regions: int = 0
    isolated: bool = False  # regions see no values from outside (fused, mask.*)
    doc: str = ""


OPS: dict[str, OpDef] = {}


def _register(name: str, kind: str, level: str, infer, num_regions: int = 0, isolated: bool = False, doc: str = ""):
    OPS[name] = OpDef(name, kind, level, infer, num_regions, isolated, doc)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise OpTypeError(msg)


def _bcast(types: list[TensorType]) -> tuple[Dim, ...]:
    shape = broadcast_shapes(*[t.shape for t in types])
    _need(shape is not None, "operand shapes do not broadcast: " + ", ".join(str(t) for t in types))
    return shape  # type: ignore[return-value]


def _same_dtype(types: list[TensorType]) -> str:
    dtypes = {t.dtype for t in types}
    _need(len(dtypes) == 1, "operand dtypes differ: " + ", ".join(str(t) for t in types) + " (insert a cast)")
    return types[0].dtype


# --------------------------------------------------------------------------------------- elementwise
# tanh_approx: tanh by the hardware's approximation where a backend has one (the H100's MUFU.TANH, relative error
# documented by PTX as ~2^-11, measured 2^-16.5 on the H100: FlashAttention's and attention-gym's fast softcap); its
# definition, and the interpreter's value, is tanh
FLOAT_UNARY = ("exp", "exp2", "log", "log2", "tanh", "tanh_approx", "sigmoid", "erf", "sqrt", "sin", "cos", "tan", "log1p", "expm1",
               "rsqrt", "floor", "ceil", "round")
NUMERIC_UNARY = ("neg", "abs", "sign")
ARITH_BINARY = ("add", "sub", "mul", "max", "min")
FLOAT_BINARY = ("div", "pow")
INT_BINARY = ("floordiv", "mod", "shl", "shr")
LOGIC_BINARY = ("and", "or", "xor")  # logical on bool, bitwise on ints
COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")
ELEMENTWISE = FLOAT_UNARY + NUMERIC_UNARY + ("not", "cast") + ARITH_BINARY + FLOAT_BINARY + INT_BINARY \
    + LOGIC_BINARY + COMPARE + ("where",)


def _unary(allowed: tuple[str, ...]):
    def infer(ts, attrs):
        _need(len(ts) == 1, f"takes 1 operand, got {len(ts)}")
        _need(ts[0].dtype in allowed, f"operand dtype {ts[0].dtype} is not one of {', '.join(allowed)}")
        return [ts[0]]
    return infer


def _binary(allowed: tuple[str, ...], result: Optional[str] = None):
    def infer(ts, attrs):
        _need(len(ts) == 2, f"takes 2 operands, got {len(ts)}")
        dt = _same_dtype(ts)
        _need(dt in allowed, f"operand dtype {dt} is not one of {', '.join(allowed)}")
        return [TensorType(result or dt, _bcast(ts))]
    return infer


NUMERIC = FLOAT_DTYPES + INT_DTYPES
for _n in FLOAT_UNARY:
    _register(_n, "elementwise", "any", _unary(FLOAT_DTYPES))
for _n in NUMERIC_UNARY:
    _register(_n, "elementwise", "any", _unary(NUMERIC))
_register("not", "elementwise", "any", _unary(("bool",) + INT_DTYPES))
for _n in ARITH_BINARY:
    _register(_n, "elementwise", "any", _binary(NUMERIC))
for _n in FLOAT_BINARY:
    _register(_n, "elementwise", "any", _binary(FLOAT_DTYPES))
_INT_DOCS = {"floordiv": "floor division; by 0 it is 0 (numpy's)", "mod": "the floor division's remainder; by 0 it is 0",
             "shl": "two's complement shift left; a count outside 0 .. bits - 1 (negative too) gives 0 (numpy's)",
             "shr": "arithmetic shift right; a count outside 0 .. bits - 1 gives the sign (-1 or 0, numpy's)"}
for _n in INT_BINARY:
    _register(_n, "elementwise", "any", _binary(INT_DTYPES), doc=_INT_DOCS[_n])
for _n in LOGIC_BINARY:
    _register(_n, "elementwise", "any", _binary(("bool",) + INT_DTYPES))
for _n in COMPARE:  # == and != also between booleans (masks compared with masks)
    _register(_n, "elementwise", "any", _binary(NUMERIC + (("bool",) if _n in ("eq", "ne") else ()), result="bool"))


def _infer_cast(ts, attrs):
    _need(len(ts) == 1, "takes 1 operand")
    _need("to" in attrs, "needs attribute `to`")
    return [TensorType(attrs["to"], ts[0].shape)]


def _infer_where(ts, attrs):
    _need(len(ts) == 3, "takes 3 operands (cond, a, b)")
    _need(ts[0].dtype == "bool", f"condition must be bool, got {ts[0]}")
    dt = _same_dtype(ts[1:])
    return [TensorType(dt, _bcast(ts))]


_register("cast", "elementwise", "any", _infer_cast,
          doc="to `to`: a float to an integer truncated toward zero and saturated to the type's range (NaN to 0, as "
              "PTX's cvt.rzi); integers wrap to a narrower type (two's complement); to bool: nonzero")
_register("where", "elementwise", "any", _infer_where)


# ---------------------------------------------------------------------------------------- data ops
def _infer_const(ts, attrs):
    _need(not ts, "takes no operands")
    _need("value" in attrs and "type" in attrs, "needs `value` and a result type")
    t: TensorType = attrs["type"]
    v = attrs["value"]
    if isinstance(v, Dim):
        _need(is_int(t.dtype), "a dimension constant must have an integer type")
    elif isinstance(v, bool):
        _need(t.dtype == "bool", "a bool constant must have type bool")
    elif isinstance(v, int):
        _need(t.dtype != "bool", "an int constant cannot have type bool")
    elif isinstance(v, float):
        _need(is_float(t.dtype) or math.isfinite(v) and v == int(v), f"float value {v} for type {t}")
    else:
        raise OpTypeError(f"bad constant value {v!r}")
    if is_int(t.dtype) and not isinstance(v, Dim):  # (the interpreter's integers would wrap around)
        lo, hi = int_range(t.dtype)
        _need(lo <= v <= hi, f"integer constant {v} does not fit {t.dtype} ({lo} .. {hi})")
    return [t]


def _infer_iota(ts, attrs):
    _need(not ts, "takes no operands")
    t: TensorType = attrs["type"]
    _need(is_int(t.dtype), "iota has an integer type")
    axis = attrs.get("axis")
    _need(isinstance(axis, int) and 0 <= axis < t.rank, f"axis {axis} out of range for {t}")
    return [t]


def _infer_gather(ts, attrs):
    _need(len(ts) >= 2, "takes a table and one index per table dimension")
    table, idx = ts[0], ts[1:]
    _need(len(idx) == table.rank, f"table {table} has rank {table.rank} but {len(idx)} indices are given")
    for t in idx:
        _need(is_int(t.dtype), f"gather index must be an integer, got {t}")
    return [TensorType(table.dtype, _bcast(idx))]


def _check_operand_dtype(a: TensorType, b: TensorType, od: Any) -> None:
    """operand_dtype, where given: f16 or bf16, the dtype of any operand that is not f32 (rounding an f16 operand to
    bf16, or f64 ones at all, is no tensor-core product)."""
    if od is None:
        return
    _need(od in TENSOR_CORE_DTYPES, f"operand_dtype must be \"f16\" or \"bf16\", got {od!r}")
    for t in (a, b):
        _need(t.dtype in ("f32", od), f"operand_dtype = \"{od}\" on an operand of {t}: the tensor cores take "
                                      f"{od} operands, computed in f32 or stored in {od}")


def _infer_matmul(ts, attrs):
    _need(len(ts) == 2, "takes 2 operands")
    a, b = ts
    _need(is_float(a.dtype) and is_float(b.dtype), "operands must be floats")
    _need(a.rank >= 2 and b.rank >= 2, "operands must have rank >= 2")
    _check_operand_dtype(a, b, attrs.get("operand_dtype"))
    am, ak = (a.shape[-1], a.shape[-2]) if attrs.get("transpose_a") else (a.shape[-2], a.shape[-1])
    bk, bn = (b.shape[-1], b.shape[-2]) if attrs.get("transpose_b") else (b.shape[-2], b.shape[-1])
    _need(ak == bk, f"contraction dims differ: {ak} vs {bk}")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    _need(batch is not None, f"batch dims do not broadcast: {a} and {b}")
    # f32 accumulation, f64 when an operand is f64 (gradcheck's precision all the way through)
    out = attrs.get("out_dtype", "f64" if "f64" in (a.dtype, b.dtype) else "f32")
    return [TensorType(out, tuple(batch) + (am, bn))]  # type: ignore[arg-type]


def _infer_graph_matmul(ts, attrs):
    """A graph product says operand_dtype only where it mixes f32 with f16 / bf16 (raise_operand_cast's products: the
    tile passes derive their products' operand_dtype from the tiles' dtypes, so any other would be dropped)."""
    od = attrs.get("operand_dtype")
    if od is not None and len(ts) == 2:
        _need(tensor_core_operand_dtype(ts[0], ts[1]) == od,
              f"operand_dtype = \"{od}\" on a product of {ts[0]} and {ts[1]}: a graph product rounds only an f32 "
              f"operand to the other's f16 / bf16")
    return _infer_matmul(ts, attrs)


def _infer_repeat(ts, attrs):
    _need(len(ts) == 1, "takes 1 operand")
    t = ts[0]
    axis, reps = attrs.get("axis"), attrs.get("repeats")
    _need(isinstance(axis, int) and 0 <= axis < t.rank, f"axis {axis} out of range for {t}")
    _need(isinstance(reps, int) and reps >= 1, "repeats must be a positive int")
    shape = list(t.shape)
    shape[axis] = shape[axis] * reps
    return [TensorType(t.dtype, tuple(shape))]


def _infer_reduce(ts, attrs):
    _need(len(ts) == 1, "takes 1 operand")
    t = ts[0]
    _need(t.dtype in NUMERIC, "reduces numbers")
    axis = attrs.get("axis")
    _need(isinstance(axis, int) and 0 <= axis < t.rank, f"axis {axis} out of range for {t}")
    shape = list(t.shape)
    shape[axis] = Const(1)  # reductions keep the axis (size 1) so results broadcast back
    return [TensorType(t.dtype, tuple(shape))]


def _infer_softmax(ts, attrs):
    _need(len(ts) == 1, "takes 1 operand")
    _need(is_float(ts[0].dtype), "softmax needs a float operand")
    axis = attrs.get("axis")
    _need(isinstance(axis, int) and 0 <= axis < ts[0].rank, f"axis {axis} out of range for {ts[0]}")
    return [ts[0]]


def _infer_squeeze(ts, attrs):
    _need(len(ts) == 1, "takes 1 operand")
    axis = attrs.get("axis")
    _need(isinstance(axis, int) and 0 <= axis < ts[0].rank, f"axis {axis} out of range for {ts[0]}")
    _need(ts[0].shape[axis] == Const(1), f"axis {axis} of {ts[0]} does not have size 1")
    return [TensorType(ts[0].dtype, ts[0].shape[:axis] + ts[0].shape[axis + 1:])]


def _infer_unsqueeze(ts, attrs):
    _need(len(ts) == 1, "takes 1 operand")
    axis = attrs.get("axis")
    _need(isinstance(axis, int) and 0 <= axis <= ts[0].rank, f"axis {axis} out of range for {ts[0]}")
    return [TensorType(ts[0].dtype, ts[0].shape[:axis] + (Const(1),) + ts[0].shape[axis:])]


def _infer_scatter_add(ts, attrs):
    _need(len(ts) >= 3, "takes a table, the updates and one index per table dimension")
    table, upd, idx = ts[0], ts[1], ts[2:]
    _need(is_float(table.dtype), f"the table must be a float tensor, got {table}")
    _need(upd.dtype == table.dtype, f"updates {upd} and table {table} have different dtypes (insert a cast)")
    _need(len(idx) == table.rank, f"table {table} has rank {table.rank} but {len(idx)} indices are given")
    for t in idx:
        _need(is_int(t.dtype), f"scatter_add index must be an integer, got {t}")
    _bcast([upd] + list(idx))
    return [table]


def _infer_group_sum(ts, attrs):
    _need(len(ts) == 1, "takes 1 operand")
    t = ts[0]
    _need(t.dtype in NUMERIC, "sums numbers")
    axis, size = attrs.get("axis"), attrs.get("size")
    _need(isinstance(axis, int) and 0 <= axis < t.rank, f"axis {axis} out of range for {t}")
    _need(isinstance(size, int) and size >= 1, "size must be a positive int")
    d = t.shape[axis]
    _need(not isinstance(d, Const) or d.value % size == 0, f"axis {axis} of {t} is not a multiple of {size}")
    shape = list(t.shape)
    shape[axis] = d // size
    return [TensorType(t.dtype, tuple(shape))]


_register("squeeze", "data", "any", _infer_squeeze, doc="drop a size-1 axis (LSE rows)")
_register("unsqueeze", "data", "any", _infer_unsqueeze, doc="insert a size-1 axis (the adjoint of squeeze; a saved LSE row broadcast against [B,H,M,N])")
_register("const", "data", "any", _infer_const, doc="a constant filling its type (a scalar, or a tile)")
_register("iota", "data", "graph", _infer_iota, doc="the index along `axis`, broadcastable (b, h, q_idx, kv_idx)")
_register("gather", "data", "any", _infer_gather, doc="table[i0, i1, ...], indices broadcast and clamped")
_register("matmul", "contraction", "graph", _infer_graph_matmul, doc="batched matmul, f32 accumulation")
_register("repeat_interleave", "data", "graph", _infer_repeat, doc="GQA: repeat kv heads for query heads")
_register("group_sum", "reduce", "graph", _infer_group_sum,
          doc="sum each run of `size` consecutive entries along `axis` (the adjoint of repeat_interleave: GQA)")
_register("scatter_add", "data", "any", _infer_scatter_add,
          doc="table + updates added at [i0, i1, ...] (indices broadcast and clamped as gather's; the adjoint "
              "of gather)")
_register("reduce_max", "reduce", "any", _infer_reduce)
_register("reduce_sum", "reduce", "any", _infer_reduce)
_register("softmax", "reduce", "graph", _infer_softmax)


# -------------------------------------------------------------------------------------- tile ops
def _slice_shape(src: TensorType, spec: tuple, n_idx: int) -> tuple[Dim, ...]:
    _need(len(spec) == src.rank, f"slice has {len(spec)} entries for a rank-{src.rank} tensor")
    _need(sum(1 for s in spec if s != ":") == n_idx, "slice needs one index operand per non-`:` entry")
    shape = []
    for s, d in zip(spec, src.shape):
        if s == ":":
            shape.append(d)
        elif s == "i":
            continue
        else:
            _need(isinstance(s, int) and s > 0, f"bad slice entry {s!r}")
            shape.append(Const(s))
    return tuple(shape)


def _infer_tile_load(ts, attrs):
    _need(len(ts) >= 1, "takes a source")
    for t in ts[1:]:
        _need(t.dtype == "i32" and t.is_scalar, f"slice offsets are i32 scalars, got {t}")
    return [TensorType(ts[0].dtype, _slice_shape(ts[0], attrs.get("slice", ()), len(ts) - 1))]


def _infer_tile_insert(ts, attrs):
    _need(len(ts) >= 2, "takes a destination and a tile")
    dst, tile = ts[0], ts[1]
    for t in ts[2:]:
        _need(t.dtype == "i32" and t.is_scalar, f"slice offsets are i32 scalars, got {t}")
    shape = _slice_shape(dst, attrs.get("slice", ()), len(ts) - 2)
    _need(tile.shape == shape and tile.dtype == dst.dtype, f"tile {tile} does not fit slice of {dst}")
    return [dst]


def _infer_tile_iota(ts, attrs):
    _need(len(ts) == 1 and ts[0].is_scalar and ts[0].dtype == "i32", "takes one i32 start")
    t: TensorType = attrs["type"]
    _need(t.static_shape() is not None, "a tile.iota has a static shape")
    axis = attrs.get("axis")
    _need(isinstance(axis, int) and 0 <= axis < t.rank, f"axis {axis} out of range for {t}")
    return [t]


TENSOR_CORE_DTYPES = ("f16", "bf16")


def tensor_core_operand_dtype(a: TensorType, b: TensorType) -> Optional[str]:
    """The dtype a tile product of `a` and `b` takes its operands in on the kernels' tensor cores: an f16 / bf16
    operand's, where the other is f32 (P and dS, computed in f32, rounded for P @ V, dS @ K, ...: FlashAttention's
    design); None where the two share a dtype (nothing to round) or one is f64 (gradcheck's precision)."""
    other = {a.dtype, b.dtype} - {"f32"}
    return other.pop() if len(other) == 1 and other <= set(TENSOR_CORE_DTYPES) and "f32" in (a.dtype, b.dtype) \
        else None


def _infer_tile_matmul(ts, attrs):
    _need(len(ts) == 2 and ts[0].rank == 2 and ts[1].rank == 2, "multiplies two 2-d tiles")
    _need(any(isinstance(d, Const) for t in ts for d in t.shape), "needs tiles (a static tile size), not whole tensors")
    _need_tensor_core_operands(ts, attrs.get("operand_dtype"))
    return _infer_matmul(ts, attrs)


def _need_tensor_core_operands(ts, od: Any) -> None:
    """A product of an f32 value with an f16 / bf16 one says the f16 / bf16 as its operand_dtype (the kernels round
    the f32 operand)."""
    want = tensor_core_operand_dtype(ts[0], ts[1])
    if want is not None:
        _need(od == want, f"the product of {ts[0]} and {ts[1]} takes its operands in {want} on the tensor cores: "
                          f"say operand_dtype = \"{want}\" (the kernels round the f32 operand; found {od!r})")


def _infer_tile_atomic_add(ts, attrs):
    _need(len(ts) >= 2, "takes an accumulator and a tile")
    acc, tile = ts[0], ts[1]
    for t in ts[2:]:
        _need(t.dtype == "i32" and t.is_scalar, f"slice offsets are i32 scalars, got {t}")
    shape = _slice_shape(acc, attrs.get("slice", ()), len(ts) - 2)
    _need(tuple(tile.shape) == tuple(shape), f"tile {tile} does not fit the slice {list(shape)} of {acc}")
    _need(acc.dtype in ("f32", "f64") and tile.dtype == acc.dtype, "accumulates f32 into f32 (or f64 into f64)")
    return []


def _infer_tile_scatter_add(ts, attrs):
    _need(len(ts) >= 2, "takes an accumulator, values and one index per accumulator dimension")
    acc, val, idx = ts[0], ts[1], ts[2:]
    _need(len(idx) == acc.rank, f"accumulator {acc} has rank {acc.rank} but {len(idx)} indices are given")
    for t in idx:
        _need(is_int(t.dtype), f"scatter index must be an integer, got {t}")
    _need(acc.dtype in ("f32", "f64") and is_float(val.dtype), "adds float values into an f32 (or f64) accumulator")
    _bcast(list(idx) + [val])
    return []


_register("tile.load", "data", "tile", _infer_tile_load, doc="a (ragged, zero-padded) tile of a tensor")
_register("tile.insert", "data", "tile", _infer_tile_insert, doc="a tensor with a tile written into it")
_register("tile.iota", "data", "tile", _infer_tile_iota, doc="start + index along `axis` of a tile")
_register("tile.matmul", "contraction", "tile", _infer_tile_matmul, doc="tile product, f32 accumulation; operand_dtype: both operands rounded to it first (the tensor cores' "
          "f16 / bf16 operands)")
_register("tile.scatter_add", "data", "tile", _infer_tile_scatter_add,
          doc="acc[i0, i1, ...] += values, indices broadcast and clamped as gather's (a captured table's gradient)")
_register("tile.atomic_add", "data", "tile", _infer_tile_atomic_add,
          doc="add a tile into a parallel_for accumulator (the iterations' sum; atomics on a GPU)")


# ---------------------------------------------------------------------------------- control flow
_register("fused", "control", "any", None, num_regions=1, isolated=True,
          doc="an elementwise function of its operands (the score function)")
_register("for", "control", "any", None, num_regions=1, doc="sequential loop with iter_args")
_register("parallel_for", "control", "graph", None, num_regions=1, doc="independent iterations over a grid")
_register("if", "control", "any", None, num_regions=2)
_register("yield", "terminator", "any", None)
_register("tile.yield", "terminator", "tile", None, doc="parallel_for terminator: tiles into result slices")
_register("return", "terminator", "graph", None)
_register("mask.classify", "mask", "tile", None, num_regions=1, isolated=True,
          doc="0 empty / 1 partial / 2 full, by interval analysis of the mask (kv bound included) over one "
              "tile pair's rows from max(q0, 0) (rows before 0 produce no output): a sound answer for the classes "
              "Interpreter.block_classes defines")
_register("mask.kv_range", "mask", "tile", None, num_regions=1, isolated=True,
          doc="first and past-last kv tile that is not empty, for one q tile")
_register("mask.q_range", "mask", "tile", None, num_regions=1, isolated=True,
          doc="first and past-last q tile that is not empty, for one kv tile (the backward's kv-outer loop)")
def _infer_mask_ranges(ts, attrs):
    _need(len(ts) == 1, "takes one captured table")
    (t,) = ts
    axis, g = attrs.get("axis"), attrs.get("granule")
    _need(isinstance(axis, int) and 0 <= axis < t.rank, f"axis {axis!r} out of range for {t}")
    _need(isinstance(g, int) and g >= 1, f"granule must be a positive int, got {g!r}")
    shape = list(t.shape)
    shape[axis] = cdiv(shape[axis], g)
    return [TensorType("i8" if t.dtype == "bool" else t.dtype, (*shape, dim(2)))]


_register("mask.ranges", "mask", "graph", _infer_mask_ranges,
          doc="least and greatest entry of a captured table per granule of one axis ([..., 2], min then max): "
              "what lets mask.classify bound a gather of run-time data by interval arithmetic")
_register("mask.block_table", "mask", "graph", None, num_regions=1, isolated=True,
          doc="exact per-tile classes of a data-dependent mask from the data at run time: rows q < M, every "
              "column of the kv tile, the kv bound included (a ragged kv tile is never full)")

TERMINATORS = ("yield", "tile.yield", "return")


def const_type_of(value: Any) -> TensorType:
    """The natural scalar type of a Python constant."""
    if isinstance(value, bool):
        return scalar("bool")
    if isinstance(value, (int, Dim)):
        return scalar("i32")
    return scalar("f32")


__all__ = ["OPS", "OpDef", "OpTypeError", "ELEMENTWISE", "TERMINATORS", "const_type_of", "dim"]
