#!/usr/bin/env python3
"""Host time of one attention call (issue 10, item 3): falower against torch SDPA (FLASH) and torch's
compiled flex_attention, at a size whose GPU time is negligible, so what is measured is Python, checks,
allocation and the launch.

Each row is `time.perf_counter` around many calls with no synchronisation in the loop (the GPU keeps up:
each kernel takes a few microseconds), divided by the number of calls; the best of several repeats.

  SDPA FLASH            F.scaled_dot_product_attention(q, k, v, is_causal=True) under sdpa_kernel(FLASH)
  flex (torch.compile)  torch.compile(flex_attention)(q, k, v, score_mod=..., block_mask=...)
  fl.compile            c(q, k, v), c = fl.compile(causal graph)
  fl.flex_attention     fl.flex_attention(q, k, v, score_mod=..., block_mask=...)  (a 0-d captured tensor)
  fl backward           c.backward(q, k, v, o, lse, do) (Delta, main kernel, dQ conversion)
  launch alone          the forward plan's cuLaunchKernel calls and nothing else (the floor)

Then a CUDA graph: a falower call captured with torch.cuda.graph, replayed on new inputs, compared with an
eager call. `--warm` measures a new process with the disk cache present instead: import, trace and passes,
building the kernel object (reading the emitted source, the cubin cache's read, the driver's module load;
Numba's import and compile only where the cubin cache misses), the first call; it says whether Numba was
imported at all.

    python benchmarks/call_overhead.py [--calls 2000] [--no-flex] [--json out.json]
    python benchmarks/call_overhead.py --warm
    python benchmarks/call_overhead.py --decode [--n 1024 4096] [--b 1] [--h 8] [--d 128]

`--decode` times decoding calls instead (M = 1 query row, no mask; split-kv's parts and their merge, or a
cluster's): SDPA FLASH and cuDNN, `fl.compile`'s call, its plan's launches alone, and a CUDA graph's replay, the
same host-time way; then cProfile's heaviest functions of the falower call, where its host time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_required import require_gpu  # noqa: E402

B, H, N, D = 1, 2, 128, 64


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / calls * 1e6)
    return best


def launch_alone_us(c, inputs: tuple, calls: int) -> float:
    """Host time of the warm call's plan's launches alone (its cuLaunchKernel calls and nothing else: the floor)."""
    import torch

    from falower.compiler import _signature

    plan = c._calls[_signature(inputs)].plan
    stream = torch.cuda.current_stream().cuda_stream

    def launch_alone():
        for run in plan.launches:
            run(stream)

    return per_call_us(launch_alone, calls)


def captured_call(c, static: list) -> tuple:
    """(a CUDA graph of c(*static), the outputs it writes), warmed on a side stream first as torch.cuda.graph asks."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            c(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = c(*static)
    return graph, out


def graphs():
    import torch

    import falower as fl

    causal = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")
    slope = torch.tensor(-0.05, device="cuda")  # a 0-d captured tensor: read by the kernel, never .item()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slope * (kv_idx - q_idx)

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return causal, slope, score_mod, mask_mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--no-flex", action="store_true", help="skip torch.compile(flex_attention)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--warm", action="store_true", help="time a warm first call in a new process")
    ap.add_argument("--warm-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--decode", action="store_true", help="decoding calls (M = 1) instead; see the docstring")
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096], help="--decode: the keys")
    ap.add_argument("--b", type=int, default=1, help="--decode: the batch")
    ap.add_argument("--h", type=int, default=8, help="--decode: the heads")
    ap.add_argument("--d", type=int, default=128, help="--decode: the head dimension")
    args = ap.parse_args()
    require_gpu("call_overhead.py")
    if args.decode:
        return decode(args)
    if args.warm_child:
        return warm_child()
    if args.warm:
        return warm(args.json)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import falower as fl

    causal, slope, score_mod, mask_mod = graphs()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    c = fl.compile(causal)
    bm = fl.create_block_mask(mask_mod, None, None, N, N, device="cuda")
    o, lse = c(q, k, v)
    do = torch.randn_like(o)
    fl.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    c.backward(q, k, v, o, lse, do)
    rows: dict[str, float] = {}

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        rows["SDPA FLASH"] = per_call_us(sdpa, args.calls)
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            tbm = create_block_mask(mask_mod, None, None, N, N, device="cuda")
            flex = torch.compile(flex_attention)
            t0 = time.perf_counter()
            flex(q, k, v, score_mod=score_mod, block_mask=tbm)
            print(f"torch.compile(flex_attention) first call: {time.perf_counter() - t0:.1f} s", flush=True)
            rows["flex (torch.compile)"] = per_call_us(lambda: flex(q, k, v, score_mod=score_mod, block_mask=tbm),
                                                       args.calls)
        except Exception as e:  # noqa: BLE001  (report and go on)
            print(f"flex (torch.compile) failed: {type(e).__name__}: {e}", flush=True)
    rows["fl.compile"] = per_call_us(lambda: c(q, k, v), args.calls)
    rows["fl.flex_attention"] = per_call_us(lambda: fl.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm),
                                            args.calls)
    rows["fl backward"] = per_call_us(lambda: c.backward(q, k, v, o, lse, do), args.calls)
    rows["launch alone"] = launch_alone_us(c, (q, k, v), args.calls)

    # CUDA graph: capture a falower call, replay on new inputs, compare with eager
    static = [x.clone() for x in (q, k, v)]
    graph, (go, glse) = captured_call(c, static)
    for x in static:
        x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g))
    graph.replay()
    eo, else_ = c(*static)
    torch.cuda.synchronize()
    graph_ok = bool(torch.equal(go, eo) and torch.equal(glse, else_))
    rows["CUDA graph replay"] = per_call_us(graph.replay, args.calls)

    dev = torch.cuda.get_device_name()
    print(f"\nhost time per call, {dev}, B={B} H={H} N={N} D={D} f16 causal, {time.strftime('%Y-%m-%d')}")
    print(f"{'call':24s} {'us/call':>9s} {'vs SDPA':>9s}")
    for name, us in rows.items():
        print(f"{name:24s} {us:9.1f} {us - rows['SDPA FLASH']:+9.1f}")
    print(f"CUDA graph capture/replay equals eager: {graph_ok}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev, "date": time.strftime("%Y-%m-%d"), "us": rows,
                                               "graph_equal": graph_ok}, indent=1))
    if not graph_ok:
        sys.exit(1)


