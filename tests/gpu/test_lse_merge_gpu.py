"""The LSE merge kernel on the GPU (marked gpu): attention over a row's keys split into parts, each part's O and
LSE by torch in float64, merged by falower.lse_merge, against the attention over all the keys at once: the merge a
context-parallel forward runs after gathering its ranks' parts, on torch tensors."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402


def _attention(q, k, v, keep):
    """O and LSE in float64 over the keys `keep` keeps; a row that keeps none gets O = 0, LSE = -inf."""
    s = (q @ k.transpose(-1, -2)).masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.nan_to_num(p @ v), lse


@pytest.mark.parametrize("parts, out", [(2, "f16"), (4, "bf16"), (3, "f32")])
def test_merged_parts_are_attention_over_all_keys(parts: int, out: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(parts)
    B, H, M, N, D = 2, 3, 129, 1000, 128
    q = torch.randn(B, H, M, D, device="cuda", dtype=torch.float64) / math.sqrt(D)
    k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float64) for _ in range(2))
    keep = torch.ones(M, N, dtype=torch.bool, device="cuda")
    keep[0, : N // parts] = False  # the first part sees no key in row 0
    keep[5] = False  # a row no part sees
    bounds = [round(i * N / parts) for i in range(parts + 1)]
    o_parts, lse_parts = [], []
    for a, z in zip(bounds, bounds[1:]):
        o_p, lse_p = _attention(q, k[:, :, a:z], v[:, :, a:z], keep[:, a:z])
        o_parts.append(o_p)
        lse_parts.append(lse_p)
    o, lse = fl.lse_merge(torch.stack(o_parts).float(), torch.stack(lse_parts).float(), out)
    want_o, want_lse = _attention(q, k, v, keep)
    tdt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[out]
    assert o.dtype == tdt and o.shape == (B, H, M, D) and lse.shape == (B, H, M) and o.device == q.device
    tol = {"f16": 2e-3, "bf16": 1.6e-2, "f32": 1e-5}[out]
    assert ((o.double() - want_o).abs() / (1 + want_o.abs())).max().item() <= tol
    fin = torch.isfinite(want_lse)
    assert (lse.double()[fin] - want_lse[fin]).abs().max().item() <= 1e-5
    assert torch.isneginf(lse[:, :, 5]).all() and (o[:, :, 5] == 0).all() and not torch.isnan(o.float()).any()
