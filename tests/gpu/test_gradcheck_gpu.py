"""torch.autograd.gradcheck through falower's kernels (marked gpu): f64 inputs take the SIMT path, which runs
forward and backward in double precision, so finite differences of the forward kernel check the backward
kernels' gradients, captured tables' included."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402


def _graphs():
    slopes = fl.capture("slopes", "f64", "H")
    bias = fl.capture("rel", "f64", "H,M,N")
    return {
        "causal": (fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal64", dtype="f64"), []),
        "alibi": (fl.attention(score_mod=lambda s, b, h, q, kv: s + slopes[h] * (kv - q),
                               mask_mod=lambda b, h, q, kv: q >= kv, name="alibi64", dtype="f64"), ["H"]),
        "bias_softcap": (fl.attention(score_mod=lambda s, b, h, q, kv: 5.0 * fl.tanh((s + bias[h, q, kv]) / 5.0),
                                      name="softcap64", dtype="f64"), ["H,M,N"]),
        "gqa": (fl.attention(group_size=2, name="gqa64", dtype="f64"), []),
    }


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", ["causal", "alibi", "bias_softcap", "gqa"])
def test_gradcheck(name: str, deterministic: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g, caps = _graphs()[name]
    c = fl.compile(g, "numba-cuda", deterministic=deterministic)
    torch.manual_seed(0)
    B, H, M, N, D = 1, 2, 9, 7, 16
    Hk = H // 2 if name == "gqa" else H
    q = torch.randn(B, H, M, D, device="cuda", dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hk, N, D, device="cuda", dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hk, N, D, device="cuda", dtype=torch.float64, requires_grad=True)
    extra = []
    for shape in caps:
        dims = {"H": H, "M": M, "N": N}
        size = [dims[d] for d in shape.split(",")]
        extra.append((torch.rand(*size, device="cuda", dtype=torch.float64) * -0.5).requires_grad_())
    assert torch.autograd.gradcheck(lambda *xs: c(*xs)[0], (q, k, v, *extra))
    assert c.backward_kernel(q, k, v, *extra).spec.path == "simt"
