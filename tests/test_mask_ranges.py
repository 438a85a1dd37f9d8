"""Data-dependent masks classified from per-granule ranges of the captured tables (`mask.ranges`).

The rule that makes the ranges safe: a tile the interval classifier calls FULL or EMPTY must be so by the
exact definition (`Interpreter.block_classes`, the dense evaluation). Checked by brute force on every data
kind the checker draws (sorted, unsorted, constant, all dropped, blocks, negative ...), at sizes around the
tiles; then the lowered graphs' numbers against the unlowered ones, forward and backward; then that sorted
document ids are classified exactly (what makes document masks as fast as static ones).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import falower as fl
from falower.errors import FalowerError
from falower.ir import interpret, parse_func, print_func
from falower.ir.interp import Interpreter
from falower.ir.verifier import verify
from falower.ir.intervals import EMPTY, FULL, RangeTable, classify, minmax_table, range_tables
from falower.passes import PassManager, parse_pipeline
from falower.passes.check import DATA_KINDS, Reference, bind_dims, edge_sizes, random_inputs
from falower.passes.mask_tiles import range_plan

from data_masks import MASKS
from test_data_masks import _build, mask_tree

FWD = "decompose-softmax,canonicalize,fuse,tile{bq=%d,bk=%d},online-softmax{exp2=true},mask-tiles{data=ranges}," \
      "canonicalize"
BWD = "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize,tile-bwd{bq=%d,bk=%d,dq=%s,data=ranges}"
RANGED = sorted(m for m in MASKS if m not in ("dense", "nested"))  # those two read data along two axes / via data


def _mask_op(func: fl.Func, name: str):
    return next(op for op in func.walk() if op.name == name)


def test_range_plan_picks_the_varying_axis() -> None:
    g = fl.lower(MASKS["doc_per_head"](), FWD % (8, 4))
    op = _mask_op(g, "mask.classify")
    assert [list(r) for r in op.attrs["ranges"]] == [[0, 2, 4]]  # doc[b, h, q]: axis 2, granule gcd(8, 4)
    assert _mask_op(g, "mask.ranges").results[0].type.shape[-1].value == 2
    assert not any(o.name == "mask.block_table" for o in g.walk())


@pytest.mark.parametrize("mask,why", [("dense", "two axes"), ("nested", "index read from data")])
def test_masks_ranges_cannot_bound_keep_the_dense_table(mask: str, why: str) -> None:
    g = fl.lower(MASKS[mask](), FWD % (8, 4))
    assert any(op.name == "mask.block_table" for op in g.walk()), why
    assert not any(op.name == "mask.ranges" for op in g.walk())


def test_a_table_read_at_fixed_indices_gets_its_exact_values() -> None:
    g = fl.lower(MASKS["threshold"](), FWD % (8, 4))  # thr[h]: nothing varies inside a tile
    assert [list(r) for r in _mask_op(g, "mask.classify").attrs["ranges"]] == [[0, 0, 1]]


def test_minmax_table_and_lookup_clamp_like_gather() -> None:
    t = np.array([[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8, 9, 7]], dtype=np.int32)
    mm = minmax_table(t, axis=1, granule=3)
    assert mm.shape == (2, 3, 2)
    np.testing.assert_array_equal(mm[0], [[1, 4], [1, 9], [2, 2]])  # the last granule is short
    r = RangeTable(mm, axis=1, granule=3, n=7)
    assert r.lookup([(1, 1), (0, 2)]) == (3.0, 6.0)
    assert r.lookup([(1, 1), (2, 4)]) == (3.0, 9.0)  # granules 0 and 1: [6, 5, 3], [5, 8, 9]
    assert r.lookup([(0, 0), (-50, -1)]) == (1.0, 4.0)  # clamped to position 0: its granule
    assert r.lookup([(0, 0), (100, 200)]) == (2.0, 2.0)  # clamped to the last position
    assert r.lookup([(0, 1), (0, 0)]) == (-math.inf, math.inf)  # a varying index off the axis: unknown
    b = minmax_table(np.array([True, False, True]), 0, 2)
    assert b.dtype == np.int8 and b.tolist() == [[0, 1], [1, 1]]


def _interval_classes(op, caps: list, env: dict, B: int, H: int, nq: int, nk: int) -> np.ndarray:
    bq, bk = op.attrs["bq"], op.attrs["bk"]
    tables = [minmax_table(caps[c], a, g) for c, a, g in op.attrs["ranges"]]
    ranges = range_tables(op.attrs["ranges"], caps + tables)
    out = np.zeros((B, H, nq, nk), dtype=np.int8)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                for j in range(nk):
                    out[b, h, i, j] = classify(op.regions[0], b, h, i * bq, i * bq + bq - 1, j * bk,
                                               j * bk + bk - 1, caps + tables, env, ranges)
    return out


def _check_sound(func: fl.Func, bq: int, bk: int, M: int, N: int, kind: str, seed: int,
                 caps: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Interval classes vs exact classes on every tile; returns both."""
    g = fl.lower(func, FWD % (bq, bk))
    op = _mask_op(g, "mask.classify")
    env = bind_dims(func, {"B": 2, "H": 2, "M": M, "N": N, "D": 4})
    caps = random_inputs(func, env, seed, kind)[3:] if caps is None else caps
    nq, nk = -(-M // bq), -(-N // bk)
    it = Interpreter("f64")
    it.env_dims = env
    pred = op.regions[0]
    exact = it.block_classes(pred, caps + [np.zeros(1)] * len(op.attrs["ranges"]), 2, 2, nq, nk, bq, bk, M)
    got = _interval_classes(op, caps, env, 2, 2, nq, nk)
    assert not ((got == FULL) & (exact != FULL)).any(), "a tile called full is not"
    assert not ((got == EMPTY) & (exact != EMPTY)).any(), "a tile called empty is not"
    return got, exact


@pytest.mark.parametrize("kind", DATA_KINDS)
@pytest.mark.parametrize("mask", RANGED)
def test_interval_classes_are_sound(mask: str, kind: str) -> None:
    for (M, N), (bq, bk) in zip([(67, 67), (130, 67), (17, 130), (64, 64)], [(16, 8), (8, 16), (16, 16), (32, 8)]):
        _check_sound(MASKS[mask](), bq, bk, M, N, kind, seed=M + N)


@pytest.mark.parametrize("docs", [1, 3, 8, 40])
def test_sorted_document_ids_are_classified_exactly(docs: int) -> None:
    """Self-attention over ascending ids: every tile classified exactly. With left padding (-1 first) only
    tiles whose rows or columns reach a padding position may stay partial: interval arithmetic does not
    know that the -1 in `doc[q] == doc[kv]` and in `doc[q] >= 0` are one value; partial is always safe."""
    rng = np.random.default_rng(docs)
    bq, bk, n = 16, 8, 130
    for low in (0, -1):
        doc = np.sort(rng.integers(low, docs, size=(2, 2, n)), axis=-1).astype(np.int32)
        got, exact = _check_sound(MASKS["doc_per_head"](), bq, bk, n, n, "sorted", 0, caps=[doc])
        pad = doc < 0
        q_pad = np.array([[[pad[b, h, i:i + bq].any() for i in range(0, n, bq)] for h in range(2)] for b in range(2)])
        kv_pad = np.array([[[pad[b, h, j:j + bk].any() for j in range(0, n, bk)] for h in range(2)] for b in range(2)])
        inexact = got != exact
        assert not (inexact & ~(q_pad[..., :, None] | kv_pad[..., None, :])).any()
        if low == 0:
            assert not inexact.any()


@pytest.mark.parametrize("M,N", [(45, 43), (17, 130)])  # 16 x 8 tiles: ragged both ways, M != N
@pytest.mark.parametrize("mask", RANGED)
def test_numbers_through_the_forward(mask: str, M: int, N: int) -> None:
    pm = PassManager(parse_pipeline(FWD % (16, 8)), check=True, shapes={"B": 2, "H": 2, "M": M, "N": N, "D": 4})
    pm.run(MASKS[mask]())
    assert all(r.check == "ok" for r in pm.records), [r.check for r in pm.records]


@pytest.mark.parametrize("dq", ["atomic", "separate"])
@pytest.mark.parametrize("mask", ["doc_per_head", "shared_prefix", "global_window", "threshold"])
def test_numbers_through_the_backward(mask: str, dq: str) -> None:
    g = MASKS[mask]()
    lowered = fl.lower(g, BWD % (8, 16, dq))
    assert any(op.name == "mask.ranges" for op in lowered.walk())
    assert not any(op.name == "mask.block_table" for op in lowered.walk())
    want = fl.lower(g, BWD.split(",tile-bwd")[0])  # the untiled backward: same inputs, same outputs
    fwd = fl.lower(g, "fa2-fwd")
    for M, N in [(17, 17), (67, 40), (33, 70)]:
        env = bind_dims(g, {"B": 2, "H": 2, "M": M, "N": N, "D": 4})
        for kind in ("sorted", "unsorted", "constant"):
            ins = random_inputs(g, env, seed=M * N, kind=kind)
            o, lse = interpret(fwd, ins, dims=env)
            do = np.random.default_rng(1).standard_normal(o.shape)
            args = [*ins, o, lse, do]
            for a, b in zip(interpret(lowered, args, dims=env), interpret(want, args, dims=env)):
                np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)


