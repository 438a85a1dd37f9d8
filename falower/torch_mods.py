"""FlexAttention's front door: `flex_attention`, `create_block_mask`, and score/mask mods written in torch.

    from falower import flex_attention, create_block_mask          # was: from torch.nn.attention.flex_attention

A `score_mod(score, b, h, q_idx, kv_idx)` or `mask_mod(b, h, q_idx, kv_idx)` written with torch operations
traces through falower's own tracer: the symbolic tensors of `falower.frontend` have a `__torch_function__`
that sends torch functions here (`torch_function`), where each maps to falower's (`torch.where` to
`fl.where`, `torch.tanh` to `fl.tanh`, `table[h, q_idx]` on a torch tensor to a gather of a captured input).
Torch tensors the mods close over become graph inputs (`lift_tensor`), named after the variable that holds
them, and are passed again at every call: a compiled graph is cached by the mods' code, the shapes and
dtypes of the tensors they reach and the Python values they close over (`_Walk`), not by the tensors'
contents, so new document ids or a trained bias table reuse the same kernels. A warm call does not walk the
mods again: it checks the reads the walk recorded (closure cells, globals, defaults, attributes) against
what they gave (`_deps_leaves`), and walks again only when one differs.

torch is imported lazily: this module may be imported without torch, and `import falower` never imports it.
"""

from __future__ import annotations

import functools
import types as _types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .errors import FalowerError, ShapeError
from .frontend import Capture, SymTensor, _identifier
from .frontend import maximum as _maximum
from .frontend import minimum as _minimum
from .frontend import where as _fl_where

# how many times a mod was traced and a graph compiled (tests check that warm calls do neither)
stats = {"traces": 0, "compiles": 0, "walks": 0}  # walks: fingerprints of a score_mod (warm calls make none)

# graph inputs and value names a captured tensor must not take: the attention's own arguments, the names the
# backward gives its extra inputs and gradients, and the index iotas
_RESERVED = {"q", "k", "v", "o", "lse", "do", "dq", "dk", "dv", "b", "h", "q_idx", "kv_idx", "score"}


def _is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "shape") and hasattr(x, "dtype") \
        and hasattr(x, "requires_grad")


# ------------------------------------------------------------------------------ captured torch tensors
_TORCH_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f32", "bfloat16": "f32",  # low-precision tables: f32
                 "int32": "i32", "int64": "i32", "int16": "i32", "uint8": "i32", "int8": "i8", "bool": "bool"}


def capture_dtype(t: Any) -> str:
    """The dtype a torch tensor is captured as: f32/f64 tables as they are (f16/bf16 ones in f32), integer
    tables as i32 (int64 document ids and index tables are converted at each call), bool as bool."""
    name = str(t.dtype).replace("torch.", "")
    if name not in _TORCH_DTYPES:
        raise FalowerError(f"a mod closes over a tensor of dtype {t.dtype}, which falower cannot capture")
    return _TORCH_DTYPES[name]


@dataclass
class _Captured:
    name: str
    dtype: str
    leaf: Optional[int]       # index into the mods' leaves (found again in a later call's mods), or None
    tensor: Any               # the tensor seen while tracing (used as it is when leaf is None)


@dataclass
class _Tracing:
    """What one trace of a pair of mods captures: torch tensors by identity, in the order first touched."""
    leaves: list                                   # tensors reachable from the mods (see _Walk)
    names: list                                    # a name hint per leaf (the variable holding it)
    by_id: dict = field(default_factory=dict)      # id(tensor) -> (Capture, _Captured)
    captured: list = field(default_factory=list)
    cacheable: bool = True                         # False once a tensor not among the leaves is captured
    used_names: set = field(default_factory=set)


_ACTIVE: list[_Tracing] = []


def lift_tensor(t: Any) -> SymTensor:
    """The symbolic graph input for a torch tensor a mod uses (indexes, or uses directly as a 0-d scalar)."""
    if not _ACTIVE:
        raise FalowerError("a torch tensor closed over by a mod can only be captured through falower.flex_attention "
                           "(with falower.attention, use falower.capture(name, dtype, shape))")
    tr = _ACTIVE[-1]
    hit = tr.by_id.get(id(t))
    if hit is None:
        leaf = next((i for i, x in enumerate(tr.leaves) if x is t), None)
        if leaf is None:
            tr.cacheable = False  # made inside the mod, or reached through an object: trace again next time
        hint = tr.names[leaf] if leaf is not None else None
        name = _fresh_name(tr, hint)
        dtype = capture_dtype(t)
        cap = Capture(name, dtype, [int(n) for n in t.shape])
        hit = (cap, _Captured(name, dtype, leaf, t))
        tr.by_id[id(t)] = hit
        tr.captured.append(hit[1])
    return hit[0]._sym()


