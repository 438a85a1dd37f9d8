"""The IR's tanh_approx (fl.tanh(x, approx=True)): tanh by definition, the hardware's approximation in the kernels.

Everything before the backend treats it as tanh, so every number the IR computes is tanh's: the interpreter, the
gradient (1 - y^2), the lowered pipelines. Only the op's name differs, and the backend maps it to one
`tanh.approx.f32` (MUFU.TANH) where `tanh` costs two MUFU operations and three more instructions
(intrinsics.tanh_ex2_f32; libdevice's ~15 where extra tanh = "libdevice"); the GPU
tests (tests/gpu/test_tanh_approx_gpu.py) bound the instruction's error and hold the kernels to the error rules.
"""

from __future__ import annotations

import numpy as np
import pytest

import falower as fl
from falower.ir import interpret, parse_func, print_func
from falower.passes import NAMED_PIPELINES, run_pipeline
from falower.passes.check import bind_dims, random_inputs


def softcap(approx: bool) -> fl.Func:
    return fl.attention(score_mod=lambda s, b, h, q, kv: 30.0 * fl.tanh(s / 30.0, approx=approx),
                        name="softcap_approx" if approx else "softcap")


def _inputs(g: fl.Func, M: int, N: int, seed: int = 0):
    env = bind_dims(g, {"B": 1, "H": 2, "M": M, "N": N, "D": 8})
    return env, random_inputs(g, env, seed=seed)


def test_the_op_is_in_the_ir_and_round_trips():
    g = softcap(True)
    text = print_func(g)
    assert "tanh_approx" in text and " tanh " not in text
    assert print_func(parse_func(text)) == text
    assert "tanh_approx" not in print_func(softcap(False))
    with pytest.raises(TypeError):
        fl.tanh(1.0, True, 3)  # approx is the one option


@pytest.mark.parametrize("M,N", [(1, 1), (2, 2), (17, 5), (5, 33)])
def test_interpreted_values_are_tanh(M, N):
    """Same numbers as the exact graph, bit for bit, in f64 and in the low precision (the op is tanh there)."""
    exact, approx = softcap(False), softcap(True)
    env, x = _inputs(exact, M, N, seed=M * 100 + N)
    for precision in ("f64", "low:f16"):
        a = interpret(exact, x, precision=precision, dims=env)
        b = interpret(approx, x, precision=precision, dims=env)
        for u, v in zip(a, b):
            assert np.array_equal(u, v, equal_nan=True), precision


def test_gradient_is_tanh_s():
    """autodiff's rule is tanh's (1 - y^2 of the forward's y): the joint functions give the same gradients."""
    exact, approx = fl.grad(softcap(False)), fl.grad(softcap(True))
    assert "tanh_approx" in print_func(approx)
    env, x = _inputs(softcap(False), 9, 13, seed=3)
    do = np.random.default_rng(1).standard_normal(x[0].shape)
    for u, v in zip(interpret(exact, x + [do], dims=env), interpret(approx, x + [do], dims=env)):
        assert np.array_equal(u, v)


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa2-bwd"])
def test_pipelines_keep_the_op_and_the_numbers(pipeline):
    """Every pass carries tanh_approx through (the lowered IR still names it) and the lowered function computes
    what the exact graph's lowering computes."""
    exact, approx = (run_pipeline(softcap(a), NAMED_PIPELINES[pipeline]) for a in (False, True))
    assert "tanh_approx" in print_func(approx)
    g = softcap(False) if pipeline == "fa2-fwd" else fl.grad(softcap(False))
    env = bind_dims(g, {"B": 1, "H": 2, "M": 70, "N": 33, "D": 8})
    x = random_inputs(exact, env, seed=5)
    for u, v in zip(interpret(exact, x, dims=env), interpret(approx, x, dims=env)):
        assert np.array_equal(u, v, equal_nan=True)


def test_backend_emits_the_instruction():
    """The forward and backward kernels call the intrinsic (tanh.approx.f32), never a full tanh; the exact graph
    keeps a full tanh (tanh_ex2_f32 in the tensor-core kernels, libdevice's where asked)."""
    pytest.importorskip("numba")
    c = fl.compile(softcap(True), "numba-cuda")
    for src in (c.specialize("f16", D=64).source, c._backward_kernel_and_dims_for("f16", 64).source):
        assert "tanh_approx_f32(" in src and " tanh_f32(" not in src and "tanh_ex2_f32((" not in src
    exact = fl.compile(softcap(False), "numba-cuda").specialize("f16", D=64).source
    assert "tanh_ex2_f32((" in exact and "tanh_approx_f32(" not in exact
    lib = fl.compile(softcap(False), "numba-cuda", extra={"tanh": "libdevice"}).specialize("f16", D=64).source
    assert "tanh_f32(" in lib and "tanh_ex2_f32((" not in lib
