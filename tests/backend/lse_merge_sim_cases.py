"""Simulator cases for test_lse_merge_simulator.py: the LSE merge kernel (backends/numba_cuda/lse_merge.py) against
the interpreter's lse_merge_func in float64, in a subprocess with NUMBA_ENABLE_CUDASIM=1. One JSON line per case:
the largest error of O and of the finite LSEs, and whether the rows every part left at -inf came back LSE -inf and
O 0. Parts with no key (LSE -inf, O 0) and rows no part saw are in every case; D is a multiple of 4 in three (a
thread's 16-byte load of four f32 a part, merge_vec) and not in one (an element a thread), and the rows' threads
fill one block partly in some and spill into a second in another.

Usage: NUMBA_ENABLE_CUDASIM=1 python lse_merge_sim_cases.py [case-id ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from sim_script import run_main  # noqa: E402

# id: (P, B, H, M, D, out dtype)
CASES = {
    "p2-f32": (2, 1, 2, 5, 40, "f32"),
    "p1-f32": (1, 1, 1, 3, 8, "f32"),
    "p3-f16": (3, 2, 1, 7, 64, "f16"),
    "p5-bf16": (5, 1, 3, 2, 33, "bf16"),
}
TOL = {"f32": 1e-6, "f16": 1e-3, "bf16": 8e-3}  # relative to 1 + |O|: the output's rounding


def run_case(case_id: str) -> dict:
    from falower.backends.numba_cuda.lse_merge import lse_merge
    from falower.ir import interpret
    from falower.ir.lse_merge import lse_merge_func

    P, B, H, M, D, dt = CASES[case_id]
    rng = np.random.default_rng(sum(map(ord, case_id)))
    o = rng.standard_normal((P, B, H, M, D)).astype(np.float32)
    lse = (rng.standard_normal((P, B, H, M)) * 4).astype(np.float32)
    lse[0, 0, 0, 0] = -np.inf  # a part with no key in this row
    o[0, 0, 0, 0] = 0.0
    lse[:, 0, -1, -1] = -np.inf  # a row no part saw
    o[:, 0, -1, -1] = 0.0
    got_o, got_l = lse_merge(o, lse, dt)
    want_o, want_l = interpret(lse_merge_func(P, "f32"), [o.astype(np.float64), lse.astype(np.float64)], "f64",
                               {"B": B, "H": H, "M": M, "D": D})
    fin = np.isfinite(want_l)
    return {"id": case_id, "dtype": dt, "tol": TOL[dt], "out_dtype": str(got_o.dtype), "shape": list(got_o.shape),
            "o_err": float(np.max(np.abs(got_o.astype(np.float64) - want_o) / (1 + np.abs(want_o)))),
            "lse_err": float(np.max(np.abs(got_l[fin] - want_l[fin]), initial=0.0)),
            "unseen_ok": bool(np.isneginf(got_l[0, -1, -1]) and (got_o[0, -1, -1] == 0).all()
                              and np.array_equal(np.isneginf(got_l), ~fin)),
            "nan": bool(np.isnan(got_o.astype(np.float64)).any() or np.isnan(got_l).any())}


def run_nan_case(case_id: str) -> dict:
    """A part whose LSE is NaN in one row and +inf in another (a NaN or +inf score reached it): the IR's merge gives
    those rows NaN O and LSE; the kernel gave LSE -inf (its `s > 0` test), a fully masked row's marker."""
    from falower.backends.numba_cuda.lse_merge import lse_merge
    from falower.ir import interpret
    from falower.ir.lse_merge import lse_merge_func

    P, B, H, M, D = 3, 1, 1, 4, 8
    rng = np.random.default_rng(7)
    o = rng.standard_normal((P, B, H, M, D)).astype(np.float32)
    lse = rng.standard_normal((P, B, H, M)).astype(np.float32)
    lse[1, 0, 0, 1] = np.nan
    lse[0, 0, 0, 2] = np.inf
    got_o, got_l = lse_merge(o, lse, "f32")
    want_o, want_l = interpret(lse_merge_func(P, "f32"), [o.astype(np.float64), lse.astype(np.float64)], "f64",
                               {"B": B, "H": H, "M": M, "D": D})
    ok = np.isfinite(want_l)
    return {"id": case_id, "lse_nan_same": bool(np.array_equal(np.isnan(got_l), np.isnan(want_l))),
            "o_nan_same": bool(np.array_equal(np.isnan(got_o), np.isnan(want_o))),
            "want_nan_rows": int(np.isnan(want_l).sum()),
            "lse_err": float(np.max(np.abs(got_l[ok] - want_l[ok]))),
            "o_err": float(np.max(np.abs(got_o[..., ok, :] - want_o[..., ok, :])))}


def main(ids) -> None:
    run_main(ids or list(CASES) + ["nan-parts"], lambda c: run_nan_case(c) if c == "nan-parts" else run_case(c))


if __name__ == "__main__":
    main(sys.argv[1:])
