"""The LSE's cotangent (passes/lse_cotangent.py): a loss that reads the forward's LSE too moves Delta by -dlse. The
fa2-bwd IR with it matches central differences of sum(o * do) + sum(lse * dlse) of the float64 forward, for q and a
captured table's gradient; the reference backend's c.backward(..., dlse=) runs it; bad calls say what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

import falower as fl
from falower.errors import FalowerError
from falower.ir.interp import Interpreter
from falower.passes.lse_cotangent import with_lse_cotangent

B, H, M, N, D = 1, 2, 21, 19, 8


def _forward(q, k, v, bias):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(D) + bias
    s = np.where(np.arange(M)[:, None] + 3 >= np.arange(N)[None, :], s, -np.inf)  # row 0 keeps 4 keys
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    return (p / l) @ v, (m + np.log(l))[..., 0]


def _graph():
    bias = fl.capture("bias", "f32", "H,M,N")
    return fl.attention(score_mod=lambda s, b, h, q, kv: s + bias[h, q, kv],
                        mask_mod=lambda b, h, q, kv: q + 3 >= kv, name="biased")


def test_the_ir_with_the_lse_cotangent_is_the_losss_gradient() -> None:
    r = np.random.default_rng(0)
    q, k, v = r.standard_normal((B, H, M, D)), r.standard_normal((B, H, N, D)), r.standard_normal((B, H, N, D))
    bias = r.standard_normal((H, M, N)) * 0.5
    do, dlse = r.standard_normal((B, H, M, D)), r.standard_normal((B, H, M))
    o, lse = _forward(q, k, v, bias)
    bwd = with_lse_cotangent(fl.lower(_graph(), "fa2-bwd"))
    assert [a.name for a in bwd.args][-1] == "dlse"
    by = dict(q=q, k=k, v=v, bias=bias, o=o, lse=lse, do=do, dlse=dlse)
    grads = dict(zip(bwd.result_names, Interpreter("f64").run(bwd, [by[a.name] for a in bwd.args])))

    def loss(**x):
        oo, ll = _forward(**{**dict(q=q, k=k, v=v, bias=bias), **x})
        return float((oo * do).sum() + (ll * dlse).sum())

    eps = 1e-6
    for name, at in (("q", (0, 0, 5, 3)), ("q", (0, 1, 20, 7)), ("k", (0, 1, 2, 1)), ("bias", (1, 4, 6))):
        base = by[name]
        hi, lo = base.copy(), base.copy()
        hi[at] += eps
        lo[at] -= eps
        num = (loss(**{name: hi}) - loss(**{name: lo})) / (2 * eps)
        assert grads["d" + name][at] == pytest.approx(num, rel=1e-5, abs=1e-7), name
    # without dlse the gradient differs (the term is not already there)
    plain = fl.lower(_graph(), "fa2-bwd")
    (dq0, *_) = Interpreter("f64").run(plain, [by[a.name] for a in plain.args])
    assert np.max(np.abs(dq0 - grads["dq"])) > 0.05


def test_the_reference_backend_takes_dlse() -> None:
    g = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")
    c = fl.compile(g, "reference")
    r = np.random.default_rng(1)
    q, k, v = (r.standard_normal((B, H, n, D)).astype(np.float16) for n in (M, N, N))
    o, lse = c(q, k, v)
    do = r.standard_normal(o.shape).astype(np.float16)
    dlse = r.standard_normal(lse.shape).astype(np.float32)
    got = c.backward(q, k, v, o, lse, do, dlse=dlse)
    f = with_lse_cotangent(c.lowered_backward)
    want = Interpreter("native").run(f, [q, k, v, o, lse, do, dlse])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    zero = c.backward(q, k, v, o, lse, do, dlse=np.zeros_like(dlse))
    for a, b in zip(zero, c.backward(q, k, v, o, lse, do)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FalowerError, match=r"dlse must have lse's shape \(1, 2, 21\), got \(1, 2, 20\)"):
        c.backward(q, k, v, o, lse, do, dlse=dlse[:, :, :20])
    with pytest.raises(FalowerError, match=r"dlse must be an array of lse's shape \(1, 2, 21\), got float"):
        c.backward(q, k, v, o, lse, do, dlse=1.0)


def test_only_the_backward_ir_takes_it() -> None:
    with pytest.raises(FalowerError, match="an LSE cotangent needs the fa2-bwd IR .* has no Delta"):
        with_lse_cotangent(fl.lower(_graph(), "fa2-fwd"))
    twice = with_lse_cotangent(fl.lower(_graph(), "fa2-bwd"))
    with pytest.raises(FalowerError, match="has its LSE cotangent already"):
        with_lse_cotangent(twice)
