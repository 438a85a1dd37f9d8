"""Descriptor words (wgmma.desc_word / desc_at) against make_desc, in the CUDA simulator (test_wgmma_simulator.py
starts it with NUMBA_ENABLE_CUDASIM=1): desc_at(hi, desc_word(hi, a) + (off >> 4)) == make_desc(hi, a + off) for
shared addresses up to 227 KB, both kinds of hi the kernels use, and every k-step offset. Prints one JSON line."""

from __future__ import annotations

import json

import numpy as np
from numba import cuda  # the simulator: this script runs with NUMBA_ENABLE_CUDASIM=1

from falower.backends.numba_cuda.wgmma import desc_at, desc_hi, desc_word, make_desc


@cuda.jit
def kernel(hi, addrs, offs, got, want):
    i = cuda.threadIdx.x
    w = desc_word(hi, addrs[i])
    for j in range(offs.shape[0]):
        got[i, j] = desc_at(hi, w + (offs[j] >> 4))
        want[i, j] = make_desc(hi, addrs[i] + offs[j])


def main() -> None:
    rng = np.random.default_rng(0)
    addrs = np.concatenate([[0, 1024, 210 * 1024 + 16], rng.integers(0, 200 * 1024 // 1024, 29) * 1024]).astype(np.int64)
    offs = np.array([0, 32, 64, 96, 8192, 8192 + 96, 6144, 16384 + 32], np.int64)
    bad = 0
    for hi in (desc_hi(16, 1024), desc_hi(8192, 1024), desc_hi(64 * 128, 1024)):
        got = np.zeros((32, len(offs)), np.int64)
        want = np.zeros((32, len(offs)), np.int64)
        kernel[1, 32](np.int64(hi), addrs, offs, got, want)
        bad += int(np.count_nonzero(got != want))
    print(json.dumps({"id": "desc-words", "mismatches": bad, "checked": 3 * 32 * len(offs)}))


if __name__ == "__main__":
    main()