def _fresh_name(tr: _Tracing, hint: Optional[str]) -> str:
    base = hint if hint and hint.isidentifier() and not hint.startswith("_") else "captured"
    base = base if base not in _RESERVED else f"{base}_table"
    name, n = base, 1
    while name in tr.used_names or name in _RESERVED:
        name, n = f"{base}_{n}", n + 1
    tr.used_names.add(name)
    return _identifier(name, "a captured tensor's name")


# -------------------------------------------------------------------------- torch functions on SymTensors
def _s(x: Any) -> Any:
    """A torch tensor becomes its captured input; symbolic tensors and Python numbers stay as they are."""
    if isinstance(x, SymTensor) or not _is_torch_tensor(x):
        return x
    return lift_tensor(x)


_REFLECTED_CMP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


def _binary(op: str) -> Callable:
    """torch.<op>(a, b) and a.<op>(b) with a or b symbolic; the reflected form when a is a number."""
    def impl(a: Any, b: Any, *, alpha: Any = None, out: Any = None) -> SymTensor:
        if out is not None:
            raise FalowerError(f"torch.{op}(..., out=...) cannot be traced: return the result instead")
        a, b = _s(a), _s(b)
        if alpha is not None and alpha != 1:
            b = b * alpha
        if isinstance(a, SymTensor):
            return getattr(a, f"__{op}__")(b)
        if op in _REFLECTED_CMP:
            return getattr(b, f"__{_REFLECTED_CMP[op]}__")(a)
        return getattr(b, f"__r{op}__")(a)
    return impl


def _reflected(op: str) -> Callable:
    """Tensor.__r<op>__(self, other) is `other <op> self`."""
    return lambda a, b: _binary(op)(b, a)


def _div(a: Any, b: Any, *, rounding_mode: Optional[str] = None, out: Any = None) -> SymTensor:
    if rounding_mode is None:
        return _binary("truediv")(a, b, out=out)
    if rounding_mode == "floor":
        return _binary("floordiv")(a, b, out=out)
    raise FalowerError(f"torch.div(rounding_mode={rounding_mode!r}) has no falower equivalent (use // for floor)")


def _unary(method: str) -> Callable:
    def impl(x: Any, *, out: Any = None) -> SymTensor:
        if out is not None:
            raise FalowerError(f"torch.{method}(..., out=...) cannot be traced: return the result instead")
        return getattr(_s(x), method)()
    return impl


def _round(x: Any, *, decimals: int = 0) -> SymTensor:
    if decimals:
        return _s(x * 10 ** decimals).round() / 10 ** decimals
    return _s(x).round()


def _torch_where(cond: Any, a: Any = None, b: Any = None) -> SymTensor:
    if a is None or b is None:
        raise FalowerError("torch.where(cond) (the indices of True elements) cannot be traced: use torch.where(cond, a, b)")
    return _fl_where(_s(cond), _s(a), _s(b))


def _clamp(x: Any, min: Any = None, max: Any = None) -> SymTensor:  # noqa: A002
    x = _s(x)
    if not isinstance(x, SymTensor):
        x = _maximum(_s(min), x) if min is not None else x
        return _minimum(x, _s(max)) if max is not None else x
    return x.clamp(_s(min), _s(max))


def _max2(a: Any, b: Any) -> SymTensor:
    return _maximum(_s(a), _s(b))


def _min2(a: Any, b: Any) -> SymTensor:
    return _minimum(_s(a), _s(b))


def _nan_ignoring(name: str) -> Callable:
    """torch.fmax / fmin take the other operand where one is NaN; falower's maximum / minimum propagate NaN, so
    mapping one to the other would be silently wrong exactly where the two differ: refused in one line."""
    def refuse(*args: Any, **kwargs: Any) -> SymTensor:
        raise FalowerError(f"torch.{name} ignores NaN operands, which falower's maximum / minimum do not: use "
                           f"torch.{'maximum' if name == 'fmax' else 'minimum'} (the same wherever no operand is NaN)")
    return refuse


