"""Simulator cases for test_fa3_simulator.py: the wgmma forward kernel (emit_fa3.py) on tiny shapes against the
float64 reference, run in a subprocess with NUMBA_ENABLE_CUDASIM=1. One JSON line per case.

Usage: NUMBA_ENABLE_CUDASIM=1 python fa3_sim_cases.py [case-id ...]
"""

from __future__ import annotations

import os
import sys
import time

sys.setswitchinterval(5e-4)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from sim_script import case_rng, example_graph, run_main  # noqa: E402
from variants import as_float, make_spec, random_captures, random_inputs, reference  # noqa: E402

# id: (variant, dtype, D, B, H, M, N, group_size, block_q, block_k[, spec.extra])
CASES = {
    "plain-f16-d64-ragged": ("plain", "f16", 64, 1, 1, 70, 45, 1, 64, 32),
    "causal-bf16-d64": ("causal", "bf16", 64, 1, 1, 40, 40, 1, 64, 16),
    "bias-f16-d64-gqa": ("bias", "f16", 64, 1, 2, 33, 20, 2, 64, 16),
    "causal-f16-d128-2wg": ("causal", "f16", 128, 1, 1, 80, 70, 1, 128, 32),
    # spec.extra["overlap"]: S_j and P_{j-1} V_{j-1} in flight together, three V buffers
    "overlap-causal-f16-d64": ("causal", "f16", 64, 1, 1, 70, 75, 1, 64, 16, {"overlap": True}),
    "overlap-bias-bf16-d128-2wg-gqa": ("bias", "bf16", 128, 1, 2, 100, 40, 2, 128, 16, {"overlap": True}),
    # spec.extra["wg_rows"] = 128: one warpgroup per 128 rows, two 64-row halves a thread (sc / sc1, acc / acc1);
    # the second q tile holds 2 rows (its second half empty), ragged kv tiles, causal rows fully masked past N
    # two heads: the grid (heads, q tiles, batch) of a block mask (emit_fa2.grid_3d) hands out both heads' second q
    # tile first
    "r128-causal-f16-d64": ("causal", "f16", 64, 1, 2, 130, 75, 1, 128, 16, {"wg_rows": 128}),
    "r128-bias-bf16-d64-gqa": ("bias", "bf16", 64, 1, 2, 100, 40, 2, 128, 32, {"wg_rows": 128}),
    "r128-plain-f16-d128-2wg": ("plain", "f16", 128, 1, 1, 200, 33, 1, 256, 16, {"wg_rows": 128}),
    # one row, one key (the second half and 127 of the first half's rows empty); a q tile minus one by a kv tile
    # plus one
    "r128-causal-f16-d64-1x1": ("causal", "f16", 64, 1, 1, 1, 1, 1, 128, 64, {"wg_rows": 128}),
    "r128-bias-bf16-d64-127x65": ("bias", "bf16", 64, 1, 1, 127, 65, 1, 128, 64, {"wg_rows": 128}),
    # spec.extra["staged_epilogue"]: O through the warpgroups' Q tiles (128 rows a warpgroup: rows past M in the
    # second q tile; 64 rows, two warpgroups, ragged)
    "staged-r128-causal-f16-d64": ("causal", "f16", 64, 1, 2, 130, 75, 1, 128, 16,
                                   {"wg_rows": 128, "staged_epilogue": True}),
    "staged-plain-f16-d64-2wg": ("plain", "f16", 64, 1, 1, 70, 45, 1, 128, 32, {"staged_epilogue": True}),
    # spec.extra["tree_softmax"]: the row max and sum over four chains (a kv tile of 64: 8 n8 tiles, 2 a chain)
    "tree-causal-f16-d64": ("causal", "f16", 64, 1, 1, 70, 75, 1, 128, 64, {"wg_rows": 128, "tree_softmax": True}),
    # spec.extra["ex2_poly"]: 5 of a row's 8 exponentials by the FMA pipe's polynomial (masked ones: exactly 0)
    "ex2poly-causal-f16-d64": ("causal", "f16", 64, 1, 1, 70, 75, 1, 128, 32, {"wg_rows": 128, "ex2_poly": 5}),
}
# through the runtime (FA2ForwardKernel with spec.extra["schedule"] = "wgmma"): the same launch path as the
# mma.sync kernel, block-mask table kernel included
RUNTIME_CASES = {
    "runtime-document-f16-d64": ("document", "f16", 64, 2, 1, 40, 40, 1, 64, 16),
    "runtime-causal-bf16-d64-gqa": ("causal", "bf16", 64, 1, 2, 50, 33, 2, 64, 32),
}

