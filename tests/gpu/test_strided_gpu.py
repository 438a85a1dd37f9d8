"""Strided q, k, v, dO on the GPU (marked gpu): [B, H, N, D] views of a model's [B, N, H, D] projections run
through the kernels by their strides, no copy, with the contiguous run's results."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402


@pytest.mark.parametrize("causal, dtype, D", [(True, "f16", 64), (False, "bf16", 128)])
def test_transposed_views_match_contiguous(causal: bool, dtype: str, D: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tdt = torch.float16 if dtype == "f16" else torch.bfloat16
    g = fl.attention(mask_mod=(lambda b, h, q, kv: q >= kv) if causal else None, name="strided", dtype=dtype,
                     group_size=2)
    c = fl.compile(g)
    torch.manual_seed(0)
    B, N, H, Hk = 2, 1000, 8, 4
    q = torch.randn(B, N, H, D, device="cuda", dtype=tdt).transpose(1, 2)
    k = torch.randn(B, N, Hk, D, device="cuda", dtype=tdt).transpose(1, 2)
    v = torch.randn(B, N, Hk, D, device="cuda", dtype=tdt).transpose(1, 2)
    do = torch.randn(B, N, H, D, device="cuda", dtype=tdt).transpose(1, 2)
    assert not q.is_contiguous()
    o, lse = c.forward(q, k, v)
    o2, lse2 = c.forward(q.contiguous(), k.contiguous(), v.contiguous())
    assert o.is_contiguous() and torch.equal(o, o2) and torch.equal(lse, lse2)
    g1 = c.backward(q, k, v, o, lse, do)
    g2 = c.backward(q.contiguous(), k.contiguous(), v.contiguous(), o, lse, do.contiguous())
    assert torch.equal(g1[1], g2[1]) and torch.equal(g1[2], g2[2])  # dK, dV: no atomics, the same bits
    assert (g1[0].float() - g2[0].float()).abs().max().item() <= 1e-2  # dQ: f32 atomic adds in any order
    # through autograd, the views are not copied: the gradients come back in the views' shape
    qa, ka, va = (x.detach().requires_grad_() for x in (q, k, v))
    oa, _ = c(qa, ka, va)
    oa.backward(do)
    assert torch.equal(oa, o) and torch.equal(ka.grad, g1[1])