def _getitem(t: Any, index: Any) -> SymTensor:
    """A torch tensor indexed by traced indices: a gather from the captured tensor."""
    index = tuple(_s(i) for i in index) if isinstance(index, tuple) else _s(index)
    return _s(t)[index]


def _method(name: str) -> Callable:
    return lambda x, *args, **kwargs: getattr(_s(x), name)(*args, **kwargs)


def _relu(x: Any, inplace: bool = False) -> SymTensor:
    """torch.relu keeps an integer tensor's dtype (max with 0.0 made it f32, and a later `%` refused a float)."""
    return _s(x).relu()


def _ones_like(x: Any, *, dtype: Any = None, **_: Any) -> SymTensor:
    return _s(x).new_full((), 1, dtype)


def _zeros_like(x: Any, *, dtype: Any = None, **_: Any) -> SymTensor:
    return _s(x).new_full((), 0, dtype)


def _full_like(x: Any, fill_value: Any, *, dtype: Any = None, **_: Any) -> SymTensor:
    return _s(x).new_full((), fill_value, dtype)


_TORCH_IMPLS: dict[str, Callable] = {
    "__getitem__": _getitem,
    "where": _torch_where,
    "div": _div, "divide": _div,
    "clamp": _clamp, "clip": _clamp,
    "clamp_min": lambda x, m: _clamp(x, min=m), "clamp_max": lambda x, m: _clamp(x, max=m),
    "maximum": _max2, "minimum": _min2, "fmax": _nan_ignoring("fmax"), "fmin": _nan_ignoring("fmin"),
    "round": _round,
    "relu": _relu,
    "ones_like": _ones_like, "zeros_like": _zeros_like, "full_like": _full_like,
    "square": _unary("square"), "reciprocal": _unary("reciprocal"),
    "logical_not": _unary("logical_not"), "bitwise_not": lambda x: ~_s(x),
    "logical_and": lambda a, b: _s(a).logical_and(_s(b)) if isinstance(_s(a), SymTensor) else _s(b).logical_and(a),
    "logical_or": lambda a, b: _s(a).logical_or(_s(b)) if isinstance(_s(a), SymTensor) else _s(b).logical_or(a),
    "neg": lambda x: -_s(x), "negative": lambda x: -_s(x), "abs": _unary("abs"), "absolute": _unary("abs"),
    "sgn": _unary("sign"), "pow": _binary("pow"), "float_power": _binary("pow"),
}
for _name in ("exp", "exp2", "log", "log2", "log1p", "expm1", "tanh", "sigmoid", "sin", "cos", "tan", "sqrt", "rsqrt",
              "sign", "floor", "ceil", "erf"):
    _TORCH_IMPLS[_name] = _unary(_name)
for _op, _names in {"add": ("add",), "sub": ("sub", "subtract"), "mul": ("mul", "multiply"),
                    "truediv": ("true_divide",), "floordiv": ("floor_divide",), "mod": ("remainder",),
                    "and": ("bitwise_and",), "or": ("bitwise_or",), "xor": ("bitwise_xor",),
                    "lt": ("lt", "less"), "le": ("le", "less_equal"), "gt": ("gt", "greater"),
                    "ge": ("ge", "greater_equal"), "eq": ("eq",), "ne": ("ne", "not_equal")}.items():
    for _name in _names + (f"__{_op}__",):
        _TORCH_IMPLS[_name] = _binary(_op)
    if _op not in _REFLECTED_CMP:
        _TORCH_IMPLS[f"__r{_op}__"] = _reflected(_op)
_TORCH_IMPLS.update({"__div__": _binary("truediv"), "__rdiv__": _reflected("truediv"), "__pow__": _binary("pow"),
                     "__rpow__": _reflected("pow"), "__neg__": lambda x: -_s(x), "__invert__": lambda x: ~_s(x),
                     "__abs__": _unary("abs")})
for _name in ("to", "float", "half", "double", "bfloat16", "int", "long", "bool", "type_as", "new_ones", "new_zeros",
              "new_full"):
    _TORCH_IMPLS[_name] = _method(_name)


