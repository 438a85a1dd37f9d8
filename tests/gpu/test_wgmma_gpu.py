"""The Hopper wgmma path on the GPU (marked gpu; needs compute capability 9.0): the probe's wgmma forms against
torch; every example through falower.compile's automatic choice (emit_fa3.auto_extra: the warp-specialized kernel,
persistent where it pays, at D = 128 and at D = 64 on 192-row tiles, 128-row ones on a small grid; emit_fa3's
kernel elsewhere) within FlashAttention's error rule, at a ragged N and at a multiple of the tiles,
with the kernel it ran checked against the rule; the examples the rule keeps on mma.sync (block lists at
D = 128) forced onto wgmma (`extra={"schedule": "wgmma"}`); and strided
GQA views with and without the softmax/P V overlap.

Run: python -m pytest -q -n 14 --dist load -m gpu tests/gpu/test_wgmma_gpu.py (kernels compile in the workers;
pyproject's --dist loadfile would run them one at a time)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402


def _hopper() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_examples_gpu import STEMS, assert_error_rule, graph, rounded  # noqa: E402


def _inputs(g, D: int, N: int, dtype: str, M: int = 0):
    from falower.passes.check import bind_dims, random_inputs

    env = bind_dims(g, {"B": 2, "H": 4, "HKV": 1, "M": M or N, "N": N, "D": D})
    raw = random_inputs(g, env, seed=N + D)
    return env, [rounded(x, dtype) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
                 for i, x in enumerate(raw)]


@pytest.mark.parametrize("N", [256, 1000, 2048])  # a multiple of 128; ragged; long (D = 64's persistent kernel)
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("stem", STEMS)
def test_example_automatic_choice(stem: str, D: int, dtype: str, N: int) -> None:
    """falower.compile(graph) as a user calls it: the kernel the rule names for the call's sizes (at D = 64 the
    192-row tiles where their work at those lengths pays, and on this test's small grid the same kernel's 128-row
    tiles: compiler._d64_tiling; on a grid small enough that twice its q tiles fill SMs 128-row ones would leave
    idle, decoding's 64-row tiles, one consumer warpgroup: compiler._decode_tiles), within the error rule."""
    _hopper()
    from falower.backends.numba_cuda import emit_fa3, runtime
    from falower.backends.numba_cuda.from_ir import reads_table_tile

    g, c = graph(stem, dtype)
    env, host = _inputs(g, D, N, dtype)
    kern = c.specialize(dtype, **env)  # the kernel a call of these sizes runs (c.kernel's, without torch inputs)
    mask = c.analysis.block_mask if c.analysis.conj else "none"
    tile = reads_table_tile(c.analysis)  # a bias[h, q, kv]: the ws kernel at D = 64 too
    want = emit_fa3.auto_extra(dtype, D, mask, (9, 0), table_tile=tile,  # FALOWER_WGMMA=0/1 in the env applies
                               sm_count=runtime.device_sm_count())
    if want and want.get("persistent") and kern.spec.extra == emit_fa3.WS_EXTRA:  # the persistent form refused
        import dataclasses

        from falower.backends.numba_cuda import emit_fa3_ws

        assert not emit_fa3_ws.persistent_pays(dataclasses.replace(kern.spec, extra=want)), stem
        want = dict(emit_fa3.WS_EXTRA)
    tiling = "decode" if want and want.get("persistent") and c._decode_tiles(dtype, "mma", env) else None
    if tiling == "decode":  # (the fiftieth session's small prefill grids: B = 2, H = 4 at N = 256-1000 here)
        from falower.backends.numba_cuda import emit_fa3_ws

        assert emit_fa3_ws.consumer_wgs(kern.spec) == 1 and kern.spec.extra.get("persistent"), (stem, N)
    elif want and want.get("persistent") and D == 64:
        tiling = c._d64_tiling(dtype, "mma", env)  # the per-size choice: 192-row tiles where their work pays,
        # 128-row ones on a small grid (this test's B = 2, H = 4)
        assert tiling is not None and bool(kern.spec.extra.get("persistent")) == (tiling != "narrow"), (
            stem, N, tiling, kern.spec.extra)
        if tiling == "narrow":  # a narrow window, short causal, a short sequence: emit_fa3's kernel
            want = emit_fa3.plain_extra(D, mask)
        elif tiling == "wide":  # the short q tile first under causal-like masks (where the cost model counts less)
            assert kern.spec.ragged_q_first == (stem in ("causal", "prefix_lm", "alibi")), (stem, N)
        else:  # two consumer warpgroups on 128 x 128 tiles: square tiles count no less work with the short one first
            from falower.backends.numba_cuda import emit_fa3_ws

            assert emit_fa3_ws.consumer_wgs(kern.spec) == 2 and not kern.spec.ragged_q_first, (stem, N)
    assert kern.spec.extra.get("schedule") == (want or {}).get("schedule"), (kern.spec.extra, want)
    if want:
        assert (kern.spec.block_q, kern.spec.block_k) == emit_fa3.tiles(
            D, mask, tile and want.get("schedule") == "wgmma-ws", persistent=bool(want.get("persistent")),
            two=tiling == "two", decode=tiling == "decode")
        assert {k: kern.spec.extra.get(k) for k in want} == want
    assert_error_rule(g, c, env, host, dtype)


