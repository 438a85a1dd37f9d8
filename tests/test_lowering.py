"""The forward lowering (issue 3): every pass preserves the numbers on every example, refuses what it
cannot handle with a message naming the precondition, and produces the FA2 structure."""

from __future__ import annotations

import math
import re
import os
import runpy
from pathlib import Path

import numpy as np
import pytest

import falower as fl
from falower.errors import PassError
from falower.ir import Func, interpret, parse_func, print_func
from falower.ir.intervals import EMPTY, FULL, PARTIAL, classify
from falower.passes import NAMED_PIPELINES, PassManager, parse_pipeline
from falower.passes.check import Reference

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
GOLDEN = Path(__file__).parent / "golden"
SMALL_TILES = "decompose-softmax,canonicalize,fuse,tile{bq=32,bk=16},online-softmax{exp2=true},mask-tiles,canonicalize"


def load(path: Path) -> Func:
    graphs = [v for v in runpy.run_path(str(path)).values() if isinstance(v, Func)]
    assert len(graphs) == 1, path
    return graphs[0]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
@pytest.mark.parametrize("pipeline", ["fa2-fwd", SMALL_TILES, "fa1-fwd"], ids=["fa2-fwd", "small-tiles", "fa1"])
def test_every_pass_preserves_numbers(path: Path, pipeline: str) -> None:
    pm = PassManager(parse_pipeline(pipeline), check=True, shapes={"M": 77, "N": 93})
    out = pm.run(load(path))
    assert [r.check for r in pm.records] == ["ok"] * len(pm.records)
    assert out.result_names == ["o", "lse"]


def test_fa2_structure_on_causal() -> None:
    text = print_func(fl.lower(load(ROOT / "examples" / "causal.py"), "fa2-fwd"))
    # one parallel loop over q tiles, one kv loop carrying (m, l, acc), exp2, one division after the loop
    assert text.count("parallel_for") == 1
    assert "iter_args(%m_i = " in text and "%l_i = " in text and "%acc_i = " in text
    assert "exp2" in text and "%corr = exp2" in text
    assert "%o_tile = div %acc, %l_safe" in text
    assert "mask.kv_range" in text and "mask.classify" in text
    assert "reduce_max" in text and "softmax" not in text and " matmul " not in text


def test_golden_fa2_fwd_causal() -> None:
    text = print_func(fl.lower(load(ROOT / "examples" / "causal.py"), "fa2-fwd"))
    path = GOLDEN / "causal.fa2-fwd.fl"
    if os.environ.get("FALOWER_UPDATE_GOLDEN") == "1" or not path.exists():
        path.write_text(text)
    assert text == path.read_text()
    assert print_func(parse_func(text)) == text  # the dump reads back


def test_fully_masked_rows_give_zero_and_neg_inf_lse() -> None:
    g = load(ROOT / "examples" / "document.py")
    low = fl.lower(g, SMALL_TILES)
    ref = Reference.build(g, {"B": 1, "H": 2, "M": 40, "N": 40})
    doc = ref.inputs[3]
    o, lse = interpret(low, ref.inputs, precision="native")
    padded = doc[0] < 0
    assert padded.any()
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.all(o[0, :, padded, :] == 0)
    assert np.all(np.isneginf(lse[0, :, padded]))
    assert np.all(np.isfinite(lse[0, :, ~padded]))


def test_gqa_loads_kv_heads_without_copies() -> None:
    text = print_func(fl.lower(load(ROOT / "examples" / "gqa.py"), "fa2-fwd"))
    assert "repeat_interleave" not in text
    assert "%hk = floordiv %h" in text and "tile.load %k[%b, %hk," in text