def torch_function(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """SymTensor.__torch_function__: the falower equivalent of a torch function, or a one-line refusal."""
    name = getattr(func, "__name__", None) or str(func)
    impl = _TORCH_IMPLS.get(name)
    if impl is None:
        raise FalowerError(f"torch.{name} has no falower equivalent in a traced score_mod/mask_mod (supported: "
                           f"arithmetic, comparisons, & | ~, torch.where, exp/log/tanh/sigmoid/sin/cos/sqrt/..., "
                           f"clamp, minimum, maximum, pow, casts, indexing captured tensors)")
    return impl(*args, **kwargs)


# -------------------------------------------------------------------------------- mods' fingerprints
def _global_names(code: _types.CodeType) -> list[str]:
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, _types.CodeType):
            names += _global_names(c)
    return names


_MISSING = object()  # a global name, attribute or cell with no value


@dataclass(frozen=True)
class _TensorSig:
    """What a key keeps of a torch tensor: its shape, dtype and device kind (not the tensor)."""
    shape: tuple
    dtype: str
    device: str


def _tensor_sig(t: Any) -> _TensorSig:
    return _TensorSig(tuple(t.shape), str(t.dtype), t.device.type)


class _Walk:
    """Fingerprints a mod (`fp`) and records every read the fingerprint depends on (`deps`): a closure
    cell's contents, a global's value, an attribute, a list's length and items. A later call checks those
    reads again (`_deps_leaves`), a few identity comparisons, instead of walking the mod."""

    def __init__(self) -> None:
        self.leaves: list = []
        self.names: list = []
        self.keep: list = []  # objects keyed by id: held so the id is not reused while the key lives
        self.deps: list = []  # (kind, container, key, expected): see _deps_leaves
        self.depth = 0

    def read(self, kind: str, container: Any, key: Any = None) -> Any:
        """container's cell / attribute / item `key`, recorded as a dependency of the key."""
        value = _read(kind, container, key)
        expected = _tensor_sig(value) if _is_torch_tensor(value) else value
        self.deps.append((kind, container, key, expected))
        return value

    def fp(self, obj: Any, hint: Optional[str] = None) -> Any:
        """A hashable key of everything a mod's trace depends on: its code, the Python values it closes
        over, the functions it calls (recursively), and for torch tensors their shape, dtype and device kind
        (the tensors themselves are collected as leaves, in a fixed order, to be passed at each call)."""
        if _is_torch_tensor(obj):
            self.leaves.append(obj)
            self.names.append(hint)
            return ("T", tuple(obj.shape), str(obj.dtype), obj.device.type)
        if obj is None or isinstance(obj, (bool, int, str)):
            return ("V", type(obj).__name__, obj)
        if isinstance(obj, float):
            return ("V", "float", repr(obj))  # repr: nan keys equal to themselves
        if obj is _MISSING:
            return ("missing",)
        if self.depth > 24:
            self.keep.append(obj)
            return ("id", id(obj))
        self.depth += 1
        try:
            if isinstance(obj, (tuple, list)):
                if isinstance(obj, list):
                    self.deps.append(("len", obj, None, len(obj)))
                return ("L", tuple(self.fp(self.read("item", obj, i), hint) for i in range(len(obj))))
            if isinstance(obj, functools.partial):
                kw = obj.keywords
                return ("P", self.fp(obj.func), self.fp(obj.args),
                        tuple((k, self.fp(self.read("item", kw, k), k)) for k in sorted(kw)))
            if isinstance(obj, _types.MethodType):  # a module's method: self.bias, self.window are its state
                owner = obj.__self__
                self.keep.append(owner)
                attrs = []
                for name in dict.fromkeys(_global_names(obj.__func__.__code__)):
                    val = self.read("attr", owner, name)
                    if _is_torch_tensor(val) or isinstance(val, (bool, int, float, str)):
                        attrs.append((name, self.fp(val, name)))
                return ("M", self.fp(obj.__func__), id(owner), tuple(attrs))
            if isinstance(obj, _types.FunctionType):
                return self._function(obj)
            self.keep.append(obj)  # modules, builtins, classes, other objects: by identity
            return ("id", id(obj))
        finally:
            self.depth -= 1

    def _function(self, f: _types.FunctionType) -> Any:
        code = self.read("attr", f, "__code__")
        if (f.__module__ or "").startswith("torch.") and not code.co_freevars:
            return ("F", code)  # a torch helper such as noop_mask
        cells = []
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            contents = self.read("cell", cell)
            cells.append((name, "empty" if contents is _MISSING else self.fp(contents, name)))
        globs = []
        g = f.__globals__
        for name in dict.fromkeys(_global_names(code)):
            val = self.read("item", g, name)
            if val is _MISSING:
                continue
            if isinstance(val, (_types.ModuleType, type, _types.BuiltinFunctionType)):
                continue  # torch, math, classes: their names are in the code already
            if _is_torch_tensor(val) or isinstance(val, (bool, int, float, str, tuple, list, functools.partial,
                                                         _types.FunctionType, _types.MethodType)):
                globs.append((name, self.fp(val, name)))
        defaults = self.read("attr", f, "__defaults__")
        kwdefaults = self.read("attr", f, "__kwdefaults__")
        return ("F", code, tuple(cells), tuple(globs), self.fp(defaults),
                self.fp(kwdefaults and tuple(sorted(kwdefaults.items()))))


