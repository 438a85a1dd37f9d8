"""Every example graph through falower.compile in the CUDA simulator (run in a subprocess with
NUMBA_ENABLE_CUDASIM=1 by test_compile_simulator.py). Prints one JSON line per case."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

sys.setswitchinterval(5e-4)

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
PIPELINE = "decompose-softmax,canonicalize,fuse,tile{bq=32,bk=16},online-softmax{exp2=true},mask-tiles,canonicalize"
SHAPES = {"B": 1, "H": 2, "HKV": 1, "M": 40, "N": 37, "D": 16}


def example(stem: str):
    from falower.ir import Func

    graphs = [v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, Func)]
    return graphs[0]


def run_case(stem: str, path: str) -> dict:
    import falower as fl
    from falower.passes.check import Reference, bind_dims, random_inputs

    g = example(stem)
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


STEMS = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
CASES = [(s, p) for s in STEMS for p in ("mma", "simt")]

if __name__ == "__main__":
    wanted = sys.argv[1:]
    for stem, path in CASES:
        cid = f"{stem}-{path}"
        if wanted and cid not in wanted:
            continue
        try:
            print(json.dumps(run_case(stem, path)), flush=True)
        except Exception as e:  # report, the test fails on it
            print(json.dumps({"id": cid, "error": f"{type(e).__name__}: {e}"}), flush=True)
