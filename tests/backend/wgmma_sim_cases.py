"""Simulator cases for test_wgmma_simulator.py (run in a subprocess with NUMBA_ENABLE_CUDASIM=1): the wgmma
emulations inside the probe's kernels (benchmarks/probe_wgmma.py) against numpy. One JSON line per case.

Usage: NUMBA_ENABLE_CUDASIM=1 python wgmma_sim_cases.py [case-id ...]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


def _bits(x: np.ndarray, kind: str) -> np.ndarray:
    """16-bit patterns of x in f16 or bf16 (round to nearest even), and the values they hold as float64."""
    if kind == "f16":
        h = x.astype(np.float16)
        return h.view(np.uint16).reshape(-1), h.astype(np.float64)
    u = x.astype(np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r.reshape(-1), (r.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def case_ss(kind, N, D):
    from probe_wgmma import ss_kernel

    rng = np.random.default_rng(0)
    qb, qv = _bits(rng.standard_normal((64, D)), kind)
    kb, kv = _bits(rng.standard_normal((N, D)), kind)
    out = np.zeros(64 * N, dtype=np.float32)
    kern, sm = ss_kernel(kind, N, D)
    kern[1, 128, 0, sm](qb, kb, out)
    ref = qv @ kv.T
    return float(np.abs(out.reshape(64, N) - ref).max() / np.abs(ref).max())


def case_rs(kind, N, BK):
    from probe_wgmma import rs_kernel

    rng = np.random.default_rng(1)
    pb, pv = _bits(rng.random((64, BK)), kind)
    vb, vv = _bits(rng.standard_normal((BK, N)), kind)
    out = np.zeros(64 * N, dtype=np.float32)
    kern, sm = rs_kernel(kind, N, BK)
    kern[1, 128, 0, sm](pb.view(np.uint32), vb, out)
    ref = pv @ vv
    return float(np.abs(out.reshape(64, N) - ref).max() / np.abs(ref).max())


def case_gemm(BM, BN, K, stages, wait1):
    from probe_wgmma import gemm_kernel

    rng = np.random.default_rng(2)
    M, N = BM * 2, BN
    ab, av = _bits(rng.standard_normal((M, K)), "f16")
    bb, bv = _bits(rng.standard_normal((N, K)), "f16")
    c = np.zeros(M * N // 2, dtype=np.uint32)
    kern, threads, sm = gemm_kernel("f16", BM, BN, stages, wait1, group_m=1)
    kern[(1, N // BN, M // BM), threads, 0, sm](ab.view(np.int16), bb.view(np.int16), c, M, N, K)
    got = c.view(np.float16).astype(np.float64).reshape(M, N)
    ref = av @ bv.T
    return float(np.abs(got - ref).max() / np.abs(ref).max())


CASES = {
    "ss_f16_n64_d128": (case_ss, ("f16", 64, 128), 1e-5),
    "ss_bf16_n32_d64": (case_ss, ("bf16", 32, 64), 1e-5),
    "rs_f16_n128_bk32": (case_rs, ("f16", 128, 32), 1e-5),
    "rs_bf16_n64_bk32": (case_rs, ("bf16", 64, 32), 1e-5),
    "gemm_64x64_k256_s3w1": (case_gemm, (64, 64, 256, 3, True), 2e-3),
    "gemm_128x64_k192_s3w0": (case_gemm, (128, 64, 192, 3, False), 2e-3),
}


def main(ids) -> None:
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
    sys.setswitchinterval(5e-4)
    for cid in ids or CASES:
        fn, args, tol = CASES[cid]
        t0 = time.time()
        try:
            err = fn(*args)
            r = {"id": cid, "err": err, "tol": tol, "ok": err <= tol}
        except Exception as exc:  # report, keep going
            r = {"id": cid, "error": f"{type(exc).__name__}: {exc}"[:2000], "ok": False}
        r["s"] = round(time.time() - t0, 1)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