def test_the_dump_reads_back() -> None:
    g = fl.lower(MASKS["shared_prefix"](), FWD % (16, 8))
    text = print_func(g)
    assert "mask.ranges" in text and "ranges = [[" in text
    assert print_func(parse_func(text)) == text


def test_verifier_names_a_bad_ranges_attribute() -> None:
    g = fl.lower(MASKS["doc_per_head"](), FWD % (16, 8))
    text = print_func(g).replace("ranges = [[0, 2, 8]]", "ranges = [[3, 2, 8]]", 1)
    with pytest.raises(FalowerError, match="ranges names capture 3"):
        verify(parse_func(text))


def test_unknown_data_option_is_refused() -> None:
    with pytest.raises(FalowerError, match="data must be table or ranges"):
        fl.lower(MASKS["blocks"](), FWD.replace("data=ranges", "data=dense") % (16, 8))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(e=mask_tree, kind=st.sampled_from(DATA_KINDS), size=st.sampled_from(edge_sizes([4, 8])),
       seed=st.integers(0, 2**16))
def test_random_data_masks_keep_their_numbers(e, kind, size, seed) -> None:
    """Random masks over captured tables (nested gathers included: those keep the dense table)."""
    g = _build(e)
    env = bind_dims(g, {"B": 2, "H": 2, "M": size[0], "N": size[1], "D": 4})
    inputs = random_inputs(g, env, seed, kind)
    ref = Reference.build(g, env, inputs=inputs)
    assert ref.compare(fl.lower(g, FWD % (4, 8))) == []


