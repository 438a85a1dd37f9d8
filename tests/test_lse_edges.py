"""The LSE as a second result (passes/raise_lse.py) where bugs hide: GQA (packed and not), fully masked rows (a
document mask's padding and unmatched rows, a mask that is all false), sizes 1, 2 and a tile's size +- 1 with M != N,
f16 / bf16 at the interpreter's native precision, the names a graph gives its results, the forms the traced front
door takes or refuses, and `falower opt --check`.

The reference is numpy's, written here from the math and not from the passes: O = P V and LSE = m + log(sum(exp(s -
m))) per row (-inf on a fully masked row), and dS = P (dP - Delta + dLSE), dQ = dS K c, dK = dS^T Q c summed over a
kv head's query heads (checked itself against central differences below)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import falower as fl
from falower.cli import main
from falower.errors import FalowerError
from falower.ir.interp import Interpreter
from falower.passes.pack_gqa import pack_gqa

SCALE = 0.3
# small tiles so that sizes 1, 2, a tile -1 / +1 and several tiles are cheap to interpret; the q and kv tiles differ
FWD = "decompose-softmax,canonicalize,fuse,tile{bq=16,bk=8},online-softmax{exp2=true,lazy=8},mask-tiles,score-licm," \
      "canonicalize"
BWD = {"atomic": "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize,tile-bwd{bq=8,bk=16,dq=atomic},"
                 "canonicalize",
       "det": "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize,"
              "tile-bwd{bq=8,bk=16,dq=separate,deterministic=true},canonicalize"}
SIZES = [1, 2, 7, 8, 9, 15, 16, 17, 33]

DOC = fl.capture("doc_id", "i32", "B,N")


def _document(b, h, q, kv):
    return (DOC[b, q] == DOC[b, kv]) & (DOC[b, q] >= 0)


MASKS = {
    "none": None,
    "causal_offset": lambda b, h, q, kv: q >= kv + 2,  # rows 0 and 1 fully masked
    "document": _document,  # padding (-1) rows and rows whose document no key holds fully masked
    "nothing": lambda b, h, q, kv: kv < 0,  # every row fully masked
}


def _graph(mask: str, G: int, dtype: str = "f32", name: str = "g") -> fl.Func:
    return fl.attention(mask_mod=MASKS[mask], return_lse=True, name=name, dtype=dtype, group_size=G, scale=SCALE)


def _keep(mask: str, B: int, M: int, N: int, doc: np.ndarray) -> np.ndarray:
    q, kv = np.arange(M)[:, None], np.arange(N)[None, :]
    if mask == "none":
        return np.ones((1, 1, M, N), bool)
    if mask == "causal_offset":
        return (q >= kv + 2)[None, None]
    if mask == "nothing":
        return np.zeros((1, 1, M, N), bool)
    qd = doc[:, np.minimum(np.arange(M), N - 1)]  # a gather clamps its index (README): q's row past N reads N - 1
    return ((qd[:, :, None] == doc[:, None, :]) & (qd[:, :, None] >= 0))[:, None]


def _np_forward(q, k, v, keep, G):
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = np.where(keep, q @ np.swapaxes(k, -1, -2) * SCALE, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m)
    l = e.sum(-1, keepdims=True)
    p = e / np.where(l == 0, 1.0, l)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    return p @ v, lse, p


def _np_backward(q, k, v, keep, G, do, dlse):
    o, _, p = _np_forward(q, k, v, keep, G)
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    ds = p * (do @ np.swapaxes(vr, -1, -2) - (do * o).sum(-1, keepdims=True) + dlse[..., None])
    B, H, N, D = kr.shape
    dk = (np.swapaxes(ds, -1, -2) @ q * SCALE).reshape(B, H // G, G, N, D).sum(2)
    dv = (np.swapaxes(p, -1, -2) @ do).reshape(B, H // G, G, N, -1).sum(2)
    return ds @ kr * SCALE, dk, dv


def _case(seed: int, B: int, HKV: int, G: int, M: int, N: int, D: int = 8, mask: str = "document"):
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, HKV * G, M, D))
    k, v = (r.standard_normal((B, HKV, N, D)) for _ in range(2))
    doc = r.integers(-1, 3, (B, N)).astype(np.int32)
    doc[0, 0] = -1  # a padding row
    if B > 1:
        doc[1, N - 1] = 7  # a document of one key, and past N the clamped rows (q >= N) read it too
    return q, k, v, doc, _keep(mask, B, M, N, doc)


def _inputs(mask, q, k, v, doc):
    return [q, k, v] + ([doc] if mask == "document" else [])


def _same_lse(got, want, rtol=1e-9, atol=1e-9):
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    assert np.isfinite(got[fin]).all()
    np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=atol)


def test_the_numpy_reference_is_the_gradient_of_its_forward() -> None:
    """_np_backward against central differences of sum(o * do) + sum(lse * dlse) over the finite LSEs (a fully masked
    row's LSE is -inf whatever the inputs: no derivative to take)."""
    q, k, v, doc, keep = _case(0, 2, 1, 2, 5, 4)
    r = np.random.default_rng(1)
    o, lse, _ = _np_forward(q, k, v, keep, 2)
    assert np.isneginf(lse).any() and np.isfinite(lse).any()
    do, dlse = r.standard_normal(o.shape), r.standard_normal(lse.shape)
    grads = _np_backward(q, k, v, keep, 2, do, dlse)
    xs = [q, k, v]
    for i, g in enumerate(grads):
        for at in [tuple(r.integers(0, n) for n in xs[i].shape) for _ in range(6)]:
            def loss(x):
                ins = list(xs)
                ins[i] = x
                oo, ll, _ = _np_forward(*ins, keep, 2)
                return (oo * do).sum() + np.where(np.isfinite(ll), ll * dlse, 0.0).sum()
            hi, lo = xs[i].copy(), xs[i].copy()
            hi[at] += 1e-6
            lo[at] -= 1e-6
            assert g[at] == pytest.approx((loss(hi) - loss(lo)) / 2e-6, rel=1e-5, abs=1e-7)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(G=st.sampled_from([2, 3, 4]), B=st.integers(1, 2), HKV=st.integers(1, 2), M=st.sampled_from(SIZES),
       N=st.sampled_from(SIZES), mask=st.sampled_from(sorted(MASKS)), seed=st.integers(0, 2 ** 16))
def test_a_gqa_graph_returns_its_lse_packed_or_not(G, B, HKV, M, N, mask, seed) -> None:
    """fa2-fwd of a GQA graph returning its LSE, as written, split over kv in 3 parts (some empty) and packed (pack-gqa:
    a kv head's query heads as its rows, O and LSE read back as [B, H, M, ...]), in float64: numpy's O and LSE, -inf exactly on the fully masked rows, O 0
    there, nothing NaN."""
    g = _graph(mask, G)
    q, k, v, doc, keep = _case(seed, B, HKV, G, M, N, mask=mask)
    wo, wl, _ = _np_forward(q, k, v, keep, G)
    ins = _inputs(mask, q, k, v, doc)
    packed, got_g = pack_gqa(g)
    assert got_g == G and packed.result_names == ["o", "lse"]
    for f, xs, how in ((g, ins, "graph"), (fl.lower(g, FWD), ins, "fa2-fwd"),
                       (fl.lower(g, FWD + ",split-kv{parts=3}"), ins, "split-kv: the parts' LSEs merged"),
                       (fl.lower(packed, FWD), [q.reshape(B, HKV, G * M, -1), *ins[1:]], "packed fa2-fwd")):
        o, lse = Interpreter("f64").run(f, xs)
        o, lse = o.reshape(wo.shape), lse.reshape(wl.shape)
        assert not np.isnan(o).any() and not np.isnan(lse).any(), how
        np.testing.assert_allclose(o, wo, rtol=1e-9, atol=1e-9, err_msg=how)
        _same_lse(lse, wl)
        assert (o[np.isneginf(wl)] == 0).all(), how


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(G=st.sampled_from([1, 2, 4]), B=st.integers(1, 2), M=st.sampled_from(SIZES), N=st.sampled_from(SIZES),
       mask=st.sampled_from(sorted(MASKS)), dq=st.sampled_from(sorted(BWD)), seed=st.integers(0, 2 ** 16))
def test_the_backward_of_a_returned_lse_with_gqa_and_fully_masked_rows(G, B, M, N, mask, dq, seed) -> None:
    """c.backward(..., dlse=) of the reference backend (the fa2-bwd IR, atomic and deterministic, of an f64 graph) is
    numpy's gradient of sum(o * do) + sum(lse * dlse), the kv heads' gradients summed over their query heads; a fully
    masked row's dlse (finite) moves nothing: its dQ row is 0, and no gradient is NaN."""
    g = _graph(mask, G, "f64")  # the reference backend interprets at the graph's precision
    q, k, v, doc, keep = _case(seed, B, 2, G, M, N, mask=mask)
    c = fl.compile(g, "reference", pipeline=FWD, backward=BWD[dq])
    ins = _inputs(mask, q, k, v, doc)
    o, lse = c(*ins)
    r = np.random.default_rng(seed + 1)
    do, dlse = r.standard_normal(o.shape), 10.0 * r.standard_normal(lse.shape)
    grads = c.backward(q, k, v, o, lse, do, *ins[3:], dlse=dlse)
    want = _np_backward(q, k, v, keep, G, do, dlse)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert not np.isnan(got).any(), name
        np.testing.assert_allclose(got, w, rtol=1e-8, atol=1e-8, err_msg=name)
    assert (grads[0][np.isneginf(lse)] == 0).all()


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_gqa_lse_at_native_precision(dtype: str) -> None:
    """f16 / bf16 inputs at the interpreter's native precision: the LSE (f32, from the f32 scores) within f32's error
    of float64's, packed or not, the fully masked rows -inf; O within the inputs' dtype's error; at 2 tiles + 1 kv."""
    G, B, HKV, M, N = 4, 2, 1, 9, 17
    g = _graph("document", G, dtype)
    q, k, v, doc, keep = _case(3, B, HKV, G, M, N)
    eps = 2.0 ** -8 if dtype == "bf16" else 2.0 ** -11
    round_ = fl.ir.interp.round_bf16 if dtype == "bf16" else (lambda x: x.astype(np.float16))
    q, k, v = (np.asarray(round_(x.astype(np.float32)), np.float64) for x in (q, k, v))
    wo, wl, _ = _np_forward(q, k, v, keep, G)
    packed = pack_gqa(g)[0]
    for f, xs in ((fl.lower(g, FWD), [q, k, v, doc]), (fl.lower(packed, FWD), [q.reshape(B, HKV, G * M, -1), k, v, doc])):
        o, lse = Interpreter("native").run(f, xs)
        assert lse.dtype == np.float32
        _same_lse(lse.reshape(wl.shape), wl, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(o, np.float64).reshape(wo.shape), wo, rtol=4 * eps, atol=4 * eps)


def test_a_mask_that_keeps_nothing_gives_lse_minus_inf_and_zero_gradients() -> None:
    """Every row fully masked, GQA, a finite (large) dlse on every row: LSE -inf, O 0 and every gradient exactly 0
    (P is 0 there, so dlse multiplies nothing), through the default fa2-fwd (packed: M <= 64) and fa2-bwd."""
    g = _graph("nothing", 2, "f64")
    q, k, v, _, _ = _case(5, 2, 2, 2, 3, 5, mask="nothing")
    c = fl.compile(g, "reference")
    assert c.packed_for(c._dims((q, k, v))) is not None
    o, lse = c(q, k, v)
    assert np.isneginf(lse).all() and (o == 0).all()
    for det in (False, True):
        c = fl.compile(g, "reference", deterministic=det)
        grads = c.backward(q, k, v, o, lse, np.ones_like(o), dlse=np.full(lse.shape, 1e30))
        assert all((x == 0).all() for x in grads)


# f64: the reference backend interprets at the graph's precision
QKV = dict(q=fl.tensor("f64", "B,HKV*2,M,D"), k=fl.tensor("f64", "B,HKV,N,D"), v=fl.tensor("f64", "B,HKV,N,D"))


def _lse_keepdim(s):
    """As torch code writes it: keepdim=True reductions, squeezed at the end."""
    m = s.amax(-1, keepdim=True)
    return (m + fl.log(fl.exp(s - m).sum(-1, keepdim=True))).squeeze(-1)


def _written_gqa(q, k, v):
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ k.mT * SCALE
    return fl.softmax(s, dim=-1) @ v, _lse_keepdim(s)


def test_a_gqa_graph_written_by_hand_returns_and_differentiates_its_lse() -> None:
    """The traced front door: GQA by repeat_interleave in the user's code, the LSE written with keepdim then squeezed;
    fa2-fwd and fa2-bwd (default tiles) at a tile's size +- 1, M != N, against numpy; the packed graph too."""
    g = fl.trace(_written_gqa, name="written", result_names=("out", "logz"), **QKV)
    q, k, v, _, keep = _case(6, 1, 2, 2, 65, 127, mask="none")
    wo, wl, _ = _np_forward(q, k, v, keep, 2)
    fwd = fl.lower(g, "fa2-fwd")
    assert fwd.result_names == ["out", "logz"]
    o, lse = Interpreter("f64").run(fwd, [q, k, v])
    np.testing.assert_allclose(o, wo, rtol=1e-9, atol=1e-9)
    _same_lse(lse, wl)
    po, pl = Interpreter("f64").run(fl.lower(pack_gqa(g)[0], "fa2-fwd"), [q.reshape(1, 2, 130, -1), k, v])
    np.testing.assert_allclose(po.reshape(wo.shape), wo, rtol=1e-9, atol=1e-9)
    _same_lse(pl.reshape(wl.shape), wl)
    r = np.random.default_rng(7)
    do, dlse = r.standard_normal(wo.shape), r.standard_normal(wl.shape)
    c = fl.compile(g, "reference")
    assert [a.name for a in c.lowered_backward.args] == ["q", "k", "v", "out", "lse", "dout", "dlogz"]
    for got, w in zip(c.backward(q, k, v, o, lse, do, dlse=dlse), _np_backward(q, k, v, keep, 2, do, dlse)):
        np.testing.assert_allclose(got, w, rtol=1e-8, atol=1e-8)


def _two(q, k, v):
    s = q @ k.mT * SCALE
    return fl.softmax(s, dim=-1) @ v, _lse_keepdim(s), _lse_keepdim(s)


def _one_twice(q, k, v):
    s = q @ k.mT * SCALE
    lse = _lse_keepdim(s)
    return fl.softmax(s, dim=-1) @ v, lse, lse


def _first(q, k, v):
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ k.mT * SCALE
    return _lse_keepdim(s), fl.softmax(s, dim=-1) @ v


MHA = dict(q=fl.tensor("f32", "B,H,M,D"), k=fl.tensor("f32", "B,H,N,D"), v=fl.tensor("f32", "B,H,N,D"))


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa2-bwd"])
@pytest.mark.parametrize("fn, qkv, msg", [
    # was: "pass fuse: the graph must return only the attention output" (raise_lse took the last, fuse saw the other)
    (_two, MHA, r"@_two returns its softmax's LSE 2 times \(out1, out2\): return it once, last"),
    (_one_twice, MHA, r"@_one_twice returns its softmax's LSE 2 times \(out1, out2\): return it once, last"),
    (_first, {**QKV, **{n: fl.tensor("f32", t.shape) for n, t in QKV.items()}},
     r"the result out0 of @_first is the softmax's LSE: return it last, after the attention's output"),
])
def test_lses_fa2_does_not_return_are_refused_in_one_line(fn, qkv, msg, pipeline) -> None:
    g = fl.trace(fn, **qkv)
    with pytest.raises(FalowerError, match=msg) as e:
        fl.lower(g, pipeline)
    assert "\n" not in str(e.value)


def _other(x_of):
    def other(q, k, v):
        s = q @ k.mT * SCALE
        return fl.softmax(s, dim=-1) @ v, _lse_keepdim(x_of(s, q, k))
    return other


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa2-bwd"])
@pytest.mark.parametrize("x_of", [
    lambda s, q, k: s * 2.0,  # other scores
    lambda s, q, k: q @ k.mT * SCALE,  # the same scores, computed again: another value, not raised
    lambda s, q, k: fl.where(s > 0.0, s, float("-inf")),  # the scores masked where the softmax's are not
    lambda s, q, k: q @ q.mT,  # another tensor altogether
], ids=["doubled", "recomputed", "masked", "q_q"])
def test_the_lse_of_another_tensor_is_not_taken_for_the_softmaxs(x_of, pipeline) -> None:
    """Only the LSE of the softmax's own input is fa2-fwd's LSE: another tensor's is an output the fused kernel does
    not make, refused in one line (never the softmax's LSE returned in its place)."""
    g = fl.trace(_other(x_of), **MHA)
    with pytest.raises(FalowerError) as e:
        fl.lower(g, pipeline)
    assert "\n" not in str(e.value) and "LSE" not in str(e.value)


def _named(names):
    def attn(q, k, v):
        s = q @ k.mT * SCALE
        return fl.softmax(s, dim=-1) @ v, _lse_keepdim(s)
    return fl.trace(attn, result_names=names, **MHA)


@pytest.mark.parametrize("names, msg", [
    # was a VerifyError after autodiff ("lse_result must name the LSE result ... got 'dq'"): autodiff checked the
    # gradients' names against the results raise_lse had left, not the LSE's
    (("o", "dq"), "pass autodiff: the gradient result dq would have the name of a result of @attn"),
    (("o", "dv"), "pass autodiff: the gradient result dv would have the name of a result of @attn"),
    # was the backend's "needs arguments do" (fa2-bwd took two arguments %lse, O and the LSE) or the reference
    # backend's ShapeError on %lse; the same for a graph returning O alone named lse
    (("lse", "z"), "pass recompute: the forward's output is named 'lse', the name the backward gives its LSE input"),
])
def test_result_names_the_backward_cannot_give_are_refused(names, msg) -> None:
    g = _named(names)
    assert fl.lower(g, "fa2-fwd").result_names == list(names)  # the forward takes any names
    for pipeline in ("fa2-bwd", "fa2-bwd-deterministic"):
        with pytest.raises(FalowerError, match=msg):
            fl.lower(g, pipeline)
    if names[0] == "lse":
        with pytest.raises(FalowerError, match=msg):
            fl.lower(fl.trace(lambda q, k, v: fl.softmax(q @ k.mT, dim=-1) @ v, result_names=("lse",), name="alone", **MHA),
                     "fa2-bwd")


@pytest.mark.parametrize("names", [("x", "o"), ("o", "q"), ("o", "do"), ("dlse", "z"), ("o", "lse")])
def test_result_names_near_the_backwards_own_differentiate_right(names) -> None:
    """Names that look like the backward's (the LSE named o with O named x: its cotangent is `do`; the LSE named q:
    its cotangent is `dq`, a gradient's name): the backend reads the roles, and the reference backward is numpy's."""
    from falower.backends.numba_cuda.from_ir_bwd import analyse_backward

    g = _named(names)
    c = fl.compile(g, "reference")
    r = np.random.default_rng(8)
    q, k, v = (r.standard_normal((1, 2, n, 8)).astype(np.float32) for n in (5, 7, 7))
    o, lse = c(q, k, v)
    do, dlse = r.standard_normal(o.shape), r.standard_normal(lse.shape)
    keep = np.ones((1, 1, 5, 7), bool)
    for got, w in zip(c.backward(q, k, v, o, lse, do.astype(np.float32), dlse=dlse.astype(np.float32)),
                      _np_backward(*(x.astype(np.float64) for x in (q, k, v)), keep, 1, do, dlse)):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)
    assert analyse_backward(c.lowered_backward).captures == []


