"""Run one example variant's forward a few times, falower's and/or FlexAttention's, and nothing else: the process
to put under a profiler (the bench's timing loop launches thousands of kernels and many variants).

    ncu --clock-control none --kernel-name regex:'document|flex' --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python3 benchmarks/run_variant.py document --d 128 --who both

--bwd adds the backward (falower's dQ and dK / dV kernels; Flex's through autograd). --who cudnn runs torch SDPA's
cuDNN backend instead (plain and causal only: the kernels falower's README rows are read against).
Variants and their captured data are bench.py's (`bench.variant`, `bench.example_compiled`); with --config the
falower kernel is that tile config's (`bench.parse_config`, e.g. 128x64w8-wsn), otherwise the automatic choice.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_required import require_gpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stem", help="an example's name (examples/<stem>.py) or a bench-only variant")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--who", choices=["falower", "flex", "both", "cudnn"], default="falower")
    ap.add_argument("--config", default="", help="a bench tile config for falower (default: automatic choice)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--bwd", action="store_true", help="then the backward: falower's c.backward (its dQ and dK / dV "
                    "kernels), Flex's through autograd")
    args = ap.parse_args()
    require_gpu("run_variant.py")

    import torch

    import bench

    D, N = args.d, args.n
    H, B = 2048 // D, max(1, 16384 // N)
    var = bench.variant(args.stem, B, H, N, D)
    q = torch.randn(B, H, N, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, H // var.group, N, D, device="cuda", dtype=torch.float16) for _ in range(2))
    if args.who in ("falower", "both"):
        c = (bench.example_compiled_config(args.stem, bench.parse_config(args.config)) if args.config
             else bench.example_compiled(args.stem))
        caps = [var.captures[a.name] for a in c.func.args[3:]]
        kern = c.kernel(q, k, v, *caps)
        print(f"falower {args.stem}: {kern.spec.name} schedule {kern.spec.extra.get('schedule', 'mma')} "
              f"tiles {kern.spec.block_q}x{kern.spec.block_k}", flush=True)
        for _ in range(args.reps):
            o, lse = c.forward(q, k, v, *caps)
        if args.bwd:
            do = torch.randn_like(q)
            for _ in range(args.reps):
                c.backward(q, k, v, o, lse, do, *caps)
    if args.who in ("flex", "both") and (var.mask_mod is not None or var.score_mod is not None):
        block_mask = bench.block_mask_for(var.mask_mod, B, H, N, var.per_batch)
        flex = bench.flex_attention()
        ql, kl, vl = (x.detach().requires_grad_(args.bwd) for x in (q, k, v))
        for _ in range(args.reps):
            o = flex(ql, kl, vl, score_mod=var.score_mod, block_mask=block_mask, scale=var.scale,
                     enable_gqa=var.group > 1)
            if args.bwd:
                o.backward(torch.randn_like(o))
    if args.who == "cudnn":
        if args.stem not in ("plain", "causal"):
            sys.exit(f"run_variant.py: --who cudnn runs plain or causal, not {args.stem!r}")
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ql, kl, vl = (x.detach().requires_grad_(args.bwd) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for _ in range(args.reps):
                o = torch.nn.functional.scaled_dot_product_attention(ql, kl, vl, is_causal=args.stem == "causal")
                if args.bwd:
                    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