def test_data_dependent_mask_gets_range_tables() -> None:
    """fa2-fwd classifies a document mask from per-granule ranges of its ids (mask-tiles' default data=ranges),
    like a static mask: kv_range and classify, no dense block table."""
    text = print_func(fl.lower(load(ROOT / "examples" / "document.py"), "fa2-fwd"))
    assert "mask.ranges %doc_id {axis = 1, granule = 64}" in text and "mask.kv_range" in text
    assert "mask.block_table" not in text


def test_data_dependent_mask_gets_a_run_time_block_table_with_data_table() -> None:
    text = print_func(fl.lower(load(ROOT / "examples" / "document.py"),
                               NAMED_PIPELINES["fa2-fwd"].replace("mask-tiles", "mask-tiles{data=table}")))
    assert "mask.block_table" in text and "mask.kv_range" not in text


def test_causal_skips_empty_tiles() -> None:
    low = fl.lower(load(ROOT / "examples" / "causal.py"), "decompose-softmax,canonicalize,fuse,"
                   "tile{bq=16,bk=16},online-softmax,mask-tiles,canonicalize")
    kv_range = next(op for op in low.walk() if op.name == "mask.kv_range")
    pred = kv_range.regions[0]
    from falower.ir.intervals import kv_range as scan

    assert scan(pred, 0, 0, q0=0, bq=16, bk=16, nkv=64, env={"N": 64}) == (0, 1)
    assert scan(pred, 0, 0, q0=32, bq=16, bk=16, nkv=64, env={"N": 64}) == (0, 3)
    assert classify(pred, 0, 0, 32, 47, 0, 15, env={"N": 64}) == FULL
    assert classify(pred, 0, 0, 32, 47, 32, 47, env={"N": 64}) == PARTIAL
    assert classify(pred, 0, 0, 32, 47, 48, 63, env={"N": 64}) == EMPTY


@pytest.mark.parametrize("mask", [
    lambda b, h, q, kv: q >= kv,
    lambda b, h, q, kv: (q - kv < 20) & (q >= kv),
    lambda b, h, q, kv: (kv < 10) | (kv <= q),
    lambda b, h, q, kv: ~(q // 16 == kv // 16),
    lambda b, h, q, kv: (q % 7) < 3,
])
def test_tile_classification_is_sound(mask) -> None:
    """An EMPTY tile has no kept element and a FULL tile no dropped one (checked by brute force)."""
    low = fl.lower(fl.attention(mask_mod=mask), "decompose-softmax,canonicalize,fuse,tile{bq=8,bk=8},"
                   "online-softmax,mask-tiles")
    pred = next(op for op in low.walk() if op.name == "mask.classify").regions[0]
    q = np.arange(64)[:, None]
    kv = np.arange(64)[None, :]
    import falower.frontend as fe  # evaluate the same mask on numbers

    keep = np.asarray(mask(0, 0, q, kv)) & (kv < 64)
    for i in range(8):
        for j in range(8):
            c = classify(pred, 0, 0, i * 8, i * 8 + 7, j * 8, j * 8 + 7, env={"N": 64})
            block = keep[i * 8:(i + 1) * 8, j * 8:(j + 1) * 8]
            if c == EMPTY:
                assert not block.any()
            if c == FULL:
                assert block.all()
    del fe


@pytest.mark.parametrize("precision", ["f64", "native"])
@pytest.mark.parametrize("mask", [
    lambda b, h, q, kv: (q * 0.496).int() <= kv,  # truncation toward zero (row 128 keeps key 63)
    lambda b, h, q, kv: (q ^ kv) >= 2,  # ints: bitwise xor
    lambda b, h, q, kv: kv >= (h ^ 3) * 64,
    lambda b, h, q, kv: (~(kv % 2)) < 0,  # ints: ~x = -x - 1, not 1 - x
    lambda b, h, q, kv: q * 0.1 <= 19.2,  # f32 keeps row 192 (19.2000008 <= 19.2000008), f64 drops it
    lambda b, h, q, kv: kv * 0.3 >= 57.6,
], ids=["trunc", "xor", "head_xor", "bit_not", "f32_tie_row", "f32_tie_col"])
def test_masked_tiles_keep_the_graphs_numbers_at_both_precisions(mask, precision) -> None:
    """Tiles the intervals call empty or full are so under the interpreter's own arithmetic (a cast truncates, ints
    xor and invert bitwise, f32 rounds): the tiled IR gives the graph's numbers, in f64 and in the kernels' f32."""
    g = fl.attention(mask_mod=mask)
    low = fl.lower(g, "decompose-softmax,canonicalize,fuse,tile{bq=64,bk=64},online-softmax,mask-tiles")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, n, 8)) for n in (257, 260, 260))
    want = fl.interpret(g, [q, k, v], precision=precision)[0].astype(np.float64)
    got = fl.interpret(low, [q, k, v], precision=precision)[0].astype(np.float64)
    np.testing.assert_allclose(got, want, atol=1e-9 if precision == "f64" else 2e-3)


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa1-fwd"])
def test_a_bare_product_is_its_own_score(pipeline: str) -> None:
    """softmax(q @ k^T) @ v with no scale and no score function: fuse makes an identity region that reads the
    scores (it once read its own result and the pass recursed without end); the numbers are the graph's."""
    T = lambda s: fl.tensor("f16", s)  # noqa: E731

    @fl.trace(q=T("B,H,M,D"), k=T("B,H,N,D"), v=T("B,H,N,D"), result_names=("o",))
    def bare(q, k, v):
        return (fl.softmax(q @ k.mT, dim=-1) @ v).to("f16")

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, n, 8)) for n in (65, 70, 70))
    low = fl.lower(bare, pipeline)
    np.testing.assert_allclose(fl.interpret(low, [q, k, v])[0], fl.interpret(bare, [q, k, v])[0], atol=1e-12)
    assert list(fl.lower(bare, "fa2-bwd").result_names) == ["dq", "dk", "dv"]


