"""split-kv on the GPU (marked gpu): a small grid's q tiles in kv parts (falower.compile's automatic choice, or the
caller's kv_parts), each part's O and LSE through the persistent kernel's epilogue into workspaces and the LSE merge
after it, against FlashAttention's error rule on the examples; decoding's shapes (a few query rows against many
keys, M != N); the direct launches, Numba's path and the bare kernel's relaunch giving the same numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import falower as fl  # noqa: E402
from falower.passes.check import bind_dims, random_inputs  # noqa: E402
from test_examples_gpu import assert_error_rule, graph, rounded  # noqa: E402

SPLIT: dict = {}


def _hopper() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU (the persistent warp-specialized kernel)")


def _compiled(stem: str, dtype: str, parts, **extra):
    g, auto = graph(stem, dtype)
    if parts == "auto" and not extra:
        return g, auto
    key = (stem, dtype, parts) + tuple(sorted(extra.items()))
    if key not in SPLIT:
        SPLIT[key] = fl.compile(g, "numba-cuda", extra={"kv_parts": parts, **extra})
    return g, SPLIT[key]


def _host(g, env, dtype, seed):
    raw = random_inputs(g, env, seed=seed)
    return [rounded(x, dtype) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
            for i, x in enumerate(raw)]


def _decoding_kernel(c, stem: str, dtype: str, env: dict):
    """The kernel a decoding call of `env`'s sizes runs: the packed GQA graph's where GQA packs (its q
    [B, HKV, M G, D], specialized with a kv head's sizes and M still a head's rows), else the graph's own."""
    if stem == "gqa":
        return c.packed_for(env).specialize(dtype, B=env["B"], D=env["D"], M=env["M"], N=env["N"], H=env["HKV"],
                                            HKV=env["HKV"])
    return c.specialize(dtype, **env)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("stem, D", [(s, d) for s in ["plain", "relative_bias", "softcap", "gqa", "causal", "alibi",
                                                       "prefix_lm", "sliding_window"] for d in (64, 128)
                                      if (s, d) != ("sliding_window", 64)])
def test_a_small_grid_splits_and_keeps_the_error_rule(stem, dtype, D):
    """B = 1, H = 8, N = 1000 in the caller's two parts: 64 q tiles of 128 rows (decode_tiles False: the automatic
    choice now takes 64-row tiles there, the next test), the last kv tile ragged. (The 48-wide window at D = 64
    then takes emit_fa3's 128 x 64 kernel, which has no parts: the caller's count is refused there,
    test_split_kv_kernel.py.)"""
    _hopper()
    g, c = _compiled(stem, dtype, 2, decode_tiles=False)
    env = bind_dims(g, {"B": 1, "H": 8, "HKV": 2, "M": 1000, "N": 1000, "D": D})
    spec = c.specialize(dtype, **env).spec
    assert spec.kv_parts == 2 and spec.block_q != 64
    assert_error_rule(g, c, env, _host(g, env, dtype, seed=D), dtype)


SMALL_PREFILL = ["plain", "relative_bias", "softcap", "gqa", "causal", "alibi", "prefix_lm", "sliding_window"]


@pytest.mark.parametrize("stem, D, dtype", [(s, d, "f16") for s in SMALL_PREFILL for d in (64, 128)]
                         + [("plain", 128, "bf16"), ("causal", 64, "bf16"), ("relative_bias", 128, "bf16")])
def test_a_small_prefill_grid_on_decodings_tiles_keeps_the_error_rule(stem, D, dtype):
    """B = 1, H = 8, N = 1000, the automatic choice: 128 q tiles of 64 rows, one consumer warpgroup, unsplit
    (emit_fa3.decode_tiles_pay), the last q and kv tiles ragged; the 48-wide window's q tiles visit 1.5 kv tiles and
    keep their tiles."""
    _hopper()
    g, c = _compiled(stem, dtype, "auto")
    env = bind_dims(g, {"B": 1, "H": 8, "HKV": 2, "M": 1000, "N": 1000, "D": D})
    spec = c.specialize(dtype, **env).spec
    assert (spec.block_q, spec.kv_parts) == ((128, 1) if stem == "sliding_window" else (64, 1))
    assert_error_rule(g, c, env, _host(g, env, dtype, seed=D + 1), dtype)