def _read(kind: str, container: Any, key: Any) -> Any:
    if kind == "cell":
        try:
            return container.cell_contents
        except ValueError:  # an empty cell (a name assigned later)
            return _MISSING
    if kind == "attr":
        try:
            return getattr(container, key)
        except Exception:  # noqa: BLE001  (a name of the code that is not an attribute)
            return _MISSING
    if isinstance(container, dict):
        return container.get(key, _MISSING)
    return container[key] if key < len(container) else _MISSING


def _deps_leaves(deps: list) -> Optional[list]:
    """The torch tensors the mods reach now, in the walk's order, if every read a key depends on gives what
    it gave when the key was made (the same object, an equal Python number or string, a tensor of the same
    shape, dtype and device kind); None if any differs (walk the mods again)."""
    leaves = []
    for kind, container, key, expected in deps:
        if kind == "len":
            if len(container) != expected:
                return None
            continue
        if kind == "cell":
            try:
                value = container.cell_contents
            except ValueError:
                value = _MISSING
        else:
            value = _read(kind, container, key)
        if value is expected:
            continue
        if type(expected) is _TensorSig:
            if not (hasattr(value, "data_ptr") and value.shape == expected.shape and str(value.dtype) == expected.dtype
                    and value.device.type == expected.device and _is_torch_tensor(value)):
                return None
            leaves.append(value)
        elif type(value) is not type(expected) or not isinstance(value, (bool, int, float, str)) or value != expected:
            return None
    return leaves


@dataclass
class _ModKey:
    key: Any
    leaves: list
    names: list
    keep: list
    deps: list = field(default_factory=list)


def _mod_key(mod: Optional[Callable]) -> _ModKey:
    if mod is None:
        return _ModKey(None, [], [], [])
    if not callable(mod):
        raise FalowerError(f"a score_mod/mask_mod must be callable, got {type(mod).__name__}")
    stats["walks"] += 1
    w = _Walk()
    key = w.fp(mod)
    return _ModKey(key, w.leaves, w.names, w.keep, w.deps)


# ---------------------------------------------------------------------------------------- block masks
class BlockMask:
    """falower's block mask: the mask_mod with its fingerprint and captured tensors, built once by
    `create_block_mask` and reused by every `flex_attention` call (every layer, every step). Which kv tiles
    are empty, partial or full comes from the traced mask: by interval arithmetic in the kernels for masks of
    indices (`mask.classify`); for masks that read tensors (document ids) from per-tile min / max of those
    tensors (`mask.ranges`) and lists of the tiles to visit (the forward's kv tiles per q tile, the
    backward's q tiles per kv tile). That block data is made on the first call with these tensors and
    remembered with them (their identity and version counter: an in-place write makes it anew), so every
    layer and step reusing this mask reuses it; masks the ranges cannot bound fall back to the dense
    `mask.block_table`, remembered the same way."""

    def __init__(self, mask_mod: Callable, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                 device: Any = None, BLOCK_SIZE: Any = 128):
        self.mask_mod = mask_mod
        self.B, self.H = B, H
        self.seq_lengths = (int(Q_LEN), int(KV_LEN))
        self.device = device
        self.BLOCK_SIZE = BLOCK_SIZE if isinstance(BLOCK_SIZE, tuple) else (BLOCK_SIZE, BLOCK_SIZE)
        self._key = _mod_key(mask_mod)

    @property
    def shape(self) -> tuple:
        return (self.B or 1, self.H or 1, *self.seq_lengths)

    def __repr__(self) -> str:
        name = getattr(self.mask_mod, "__name__", type(self.mask_mod).__name__)
        return f"falower.BlockMask(mask_mod={name}, shape={self.shape})"


