"""torch autograd through falower (falower.autograd) on the CPU, with the reference backend.

The reference backend runs the same lowered forward (fa2-fwd) and backward (fa2-bwd) IR in the numpy
interpreter, so the autograd plumbing (saving o and lse, mapping gradients to captures by name, dtypes,
None for what has no gradient) is tested here without a GPU. Needs torch (skipped without it, as on CI).

Two precisions: the reference backend's own ("native": f16 values, f32 accumulation), and float64 (the
interpreter at precision f64, patched in) for comparisons with torch's float64 autograd and gradcheck.
"""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402
import falower.compiler as compiler_module  # noqa: E402
from falower.ir import Func  # noqa: E402
from falower.ir.interp import Interpreter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEMS = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
_COMPILED: dict = {}


def example(stem: str, dtype: str = "f16") -> Func:
    g = next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, Func))
    if dtype != "f16":  # traced in f16: retrace the text (as tests/gpu/test_examples_gpu.py does for bf16)
        g = fl.parse_func(fl.print_func(g).replace("f16[", f"{dtype}[").replace('"f16"', f'"{dtype}"'))
    return g


def compiled(stem: str, dtype: str = "f16"):
    """One compiled reference per example: the backward pipeline is lowered once and reused."""
    key = (stem, dtype)
    if key not in _COMPILED:
        _COMPILED[key] = fl.compile(example(stem, dtype), "reference")
    return _COMPILED[key]


@pytest.fixture
def float64_interpreter(monkeypatch):
    """The reference backend computing every value in float64 (its own precision is the graph's dtypes),
    so that gradients can be held to float64 tolerances."""
    monkeypatch.setattr(compiler_module, "Interpreter", lambda precision="f64": Interpreter("f64"))


