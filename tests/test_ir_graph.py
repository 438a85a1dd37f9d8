"""The networkx view and DOT export."""

from __future__ import annotations

import re

import networkx as nx

import falower as fl
from falower.ir import parse_func
from falower.ir.graph import to_dot, to_networkx

TILED = """func @tiled(%x: f32[M,4]) -> (out0: f32[M,4]) {
  %o = parallel_for (%i) in (cdiv(M, 8)) : f32[M,4] {
    %c8 = const 8 : i32
    %q0 = mul %i, %c8 : i32
    %t = tile.load %x[%q0 : 8, :] : f32[8,4]
    %s = fused %t : f32[8,4] {
    ^(%a: f32[8,4]):
      %e = exp %a : f32[8,4]
      yield %e
    }
    tile.yield %s into [%q0 : 8, :]
  }
  return %o
}
"""


def causal() -> fl.Func:
    return fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")


def test_def_use_graph_of_a_flat_function() -> None:
    g = causal()
    G = to_networkx(g)
    n_ops = sum(1 for _ in g.walk())
    assert sum(1 for _, d in G.nodes(data=True) if d["kind"] == "op") == n_ops
    assert {n for n, d in G.nodes(data=True) if d["kind"] == "arg"} == {"arg:q", "arg:k", "arg:v"}
    assert nx.is_directed_acyclic_graph(G)
    ret = next(n for n, d in G.nodes(data=True) if d.get("op") == "return")
    # every op reaches the output except the unused iotas (b, h) the frontend always creates
    dead = {d["label"] for n, d in G.nodes(data=True) if d["kind"] == "op" and n != ret and not nx.has_path(G, n, ret)}
    assert dead == {"iota : i32[B,1,1,1]", "iota : i32[1,H,1,1]"}
    first = next(n for n in nx.topological_sort(G) if G.nodes[n].get("op") == "matmul")
    assert G.nodes[first]["label"] == "matmul : f32[B,H,M,N]"
    assert set(G.predecessors(first)) == {"arg:q", "arg:k"}


def test_same_value_used_twice_is_one_edge_with_both_operand_positions() -> None:
    f, b, (x,) = fl.ir.new_func("sq", [("x", fl.ir.tensor("f32", "N"))])
    b.ret(b.emit("mul", x, x))
    G = to_networkx(f)
    mul = next(n for n, d in G.nodes(data=True) if d.get("op") == "mul")
    assert G.edges["arg:x", mul]["operands"] == [0, 1]


def test_regions_are_flattened_with_a_region_attribute() -> None:
    G = to_networkx(parse_func(TILED))
    pfor = next(n for n, d in G.nodes(data=True) if d.get("op") == "parallel_for")
    fused = next(n for n, d in G.nodes(data=True) if d.get("op") == "fused")
    exp = next(n for n, d in G.nodes(data=True) if d.get("op") == "exp")
    assert G.nodes[fused]["region"] == pfor
    assert G.nodes[exp]["region"] == fused
    assert G.nodes[exp]["depth"] == 2
    assert G.nodes["barg:a"]["region"] == fused and G.has_edge("barg:a", exp)
    assert G.has_edge("barg:i", next(n for n, d in G.nodes(data=True) if d.get("op") == "mul"))


def test_dot_text() -> None:
    dot = to_dot(parse_func(TILED))
    assert dot.startswith('digraph "tiled" {')
    assert dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    assert 'subgraph "cluster_op_0" {' in dot  # the parallel_for's region
    assert '[label="exp : f32[8,4]", shape=box];' in dot
    assert '"arg:x" -> ' in dot
    # every edge endpoint is a declared node
    nodes = set(re.findall(r'^\s*"([^"]+)" \[label=', dot, re.M))
    for u, v in re.findall(r'^\s*"([^"]+)" -> "([^"]+)"', dot, re.M):
        assert u in nodes and v in nodes


def test_dot_escapes_quotes() -> None:
    f, b, (x,) = fl.ir.new_func('we"ird', [("x", fl.ir.tensor("f32", "N"))])
    b.ret(b.emit("neg", x))
    assert 'digraph "we\\"ird" {' in to_dot(f)


def test_views_of_every_lowered_example() -> None:
    """Deep nesting (parallel_for > for > if > fused, mask predicates) still gives a consistent view."""
    from pathlib import Path

    from falower.cli import default_pipeline, select_graph

    for ex in sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py")):
        f = fl.run_pipeline(select_graph(ex, None), default_pipeline())
        G = to_networkx(f)
        assert nx.is_directed_acyclic_graph(G)
        assert sum(1 for _, d in G.nodes(data=True) if d["kind"] == "op") == sum(1 for _ in f.walk())
        assert not any(d["kind"] == "undefined" for _, d in G.nodes(data=True))
        dot = to_dot(f)
        assert dot.count("{") - dot.count("\\{") == dot.count("}") - dot.count("\\}")
