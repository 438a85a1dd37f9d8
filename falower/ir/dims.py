"""Symbolic dimensions: B, H, M, N, D and the arithmetic tiling needs (cdiv, floor division, min, max).

Dims are small immutable expression trees, simplified as they are built so that structural equality is
good enough to compare shapes (`cdiv(M, 64)` built twice is the same object value).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Union

from ..errors import ParseError, ShapeError

DimLike = Union["Dim", int, str]


TRACED_SIZE = None  # the frontend's: a symbolic size as a traced f32 scalar, while a graph is traced


def _size_error(d: "Dim", use: str) -> Exception:
    from ..errors import FalowerError

    return FalowerError(f"the size {d} is symbolic and {use} needs its value: give it one (fl.tensor('f16', "
                        f"'B,H,M,64') or head_dim=64), or write the arithmetic on a traced value (s * {d} ** -0.5 and "
                        f"s / {d} ** 0.5 trace it)")


def _dim_or_none(x: object) -> Optional["Dim"]:
    """x as a Dim (`dim`'s rules), or None where it is not one (a traced tensor: `N - kv` is then the tensor's
    __rsub__)."""
    try:
        return dim(x)  # type: ignore[arg-type]
    except TypeError:
        return None


class Dim:
    """Base of the expression tree; use `dim()` to build one from an int or a symbol name. An operand that is
    not a dimension (a traced tensor in a score_mod: `N - kv`) gets NotImplemented, so its own reflected
    operator runs."""

    def _bin(self, op: str, other: object, reflected: bool = False):
        o = _dim_or_none(other)
        if o is None:
            return NotImplemented
        return binop(op, o, self) if reflected else binop(op, self, o)

    def __add__(self, other: DimLike) -> "Dim":
        return self._bin("+", other)

    def __radd__(self, other: DimLike) -> "Dim":
        return self._bin("+", other, True)

    def __sub__(self, other: DimLike) -> "Dim":
        return self._bin("-", other)

    def __rsub__(self, other: DimLike) -> "Dim":
        return self._bin("-", other, True)

    def __mul__(self, other: DimLike) -> "Dim":
        return self._bin("*", other)

    def __rmul__(self, other: DimLike) -> "Dim":
        return self._bin("*", other, True)

    def __floordiv__(self, other: DimLike) -> "Dim":
        return self._bin("fdiv", other)

    # A size in float arithmetic (`s * q.shape[-1] ** -0.5`, `s / math.sqrt(D)`): a number for a constant size; a
    # symbolic one becomes a traced f32 scalar while a graph is traced (TRACED_SIZE, set by the frontend), else a
    # one-line error. Sizes themselves only add, subtract, multiply and floor-divide.
    def _float_op(self, op: str, other: object, reflected: bool = False):
        if isinstance(other, Dim) or not isinstance(other, (int, float)) or isinstance(other, bool):
            return NotImplemented
        fn = {"/": operator.truediv, "**": operator.pow}[op]
        x: object = float(self.value) if isinstance(self, Const) else None
        if x is None:
            if TRACED_SIZE is None:
                raise _size_error(self, op)
            x = TRACED_SIZE(self)
        return fn(other, x) if reflected else fn(x, other)

    def __truediv__(self, other: object):
        return self._float_op("/", other)

    def __rtruediv__(self, other: object):
        return self._float_op("/", other, True)

    def __pow__(self, other: object):
        return self._float_op("**", other)

    def __rpow__(self, other: object):
        return self._float_op("**", other, True)

    def __float__(self) -> float:
        if isinstance(self, Const):
            return float(self.value)
        raise _size_error(self, "float()")

    def __index__(self) -> int:
        if isinstance(self, Const):
            return self.value
        raise _size_error(self, "an int")

    def symbols(self) -> set[str]:
        raise NotImplementedError

    def eval(self, env: Mapping[str, int]) -> int:
        raise NotImplementedError

    @property
    def is_const(self) -> bool:
        return isinstance(self, Const)


@dataclass(frozen=True, eq=True)
class Const(Dim):
    value: int

    def symbols(self) -> set[str]:
        return set()

    def eval(self, env: Mapping[str, int]) -> int:
        return self.value

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True, eq=True)
class Sym(Dim):
    name: str

    def symbols(self) -> set[str]:
        return {self.name}

    def eval(self, env: Mapping[str, int]) -> int:
        if self.name not in env:
            raise ShapeError(f"no size given for dimension {self.name} (pass it with --shapes {self.name}=...)")
        return int(env[self.name])

    def __str__(self) -> str:
        return self.name


_FUNCS = ("cdiv", "fdiv", "min", "max")
_INFIX = ("+", "-", "*")


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "fdiv":
        return a // b
    if op == "cdiv":
        return -(-a // b)
    if op == "min":
        return min(a, b)
    if op == "max":
        return max(a, b)
    raise ValueError(op)


@dataclass(frozen=True, eq=True)
class BinDim(Dim):
    op: str
    lhs: Dim
    rhs: Dim

    def symbols(self) -> set[str]:
        return self.lhs.symbols() | self.rhs.symbols()

    def eval(self, env: Mapping[str, int]) -> int:
        a, b = self.lhs.eval(env), self.rhs.eval(env)
        if b == 0 and self.op in ("fdiv", "cdiv"):
            why = "" if isinstance(self.rhs, Const) else f" ({self.rhs} = 0)"
            raise ShapeError(f"dimension {self} divides by zero{why}")
        return _apply(self.op, a, b)

    def __str__(self) -> str:
        if self.op in _FUNCS:
            return f"{self.op}({self.lhs}, {self.rhs})"
        return f"{_wrap(self.lhs, self.op, False)}{self.op}{_wrap(self.rhs, self.op, True)}"


_PREC = {"+": 1, "-": 1, "*": 2}


def _wrap(d: Dim, parent: str, right: bool) -> str:
    if isinstance(d, BinDim) and d.op in _INFIX:
        p, c = _PREC[parent], _PREC[d.op]
        if c < p or (right and c == p and parent == "-") or (right and c == p and d.op != parent):
            return f"({d})"
    if isinstance(d, Const) and d.value < 0:
        return f"({d})"
    return str(d)


def dim(x: DimLike) -> Dim:
    """An int, a symbol name, an expression string or a Dim, as a Dim."""
    if isinstance(x, Dim):
        return x
    if isinstance(x, bool):
        raise TypeError("a dimension cannot be a bool")
    if isinstance(x, int):
        return Const(int(x))
    if isinstance(x, str):
        return parse_dim(x)
    try:
        import numpy as np

        if isinstance(x, np.integer):
            return Const(int(x))
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"cannot make a dimension from {x!r}")


def binop(op: str, a: Dim, b: Dim) -> Dim:
    """Build and simplify: fold constants and drop identities, so equal dims compare equal."""
    if isinstance(a, Const) and isinstance(b, Const):
        if op in ("fdiv", "cdiv") and b.value == 0:
            raise ShapeError("dimension division by zero")
        return Const(_apply(op, a.value, b.value))
    if op == "+":
        if isinstance(a, Const) and a.value == 0:
            return b
        if isinstance(b, Const) and b.value == 0:
            return a
        if isinstance(b, Const) and b.value < 0:
            return binop("-", a, Const(-b.value))
    if op == "-":
        if isinstance(b, Const) and b.value == 0:
            return a
        if a == b:
            return Const(0)
    if op == "*":
        if isinstance(a, Const) and not isinstance(b, Const):
            a, b = b, a  # constants on the right: N*2, never 2*N
        if isinstance(b, Const) and b.value == 1:
            return a
        if isinstance(b, Const) and b.value == 0:
            return Const(0)
    if op in ("fdiv", "cdiv") and isinstance(b, Const) and b.value == 1:
        return a
    if op in ("fdiv", "cdiv") and isinstance(a, BinDim) and a.op == "*" and isinstance(b, Const) and b.value > 0 \
            and a.rhs == b:
        return a.lhs  # (HKV*4) // 4 = HKV: the kv heads of a GQA gradient
    if op in ("min", "max") and a == b:
        return a
    return BinDim(op, a, b)


def cdiv(a: DimLike, b: DimLike) -> Dim:
    return binop("cdiv", dim(a), dim(b))


def dmin(a: DimLike, b: DimLike) -> Dim:
    return binop("min", dim(a), dim(b))


def dmax(a: DimLike, b: DimLike) -> Dim:
    return binop("max", dim(a), dim(b))


# ----------------------------------------------------------------------------------------------- parse
_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(.))")


def _tokens(text: str) -> list[str]:
    out = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            break
        tok = m.group(1) or m.group(2) or m.group(3)
        if tok and not tok.isspace():
            out.append(tok)
        pos = m.end()
    return out


MAX_DEPTH = 100  # nesting a reader takes (a dim's parentheses, minus signs and calls; the IR parser's lists and
# regions): far past any dump, well inside Python's stack


class _DimParser:
    def __init__(self, text: str):
        self.text = text
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0

    def short(self) -> str:
        return repr(self.text) if len(self.text) <= 40 else repr(self.text[:40]) + "..."

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expect: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expect is not None and tok != expect):
            raise ParseError(f"bad dimension expression {self.text!r}: expected {expect or 'more'}, got {tok!r}")
        self.i += 1
        return tok

    def expr(self) -> Dim:
        d = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            d = binop(op, d, self.term())
        return d

    def term(self) -> Dim:
        d = self.atom()
        while self.peek() == "*":
            self.take()
            d = binop("*", d, self.atom())
        return d

    def atom(self) -> Dim:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ParseError(f"bad dimension expression {self.short()}: nested more than {MAX_DEPTH} levels deep")
        try:
            return self._atom()
        finally:
            self.depth -= 1

    def _atom(self) -> Dim:
        tok = self.take()
        if tok == "(":
            d = self.expr()
            self.take(")")
            return d
        if tok == "-":
            inner = self.atom()
            return binop("-", Const(0), inner) if not isinstance(inner, Const) else Const(-inner.value)
        if tok.isdigit():
            if len(tok) > 1000:
                raise ParseError(f"bad dimension expression {self.short()}: a number is too long")
            return Const(int(tok))
        if tok in _FUNCS and self.peek() == "(":
            self.take("(")
            a = self.expr()
            self.take(",")
            b = self.expr()
            self.take(")")
            return binop(tok, a, b)
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", tok):
            return Sym(tok)
        raise ParseError(f"bad dimension expression {self.text!r}: unexpected {tok!r}")


def parse_dim(text: str) -> Dim:
    p = _DimParser(text)
    d = p.expr()
    if p.peek() is not None:
        raise ParseError(f"bad dimension expression {text!r}: trailing {p.peek()!r}")
    return d


def solve_dims(pairs: list[tuple[Dim, int]], env: dict[str, int]) -> dict[str, int]:
    """Bind symbols from (declared dim, actual size) pairs; checks every pair once all are bound.

    Handles plain symbols and `S*c` (what GQA shapes use); raises ShapeError on a mismatch.
    """
    env = dict(env)
    progress = True
    while progress:
        progress = False
        for d, n in pairs:
            free = d.symbols() - env.keys()
            if len(free) != 1:
                continue
            (name,) = free
            if isinstance(d, Sym):
                env[name] = n
                progress = True
            elif isinstance(d, BinDim) and d.op == "*" and isinstance(d.rhs, Const) and isinstance(d.lhs, Sym):
                if n % d.rhs.value:
                    raise ShapeError(f"size {n} is not a multiple of {d.rhs.value} for dimension {d}")
                env[name] = n // d.rhs.value
                progress = True
    for d, n in pairs:
        missing = d.symbols() - env.keys()
        if missing:
            raise ShapeError(f"cannot infer dimension {', '.join(sorted(missing))} from the inputs; give it with --shapes")
        if d.eval(env) != n:
            raise ShapeError(f"dimension {d} = {d.eval(env)} but the input has size {n}")
    return env
