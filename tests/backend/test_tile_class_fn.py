"""The kernels' tile classifier (`from_ir._interval_fn`, emitted as tile_class_fn) run as Python against the IR's
(`intervals.classify`, which `mask.kv_range` and `mask.classify` define): where the kernel says full or empty the
IR must say the same, and for a floordiv / mod by one value (a size, a captured scalar, a literal) the kernel must
decide as many tiles as the IR does, not call every tile partial (a packed GQA window visited every kv tile)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import falower as fl
from falower.backends.numba_cuda.from_ir import _interval_fn
from falower.ir import intervals
from falower.errors import FalowerError
from falower.frontend import SymTensor
from falower.passes.pack_gqa import pack_gqa

off = fl.capture("off", "i32", ())
chunk = fl.capture("chunk", "i32", ())
small = fl.capture("small", "i8", ())

GRAPHS = {
    # pack_gqa's q_idx = r % M under a decoding window with the cache's offset
    "packed-window": lambda: pack_gqa(fl.attention(
        group_size=4, name="gw", mask_mod=lambda b, h, q, kv: (q + off - kv >= 0) & (q + off - kv < 300)))[0],
    # pack_gqa's h = j G + r // M read by a head-dependent mask
    "packed-head": lambda: pack_gqa(fl.attention(
        group_size=4, name="gh", mask_mod=lambda b, h, q, kv: (q >= kv) | (h % 2 == 0)))[0],
    # chunked causal by a captured chunk length
    "chunked": lambda: fl.attention(name="ch", mask_mod=lambda b, h, q, kv: (q // chunk == kv // chunk) & (q >= kv)),
    # by arithmetic of an i8 scalar (a cast, a product: one value a tile too)
    "chunk_expr": lambda: fl.attention(name="ce", mask_mod=lambda b, h, q, kv: (q // (small * 2) == kv // (small * 2))
                                       & (q >= kv)),
    # by a literal
    "literal": lambda: fl.attention(name="li", mask_mod=lambda b, h, q, kv: (q % 128) >= (kv % 128)),
}


def _predicate(func):
    low = fl.lower(func, "fa2-fwd")
    return next(op for op in low.walk() if op.name == "mask.kv_range").regions[0]


def _kernel_classifier(pred, dims):
    names = [a.name or f"c{i}" for i, a in enumerate(pred.args[4:])]
    sizes = sorted({s for op in pred.ops if op.name == "const" and hasattr(op.attrs["value"], "symbols")
                    for s in op.attrs["value"].symbols()})
    sig = "".join(f", cap_{n}" for n in names) + "".join(f", dim_{s}" for s in sizes)
    src = "\n".join(_interval_fn(pred, {"D": 64}, sig))
    ns: dict = {}
    exec(src, ns)  # noqa: S102 - the emitted classifier is plain Python
    return ns["tile_class_fn"], [dims[s] for s in sizes], src


@pytest.mark.parametrize("name", list(GRAPHS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_tile_class_fn_agrees_with_intervals(name, data) -> None:
    pred = _predicate(GRAPHS[name]())
    dims = {"M": data.draw(st.integers(1, 9), "M"), "N": 4096, "HKV": 2, "B": 1, "D": 64}
    fn, size_args, src = _kernel_classifier(pred, dims)
    assert "return 1\n" != src.split(":\n", 1)[1].lstrip(), src  # the classifier was not given up on
    caps = ([data.draw(st.integers(0, 600), "off")] if name == "packed-window"
            else [data.draw(st.integers(1, 300), "chunk")] if name == "chunked"
            else [data.draw(st.integers(-3, 60), "small")] if name == "chunk_expr" else [])
    h = data.draw(st.integers(0, 7), "h")
    bq, bk = data.draw(st.sampled_from([(64, 128), (128, 128), (16, 16)]), "tiles")
    q0 = data.draw(st.integers(0, 40), "q tile") * bq
    k0 = data.draw(st.integers(0, 40), "kv tile") * bk
    want = intervals.classify(pred, 0, h, q0, q0 + bq - 1, k0, k0 + bk - 1, [np.int32(c) for c in caps], dims)
    got = fn(0, h, q0, q0 + bq - 1, k0, k0 + bk - 1, *[np.array([c], np.int32) for c in caps], *size_args)
    if name == "chunk_expr" and caps[0] <= 0:  # a divisor not positive: the kernel's whole tile partial, sound
        assert got in (want, intervals.PARTIAL), (name, caps, q0, k0, bq, bk)
    else:
        assert got == want, (name, dims["M"], caps, h, q0, k0, bq, bk)


def test_packed_window_classifier_skips_tiles() -> None:
    """The packed decoding window (M = 1, offset 5000, width 300, 128-wide kv tiles) keeps kv 4701 .. 5000: the
    kernel's classifier calls the tiles outside that empty, as the IR's kv range does."""
    pred = _predicate(GRAPHS["packed-window"]())
    fn, size_args, _ = _kernel_classifier(pred, {"M": 1, "N": 8192})
    cls = [fn(0, 0, 0, 3, k0, k0 + 127, np.array([5000], np.int32), *size_args) for k0 in range(0, 8192, 128)]
    live = [j for j, c in enumerate(cls) if c != intervals.EMPTY]
    assert live == list(range(4701 // 128, 5000 // 128 + 1))
    ir_range = intervals.kv_range(pred, 0, 0, 0, 64, 128, 8192, [np.int32(5000)], {"M": 1, "N": 8192})
    assert ir_range == (live[0], live[-1] + 1)


# ---- random integer predicates: the IR's classification and the kernels' both sound, and the kernels' the IR's ----

LEAF = st.sampled_from(["q", "kv", "h", "c", "k"])
EXPR = st.recursive(
    st.tuples(LEAF, st.integers(-5, 40)),
    lambda kids: st.one_of(
        st.tuples(st.sampled_from(["add", "sub", "mul", "min", "max"]), kids, kids),
        st.tuples(st.sampled_from(["neg", "abs"]), kids),
        st.tuples(st.sampled_from(["floordiv", "mod"]), kids, st.sampled_from(["c", "c2", 1, 3, 7, 64]))),
    max_leaves=4)
PRED = st.recursive(
    st.tuples(st.sampled_from(["lt", "le", "gt", "ge", "eq", "ne"]), EXPR, EXPR),
    lambda kids: st.one_of(st.tuples(st.sampled_from(["and", "or"]), kids, kids), st.tuples(st.just("not"), kids)),
    max_leaves=3)
SCALAR = fl.capture("c", "i32", ())


def _expr(node, q, kv, h):
    kind = node[0]
    if kind in ("q", "kv", "h", "c", "k"):
        return {"q": q, "kv": kv, "h": h, "c": SCALAR, "k": node[1]}[kind]
    if kind in ("neg", "abs"):
        x = _expr(node[1], q, kv, h)
        return -x if kind == "neg" else abs(x)
    x = _expr(node[1], q, kv, h)
    if kind in ("floordiv", "mod"):
        d = {"c": SCALAR, "c2": SCALAR * 2}.get(node[2], node[2])
        return x // d if kind == "floordiv" else x % d
    y = _expr(node[2], q, kv, h)
    if kind in ("min", "max"):
        if isinstance(x, int) and isinstance(y, int):
            return min(x, y) if kind == "min" else max(x, y)
        x, y = (v if isinstance(v, (int, SymTensor)) else v + 0 for v in (x, y))  # (a capture as a symbolic value)
        return fl.minimum(x, y) if kind == "min" else fl.maximum(x, y)
    return {"add": x + y, "sub": x - y, "mul": x * y}[kind]


def _pred(node, q, kv, h):
    kind = node[0]
    if kind == "not":
        return ~_pred(node[1], q, kv, h)
    if kind in ("and", "or"):
        x, y = _pred(node[1], q, kv, h), _pred(node[2], q, kv, h)
        return (x & y) if kind == "and" else (x | y)
    x, y = _expr(node[1], q, kv, h), _expr(node[2], q, kv, h)
    return {"lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y, "eq": x == y, "ne": x != y}[kind]


@settings(max_examples=120, deadline=None)
@given(tree=PRED, data=st.data())
def test_random_predicates_classify_soundly_and_alike(tree, data) -> None:
    """Random integer masks over q, kv, h, a captured scalar and constants (+, -, *, min, max, neg, abs, and floordiv /
    mod by constants, the scalar or twice it), on random tiles: intervals.classify (the IR's mask.classify) and the
    emitted tile_class_fn never call a tile full or empty that is not (checked element by element with the emitted
    mask_fn), and the kernel's class is the IR's, or partial where it does not model an op."""
    from falower.backends.numba_cuda.from_ir import analyse, device_source

    try:
        g = fl.attention(name="rand", mask_mod=lambda b, h, q, kv: _pred(tree, q, kv, h))
        pred = _predicate(g)
    except (FalowerError, StopIteration):  # a predicate of constants alone, or one that folded: no tiles to class
        return
    low = analyse(fl.lower(g, "fa2-fwd"))
    ns: dict = {"np": np, "math": math}
    exec(device_source(low, {"D": 64}), ns)  # noqa: S102 - mask_fn as the kernels evaluate it per element
    dims = {"M": 10 ** 6, "N": 10 ** 6, "B": 1, "H": 8, "D": 64}
    fn, size_args, src = _kernel_classifier(pred, dims)
    c = data.draw(st.integers(1, 50), "c")
    caps = [c] if "c" in [a.name for a in pred.args[4:]] else []
    h = data.draw(st.integers(0, 3), "h")
    bq, bk = data.draw(st.sampled_from([(4, 4), (8, 16), (16, 8)]), "tiles")
    q0, k0 = (data.draw(st.integers(0, 12), "q tile") * bq, data.draw(st.integers(0, 12), "kv tile") * bk)
    want = intervals.classify(pred, 0, h, q0, q0 + bq - 1, k0, k0 + bk - 1, [np.int32(x) for x in caps], dims)
    got = fn(0, h, q0, q0 + bq - 1, k0, k0 + bk - 1, *[np.array([x], np.int32) for x in caps], *size_args)
    mask_caps = [np.array([x], np.int32) for x in caps]
    kept = {bool(ns["mask_fn"](0, h, q, kv, *mask_caps)) for q in range(q0, q0 + bq) for kv in range(k0, k0 + bk)}
    for name, cls in (("intervals", want), ("tile_class_fn", got)):
        assert cls != intervals.FULL or kept == {True}, (name, tree, c, q0, k0, bq, bk)
        assert cls != intervals.EMPTY or kept == {False}, (name, tree, c, q0, k0, bq, bk)
    assert got in (want, intervals.PARTIAL), (tree, c, q0, k0, bq, bk, want, got)