def _renamed(text: str) -> str:
    """An attention graph's text with its batch dim named Z and its kv length L."""
    return re.sub(r"\bB\b", "Z", re.sub(r"\bN\b", "L", text))


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa1-fwd", "fa2-fwd,split-kv{parts=3}"])
@pytest.mark.parametrize("stem", ["plain", "causal", "document"])
def test_dims_keep_their_own_names(stem: str, pipeline: str) -> None:
    """tile, mask-tiles and tile-bwd take the batch and kv extents from Q's and K's types, whatever they are named
    (they once wrote B and N: a kv length named L lowered to loops over N, wrong numbers for any N given)."""
    g = fl.parse_func(_renamed(fl.print_func(load(ROOT / "examples" / f"{stem}.py"))))
    low = fl.lower(g, pipeline)
    text = fl.print_func(low)
    assert not re.search(r"\b[BN]\b", text), text
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((2, 2, n, 8)) for n in (65, 130, 130, 65))
    caps = [np.sort(rng.integers(-1, 3, (2, 130))).astype(np.int32)] if stem == "document" else []
    if stem == "document":
        q, do = (rng.standard_normal((2, 2, 130, 8)) for _ in range(2))
    want = fl.interpret(fl.grad(g), [q, k, v, *caps, do])
    np.testing.assert_allclose(fl.interpret(low, [q, k, v, *caps])[0], want[0], atol=1e-12)
    o, lse = fl.interpret(fl.lower(g, "fa2-fwd"), [q, k, v, *caps])
    for a, b in zip(fl.interpret(fl.lower(g, "fa2-bwd"), [q, k, v, *caps, o, lse, do]), want[1:]):
        np.testing.assert_allclose(a, b, atol=1e-12)


