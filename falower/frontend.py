"""Tracing attention written as ordinary tensor code into the IR.

`trace` runs a Python function on symbolic tensors whose operators append ops to a graph
(`q @ k.mT * scale`, `softmax(x, dim=-1)`, `where(...)`, indexing a captured table). `attention` builds
the usual graph from FlexAttention-style `score_mod(score, b, h, q_idx, kv_idx)` and
`mask_mod(b, h, q_idx, kv_idx)` functions; tensors they close over come from `capture(...)`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from .errors import FalowerError
from .ir.builder import Builder, new_func
from .ir.core import Func, Value
from .ir import dims as _dims_module
from .ir.dims import Const, Dim, DimLike, dim
from .ir.types import FLOAT_DTYPES, TensorType, is_float, is_int

Scalar = Union[int, float, bool]

_CURRENT: list["_Trace"] = []

_FLOAT_RANK = {"f16": 1, "bf16": 1, "f32": 2, "f64": 3}


def _parse_shape(shape: Union[str, Sequence[DimLike]]) -> tuple[Dim, ...]:
    if isinstance(shape, str):
        parts = [p for p in shape.replace(" ", "").split(",") if p] if shape.strip() else []
        return tuple(dim(p) for p in parts)
    return tuple(dim(d) for d in shape)


def tensor(dtype: str, shape: Union[str, Sequence[DimLike]]) -> TensorType:
    """A tensor type for `trace`: `tensor("f16", "B,H,M,D")`."""
    return TensorType(dtype, _parse_shape(shape))


@dataclass
class _Trace:
    builder: Builder
    func: Func
    captured: dict[str, Value]
    owners: dict[str, "Capture"] = field(default_factory=dict)


def _identifier(name: str, what: str) -> str:
    """Names appear in dumps (`%name`, `@name`), so they must read back: identifiers only."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise FalowerError(f"{what} must be an identifier (letters, digits, _), got {name!r}")
    return name


def _builder() -> Builder:
    if not _CURRENT:
        raise FalowerError("symbolic tensors can only be used inside falower.trace or falower.attention")
    return _CURRENT[-1].builder


def _traced_size(d: Dim) -> "SymTensor":
    """A symbolic size as a traced f32 scalar (`q.shape[-1] ** -0.5` while tracing: dims.TRACED_SIZE)."""
    if not _CURRENT:
        raise FalowerError(f"the size {d} is symbolic: float arithmetic on it needs a traced graph (inside "
                           "falower.trace) or a value")
    return SymTensor(_builder().const(d)).to("f32")


_dims_module.TRACED_SIZE = _traced_size


def _small_int_exponent(x: Any) -> bool:
    """A Python int exponent that an integer power can take as products (0 .. 64)."""
    try:
        import numpy as np

        ints: tuple = (int, np.integer)
    except ImportError:  # pragma: no cover
        ints = (int,)
    return isinstance(x, ints) and not isinstance(x, bool) and 0 <= int(x) <= 64


def _promote(a: str, b: str) -> str:
    if a == b:
        return a
    if is_float(a) and is_float(b):
        if _FLOAT_RANK[a] == _FLOAT_RANK[b]:
            return "f32"  # f16 with bf16
        return a if _FLOAT_RANK[a] > _FLOAT_RANK[b] else b
    if is_float(a):
        return a
    if is_float(b):
        return b
    if "i32" in (a, b):
        return "i32"
    return b if a == "bool" else a  # bool with i8: i8 (bools count as 0 and 1), in either order


