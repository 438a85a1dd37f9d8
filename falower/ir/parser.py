"""Reads back what the printer writes, so every dump can be fed in again (`falower opt dump.mlir`)."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

from ..errors import ParseError, ShapeError
from .builder import normalize_attrs
from .core import Block, Func, Op, Value
from .dims import MAX_DEPTH, Dim, binop, Const, Sym
from .ops import OPS
from .types import DTYPES, TensorType

_TOKEN = re.compile(r"""
    (?P<ws>\s+|//[^\n]*)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<val>%[A-Za-z0-9_.<>?]+)
  | (?P<sym>@[A-Za-z0-9_.]+)
  | (?P<num>\d+\.\d*(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+|\d+)
  | (?P<id>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<arrow>->)
  | (?P<p>[()\[\]{},:=^*+\-])
""", re.VERBOSE)


class Tok:
    __slots__ = ("kind", "text", "line")

    def __init__(self, kind: str, text: str, line: int):
        self.kind, self.text, self.line = kind, text, line


def tokenize(text: str) -> list[Tok]:
    toks: list[Tok] = []
    pos, line = 0, 1
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ParseError(f"line {line}: unexpected character {text[pos]!r}")
        kind = m.lastgroup or ""
        if kind != "ws":
            toks.append(Tok(kind, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return toks


class Parser:
    def __init__(self, text: str):
        if not isinstance(text, str):
            raise ParseError(f"IR text must be a str, got {type(text).__name__}")
        self.toks = tokenize(text)
        self.i = 0
        self.scopes: list[dict[str, Value]] = []
        self.depth = 0

    # ----------------------------------------------------------------------------------- tokens
    def peek(self, k: int = 0) -> Optional[Tok]:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def at(self, text: str, k: int = 0) -> bool:
        t = self.peek(k)
        return t is not None and t.text == text

    def error(self, msg: str) -> ParseError:
        t = self.peek()
        where = f"line {t.line}, at {t.text!r}" if t else "end of input"
        return ParseError(f"{where}: {msg}")

    def take(self, text: Optional[str] = None, kind: Optional[str] = None) -> Tok:
        t = self.peek()
        if t is None or (text is not None and t.text != text) or (kind is not None and t.kind != kind):
            raise self.error(f"expected {text or kind}")
        self.i += 1
        return t

    def accept(self, text: str) -> bool:
        if self.at(text):
            self.i += 1
            return True
        return False

    def nest(self) -> None:
        """Enter one level of nesting (a parenthesis, a list, a region); `unnest` leaves it."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(f"nested more than {MAX_DEPTH} levels deep")

    def unnest(self) -> None:
        self.depth -= 1

    def integer(self, t: Tok) -> int:
        try:
            return int(t.text)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise ParseError(f"line {t.line}: integer {t.text[:20]}... is too long") from None

    # ----------------------------------------------------------------------------------- values
    def define(self, name: str, v: Value) -> None:
        if any(name in s for s in self.scopes):
            raise self.error(f"%{name} is defined twice")
        self.scopes[-1][name] = v
        v.name = name if not name.isdigit() else None

    def use(self) -> Value:
        t = self.take(kind="val")
        name = t.text[1:]
        for s in reversed(self.scopes):
            if name in s:
                return s[name]
        raise ParseError(f"line {t.line}: use of undefined value %{name}")

    # ------------------------------------------------------------------------------- types, dims
    def dim_expr(self) -> Dim:
        d = self.dim_term()
        while self.at("+") or self.at("-"):
            op = self.take().text
            d = binop(op, d, self.dim_term())
        return d

    def dim_term(self) -> Dim:
        d = self.dim_atom()
        while self.at("*"):
            self.take()
            d = binop("*", d, self.dim_atom())
        return d

    def dim_atom(self) -> Dim:
        t = self.take()
        if t.text in ("(", "-") or (t.text in ("cdiv", "fdiv", "min", "max") and self.at("(")):
            self.nest()
            try:
                return self.dim_nested(t)
            finally:
                self.unnest()
        if t.kind == "num" and t.text.isdigit():
            return Const(self.integer(t))
        if t.kind == "id":
            return Sym(t.text)
        self.i -= 1
        raise self.error("expected a dimension")

    def dim_nested(self, t: Tok) -> Dim:
        """The rest of a dim that nests: `( expr )`, `- atom` or `cdiv(a, b)` (fdiv, min, max)."""
        if t.text == "(":
            d = self.dim_expr()
            self.take(")")
            return d
        if t.text == "-":
            inner = self.dim_atom()
            return Const(-inner.value) if isinstance(inner, Const) else binop("-", Const(0), inner)
        self.take("(")
        a = self.dim_expr()
        self.take(",")
        b = self.dim_expr()
        self.take(")")
        try:
            return binop(t.text, a, b)
        except ShapeError as e:  # cdiv(4, 0): constants folded as they are read
            raise ParseError(f"line {t.line}: {e}") from None

    def type(self) -> TensorType:
        t = self.take(kind="id")
        if t.text not in DTYPES:
            self.i -= 1
            raise self.error(f"unknown dtype (known: {', '.join(DTYPES)})")
        shape: list[Dim] = []
        if self.accept("["):
            if not self.at("]"):
                shape.append(self.dim_expr())
                while self.accept(","):
                    shape.append(self.dim_expr())
            self.take("]")
        return TensorType(t.text, tuple(shape))

    def types(self) -> list[TensorType]:
        out = [self.type()]
        while self.accept(","):
            out.append(self.type())
        return out

    # --------------------------------------------------------------------------------- attributes
    def attr_value(self) -> Any:
        t = self.peek()
        if t is None:
            raise self.error("expected an attribute value")
        if t.kind == "str":
            self.take()
            try:
                return json.loads(t.text)
            except json.JSONDecodeError as e:  # a bad escape (\q), a raw newline: not what the printer writes
                raise ParseError(f"line {t.line}: bad string attribute: {e.msg} (character {e.pos})") from None
        if t.text == "[":
            self.nest()
            self.take()
            items = []
            if not self.at("]"):
                items.append(self.attr_value())
                while self.accept(","):
                    items.append(self.attr_value())
            self.take("]")
            self.unnest()
            return tuple(items)
        if t.text in ("true", "false"):
            self.take()
            return t.text == "true"
        if t.text in ("inf", "nan"):
            self.take()
            return math.inf if t.text == "inf" else math.nan
        if t.text == "-" and self.peek(1) is not None and self.peek(1).text == "inf":  # type: ignore[union-attr]
            self.take()
            self.take()
            return -math.inf
        neg = t.text == "-" and self.peek(1) is not None and self.peek(1).kind == "num"  # type: ignore[union-attr]
        num = self.peek(1) if neg else t
        if num is not None and num.kind == "num" and not num.text.isdigit():
            self.i += 2 if neg else 1
            return -float(num.text) if neg else float(num.text)
        if t.text == ":":
            self.take()
            return ":"
        d = self.dim_expr()
        return d.value if isinstance(d, Const) else d

    def attrs(self, then: tuple[str, ...] = ()) -> dict[str, Any]:
        """`{key = value, flag}` if one is next, else {}. `then`: what must follow the dict where a block of ops
        may stand instead (`func ... { return %x }`, `for ... { yield }`); when something else follows, the
        braces were that block and are left unread."""
        out: dict[str, Any] = {}
        key, after = self.peek(1), self.peek(2)
        if not (self.at("{") and key is not None and key.kind == "id" and after is not None
                and after.text in ("=", ",", "}")):
            return out
        if then:
            start = self.i
            out = self.attrs()
            if self.peek() is None or self.peek().text not in then:  # type: ignore[union-attr]
                self.i = start
                return {}
            return out
        self.take("{")
        while True:
            key = self.take(kind="id").text
            out[key] = self.attr_value() if self.accept("=") else True
            if not self.accept(","):
                break
        self.take("}")
        return normalize_attrs(out)

    # ------------------------------------------------------------------------------------- ops
    def func(self) -> Func:
        self.take("func")
        name = self.take(kind="sym").text[1:]
        self.take("(")
        body = Block()
        self.scopes = [{}]
        if not self.at(")"):
            while True:
                vname = self.take(kind="val").text[1:]
                self.take(":")
                self.define(vname, body.add_arg(self.type()))
                if not self.accept(","):
                    break
        self.take(")")
        self.take("->")
        self.take("(")
        rnames, rtypes = [], []
        if not self.at(")"):
            while True:
                rnames.append(self.take(kind="id").text)
                self.take(":")
                rtypes.append(self.type())
                if not self.accept(","):
                    break
        self.take(")")
        fattrs = self.attrs(then=("{",))
        self.take("{")
        self.block_ops(body)
        self.take("}")
        f = Func(name, body, fattrs)
        if rnames and rnames != [f"out{i}" for i in range(len(rnames))]:
            f.attrs["result_names"] = tuple(rnames)
        ret = body.terminator
        if ret is None or ret.name != "return":
            raise ParseError(f"func @{name} does not end in return")
        got = [v.type for v in ret.operands]
        if got != rtypes:
            raise ParseError(f"func @{name}: signature says ({', '.join(map(str, rtypes))}) but return gives "
                             f"({', '.join(map(str, got))})")
        return f

    def block_ops(self, block: Block) -> None:
        while not self.at("}"):
            if self.peek() is None:
                raise self.error("missing '}'")
            self.op(block)

    def region(self, arg_names: list[str], arg_types: list[TensorType]) -> Block:
        if len(self.scopes) > MAX_DEPTH:
            raise self.error(f"regions nested more than {MAX_DEPTH} levels deep")
        blk = Block(arg_types)
        self.scopes.append({})
        for n, a in zip(arg_names, blk.args):
            self.define(n, a)
        return blk

    def op(self, block: Block) -> None:
        names: list[str] = []
        if self.peek() is not None and self.peek().kind == "val":  # type: ignore[union-attr]
            names.append(self.take().text[1:])
            while self.accept(","):
                names.append(self.take(kind="val").text[1:])
            self.take("=")
        t = self.take(kind="id")
        name = t.text
        if name not in OPS:
            raise ParseError(f"line {t.line}: unknown op {name!r}")
        handler = getattr(self, "op_" + name.replace(".", "_"), None)
        op = handler() if handler else self.generic(name)
        if len(op.results) != len(names):
            raise ParseError(f"line {t.line}: {name} has {len(op.results)} results but {len(names)} names are given")
        block.append(op)
        for n, r in zip(names, op.results):
            self.define(n, r)

    def generic(self, name: str) -> Op:
        operands = []
        if self.peek() is not None and self.peek().kind == "val":  # type: ignore[union-attr]
            operands.append(self.use())
            while self.accept(","):
                operands.append(self.use())
        attrs = self.attrs()
        types = self.types() if self.accept(":") else []
        regions = []
        if self.at("{") and self.at("^", 1):
            self.take("{")
            while self.accept("^"):
                self.take("(")
                anames, atypes = [], []
                if not self.at(")"):
                    while True:
                        anames.append(self.take(kind="val").text[1:])
                        self.take(":")
                        atypes.append(self.type())
                        if not self.accept(","):
                            break
                self.take(")")
                self.take(":")
                blk = self.region(anames, atypes)
                while not (self.at("}") or self.at("^")):
                    self.op(blk)
                self.scopes.pop()
                regions.append(blk)
            self.take("}")
        return Op(name, operands, types, attrs, regions)

    def op_const(self) -> Op:
        value = self.attr_value()
        if isinstance(value, tuple):
            raise self.error("a constant is a single value")
        self.take(":")
        t = self.type()
        return Op("const", [], [t], normalize_attrs({"value": value}))

    def slice(self) -> tuple[tuple, list[Value]]:
        self.take("[")
        spec, idx = [], []
        while True:
            if self.accept(":"):
                spec.append(":")
            else:
                idx.append(self.use())
                if self.accept(":"):
                    size = self.take(kind="num")
                    if not size.text.isdigit():
                        raise ParseError(f"line {size.line}: a tile size must be an integer, got {size.text}")
                    spec.append(self.integer(size))
                else:
                    spec.append("i")
            if not self.accept(","):
                break
        self.take("]")
        return tuple(spec), idx

    def op_tile_load(self) -> Op:
        src = self.use()
        spec, idx = self.slice()
        self.take(":")
        return Op("tile.load", [src, *idx], [self.type()], {"slice": spec})

    def op_tile_insert(self) -> Op:
        tile = self.use()
        self.take("into")
        dst = self.use()
        spec, idx = self.slice()
        self.take(":")
        return Op("tile.insert", [dst, tile, *idx], [self.type()], {"slice": spec})

    def op_tile_atomic_add(self) -> Op:
        tile = self.use()
        self.take("into")
        acc = self.use()
        spec, idx = self.slice()
        return Op("tile.atomic_add", [acc, tile, *idx], [], {"slice": spec})

    def op_tile_yield(self) -> Op:
        operands, specs = [], []
        if self.peek() is None or self.peek().kind != "val":  # type: ignore[union-attr]
            return Op("tile.yield", [], [], {"slices": ()})
        while True:
            operands.append(self.use())
            self.take("into")
            spec, idx = self.slice()
            operands += idx
            specs.append(spec)
            if not self.accept(","):
                break
        return Op("tile.yield", operands, [], {"slices": tuple(specs)})

    def op_for(self) -> Op:
        iv = self.take(kind="val").text[1:]
        self.take("=")
        lo = self.use()
        self.take("to")
        hi = self.use()
        self.take("iter_args")
        self.take("(")
        anames, inits = [], []
        if not self.at(")"):
            while True:
                anames.append(self.take(kind="val").text[1:])
                self.take("=")
                inits.append(self.use())
                if not self.accept(","):
                    break
        self.take(")")
        attrs = self.attrs(then=(":", "{"))
        types = self.types() if self.accept(":") else []
        self.take("{")
        blk = self.region([iv] + anames, [TensorType("i32", ())] + [v.type for v in inits])
        self.block_ops(blk)
        self.scopes.pop()
        self.take("}")
        return Op("for", [lo, hi, *inits], types, attrs, [blk])

    def op_parallel_for(self) -> Op:
        self.take("(")
        ivs = [self.take(kind="val").text[1:]]
        while self.accept(","):
            ivs.append(self.take(kind="val").text[1:])
        self.take(")")
        accs: list[str] = []
        if self.accept("accumulate"):
            self.take("(")
            accs.append(self.take(kind="val").text[1:])
            while self.accept(","):
                accs.append(self.take(kind="val").text[1:])
            self.take(")")
        self.take("in")
        self.take("(")
        bounds = [self.dim_expr()]
        while self.accept(","):
            bounds.append(self.dim_expr())
        self.take(")")
        attrs = self.attrs()
        self.take(":")
        types = self.types()
        self.take("{")
        if len(accs) > len(types):
            raise self.error(f"{len(accs)} accumulators for {len(types)} results")
        acc_types = list(types[len(types) - len(accs):]) if accs else []
        blk = self.region(ivs + accs, [TensorType("i32", ())] * len(ivs) + acc_types)
        self.block_ops(blk)
        self.scopes.pop()
        self.take("}")
        attrs["bounds"] = tuple(bounds)
        if accs:
            attrs["accumulators"] = len(accs)
        return Op("parallel_for", [], types, normalize_attrs(attrs), [blk])

    def op_if(self) -> Op:
        cond = self.use()
        types = self.types() if self.accept(":") else []
        blocks = []
        for k in range(2):
            if k:
                self.take("else")
            self.take("{")
            blk = self.region([], [])
            self.block_ops(blk)
            self.scopes.pop()
            self.take("}")
            blocks.append(blk)
        return Op("if", [cond], types, {}, blocks)


def parse_funcs(text: str) -> list[Func]:
    p = Parser(text)
    funcs: list[Func] = []
    while p.peek() is not None:
        line = p.peek().line  # type: ignore[union-attr]
        try:
            f = p.func()
        except RecursionError:  # a safety net: the depth limits (MAX_DEPTH) stop every nesting we know of
            t = p.peek()
            raise ParseError(f"line {t.line if t else line}: nested too deeply to read") from None
        if any(g.name == f.name for g in funcs):
            raise ParseError(f"line {line}: a second func named @{f.name}")
        funcs.append(f)
    if not funcs:
        raise ParseError("no func in the input")
    return funcs


def parse_func(text: str) -> Func:
    funcs = parse_funcs(text)
    if len(funcs) != 1:
        raise ParseError(f"expected one func, found {len(funcs)}")
    return funcs[0]
