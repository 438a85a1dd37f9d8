"""Every example graph through falower.compile in the CUDA simulator (run in a subprocess with
NUMBA_ENABLE_CUDASIM=1 by test_compile_simulator.py). Prints one JSON line per case."""

from __future__ import annotations

import sys
from pathlib import Path

sys.setswitchinterval(5e-4)

import numpy as np  # noqa: E402
from sim_script import example_graph, run_main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
PIPELINE = "decompose-softmax,canonicalize,fuse,tile{bq=32,bk=16},online-softmax{exp2=true},mask-tiles,score-licm,canonicalize"
SHAPES = {"B": 1, "H": 2, "HKV": 1, "M": 40, "N": 37, "D": 16}


def run_case(stem: str, path: str) -> dict:
    import falower as fl
    from falower.passes.check import Reference, bind_dims, random_inputs

    g = example_graph(stem)
    env = bind_dims(g, SHAPES)
    # q, k, v in f16; captured float tables in f32; the reference sees the same rounded values in float64
    inputs = [x.astype(np.float16) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
              for i, x in enumerate(random_inputs(g, env, seed=1))]
    ref = Reference.build(g, env, inputs=inputs)
    c = fl.compile(g, "numba-cuda", pipeline=PIPELINE, path=path, num_warps=2 if path == "mma" else None)
    o, lse = c(*inputs)
    want_o, want_lse = ref.outputs["o"], ref.outputs["lse"]
    got = np.asarray(o, dtype=np.float64)
    fin = np.isfinite(want_lse)
    return {
        "id": f"{stem}-{path}",
        "nan": bool(np.isnan(got).any() or np.isnan(lse).any()),
        "o_err": float(np.max(np.abs(got - want_o))),
        "lse_err": float(np.max(np.abs(lse[fin] - want_lse[fin]))) if fin.any() else 0.0,
        "lse_inf_ok": bool(np.array_equal(np.isneginf(lse), np.isneginf(want_lse))),
        "masked_rows": int((~fin).sum()),
    }


def run_table_case(mask: str, kind: str) -> dict:
    """The block-mask kernel's tile classes equal the IR's `mask.block_table` (one meaning of a class)."""
    import falower as fl
    from falower.ir.interp import Interpreter
    from falower.passes.check import bind_dims, random_inputs

    sys.path.insert(0, str(ROOT / "tests"))
    from data_masks import MASKS

    g = MASKS[mask]()
    env = bind_dims(g, SHAPES)
    inputs = [x.astype(np.float16) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
              for i, x in enumerate(random_inputs(g, env, seed=2, kind=kind))]
    c = fl.compile(g, "numba-cuda", pipeline=PIPELINE.replace("mask-tiles", "mask-tiles{data=table}"), path="mma",
                   num_warps=2)  # the dense table (data=ranges, the default, makes no table)
    caps = [inputs[c.lowered.args.index(v)] for v in c.analysis.captures]
    caps += [int(env[d]) for d in c.analysis.runtime_dims]
    got = c.kernel(*inputs).block_table(inputs[0], inputs[1], inputs[2], *caps)
    op = next(o for o in c.lowered.walk() if o.name == "mask.block_table")
    it = Interpreter("f64")
    it.run(c.lowered, inputs, env)  # binds the sizes
    (want,) = it.op(op, {v: x for v, x in zip(c.lowered.args, inputs)})
    return {"id": f"table-{mask}-{kind}", "equal": bool(np.array_equal(got, want)),
            "got": got.reshape(-1).tolist(), "want": want.reshape(-1).tolist()}


def run_idiom_case(which: str) -> dict:
    """Score functions with the frontend's newer maths, and a window passed as a captured scalar (two
    values, one kernel), through falower.compile in the simulator."""
    import falower as fl
    from falower.passes.check import Reference, bind_dims, random_inputs

    if which == "maths":
        g = fl.attention(score_mod=lambda s, b, h, q, kv: s + fl.sin(q * 0.1) * fl.cos(kv * 0.2)
                         + fl.round(s * 2.0) * 0.01 + fl.floor(s) * 0.01 + fl.sign(q - kv) * 0.1
                         + fl.rsqrt(abs(s) + 1.0) + fl.log1p(abs(s)) - fl.expm1(s * 0.01) + fl.tan(s * 0.01),
                         name="maths")
        windows = [None]
    elif which == "i8":  # i8 wraps: q cast (rows 128 on negative) in a table's index and in the mask, i8 sums past
        # 127 in the mask (the tile classes' intervals), an i8 table's entries in the score
        bias = fl.capture("bias", "f32", "H,M,N")
        t8 = fl.capture("t8", "i8", "M,N")
        g = fl.attention(score_mod=lambda s, b, h, q, kv: s + bias[h, q.to("i8"), kv] + (t8[q, kv] + 100).to("f32")
                         * 0.01, mask_mod=lambda b, h, q, kv: (q.to("i8") >= 0) & ((q.to("i8") + 100) > 0) | (kv < 8),
                         name="bias_i8")
        windows = [None]
    elif which == "i32":  # i32 wraps as the IR's: q * 2^25 past row 63 in the score, kv + w with a captured w in the
        # mask (w = 2^31 - 1 keeps only kv = 0: no row bounds, the tiles partial), a float cast to i32 saturated; a
        # floor past 2^63 (Numba's math.floor went through an int64), integers divided by 0 at kv = 5 (0, as numpy's), shifts by
        # negative counts and counts past the bits (numpy's: 0, the sign)
        window = fl.capture("window", "i32", "")
        g = fl.attention(score_mod=lambda s, b, h, q, kv: s + (q * 33554432).to("f32") * 2.0 ** -31
                         + (s * 1e12).to("i32").to("f32") * 2.0 ** -33 + fl.floor(s * 1e30) * 1e-31
                         + (q // (kv - 5) + q % (kv - 5)).to("f32") * 0.01
                         + ((q + 1) << (kv - 20)).to("f32") * 1e-9 + ((q - 20) >> (kv - 20)).to("f32") * 0.1,
                         mask_mod=lambda b, h, q, kv: (kv + window >= q) | (kv < fl.ir.dims.dim("M") * 201326592),
                         name="i32_wraps")  # (M * 201326592 wraps negative at M = 100: the IR's const is i32)
        windows = [2 ** 31 - 1, 5]
    else:
        window = fl.capture("window", "i32", "")
        g = fl.attention(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < window), name="captured_window")
        windows = [5, 17]
    env = bind_dims(g, {**SHAPES, "M": 200, "H": 1} if which == "i8" else {**SHAPES, "M": 100} if which == "i32"
                    else SHAPES)
    c = fl.compile(g, "numba-cuda", pipeline=PIPELINE, path="mma", num_warps=2)
    errs = []
    for w in windows:
        raw = random_inputs(g, env, seed=3)
        inputs = [x.astype(np.float16) for x in raw[:3]] + ([np.array(w, dtype=np.int32)] if w is not None else
                                                            [x.astype(np.float32) if x.dtype.kind == "f" else x
                                                             for x in raw[3:]])
        ref = Reference.build(g, env, inputs=inputs)
        o, lse = c(*inputs)
        fin = np.isfinite(ref.outputs["lse"])
        errs.append(max(float(np.max(np.abs(np.asarray(o, np.float64) - ref.outputs["o"]))),
                        float(np.max(np.abs(lse[fin] - ref.outputs["lse"][fin]))) if fin.any() else 0.0))
    return {"id": f"idiom-{which}", "err": max(errs), "kernels": len(c._kernels)}