# ------------------------------------------------------------------------------------------------ decoding
def decode(args) -> None:
    """Host time of decoding calls (M = 1): SDPA FLASH and cuDNN, falower's call, its launches alone, a graph's
    replay, per key count; then the falower call's heaviest functions by cProfile (its own time)."""
    import cProfile
    import pstats

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import falower as fl
    from falower.compiler import _signature

    c = fl.compile(fl.attention(name="plain"))
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.cuda.get_device_name()
    print(f"host time per decoding call, {dev}, B={args.b} H={args.h} M=1 D={args.d} f16, {time.strftime('%Y-%m-%d')}")
    print(f"{'N':>6s} {'call':24s} {'us/call':>9s} {'vs FLASH':>9s}")
    out: dict[str, dict[str, float]] = {}
    for n in args.n:
        q = torch.randn(args.b, args.h, 1, args.d, device="cuda", dtype=torch.float16, generator=g)
        k, v = (torch.randn(args.b, args.h, n, args.d, device="cuda", dtype=torch.float16, generator=g)
                for _ in range(2))
        o, _ = c(q, k, v)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        err = float((o.float() - ref).abs().max())
        rows: dict[str, float] = {}
        for name, backend in (("SDPA FLASH", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    rows[name] = per_call_us(lambda: F.scaled_dot_product_attention(q, k, v), args.calls)
            except RuntimeError as e:  # (a backend that refuses the shape: reported, not timed)
                print(f"{n:6d} {name}: {str(e).splitlines()[0][:80]}")
        rows["fl.compile"] = per_call_us(lambda: c(q, k, v), args.calls)
        rows["launch alone"] = launch_alone_us(c, (q, k, v), args.calls)
        graph, _ = captured_call(c, [x.clone() for x in (q, k, v)])
        plan = c._calls[_signature((q, k, v))].plan
        rows["CUDA graph replay"] = per_call_us(graph.replay, args.calls)
        flash = rows.get("SDPA FLASH", float("nan"))
        for name, us in rows.items():
            print(f"{n:6d} {name:24s} {us:9.1f} {us - flash:+9.1f}")
        print(f"{n:6d} launches: {len(plan.launches)}; max |O - SDPA f32|: {err:.2e}", flush=True)
        out[str(n)] = rows
    pieces = _decode_pieces(c, (q, k, v), args.calls)
    print(f"\nthe falower call's pieces at N = {args.n[-1]} (each timed alone, us):")
    for name, us in pieces.items():
        print(f"  {name:44s} {us:6.2f}")
    out["pieces"] = pieces
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        c(q, k, v)
    prof.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile of {args.calls} falower calls at N = {args.n[-1]} (own time):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev, "date": time.strftime("%Y-%m-%d"), "us": out}, indent=1))


