"""The wgmma emulations (falower/backends/numba_cuda/wgmma.py) in the CUDA simulator, against numpy.

The kernels are the GPU probe's (benchmarks/probe_wgmma.py), so the code the simulator checks is the code the
H100 runs: S = Q K^T from two 128 B-swizzled K-major descriptors (D = 128 crosses a 64-column block), O = P V
with P in registers and V MN-major, and the cp.async-pipelined GEMM. Cases run in one subprocess
(wgmma_sim_cases.py) because the simulator must be on before numba.cuda is imported.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import collect, run_cases, spawn  # noqa: E402
from wgmma_sim_cases import CASES  # noqa: E402


@pytest.fixture(scope="module")
def results():
    return run_cases("wgmma_sim_cases.py")


@pytest.mark.parametrize("case", sorted(CASES))
def test_wgmma_emulation(results, case):
    r = results.get(case)
    assert r is not None, f"case {case} produced no result"
    assert r["ok"], r


def test_descriptor_words_equal_make_desc():
    """The kernels' K / V descriptors are one 32-bit word plus (offset >> 4) a k step (desc_word, desc_at): equal to
    make_desc of the offset address, for every hi the kernels use and addresses over all of shared memory."""
    r = collect(spawn("desc_cases.py"), timeout=300)["desc-words"]
    assert r["checked"] == 768 and r["mismatches"] == 0, r


def test_descriptor_layouts():
    """The descriptor decoding the emulations use, on its own: K-major and MN-major 128 B swizzle."""
    from falower.backends.numba_cuda.wgmma import desc_hi, operand_addresses

    # K-major: rows 128 B apart inside an 8-row atom, atoms SBO = 1024 apart, chunk XOR (row & 7)
    desc = desc_hi(16, 1024) | ((4096 + 32) >> 4)
    addr = operand_addresses(desc, 16, "k")
    for r in range(16):
        for k in range(16):
            chunk = (32 + 2 * k) // 16
            want = 4096 + r * 128 + ((chunk ^ (r & 7)) << 4) + (2 * k) % 16
            assert addr[r, k] == want
    # MN-major: 64 elements of a row contiguous (swizzled), 64-wide blocks LBO apart, k groups of 8 SBO apart
    desc = desc_hi(64 * 128, 1024) | (2048 >> 4)
    addr = operand_addresses(desc, 128, "mn")
    for n in (0, 9, 63, 64, 100, 127):
        for k in range(16):
            row = 16 + k  # start 2048 = row 16 of the first block
            want = (n // 64) * 64 * 128 + row * 128 + ((((n % 64) // 8) ^ (row & 7)) << 4) + (n % 8) * 2
            assert addr[n, k] == want, (n, k)
    assert np.all(operand_addresses(desc, 8, "mn") % 2 == 0)


def test_factories_validate():
    from falower.backends.numba_cuda import wgmma

    with pytest.raises(ValueError):
        wgmma.wgmma_ss("f32", 64)
    with pytest.raises(ValueError):
        wgmma.wgmma_rs("f16", 12)
    with pytest.raises(ValueError):
        wgmma.desc_hi(8, 1024)
