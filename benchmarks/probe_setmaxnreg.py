"""Does setmaxnreg take effect when the driver compiles a kernel's PTX as a whole program?

ptxas ignores setmaxnreg in a relocatable compile (warning C7504), and every linker compiles relocatably, so the
warp-specialized forward's producer warpgroup (40 registers) and consumers (232) never got their split under
Numba: 384 threads launch with 168 registers a thread, and the consumers spill at D = 128. runtime.link_cubin now
hands such a kernel's PTX to the driver (`whole_program_ptx`). This probe compiles one such kernel both ways and
prints each route's registers, spills and warnings: nvJitLink's verbose log, and the driver's JIT log
(cuModuleLoadDataEx with CU_JIT_INFO_LOG_BUFFER and CU_JIT_LOG_VERBOSE). Needs a GPU for the driver route.

    python3 benchmarks/probe_setmaxnreg.py [--variant plain] [--d 128] [--stages 2] [--producer-regs 40]
        [--persistent 132]

Without a GPU, a CUDA toolkit's ptxas (whole program) gives the same spill count ("ptxas" in the output).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def kernel_ptx(variant: str, D: int, stages: int, producer_regs: int = 0, persistent: int = 0) -> tuple[str, str]:
    """(entry name, sm_90a PTX) of the producer-warpgroup ws kernel for examples/<variant>.py at D, f16."""
    import runpy

    import falower as fl
    from falower.backends.numba_cuda import emit_fa3_ws
    from falower.backends.numba_cuda.from_ir import analyse, build_spec
    from falower.backends.numba_cuda.runtime import FA2ForwardKernel, load_source, ptx_image, ptx_of

    g = runpy.run_path(str(ROOT / "examples" / f"{variant}.py"))["graph"]
    spec = build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": D}, "f16", "mma", None,
                      {"schedule": "wgmma-ws", "producer": "warpgroup", "stages": stages,
                       **({"producer_regs": producer_regs} if producer_regs else {}),
                       **({"persistent": persistent} if persistent else {})})
    kern = getattr(load_source(emit_fa3_ws.emit_fa3_ws_forward(spec), spec.name), spec.name)
    argtypes = FA2ForwardKernel.argtypes(type("Holder", (), {"spec": spec})())
    ptx = ptx_image(ptx_of(kern, argtypes, (9, 0)), "sm_90a")[:-1].decode()  # as link_cubin hands it over
    return re.search(r"\.entry\s+([\w$]+)\s*\(", ptx).group(1), ptx


def linked(ptx: str) -> dict:
    from falower.backends.numba_cuda.runtime import resource_usage

    u = resource_usage(ptx, "sm_90a")
    return {"registers": u["registers"], "spill_stores": u["spill_stores"],
            "warnings": sorted(set(re.findall(r"C75\d\d", u["log"])))}


def ptxas_whole(ptx: str, cubin: Optional[Path] = None) -> dict:
    """A CUDA toolkit's ptxas on the PTX as a whole program (not relocatable: setmaxnreg holds, as under the
    driver's JIT), where one is on PATH: the same spill count without a GPU. `cubin`: where to keep the output
    (sass_local.py disassembles it)."""
    import shutil
    import subprocess
    import tempfile

    exe = shutil.which("ptxas")
    if exe is None:
        return {"error": "no ptxas on PATH"}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        for _ in range(2):  # an older ptxas than the PTX's ISA: once more, at the version it names as its own
            src.write_text(ptx)
            run = subprocess.run([exe, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                                 capture_output=True, text=True)
            log = run.stdout + run.stderr
            older = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", log)
            if run.returncode == 0 or not older:
                break
            ptx = re.sub(r"^\.version [\d.]+", f".version {older.group(1)}", ptx, count=1, flags=re.M)
        if run.returncode == 0 and cubin is not None:
            Path(cubin).write_bytes((Path(tmp) / "k.cubin").read_bytes())
    if run.returncode != 0:
        return {"error": f"ptxas rc {run.returncode}", "log": log[-2000:]}
    regs, spills = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(regs.group(1)) if regs else -1, "spill_stores": int(spills.group(1)) if spills else -1,
            "warnings": sorted(set(re.findall(r"C75\d\d", log)))}


def driver_jit(ptx: str, entry: str) -> dict:
    """cuModuleLoadDataEx on the PTX: the JIT's info log, the function's registers and local memory."""
    lib = ctypes.CDLL("libcuda.so.1")

    def call(name, *args):
        rc = getattr(lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    call("cuInit", 0)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    call("cuDeviceGet", ctypes.byref(dev), 0)
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    call("cuCtxSetCurrent", ctx)
    size = 1 << 16
    info, err = ctypes.create_string_buffer(size), ctypes.create_string_buffer(size)
    opts = (ctypes.c_int * 5)(3, 4, 5, 6, 12)  # INFO_LOG_BUFFER, its size, ERROR_LOG_BUFFER, its size, LOG_VERBOSE
    vals = (ctypes.c_void_p * 5)(ctypes.cast(info, ctypes.c_void_p), ctypes.c_void_p(size),
                                 ctypes.cast(err, ctypes.c_void_p), ctypes.c_void_p(size), ctypes.c_void_p(1))
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    image = ctypes.create_string_buffer(ptx.encode() + b"\0")
    rc = lib.cuModuleLoadDataEx(ctypes.byref(mod), image, 5, opts, vals)
    log = info.value.decode(errors="replace")
    if rc != 0:
        return {"error": f"cuModuleLoadDataEx CUresult {rc}", "log": err.value.decode(errors="replace")[-2000:]}
    call("cuModuleGetFunction", ctypes.byref(fn), mod, entry.encode())
    regs, local = ctypes.c_int(), ctypes.c_int()
    call("cuFuncGetAttribute", ctypes.byref(regs), 4, fn)  # CU_FUNC_ATTRIBUTE_NUM_REGS
    call("cuFuncGetAttribute", ctypes.byref(local), 3, fn)  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
    m = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": regs.value, "local_bytes": local.value, "spill_stores": int(m.group(1)) if m else -1,
            "warnings": sorted(set(re.findall(r"C75\d\d", log))),
            "log": "\n".join(ln for ln in log.splitlines() if "info" in ln or "warn" in ln.lower())[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="plain")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--producer-regs", type=int, default=0, help="the producer's setmaxnreg (default 40)")
    ap.add_argument("--persistent", type=int, default=0, help="blocks of a persistent kernel (default: one an item)")
    a = ap.parse_args()
    entry, ptx = kernel_ptx(a.variant, a.d, a.stages, a.producer_regs, a.persistent)
    out = {"variant": a.variant, "D": a.d, "stages": a.stages, "producer_regs": a.producer_regs or 40,
           "setmaxnreg": re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32 \d+", ptx),
           "persistent": a.persistent, "nvjitlink": linked(ptx), "ptxas": ptxas_whole(ptx)}
    try:
        out["driver"] = driver_jit(ptx, entry)
    except OSError as exc:
        out["driver"] = {"error": f"no libcuda: {exc}"}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