@pytest.mark.parametrize("which", ["max", "cast", "times_inf"])
def test_nan_in_a_table_or_from_inf_times_zero_keeps_tiles_partial(which: str) -> None:
    """NaN has no interval: a float table with a NaN entry (its granule's range table NaN), and inf * 0, once gave
    wrong tile classes (`max(0, thr[kv]) > -1` called FULL where NaN's row keeps nothing: o 0.13 off) or a crash
    (the cast of NaN in intervals._cast). Now NaN-possible values are UNKNOWN and float ops on them stay UNKNOWN:
    the lowered IR (ranges) equals the graph, as the dense table's lowering does."""
    inf = float("inf")

    def make():
        thr = fl.capture("thr", "f32", "N")
        mask = {"max": lambda b, h, q, kv: fl.maximum(0.0, thr[kv]) > -1.0,
                "cast": lambda b, h, q, kv: (thr[kv] * 4.0).to("i32") <= q,
                "times_inf": lambda b, h, q, kv: (fl.where(q >= 8, inf, 1.0) * abs((kv == 0).to("f32")) + 5.0
                                                  + thr[kv] * 0.0).to("i32") >= 5}[which]
        return fl.attention(mask_mod=mask, name=f"nan_{which}")

    g0 = make()
    env = bind_dims(g0, {"M": 70, "N": 140})
    ins = random_inputs(g0, env, 0)
    ins[3] = np.abs(ins[3])
    ins[3][3] = np.nan
    want = interpret(g0, ins, dims=env)[0]
    pipe = ("decompose-softmax,canonicalize,fuse,tile{bq=128,bk=64},online-softmax{exp2=true,lazy=8},"
            "mask-tiles{data=%s},score-licm,canonicalize")
    for data in ("ranges", "table"):
        got = interpret(fl.run_pipeline(make(), pipe % data), ins, dims=env)[0]
        np.testing.assert_allclose(got, want, atol=1e-9, err_msg=f"{which}, data={data}")


def test_a_cast_that_overflows_to_inf_keeps_its_tiles_partial() -> None:
    """(q * 1000).to('f16') is inf past q = 65: the mask `... < inf` drops those rows at native precision, and the
    interval analysis, which never widened an end past f16's largest value to inf, called their tiles FULL."""
    g = fl.attention(mask_mod=lambda b, h, q, kv: (q.to("f32") * 1000.0).to("f16") < float("inf"), name="f16mask")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 128, 8)).astype(np.float16) for _ in range(3))
    pipe = "decompose-softmax,canonicalize,fuse,tile{bq=16,bk=16},online-softmax"
    with np.errstate(over="ignore"):  # (the f16 cast's inf, on purpose)
        naive = interpret(g, [q, k, v], "native")[0]
        want = interpret(fl.lower(g, pipe), [q, k, v], "native")[0]  # P @ V's P in f16, as the kernels' (naive: f32)
        got = interpret(fl.lower(g, pipe + ",mask-tiles"), [q, k, v], "native")[0]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got.astype(np.float64), naive.astype(np.float64), atol=2e-3)


def test_concrete_sizes_lower_through_mask_tiles() -> None:
    """A graph traced at concrete sizes: tile's kv loop bound folds cdiv(50, 64) to 1, which mask-tiles refused
    (`not tile's cdiv(kv length, bk)`) for every graph, masked or not; the length now comes from the kv bound's
    compare (a review helper). M = 37, N = 50 (the kv bound's ragged tile) against the graph."""
    @fl.trace(q=fl.tensor("f16", "1,2,37,8"), k=fl.tensor("f16", "1,2,50,8"), v=fl.tensor("f16", "1,2,50,8"))
    def graph(q, k, v):
        return fl.softmax(q @ k.mT * 0.35, -1) @ v

    rng = np.random.default_rng(1)
    ins = [rng.standard_normal(s).astype(np.float16) for s in ((1, 2, 37, 8), (1, 2, 50, 8), (1, 2, 50, 8))]
    want = interpret(graph, ins)[0]
    low = fl.lower(graph, "fa2-fwd")
    assert any(op.name == "mask.kv_range" for op in low.walk())
    np.testing.assert_allclose(interpret(low, ins)[0], want, atol=1e-9)
