"""Simulator cases for test_pack_gqa_simulator.py: GQA decoding calls through falower.compile's automatic choice on
a (pretended) Hopper GPU, which runs them through the packed graph (passes/pack_gqa.py: the persistent kernel on
decoding's 64-row q tiles, a kv head's query heads as its rows), against the float64 reference of the GQA graph as
written. Masks that read the query head (a mask on h % 2) or row (causal, a window) take the packed row's rebuilt
h = j G + r // M and q_idx = r % M, and the kernels' tile classifier bounds them with M's size. Run in a subprocess
with NUMBA_ENABLE_CUDASIM=1.

Usage: NUMBA_ENABLE_CUDASIM=1 python pack_gqa_sim_cases.py [case-id ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from sim_script import against_reference, case_rng, run_main  # noqa: E402

# id: (mods, G, M, N, D)
CASES = {
    "headmask-g4-m3": ("headmask", 4, 3, 70, 64),
    "causal-g4-m1": ("causal", 4, 1, 70, 64),
    "window-g2-m5": ("window", 2, 5, 140, 64),
}


def run_case(case_id: str) -> dict:
    import falower as fl
    from falower.backends.numba_cuda import runtime
    from falower.passes.check import Reference

    runtime.device_cc = lambda: (9, 0)  # the automatic choice's Hopper kernel, in the simulator
    runtime.device_sm_count = lambda: 2
    mods, G, M, N, D = CASES[case_id]
    kw = {"causal": dict(mask_mod=lambda b, h, q, kv: q >= kv),
          "window": dict(mask_mod=lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 5)),
          "headmask": dict(mask_mod=lambda b, h, q, kv: (q >= kv) | (h % 2 == 0))}[mods]
    g = fl.attention(group_size=G, name=f"gqa_{mods}", **kw)
    rng = case_rng(case_id)
    HKV = 2
    q = rng.standard_normal((1, HKV * G, M, D)).astype(np.float16)
    k, v = (rng.standard_normal((1, HKV, N, D)).astype(np.float16) for _ in range(2))
    ins = [q, k, v]
    c = fl.compile(g, "numba-cuda")
    env = c._dims(ins)
    packed = c.packed_for(env)
    kern = packed.specialize("f16", **env)
    ref = Reference.build(g, env, inputs=[x.astype(np.float64) if i < 3 else x for i, x in enumerate(ins)])
    o, lse = c(*ins)
    return {"id": case_id, "dtype": "f16", "block_q": kern.spec.block_q, "packed": packed.func.name,
            **against_reference(np.asarray(o).astype(np.float64), np.asarray(lse), ref.outputs["o"],
                                ref.outputs["lse"])}


def main(ids: list[str]) -> None:
    run_main(ids or list(CASES), run_case)


if __name__ == "__main__":
    main(sys.argv[1:])