@pytest.mark.parametrize("M, N", [(1000, 1000), (1100, 1500), (2000, 1100), (3001, 3001), (1537, 2048)])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("stem", ["causal", "prefix_lm", "alibi"])
def test_short_q_tile_first(stem: str, dtype: str, M: int, N: int) -> None:
    """D = 64's 192-row tiles with the short q tile first (tile{ragged_q=first}, the automatic choice under
    causal-like masks): rows before 0 zeros by the TMA loads and clipped by the TMA stores (a warp's box straddles
    row 0 where q_pad is not a multiple of 16: M = 1000, 1100, 3001, 1537), within FlashAttention's error rule,
    M != N both ways."""
    _hopper()
    g, _ = graph(stem, dtype)
    c = fl.compile(g, "numba-cuda", extra={"small_grid": False})  # this test's B = 2, H = 4 would take 128 rows
    env, host = _inputs(g, 64, N, dtype, M)
    kern = c.specialize(dtype, **env)
    assert kern.spec.block_q == 192 and kern.spec.ragged_q_first, (stem, M, N, kern.spec.extra)
    assert_error_rule(g, c, env, host, dtype)


_FORCED: dict = {}


@pytest.mark.parametrize("N", [256, 1000])
@pytest.mark.parametrize("stem", STEMS)
def test_example_forced_wgmma_d128(stem: str, N: int) -> None:
    """The plain wgmma kernel (emit_fa3) where the rule takes the warp-specialized one at D = 128 (no mask,
    static masks, block lists): asked for, it runs them within the error rule too (it is the fallback)."""
    _hopper()
    from falower.backends.numba_cuda import emit_fa3, runtime

    g, auto = graph(stem, "f16")
    mask = auto.analysis.block_mask if auto.analysis.conj else "none"
    if (emit_fa3.auto_extra("f16", 128, mask, (9, 0)) or {}).get("schedule") == "wgmma":
        pytest.skip("the automatic choice already runs this kernel here (test_example_automatic_choice)")
    if stem not in _FORCED:
        _FORCED[stem] = fl.compile(g, extra={"schedule": "wgmma"})
    c = _FORCED[stem]
    assert c.specialize("f16", D=128).spec.extra["schedule"] == "wgmma"
    env, host = _inputs(g, 128, N, "f16")
    assert_error_rule(g, c, env, host, "f16")


_R128: dict = {}


@pytest.mark.parametrize("N", [256, 1000])
@pytest.mark.parametrize("stem", STEMS)
def test_example_wg_rows_128_d64(stem: str, N: int) -> None:
    """emit_fa3 with one warpgroup per 128 rows (extra wg_rows=128: two 64-row halves a thread) on every example
    at D = 64, within the error rule."""
    _hopper()
    g, _ = graph(stem, "f16")
    if stem not in _R128:
        _R128[stem] = fl.compile(g, extra={"schedule": "wgmma", "wg_rows": 128})
    c = _R128[stem]
    spec = c.specialize("f16", D=64).spec
    assert (spec.extra["schedule"], spec.extra["wg_rows"], spec.block_q) == ("wgmma", 128, 128), spec.extra
    env, host = _inputs(g, 64, N, "f16")
    assert_error_rule(g, c, env, host, "f16")


def test_probe_forms() -> None:
    _hopper()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import probe_wgmma

    res = probe_wgmma.run_gpu(1024, [])
    for r in res:
        if r["case"].startswith(("ss_", "rs_")):
            assert r["ok"] == (not r["case"].endswith("swap1")), r  # the swapped MN-major descriptor must fail


@pytest.mark.parametrize("causal, dtype, D, overlap", [(True, "f16", 64, False), (True, "f16", 64, True),
                                                       (False, "bf16", 128, True)])
def test_wgmma_forward_error_rule(causal: bool, dtype: str, D: int, overlap: bool) -> None:
    """The project's error rule (tests/gpu/test_examples_gpu.py: naive attention with every float rounded to the
    input dtype) on the API path; then strided GQA views give the contiguous run's bits."""
    _hopper()
    from falower.passes.check import bind_dims, random_inputs

    g = fl.attention(mask_mod=(lambda b, h, q, kv: q >= kv) if causal else None, name="wgmma", dtype=dtype,
                     group_size=2)
    c = fl.compile(g, extra={"schedule": "wgmma", "overlap": overlap})
    for N in (17, 1000):
        env = bind_dims(g, {"B": 2, "H": 4, "HKV": 2, "M": N, "N": N, "D": D})
        host = [rounded(x, dtype) for x in random_inputs(g, env, seed=N + D)]
        assert_error_rule(g, c, env, host, dtype)
    tdt = torch.float16 if dtype == "f16" else torch.bfloat16
    B, N, H, Hk = 2, 1000, 8, 4
    q = torch.randn(B, N, H, D, device="cuda", dtype=tdt).transpose(1, 2)
    k = torch.randn(B, N, Hk, D, device="cuda", dtype=tdt).transpose(1, 2)
    v = torch.randn(B, N, Hk, D, device="cuda", dtype=tdt).transpose(1, 2)
    o, lse = c.forward(q, k, v)
    o2, lse2 = c.forward(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