@pytest.mark.parametrize("parts", [4, 8, 16])
@pytest.mark.parametrize("stem, M, N", [("plain", 1, 8192), ("plain", 64, 5000), ("causal", 300, 1200),
                                        ("alibi", 130, 4096), ("relative_bias", 17, 3000)])
def test_decoding_shapes_and_more_parts(stem, M, N, parts):
    """A few query rows against many keys (FlashDecoding's case: one q tile a head), M != N, with the caller's
    4, 8 or 16 parts (some parts of a causal q tile visit nothing: O 0, LSE -inf, weight 0 in the merge)."""
    _hopper()
    g, c = _compiled(stem, "f16", parts)
    env = bind_dims(g, {"B": 1, "H": 4, "HKV": 1, "M": M, "N": N, "D": 128})
    assert c.specialize("f16", **env).spec.kv_parts == parts
    assert_error_rule(g, c, env, _host(g, env, "f16", seed=M + N), "f16")


@pytest.mark.parametrize("stem, M, N, want", [("plain", 128, 8192, (128, 128, 16)), ("plain", 256, 4096, (128, 128, 8)),
                                              ("causal", 256, 3000, (128, 64, 1))])
def test_a_few_rows_at_d64_split_on_the_persistent_tiles(stem, M, N, want):
    """D = 64, a few q tiles against a long cache (M = 128-256, H = 8): the persistent kernel's 128 x 128 tiles in
    parts (compiler._two_tiles_split), where 128 x 64 ran one block a q tile; causal's rows there see three kv tiles
    at most and keep 128 x 64; the error rule, M != N."""
    _hopper()
    g, c = _compiled(stem, "f16", "auto")
    env = bind_dims(g, {"B": 1, "H": 8, "M": M, "N": N, "D": 64})
    spec = c.specialize("f16", **env).spec
    assert (spec.block_q, spec.block_k, spec.kv_parts) == want
    assert_error_rule(g, c, env, _host(g, env, "f16", seed=M), "f16")


def test_the_automatic_choice_on_decoding_takes_sixteen_parts():
    _hopper()
    g, c = _compiled("plain", "f16", "auto")
    env = bind_dims(g, {"B": 1, "H": 8, "M": 1, "N": 8192, "D": 128})
    assert c.specialize("f16", **env).spec.kv_parts == 16  # 8 q tiles, 64 kv tiles
    assert_error_rule(g, c, env, _host(g, env, "f16", seed=1), "f16")


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("stem, M, N, dtype", [
    ("plain", 1, 8192, "f16"), ("plain", 64, 5000, "f16"), ("causal", 1, 3000, "f16"), ("alibi", 33, 4096, "f16"),
    ("relative_bias", 17, 3000, "f16"), ("softcap", 64, 2000, "f16"), ("gqa", 1, 4096, "f16"),
    ("prefix_lm", 20, 3000, "f16"), ("plain", 1, 8192, "bf16"), ("relative_bias", 40, 3000, "bf16"),
    ("sliding_window", 64, 3000, "f16")])
def test_decoding_tiles_keep_the_error_rule(stem, M, N, dtype, D):
    """At most 64 query rows, the automatic choice: the persistent kernel with one consumer warpgroup on 64-row q
    tiles (emit_fa3.DECODE_TILES), at D = 64 and 128 (B = 2, H = 4; GQA's HKV = 2), f16 and bf16; its q tiles in
    parts where the rows see many keys (the causal masks' and the window's rows see one or two kv tiles: one part)."""
    _hopper()
    g, c = _compiled(stem, dtype, "auto")
    env = bind_dims(g, {"B": 2, "H": 4, "HKV": 2, "M": M, "N": N, "D": D})
    kern = c.specialize(dtype, **env)
    assert kern.spec.block_q == 64
    assert (kern.spec.kv_parts > 1) == (stem in ("plain", "relative_bias", "softcap", "gqa")), kern.spec.kv_parts
    assert_error_rule(g, c, env, _host(g, env, dtype, seed=M + N + D), dtype)


@pytest.mark.parametrize("stem, M", [("plain", 1), ("plain", 7), ("plain", 8), ("plain", 9), ("plain", 17),
                                     ("plain", 63), ("causal", 8), ("softcap", 9), ("alibi", 16)])