CLI_GRAPHS = '''
import falower as fl

doc_id = fl.capture("doc_id", "i32", "B,N")


def same_document(b, h, q_idx, kv_idx):
    return (doc_id[b, q_idx] == doc_id[b, kv_idx]) & (doc_id[b, q_idx] >= 0)


gqa_doc = fl.attention(mask_mod=same_document, group_size=2, return_lse=True, name="gqa_doc")


def written(q, k, v):
    k, v = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    s = q @ k.mT * 0.25
    s = fl.where(s > 0.0, s, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = fl.where(m == float("-inf"), 0.0, m)  # unguarded, a fully masked row's written LSE is NaN: not checkable
    return fl.softmax(s, dim=-1) @ v, (m + fl.log(fl.exp(s - m).sum(-1, keepdim=True))).squeeze(-1)


hand = fl.trace(written, name="hand", result_names=("out", "logz"), q=fl.tensor("f16", "B,HKV*4,M,D"),
                k=fl.tensor("f16", "B,HKV,N,D"), v=fl.tensor("f16", "B,HKV,N,D"))
'''


@pytest.mark.parametrize("pack", [False, True], ids=["as_written", "packed"])
@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa2-bwd"])
@pytest.mark.parametrize("graph, sig", [
    ("gqa_doc", ("o", "lse", "dlse", "f16")),
    ("hand", ("out", "logz", "dlogz", "f32")),  # rows with no positive score fully masked; the LSE's own name
])
def test_opt_check_holds_a_gqa_graph_returning_its_lse(tmp_path, capsys, graph, sig, pipeline, pack) -> None:
    """`falower opt --check` (every pass against the float64 graph, gradients against finite differences for
    fa2-bwd) on GQA graphs that return their LSE, as written and --pack-gqa."""
    src = tmp_path / "graphs.py"
    src.write_text(CLI_GRAPHS)
    argv = ["opt", str(src), "--graph", graph, "-p", pipeline, "--check", "--shapes", "B=1,HKV=1,D=8"]
    code = main(argv + (["--pack-gqa"] if pack else []))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "numbers preserved after" in err and all(line.endswith(" ok") for line in err.splitlines()
                                                    if line.startswith("check: "))
    head = out.splitlines()[0]
    o, lse, dlse, ot = sig
    heads = "HKV" if pack else ("HKV*2" if graph == "gqa_doc" else "HKV*4")
    rows = ("M*2" if graph == "gqa_doc" else "M*4") if pack else "M"
    if pipeline == "fa2-fwd":
        assert head.endswith(f"-> ({o}: {ot}[B,{heads},{rows},D], {lse}: f32[B,{heads},{rows}]) {{")
    else:
        assert f"%{o}: {ot}[B,{heads},{rows},D], %lse: f32[B,{heads},{rows}], %d{o}: {ot}[B,{heads},{rows},D], " \
               f"%{dlse}: f32[B,{heads},{rows}]) -> (dq:" in head, head
    if pipeline == "fa2-bwd" and not pack:
        assert "gradients: finite differences" in err