class SymTensor:
    """A symbolic tensor during tracing: operators append ops to the graph being built."""

    __array_priority__ = 1000  # numpy scalars on the left defer to us

    def __init__(self, value: Value, transposed: bool = False):
        self.value = value
        self.transposed = transposed

    # ------------------------------------------------------------------------------ information
    @property
    def dtype(self) -> str:
        return self.value.type.dtype

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.value.type.shape

    @property
    def ndim(self) -> int:
        return self.value.type.rank

    def __repr__(self) -> str:
        return f"SymTensor({self.value.type})"

    def __iter__(self):
        raise FalowerError("a symbolic tensor cannot be iterated while tracing (a Python for loop, list() or * over "
                           "a traced value): index it (x[i]) or use tensor ops")

    def __len__(self) -> int:
        raise FalowerError("len() of a symbolic tensor while tracing: use x.shape")

    def __round__(self, ndigits: Any = None):
        raise FalowerError("round() of a symbolic tensor while tracing: use falower.round(x) or torch.round(x)")

    def __array__(self, *args: Any, **kwargs: Any):
        raise FalowerError("numpy does not trace symbolic tensors (a numpy function, or a numpy array indexed by a "
                           "traced index): use falower's functions (falower.where, ...) or torch's, and close over "
                           "tables with falower.capture(...) or a torch tensor")

    def __bool__(self) -> bool:
        raise FalowerError("a symbolic tensor has no truth value while tracing (Python `if`, `and`, `or`, `not` on "
                           "a traced value, or a chained comparison such as 0 <= x < w): use torch.where(cond, a, b) "
                           "or falower.where(cond, a, b) instead of `if`, & | ~ instead of and/or/not, and "
                           "(0 <= x) & (x < w) for a chain")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        """torch functions called on symbolic tensors (`torch.where`, `torch.tanh`, indexing a torch tensor
        with traced indices) map to falower's: score and mask functions written in torch trace as they are.
        Only torch calls this, so torch is already imported; falower.torch_mods holds the table."""
        from .torch_mods import torch_function

        return torch_function(func, types, args, kwargs or {})

    def __float__(self) -> float:
        raise FalowerError(_math_call_message())

    __int__ = __complex__ = __trunc__ = __float__  # type: ignore[assignment]

    def __index__(self) -> int:
        raise FalowerError("a traced tensor cannot be a Python int (a Python list or tuple indexed by it, range(), "
                           "int(), or a math.* function): capture the list as a table with falower.capture(...) or a "
                           "torch tensor, and use falower.where / torch.where for choices")

    def __setitem__(self, index: Any, value: Any) -> None:
        raise FalowerError("traced tensors are immutable (x[i] = y, masked_fill_): use torch.where(cond, y, x) or "
                           "falower.where(cond, y, x)")

    def __getattr__(self, name: str) -> Any:
        """A method falower does not trace: named in one line (an AttributeError too, so hasattr() stays False)."""
        if name.startswith("__") or name in ("value", "transposed") or hasattr(type(self), name):
            raise AttributeError(name)  # (a property that raised inside: its own error, not 'no method')
        raise _NoMethod(f"traced tensors have no method {name!r} (falower traces the torch ops listed in README's "
                        "'FlexAttention users'; write it with those)")

    def _v(self) -> Value:
        if self.transposed:
            raise FalowerError("a transposed tensor (.mT) can only be used as a matmul operand")
        return self.value

    # --------------------------------------------------------------------------------- helpers
    @staticmethod
    def _lift(x: Any, like: "SymTensor") -> "SymTensor":
        if isinstance(x, SymTensor):
            return x
        if isinstance(x, Capture):  # a captured tensor used directly (a 0-d window size, a temperature)
            return x._sym()
        if isinstance(x, bool):
            return SymTensor(_builder().const(x))
        if isinstance(x, int):
            dtype = like.dtype if like.dtype != "bool" else "i32"
            return SymTensor(_builder().const(float(x) if is_float(dtype) else x, TensorType(dtype, ())))
        if isinstance(x, float):
            dtype = like.dtype if is_float(like.dtype) else "f32"
            return SymTensor(_builder().const(x, TensorType(dtype, ())))
        if isinstance(x, Dim):
            return SymTensor(_builder().const(x))
        if type(x).__module__.startswith("torch") and hasattr(x, "shape"):  # a torch tensor a mod closes over
            from .torch_mods import lift_tensor

            return lift_tensor(x)
        try:
            import numpy as np

            if isinstance(x, np.generic):
                return SymTensor._lift(x.item(), like)
        except ImportError:  # pragma: no cover
            pass
        raise FalowerError(f"cannot use {type(x).__name__} in a traced expression")

    def _binary(self, name: str, other: Any, reverse: bool = False) -> "SymTensor":
        if name == "pow" and not reverse and _small_int_exponent(other) and not is_float(self.dtype):
            return self._int_power(int(other))
        o = self._lift(other, self)
        a, b = (o, self) if reverse else (self, o)
        av, bv = a._v(), b._v()
        target = _promote(av.type.dtype, bv.type.dtype)
        if name in ("floordiv", "mod") and is_float(target):
            raise FalowerError(f"// and % take integers in falower (got {target}): for floats write "
                               "fl.floor(a / b) and a - b * fl.floor(a / b)")
        if name in ("div", "pow") and not is_float(target):
            target = "f32"
        if target == "bool" and name not in ("eq", "ne", "and", "or", "xor"):
            target = "i32"  # arithmetic and ordering on masks count them as 0 and 1, as torch does
        bld = _builder()
        return SymTensor(bld.emit(name, bld.cast(av, target), bld.cast(bv, target)))

    def _int_power(self, e: int) -> "SymTensor":
        """An integer to a constant power e >= 0, as Python and torch keep it: an integer (products, wrapping at
        i32 as every i32 op does), where the pow op would compute it in f32 (inexact past 2^24)."""
        base = self if self.dtype != "bool" else self.to("i32")
        out: Optional[SymTensor] = None
        while e:
            if e & 1:
                out = base if out is None else out * base
            e >>= 1
            if e:
                base = base * base
        return out if out is not None else base * 0 + 1

    def _unary(self, name: str) -> "SymTensor":
        v = self._v()
        bld = _builder()
        if name not in ("neg", "abs", "not", "sign") and not is_float(v.type.dtype):
            v = bld.cast(v, "f32")
        return SymTensor(bld.emit(name, v))

    # ------------------------------------------------------------------------------- operators
    def __add__(self, o): return self._binary("add", o)
    def __radd__(self, o): return self._binary("add", o, True)
    def __sub__(self, o): return self._binary("sub", o)
    def __rsub__(self, o): return self._binary("sub", o, True)
    def __mul__(self, o): return self._binary("mul", o)
    def __rmul__(self, o): return self._binary("mul", o, True)
    def __truediv__(self, o): return self._binary("div", o)
    def __rtruediv__(self, o): return self._binary("div", o, True)
    def __floordiv__(self, o): return self._binary("floordiv", o)
    def __rfloordiv__(self, o): return self._binary("floordiv", o, True)
    def __mod__(self, o): return self._binary("mod", o)
    def __rmod__(self, o): return self._binary("mod", o, True)
    def __pow__(self, o): return self._binary("pow", o)
    def __rpow__(self, o): return self._binary("pow", o, True)  # 2.0 ** -(h + 1): ALiBi's slopes
    def __lshift__(self, o): return self._binary("shl", o)
    def __rshift__(self, o): return self._binary("shr", o)
    def __and__(self, o): return self._binary("and", o)
    def __rand__(self, o): return self._binary("and", o, True)
    def __or__(self, o): return self._binary("or", o)
    def __ror__(self, o): return self._binary("or", o, True)
    def __xor__(self, o): return self._binary("xor", o)
    def __rxor__(self, o): return self._binary("xor", o, True)
    def __lt__(self, o): return self._binary("lt", o)
    def __le__(self, o): return self._binary("le", o)
    def __gt__(self, o): return self._binary("gt", o)
    def __ge__(self, o): return self._binary("ge", o)
    def __eq__(self, o): return self._binary("eq", o)  # type: ignore[override]
    def __ne__(self, o): return self._binary("ne", o)  # type: ignore[override]
    __hash__ = object.__hash__
    def __rlshift__(self, o): return self._binary("shl", o, True)
    def __rrshift__(self, o): return self._binary("shr", o, True)
    def __pos__(self): return self
    def __divmod__(self, o): return self // o, self % o
    def __rdivmod__(self, o): return self._binary("floordiv", o, True), self._binary("mod", o, True)
    def __neg__(self): return self._unary("neg")
    def __abs__(self): return self._unary("abs")
    def __invert__(self): return self._unary("not")

    def __matmul__(self, other: "SymTensor") -> "SymTensor":
        if not isinstance(other, SymTensor):
            raise FalowerError("matmul needs two tensors")
        bld = _builder()
        return SymTensor(bld.emit("matmul", self.value, other.value,
                                  transpose_a=self.transposed, transpose_b=other.transposed))

    @property
    def mT(self) -> "SymTensor":
        """The transpose of the last two dims; only a matmul consumes it (as a flag, no copy)."""
        return SymTensor(self.value, not self.transposed)

    def transpose(self, d0: int, d1: int) -> "SymTensor":
        r = self.ndim
        if {d0 % r, d1 % r} != {r - 1, r - 2}:
            raise FalowerError("only the last two dims can be transposed (and only for a matmul)")
        return self.mT

    # ---------------------------------------------------------------------------------- methods
    def exp(self): return self._unary("exp")
    def exp2(self): return self._unary("exp2")
    def log(self): return self._unary("log")
    def log2(self): return self._unary("log2")
    def tanh(self, approx: bool = False):
        """tanh; approx=True allows the hardware's approximation (op tanh_approx: one MUFU.TANH on the H100, relative
        error documented as ~2^-11, measured 2^-16.5; FlashAttention's softcap) where the exact one costs two MUFU
        operations and ~15 instructions (a softcap at 1.4x the speed: BENCHMARKS.md)."""
        return self._unary("tanh_approx" if approx else "tanh")
    def sigmoid(self): return self._unary("sigmoid")
    def erf(self): return self._unary("erf")
    def sqrt(self): return self._unary("sqrt")
    def sin(self): return self._unary("sin")
    def cos(self): return self._unary("cos")
    def tan(self): return self._unary("tan")
    def log1p(self): return self._unary("log1p")
    def expm1(self): return self._unary("expm1")
    def rsqrt(self): return self._unary("rsqrt")
    def floor(self): return self._unary("floor")
    def ceil(self): return self._unary("ceil")
    def round(self): return self._unary("round")
    def sign(self): return self._unary("sign")
    def abs(self): return self._unary("abs")

    def to(self, *args: Any, dtype: Any = None, **kwargs: Any) -> "SymTensor":
        """A cast: `.to("f32")`, `.to(torch.float32)`, `.to(dtype=...)`; a device (torch's `.to(device)`)
        means nothing while tracing and is ignored."""
        for a in args:
            if dtype is None and _is_dtype_like(a):
                dtype = a
        if dtype is None:
            return self
        return SymTensor(_builder().cast(self._v(), _dtype_name(dtype)))

    def float(self) -> "SymTensor":
        return self.to("f32")

    def half(self) -> "SymTensor":
        return self.to("f16")

    def double(self) -> "SymTensor":
        return self.to("f64")

    def bfloat16(self) -> "SymTensor":
        return self.to("bf16")

    def int(self) -> "SymTensor":
        return self.to("i32")

    long = int  # falower's integers are i32: indices and ids fit

    def bool(self) -> "SymTensor":
        return self.to("bool")

    def type_as(self, other: "SymTensor") -> "SymTensor":
        return self.to(_sym(other).dtype)

    def clamp(self, min: Any = None, max: Any = None) -> "SymTensor":  # noqa: A002  (torch's names)
        """torch.clamp: max(x, min) then min(., max), for floats and integers (NATTEN's kernel centres)."""
        out = self
        if min is not None:
            out = out._binary("max", min)
        if max is not None:
            out = out._binary("min", max)
        return out

    clip = clamp

    def clamp_min(self, m: Any) -> "SymTensor":
        return self.clamp(min=m)

    def clamp_max(self, m: Any) -> "SymTensor":
        return self.clamp(max=m)

    def maximum(self, o: Any) -> "SymTensor":
        return self._binary("max", o)

    def minimum(self, o: Any) -> "SymTensor":
        return self._binary("min", o)

    def pow(self, o: Any) -> "SymTensor":
        return self._binary("pow", o)

    def add(self, o: Any, alpha: Any = 1) -> "SymTensor":
        return self + (o if alpha == 1 else o * alpha)

    def sub(self, o: Any, alpha: Any = 1) -> "SymTensor":
        return self - (o if alpha == 1 else o * alpha)

    def mul(self, o: Any) -> "SymTensor":
        return self * o

    def div(self, o: Any, rounding_mode: Any = None) -> "SymTensor":
        if rounding_mode is None:
            return self / o
        if rounding_mode == "floor" and not is_float(self.dtype) and not is_float(_sym_dtype(o)):
            return self // o
        raise FalowerError(f"div(rounding_mode={rounding_mode!r}) is not traced: integers take rounding_mode='floor' "
                           "(that is //); for floats write (a / b).floor()")

    def remainder(self, o: Any) -> "SymTensor":
        return self % o

    def floor_divide(self, o: Any) -> "SymTensor":
        return self // o

    def eq(self, o: Any) -> "SymTensor": return self == o
    def ne(self, o: Any) -> "SymTensor": return self != o
    def lt(self, o: Any) -> "SymTensor": return self < o
    def le(self, o: Any) -> "SymTensor": return self <= o
    def gt(self, o: Any) -> "SymTensor": return self > o
    def ge(self, o: Any) -> "SymTensor": return self >= o
    def bitwise_and(self, o: Any) -> "SymTensor": return self & o
    def bitwise_or(self, o: Any) -> "SymTensor": return self | o
    def bitwise_xor(self, o: Any) -> "SymTensor": return self ^ o
    def bitwise_not(self) -> "SymTensor": return ~self
    def neg(self) -> "SymTensor": return -self
    negative = neg
    def sgn(self) -> "SymTensor": return self.sign()

    def relu(self) -> "SymTensor":
        if self._v().type.dtype == "bool":
            raise FalowerError("relu of a bool tensor (torch refuses it too): cast it first, e.g. x.int()")
        return self._binary("max", 0)

    def where(self, cond: Any, other: Any) -> "SymTensor":
        """torch's x.where(cond, y): x where cond, else y."""
        return where(cond, self, other)

    def masked_fill(self, mask: Any, value: Any) -> "SymTensor":
        """torch's x.masked_fill(mask, v): v where mask, else x (`s.masked_fill(~causal, float('-inf'))`)."""
        return where(mask, value, self)

    def square(self) -> "SymTensor":
        return self * self

    def reciprocal(self) -> "SymTensor":
        return 1.0 / self

    def logical_and(self, o: Any) -> "SymTensor":
        return self.bool() & _as_bool(o)

    def logical_or(self, o: Any) -> "SymTensor":
        return self.bool() | _as_bool(o)

    def logical_not(self) -> "SymTensor":
        return ~self.bool()

    def new_full(self, size: Any, fill_value: Any, dtype: Any = None, **_device: Any) -> "SymTensor":
        """A scalar constant (torch's `b.new_ones((), dtype=torch.bool)`, as in FlexAttention's and_masks and
        noop_mask); only 0-d sizes: anything else would be a tensor of its own shape."""
        if tuple(size) not in ((), (1,)):
            raise FalowerError(f"new_full/new_ones/new_zeros while tracing make a scalar; size {tuple(size)} is not one")
        dt = _dtype_name(dtype) if dtype is not None else self.dtype
        value = bool(fill_value) if dt == "bool" else float(fill_value) if is_float(dt) else int(fill_value)
        return SymTensor(_builder().const(value, TensorType(dt, ())))

    def new_ones(self, size: Any = (), dtype: Any = None, **kw: Any) -> "SymTensor":
        return self.new_full(size, 1, dtype)

    def new_zeros(self, size: Any = (), dtype: Any = None, **kw: Any) -> "SymTensor":
        return self.new_full(size, 0, dtype)

    @property
    def device(self) -> None:
        """No device while tracing (torch code passes `device=b.device` along; it is ignored)."""
        return None

    def _axis(self, d: int) -> int:
        if not -self.ndim <= d < self.ndim:
            raise FalowerError(f"dim {d} is out of range for a tensor of rank {self.ndim}")
        return d % self.ndim

    def softmax(self, dim: int = -1) -> "SymTensor":
        v = self._v()
        if not is_float(v.type.dtype):
            v = _builder().cast(v, "f32")
        return SymTensor(_builder().emit("softmax", v, axis=self._axis(dim)))

    def amax(self, dim: int = -1, keepdim: bool = True) -> "SymTensor":
        """The max along `dim`, keeping it as size 1 by default (falower's reductions keep it; keepdim=False
        drops it, as torch's default does)."""
        return self._reduce("reduce_max", dim, keepdim)

    def sum(self, dim: int = -1, keepdim: bool = True) -> "SymTensor":
        return self._reduce("reduce_sum", dim, keepdim)

    def _reduce(self, name: str, dim: int, keepdim: bool) -> "SymTensor":
        axis = self._axis(dim)
        r = _builder().emit(name, self._v(), axis=axis)
        return SymTensor(r if keepdim else _builder().emit("squeeze", r, axis=axis))

    def squeeze(self, dim: Optional[int] = None) -> "SymTensor":
        """`dim` dropped where it has size 1 (a fixed other size leaves the tensor as it is, as torch's; a symbolic
        one is refused: its size is not known while tracing), or with dim=None every dim of size 1."""
        t = self._v().type
        if dim is None:
            axes = [a for a, d in enumerate(t.shape) if d == Const(1)]
        else:
            axes = [self._axis(dim)]
            if not isinstance(t.shape[axes[0]], Const):
                raise FalowerError(f"squeeze({dim}): dim {dim} of {t} has the symbolic size {t.shape[axes[0]]}, "
                                   "which may not be 1: index or reduce it instead")
            if t.shape[axes[0]] != Const(1):
                return self
        v = self._v()
        for a in reversed(axes):
            v = _builder().emit("squeeze", v, axis=a)
        return SymTensor(v)

    def unsqueeze(self, dim: int) -> "SymTensor":
        r = self.ndim
        if not -r - 1 <= dim <= r:
            raise FalowerError(f"unsqueeze({dim}): dim is out of range for a tensor of rank {r} (-{r + 1} to {r})")
        return SymTensor(_builder().emit("unsqueeze", self._v(), axis=dim % (r + 1)))

    def repeat_interleave(self, repeats: int, dim: int) -> "SymTensor":
        return SymTensor(_builder().emit("repeat_interleave", self._v(), axis=self._axis(dim), repeats=int(repeats)))

    def __getitem__(self, index: Any) -> "SymTensor":
        """Indexing a captured table with index tensors is a gather (indices are clamped into range). Fewer
        indices than the table's rank give a row (`means[h]`), to index further or, when the rest of its dims
        have size 1, to use as it is."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > self.ndim:
            raise FalowerError(f"indexing a rank-{self.ndim} tensor needs {self.ndim} indices, got {len(index)}")
        if len(index) < self.ndim:
            return _Row(self, index)
        bld = _builder()
        idx = []
        for axis, i in enumerate(index):
            if type(i).__module__ == "numpy" and hasattr(i, "dtype") and i.dtype.kind in "iu" and i.ndim == 0:
                i = int(i)  # a numpy integer index is a Python one
            if isinstance(i, int) and not isinstance(i, bool):
                idx.append(bld.const(_constant_index(i, self.shape[axis], axis)))
                continue
            if isinstance(i, Dim):
                idx.append(bld.const(i))
                continue
            t = _sym(i)
            if not is_int(t.dtype):
                raise FalowerError(f"gather indices must be integers, got {t.dtype}")
            idx.append(bld.cast(t._v(), "i32"))
        return SymTensor(bld.emit("gather", self._v(), *idx))


class _Row(SymTensor):
    """`table[i]` with fewer indices than the table has dims: indexing it again completes the gather
    (`means[h][kv]` is `means[h, kv]`); when the remaining dims have size 1 it is usable as it is."""

    def __init__(self, table: SymTensor, index: tuple):
        self.table, self.index = table, index
        rest = table.shape[len(index):]
        self.rest = rest
        full = all(d == dim(1) for d in rest)
        value = table[index + (0,) * len(rest)].value if full else None
        super().__init__(value)  # type: ignore[arg-type]

    @property
    def dtype(self) -> str:
        return self.table.dtype

    @property
    def ndim(self) -> int:
        return self._v().type.rank  # (a row with dims left: the error below, as for its shape)

    def _v(self) -> Value:
        if self.value is None:
            dims = ", ".join(str(d) for d in self.rest)
            raise FalowerError(f"a row of the captured {self.table.value.type} indexed with {len(self.index)} of "
                               f"{self.table.ndim} indices has dims [{dims}] left: index it fully "
                               f"(t[i, j] or t[i][j]) before using it in arithmetic")
        return self.value

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self._v().type.shape

    def __getitem__(self, index: Any) -> SymTensor:
        index = index if isinstance(index, tuple) else (index,)
        return self.table[self.index + index]


_FL_EQUIVALENT = {"log": "log", "exp": "exp", "exp2": "exp2", "log2": "log2", "tanh": "tanh", "erf": "erf",
                  "sqrt": "sqrt", "sin": "sin", "cos": "cos", "tan": "tan", "log1p": "log1p", "expm1": "expm1",
                  "floor": "floor", "ceil": "ceil", "fabs": "abs", "pow": "** (a ** b)", "copysign": "sign",
                  "trunc": ".to('i32') (toward zero)"}


def _math_call_message() -> str:
    """Python's math functions turn their argument into a float, which a traced tensor cannot be: name the
    falower function to use instead (found in the caller's source line where there is one)."""
    import linecache
    import sys

    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back  # type: ignore[assignment]
    called = None
    if frame is not None:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        calls = list(dict.fromkeys(re.findall(r"\bmath\.(\w+)\s*\(", line)))
        if len(calls) > 1:  # which one got the tensor the line does not say: name them all
            insteads = [f"fl.{_FL_EQUIVALENT[c]}" if _FL_EQUIVALENT.get(c, "").isidentifier() else
                        _FL_EQUIVALENT.get(c, "no equivalent") for c in calls]
            return (f"one of {', '.join('math.' + c for c in calls)} on this line got a traced tensor (they need "
                    f"Python floats): use {' / '.join(insteads)}")
        called = calls[0] if calls else None
    if called is not None:
        fl_name = _FL_EQUIVALENT.get(called)
        instead = f"use fl.{fl_name}(x)" if fl_name and fl_name.isidentifier() else \
            f"use {fl_name}" if fl_name else "falower has no equivalent of it yet"
        return f"math.{called} cannot take a traced tensor (it needs a Python float): {instead}"
    return ("a traced tensor cannot become a Python number (was it passed to a math.* function?): use the "
            "falower functions instead, e.g. fl.erf, fl.exp, fl.log, fl.sin, fl.sqrt")


class _NoMethod(FalowerError, AttributeError):
    """A method traced tensors do not have: a one-line falower error that hasattr() also reads as absent."""


def _sym_dtype(x: Any) -> str:
    """The dtype x would trace as: a traced tensor's, f32 for a Python float, i32 otherwise."""
    if isinstance(x, (SymTensor, Capture)):
        return x.dtype
    return "f32" if isinstance(x, float) else "i32"


def _constant_index(i: int, extent: Dim, axis: int) -> DimLike:
    """A Python int index as Python reads it: a negative one counts from the end (`bias[-1]` is the last entry, not
    the first that the gather's clamp would give), one past the end of a known extent is refused. Traced indices
    are clamped into range instead (README, "The IR and its levels")."""
    if extent.is_const:
        n = extent.eval({})
        if not -n <= i < n:
            raise FalowerError(f"index {i} is out of range for axis {axis} of size {n}")
        return i % n
    return extent + i if i < 0 else i


def _as_bool(o: Any) -> Any:
    """A logical op's other operand as a truth value (torch.logical_and(mask, 2) is mask & True)."""
    if isinstance(o, (SymTensor, Capture)):
        return o.bool()
    if isinstance(o, (bool, int, float)) or type(o).__module__ == "numpy":
        return bool(o)
    return o


_DTYPE_ALIASES = {"float16": "f16", "half": "f16", "bfloat16": "bf16", "float32": "f32", "float": "f32",
                  "float64": "f64", "double": "f64", "int32": "i32", "int8": "i8", "bool": "bool",
                  # falower has no 64/16-bit integers: torch's int64 indices and ids are computed in i32
                  "int64": "i32", "long": "i32", "int": "i32", "int16": "i32", "short": "i32", "uint8": "i32"}


def _is_dtype_like(x: Any) -> bool:
    """A dtype argument of `.to(...)` (a torch dtype or a dtype name), as opposed to a device."""
    if type(x).__name__ == "dtype" or isinstance(x, type):
        return True
    if isinstance(x, str):
        return x.replace("torch.", "") in _DTYPE_ALIASES or x in FLOAT_DTYPES + ("i8", "i32", "bool")
    return False


def _dtype_name(d: Any) -> str:
    s = getattr(d, "__name__", None) if isinstance(d, type) else None  # float, int, bool as in torch's .to(float)
    s = s or str(d).replace("torch.", "").replace("numpy.", "")
    s = _DTYPE_ALIASES.get(s, s)
    if s not in FLOAT_DTYPES + ("i8", "i32", "bool"):
        raise FalowerError(f"unknown dtype {d!r}")
    return s


# ------------------------------------------------------------------------------ free functions
def _sym(x: Any) -> SymTensor:
    if isinstance(x, Capture):  # fl.exp(temperature), fl.maximum(w, w): a capture is its symbolic tensor here
        return x._sym()
    if not isinstance(x, SymTensor):
        raise FalowerError(f"expected a traced tensor (a score, an index, a captured table's entry), got "
                           f"{type(x).__name__} {x!r}: falower's functions take at least one (Python's own for numbers)")
    return x


def softmax(x: SymTensor, dim: int = -1) -> SymTensor:
    return _sym(x).softmax(dim)


def where(cond: Any, a: Any, b: Any) -> SymTensor:
    ref = next((t for t in (a, b, cond) if isinstance(t, SymTensor)), None)
    if ref is None:
        raise FalowerError("where needs at least one symbolic tensor")
    bld = _builder()
    c = SymTensor._lift(cond, ref)
    like = a if isinstance(a, SymTensor) else b if isinstance(b, SymTensor) else ref
    av, bv = SymTensor._lift(a, like), SymTensor._lift(b, like)
    target = _promote(av.dtype, bv.dtype)
    if c.dtype != "bool":
        raise FalowerError(f"where's condition must be bool, got {c.dtype}")
    return SymTensor(bld.emit("where", c._v(), bld.cast(av._v(), target), bld.cast(bv._v(), target)))


def maximum(a: Any, b: Any) -> SymTensor:
    return _sym(a)._binary("max", b) if isinstance(a, (SymTensor, Capture)) else _sym(b)._binary("max", a, True)


def minimum(a: Any, b: Any) -> SymTensor:
    return _sym(a)._binary("min", b) if isinstance(a, (SymTensor, Capture)) else _sym(b)._binary("min", a, True)


def exp(x): return _sym(x).exp()
def exp2(x): return _sym(x).exp2()
def log(x): return _sym(x).log()
def tanh(x, approx: bool = False): return _sym(x).tanh(approx)
def sigmoid(x): return _sym(x).sigmoid()
def erf(x): return _sym(x).erf()
def sqrt(x): return _sym(x).sqrt()
def sin(x): return _sym(x).sin()
def cos(x): return _sym(x).cos()
def tan(x): return _sym(x).tan()
def log1p(x): return _sym(x).log1p()
def expm1(x): return _sym(x).expm1()
def rsqrt(x): return _sym(x).rsqrt()
def floor(x): return _sym(x).floor()
def ceil(x): return _sym(x).ceil()
def round(x): return _sym(x).round()  # noqa: A001  (the torch name)
def sign(x): return _sym(x).sign()
def log2(x): return _sym(x).log2()
def absolute(x): return _sym(x).abs()  # falower.abs (named so to leave Python's abs alone in this module)


# ----------------------------------------------------------------------------------- captures
class Capture:
    """A tensor that score/mask functions close over (ALiBi slopes, a bias table, document ids).

    It becomes an argument of the traced graph the first time a traced function touches it.
    """

    def __init__(self, name: str, dtype: str, shape: Union[str, Sequence[DimLike]]):
        self.name = _identifier(name, "a captured tensor's name")
        self.type = TensorType(_dtype_name(dtype), _parse_shape(shape))

    def _sym(self) -> SymTensor:
        if not _CURRENT:
            raise FalowerError(f"captured tensor {self.name!r} used outside of tracing")
        tr = _CURRENT[-1]
        if self.name not in tr.captured:
            if any(a.name == self.name for a in tr.func.body.args):
                raise FalowerError(f"captured tensor {self.name!r} has the name of a graph input")
            tr.captured[self.name] = tr.func.body.add_arg(self.type, self.name)
            tr.owners[self.name] = self
        elif tr.owners[self.name] is not self:
            raise FalowerError(f"two different captured tensors are named {self.name!r}: give them distinct names")
        return SymTensor(tr.captured[self.name])

    def __getitem__(self, index: Any) -> SymTensor:
        return self._sym()[index]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("name", "type"):
            raise AttributeError(name)
        return getattr(self._sym(), name)


def _delegate(name: str) -> Callable:
    def method(self: Capture, *args: Any) -> Any:
        return getattr(self._sym(), name)(*args)
    method.__name__ = name
    return method


# Operators look methods up on the type, not through __getattr__: a capture used directly in arithmetic
# (`score * temperature`, `q - kv < window` with 0-d captures) forwards each one to its symbolic tensor.
for _op in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "rfloordiv", "mod",
            "rmod", "pow", "rpow", "and", "rand", "or", "ror", "xor", "rxor", "lt", "le", "gt", "ge", "eq", "ne",
            "neg", "abs", "invert", "float", "int", "index", "bool", "iter", "len", "round", "array", "lshift",
            "rlshift", "rshift", "rrshift", "pos", "divmod", "rdivmod", "trunc", "setitem"):
    setattr(Capture, f"__{_op}__", _delegate(f"__{_op}__"))


