"""The wgmma forward kernel (emit_fa3.py) in the CUDA simulator against the float64 reference (fa3_sim_cases.py,
one subprocess: the simulator must be on before numba.cuda is imported); and its PTX for sm_90a (no GPU)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import FORWARD_O_TOL as TOL, run_cases  # noqa: E402
from fa3_sim_cases import API_CASES, CASES, RUNTIME_CASES  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases("fa3_sim_cases.py", tmp_path_factory.mktemp("kernels"))


@pytest.mark.parametrize("case", sorted(CASES) + sorted(RUNTIME_CASES) + sorted(API_CASES))
def test_fa3_simulator(results, case):
    r = results.get(case)
    assert r is not None and "error" not in r, r
    assert r.get("wgmma", True), r  # the API cases ran the wgmma kernel
    if case.startswith(("api-document", "api-nested")):  # row bounds from tables: read once, before the kv loop
        assert r["bounds_hoisted"] and r["block_mask"] == ("list" if "document" in case else "table"), r
    assert not r["nan"], r
    assert r.get("masked_ok", True), r
    assert r["o_err"] <= TOL[r["dtype"]], r
    assert r["lse_err"] <= 1e-3, r


@pytest.mark.slow
@pytest.mark.parametrize("variant, D", [("plain", 128), ("causal", 64)])
def test_fa3_ptx(variant, D, tmp_path, monkeypatch):
    """wgmma count per kv tile, no local memory, no f64, and no calls: ptxas serializes every wgmma of a
    function with a call in it (C7509), and an IEEE division or a 64-bit division by a run-time value is one."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("PTX checks need the real CUDA target")
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from variants import make_spec

    from falower.backends.numba_cuda import emit_fa3
    from falower.backends.numba_cuda.runtime import FA2ForwardKernel, load_source, ptx_of, resource_usage

    spec = make_spec(variant, D, "f16", path="mma", block_q=128, block_k=128, num_warps=8,
                     name=f"fa3_ptx_{variant}_{D}")
    kern = getattr(load_source(emit_fa3.emit_fa3_forward(spec), spec.name), spec.name)
    argtypes = FA2ForwardKernel.argtypes(type("Holder", (), {"spec": spec})())
    ptx = ptx_of(kern, argtypes, (9, 0))
    n_s = ptx.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16")  # S = Q K^T (block_k = 128)
    n_o = ptx.count(f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.f16.f16")  # O += P V (n = D)
    assert (n_s, n_o) == ((D // 16, 128 // 16) if D != 128 else (D // 16 + 128 // 16,) * 2), (n_s, n_o)
    assert not re.search(r"\.f64\b", ptx)
    assert not re.search(r"\b(ld|st)\.local\b", ptx)
    assert not re.search(r"\bcall\b|\brcp\.rn\b|\bdiv\.[su]64\b", ptx)
    try:
        usage = resource_usage(ptx.replace(".target sm_90\n", ".target sm_90a\n"), "sm_90a")
    except Exception as exc:
        pytest.skip(f"nvJitLink unavailable: {exc}")
    assert "C7509" not in usage["log"], usage["log"]
    assert usage["spill_stores"] == 0, usage["log"]
