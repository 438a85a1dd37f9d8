"""`row_bounds_fn`: a mask that keeps one kv interval per row, as that interval (row_bounds.py).

The kernels trust it on partial tiles instead of mask_fn, so it must be exact: lo <= kv < hi exactly where
mask_fn(b, h, q, kv) is true. Checked pointwise on the examples and, by hypothesis, on random masks built from
affine atoms (q - kv, kv - q, kv, q, q vs kv + c) under & and |, some of which are intervals and some not;
masks that are not (a document mask, !=, a coefficient of 2) must get no bounds at all."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import falower as fl
from falower.backends.numba_cuda.from_ir import analyse, device_source

ROOT = Path(__file__).resolve().parent.parent.parent


def _functions(g: fl.Func) -> dict:
    low = analyse(fl.lower(g, "fa2-fwd"))
    src = device_source(low, {"D": 64})
    ns: dict = {"np": np, "math": math}
    exec(src, ns)  # plain defs (spec.py's contract): the same source the kernels are built from
    return ns


def _check_exact(ns: dict, caps=(), size: int = 70, bounds_caps=None) -> int:
    """Pointwise: where row_bounds_fn says exact, mask_fn == (lo <= kv < hi). Returns how many rows were exact."""
    mask, bounds = ns["mask_fn"], ns["row_bounds_fn"]
    exact_rows = 0
    for b in range(2):
        for h in range(2):
            for q in range(size):
                lo, hi, exact = bounds(b, h, q, *(caps if bounds_caps is None else bounds_caps))
                if not exact:
                    continue
                exact_rows += 1
                got = [bool(mask(b, h, q, kv, *caps)) for kv in range(size)]
                assert got == [lo <= kv < hi for kv in range(size)], (b, h, q, lo, hi)
    return exact_rows


def _example(stem: str) -> fl.Func:
    return next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))


@pytest.mark.parametrize("stem", ["causal", "sliding_window", "prefix_lm", "alibi"])
def test_examples_with_one_interval_per_row_get_exact_bounds(stem: str) -> None:
    ns = _functions(_example(stem))
    assert "row_bounds_fn" in ns, f"{stem}: its mask keeps one kv interval per row"
    caps = (np.linspace(0.1, 1.0, 2, dtype=np.float32),) if stem == "alibi" else ()
    assert _check_exact(ns, caps) == 2 * 2 * 70  # static bounds: always exact


def _doc_ids(kind: str, n: int, rng) -> np.ndarray:
    if kind == "sorted":
        ids = np.sort(rng.integers(0, 5, (2, n)), axis=-1)
        ids[:, n - n // 8:] = -1  # padding rows: the second conjunct drops them
    elif kind == "unsorted":  # ids that come back after another: no exact runs for that batch row
        ids = rng.integers(0, 3, (2, n))
    elif kind == "constant":
        ids = np.full((2, n), 7)
    elif kind == "one_each":  # every position its own document
        ids = np.tile(np.arange(n), (2, 1))
    else:  # "mixed": batch 0 sorted, batch 1 with a document that comes back
        ids = np.sort(rng.integers(0, 4, (2, n)), axis=-1)
        ids[1, : n // 4] = ids[1, -1]
    return ids.astype(np.int32)


@pytest.mark.parametrize("kind", ["sorted", "unsorted", "constant", "one_each", "mixed"])
@pytest.mark.parametrize("n", [1, 2, 63, 70])
def test_document_mask_bounds_from_run_tables(kind: str, n: int) -> None:
    """doc[b, q] == doc[b, kv] & doc[b, q] >= 0: its bounds read the run table of doc_id along kv, made per
    data; exact exactly for the batch rows whose ids do not come back, and pointwise right there. The kernel's
    kv runs past the table (N > n) when the caller's table is short: the clamped gather's meaning is kept."""
    from falower.backends.numba_cuda.block_data import run_table_host

    ns = _functions(_example("document"))
    assert "row_bounds_fn" in ns
    ids = _doc_ids(kind, n, np.random.default_rng(n))
    names = ns["row_bounds_fn"].__code__.co_varnames[3:ns["row_bounds_fn"].__code__.co_argcount]
    assert [nm for nm in names if "runs" in nm] == ["rng_doc_id_runs_1"]
    made = {"cap_doc_id": ids, "rng_doc_id_runs_1": run_table_host(ids, 1)}
    caps = tuple(made.get(nm, np.zeros((1, 1, 2), np.int32)) for nm in names)
    exact = _check_exact(ns, caps, size=n + 3)
    contiguous = [len(np.unique(r)) == 1 + int((r[1:] != r[:-1]).sum()) for r in ids]
    assert exact == 2 * (n + 3) * sum(contiguous), (kind, contiguous)


def test_run_table_torch_matches_numpy() -> None:
    torch = pytest.importorskip("torch")
    from falower.backends.numba_cuda.block_data import run_table, run_table_host

    rng = np.random.default_rng(0)
    for kind in ["sorted", "unsorted", "constant", "one_each", "mixed"]:
        ids = _doc_ids(kind, 37, rng)
        for axis in (0, 1):
            np.testing.assert_array_equal(run_table(torch.from_numpy(ids), axis).numpy(), run_table_host(ids, axis))
            np.testing.assert_array_equal(run_table(ids, axis), run_table_host(ids, axis))


def test_gathers_along_kv_that_are_not_a_run_get_no_bounds() -> None:
    """doc[b, kv] == doc[b, q + 1] (another row's id), doc[b, kv] < 3 (not an equality of the same table at q),
    f32 tables (NaN == NaN is false): the mask stays per element."""
    d = fl.capture("d", "i32", "B,N")
    f = fl.capture("f", "f32", "B,N")
    for mask in (lambda b, h, q, kv: d[b, kv] == d[b, q + 1], lambda b, h, q, kv: d[b, kv] < 3,
                 lambda b, h, q, kv: f[b, kv] == f[b, q]):
        assert "row_bounds_fn" not in _functions(fl.attention(mask_mod=mask, name="m"))


def test_window_and_causal_bounds_are_the_row_band() -> None:
    ns = _functions(fl.attention(mask_mod=lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 16), name="w16"))
    assert ns["row_bounds_fn"](0, 0, 40) == (25, 41, True)
    assert ns["row_bounds_fn"](0, 0, 3)[1] == 4  # lo may be negative: the kernel clamps


# ---- random masks ----

OPS = ["lt", "le", "gt", "ge", "eq"]


def _cmp(x, op: str, y):
    return {"lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y, "eq": x == y, "ne": x != y}[op]


ATOM = st.tuples(st.sampled_from(["diff", "rdiff", "kv", "q", "qkv", "ne", "two"]), st.sampled_from(OPS),
                 st.integers(-20, 40))
TREE = st.recursive(ATOM, lambda kids: st.tuples(st.sampled_from(["and", "or"]), kids, kids), max_leaves=4)


def _build(node, q, kv):
    if node[0] in ("and", "or"):
        x, y = _build(node[1], q, kv), _build(node[2], q, kv)
        return (x & y) if node[0] == "and" else (x | y)
    kind, op, c = node
    if kind == "diff":
        return _cmp(q - kv, op, c)
    if kind == "rdiff":
        return _cmp(kv - q, op, c)
    if kind == "kv":
        return _cmp(kv, op, c)
    if kind == "q":
        return _cmp(q, op, c)
    if kind == "qkv":
        return _cmp(q, op, kv + c)
    if kind == "ne":
        return _cmp(q - kv, "ne", c)
    return _cmp(kv + kv, op, q + c)  # "two": 2 kv, not one interval's worth of rule


def _simple(node) -> bool:
    """A conjunction of atoms the rules turn into bounds (so bounds must exist)."""
    if node[0] == "and":
        return _simple(node[1]) and _simple(node[2])
    return node[0] in ("diff", "rdiff", "kv", "q", "qkv")


@settings(max_examples=60, deadline=None)
@given(TREE)
def test_random_affine_masks_bounds_are_exact_where_given(tree) -> None:
    g = fl.attention(mask_mod=lambda b, h, q, kv: _build(tree, q, kv), name="rand")
    ns = _functions(g)
    if _simple(tree):
        assert "row_bounds_fn" in ns, tree
    if "row_bounds_fn" in ns:
        _check_exact(ns, size=48)


def test_runs_under_an_or_are_not_asked_for() -> None:
    """(kv < plen[b]) | (doc[b, q] == doc[b, kv]): an interval or a run is not one interval; no run table is
    made for bounds that are never emitted."""
    doc = fl.capture("doc", "i32", "B,N")
    plen = fl.capture("plen", "i32", "B")
    g = fl.attention(mask_mod=lambda b, h, q, kv: (kv < plen[b]) | (doc[b, q] == doc[b, kv]), name="sp")
    low = analyse(fl.lower(g, "fa2-fwd"))
    assert low.runs == [] and "row_bounds_fn" not in device_source(low, {"D": 64})


@pytest.mark.parametrize("stem, reads", [("document", True), ("causal", False), ("sliding_window", False),
                                         ("prefix_lm", False), ("alibi", False), ("plain", False)])
def test_row_bounds_that_read_tables_are_hoisted(stem: str, reads: bool) -> None:
    """The wgmma kernels read a row's bounds once before the kv loop where they are loads from captured tables
    (emit_fa2.row_bounds_read_data: the document mask's ids and run table); static bounds stay in the partial tiles."""
    import dataclasses

    from falower.backends.numba_cuda.emit_fa2 import row_bounds_read_data
    from falower.backends.numba_cuda.emit_fa3_ws import emit_fa3_ws_forward
    g = _example(stem)
    c = fl.compile(g, "numba-cuda")  # the default pipeline's 128 x 64 tiles
    env = {"B": 1, "H": 2, "HKV": 2, "M": 130, "N": 130, "D": 64}
    from falower.passes.check import bind_dims, random_inputs

    inputs = random_inputs(g, bind_dims(g, env), seed=0, **({"kind": "sorted"} if stem == "document" else {}))
    inputs = [x.astype(np.float16) if i < 3 else x for i, x in enumerate(inputs)]
    spec = c.kernel(*inputs).spec
    assert row_bounds_read_data(spec) is reads
    ws = emit_fa3_ws_forward(dataclasses.replace(spec, block_q=128, extra={"schedule": "wgmma-ws", "producer": "none"}))
    loop = ws.index("while j <= kv_last:")
    assert ("= row_bounds_fn(" in ws[:loop] and "masked_score_row_in(sc" in ws[loop:]) is reads


def test_a_sum_that_can_wrap_gets_no_bounds_and_the_mask_wraps() -> None:
    """`kv + w >= q` with a captured i32 w: the IR's sum wraps past 2^31 - 1 (w = 2^31 - 1 keeps kv = 0 only), the
    bounds' arithmetic (kv >= q - w) would not, so no row bounds; mask_fn wraps as the IR does. `q - kv < w` cannot
    leave i32 for sizes up to value_ranges.SIZE_MAX and keeps its bounds, its mask no wrap code."""
    from falower.ir import interpret

    w = fl.capture("w", "i32", "")
    ns = _functions(fl.attention(mask_mod=lambda b, h, q, kv: kv + w >= q, name="kvw"))
    assert "row_bounds_fn" not in ns
    big = np.array([2 ** 31 - 1], np.int32)
    with np.errstate(over="ignore"):  # (numpy's int32 scalar sum wraps before the code's own wrap: the same)
        assert [bool(ns["mask_fn"](0, 0, 3, kv, big)) for kv in range(4)] == [True, False, False, False]
    g = fl.attention(mask_mod=lambda b, h, q, kv: kv + w >= q, name="kvw")  # the IR agrees: kv = 0 alone
    rng = np.random.default_rng(0)
    q_, k_ = rng.standard_normal((1, 1, 5, 8)), rng.standard_normal((1, 1, 6, 8))
    v_ = rng.standard_normal((1, 1, 6, 8))
    with np.errstate(over="ignore"):
        (o, *_) = interpret(g, [q_, k_, v_, np.array(2 ** 31 - 1, np.int32)])
    np.testing.assert_allclose(o[0, 0], np.broadcast_to(v_[0, 0, 0], (5, 8)), rtol=1e-12)
    window = fl.attention(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < w), name="qkw")
    assert "2147483648" not in device_source(analyse(fl.lower(window, "fa2-fwd")), {"D": 64})
    win = _functions(window)
    assert "row_bounds_fn" in win
    assert _check_exact(win, (np.array([5], np.int32),), bounds_caps=(np.array([5], np.int32),)) == 2 * 2 * 70

