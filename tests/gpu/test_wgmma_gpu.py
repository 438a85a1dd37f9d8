"""The Hopper wgmma path on the GPU (marked gpu; needs compute capability 9.0): the probe's wgmma forms against
torch, and the wgmma forward through the public API (`extra={"schedule": "wgmma"}`, issue 11) within
FlashAttention's error rule, on strided GQA views, with and without the softmax/P V overlap."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402


def _hopper() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


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
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_examples_gpu import assert_error_rule, rounded

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
