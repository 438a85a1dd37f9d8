#!/usr/bin/env python3
"""FA2 forward on the GPU: check, then time falower's Numba kernel against torch SDPA (FLASH, CUDNN).

Sweep (the FlashAttention-2 paper's): D = 64, 128; N = 512 .. 16k; B * N = 16k tokens; H * D = 2048;
causal and not; fp16. FLOPs = 4 * B * H * N * N * D, halved for causal. Times are medians of
triton.testing.do_bench (CUDA events). "ours" times the forward kernel launched on prepared buffers
(`FA2ForwardKernel.prepare`); "ours+call" the whole Python call (checks, allocation, launch).

    python benchmarks/bench_fwd.py                 # the full sweep
    python benchmarks/bench_fwd.py --quick         # D=64,128 at N=1k,4k only, fewer configs
    python benchmarks/bench_fwd.py --configs 64x64w4,128x64w8 --n 4096

Prints a short table last; writes bench.log, results.json and results.md to $OUT (default ./bench_out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    import torch  # noqa: E402
except ImportError:  # make_kernel alone works without torch (PTX inspection on a CPU machine)
    torch = None

from falower.backends.numba_cuda import FA2ForwardKernel, FA2ForwardSpec  # noqa: E402

LOG2E = 1.4426950408889634
OUT = Path(os.environ.get("OUT", "./bench_out"))


def log(*args) -> None:
    line = " ".join(str(a) for a in args)
    print(line, flush=True)
    with open(OUT / "bench.log", "a") as f:
        f.write(line + "\n")


# ------------------------------------------------------------------------------------------------
# The kernel under test. One factory: today it writes the spec by hand; later falower.compile(...).
# ------------------------------------------------------------------------------------------------


def parse_config(text: str) -> tuple:
    """'128x64w8' -> (128, 64, 8, {}) = (block_q, block_k, num_warps, spec.extra). Suffixes set extras:
    '-qs' / '-qr' Q in shared memory / registers, '-2b' two barriers per kv tile (K and V waited for
    separately), '-hgN' block order in groups of N (b, h) pairs, '-ws' / '-nows' per-warp skipping of
    masked rows in partial tiles on / off (default off)."""
    text, *opts = text.split("-")
    tiles, warps = text.split("w")
    bq, bk = tiles.split("x")
    extra = {}
    for o in opts:
        if o in ("qs", "qr"):
            extra["q_in_regs"] = o == "qr"
        elif o == "2b":
            extra["one_barrier"] = False
        elif o == "nows":
            extra["warp_skip"] = False
        elif o == "ws":
            extra["warp_skip"] = True
        elif o.startswith("hg"):
            extra["head_group"] = int(o[2:])
        else:
            raise ValueError(f"unknown config option {o!r} in {text!r}")
    return (int(bq), int(bk), int(warps), extra)


def config_tag(cfg: tuple) -> str:
    bq, bk, nw, *rest = cfg
    extra = rest[0] if rest else {}
    tag = f"{bq}x{bk}w{nw}"
    if "q_in_regs" in extra:
        tag += "-qr" if extra["q_in_regs"] else "-qs"
    if extra.get("one_barrier") is False:
        tag += "-2b"
    if "head_group" in extra:
        tag += f"-hg{extra['head_group']}"
    if "warp_skip" in extra:
        tag += "-ws" if extra["warp_skip"] else "-nows"
    return tag


DEFAULT_CONFIG = {64: (128, 64, 4), 128: (128, 64, 4)}


PIPELINE = "decompose-softmax,canonicalize,fuse,tile{{bq={bq},bk={bk}}},online-softmax{{exp2=true}},mask-tiles,canonicalize"


def make_kernel(D: int, causal: bool, dtype: str = "f16", config: tuple | None = None):
    """The kernel under test, as a user gets it: attention written with falower.attention, lowered by
    the FA2 pipeline (tile sizes from `config`) and compiled by falower.compile; a FA2ForwardKernel."""
    import falower as fl

    config = config or DEFAULT_CONFIG[D]
    bq, bk, nw = config[:3]
    extra = dict(config[3]) if len(config) > 3 else {}
    mask = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx) if causal else None
    graph = fl.attention(mask_mod=mask, name="causal" if causal else "plain", dtype=dtype)
    compiled = fl.compile(graph, "numba-cuda", pipeline=PIPELINE.format(bq=bq, bk=bk), path="mma",
                          num_warps=nw, extra=extra)
    return compiled.specialize(dtype, D=D)


# ------------------------------------------------------------------------------------------------


def sdpa(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel(be):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def reference64(q, k, v, causal):
    q64, k64, v64 = q.double(), k.double(), v.double()
    s = (q64 @ k64.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        M, N = s.shape[-2:]
        s = s.masked_fill(torch.ones(M, N, dtype=torch.bool, device=q.device).tril().logical_not(), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v64, lse


def naive_lowprec(q, k, v, causal):
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        M, N = s.shape[-2:]
        s = s.masked_fill(torch.ones(M, N, dtype=torch.bool, device=q.device).tril().logical_not(), -math.inf)
    return torch.softmax(s, dim=-1).to(v.dtype) @ v


def check(D, causal, config, dtype=None):
    """FA error rule at N = 1000 (ragged) and a relative error; returns a dict."""
    dtype = dtype or torch.float16
    torch.manual_seed(0)
    B, H, N = 2, 4, 1000
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
    kern = make_kernel(D, causal, "f16" if dtype == torch.float16 else "bf16", config)
    t0 = time.time()
    o, lse = kern(q, k, v)
    torch.cuda.synchronize()
    first = time.time() - t0
    ref, ref_lse = reference64(q, k, v, causal)
    err = (o.double() - ref).abs().max().item()
    naive = (naive_lowprec(q, k, v, causal).double() - ref).abs().max().item()
    rel = ((o.double() - ref).norm() / ref.norm()).item()
    lse_err = (lse.double() - ref_lse).abs().max().item()
    ok = err <= 2 * naive + 1e-5 and lse_err < 1e-3 and not torch.isnan(o).any().item()
    return {"D": D, "causal": causal, "config": config, "max_err": err, "naive_err": naive, "rel_err": rel,
            "lse_err": lse_err, "ok": ok, "first_call_s": first}


def _compile_one(job) -> str:
    D, causal, cfg = job
    kern = make_kernel(D, causal, "f16", cfg)
    q = torch.randn(1, 1, 64, D, device="cuda", dtype=torch.float16)
    kern(q, q, q)
    torch.cuda.synchronize()
    return f"D={D} causal={causal} {config_tag(cfg)}"


def precompile(jobs) -> None:
    """Compile every kernel in parallel processes; Numba's disk cache (cache=True, next to the generated
    source) then lets this process load them instead of compiling one after another."""
    import concurrent.futures
    import multiprocessing

    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 4),
                                                mp_context=ctx) as ex:
        done = list(ex.map(_compile_one, jobs))
    log(f"precompiled {len(done)} kernels in {time.time() - t0:.1f}s")


def bench(fn, warmup=25, rep=100):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--d", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="*", default=None)
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--configs", default="", help="comma-separated tile configs per D, e.g. 64x64w4,128x64w8")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--precompile", action="store_true", help="compile all kernels in parallel first")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    Ns = args.n or ([1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192, 16384])
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    dev = torch.cuda.get_device_name()
    log(f"# bench_fwd {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} on {dev}; torch {torch.__version__}")
    configs_for = {}
    for D in args.d:
        if args.configs:
            cfgs = [parse_config(c) for c in args.configs.split(",")]
            configs_for[D] = cfgs
        else:
            configs_for[D] = [DEFAULT_CONFIG[D]]

    if args.precompile:
        precompile([(D, causal, cfg) for D in args.d for causal in causals for cfg in configs_for[D]])

    checks = []
    if not args.no_check:
        for D in args.d:
            for causal in causals:
                for cfg in configs_for[D]:
                    r = check(D, causal, cfg)
                    checks.append(r)
                    log(f"check D={D} causal={causal} cfg={cfg}: max_err {r['max_err']:.2e} naive {r['naive_err']:.2e} "
                        f"rel {r['rel_err']:.2e} lse {r['lse_err']:.2e} {'OK' if r['ok'] else 'FAIL'} "
                        f"(first call {r['first_call_s']:.1f}s)")

    rows = []
    for D in args.d:
        H = 2048 // D
        for causal in causals:
            for N in Ns:
                B = max(1, 16384 // N)
                flops = 4 * B * H * N * N * D / (2 if causal else 1)
                q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
                row = {"D": D, "N": N, "B": B, "H": H, "causal": causal}
                if not args.no_sdpa:
                    for be in ("flash", "cudnn"):
                        try:
                            ms = bench(lambda: sdpa(q, k, v, causal, be))
                            row[be] = flops / ms / 1e9
                        except Exception as exc:  # a backend may refuse a shape
                            row[be] = float("nan")
                            log(f"  {be} failed: {type(exc).__name__}: {str(exc)[:100]}")
                for cfg in configs_for[D]:
                    kern = make_kernel(D, causal, "f16", cfg)
                    launch, finish = kern.prepare(q, k, v)
                    ms = bench(launch)
                    tag = config_tag(cfg)
                    row[f"ours {tag}"] = flops / ms / 1e9
                    if cfg == configs_for[D][0]:
                        row["ours+call"] = flops / bench(lambda: kern(q, k, v)) / 1e9
                rows.append(row)
                log(json.dumps(row))
                del q, k, v
    (OUT / "results.json").write_text(json.dumps({"device": dev, "checks": checks, "rows": rows}, indent=1))

    keys = [k for k in rows[0] if k.startswith("ours ")] if rows else []
    md = [f"TFLOP/s, fp16 forward, {dev}, {time.strftime('%Y-%m-%d', time.gmtime())}",
          "", "| D | causal | N | " + " | ".join(keys) + " | ours+call | FLASH | CUDNN | best/FLASH | best/CUDNN |",
          "|" + "---|" * (8 + len(keys))]
    for r in rows:
        best = max(r[k] for k in keys)
        md.append(f"| {r['D']} | {'y' if r['causal'] else 'n'} | {r['N']} | "
                  + " | ".join(f"{r[k]:.0f}" for k in keys)
                  + f" | {r.get('ours+call', float('nan')):.0f} | {r.get('flash', float('nan')):.0f} | "
                  f"{r.get('cudnn', float('nan')):.0f} | {best / r.get('flash', float('nan')):.2f} | "
                  f"{best / r.get('cudnn', float('nan')):.2f} |")
    (OUT / "results.md").write_text("\n".join(md) + "\n")
    log("\n".join(md))
    if checks and not all(c["ok"] for c in checks):
        log("SOME CHECKS FAILED")
        sys.exit(1)


if __name__ == "__main__":
    main()
