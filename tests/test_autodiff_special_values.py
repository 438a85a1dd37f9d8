"""Gradients at the awkward points a review found NaN at (each test fails before its fix): a score function whose
derivative is infinite at s = 0 (sqrt(max(s, 0))) on masked entries of the joint and on the padding of ragged tiles
in the lowered backward, a captured -inf (an additive mask table) times a learned parameter, and a ** b at a = b = 0;
against central finite differences of the forward in float64. And a learned 0-d temperature read through div, sub,
exp or twice, which tile-bwd once refused in words that named a reduction."""

from __future__ import annotations

import numpy as np
import pytest

import falower as fl
from falower.ir.interp import Interpreter
from falower.passes import run_pipeline
from falower.passes.check import bind_dims, finite_differences, logsumexp_rows, random_inputs


def _sqrt_relu(mask=None, name="sqrtrelu"):
    return fl.attention(score_mod=lambda s, b, h, q, kv: fl.sqrt(fl.maximum(s, 0.0)), mask_mod=mask, name=name)


def test_masked_entries_with_a_zero_score_get_no_nan_gradient() -> None:
    doc = fl.capture("doc", "i32", "B,N")
    g = _sqrt_relu(lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (doc[b, q] >= 0), "padded")
    env = bind_dims(g, {"B": 1, "H": 1, "M": 4, "N": 4, "D": 2})
    q, k, v, _ = random_inputs(g, env, 0)
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    docs = np.array([[0, 0, 1, -1]], np.int32)  # token 3 is padding, with a zero embedding: its scores are 0
    q[0, 0, 3] = 0.0
    k[0, 0, 3] = 0.0
    do = np.random.default_rng(1).standard_normal(q.shape)
    o, dq, dk, dv = Interpreter("f64").run(fl.grad(g), [q, k, v, docs, do], env)
    fq, fk, fv = finite_differences(g, [q, k, v, docs], [do], env)
    for got, want in ((dq, fq), (dk, fk), (dv, fv)):
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("M,N,pipeline", [(3, 4, "fa2-bwd"), (5, 7, "tile-bwd{bq=2,bk=3}"),
                                          (5, 7, "tile-bwd{bq=2,bk=3,dq=separate,deterministic=true}")])
def test_the_padding_of_ragged_tiles_gets_no_nan_gradient(M: int, N: int, pipeline: str) -> None:
    g = _sqrt_relu()
    env = bind_dims(g, {"B": 1, "H": 1, "M": M, "N": N, "D": 2})
    q, k, v = (x.astype(np.float64) for x in random_inputs(g, env, 0))
    do = np.random.default_rng(1).standard_normal(q.shape)
    it = Interpreter("f64")
    o, dq, dk, dv = it.run(fl.grad(g), [q, k, v, do], env)
    S = np.sqrt(np.maximum(q @ k.swapaxes(-1, -2) / np.sqrt(2), 0))
    lse = logsumexp_rows(S, 3)
    if pipeline != "fa2-bwd":
        pipeline = "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize," + pipeline
    bw = run_pipeline(g, pipeline)
    got = dict(zip(bw.result_names, it.run(bw, [q, k, v, o, lse, do], env)))
    for name, want in (("dq", dq), ("dk", dk), ("dv", dv)):
        np.testing.assert_allclose(got[name], want, atol=1e-10, err_msg=name)


