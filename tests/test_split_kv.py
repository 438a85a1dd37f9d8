"""split-kv and the LSE merge: a q tile's kv range in parts merged by their LSE means what the unsplit attention
means (the interpreter against the float64 reference of the input graph), on every example, at the sizes where
shares go wrong (one kv tile, a tile plus one, more parts than tiles, M != N, fully masked rows); the merge alone
against numpy over the concatenated keys; the pass's preconditions; the dump round trip; the backends."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import falower as fl
from falower.cli import select_graph
from falower.errors import FalowerError, PassError
from falower.ir import interpret, parse_func, print_func
from falower.ir.lse_merge import lse_merge_func
from falower.passes.check import Reference

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = sorted(p.stem for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
# 16 x 16 tiles: several kv tiles (so several shares) at sizes the interpreter runs in a blink
SMALL = ("decompose-softmax,canonicalize,fuse,tile{bq=16,bk=16},online-softmax{exp2=true,lazy=8},mask-tiles,"
         "score-licm,canonicalize")


def example(stem: str) -> fl.Func:
    return select_graph(ROOT / "examples" / f"{stem}.py", None)


def sizes(M: int, N: int) -> dict[str, int]:
    return {"B": 1, "H": 2, "HKV": 1, "M": M, "N": N, "D": 4}


@pytest.mark.parametrize("stem", VARIANTS)
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_split_kv_keeps_every_examples_numbers(stem: str, parts: int) -> None:
    """N = 50: four 16-wide kv tiles in 2, 3 or 5 shares (5: a share of one tile, the fifth part empty)."""
    g = example(stem)
    ref = Reference.build(g, sizes(37, 50))
    assert ref.compare(fl.lower(g, f"{SMALL},split-kv{{parts={parts}}}"), tol=1e-9) == []


@pytest.mark.parametrize("stem", ["causal", "document", "sliding_window", "alibi", "relative_bias"])
@pytest.mark.parametrize("M, N", [(1, 1), (2, 17), (17, 2), (16, 16), (15, 33), (70, 10)])
def test_split_kv_at_the_edge_sizes(stem: str, M: int, N: int) -> None:
    """One tile and one row, a tile plus one, a tile minus one, M != N both ways; 70 x 10 under the 48-wide window
    leaves rows 58.. with no key at all."""
    g = example(stem)
    lowered = fl.lower(g, f"{SMALL},split-kv{{parts=3}}")
    for kind in ("sorted", "unsorted", "constant"):
        ref = Reference.build(g, sizes(M, N), kind=kind)
        assert ref.compare(lowered, tol=1e-9) == [], kind


def test_a_row_no_part_sees_keeps_lse_minus_inf_and_o_zero() -> None:
    g = example("sliding_window")  # keys q - 48 < kv <= q
    ref = Reference.build(g, sizes(70, 10))
    o, lse = interpret(fl.lower(g, f"{SMALL},split-kv{{parts=4}}"), ref.inputs, "f64", ref.env)
    assert np.isneginf(lse[..., 58:]).all() and np.isfinite(lse[..., :57]).all()
    assert (o[..., 58:, :] == 0).all() and not np.isnan(o).any()


def test_parts_one_is_the_identity_and_the_default_pipeline_splits_too() -> None:
    g = example("causal")
    base = fl.lower(g, "fa2-fwd")
    assert print_func(fl.lower(g, "fa2-fwd,split-kv{parts=1}")) == print_func(base)
    split = fl.lower(g, "fa2-fwd,split-kv")  # parts=2 by default, on fa2-fwd's 128 x 64 tiles
    ref = Reference.build(g, sizes(130, 300))
    assert ref.compare(split, tol=1e-9) == []
    text = print_func(split)
    assert "parallel_for (%part, %b, %h, %qi) in (2, B, H, cdiv(M, 128)) : f32[2,B,H,M,D], f32[2,B,H,M]" in text
    assert "for %kj = %kv_part_lo to %kv_part_hi" in text and "%o_merged = reduce_sum" in text


@pytest.mark.parametrize("stem", ["causal", "relative_bias", "sliding_window"])
def test_parts_stored_rounded_say_so_and_stay_within_the_rounding(stem: str) -> None:
    """split-kv{part_dtype=f16}: each part's O is cast to f16 in the parallel_for (what the numba-cuda kernel's
    epilogue stores) and widened to f32 before the merge, and the function still means the unsplit attention (the
    reference interpreter runs in float64; the kernels' rounding is the GPU tests' error rule). An unknown dtype is
    refused."""
    g = example(stem)
    lowered = fl.lower(g, f"{SMALL},split-kv{{parts=3,part_dtype=f16}}")
    text = print_func(lowered)
    assert ": f16[3,B,H,M,D], f32[3,B,H,M] {" in text and "cast %o_parts {to = \"f32\"}" in text
    ref = Reference.build(g, sizes(37, 50))
    assert ref.compare(lowered, tol=1e-9) == []
    with pytest.raises(PassError, match="part_dtype must be f32, f16 or bf16, got 'f8'"):
        fl.lower(g, f"{SMALL},split-kv{{parts=3,part_dtype=f8}}")


def test_the_split_dump_round_trips_and_computes_the_same() -> None:
    lowered = fl.lower(example("document"), "fa2-fwd,split-kv{parts=3}")
    text = print_func(lowered)
    again = parse_func(text)
    fl.verify(again)
    assert print_func(again) == text
    ref = Reference.build(lowered, sizes(130, 140))
    for x, y in zip(interpret(lowered, ref.inputs, "native", ref.env), interpret(again, ref.inputs, "native", ref.env)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("pipeline, why", [
    ("decompose-softmax,split-kv", "needs one parallel_for over (b, h, q tile), found 0"),
    ("fa1-fwd,split-kv", "needs the forward.s parallel_for (b, h, q tile) with outputs O and LSE; got 2 bounds"),
    ("fa2-fwd,split-kv{parts=0}", "parts must be 1 to 1024, got 0"),
    ("fa2-fwd,split-kv{parts=100000000}", "parts must be 1 to 1024, got 100000000"),  # --check ran for minutes
])
def test_the_pass_says_which_precondition_failed(pipeline: str, why: str) -> None:
    with pytest.raises(PassError, match="pass split-kv: .*" + why.replace("(", r"\(").replace(")", r"\)")):
        fl.lower(example("causal"), pipeline)


def test_an_op_after_p_v_is_refused_not_merged() -> None:
    """tanh(P @ V): the merge is linear in each part's O, so the pass must not merge the parts' tanh."""
    @fl.trace(q=fl.tensor("f16", "B,H,M,D"), k=fl.tensor("f16", "B,H,N,D"), v=fl.tensor("f16", "B,H,N,D"))
    def g(q, k, v):
        return fl.tanh(fl.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v)

    with pytest.raises(PassError, match="pass split-kv: O's tile is not the kv loop's acc / l"):
        fl.lower(g, "fa2-fwd,split-kv{parts=3}")


def test_passes_after_split_kv_that_need_the_q_tile_nest_say_so() -> None:
    with pytest.raises(PassError, match="pass mask-tiles: .*split-kv's parts.*run split-kv last"):
        fl.lower(example("causal"), f"{SMALL.replace(',mask-tiles', '')},split-kv{{parts=3}},mask-tiles")


def test_the_backward_graph_is_refused() -> None:
    with pytest.raises(PassError, match="pass split-kv: "):
        fl.lower(example("causal"), "fa2-bwd,split-kv")


def test_the_reference_backend_runs_it_and_numba_cuda_says_what_it_needs() -> None:
    """The reference backend runs any split. The numba-cuda kernel stores each part through O's epilogue, so its
    parts must be in the inputs' dtype, and only the persistent warp-specialized wgmma kernel has the parts in its
    work items (without a Hopper GPU the choice is mma.sync, which says so); the kernel itself is
    tests/backend/test_split_kv_simulator.py's and tests/gpu/test_split_kv_gpu.py's."""
    g = example("causal")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 100, 16)).astype(np.float16)
    k = rng.standard_normal((1, 2, 300, 16)).astype(np.float16)
    o_split, lse_split = fl.compile(g, "reference", pipeline="fa2-fwd,split-kv{parts=3}").forward(q, k, k)
    o, lse = fl.compile(g, "reference").forward(q, k, k)
    np.testing.assert_allclose(o_split.astype(np.float32), o.astype(np.float32), atol=1e-3)
    np.testing.assert_allclose(lse_split, lse, atol=1e-5)
    with pytest.raises(FalowerError, match=r"parts are f32 but the inputs are f16: .*split-kv\{part_dtype=f16\}"):
        fl.compile(g, "numba-cuda", pipeline="fa2-fwd,split-kv{parts=2}", path="mma").specialize("f16", D=16)
    with pytest.raises(FalowerError, match="split-kv .2 parts. is emitted by the persistent warp-specialized"):
        fl.compile(g, "numba-cuda", pipeline="fa2-fwd,split-kv{parts=2,part_dtype=f16}", path="mma",
                   extra={"schedule": "mma"}).specialize("f16", D=16)


@settings(max_examples=40, deadline=None)
@given(parts=st.integers(1, 5), rows=st.integers(1, 6), seed=st.integers(0, 2**16), empty=st.floats(0.0, 1.0))
def test_the_merge_is_attention_over_the_concatenated_keys(parts: int, rows: int, seed: int, empty: float) -> None:
    """lse_merge_func on parts of random keys (some parts, or whole rows, with no key) against numpy's softmax over
    all the parts' keys at once."""
    rng = np.random.default_rng(seed)
    D, keys = 3, rng.integers(0, 4, size=parts)  # keys a part: 0 is a part that saw nothing
    x = [rng.standard_normal((1, 1, rows, n)) * 3 for n in keys]
    v = [rng.standard_normal((n, D)) for n in keys]
    for i in range(rows):  # some rows are masked out in every part
        if rng.random() < empty:
            for xp in x:
                xp[..., i, :] = -math.inf
    o_parts, lse_parts = [], []
    for xp, vp in zip(x, v):
        with np.errstate(divide="ignore", invalid="ignore"):
            m = xp.max(axis=-1, initial=-math.inf)
            e = np.exp(xp - np.where(np.isneginf(m), 0, m)[..., None])
            s = e.sum(axis=-1)
            lse_parts.append(np.where(s > 0, np.log(s) + np.where(np.isneginf(m), 0, m), -math.inf))
            o_parts.append(np.where(s[..., None] > 0, (e / np.where(s > 0, s, 1)[..., None]) @ vp, 0.0))
    o, lse = interpret(lse_merge_func(parts, "f32"), [np.stack(o_parts), np.stack(lse_parts)], "f64",
                       {"B": 1, "H": 1, "M": rows, "D": D})
    xs, vs = np.concatenate(x, axis=-1), np.concatenate(v, axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        m = xs.max(axis=-1, initial=-math.inf)
        e = np.exp(xs - np.where(np.isneginf(m), 0, m)[..., None])
        s = e.sum(axis=-1)
        want_lse = np.where(s > 0, np.log(s) + np.where(np.isneginf(m), 0, m), -math.inf)
        want_o = np.where(s[..., None] > 0, (e / np.where(s > 0, s, 1)[..., None]) @ vs, 0.0)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    assert not np.isnan(o).any()


def test_the_merge_refuses_parts_that_do_not_line_up() -> None:
    from falower.ir.builder import new_func
    from falower.ir.dims import dim
    from falower.ir.lse_merge import build_lse_merge
    from falower.ir.types import TensorType

    _, b, (o, lse) = new_func("m", [("o", TensorType("f32", (dim(2), dim("M"), dim("D")))),
                                    ("lse", TensorType("f32", (dim(3), dim("M"))))])
    with pytest.raises(ValueError, match="lse merge: O parts"):
        build_lse_merge(b, o, lse)
    with pytest.raises(ValueError, match="parts must be at least 1"):
        lse_merge_func(0)


def test_the_shares_partition_each_q_tiles_kv_range() -> None:
    """The parts' loops [lo_p, hi_p) cover [lo, hi) exactly once and stay inside it (past hi a tile would be
    skipped as empty, so the numbers alone cannot see a share that runs over: this checks the bounds)."""
    from falower.ir.builder import new_func
    from falower.ir.types import scalar
    from falower.passes.split_kv import _share

    for parts in (1, 2, 3, 7):
        f, b, (lo, hi, part) = new_func("share", [("lo", scalar("i32")), ("hi", scalar("i32")),
                                                  ("part", scalar("i32"))])
        b.ret(*_share(b, lo, hi, part, parts))
        for lo_v, hi_v in [(0, 0), (0, 1), (0, 5), (3, 4), (2, 9), (5, 3), (0, 64)]:
            seen: list[int] = []
            for p in range(parts):
                a, z = (int(x) for x in interpret(f, [np.int32(lo_v), np.int32(hi_v), np.int32(p)], "native", {}))
                n = max(hi_v - lo_v, 0)
                assert lo_v <= a and z <= max(hi_v, lo_v) and n // parts <= z - a <= -(-n // parts)  # even shares
                seen += range(a, z)
            assert seen == list(range(lo_v, max(hi_v, lo_v))), (parts, lo_v, hi_v, seen)


@settings(max_examples=25, deadline=None)
@given(stem=st.sampled_from(VARIANTS), bq=st.sampled_from([16, 32]), bk=st.sampled_from([16, 32]),
       parts=st.integers(2, 6), M=st.integers(1, 70), N=st.integers(1, 70),
       ragged=st.sampled_from(["last", "first"]), seed=st.integers(0, 3))
def test_split_kv_on_random_tiles_parts_and_sizes(stem: str, bq: int, bk: int, parts: int, M: int, N: int,
                                                 ragged: str, seed: int) -> None:
    """Any example, tile sizes, ragged end, part count and M x N: the split means the unsplit attention (a mask
    reading captured tables refuses ragged_q=first in mask-tiles, before split-kv is reached: that draw is skipped)."""
    g = example(stem)
    pipeline = (f"decompose-softmax,canonicalize,fuse,tile{{bq={bq},bk={bk},ragged_q={ragged}}},"
                f"online-softmax{{exp2=true,lazy=8}},mask-tiles,score-licm,canonicalize,split-kv{{parts={parts}}}")
    try:
        lowered = fl.lower(g, pipeline)
    except PassError as e:
        assert ragged == "first" and "pass mask-tiles" in str(e), e
        return
    kind = ("sorted", "unsorted", "constant")[seed % 3]
    ref = Reference.build(g, sizes(M, N), seed=seed, kind=kind)
    assert ref.compare(lowered, tol=1e-9) == []


def test_fuse_after_tiling_says_so() -> None:
    """fuse after split-kv read the LSE merge's reduce_max as a softmax over axis 0 (a review helper); after fa2-fwd
    it said there was no softmax. Both now say the graph is tiled already."""
    import falower as fl
    from falower.errors import PassError

    g = fl.attention(name="plain")
    for pipe in ("fa2-fwd,fuse", "fa2-fwd,split-kv{parts=2},fuse"):
        with pytest.raises(PassError, match=r"^pass fuse: the graph is already tiled"):
            fl.lower(g, pipe)
