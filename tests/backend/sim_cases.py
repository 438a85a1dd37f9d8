"""Simulator cases for test_simulator.py, run in a subprocess with NUMBA_ENABLE_CUDASIM=1.

Usage: NUMBA_ENABLE_CUDASIM=1 python sim_cases.py [case-id ...]   (prints one JSON line per case)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

sys.setswitchinterval(5e-4)  # the simulator's threads hand over the GIL far more often
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from sim_script import case_rng  # noqa: E402
from variants import as_float, make_spec, random_captures, random_inputs, reference  # noqa: E402

# id: (variant, path, dtype, D, B, H, M, N, group_size, block_q, block_k, num_warps[, spec.extra])
CASES = {
    "mma-plain-f16-d64": ("plain", "mma", "f16", 64, 1, 1, 40, 40, 1, 32, 32, 2),
    "mma-plain-f16-ragged": ("plain", "mma", "f16", 16, 1, 2, 17, 23, 1, 32, 32, 2),
    "mma-plain-f16-n1": ("plain", "mma", "f16", 16, 1, 1, 17, 1, 1, 32, 32, 2),
    "mma-causal-bf16": ("causal", "mma", "bf16", 16, 1, 2, 40, 40, 1, 32, 32, 2),
    "mma-causal-f16-m20-n40": ("causal", "mma", "f16", 16, 1, 1, 20, 40, 1, 16, 16, 1),
    "mma-bias-f16": ("bias", "mma", "f16", 16, 1, 2, 40, 35, 1, 32, 32, 2),
    "mma-table-f16-masked-rows": ("document", "mma", "f16", 16, 2, 1, 40, 40, 1, 32, 32, 2),
    "mma-gqa-f16": ("plain", "mma", "f16", 16, 1, 4, 33, 40, 2, 32, 32, 2),
    # two m16 fragments per warp; and Q re-read from shared memory every k step
    "mma-plain-f16-2frags-2barriers": ("plain", "mma", "f16", 16, 1, 1, 70, 45, 1, 64, 16, 2, {"one_barrier": False}),
    # block order in groups of 3 (b, h) pairs over 4 pairs: a full group and a remainder group
    "mma-causal-f16-headgroups": ("causal", "mma", "f16", 16, 2, 2, 40, 24, 1, 16, 16, 1, {"head_group": 3}),
    "mma-causal-f16-2frags-qsmem": ("causal", "mma", "f16", 16, 1, 1, 70, 45, 1, 64, 16, 2, {"q_in_regs": False}),
    # per-warp skipping of hidden rows inside partial tiles (spec.extra["warp_skip"], off by default)
    "mma-causal-f16-warpskip": ("causal", "mma", "f16", 16, 1, 1, 70, 45, 1, 64, 16, 2, {"warp_skip": True}),
    "simt-plain-f32-gqa-d24": ("plain", "simt", "f32", 24, 1, 4, 40, 40, 2, 32, 16, 1),
    "simt-causal-f16": ("causal", "simt", "f16", 16, 1, 2, 40, 40, 1, 32, 16, 1),
    "simt-bias-bf16": ("bias", "simt", "bf16", 16, 1, 2, 40, 35, 1, 32, 16, 1),
    "simt-table-f32-masked-rows": ("document", "simt", "f32", 16, 2, 1, 40, 40, 1, 32, 16, 1),
    "simt-plain-f32-n1": ("plain", "simt", "f32", 16, 1, 1, 17, 1, 1, 32, 16, 1),
    # online-softmax{lazy=T} (spec.lazy_rescale): T = 0.5 makes the max both move and stay across kv tiles (and
    # O's rescale both run and be skipped); 8 on fully masked rows (m = -inf throughout)
    "mma-causal-f16-lazy": ("causal", "mma", "f16", 16, 1, 2, 40, 70, 1, 16, 16, 1, {"lazy_rescale": 0.5}),
    "mma-table-f16-masked-rows-lazy": ("document", "mma", "f16", 16, 2, 1, 40, 40, 1, 32, 32, 2,
                                       {"lazy_rescale": 8.0}),
    "simt-causal-f16-lazy": ("causal", "simt", "f16", 16, 1, 2, 40, 70, 1, 32, 16, 1, {"lazy_rescale": 0.5}),
}


def run_case(case_id: str) -> dict:
    from falower.backends.numba_cuda import FA2ForwardKernel

    variant, path, dtype, D, B, H, M, N, G, bq, bk, nw, *extra = CASES[case_id]
    rng = case_rng(case_id)
    spec = make_spec(variant, D, dtype, path=path, block_q=bq, block_k=bk, num_warps=nw, group_size=G,
                     name=f"sim_{case_id.replace('-', '_')}")
    if extra:
        extra = dict(extra[0])
        spec = dataclasses.replace(spec, lazy_rescale=extra.pop("lazy_rescale", 0.0), extra=extra)
    kern = FA2ForwardKernel(spec)
    q, k, v = random_inputs(rng, dtype, B, H, M, N, D, G)
    caps = random_captures(rng, variant, B, H, M, N)
    t0 = time.time()
    o, lse = kern(q, k, v, *caps)
    seconds = time.time() - t0
    qf, kf, vf = (as_float(x, dtype) for x in (q, k, v))
    ro, rl = reference(qf, kf, vf, variant, caps, G)
    of = as_float(o, dtype)
    masked = ~np.isfinite(rl)
    return {
        "id": case_id,
        "dtype": dtype,
        "o_err": float(np.abs(of - ro).max()),
        "lse_err": float(np.abs(lse[~masked] - rl[~masked]).max()) if (~masked).any() else 0.0,
        "nan": bool(np.isnan(of).any() or np.isnan(lse).any()),
        "masked_rows": int(masked.sum()),
        "masked_ok": bool(np.all(np.isneginf(lse[masked])) and np.all(of[masked] == 0.0)),
        "lse_inf_where_expected": bool(np.array_equal(np.isneginf(lse), masked)),
        "seconds": seconds,
    }


if __name__ == "__main__":
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
    for cid in sys.argv[1:] or list(CASES):
        print(json.dumps(run_case(cid)), flush=True)
