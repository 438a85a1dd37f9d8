"""The kernels' size bound: the i32 wraps of their element code (from_ir._ScalarEmitter.expr) are decided for sizes
up to value_ranges.SIZE_MAX, so the runtime refuses larger inputs rather than compute what the IR would not."""

from __future__ import annotations

import numpy as np
import pytest

import falower as fl
from falower.backends.numba_cuda.from_ir import analyse


def test_the_kernels_refuse_sizes_past_the_ranges_bound() -> None:
    """The kernels wrap i32 only where a value can leave it for sizes up to value_ranges.SIZE_MAX (2^24): a larger
    M (here a zero-stride view, no memory) is refused in one line naming it; at the bound itself it passes."""
    from numpy.lib.stride_tricks import as_strided

    from falower.backends.numba_cuda.from_ir import build_spec
    from falower.backends.numba_cuda.runtime import FA2ForwardKernel
    from falower.ir.value_ranges import SIZE_MAX

    kern = FA2ForwardKernel.__new__(FA2ForwardKernel)
    kern.spec = build_spec(analyse(fl.lower(fl.attention(name="plain"), "fa2-fwd")), {"D": 64}, "f16", "mma", None)
    base = np.zeros(64, np.float16)
    for m, ok in ((SIZE_MAX, True), (SIZE_MAX + 1, False)):
        q = as_strided(base, (1, 1, m, 64), (0, 0, 0, 2))
        k = as_strided(base, (1, 1, 3, 64), (0, 0, 0, 2))
        if ok:
            assert kern._check(q, k, k, ()) == "numpy"
        else:
            with pytest.raises(ValueError, match=r"^M is 16777217: the kernels take sizes up to 2\^24"):
                kern._check(q, k, k, ())


def test_a_nan_constant_builds() -> None:
    """A NaN constant in a score was emitted as `np.float32(nan)`, a NameError when the module loads (a review).
    Not one purpose with the sizes above, but the same family: what the kernels' element code cannot express."""
    from falower.backends.numba_cuda.from_ir import device_source

    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + fl.where(kv == 3, float("nan"), 0.0), name="nanc")
    from types import SimpleNamespace

    ns: dict = {"np": np, "math": __import__("math"), "cuda": SimpleNamespace(fma=lambda a, b, c: a * b + c)}
    exec(device_source(analyse(fl.lower(g, "fa2-fwd")), {"D": 64}), ns)
    assert np.isnan(ns["score_fn"](np.float32(1.0), 0, 0, 0, 3)) and np.isfinite(ns["score_fn"](np.float32(1.0), 0, 0, 0, 2))