def create_block_mask(mask_mod: Callable, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      device: Any = None, BLOCK_SIZE: Any = 128, _compile: bool = False, **_ignored: Any) -> BlockMask:
    """torch.nn.attention.flex_attention.create_block_mask's signature; `_compile` and the block-size
    options are accepted for compatibility (falower's tiles come from its pipeline)."""
    return BlockMask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE)


# ------------------------------------------------------------------------------------- flex_attention
@dataclass
class _Entry:
    compiled: Any
    captured: list  # _Captured per graph input after q, k, v, in the graph's order


_CACHE: dict = {}


@dataclass
class _Fast:
    """A warm call's shortcut to a cached graph: the mod objects (held, so their ids stay theirs), the reads
    the score_mod's key depends on, and how its tensors alias."""
    score_mod: tuple  # _identity(score_mod)
    block_mask: Any
    deps: list
    aliases: tuple
    entry: _Entry


_FAST: dict = {}
_FAST_LIMIT = 256  # mods made anew at each call (a lambda in a loop) would otherwise pile up here
_NO_MOD = _ModKey(None, [], [], [])


def _identity(mod: Any) -> tuple:
    """The objects a mod is: itself, or a bound method's function and owner (`m.score_mod` is a new method
    object at each access, the same function of the same module)."""
    if isinstance(mod, _types.MethodType):
        return (mod.__func__, mod.__self__)
    return (mod,)


def _aliases(leaves: list) -> tuple:
    """For each tensor the mods reach, the first position it is reached at (the same tensor twice is one
    captured input)."""
    first: dict = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(leaves))


def _torch_dtype_name(t: Any) -> str:
    name = str(t.dtype).replace("torch.", "")
    dt = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}.get(name)
    if dt is None:
        raise FalowerError(f"flex_attention takes float16, bfloat16, float32 or float64 q, k, v, got {t.dtype}")
    return dt


def _build(score: _ModKey, mask: _ModKey, score_mod: Optional[Callable], mask_mod: Optional[Callable], dtype: str,
           group: int, scale: Optional[float], backend: str) -> tuple[_Entry, bool]:
    from .compiler import compile as fl_compile
    from .frontend import attention

    tr = _Tracing(score.leaves + mask.leaves, score.names + mask.names)
    _ACTIVE.append(tr)
    try:
        name = getattr(score_mod, "__name__", None) or getattr(mask_mod, "__name__", None) or "flex"
        name = name if name.isidentifier() and not name.startswith("<") else "flex"
        graph = attention(score_mod=score_mod, mask_mod=mask_mod, name=name, dtype=dtype, scale=scale,
                          group_size=group)
    finally:
        _ACTIVE.pop()
    stats["traces"] += 1
    by_name = {c.name: c for c in tr.captured}
    captured = [by_name[a.name] for a in graph.args[3:]]
    compiled = fl_compile(graph, backend=backend)
    stats["compiles"] += 1
    return _Entry(compiled, captured), tr.cacheable


def _capture_args(entry: _Entry, leaves: list, device: Any) -> list:
    import torch

    out = []
    for c in entry.captured:
        t = leaves[c.leaf] if c.leaf is not None else c.tensor
        want = {"f32": torch.float32, "f64": torch.float64, "i32": torch.int32, "i8": torch.int8,
                "bool": torch.bool}[c.dtype]
        if t.dtype != want or t.device != device:
            t = _converted(t, device, want)
        out.append(t)
    return out


_CONVERTED: dict = {}  # (id, version, dtype, device) -> (weak reference to the tensor, its converted copy)


