"""tanh_ex2_f32 (intrinsics.py): the IR's tanh in the tensor-core kernels, 1 - 2 / (1 + 2**y) with y = 2 log2(e) x
merged into the argument's constant factor by from_ir. Its float32 steps (the simulator's version) against float64
tanh, the values at the ends, the PTX's constants, and which kernels take it (from_ir.tanh_by_ex2). The hardware's
error is bounded on the GPU (tests/gpu/test_tanh_approx_gpu.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import falower as fl
from falower.backends.numba_cuda import intrinsics as I
from falower.backends.numba_cuda.from_ir import TWO_LOG2E, BackendError, tanh_by_ex2


def steps(x):
    return np.array([I.tanh_ex2_steps(np.float32(v) * np.float32(TWO_LOG2E)) for v in np.asarray(x, np.float32)],
                    dtype=np.float64)


def test_absolute_error_over_a_sweep():
    """|steps - tanh| <= 2**-22 from tiny |x| to saturation (the kernels' scores take the error as absolute)."""
    x = np.concatenate([np.linspace(-12, 12, 48001), np.logspace(-30, 0, 2001), -np.logspace(-30, 0, 2001)])
    got = steps(x)
    want = np.tanh(x.astype(np.float32).astype(np.float64))
    assert np.max(np.abs(got - want)) <= 2.0 ** -22
    assert np.all(np.abs(got) <= 1.0)


@pytest.mark.parametrize("y, want", [(np.inf, 1.0), (-np.inf, -1.0), (200.0, 1.0), (-200.0, -1.0), (0.0, 0.0)])
def test_ends(y, want):
    """Saturation gives exactly +-1 (2**y = inf: r = 0; 2**y = 0: r = 1), y = 0 exactly 0."""
    assert I.tanh_ex2_steps(np.float32(y)) == np.float32(want)


def test_nan_stays_nan():
    assert np.isnan(I.tanh_ex2_steps(np.float32(np.nan)))


def test_ptx_is_the_steps():
    ptx = I.TANH_EX2_PTX
    consts = [float(np.array([int(h, 16)], dtype=np.uint32).view(np.float32)[0])
              for h in re.findall(r"0f([0-9A-F]{8})", ptx)]
    assert consts == [1.0, -2.0, 1.0]
    ops = re.findall(r"\b(ex2|add|rcp|fma)\.[a-z0-9.]+", ptx)
    assert ops == ["ex2", "add", "rcp", "fma"]
    assert "tanh" not in ptx


def test_which_kernels_take_it():
    assert tanh_by_ex2("mma", None) and tanh_by_ex2("mma", {"tanh": "ex2"})
    assert not tanh_by_ex2("mma", {"tanh": "libdevice"})
    assert not tanh_by_ex2("simt", None)
    with pytest.raises(BackendError, match=r"extra\['tanh'\] must be 'ex2' or 'libdevice', got 'fast'"):
        tanh_by_ex2("mma", {"tanh": "fast"})


def _softcap(cap: float = 30.0) -> fl.Func:
    return fl.attention(score_mod=lambda s, b, h, q, kv: cap * fl.tanh(s / cap), name="softcap")


@pytest.mark.parametrize("D", [64, 128])
def test_the_argument_factor_is_merged(D):
    """softcap: tanh(s * scale / 30) becomes one multiply by scale / 30 * 2 log2(e) into tanh_ex2_f32, in the
    forward's score and the backward's recomputation of P; the SIMT kernels (f32) keep libdevice's tanhf."""
    pytest.importorskip("numba")
    c = fl.compile(_softcap(), "numba-cuda")
    k = float(np.float32(float(np.float32(D ** -0.5 / 30.0)) * TWO_LOG2E))
    fwd = c.specialize("f16", D=D).source
    bwd = c._backward_kernel_and_dims_for("f16", D).source
    for src in (fwd, bwd):
        assert f"tanh_ex2_f32((s * np.float32({k!r})))" in src
        assert "tanh_f32(" not in src
    if D == 64:  # the SIMT kernel's default tiles hold D = 64 in its 48 KB of shared memory
        f32 = c.specialize("f32", D=D).source
        assert "tanh_f32(" in f32 and "tanh_ex2_f32((" not in f32  # libdevice's tanhf
