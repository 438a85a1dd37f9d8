"""Decoding and small prefill grids in split-kv parts: the automatic choice against forced part counts, each call
timed whole inside a CUDA graph (twenty calls captured, the median of fifteen replays), SDPA's FLASH and cuDNN
captured the same way in the same process (plain attention; causal for the causal rows). What the fifty-second
session's calls C, G and I measured (benchmarks/NOTES.md "The merge inside a cluster"; BENCHMARKS.md, same
session), from its scripts `.whl/s52_c.py`, `s52_g.py`, `s52_i.py`, merged here; the set "batch" (decoding at B = 4-8,
the fifty-third session's `.whl/s53_c.py`) and "slope" (decoding's time against its kv tiles a block) added after.

    python3 benchmarks/split_parts.py [--cold] [--rounds R] [--flex]
        [--set decode|masked|prefill|batch|slope|twosm|maps|eights|twos|threes|padding|cluster|push|early|flex|all]

`--cold` gives each captured call its own copy of Q, K and V (a model's layers: their caches not in L2); without it
the twenty calls read the same tensors, which at these sizes (4-34 MB) stay in the 50 MB L2.

Variants: "auto" the automatic choice; "pN" N parts merged by the merge kernel (cluster_merge off); "cN" N parts
merged in a cluster (cluster_merge True: launched even where the device holds fewer of the grid's clusters at once;
the automatic choice takes clusters at 8 parts, and at decoding's 2 and 4 where the grid fits the SMs, then the
merge kernel where the device holds fewer); "sN" the automatic parts on a ring of
N K / V stages (2 by default: one tile's loads ahead); "b2" two blocks an SM (`blocks_per_sm`), "k64" decoding's
64-wide kv tiles on one; "nosp" the softmax of every row, padding too; "mp" the tensor maps prefetched
(map_prefetch); "pull" the cluster's merge by its two barriers and remote reads (cluster_push off); "efi" the
block's first item sent by its thread 0 at its entry (early_first_item), "nosmr" decoding's one consumer warpgroup
at the launch's registers (setmaxnreg off), "efinosmr" both; "smrdec" only the producer's setmaxnreg.dec (the
consumers at the launch's registers), "efidec" that and "efi". `--rounds R`
replays every variant's graph and SDPA's in turn R times (the median of the rounds: pairs a 1% difference);
`--flex` adds FlexAttention's call (plain and GQA rows). Kernels are compiled first in parallel processes. Prints one
markdown table, with the largest difference of a forced variant's O from the automatic choice's, then one of the
automatic cluster kernels' grid clusters against the most the device runs at once (cuOccupancyMaxActiveClusters).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_required import require_gpu  # noqa: E402

VARIANTS = {"auto": {}, "p1": {"kv_parts": 1}, "p2": {"kv_parts": 2, "cluster_merge": False},
            "p4": {"kv_parts": 4, "cluster_merge": False}, "p8": {"kv_parts": 8, "cluster_merge": False},
            "c2": {"kv_parts": 2, "cluster_merge": True}, "c4": {"kv_parts": 4, "cluster_merge": True},
            "c8": {"kv_parts": 8}, "p16": {"kv_parts": 16},
            "s3": {"stages": 3}, "s4": {"stages": 4},  # the automatic parts on a ring of 3 or 4 K / V stages
            "b2": {"blocks_per_sm": 2},  # two blocks an SM (at D = 128 on 64-wide kv tiles), the parts they take
            "k64": {"decode_block_k": 64},  # one block an SM on 64-wide kv tiles (b2's control)
            "nosp": {"skip_padding": False},  # every row's softmax (skips_padding_softmax off)
            "mp": {"map_prefetch": True},  # the producer's tensor maps prefetched before their acquires
            "pull": {"cluster_push": False},  # the cluster's merge by two barriers and remote reads, not pushes
            "efi": {"early_first_item": True},  # the block's first item sent by thread 0 at its entry, not by the loop
            "nosmr": {"setmaxnreg": False},  # one consumer warpgroup at the launch's registers, no setmaxnreg
            "efinosmr": {"early_first_item": True, "setmaxnreg": False},  # both
            "smrdec": {"setmaxnreg": "dec"},  # the producer's setmaxnreg.dec only: no consumer waits on it
            "efidec": {"early_first_item": True, "setmaxnreg": "dec"}}  # that and the first item sent at entry
EARLY = ("efi", "smrdec", "efidec")  # the set "early"'s variants (nosmr, efinosmr: slower, 2026-12-01)
HEADS = 8  # decoding's kv heads (GQA: G query heads each)
# set -> (stem, G (prefill: H), D, M, N, the forced variants[, B]) (B 1 where not given); stems: the examples,
# "window_off" (a 1024 window behind the cache's offset N - M) and "causal_off" (causal behind it)
CASES = {
    "decode": [("plain", 1, 128, 1, 512, ("p2", "p4")), ("plain", 1, 128, 1, 1024, ("p4", "p8")),
               ("plain", 1, 128, 1, 1536, ("p4", "p8")), ("plain", 1, 128, 1, 2048, ("p8", "p16")),
               ("plain", 1, 128, 1, 3000, ("p8", "p16")), ("plain", 1, 64, 1, 512, ("p2", "p4")),
               ("plain", 1, 64, 1, 1024, ("p4", "p8")), ("plain", 1, 64, 1, 2048, ("p8", "p16")),
               ("plain", 1, 128, 16, 1024, ("p4", "p8")), ("gqa", 4, 128, 1, 1024, ("p4", "p8")),
               ("relative_bias", 1, 128, 17, 3000, ("p8",)), ("softcap", 1, 128, 1, 1024, ("p4", "p8")),
               ("plain", 1, 128, 64, 1024, ("p4", "p8"))],
    "masked": [("window_off", 1, 128, 1, 8192, ("p4", "p8")), ("window_off", 4, 128, 1, 8192, ("p4", "p8")),
               ("causal_off", 1, 128, 1, 1024, ("p4", "p8")), ("causal_off", 1, 128, 1, 3000, ("p8",)),
               ("causal_off", 1, 64, 1, 2048, ("p8",)), ("causal_off", 4, 128, 4, 3000, ("p8",)),
               ("causal_off", 4, 128, 1, 1024, ("p4", "p8"))],
    "prefill": [(st, h, d, n, n, vs) for st in ("causal", "plain") for d in (128, 64) for h, n, vs in
                ((1, 512, ("p1", "p2")), (1, 768, ("p1", "p2")), (1, 1024, ("p2", "p4")), (2, 1024, ("p2", "p4")))]
    + [("prefix_lm", 1, 128, 1024, 1024, ("p2", "p4"))],
    "batch": [("plain", 1, 128, 1, 1024, ("p2", "c2", "p4", "s3"), 4),
              ("plain", 1, 128, 1, 1024, ("p2", "c2", "p4", "s3"), 8),
              ("plain", 1, 128, 1, 4096, ("p2", "p4", "s3"), 8),
              ("plain", 1, 64, 1, 1024, ("p2", "c2", "p4", "s3", "s4"), 8),
              ("gqa", 4, 128, 1, 2048, ("p2", "p4", "s3"), 4), ("gqa", 4, 128, 1, 8192, ("p2", "p4", "s3"), 8),
              ("plain", 1, 128, 16, 2048, ("p2", "c2", "p4", "s3"), 4), ("plain", 1, 128, 1, 3000, ("s3",), 1)],
    # decoding's cost against its kv tiles a block (p1: N / 128 tiles; p2 half): a line's slope is a tile's time
    # on one block's chain, its intercept the fixed cost (B = 1: 8 blocks alone; B = 8: 64 blocks sharing HBM)
    # two blocks an SM against one, and against one on the same 64-wide kv tiles
    "twosm": [("plain", 1, 128, 1, 1024, ("b2", "k64"), b) for b in (1, 4, 8)]
    + [("plain", 1, 128, 1, 256, ("b2", "k64"), 8), ("plain", 1, 128, 1, 4096, ("b2", "k64"), 8),
       ("plain", 1, 128, 1, 3000, ("b2", "k64"), 1), ("plain", 1, 64, 1, 1024, ("b2", "k64"), 8),
       ("gqa", 4, 128, 1, 2048, ("b2", "k64"), 4), ("plain", 1, 128, 16, 2048, ("b2", "k64"), 4)],
    "slope": [("plain", 1, 128, 1, n, ("p1", "p2"), b) for b in (1, 8) for n in (128, 256, 512, 1024, 2048)],
    # decoding's parts merged in a cluster of 2 or 4 on grids past half the SMs, against the merge kernel
    "cluster": [("plain", 1, d, 1, n, ("p2", "c2"), 8) for d in (128, 64) for n in (1024, 2048, 4096)]
    + [("plain", 1, 128, 1, 1024, ("p4", "c4", "c2"), 4), ("plain", 1, 128, 16, 2048, ("p4", "c4", "c2"), 4),
       ("gqa", 4, 128, 1, 8192, ("p2", "c2"), 8), ("plain", 1, 128, 1, 1024, ("p2", "c2"), 16)],
    # the producer's tensor maps prefetched before their acquires, on decoding's grids and a small prefill
    "maps": [("plain", 1, 128, 1, n, ("mp",), b) for b, n in ((1, 1024), (4, 1024), (8, 1024), (8, 4096))]
    + [("plain", 1, 64, 1, 1024, ("mp",), 8), ("gqa", 4, 128, 1, 2048, ("mp",), 4),
       ("plain", 2, 128, 1024, 1024, ("mp",))],
    # decoding's 8 parts in clusters of 8 on grids of 16 of them (B = 2), against the merge kernel
    # (and in 4 parts, by the merge kernel or in clusters of 4: 64 blocks)
    "eights": [("plain", 1, d, 1, n, ("p8", "c8", "p4", "c4"), 2) for d in (128, 64) for n in (1024, 2048, 8192)]
    + [("gqa", 4, 128, 1, 2048, ("p8", "c8", "p4", "c4"), 2), ("plain", 1, 128, 1, 1024, ("p8", "c8"), 1)],
    # where 8 parts' clusters outnumber the device's (B = 2: 16 of 15), 4 parts in clusters of 4 against the
    # automatic choice's 8 by the merge kernel, over N: where the two cross
    "twos": [("plain", 1, d, 1, n, ("p8", "c4"), 2) for d in (128, 64)
             for n in (1024, 2048, 3072, 4096, 6144, 8192)]
    + [("gqa", 4, 128, 1, n, ("p8", "c4"), 2) for n in (2048, 4096)],
    # 4 parts in clusters of 4 past half the SMs but within what the device holds at once (B = 3: 24 of 30)
    "threes": [("plain", 1, d, 1, n, ("p4", "c4"), 3) for d in (128, 64) for n in (1024, 2048, 4096)]
    + [("gqa", 4, 128, 1, 2048, ("p4", "c4"), 3), ("plain", 1, 128, 16, 2048, ("p4", "c4"), 3)],
    # decoding's softmax for the query rows only (skips_padding_softmax) against every row's
    "padding": [("plain", 1, 128, 1, n, ("nosp",), b) for b, n in ((1, 1024), (1, 3000), (4, 1024), (8, 1024),
                                                                   (8, 4096))]
    + [("plain", 1, 64, 1, 1024, ("nosp",), 8), ("gqa", 4, 128, 1, 2048, ("nosp",), 4),
       ("plain", 1, 128, 16, 2048, ("nosp",), 4), ("softcap", 1, 128, 1, 1024, ("nosp",), 4)],
    # the automatic cluster kernels (clusters of 2, 4 and 8) with the parts' rows pushed to the rank that merges
    # them (cluster_push, the default) against their two barriers' remote reads
    "push": [("plain", 1, d, 1, n, ("pull",), b) for d in (128, 64) for b, n in ((1, 1024), (2, 1024), (2, 2048),
                                                                                (3, 2048), (8, 1024))]
    + [("gqa", 4, 128, 1, 2048, ("pull",), 2), ("plain", 1, 128, 16, 2048, ("pull",), 3),
       ("plain", 1, 128, 64, 1024, ("pull",), 2)],
    # the block's first item sent by producer thread 0 at its entry (early_first_item) against from the producer's
    # loop after the block's barrier and the ticket (the default); with and without setmaxnreg on decoding's one
    # consumer warpgroup: decoding's clusters and merge kernel, GQA, a softcap, 16 and 64 query rows
    "early": [("plain", 1, d, 1, n, EARLY, b) for d in (128, 64) for b, n in ((1, 1024), (2, 1024), (8, 1024),
                                                                            (1, 8192))]
    + [("gqa", 4, 128, 1, 2048, EARLY, 2), ("softcap", 1, 128, 1, 1024, EARLY, 4),
       ("plain", 1, 128, 16, 2048, EARLY, 3), ("plain", 1, 128, 64, 1024, EARLY, 2)],
    # decoding's automatic choice against FlexAttention too (run with --flex): one part, 8 or 16 by the merge kernel,
    # clusters of 2, 4 and 8
    "flex": [("plain", 1, 128, 1, n, (), b) for b, n in ((1, 1024), (1, 8192), (2, 1024), (8, 1024))]
    + [("plain", 1, 64, 1, 1024, (), 2), ("gqa", 4, 128, 1, 2048, (), 2), ("plain", 1, 128, 64, 1024, (), 2)],
}
_COMPILED: dict = {}
COLD_BYTES = 160 << 20  # --cold: the copies' bytes together at least this (the H200's L2 is 50 MB)


def cold_copies(nbytes: int) -> int:
    """How many copies of a call's inputs (`nbytes` each) make COLD_BYTES (at least 2; a graph captures as many
    calls)."""
    return max(2, -(-COLD_BYTES // max(nbytes, 1)))


def compiled(stem: str, group: int, var: str):
    import falower as fl

    key = (stem, group, var)
    if key not in _COMPILED:
        extra = VARIANTS[var] or None
        if stem in ("window_off", "causal_off"):
            off = fl.capture("off", "i32", ())
            if stem == "window_off":
                g = fl.attention(group_size=group, name=f"wo{group}",
                                 mask_mod=lambda b, h, q, kv: (q + off - kv >= 0) & (q + off - kv < 1024))
            else:
                g = fl.attention(group_size=group, name=f"co{group}", mask_mod=lambda b, h, q, kv: q + off - kv >= 0)
            _COMPILED[key] = fl.compile(g, extra=extra)
        else:
            import bench

            _COMPILED[key] = bench.example_compiled(stem, **(extra or {}))
    return _COMPILED[key]


def is_prefill(M: int) -> bool:
    return M > 64


def heads(group: int, M: int) -> tuple[int, int]:
    """(q heads, kv heads): decoding's HEADS kv heads of `group` query heads each; a prefill row's `group` heads."""
    return (group, group) if is_prefill(M) else (HEADS * group, HEADS)


def cases(name: str) -> list[tuple]:
    """A set's cases as (stem, G or H, D, M, N, the forced variants, B)."""
    return [case + (1,) * (7 - len(case)) for case in CASES[name]]


