"""block_data.py without a GPU: the torch form of mask.ranges equals the interpreter's, and block data is
remembered with the data it came from (same tensor and version: the same tables; an in-place write or a new
tensor: made anew; numpy by its content). torch on the CPU stands for CUDA here: only the range tables are
made (the backward's spec without its block lists). The backward's block lists (per kv tile the q tiles to
visit, per q tile the kv tiles for the deterministic dQ kernel), made by the list kernel's own row code run
as Python, are sound against a brute force over every (q, kv) pair and hold exactly what the kernels' scan
would visit; the dense block table (masks the range analysis cannot bound) is remembered like block data."""

from __future__ import annotations

import dataclasses
import functools
import runpy
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")

import falower as fl  # noqa: E402
from falower.backends.numba_cuda.block_data import (BlockData, BlockTables, caller_count, data_key,  # noqa: E402
                                                    host_block_lists, list_layout, range_table)
from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec  # noqa: E402
from falower.ir import intervals  # noqa: E402
from falower.ir.interp import Interpreter  # noqa: E402
from falower.ir.intervals import minmax_table  # noqa: E402
from falower.passes.check import bind_dims, random_inputs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
try:  # torch on the CPU stands for CUDA in the tests that take it; the rest is numpy
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


@needs_torch
@pytest.mark.parametrize("shape,axis,granule", [((2, 7), 1, 3), ((2, 3, 64), 2, 64), ((5,), 0, 1), ((3, 130), 1, 64),
                                                ((4, 2), 0, 4), ((1, 1), 1, 16)])
@pytest.mark.parametrize("dtype", ["i32", "bool", "f32"])
def test_torch_ranges_equal_the_interpreters(shape, axis, granule, dtype) -> None:
    rng = np.random.default_rng(sum(shape))
    x = rng.integers(-3, 5, size=shape)
    x = x > 0 if dtype == "bool" else x.astype(np.float32 if dtype == "f32" else np.int32)
    want_dtype = "i32" if dtype == "bool" else dtype
    got = range_table(torch.from_numpy(x), axis, granule, want_dtype)
    want = minmax_table(x, axis, granule)
    assert got.is_contiguous() and tuple(got.shape) == want.shape
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(range_table(x, axis, granule, want_dtype), want)  # the numpy form


def _document_spec(lists: bool = False):
    """The document backward's spec; without `lists`, its range table only (the block lists need a GPU or the
    simulator: torch on the CPU makes the range tables only)."""
    g = runpy.run_path(str(ROOT / "examples" / "document.py"))["graph"]
    spec = build_backward_spec(analyse_backward(fl.lower(g, "fa2-bwd")), {"D": 64}, "f16", "mma", None)
    if lists:
        return spec
    return dataclasses.replace(spec, block_mask="static",
                               captures=tuple(c for c in spec.captures if c.derived[:1] != ("q_count",)
                                              and c.derived[:1] != ("q_tiles",)))


@needs_torch
def test_block_data_is_remembered_with_its_tensor() -> None:
    spec = _document_spec()
    assert caller_count(spec) == 3  # doc_id, dim_M, dim_N; then the range table
    bd = BlockData(spec)
    doc = torch.sort(torch.randint(0, 4, (2, 200), dtype=torch.int32), dim=1).values
    q = torch.zeros(2, 1, 200, 64, dtype=torch.float16)
    sizes = (2, 1, 200, 200)
    (first,) = bd.derive([doc, 200, 200], sizes, q)
    np.testing.assert_array_equal(first.numpy(), minmax_table(doc.numpy(), 1, 64))
    (again,) = bd.derive([doc, 200, 200], sizes, q)
    assert again is first  # the same tensor, unchanged: made once (every layer, every step)
    doc[:, :10] = 7  # an in-place write bumps the version counter: new data
    (after,) = bd.derive([doc, 200, 200], sizes, q)
    assert after is not first
    np.testing.assert_array_equal(after.numpy(), minmax_table(doc.numpy(), 1, 64))
    other = doc.clone()  # equal contents, another tensor: made anew (never mistaken for a freed one)
    (third,) = bd.derive([other, 200, 200], sizes, q)
    assert third is not after
    np.testing.assert_array_equal(third.numpy(), after.numpy())
    host = doc.numpy().copy()  # numpy has no version counter: recognised by its content
    (a,) = bd.derive([host, 200, 200], sizes, host)
    (b,) = bd.derive([host.copy(), 200, 200], sizes, host)
    assert a is b  # equal contents (another array too): the same data
    host[1, -1] += 1  # an in-place write: new contents, made anew
    (c,) = bd.derive([host, 200, 200], sizes, host)
    assert c is not a
    np.testing.assert_array_equal(c, minmax_table(host, 1, 64))
    (d,) = bd.derive([host, 200, 199], sizes, host)  # another size: made anew
    assert d is not c