def _decode_pieces(c, inputs: tuple, calls: int) -> dict[str, float]:
    """Host time of each step of a warm falower call, timed alone (the same calls the call makes, in its order):
    where the whole call's host time goes beyond its launches."""
    import torch

    from falower.compiler import _signature, _wants_grad

    key = _signature(inputs)
    call = c._calls[key]
    plan = call.plan
    kern = plan.kern
    q = inputs[0]
    arrays, caps = call.arguments(inputs)
    o = torch.empty(plan.o_shape, dtype=q.dtype, device=plan.device)
    lse = torch.empty(plan.lse_shape, dtype=plan.lse_dtype, device=plan.device)
    ptrs = tuple(x.data_ptr() for x in arrays)
    stream = plan.stream(plan.dev_index)
    pieces = {
        "whole call c(q, k, v)": lambda: c(*inputs),
        "_wants_grad": lambda: _wants_grad(inputs),
        "_signature": lambda: _signature(inputs),
        "_WarmCall.arguments": lambda: call.arguments(inputs),
        "torch.empty o and lse": lambda: (torch.empty(plan.o_shape, dtype=q.dtype, device=plan.device),
                                          torch.empty(plan.lse_shape, dtype=plan.lse_dtype, device=plan.device)),
        "q.new_empty o and lse": lambda: (q.new_empty(plan.o_shape),
                                          q.new_empty(plan.lse_shape, dtype=plan.lse_dtype)),
        "torch.empty o and lse, device index": lambda: (
            torch.empty(plan.o_shape, dtype=q.dtype, device=plan.dev_index),
            torch.empty(plan.lse_shape, dtype=plan.lse_dtype, device=plan.dev_index)),
        "data_ptr x 3": lambda: (arrays[0].data_ptr(), arrays[1].data_ptr(), arrays[2].data_ptr()),
        "plan.stream": lambda: plan.stream(plan.dev_index),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "plan.launch_into (with its launches)": lambda: plan.launch_into(ptrs, caps, o, lse),
        "the launches alone": lambda: [run(stream) for run in plan.launches],
    }
    if plan.kv_maps:
        def maps():
            for slot, i, geometry, name in plan.kv_maps:
                kern.maps.torch(ptrs[i], plan.device, geometry, False, stream, name)
        pieces[f"tensor maps x {len(plan.kv_maps)}"] = maps
    if plan.ws_shapes is not None:
        pieces["split_workspaces"] = lambda: kern.split_workspaces(plan.device, stream, plan.ws_shapes, o.dtype,
                                                                   lse.dtype, False)
    return {name: per_call_us(fn, calls) for name, fn in pieces.items()}


# ------------------------------------------------------------------------------------------------ warm path
def warm(json_path) -> None:
    """Run warm_child twice in new processes (the first may compile; the second finds the disk cache)."""
    for label in ("first process (may compile)", "second process (warm disk cache)"):
        env = dict(os.environ, FALOWER_QUIET="1")
        proc = subprocess.run([sys.executable, __file__, "--warm-child"], env=env, capture_output=True, text=True)
        print(f"--- {label}\n{proc.stdout}{proc.stderr[-3000:]}", flush=True)
        if json_path and label.startswith("second"):
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if line:
                Path(json_path).write_text(line[-1])


def warm_child() -> None:
    stamps = {}
    t0 = time.perf_counter()
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    stamps["import torch + CUDA init"] = time.perf_counter() - t0
    t = time.perf_counter()
    import falower as fl
    from falower.backends.numba_cuda import runtime

    stamps["import falower"] = time.perf_counter() - t
    parts = {"emit (or read the emitted source)": 0.0, "load_source (imports numba.cuda)": 0.0,
             "kernel image (cubin cache, else Numba)": 0.0, "cubin cache read (inside the above)": 0.0,
             "module load (driver)": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                parts[name] += time.perf_counter() - t
        return wrapper

    from falower.backends.numba_cuda import cubin_cache

    runtime.emit_cached = timed("emit (or read the emitted source)", runtime.emit_cached)
    runtime.load_source = timed("load_source (imports numba.cuda)", runtime.load_source)
    runtime.DirectKernel.image = timed("kernel image (cubin cache, else Numba)", runtime.DirectKernel.image)
    cubin_cache.load = timed("cubin cache read (inside the above)", cubin_cache.load)
    runtime.DirectKernel.function = timed("module load (driver)", runtime.DirectKernel.function)

    t = time.perf_counter()
    causal, slope, score_mod, mask_mod = graphs()
    c = fl.compile(causal)
    stamps["trace + fa2-fwd passes"] = time.perf_counter() - t
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
    t = time.perf_counter()
    c(q, k, v)
    torch.cuda.synchronize()
    stamps["first call (kernel build + launch)"] = time.perf_counter() - t
    t = time.perf_counter()
    bm = fl.create_block_mask(mask_mod, None, None, N, N, device="cuda")
    fl.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    torch.cuda.synchronize()
    stamps["first flex_attention (trace, passes, build, launch)"] = time.perf_counter() - t
    for name, sec in list(stamps.items()) + [(f"  of which {k}", v) for k, v in parts.items()]:
        print(f"{name:55s} {sec * 1e3:9.1f} ms")
    total = sum(v for k, v in stamps.items() if not k.startswith("import torch"))
    print(f"{'total after import torch (2 kernels)':55s} {total * 1e3:9.1f} ms")
    numba = "numba" in sys.modules
    print(f"{'numba imported':55s} {'yes' if numba else 'no'}")
    print(json.dumps({"stamps_ms": {k: v * 1e3 for k, v in stamps.items()},
                      "parts_ms": {k: v * 1e3 for k, v in parts.items()}, "total_ms": total * 1e3,
                      "numba_imported": numba}))


if __name__ == "__main__":
    main()