def test_decodings_padding_rows_skip_the_softmax_and_keep_the_numbers(stem, M):
    """Decoding's warps whose 8 rows are all past M skip the softmax (emit_fa3_ws.skips_padding_softmax): row counts
    at the 8-row halves' edges, the kernel with the skip against the one without (`skip_padding` False) and both
    under the error rule; the causal rows (q >= kv) see only their first keys, the rest masked (S -inf there)."""
    _hopper()
    from falower.backends.numba_cuda.emit_fa3_ws import skips_padding_softmax

    g, c = _compiled(stem, "f16", "auto")
    _, every = _compiled(stem, "f16", "auto", skip_padding=False)
    env = bind_dims(g, {"B": 2, "H": 4, "HKV": 2, "M": M, "N": 1500, "D": 128})
    assert skips_padding_softmax(c.specialize("f16", **env).spec)
    assert not skips_padding_softmax(every.specialize("f16", **env).spec)
    dev = assert_error_rule(g, c, env, _host(g, env, "f16", seed=M), "f16")
    o_skip, lse_skip = c(*dev)
    o_all, lse_all = every(*dev)
    assert torch.isfinite(o_skip).all() and torch.isfinite(lse_skip).all()
    assert (o_skip.float() - o_all.float()).abs().max().item() <= 2e-3
    assert (lse_skip - lse_all).abs().max().item() <= 1e-4


@pytest.mark.parametrize("causal, M, N, fused", [(True, 1024, 1024, False), (False, 1, 4096, False),
                                                 (False, 1, 4096, True)])