# through falower.compile (the API's warm call, derived captures included): the document example, whose
# data-dependent mask is visited from the per-q-tile block list (block_mask == "list", block_data.py), asked for
# by extra={"schedule": "wgmma"}; and causal chosen by FALOWER_WGMMA=1 with no extra (the automatic choice, which
# without the override never takes wgmma in the simulator). id: (example, ids kind, dtype, D, B, H, M, N, bq, bk,
# extra, FALOWER_WGMMA)
API_CASES = {
    "api-document-list-f16-d64": ("document", "sorted", "f16", 64, 2, 2, 40, 37, 64, 16, {"schedule": "wgmma"}, ""),
    "api-auto-causal-f16-d64": ("causal", "normal", "f16", 64, 1, 2, 33, 50, 64, 32, {}, "1"),
    # the warp-specialized kernel (no producer) on the same block lists, its partial tiles' row bounds (run tables)
    # computed once before the kv loop: 5 kv tiles of one q tile, full, partial and empty among them
    "api-document-list-ws-f16-d64": ("document", "sorted", "f16", 64, 1, 2, 70, 75, 128, 16,
                                     {"schedule": "wgmma-ws", "producer": "none"}, ""),
    # offsets[ids[q]] <= kv (`nested_graph`): a dense block table, and row bounds read from tables whose upper side
    # is unbounded (2**40): hoisted before the kv loop they must survive the 32-bit clamp (they became 0 once)
    "api-nested-table-f16-d64": ("nested", "normal", "f16", 64, 1, 2, 70, 75, 128, 64, {"schedule": "wgmma"}, ""),
    "api-nested-table-ws-f16-d64": ("nested", "normal", "f16", 64, 1, 1, 70, 75, 128, 16,
                                    {"schedule": "wgmma-ws", "producer": "none"}, ""),
    # 128 rows a warpgroup: the four rows' hoisted bounds (rb_lo0, 8, 64, 72) on the block list
    "api-document-list-r128-f16-d64": ("document", "sorted", "f16", 64, 1, 2, 140, 75, 128, 16,
                                       {"schedule": "wgmma", "wg_rows": 128}, ""),
}


def nested_graph():
    import falower as fl

    ids_t = fl.capture("ids", "i32", "N")
    offsets_t = fl.capture("offsets", "i32", "N")
    return fl.attention(mask_mod=lambda b, h, q, kv: offsets_t[ids_t[q]] <= kv, name="nested_sim")
PIPELINE = "decompose-softmax,canonicalize,fuse,tile{{bq={bq},bk={bk}}},online-softmax{{exp2=true}},mask-tiles," \
           "score-licm,canonicalize"


def run_api_case(case_id: str) -> dict:
    import falower as fl
    from falower.passes.check import Reference, bind_dims, random_inputs as graph_inputs

    stem, kind, dtype, D, B, H, M, N, bq, bk, extra, flag = API_CASES[case_id]
    g = nested_graph() if stem == "nested" else example_graph(stem)
    assert dtype == "f16"  # numpy inputs: bf16 has no numpy dtype the API takes
    env = bind_dims(g, {"B": B, "H": H, "HKV": H, "M": M, "N": N, "D": D})
    raw = graph_inputs(g, env, seed=M * 100 + N, **({} if kind == "normal" else {"kind": kind}))
    inputs = [x.astype(np.float16) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x for i, x in enumerate(raw)]
    ref = Reference.build(g, env, inputs=inputs)
    os.environ["FALOWER_WGMMA"] = flag
    c = fl.compile(g, "numba-cuda", pipeline=PIPELINE.format(bq=bq, bk=bk), extra=extra)
    kern = c.kernel(*inputs)
    o, lse = c(*inputs)
    os.environ["FALOWER_WGMMA"] = ""
    want_o, want_lse = ref.outputs["o"], ref.outputs["lse"]
    fin = np.isfinite(want_lse)
    of = as_float(o, dtype)
    return {
        "id": case_id,
        "dtype": dtype,
        "wgmma": kern.spec.extra.get("schedule") == extra.get("schedule", "wgmma") and "wgmma_ss" in kern.source,
        "block_mask": kern.spec.block_mask,
        "bounds_hoisted": "rb_lo0" in kern.source,  # the row bounds read before the kv loop (emit_row_bounds)
        "o_err": float(np.abs(of - want_o).max()),
        "lse_err": float(np.abs(lse[fin] - want_lse[fin]).max()) if fin.any() else 0.0,
        "nan": bool(np.isnan(of).any() or np.isnan(lse).any()),
        "masked_ok": bool(np.array_equal(np.isneginf(lse), np.isneginf(want_lse)) and np.all(of[~fin] == 0.0)),
    }


