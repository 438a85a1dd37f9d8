"""Simulator cases for test_split_kv_simulator.py: split-kv's kernel (the persistent warp-specialized kernel with a
part index in its work items, emit_fa3_ws._emit_kv_share) and its LSE merge (lse_merge.split_merge_kernel), run by
falower.compile on the split-kv IR, against the float64 reference of the unsplit graph, in a subprocess with
NUMBA_ENABLE_CUDASIM=1. One JSON line per case. Where the parts went wrong the numbers say so: a tile visited by two
parts moves LSE by up to log 2, a tile no part visits moves O.

Usage: NUMBA_ENABLE_CUDASIM=1 python split_kv_sim_cases.py [case-id ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from sim_script import against_reference, example_graph, run_main, tiled_pipeline  # noqa: E402

PWG = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 1, "item_order": "dynamic"}  # one block
# walks every item (the persistent producer-warpgroup kernel the automatic choice takes on a Hopper GPU)

# id: (example, M, N, D, tile (bq, bk), parts, dtype, tile pass's ragged_q[, {"B": .., "persistent": ..}]); B = 1 and
# one block where not given; ragged last q and kv tiles everywhere
CASES = {
    # causal, M != N: each q tile's own range in two shares (q tile 0: one kv tile, so one part is empty)
    "causal-p2": ("causal", 300, 390, 64, (128, 128), 2, "f16", "last"),
    # more parts than kv tiles (2): six of a q tile's eight parts visit nothing (O 0, LSE -inf, weight 0)
    "causal-p8-130x129": ("causal", 130, 129, 64, (128, 128), 8, "f16", "last"),
    # no mask: four shares of four kv tiles, the last ragged (bf16: tests/gpu/test_split_kv_gpu.py; the simulator's
    # calls take numpy, which has no bf16)
    "plain-p4": ("plain", 200, 390, 64, (128, 128), 4, "f16", "last"),
    # a 48-wide window, M > N: rows 148.. see no key, their q tile's range is empty in every part
    "window-p2-unseen-rows": ("sliding_window", 300, 100, 64, (128, 128), 2, "f16", "last"),
    # ALiBi (its column term in S = Q K^T, col_mma, and its kv order kv_last - 1, kv_last, then down)
    "alibi-p2": ("alibi", 200, 300, 64, (128, 128), 2, "f16", "last"),
    # the relative bias (each warpgroup's run of the table in shared memory, row_slice); its table given as float64,
    # which the call converts to the f32 the graph declares (read as f32 it gave O off by 4, LSE inf)
    "relbias-p2": ("relative_bias", 150, 300, 64, (128, 128), 2, "f16", "last"),
    # three consumer warpgroups (192-row q tiles, D = 64's wide kernel), the short q tile first (ragged_q first)
    "causal-p2-192-first": ("causal", 250, 300, 64, (192, 128), 2, "f16", "first"),
    # GQA: a kv head for every 4 q heads (H = 4, HKV = 1)
    "gqa-p2-d128": ("gqa", 130, 260, 128, (128, 128), 2, "f16", "last"),
    # one consumer warpgroup (64-row q tiles, decoding's: emit_fa3.DECODE_TILES), one query row against 3 kv tiles;
    # the q tile's last part merging in the kernel (extra fused_merge), and the merge kernel
    "plain-p4-decode-d128": ("plain", 1, 300, 128, (64, 128), 4, "f16", "last", {"fused_merge": True}),
    "plain-p4-decode-d128-merge-kernel": ("plain", 1, 300, 128, (64, 128), 4, "f16", "last"),
    # ... on a ring of 3 K / V stages (extra stages: what benchmarks/split_parts.py's "s3" times), two parts of 3
    # kv tiles each (the last ragged), so each part's ring wraps
    "plain-p2-decode-d128-3stages": ("plain", 1, 700, 128, (64, 128), 2, "f16", "last", {"stages": 3}),
    # ... asked to merge in a cluster (extra cluster_merge): Numba's launches have no clusters, so the call runs the
    # kernel without it (FA2ForwardKernel.without_cluster) and the merge kernel; M = 40 rows
    "plain-p4-decode-d128-cluster": ("plain", 40, 300, 128, (64, 128), 4, "f16", "last", {"cluster_merge": True}),
    # ... on two blocks an SM (extra blocks_per_sm: launch bounds the simulator ignores) with decoding's 64-wide kv
    # tiles at D = 128 (the ring's half that fits two blocks), two batches on three blocks
    "plain-p4-decode-d128-bk64-2sm": ("plain", 1, 300, 128, (64, 64), 4, "f16", "last",
                                      {"B": 2, "persistent": 3, "blocks_per_sm": 2}),
    # ... ALiBi at M = 50 on two batches and three blocks; the relative bias's run of the table (row_slice) at D = 128
    "alibi-p2-decode-m50": ("alibi", 50, 390, 64, (64, 128), 2, "f16", "last",
                            {"B": 2, "persistent": 3, "fused_merge": True}),
    "relbias-p2-decode-m17": ("relative_bias", 17, 300, 128, (64, 128), 2, "f16", "last", {"fused_merge": True}),
    # the bias table [H, M, N] on decoding's kernel (what compiler._auto_choice's few_rows takes: its rows read where
    # the score uses them, only for rows below M: emit_fa3_ws.skips_padding_rows), three rows in two parts
    "bias-p2-decode-m3": ("bias", 3, 300, 64, (64, 128), 2, "f16", "last"),
    # ... under a mask (keys up to q + 297: the last kv tile partial), the masked path's rows below M only
    "bias-causal-p2-decode-m3": ("bias_causal", 3, 300, 64, (64, 128), 2, "f16", "last"),
    # a small prefill grid's 64-row q tiles (compiler._decode_tiles past 64 rows): four q tiles under causal, the
    # last ragged, each of its kv range in two shares, on two blocks
    "causal-p2-q64-m200": ("causal", 200, 200, 64, (64, 128), 2, "f16", "last", {"persistent": 2}),
    # two batches (the workspaces' part-major layout, kvp B + b) on three blocks (each block's first item its own,
    # the counter's tickets the rest: own_first_item), 16 items
    "causal-p4-b2-three-blocks": ("causal", 250, 300, 64, (128, 128), 4, "f16", "last", {"B": 2, "persistent": 3}),
}


def run_case(case_id: str) -> dict:
    import falower as fl
    from falower.backends.numba_cuda import emit_fa2, emit_fa3_ws
    from falower.passes.check import Reference, bind_dims, random_inputs

    stem, M, N, D, (bq, bk), P, dt, ragged, *more = CASES[case_id]
    over = more[0] if more else {}
    g = _bias_causal() if stem == "bias_causal" else example_graph(stem)
    if dt != "f16":
        g = fl.parse_func(fl.print_func(g).replace("f16[", f"{dt}[").replace('"f16"', f'"{dt}"'))
    sizes = {"B": over.get("B", 1), "H": 4 if stem == "gqa" else 2, "HKV": 1, "M": M, "N": N, "D": D}
    env = bind_dims(g, {k: v for k, v in sizes.items() if k in _dims(g)})
    drawn = random_inputs(g, env, seed=sum(map(ord, case_id)))
    host = [_rounded(x, dt) if i < 3 else x for i, x in enumerate(drawn)]
    ref = Reference.build(g, env, inputs=[_value(x, dt) if i < 3 else x for i, x in enumerate(host)])
    pipe = tiled_pipeline(bq, bk) + f",split-kv{{parts={P},part_dtype={dt}}}"
    if ragged == "first":
        pipe = pipe.replace(f"tile{{bq={bq},bk={bk}}}", f"tile{{bq={bq},bk={bk},ragged_q=first}}")
    knobs = {k: True for k in ("fused_merge", "cluster_merge") if over.get(k)}
    knobs.update({k: over[k] for k in ("stages", "blocks_per_sm") if k in over})
    c = fl.compile(g, "numba-cuda", pipeline=pipe, path="mma", extra={**PWG, "persistent": over.get("persistent", 1),
                                                                       **knobs})
    kern = c.kernel(*host)
    o, lse = c(*host)
    o = _value(np.asarray(o), dt)
    return {"id": case_id, "dtype": dt, "kv_parts": kern.spec.kv_parts, "ragged_first": kern.spec.ragged_q_first,
            "shares": "kv_cnt = max(kv_last - kv_first + 1, 0)" in kern.source,
            # the q tile's last part merges (fused_merge), or the cluster's blocks from their shared memory (read
            # there, or pushed into their own: cluster_push)
            "fused": any(f"merge_unit({a}" in kern.source for a in ("o, lse", "cl_lse_s", "cl_rl")),
            "cluster": emit_fa2.cluster_parts(kern.spec),  # (cluster_merge)
            "stages": emit_fa3_ws.stages(kern.spec),
            "blocks_per_sm": emit_fa3_ws.blocks_per_sm(kern.spec),  # (launch bounds: the simulator runs it as any)
            **against_reference(o, lse, ref.outputs["o"], ref.outputs["lse"])}


def _bias_causal():
    """A bias table [H, M, N] under a mask that keeps keys up to q + 297 (decoding's offset for M = 3, N = 300)."""
    import falower as fl

    bias = fl.capture("bias", "f32", "H,M,N")
    return fl.attention(score_mod=lambda s, b, h, q, kv: s + bias[h, q, kv],
                        mask_mod=lambda b, h, q, kv: kv <= q + 297, name="bias_causal")


def _dims(g) -> set[str]:
    return {getattr(d, "name", "") for a in g.args for d in a.type.shape}


def _rounded(x: np.ndarray, dt: str) -> np.ndarray:
    """q, k, v as the kernel takes them: f16, or bf16 as its 16-bit patterns (numpy has no bf16; round to nearest
    even)."""
    if dt == "f16":
        return x.astype(np.float16)
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _value(x: np.ndarray, dt: str) -> np.ndarray:
    """The float64 values of `_rounded`'s arrays (and of the kernel's O)."""
    if dt == "f16":
        return x.astype(np.float64)
    return (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def main(ids: list[str]) -> None:
    run_main(ids or list(CASES), run_case)


if __name__ == "__main__":
    main(sys.argv[1:])
