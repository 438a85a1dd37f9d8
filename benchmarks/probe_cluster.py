"""Can falower's kernels run as clusters of 4 CTAs, launched as they are now (cuLaunchKernel, grid in blocks)?

The bias table's kernel reads each f32 table tile once a batch row: the 4 batch rows of one (head, q tile) read the
same tiles, 4.3 GB through L2 a call at B = 4 (benchmarks/NOTES.md, "The softcap's tanh in four instructions",
Next 1). A cluster of those 4 CTAs, each loading a quarter of a tile and multicasting it to all four, would cut that
to a quarter. Numba-CUDA 0.30 has no cluster launch argument, but falower loads its own PTX and launches through
cuLaunchKernel (runtime.py), and a kernel whose PTX carries `.explicitcluster` and `.reqnctapercluster 4, 1, 1`
launches as clusters with a plain launch whose grid is a multiple of 4 (CUDA Programming Guide, "Launching with
Clusters in Triple Chevron Notation"). This probe checks, on a GPU, what that path rests on:
  - cluster: the function's required cluster width (attribute 11) reads 4; a grid of 8 runs, each CTA sees its
    %cluster_ctarank and %clusterid; each CTA arrives once on every peer's mbarrier (mapa + a remote
    mbarrier.arrive), and all pass their wait; a grid of 6 is refused (not a multiple of 4);
  - multicast: each rank copies a 256-byte quarter of a 1 KB buffer by cp.async.bulk ... multicast::cluster with
    mask 0xF; every CTA's barrier expects the whole 1 KB, and every CTA reads the whole buffer back;
  - tensor multicast: the same by TMA tensor copies of an f32 [128, 32] tile, 32 rows a rank, through a map in
    global memory (fence.proxy.tensormap before the copy), as the bias table's tiles would come.
Written 2026-11-28 from CUTLASS's and FlashAttention-3's forms (include/cute/arch/copy_sm90_tma.hpp,
cluster_sm90.hpp, include/cutlass/arch/barrier.h; hopper/flash_fwd_kernel_sm90.h). Run on an H200 the same day
(16:49 UTC, the tensor copies at 17:12): all three "ok": width 4, the 8 CTAs ranks 0-3 of clusters 0 and 1, every
remote arrival seen; a grid of 6 refused at launch (CUresult 912: a cluster misconfiguration); every CTA read the
whole multicast buffer, and the whole f32 tile the four ranks' tensor copies multicast.

    python3 benchmarks/probe_cluster.py              # the launch path, multicast
    python3 benchmarks/probe_cluster.py --capacity   # how many clusters of 1-16 CTAs run at once (capacity_probe)

Prints one JSON line.
"""

from __future__ import annotations

import ctypes
import json

_HEAD = """.version 8.0
.target sm_90a
.address_size 64
"""

# every CTA: its rank and cluster id to out[2 ctaid]; one arrival from each of the cluster's 4 CTAs on its barrier
CLUSTER_PTX = _HEAD + r""".visible .entry k(.param .u64 p)
.explicitcluster
.reqnctapercluster 4, 1, 1
{
.reg .b32 r<6>; .reg .b64 d<2>; .reg .pred q; .shared .align 8 .b64 bar;
mov.u32 r0, %cluster_ctarank; mov.u32 r1, %clusterid.x; mov.u32 r2, %ctaid.x; mov.u32 r3, %tid.x; mov.u32 r4, bar;
setp.eq.u32 q, r3, 0; @q mbarrier.init.shared::cta.b64 [bar], 4;
fence.mbarrier_init.release.cluster; barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;
setp.lt.u32 q, r3, 4; @!q bra W;
mapa.shared::cluster.u32 r5, r4, r3; mbarrier.arrive.release.cluster.shared::cluster.b64 _, [r5];
W: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 q, [bar], 0; @!q bra W;
barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;
setp.ne.u32 q, r3, 0; @q bra X;
ld.param.u64 d0, [p]; cvta.to.global.u64 d0, d0; mul.wide.u32 d1, r2, 8; add.u64 d0, d0, d1;
st.global.v2.u32 [d0], {r0, r1};
X: ret;
}
"""

