"""What a data mask's block data costs when its data is new (a new batch's document ids every step), part by part.

Block data (range tables, run tables, block lists: falower/backends/numba_cuda/block_data.py) is remembered with the
tensor it came from, so a step whose ids are new makes it again for the forward's kernel and for the backward's.
This probe times each derived capture of both kernels, and the block list kernel, two ways:
  issue  the host's time to issue it (the GPU kept busy by a sleep kernel first, so nothing waits for it): what a
         step pays where the host is the bound (small shapes, a GPU idle between calls);
  gpu    CUDA events around it, queued behind that sleep: what it adds where the GPU is the bound.
and the whole calls (forward + backward, and torch autograd) with the same ids against a new view of them each call.

    python3 benchmarks/probe_block_data.py [--example document] [--n 4096] [--d 128] [--b 4] [--h 16] [--profile] [--pyprofile]

Needs torch and a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPS = 20


def issue_and_gpu(fn, reps: int = REPS) -> tuple[float, float]:
    """(host issue, GPU time) of one fn() in microseconds, each the mean over `reps` calls queued behind a sleep."""
    import torch

    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work: the calls below queue behind it
    e0.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    issue = (time.perf_counter() - t0) / reps * 1e6
    e1.record()
    torch.cuda.synchronize()
    return issue, e0.elapsed_time(e1) / reps * 1e3


def wall(fn, reps: int = REPS) -> float:
    """One fn() by the host's clock with the GPU idle before it and waited for after: microseconds, the median."""
    import statistics

    import torch

    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def parts(c, kern, caps: list, sizes: tuple, like) -> list[tuple[str, object]]:
    """(name, fn) for each derived capture of `kern` (made from `caps`, the caller's captures and sizes), the block
    list kernel, and the whole block data."""
    from falower.backends.numba_cuda.block_data import list_layout, range_table, run_table

    blocks = c.block_data(kern)
    if blocks is None:
        return []
    spec, first = kern.spec, blocks.first
    made = list(caps[:first])
    out, derived = [], []
    for cap in spec.captures[first:]:
        if cap.derived[0] == "ranges":
            _, i, axis, g = cap.derived
            fn = (lambda i=i, axis=axis, g=g, dt=cap.dtype: range_table(made[i], axis, g, dt))
            out.append((f"ranges {spec.captures[i].name} axis {axis} by {g}", fn))
            derived.append(fn())
        elif cap.derived[0] == "runs":
            _, i, axis = cap.derived
            fn = (lambda i=i, axis=axis: run_table(made[i], axis))
            out.append((f"runs {spec.captures[i].name} axis {axis}", fn))
            derived.append(fn())
    if list_layout(spec, sizes):
        out.append(("block list kernel", lambda: blocks._block_list(made + derived, sizes, like)))
    out.append(("all of it", lambda: blocks._make(made, sizes, like)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--example", default="document")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--profile", action="store_true",
                    help="also torch.profiler's host table of 5 steps each: the calls and autograd, same ids and new")
    ap.add_argument("--pyprofile", action="store_true",
                    help="also cProfile's table of 20 autograd steps with the same ids, by own time")
    args = ap.parse_args()
    from gpu_required import require_gpu

    require_gpu("probe_block_data.py")

    import torch

    import bench
    import falower as fl

    B, H, N, D = args.b, args.h, args.n, args.d
    var = bench.variant(args.example, B, H, N, D)
    c = fl.compile(bench.example_graph(args.example), "numba-cuda")
    torch.manual_seed(0)
    q, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn(B, H // var.group, N, D, device="cuda", dtype=torch.float16) for _ in range(2))
    user = [var.captures[a.name] for a in c.func.args[3:]]
    o, lse = c.forward(q, k, v, *user)
    c.backward(q, k, v, o, lse, do, *user)
    rows = []
    for phase, (kern, env) in (("fwd", c._kernel_and_dims((q, k, v, *user))),
                               ("bwd", c._backward_kernel_and_dims((q, k, v, *user)))):
        sizes = (c.runtime_sizes(kern, env) if phase == "fwd"  # the backward's from its spec, as a call's
                 else [int(env[d.removeprefix("dim_")]) for d in kern.spec.dims])
        caps = [*user, *sizes]
        for name, fn in parts(c, kern, caps, (B, H, N, N), q):
            issue, gpu = issue_and_gpu(fn)
            rows.append((phase, name, issue, gpu, wall(fn)))

    def fresh(x):  # the same values as a new tensor object: its block data is made again
        return x.view(x.shape) if isinstance(x, torch.Tensor) else x

    def calls(new: bool):
        u = [fresh(x) for x in user] if new else user
        o, lse = c.forward(q, k, v, *u)
        c.backward(q, k, v, o, lse, do, *u)

    ql, kl, vl = (x.detach().clone().requires_grad_(True) for x in (q, k, v))

    def autograd(new: bool):
        u = [fresh(x) for x in user] if new else user
        c(ql, kl, vl, *u)[0].backward(do)

    for name, fn in (("calls", calls), ("autograd", autograd)):
        same, new = wall(lambda: fn(False)), wall(lambda: fn(True))
        issue_new, gpu_new = issue_and_gpu(lambda: fn(True), 10)
        issue_same, gpu_same = issue_and_gpu(lambda: fn(False), 10)
        rows.append(("step", f"{name}: new ids - same ids", issue_new - issue_same, gpu_new - gpu_same, new - same))
        rows.append(("step", f"{name}, same ids", issue_same, gpu_same, same))

    if args.pyprofile:
        import cProfile
        import pstats

        autograd(False)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            autograd(False)
        prof.disable()
        torch.cuda.synchronize()
        print("\nautograd, same ids, 20 steps: Python's time by function")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(22)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("calls", calls), ("autograd", autograd)):
            for new in (False, True):
                fn(new)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(5):
                        fn(new)
                    torch.cuda.synchronize()
                print(f"\n{name}, {'new' if new else 'same'} ids, 5 steps: the host's time by op")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))

    print(f"\nblock data of {args.example}, B = {B}, H = {H}, N = {N}, D = {D}, {torch.cuda.get_device_name()} "
          f"(microseconds; issue: the host's, GPU busy; gpu: CUDA events; wall: GPU idle before, waited after)")
    print("| kernel | part | issue | gpu | wall |")
    print("|---|---|---|---|---|")
    for phase, name, issue, gpu, w in rows:
        print(f"| {phase} | {name} | {issue:.0f} | {gpu:.0f} | {w:.0f} |")


if __name__ == "__main__":
    main()
