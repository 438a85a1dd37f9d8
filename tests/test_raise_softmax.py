"""A softmax written by hand in traced code (a review of naive-attention forms: refused by fuse and delta, 'reduce_max is
not followed by the max guard' / 'no softmax gradient') is taken as the softmax op by decompose-softmax and autodiff
(passes/raise_softmax.py): the forms below lower through fa2-fwd and fa2-bwd with every pass checked in float64, and
mean what the hand-written Python means wherever a row has a finite entry."""

from __future__ import annotations

import numpy as np
import pytest

import falower as fl
from falower.ir import interpret
from falower.passes import PassManager, parse_pipeline, run_pipeline

QKV = dict(q=fl.tensor("f16", "B,H,M,D"), k=fl.tensor("f16", "B,H,N,D"), v=fl.tensor("f16", "B,H,N,D"))
SHAPES = {"B": 1, "H": 2, "M": 37, "N": 45, "D": 16}


def _scores(q, k):
    return q @ k.mT * 0.25


FORMS = {
    "max": lambda s: (lambda e: e / e.sum(dim=-1, keepdim=True))(fl.exp(s - s.amax(dim=-1, keepdim=True))),
    "no_max": lambda s: (lambda e: e / e.sum(dim=-1, keepdim=True))(fl.exp(s)),
    "masked": lambda s: (lambda x: (lambda e: e / e.sum(dim=-1, keepdim=True))(
        fl.exp(x - x.amax(dim=-1, keepdim=True))))(fl.where(s > -0.5, s, -1e9)),
    "exp2": lambda s: (lambda y: (lambda e: e / e.sum(dim=-1, keepdim=True))(
        fl.exp2(y - y.amax(dim=-1, keepdim=True))))(s * 1.4426950408889634),
    "reciprocal": lambda s: (lambda e: e * (1.0 / e.sum(dim=-1, keepdim=True)))(fl.exp(s - s.amax(dim=-1, keepdim=True))),
    # torch's keepdim=False, unsqueezed back (canonicalize's squeeze_pairs, which raise_softmax runs first)
    "squeezed": lambda s: (lambda e: e / e.sum(-1, keepdim=False).unsqueeze(-1))(
        fl.exp(s - s.amax(dim=-1, keepdim=False).unsqueeze(-1))),
}


def _after_pv(q, k, v):
    """The rows normalized after the product: (e @ v) / sum(e)."""
    s = _scores(q, k)
    e = fl.exp(s - s.amax(dim=-1, keepdim=True))
    return ((e @ v) / e.sum(dim=-1, keepdim=True)).to("f16")


def _graph(form: str) -> fl.Func:
    if form == "after_pv":
        return fl.trace(_after_pv, name="hand_after_pv", result_names=("o",), **QKV)
    return fl.trace(lambda q, k, v: (FORMS[form](_scores(q, k)) @ v).to("f16"), name=f"hand_{form}",
                    result_names=("o",), **QKV)


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa2-bwd"])
@pytest.mark.parametrize("form", sorted(FORMS) + ["after_pv"])
def test_a_hand_written_softmax_lowers_and_keeps_its_numbers(form: str, pipeline: str) -> None:
    pm = PassManager(parse_pipeline(pipeline), check=True, shapes=SHAPES)
    pm.run(_graph(form))
    assert all(r.check == "ok" for r in pm.records), [(r.name, r.check) for r in pm.records]


def test_a_decomposed_dump_fed_back_lowers_to_the_forward() -> None:
    """decompose-softmax's own output, parsed back, through fa2-fwd: its guarded softmax is taken as the op again."""
    causal = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")
    dumped = fl.parse_func(fl.print_func(run_pipeline(causal, "decompose-softmax,canonicalize")))
    pm = PassManager(parse_pipeline("fa2-fwd"), check=True, shapes=SHAPES)
    pm.run(dumped)
    assert all(r.check == "ok" for r in pm.records), [(r.name, r.check) for r in pm.records]


def test_a_fully_masked_row_is_zero_where_the_hand_written_form_is_nan() -> None:
    """The one place the two differ, as the module docstring says: softmax defines a row of -inf as 0."""
    g = fl.trace(lambda s: FORMS["max"](s), name="rows", s=fl.tensor("f32", "M,N"))
    x = np.array([[0.0, 1.0, 2.0], [-np.inf, -np.inf, -np.inf]])
    with np.errstate(invalid="ignore"):
        (hand,) = interpret(g, [x], "f64")
    (raised,) = interpret(run_pipeline(g, "decompose-softmax"), [x], "f64")
    assert np.isnan(hand[1]).all() and (raised[1] == 0).all()
    np.testing.assert_allclose(raised[0], hand[0], rtol=1e-15)


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa2-bwd"])
@pytest.mark.parametrize("where", ["q", "k", "both"])
def test_a_factor_on_q_or_k_moves_onto_the_product(where: str, pipeline: str) -> None:
    """(q * c) @ k^T: fuse refused it ('q must be a graph input ... computed by mul') in the forward; decompose-softmax
    moves a constant factor on an input onto the product first (raise_scale.py)."""
    def f(q, k, v):
        qs = q * 0.25 if where in ("q", "both") else q
        ks = k * 0.5 if where in ("k", "both") else k
        return (fl.softmax(qs @ ks.mT, dim=-1) @ v).to("f16")

    g = fl.trace(f, name=f"scaled_{where}", result_names=("o",), **QKV)
    pm = PassManager(parse_pipeline(pipeline), check=True, shapes=SHAPES)
    pm.run(g)
    assert all(r.check == "ok" for r in pm.records), [(r.name, r.check) for r in pm.records]