def _converted(t: Any, device: Any, want: Any) -> Any:
    """`t.to(device, want)`, the same copy again while `t` is the same tensor with the same contents (its
    version counter): int64 document ids converted to int32 at every call would be new data at every call,
    and the kernels' block data (range tables, block list) would be made anew each time. Tensors that
    require grad are converted each call (autograd must see this call's conversion)."""
    import weakref

    if t.requires_grad:
        return t.to(device=device, dtype=want)
    key = (id(t), t._version, want, device)
    hit = _CONVERTED.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    out = t.to(device=device, dtype=want)
    if len(_CONVERTED) >= 64:
        _CONVERTED.clear()
    _CONVERTED[key] = (weakref.ref(t), out)
    return out


def _check_call(query: Any, key: Any, value: Any, block_mask: Any, scale: Any, enable_gqa: bool,
                return_aux: Any) -> tuple:
    """flex_attention's checks of its arguments; returns (dtype, group, backend, scale), remembered for the
    call's signature (_CHECKED)."""
    scale_arg = scale
    import torch

    if return_aux is not None:
        raise FalowerError("flex_attention(return_aux=...) is not supported by falower: use return_lse=True")
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise FalowerError("block_mask must come from falower.create_block_mask (torch's BlockMask holds no "
                           "mask falower can trace: build it again with falower.create_block_mask)")
    for n, t in (("query", query), ("key", key), ("value", value)):
        if not torch.is_tensor(t) or t.dim() != 4:
            raise ShapeError(f"flex_attention's {n} must be a 4-d tensor [B, H, N, D], got "
                             f"{tuple(t.shape) if torch.is_tensor(t) else type(t).__name__}")
    B, Hq, L, E = query.shape
    Bk, Hkv, S, Ek = key.shape
    if tuple(value.shape) != tuple(key.shape):
        raise ShapeError(f"value must have key's shape {tuple(key.shape)} (falower needs the same head dim for "
                         f"q, k and v), got {tuple(value.shape)}")
    if Bk != B or Ek != E:
        raise ShapeError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must agree in batch and head dim")
    if Hq != Hkv:
        if not enable_gqa:
            raise ShapeError(f"query has {Hq} heads and key {Hkv}: pass enable_gqa=True for grouped-query attention")
        if Hq % Hkv:
            raise ShapeError(f"enable_gqa needs query heads ({Hq}) to be a multiple of key/value heads ({Hkv})")
    if not (query.dtype == key.dtype == value.dtype):
        raise ShapeError(f"query, key and value must have one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if block_mask is not None and block_mask.seq_lengths != (L, S):
        raise ShapeError(f"block_mask was made for Q_LEN, KV_LEN = {block_mask.seq_lengths}, but query and key "
                         f"have {L} and {S}")
    dtype = _torch_dtype_name(query)
    group = Hq // Hkv
    backend = "numba-cuda" if query.is_cuda else "reference"
    scale = None if scale is None else float(scale)
    out = (dtype, group, backend, scale)
    if len(_CHECKED) >= _FAST_LIMIT:
        _CHECKED.clear()
    _CHECKED[(query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, query.device, enable_gqa,
              scale_arg, return_aux, type(block_mask), block_mask.seq_lengths if block_mask is not None else None)] = out
    return out


_CHECKED: dict = {}


def flex_attention(query: Any, key: Any, value: Any, score_mod: Optional[Callable] = None,
                   block_mask: Optional[BlockMask] = None, scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options: Any = None, *, return_aux: Any = None) -> Any:
    """torch.nn.attention.flex_attention.flex_attention on falower's kernels (numba-cuda for CUDA tensors,
    the reference interpreter for CPU ones). query [B, Hq, L, E], key/value [B, Hkv, S, E]; returns the
    output [B, Hq, L, E] (contiguous), or (output, lse) with return_lse (lse [B, Hq, L] in float32, natural
    log). Differentiable: inputs or captured tensors that require grad go through falower's backward."""
    import torch

    try:  # a call signature checked before skips the checks (warm calls: the same shapes every step)
        checked = _CHECKED.get((query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
                                query.device, enable_gqa, scale, return_aux, type(block_mask),
                                block_mask.seq_lengths if block_mask is not None else None))
    except (AttributeError, TypeError):  # not tensors, or an unhashable argument: the checks say what is wrong
        checked = None
    if checked is None:
        checked = _check_call(query, key, value, block_mask, scale, enable_gqa, return_aux)
    dtype, group, backend, scale = checked

    mask_mod = block_mask.mask_mod if block_mask is not None else None
    mask = block_mask._key if block_mask is not None else _NO_MOD
    # warm calls: the same mod objects whose recorded reads (closure cells, globals, defaults) still give
    # what they gave: a few identity checks instead of a walk of the mods
    ident = _identity(score_mod)
    fast_key = (tuple(map(id, ident)), id(block_mask), dtype, group, scale, backend)
    fast = _FAST.get(fast_key)
    entry = None
    if fast is not None and fast.block_mask is block_mask and all(a is b for a, b in zip(fast.score_mod, ident)):
        score_leaves = _deps_leaves(fast.deps)
        if score_leaves is not None:
            leaves = score_leaves + mask.leaves
            if _aliases(leaves) == fast.aliases:
                entry = fast.entry
    if entry is None:
        score = _mod_key(score_mod)
        leaves = score.leaves + mask.leaves
        aliases = _aliases(leaves)
        cache_key = (score.key, mask.key, aliases, dtype, group, scale, backend)
        entry = _CACHE.get(cache_key)
        if entry is None:
            entry, cacheable = _build(score, mask, score_mod, mask_mod, dtype, group, scale, backend)
            if cacheable:
                _CACHE[cache_key] = entry
                entry.keep = score.keep + mask.keep  # type: ignore[attr-defined]  (ids in the key stay unique)
        if cache_key in _CACHE:
            if len(_FAST) >= _FAST_LIMIT:
                _FAST.clear()
            _FAST[fast_key] = _Fast(ident, block_mask, score.deps, aliases, entry)
    caps = _capture_args(entry, leaves, query.device)
    # strided views go to the kernels as they are (strides are kernel arguments: the [B, N, H, D] -> [B, H, N, D]
    # transposes of model code cost no copy); only a last dimension that is not contiguous is copied
    q, k, v = (t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    o, lse = entry.compiled(q, k, v, *caps)
    if not torch.is_tensor(o):  # the reference backend without autograd returns numpy arrays
        o = torch.from_numpy(_np_contiguous(o)).to(device=query.device, dtype=query.dtype)
        lse = torch.from_numpy(_np_contiguous(lse)).to(device=query.device)
    lse = lse if lse.dtype == torch.float64 else lse.float()
    return (o, lse) if return_lse else o


def _np_contiguous(x: Any) -> Any:
    import numpy as np

    return np.ascontiguousarray(x)


def clear_cache() -> None:
    """Forget every compiled flex_attention graph (the next call traces and compiles again)."""
    _CACHE.clear()
    _FAST.clear()


# --------------------------------------------------------------------------- FlexAttention's helpers
def _bool_scalar(like: Any, value: bool) -> Any:
    """A 0-d bool constant next to `like`: a traced one while tracing, a torch one on real index tensors."""
    if isinstance(like, SymTensor):
        return like.new_full((), value, "bool")
    import torch

    return like.new_full((), value, dtype=torch.bool)


def noop_mask(batch: Any, head: Any, token_q: Any, token_kv: Any) -> Any:
    """A mask_mod that keeps everything."""
    return _bool_scalar(batch, True)


def and_masks(*mask_mods: Callable) -> Callable:
    """The intersection of mask_mods."""
    if not all(callable(m) for m in mask_mods):
        raise FalowerError(f"and_masks takes mask_mods (callables), got {mask_mods}")

    def and_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        result = _bool_scalar(b, True)
        for m in mask_mods:
            result = result & m(b, h, q_idx, kv_idx)
        return result

    return and_mask


def or_masks(*mask_mods: Callable) -> Callable:
    """The union of mask_mods."""
    if not all(callable(m) for m in mask_mods):
        raise FalowerError(f"or_masks takes mask_mods (callables), got {mask_mods}")

    def or_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        result = _bool_scalar(b, False)
        for m in mask_mods:
            result = result | m(b, h, q_idx, kv_idx)
        return result

    return or_mask


def helper(name: str) -> Callable:
    """FlexAttention's helper `name` (and_masks, or_masks, noop_mask): torch's own where torch has it (it
    traces the same way), else falower's equivalent above."""
    try:
        from torch.nn.attention import flex_attention as fa

        return getattr(fa, name)
    except (ImportError, AttributeError):  # no torch, or a torch without FlexAttention
        return globals()[name]
