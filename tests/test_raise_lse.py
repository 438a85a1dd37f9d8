"""The LSE as a second result (passes/raise_lse.py): a graph that returns its softmax's log-sum-exp beside O lowers
through fa2-fwd (the LSE output named as the graph named it) and fa2-bwd (the joint function takes its cotangent,
Delta moves by it), every pass checked in float64 against the written graph, gradients against central differences;
the forms that are not an LSE, or not in the place fa2-fwd returns it, are refused in one line."""

from __future__ import annotations

import math

import numpy as np
import pytest

import falower as fl
from falower.backends.numba_cuda.from_ir_bwd import analyse_backward
from falower.backends.numba_cuda.from_ir import BackendError
from falower.errors import FalowerError
from falower.ir.interp import Interpreter
from falower.ir.parser import parse_func
from falower.ir.printer import print_func
from falower.passes import PassManager, parse_pipeline

QKV = dict(q=fl.tensor("f32", "B,H,M,D"), k=fl.tensor("f32", "B,H,N,D"), v=fl.tensor("f32", "B,H,N,D"))
SHAPES = {"B": 1, "H": 2, "M": 37, "N": 45, "D": 16}
NEG = float("-inf")


def _masked(s):
    """The positive scores only: a row with none is fully masked (its LSE -inf)."""
    return fl.where(s > 0.0, s, NEG)


def _shared(s):
    m = s.amax(-1, keepdim=True)
    e = fl.exp(s - m)
    l = e.sum(-1, keepdim=True)
    return e / l, (m + fl.log(l)).squeeze(-1)


def _guarded(x):
    m = x.amax(-1, keepdim=True)
    m_safe = fl.where(m == NEG, 0.0, m)
    return fl.softmax(x, dim=-1), (m_safe + fl.log(fl.exp(x - m_safe).sum(-1, keepdim=True))).squeeze(-1)


FORMS = {
    # the softmax's own m, e and l, squeezed at the end
    "shared": _shared,
    # torch's habit: keepdim=False reductions, the softmax op beside them, the log term first
    "keepdim_false": lambda s: (fl.softmax(s, dim=-1),
                                fl.log(fl.exp(s - s.amax(-1, keepdim=True)).sum(-1, keepdim=False))
                                + s.amax(-1, keepdim=False)),
    "no_max": lambda s: (fl.softmax(s, dim=-1), fl.log(fl.exp(s).sum(-1, keepdim=False))),
    # decompose-softmax's guard on the max: a fully masked row's LSE is -inf, not NaN
    "guarded": lambda s: _guarded(_masked(s)),
}


def _graph(form: str, names=("o", "lse"), forms=FORMS) -> fl.Func:
    def attn(q, k, v):
        p, lse = forms[form](q @ k.mT * 0.25)
        return p @ v, lse
    return fl.trace(attn, name=f"lse_{form}", result_names=names, **QKV)


def _checked(g: fl.Func, pipeline: str) -> fl.Func:
    pm = PassManager(parse_pipeline(pipeline), check=True, shapes=SHAPES)
    out = pm.run(g)
    assert all(r.check == "ok" for r in pm.records), [(r.name, r.check) for r in pm.records]
    return out


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_forward_returns_the_graphs_lse_under_its_name(form: str) -> None:
    fwd = _checked(_graph(form, ("out", "logz")), "fa2-fwd")
    assert fwd.result_names == ["out", "logz"] and "lse_result" not in fwd.attrs
    assert str(fwd.results[1].type) == "f32[B,H,M]"