# rank r copies bytes 256 r .. 256 r + 255 of src to every CTA's s[256 r ..] (mask 0xF); each reads s back whole
MULTICAST_PTX = _HEAD + r""".visible .entry k(.param .u64 p, .param .u64 o)
.explicitcluster
.reqnctapercluster 4, 1, 1
{
.reg .b32 r<9>; .reg .b64 d<4>; .reg .pred q; .reg .b16 h; .shared .align 128 .b8 s[1024]; .shared .align 8 .b64 bar;
mov.u32 r0, %cluster_ctarank; mov.u32 r3, %tid.x; mov.u32 r4, bar; mov.u32 r6, s;
setp.eq.u32 q, r3, 0; @q mbarrier.init.shared::cta.b64 [bar], 1;
fence.mbarrier_init.release.cluster; barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;
@!q bra W;
mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], 1024;
ld.param.u64 d0, [p]; cvta.to.global.u64 d0, d0; mul.wide.u32 d1, r0, 256; add.u64 d0, d0, d1;
shl.b32 r7, r0, 8; add.u32 r7, r6, r7; mov.b16 h, 15;
cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [r7], [d0], 256, [r4], h;
W: mbarrier.try_wait.parity.shared::cta.b64 q, [bar], 0; @!q bra W;
shl.b32 r8, r3, 2; add.u32 r8, r6, r8; ld.shared.u32 r5, [r8];
mov.u32 r2, %ctaid.x; mad.lo.u32 r2, r2, 256, r3;
ld.param.u64 d2, [o]; cvta.to.global.u64 d2, d2; mul.wide.u32 d3, r2, 4; add.u64 d2, d2, d3; st.global.u32 [d2], r5;
barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;
ret;
}
"""

# the bias table's form: rank r loads rows 32 r .. 32 r + 31 of a [128, 32] f32 tensor by a TMA tensor copy through
# a map in global memory (as the kernels pass theirs; PTX 8.3 for fence.proxy.tensormap), multicast to the cluster;
# each CTA's barrier expects the whole 16 KB, and its 256 threads copy the tile to out[ctaid]
TENSOR_MULTICAST_PTX = _HEAD.replace("8.0", "8.3") + r""".visible .entry k(.param .u64 m, .param .u64 o)
.explicitcluster
.reqnctapercluster 4, 1, 1
{
.reg .b32 r<10>; .reg .b64 d<3>; .reg .pred q, p; .reg .b16 h; .shared .align 1024 .b8 s[16384];
.shared .align 8 .b64 bar;
mov.u32 r0, %cluster_ctarank; mov.u32 r3, %tid.x; mov.u32 r4, bar; mov.u32 r6, s;
ld.param.u64 d0, [m];
setp.eq.u32 q, r3, 0; @q mbarrier.init.shared::cta.b64 [bar], 1;
fence.mbarrier_init.release.cluster; barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;
@!q bra W;
fence.proxy.tensormap::generic.acquire.gpu [d0], 128;
mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], 16384;
shl.b32 r7, r0, 12; add.u32 r7, r6, r7; shl.b32 r8, r0, 5; mov.u32 r9, 0; mov.b16 h, 15;
cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [r7], [d0, {r9, r8}],
    [r4], h;
W: mbarrier.try_wait.parity.shared::cta.b64 p, [bar], 0; @!p bra W;
ld.param.u64 d1, [o]; cvta.to.global.u64 d1, d1; mov.u32 r1, 0;
L: mad.lo.u32 r2, r3, 16, r1; shl.b32 r5, r2, 2; add.u32 r5, r6, r5; ld.shared.u32 r5, [r5];
mov.u32 r8, %ctaid.x; mad.lo.u32 r8, r8, 4096, r2; mul.wide.u32 d2, r8, 4; add.u64 d2, d1, d2; st.global.u32 [d2], r5;
add.u32 r1, r1, 1; setp.lt.u32 p, r1, 16; @p bra L;
barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;
ret;
}
"""


