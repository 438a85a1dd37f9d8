"""The wgmma forward kernel (emit_fa3.py) on the GPU: FlashAttention's error rule, then TFLOP/s against SDPA
FLASH and CUDNN from the same run (issue 11). Kernels compile in parallel worker processes (Numba's disk
cache), then the main process loads them.

Usage: python3 benchmarks/bench_fa3.py [--configs plain,128,128,128 causal,64,128,128 ...] [--n 4096]
       a config is variant,D,block_q,block_k[,overlap] (variant: plain or causal; overlap: spec.extra["overlap"])
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "backend"))
sys.path.insert(0, str(ROOT))


def _spec(cfg: str):
    from variants import make_spec

    import dataclasses

    variant, D, bq, bk, *flags = cfg.split(",")
    D, bq, bk = int(D), int(bq), int(bk)
    spec = make_spec(variant, D, "f16", path="mma", block_q=bq, block_k=bk, num_warps=4 * (bq // 64),
                     name=f"fa3_{variant}_d{D}_{bq}x{bk}{'_' + '_'.join(flags) if flags else ''}")
    return dataclasses.replace(spec, extra={"overlap": "overlap" in flags})


def _argtypes(spec):
    from falower.backends.numba_cuda.runtime import FA2ForwardKernel

    holder = type("Holder", (), {"spec": spec})()
    return FA2ForwardKernel.argtypes(holder)


def _kernel(spec):
    from falower.backends.numba_cuda import emit_fa3
    from falower.backends.numba_cuda.runtime import load_source

    return getattr(load_source(emit_fa3.emit_fa3_forward(spec), spec.name), spec.name)


def compile_one(cfg: str) -> dict:
    """Worker: compile (fills Numba's disk cache) and report registers from the PTX's link."""
    t0 = time.time()
    try:
        spec = _spec(cfg)
        kern = _kernel(spec)
        kern.compile(_argtypes(spec))
        return {"cfg": cfg, "compile_s": round(time.time() - t0, 1)}
    except Exception as exc:
        import traceback

        return {"cfg": cfg, "error": traceback.format_exc()[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=["plain,128,128,128", "plain,128,128,64", "causal,128,128,128",
                                                     "plain,64,128,128", "plain,64,192,128", "causal,64,128,128"])
    ap.add_argument("--n", type=int, nargs="*", default=[4096])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    t0 = time.time()
    with ProcessPoolExecutor(max_workers=min(len(args.configs), 12)) as pool:
        for r in pool.map(compile_one, args.configs):
            print(json.dumps(r), flush=True)
    print(json.dumps({"parallel_compile_s": round(time.time() - t0, 1)}), flush=True)

    import torch
    import torch.nn.functional as F
    from numba import cuda
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from falower.backends.numba_cuda import emit_fa3

    results = []

    def emit(r):
        print(json.dumps(r), flush=True)
        results.append(r)

    def bench(fn, reps=7, inner=10):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            st.record()
            for _ in range(inner):
                fn()
            en.record()
            en.synchronize()
            times.append(st.elapsed_time(en) / inner)
        return sorted(times)[len(times) // 2]

    def runner(spec, kern, q, k, v):
        B, H, M, D = q.shape
        N = k.shape[2]
        o = torch.empty_like(q)
        lse = torch.empty(B, H, M, device=q.device, dtype=torch.float32)
        flat = lambda t: cuda.as_cuda_array(t.reshape(-1))  # noqa: E731
        a = (flat(q.view(torch.int16)), flat(k.view(torch.int16)), flat(v.view(torch.int16)),
             flat(o.view(torch.int32)), flat(lse), B, H, M, N, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
        compiled = kern.compile(_argtypes(spec))  # the workers' disk cache: the exact signature they compiled
        cufunc = compiled._codelibrary.get_cufunc()
        from numba.cuda.cudadrv.driver import binding, driver

        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        smem = emit_fa3.smem_bytes(spec)
        driver.cuKernelSetAttribute(attr, smem, cufunc.handle, cufunc.device.id)
        g, nt = emit_fa3.grid(spec, B, H, M, N), emit_fa3.threads_per_block(spec)
        stream = cuda.default_stream()
        return (lambda: compiled.launch(a, g, (nt, 1, 1), stream, smem)), o, lse

    dev = "cuda"
    torch.manual_seed(0)
    for cfg in args.configs:
        variant, D = cfg.split(",")[0], int(cfg.split(",")[1])
        causal = variant == "causal"
        try:
            spec = _spec(cfg)
            kern = _kernel(spec)
            # FlashAttention's error rule at a ragged size: max error vs float64 <= 2x naive f16 attention's
            B, H, M = 1, 2, 1000
            q, k, v = (torch.randn(B, H, M, D, device=dev, dtype=torch.float16) for _ in range(3))
            fn, o, lse = runner(spec, kern, q, k, v)
            fn()
            torch.cuda.synchronize()
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
            s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(D))
            if causal:
                s = s.masked_fill(torch.ones(M, M, device=dev, dtype=torch.bool).triu(1), float("-inf"))
            naive = torch.softmax(s, dim=-1) @ v
            err = (o.double() - ref).abs().max().item()
            nerr = (naive.double() - ref).abs().max().item()
            lref = torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
                                   + (torch.zeros(M, M, device=dev, dtype=torch.float64).masked_fill(
                                       torch.ones(M, M, device=dev, dtype=torch.bool).triu(1), float("-inf"))
                                      if causal else 0), dim=-1)
            lerr = (lse.double() - lref).abs().max().item()
            emit({"case": f"check_{cfg}", "max_err": err, "naive_f16_err": nerr, "lse_err": lerr,
                  "ok": bool(err <= 2 * nerr + 1e-5 and lerr < 1e-3)})
            for n in args.n:
                B, H = 16384 // n, 2048 // D
                q, k, v = (torch.randn(B, H, n, D, device=dev, dtype=torch.float16) for _ in range(3))
                flops = 4 * B * H * n * n * D / (2 if causal else 1)
                fn, o, lse = runner(spec, kern, q, k, v)
                ms = bench(fn)
                r = {"case": f"fa3_{cfg}", "N": n, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(be):
                            f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                            sms = bench(f)
                        r[name] = round(flops / sms / 1e9, 1)
                    except Exception as exc:
                        r[name] = repr(exc)[:100]
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    rr = F.scaled_dot_product_attention(q[:1, :2], k[:1, :2], v[:1, :2], is_causal=causal)
                r["vs_flash_max_diff"] = (o[:1, :2].float() - rr.float()).abs().max().item()
                emit(r)
        except Exception:
            import traceback

            emit({"case": cfg, "error": traceback.format_exc()[-1500:]})
    with open(os.path.join(args.out, "bench_fa3.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
