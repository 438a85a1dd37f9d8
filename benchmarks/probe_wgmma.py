"""wgmma from Numba on the H100 (issue 11): correctness of each form against torch, and a GEMM's TFLOP/s.

Kernels (each also runs in the CUDA simulator on tiny shapes: tests/backend/test_wgmma_simulator.py):
    ss_kernel(kind, N, D)          S[64, N] = Q[64, D] K[N, D]^T, both K-major in 128 B-swizzled shared memory,
                                   D // 16 wgmma m64nNk16 from descriptors (D = 128 crosses a 64-column block)
    rs_kernel(kind, N, BK, swap)   O[64, N] = P[64, BK] V[BK, N], P from registers (mma.sync A layout), V
                                   MN-major (trans-b); swap=True exchanges LBO and SBO (to find which the
                                   hardware means when N > 64 spans two 64-column blocks)
    gemm_kernel(kind, BM, BN, STAGES, wait1)
                                   C[M, N] = A[M, K] B[N, K]^T, BM // 64 warpgroups, K steps of 64 through a
                                   STAGES-deep cp.async ring of 128 B-swizzled tiles, m64n{BN}k16 wgmmas;
                                   wait1: keep one k step of wgmmas in flight across the next barrier
Usage on the GPU: python3 benchmarks/probe_wgmma.py [--size 8192] [--configs 128x256x4w1 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from numba import cuda

from falower.backends.numba_cuda.intrinsics import (
    SIMULATOR,
    cp_async16_s,
    cp_async_commit,
    pack_bf16x2,
    pack_f16x2,
    smem_base,
)
from falower.backends.numba_cuda.wgmma import (
    cp_async_wait,
    desc_hi,
    fence_proxy_async,
    make_desc,
    swizzled_offset,
    wgmma_commit,
    wgmma_fence,
    wgmma_fence_regs,
    wgmma_rs,
    wgmma_ss,
    wgmma_wait1,
    wgmma_wait_regs,
)

SMEM_DTYPE = np.dtype(np.uint16) if SIMULATOR else np.uint16
ZERO = np.float32(0.0)
ALIGN = 1024  # 128 B-swizzle atoms sit at 1024-byte aligned shared addresses


def ss_kernel(kind: str, N: int, D: int):
    """q [64*D], k [N*D] uint16 bits, row-major; out f32 [64*N]."""
    mma = wgmma_ss(kind, N)
    R = N // 2
    wait = wgmma_wait_regs(0, R)
    HI = desc_hi(16, 1024)
    K_OFF = 64 * D * 2  # bytes: Q blocks first

    @cuda.jit
    def ss(q, k, out):
        smem = cuda.shared.array(0, SMEM_DTYPE)
        sb0 = smem_base(smem)
        pad = (ALIGN - (sb0 & (ALIGN - 1))) & (ALIGN - 1)
        sb = sb0 + pad
        tid = cuda.threadIdx.x
        for e in range(tid, 64 * D, 128):
            r = e // D
            d = e % D
            smem[(pad + (d >> 6) * 64 * 128 + swizzled_offset(r, (d & 63) >> 3) + (d & 7) * 2) >> 1] = q[e]
        for e in range(tid, N * D, 128):
            r = e // D
            d = e % D
            smem[(pad + K_OFF + (d >> 6) * N * 128 + swizzled_offset(r, (d & 63) >> 3) + (d & 7) * 2) >> 1] = k[e]
        fence_proxy_async()
        cuda.syncthreads()
        acc = cuda.local.array(R, np.float32)
        wgmma_fence()
        for ks in range(D // 16):
            da = make_desc(HI, sb + (ks >> 2) * 64 * 128 + (ks & 3) * 32)
            db = make_desc(HI, sb + K_OFF + (ks >> 2) * N * 128 + (ks & 3) * 32)
            mma(acc, 0, da, db, 1 if ks > 0 else 0)
        wgmma_commit()
        wait(acc, 0)
        lane = tid & 31
        row = (tid >> 5) * 16 + (lane >> 2)
        col = (lane & 3) * 2
        for j in range(N // 8):
            out[row * N + 8 * j + col] = acc[4 * j]
            out[row * N + 8 * j + col + 1] = acc[4 * j + 1]
            out[(row + 8) * N + 8 * j + col] = acc[4 * j + 2]
            out[(row + 8) * N + 8 * j + col + 1] = acc[4 * j + 3]

    return ss, 64 * D * 2 + N * D * 2 + ALIGN


def rs_kernel(kind: str, N: int, BK: int, swap: bool = False):
    """p [64*BK/2] uint32 pairs (row-major P), v [BK*N] uint16 bits row-major; out f32 [64*N]."""
    mma = wgmma_rs(kind, N, 1)
    R = N // 2
    wait = wgmma_wait_regs(0, R)
    lbo, sbo = BK * 128, 1024  # CUTLASS: LBO between 64-column blocks (MN), SBO between 8-row groups (K)
    HI = desc_hi(sbo, lbo) if swap else desc_hi(lbo, sbo)

    @cuda.jit
    def rs(p, v, out):
        smem = cuda.shared.array(0, SMEM_DTYPE)
        sb0 = smem_base(smem)
        pad = (ALIGN - (sb0 & (ALIGN - 1))) & (ALIGN - 1)
        sb = sb0 + pad
        tid = cuda.threadIdx.x
        for e in range(tid, BK * N, 128):
            r = e // N
            n = e % N
            smem[(pad + (n >> 6) * BK * 128 + swizzled_offset(r, (n & 63) >> 3) + (n & 7) * 2) >> 1] = v[e]
        fence_proxy_async()
        cuda.syncthreads()
        lane = tid & 31
        row = (tid >> 5) * 16 + (lane >> 2)
        t2 = (lane & 3) * 2
        acc = cuda.local.array(R, np.float32)
        wgmma_fence()
        for kk in range(BK // 16):
            a0 = p[(row * BK + kk * 16 + t2) >> 1]
            a1 = p[((row + 8) * BK + kk * 16 + t2) >> 1]
            a2 = p[(row * BK + kk * 16 + 8 + t2) >> 1]
            a3 = p[((row + 8) * BK + kk * 16 + 8 + t2) >> 1]
            mma(acc, 0, a0, a1, a2, a3, make_desc(HI, sb + kk * 2048), 1 if kk > 0 else 0)
        wgmma_commit()
        wait(acc, 0)
        for j in range(N // 8):
            out[row * N + 8 * j + t2] = acc[4 * j]
            out[row * N + 8 * j + t2 + 1] = acc[4 * j + 1]
            out[(row + 8) * N + 8 * j + t2] = acc[4 * j + 2]
            out[(row + 8) * N + 8 * j + t2 + 1] = acc[4 * j + 3]

    return rs, BK * N * 2 + ALIGN


def gemm_kernel(kind: str = "f16", BM: int = 128, BN: int = 256, STAGES: int = 4, wait1: bool = True,
                group_m: int = 8):
    """a [M*K], b [N*K] int16 bits row-major; c [M*N/2] uint32 pairs. M % (BM * group_m) == N % BN == K % 64 == 0.

    Launch: grid (group_m, N // BN, M // BM // group_m), 2 * BM threads, `smem` bytes of dynamic shared memory."""
    WG = BM // 64
    THREADS = 128 * WG
    R = BN // 2
    A_ST = BM * 128  # bytes of one stage's A tile (64 columns of 16-bit)
    ST = A_ST + BN * 128
    ROWSTEP = THREADS // 8  # rows one sweep of the block's 16-byte copies covers (a multiple of 8)
    A_PER = BM // ROWSTEP
    B_PER = BN // ROWSTEP
    HI = desc_hi(16, 1024)
    mma = wgmma_ss(kind, BN)
    wait_all = wgmma_wait_regs(0, R)
    fence_acc = wgmma_fence_regs(R)
    PRE = STAGES - 2 if wait1 else STAGES - 1  # stages loaded ahead
    cp_wait = cp_async_wait(PRE - 1)  # groups that may still be in flight when stage kt must have landed
    pack = pack_f16x2 if kind == "f16" else pack_bf16x2
    GM = group_m
    assert BM % 64 == 0 and BN % ROWSTEP == 0 and BM % ROWSTEP == 0 and PRE >= 1

    @cuda.jit
    def gemm(a, b, c, M, N, K):
        smem = cuda.shared.array(0, SMEM_DTYPE)
        sb0 = smem_base(smem)
        sb = sb0 + ((ALIGN - (sb0 & (ALIGN - 1))) & (ALIGN - 1))
        tid = cuda.threadIdx.x
        wg = tid >> 7
        # grouped tile order from a 3-D grid (group_m, N // BN, M // BM // group_m): consecutive blocks take
        # group_m block rows of one column panel, so a wave's A and B panels stay in L2. No division by a
        # run-time value: a 64-bit division is a subroutine call, and any call makes ptxas serialize the wgmmas
        pm = cuda.blockIdx.z * GM + cuda.blockIdx.x
        pn = cuda.blockIdx.y
        nk = K // 64
        lr = tid >> 3
        soff = swizzled_offset(lr, tid & 7)
        a_g = (pm * BM + lr) * K + (tid & 7) * 8
        b_g = (pn * BN + lr) * K + (tid & 7) * 8
        for s in range(PRE):
            if s < nk:
                base = sb + s * ST
                for i in range(A_PER):
                    cp_async16_s(base + soff + i * ROWSTEP * 128, a, a_g + i * ROWSTEP * K + s * 64, 16)
                for i in range(B_PER):
                    cp_async16_s(base + A_ST + soff + i * ROWSTEP * 128, b, b_g + i * ROWSTEP * K + s * 64, 16)
            cp_async_commit()
        acc = cuda.local.array(R, np.float32)
        for i in range(R):
            acc[i] = ZERO
        for kt in range(nk):
            cp_wait()
            fence_proxy_async()
            cuda.syncthreads()  # stage kt landed for all; the ring slot loaded next is no longer read
            nxt = kt + PRE
            if nxt < nk:
                base = sb + (nxt % STAGES) * ST
                for i in range(A_PER):
                    cp_async16_s(base + soff + i * ROWSTEP * 128, a, a_g + i * ROWSTEP * K + nxt * 64, 16)
                for i in range(B_PER):
                    cp_async16_s(base + A_ST + soff + i * ROWSTEP * 128, b, b_g + i * ROWSTEP * K + nxt * 64, 16)
            cp_async_commit()
            cur = sb + (kt % STAGES) * ST
            if wait1:
                wgmma_fence()
            else:
                fence_acc(acc, 0)
            for ks in range(4):
                mma(acc, 0, make_desc(HI, cur + wg * 8192 + ks * 32), make_desc(HI, cur + A_ST + ks * 32), 1)
            wgmma_commit()
            if wait1:
                wgmma_wait1()
            else:
                wait_all(acc, 0)
        wait_all(acc, 0)
        lane = tid & 31
        row = pm * BM + wg * 64 + ((tid >> 5) & 3) * 16 + (lane >> 2)
        col = pn * BN + (lane & 3) * 2
        for j in range(BN // 8):
            c[(row * N + col + 8 * j) >> 1] = pack(acc[4 * j], acc[4 * j + 1])
            c[((row + 8) * N + col + 8 * j) >> 1] = pack(acc[4 * j + 2], acc[4 * j + 3])

    return gemm, THREADS, STAGES * ST + ALIGN


# --------------------------------------------------------------------------------------------------
# GPU driver
# --------------------------------------------------------------------------------------------------


def _set_smem(kernel, args, nbytes: int) -> None:
    """Allow more than 48 KB of dynamic shared memory on the overload `args` launch (as runtime.py does)."""
    from numba.cuda.cudadrv.driver import binding, driver

    compiled = kernel._compile_for_args(*args)
    cufunc = compiled._codelibrary.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
    return compiled


def _bits(t, torch):
    return cuda.as_cuda_array(t.view(torch.int16).reshape(-1))


def run_gpu(size: int, configs: list[str]) -> list[dict]:
    import torch

    torch.manual_seed(0)
    dev = "cuda"
    results = []
    dt = {"f16": torch.float16, "bf16": torch.bfloat16}

    def check(name, got, ref, tol):
        err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        r = {"case": name, "rel_err": err, "ok": bool(err < tol)}
        print(json.dumps(r), flush=True)
        results.append(r)

    # S = Q K^T from two descriptors
    for kind, N, D in (("f16", 64, 64), ("f16", 128, 128), ("bf16", 64, 128), ("f16", 256, 64)):
        try:
            q = torch.randn(64, D, device=dev, dtype=dt[kind])
            k = torch.randn(N, D, device=dev, dtype=dt[kind])
            out = torch.zeros(64 * N, device=dev, dtype=torch.float32)
            kern, sm = ss_kernel(kind, N, D)
            args = (_bits(q, torch), _bits(k, torch), cuda.as_cuda_array(out))
            _set_smem(kern, args, sm)
            kern[1, 128, 0, sm](_bits(q, torch), _bits(k, torch), cuda.as_cuda_array(out))
            torch.cuda.synchronize()
            check(f"ss_{kind}_n{N}_d{D}", out.view(64, N), q.float() @ k.float().T, 1e-5)
        except Exception as exc:  # keep going: one broken form must not hide the others
            print(json.dumps({"case": f"ss_{kind}_n{N}_d{D}", "error": repr(exc)[:400]}), flush=True)
    # O = P V, P from registers, V MN-major
    for kind, N, BK, swap in (("f16", 64, 64, False), ("f16", 128, 64, False), ("f16", 128, 64, True),
                              ("bf16", 128, 128, False), ("bf16", 128, 128, True)):
        try:
            p = torch.rand(64, BK, device=dev, dtype=dt[kind])
            v = torch.randn(BK, N, device=dev, dtype=dt[kind])
            out = torch.zeros(64 * N, device=dev, dtype=torch.float32)
            kern, sm = rs_kernel(kind, N, BK, swap)
            kern[1, 128, 0, sm](cuda.as_cuda_array(p.view(torch.int32).reshape(-1)), _bits(v, torch),
                                cuda.as_cuda_array(out))
            torch.cuda.synchronize()
            check(f"rs_{kind}_n{N}_bk{BK}_swap{int(swap)}", out.view(64, N), p.float() @ v.float(), 1e-5)
        except Exception as exc:
            print(json.dumps({"case": f"rs_{kind}_n{N}_bk{BK}_swap{int(swap)}", "error": repr(exc)[:400]}),
                  flush=True)

    # the GEMM
    M = N = K = size
    a = torch.randn(M, K, device=dev, dtype=torch.float16)
    b = torch.randn(N, K, device=dev, dtype=torch.float16)
    flops = 2 * M * N * K

    def bench(fn, reps=7, inner=10):
        """Median over `reps` of the mean of `inner` back-to-back launches (host launch cost hidden)."""
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            st.record()
            for _ in range(inner):
                fn()
            en.record()
            en.synchronize()
            times.append(st.elapsed_time(en) / inner)
        return float(np.median(times))

    ref = a @ b.T
    ms = bench(lambda: a @ b.T)
    r = {"case": "torch_matmul", "ms": ms, "tflops": flops / ms / 1e9}
    print(json.dumps(r), flush=True)
    results.append(r)
    for cfg in configs:
        bm, bn, rest = cfg.split("x")
        stages, w = rest.split("w")
        try:
            t0 = time.time()
            kern, threads, sm = gemm_kernel("f16", int(bm), int(bn), int(stages), w == "1")
            c = torch.empty(M, N, device=dev, dtype=torch.float16)
            args = (_bits(a, torch), _bits(b, torch), cuda.as_cuda_array(c.view(torch.int32).reshape(-1)), M, N, K)
            grid = (8, N // int(bn), M // int(bm) // 8)
            _set_smem(kern, args, sm)
            compile_s = time.time() - t0
            launch = kern[grid, threads, 0, sm]
            launch(*args)
            torch.cuda.synchronize()
            err = ((c.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            ms = bench(lambda: launch(*args))
            r = {"case": f"gemm_{cfg}", "ms": ms, "tflops": flops / ms / 1e9, "rel_err": err,
                 "compile_s": round(compile_s, 1), "smem": sm}
        except Exception as exc:
            r = {"case": f"gemm_{cfg}", "error": repr(exc)[:600]}
        print(json.dumps(r), flush=True)
        results.append(r)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--configs", nargs="*", default=["128x256x4w1", "128x256x4w0", "128x128x5w1", "128x256x3w1"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from gpu_required import require_gpu

    require_gpu("probe_wgmma.py")
    res = run_gpu(args.size, args.configs)
    with open(os.path.join(args.out, "probe_wgmma.json"), "w") as f:
        json.dump({"device": torch_device_name(), "results": res}, f, indent=1)


def torch_device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    sys.exit(main())
