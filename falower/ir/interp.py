"""The reference interpreter: the definition of what every op means, at every level, in numpy.

`precision="f64"` computes every float in float64 (the reference the passes are checked against);
`precision="native"` keeps each value in its declared dtype (f16 rounded, bf16 emulated in float32,
contractions accumulating in float32), which is what a kernel computes. Shapes are bound from the inputs.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..errors import FalowerError, ShapeError
from . import intervals
from .core import Block, Func, Op, Value
from .dims import Dim, dim, solve_dims
from .types import TensorType, int_range, is_float, numpy_dtype


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bf16 (ties to even), kept in float32."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    out = rounded.view(np.float32)
    return np.where(np.isnan(x), x, out)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """`x` rounded to f16 (as float16) or bf16 (kept in float32): the low precisions' stores and the tensor cores'
    operands (tile.matmul's operand_dtype)."""
    return round_bf16(x.astype(np.float32)) if dtype == "bf16" else x.astype(np.float16)


_UNARY = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2,
    "tanh": np.tanh, "tanh_approx": np.tanh, "sqrt": np.sqrt, "sigmoid": lambda a: 1.0 / (1.0 + np.exp(-a)),
    "erf": lambda a: _erf(a), "not": lambda a: np.logical_not(a) if a.dtype == np.bool_ else np.invert(a),
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "log1p": np.log1p, "expm1": np.expm1,
    "rsqrt": lambda a: 1.0 / np.sqrt(a), "sign": np.sign, "floor": np.floor, "ceil": np.ceil,
    "round": np.round,  # half to even, as torch.round
}
_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "max": np.maximum,
    "min": np.minimum, "pow": np.power, "floordiv": np.floor_divide, "mod": np.mod,
    "shl": np.left_shift, "shr": np.right_shift, "eq": np.equal, "ne": np.not_equal, "lt": np.less,
    "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
}
# and / or / xor: (on booleans, on integers)
_LOGICAL = {"and": (np.logical_and, np.bitwise_and), "or": (np.logical_or, np.bitwise_or),
            "xor": (np.logical_xor, np.bitwise_xor)}
# (interpreter class, op name) -> its op_<name> method, or False for the elementwise rules (looked up once)
_HANDLERS: dict = {}
PRECISIONS = ("f64", "native", "low:f16", "low:bf16")


class PrecisionError(FalowerError, ValueError):
    """An interpreter precision that is not one of PRECISIONS (a ValueError too, as it always was)."""


def check_input(name: str, x: Any, t: TensorType) -> np.ndarray:
    """`x` as an array, or a ShapeError when its kind of values cannot be `t`'s: a float input takes float arrays
    of any width (and Python numbers), an int input takes integer arrays whose values fit, a bool input bools.
    Nothing is converted silently: bf16 given as uint16 bits, float ids, wrapping int64 ids are refused."""
    python_number = isinstance(x, (int, float)) and not isinstance(x, bool)
    try:
        a = np.asarray(x)
    except ValueError as e:  # a ragged nested list
        raise ShapeError(f"input %{name} ({t}) is not an array: {e}") from None
    kind, dt = a.dtype.kind, t.dtype
    if is_float(dt):
        ok = kind == "f" or (python_number and kind in "iu")
        hint = " (bf16 is given as float32 or float16 values, not as raw bits)" if kind == "u" and \
            a.dtype.itemsize == 2 else ""
        if not ok:
            raise ShapeError(f"input %{name} ({t}) expects float values, got {_what(x, a)}{hint}")
        return a
    if dt == "bool":
        if kind != "b":
            raise ShapeError(f"input %{name} ({t}) expects bool values, got {_what(x, a)}")
        return a
    if kind not in "iu":
        raise ShapeError(f"input %{name} ({t}) expects integer values, got {_what(x, a)}")
    lo, hi = int_range(dt)
    if a.size and (a.dtype.itemsize > numpy_dtype(dt).itemsize or kind == "u") and \
            (int(a.min()) < lo or int(a.max()) > hi):
        raise ShapeError(f"input %{name} ({t}) holds {dt} values, but its values span "
                         f"{int(a.min())}..{int(a.max())}, outside {lo}..{hi}")
    return a


def _what(x: Any, a: np.ndarray) -> str:
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return f"{type(x).__name__} of dtype {a.dtype}"
    return f"{type(x).__name__} (as an array, dtype {a.dtype})"