def test_a_captured_minus_inf_times_a_parameter_has_a_finite_gradient() -> None:
    am = fl.capture("amask", "f32", "B,1,M,N")
    temp = fl.capture("temp", "f32", "H")
    g = fl.attention(score_mod=lambda s, b, h, q, kv: (s + am[b, 0, q, kv]) * temp[h], name="addmask_temp")
    env = bind_dims(g, {"B": 1, "H": 2, "M": 3, "N": 4, "D": 2})
    q, k, v, _, _ = (x.astype(np.float64) for x in random_inputs(g, env, 0))
    amask = np.where(np.arange(4) <= np.arange(3)[:, None], 0.0, -np.inf)[None, None]
    t = np.array([0.7, 1.3])
    do = np.random.default_rng(1).standard_normal(q.shape)
    fd = finite_differences(g, [q, k, v, amask, t], [do], env)
    joint = Interpreter("f64").run(fl.grad(g), [q, k, v, amask, t, do], env)
    np.testing.assert_allclose(joint[-1], fd[4], rtol=1e-6)
    o = joint[0]
    bw = fl.lower(g, "fa2-bwd")
    got = dict(zip(bw.result_names, Interpreter("f64").run(bw, [q, k, v, amask, t, o, _lse(g, [q, k, v, amask, t], env),
                                                                 do], env)))
    np.testing.assert_allclose(got["dtemp"], fd[4], rtol=1e-6)


def test_pow_at_zero_to_the_zero_has_zero_slope() -> None:
    t_c, e_c = fl.capture("t", "f32", "H,N"), fl.capture("e", "f32", "H")
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + t_c[h, kv] ** e_c[h], name="powtab")
    env = bind_dims(g, {"B": 1, "H": 2, "M": 3, "N": 4, "D": 2})
    q, k, v, t, _ = (x.astype(np.float64) for x in random_inputs(g, env, 0))
    t = np.abs(t)
    t[0, 1] = 0.0
    e = np.array([0.0, 2.0])  # head 0: t ** 0 is the constant 1, also at t = 0
    do = np.random.default_rng(1).standard_normal(q.shape)
    out = Interpreter("f64").run(fl.grad(g), [q, k, v, t, e, do], env)
    fd = finite_differences(g, [q, k, v, t, e], [do], env)
    np.testing.assert_allclose(out[-2], fd[3], atol=1e-7)


TEMP = fl.capture("temp", "f32", "")
TEMP_MODS = {"div": lambda s, b, h, q, kv: s / TEMP, "sub": lambda s, b, h, q, kv: s - TEMP,
             "exp": lambda s, b, h, q, kv: s * fl.exp(TEMP), "cap": lambda s, b, h, q, kv: TEMP * fl.tanh(s / TEMP),
             "twice": lambda s, b, h, q, kv: s * TEMP + TEMP * (kv - q) * 0.01,
             # autodiff's zero-cotangent guard on the scalar's own sum hid it from tile-bwd (a review's finding)
             "sq": lambda s, b, h, q, kv: s * TEMP ** 2, "inv": lambda s, b, h, q, kv: s * (1.0 / TEMP),
             "rsqrt": lambda s, b, h, q, kv: s * fl.rsqrt(TEMP), "log": lambda s, b, h, q, kv: s + fl.log(TEMP)}


@pytest.mark.parametrize("name", sorted(TEMP_MODS))
def test_a_learned_temperature_lowers_through_tile_bwd(name: str) -> None:
    g = fl.attention(score_mod=TEMP_MODS[name], name=f"temp_{name}")
    env = bind_dims(g, {"B": 2, "H": 2, "M": 5, "N": 7, "D": 3})
    q, k, v, _ = (x.astype(np.float64) for x in random_inputs(g, env, 0))
    t = np.float64(1.7)
    do = np.random.default_rng(1).standard_normal(q.shape)
    it = Interpreter("f64")
    o, *want = it.run(fl.grad(g), [q, k, v, t, do], env)
    pre = "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize"
    whole = run_pipeline(g, pre)
    ref = dict(zip(whole.result_names, it.run(whole, [q, k, v, t, o, _lse(g, [q, k, v, t], env), do], env)))
    for tiles in ("tile-bwd{bq=2,bk=3}", "tile-bwd{bq=2,bk=3,dq=separate,deterministic=true}"):
        bw = run_pipeline(g, f"{pre},{tiles},canonicalize")
        got = dict(zip(bw.result_names, it.run(bw, [q, k, v, t, o, _lse(g, [q, k, v, t], env), do], env)))
        for n, w in zip(("dq", "dk", "dv", "dtemp"), want):
            np.testing.assert_allclose(got[n], w, rtol=1e-9, atol=1e-12, err_msg=f"{tiles} {n}")
            np.testing.assert_allclose(ref[n], w, rtol=1e-9, atol=1e-12, err_msg=f"whole {n}")


