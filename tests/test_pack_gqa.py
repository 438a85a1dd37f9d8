"""pack-gqa (falower/passes/pack_gqa.py): a GQA graph rewritten so a kv head's G query heads are the rows of one
problem. The packed graph on q reshaped [B, HKV, M*G, D] gives the GQA graph's numbers (the interpreter: every row
is computed alone), scores and masks that read the query head or row included (rebuilt from the packed row); a
graph that reads q itself, or a capture that could be read by broadcast, is refused by name; falower.compile runs
calls of at most PACK_MAX_QUERY_ROWS query rows a head through it (decoding, speculative decoding), and the kernel it
builds for decoding is decoding's (64-row q tiles in parts)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import falower as fl
from falower.errors import PassError
from falower.ir.interp import Interpreter
from falower.passes.pack_gqa import PACK_MAX_QUERY_ROWS, group_of, pack_gqa, score_reads_query_index


def _gqa(group: int = 4, score_mod=None, mask_mod=None):
    return fl.attention(score_mod=score_mod, mask_mod=mask_mod, group_size=group, name="gqa")


def _inputs(rng, B, HKV, G, M, N, D):
    q = rng.standard_normal((B, HKV * G, M, D)).astype(np.float16)
    k, v = (rng.standard_normal((B, HKV, N, D)).astype(np.float16) for _ in range(2))
    return q, k, v


def test_the_packed_graph_reads_q_packed_and_repeats_nothing():
    packed, G = pack_gqa(_gqa(4))
    text = fl.print_func(packed)
    assert G == 4 and "repeat_interleave" not in text and "%h = iota" not in text
    assert "%q: f16[B,HKV,M*4,D]" in text and "-> (o: f16[B,HKV,M*4,D])" in text
    assert "matmul %q, %k {transpose_b} : f32[B,HKV,M*4,N]" in text
    fl.verify(packed)


SLOPES = fl.capture("slopes", "f32", "HS")
MODS = {  # (score_mod, mask_mod): what reads the query head (h) or row (q_idx), and what reads neither
    "none": (None, None),
    "softcap": (lambda s, b, h, q, kv: 20.0 * fl.tanh(s / 20.0), None),
    "causal": (None, lambda b, h, q, kv: q >= kv),
    "window": (None, lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 3)),
    "alibi": (lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q), None),
    "head_mask": (None, lambda b, h, q, kv: (h % 3 != 1) | (kv < 2)),
}


@settings(max_examples=40, deadline=None)
@given(G=st.sampled_from([2, 4, 8]), B=st.integers(1, 2), HKV=st.integers(1, 3), M=st.integers(1, 9),
       N=st.integers(1, 70), mods=st.sampled_from(sorted(MODS)))
def test_the_packed_graph_gives_the_gqa_graphs_numbers(G, B, HKV, M, N, mods):
    """Each row's softmax and product are the same numbers whichever head it is filed under, up to the order of the
    graph-level matmul's f32 sums (numpy's BLAS batches [1, 6, 1, 8] and [1, 3, 2, 8] differently): within two f16
    ulps."""
    g = _gqa(G, *MODS[mods])
    packed, got = pack_gqa(g)
    assert got == G
    q, k, v = _inputs(np.random.default_rng(M * N + G), B, HKV, G, M, N, 8)
    caps = [np.linspace(0.1, 1.0, HKV * G).astype(np.float32)] if mods == "alibi" else []
    want = Interpreter("native").run(g, [q, k, v, *caps])[0]
    o = Interpreter("native").run(packed, [q.reshape(B, HKV, M * G, 8), k, v, *caps])[0]
    np.testing.assert_allclose(o.reshape(B, HKV * G, M, 8).astype(np.float64), want.astype(np.float64),
                               rtol=2.0 ** -9, atol=2.0 ** -14)


def test_what_pack_gqa_refuses_it_names():
    with pytest.raises(PassError, match="pack-gqa: k and v are not each repeated over heads once.*not a GQA graph"):
        pack_gqa(fl.attention(name="mha"))
    packed = fl.print_func(pack_gqa(_gqa(4, score_mod=lambda s, b, h, q, kv: s + h - q))[0])
    assert "%h = add %h_first, %h_in_group" in packed and "%q_idx = mod %row, %rows" in packed
    text = fl.print_func(_gqa(4)).replace("%v: f16[B,HKV,N,D])", "%v: f16[B,HKV,N,D], %bias: f32[1,HKV*4,1,1])")
    text = text.replace("  %7 = softmax %6", "  %hb = add %6, %bias : f32[B,HKV*4,M,N]\n  %7 = softmax %hb")
    with pytest.raises(PassError, match=r"captured %bias f32\[1,HKV\*4,1,1\] has the query heads' or rows' size"):
        pack_gqa(fl.parse_func(text))
    # a score that reads q itself (a gather of q's head 5: packed, it would land on another row)
    text = fl.print_func(_gqa(4)).replace("  %7 = softmax %6", "  %c5 = const 5 : i32\n  %c0 = const 0 : i32\n"
                                          "  %gk = gather %q, %b, %c5, %c0, %kv_idx : f16[B,1,1,N]\n"
                                          "  %gf = cast %gk {to = \"f32\"} : f32[B,1,1,N]\n"
                                          "  %sg = add %6, %gf : f32[B,HKV*4,M,N]\n  %7 = softmax %sg")
    with pytest.raises(PassError, match="q must be read only by the score's product q k.T, got matmul, gather"):
        pack_gqa(fl.parse_func(text))
    assert group_of(fl.attention(name="mha")) == 1 and group_of(_gqa(8)) == 8


def test_a_decoding_call_runs_the_packed_graph():
    """falower.compiler packs a call of at most PACK_MAX_QUERY_ROWS query rows a head (M * G past one q tile too);
    more rows or extra pack_gqa False keep the graph as written; the outputs are the unpacked call's, in its
    shapes."""
    rng = np.random.default_rng(1)
    for mods in ("none", "causal", "alibi", "window"):
        g = _gqa(4, *MODS[mods])
        c, plain = fl.compile(g, "reference"), fl.compile(g, "reference", extra={"pack_gqa": False})
        for M, packs in ((1, True), (17, True), (PACK_MAX_QUERY_ROWS, True), (PACK_MAX_QUERY_ROWS + 1, False)):
            q, k, v = _inputs(rng, 2, 2, 4, M, 45, 16)
            caps = [np.linspace(0.1, 1.0, 8).astype(np.float32)] if mods == "alibi" else []
            env = c._dims([q, k, v, *caps])
            packs = packs and mods != "alibi"  # (its score reads the query head and row: score_reads_query_index)
            assert (c.packed_for(env) is not None) == packs and plain.packed_for(env) is None
            o, lse = c(q, k, v, *caps)
            o2, lse2 = plain(q, k, v, *caps)
            assert o.shape == (2, 8, M, 16) and lse.shape == (2, 8, M)
            np.testing.assert_allclose(o.astype(np.float64), o2.astype(np.float64), rtol=2.0 ** -9, atol=2.0 ** -14)
            np.testing.assert_allclose(lse, lse2, rtol=1e-6, atol=1e-6)  # (-inf where a row sees no key, in both)
    causal = fl.compile(_gqa(4, mask_mod=lambda b, h, q, kv: q >= kv), "reference")
    assert causal.packed_for({"B": 1, "HKV": 2, "M": 1, "N": 45, "D": 16}) is not None  # (q_idx rebuilt)


def test_the_score_reading_the_query_head_or_row_is_not_packed():
    """falower.compile packs a graph whose mask reads the query head or row (rebuilt once a row's bounds a tile) but
    not one whose score does (rebuilt per element: packed ALiBi decoding ran 0.43-0.58x the unpacked call)."""
    reads = {"none": False, "causal": False, "window": False, "alibi": True}
    for mods, want in reads.items():
        assert score_reads_query_index(_gqa(4, *MODS[mods])) is want, mods
    head_mask = _gqa(4, mask_mod=lambda b, h, q, kv: (q >= kv) | (h % 2 == 0))
    row_score = _gqa(4, score_mod=lambda s, b, h, q, kv: s * (q + 1))
    assert not score_reads_query_index(head_mask) and score_reads_query_index(row_score)
    for score in (lambda s, b, h, q, kv: s + fl.where(q >= kv, 0.0, float("-inf")),  # a select the score makes
                  lambda s, b, h, q, kv: s * fl.where(h < 2, 1.0, 0.5),
                  lambda s, b, h, q, kv: s + fl.where(q >= kv, 0, 1) * -1e4):
        assert score_reads_query_index(_gqa(4, score_mod=score))
    assert fl.compile(row_score, "reference").packed_for({"B": 1, "HKV": 2, "M": 1, "N": 45, "D": 16}) is None
    assert fl.compile(head_mask, "reference").packed_for({"B": 1, "HKV": 2, "M": 1, "N": 45, "D": 16}) is not None
    pack_gqa(row_score)  # (the rewrite itself is right for both: test_packing_preserves_the_numbers)


def test_the_packed_decoding_kernel_is_decodings(monkeypatch):
    """On a Hopper GPU the packed graph's kernel for B = 1, HKV = 8, G = 4, M = 1, N = 8k is decoding's: four rows
    of one 64-row q tile a kv head, in 16 parts (8 q tiles), where the unpacked call ran 32 q tiles of one row."""
    from falower.backends.numba_cuda import runtime

    monkeypatch.setattr(runtime, "device_cc", lambda: (9, 0))
    monkeypatch.setattr(runtime, "device_sm_count", lambda: 132)
    monkeypatch.setattr(runtime, "_has_gpu", lambda: False)
    c = fl.compile(_gqa(4))
    env = {"B": 1, "HKV": 8, "M": 1, "N": 8192, "D": 128}
    packed = c.packed_for(env)
    kern = packed.specialize("f16", **env)
    assert (kern.spec.block_q, kern.spec.kv_parts) == (64, 16)
    assert "parallel_for (%part, %b, %h, %qi) in (16, B, HKV, cdiv(M*4, 64))" in fl.print_func(
        packed.lowered_of(kern))
    unpacked = c.specialize("f16", **env)
    assert unpacked.spec.kv_parts == 4  # 32 q tiles of one row


def test_gqa_counts_its_tiles_as_mha_does(monkeypatch):
    """The cost model counts a static mask's visited kv tiles at every size 1, GQA's G heads included: a q tile's
    average is MHA's (causal at N = 1k: 4.5 of 8), so 8 query heads over 2 kv heads take MHA's tiles; and the packed
    graph's rows (M*4) reach the count, so a masked decoding call splits packed as unpacked."""
    from falower.backends.numba_cuda import runtime

    monkeypatch.setattr(runtime, "device_cc", lambda: (9, 0))
    monkeypatch.setattr(runtime, "device_sm_count", lambda: 132)
    monkeypatch.setattr(runtime, "_has_gpu", lambda: False)
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    gqa, mha = fl.compile(_gqa(4, mask_mod=causal)), fl.compile(fl.attention(mask_mod=causal))
    for D in (64, 128):
        assert gqa._visited_kv_tiles(128, 128, 1024, 1024, D) == pytest.approx(mha._visited_kv_tiles(128, 128, 1024,
                                                                                                     1024, D))
        g = gqa.specialize("f16", B=1, HKV=2, M=1024, N=1024, D=D).spec
        m = mha.specialize("f16", B=1, H=8, M=1024, N=1024, D=D).spec
        assert (g.block_q, g.kv_parts) == (m.block_q, m.kv_parts) == (64, 1)
    window = fl.compile(_gqa(4, mask_mod=lambda b, h, q, kv: kv < 5000))
    env = {"B": 1, "HKV": 8, "M": 1, "N": 8192, "D": 128}
    # 8 q tiles of 40 kv tiles: 16 parts of 2.5 (decoding's parts keep KV_PART_MIN_TILES_DECODE = 2 tiles)
    assert window.packed_for(env).specialize("f16", **env).spec.kv_parts == 16
    # the rebuilt row q_idx = r % M is bounded with M's size: a packed causal decoding row keeps key 0 only, one kv
    # tile (the model counted all 64 and split it in 16 parts while the size was unknown to it)
    packed_causal = gqa.packed_for(env)
    assert packed_causal._visited_kv_tiles(64, 128, 4, 8192, 128) < 1.1
    assert packed_causal.specialize("f16", **env).spec.kv_parts == 1


def test_a_graph_that_does_not_pack_takes_its_inputs_as_before():
    """The packing's checks run only on a GQA graph: an MHA graph on the reference backend still takes a capture
    given as a Python list (np.asarray), and wrong inputs give the errors they gave."""
    import runpy
    from pathlib import Path

    from falower.errors import ShapeError

    g = next(v for v in runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples" / "alibi.py")).values()
             if isinstance(v, fl.Func))
    c = fl.compile(g, "reference")
    q, k, v = _inputs(np.random.default_rng(2), 1, 2, 1, 5, 7, 8)
    o, lse = c(q, k, v, [0.5, 0.25])
    assert o.shape == (1, 2, 5, 8) and lse.shape == (1, 2, 5)
    with pytest.raises(ShapeError, match="takes 4 inputs"):
        c(q, k, v)
    gq = fl.compile(_gqa(4), "reference")
    with pytest.raises(ShapeError, match="must have rank 4"):
        gq(q[0], k, v)