@pytest.mark.parametrize("mask", ["causal_offset", "document", "nothing"])
def test_a_z_loss_cotangent_of_minus_inf_on_fully_masked_rows_stays_off_the_gradients(mask: str) -> None:
    """d(sum(lse ** 2)) = 2 lse is -inf on a fully masked row: Delta - dlse is +inf there and P (dP - Delta) is
    0 * -inf, which the partial tiles' mask select (where(keep, dS, 0)) drops (the simulator's kernels too, tried by
    hand on lse_grad_sim_cases' gqareturned graph: NaN in dS's products, none in the gradients). Elsewhere: numpy's."""
    g = _graph(mask, 2, "f64")
    q, k, v, doc, keep = _case(11, 2, 1, 2, 9, 17, mask=mask)
    ins = _inputs(mask, q, k, v, doc)
    for det in (False, True):
        c = fl.compile(g, "reference", pipeline=FWD, backward=BWD["det" if det else "atomic"])
        o, lse = c(*ins)
        assert np.isneginf(lse).any()
        do = np.random.default_rng(12).standard_normal(o.shape)
        grads = c.backward(q, k, v, o, lse, do, *ins[3:], dlse=2 * lse)
        want = _np_backward(q, k, v, keep, 2, do, np.where(np.isneginf(lse), 0.0, 2 * lse))
        for got, w in zip(grads, want):
            np.testing.assert_allclose(got, w, rtol=1e-8, atol=1e-8)