def _driver():
    """libcuda with cuTensorMapEncodeTiled typed (tensor_maps._driver, the kernels' own), a context current."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from falower.backends.numba_cuda.tensor_maps import _driver as maps_driver

    lib = maps_driver()
    lib.cuInit(0)
    ctx = ctypes.c_void_p()
    lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    lib.cuCtxSetCurrent(ctx)
    return lib


def _function(lib, ptx: str):
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    err = lib.cuModuleLoadData(ctypes.byref(mod), ptx.encode() + b"\0")
    if err:
        return err, None
    return lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"k"), fn


def cluster_probe(lib) -> dict:
    err, fn = _function(lib, CLUSTER_PTX)
    out: dict = {"load": err}
    if err:
        return out
    width = ctypes.c_int()
    lib.cuFuncGetAttribute(ctypes.byref(width), 11, fn)  # CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH
    out["required_cluster_width"] = width.value
    buf = ctypes.c_uint64()
    lib.cuMemAlloc_v2(ctypes.byref(buf), 128)
    arg = ctypes.c_uint64(buf.value)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    for grid in (8, 6):
        host = (ctypes.c_uint32 * 16)()
        lib.cuMemsetD8_v2(buf, 255, 128)
        launch = lib.cuLaunchKernel(fn, grid, 1, 1, 32, 1, 1, 0, None, params, None)
        sync = lib.cuCtxSynchronize()
        lib.cuMemcpyDtoH_v2(host, buf, 64)
        ranks = [(host[2 * i], host[2 * i + 1]) for i in range(8)]
        out[f"grid_{grid}"] = {"launch": launch, "sync": sync, "rank_cluster": ranks}
    g8 = out["grid_8"]
    out["ok"] = (width.value == 4 and g8["launch"] == 0 and g8["sync"] == 0
                 and g8["rank_cluster"] == [(i % 4, i // 4) for i in range(8)] and out["grid_6"]["launch"] != 0)
    return out


def _run_eight(lib, fn, args: list, dst, ctype, words: int, want: list, out: dict) -> dict:
    """Launch fn on 8 CTAs of 256 threads with the u64 arguments `args`, read back 8 x `words` values of `ctype`
    from dst, and check that every CTA wrote `want` whole."""
    vals = [ctypes.c_uint64(a) for a in args]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    out["launch"] = lib.cuLaunchKernel(fn, 8, 1, 1, 256, 1, 1, 0, None, params, None)
    out["sync"] = lib.cuCtxSynchronize()
    host = (ctype * (8 * words))()
    lib.cuMemcpyDtoH_v2(host, dst, ctypes.sizeof(host))
    out["cta_whole"] = [list(host[k * words:(k + 1) * words]) == want for k in range(8)]
    out["ok"] = out.get("encode", 0) == 0 and out["launch"] == 0 and out["sync"] == 0 and all(out["cta_whole"])
    return out


def multicast_probe(lib) -> dict:
    err, fn = _function(lib, MULTICAST_PTX)
    out: dict = {"load": err}
    if err:
        return out
    src, dst = ctypes.c_uint64(), ctypes.c_uint64()
    lib.cuMemAlloc_v2(ctypes.byref(src), 1024)
    lib.cuMemAlloc_v2(ctypes.byref(dst), 8192)
    lib.cuMemcpyHtoD_v2(src, (ctypes.c_uint32 * 256)(*range(256)), 1024)
    return _run_eight(lib, fn, [src.value, dst.value], dst, ctypes.c_uint32, 256, list(range(256)), out)


def tensor_multicast_probe(lib) -> dict:
    err, fn = _function(lib, TENSOR_MULTICAST_PTX)
    out: dict = {"load": err}
    if err:
        return out
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    src, dst, mdev = u64(), u64(), u64()
    lib.cuMemAlloc_v2(ctypes.byref(src), 16384)
    lib.cuMemAlloc_v2(ctypes.byref(dst), 8 * 16384)
    lib.cuMemAlloc_v2(ctypes.byref(mdev), 128)
    vals = (ctypes.c_float * 4096)(*[float(i) for i in range(4096)])
    lib.cuMemcpyHtoD_v2(src, vals, 16384)
    buf = ctypes.create_string_buffer(192)
    at = (ctypes.addressof(buf) + 63) & ~63
    out["encode"] = lib.cuTensorMapEncodeTiled(  # FLOAT32 (7), rank 2: dims (32, 128), rows 128 bytes apart,
        ctypes.c_void_p(at), 7, 2, ctypes.c_void_p(src.value), (u64 * 2)(32, 128), (u64 * 1)(128),  # box 32 x 32,
        (u32 * 2)(32, 32), (u32 * 2)(1, 1), 0, 0, 0, 0)  # no interleave, no swizzle, no promotion, zero fill
    lib.cuMemcpyHtoD_v2(mdev, ctypes.c_void_p(at), 128)
    return _run_eight(lib, fn, [mdev.value, dst.value], dst, ctypes.c_float, 4096, list(vals), out)


# a cluster of `width` CTAs that records, per CTA, its SM and the global timer at its start and end around a spin of
# ~`spin` ns: how many clusters of that width run at once with one CTA an SM (capacity_probe)
def _capacity_ptx(width: int) -> str:
    return _HEAD + f""".visible .entry k(.param .u64 p, .param .u64 spin)
