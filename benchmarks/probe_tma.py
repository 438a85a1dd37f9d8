"""Can the kernels copy by TMA tensor copies with the tensor map in global memory, passed as a plain pointer?

The warp-specialized forward stores each row of O by a bulk copy of its own (emit_fa3_ws.bulk_store: 16 copies a
warp) and its producer copies K and V by 16-byte cp.async (2 x 128 a thread a tile). A TMA tensor copy moves a
64 x 64 box in one instruction, but needs a tensor map (CUtensorMap, 128 opaque bytes), which CUDA C passes as a
__grid_constant__ parameter and Numba cannot. PTX also takes a map in global memory (benchmarks/NOTES.md, "O's rows
by bulk copies", Next (2)). This probe, on a GPU, checks what that path would rest on:
  - layout: a box loaded with SWIZZLE_128B lands as chunk c of row r at chunk c ^ (r & 7) of a 1024-byte aligned
    buffer (the layout the kernels' Q / K / V tiles already have), with the map acquired by
    fence.proxy.tensormap (".gpu", ".sys") and without;
  - clipping: a box stored across the tensor's last row writes the rows inside it and nothing past it;
  - cost: cuTensorMapEncodeTiled and cuTensorMapReplaceAddress on the host, a call each.
Without a GPU (--ptx-only) it compiles the probe's kernels and runs a CUDA toolkit's ptxas on them, which checks
the PTX of the copies and fences.

    python3 benchmarks/probe_tma.py [--ptx-only]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BOX = 64  # rows and 16-bit columns of a box: 128 bytes a row, the 128-byte swizzle's span
BOX_BYTES = BOX * BOX * 2
SMEM_HALVES = (BOX_BYTES + 1024 + 16) // 2  # a box, its 1024-byte alignment and an mbarrier, in 16-bit elements
FENCES = ("none", "gpu", "sys")


def _intrinsics():
    """tma_load_2d(sdst, map, col, row, mbar), tma_store_2d(map, col, row, ssrc) and the map's acquire fences,
    each one inline-PTX call (the map a generic address: a u64), made as intrinsics.py makes its mbarrier ones."""
    from numba import types

    from falower.backends.numba_cuda.intrinsics import _addr_asm

    u32, u64, i32 = types.uint32, types.uint64, types.int32
    return {
        "tma_load_2d": _addr_asm("tma_load_2d", "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx"
                                 "::bytes [$0], [$1, {$2, $3}], [$4];", 5, arg_types=(u32, u64, i32, i32, u32)),
        "tma_store_2d": _addr_asm("tma_store_2d", "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group "
                                  "[$0, {$1, $2}], [$3];", 4, arg_types=(u64, i32, i32, u32)),
        "acquire_gpu": _addr_asm("acquire_gpu", "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", 1,
                                 arg_types=(u64,)),
        "acquire_sys": _addr_asm("acquire_sys", "fence.proxy.tensormap::generic.acquire.sys [$0], 128;", 1,
                                 arg_types=(u64,)),
    }


def kernels():
    """(load_dump, store_box): one block each. load_dump copies the box at (col, row) into shared memory by TMA and
    dumps the buffer's words as they lie; store_box stages the given words into the buffer and stores it as the box
    at (col, row). `fence`: 0 none, 1 the map acquired at .gpu, 2 at .sys (thread 0, before its copy)."""
    from numba import cuda

    from falower.backends.numba_cuda.intrinsics import (bulk_commit, bulk_wait_read0, lds_v4_u32, mbar_arrive_expect_tx,
                                                        mbar_init, mbar_wait, smem_base, sts_u32)
    from falower.backends.numba_cuda.wgmma import fence_proxy_async

    t = _intrinsics()
    tma_load_2d, tma_store_2d, acquire_gpu, acquire_sys = (t[k] for k in ("tma_load_2d", "tma_store_2d",
                                                                          "acquire_gpu", "acquire_sys"))
    words = BOX_BYTES // 4

    @cuda.jit
    def load_dump(mp, col, row, dump, fence):
        sm = cuda.shared.array(SMEM_HALVES, np.uint16)
        sb = (smem_base(sm) + np.uint32(1023)) & np.uint32(0xFFFFFC00)  # the swizzle's 1024-byte alignment
        bar = sb + np.uint32(BOX_BYTES)
        tid = cuda.threadIdx.x
        if tid == 0:
            if fence == 1:
                acquire_gpu(mp)
            elif fence == 2:
                acquire_sys(mp)
            mbar_init(bar, 1)
            mbar_arrive_expect_tx(bar, BOX_BYTES)
            tma_load_2d(sb, mp, col, row, bar)
            mbar_wait(bar, 0)
        cuda.syncthreads()
        for i in range(tid, words // 4, cuda.blockDim.x):
            w0, w1, w2, w3 = lds_v4_u32(sb + np.uint32(16 * i))
            dump[4 * i] = w0
            dump[4 * i + 1] = w1
            dump[4 * i + 2] = w2
            dump[4 * i + 3] = w3

    @cuda.jit
    def store_box(mp, col, row, src, fence):
        sm = cuda.shared.array(SMEM_HALVES, np.uint16)
        sb = (smem_base(sm) + np.uint32(1023)) & np.uint32(0xFFFFFC00)
        tid = cuda.threadIdx.x
        for i in range(tid, words, cuda.blockDim.x):
            sts_u32(sb + np.uint32(4 * i), src[i])
        fence_proxy_async()  # the staged words are visible to the async proxy
        cuda.syncthreads()
        if tid == 0:
            if fence == 1:
                acquire_gpu(mp)
            elif fence == 2:
                acquire_sys(mp)
            tma_store_2d(mp, col, row, sb)
            bulk_commit()
            bulk_wait_read0()

    return load_dump, store_box


def _driver():
    """libcuda with cuTensorMapEncodeTiled typed (tensor_maps._driver, the kernels' own) and the address replace."""
    from falower.backends.numba_cuda.tensor_maps import _driver as maps_driver

    lib = maps_driver()
    lib.cuTensorMapReplaceAddress.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


class TensorMap:
    """A host CUtensorMap (128 bytes, 64-byte aligned) for a row-major [rows, cols] 16-bit tensor at `ptr`: boxes
    of BOX x BOX, SWIZZLE_128B, no interleave, no L2 promotion, zeros out of bounds."""

    def __init__(self, lib, ptr: int, rows: int, cols: int) -> None:
        self.lib = lib
        self._buf = ctypes.create_string_buffer(256)
        self.addr = (ctypes.addressof(self._buf) + 63) & ~63
        self.dims = (ctypes.c_uint64 * 2)(cols, rows)  # innermost first
        self.strides = (ctypes.c_uint64 * 1)(cols * 2)  # bytes between rows (the innermost stride is implied)
        self.box = (ctypes.c_uint32 * 2)(BOX, BOX)
        self.estr = (ctypes.c_uint32 * 2)(1, 1)
        self.encode(ptr)

    def encode(self, ptr: int) -> None:
        rc = self.lib.cuTensorMapEncodeTiled(ctypes.c_void_p(self.addr), 6, 2, ctypes.c_void_p(ptr), self.dims,
                                             self.strides, self.box, self.estr, 0, 3, 0, 0)  # FLOAT16, SWIZZLE_128B
        if rc != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled: CUresult {rc}")

    def replace(self, ptr: int) -> None:
        rc = self.lib.cuTensorMapReplaceAddress(ctypes.c_void_p(self.addr), ctypes.c_void_p(ptr))
        if rc != 0:
            raise RuntimeError(f"cuTensorMapReplaceAddress: CUresult {rc}")

    def bytes(self) -> np.ndarray:
        return np.frombuffer(ctypes.string_at(self.addr, 128), np.uint8).copy()


def swizzled(box: np.ndarray) -> np.ndarray:
    """A [BOX, BOX] 16-bit box as SWIZZLE_128B lays it in a 1024-byte aligned buffer: 16-byte chunk c of row r at
    chunk c ^ (r & 7) of the row (the kernels' Q / K / V tile layout)."""
    out = np.empty_like(box)
    for r in range(BOX):
        for c in range(BOX // 8):
            out[r, (c ^ (r & 7)) * 8:(c ^ (r & 7)) * 8 + 8] = box[r, c * 8:c * 8 + 8]
    return out


def run_gpu() -> dict:
    from numba import cuda

    load_dump, store_box = kernels()
    lib = _driver()
    name = cuda.get_current_device().name
    res: dict = {"device": name.decode() if isinstance(name, bytes) else str(name)}
    rows, cols = 256, 128
    x = (np.arange(rows)[:, None] * 256 + np.arange(cols)[None, :]).astype(np.uint16)  # row and column in the bits
    dx = cuda.to_device(x)
    tm = TensorMap(lib, dx.device_ctypes_pointer.value, rows, cols)
    dmap = cuda.to_device(tm.bytes())  # the map in global memory (device allocations are 256-byte aligned)
    mp = np.uint64(dmap.device_ctypes_pointer.value)
    want = swizzled(x[64:128, 64:128])
    for f, name in enumerate(FENCES):
        dump = cuda.device_array(BOX_BYTES // 4, np.uint32)
        try:
            load_dump[1, 128](mp, 64, 64, dump, f)
            cuda.synchronize()
            got = dump.copy_to_host().view(np.uint16).reshape(BOX, BOX)
            res[f"load_{name}"] = "swizzled" if np.array_equal(got, want) else (
                "row-major" if np.array_equal(got, x[64:128, 64:128]) else "other")
        except Exception as exc:  # a fault on one fence mode leaves the others' readings
            res[f"load_{name}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    # a box stored across the tensor's end: rows 100 .. 127 of the map are outside its 100 rows
    sentinel = np.uint16(0xBEEF)
    o = np.full((128, cols), sentinel, np.uint16)
    do = cuda.to_device(o)
    om = TensorMap(lib, do.device_ctypes_pointer.value, 100, cols)
    dom = cuda.to_device(om.bytes())
    src = swizzled(x[:64, :64])
    store_box[1, 128](np.uint64(dom.device_ctypes_pointer.value), 0, 64, cuda.to_device(src.view(np.uint32).ravel()),
                      1)
    cuda.synchronize()
    back = do.copy_to_host()
    res["store_inside"] = bool(np.array_equal(back[64:100, :64], x[:36, :64]))
    res["store_past_end_untouched"] = bool((back[100:] == sentinel).all() and (back[64:100, 64:] == sentinel).all())
    for what, fn in (("encode_us", lambda: tm.encode(dx.device_ctypes_pointer.value)),
                     ("replace_address_us", lambda: tm.replace(dx.device_ctypes_pointer.value))):
        t0 = time.perf_counter()
        for _ in range(1000):
            fn()
        res[what] = (time.perf_counter() - t0) * 1e3  # us a call (1000 calls)
    return res


def run_ptx_only() -> dict:
    """The kernels' PTX (no GPU: runtime.ptx_of answers the compute capability) through a toolkit's ptxas."""
    from numba import types

    from falower.backends.numba_cuda.runtime import ptx_image, ptx_of
    from probe_setmaxnreg import ptxas_whole

    load_dump, store_box = kernels()
    u32 = types.Array(types.uint32, 1, "C")
    out = {}
    for name, kern, sig in (("load_dump", load_dump, (types.uint64, types.int32, types.int32, u32, types.int32)),
                            ("store_box", store_box, (types.uint64, types.int32, types.int32, u32, types.int32))):
        ptx = ptx_image(ptx_of(kern, sig, (9, 0)), "sm_90a")[:-1].decode()
        usage = ptxas_whole(ptx)
        out[name] = {k: usage[k] for k in ("registers", "spill_stores", "error", "log") if k in usage}
        out[name]["tma"] = ptx.count("cp.async.bulk.tensor")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ptx-only", action="store_true", help="compile and ptxas the kernels; no GPU")
    a = ap.parse_args()
    if not a.ptx_only:
        from gpu_required import require_driver

        require_driver("probe_tma.py")
    print(json.dumps(run_ptx_only() if a.ptx_only else run_gpu()))


if __name__ == "__main__":
    main()