class Interpreter:
    def __init__(self, precision: str = "f64"):
        if not isinstance(precision, str):  # interpret(func, q, k, v): the inputs given one by one
            raise PrecisionError(f"the precision must be a str ('f64', 'native', 'low:f16' or 'low:bf16'), got "
                                 f"{type(precision).__name__}: pass the inputs as one list, interpret(func, [q, k, v])")
        if precision not in PRECISIONS:
            raise PrecisionError(f"unknown precision {precision!r}: it is 'f64', 'native', 'low:f16' or 'low:bf16'")
        self.precision = precision
        # "low:<dtype>": naive attention in that precision, every float result rounded to it
        # (computed in float32, as cuBLAS and torch do for f16 and bf16). FlashAttention's error rule
        # compares a kernel with this.
        self.low = precision.split(":")[1] if precision.startswith("low:") else None
        self.env_dims: dict[str, int] = {}
        self._made: dict[int, tuple[Op, np.ndarray]] = {}  # const / iota values of this run (_made_once)

    # ------------------------------------------------------------------------------------ dtypes
    def store(self, x: Any, t: TensorType) -> np.ndarray:
        """A value as its type holds it."""
        x = np.asarray(x)
        if t.dtype == "bool":
            return x.astype(np.bool_)
        if not is_float(t.dtype):
            return x.astype(numpy_dtype(t.dtype))
        if self.precision == "f64":
            return x.astype(np.float64)
        if self.low is not None and t.dtype != "f64":
            return round_to(x, self.low)
        if t.dtype == "bf16":
            return round_bf16(x.astype(np.float32))
        return x.astype(numpy_dtype(t.dtype))

    def compute_dtype(self, t: TensorType) -> Any:
        if self.precision == "f64" or t.dtype == "f64":
            return np.float64
        return np.float32

    # ------------------------------------------------------------------------------------- entry
    def run(self, func: Func, inputs: Sequence[Any], dims: Optional[Mapping[str, int]] = None) -> list[np.ndarray]:
        if not isinstance(func, Func):
            raise FalowerError(f"interpret: the graph must be a falower Func, got {type(func).__name__}")
        if isinstance(inputs, (str, bytes, np.ndarray)) or not hasattr(inputs, "__len__"):
            raise FalowerError(f"interpret: the inputs must be a list of arrays, got {type(inputs).__name__}")
        args = func.args
        if len(inputs) != len(args):
            names = ", ".join(a.name or "?" for a in args)
            raise ShapeError(f"@{func.name} takes {len(args)} inputs ({names}), got {len(inputs)}")
        pairs: list[tuple[Dim, int]] = []
        arrays = []
        for a, x in zip(args, inputs):
            x = check_input(a.name or "?", x, a.type)
            if x.ndim != a.type.rank:
                raise ShapeError(f"input %{a.name} must have rank {a.type.rank} ({a.type}), got shape {x.shape}")
            for axis, (d, n) in enumerate(zip(a.type.shape, x.shape)):
                if n < 1:
                    raise ShapeError(f"input %{a.name} has size {n} along dimension {d} (axis {axis}) of {a.type}: "
                                     "sizes must be positive")
            pairs += list(zip(a.type.shape, x.shape))
            arrays.append(x)
        for name, n in (dims or {}).items():
            if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n < 1:
                raise ShapeError(f"dimension {name} = {n}: sizes must be positive")
        self.env_dims = solve_dims(pairs, dict(dims or {}))
        self._made = {}
        env: dict[Value, np.ndarray] = {}
        for a, x in zip(args, arrays):
            env[a] = self.store(x, a.type)
        outs = self.block(func.body, env)
        self.top_env = env
        return [o if o.flags.writeable else o.copy() for o in outs]

    def _made_once(self, op: Op, make: Any) -> np.ndarray:
        """The value of a const or iota op, made once a run (a loop's body re-ran them every iteration) and
        read-only, so that an op writing into it in place would raise instead of changing it for the next."""
        hit = self._made.get(id(op))
        if hit is None:
            arr = make()
            arr.flags.writeable = False
            hit = self._made[id(op)] = (op, arr)  # the op kept alive with its id
        return hit[1]

    def block(self, blk: Block, env: dict[Value, np.ndarray]) -> list[np.ndarray]:
        self.last_env = env
        for op in blk.ops:
            if op.name in ("yield", "return"):
                return [env[v] for v in op.operands]
            if op.name == "tile.yield":
                return [env[v] for v in op.operands]
            results = self.op(op, env)
            for r, x in zip(op.results, results):
                env[r] = x
        raise ValueError("block without terminator")

    def shape(self, t: TensorType, what: str = "a value") -> tuple[int, ...]:
        """`t`'s sizes at this run's dims; a ShapeError naming `what` (an op) when a dim cannot be a size."""
        sizes = []
        for d in t.shape:
            try:
                n = d.eval(self.env_dims)
            except ShapeError as e:
                raise ShapeError(f"{what}: type {t}: {e}") from None
            if n < 0:
                env = ", ".join(f"{k}={self.env_dims[k]}" for k in sorted(d.symbols()) if k in self.env_dims)
                raise ShapeError(f"{what}: type {t}: dimension {d} = {n} with {env}: sizes cannot be negative")
            sizes.append(n)
        return tuple(sizes)

    # --------------------------------------------------------------------------------------- ops
    def op(self, op: Op, env: dict[Value, np.ndarray]) -> list[np.ndarray]:
        x = [env[v] for v in op.operands]
        n = op.name
        key = (type(self), n)
        handler = _HANDLERS.get(key)
        if handler is None:
            handler = _HANDLERS[key] = getattr(type(self), "op_" + n.replace(".", "_"), False)
        if handler:
            return handler(self, op, x, env)
        rt = op.results[0].type if op.results else None
        with np.errstate(all="ignore"):
            y = self.elementwise(n, op, x, rt)
        return [self.store(y, rt)]  # type: ignore[arg-type]

    def elementwise(self, n: str, op: Op, x: list[np.ndarray], rt: Optional[TensorType]) -> np.ndarray:
        if rt is not None and is_float(rt.dtype) and n not in ("cast", "where"):
            cd = self.compute_dtype(rt)
            x = [a.astype(cd) if a.dtype.kind == "f" else a for a in x]
        if n in _UNARY:
            return _UNARY[n](x[0])
        if n in _BINARY:
            return _BINARY[n](x[0], x[1])
        if n in _LOGICAL:
            f = _LOGICAL[n]
            return f[0](x[0], x[1]) if x[0].dtype == np.bool_ else f[1](x[0], x[1])
        if n == "where":
            return np.where(x[0], x[1], x[2])
        if n == "cast":
            src = x[0]
            if src.dtype.kind == "f" and rt is not None and not is_float(rt.dtype) and rt.dtype != "bool":
                lo, hi = int_range(rt.dtype)  # toward zero, saturated, NaN to 0 (the op's definition, PTX's cvt.rzi)
                src = np.clip(np.trunc(np.nan_to_num(src.astype(np.float64), nan=0.0)), lo, hi)
            return src
        raise NotImplementedError(f"the interpreter has no rule for {n}")

    def op_const(self, op: Op, x, env) -> list[np.ndarray]:
        def make() -> np.ndarray:
            t = op.results[0].type
            v = op.attrs["value"]
            if isinstance(v, Dim):
                v = v.eval(self.env_dims)
            return self.store(np.full(self.shape(t, "const"), v), t)

        return [self._made_once(op, make)]

    def op_iota(self, op: Op, x, env) -> list[np.ndarray]:
        def make() -> np.ndarray:
            shape = self.shape(op.results[0].type, op.name)
            axis = op.attrs["axis"]
            view = [1] * len(shape)
            view[axis] = shape[axis]
            return np.broadcast_to(np.arange(shape[axis], dtype=np.int32).reshape(view), shape).copy()

        return [self._made_once(op, make)]

    def op_tile_iota(self, op: Op, x, env) -> list[np.ndarray]:
        (r,) = self.op_iota(op, x, env)
        return [(r + x[0]).astype(np.int32)]

    def op_gather(self, op: Op, x, env) -> list[np.ndarray]:
        table, idx = x[0], x[1:]
        clipped = [np.clip(i, 0, table.shape[d] - 1) for d, i in enumerate(idx)]
        return [self.store(table[tuple(clipped)], op.results[0].type)]

    def _matmul(self, op: Op, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        cd = self.compute_dtype(op.results[0].type)  # f64 products accumulate in f64 (f32 lost ~1e-7)
        od = op.attrs.get("operand_dtype")
        if od is not None and self.precision != "f64":  # the tensor cores' operands (f64: the exact reference)
            a, b = round_to(a, od), round_to(b, od)
        a, b = a.astype(cd), b.astype(cd)
        if op.attrs.get("transpose_a"):
            a = np.swapaxes(a, -1, -2)
        if op.attrs.get("transpose_b"):
            b = np.swapaxes(b, -1, -2)
        return self.store(np.matmul(a, b), op.results[0].type)

    def op_matmul(self, op: Op, x, env) -> list[np.ndarray]:
        return [self._matmul(op, x[0], x[1])]

    op_tile_matmul = op_matmul

    def op_squeeze(self, op: Op, x, env) -> list[np.ndarray]:
        return [np.squeeze(x[0], axis=op.attrs["axis"])]

    def op_unsqueeze(self, op: Op, x, env) -> list[np.ndarray]:
        return [np.expand_dims(x[0], axis=op.attrs["axis"])]

    def op_repeat_interleave(self, op: Op, x, env) -> list[np.ndarray]:
        return [np.repeat(x[0], op.attrs["repeats"], axis=op.attrs["axis"])]

    def op_group_sum(self, op: Op, x, env) -> list[np.ndarray]:
        """Sums of `size` consecutive entries along `axis`: x[.., g*size : (g+1)*size, ..] summed for each g."""
        t = op.results[0].type
        a, axis, size = x[0], op.attrs["axis"], op.attrs["size"]
        if a.shape[axis] % size:
            raise ShapeError(f"group_sum: axis {axis} has size {a.shape[axis]}, not a multiple of {size}")
        if a.dtype.kind == "f":
            a = a.astype(self.compute_dtype(t))
        groups = a.reshape(a.shape[:axis] + (a.shape[axis] // size, size) + a.shape[axis + 1:])
        return [self.store(groups.sum(axis=axis + 1), t)]

    def op_scatter_add(self, op: Op, x, env) -> list[np.ndarray]:
        """The table with every update added at its (clamped, as in gather) indices; repeated indices add up.
        Updates and indices broadcast together: each element of the broadcast adds once."""
        t = op.results[0].type
        cd = self.compute_dtype(t)
        out = x[0].astype(cd)  # a copy: the op is pure
        _scatter_into(out, x[1].astype(cd), x[2:])
        return [self.store(out, t)]

    def _reduce(self, op: Op, a: np.ndarray, f) -> list[np.ndarray]:
        t = op.results[0].type
        if f is np.max and a.shape[op.attrs["axis"]] == 0:
            raise ShapeError(f"{op.name}: the maximum over axis {op.attrs['axis']} of a {list(a.shape)} tensor, "
                             "which has no entries")
        if a.dtype.kind == "f":
            a = a.astype(self.compute_dtype(t))
        return [self.store(f(a, axis=op.attrs["axis"], keepdims=True), t)]

    def op_reduce_max(self, op: Op, x, env) -> list[np.ndarray]:
        return self._reduce(op, x[0], np.max)

    def op_reduce_sum(self, op: Op, x, env) -> list[np.ndarray]:
        return self._reduce(op, x[0], np.sum)

    def op_softmax(self, op: Op, x, env) -> list[np.ndarray]:
        """Softmax with falower's rule for a row whose every entry is -inf: all zeros, never NaN."""
        t = op.results[0].type
        a = x[0].astype(self.compute_dtype(t))
        axis = op.attrs["axis"]
        with np.errstate(all="ignore"):
            m = np.max(a, axis=axis, keepdims=True)
            m = np.where(np.isneginf(m), 0.0, m)
            e = np.exp(a - m)
            s = np.sum(e, axis=axis, keepdims=True)
            p = e / np.where(s == 0, 1.0, s)
        return [self.store(p, t)]

    # ------------------------------------------------------------------------------------- tiles
    def _slices(self, shape: tuple[int, ...], spec: tuple, idx: list[np.ndarray], what: str = "a tile op"):
        """Source slices, the part of the tile they fill, and the tile's shape (ragged tiles clip); `what` names
        the op for the ShapeError an index out of range raises."""
        src, dst, tile_shape = [], [], []
        it = iter(idx)
        for s, size in zip(spec, shape):
            if s == ":":
                src.append(slice(None))
                dst.append(slice(None))
                tile_shape.append(size)
            elif s == "i":
                i = int(next(it))
                if not 0 <= i < size:
                    axis = len(src)
                    raise ShapeError(f"{what}: index {i} on axis {axis} of a {list(shape)} tensor is out of range "
                                     f"0..{size - 1}")
                src.append(i)
            else:  # rows of the tile before 0 (tile{ragged_q=first}) or past the axis are padding
                start = int(next(it))
                lo, stop = max(start, 0), min(start + s, size)
                n = max(stop - lo, 0)
                src.append(slice(lo, lo + n))
                dst.append(slice(lo - start, lo - start + n))
                tile_shape.append(s)
        return tuple(src), tuple(dst), tuple(tile_shape)

    def op_tile_load(self, op: Op, x, env) -> list[np.ndarray]:
        a = x[0]
        src, dst, shape = self._slices(a.shape, op.attrs["slice"], x[1:], "tile.load")
        out = np.zeros(shape, dtype=a.dtype)
        out[dst] = a[src]
        return [out]

    def op_tile_atomic_add(self, op: Op, x, env) -> list[np.ndarray]:
        acc, tile = x[0], x[1]
        src, dst, _ = self._slices(acc.shape, op.attrs["slice"], x[2:], "tile.atomic_add")
        acc[src] += tile[dst].astype(acc.dtype)
        return []

    def op_tile_scatter_add(self, op: Op, x, env) -> list[np.ndarray]:
        _scatter_into(x[0], np.asarray(x[1]).astype(x[0].dtype), x[2:])  # in place: an accumulator
        return []

    def op_tile_insert(self, op: Op, x, env) -> list[np.ndarray]:
        dst_arr, tile = x[0].copy(), x[1]
        src, dst, _ = self._slices(dst_arr.shape, op.attrs["slice"], x[2:], "tile.insert")
        dst_arr[src] = tile[dst]
        return [dst_arr]

    # ------------------------------------------------------------------------------ control flow
    def op_for(self, op: Op, x, env) -> list[np.ndarray]:
        lo, hi, state = int(x[0]), int(x[1]), list(x[2:])
        blk = op.regions[0]
        for i in range(lo, hi):
            inner = dict(env)
            inner[blk.args[0]] = np.int32(i)
            for a, s in zip(blk.args[1:], state):
                inner[a] = s
            state = self.block(blk, inner)
        return state

    def op_parallel_for(self, op: Op, x, env) -> list[np.ndarray]:
        """Every iteration writes its tiles into the stored results; accumulators (the last
        `accumulators` results) start at zero and sum what every iteration's tile.atomic_add adds."""
        bounds = [dim(b).eval(self.env_dims) for b in op.attrs["bounds"]]
        blk = op.regions[0]
        outs = [np.zeros(self.shape(r.type, "parallel_for"),
                         dtype=numpy_dtype(r.type.dtype) if self.precision == "native" or not is_float(r.type.dtype)
                         else np.float64) for r in op.results]
        n_acc = op.attrs.get("accumulators", 0)
        accs = outs[len(outs) - n_acc:]
        term = blk.terminator
        assert term is not None
        for ivs in itertools.product(*[range(b) for b in bounds]):
            inner = dict(env)
            for a, i in zip(blk.args, ivs):
                inner[a] = np.int32(i)
            for a, acc in zip(blk.args[len(bounds):], accs):
                inner[a] = acc  # shared across iterations: tile.atomic_add adds into it in place
            vals = self.block(blk, inner)
            pos = 0
            for j, (out, spec) in enumerate(zip(outs, term.attrs["slices"])):
                k = sum(1 for s in spec if s != ":")
                tile, idx = vals[pos], vals[pos + 1: pos + 1 + k]
                pos += 1 + k
                src, dst, _ = self._slices(out.shape, spec, idx, f"parallel_for iteration {ivs}: tile.yield into "
                                                                 f"result {j}")
                out[src] = tile[dst]
        return [self.store(o, r.type) for o, r in zip(outs, op.results)]

    def op_if(self, op: Op, x, env) -> list[np.ndarray]:
        blk = op.regions[0] if bool(x[0]) else op.regions[1]
        return self.block(blk, dict(env))

    def op_fused(self, op: Op, x, env) -> list[np.ndarray]:
        blk = op.regions[0]
        return self.block(blk, dict(zip(blk.args, x)))

    # -------------------------------------------------------------------------------------- masks
    def op_mask_classify(self, op: Op, x, env) -> list[np.ndarray]:
        b, h, q0, k0 = (int(v) for v in x[:4])
        bq, bk = op.attrs["bq"], op.attrs["bk"]
        c = intervals.classify(op.regions[0], b, h, q0, q0 + bq - 1, k0, k0 + bk - 1, x[4:], self.env_dims,
                               self._ranges(op, x))
        return [np.int32(c)]

    def _ranges(self, op: Op, x) -> dict:
        return intervals.range_tables(op.attrs.get("ranges", ()), x[4:])

    def op_mask_ranges(self, op: Op, x, env) -> list[np.ndarray]:
        t = intervals.minmax_table(x[0], op.attrs["axis"], op.attrs["granule"])
        return [self.store(t, op.results[0].type)]

    def op_mask_kv_range(self, op: Op, x, env) -> list[np.ndarray]:
        b, h, q0, nkv = (int(v) for v in x[:4])
        lo, hi = intervals.kv_range(op.regions[0], b, h, q0, op.attrs["bq"], op.attrs["bk"], nkv, x[4:],
                                    self.env_dims, self._ranges(op, x))
        return [np.int32(lo), np.int32(hi)]

    def op_mask_q_range(self, op: Op, x, env) -> list[np.ndarray]:
        b, h, k0, nq = (int(v) for v in x[:4])
        lo, hi = intervals.q_range(op.regions[0], b, h, k0, op.attrs["bq"], op.attrs["bk"], nq, x[4:],
                                   self.env_dims, self._ranges(op, x))
        return [np.int32(lo), np.int32(hi)]

    def op_mask_block_table(self, op: Op, x, env) -> list[np.ndarray]:
        """Exact classification from the data (see `block_classes` for what a class means)."""
        B, H, nq, nk = self.shape(op.results[0].type, "mask.block_table")
        return [self.block_classes(op.regions[0], x, B, H, nq, nk, op.attrs["bq"], op.attrs["bk"],
                                   self._extent(op, "M"))]

    def block_classes(self, pred: Block, captures: Sequence[np.ndarray], B: int, H: int, nq: int, nk: int,
                      bq: int, bk: int, M: int) -> np.ndarray:
        """The tile classes of a mask predicate over (b, h, q, kv), int8 [B, H, nq, nk].

        One meaning for a tile class, shared by `mask.classify`, `mask.block_table` and the kernels: over the
        rows q < M of the q tile (rows past M produce no output) and *every* one of the bk columns of the kv
        tile, evaluated with the predicate as written, which includes the kv bound `kv < N` that `tile` adds.
        FULL (2): every such position is kept; EMPTY (0): none is; PARTIAL (1): anything else. So a ragged
        last kv tile is never FULL, and the unmasked full-tile path never sees padded columns. (The interval
        classifier of `mask.classify` may answer PARTIAL where it cannot prove more; that is always safe.)
        Evaluated one row of q tiles at a time: memory B*H*bq*nk*bk, not B*H*M*N. Pass H = 1 when the
        predicate does not read h.
        """
        b = np.arange(B, dtype=np.int32).reshape(B, 1, 1, 1)
        h = np.arange(H, dtype=np.int32).reshape(1, H, 1, 1)
        kv = np.arange(nk * bk, dtype=np.int32).reshape(1, 1, 1, nk * bk)
        table = np.zeros((B, H, nq, nk), dtype=np.int8)
        for i in range(nq):
            rows = min(bq, M - i * bq)
            if rows <= 0:
                continue
            q = np.arange(i * bq, i * bq + rows, dtype=np.int32).reshape(1, 1, rows, 1)
            with np.errstate(all="ignore"):
                (keep,) = self.block(pred, dict(zip(pred.args, [b, h, q, kv, *captures])))
            keep = np.broadcast_to(np.asarray(keep, dtype=bool), (B, H, rows, nk * bk)).reshape(B, H, rows, nk, bk)
            table[:, :, i, :] = np.where(keep.all(axis=(2, 4)), 2, np.where(keep.any(axis=(2, 4)), 1, 0))
        return table

    def _extent(self, op: Op, which: str) -> int:
        d = op.attrs.get("m" if which == "M" else "n")
        return dim(d).eval(self.env_dims) if d is not None else self.env_dims[which]


def _scatter_into(table: np.ndarray, values: np.ndarray, idx) -> None:
    """table[i0, i1, ...] += values, in place; indices clamped as gather's, broadcast with the values, and
    repeated indices add up (scatter_add and tile.scatter_add)."""
    clipped = [np.clip(i, 0, table.shape[d] - 1) for d, i in enumerate(idx)]
    arrays = np.broadcast_arrays(values, *clipped)
    np.add.at(table, tuple(arrays[1:]), arrays[0])


def _erf(a: np.ndarray) -> np.ndarray:
    f = np.vectorize(math.erf, otypes=[np.float64])
    return f(a).astype(a.dtype) if a.dtype.kind == "f" else f(a)


def interpret(func: Func, inputs: Sequence[Any], precision: str = "f64",
              dims: Optional[Mapping[str, int]] = None) -> list[np.ndarray]:
    """Run `func` on numpy inputs; returns its outputs."""
    return Interpreter(precision).run(func, inputs, dims)
