"""Every example's backward through falower.compile in the CUDA simulator (run in a subprocess with
NUMBA_ENABLE_CUDASIM=1 by test_backward_simulator.py). Prints one JSON line per case.

The backward kernels are fed the reference's O and LSE and a random dO; their gradients are compared with
the backward function's own IR interpreted in float64 on the same (rounded) inputs: the kernel must compute
the program the IR says, tile classes, bounds and captured tables' gradients included.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.setswitchinterval(5e-4)

import numpy as np  # noqa: E402
from sim_script import example_graph, run_main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
BWD = "autodiff,decompose-softmax,canonicalize,delta,recompute,canonicalize,tile-bwd{{bq={t},bk={tk},dq={dq}}},canonicalize"
DQ = {"atomic": "atomic", "det": "separate,deterministic=true"}
FWD = "decompose-softmax,canonicalize,fuse,tile{bq=32,bk=16},online-softmax{exp2=true},mask-tiles,score-licm,canonicalize"


def _two_tables():
    """Two tables of different ranks whose gradients the IR adds in the other order than the function returns them
    (the score reads b1 first, the scatters add db2 first): the deterministic kernel once read b1's indices in b2
    (IndexError), or swapped two tables' gradients of one rank; and the simulator's configured parts-sum launches
    took the last table's grid for both (dispatcher[config] returns itself there)."""
    import falower as fl

    b1 = fl.capture("b1", "f32", "H,M,N")
    b2 = fl.capture("b2", "f32", "M,N")
    return fl.attention(score_mod=lambda s, b, h, q, kv: s + b1[h, q, kv] * 0.5 + b2[q, kv] * 2.0, name="two_tables")


def _temperature(kind: str):
    """A learned 0-d temperature read through div, sub, exp (`s / t`, `s - t`, `s * exp(t)`): autodiff's gradient
    is -sum(...) or sum(...) * exp(t), which tile-bwd once refused ('a reduce_sum ... that is neither a captured
    tensor's gradient') where only `s * t` and `s + t` lowered; it now takes the neg or the factor inside the sum.
    'cap' (t read twice) lowers in the IR and the kernels refuse it in words."""
    import falower as fl

    t = fl.capture("temp", "f32", "")
    if kind in ("idx", "invidx"):  # an entry of a [4] table at a constant index: once 'cannot move squeeze to tiles'
        t4 = fl.capture("temp", "f32", "4")
        mod = (lambda s, b, h, q, kv: s * t4[1]) if kind == "idx" else (lambda s, b, h, q, kv: s * (1.0 / t4[1]))
        return lambda: fl.attention(score_mod=mod, name=f"temp_{kind}")
    mods = {"div": lambda s, b, h, q, kv: s / t, "sub": lambda s, b, h, q, kv: s - t,
            "exp": lambda s, b, h, q, kv: s * fl.exp(t), "cap": lambda s, b, h, q, kv: t * fl.tanh(s / t),
            "sq": lambda s, b, h, q, kv: s * t ** 2}  # (sq: autodiff's guard of a scalar's cotangent had hidden the sum)
    return lambda: fl.attention(score_mod=mods[kind], name=f"temp_{kind}")


EXTRA_GRAPHS = {"two_tables": _two_tables,
                **{f"temp_{k}": _temperature(k) for k in ("div", "sub", "exp", "cap", "idx", "invidx", "sq")}}


