"""Values, ops, blocks and functions: the IR's storage.

An op has operands, typed results, attributes and regions; a region is one block with typed arguments
whose last op is a terminator (`yield`, `tile.yield` or `return`). Names are hints: the printer assigns
the final `%names` at print time so dumps are deterministic.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from .types import TensorType


class Value:
    """An SSA value: an op result or a block argument."""

    __slots__ = ("type", "name", "owner", "index")

    def __init__(self, type: TensorType, name: Optional[str] = None, owner: Any = None, index: int = 0):
        self.type = type
        self.name = name
        self.owner = owner  # the Op that defines it, or the Block whose argument it is
        self.index = index

    def __repr__(self) -> str:
        return f"Value({self.name or '?'}: {self.type})"


class Block:
    """A region's body: arguments and a list of ops ending in a terminator."""

    def __init__(self, arg_types: list[TensorType] | None = None, arg_names: list[Optional[str]] | None = None):
        arg_types = arg_types or []
        arg_names = arg_names or [None] * len(arg_types)
        self.args: list[Value] = [Value(t, n, self, i) for i, (t, n) in enumerate(zip(arg_types, arg_names))]
        self.ops: list[Op] = []
        self.parent: Optional[Op] = None

    def add_arg(self, type: TensorType, name: Optional[str] = None) -> Value:
        v = Value(type, name, self, len(self.args))
        self.args.append(v)
        return v

    def append(self, op: "Op") -> "Op":
        op.parent = self
        self.ops.append(op)
        return op

    @property
    def terminator(self) -> Optional["Op"]:
        return self.ops[-1] if self.ops else None


class Op:
    """One operation. `attrs` hold ints, floats, bools, strings, Dims and tuples of these."""

    def __init__(
        self,
        name: str,
        operands: list[Value],
        result_types: list[TensorType],
        attrs: dict[str, Any] | None = None,
        regions: list[Block] | None = None,
        result_names: list[Optional[str]] | None = None,
    ):
        self.name = name
        self.operands = list(operands)
        names = result_names or [None] * len(result_types)
        self.results = [Value(t, n, self, i) for i, (t, n) in enumerate(zip(result_types, names))]
        self.attrs = dict(attrs or {})
        self.regions = list(regions or [])
        for r in self.regions:
            r.parent = self
        self.parent: Optional[Block] = None

    @property
    def result(self) -> Value:
        if len(self.results) != 1:
            raise ValueError(f"{self.name} has {len(self.results)} results")
        return self.results[0]

    def walk(self) -> Iterator["Op"]:
        """This op, then every op nested in its regions, in order."""
        yield self
        for r in self.regions:
            for op in r.ops:
                yield from op.walk()

    def __repr__(self) -> str:
        return f"Op({self.name})"


class Func:
    """A graph: named typed arguments, a body block ending in `return`."""

    def __init__(self, name: str, body: Block, attrs: dict[str, Any] | None = None):
        self.name = name
        self.body = body
        self.attrs = dict(attrs or {})

    @property
    def args(self) -> list[Value]:
        return self.body.args

    @property
    def results(self) -> list[Value]:
        term = self.body.terminator
        return list(term.operands) if term is not None else []

    @property
    def result_names(self) -> list[str]:
        names = self.attrs.get("result_names")
        if names:
            return list(names)
        return [f"out{i}" for i in range(len(self.results))]

    def walk(self) -> Iterator[Op]:
        for op in self.body.ops:
            yield from op.walk()


def clone_block(block: Block, vmap: dict[Value, Value]) -> Block:
    """Deep copy of a block; `vmap` maps outer values (and is extended with this block's values)."""
    new = Block([a.type for a in block.args], [a.name for a in block.args])
    for old, nv in zip(block.args, new.args):
        vmap[old] = nv
    for op in block.ops:
        new.append(clone_op(op, vmap))
    return new


def clone_op(op: Op, vmap: dict[Value, Value]) -> Op:
    regions = [clone_block(r, vmap) for r in op.regions]
    new = Op(op.name, [vmap.get(v, v) for v in op.operands], [r.type for r in op.results], dict(op.attrs),
             regions, [r.name for r in op.results])
    for old, nv in zip(op.results, new.results):
        vmap[old] = nv
    return new


def clone_func(func: Func, name: Optional[str] = None) -> Func:
    return Func(name or func.name, clone_block(func.body, {}), dict(func.attrs))


def defined_values(block: Block) -> Iterator[Value]:
    yield from block.args
    for op in block.ops:
        yield from op.results


def uses(func: Func) -> dict[Value, list[Op]]:
    """Every value's users, regions included."""
    out: dict[Value, list[Op]] = {}
    for op in func.walk():
        for v in op.operands:
            out.setdefault(v, []).append(op)
    return out


def backward_slice(block: Block, roots: list[Value]) -> list[Op]:
    """The ops of `block` that `roots` depend on (directly or through other ops of `block`), in order."""
    need: set[int] = set()
    stack = list(roots)
    while stack:
        v = stack.pop()
        op = v.owner
        if isinstance(op, Op) and op.parent is block and id(op) not in need:
            need.add(id(op))
            stack.extend(op.operands)
    return [op for op in block.ops if id(op) in need]


def replace_uses(block: Block, old: Value, new: Value) -> None:
    """Replace `old` by `new` in every operand of `block` and the blocks nested in it."""
    for op in block.ops:
        op.operands = [new if v is old else v for v in op.operands]
        for r in op.regions:
            replace_uses(r, old, new)
