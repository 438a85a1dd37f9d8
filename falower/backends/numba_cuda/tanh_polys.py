"""The odd polynomials the tensor-core kernels take for tanh where a tile's scores allow it, without Numba: from_ir
writes its bounds and folded coefficients into a kernel's source, intrinsics builds its PTX from them.

Each is tanh(y / (2 log2 e)) = y R(y^2) for |y| <= its range, y in tanh_ex2's units (from_ir folds 2 log2 e into
the argument's multiply), R's coefficients lowest first, fitted for absolute error by Lawson's minimax iteration and
rounded to f32. Their errors through the f32 steps: tests/backend/test_tanh_small.py."""

from __future__ import annotations

import math

# tanh_small: |y| <= 2 log2 e (|tanh's argument| <= 1), R of degree 6: 1.46e-7 (2**-22.7), 8 instructions
TANH_SMALL_Y = 2.0 * 1.4426950408889634
TANH_SMALL_POLY = (0.34657347202301025, -0.013875526376068592, 0.0006659904029220343, -3.199020284228027e-05,
                   1.4408163906409754e-06, -5.15656566335565e-08, 1.0030335451105543e-09)

# tanh_tiny: |y| <= log2(e) / 2 (|tanh's argument| <= 1/4), R of degree 2, its first coefficient pinned to
# 1 / (2 log2 e) so that tiny |y| stay relatively exact: 9.9e-8 (2**-23.26), 4 instructions
TANH_TINY_Y = 0.5 * 1.4426950408889634
TANH_TINY_POLY = (0.3465735912322998, -0.013871696777641773, 0.000642322120256722)

_F32_MIN_SAFE = 2.0 ** -100  # a folded coefficient this small would lose digits to f32's subnormals
_F32_MAX_SAFE = 2.0 ** 100


def f32(v: float) -> float:
    """v rounded to the nearest f32, as a Python float."""
    import struct

    return struct.unpack("f", struct.pack("f", v))[0]


def folded(poly: tuple, k: float):
    """The coefficients of s R'(s^2) = (s k) R((s k)^2), R' = k^(2i+1) R_i rounded to f32, so that a kernel computes
    tanh(s k / (2 log2 e)) without the multiply by k; None where one would leave f32's comfortable range."""
    out = tuple(f32(c * k ** (2 * i + 1)) for i, c in enumerate(poly))
    if not all(math.isfinite(c) and _F32_MIN_SAFE <= abs(c) <= _F32_MAX_SAFE for c in out):
        return None
    return out
