"""How long PTX -> cubin takes, cold, by each route a falower compile could take (issue 10, compile time).

Numba links a kernel's PTX through cuda.core's Linker (nvJitLink): on the H100 host that step was 1.66 s of
the warp-specialized forward's 7.21 s cold compile, against 0.86 s for ptxas on the same PTX in a warm process.
This probe times, each in a fresh process (imports and first-use costs included, Python's start excluded):

    core        cuda.core Linker, as Numba calls it
    nvjitlink   cuda.bindings.nvjitlink directly (create, add PTX, complete, get the cubin)
    culink      the driver's linker through ctypes (cuLinkCreate / AddData / Complete): a cubin to cache
    module      cuModuleLoadData on the PTX (the driver compiles it, whole program, nothing to cache)

and reports each route's registers (from the loaded function where a GPU is present).

    python benchmarks/probe_link.py KERNEL.ptx [--routes core nvjitlink culink module] [--arch sm_90a]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import subprocess
import sys
import time


def _entry(ptx: str) -> str:
    m = re.search(r"\.entry\s+([\w$]+)\s*\(", ptx)
    if m is None:
        raise SystemExit("probe_link: no .entry in the PTX")
    return m.group(1)


def _cuda():
    lib = ctypes.CDLL("libcuda.so.1")

    def call(name, *args):
        rc = getattr(lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")
    return lib, call


def _context(call):
    call("cuInit", 0)
    dev = ctypes.c_int()
    call("cuDeviceGet", ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    call("cuCtxSetCurrent", ctx)


def _registers(call, mod: ctypes.c_void_p, entry: str) -> int:
    """Registers a thread of `entry` in the loaded module `mod`."""
    fn, regs = ctypes.c_void_p(), ctypes.c_int()
    call("cuModuleGetFunction", ctypes.byref(fn), mod, entry.encode())
    call("cuFuncGetAttribute", ctypes.byref(regs), 4, fn)  # CU_FUNC_ATTRIBUTE_NUM_REGS
    return regs.value


def _load(call, image: bytes) -> ctypes.c_void_p:
    mod = ctypes.c_void_p()
    call("cuModuleLoadData", ctypes.byref(mod), ctypes.c_char_p(image))
    return mod


def route(name: str, ptx: str, arch: str) -> dict:
    """PTX -> cubin (or a loaded module) by route `name`, timed from here (this process is fresh)."""
    data = ptx.encode()
    entry = _entry(ptx)
    out: dict = {"route": name}
    t = time.perf_counter()
    cubin = None
    if name == "core":
        from cuda.core import Linker, LinkerOptions, ObjectCode

        obj = Linker(ObjectCode.from_ptx(data, name="kernel.ptx"), options=LinkerOptions(arch=arch)).link("cubin")
        cubin = bytes(obj.code) if not isinstance(obj.code, bytes) else obj.code
    elif name == "nvjitlink":
        from cuda.bindings import nvjitlink

        h = nvjitlink.create(1, [f"-arch={arch}"])
        nvjitlink.add_data(h, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        nvjitlink.complete(h)
        buf = bytearray(nvjitlink.get_linked_cubin_size(h))
        nvjitlink.get_linked_cubin(h, buf)
        nvjitlink.destroy(h)
        cubin = bytes(buf)
    elif name in ("culink", "module"):
        lib, call = _cuda()
        t_ctx = time.perf_counter()
        _context(call)
        out["context_s"] = time.perf_counter() - t_ctx
        if name == "culink":
            state = ctypes.c_void_p()
            call("cuLinkCreate_v2", 0, None, None, ctypes.byref(state))
            call("cuLinkAddData_v2", state, 1, ctypes.c_char_p(data), ctypes.c_size_t(len(data)), b"kernel.ptx",
                 0, None, None)  # CU_JIT_INPUT_PTX
            img, size = ctypes.c_void_p(), ctypes.c_size_t()
            call("cuLinkComplete", state, ctypes.byref(img), ctypes.byref(size))
            cubin = ctypes.string_at(img, size.value)
            call("cuLinkDestroy", state)
        else:
            mod = _load(call, data + b"\0")  # the driver compiles the PTX
            out["seconds"] = time.perf_counter() - t
            out["registers"] = _registers(call, mod, entry)
            return out
    else:
        raise SystemExit(f"probe_link: unknown route {name!r}")
    out["seconds"] = time.perf_counter() - t
    out["cubin_bytes"] = len(cubin)
    try:
        lib, call = _cuda()
        _context(call)
        out["registers"] = _registers(call, _load(call, cubin), entry)
    except (OSError, RuntimeError) as e:  # no GPU here: the time stands, the registers are unknown
        out["registers"] = f"n/a ({e})"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ptx")
    ap.add_argument("--routes", nargs="*", default=["core", "nvjitlink", "culink", "module"])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--repeat", type=int, default=2, help="fresh processes per route")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ptx = open(args.ptx).read()
    if args.arch.endswith("a"):  # numba-cuda prints sm_90 in the PTX of a wgmma kernel; wgmma needs sm_90a
        ptx = re.sub(r"\.target sm_(\d+)\b(?!a)", r".target sm_\1a", ptx)
    if args.child:
        print(json.dumps(route(args.child, ptx, args.arch)))
        return
    for name in args.routes:
        for _ in range(args.repeat):
            cmd = [sys.executable, __file__, args.ptx, "--arch", args.arch, "--child", name]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{name:10s} FAILED: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            extra = f"  (context {res['context_s']:.2f} s)" if "context_s" in res else ""
            print(f"{name:10s} {res['seconds']:6.2f} s  registers {res['registers']}{extra}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