@needs_torch
def test_flex_conversions_are_remembered_per_tensor_version() -> None:
    from falower.torch_mods import _converted

    ids = torch.arange(10)  # int64, as torch.randint gives: converted to the kernels' int32
    a = _converted(ids, ids.device, torch.int32)
    assert a.dtype == torch.int32 and _converted(ids, ids.device, torch.int32) is a
    ids += 1
    b = _converted(ids, ids.device, torch.int32)
    assert b is not a and int(b[0]) == 1
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    assert _converted(w, w.device, torch.float32) is not _converted(w, w.device, torch.float32)


# ------------------------------------------------------------------------------------ the backward's block lists
def _gqa_document() -> fl.Func:
    """Document ids with GQA (two query heads a kv head) and a head-dependent mask (odd heads causal too): the
    kv-outer list walks (head, q tile) pairs whose classes differ between the heads of a group."""
    doc = fl.capture("doc_id", "i32", "B,N")
    return fl.attention(mask_mod=lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (doc[b, q] >= 0)
                        & ((h % 2 == 0) | (q >= kv)), group_size=2, name="gqa_document")


GRAPHS = {"document": lambda: runpy.run_path(str(ROOT / "examples" / "document.py"))["graph"],
          "gqa_document": _gqa_document}


@functools.cache
def _lowered(graph: str, pipeline: str):
    g = GRAPHS[graph]()
    lowered = fl.lower(g, pipeline)
    low = analyse_backward(lowered)
    return g, lowered, low, build_backward_spec(low, {"D": 64}, "f16", "mma", None)


def _operands(func: fl.Func, op, by_name: dict) -> list:
    """The values of a mask op's captured operands: graph inputs, and mask.ranges tables made from them."""
    out = []
    for v in op.operands[4:]:
        if v.owner is func.body:
            out.append(by_name[v.name])
        else:
            r = v.owner
            assert r.name == "mask.ranges", r.name
            out.append(minmax_table(by_name[r.operands[0].name], r.attrs["axis"], r.attrs["granule"]))
    return out


