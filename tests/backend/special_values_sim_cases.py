"""Kernels against the IR at special values (a review's findings, each failing before its fix), in the CUDA simulator
(run by test_special_values_simulator.py): a NaN entry a score's maximum / minimum reads (numpy's NaN-propagating
maximum is the IR's; Python's max and CUDA's fmaxf return the other operand), a row a NaN score reached (LSE NaN,
as the IR's; the kernels wrote -inf, a fully masked row's marker), fl.sign of a float NaN (NaN, not 0) and of
floats at all (the simulator raised on its bool subtraction), log(0) and sqrt of a negative (the simulator's math
module raised where the GPU's libdevice gives -inf and NaN), a dS past f16's range (run_sharp). Forward and backward through falower.compile at 16 x
16 tiles, against the lowered functions interpreted in float64: NaN exactly where the IR has it, the rest close."""

from __future__ import annotations

import sys

import numpy as np  # noqa: E402
from sim_script import run_main  # noqa: E402

FWD = "decompose-softmax,canonicalize,fuse,tile{bq=16,bk=16},online-softmax{exp2=true},mask-tiles,score-licm,canonicalize"
BWD = "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize,tile-bwd{bq=16,bk=16,dq=atomic},canonicalize"


def _graph(case: str):
    import falower as fl

    bias = fl.capture("bias", "f32", "H,M,N")
    mods = {"max": lambda s, b, h, q, kv: fl.maximum(s, bias[h, q, kv]),
            "max_rev": lambda s, b, h, q, kv: fl.maximum(bias[h, q, kv], s),
            "min": lambda s, b, h, q, kv: fl.minimum(s, bias[h, q, kv] + 3.0),
            "sign": lambda s, b, h, q, kv: s + fl.sign(bias[h, q, kv]),
            "plain_nan": lambda s, b, h, q, kv: s + bias[h, q, kv],
            # log(0) = -inf (an additive log-mask) and sqrt(-x) = NaN: the simulator's math module raised on both
            "logmask": lambda s, b, h, q, kv: s + fl.log(fl.where(bias[h, q, kv] > 0.0, 1.0, 0.0)),
            "sqrtneg": lambda s, b, h, q, kv: s + fl.sqrt(bias[h, q, kv] + 1.0)}
    return fl.attention(score_mod=mods[case], name=f"sv_{case}")


