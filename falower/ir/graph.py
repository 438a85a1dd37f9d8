"""Graph views of a function: a networkx DiGraph for graph algorithms, and DOT text for looking at it.

networkx is a view here, never the IR's storage (operand order and multiple results matter, see DESIGN.md).
Nodes are the function's arguments, every op (nested ones included) and every region argument; edges go
from the node that defines a value to each op that uses it. Nested regions are flattened: every node has a
`region` attribute naming the op that owns its region (None at the top level), and `to_dot` draws each
region as a cluster. Value names are the printer's, so the picture matches `print_func`.
"""

from __future__ import annotations

from typing import Any, Optional

import networkx as nx

from .core import Block, Func, Op, Value
from .printer import Printer


def _value_names(func: Func) -> dict[Value, str]:
    """The `%names` the printer assigns (printing is the only place names are decided)."""
    p = Printer()
    p.func(func)
    return dict(p.n.names)


def to_networkx(func: Func) -> nx.DiGraph:
    """Def-use graph of `func`. Node keys are strings: `arg:<name>`, `op:<k>` (walk order), `barg:<name>`."""
    names = _value_names(func)
    g = nx.DiGraph(name=func.name)
    defining: dict[Value, str] = {}

    def value_label(v: Value) -> str:
        return f"%{names.get(v, '?')} : {v.type}"

    for a in func.args:
        key = f"arg:{names[a]}"
        g.add_node(key, kind="arg", label=value_label(a), region=None, depth=0)
        defining[a] = key

    counter = [0]
    op_keys: dict[Op, str] = {}

    def visit(block: Block, region: Optional[str], depth: int) -> None:
        for op in block.ops:
            key = f"op:{counter[0]}"
            counter[0] += 1
            op_keys[op] = key
            types = ", ".join(str(r.type) for r in op.results)
            label = f"{op.name} : {types}" if types else op.name
            g.add_node(key, kind="op", op=op.name, label=label, region=region, depth=depth,
                       results=[f"%{names.get(r, '?')}" for r in op.results])
            for r in op.results:
                defining[r] = key
            for ri, r in enumerate(op.regions):
                for a in r.args:
                    akey = f"barg:{names.get(a, id(a))}"
                    g.add_node(akey, kind="block_arg", label=value_label(a), region=key, depth=depth + 1,
                               region_index=ri)
                    defining[a] = akey
                visit(r, key, depth + 1)

    visit(func.body, None, 0)
    for op, key in op_keys.items():
        for i, v in enumerate(op.operands):
            src = defining.get(v)
            if src is None:  # a value the function never defines: show it rather than fail
                src = f"undefined:{id(v)}"
                g.add_node(src, kind="undefined", label=f"%{v.name or '?'} : {v.type} (undefined)",
                           region=None, depth=0)
            if g.has_edge(src, key):
                g.edges[src, key]["operands"].append(i)
            else:
                g.add_edge(src, key, operands=[i], value=f"%{names.get(v, v.name or '?')}")
    return g


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


_SHAPES = {"arg": "ellipse", "block_arg": "ellipse", "op": "box", "undefined": "octagon"}


def to_dot(func: Func) -> str:
    """Graphviz DOT text of `to_networkx(func)`; regions become clusters. Needs no pydot or graphviz."""
    g = to_networkx(func)
    children: dict[Optional[str], list[str]] = {}
    for n, data in g.nodes(data=True):
        children.setdefault(data.get("region"), []).append(n)

    lines = [f"digraph {_quote(func.name)} {{", "  node [fontname=\"monospace\", fontsize=10];",
             f"  label={_quote('@' + func.name)};"]

    def node_line(n: str, data: dict[str, Any], pad: str) -> str:
        return f"{pad}{_quote(n)} [label={_quote(data['label'])}, shape={_SHAPES.get(data['kind'], 'box')}];"

    def emit(region: Optional[str], pad: str) -> None:
        for n in children.get(region, []):
            data = g.nodes[n]
            lines.append(node_line(n, data, pad))
            if n in children:  # an op that owns regions: its region nodes form a cluster
                cid = n.replace(":", "_")
                lines.append(f"{pad}subgraph {_quote('cluster_' + cid)} {{")
                lines.append(f"{pad}  label={_quote(data['op'] + ' region')};")
                lines.append(f"{pad}  style=dashed;")
                emit(n, pad + "  ")
                lines.append(f"{pad}}}")

    emit(None, "  ")
    for u, v, data in g.edges(data=True):
        lines.append(f"  {_quote(u)} -> {_quote(v)} [label={_quote(data['value'])}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


__all__ = ["to_networkx", "to_dot"]