def run_case(stem: str, path: str, tile: int, M: int, N: int, dq: str = "atomic", bk: int = 0, D: int = 16,
             kind: str = "sorted") -> dict:
    import falower as fl
    from falower.ir.interp import Interpreter
    from falower.passes.check import bind_dims, random_inputs

    g = EXTRA_GRAPHS[stem]() if stem in EXTRA_GRAPHS else example_graph(stem)
    env = bind_dims(g, {"B": 1, "H": 2, "HKV": 1, "M": M, "N": N, "D": D})
    bk = bk or tile
    inputs = [x.astype(np.float16) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
              for i, x in enumerate(random_inputs(g, env, seed=1, kind=kind))]
    bwd = BWD.format(t=tile, tk=bk, dq=DQ[dq])
    c = fl.compile(g, "numba-cuda", pipeline=FWD, backward=bwd, path=path)
    ref = fl.compile(g, "reference", pipeline=FWD, backward=bwd)
    o, lse = ref(*inputs)
    o, lse = o.astype(np.float16), lse.astype(np.float32)
    do = np.random.default_rng(5).standard_normal(o.shape).astype(np.float16)
    got = c.backward(inputs[0], inputs[1], inputs[2], o, lse, do, *inputs[3:])
    f = c.lowered_backward
    by = {a.name: x for a, x in zip(g.args, inputs)}
    by.update(o=o, lse=lse, do=do)
    want = Interpreter("f64").run(f, [by[a.name] for a in f.args])
    out = {"id": case_id((stem, path, tile, M, N, dq, bk, D)), "grads": {},
           "block_mask": c.backward_kernel(*inputs).spec.block_mask}
    for name, a, b in zip(c.gradient_names(), got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        out["grads"][name] = {"err": float(np.max(np.abs(a - b))), "scale": float(np.max(np.abs(b))),
                              "nan": bool(np.isnan(a).any()), "shape_ok": a.shape == b.shape}
    if dq == "det":  # the same bits on a second run
        again = c.backward(inputs[0], inputs[1], inputs[2], o, lse, do, *inputs[3:])
        out["same_bits"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, again))
    masked = ~np.isfinite(lse)  # fully masked rows: the reference says dq = 0 there, the kernel must too
    out["masked_rows"] = int(masked.sum())
    out["masked_dq_zero"] = bool(np.all(np.asarray(got[0], np.float64)[masked] == 0))
    return out


STEMS = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
# 16 x 16 tiles (one warp) at M = 20, N = 19: ragged q and kv tiles, a diagonal, every example on both paths;
# 32 x 32 tiles (two warps, several q tiles per kv tile) at M = 40, N = 37 for the tensor-core path.
# the SIMT path shares the IR side (alibi and GQA on it: the deterministic and strided cases)
SIMT_STEMS = ("causal", "document", "relative_bias")
CASES = [(s, p, 16, 20, 19, "atomic") for s in STEMS for p in ("mma", "simt") if p == "mma" or s in SIMT_STEMS]
CASES += [(s, "mma", 32, 40, 37, "atomic") for s in ("causal", "gqa", "relative_bias")]
# deterministic=true: dQ by the q-outer kernel, captured gradients summed per block in a fixed order (GQA and
# prefix LM on it, and causal at 32 x 32 tiles, cut for CI time: the atomic cases run them, alibi / causal /
# document / the per-element tables the deterministic kernel)
CASES += [(s, "mma", 16, 20, 19, "det") for s in ("alibi", "causal", "document")]
CASES += [("alibi", "simt", 16, 20, 19, "det")]
# tables read at per-element indices: contributions staged, added by their address's owner in slot order
CASES += [("relative_bias", "mma", 16, 20, 19, "det"), ("bias", "mma", 16, 20, 19, "det"),
          ("relative_bias", "simt", 16, 20, 19, "det"), ("two_tables", "mma", 16, 20, 19, "det"),
          ("temp_div", "mma", 16, 20, 19, "atomic"), ("temp_div", "mma", 16, 20, 19, "det"),
          ("temp_sub", "mma", 16, 20, 19, "atomic"), ("temp_exp", "mma", 16, 20, 19, "det"),
          ("temp_idx", "mma", 16, 20, 19, "atomic"), ("temp_idx", "mma", 16, 20, 19, "det"),
          ("temp_invidx", "mma", 16, 20, 19, "atomic"), ("temp_sq", "mma", 16, 20, 19, "det")]
# block_k = 2 block_q (fa2-bwd's shape, 64 x 128): two warps of kv rows, dQ's one 16-row group split over D
CASES += [(s, "mma", 16, 20, 37, "atomic", 32, 32) for s in ("causal", "alibi")]
# the 48-wide window at 16-row tiles: kv tile 0 sees q tiles 0-3 of 5, the walk (first and last pair by a ballot)
# ends there; ending one pair early fails it
CASES += [("sliding_window", "mma", 16, 80, 40, "atomic")]