.explicitcluster
.reqnctapercluster {width}, 1, 1
{{""" + r"""
.reg .b32 r<4>; .reg .b64 d<8>; .reg .pred q;
mov.u32 r3, %tid.x; setp.ne.u32 q, r3, 0;
barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;
mov.u64 d2, %globaltimer; ld.param.u64 d5, [spin]; add.u64 d6, d2, d5;
S: mov.u64 d3, %globaltimer; setp.lt.u64 q, d3, d6; @q bra S;
setp.ne.u32 q, r3, 0; @q bra X;
mov.u32 r0, %smid; mov.u32 r1, %ctaid.x;
ld.param.u64 d0, [p]; cvta.to.global.u64 d0, d0; mul.wide.u32 d1, r1, 24; add.u64 d0, d0, d1;
cvt.u64.u32 d4, r0; st.global.u64 [d0], d4; st.global.u64 [d0+8], d2; st.global.u64 [d0+16], d3;
X: barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;
ret;
}
"""


def capacity_probe(lib, widths=(1, 2, 4, 8, 16), smem: int = 160 * 1024, spin_ns: int = 200_000) -> dict:
    """For each cluster width: the driver's cuOccupancyMaxActiveClusters with one CTA an SM (`smem` bytes of dynamic
    shared memory, as the persistent kernels take) and, measured, how many clusters ran at once in a grid of 16
    clusters (each CTA spinning `spin_ns`: the most CTAs whose [start, end] overlap one instant, over the width),
    and the SMs the grid used. Why: a merge of a q tile's split-kv parts inside a cluster needs all of a q tile's
    parts (up to 16) co-scheduled, and a GPC has 16-18 SMs on an H100 / H200 (benchmarks/NOTES.md)."""
    from falower.backends.numba_cuda.runtime import _LaunchConfig  # (on sys.path: _driver)

    out: dict = {}
    query = getattr(lib, "cuOccupancyMaxActiveClusters", None)
    for w in widths:
        err, fn = _function(lib, _capacity_ptx(w))
        row: dict = {"load": err}
        out[str(w)] = row
        if err:
            continue
        row["smem_attr"] = lib.cuFuncSetAttribute(fn, 8, smem)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
        if w > 8:
            row["nonportable_attr"] = lib.cuFuncSetAttribute(fn, 14, 1)  # NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        grid = 16 * w
        if query is not None:
            cfg = _LaunchConfig()
            cfg.grid[0], cfg.grid[1], cfg.grid[2] = grid, 1, 1
            cfg.block[0], cfg.block[1], cfg.block[2] = 128, 1, 1
            cfg.smem, cfg.num_attrs = smem, 0
            n = ctypes.c_int()
            row["max_active_clusters_err"] = query(ctypes.byref(n), fn, ctypes.byref(cfg))
            row["max_active_clusters"] = n.value
        buf = ctypes.c_uint64()
        lib.cuMemAlloc_v2(ctypes.byref(buf), 24 * grid)
        a0, a1 = ctypes.c_uint64(buf.value), ctypes.c_uint64(spin_ns)
        params = (ctypes.c_void_p * 2)(ctypes.addressof(a0), ctypes.addressof(a1))
        row["launch"] = lib.cuLaunchKernel(fn, grid, 1, 1, 128, 1, 1, smem, None, params, None)
        row["sync"] = lib.cuCtxSynchronize()
        host = (ctypes.c_uint64 * (3 * grid))()
        lib.cuMemcpyDtoH_v2(host, buf, 24 * grid)
        rec = [(host[3 * i], host[3 * i + 1], host[3 * i + 2]) for i in range(grid)]
        if row["launch"] == 0 and row["sync"] == 0:
            starts = sorted(r[1] for r in rec)
            most = max(sum(1 for r in rec if r[1] <= t < r[2]) for t in starts)
            row["clusters_at_once"] = most / w
            row["sms_used"] = len({r[0] for r in rec})
            row["waves_ns"] = max(r[2] for r in rec) - min(r[1] for r in rec)
        lib.cuMemFree_v2(buf)
    return out


def main() -> None:
    import sys

    from gpu_required import require_driver

    require_driver("probe_cluster.py")
    lib = _driver()
    if sys.argv[1:] == ["--capacity"]:
        print(json.dumps({"capacity": capacity_probe(lib)}))
        return
    print(json.dumps({"cluster": cluster_probe(lib), "multicast": multicast_probe(lib),
                      "tensor_multicast": tensor_multicast_probe(lib)}))


if __name__ == "__main__":
    main()
