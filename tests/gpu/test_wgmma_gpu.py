"""The Hopper wgmma path on the GPU (marked gpu; needs compute capability 9.0): the probe's wgmma forms against
torch, and the wgmma forward through the public API (`extra={"schedule": "wgmma"}`, issue 11) within
FlashAttention's error rule, on strided GQA views, with and without the softmax/P V overlap."""

from __future__ import annotations

import math
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
    _hopper()
    tdt = torch.float16 if dtype == "f16" else torch.bfloat16
    g = fl.attention(mask_mod=(lambda b, h, q, kv: q >= kv) if causal else None, name="wgmma", dtype=dtype,
                     group_size=2)
    c = fl.compile(g, extra={"schedule": "wgmma", "overlap": overlap})
    torch.manual_seed(0)
    B, N, H, Hk = 2, 1000, 8, 4
    q = torch.randn(B, N, H, D, device="cuda", dtype=tdt).transpose(1, 2)
    k = torch.randn(B, N, Hk, D, device="cuda", dtype=tdt).transpose(1, 2)
    v = torch.randn(B, N, Hk, D, device="cuda", dtype=tdt).transpose(1, 2)
    o, lse = c.forward(q, k, v)
    kr, vr = (x.repeat_interleave(2, dim=1) for x in (k, v))
    s = (q.double() @ kr.double().transpose(-1, -2)) / math.sqrt(D)
    if causal:
        s = s.masked_fill(torch.ones(N, N, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ vr.double()
    sl = (q @ kr.transpose(-1, -2)) * (1 / math.sqrt(D))
    if causal:
        sl = sl.masked_fill(torch.ones(N, N, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    naive = torch.softmax(sl.float(), -1).to(tdt) @ vr
    err = (o.double() - ref).abs().max().item()
    nerr = (naive.double() - ref).abs().max().item()
    assert err <= 2 * nerr + 1e-5, (err, nerr)
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max().item() < 1e-3