def test_refuses_softmax_over_head_dim() -> None:
    @fl.trace(q=fl.tensor("f16", "B,H,M,D"), k=fl.tensor("f16", "B,H,N,D"), v=fl.tensor("f16", "B,H,N,D"))
    def wrong_axis(q, k, v):
        return (fl.softmax(q @ k.mT * 0.125, dim=2) @ v).to("f16")

    with pytest.raises(PassError, match="only a softmax over the kv axis"):
        fl.lower(wrong_axis, "fa2-fwd")


def test_refuses_a_reduction_that_is_not_a_softmax() -> None:
    """exp(s) / sum(exp(s)) is a softmax written out (raise_softmax.py takes it); exp(s) / sum(2 exp(s)) is not."""
    @fl.trace(q=fl.tensor("f16", "B,H,M,D"), k=fl.tensor("f16", "B,H,N,D"), v=fl.tensor("f16", "B,H,N,D"))
    def sum_norm(q, k, v):
        s = (q @ k.mT * 0.125).exp()
        return ((s / (s * 2.0).sum(dim=-1)) @ v).to("f16")

    with pytest.raises(PassError, match="no softmax found"):
        fl.lower(sum_norm, "fa2-fwd")


def test_passes_name_their_missing_precondition() -> None:
    g = load(ROOT / "examples" / "causal.py")
    with pytest.raises(PassError, match="run fuse first"):
        fl.lower(g, "decompose-softmax,tile")
    with pytest.raises(PassError, match="run decompose-softmax first"):
        fl.lower(g, "fuse")
    with pytest.raises(PassError, match="run tile first"):
        fl.lower(g, "decompose-softmax,fuse,online-softmax")


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa2-bwd"])
@pytest.mark.parametrize("use", ["mask", "bias"])
def test_a_captured_tensor_used_whole_is_refused_by_name(use: str, pipeline: str) -> None:
    """where(keep, s, -inf) with keep bool [M, N], or s + bias with bias [M, N], not indexed: the kernels read
    captured tables by index. Once a broadcast error with no pass named (fa2-fwd) and a KeyError (fa2-bwd); a
    review helper's find."""
    keep = fl.capture("keep", "bool" if use == "mask" else "f32", "M,N")

    @fl.trace(q=fl.tensor("f16", "B,H,M,D"), k=fl.tensor("f16", "B,H,N,D"), v=fl.tensor("f16", "B,H,N,D"))
    def whole(q, k, v):
        s = q @ k.mT * 0.25
        s = fl.where(keep, s, -float("inf")) if use == "mask" else s + keep
        return (fl.softmax(s, dim=-1) @ v).to("f16")

    with pytest.raises(PassError, match=r"^pass (fuse|tile-bwd): captured tensor %keep \((bool|f32)\[M,N\]\) is used "
                                        r"whole by (where|add); .* write keep\[\.\.\., q_idx, kv_idx\]"):
        fl.lower(whole, pipeline)


def test_a_softmax_over_f16_scores_is_refused_by_name() -> None:
    """softmax((q @ k^T).to('f16')): the tiled softmax keeps its statistics in f32 / f64; tile once built IR that
    failed verification without naming itself."""
    @fl.trace(q=fl.tensor("f16", "B,H,M,D"), k=fl.tensor("f16", "B,H,N,D"), v=fl.tensor("f16", "B,H,N,D"))
    def f16_scores(q, k, v):
        return (fl.softmax((q @ k.mT).to("f16"), dim=-1) @ v).to("f16")

    with pytest.raises(PassError, match=r"^pass fuse: the softmax's scores are f16"):
        fl.lower(f16_scores, "fa2-fwd")


def test_errors_inside_a_pass_name_the_pass(monkeypatch) -> None:
    """A builder's error raised inside a pass, and a pass's own bug, come out as one line that names the pass."""
    from falower.passes import tile as tile_mod

    def broken(self, func):
        raise KeyError("some value")

    monkeypatch.setattr(tile_mod.Tile, "run", broken)
    with pytest.raises(PassError, match=r"^pass tile: internal error \(KeyError: 'some value'\); please report"):
        fl.lower(load(ROOT / "examples" / "causal.py"), "decompose-softmax,canonicalize,fuse,tile")