def kernel(stem: str, group: int, var: str, D: int, M: int, N: int, B: int = 1):
    """The kernel a call of these sizes runs (the packed GQA graph's where a decoding call packs)."""
    return kernel_and_dims(stem, group, var, D, M, N, B)[0]


def kernel_and_dims(stem: str, group: int, var: str, D: int, M: int, N: int, B: int = 1):
    """(kernel, its heads, its rows): `kernel`'s, with the (H, M) its grid takes (HKV and M G where GQA packs)."""
    c = compiled(stem, group, var)
    H, HKV = heads(group, M)
    env = dict(B=B, D=D, M=M, N=N, H=H, HKV=HKV)
    packed = c.packed_for(env) if H != HKV else None
    if packed is not None:
        # (the packed graph's q is [B, HKV, M G, D]: its M is still a head's rows)
        return packed.specialize("f16", B=B, D=D, M=M, N=N, H=HKV, HKV=HKV), HKV, M * (H // HKV)
    return c.specialize("f16", **env), H, M


def build(job: tuple) -> tuple:
    """(job, (parts, cluster size)) of the kernel a job's call runs, compiled (cached) on the way."""
    from falower.backends.numba_cuda.emit_fa2 import cluster_parts

    spec = kernel(*job).spec
    return job, (spec.kv_parts, cluster_parts(spec))


def jobs(sets: list[str]) -> list[tuple]:
    return [(s, g, v, D, M, N, B) for name in sets for s, g, D, M, N, vs, B in cases(name) for v in ("auto",) + vs]


def captured(fn, reps: int = 20) -> tuple:
    """(graph, calls in it): `reps` calls captured in one CUDA graph. `fn` a list of calls: the graph's calls take
    them in turn (`--cold`: each its own copy of the inputs), `reps` at least their number."""
    import torch

    fns = fn if isinstance(fn, list) else [fn]
    reps = max(reps, len(fns))
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fns[0]()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for i in range(reps):
                fns[i % len(fns)]()
    torch.cuda.synchronize()
    return g, reps


def replayed(graph: tuple, iters: int = 15) -> float:
    """us a call of a `captured` graph: the median of `iters` replays."""
    import torch

    g, reps = graph
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(ts)


def interleaved(fns: dict, rounds: int) -> dict:
    """{name: us a call}: each of `fns` (name -> a call or a list, as `captured` takes) captured once, then the
    graphs replayed in turn for `rounds` rounds (a round: `replayed` of each, in order); the median of the rounds.
    Flex's call left out (with a line) where it cannot be captured.
    Paired this way, a difference of ~1% between two variants is read above the clock's and the L2's drift."""
    graphs = {}
    for name, fn in fns.items():
        try:
            graphs[name] = captured(fn)
        except Exception as exc:  # (a call that cannot be captured, if any: its column reads nan)
            if name != "flex":
                raise
            print(f"  {name}: not captured: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
    got: dict = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            got[name].append(replayed(g))
    return {name: statistics.median(ts) for name, ts in got.items()}


def flex_call(H: int, HKV: int):
    """FlexAttention's call for plain attention (GQA where H != HKV): torch.compile(flex_attention), bench.py's."""
    import bench

    return lambda q, k, v: bench.flex_attention()(q, k, v, enable_gqa=H != HKV)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=[*CASES, "all"], default="all")
    ap.add_argument("--cold", action="store_true",
                    help=f"each call of a graph reads its own copy of Q, K, V (the copies together at least "
                         f"{COLD_BYTES >> 20} MB, over three times the L2): a model's layers, whose caches are not "
                         "in L2; every kernel timed the same way")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of replays, every variant's graph (and SDPA's) replayed in turn each round; the "
                         "median over rounds (default 1: each timed once, one after the other)")
    ap.add_argument("--flex", action="store_true",
                    help="FlexAttention too (torch.compile(flex_attention), plain and GQA rows only: each shape "
                         "compiles once, ~10-30 s)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    require_gpu("split_parts.py")
    sets = list(CASES) if args.set == "all" else [args.set]
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t0 = time.time()
    with mp.get_context("spawn").Pool(min(15, os.cpu_count() or 1)) as pool:
        got = dict(pool.map(build, jobs(sets)))
    print(f"compiled {len(got)} kernels in {time.time() - t0:.0f} s" + (
        f"; --cold: each call its own inputs, copies of at least {COLD_BYTES >> 20} MB together" if args.cold else ""),
        flush=True)
    from falower.backends.numba_cuda.emit_fa2 import cluster_parts

    F = torch.nn.functional
    fits = []  # the automatic kernels merged in a cluster: their grid's clusters against what the device holds
    print("| case | B | G or H | D | M | N | auto us (parts) | forced us | forced best / auto | FLASH | cuDNN | Flex | "
          "auto vs FLASH | auto vs cuDNN | auto vs Flex | max abs O - auto's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in sets:
        for stem, group, D, M, N, forced, B in cases(name):
            H, HKV = heads(group, M)
            copies = cold_copies(2 * (B * H * M + 2 * B * HKV * N) * D) if args.cold else 1
            qs = [torch.randn(B, H, M, D, device="cuda", dtype=torch.float16) for _ in range(copies)]
            kvs = [[torch.randn(B, HKV, N, D, device="cuda", dtype=torch.float16) for _ in range(2)]
                   for _ in range(copies)]
            q, (k, v) = qs[0], kvs[0]
            caps = [N - M] if stem in ("window_off", "causal_off") else \
                [torch.randn(HKV, 2 * N - 1, device="cuda")] if stem == "relative_bias" else []

            def calls(f):  # f(q, k, v) on each copy
                return [lambda i=i: f(qs[i], *kvs[i]) for i in range(copies)]

            fns, outs = {}, {}
            for var in ("auto",) + forced:
                c = compiled(stem, group, var)
                outs[var] = c(q, k, v, *caps)[0].float()
                fns[var] = calls(lambda q, k, v, c=c: c(q, k, v, *caps))
            err = max([(outs[var] - outs["auto"]).abs().max().item() for var in forced], default=0.0)  # the same
            ref = {"flash": float("nan"), "cudnn": float("nan"), "flex": float("nan")}
            for backend, label in ((SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.CUDNN_ATTENTION, "cudnn")):

                def sdpa(q, k, v, backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=stem == "causal",
                                                              enable_gqa=H != HKV)
                try:
                    sdpa(q, k, v)
                    fns[label] = calls(sdpa)
                except RuntimeError:
                    pass
            if args.flex and stem in ("plain", "gqa"):
                try:
                    flex = flex_call(H, HKV)
                    flex(q, k, v)
                    fns["flex"] = calls(flex)
                except Exception as exc:  # (a shape Flex refuses: its column reads nan)
                    print(f"  flex refused {stem} B={B} M={M} N={N} D={D}: {type(exc).__name__}: {str(exc)[:100]}",
                          flush=True)
            times = interleaved(fns, args.rounds)
            ref.update({k: t for k, t in times.items() if k in ref})
            parts, cluster = got[(stem, group, "auto", D, M, N, B)]
            best = min([times[var] for var in forced], default=float("nan"))
            auto = f"{times['auto']:.1f} (p{parts}{' cluster' if cluster else ''})"
            others = ", ".join(f"{var}: {times[var]:.1f}" for var in forced)
            print(f"| {stem} | {B} | {group} | {D} | {M} | {N} | {auto} | {others} | {best / times['auto']:.3f} | "
                  f"{ref['flash']:.1f} | {ref['cudnn']:.1f} | {ref['flex']:.1f} | {ref['flash'] / times['auto']:.2f} | "
                  f"{ref['cudnn'] / times['auto']:.2f} | {ref['flex'] / times['auto']:.2f} | {err:.0e} |", flush=True)
            kern, kh, rows = kernel_and_dims(stem, group, "auto", D, M, N, B)
            if cluster_parts(kern.spec):
                fits.append(f"| {stem} | {B} | {D} | {M} | {N} | {cluster_parts(kern.spec)} | "
                            f"{kern.grid_clusters(B, kh, rows, N)} | "
                            f"{kern.device_clusters(torch.cuda.current_device())} |")
    if fits:
        print("\n| case | B | D | M | N | cluster | the grid's clusters | the device's most at once |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(fits))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
