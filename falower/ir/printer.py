"""The printer is the spec of how IR looks: SSA text, one op per line, types after `:`, attributes in `{}`.

Value names are assigned here, at print time, from the names that builders and passes hint: a hint is
used once per function, later uses of it get `_1`, `_2`, ...; values without a hint are numbered.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from .core import Block, Func, Op, Value
from .dims import Dim
from .types import TensorType


def format_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(float(x))


def format_attr_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return format_float(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, Dim):
        return str(v)
    if isinstance(v, TensorType):
        return str(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(format_attr_value(x) for x in v) + "]"
    raise TypeError(f"cannot print attribute value {v!r}")


def format_attrs(attrs: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    items = []
    for k in sorted(attrs):
        if k in skip:
            continue
        v = attrs[k]
        items.append(k if v is True else f"{k} = {format_attr_value(v)}")
    return " {" + ", ".join(items) + "}" if items else ""


class Namer:
    def __init__(self) -> None:
        self.names: dict[Value, str] = {}
        self.taken: set[str] = set()
        self.counter = 0

    def define(self, v: Value) -> str:
        if v in self.names:
            return self.names[v]
        hint = v.name
        if hint and not hint.isdigit():
            name, k = hint, 1
            while name in self.taken:
                name = f"{hint}_{k}"
                k += 1
        else:
            while str(self.counter) in self.taken:
                self.counter += 1
            name = str(self.counter)
            self.counter += 1
        self.taken.add(name)
        self.names[v] = name
        return name

    def __call__(self, v: Value) -> str:
        name = self.names.get(v)
        return "%" + (name if name is not None else f"<undefined {v.name or '?'}>")


class Printer:
    def __init__(self, indent: str = "  "):
        self.indent = indent
        self.lines: list[str] = []
        self.n = Namer()
        self.op_lines: dict[Op, int] = {}

    def func(self, f: Func, header: Optional[str] = None) -> str:
        if header:
            self.lines.append(header)
        for a in f.args:
            self.n.define(a)
        args = ", ".join(f"{self.n(a)}: {a.type}" for a in f.args)
        term = f.body.terminator
        rtypes = [v.type for v in term.operands] if term is not None and term.name == "return" else []
        rnames = f.result_names
        results = ", ".join(f"{n}: {t}" for n, t in zip(rnames, rtypes))
        attrs = format_attrs({k: v for k, v in f.attrs.items() if k != "result_names"})
        self.lines.append(f"func @{f.name}({args}) -> ({results}){attrs} {{")
        self.block_ops(f.body, 1)
        self.lines.append("}")
        return "\n".join(self.lines) + "\n"

    def block_ops(self, block: Block, depth: int) -> None:
        for op in block.ops:
            self.op(op, depth)

    def _results(self, op: Op) -> str:
        if not op.results:
            return ""
        return ", ".join("%" + self.n.define(r) for r in op.results) + " = "

    def _types(self, op: Op) -> str:
        return ", ".join(str(r.type) for r in op.results)

    def _slice(self, spec: tuple, idx: list[Value]) -> str:
        parts, it = [], iter(idx)
        for s in spec:
            if s == ":":
                parts.append(":")
            elif s == "i":
                parts.append(self.n(next(it)))
            else:
                parts.append(f"{self.n(next(it))} : {s}")
        return "[" + ", ".join(parts) + "]"

    def op(self, op: Op, depth: int) -> None:
        self.op_lines[op] = len(self.lines)
        pad = self.indent * depth
        n = self.n
        name = op.name
        if name == "const":
            v = op.attrs["value"]
            self.lines.append(f"{pad}{self._results(op)}const {format_attr_value(v)} : {self._types(op)}")
        elif name == "tile.load":
            spec = op.attrs["slice"]
            s = self._slice(spec, op.operands[1:])
            self.lines.append(f"{pad}{self._results(op)}tile.load {n(op.operands[0])}{s} : {self._types(op)}")
        elif name == "tile.insert":
            spec = op.attrs["slice"]
            s = self._slice(spec, op.operands[2:])
            self.lines.append(f"{pad}{self._results(op)}tile.insert {n(op.operands[1])} into "
                              f"{n(op.operands[0])}{s} : {self._types(op)}")
        elif name == "tile.atomic_add":
            s = self._slice(op.attrs["slice"], op.operands[2:])
            self.lines.append(f"{pad}tile.atomic_add {n(op.operands[1])} into {n(op.operands[0])}{s}")
        elif name == "tile.yield":
            parts, pos = [], 0
            for spec in op.attrs["slices"]:
                k = sum(1 for s in spec if s != ":")
                tile, idx = op.operands[pos], op.operands[pos + 1: pos + 1 + k]
                parts.append(f"{n(tile)} into {self._slice(spec, list(idx))}")
                pos += 1 + k
            self.lines.append(f"{pad}tile.yield" + (" " + ", ".join(parts) if parts else ""))
        elif name == "for" and len(op.operands) >= 2 and op.regions and op.regions[0].args:
            blk = op.regions[0]
            for a in blk.args:
                self.n.define(a)
            lo, hi, inits = op.operands[0], op.operands[1], op.operands[2:]
            iters = ", ".join(f"{n(a)} = {n(i)}" for a, i in zip(blk.args[1:], inits))
            types = f" : {self._types(op)}" if op.results else ""
            attrs = format_attrs(op.attrs)
            self.lines.append(f"{pad}{self._results(op)}for {n(blk.args[0])} = {n(lo)} to {n(hi)} "
                              f"iter_args({iters}){attrs}{types} {{")
            self.block_ops(blk, depth + 1)
            self.lines.append(f"{pad}}}")
        elif name == "parallel_for":
            blk = op.regions[0]
            for a in blk.args:
                self.n.define(a)
            nb = len(op.attrs["bounds"])
            ivs = ", ".join(n(a) for a in blk.args[:nb])
            accs = f" accumulate({', '.join(n(a) for a in blk.args[nb:])})" if len(blk.args) > nb else ""
            bounds = ", ".join(str(b) for b in op.attrs["bounds"])
            attrs = format_attrs(op.attrs, skip=("bounds", "accumulators"))
            self.lines.append(f"{pad}{self._results(op)}parallel_for ({ivs}){accs} in ({bounds}){attrs} : "
                              f"{self._types(op)} {{")
            self.block_ops(blk, depth + 1)
            self.lines.append(f"{pad}}}")
        elif name == "if":
            types = f" : {self._types(op)}" if op.results else ""
            self.lines.append(f"{pad}{self._results(op)}if {n(op.operands[0])}{types} {{")
            self.block_ops(op.regions[0], depth + 1)
            self.lines.append(f"{pad}}} else {{")
            self.block_ops(op.regions[1], depth + 1)
            self.lines.append(f"{pad}}}")
        else:
            operands = ", ".join(n(v) for v in op.operands)
            sep = " " if operands else ""
            attrs = format_attrs(op.attrs)
            types = f" : {self._types(op)}" if op.results else ""
            line = f"{pad}{self._results(op)}{name}{sep}{operands}{attrs}{types}"
            if op.regions:
                for r in op.regions:
                    for a in r.args:
                        self.n.define(a)
                line += " {"
                self.lines.append(line)
                for r in op.regions:
                    args = ", ".join(f"{n(a)}: {a.type}" for a in r.args)
                    self.lines.append(f"{pad}^({args}):")
                    self.block_ops(r, depth + 1)
                self.lines.append(f"{pad}}}")
            else:
                self.lines.append(line)


def print_func(f: Func, header: Optional[str] = None) -> str:
    return Printer().func(f, header)


def print_module(funcs: list[Func]) -> str:
    return "\n".join(print_func(f) for f in funcs)
