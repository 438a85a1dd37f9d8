"""On the GPU: the IR's tanh in the tensor-core kernels, intrinsics.tanh_ex2_f32 (1 - 2 / (1 + 2**y): ex2.approx,
rcp.approx and two FMA-pipe instructions, where libdevice's tanhf is ~16 instructions an element).

Checked here: the instruction sequence's absolute error against float64 tanh over a sweep of f32 values (the bound
from_ir.tanh_by_ex2 documents), and the softcap example under both tanhs within the error rules every example is held
to (test_examples_gpu, test_backward_gpu run the default, this one, on all their shapes)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import falower as fl  # noqa: E402
from falower.passes.check import bind_dims, random_inputs  # noqa: E402
from test_backward_gpu import needs_cuda  # noqa: E402
from test_examples_gpu import assert_error_rule, graph, rounded, to_device  # noqa: E402

# the float32 steps rounded exactly reach 2^-22.4 (tests/backend/test_tanh_ex2.py); ex2.approx and rcp.approx add
# their own relative errors (~2^-22 each), through 2 r (1 - r) <= 1/2 and 2 r <= 1
BOUND = 2.0 ** -20


def test_tanh_ex2_absolute_error_bound():
    """Every swept f32 x in [-20, 20] plus |x| from 1e-30 to 1: |tanh_ex2(2 log2(e) x) - tanh(x)| <= 2^-20, in
    [-1, 1], exactly +-1 where |x| >= 10."""
    needs_cuda()
    from numba import cuda

    from falower.backends.numba_cuda.from_ir import TWO_LOG2E
    from falower.backends.numba_cuda.intrinsics import tanh_ex2_f32

    k = np.float32(TWO_LOG2E)

    @cuda.jit
    def run(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = tanh_ex2_f32(x[i] * k)

    small = np.logspace(-30, 0, 200_001)
    x = np.concatenate([np.linspace(-20, 20, 2_000_001), small, -small]).astype(np.float32)
    dy = cuda.to_device(np.zeros_like(x))
    run[(x.size + 255) // 256, 256](cuda.to_device(x), dy)
    y = dy.copy_to_host().astype(np.float64)
    err = np.abs(y - np.tanh(x.astype(np.float64)))
    print(f"tanh_ex2_f32: max absolute error {err.max():.3g} (2^{np.log2(err.max()):.2f})")
    assert err.max() <= BOUND
    assert np.all(np.abs(y) <= 1.0)
    big = np.abs(x) >= 10
    assert np.all(np.abs(y[big]) == 1.0)


@pytest.mark.parametrize("N", [1, 17, 1000, 4096])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("tanh", ["ex2", "libdevice"])
def test_softcap_forward_error_rule(tanh, D, N):
    """Both tanhs within the forward's error rule, and the kernels' outputs within f16's reach of each other."""
    needs_cuda()
    dtype = "f16"
    g, _ = graph("softcap", dtype)
    c = fl.compile(g, "numba-cuda", extra={"tanh": tanh})
    env = bind_dims(g, {"B": 1, "H": 2, "HKV": 1, "M": N, "N": N, "D": D})
    raw = random_inputs(g, env, seed=N + D)
    host = [rounded(x, dtype) for x in raw[:3]]
    assert_error_rule(g, c, env, host, dtype)
    src = c.specialize(dtype, D=D).source
    assert ("tanh_ex2_f32((" in src) == (tanh == "ex2") and ("math.tanh(" in src) == (tanh == "libdevice")