@pytest.mark.parametrize("pipeline", ["fa2-bwd", "fa2-bwd-deterministic"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_backward_takes_the_lse_cotangent(form: str, pipeline: str) -> None:
    """--check's finite differences of sum(o * do) + sum(logz * dlogz) hold the joint function (a sign error in the
    softmax rule's term fails them: tried); the passes after it hold to its numbers."""
    bwd = _checked(_graph(form, ("out", "logz")), pipeline)
    assert [a.name for a in bwd.args] == ["q", "k", "v", "out", "lse", "dout", "dlogz"]
    delta = next(op for op in bwd.body.ops if op.name == "parallel_for" and op.results[0].name == "delta")
    assert any(op.name == "tile.load" and op.operands[0] is bwd.args[-1] for op in delta.walk())
    low = analyse_backward(bwd)  # the kernels take it as with_lse_cotangent's: not a captured table
    assert low.captures == []


def test_a_dump_of_a_middle_level_keeps_the_name_and_reads_back() -> None:
    mid = fl.lower(_graph("shared", ("o", "logz")), "decompose-softmax,canonicalize,fuse")
    text = print_func(mid)
    assert text.splitlines()[0].endswith('-> (o: f32[B,H,M,D]) {lse_result = "logz"} {')
    back = parse_func(text)
    assert print_func(back) == text
    fwd = fl.lower(back, "tile{bq=128,bk=64},online-softmax{exp2=true,lazy=8},mask-tiles,score-licm,canonicalize")
    assert fwd.result_names == ["o", "logz"]


def test_the_lse_of_the_ir_is_the_written_one() -> None:
    """fa2-fwd's LSE at native precision against the written graph's in float64, fully masked rows included (rows
    0-3 of q against positive keys: no positive score)."""
    g = _graph("guarded")
    fwd = fl.lower(g, "fa2-fwd")
    env = {"B": 1, "H": 2, "M": 20, "N": 19, "D": 16}
    r = np.random.default_rng(3)
    xs = [np.abs(r.standard_normal((1, 2, env[n], 16))).astype(np.float32) for n in "MNN"]
    xs[0][:, :, :4] *= -1
    o, lse = Interpreter("native").run(fwd, xs, env)
    wo, wl = Interpreter("f64").run(g, xs, env)
    assert np.isneginf(lse[:, :, :4]).all() and np.isneginf(wl[:, :, :4]).all()
    np.testing.assert_allclose(lse[:, :, 4:], wl[:, :, 4:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o, wo, rtol=1e-4, atol=1e-5)


NOT_LSE = {
    # the max added, the exponent not shifted by it: log(sum(exp(s))) + max(s) is no LSE
    "unshifted": lambda s: (fl.softmax(s, dim=-1), s.amax(-1, keepdim=False) + fl.log(fl.exp(s).sum(-1, keepdim=False))),
    # the LSE of other scores than the softmax's
    "other_scores": lambda s: (fl.softmax(s, dim=-1), fl.log(fl.exp(s * 2.0).sum(-1, keepdim=False))),
}


@pytest.mark.parametrize("form", sorted(NOT_LSE))
def test_a_second_result_that_is_not_the_lse_is_refused(form: str) -> None:
    with pytest.raises(FalowerError, match="pass fuse: the graph must return only the attention output"):
        fl.lower(_graph(form, forms=NOT_LSE), "fa2-fwd")


def test_an_lse_kept_with_its_axis_or_returned_first_is_refused() -> None:
    def kept(q, k, v):
        s = q @ k.mT * 0.25
        m = s.amax(-1, keepdim=True)
        return fl.softmax(s, dim=-1) @ v, m + fl.log(fl.exp(s - m).sum(-1, keepdim=True))

    def first(q, k, v):
        p, lse = _shared(q @ k.mT * 0.25)
        return lse, p @ v

    for fn, msg in ((kept, r"the result lse of @kept is the softmax's LSE as f32\[B,H,M,1\]: return it as f32\[B,H,M\]"),
                    (first, "the result lse of @first is the softmax's LSE: return it last")):
        names = ("o", "lse") if fn is kept else ("lse", "o")
        g = fl.trace(fn, result_names=names, **QKV)
        for pipeline in ("fa2-fwd", "fa2-bwd"):
            with pytest.raises(FalowerError, match=msg):
                fl.lower(g, pipeline)


def test_the_fa1_order_says_it_has_no_lse() -> None:
    with pytest.raises(FalowerError, match=r"online-softmax: @lse_shared returns its softmax's LSE \(lse\), which "
                                           "the FA1 order does not compute"):
        fl.lower(_graph("shared"), "fa1-fwd")


def _numpy_forward(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) * 0.25
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(-1, keepdims=True)
    return (e / l) @ v, (m + np.log(l))[..., 0]


@pytest.mark.parametrize("names", [("o", "lse"), ()])
def test_the_reference_backend_differentiates_the_returned_lse(names) -> None:
    """c.backward(..., dlse=) of a graph returning its LSE is the gradient of sum(o * do) + sum(lse * dlse) (central
    differences of numpy's forward); without dlse, of sum(o * do). Unnamed results (out0, out1) included: the
    backward took O by the name `o` only (a KeyError)."""
    g = _graph("shared", names)
    c = fl.compile(g, "reference")
    r = np.random.default_rng(2)
    q, k, v = (r.standard_normal((1, 2, n, 8)) for n in (5, 7, 7))
    o, lse = c(q, k, v)
    do, dlse = r.standard_normal(o.shape), r.standard_normal(lse.shape)
    with_lse = dict(zip(("dq", "dk", "dv"), c.backward(q, k, v, o, lse, do, dlse=dlse)))
    without = dict(zip(("dq", "dk", "dv"), c.backward(q, k, v, o, lse, do)))
    x = dict(q=q, k=k, v=v)
    eps = 1e-6
    for name, at in (("q", (0, 1, 2, 3)), ("k", (0, 0, 6, 1)), ("v", (0, 1, 4, 7))):
        num = []
        for w in (1.0, 0.0):
            def loss(arr):
                oo, ll = _numpy_forward(**{**x, name: arr})
                return float((oo * do).sum() + w * (ll * dlse).sum())
            hi, lo = x[name].copy(), x[name].copy()
            hi[at] += eps
            lo[at] -= eps
            num.append((loss(hi) - loss(lo)) / (2 * eps))
        assert with_lse["d" + name][at] == pytest.approx(num[0], rel=1e-4, abs=1e-6), name
        assert without["d" + name][at] == pytest.approx(num[1], rel=1e-4, abs=1e-6), name
    assert not math.isclose(with_lse["dq"][0, 1, 2, 3], without["dq"][0, 1, 2, 3], abs_tol=1e-3)


def test_the_backend_refuses_a_delta_edited_away_from_the_cotangent() -> None:
    bwd = fl.lower(_graph("shared", ("o", "logz")), "fa2-bwd")
    text = print_func(bwd)
    dropped = text.replace("tile.yield %delta_moved into", "tile.yield %delta_1 into", 1)
    assert dropped != text
    with pytest.raises(BackendError, match=r"takes %dlogz, the LSE's cotangent, but Delta is not rowsum\(dO \* O\) "
                                           "less it"):
        analyse_backward(parse_func(dropped))
    plain = fl.lower(fl.attention(name="plain", dtype="f32"), "fa2-bwd")
    text = print_func(plain)
    edited = text.replace("%o_t = tile.load %o[", "%o_t = tile.load %do[", 1)
    assert edited != text
    with pytest.raises(BackendError, match=r"Delta reads %do, where its kernel computes rowsum\(dO \* O\)"):
        analyse_backward(parse_func(edited))


def test_the_verifier_holds_the_lse_results_name() -> None:
    from falower.errors import VerifyError
    from falower.ir.verifier import verify

    text = print_func(fl.lower(_graph("shared", ("o", "logz")), "decompose-softmax"))
    verify(parse_func(text))
    for bad in ('"o"', '"no such"', "3"):
        with pytest.raises(VerifyError, match="lse_result must name the LSE result"):
            verify(parse_func(text.replace('"logz"', bad, 1)))


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa2-bwd"])
def test_attention_writes_the_lse_when_asked(pipeline: str) -> None:
    """fl.attention(return_lse=True): the guarded form, rows 0-2 fully masked (LSE -inf, zero gradients), checked."""
    g = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv + 3, return_lse=True, name="returned", dtype="f32")
    assert g.result_names == ["o", "lse"] and str(g.results[1].type) == "f32[B,H,M]"
    out = _checked(g, pipeline)
    assert out.result_names == (["o", "lse"] if pipeline == "fa2-fwd" else ["dq", "dk", "dv"])
    with pytest.raises(FalowerError, match="attention's return_lse must be True or False, got 'yes'"):
        fl.attention(return_lse="yes")


def test_compile_refuses_a_pipeline_that_drops_the_lse() -> None:
    with pytest.raises(FalowerError, match=r"@lse_shared returns its softmax's LSE \(lse\), which pipeline "
                                           "decompose-softmax,canonicalize does not compute"):
        fl.compile(_graph("shared"), "reference", pipeline="decompose-softmax,canonicalize")