def run_f64_case(case: str) -> dict:
    """f64 inputs through the SIMT kernels (what gradcheck runs): forward and backward against the IR in
    float64 (a graph traced in f64 accumulates in f64 all the way, and so do the kernels). `case` is the dq
    mode, prefixed `scalar-` for a captured 0-d temperature (its gradient is a sum over every element)."""
    import falower as fl
    from falower.ir.interp import Interpreter

    dq = case.removeprefix("scalar-")
    B, H, M, N, D = 1, 2, 20, 19, 16
    if case.startswith("scalar-"):
        cap, val = fl.capture("temp", "f64", ()), np.array(0.7)
        score = lambda s, b, h, q, kv: s * cap  # noqa: E731
    else:
        cap, val = fl.capture("slopes", "f64", "H"), np.array([-0.3, -0.1])
        score = lambda s, b, h, q, kv: s + cap[h] * (kv - q)  # noqa: E731
    g = fl.attention(score_mod=score, mask_mod=lambda b, h, q, kv: q >= kv, name="f64case", dtype="f64")
    c = fl.compile(g, "numba-cuda", pipeline=FWD, backward=BWD.format(t=16, tk=16, dq=DQ[dq]))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, n, D)) for n in (M, N, N))
    o, lse = c(q, k, v, val)
    want_o, want_lse = Interpreter("f64").run(c.lowered, [q, k, v, val])
    do = rng.standard_normal(o.shape)
    got = c.backward(q, k, v, o, lse, do, val)
    f = c.lowered_backward
    by = {"q": q, "k": k, "v": v, g.args[3].name: val, "o": o, "lse": lse, "do": do}
    want = Interpreter("f64").run(f, [by[a.name] for a in f.args])
    errs = {"o": float(np.abs(o - want_o).max()), "lse": float(np.abs(lse - want_lse).max())}
    errs.update({n: float(np.abs(a - b).max()) for n, a, b in zip(c.gradient_names(), got, want)})
    return {"id": f"f64-{case}", "errs": errs, "dtypes": sorted({str(np.asarray(x).dtype) for x in (o, lse, *got)})}


F64_CASES = ["atomic", "det", "scalar-atomic", "scalar-det"]


def run_strided_case(stem: str, path: str) -> dict:
    """q, k, v and dO as [B, H, N, D] views of [B, N, H, D] arrays (a model's transposed projections): the
    kernels take their strides, and give what the contiguous copies give (dQ up to its atomic adds' order)."""
    import falower as fl
    from falower.passes.check import bind_dims, random_inputs

    g = example_graph(stem)
    env = bind_dims(g, {"B": 2, "H": 2, "HKV": 1, "M": 20, "N": 19, "D": 16})
    inputs = [x.astype(np.float16) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
              for i, x in enumerate(random_inputs(g, env, seed=4))]
    strided = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in inputs[:3]]
    assert not strided[0].flags.c_contiguous
    c = fl.compile(g, "numba-cuda", pipeline=FWD, backward=BWD.format(t=16, tk=16, dq="atomic"), path=path)
    o, lse = c(*strided, *inputs[3:])
    o2, lse2 = c(*inputs)
    do = np.random.default_rng(6).standard_normal(o.shape).astype(np.float16)
    do_s = np.ascontiguousarray(do.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    g1 = c.backward(*strided, o, lse, do_s, *inputs[3:])
    g2 = c.backward(*inputs[:3], o, lse, do, *inputs[3:])
    diffs = {n: float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
             for n, a, b in zip(c.gradient_names(), g1, g2)}
    return {"id": f"strided-{stem}-{path}", "fwd_equal": bool(np.array_equal(o, o2) and np.array_equal(lse, lse2)),
            "diffs": diffs}


STRIDED_CASES = [("causal", "mma"), ("alibi", "mma"), ("gqa", "simt")]


def case_id(case: tuple) -> str:
    stem, path, tile, M, N, dq, *rest = case
    bk, D = rest if rest else (tile, 16)
    tiles = f"{tile}" if bk == tile else f"{tile}x{bk}"
    return f"{stem}-{path}-{tiles}-{M}x{N}" + ("-det" if dq == "det" else "") + (f"-D{D}" if D != 16 else "")


if __name__ == "__main__":
    jobs = {case_id(case): (run_case, case) for case in CASES}
    jobs.update({f"strided-{stem}-{path}": (run_strided_case, (stem, path)) for stem, path in STRIDED_CASES})
    jobs.update({f"f64-{dq}": (run_f64_case, (dq,)) for dq in F64_CASES})
    run_main([c for c in jobs if not sys.argv[1:] or c in sys.argv[1:]], lambda cid: jobs[cid][0](*jobs[cid][1]))