def inputs(c, B=2, H=2, M=37, N=37, D=16, dtype=torch.float16, seed=0) -> list:
    """Random torch CPU inputs for `c`'s graph: q, k, v in `dtype`, float captures as their declared dtype
    (float64 when `dtype` is), document ids sorted with a tail of -1 (fully masked rows)."""
    env = {"B": B, "H": H, "HKV": max(1, H // 4), "M": M, "N": N, "D": D}
    gen = torch.Generator().manual_seed(seed)
    out = []
    for a in c.func.args:
        shape = a.type.concrete(env)
        if a.type.dtype in ("f16", "bf16", "f32", "f64"):
            want = dtype if a.name in ("q", "k", "v") or dtype == torch.float64 else torch.float32
            scale = 0.5 if a.name not in ("q", "k", "v") else 1.0
            out.append((scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(want))
        else:
            ids = torch.sort(torch.randint(0, 3, shape, generator=gen), dim=-1).values
            ids[..., -max(1, shape[-1] // 8):] = -1
            out.append(ids.to(torch.int32))
    return out


def leaves(xs: list) -> list:
    return [x.clone().requires_grad_(True) if x.is_floating_point() else x for x in xs]


# -------------------------------------------------------------------------- autograd == c.backward
@pytest.mark.parametrize("stem", STEMS)
def test_autograd_gradients_are_backward_results(stem: str) -> None:
    """loss.backward() through c(...) gives exactly c.backward's gradients, each on its own input (by name),
    in the input's dtype and shape; integer captures get none; lse is differentiable (FlexAttention's is)."""
    c = compiled(stem)
    xs = leaves(inputs(c, H=4 if stem == "gqa" else 2))
    o, lse = c(*xs)
    assert o.requires_grad and lse.requires_grad
    lse = lse.detach()
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(o.dtype)
    o.backward(do)
    want = c.backward(*xs[:3], o.detach(), lse, do, *xs[3:])
    names = c.gradient_names()
    assert names[:3] == ["dq", "dk", "dv"] and len(want) == len(names)
    by_name = dict(zip(names, want))
    for a, x in zip(c.func.args, xs):
        if not x.is_floating_point():
            assert x.grad is None and "d" + a.name not in by_name
            continue
        assert x.grad is not None and x.grad.dtype == x.dtype and x.grad.shape == x.shape, a.name
        np.testing.assert_array_equal(x.grad.float().numpy(), np.asarray(by_name["d" + a.name], dtype=np.float32))
        assert torch.isfinite(x.grad).all()


def test_fully_masked_rows_get_zero_dq() -> None:
    c = compiled("document")
    xs = leaves(inputs(c))
    o, _ = c(*xs)
    o.float().square().sum().backward()
    padded = xs[3] < 0  # [B, N]: rows of q whose document id is -1 attend to nothing
    assert padded.any()
    assert torch.all(xs[0].grad[padded.unsqueeze(1).expand(-1, xs[0].shape[1], -1)] == 0)
    assert torch.all(o.detach()[padded.unsqueeze(1).expand(-1, o.shape[1], -1)] == 0)


def test_only_what_requires_grad_gets_a_gradient() -> None:
    c = compiled("alibi")
    q, k, v, slopes = inputs(c)
    v.requires_grad_(True)
    o, _ = c(q, k, v, slopes)
    o.float().sum().backward()
    assert v.grad is not None and q.grad is None and k.grad is None and slopes.grad is None
    slopes.requires_grad_(True)
    o, _ = c(q, k, v, slopes)
    o.float().sum().backward()
    assert slopes.grad is not None and slopes.grad.dtype == torch.float32 and slopes.grad.abs().sum() > 0


def test_without_grad_the_call_is_the_plain_forward() -> None:
    c = compiled("causal")
    xs = inputs(c)
    o0, lse0 = c(*xs)  # nothing requires grad: numpy out, as forward()
    assert isinstance(o0, np.ndarray)
    with torch.no_grad():
        o1, _ = c(*leaves(xs))
    assert isinstance(o1, np.ndarray)
    o2, lse2 = c(*leaves(xs))
    assert torch.is_tensor(o2) and o2.grad_fn is not None
    np.testing.assert_array_equal(o2.detach().numpy(), o0)
    np.testing.assert_array_equal(lse2.detach().numpy(), lse0)  # (lse is differentiable: detach, as in torch)


def test_strided_inputs_and_strided_cotangent() -> None:
    """q, k, v as a model makes them (a transpose of [B, N, H, D]) and the cotangent of o.sum() (a broadcast,
    stride 0): the kernels take row-major buffers, autograd copies where needed."""
    c = compiled("causal")
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in inputs(c))
    assert not q.is_contiguous()
    xs = leaves([q, k, v])
    o, _ = c(*xs)
    o.sum().backward()
    ys = leaves([x.detach().contiguous() for x in (q, k, v)])
    o2, _ = c(*ys)
    o2.backward(torch.ones_like(o2))
    for x, y in zip(xs, ys):
        assert x.grad.shape == x.shape
        assert torch.equal(x.grad, y.grad)


def test_bf16_inputs_come_back_as_bf16() -> None:
    """The reference backend computes bf16 in float32 (numpy has no bf16): outputs and gradients are bf16
    tensors again."""
    c = compiled("alibi", "bf16")
    xs = leaves(inputs(c, dtype=torch.bfloat16))
    o, lse = c(*xs)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    o.float().sum().backward()
    assert xs[0].grad.dtype == torch.bfloat16 and xs[3].grad.dtype == torch.float32
    assert all(torch.isfinite(x.grad).all() for x in xs)


def test_double_backward_is_refused() -> None:
    c = compiled("causal")
    xs = leaves(inputs(c, M=5, N=5, D=4))
    o, _ = c(*xs)
    (gq,) = torch.autograd.grad(o.float().sum(), xs[0], create_graph=True)
    with pytest.raises(RuntimeError):
        gq.float().sum().backward()


# ----------------------------------------------------------------- against torch's float64 autograd
def naive_attention(q, k, v, slopes=None, causal=True):
    """softmax(q k^T / sqrt(D) + slopes[h] * (kv - q), causal) @ v in torch, for autograd to differentiate."""
    M, N, D = q.shape[-2], k.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    dist = (torch.arange(N)[None, :] - torch.arange(M)[:, None]).to(s.dtype)
    if slopes is not None:
        s = s + slopes.to(s.dtype)[None, :, None, None] * dist
    if causal:
        s = s.masked_fill(dist > 0, -math.inf)
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("stem", ["causal", "alibi"])
def test_gradients_match_torch_float64_autograd(stem: str, float64_interpreter) -> None:
    c = fl.compile(example(stem), "reference")
    xs = leaves(inputs(c, M=37, N=37, dtype=torch.float64))
    ys = leaves([x.detach().clone() for x in xs])
    o, _ = c(*xs)
    do = torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    o.backward(do)
    want = naive_attention(*ys)
    want.backward(do)
    torch.testing.assert_close(o.detach(), want.detach(), rtol=1e-10, atol=1e-10)
    for x, y in zip(xs, ys):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("stem", ["causal", "alibi"])
def test_native_precision_gradients_are_close_to_float64(stem: str) -> None:
    """The reference backend in its own precision (f16 storage, f32 accumulation) against torch's float64
    gradients on the same (f16-rounded) inputs: within f16 rounding."""
    c = compiled(stem)
    xs = leaves(inputs(c, M=64, N=64))
    ys = leaves([x.detach().double() for x in xs])
    o, _ = c(*xs)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3)).to(o.dtype)
    o.backward(do)
    naive_attention(*ys).backward(do.double())
    for x, y in zip(xs, ys):
        err = (x.grad.double() - y.grad).abs().max().item()
        assert err <= 2e-2 * max(1.0, y.grad.abs().max().item()), (err, y.grad.abs().max().item())


@pytest.mark.parametrize("stem", ["causal", "alibi", "bias", "relative_bias", "document", "gqa", "softcap"])
def test_gradcheck(stem: str, float64_interpreter) -> None:
    """torch.autograd.gradcheck (finite differences against the backward) on tiny float64 inputs."""
    c = fl.compile(example(stem), "reference")
    xs = leaves(inputs(c, B=1, H=4 if stem == "gqa" else 2, M=5, N=6 if stem != "document" else 5, D=4,
                       dtype=torch.float64, seed=4))

    def f(*ys):
        return c(*ys)[0]

    assert torch.autograd.gradcheck(f, tuple(xs), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("stem", ["causal", "alibi", "bias", "gqa"])
def test_gradcheck_through_the_lse(stem: str, float64_interpreter) -> None:
    """A loss that reads the lse too (a z-loss, an attention sink): gradcheck of (o, lse) against the backward with
    the LSE's cotangent (passes/lse_cotangent.py; the lse was not differentiable, so its term was dropped)."""
    c = fl.compile(example(stem), "reference")
    xs = leaves(inputs(c, B=1, H=4 if stem == "gqa" else 2, M=5, N=6, D=4, dtype=torch.float64, seed=6))
    assert torch.autograd.gradcheck(lambda *ys: c(*ys), tuple(xs), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_a_loss_of_the_lse_alone() -> None:
    """o unused by the loss: its cotangent is zeros, the lse's drives the gradient (autograd passes None for o)."""
    c = compiled("causal")
    xs = leaves(inputs(c, M=20, N=20))
    ys = leaves([x.detach().double() for x in xs])
    _, lse = c(*xs)
    (lse * lse).sum().backward()
    q, k, v = ys
    s = (q @ k.mT) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), -math.inf)
    (torch.logsumexp(s, -1) ** 2).sum().backward()
    for x, y in zip(xs[:2], ys[:2]):  # within the reference backend's f16 storage
        assert (x.grad.double() - y.grad).abs().max().item() <= 2e-2 * max(1.0, y.grad.abs().max().item())
    assert torch.count_nonzero(xs[2].grad) == 0  # v does not reach the lse
