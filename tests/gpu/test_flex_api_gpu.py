"""falower.flex_attention against torch.nn.attention.flex_attention.flex_attention on CUDA fp16, for the
FlexAttention-documentation and attention-gym mods of tests/flex_mods.py (causal, ALiBi, softcap, sliding
window, prefix-LM, document masking, relative bias, NATTEN, sin-based, GQA): both are checked against a
float64 math reference of the same mods, falower's error at most twice torch's plus a small floor (the
FlashAttention criterion), and the warm call does not trace again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/flex_mods.py

import falower as fl  # noqa: E402
from falower import torch_mods  # noqa: E402
from flex_mods import make_cases, math_reference  # noqa: E402

B, H, D = 2, 4, 64
N = 300  # ragged against every tile size


def _cases():
    if not torch.cuda.is_available():
        return {}
    return {c.name: c for c in make_cases(B, H, N, "cuda")}


CASES = _cases()


def _errors(case, dtype):
    n = case.N
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, n, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, H // case.group, n, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, H // case.group, n, D, device="cuda", dtype=dtype, generator=g)
    ref, _ = math_reference(q.double(), k.double(), v.double(), case.score_mod, case.mask_mod, group=case.group)
    kw = dict(score_mod=case.score_mod, enable_gqa=case.group > 1)
    bm_fl = fl.create_block_mask(case.mask_mod, B, H, n, n, device="cuda") if case.mask_mod else None
    bm_t = flex.create_block_mask(case.mask_mod, B, H, n, n, device="cuda") if case.mask_mod else None
    out_fl = fl.flex_attention(q, k, v, block_mask=bm_fl, **kw)
    out_t = flex.flex_attention(q, k, v, block_mask=bm_t, **kw)
    torch.cuda.synchronize()
    return (out_fl.double() - ref).abs().max().item(), (out_t.double() - ref).abs().max().item(), out_fl, q


@pytest.mark.parametrize("name", sorted(CASES) or ["none"])
def test_matches_torch_flex_attention_fp16(name):
    if name not in CASES:
        pytest.skip("no CUDA device")
    case = CASES[name]
    err_fl, err_t, out, q = _errors(case, torch.float16)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert err_fl <= 2 * err_t + 2e-3, f"{name}: falower error {err_fl:.2e}, torch flex_attention {err_t:.2e}"


def test_warm_call_does_not_trace_again():
    if not CASES:
        pytest.skip("no CUDA device")
    case = CASES["softcap"]
    _errors(case, torch.float16)
    traces = torch_mods.stats["traces"]
    _errors(case, torch.float16)
    assert torch_mods.stats["traces"] == traces


def test_backward_matches_torch_flex_attention():
    if not CASES:
        pytest.skip("no CUDA device")
    case = CASES["alibi"]
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    do = torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=g)
    grads = {}
    for lib in (fl, flex):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        bm = lib.create_block_mask(case.mask_mod, B, H, N, N, device="cuda")
        lib.flex_attention(qq, kk, vv, score_mod=case.score_mod, block_mask=bm).backward(do)
        grads[lib] = (qq.grad, kk.grad, vv.grad)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    math_reference(qd, kd, vd, case.score_mod, case.mask_mod)[0].backward(do.double())
    for got, theirs, want in zip(grads[fl], grads[flex], (qd.grad, kd.grad, vd.grad)):
        e_fl = (got.double() - want).abs().max().item()
        e_t = (theirs.double() - want).abs().max().item()
        assert e_fl <= 3 * e_t + 2e-3, f"falower gradient error {e_fl:.2e}, torch flex_attention {e_t:.2e}"


@pytest.mark.parametrize("D", [64, 128])
def test_a_loss_of_the_lse_has_its_gradient(D: int):
    """flex_attention(return_lse=True) with a loss reading the lse (a z-loss): the kernels' gradients with the LSE's
    cotangent (Delta - dlse, passes/lse_cotangent.py) against float64 autograd of the math, within 3x torch
    flex_attention's error (or 2e-3 of the gradient's scale where torch's flex cannot differentiate its lse)."""
    if not CASES:
        pytest.skip("no CUDA device")
    case = CASES["alibi"]
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    do = torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=g)
    dl = torch.randn(B, H, N, device="cuda", dtype=torch.float32, generator=g)
    grads = {}
    for lib in (fl, flex):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        bm = lib.create_block_mask(case.mask_mod, B, H, N, N, device="cuda")
        try:
            o, lse = lib.flex_attention(qq, kk, vv, score_mod=case.score_mod, block_mask=bm, return_lse=True)
            ((o.float() * do.float()).sum() + (lse * dl).sum() + 0.01 * (lse * lse).sum()).backward()
        except Exception:
            assert lib is flex
            continue
        grads[lib] = (qq.grad, kk.grad)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = math_reference(qd, kd, vd, case.score_mod, case.mask_mod)
    ((o * do.double()).sum() + (lse * dl.double()).sum() + 0.01 * (lse * lse).sum()).backward()
    for i, want in enumerate((qd.grad, kd.grad)):
        e_fl = (grads[fl][i].double() - want).abs().max().item()
        bound = 3 * (grads[flex][i].double() - want).abs().max().item() + 2e-3 if flex in grads \
            else 2e-3 * max(1.0, want.abs().max().item())
        assert e_fl <= bound, f"falower gradient error {e_fl:.2e} against {bound:.2e}"
