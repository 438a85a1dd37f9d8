"""PTX of the backward's tensor-core kernel, compiled for sm_90 without a GPU (numba-cuda's NVVM wheels)."""

from __future__ import annotations

import os
import re
import runpy
from pathlib import Path

import pytest

pytest.importorskip("numba.cuda")
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("PTX checks need the real CUDA target, not the simulator", allow_module_level=True)

import falower as fl  # noqa: E402
from falower.backends.numba_cuda import resource_usage  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))


def _kernel(stem: str, D: int, dtype: str):
    g = next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))
    c = fl.compile(g, "numba-cuda")
    return c._backward_kernel_and_dims_for(dtype, D)


@pytest.mark.slow
# One kernel (a PTX build takes 60-90 s on CI's two cores); bf16, D = 128 and captured tables are exercised by
# the simulator cases and on the GPU (tests/gpu/test_backward_gpu.py).
@pytest.mark.parametrize("stem, D, dtype, max_spill", [("causal", 64, "f16", 96)])
def test_backward_mma_ptx(stem, D, dtype, max_spill):
    """Five products per tile pair on the tensor cores (S^T, dP^T, dV, dK: (64/16) * (64/8) or (D/16) * 8 each;
    dQ (64/16) * (D/8)), no f64, no local arrays; ptxas spills bounded by what was measured on 2026-11-23
    (64 x 128 tiles with the strides as kernel arguments: causal f16 D=64 72 bytes, alibi bf16 D=64 96, plain
    f16 D=128 248: dK and dV accumulators (D/2 each) live beside S^T and dP^T; the H100 timing did not move)."""
    kern = _kernel(stem, D, dtype)
    ptx = kern.ptx(cc=(9, 0))
    n_mma = len(re.findall(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\." + dtype, ptx))
    assert n_mma == 2 * (D // 16) * 8 + 2 * 4 * (D // 8) + 4 * (D // 8), n_mma
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert "cp.async.cg.shared.global" in ptx
    assert re.search(r"\bred\.global\.add\.v4\.f32\b", ptx), "dQ's vector reductions are missing"
    assert not re.search(r"\.f64\b", ptx), "f64 arithmetic in the kernel"
    assert not re.search(r"\b(ld|st)\.local\b", ptx), "local memory in the kernel"
    try:
        usage = resource_usage(ptx, "sm_90")
    except Exception as exc:  # nvJitLink missing or unable to run here
        pytest.skip(f"nvJitLink unavailable: {exc}")
    assert usage["spill_stores"] <= max_spill, usage["log"]
    assert 0 < usage["registers"] <= 255