@pytest.mark.parametrize("pipeline", ["fa2-bwd", "fa2-bwd-deterministic"])
@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("kind", ["sorted", "unsorted", "constant", "nothing", "positions"])
@pytest.mark.parametrize("M,N", [(1, 1), (2, 2), (63, 63), (65, 65), (130, 67), (67, 130), (200, 200)])
def test_backward_block_lists_are_sound_and_the_scans(pipeline: str, graph: str, kind: str, M: int, N: int) -> None:
    """The transposed list (per kv tile, the (head, q tile) pairs to visit, partial flagged) and the dQ kernel's
    list (per q tile, the kv tiles): every tile with a kept (q < M, kv < N) pair is listed, a tile listed full
    is full (brute force over every pair: Interpreter.block_classes), each row ascending, and the list holds
    exactly the tiles the kernels' scan visits with the scan's classes (the IR's mask.classify over the same
    range tables, on every tile: the backward's classes are not clamped to M and N)."""
    g, lowered, low, spec = _lowered(graph, pipeline)
    assert low.block_mask == "list"
    G = spec.group_size
    B, H = 2, 2 * G
    env = bind_dims(g, {"B": B, "H": H, "HKV": H // G, "M": M, "N": N, "D": 64})
    inputs = random_inputs(g, env, seed=M * 1000 + N, kind=kind)
    by_name = {a.name: x for a, x in zip(g.args, inputs)}
    caps = [by_name[c.name] for c in low.captures] + [int(env[d]) for d in spec.dims]
    caps += [minmax_table(caps[c], a, gr).astype(np.int32) for c, a, gr in low.ranges]
    sizes = (B, H, M, N)
    lists = dict(zip([t for t, _ in list_layout(spec, sizes)], host_block_lists(spec, caps, sizes)))
    BQ, BK = spec.block_q, spec.block_k
    nq, nk = -(-M // BQ), -(-N // BK)
    it = Interpreter("f64")
    it.env_dims = env

    def check(op, rows, listed_of) -> int:
        """rows: (row index, b, [(entry value, h, qt, kj) of every candidate in order]); returns tiles left out."""
        vals = _operands(lowered, op, by_name)
        ranges = intervals.range_tables(op.attrs["ranges"], vals)
        exact = it.block_classes(op.regions[0], vals, B, H, nq, nk, BQ, BK, M)
        skipped = 0
        for r, b, cands in rows:
            got = listed_of(r)
            assert np.all(np.diff(got >> 1) > 0), (r, got)
            want = []
            for e, h, qt, kj in cands:
                scan = intervals.classify(op.regions[0], b, h, qt * BQ, qt * BQ + BQ - 1, kj * BK, kj * BK + BK - 1,
                                          vals, env, ranges)
                if scan != 0:
                    want.append(e * 2 + (scan == 1))
                if exact[b, h, qt, kj] != 0:
                    assert scan != 0, ("a tile with kept pairs left out", b, h, qt, kj)
                if scan == 2:
                    assert exact[b, h, qt, kj] == 2 and (kj + 1) * BK <= N, ("called full", b, h, qt, kj)
                skipped += scan == 0
            assert got.tolist() == want, (r, got, want)
        return skipped

    HK = H // G
    total = G * nq
    count, tiles = lists["q_count"], lists["q_tiles"]
    rows = [((b * HK + hk) * nk + kj, b, [(i * nq + qt, hk * G + i, qt, kj) for i in range(G) for qt in range(nq)])
            for b in range(B) for hk in range(HK) for kj in range(nk)]
    skipped = check(low.classify, rows, lambda r: tiles[r * total: r * total + count[r]])
    if kind == "sorted" and M >= 200 and N >= 200:
        assert skipped > 0  # a document mask leaves tiles out: what the lists are for
    if pipeline == "fa2-bwd-deterministic":
        count, tiles = lists["kv_count"], lists["kv_tiles"]
        rows = [((b * H + h) * nq + qt, b, [(kj, h, qt, kj) for kj in range(nk)])
                for b in range(B) for h in range(H) for qt in range(nq)]
        check(low.q_classify, rows, lambda r: tiles[r * nk: r * nk + count[r]])
    else:
        assert "kv_count" not in lists  # dQ by atomics from the kv-outer kernel: no q-outer list


# ------------------------------------------------------------------------------------ the dense block table
def test_block_tables_are_remembered_with_their_data() -> None:
    """The dense block table of a mask the range analysis cannot bound: one per distinct data (numpy by its
    content, Python numbers by value), evaluated once; a new size, a write or other content: a new one."""
    bt = BlockTables()
    made = []

    def alloc():
        made.append(np.zeros(4, dtype=np.int8))
        return made[-1]

    ids = np.arange(10, dtype=np.int32)
    offsets = np.arange(10, dtype=np.int32)[::-1].copy()
    sizes = (1, 1, 10, 10)
    e1 = bt.entry([ids, offsets, 10], sizes, alloc)
    bt.fill(e1, lambda: e1.table.fill(1))
    e2 = bt.entry([ids, offsets.copy(), 10], sizes, alloc)  # equal contents: the same table, not evaluated again
    assert e2 is e1 and e2.filled
    bt.fill(e2, lambda: pytest.fail("evaluated again"))
    assert bt.evaluations == 1 and len(made) == 1
    offsets[3] = 0  # in place: new data
    e3 = bt.entry([ids, offsets, 10], sizes, alloc)
    assert e3 is not e1 and not e3.filled
    bt.fill(e3, lambda: None)
    assert bt.evaluations == 2
    assert bt.entry([ids, offsets, 11], sizes, alloc) is not e3  # another captured size
    assert bt.entry([ids, offsets, 10], (1, 1, 10, 9), alloc) is not e3  # another (B, H, M, N)
    assert data_key([ids, object()], sizes) is None  # an array it cannot see into: never remembered
    unknown = bt.entry([ids, object()], sizes, alloc)
    assert bt.entry([ids, object()], sizes, alloc) is not unknown


def test_a_captured_call_gets_a_table_of_its_own_each_time() -> None:
    """While a CUDA graph captures, the table is the graph's: a new one, unfilled (its fill a launch in the graph),
    never remembered, whatever was remembered for the same data."""
    bt = BlockTables()
    ids = np.arange(10, dtype=np.int32)
    sizes = (1, 1, 10, 10)
    eager = bt.entry([ids, 10], sizes, lambda: np.zeros(4, dtype=np.int8))
    bt.fill(eager, lambda: None)
    captured = [bt.entry([ids, 10], sizes, lambda: np.zeros(4, dtype=np.int8), capturing=True) for _ in range(2)]
    assert len({id(eager), *map(id, captured)}) == 3 and not any(e.filled for e in captured)
    assert [id(t) for t in bt._captured] == [id(e.table) for e in captured]  # kept alive, as the graphs read them
    assert bt.entry([ids, 10], sizes, lambda: pytest.fail("made again")) is eager  # the eager one still remembered


@needs_torch
def test_block_tables_follow_a_tensors_version() -> None:
    bt = BlockTables()
    keep = torch.ones(8, 8, dtype=torch.bool)
    sizes = (1, 1, 8, 8)
    e1 = bt.entry([keep], sizes, lambda: torch.zeros(1))
    assert bt.entry([keep], sizes, lambda: torch.zeros(1)) is e1
    keep[0, 0] = False  # an in-place write bumps the version counter
    assert bt.entry([keep], sizes, lambda: torch.zeros(1)) is not e1
    assert bt.entry([keep.clone()], sizes, lambda: torch.zeros(1)) is not e1  # another tensor


def test_a_block_list_past_32_bit_positions_is_a_clear_error() -> None:
    """The kernels walk a block list by 32-bit positions (emit_fa2._emit_list_ahead): a list of 2**31 entries or
    more is refused by name, not wrapped around; one entry fewer is laid out."""
    g = runpy.run_path(str(ROOT / "examples" / "document.py"))["graph"]
    spec = fl.compile(g).specialize("f16", D=64).spec
    tags = dict(list_layout(spec, (1, 1, 256, 256)))
    assert "kv_tiles" in tags and tags["kv_tiles"] == (256 // spec.block_q) * (256 // spec.block_k)
    nq = nk = 1 << 11  # 2**22 tiles a (b, h) row
    rows = (1 << 31) // (nq * nk)  # (b, h) rows that make 2**31 entries
    big = (rows, 1, nq * spec.block_q, nk * spec.block_k)
    with pytest.raises(ValueError, match=r"block list of B=512.*over the kernels' 32-bit positions"):
        list_layout(spec, big)
    dict(list_layout(spec, (rows - 1, 1, nq * spec.block_q, nk * spec.block_k)))  # just under: laid out
