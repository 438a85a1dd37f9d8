"""Simulator cases for test_tanh_small_simulator.py: the softcap (30 tanh(s / 30)) on the two wgmma kernels, a
tile's tanh by the FMA pipe's polynomial where every score of the warp's rows lies in its range (emit_fa2.
small_scores) and by tanh_ex2 elsewhere, through falower.compile against the reference interpreter in float64, in a
subprocess with NUMBA_ENABLE_CUDASIM=1. One JSON line per case, with the calls of score_row_small and score_row
counted (the simulator calls the kernel's module globals): some query rows are scaled up so that their warps' scores
leave the range, others less so that theirs leave only tanh_tiny's (|s scale| <= c / 4, emit_fa2.tiny_scores), and
the rest stay in it, so each case takes all three paths.

Usage: NUMBA_ENABLE_CUDASIM=1 python tanh_small_sim_cases.py [case-id ...]
"""

from __future__ import annotations

import os
import sys

sys.setswitchinterval(5e-4)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from sim_script import against_reference, count_calls, example_graph, run_main, tiled_pipeline  # noqa: E402

# id: (M, N, D, tile (bq, bk), spec.extra, the query rows scaled by 40[, those scaled by 4]); ragged last tiles,
# M != N. Scaled by 4, a row's scaled scores reach ~4 x 4.5 sigma: over the cap's quarter (7.5), under the cap (30)
CASES = {
    "ws-softcap": (100, 90, 64, (128, 32), {"schedule": "wgmma-ws", "producer": "none"}, (40, 56), (80, 96)),
    "fa3-r128-softcap": (70, 75, 64, (128, 32), {"schedule": "wgmma", "wg_rows": 128}, (0, 9), (32, 48)),
    # the persistent producer kernel as the softcap takes it by default: two Q buffers, Q, K and V by TMA loads,
    # the epilogue at the item's end through the item's own Q tile (not in the next item's S); four items on one
    # block, kv tile 0 full (the small path is a full tile's), tile 1 ragged
    "pwg-persist-softcap": (150, 200, 64, (128, 128), {"schedule": "wgmma-ws", "producer": "warpgroup",
                                                      "persistent": 1, "item_order": "dynamic"}, (40, 56),
                            (80, 96)),
}
# the softcap with tanh.approx (MUFU.TANH; the simulator computes tanh) as the automatic choice builds it at D = 128
# (here D = 64): the persistent producer kernel with 8 of a row's 32 exponentials a tile by the FMA pipe's
# polynomial (emit_fa3_ws.auto_ex2_poly), the ragged kv tile's masked ones among them (2^-inf must be 0, not a
# wrapped exponent); ex2 and ex2_poly are counted, 8 polynomial to 25 MUFU a softmax_row (24 and alpha's).
# Four items on one block, the last kv tile ragged.
APPROX_CASES = {
    "pwg-persist-softcap-approx-xp8": (150, 200, 64, (128, 128), {"schedule": "wgmma-ws", "producer": "warpgroup",
                                                                 "persistent": 1, "item_order": "dynamic",
                                                                 "ex2_poly": 8}, (40, 56)),
}


def run_case(case_id: str) -> dict:
    import falower as fl
    from falower.backends.numba_cuda.emit_fa2 import small_scores, tiny_scores
    from falower.backends.numba_cuda.emit_fa3_ws import epilogue_in_s, q_double, tma_loads
    from falower.passes.check import Reference, bind_dims

    M, N, D, (bq, bk), extra, (r0, r1), *four = {**CASES, **APPROX_CASES}[case_id]
    B, H = 1, 2
    g = example_graph("softcap") if case_id in CASES else fl.attention(
        score_mod=lambda s, b, h, q, kv: 30.0 * fl.tanh(s / 30.0, approx=True), name="softcap_approx")
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, H, M, D)).astype(np.float32)
    q[:, :, r0:r1] *= 40.0  # these rows' scaled scores reach ~40 sigma: their warps take tanh_ex2
    for f0, f1 in four:
        q[:, :, f0:f1] *= 4.0  # these ~4 x 4.5 sigma at most: tanh_small, not tanh_tiny
    q = q.astype(np.float16)
    k, v = (rng.standard_normal((B, H, N, D)).astype(np.float16) for _ in range(2))
    env = bind_dims(g, {"B": B, "H": H, "M": M, "N": N, "D": D})
    ref = Reference.build(g, env, inputs=[x.astype(np.float64) for x in (q, k, v)])
    c = fl.compile(g, "numba-cuda", pipeline=tiled_pipeline(bq, bk), path="mma", extra=extra)
    kern = c.kernel(q, k, v)
    calls = count_calls(kern, ("score_row_tiny", "score_row_small", "score_row", "ex2_poly", "ex2"))
    o, lse = c(q, k, v)
    ws = kern.spec.extra.get("schedule") == "wgmma-ws"
    return {"id": case_id, "dtype": "f16", "schedule": kern.spec.extra.get("schedule", "mma"),
            "bound": small_scores(kern.spec), "tiny_bound": tiny_scores(kern.spec), "calls": calls,
            "form": [f(kern.spec) if ws else False for f in (q_double, tma_loads, epilogue_in_s)],
            **against_reference(o, lse, ref.outputs["o"], ref.outputs["lse"])}


def main(ids) -> None:
    run_main(ids or [*CASES, *APPROX_CASES], run_case)


if __name__ == "__main__":
    main(sys.argv[1:])