@pytest.mark.parametrize("tier", ["small", "tiny"])
def test_tanh_small_is_its_steps(tier):
    """tanh_small_f32 and tanh_tiny_f32 (the FMA pipe's polynomials, no approximate instruction): bit for bit their
    float32 steps (intrinsics.tanh_small_steps, tanh_tiny_steps) over their ranges, and within 2^-22.5 (tanh_tiny:
    2^-23.2) of tanh(y / (2 log2 e))."""
    needs_cuda()
    from numba import cuda

    from falower.backends.numba_cuda import intrinsics as I

    fn, steps, Y, bound = {"small": (I.tanh_small_f32, I.tanh_small_steps, I.TANH_SMALL_Y, 2.0 ** -22.5),
                           "tiny": (I.tanh_tiny_f32, I.tanh_tiny_steps, I.TANH_TINY_Y, 2.0 ** -23.2)}[tier]

    @cuda.jit
    def run(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = fn(x[i])

    x = np.concatenate([np.linspace(-Y, Y, 400_001), np.logspace(-30, np.log10(Y), 2001)])
    x = x.astype(np.float32)
    dy = cuda.to_device(np.zeros_like(x))
    run[(x.size + 255) // 256, 256](cuda.to_device(x), dy)
    y = dy.copy_to_host()
    want = np.array([steps(v) for v in x[::97]], np.float32)
    assert np.array_equal(y[::97], want)
    err = np.abs(y.astype(np.float64) - np.tanh(x.astype(np.float64) / (2.0 * 1.4426950408889634)))
    print(f"tanh_{tier}_f32: max absolute error {err.max():.3g} (2^{np.log2(err.max()):.2f})")
    assert err.max() <= bound


@pytest.mark.parametrize("N", [17, 1000, 4096])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("scale", [1.0, 2.0, 8.0])
def test_softcap_small_tanh_error_rule(scale, D, N):
    """The softcap with its tiles' tanh by the short polynomial where their scores are within a quarter of the cap
    (|s scale| <= 7.5), by the long one where they are within it (<= 30), by tanh_ex2 elsewhere. Unscaled queries
    keep every scaled score near N(0, 1), in the short one's range; scaled by 2 a score leaves it at ~3.75 sigma,
    scaled by 8 the long one's, so some warps' tiles take each path. Within the forward's error rule, and within
    f16's reach of the kernel without the polynomials (extra tanh_small False)."""
    needs_cuda()
    dtype = "f16"
    g, c = graph("softcap", dtype)
    assert "score_row_small(" in c.specialize(dtype, D=D).source and "score_row_tiny(" in c.specialize(
        dtype, D=D).source
    env = bind_dims(g, {"B": 1, "H": 2, "HKV": 1, "M": N, "N": N, "D": D})
    raw = random_inputs(g, env, seed=N + D + 1)
    raw[0] = raw[0] * scale
    host = [rounded(x, dtype) for x in raw[:3]]
    dev = assert_error_rule(g, c, env, host, dtype)
    o_small = c(*dev)[0].float()
    o_exact = fl.compile(g, "numba-cuda", extra={"tanh_small": False})(*dev)[0].float()
    assert torch.allclose(o_small, o_exact, atol=2e-3, rtol=0)


@pytest.mark.parametrize("D", [64, 128])
def test_softcap_nan_row_beside_large_scores(D):
    """A query row with a NaN (row 0) and one whose scores leave every polynomial's range (row 8, scaled by 40) are
    the same thread's rows g and g + 8: the NaN's vote must send both to tanh_ex2 (score_row_calls votes out of
    range unless max |s| <= the bound), not carry row 8 into a polynomial. Row 0 comes out NaN, every other row as
    the kernel without the polynomials computes it (extra tanh_small False), row 8 included."""
    needs_cuda()
    dtype = "f16"
    g, c = graph("softcap", dtype)
    env = bind_dims(g, {"B": 1, "H": 2, "HKV": 1, "M": 256, "N": 256, "D": D})
    raw = random_inputs(g, env, seed=D + 3)
    q = np.array(raw[0], np.float32)
    q[:, :, 0, 0] = np.nan
    q[:, :, 8, :] *= 40.0
    host = [rounded(x, dtype) for x in (q, raw[1], raw[2])]
    dev = to_device(host, dtype)
    o = c(*dev)[0].float().cpu().numpy()
    exact = fl.compile(g, "numba-cuda", extra={"tanh_small": False})(*dev)[0].float().cpu().numpy()
    assert np.isnan(o[:, :, 0]).all()
    assert np.isfinite(o[:, :, 1:]).all()
    assert np.allclose(o[:, :, 1:], exact[:, :, 1:], atol=2e-3, rtol=0), np.abs(o[:, :, 8] - exact[:, :, 8]).max()
