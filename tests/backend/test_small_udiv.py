"""emit_fa2.emit_small_udiv: the kernels' quotient without a division instruction (a 64-bit division is a call,
which serializes every wgmma), from a float reciprocal and one correction step each way. Run as Python with the
reciprocal off by up to two float32 ulps either way (rcp.approx.ftz is within one), it must be exact wherever the
kernels use it (n < 2^22)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from falower.backends.numba_cuda.emit_fa2 import _Code, emit_small_udiv


def _quotient_fn(ulps: int):
    """The emitted code as a Python function quotient(n, d), its reciprocal `ulps` float32 steps off."""
    def rcp_approx(x):
        r = np.float32(1) / np.float32(x)
        for _ in range(abs(ulps)):
            r = np.nextafter(r, np.float32(np.inf if ulps > 0 else -np.inf), dtype=np.float32)
        return r

    c = _Code()
    c("def quotient(n, d):")
    with c.indent():
        emit_small_udiv(c, "out", "n", "d")
        c("return out")
    ns: dict = {}
    exec(c.text(), {"np": np, "rcp_approx": rcp_approx}, ns)
    return ns["quotient"]


QUOTIENTS = {ulps: _quotient_fn(ulps) for ulps in range(-2, 3)}


def QUOTIENT(n: int, d: int, ulps: int) -> int:
    return QUOTIENTS[ulps](n, d)


@settings(max_examples=400, deadline=None)
@given(n=st.integers(0, 2**22 - 1), d=st.integers(1, 2**16), ulps=st.integers(-2, 2))
def test_small_udiv_exact(n, d, ulps):
    assert QUOTIENT(n, d, ulps) == n // d


def test_small_udiv_edges():
    """Multiples of d and their neighbours, where a reciprocal a hair low or high lands one off."""
    for d in (1, 2, 3, 7, 16, 32, 127, 132, 1000, 4096, 65535):
        for k in (0, 1, 2, 5, 31, 1000, (2**22 - 1) // d):
            for n in (k * d - 1, k * d, k * d + 1):
                if 0 <= n < 2**22:
                    for ulps in (-2, 0, 2):
                        assert QUOTIENT(n, d, ulps) == n // d, (n, d, ulps)
