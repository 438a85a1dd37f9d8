"""Building IR: one `Builder` appends ops to a block and infers result types from the op table."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

from ..errors import VerifyError
from .core import Block, Func, Op, Value
from .dims import Const, Dim, DimLike, dim
from .ops import OPS, OpTypeError, const_type_of, tensor_core_operand_dtype
from .types import TensorType, scalar


def _normalize_attr(v: Any) -> Any:
    if isinstance(v, Const):
        return v.value
    if isinstance(v, list):
        return tuple(_normalize_attr(x) for x in v)
    if isinstance(v, tuple):
        return tuple(_normalize_attr(x) for x in v)
    return v


def normalize_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """False flags are dropped and constant dims become ints, so built and parsed IR compare equal. A
    constant's `value` is data, not a flag: `const false` keeps it."""
    return {k: _normalize_attr(v) for k, v in attrs.items() if (v is not False or k == "value") and v is not None}


class Builder:
    """Appends ops at the end of `block`."""

    def __init__(self, block: Block):
        self.block = block

    # ------------------------------------------------------------------------------------ generic
    def op(self, name: str, operands: Sequence[Value], result_types: Sequence[TensorType],
           attrs: Optional[dict[str, Any]] = None, regions: Optional[list[Block]] = None,
           names: Optional[Sequence[Optional[str]]] = None) -> Op:
        op = Op(name, list(operands), list(result_types), normalize_attrs(attrs or {}), regions,
                list(names) if names else None)
        return self.block.append(op)

    def emit(self, name: str, *operands: Value, name_hint: Optional[str] = None, **attrs: Any) -> Value:
        """An op with one result whose type the op table infers."""
        opdef = OPS.get(name)
        if opdef is None or opdef.infer is None:
            raise VerifyError(f"cannot build op {name!r} with emit()")
        attrs = normalize_attrs(attrs)
        try:
            (rtype,) = opdef.infer([v.type for v in operands], attrs)
        except OpTypeError as e:
            raise VerifyError(f"{name}: {e}") from None
        attrs.pop("type", None)
        return self.op(name, operands, [rtype], attrs, names=[name_hint]).result

    # ------------------------------------------------------------------------------------ data
    def const(self, value: Any, type: Optional[TensorType] = None, name_hint: Optional[str] = None) -> Value:
        if isinstance(value, Dim) and isinstance(value, Const):
            value = value.value
        if isinstance(value, float) and type is None:
            type = scalar("f32")
        type = type or const_type_of(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and type.dtype in ("f16", "bf16", "f32", "f64"):
            value = float(value)
        return self.op("const", [], [type], {"value": value}, names=[name_hint]).result

    def iota(self, axis: int, shape: Sequence[DimLike], name_hint: Optional[str] = None) -> Value:
        t = TensorType("i32", tuple(dim(d) for d in shape))
        return self.op("iota", [], [t], {"axis": axis}, names=[name_hint]).result

    def cast(self, x: Value, to: str) -> Value:
        if x.type.dtype == to:
            return x
        return self.emit("cast", x, to=to)

    def tile_iota(self, start: Value, axis: int, shape: Sequence[int], name_hint: Optional[str] = None) -> Value:
        t = TensorType("i32", tuple(dim(d) for d in shape))
        return self.op("tile.iota", [start], [t], {"axis": axis}, names=[name_hint]).result

    def tile_load(self, src: Value, index: Sequence[Value | int | str], name_hint: Optional[str] = None) -> Value:
        """`index` entries: a Value (a scalar index, the dim is dropped), (Value, size) or ":"."""
        spec, operands = _slice(index)
        return self.emit("tile.load", src, *operands, slice=spec, name_hint=name_hint)

    def tile_insert(self, dst: Value, tile: Value, index: Sequence[Any], name_hint: Optional[str] = None) -> Value:
        spec, operands = _slice(index)
        return self.emit("tile.insert", dst, tile, *operands, slice=spec, name_hint=name_hint)

    def tile_matmul(self, a: Value, b: Value, name_hint: Optional[str] = None, **attrs: Any) -> Value:
        """A tile product as the kernels compute it: an f32 tile times an f16 / bf16 one (or an f32 cast of one,
        as the backward's dO) takes both operands in the f16 / bf16 (`operand_dtype`, what the interpreter rounds
        them to), accumulating in f32."""
        od = tensor_core_operand_dtype(a.type, b.type) or tensor_core_operand_dtype(_stored(a), _stored(b))
        if od is not None:
            attrs.setdefault("operand_dtype", od)
        return self.emit("tile.matmul", a, b, name_hint=name_hint, **attrs)

    # ------------------------------------------------------------------------------ control flow
    def for_loop(self, lo: Value, hi: Value, inits: Sequence[Value],
                 body: Callable[["Builder", Value, list[Value]], Sequence[Value]],
                 iv_name: str = "kj", iter_names: Optional[Sequence[Optional[str]]] = None,
                 result_names: Optional[Sequence[Optional[str]]] = None, attrs: Optional[dict] = None) -> list[Value]:
        names = list(iter_names or [None] * len(inits))
        blk = Block([scalar("i32")] + [v.type for v in inits], [iv_name] + names)
        outs = body(Builder(blk), blk.args[0], blk.args[1:])
        Builder(blk).op("yield", list(outs), [])
        op = self.op("for", [lo, hi, *inits], [v.type for v in inits], attrs or {}, [blk],
                     names=result_names or names)
        return op.results

    def parallel_for(self, bounds: Sequence[DimLike], iv_names: Sequence[str], result_types: Sequence[TensorType],
                     body: Callable[..., Sequence[tuple[Value, Sequence[Any]]]],
                     result_names: Optional[Sequence[Optional[str]]] = None,
                     accumulators: Sequence[tuple[TensorType, str]] = ()) -> list[Value]:
        """`body(builder, ivs)` returns, per result, (tile, slice index) where the tile goes in the result.
        With `accumulators` ((type, name) each) the body is called as `body(builder, ivs, accumulators)` and
        the accumulators' sums are results after the stored ones."""
        blk = Block([scalar("i32")] * len(bounds) + [t for t, _ in accumulators],
                    list(iv_names) + [n for _, n in accumulators])
        ivs = blk.args[:len(bounds)]
        outs = body(Builder(blk), ivs, blk.args[len(bounds):]) if accumulators else body(Builder(blk), ivs)
        operands: list[Value] = []
        specs = []
        for tile, index in outs:
            spec, idx = _slice(index)
            operands += [tile, *idx]
            specs.append(spec)
        Builder(blk).op("tile.yield", operands, [], {"slices": tuple(specs)})
        attrs: dict[str, Any] = {"bounds": tuple(dim(b) for b in bounds)}
        if accumulators:
            attrs["accumulators"] = len(accumulators)
        names = list(result_names or [None] * len(result_types)) + [n.removesuffix("_acc") for _, n in accumulators]
        op = self.op("parallel_for", [], list(result_types) + [t for t, _ in accumulators], attrs, [blk], names=names)
        return op.results

    def if_(self, cond: Value, result_types: Sequence[TensorType],
            then: Callable[["Builder"], Sequence[Value]], orelse: Callable[["Builder"], Sequence[Value]],
            result_names: Optional[Sequence[Optional[str]]] = None) -> list[Value]:
        blocks = []
        for fn in (then, orelse):
            blk = Block()
            outs = fn(Builder(blk))
            Builder(blk).op("yield", list(outs), [])
            blocks.append(blk)
        return self.op("if", [cond], list(result_types), {}, blocks, names=result_names).results

    def isolated(self, name: str, operands: Sequence[Value], arg_names: Sequence[Optional[str]],
                 body: Callable[["Builder", list[Value]], Sequence[Value]], attrs: Optional[dict] = None,
                 result_types: Optional[Sequence[TensorType]] = None,
                 result_names: Optional[Sequence[Optional[str]]] = None,
                 arg_types: Optional[Sequence[TensorType]] = None) -> list[Value]:
        """An op whose region is a closed function of block arguments (fused, mask.*)."""
        blk = Block(list(arg_types or [v.type for v in operands]), list(arg_names))
        outs = body(Builder(blk), blk.args)
        Builder(blk).op("yield", list(outs), [])
        types = list(result_types) if result_types is not None else [v.type for v in outs]
        return self.op(name, list(operands), types, attrs or {}, [blk], names=result_names).results

    def ret(self, *values: Value) -> Op:
        return self.op("return", list(values), [])


def _slice(index: Sequence[Any]) -> tuple[tuple, list[Value]]:
    spec: list[Any] = []
    operands: list[Value] = []
    for e in index:
        if isinstance(e, str) and e == ":":
            spec.append(":")
        elif isinstance(e, Value):
            spec.append("i")
            operands.append(e)
        elif isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], Value):
            spec.append(int(e[1]))
            operands.append(e[0])
        else:
            raise VerifyError(f"bad slice entry {e!r}")
    return tuple(spec), operands


def new_func(name: str, args: Sequence[tuple[str, TensorType]]) -> tuple[Func, Builder, list[Value]]:
    """A function with named arguments and an empty body, and a builder at its end."""
    body = Block([t for _, t in args], [n for n, _ in args])
    func = Func(name, body)
    return func, Builder(body), body.args


NEG_INF = -math.inf


def _stored(v: Value) -> TensorType:
    """`v`'s type, or its source's where `v` is an f32 cast of an f16 / bf16 value (exact: the kernels keep the
    source's dtype for the tensor cores)."""
    op = v.owner
    if isinstance(op, Op) and op.name == "cast" and v.type.dtype == "f32" and op.operands[0].type.dtype in ("f16", "bf16"):
        return op.operands[0].type
    return v.type