def run_case(case: str) -> dict:
    import falower as fl
    from falower.ir.interp import Interpreter

    g = _graph(case)
    r = np.random.default_rng(0)
    q, k, v = (r.standard_normal((1, 1, n, 16)).astype(np.float16) for n in (20, 19, 19))
    bt = (r.standard_normal((1, 20, 19)) * 0.5).astype(np.float32)
    bt[0, 4, 3] = np.nan  # row 4 reads a NaN entry
    bt[0, 7, :] = 0.0  # sign at 0 (and -0.0)
    bt[0, 7, 5] = -0.0
    c = fl.compile(g, "numba-cuda", pipeline=FWD, backward=BWD, path="mma")
    o, lse = (np.asarray(x, np.float64) for x in c(q, k, v, bt))
    ro, rl = (np.asarray(x, np.float64) for x in Interpreter("f64").run(c.lowered, [q, k, v, bt]))
    out = {"id": case, "o_nan_same": bool(np.array_equal(np.isnan(o), np.isnan(ro))),
           "lse_nan_same": bool(np.array_equal(np.isnan(lse), np.isnan(rl))),
           "lse_ninf_same": bool(np.array_equal(np.isneginf(lse), np.isneginf(rl))),
           "ref_nan_rows": int(np.isnan(rl).sum())}
    ok = ~np.isnan(ro)
    out["o_err"] = float(np.max(np.abs(o[ok] - ro[ok]))) if ok.any() else 0.0
    okl = np.isfinite(rl)
    out["lse_err"] = float(np.max(np.abs(lse[okl] - rl[okl]))) if okl.any() else 0.0
    o16, l32 = ro.astype(np.float16), rl.astype(np.float32)  # the backward fed the IR's own O and LSE
    do = np.random.default_rng(5).standard_normal(o16.shape).astype(np.float16)
    got = c.backward(q, k, v, o16, l32, do, bt)
    by = {"q": q, "k": k, "v": v, "bias": bt, "o": o16, "lse": l32, "do": do}
    want = Interpreter("f64").run(c.lowered_backward, [by[a.name] for a in c.lowered_backward.args])
    out["grads"] = {}
    for name, a, b in zip(c.gradient_names(), got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        fin = ~np.isnan(b)
        out["grads"][name] = {"nan_same": bool(np.array_equal(np.isnan(a), np.isnan(b))),
                              "err": float(np.max(np.abs(a[fin] - b[fin]))) if fin.any() else 0.0,
                              "scale": float(np.max(np.abs(b[fin]))) if fin.any() else 0.0}
    return out


def run_sharp(case: str) -> dict:
    """A score_mod 1e7 times sharper than the product (q ~ 3e-5, k rows ~1 + 0.002 noise: the softmax is not
    saturated and dq, dk stay in f16's range): dS ~1e5 is past f16's 65504. The kernels round dS to f16 for dS @ K
    and dS^T @ Q (inf, then inf - inf = NaN); the IR says so by its products' operand_dtype, which the native
    interpreter honours (f64, the exact reference, keeps dq finite). Before operand_dtype the native IR was finite."""
    import falower as fl
    from falower.ir.interp import Interpreter

    g = fl.attention(score_mod=lambda s, b, h, q, kv: s * 1e7, name="sv_sharp")
    r = np.random.default_rng(0)
    q = (r.standard_normal((1, 1, 20, 16)) * 3e-5).astype(np.float16)
    k = (1.0 + 0.002 * r.standard_normal((1, 1, 19, 16))).astype(np.float16)
    v = r.standard_normal((1, 1, 19, 16)).astype(np.float16)
    c = fl.compile(g, "numba-cuda", pipeline=FWD, backward=BWD, path="mma")
    o, lse = (np.asarray(x) for x in Interpreter("native").run(c.lowered, [q, k, v]))
    rows = np.where(np.arange(20) < 8, 1.0, 1e-3)[:, None]  # dO's rows 8.. small: their dS stays in f16's range
    do = (r.standard_normal(o.shape) * rows).astype(np.float16)
    got = c.backward(q, k, v, o.astype(np.float16), lse.astype(np.float32), do)
    by = {"q": q, "k": k, "v": v, "o": o.astype(np.float16), "lse": lse.astype(np.float32), "do": do}
    args = [by[a.name] for a in c.lowered_backward.args]
    with np.errstate(all="ignore"):
        native = Interpreter("native").run(c.lowered_backward, args)
        exact = Interpreter("f64").run(c.lowered_backward, args)
    out: dict = {"id": case, "grads": {}, "dq_nonfinite_rows": []}
    for name, a, n, e in zip(c.gradient_names(), got, native, exact):
        a, n, e = (np.asarray(x, np.float64) for x in (a, n, e))
        fin = np.isfinite(n)
        out["grads"][name] = {"nonfinite_same": bool(np.array_equal(~np.isfinite(a), ~fin)),
                              "nan_same": bool(np.array_equal(np.isnan(a), np.isnan(n))),
                              "nonfinite": int((~fin).sum()), "exact_nonfinite": int((~np.isfinite(e)).sum()),
                              "err": float(np.max(np.abs(a[fin] - n[fin]))) if fin.any() else 0.0,
                              "ir_err": float(np.max(np.abs(e[fin] - n[fin]))) if fin.any() else 0.0,
                              "scale": float(np.max(np.abs(n[fin]))) if fin.any() else 0.0}
        if name == "dq":
            out["dq_nonfinite_rows"] = [int(i) for i in np.nonzero((~np.isfinite(a)).any(axis=(0, 1, 3)))[0]]
    return out


def run_any(case: str) -> dict:
    return run_sharp(case) if case == "sharp" else run_case(case)


CASES = ["max", "max_rev", "min", "sign", "plain_nan", "logmask", "sqrtneg"]
OVERFLOW_CASES = ["sharp"]
NAN_ROWS = {"logmask": 0, "sqrtneg": None}  # the IR's NaN rows (None: some); the rest: the one row that read NaN

if __name__ == "__main__":
    run_main([c for c in CASES + OVERFLOW_CASES if not sys.argv[1:] or c in sys.argv[1:]], run_any)
