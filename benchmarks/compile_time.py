"""Cold compile time of falower's kernels, broken down by stage (issue 10, item 5).

For each kernel: trace (building the graph), passes (the lowering pipeline), emission (spec, kernel source,
exec of the module), Numba's front end per compiler pass (exclusive times: a device function compiled inside
a kernel pass is counted under its own passes), NVVM (LLVM IR -> PTX), ptxas (PTX -> SASS through nvJitLink,
which also reports registers and spills), and the PTX's instruction mix. No GPU needed: it builds PTX for
sm_90. With `--first-call` on a GPU machine it also times the real first launch (compile + load + run) of the
forward kernels in a fresh process each. On a GPU machine the kernel object compiles (links, loads, caches) when it
is built, so `emission` is the real cold compile there, and its parts are printed: Numba's front end, NVVM,
the driver's cuInit (`driver`), Numba's primary context (`context`), nvJitLink (`link`), cuModuleLoadData
(`load`), Numba's and falower's disk caches, and the rest (the emitter, exec of the module, Python around them).

    python benchmarks/compile_time.py [--kernels causal_fwd_d64 ...] [--top 8] [--json out.json] [--first-call]
                                      [--ptx-dir DIR] [--profile DIR]

Each kernel is compiled in a fresh process (a warm Numba would hide the work shared between kernels, e.g.
the intrinsics' typing and the ~1 s Numba spends loading its typing registries at a process's first compile,
which the first kernel's numbers include), with FALOWER_CACHE_DIR pointing at a new empty directory. `cpu` is
the process's CPU seconds for PTX + ptxas: the number to compare when other jobs share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (how the graph is made, dtype, D, what to build)
KERNELS = {
    "causal_fwd_d64_f16": ("causal", "f16", 64, "fwd"),
    "causal_fwd_d128_f16": ("causal", "f16", 128, "fwd"),
    "causal_fwd_d128_f16_wgmma": ("causal", "f16", 128, "fwd-wgmma"),  # emit_fa3's v2 (sm_90a), asked for by name
    # what an H100 picks at D = 128 (no mask, static masks): the warp-specialized kernel, emit_fa3_ws, producer none
    "causal_fwd_d128_f16_ws": ("causal", "f16", 128, "fwd-wgmma-ws"),
    "alibi_fwd_d64_bf16": ("example:alibi", "bf16", 64, "fwd"),
    "document_fwd_d64_f16": ("example:document", "f16", 64, "fwd"),
    "document_fwd_d128_f16": ("example:document", "f16", 128, "fwd"),  # mma.sync: block lists stay off wgmma
    "causal_bwd_d128_f16": ("causal", "f16", 128, "bwd"),
    "causal_bwd_det_d64_f16": ("causal", "f16", 64, "bwd-det"),
    "causal_bwd_d64_f16": ("causal", "f16", 64, "bwd"),
    "alibi_bwd_d64_bf16": ("example:alibi", "bf16", 64, "bwd"),  # a captured table's gradient (the slopes)
}

PTX_COUNTS = {
    "mma": r"\bmma\.sync\.aligned",
    "wgmma": r"\bwgmma\.mma_async",
    "ldmatrix": r"\bldmatrix\.sync",
    "cp.async": r"\bcp\.async\.cg",
    "ld.local": r"\bld\.local\b",
    "st.local": r"\bst\.local\b",
    "bra": r"\bbra(\.uni)?\b",
}


# What a cold compile does besides Numba's passes and NVVM, timed on a GPU machine (where building the kernel
# object compiles, loads and caches it: the "emission" figure): (module, attribute, name in the breakdown)
_GPU_PARTS = [
    ("falower.backends.numba_cuda.cubin_cache", "Driver.available", "driver"),  # cuInit through ctypes
    ("falower.backends.numba_cuda.cubin_cache", "Driver.compute_capability", "driver"),
    ("numba.cuda.cudadrv.devices", "_Runtime.get_or_create_context", "context"),  # Numba's primary context (1st call)
    ("numba.cuda.cudadrv.driver", "_Linker.complete", "link"),  # Numba's link (cuda.core, nvJitLink)
    ("falower.backends.numba_cuda.runtime", "nvjitlink_cubin", "link"),  # falower's direct nvJitLink link
    ("numba.cuda.cudadrv.driver", "Context.create_module_image", "load"),  # cuModuleLoadData
    ("numba.cuda.core.caching", "Cache.save_overload", "numba_cache"),  # Numba's disk cache (pickle, index)
    ("falower.backends.numba_cuda.cubin_cache", "store", "cubin_cache"),  # falower's cubin cache
]


def _instrument() -> tuple[dict, dict]:
    """Time every Numba CUDA compiler pass (exclusive of nested passes), every NVVM compilation, and the other
    parts of a compile on a GPU machine (`_GPU_PARTS`), each exclusive of the others it contains."""
    import importlib

    from numba.cuda.core import compiler_machinery as cm
    from numba.cuda.cudadrv import nvvm

    passes: dict[str, float] = {}
    other = {"nvvm": 0.0}
    stack: list[float] = []  # time spent in nested timed regions, per open region

    def timed_region(fn, record):
        def wrapper(*args, **kwargs):
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - t0
                nested = stack.pop()
                record(args, total - nested)
                if stack:
                    stack[-1] += total
        return wrapper

    def rec_pass(args, dt):
        name = args[1].name() if hasattr(args[1], "name") else str(args[1])
        passes[name] = passes.get(name, 0.0) + dt

    def rec_nvvm(args, dt):
        other["nvvm"] += dt

    cm.PassManager._runPass = timed_region(cm.PassManager._runPass, lambda a, dt: rec_pass(a[1:], dt))
    nvvm.compile_ir = timed_region(nvvm.compile_ir, rec_nvvm)
    for modname, attr, key in _GPU_PARTS:
        owner = importlib.import_module(modname)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, name):
            continue
        other.setdefault(key, 0.0)

        def rec(args, dt, key=key):
            other[key] += dt

        setattr(owner, name, timed_region(getattr(owner, name), rec))
    return passes, other


def _graph(how: str, D: int):
    import falower as fl

    if how == "causal":
        return fl.attention(mask_mod=lambda b, h, q, k: q >= k, name="causal", head_dim=D)
    stem = how.split(":", 1)[1]
    return next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))


def _bwd_extra_kernels(kern) -> list[tuple[str, object, tuple]]:
    """(name, dispatcher, argtypes) of the backward's other kernels: Delta, and dQ's conversion or dQ kernel."""
    from numba import types

    from falower.backends.numba_cuda.runtime import _capture_types

    s = kern.spec
    elem = {"f32": types.float32, "f64": types.float64}.get(s.dtype, types.int16)
    acc = types.float64 if s.dtype == "f64" else types.float32
    arr = lambda t: types.Array(t, 1, "C")  # noqa: E731
    i64 = types.int64
    out = [("delta", kern._delta, (arr(elem), arr(elem), arr(acc), arr(acc), i64, i64, i64, i64, i64, i64))]
    packed = arr(types.int32) if s.path == "mma" else arr(elem)
    if s.dq == "atomic":
        out.append(("dq_convert", kern._dq, (arr(acc), packed, i64)))
    else:
        args = [arr(elem)] * 3 + [arr(acc), arr(elem), arr(acc), packed] + [i64] * 16
        if s.block_mask == "table":
            args.append(arr(types.int8))
        out.append(("dq_kernel", kern._dq, tuple(args + list(_capture_types(s)))))
    return out


def measure(name: str, top: int) -> dict:
    """Compile one kernel (in this process) and return its breakdown."""
    how, dtype, D, what = KERNELS[name]
    if what.startswith("fwd-wgmma"):  # the automatic choice on compute capability 9.x, forced here (no GPU)
        os.environ["FALOWER_WGMMA"] = "1"
    t, cpu0 = time.perf_counter(), time.process_time()
    import falower  # noqa: F401  (the imports a fresh process pays once: numba, numba-cuda, falower)
    import numba.cuda.compiler  # noqa: F401

    imports = (time.perf_counter() - t, time.process_time() - cpu0)
    passes, other = _instrument()
    from falower.backends.numba_cuda.runtime import ptx_of, resource_usage

    # ptx_of and a launch's compile (runtime.compile_unbound) both run under intrinsics.lean_compiles: the same
    # pipeline is measured (FALOWER_NUMBA_PIPELINE=default: numba-cuda's own, for both)
    import falower as fl

    res: dict = {"kernel": name, "imports": imports[0], "imports_cpu": imports[1]}
    t = time.perf_counter()
    g = _graph(how, D)
    res["trace"] = time.perf_counter() - t
    t = time.perf_counter()
    # "fwd-wgmma": emit_fa3's kernel by name (at D = 128 the automatic choice is now emit_fa3_ws's)
    c = fl.compile(g, deterministic=(what == "bwd-det"), extra={"schedule": "wgmma"} if what == "fwd-wgmma" else None)
    if what.startswith("bwd"):
        c.lowered_backward
    res["passes"] = time.perf_counter() - t
    t = time.perf_counter()
    prof = None
    if os.environ.get("FALOWER_PROFILE_DIR"):  # cProfile of the emission (on a GPU machine: the cold compile)
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    if what.startswith("fwd"):
        kern = c.specialize(dtype, D=D)
        want = {"fwd-wgmma": "wgmma", "fwd-wgmma-ws": "wgmma-ws"}.get(what)
        if want is not None and kern.spec.extra.get("schedule") != want:
            raise RuntimeError(f"{name}: built schedule {kern.spec.extra.get('schedule')!r}, not {want!r}")
        builds = [("main", kern._kernel, kern.argtypes())]
    else:
        kern = c._backward_kernel_and_dims_for(dtype, D)
        builds = [("main", kern._kernel, kern.argtypes())] + _bwd_extra_kernels(kern)
    res["emission"] = time.perf_counter() - t
    if prof is not None:
        prof.disable()
        prof.dump_stats(str(Path(os.environ["FALOWER_PROFILE_DIR"], f"{name}.prof")))
    # on a GPU machine the kernel object compiled, loaded and cached its kernel here: the cold compile's parts
    res["emission_parts"] = {"front_end": sum(passes.values()), **{k: v for k, v in other.items() if v}}
    res["source_lines"] = kern.source.count("\n")
    res["kernels"] = {}
    for kname, disp, argtypes in builds:
        passes.clear()
        for key in other:
            other[key] = 0.0
        t, cpu = time.perf_counter(), time.process_time()
        ptx = ptx_of(disp, argtypes, (9, 0))
        ptx_s = time.perf_counter() - t
        t = time.perf_counter()
        if "wgmma." in ptx:  # wgmma needs sm_90a (numba-cuda names sm_90 in the PTX it prints); on an H100 the
            # automatic choice puts the D = 128 backward and forward on wgmma too
            usage = resource_usage(ptx.replace(".target sm_90\n", ".target sm_90a\n"), "sm_90a")
        else:
            usage = resource_usage(ptx, "sm_90")
        ptxas_s = time.perf_counter() - t
        cpu = time.process_time() - cpu  # CPU seconds of this process: robust when other jobs share the cores
        front = sum(passes.values())
        k = {
            "ptx": ptx_s,
            "front_end": front,
            "nvvm": other["nvvm"],
            "other": ptx_s - front - other["nvvm"],
            "ptxas": ptxas_s,
            "cpu": cpu,
            "passes": dict(sorted(passes.items(), key=lambda kv: -kv[1])),
            "registers": usage["registers"],
            "spill_stores": usage["spill_stores"],
            "spill_loads": usage["spill_loads"],
            "stack_frame": usage["stack_frame"],
            "ptx_counts": {k2: len(re.findall(p, ptx)) for k2, p in PTX_COUNTS.items()},
        }
        res["kernels"][kname] = k
        if os.environ.get("FALOWER_PTX_DIR"):  # keep the PTX, to diff it across changes
            Path(os.environ["FALOWER_PTX_DIR"], f"{name}.{kname}.ptx").write_text(ptx)
    res["total"] = res["trace"] + res["passes"] + res["emission"] + sum(
        k["ptx"] + k["ptxas"] for k in res["kernels"].values())
    del top
    return res


def first_call(name: str) -> dict:
    """On a GPU: the first call of a forward kernel (compile, load, launch, synchronise)."""
    import numpy as np
    from numba import cuda

    import falower as fl
    from falower.passes.check import bind_dims, random_inputs

    how, dtype, D, what = KERNELS[name]
    if what != "fwd":
        return {"kernel": name, "first_call": None}
    g = _graph(how, D)
    env = bind_dims(g, {"B": 1, "H": 2, "HKV": 1, "M": 256, "N": 256, "D": D})
    np_dtype = np.float16 if dtype == "f16" else np.float32
    inputs = [x.astype(np_dtype) if i < 3 else x for i, x in enumerate(random_inputs(g, env))]
    if dtype == "bf16":
        import torch  # bf16 inputs need torch

        inputs = [torch.from_numpy(x).cuda().to(torch.bfloat16) if i < 3 else torch.from_numpy(x).cuda()
                  for i, x in enumerate(inputs)]
    t = time.perf_counter()
    c = fl.compile(g)
    c(*inputs)
    cuda.synchronize()
    return {"kernel": name, "first_call": time.perf_counter() - t}


def _child(name: str, top: int, gpu: bool) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, FALOWER_CACHE_DIR=cache)
        cmd = [sys.executable, __file__, "--child", name, "--top", str(top)] + (["--first-call"] if gpu else [])
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(ROOT))
        if out.returncode != 0:
            return {"kernel": name, "error": out.stderr[-2000:]}
        return json.loads(out.stdout.strip().splitlines()[-1])


def _print(res: dict, top: int) -> None:
    if "error" in res:
        print(f"{res['kernel']}: FAILED\n{res['error']}")
        return
    print(f"== {res['kernel']}  ({res['source_lines']} source lines)  total {res['total']:.2f} s")
    print(f"   imports {res.get('imports', 0):.2f} (cpu {res.get('imports_cpu', 0):.2f}, once a process)  "
          f"trace {res['trace']:.2f}  passes {res['passes']:.2f}  emission {res['emission']:.2f}")
    parts = res.get("emission_parts") or {}
    if parts.get("front_end", 0) > 0.05:  # a GPU machine: the emission was the cold compile
        rest = res["emission"] - sum(parts.values())
        print("   emission = " + " + ".join(f"{k} {v:.2f}" for k, v in parts.items()) + f" + other {rest:.2f}")
    for kname, k in res["kernels"].items():
        print(f"   [{kname}] ptx {k['ptx']:.2f} s = front end {k['front_end']:.2f} + nvvm {k['nvvm']:.2f} "
              f"+ other {k['other']:.2f};  ptxas {k['ptxas']:.2f} s;  cpu {k.get('cpu', 0):.2f} s")
        tops = list(k["passes"].items())[:top]
        print("      " + ", ".join(f"{n} {v:.2f}" for n, v in tops))
        cnt = k["ptx_counts"]
        print(f"      regs {k['registers']}  spill st/ld {k['spill_stores']}/{k['spill_loads']}  "
              f"stack {k['stack_frame']}  " + " ".join(f"{n} {v}" for n, v in cnt.items()))
    if res.get("first_call") is not None:
        print(f"   first call on the GPU (compile + load + run): {res['first_call']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="*", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--top", type=int, default=6, help="Numba passes to print per kernel")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--first-call", action="store_true", help="also time the first call on a GPU (fwd kernels)")
    ap.add_argument("--ptx-dir", help="write each kernel's PTX here (NAME.KERNEL.ptx)")
    ap.add_argument("--profile", help="write a cProfile of each kernel's emission here (NAME.prof; pstats)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = measure(args.child, args.top)
        if args.first_call:  # a second fresh process: nothing compiled yet
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, FALOWER_CACHE_DIR=cache)
                code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                        f"import compile_time as ct; print(json.dumps(ct.first_call({args.child!r})))")
                out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
                res["first_call"] = json.loads(out.stdout.strip().splitlines()[-1])["first_call"] \
                    if out.returncode == 0 else None
        print(json.dumps(res))
        return
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["FALOWER_PROFILE_DIR"] = os.path.abspath(args.profile)
    if args.ptx_dir:
        os.makedirs(args.ptx_dir, exist_ok=True)
        os.environ["FALOWER_PTX_DIR"] = os.path.abspath(args.ptx_dir)
    results = []
    for name in args.kernels:
        res = _child(name, args.top, args.first_call)
        _print(res, args.top)
        results.append(res)
        sys.stdout.flush()
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                "command": " ".join(sys.argv)}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