def test_direct_numba_and_relaunch_give_the_same_numbers(monkeypatch, causal, M, N, fused):
    """The direct plan (the kernel's workspaces for the stream, the merge by cuLaunchKernel, or by the kernel itself
    on decoding's tiles where asked: fused_merge), Numba's launch path (FALOWER_DIRECT_LAUNCH=0) and the bare
    kernel's relaunch: the same O and LSE, bit for bit, call after call (the fused merge's counts carry over mod P)."""
    from falower.backends.numba_cuda import emit_fa3_ws

    _hopper()
    g, _ = graph("causal" if causal else "plain", "f16")
    c = fl.compile(g, "numba-cuda", extra={"kv_parts": 4, "cluster_merge": False,  # (a small grid: not a cluster)
                                           **({"fused_merge": True} if fused else {})})
    env = bind_dims(g, {"B": 1, "H": 8, "M": M, "N": N, "D": 128})
    kern = c.specialize("f16", **env)
    assert kern.spec.kv_parts == 4 and emit_fa3_ws.fused_merge(kern.spec) == fused
    q = torch.randn(1, 8, M, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 8, N, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    o1, lse1 = kern(q, k, v)
    launch, finish = kern.relaunch(q, k, v)
    launch()
    o2, lse2 = finish()
    monkeypatch.setenv("FALOWER_DIRECT_LAUNCH", "0")
    o3, lse3 = kern(q, k, v)
    torch.cuda.synchronize()
    for o, lse in ((o2, lse2), (o3, lse3)):
        assert torch.equal(o, o1) and torch.equal(lse, lse1)
    o4, lse4 = kern(q, k, v)  # Numba's path again (its counts, kept for stream 0, carry over)
    monkeypatch.setenv("FALOWER_DIRECT_LAUNCH", "1")
    o5, lse5 = kern(q, k, v)  # the direct plan again, after Numba's launches
    torch.cuda.synchronize()
    for o, lse in ((o4, lse4), (o5, lse5)):
        assert torch.equal(o, o1) and torch.equal(lse, lse1)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert (o1.float() - want.float()).abs().max().item() < 4e-3


def test_a_captured_split_call_replays_as_the_eager_one():
    """A split call captured into a CUDA graph (its own workspaces, kept with the graph), replayed on new inputs,
    equals the eager call on them; two graphs of it replay at once on two streams without sharing workspaces."""
    _hopper()
    g, c = _compiled("plain", "f16", "auto")
    shape = (1, 8, 1, 128), (1, 8, 8192, 128)
    assert c.specialize("f16", B=1, H=8, M=1, N=8192, D=128).spec.kv_parts == 16
    static = [torch.randn(shape[0], device="cuda", dtype=torch.float16)] + \
        [torch.randn(shape[1], device="cuda", dtype=torch.float16) for _ in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            c(*static)
    torch.cuda.current_stream().wait_stream(side)
    graphs, outs = [], []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(c(*static))
        graphs.append(graph)
    for x in static:
        x.copy_(torch.randn_like(x))
    streams = [torch.cuda.Stream() for _ in graphs]
    for graph, s in zip(graphs, streams):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            graph.replay()
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    eo, else_ = c(*static)
    torch.cuda.synchronize()
    for go, glse in outs:
        assert torch.equal(go, eo) and torch.equal(glse, else_)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype, M", [("f16", 1), ("bf16", 1), ("f16", 16), ("f16", 17), ("f16", 64), ("f16", 65)])
def test_gqa_decoding_runs_packed_and_keeps_the_error_rule(dtype, M, D):
    """GQA decoding (G = 4, B = 2, HKV = 2, N = 3000) through the packed graph (passes/pack_gqa.py: a kv head's four
    query heads as the rows of one problem) where M <= PACK_MAX_QUERY_ROWS (64: past one q tile from M = 17), as
    written at M = 65; a q whose heads do not follow its rows (a [B, M, H, D] buffer seen as [B, H, M, D]) gives the
    same numbers, bit for bit."""
    _hopper()
    g, c = _compiled("gqa", dtype, "auto")
    env = bind_dims(g, {"B": 2, "HKV": 2, "M": M, "N": 3000, "D": D})
    assert (c.packed_for(env) is not None) == (M <= 64)
    dev = assert_error_rule(g, c, env, _host(g, env, dtype, seed=M + D), dtype)
    q = dev[0].transpose(1, 2).contiguous().transpose(1, 2)
    o, lse = c(*dev)
    o2, lse2 = c(q, *dev[1:])
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


PACKED_MODS = {  # GQA graphs whose score or mask reads the query head or row: packed, both are rebuilt from the row
    "causal": dict(mask_mod=lambda b, h, q, kv: q >= kv),
    "window": dict(mask_mod=lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 48)),
    "head_mask": dict(mask_mod=lambda b, h, q, kv: (q >= kv) | (h % 2 == 0)),
    # decoding's window behind the cache's offset (set to N - M below): the kernel's tile classifier bounds r % M
    # with M's run-time size, so it visits the window's kv tiles only
    "window_offset": dict(mask_mod=lambda b, h, q, kv: (q + PACKED_OFFSET - kv >= 0)
                          & (q + PACKED_OFFSET - kv < 300)),
}
PACKED_OFFSET = fl.capture("offset", "i32", ())


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("mods", sorted(PACKED_MODS))
def test_packed_gqa_decoding_rebuilds_the_query_head_and_row(mods, M, D):
    """GQA decoding (G = 4, B = 2, HKV = 2, N = 3000) packed where the mask reads the query row (causal, the 48-wide
    window, a window behind the cache's offset) or head (h % 2): the packed graph computes h = j G + r // M and
    q_idx = r % M from the packed row r of kv head j (passes/pack_gqa.py), the kernels' tile classifier bounds them
    with M's size (from_ir._interval_fn), and the error rule holds."""
    _hopper()
    key = ("packed", mods)
    if key not in SPLIT:
        g = fl.attention(group_size=4, name=f"gqa_{mods}", **PACKED_MODS[mods])
        SPLIT[key] = (g, fl.compile(g, "numba-cuda"))
    g, c = SPLIT[key]
    env = bind_dims(g, {"B": 2, "HKV": 2, "M": M, "N": 3000, "D": D, "HS": 8})
    assert c.packed_for(env) is not None
    host = _host(g, env, "f16", seed=M + D)
    if mods == "window_offset":
        host[3] = np.array(3000 - M, dtype=np.int32)
    assert_error_rule(g, c, env, host, "f16")


@pytest.mark.parametrize("stem, dtype, D, M, N, P", [
    ("plain", "f16", 128, 1, 1024, 4), ("plain", "bf16", 64, 1, 3000, 8), ("plain", "f16", 128, 16, 3000, 8),
    ("plain", "f16", 128, 64, 1000, 2), ("plain", "f16", 64, 33, 300, 8), ("gqa", "f16", 128, 1, 3000, 8),
    ("relative_bias", "f16", 128, 17, 300, 4), ("softcap", "bf16", 128, 5, 2000, 4)])
def test_a_cluster_merges_its_q_tiles_parts(monkeypatch, stem, dtype, D, M, N, P):
    """extra cluster_merge: a q tile's P parts as the blocks of one cluster, merged after a cluster barrier
    (emit_fa3_ws.cluster_merge; runtime._cluster_launcher). The error rule holds (B = 2, H = 8); the same O and LSE
    call after call, by the bare kernel's relaunch and replayed from a CUDA graph; within rounding of the kernel
    without it (the merge kernel after it), which Numba's launch path runs (FALOWER_DIRECT_LAUNCH=0). Parts with no kv
    tile (N = 300 in 8 parts of 128-key tiles) and rows shared out over the cluster's ranks (M = 16-64) included.
    The parts' rows pushed to the ranks that merge them (cluster_push, the default) give the bits of the two
    barriers' reads (extra cluster_push False)."""
    from falower.backends.numba_cuda.emit_fa2 import cluster_parts
    from falower.backends.numba_cuda.emit_fa3_ws import cluster_push

    _hopper()
    g, c = _compiled(stem, dtype, P, cluster_merge=True)
    env = bind_dims(g, {"B": 2, "H": 8, "HKV": 2, "M": M, "N": N, "D": D})
    dev = assert_error_rule(g, c, env, _host(g, env, dtype, seed=M + N + D), dtype)
    packed = c.packed_for(env) if stem == "gqa" else None
    kc, kin = (c, tuple(dev)) if packed is None else (packed, (dev[0].reshape(2, 2, M * 4, D), *dev[1:]))
    kern = kc.kernel(*kin)
    assert cluster_parts(kern.spec) == P and kern.spec.block_q == 64, (kern.spec.kv_parts, kern.spec.block_q)
    o1, lse1 = c(*dev)
    o2, lse2 = c(*dev)
    torch.cuda.synchronize()
    assert torch.equal(o2, o1) and torch.equal(lse2, lse1)
    if 64 % P == 0:  # the parts' rows pushed to the rank that merges them, or read there after a barrier: one merge
        _, pulled = _compiled(stem, dtype, P, cluster_merge=True, cluster_push=False)
        pk = pulled if packed is None else pulled.packed_for(env)
        assert cluster_push(kern.spec) and not cluster_push(pk.kernel(*kin).spec)
        o6, lse6 = pulled(*dev)
        torch.cuda.synchronize()
        assert torch.equal(o6, o1) and torch.equal(lse6, lse1)
    if len(kin) == 3:  # no captures: the bare kernel's relaunch too
        launch, finish = kern.relaunch(*kin)
        launch()
        o3, lse3 = finish()
        torch.cuda.synchronize()
        assert torch.equal(o3.reshape(o1.shape), o1) and torch.equal(lse3.reshape(lse1.shape), lse1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        c(*dev)
    torch.cuda.current_stream().wait_stream(side)
    graph_ = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph_):
        og, lseg = c(*dev)
    graph_.replay()
    torch.cuda.synchronize()
    assert torch.equal(og, o1) and torch.equal(lseg, lse1)
    if len(kin) == 3:  # the kernel without the cluster (the merge kernel after it), by its plan and by Numba's path
        o4, lse4 = kern.without_cluster(*kin)
        monkeypatch.setenv("FALOWER_DIRECT_LAUNCH", "0")
        o5, lse5 = kern(*kin)  # (the kernel's own call asks for its plan again: none, so Numba's path)
        torch.cuda.synchronize()
        assert torch.equal(o5, o4) and torch.equal(lse5, lse4)
        o4, lse4 = o4.reshape(o1.shape), lse4.reshape(lse1.shape)
        assert (o4.float() - o1.float()).abs().max().item() <= 2e-3
        fin = torch.isfinite(lse1)
        assert torch.equal(fin, torch.isfinite(lse4)) and (lse4[fin] - lse1[fin]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("stem, D, dtype", [(s, d, "f16") for s in ("causal", "plain", "prefix_lm", "alibi",
                                                                   "relative_bias", "softcap") for d in (64, 128)]
                         + [("causal", 128, "bf16"), ("alibi", 64, "bf16")])
def test_a_small_prefill_grids_parts_merge_in_a_cluster(stem, D, dtype):
    """B = 1, H = 1, M = N = 1000, the automatic choice: 16 q tiles of 64 rows in 4 parts, 64 blocks (at most half
    the SMs: compiler._cluster_small_grid), merged in a cluster; causal's early q tiles leave parts without a kv
    tile, the last q and kv tiles ragged. The error rule holds."""
    from falower.backends.numba_cuda.emit_fa2 import cluster_parts

    _hopper()
    g, c = _compiled(stem, dtype, "auto")
    env = bind_dims(g, {"B": 1, "H": 1, "HKV": 1, "M": 1000, "N": 1000, "D": D})
    spec = c.specialize(dtype, **env).spec
    assert (spec.kv_parts, cluster_parts(spec), spec.block_q) == (4, 4, 64)
    assert_error_rule(g, c, env, _host(g, env, dtype, seed=D + 7), dtype)


@pytest.mark.parametrize("stem, dtype, D, M, N, B, P", [
    ("plain", "f16", 128, 1, 1024, 8, 2), ("plain", "bf16", 64, 1, 4096, 8, 2),
    ("softcap", "f16", 128, 7, 1000, 8, 2), ("gqa", "f16", 128, 1, 2048, 8, 2),
    ("relative_bias", "f16", 64, 3, 300, 8, 2),
    ("plain", "f16", 128, 1, 1024, 3, 4), ("gqa", "bf16", 64, 2, 2048, 3, 4), ("softcap", "bf16", 64, 16, 700, 3, 4)])
def test_decodings_parts_merge_in_a_cluster_where_the_grid_fits(stem, dtype, D, M, N, B, P):
    """Decoding at H = 8 (8 B q tiles of 64 rows), the automatic choice: B = 8 in 2 parts (128 blocks, 64 clusters
    of 2), B = 3 in 4 (96 blocks, 24 clusters of 4), at most the SMs and what the device holds at once
    (compiler._cluster_small_grid, FA2ForwardKernel.plan: the call runs the cluster kernel); N = 1000 leaves the
    last kv tile ragged, N = 300 is 3 tiles (the last ragged) in 2 parts, N = 700 6 tiles in 4 parts, GQA packed
    (its rows M G). The error rule holds."""
    from falower.backends.numba_cuda.emit_fa2 import cluster_parts

    _hopper()
    g, c = _compiled(stem, dtype, "auto")
    env = bind_dims(g, {"B": B, "H": 32 if stem == "gqa" else 8, "HKV": 8, "M": M, "N": N, "D": D})
    kern = _decoding_kernel(c, stem, dtype, env)
    assert (kern.spec.kv_parts, cluster_parts(kern.spec), kern.spec.block_q) == (P, P, 64)
    assert_error_rule(g, c, env, _host(g, env, dtype, seed=D + N + B), dtype)
    plans = [p for p in kern._plans.values() if p is not None]
    assert plans and all(p.kern is kern for p in plans)  # the clusters ran (not the merge kernel's form)


@pytest.mark.parametrize("dtype, D, M, N", [("f16", 128, 1, 3000), ("bf16", 64, 17, 1000), ("f16", 128, 64, 8192),
                                           ("f16", 64, 1, 100)])
def test_a_bias_table_decodes_on_the_persistent_kernel_in_parts(dtype, D, M, N):
    """bias[h, q, kv] at decoding's shapes (B = 2, H = 8): the persistent kernel with decoding's tiles and split-kv's
    parts (compiler._auto_choice's few_rows; 8 parts merged in a cluster), the table's rows read where the score uses
    them; the error rule holds."""
    _hopper()
    g, c = _compiled("bias", dtype, "auto")
    env = bind_dims(g, {"B": 2, "H": 8, "M": M, "N": N, "D": D})
    spec = c.specialize(dtype, **env).spec
    assert spec.block_q == 64 and (spec.kv_parts > 1) == (N > 128), spec.kv_parts
    assert_error_rule(g, c, env, _host(g, env, dtype, seed=M + N + D), dtype)


@pytest.mark.parametrize("most", [0, 7, 8])
def test_a_device_without_room_for_the_clusters_takes_the_merge_kernel(monkeypatch, most):
    """Where runtime.max_active_clusters says the device holds fewer clusters of the kernel's width at once than
    the call's grid launches (none: a MIG slice; 7 of the 8 here: a GPC short), the call takes the kernel without
    the cluster (FA2ForwardKernel.without_cluster: the merge kernel after it), its numbers those of that kernel, bit
    for bit; where it holds them all, the cluster kernel runs."""
    from falower.backends.numba_cuda import runtime
    from falower.backends.numba_cuda.emit_fa2 import cluster_parts

    _hopper()
    g, _ = graph("plain", "f16")
    c = fl.compile(g, "numba-cuda")  # its own kernel objects: the shared ones keep their plans
    q = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    kern = c.kernel(q, k, v)
    assert cluster_parts(kern.spec) == 8 and not kern._cluster_fit and kern.grid_clusters(1, 8, 1, 1024) == 8
    monkeypatch.setattr(runtime, "max_active_clusters", lambda *a: most)
    o, lse = c(q, k, v)
    o2, lse2 = kern.without_cluster(q, k, v)
    torch.cuda.synchronize()
    assert list(kern._cluster_fit.values()) == [most]
    assert [p.kern for p in kern._plans.values()] == [kern if most == 8 else kern.without_cluster]
    if most < 8:
        assert torch.equal(o, o2) and torch.equal(lse, lse2)
    else:  # (the cluster's merge and the merge kernel's: the same rule, not the same bits)
        assert (o.float() - o2.float()).abs().max().item() < 1e-3


@pytest.mark.parametrize("D", [64, 128])
def test_the_probe_holds_as_many_clusters_as_decodings_kernels(D):
    """runtime.device_clusters_held asks the driver about a kernel that does nothing (before any real kernel
    exists, for the part count); its counts must be those of decoding's own cluster kernels, which the plan holds
    the grid to (FA2ForwardKernel.device_clusters), at every width they take."""
    from falower.backends.numba_cuda import runtime

    _hopper()
    g, _ = graph("plain", "f16")
    for width in (2, 4, 8):
        c = fl.compile(g, "numba-cuda", extra={"kv_parts": width, "cluster_merge": True})
        kern = c.specialize("f16", B=1, H=8, M=1, N=width * 128, D=D)
        held = runtime.device_clusters_held(width)
        assert held and held == kern.device_clusters(torch.cuda.current_device()), (width, held)


@pytest.mark.parametrize("stem, dtype, D, N", [("plain", "f16", 128, 1024), ("plain", "bf16", 64, 1000),
                                               ("gqa", "f16", 128, 2000), ("plain", "f16", 64, 2048),
                                               ("plain", "f16", 128, 4096)])
def test_decoding_takes_fewer_parts_where_the_device_holds_too_few_clusters(stem, dtype, D, N):
    """B = 2, H = 8 decoding (16 q tiles): 8 parts of one tile make 16 clusters of 8, and where the device holds
    fewer at once (the H200: 15) a cache up to emit_fa3.KV_FEWER_PARTS_MAX_KEYS takes 4 parts in clusters of 4
    (compiler._fewer_parts_held) and the call runs them; a longer one keeps 8 parts (the plan's merge kernel).
    Where the device holds all 16, 8 parts in their clusters. The error rule holds."""
    from falower.backends.numba_cuda import emit_fa3, runtime
    from falower.backends.numba_cuda.emit_fa2 import cluster_parts

    _hopper()
    g, c = _compiled(stem, dtype, "auto")
    env = bind_dims(g, {"B": 2, "H": 32 if stem == "gqa" else 8, "HKV": 8, "M": 1, "N": N, "D": D})
    kern = _decoding_kernel(c, stem, dtype, env)
    held8, held4 = runtime.device_clusters_held(8) or 0, runtime.device_clusters_held(4) or 0
    fewer = held8 < 16 <= held4 and N <= emit_fa3.KV_FEWER_PARTS_MAX_KEYS[D]
    assert (kern.spec.kv_parts, cluster_parts(kern.spec)) == ((4, 4) if fewer else (8, 8))
    assert_error_rule(g, c, env, _host(g, env, dtype, seed=D + N), dtype)
    plans = [p for p in kern._plans.values() if p is not None]
    ran = kern if fewer or held8 >= 16 else kern.without_cluster
    assert plans and all(p.kern is ran for p in plans)