def launch_args(spec, q, k, v, caps):
    """The forward kernel's arguments (emit_fa2's signature) for contiguous numpy inputs."""
    B, H, M, D = q.shape
    _, Hk, N, _ = k.shape
    bits = [np.ascontiguousarray(x).view(np.int16).reshape(-1) for x in (q, k, v)]
    o = np.zeros(B * H * M * D // 2, dtype=np.uint32)
    lse = np.zeros(B * H * M, dtype=np.float32)
    strides = (H * M * D, M * D, D, Hk * N * D, N * D, D, Hk * N * D, N * D, D)
    from falower.backends.numba_cuda.emit_fa2 import uses_kv_maps, uses_o_map, uses_work_counter
    from falower.backends.numba_cuda.intrinsics import sim_tensor_map
    from falower.backends.numba_cuda.tensor_maps import o_map_geometry, qkv_map_geometry

    work = (np.zeros(2, dtype=np.int32),) if uses_work_counter(spec) else ()  # item_order "dynamic"'s counter
    o_arg = o
    if uses_o_map(spec):  # O's tensor map (tma_store): the simulator's stand-in for the driver's, over the device
        from numba import cuda  # array the kernel writes (a host array would be copied in and back over it)

        o_arg = cuda.to_device(o)
        o = np.asarray(o_arg)  # its memory
        work += (sim_tensor_map(o.view(np.uint16), *o_map_geometry(B * H, M, D)),)
    if uses_kv_maps(spec):  # Q's, K's and V's maps (tma_loads), over the device arrays the kernel reads
        from numba import cuda

        bits = [cuda.to_device(x) for x in bits]
        work += tuple(sim_tensor_map(np.asarray(x).view(np.uint16), *qkv_map_geometry(
            B, heads, rows, D, strides[3 * i:3 * i + 3], 64 if i == 0 else spec.block_k))
            for i, (x, heads, rows) in enumerate(zip(bits, (H, Hk, Hk), (M, N, N))))
    return (*bits, o_arg, lse, B, H, M, N, *strides, *work, *caps), o, lse


def run_case(case_id: str) -> dict:
    from falower.backends.numba_cuda import emit_fa3
    from falower.backends.numba_cuda.runtime import load_source

    import dataclasses

    variant, dtype, D, B, H, M, N, G, bq, bk, *extra = CASES[case_id]
    rng = case_rng(case_id)
    spec = make_spec(variant, D, dtype, path="mma", block_q=bq, block_k=bk, num_warps=4 * (bq // 64),
                     group_size=G, name=f"fa3sim_{case_id.replace('-', '_')}")
    if extra:
        spec = dataclasses.replace(spec, extra=extra[0])
    src = emit_fa3.emit_fa3_forward(spec)
    kern = getattr(load_source(src, spec.name), spec.name)
    q, k, v = random_inputs(rng, dtype, B, H, M, N, D, G)
    caps = random_captures(rng, variant, B, H, M, N)
    args, o, lse = launch_args(spec, q, k, v, caps)
    t0 = time.time()
    kern[emit_fa3.grid(spec, B, H, M, N), emit_fa3.threads_per_block(spec), 0, emit_fa3.smem_bytes(spec)](*args)
    seconds = time.time() - t0
    qf, kf, vf = (as_float(x, dtype) for x in (q, k, v))
    ro, rl = reference(qf, kf, vf, variant, caps, G)
    if dtype == "f16":
        of = o.view(np.float16).astype(np.float64).reshape(B, H, M, D)
    else:
        of = (o.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64).reshape(B, H, M, D)
    lse = lse.reshape(B, H, M)
    masked = ~np.isfinite(rl)
    return {
        "id": case_id,
        "dtype": dtype,
        "o_err": float(np.abs(of - ro).max()),
        "lse_err": float(np.abs(lse[~masked] - rl[~masked]).max()) if (~masked).any() else 0.0,
        "nan": bool(np.isnan(of).any() or np.isnan(lse).any()),
        "seconds": round(seconds, 1),
    }


def run_runtime_case(case_id: str) -> dict:
    import dataclasses

    from falower.backends.numba_cuda import FA2ForwardKernel

    variant, dtype, D, B, H, M, N, G, bq, bk = RUNTIME_CASES[case_id]
    rng = case_rng(case_id)
    spec = make_spec(variant, D, dtype, path="mma", block_q=bq, block_k=bk, num_warps=4, group_size=G,
                     name=f"fa3rt_{case_id.replace('-', '_')}")
    kern = FA2ForwardKernel(dataclasses.replace(spec, extra={"schedule": "wgmma"}))
    assert "wgmma_ss" in kern.source
    q, k, v = random_inputs(rng, dtype, B, H, M, N, D, G)
    caps = random_captures(rng, variant, B, H, M, N)
    o, lse = kern(q, k, v, *caps)
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
        "masked_ok": bool(np.all(np.isneginf(lse[masked])) and np.all(of[masked] == 0.0)),
    }


def main(ids) -> None:
    run_main(ids or [*CASES, *RUNTIME_CASES, *API_CASES], lambda cid: (
        run_runtime_case if cid in RUNTIME_CASES else run_api_case if cid in API_CASES else run_case)(cid))


if __name__ == "__main__":
    main(sys.argv[1:])