def capture(name: str, dtype: str, shape: Union[str, Sequence[DimLike]]) -> Capture:
    return Capture(name, dtype, shape)


# ------------------------------------------------------------------------------------ tracing
def trace(fn: Optional[Callable] = None, *, name: Optional[str] = None, result_names: Sequence[str] = (),
          **arg_types: TensorType):
    """Trace `fn(**symbolic inputs)` into a graph (a `Func`). Usable as a decorator with arguments."""

    def run(f: Callable) -> Func:
        fname = _identifier(name or f.__name__, "a graph's name")
        func, bld, args = new_func(fname, list(arg_types.items()))
        _CURRENT.append(_Trace(bld, func, {}))
        try:
            out = f(*[SymTensor(a) for a in args])
        finally:
            _CURRENT.pop()
        outs = out if isinstance(out, tuple) else (out,)
        values = [_sym(o)._v() for o in outs]
        bld.ret(*values)
        if result_names:
            func.attrs["result_names"] = tuple(result_names)
        from .ir.verifier import verify

        verify(func)
        return func

    if fn is not None:
        return run(fn)
    return run


def attention(
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    *,
    name: str = "attention",
    dtype: str = "f16",
    head_dim: DimLike = "D",
    scale: Optional[float] = None,
    group_size: int = 1,
    return_lse: bool = False,
) -> Func:
    """The FlexAttention-style graph: softmax(score_mod(q @ k^T * scale) masked by mask_mod) @ v.

    q is [B, H, M, D]; k and v are [B, H, N, D], or [B, HKV, N, D] with H = HKV * group_size for GQA
    (grouped query heads share a kv head). Outputs O in `dtype`; with `return_lse`, also the scores' log-sum-exp
    per query row, [B, H, M] in f32 (-inf on a fully masked row), as the graph's second result `lse`: differentiable
    (passes/raise_lse.py).
    """
    dtype = _dtype_name(dtype)
    for what, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise FalowerError(f"attention's {what} must be a function (s, b, h, q_idx, kv_idx) or None, got "
                               f"{type(fn).__name__}")
    if not isinstance(name, str) or not name.isidentifier():
        raise FalowerError(f"attention's name must be an identifier, got {name!r}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, str, Dim)) or \
            isinstance(head_dim, int) and head_dim < 1:
        raise FalowerError(f"attention's head_dim must be a positive int or a dim name, got {head_dim!r}")
    D = dim(head_dim)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise FalowerError(f"attention's group_size must be an int >= 1, got {group_size!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise FalowerError(f"attention's scale must be a finite number or None, got {scale!r}")
    if not isinstance(return_lse, bool):
        raise FalowerError(f"attention's return_lse must be True or False, got {return_lse!r}")
    heads_q: DimLike = "H" if group_size == 1 else dim("HKV") * group_size
    heads_kv: DimLike = "H" if group_size == 1 else "HKV"
    qt = tensor(dtype, ["B", heads_q, "M", D])
    kt = tensor(dtype, ["B", heads_kv, "N", D])

    def body(q: SymTensor, k: SymTensor, v: SymTensor) -> SymTensor:
        bld = _builder()
        if group_size > 1:
            k, v = k.repeat_interleave(group_size, 1), v.repeat_interleave(group_size, 1)
        s = q @ k.mT
        acc = s.dtype  # f32, or f64 for f64 inputs
        if scale is not None:
            s = s * float(scale)
        elif isinstance(D, Dim) and D.is_const:
            s = s * (1.0 / math.sqrt(D.eval({})))
        else:
            s = s / SymTensor(bld.const(D)).to(s.dtype).sqrt()
        H = q.shape[1]
        b = SymTensor(bld.iota(0, ["B", 1, 1, 1], "b"))
        h = SymTensor(bld.iota(1, [1, H, 1, 1], "h"))
        qi = SymTensor(bld.iota(2, [1, 1, "M", 1], "q_idx"))
        ki = SymTensor(bld.iota(3, [1, 1, 1, "N"], "kv_idx"))
        if score_mod is not None:
            shape = s.shape
            s = score_mod(s, b, h, qi, ki)
            s = _sym(s)
            if not is_float(s.dtype):
                raise FalowerError(f"score_mod must return a float tensor, got {s.dtype}")
            if s.shape != shape:
                got = ", ".join(map(str, s.shape))
                raise FalowerError(f"score_mod must return a score per (b, h, q_idx, kv_idx), shape [B, H, M, N]; it "
                                   f"returned [{got}], which does not depend on the score (falower lowers scores "
                                   "computed from q @ k^T)")
            s = s.to(acc)
        if mask_mod is not None:
            m = mask_mod(b, h, qi, ki)
            if isinstance(m, SymTensor) and is_int(m.dtype):
                raise FalowerError(f"mask_mod must return a bool tensor, not {m.dtype}: compare it (keep[b, kv] != 0) "
                                   "or .bool() it (an integer operand of & | ^ makes the result an integer, as torch's)")
            if not isinstance(m, SymTensor) or m.dtype != "bool":
                raise FalowerError("mask_mod must return a bool tensor (a comparison, or & | ~ of comparisons)")
            s = where(m, s, -math.inf)
        p = softmax(s, dim=-1)
        if not return_lse:
            return (p @ v).to(dtype)
        m = s.amax(-1, keepdim=True)
        m = where(m == -math.inf, 0.0, m)  # a fully masked row: -inf, not NaN
        return (p @ v).to(dtype), (m + (s - m).exp().sum(-1, keepdim=True).log()).squeeze(-1)

    body.__name__ = name
    return trace(body, name=name, result_names=("o", "lse") if return_lse else ("o",), q=qt, k=kt, v=kt)