def _lse(g, inputs, env) -> np.ndarray:
    """The forward's LSE from fa2-fwd's lowered graph interpreted in float64."""
    f = fl.lower(g, "fa2-fwd")
    return dict(zip(f.result_names, Interpreter("f64").run(f, inputs, env)))["lse"]


def test_a_temperature_read_twice_is_refused_by_the_kernels_in_words() -> None:
    """t * tanh(s / t): the IR lowers it (above); the kernels add one sum a table and say so in one line."""
    pytest.importorskip("numba")
    from falower.errors import FalowerError

    g = fl.attention(score_mod=TEMP_MODS["cap"], name="temp_cap_kernel")
    c = fl.compile(g, "numba-cuda", path="mma")
    with pytest.raises(FalowerError, match="a captured gradient adds sums of several terms"):
        c._backward_kernel_and_dims_for("f16", 64)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_tables_entry_at_a_constant_index_lowers(deterministic: bool) -> None:
    """s * t[1] with t of shape [4]: its gradient is a total sum scattered at index 1 (tile-bwd once said 'cannot
    move squeeze to tiles: axis -2 out of range'); t[-1] is the last entry (the frontend counts from the end)."""
    t4 = fl.capture("temp", "f32", "4")
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s * t4[1] - t4[-1] * 0.5, name="temp_idx")
    env = bind_dims(g, {"B": 2, "H": 2, "M": 5, "N": 7, "D": 3})
    q, k, v, _ = (x.astype(np.float64) for x in random_inputs(g, env, 0))
    t = np.array([0.3, 1.7, -2.0, 0.9])
    do = np.random.default_rng(1).standard_normal(q.shape)
    it = Interpreter("f64")
    o, *want = it.run(fl.grad(g), [q, k, v, t, do], env)
    fd = finite_differences(g, [q, k, v, t], [do], env)
    np.testing.assert_allclose(want[3], fd[3], atol=1e-7)
    assert want[3][0] == 0.0 and want[3][2] == 0.0  # entries nobody reads
    dq = "separate,deterministic=true" if deterministic else "atomic"
    bw = run_pipeline(g, "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize,"
                         f"tile-bwd{{bq=2,bk=3,dq={dq}}},canonicalize")
    got = dict(zip(bw.result_names, it.run(bw, [q, k, v, t, o, _lse(g, [q, k, v, t], env), do], env)))
    for n, w in zip(("dq", "dk", "dv", "dtemp"), want):
        np.testing.assert_allclose(got[n], w, rtol=1e-9, atol=1e-12, err_msg=n)


@pytest.mark.parametrize("body,words", [
    (lambda q, k, v: fl.softmax(q @ k.mT, dim=-1) @ (v * 2.0), "%v .* reaches the products through mul"),
    (lambda q, k, v: fl.softmax(q @ fl.tanh(k).mT, dim=-1) @ v, "%k .* reaches the products through tanh"),
])
def test_an_input_transformed_before_its_product_is_named_as_one(body, words: str) -> None:
    """The backward's refusal names q / k / v as the inputs they are (it called them 'captured tensors' and asked
    for v[..., q_idx, kv_idx])."""
    from falower.errors import PassError

    x = fl.tensor("f16", "B,H,M,D")
    y = fl.tensor("f16", "B,H,N,D")
    g = fl.trace(body, name="transformed", q=x, k=y, v=y)
    with pytest.raises(PassError, match=words):
        fl.lower(g, "fa2-bwd")
