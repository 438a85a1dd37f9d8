"""Floors of the backward's main kernel: its source with a part taken out (the dQ reductions, the elementwise
code, one of the GEMM groups, ...), each timed by the whole backward call beside the kernel as built. A floor's
numbers are wrong by design; only its time is read: what the kernel would take if that part cost nothing
(benchmarks/NOTES.md, METHOD.md's "count the floor first").

    python3 benchmarks/probe_bwd.py --d 128 [--causal] [--variants built,nored,noelem] [--json out.json]
    python3 benchmarks/probe_bwd.py --d 128 --extra '{"dq_bulk": true}' --variants built,nored,nofence,nostage
                                    # the edits on a kernel built with that spec.extra (here dQ's bulk reductions)

Every variant is compiled first in parallel processes (`--compile-one NAME`, the cubin cache shared on disk), then
timed in this one in interleaved rounds. Needs torch and a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

_GEMM_S = r"^\s*WG_S\(.*\n"
_GEMM_D = r"^\s*WG_D\(.*\n"
_GEMM_Q = r"^\s*WG_Q\(.*\n"
_DS_STORES = r"^\s*store_dst_wg\(smem_w,.*\n"
_NO_RED = (r"\b(qi|ql) < M:", r"\1 < -1:")  # the dQ reductions' guard (vector or bulk) never true
_ELEM = (r"(s[01]), (p[01]) = elem_\w+\(lget\(x, (i(?: \+ 2)?)\), lget\(y, (i(?: \+ 2)?)\),.*",
         r"\1, \2 = lget(x, \3), lget(y, \4)")

# name -> (what it removes, [(regex, replacement)]); every regex must match the kernel's source
VARIANTS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "bulk": ("nothing: the kernel built with spec.extra dq_bulk True (dQ staged, added by bulk reductions)", []),
    "red": ("nothing: the kernel built with spec.extra dq_bulk False (dQ by the threads' vector reductions)", []),
    "built": ("nothing: the kernel as built", []),
    "empty": ("the whole q loop (left: Delta, dQ's conversion, K / V loads, dK / dV stores)",
              [(r"^([ \t]*)while qc <=? (?:nq|p_last):", r"\1while qc < -1:")]),
    "nored": ("the dQ reductions", [_NO_RED]),
    "noelem": ("the elementwise P / dS code (P = S, dS = dP)", [_ELEM]),
    "nodq": ("dQ's GEMM and its reductions", [(_GEMM_Q, ""), _NO_RED]),
    "nodkdv": ("the dV and dK GEMMs", [(_GEMM_D, "")]),
    "nosdp": ("the S^T and dP^T GEMMs", [(_GEMM_S, "")]),
    "gemms": ("everything but the GEMMs, loads and barriers (no elementwise, dS^T stores, reductions)",
              [_ELEM, (_DS_STORES, ""), _NO_RED]),
    "nowait": ("the wait before dQ's staging for the last tile's bulk reductions to have read it (races: timing only)",
               [(r"^[ \t]*bulk_wait_read0\(\)  # the last tile's reductions.*\n", "")]),
    "nofence": ("the proxy fence after dQ's staging (races: timing only)",
                [(r"^[ \t]*fence_proxy_async\(\)  # the staged rows.*\n", "")]),
    "nostage": ("dQ's staging stores (the bulk reductions then add stale rows: timing only)",
                [(r"^[ \t]*sts_v4_f32\(dqs_t.*\n", "")]),
    # two that move work rather than remove it, written for plain D = 128, N = 4k (64 q tiles, 64 dQ columns a warp)
    "rotate": ("nothing: each kv tile's walk starts at q tile 21 kj mod 64 (blocks running together add into different "
               "dQ rows; the numbers stay right)", [(r"\b(qc|qn__1) \* 64\b", r"((\1 + kj * 21) & 63) * 64")]),
    "oneop": ("dq_bulk's 16 row reductions of a warp made one of 4352 bytes by lane 0 (wrong rows: timing only)",
              [(r"if lane < 16 and ql < M:", "if lane == 0 and ql < M:"), (r", dqs_l, 256\)", ", dqs_l, 4352)")]),
    "nosync": ("the loop's first barrier (races: timing only)",
               [(r"^[ \t]*cuda\.syncthreads\(\)\n(?=[ \t]*if qn\w* <)", "")]),
}


EXTRA = {"bulk": {"dq_bulk": True}, "red": {"dq_bulk": False}}  # variants built from their own spec.extra


def edited(source: str, name: str) -> str:
    out = source
    for pat, rep in VARIANTS[name][1]:
        new, n = re.subn(pat, rep, out, flags=re.M)
        if n == 0:
            raise SystemExit(f"probe_bwd: variant {name}: {pat!r} is not in the kernel's source")
        out = new
    return out


def setup(D: int, causal: bool, B: int, H: int, N: int, extra: dict | None = None):
    import torch

    import falower as fl

    mask = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx) if causal else None
    c = fl.compile(fl.attention(mask_mod=mask, name="causal" if causal else "plain", dtype="f16"), "numba-cuda",
                   extra=extra)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(4))
    o, lse = c.forward(q, k, v)
    kern, env = c._backward_kernel_and_dims((q, k, v))
    sizes = [int(env[d]) for d in kern.spec.dims]  # the sizes the score reads (M, N), as c.backward adds them
    return c, kern, (q, k, v, o, lse, do, *sizes)


def use_variant(kern, source: str, name: str) -> None:
    """Point the backward kernel object at `name`'s source (its plans and direct kernels made anew)."""
    kern.source = edited(source, name)
    kern._dispatchers.pop("main", None)
    kern._direct.pop("main", None)
    kern._plans.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default="")
    ap.add_argument("--extra", default="", help="spec.extra of the kernel the edits apply to (JSON)")
    ap.add_argument("--compile-one", default="")
    a = ap.parse_args()
    B, H = 4, 16 if a.d == 128 else 32
    base_extra = json.loads(a.extra) if a.extra else None
    if a.compile_one:
        c, kern, args = setup(a.d, a.causal, B, H, a.n, EXTRA.get(a.compile_one, base_extra))
        use_variant(kern, kern.source, a.compile_one)
        kern._direct_kernel("main")
        return
    c, kern, args = setup(a.d, a.causal, B, H, a.n, base_extra)
    source = kern.source
    others = {x: setup(a.d, a.causal, B, H, a.n, EXTRA[x])[1] for x in EXTRA if x in a.variants.split(",")}
    names = [x for x in a.variants.split(",") if x]
    for x in names:
        if x not in VARIANTS:
            raise SystemExit(f"probe_bwd: unknown variant {x!r} (known: {', '.join(VARIANTS)})")
        if x not in EXTRA:
            edited(source, x)  # fails early on a pattern the source lacks
    base = [sys.executable, __file__, "--d", str(a.d), "--n", str(a.n)] + (["--causal"] if a.causal else []) \
        + (["--extra", a.extra] if a.extra else [])
    procs = [subprocess.Popen(base + ["--compile-one", x]) for x in names]
    if any(p.wait() for p in procs):
        raise SystemExit("probe_bwd: a variant failed to compile")
    import torch

    def timed(fn, reps=20):
        for _ in range(3):
            fn()
        st = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
        st[0].record()
        for i in range(reps):
            fn()
            st[i + 1].record()
        torch.cuda.synchronize()
        return sorted(st[i].elapsed_time(st[i + 1]) for i in range(reps))[reps // 2]

    flops = 2.5 * 4 * B * H * a.n * a.n * a.d / (2 if a.causal else 1)
    times: dict[str, list[float]] = {x: [] for x in names}
    for r in range(a.rounds):
        for x in names:
            if x in EXTRA:
                times[x].append(timed(lambda: others[x](*args)))
                continue
            use_variant(kern, source, x)
            times[x].append(timed(lambda: kern(*args)))
    med = {x: sorted(t)[len(t) // 2] for x, t in times.items()}
    print(f"backward floors, D = {a.d}, N = {a.n}, B = {B}, H = {H}, causal = {a.causal}, {a.rounds} rounds "
          f"(the whole backward call: Delta, main, dQ's conversion)")
    print("| variant | removes | ms | TFLOP/s | of built |")
    print("|---|---|---|---|---|")
    for x in names:
        print(f"| {x} | {VARIANTS[x][0]} | {med[x]:.3f} | {flops / med[x] / 1e9:.0f} | "
              f"{med[x] / med.get('built', med[x]):.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"D": a.d, "N": a.n, "causal": a.causal, "ms": times}))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