LD_PAIR_CALLS = [0]


def count_ld_pair() -> None:
    """Count the simulator's ld_pair calls (installed before any kernel module is built: each imports it by
    name, and a module is built once per spec and shared by the cases)."""
    from falower.backends.numba_cuda import intrinsics

    real = intrinsics.ld_pair

    def counted(garr, idx):
        LD_PAIR_CALLS[0] += 1
        return real(garr, idx)

    intrinsics.ld_pair = counted


def run_pair_case(which: str) -> dict:
    """A bias table read at [h, q, kv] through `score_pair_fn` (one 8-byte load for columns kv, kv + 1): an even
    N (the pairs path), an odd one (rows start off 8-byte alignment: `pairs_aligned` says no, the per-element
    path), a table shorter than N (kv past its end clamps, as gather does, inside the pairs path). Counts the
    ld_pair calls to show which path ran. A table whose address is off alignment is the GPU suite's (numpy
    inputs are copied to aligned device arrays here)."""
    import falower as fl
    from falower.passes.check import Reference, bind_dims, random_inputs

    LD_PAIR_CALLS[0] = 0
    if which == "short":
        tab = fl.capture("tab", "f32", "H,M,6")
        g = fl.attention(score_mod=lambda s, b, h, q, kv: s + tab[h, q, kv], name="short_table")
    else:
        g = example_graph("bias")
    env = bind_dims(g, {**SHAPES, "B": 3, "N": 37 if which == "odd" else 38})  # B != H: the grid puts b inner
    inputs = [x.astype(np.float16) if i < 3 else x.astype(np.float32)
              for i, x in enumerate(random_inputs(g, env, seed=4))]
    ref = Reference.build(g, env, inputs=inputs)
    c = fl.compile(g, "numba-cuda", pipeline=PIPELINE, path="mma", num_warps=2)
    o, lse = c(*inputs)
    return {"id": f"pairs-{which}", "err": max(float(np.max(np.abs(np.asarray(o, np.float64) - ref.outputs["o"]))),
                                               float(np.max(np.abs(lse - ref.outputs["lse"])))),
            "ld_pair": LD_PAIR_CALLS[0], "pair_fn": "def score_pair_fn(" in c.kernel(*inputs).spec.device_source}


STEMS = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
# every example on the tensor-core path; the SIMT path (f32 / f64 / odd head dims) on the examples that stress
# its own code (masked rows, per-element tables, GQA, causal tiles): the rest were cut for CI time
SIMT_STEMS = {"causal", "document", "gqa", "relative_bias"}
CASES = [(s, p) for s in STEMS for p in ("mma", "simt") if p == "mma" or s in SIMT_STEMS]
IDIOM_CASES = ["maths", "window", "i8", "i32"]
PAIR_CASES = ["aligned", "odd", "short"]
TABLE_CASES = [("blocks", "blocks"), ("blocks", "constant"), ("shared_prefix", "unsorted"), ("dense", "sorted")]

if __name__ == "__main__":
    count_ld_pair()
    jobs = {f"{stem}-{path}": (run_case, (stem, path)) for stem, path in CASES}
    jobs.update({f"idiom-{which}": (run_idiom_case, (which,)) for which in IDIOM_CASES})
    jobs.update({f"pairs-{which}": (run_pair_case, (which,)) for which in PAIR_CASES})
    jobs.update({f"table-{mask}-{kind}": (run_table_case, (mask, kind)) for mask, kind in TABLE_CASES})
    run_main([c for c in jobs if not sys.argv[1:] or c in sys.argv[1:]], lambda cid: jobs[cid][0](*jobs[cid][1]))
