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


def sharp_graph():
    import falower as fl

    return fl.attention(score_mod=lambda s, b, h, q, kv: s * 1e7, name="sv_sharp")


def sharp_inputs(B: int, H: int, M: int, N: int, D: int, sharp_rows: int, seed: int = 0):
    """q ~ 3e-5, k's rows ~1 + 0.002 noise (the score 1e7 times sharper is not saturated, and dq and dk stay in
    f16's range), dO's rows past `sharp_rows` 1000 times smaller (their dS stays in f16's range; the first rows'
    dS ~1e5 is past 65504)."""
    r = np.random.default_rng(seed)
    q = (r.standard_normal((B, H, M, D)) * 3e-5).astype(np.float16)
    k = (1.0 + 0.002 * r.standard_normal((B, H, N, D))).astype(np.float16)
    v = r.standard_normal((B, H, N, D)).astype(np.float16)
    rows = np.where(np.arange(M) < sharp_rows, 1.0, 1e-3)[:, None]
    do = (r.standard_normal((B, H, M, D)) * rows).astype(np.float16)
    return q, k, v, do


def run_sharp(case: str) -> dict:
    """A dS past f16's 65504 (sharp_inputs). The kernels round dS to f16 for dS @ K and dS^T @ Q (inf, then
    inf - inf = NaN); the IR says so by its products' operand_dtype, which the native interpreter honours (f64,
    the exact reference, keeps dq finite). Before operand_dtype the native IR was finite."""
    import falower as fl
    from falower.ir.interp import Interpreter

    q, k, v, do = sharp_inputs(1, 1, 20, 19, 16, 8)
    c = fl.compile(sharp_graph(), "numba-cuda", pipeline=FWD, backward=BWD, path="mma")
    o, lse = (np.asarray(x) for x in Interpreter("native").run(c.lowered, [q, k, v]))
    o, lse = o.astype(np.float16), lse.astype(np.float32)
    got = c.backward(q, k, v, o, lse, do)
    by = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do}
    out: dict = {"id": case, **compare_with_native(c.lowered_backward, [by[a.name] for a in c.lowered_backward.args],
                                                   c.gradient_names(), got)}
    return out


def compare_with_native(bwd, args, names, got) -> dict:
    """Each gradient's non-finite entries against the native IR's (and the f64 IR's: none), the rest's error, the
    native IR's own error from f64 at those entries, and dq's non-finite rows."""
    from falower.ir.interp import Interpreter

    with np.errstate(all="ignore"):
        native = Interpreter("native").run(bwd, args)
        exact = Interpreter("f64").run(bwd, args)
    out: dict = {"grads": {}, "dq_nonfinite_rows": []}
    for name, a, n, e in zip(names, got, native, exact):
        a, n, e = (np.asarray(x, np.float64) for x in (a, n, e))
        fin = np.isfinite(n)
        out["grads"][name] = {"nonfinite_same": bool(np.array_equal(~np.isfinite(a), ~fin)),
                              "nan_same": bool(np.array_equal(np.isnan(a), np.isnan(n))),
                              "nonfinite": int((~fin).sum()), "exact_nonfinite": int((~np.isfinite(e)).sum()),
                              "err": float(np.max(np.abs(a[fin] - n[fin]))) if fin.any() else 0.0,
                              "ir_err": float(np.max(np.abs(e[fin] - n[fin]))) if fin.any() else 0.0,
                              "scale": float(np.max(np.abs(n[fin]))) if fin.any() else 0.0}
        if name == "dq":
            out["dq_nonfinite_rows"] = sorted({int(i) for i in np.nonzero(~np.isfinite(a))[2]})
    return out


def assert_as_native(r: dict, sharp_rows: int) -> None:
    """compare_with_native's result: dq non-finite on the sharp rows only, dk somewhere, dv nowhere, each gradient's
    non-finite entries (and NaNs) the native IR's, none in the f64 IR, the rest as close to the native IR as the
    native IR is to f64 (dq's finite rows cancel, k's rows ~1: f16's dS rounding moves them ~1 in 19)."""
    g = r["grads"]
    assert r["dq_nonfinite_rows"] == list(range(sharp_rows)), r
    assert g["dk"]["nonfinite"] > 0 and g["dv"]["nonfinite"] == 0, g
    for name, x in g.items():
        assert x["exact_nonfinite"] == 0, (name, x)
        assert x["nonfinite_same"] and x["nan_same"], (name, x)
        assert x["err"] <= 2 * x["ir_err"] + 4e-3 * max(1.0, x["scale"]), (name, x)


def run_any(case: str) -> dict:
    return run_sharp(case) if case == "sharp" else run_case(case)


CASES = ["max", "max_rev", "min", "sign", "plain_nan", "logmask", "sqrtneg"]
OVERFLOW_CASES = ["sharp"]
NAN_ROWS = {"logmask": 0, "sqrtneg": None}  # the IR's NaN rows (None: some); the rest: the one row that read NaN

if __name__ == "__main__":
    run_main([c for c in CASES + OVERFLOW_CASES if not sys.argv[1:] or c in sys.argv[1:]], run_any)
