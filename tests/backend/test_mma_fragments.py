"""The simulator's m16n8k16 and register-A wgmma operands (intrinsics.frag_halves / frag_a_tile / frag_b_tile, one
array step for the warp) against the PTX fragment layout written out lane by lane: lane (g, t) = (lane >> 2,
lane & 3) holds A[g][2t..2t+1] in a0, A[g+8][2t..] in a1, A[g][2t+8..] in a2, A[g+8][2t+8..] in a3, and
B[2t..2t+1][g] in b0, B[2t+8..2t+9][g] in b1, each word's low half first."""

from __future__ import annotations

import numpy as np
import pytest

from falower.backends.numba_cuda.intrinsics import frag_a_tile, frag_b_tile, frag_halves


def _half(bits: int, kind: str) -> float:
    bits &= 0xFFFF
    if kind == "f16":
        return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])
    return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])


def _by_lane(frags, kind):
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for ln in range(32):
        g, t = ln >> 2, ln & 3
        w = [int(x) & 0xFFFFFFFF for x in frags[ln]]
        pairs = [(_half(x, kind), _half(x >> 16, kind)) for x in w]
        A[g, 2 * t : 2 * t + 2] = pairs[0]
        A[g + 8, 2 * t : 2 * t + 2] = pairs[1]
        A[g, 2 * t + 8 : 2 * t + 10] = pairs[2]
        A[g + 8, 2 * t + 8 : 2 * t + 10] = pairs[3]
        B[2 * t : 2 * t + 2, g] = pairs[4]
        B[2 * t + 8 : 2 * t + 10, g] = pairs[5]
    return A, B


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_fragments_follow_the_ptx_layout(kind: str) -> None:
    rng = np.random.default_rng(3)
    vals = rng.standard_normal((32, 12)).astype(np.float16 if kind == "f16" else np.float32)
    if kind == "f16":
        halves = vals.view(np.uint16).astype(np.uint32)
    else:
        halves = vals.view(np.uint32) >> 16
    words = halves[:, 0::2] | (halves[:, 1::2] << 16)
    # the emitted code hands the words over as np.uint32, np.int32 (negative where the high bit is set) or ints
    frags = [tuple(np.uint32(x) if ln % 3 == 0 else np.int32(np.uint32(x).view(np.int32)) if ln % 3 == 1 else int(x)
                   for x in words[ln]) for ln in range(32)]
    A, B = _by_lane(frags, kind)
    h = frag_halves(frags, kind)
    assert np.array_equal(frag_a_tile(h), A) and np.array_equal(frag_b_tile(h, 4), B)
    assert len(set(A.ravel())) > 200 and len(set(B.ravel())) > 100  # every entry written, none left zero