def test_mask_tiles_twice_is_a_no_op() -> None:
    """Its already-done check came after the one that fails on the split score function ('the kv loop has no fused
    score function'); a review helper's find."""
    g = load(ROOT / "examples" / "causal.py")
    once = fl.lower(g, "fa2-fwd")
    assert print_func(fl.lower(g, "fa2-fwd,mask-tiles")) == print_func(once)


def test_fa1_order_moves_the_kv_loop_outside() -> None:
    text = print_func(fl.lower(load(ROOT / "examples" / "plain.py"), "fa1-fwd"))
    kv = text.index("for %kj")
    qi = text.index("for %qi")
    assert kv < qi  # kv tiles outer, q tiles inner
    assert "tile.insert %O_new into" in text and "tile.load %O_c" in text


def test_pipeline_strings_print_back() -> None:
    for text in ["decompose-softmax,canonicalize,fuse,tile{bq=64,bk=32},online-softmax{exp2=true}",
                 "tile{order=fa1}", "mask-tiles,canonicalize"]:
        assert str(parse_pipeline(text)) == text


def test_names_must_read_back_and_captures_must_be_distinct() -> None:
    with pytest.raises(fl.FalowerError, match="must be an identifier"):
        fl.capture("my-bias", "f32", "H,M,N")
    with pytest.raises(fl.FalowerError, match="must be an identifier"):
        fl.attention(name="my graph")
    a, b = fl.capture("t", "f32", "H"), fl.capture("t", "i32", "B,N")
    with pytest.raises(fl.FalowerError, match="two different captured tensors are named 't'"):
        fl.attention(score_mod=lambda s, bb, h, q, kv: s + a[h] + b[bb, q].to("f32"))


SHIPPED_PASSES = sorted(n for n, c in fl.passes.PASSES.items() if c.__module__.startswith("falower."))


@pytest.mark.parametrize("name", SHIPPED_PASSES)
def test_every_pass_states_its_precondition_and_shows_before_after(name) -> None:
    from falower.passes import PASSES

    assert len(SHIPPED_PASSES) >= 6
    doc = PASSES[name].__doc__ or ""
    assert "Requires" in doc, f"{name}: docstring must say what the pass requires"
    assert "=>" in doc, f"{name}: docstring must show IR before => after"
    assert PASSES[name].summary, f"{name}: one-line summary for `falower passes`"


@pytest.mark.parametrize("call,says", [
    (lambda g: fl.lower(g, 123), "the pipeline must be a string"),
    (lambda g: fl.lower(g, None), "the pipeline must be a string"),
    (lambda g: fl.lower(None, "fa2-fwd"), "the graph must be a falower Func"),
    (lambda g: fl.lower(g, "fa2-fwd", bogus=1), "unknown option bogus="),
    (lambda g: fl.compile(g, "reference", extra=[1]), "extra must be a dict"),
])
def test_the_api_names_a_bad_argument(call, says: str) -> None:
    with pytest.raises(fl.FalowerError, match=says):
        call(fl.attention())


def test_a_score_function_of_many_chained_ops_lowers() -> None:
    """An unrolled score of 500 chained ops: the passes' walks from a value to its definitions recurse once an op
    and passed Python's 1000 frames (score-licm and tile-bwd: 'internal error (RecursionError)'); the pipelines and
    the kernels' source builders now run with a raised limit (passes.manager.deep_graphs), restored after."""
    import sys

    def deep(s, b, h, q, kv):
        for _ in range(500):
            s = s + (kv - q) * 0.001
        return s

    g = fl.attention(score_mod=deep, name="deep")
    limit = sys.getrecursionlimit()
    fl.lower(g, "fa2-fwd")
    fl.lower(g, "fa2-bwd")
    assert sys.getrecursionlimit() == limit
