"""PTX intrinsics for the Numba CUDA backend, and their pure-Python emulations.

This is the only module of falower that touches llvmlite. Each intrinsic is a Numba `@intrinsic`
whose code generation calls an `ir.InlineAsm` with one PTX instruction (or a small `{ ... }` block).
When the CUDA simulator is on (`NUMBA_ENABLE_CUDASIM=1`, read when this module is imported), the same
names are bound to Python functions that follow the PTX fragment layouts, so a kernel that uses the
tensor-core path runs unchanged in the simulator. Warp-collective operations (mma, ldmatrix, shuffles)
are emulated by exchanging each lane's operands through a per-warp scratch area guarded by a per-warp
32-party barrier (sim_threads.HandOverBarrier); kernels must therefore call them with all 32 lanes of a
warp (uniform control flow), which is what the hardware requires too.

Fragment layouts (lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3), two 16-bit values per uint32
with the lower column in the low half:
    A (16x16, row):  a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10]
    B (16x8,  col):  b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]
    C (16x8,  f32):  c0, c1 = C[g, 2t], C[g, 2t+1];  c2, c3 = C[g+8, 2t], C[g+8, 2t+1]

Public names (identical in both modes):
    mma_f16, mma_bf16              (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
    ldmatrix_x4, ldmatrix_x4_trans (smem_u16_array, element_index) -> (r0, r1, r2, r3)
    cp_async16                     (smem_u16_array, s_index, global_array, g_index, src_bytes) 16 bytes,
                                   zero-filled beyond src_bytes (0 or 16)
    cp_async_commit(), cp_async_wait0(), cp_async_wait1()
    griddep_wait()                 griddepcontrol.wait: until the grid this one was launched to depend on
                                   programmatically (runtime._launcher's `programmatic`) has finished and its
                                   writes are visible; nothing where there is none (sm_90)
    griddep_launch_dependents()    griddepcontrol.launch_dependents: the grid launched after this one
                                   programmatically may start once every block has said so (sm_90)
    smem_base                      (shared array) -> uint32 shared-window byte address of element 0 (the
                                   dynamic area or a static array)
    ldsm_x4, ldsm_x4_trans         (shared byte address: uint32) -> (r0, r1, r2, r3)   (32-bit addressing)
    stsm_x4                        (shared byte address, r0, r1, r2, r3): stmatrix .x4, ldsm_x4's inverse: lane
                                   8 m + r gives the address of row r of matrix m, and each lane's word m is
                                   its (row g, columns 2t, 2t + 1) of matrix m (an mma fragment's layout)
    cp_async16_s                   (shared byte address, global_array, g_index, src_bytes)
    prefetch_l2                    (global_array, (i0, i1, ...)) -> int32 0: prefetch.global.L2 of that element
                                   (a hint: the score's gathers of the next kv tile; no-op in the simulator)
    ld_pair                        (global_array, (i0, ..., ik)) -> (a[i0, .., ik], a[i0, .., ik + 1]), one 8-byte
                                   load of a 4-byte dtype (the caller has checked `pairs_aligned` and the range)
    rows_aligned16                 (global_array) -> bool: the last axis contiguous, the other strides and the data
                                   address multiples of 16 bytes (16-byte copies of a row start aligned)
    lds_v2_f32                     (shared byte address) -> (f32, f32): one 8-byte shared load
    elem_addr                      (global_array, (i0, ..., ik)) -> uint64 generic address of that element
    cp_async16_a                   (shared byte address, uint64 generic address, src_bytes): cp.async of 16 bytes
                                   (zero-filled past src_bytes; with elem_addr, from any element of an n-d array)
    ldg_f32_a                      (uint64 generic address of global memory): one f32 load from it (a table's
                                   entry whose row address the kernel keeps: emit_fa3_ws.slice_rows)
    pairs_aligned                  (global_array) -> bool: 4-byte elements, the last axis contiguous and even, the
                                   other strides and the data address multiples of 8 bytes (so every even last
                                   index starts an 8-byte aligned pair)
    pack_f16x2, pack_bf16x2        (lo: f32, hi: f32) -> uint32 (round to nearest even)
    ex2                            (x: f32) -> f32, 2**x (ex2.approx.ftz)
    ex2_poly                       (x: f32, x <= 64) -> f32, 2**x on the FMA and integer pipes, not MUFU: x
                                   rounded to j + f (|f| <= 1/2) by a 1.5 * 2**23 shift, 2**f by a cubic
                                   (relative error 1.0e-4), j added to the exponent; x <= -127 (-inf) gives 0
    tanh_approx_f32                (x: f32) -> f32, tanh.approx.f32 (one MUFU.TANH; the IR's tanh_approx)
    tanh_ex2_f32                   (y: f32) -> f32, tanh(y / (2 log2 e)) as 1 - 2 / (1 + 2**y): ex2 and rcp on
                                   MUFU and two FMA-pipe instructions, absolute error ~2**-22 (the tensor-core
                                   kernels' tanh; TANH_EX2_PTX)
    tanh_small_f32                 (y: f32, |y| <= TANH_SMALL_Y) -> f32, the same tanh(y / (2 log2 e)) by an odd
                                   polynomial on the FMA pipe, no MUFU: 8 instructions, absolute error ~2**-22.7
                                   (TANH_SMALL_PTX; the kernels take it for a tile whose scores all lie in range)
    tanh_tiny_f32                  (y: f32, |y| <= TANH_TINY_Y) -> f32, the same in 4 instructions for |tanh's
                                   argument| <= 1/4, absolute error ~2**-23.26 (TANH_TINY_PTX)
    sin_f32, cos_f32, tan_f32      (x: f32) -> f32, libdevice's float32 versions (no f64 in the kernel)
    rint_f32                       (x: f32) -> f32, round half to even
    floor_f32, ceil_f32            (x: f32) -> f32, libdevice's floorf / ceilf: inf, NaN and |x| past 2^63 as the
                                   IR's floor (Numba's math.floor returns an int64, undefined there); floor_f64,
                                   ceil_f64 the same in f64 (the SIMT kernels' f64 form)
    shfl_xor_f32                   (x: f32, lane_mask) -> f32 (full-warp butterfly shuffle)
    ballot                         (pred) -> uint32: bit i set where lane i's pred is nonzero (full warp)
    lowest_bit, highest_bit        (m: uint32, m != 0) -> int32: the index of m's lowest / highest set bit
    div_u32                        (a, b: uint32, b != 0) -> int32: a // b by div.u32, which ptxas expands inline
                                   (a 64-bit division is a call, and a call serializes every wgmma)
    warp_min, warp_max             (x: int32) -> int32: the least / greatest x over the warp's 32 lanes
                                   (redux.sync, sm_80+): its SASS (REDUX) writes a uniform register, so ptxas
                                   knows the result is the same in every lane, which a ballot's or a shuffle's
                                   result is not to it
    warp_sum                       (x: int32) -> int32: the sum of x over the warp's 32 lanes (redux.sync.add)
    ldg_cg_vec, ldg_cg_f32         (1-D array of 4-byte words, index) -> its 16 bytes there as 4 words; (f32 array,
                                   index) -> one f32: ld.global.cg (L2, never a stale L1 line), kept in order with
                                   the fences (volatile): what the last of a kernel's blocks reads of the others'
    cluster_sync()                 barrier.cluster.arrive.release + wait.acquire: every non-exited thread of the
                                   block's cluster has arrived, and their writes before it are visible to this
                                   thread after it (a launch in clusters: runtime._launcher's `cluster`); the
                                   simulator runs one block at a time, so it has none (it raises)
    mapa_shared                    (shared byte address, rank) -> uint32: the same address in block `rank` of the
                                   cluster (mapa.shared::cluster), for ld_cluster_v4_u32 / ld_cluster_f32 (its 16
                                   bytes as 4 words; its f32): a cluster's blocks reading each other's shared memory;
                                   and for st_async_* (the address and the mbarrier pushed to)
    cluster_arrive_relaxed(), cluster_wait()
                                   cluster_sync's two halves apart: barrier.cluster.arrive.relaxed at a kernel's
                                   start (after fence_mbar_init_cluster: a peer may then arrive on this block's
                                   mbarriers) and barrier.cluster.wait.acquire before the first remote write
                                   (emit_fa3_ws.cluster_push: no thread waits at the start)
    fence_mbar_init_cluster()      fence.mbarrier_init.release.cluster: this thread's mbar_inits are visible to the
                                   cluster's other blocks through its next cluster barrier arrival
    st_async_v4_u32, st_async_f32  (shared::cluster address, four words / one f32, shared::cluster mbarrier): one
                                   st.async into a block of the cluster's shared memory whose bytes complete on that
                                   block's mbarrier (complete_tx, release at cluster scope): a one-way push
    mbar_wait_cluster(addr, parity)
                                   mbar_wait with acquire at cluster scope: what other blocks' st.async wrote and
                                   counted on this block's mbarrier is visible after it
    fence_proxy_async_smem()       fence.proxy.async.shared::cta: this thread's shared-memory writes before it (its
                                   mbar_inits) are visible to the async proxy, whose TMA copies complete on them
    fence_acq_rel_gpu()            fence.acq_rel.gpu: this thread's writes before it are visible to the GPU before
                                   its later ones (an atomic count); after a count, the writes it counted are visible
    ldg_vec, stg_vec               (array, index; a tuple past 1-D) -> the 16 bytes at arr[index] as a tuple of arr's
                                   elements (4 f32, 8 16-bit words), one vector load the compiler schedules as any load; (arr,
                                   index, tuple of arr's elements of 8 or 16 bytes): one vector store. Both aligned to
                                   their size (the caller's check)
    red_add_v4_f32                 (f32 array, index, a, b, c, d): arr[index:index+4] += (a, b, c, d), one
                                   vector reduction (sm_90; index a multiple of 4)
    sts_v4_f32                     (shared byte address, a, b, c, d): four f32 to 16 aligned bytes of shared memory,
                                   one st.shared.v4.f32
    mma_acc_f16, mma_acc_bf16      (f32 array x, i, a0..a3, b0, b1): x[i:i+4] += A B, one mma on four elements of a
                                   per-thread accumulator array (mma_set_*: x[i:i+4] = A B, from zero)
    lget, lset                     (array x, i) -> x[i]; (x, i, v): x[i] = v, without wraparound or bounds code
                                   (per-thread arrays indexed by constants: cheap to compile, see below)
    f16_to_f32, bf16_to_f32        (bits: int16/uint16) -> f32
    f32_to_f16, f32_to_bf16        (x: f32) -> int16 bits
    device_function                decorator for inlined device functions in generated sources
    launch_bounds                  (max_threads, min_blocks) decorator under `@kernel_jit`: ptxas keeps registers
                                   low enough for min_blocks blocks per SM (ignored by the simulator)
    SIMULATOR                      True when the emulations are in use
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading

import numpy as np

from .tanh_polys import TANH_SMALL_POLY, TANH_SMALL_Y, TANH_TINY_POLY, TANH_TINY_Y  # noqa: F401 (ranges re-exported)

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"

__all__ = [
    "SIMULATOR",
    "device_function",
    "kernel_jit",
    "lean_compiles",
    "launch_bounds",
    "mma_f16",
    "mma_bf16",
    "ldmatrix_x4",
    "ldmatrix_x4_trans",
    "cp_async16",
    "cp_async16_s",
    "prefetch_l2",
    "ld_pair",
    "pairs_aligned",
    "rows_aligned16",
    "lds_v2_f32",
    "sts_u32",
    "sts_v4_f32",
    "stsm_x4",
    "lds_v4_u32",
    "stg_v4_u32",
    "ldg_vec",
    "stg_vec",
    "ldg_cg_vec",
    "ldg_cg_f32",
    "fence_acq_rel_gpu",
    "fence_proxy_async_smem",
    "cluster_sync",
    "mapa_shared",
    "ld_cluster_v4_u32",
    "ld_cluster_f32",
    "cluster_arrive_relaxed",
    "cluster_wait",
    "fence_mbar_init_cluster",
    "st_async_v4_u32",
    "st_async_f32",
    "mbar_wait_cluster",
    "elem_addr",
    "cp_async16_a",
    "ldg_f32_a",
    "smem_base",
    "ldsm_x4",
    "ldsm_x4_trans",
    "cp_async_commit",
    "griddep_wait",
    "griddep_launch_dependents",
    "cp_async_wait0",
    "cp_async_wait1",
    "pack_f16x2",
    "pack_bf16x2",
    "ex2",
    "ex2_poly",
    "tanh_approx_f32",
    "tanh_ex2_f32",
    "tanh_small_f32",
    "tanh_tiny_f32",
    "shfl_xor_f32",
    "ballot",
    "lowest_bit",
    "highest_bit",
    "div_u32",
    "warp_min",
    "warp_max",
    "warp_sum",
    "global_timer",
    "clock64",
    "sm_id",
    "red_add_v4_f32",
    "mma_acc_f16",
    "mma_set_f16",
    "mma_acc_bf16",
    "mma_set_bf16",
    "lget",
    "lset",
    "f16_to_f32",
    "bf16_to_f32",
    "f32_to_f16",
    "f32_to_bf16",
    "sin_f32",
    "cos_f32",
    "tan_f32",
    "rint_f32",
    "floor_f32",
    "ceil_f32",
    "floor_f64",
    "ceil_f64",
    "exp_f32",
    "exp2_f32",
    "log_f32",
    "log2_f32",
    "sqrt_f32",
    "log1p_f32",
    "expm1_f32",
    "tanh_f32",
    "erf_f32",
    "pow_f32",
]


# --------------------------------------------------------------------------------------------------
# Bit helpers shared by the emulations (numpy, exact IEEE rounding)
# --------------------------------------------------------------------------------------------------


def _f32_to_f16_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float32).astype(np.float16).view(np.uint16)[0])


def _f32_to_bf16_bits(x: float) -> int:
    u = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x007FFFFF):  # NaN stays NaN
        return ((u >> 16) | 0x40) & 0xFFFF
    rounding = 0x7FFF + ((u >> 16) & 1)  # round to nearest even
    return ((u + rounding) >> 16) & 0xFFFF


def _f16_bits_to_float(bits: int) -> float:
    return float(np.array([int(bits) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def _bf16_bits_to_float(bits: int) -> float:
    return float(np.array([(int(bits) & 0xFFFF) << 16], dtype=np.uint32).view(np.float32)[0])


def frag_halves(frags, kind: str) -> np.ndarray:
    """The 16-bit halves of a warp's 32-bit fragment words as float64: frags[lane] is a lane's words (any ints),
    the result [32, 2 * words] holds each word's low half then its high half."""
    words = (np.array(frags, dtype=np.int64) & 0xFFFFFFFF).astype(np.uint32)
    halves = words.view(np.uint16)  # little-endian: the low half first
    if kind == "f16":
        return halves.view(np.float16).astype(np.float64)
    return (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


_LANE_G = np.arange(32) >> 2  # a lane's group (row within 8) and thread-in-group (column pair within 8)
_LANE_T = np.arange(32) & 3


def frag_a_tile(h: np.ndarray) -> np.ndarray:
    """The 16 x 16 A operand of m16n8k16 (and of wgmma's register A, a warp's 16 rows) from frag_halves of the
    lanes' a0..a3: word w holds rows g + 8 (w & 1), columns 2 t + 8 (w >> 1) and the next."""
    A = np.zeros((16, 16), dtype=np.float64)
    for w in range(4):
        r, c = _LANE_G + 8 * (w & 1), 2 * _LANE_T + 8 * (w >> 1)
        A[r, c] = h[:, 2 * w]
        A[r, c + 1] = h[:, 2 * w + 1]
    return A


def frag_b_tile(h: np.ndarray, first: int) -> np.ndarray:
    """The 16 x 8 B operand of m16n8k16 from frag_halves, the lanes' b0 and b1 at words first and first + 1:
    word j holds rows 2 t + 8 j and the next, column g."""
    B = np.zeros((16, 8), dtype=np.float64)
    for j in range(2):
        r = 2 * _LANE_T + 8 * j
        B[r, _LANE_G] = h[:, 2 * (first + j)]
        B[r + 1, _LANE_G] = h[:, 2 * (first + j) + 1]
    return B


def launch_bounds(max_threads: int, min_blocks: int):
    """Mark a generated kernel with CUDA launch bounds; `kernel_jit` (below it in the source, so applied after)
    passes them to Numba. min_blocks = 2 caps registers at 65536 / (2 * max_threads): the wgmma forward at
    D = 64 under a mask used 139 registers, one block per SM, where 2 fit in shared memory."""

    def mark(fn):
        fn.__falower_launch_bounds__ = (int(max_threads), int(min_blocks))
        return fn

    return mark


def max_registers(n: int):
    """Cap a generated kernel's registers a thread at n (ptxas -maxrregcount, given to the linker by `kernel_jit`;
    ignored by the simulator). The cap must leave the block launchable: the SM allocates registers to warps in
    groups of 4, so a 288-thread block (9 warps) is sized like 384 threads and takes at most 168 a thread -- which
    is why ptxas sizes a `.maxntid 288` kernel at 168; 288 x 224 failed every launch on the H100 with
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (emit_fa3_ws.MAX_REGS_WARP, emit_fa3_ws.registers_fit)."""

    def mark(fn):
        fn.__falower_max_registers__ = int(n)
        return fn

    return mark


# ex2_poly: 2**x without MUFU (the SFU does 16 results a clock an SM, the FMA pipe 128): x = j + f by the
# round-to-nearest shift 1.5 * 2**23 (t's low mantissa bits are then j in two's complement, so t << 23 is j in the
# exponent field), 2**f = 1 + f (c1 + f (c2 + f c3)) on |f| <= 1/2 with c0 exactly 1 (x = -127, where -inf is
# clamped, gives p = 1 and exponent 127 - 127 = 0: exactly 0), then j added to p's exponent. The cubic was fitted
# for relative error (Lawson's minimax iteration): 1.0e-4 at most, under f16's half ulp (2.4e-4), which P is
# rounded to before P V. 9 instructions: 7 on the FMA pipe, 2 integer.
EX2_SHIFT = 12582912.0  # 1.5 * 2**23
EX2_POLY = (0.6932829022407532, 0.24221037328243256, 0.05500858277082443)  # c1, c2, c3


def _f32_hex(v: float) -> str:
    return "0f%08X" % int(np.array([v], dtype=np.float32).view(np.uint32)[0])


EX2_POLY_PTX = ("{ .reg .f32 x, t, r, f, p; .reg .b32 i, b; "
                f"max.f32 x, $1, {_f32_hex(-127.0)}; add.rn.f32 t, x, {_f32_hex(EX2_SHIFT)}; "
                f"sub.rn.f32 r, t, {_f32_hex(EX2_SHIFT)}; sub.rn.f32 f, x, r; "
                f"fma.rn.f32 p, f, {_f32_hex(EX2_POLY[2])}, {_f32_hex(EX2_POLY[1])}; "
                f"fma.rn.f32 p, p, f, {_f32_hex(EX2_POLY[0])}; fma.rn.f32 p, p, f, {_f32_hex(1.0)}; "
                "mov.b32 i, t; shl.b32 i, i, 23; mov.b32 b, p; add.s32 b, b, i; mov.b32 $0, b; }")


def ex2_poly_f32(x) -> np.float32:
    """EX2_POLY_PTX's steps in numpy float32, each rounded as the PTX rounds it (an FMA rounds once): the
    simulator's ex2_poly, and what the tests hold the PTX's constants to."""
    xf = np.float32(max(np.float32(x), np.float32(-127.0)))  # PTX max.f32: a NaN operand gives the other
    t = np.float32(xf + np.float32(EX2_SHIFT))
    f = np.float32(xf - np.float32(t - np.float32(EX2_SHIFT)))
    p = np.float32(EX2_POLY[2])
    for c in (EX2_POLY[1], EX2_POLY[0], 1.0):
        p = np.float32(np.float64(p) * np.float64(f) + np.float64(np.float32(c)))
    bits = (int(np.float32(p).view(np.uint32)) + (int(t.view(np.int32)) << 23)) & 0xFFFFFFFF
    return np.uint32(bits).view(np.float32)


# tanh_ex2: the IR's tanh in the tensor-core kernels, where a score's error that matters is absolute (P = 2**(x c
# - m) moves by c ln 2 times it, relatively). libdevice's tanhf (2 ulp) is ~16 instructions and two MUFU operations
# an element beside a polynomial for small |x|; this is 1 - 2 / (1 + e), e = 2**y with y = 2 log2(e) x folded into
# the argument's multiply by from_ir (from_ir.TWO_LOG2E): ex2, add, rcp, fma, the same two MUFU operations and two
# FMA-pipe ones. Its absolute error is ~2**-22 everywhere (ex2.approx's and rcp.approx's relative errors through
# 2 r (1 - r) and 2 r), its relative error therefore large for |x| << 1, where 1 - 2 r cancels: a score takes it as
# c tanh(s / c), whose error is absolute. Saturates to +-1 (e = inf: r = 0; e = 0: r = 1) and keeps NaN.
TANH_EX2_PTX = ("{ .reg .f32 e, d, r; ex2.approx.ftz.f32 e, $1; "
                f"add.rn.f32 d, e, {_f32_hex(1.0)}; rcp.approx.ftz.f32 r, d; "
                f"fma.rn.f32 $0, r, {_f32_hex(-2.0)}, {_f32_hex(1.0)}; }}")


def tanh_ex2_steps(y) -> np.float32:
    """TANH_EX2_PTX's steps in numpy float32 (ex2 and rcp rounded once, as if exact): the simulator's tanh_ex2_f32,
    and what the tests hold the PTX's constants to."""
    with np.errstate(over="ignore", under="ignore", divide="ignore"):
        e = np.float32(np.exp2(np.float32(y)))
        d = np.float32(e + np.float32(1.0))
        r = np.float32(np.float32(1.0) / d)
    return np.float32(np.float64(r) * -2.0 + 1.0)


def _odd_poly_ptx(coeffs: tuple) -> str:
    """y R(y^2) with R's coefficients lowest first: one multiply for u = y^2, len - 1 FMAs (Horner), one by y."""
    return ("{ .reg .f32 u, p; mul.rn.f32 u, $1, $1; "
            f"fma.rn.f32 p, u, {_f32_hex(coeffs[-1])}, {_f32_hex(coeffs[-2])}; "
            + "".join(f"fma.rn.f32 p, p, u, {_f32_hex(c)}; " for c in coeffs[-3::-1])
            + "mul.rn.f32 $0, $1, p; }")


def _odd_poly_steps(y, coeffs: tuple) -> np.float32:
    """_odd_poly_ptx's steps in numpy float32, each rounded as the PTX rounds it."""
    y = np.float32(y)
    u = np.float32(y * y)
    p = np.float32(coeffs[-1])
    for c in coeffs[-2::-1]:
        p = np.float32(np.float64(p) * np.float64(u) + np.float64(np.float32(c)))
    return np.float32(y * p)


# tanh_small: tanh(y / (2 log2 e)) for |y| <= TANH_SMALL_Y (|tanh's argument| <= 1) as y R(y^2), R of degree 6 fitted
# for absolute error (Lawson's minimax iteration, coefficients rounded to f32): 1.46e-7 (2**-22.7) at most with every
# step rounded as the PTX rounds it, under tanh_ex2's 2**-22.4. One multiply for u = y^2, six FMAs, one multiply by y:
# 8 FMA-pipe instructions where tanh_ex2 takes two MUFU operations, which bound the softcap (three an element with
# softmax's ex2, against plain's one). The kernels check that a tile's scores are in range (a max of |s| and a
# ballot) and take tanh_ex2 otherwise (emit_fa2.small_scores).
TANH_SMALL_PTX = _odd_poly_ptx(TANH_SMALL_POLY)  # TANH_SMALL_Y, _POLY: tanh_polys.py

# tanh_tiny: the same for |y| <= TANH_TINY_Y (|tanh's argument| <= 1/4) with R of degree 2 (Lawson, f32
# coefficients, the first pinned to 1 / (2 log2 e) so that tiny |y| stay relatively exact): 9.9e-8 (2**-23.26) at most
# through the f32 steps, under tanh_small's error, in 4 instructions where
# tanh_small takes 8. Why: the softcap on its polynomial path was bound by issue slots (NOTES "The softcap's tanh on
# the FMA pipe"), ~14.5 instructions an element, of which the tanh was 9; scores with |s scale| <= c / 4 (c the
# cap) take this one (emit_fa2.tiny_scores).
TANH_TINY_PTX = _odd_poly_ptx(TANH_TINY_POLY)  # TANH_TINY_Y, _POLY: tanh_polys.py


def tanh_small_steps(y) -> np.float32:
    """TANH_SMALL_PTX's steps in numpy float32, each rounded as the PTX rounds it: the simulator's tanh_small_f32."""
    return _odd_poly_steps(y, TANH_SMALL_POLY)


def tanh_tiny_steps(y) -> np.float32:
    """TANH_TINY_PTX's steps in numpy float32: the simulator's tanh_tiny_f32."""
    return _odd_poly_steps(y, TANH_TINY_POLY)


if SIMULATOR:
    from numba import cuda
    from falower.backends.numba_cuda.sim_threads import HandOverBarrier, install_block_manager

    # ----------------------------------------------------------------------------------------------
    # Emulations. Each simulated CUDA thread is a Python thread (numba's BlockThread) that knows its
    # threadIdx and its block manager; a warp is 32 consecutive linear thread ids.
    # ----------------------------------------------------------------------------------------------

    import weakref

    # the static shared arrays the guarded allocator made (by id): `smem_base` gives each a window of fake shared
    # byte addresses from STATIC_WINDOW on, which the emulated shared loads read (`_shared_words`)
    _static_arrays: "weakref.WeakValueDictionary[int, np.ndarray]" = weakref.WeakValueDictionary()
    STATIC_WINDOW = 1 << 24

    def _guard_shared_allocation() -> None:
        """Make the simulator's static shared arrays one per call site and launch, as on the GPU.

        numba-cuda's simulator (0.30) creates a `cuda.shared.array` when the first thread reaches it, by a
        check-then-insert on a dict with no lock: two threads switched between the check and the insert
        get two different arrays, so a block's threads stop sharing memory and read whatever the other
        array holds (uninitialised numpy memory: garbage or NaN). It struck CI's simulator backward tests
        about once a run under load; tests/backend/test_simulator_shared_arrays.py reproduces it. The same
        key (the caller's file and line), under a lock; the caller's frame read directly, not through
        `traceback.extract_stack` (which also formats every frame's source line, per thread and array)."""
        import sys

        from numba.core import types
        from numba.cuda.simulator import kernelapi
        from numba.np import numpy_support

        shared = kernelapi.FakeCUDAShared
        if getattr(shared.array, "_falower_guarded", False):
            return
        unguarded = shared.array
        lock = threading.Lock()

        def array(self, shape, dtype, alignment=None):
            if shape == 0:  # the dynamic area: no per-site state
                return unguarded(self, shape, dtype, alignment)
            # (an alignment the simulator refuses: numpy's allocations are at least 16-byte aligned, and
            # `smem_base` windows of static arrays start at multiples of 2**24)
            if isinstance(dtype, types.Type):
                dtype = numpy_support.as_dtype(dtype)
            caller = sys._getframe(1)
            key = (caller.f_code.co_filename, caller.f_lineno)
            with lock:
                res = self._allocations.get(key)
                if res is None:
                    res = self._allocations[key] = np.empty(shape, dtype)
                    _static_arrays[id(res)] = res
            return res

        array._falower_guarded = True
        shared.array = array

    _guard_shared_allocation()
    install_block_manager()

    _warp_lock = threading.Lock()

    # Seconds that warp 1 of each warpgroup (every fourth warp) sleeps before each emulated shared-memory read of
    # ldmatrix, lds_v2_f32 / lds_v4_u32 and wgmma's operands (0: none). The emulated threads run close to lockstep;
    # on the GPU a warp runs ahead of the others, and a kernel that rewrites shared memory another warp still reads
    # gives wrong numbers here too with it (README, "Debugging"). Plain `smem[i]` reads are Numba's: not slowed.
    SLOW_WARP = float(os.environ.get("FALOWER_SIM_SLOW_WARP", "0"))

    def slow_warp() -> None:
        if SLOW_WARP and (threading.current_thread().thread_id // 32) % 4 == 1:
            import time

            time.sleep(SLOW_WARP)

    class _Warp:
        """Scratch for one warp: two alternating slots of 32 entries and a 32-party barrier.

        Alternating slots make one barrier per exchange enough: a lane can write slot s^1 for the next
        exchange while a slow lane still reads slot s, and it cannot pass the next barrier before the
        slow lane has finished reading.
        """

        def __init__(self) -> None:
            self.barrier = HandOverBarrier(32)
            self.slots = [[None] * 32, [None] * 32]
            self.memo = None  # (exchange number, the warp's shared result): _exchange_once

    def _lane_and_warp():
        th = threading.current_thread()
        tid = th.thread_id
        mgr = th._manager
        key = (tuple(th.blockIdx), tid // 32)
        warps = getattr(mgr, "_falower_warps", None)
        if warps is None:
            with _warp_lock:
                warps = getattr(mgr, "_falower_warps", None)
                if warps is None:
                    warps = {}
                    mgr._falower_warps = warps
        warp = warps.get(key)
        if warp is None:
            with _warp_lock:
                warp = warps.get(key)
                if warp is None:
                    warp = _Warp()
                    warps[key] = warp
        counter = getattr(th, "_falower_exchanges", 0)
        th._falower_exchanges = counter + 1
        return tid % 32, warp, counter & 1

    def _exchange(value):
        """Publish this lane's value; return the list of all 32 lanes' values."""
        lane, warp, slot = _lane_and_warp()
        warp.slots[slot][lane] = value
        warp.barrier.wait()
        return lane, warp.slots[slot]

    def _exchange_once(value, compute):
        """Publish this lane's value; return (lane, compute(all 32 lanes' values)), computed by the first lane past
        the barrier and shared with the warp's other lanes (a warp's product, not 32 of them). Keyed by the
        exchange's number: a lane of the next exchange cannot pass its barrier before every lane read this one."""
        lane, warp, slot = _lane_and_warp()
        number = threading.current_thread()._falower_exchanges
        warp.slots[slot][lane] = value
        warp.barrier.wait()
        memo = warp.memo
        if memo is None or memo[0] != number:
            memo = (number, compute(warp.slots[slot]))
            warp.memo = memo
        return lane, memo[1]

    def device_function(fn):
        return cuda.jit(device=True)(fn)

    kernel_jit = cuda.jit  # the simulator takes no options

    def lean_compiles():
        """No Numba pipeline to swap under the simulator."""
        return contextlib.nullcontext()

    def _mma(kind, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        def product(frags):
            h = frag_halves(frags, kind)
            return (frag_a_tile(h) @ frag_b_tile(h, 4)).astype(np.float32)  # each entry one f64 sum, rounded

        lane, P = _exchange_once((a0, a1, a2, a3, b0, b1), product)
        g, t = lane >> 2, lane & 3
        f = np.float32
        return (f(P[g, 2 * t] + f(c0)), f(P[g, 2 * t + 1] + f(c1)), f(P[g + 8, 2 * t] + f(c2)),
                f(P[g + 8, 2 * t + 1] + f(c3)))

    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma("f16", a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma("bf16", a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    def _mma_into(kind, init, x, i, a0, a1, a2, a3, b0, b1):
        i = int(i)
        c = (np.float32(0),) * 4 if init else (x[i], x[i + 1], x[i + 2], x[i + 3])
        x[i], x[i + 1], x[i + 2], x[i + 3] = _mma(kind, a0, a1, a2, a3, b0, b1, *c)

    def mma_acc_f16(x, i, a0, a1, a2, a3, b0, b1):
        _mma_into("f16", False, x, i, a0, a1, a2, a3, b0, b1)

    def mma_set_f16(x, i, a0, a1, a2, a3, b0, b1):
        _mma_into("f16", True, x, i, a0, a1, a2, a3, b0, b1)

    def mma_acc_bf16(x, i, a0, a1, a2, a3, b0, b1):
        _mma_into("bf16", False, x, i, a0, a1, a2, a3, b0, b1)

    def mma_set_bf16(x, i, a0, a1, a2, a3, b0, b1):
        _mma_into("bf16", True, x, i, a0, a1, a2, a3, b0, b1)

    def lget(x, i):
        return x[int(i)]

    def lset(x, i, v):
        x[int(i)] = v

    def _ldmatrix(smem, index, trans):
        slow_warp()
        lane, addrs = _exchange(int(index))
        g, t = lane >> 2, lane & 3
        out = []
        for i in range(4):
            if trans:
                lo = int(smem[addrs[8 * i + 2 * t] + g]) & 0xFFFF
                hi = int(smem[addrs[8 * i + 2 * t + 1] + g]) & 0xFFFF
            else:
                base = addrs[8 * i + g]
                lo = int(smem[base + 2 * t]) & 0xFFFF
                hi = int(smem[base + 2 * t + 1]) & 0xFFFF
            out.append(np.uint32(lo | (hi << 16)))
        return tuple(out)

    def ldmatrix_x4(smem, index):
        return _ldmatrix(smem, index, False)

    # 32-bit shared addressing: the block's dynamic shared array is remembered by smem_base, and a
    # "shared address" is a byte offset into it.
    def _block_smem(array=None):
        th = threading.current_thread()
        mgr = th._manager
        key = ("smem", tuple(th.blockIdx))
        if array is None:  # a read of what the block registered: no lock (a block's threads all read it)
            return mgr._falower_smem[key]
        with _warp_lock:
            store = getattr(mgr, "_falower_smem", None)
            if store is None:
                store = {}
                mgr._falower_smem = store
            if array is not None:
                store[key] = array
            return store[key]

    def smem_base(smem):
        th = threading.current_thread()
        key = ("smem", tuple(th.blockIdx))
        with _warp_lock:
            main = getattr(th._manager, "_falower_smem", {}).get(key)
            same = main is not None and main.__array_interface__["data"][0] == smem.__array_interface__["data"][0]
        if id(smem) not in _static_arrays or main is None or same:  # the block's main area (dynamic, or the
            _block_smem(smem)  # first array it asks for): addresses from 0
            return 0
        with _warp_lock:  # another static array: a window of its own of fake shared addresses, per block
            store = th._manager.__dict__.setdefault("_falower_static", {})
            arrays = store.setdefault(tuple(th.blockIdx), [])
            if not any(a is smem for a in arrays):
                arrays.append(smem)
            return STATIC_WINDOW * (1 + next(i for i, a in enumerate(arrays) if a is smem))

    def _shared_words(saddr: int, dtype) -> tuple[np.ndarray, int]:
        """The shared array a byte address of `smem_base`'s lies in, viewed as `dtype`, and the address's element
        in it: the dynamic area below STATIC_WINDOW, a static array's window above."""
        at = int(saddr)
        if at < STATIC_WINDOW:
            return _block_smem().view(dtype), at // np.dtype(dtype).itemsize
        th = threading.current_thread()
        arr = th._manager._falower_static[tuple(th.blockIdx)][at // STATIC_WINDOW - 1]
        return arr.view(dtype), (at % STATIC_WINDOW) // np.dtype(dtype).itemsize

    def ldsm_x4(addr):
        smem = _block_smem()
        return _ldmatrix(smem, int(addr) // smem.itemsize, False)

    def ldsm_x4_trans(addr):
        smem = _block_smem()
        return _ldmatrix(smem, int(addr) // smem.itemsize, True)

    def cp_async16_s(saddr, garr, g_index, src_bytes):
        smem = _block_smem()
        cp_async16(smem, int(saddr) // smem.itemsize, garr, g_index, src_bytes)

    def ldmatrix_x4_trans(smem, index):
        return _ldmatrix(smem, index, True)

    def cp_async16(smem, s_index, garr, g_index, src_bytes):
        # Synchronous copy: completion is immediate, so commit/wait are no-ops. 16 bytes of the
        # global array's element type, zero-filled when src_bytes == 0.
        n = 16 // garr.itemsize
        sview = smem.view(garr.dtype) if smem.dtype != garr.dtype else smem
        s0 = int(s_index) * smem.itemsize // garr.itemsize
        if int(src_bytes) >= 16:
            sview[s0 : s0 + n] = garr[int(g_index) : int(g_index) + n]
        else:
            sview[s0 : s0 + n] = 0

    def cp_async_commit():
        pass

    def griddep_wait():  # the simulator runs one launch at a time
        pass

    def griddep_launch_dependents():
        pass

    def prefetch_l2(garr, idx):
        """A hint, so nothing to emulate; but its element must exist: an out-of-range index raises here, where the
        GPU would quietly prefetch some other line."""
        np.ravel_multi_index(tuple(int(i) for i in idx), garr.shape)
        return np.int32(0)

    def ld_pair(garr, idx):
        last = tuple(idx[:-1]) + (idx[-1] + 1,)
        return garr[tuple(idx)], garr[last]

    def _rows_aligned(a, align):
        """The last axis contiguous, the other strides and the data address multiples of `align` bytes."""
        if a.ndim == 0 or a.strides[-1] != a.itemsize:
            return False
        return all(st % align == 0 for st in a.strides[:-1]) and a.__array_interface__["data"][0] % align == 0

    def rows_aligned16(garr):
        return _rows_aligned(np.asarray(garr), 16)

    _ADDRS: dict = {}  # simulated generic addresses: an array's data address -> the array

    def elem_addr(garr, idx):
        a = np.asarray(garr)
        base = a.__array_interface__["data"][0]
        with _warp_lock:
            _ADDRS[base] = a
        return np.uint64(base + sum(int(i) * st for i, st in zip(idx, a.strides)))

    def cp_async16_a(saddr, gaddr, src_bytes):
        gaddr = int(gaddr)
        with _warp_lock:
            base, a = next((b, x) for b, x in _ADDRS.items() if b <= gaddr < b + max(x.nbytes, 1))
        if not a.flags.c_contiguous:
            raise NotImplementedError("cp_async16_a emulation: contiguous arrays only")
        raw = a.reshape(-1).view(np.uint8)
        smem = _block_smem().view(np.uint8)
        at, off, n = int(saddr), gaddr - base, int(src_bytes)
        smem[at:at + 16] = 0
        smem[at:at + n] = raw[off:off + n]

    def ldg_f32_a(gaddr):
        """The f32 at a generic address inside an array elem_addr has seen (read where it lies: the simulator's
        addresses are the host arrays' own)."""
        gaddr = int(gaddr)
        with _warp_lock:
            inside = any(_spans(x, b, gaddr, 4) for b, x in _ADDRS.items())
        if not inside:
            raise RuntimeError(f"ldg_f32_a: {gaddr:#x} is not inside an array elem_addr was given")
        return np.float32(ctypes.c_float.from_address(gaddr).value)

    def _spans(a, base: int, at: int, n: int) -> bool:
        """Whether bytes at .. at + n lie inside the elements of `a` (its data at `base`, any strides)."""
        lo = base + sum(min(0, (k - 1) * st) for k, st in zip(a.shape, a.strides))
        hi = base + sum(max(0, (k - 1) * st) for k, st in zip(a.shape, a.strides)) + a.itemsize
        return a.size > 0 and lo <= at and at + n <= hi

    def lds_v2_f32(saddr):
        slow_warp()
        if int(saddr) % 8:
            raise RuntimeError(f"lds_v2_f32: shared address {int(saddr):#x} is not 8-byte aligned")
        f, at = _shared_words(saddr, np.float32)
        return np.float32(f[at]), np.float32(f[at + 1])

    def sts_u32(saddr, val):
        _block_smem().view(np.uint32)[int(saddr) // 4] = np.uint32(val)

    def sts_v4_f32(saddr, a, b, c, d):
        at = int(saddr)
        if at % 16:
            raise ValueError(f"sts_v4_f32: a 16-byte aligned shared address, got {at:#x}")
        _block_smem().view(np.float32)[at // 4:at // 4 + 4] = np.array([a, b, c, d], np.float32)

    def stsm_x4(saddr, r0, r1, r2, r3):
        """The warp's four 8 x 8 matrices: each lane writes its own word of each to the row address its matrix's
        row lane gave (the lanes' addresses exchanged first)."""
        slow_warp()
        lane, addrs = _exchange(int(saddr))
        g, t = lane >> 2, lane & 3
        words = _block_smem().view(np.uint8)
        for m, r in enumerate((r0, r1, r2, r3)):
            at = int(addrs[8 * m + g]) + 4 * t
            words[at:at + 4] = np.frombuffer(np.uint32(r).tobytes(), np.uint8)

    def lds_v4_u32(saddr):
        slow_warp()
        u = _block_smem().view(np.uint32)
        at = int(saddr) // 4
        return tuple(np.uint32(u[at + i]) for i in range(4))

    def stg_v4_u32(arr, index, a, b, c, d):
        for i, x in enumerate((a, b, c, d)):
            arr[int(index) + i] = np.uint32(x)

    def _vec_at(a, index, nbytes):
        """The element index of a `nbytes` vector at a[index] (1-D), refused where the GPU's access would fault."""
        at = int(index)
        address = a.__array_interface__["data"][0] + at * a.itemsize
        if a.ndim != 1 or address % nbytes or at < 0 or at + nbytes // a.itemsize > a.size:
            raise ValueError(f"vector access of {nbytes} bytes at element {at} of a {a.size}-element {a.dtype} array: "
                             "out of range or misaligned")
        return at

    def ldg_vec(arr, index):
        a = np.asarray(arr)
        if isinstance(index, tuple):  # an N-d array's element: its row from there on must hold the 16 bytes
            idx = tuple(int(i) for i in index)
            n = 16 // a.itemsize
            if len(idx) != a.ndim or a.strides[-1] != a.itemsize:
                raise ValueError(f"ldg_vec: index {index} of a {a.ndim}-d array whose last axis is not contiguous")
            if any(not 0 <= i < k for i, k in zip(idx, a.shape)) or idx[-1] + n > a.shape[-1]:
                raise ValueError(f"ldg_vec: 16 bytes at {index} leave a row of a {a.shape} array")
            row = a[idx[:-1]]
            if row[idx[-1]:].__array_interface__["data"][0] % 16:
                raise ValueError(f"ldg_vec: 16 bytes at {index} are not 16-byte aligned")
            return tuple(a.dtype.type(x) for x in row[idx[-1]:idx[-1] + n])
        at = _vec_at(a, index, 16)
        return tuple(a.dtype.type(a[at + i]) for i in range(16 // a.itemsize))

    def ldg_cg_vec(arr, index):
        a = np.asarray(arr)
        if a.itemsize != 4:
            raise ValueError(f"ldg_cg_vec reads 4-byte words, got a {a.dtype} array")
        return ldg_vec(arr, index)

    def ldg_cg_f32(arr, index):
        return np.float32(np.asarray(arr)[int(index)])

    def fence_acq_rel_gpu():  # the simulator's threads share one memory
        pass

    def fence_proxy_async_smem():  # the simulator's TMA copies write through the same memory
        pass

    def _no_cluster(name):
        def refuse(*args):
            raise NotImplementedError(f"{name}: the simulator runs one block at a time and has no clusters; a kernel "
                                      "that merges in a cluster (emit_fa3_ws.cluster_merge) runs on a GPU only")

        refuse.__name__ = name
        return refuse

    mapa_shared = _no_cluster("mapa_shared")
    ld_cluster_v4_u32 = _no_cluster("ld_cluster_v4_u32")
    ld_cluster_f32 = _no_cluster("ld_cluster_f32")
    cluster_sync = _no_cluster("cluster_sync")
    cluster_arrive_relaxed = _no_cluster("cluster_arrive_relaxed")
    cluster_wait = _no_cluster("cluster_wait")
    fence_mbar_init_cluster = _no_cluster("fence_mbar_init_cluster")
    st_async_v4_u32 = _no_cluster("st_async_v4_u32")
    st_async_f32 = _no_cluster("st_async_f32")
    mbar_wait_cluster = _no_cluster("mbar_wait_cluster")

    def stg_vec(arr, index, vals):
        a = np.asarray(arr)
        at = _vec_at(a, index, len(vals) * a.itemsize)
        for i, x in enumerate(vals):
            a[at + i] = x

    def pairs_aligned(garr):
        a = np.asarray(garr)
        return a.ndim > 0 and a.itemsize == 4 and a.shape[-1] % 2 == 0 and _rows_aligned(a, 8)

    def cp_async_wait0():
        pass

    def cp_async_wait1():
        pass

    def pack_f16x2(lo, hi):
        return np.uint32(_f32_to_f16_bits(lo) | (_f32_to_f16_bits(hi) << 16))

    def pack_bf16x2(lo, hi):
        return np.uint32(_f32_to_bf16_bits(lo) | (_f32_to_bf16_bits(hi) << 16))

    def ex2(x):
        with np.errstate(over="ignore", under="ignore"):
            return np.float32(np.exp2(np.float32(x)))

    def ex2_poly(x):
        return ex2_poly_f32(x)

    def tanh_approx_f32(x):  # the simulator computes the definition, tanh, in f32
        return np.float32(np.tanh(np.float32(x)))

    def tanh_ex2_f32(y):
        return tanh_ex2_steps(y)

    def tanh_small_f32(y):
        return tanh_small_steps(y)

    def tanh_tiny_f32(y):
        return tanh_tiny_steps(y)

    def shfl_xor_f32(x, lane_mask):
        lane, vals = _exchange(np.float32(x))
        return vals[lane ^ int(lane_mask)]

    def ballot(pred):
        _, vals = _exchange(bool(pred))
        return np.uint32(sum(1 << i for i, p in enumerate(vals) if p))

    def lowest_bit(m):
        m = int(m) & 0xFFFFFFFF
        return np.int32((m & -m).bit_length() - 1)

    def highest_bit(m):
        return np.int32((int(m) & 0xFFFFFFFF).bit_length() - 1)

    def div_u32(a, b):
        return np.int32((int(a) & 0xFFFFFFFF) // (int(b) & 0xFFFFFFFF))

    def warp_min(x):
        _, vals = _exchange(int(x))
        return np.int32(min(vals))

    def warp_max(x):
        _, vals = _exchange(int(x))
        return np.int32(max(vals))

    def warp_sum(x):
        _, vals = _exchange(int(x))
        return np.int32(sum(vals))

    def global_timer():
        import time as _t

        return np.uint64(_t.perf_counter_ns())

    def sm_id():
        return np.uint32(0)

    def clock64():
        import time as _t

        return np.uint64(_t.perf_counter_ns())

    _red_lock = threading.Lock()

    def red_add_v4_f32(arr, index, a, b, c, d):
        at = _vec_at(np.asarray(arr), index, 16)  # refused where the GPU's access would fault (misaligned, past the end)
        with _red_lock:
            for i, x in enumerate((a, b, c, d)):
                arr[at + i] += np.float32(x)

    def f16_to_f32(bits):
        return np.float32(_f16_bits_to_float(bits))

    def bf16_to_f32(bits):
        return np.float32(_bf16_bits_to_float(bits))

    def f32_to_f16(x):
        return np.int16(np.uint16(_f32_to_f16_bits(x)).view(np.int16))

    def f32_to_bf16(x):
        return np.int16(np.uint16(_f32_to_bf16_bits(x)).view(np.int16))

    def _np_as(fn, t=np.float32):
        """A libdevice function in the simulator: numpy's in the dtype t, whose inf / NaN at a domain's edge (log(0),
        sqrt(-1), 2^2000) are the GPU's, where Python's math module raises (and Numba's math.sin computes in f64)."""
        def f(*x):
            with np.errstate(all="ignore"):
                return t(fn(*(t(a) for a in x)))
        return f

    sin_f32, cos_f32, tan_f32, rint_f32 = _np_as(np.sin), _np_as(np.cos), _np_as(np.tan), _np_as(np.rint)
    floor_f32, ceil_f32 = _np_as(np.floor), _np_as(np.ceil)
    floor_f64, ceil_f64 = _np_as(np.floor, np.float64), _np_as(np.ceil, np.float64)
    exp_f32, exp2_f32, log_f32, log2_f32 = _np_as(np.exp), _np_as(np.exp2), _np_as(np.log), _np_as(np.log2)
    sqrt_f32, log1p_f32, expm1_f32, tanh_f32 = _np_as(np.sqrt), _np_as(np.log1p), _np_as(np.expm1), _np_as(np.tanh)
    pow_f32 = _np_as(np.power)

    def erf_f32(x):
        return np.float32(math.erf(float(x))) if x == x else np.float32(x)

else:
    from llvmlite import ir
    from numba import cuda, types
    from numba.core import cgutils
    from numba.cuda.extending import intrinsic

    def device_function(fn):
        """Device functions of generated kernels: always inlined at the NVVM level."""
        return cuda.jit(device=True, forceinline=True)(fn)

    def _linear_singly_assigned_variables() -> None:
        """Replace numba-cuda's `Lower._find_singly_assigned_variable` with a linear-time equivalent.

        The original (numba-cuda 0.30) rescans the whole defining block for every variable defined in one block
        and used only there: quadratic in the block's length. Our kernels are long straight-line blocks of
        uniquely named temporaries (ssa_names.py), where that scan was 30% of a cold compile (12 of 24 s at
        D = 128; benchmarks/NOTES.md, "Compile time"). Same result: a variable is singly assigned when it is
        not an alloca variable, is defined in exactly one block, is not used outside it, and has exactly one
        assignment there. Only applied when the method is the one this was written against.
        """
        from collections import defaultdict

        try:
            from numba.cuda import lowering as _lowering
            from numba.cuda.core import ir as _ir
            from numba.cuda.core.analysis import compute_use_defs, must_use_alloca
        except ImportError:  # another numba-cuda layout: keep its own method
            return
        original = getattr(_lowering.Lower, "_find_singly_assigned_variable", None)
        if original is None or getattr(original, "__qualname__", "") != "Lower._find_singly_assigned_variable":
            return

        def _find_singly_assigned_variable(self):
            blocks = self.func_ir.blocks
            sav = set()
            if not self.func_ir.func_id.is_generator:
                use_defs = compute_use_defs(blocks)
                alloca_vars = must_use_alloca(blocks)
                def_blocks = defaultdict(set)
                for blk, vl in use_defs.defmap.items():
                    for var in vl:
                        def_blocks[var].add(blk)
                used_in = set()
                for vl in use_defs.usemap.values():
                    used_in.update(vl)
                assigns = defaultdict(int)  # (block, name) -> assignments, one pass over every block
                for label, block in self.blocks.items():
                    for stmt in block.find_insts(_ir.assign_types):
                        assigns[label, stmt.target.name] += 1
                for var, blks in def_blocks.items():
                    if var not in alloca_vars and len(blks) == 1 and var not in used_in:
                        (defblk,) = blks
                        if assigns[defblk, var] == 1:
                            sav.add(var)
            self._singly_assigned_vars = sav
            self._blk_local_varmap = {}

        _lowering.Lower._find_singly_assigned_variable = _find_singly_assigned_variable
        _lowering.Lower._find_singly_assigned_variable_original = original

    _linear_singly_assigned_variables()

    def _memoized_builtin_call_types() -> None:
        """Remember the signature Numba's CUDA typing context found for a builtin operator on given argument types.

        `Function.get_call_type` (numba 0.68) tries every template registered for the operator, in order, on
        every call: `a + b` on two integers walks past the overloads for arrays, tuples, strings, sets, ... (each
        failing one hashes the compile flags), 0.3-0.5 ms each; our kernels' address arithmetic has thousands
        of them, typed in each round of type inference and once more when lowered (benchmarks/NOTES.md,
        "Compile time", lever 10). The answer depends only on the function type (its templates are in its key:
        a newly registered overload makes a new one) and the argument types, so it is remembered per typing
        context, and only where it cannot depend on the compilation's flags: the winning template's
        implementation key is the operator itself (a plain `ConcreteTemplate`/`AbstractTemplate` such as the
        integer, float and array-index rules), never an `@overload` compiled per flags. The side effect of a
        first resolution (`_impl_keys[args]`, read by lowering) is replayed on every hit. Only applied when the
        method is the one this was written against."""
        try:
            from numba.core.types import functions as _functions
            from numba.cuda.target import CUDATypingContext
        except ImportError:
            return
        original = _functions.BaseFunction.get_call_type
        if getattr(original, "__qualname__", "") != "BaseFunction.get_call_type":
            return
        import builtins

        plain = (types.Number, types.Boolean, types.Array, types.NoneType)

        def get_call_type(self, context, args, kws):
            if kws or not isinstance(context, CUDATypingContext) or not isinstance(self, _functions.Function):
                return original(self, context, args, kws)
            fn = self.typing_key
            if not (getattr(fn, "__module__", None) in ("_operator", "operator") or fn in _BUILTINS) \
                    or not all(isinstance(a, plain) for a in args):
                return original(self, context, args, kws)
            cache = context.__dict__.setdefault("_falower_call_types", {})
            key = (self, args)
            hit = cache.get(key)
            if hit is not None:
                sig, impl = hit
                self._impl_keys[sig.args] = impl
                return sig
            sig = original(self, context, args, kws)
            if sig is not None:
                impl = self._impl_keys.get(sig.args)
                if impl is fn:
                    cache[key] = (sig, impl)
            return sig

        _BUILTINS = {builtins.max, builtins.min, builtins.abs, builtins.bool, builtins.int, builtins.float}
        get_call_type.__qualname__ = "BaseFunction.get_call_type"  # the original's name: applied once
        get_call_type.__wrapped__ = original
        _functions.BaseFunction.get_call_type = get_call_type

    _memoized_builtin_call_types()

    def _refresh_only_when_registries_grew() -> None:
        """Skip a Numba context `refresh()` when no registry it loads from has a registration it has not seen.

        numba-cuda refreshes the target context (and with it the typing context) after every failed
        implementation look-up, and there is one such failure by design per array access lowered
        (`make_array` asks for an `__array__` implementation first) and per overload template typed: each refresh
        re-imports and walks ~40 registries, ~0.5-1 ms, 10-15% of a cold compile of our kernels
        (benchmarks/NOTES.md, "Compile time", lever 11). A refresh only ever installs registrations appended to
        those registries since the last one, so when the total count of every registry's registration lists
        (of this context and, for a target context, its typing context) is what it was after the last refresh,
        there is nothing to install and the call returns. Only applied where the layout is the one this was
        written against."""
        try:
            from numba.cuda.core import base as _base
            from numba.cuda.typing import context as _typing
        except ImportError:
            return
        target_refresh, typing_refresh = _base.BaseContext.refresh, _typing.BaseContext.refresh
        if getattr(target_refresh, "__qualname__", "") != "BaseContext.refresh" or \
                getattr(typing_refresh, "__qualname__", "") != "BaseContext.refresh":
            return

        def count(ctx) -> int:
            n = 0
            for registry, loader in ctx._registries.items():
                for name in loader.registry_items:
                    n += len(getattr(registry, name))
            return n

        def wrap(original, counts):
            def refresh(self):
                try:
                    before = counts(self)
                except AttributeError:  # not the layout this was written for
                    return original(self)
                if before and self.__dict__.get("_falower_refreshed_at") == before:
                    return None
                original(self)
                self._falower_refreshed_at = counts(self)
                return None

            refresh.__qualname__ = "BaseContext.refresh"
            refresh.__wrapped__ = original
            return refresh

        _typing.BaseContext.refresh = wrap(typing_refresh, lambda ctx: (count(ctx),))
        _base.BaseContext.refresh = wrap(target_refresh, lambda ctx: (count(ctx), count(ctx.typing_context)))

    _refresh_only_when_registries_grew()

    def _lean_pipeline():
        """numba-cuda's CUDACompiler with its closure-inlining pass run only where there is something to inline.

        InlineClosureLikes inlines calls of locally defined closures (`make_function`), `functools.reduce` and
        list-building loops, and costs a walk with definition look-ups per call plus two liveness analyses of
        the whole function: 8-19 s of a cold compile of our long kernels (benchmarks/NOTES.md, "Compile
        time", lever 7). Generated kernels and their helpers contain none of those constructs; this pass
        checks that (one scan) and runs the original pass wherever one occurs. Only for our kernels and
        device functions (`lean_compiles`); None where numba-cuda's layout differs."""
        try:
            from numba.cuda.compiler import CUDACompiler
            from numba.cuda.core import ir as _ir
            from numba.cuda.core.compiler_machinery import FunctionPass, register_pass
            from numba.cuda.core.untyped_passes import InlineClosureLikes
        except ImportError:
            return None

        def needs_inlining(func_ir) -> bool:
            for block in func_ir.blocks.values():
                for inst in block.body:
                    if not isinstance(inst, _ir.assign_types):
                        continue
                    v = inst.value
                    if isinstance(v, _ir.expr_types) and v.op in ("make_function", "build_list"):
                        return True
                    if isinstance(v, _ir.global_types + _ir.freevar_types) and getattr(v.value, "__name__", "") == "reduce":
                        return True
            return False

        @register_pass(mutates_CFG=True, analysis_only=False)
        class InlineClosureLikesWhereAny(FunctionPass):
            _name = "inline_closure_likes_where_any"

            def __init__(self):
                FunctionPass.__init__(self)

            def run_pass(self, state):
                if needs_inlining(state.func_ir):
                    return InlineClosureLikes().run_pass(state)
                return False

        class LeanCUDACompiler(CUDACompiler):
            def define_pipelines(self):
                pms = super().define_pipelines()
                for pm in pms:
                    pm.passes = [(InlineClosureLikesWhereAny, d) if p is InlineClosureLikes else (p, d)
                                 for p, d in pm.passes]
                    pm._finalized = False
                    pm.finalize()
                return pms

        return LeanCUDACompiler

    _LEAN_PIPELINE = _lean_pipeline()

    @contextlib.contextmanager
    def lean_compiles():
        """Compile under the lean pipeline: numba-cuda's compile_cuda (which kernels and device functions both go
        through) names its pipeline by the module global `CUDACompiler`, not by a dispatcher's
        `_compiler.pipeline_class` (which falower used to set, reaching nothing: only benchmarks/compile_time.py,
        which swapped the global, had the lean pipeline); here it is swapped for one compile, under Numba's compiler
        lock (no other compile sees it). FALOWER_NUMBA_PIPELINE=default keeps numba-cuda's own."""
        import numba.cuda.compiler as _cuda_compiler
        from numba.cuda.core.compiler_lock import global_compiler_lock

        if _LEAN_PIPELINE is None or os.environ.get("FALOWER_NUMBA_PIPELINE", "lean") != "lean" or \
                not isinstance(getattr(_cuda_compiler, "CUDACompiler", None), type):
            yield
            return
        with global_compiler_lock:
            original = _cuda_compiler.CUDACompiler
            _cuda_compiler.CUDACompiler = _LEAN_PIPELINE
            try:
                yield
            finally:
                _cuda_compiler.CUDACompiler = original

    def kernel_jit(fn):
        """Kernels of generated sources: cached on disk, compiled through the lean pipeline, with the launch
        bounds of `launch_bounds` and the register cap of `max_registers` where the source asks for them; no
        link-time optimisation (numba-cuda's default): NVVM compiles the kernel and its device functions as one
        module already, and LTO ran NVVM a second time and optimised again at link time (runtime.compile_unbound)."""
        opts = {"cache": True, "lto": False}
        bounds = getattr(fn, "__falower_launch_bounds__", None)
        if bounds:
            opts["launch_bounds"] = bounds
        regs = getattr(fn, "__falower_max_registers__", None)
        if regs:
            opts["max_registers"] = regs
        return cuda.jit(**opts)(fn)

    # float32 maths from libdevice: Numba's math.sin/cos/tan and round() on a float32 compute in f64
    from numba.cuda import libdevice as _libdevice

    sin_f32 = _libdevice.sinf
    cos_f32 = _libdevice.cosf
    tan_f32 = _libdevice.tanf
    rint_f32 = _libdevice.rintf  # round half to even, as torch.round
    floor_f32 = _libdevice.floorf
    ceil_f32 = _libdevice.ceilf
    floor_f64 = _libdevice.floor
    ceil_f64 = _libdevice.ceil
    # what Numba's math.exp / log / ... lower a float32 to, named so that the simulator can take numpy's (above)
    exp_f32, exp2_f32, log_f32, log2_f32 = _libdevice.expf, _libdevice.exp2f, _libdevice.logf, _libdevice.log2f
    sqrt_f32, log1p_f32, expm1_f32, tanh_f32 = _libdevice.sqrtf, _libdevice.log1pf, _libdevice.expm1f, _libdevice.tanhf
    erf_f32, pow_f32 = _libdevice.erff, _libdevice.powf

    _U32 = types.uint32
    _F32 = types.float32
    _I16 = types.int16

    def _asm(context, builder, ptx, constraints, in_vals, ret_types, side_effect=False):
        """Emit one inline-asm call. in_vals: LLVM values; ret_types: list of Numba types."""
        in_lltypes = [v.type for v in in_vals]
        if not ret_types:
            ret_ll = ir.VoidType()
        elif len(ret_types) == 1:
            ret_ll = context.get_value_type(ret_types[0])
        else:
            ret_ll = ir.LiteralStructType([context.get_value_type(t) for t in ret_types])
        fnty = ir.FunctionType(ret_ll, in_lltypes)
        asm = ir.InlineAsm(fnty, ptx, constraints, side_effect=side_effect)
        return builder.call(asm, in_vals)

    def _cast_all(context, builder, sig, args, targets):
        return [context.cast(builder, v, ty, to) for v, ty, to in zip(args, sig.args, targets)]

    def _tuple_result(context, builder, sig, res, n):
        elems = [builder.extract_value(res, i) for i in range(n)]
        return context.make_tuple(builder, sig.return_type, elems)

    def _item_ptr(context, builder, arrty, arr, idxty, idx):
        """Pointer to arr[idx], idx a tuple with one index per axis (or one index), through the array's strides."""
        ary = context.make_array(arrty)(context, builder, arr)
        is_tuple = isinstance(idxty, types.BaseTuple)
        tys = list(idxty) if is_tuple else [idxty]
        raw = cgutils.unpack_tuple(builder, idx, len(tys)) if is_tuple else [idx]
        idxs = [context.cast(builder, v, t, types.intp) for v, t in zip(raw, tys)]
        return cgutils.get_item_pointer(context, builder, arrty, ary, idxs, wraparound=False)

    def _rows_aligned(context, builder, arrty, arr, item, align):
        """i1: the last axis contiguous (stride `item` bytes), the other strides and the data address multiples of
        `align` bytes."""
        ary = context.make_array(arrty)(context, builder, arr)
        i64 = ir.IntType(64)
        strides = cgutils.unpack_tuple(builder, ary.strides, arrty.ndim)
        ok = builder.icmp_unsigned("==", strides[-1], ir.Constant(strides[-1].type, item))
        bits = builder.ptrtoint(ary.data, i64)
        for st in strides[:-1]:
            bits = builder.or_(bits, st)
        return builder.and_(ok, builder.icmp_unsigned("==", builder.and_(bits, ir.Constant(i64, align - 1)),
                                                      ir.Constant(i64, 0)))

    def _element_address(context, builder, arrty, arr, index, indexty):
        """Generic address (i64) of arr[index] for a 1-D array."""
        ary = context.make_array(arrty)(context, builder, arr)
        idx = context.cast(builder, index, indexty, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, arrty, ary, [idx], wraparound=False)
        return builder.ptrtoint(ptr, ir.IntType(64))

    # ---- mma.sync m16n8k16, fp32 accumulate ------------------------------------------------------

    def _mma_codegen(kind):
        ptx = (
            f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
        )
        cons = "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f"

        def codegen(context, builder, sig, args):
            vals = _cast_all(context, builder, sig, args, [_U32] * 6 + [_F32] * 4)
            res = _asm(context, builder, ptx, cons, vals, [_F32] * 4)
            return _tuple_result(context, builder, sig, res, 4)

        return codegen

    _MMA_RET = types.UniTuple(_F32, 4)

    # ---- per-thread accumulator arrays: element access and mma in place ---------------------------
    # Numba lowers x[i] through its generic array indexing (the array struct spilled to a stack slot, shape and
    # strides loaded, negative-index wraparound selects, then the element pointer): ~15 LLVM instructions and
    # ~5 ms of lowering per access on the dev machine, all of which NVVM folds away for our constant-indexed
    # local arrays. These take the data pointer out of the array value and index it: one GEP (benchmarks/
    # NOTES.md, "Compile time", lever 15). 1-D arrays and indices the caller knows to be in range only.

    def _data_ptr(context, builder, arrty, arr, index, indexty, offset=0):
        pos = context.data_model_manager[arrty].get_field_position("data")
        data = builder.extract_value(arr, pos)
        idx = context.cast(builder, index, indexty, types.intp)
        if offset:
            idx = builder.add(idx, ir.Constant(idx.type, offset))
        return builder.gep(data, [idx], inbounds=True)

    @intrinsic
    def lget(typingctx, x, i):
        sig = x.dtype(x, i)

        def codegen(context, builder, sig, args):
            return builder.load(_data_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]))

        return sig, codegen

    @intrinsic
    def lset(typingctx, x, i, v):
        sig = types.void(x, i, v)

        def codegen(context, builder, sig, args):
            val = context.cast(builder, args[2], sig.args[2], sig.args[0].dtype)
            builder.store(val, _data_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]))

        return sig, codegen

    def _mma_into_codegen(kind, init):
        ptx = (
            f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
        )
        cons = "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f"

        def codegen(context, builder, sig, args):
            ptrs = [_data_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], e) for e in range(4)]
            ab = _cast_all(context, builder, types.void(*sig.args[2:]), args[2:], [_U32] * 6)
            acc = [ir.Constant(ir.FloatType(), 0.0)] * 4 if init else [builder.load(p) for p in ptrs]
            res = _asm(context, builder, ptx, cons, ab + acc, [_F32] * 4)
            for e, p in enumerate(ptrs):
                builder.store(builder.extract_value(res, e), p)

        return codegen

    def _mma_into(kind, init):
        def typer(typingctx, x, i, a0, a1, a2, a3, b0, b1):
            return types.void(x, i, a0, a1, a2, a3, b0, b1), _mma_into_codegen(kind, init)

        typer.__name__ = f"mma_{'set' if init else 'acc'}_{kind}"
        return intrinsic(typer)

    mma_acc_f16 = _mma_into("f16", False)
    mma_set_f16 = _mma_into("f16", True)
    mma_acc_bf16 = _mma_into("bf16", False)
    mma_set_bf16 = _mma_into("bf16", True)

    @intrinsic
    def mma_f16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = _MMA_RET(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        return sig, _mma_codegen("f16")

    @intrinsic
    def mma_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = _MMA_RET(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        return sig, _mma_codegen("bf16")

    # ---- ldmatrix ---------------------------------------------------------------------------------

    def _ldmatrix_codegen(trans):
        suffix = ".trans" if trans else ""
        ptx = (
            "{ .reg .u64 sa; cvta.to.shared.u64 sa, $4; "
            f"ldmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 {{$0,$1,$2,$3}}, [sa]; }}"
        )

        def codegen(context, builder, sig, args):
            addr = _element_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            res = _asm(context, builder, ptx, "=r,=r,=r,=r,l", [addr], [_U32] * 4, side_effect=True)
            return _tuple_result(context, builder, sig, res, 4)

        return codegen

    def _ldsm_codegen(trans):
        suffix = ".trans" if trans else ""
        ptx = f"ldmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 {{$0,$1,$2,$3}}, [$4];"

        def codegen(context, builder, sig, args):
            (addr,) = _cast_all(context, builder, sig, args, [_U32])
            res = _asm(context, builder, ptx, "=r,=r,=r,=r,r", [addr], [_U32] * 4, side_effect=True)
            return _tuple_result(context, builder, sig, res, 4)

        return codegen

    @intrinsic
    def ldsm_x4(typingctx, addr):
        return types.UniTuple(_U32, 4)(addr), _ldsm_codegen(False)

    @intrinsic
    def ldsm_x4_trans(typingctx, addr):
        return types.UniTuple(_U32, 4)(addr), _ldsm_codegen(True)

    @intrinsic
    def smem_base(typingctx, smem):
        def codegen(context, builder, sig, args):
            zero = context.get_constant(types.intp, 0)
            addr = _element_address(context, builder, sig.args[0], args[0], zero, types.intp)
            ptx = "{ .reg .u64 sa; cvta.to.shared.u64 sa, $1; cvt.u32.u64 $0, sa; }"
            return _asm(context, builder, ptx, "=r,l", [addr], [_U32])

        return _U32(smem), codegen

    # 16 bytes from a generic address ($1) to a 32-bit shared address ($0), zero-filled past $2 bytes
    _CP_ASYNC_TO_SHARED = "{ .reg .u64 ga; cvta.to.global.u64 ga, $1; cp.async.cg.shared.global [$0], [ga], 16, $2; }"

    @intrinsic
    def cp_async16_s(typingctx, saddr, garr, g_index, src_bytes):
        sig = types.void(saddr, garr, g_index, src_bytes)
        ptx = _CP_ASYNC_TO_SHARED

        def codegen(context, builder, sig, args):
            sa = context.cast(builder, args[0], sig.args[0], _U32)
            ga = _element_address(context, builder, sig.args[1], args[1], args[2], sig.args[2])
            nb = context.cast(builder, args[3], sig.args[3], _U32)
            _asm(context, builder, ptx, "r,l,r,~{memory}", [sa, ga, nb], [], side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def prefetch_l2(typingctx, garr, idx):
        """prefetch.global.L2 of garr[idx] (idx a tuple of indices, one per dimension, in range); returns 0."""
        sig = types.int32(garr, idx)
        ptx = "{ .reg .u64 ga; cvta.to.global.u64 ga, $0; prefetch.global.L2 [ga]; }"

        def codegen(context, builder, sig, args):
            ptr = _item_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            _asm(context, builder, ptx, "l,~{memory}", [builder.ptrtoint(ptr, ir.IntType(64))], [], side_effect=True)
            return context.get_constant(types.int32, 0)

        return sig, codegen

    @intrinsic
    def ld_pair(typingctx, garr, idx):
        """(garr[..., i], garr[..., i + 1]) by one 8-byte vector load (ld.v2.b32): the caller has checked
        `pairs_aligned(garr)`, that i is even and that i + 1 is in range."""
        if garr.dtype.bitwidth != 32:
            return None
        sig = types.UniTuple(garr.dtype, 2)(garr, idx)

        def codegen(context, builder, sig, args):
            ptr = _item_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            elt = context.get_value_type(sig.args[0].dtype)
            vec = builder.load(builder.bitcast(ptr, ir.PointerType(ir.VectorType(elt, 2))), align=8)
            pair = [builder.extract_element(vec, ir.Constant(ir.IntType(32), e)) for e in range(2)]
            return context.make_tuple(builder, sig.return_type, pair)

        return sig, codegen

    @intrinsic
    def rows_aligned16(typingctx, garr):
        """Whether garr's last axis is contiguous and its other strides and data address are multiples of 16."""
        if not isinstance(garr, types.Array) or garr.ndim == 0:
            return None
        sig = types.boolean(garr)

        def codegen(context, builder, sig, args):
            item = context.get_abi_sizeof(context.get_data_type(sig.args[0].dtype))
            return _rows_aligned(context, builder, sig.args[0], args[0], item, 16)

        return sig, codegen

    @intrinsic
    def elem_addr(typingctx, garr, idx):
        """The generic address (uint64) of garr[idx], idx a tuple with one index per axis."""
        sig = types.uint64(garr, idx)

        def codegen(context, builder, sig, args):
            ptr = _item_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            return builder.ptrtoint(ptr, ir.IntType(64))

        return sig, codegen

    @intrinsic
    def ldg_f32_a(typingctx, gaddr):
        """One f32 load from a generic address in global memory (elem_addr's, plus offsets): an LLVM load, which
        the compilers schedule as they would an array's (an asm with a memory clobber would pin it in place)."""
        sig = types.float32(gaddr)

        def codegen(context, builder, sig, args):
            ga = context.cast(builder, args[0], sig.args[0], types.uint64)
            ptr = builder.addrspacecast(builder.inttoptr(ga, ir.PointerType(ir.FloatType())),
                                        ir.PointerType(ir.FloatType(), 1))
            return builder.load(ptr, align=4)

        return sig, codegen

    @intrinsic
    def cp_async16_a(typingctx, saddr, gaddr, src_bytes):
        """cp.async of 16 bytes from the generic address gaddr to the shared byte address saddr (zero past
        src_bytes): the copies of a table tile whose row addresses the kernel keeps."""
        sig = types.void(saddr, gaddr, src_bytes)
        ptx = _CP_ASYNC_TO_SHARED

        def codegen(context, builder, sig, args):
            sa = context.cast(builder, args[0], sig.args[0], _U32)
            ga = context.cast(builder, args[1], sig.args[1], types.uint64)
            nb = context.cast(builder, args[2], sig.args[2], _U32)
            _asm(context, builder, ptx, "r,l,r,~{memory}", [sa, ga, nb], [], side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def lds_v2_f32(typingctx, saddr):
        """(f32, f32) at the shared byte address saddr (8-byte aligned): one ld.shared.v2.f32."""
        sig = types.UniTuple(_F32, 2)(saddr)
        ptx = "ld.shared.v2.f32 {$0, $1}, [$2];"

        def codegen(context, builder, sig, args):
            sa = context.cast(builder, args[0], sig.args[0], _U32)
            res = _asm(context, builder, ptx, "=f,=f,r,~{memory}", [sa], [_F32, _F32], side_effect=True)
            return _tuple_result(context, builder, sig, res, 2)

        return sig, codegen

    @intrinsic
    def pairs_aligned(typingctx, garr):
        """Whether every even index of garr's last axis starts an 8-byte aligned pair: 4-byte elements, the last
        axis contiguous with an even length, every other stride and the data address multiples of 8."""
        if not isinstance(garr, types.Array) or garr.dtype.bitwidth != 32 or garr.ndim == 0:
            return None
        sig = types.boolean(garr)

        def codegen(context, builder, sig, args):
            arrty = sig.args[0]
            i64 = ir.IntType(64)
            shapes = cgutils.unpack_tuple(builder, context.make_array(arrty)(context, builder, args[0]).shape,
                                          arrty.ndim)
            even = builder.icmp_unsigned("==", builder.and_(shapes[-1], ir.Constant(i64, 1)), ir.Constant(i64, 0))
            return builder.and_(_rows_aligned(context, builder, arrty, args[0], 4, 8), even)

        return sig, codegen

    @intrinsic
    def ldmatrix_x4(typingctx, smem, index):
        return types.UniTuple(_U32, 4)(smem, index), _ldmatrix_codegen(False)

    @intrinsic
    def ldmatrix_x4_trans(typingctx, smem, index):
        return types.UniTuple(_U32, 4)(smem, index), _ldmatrix_codegen(True)

    # ---- cp.async ---------------------------------------------------------------------------------

    @intrinsic
    def cp_async16(typingctx, smem, s_index, garr, g_index, src_bytes):
        sig = types.void(smem, s_index, garr, g_index, src_bytes)
        ptx = (
            "{ .reg .u64 sa, ga; cvta.to.shared.u64 sa, $0; cvta.to.global.u64 ga, $1; "
            "cp.async.cg.shared.global [sa], [ga], 16, $2; }"
        )

        def codegen(context, builder, sig, args):
            sa = _element_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            ga = _element_address(context, builder, sig.args[2], args[2], args[3], sig.args[3])
            nb = context.cast(builder, args[4], sig.args[4], types.uint32)
            _asm(context, builder, ptx, "l,l,r,~{memory}", [sa, ga, nb], [], side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def sts_u32(typingctx, saddr, val):
        """One 32-bit word to the shared byte address saddr (st.shared.u32)."""
        sig = types.void(saddr, val)

        def codegen(context, builder, sig, args):
            sa = context.cast(builder, args[0], sig.args[0], _U32)
            v = context.cast(builder, args[1], sig.args[1], _U32)
            _asm(context, builder, "st.shared.u32 [$0], $1;", "r,r,~{memory}", [sa, v], [], side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def sts_v4_f32(typingctx, saddr, a, b, c, d):
        """Four f32 to the shared byte address saddr (16-byte aligned): one st.shared.v4.f32."""
        sig = types.void(saddr, a, b, c, d)

        def codegen(context, builder, sig, args):
            sa = context.cast(builder, args[0], sig.args[0], _U32)
            vals = [context.cast(builder, x, t, types.float32) for x, t in zip(args[1:], sig.args[1:])]
            _asm(context, builder, "st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f,~{memory}", [sa, *vals], [],
                 side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def lds_v4_u32(typingctx, saddr):
        """Four 32-bit words at the shared byte address saddr (16-byte aligned): one ld.shared.v4.u32."""
        sig = types.UniTuple(_U32, 4)(saddr)

        def codegen(context, builder, sig, args):
            sa = context.cast(builder, args[0], sig.args[0], _U32)
            res = _asm(context, builder, "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,~{memory}", [sa],
                       [_U32] * 4, side_effect=True)
            return _tuple_result(context, builder, sig, res, 4)

        return sig, codegen

    @intrinsic
    def ld_cluster_v4_u32(typingctx, caddr):
        """Four 32-bit words at the shared::cluster address caddr (mapa_shared's: a block of the cluster's shared
        memory, 16-byte aligned): one ld.shared::cluster.v4.u32."""
        sig = types.UniTuple(_U32, 4)(caddr)

        def codegen(context, builder, sig, args):
            ca = context.cast(builder, args[0], sig.args[0], _U32)
            res = _asm(context, builder, "ld.shared::cluster.v4.u32 {$0, $1, $2, $3}, [$4];",
                       "=r,=r,=r,=r,r,~{memory}", [ca], [_U32] * 4, side_effect=True)
            return _tuple_result(context, builder, sig, res, 4)

        return sig, codegen

    @intrinsic
    def ld_cluster_f32(typingctx, caddr):
        """The f32 at the shared::cluster address caddr (mapa_shared's): one ld.shared::cluster.f32."""
        sig = types.float32(caddr)

        def codegen(context, builder, sig, args):
            ca = context.cast(builder, args[0], sig.args[0], _U32)
            return _asm(context, builder, "ld.shared::cluster.f32 $0, [$1];", "=f,r,~{memory}", [ca], [types.float32],
                        side_effect=True)

        return sig, codegen

    @intrinsic
    def stg_v4_u32(typingctx, arr, index, a, b, c, d):
        """arr[index : index + 4] = (a, b, c, d) as one 16-byte store (index a multiple of 4)."""
        sig = types.void(arr, index, a, b, c, d)

        def codegen(context, builder, sig, args):
            ga = _element_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            vals = [context.cast(builder, v, ty, _U32) for v, ty in zip(args[2:], sig.args[2:])]
            _asm(context, builder, "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", [ga, *vals], [],
                 side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def ldg_vec(typingctx, arr, index):
        """The 16 bytes at arr[index] (16-byte aligned; index one per axis, a tuple past 1-D) as a tuple of arr's
        elements: one ld.v4.b32 through an LLVM load, so the compilers batch it with the loads around it (an asm
        with a memory clobber would not)."""
        if not isinstance(arr, types.Array) or arr.dtype.bitwidth not in (16, 32):
            return None
        if (arr.ndim != 1 or isinstance(index, types.BaseTuple)) and not (
                isinstance(index, types.BaseTuple) and len(index) == arr.ndim):
            return None
        n = 128 // arr.dtype.bitwidth
        sig = types.UniTuple(arr.dtype, n)(arr, index)

        def codegen(context, builder, sig, args):
            ptr = _item_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            words = builder.load(builder.bitcast(ptr, ir.PointerType(ir.VectorType(ir.IntType(32), 4))), align=16)
            vec = builder.bitcast(words, ir.VectorType(context.get_value_type(sig.args[0].dtype), n))
            elems = [builder.extract_element(vec, ir.Constant(ir.IntType(32), e)) for e in range(n)]
            return context.make_tuple(builder, sig.return_type, elems)

        return sig, codegen

    @intrinsic
    def ldg_cg_vec(typingctx, arr, index):
        """The 16 bytes at arr[index] (1-D, 4-byte words, 16-byte aligned) as 4 words: one ld.global.cg.v4 (cached in
        L2 only: another SM's writes, fenced and counted, are never read from a stale L1 line), volatile so that it
        stays after the fence and the count before it."""
        if not isinstance(arr, types.Array) or arr.ndim != 1 or arr.dtype.bitwidth != 32:
            return None
        sig = types.UniTuple(arr.dtype, 4)(arr, index)
        ptx = "{ .reg .u64 ga; cvta.to.global.u64 ga, $4; ld.global.cg.v4.u32 {$0, $1, $2, $3}, [ga]; }"

        def codegen(context, builder, sig, args):
            ga = _element_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            res = _asm(context, builder, ptx, "=r,=r,=r,=r,l", [ga], [_U32] * 4, side_effect=True)
            elt = context.get_value_type(sig.args[0].dtype)
            words = [builder.bitcast(builder.extract_value(res, i), elt) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, words)

        return sig, codegen

    @intrinsic
    def ldg_cg_f32(typingctx, arr, index):
        """arr[index] (1-D f32) by one ld.global.cg, volatile (ldg_cg_vec's reasons)."""
        if not isinstance(arr, types.Array) or arr.ndim != 1 or arr.dtype != types.float32:
            return None
        sig = types.float32(arr, index)
        ptx = "{ .reg .u64 ga; cvta.to.global.u64 ga, $1; ld.global.cg.f32 $0, [ga]; }"

        def codegen(context, builder, sig, args):
            ga = _element_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            return _asm(context, builder, ptx, "=f,l", [ga], [_F32], side_effect=True)

        return sig, codegen

    @intrinsic
    def stg_vec(typingctx, arr, index, vals):
        """arr[index : index + len(vals)] = vals (1-D; vals of arr's element type, or of an integer type of its width
        (packed halves as uint32 into an int32 view), 8 or 16 bytes, aligned to that): one vector store through
        LLVM."""
        if not isinstance(arr, types.Array) or arr.ndim != 1 or not isinstance(vals, types.UniTuple):
            return None
        ints = isinstance(vals.dtype, types.Integer) and isinstance(arr.dtype, types.Integer)  # (one LLVM type: iN)
        if not (vals.dtype == arr.dtype or ints and vals.dtype.bitwidth == arr.dtype.bitwidth) \
                or vals.count * arr.dtype.bitwidth not in (64, 128):
            return None
        n, nbytes = vals.count, vals.count * arr.dtype.bitwidth // 8
        sig = types.void(arr, index, vals)

        def codegen(context, builder, sig, args):
            ptr = _item_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            elt = context.get_value_type(sig.args[0].dtype)
            vec = ir.Constant(ir.VectorType(elt, n), None)
            for e, x in enumerate(cgutils.unpack_tuple(builder, args[2], n)):
                vec = builder.insert_element(vec, x, ir.Constant(ir.IntType(32), e))
            words = ir.VectorType(ir.IntType(32), nbytes // 4)
            builder.store(builder.bitcast(vec, words), builder.bitcast(ptr, ir.PointerType(words)), align=nbytes)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def red_add_v4_f32(typingctx, arr, index, a, b, c, d):
        """arr[index : index + 4] += (a, b, c, d) as one vector reduction (sm_90; index a multiple of 4)."""
        sig = types.void(arr, index, a, b, c, d)
        ptx = "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};"

        def codegen(context, builder, sig, args):
            ga = _element_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            vals = [context.cast(builder, v, ty, _F32) for v, ty in zip(args[2:], sig.args[2:])]
            _asm(context, builder, ptx, "l,f,f,f,f,~{memory}", [ga, *vals], [], side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    def _void_asm_intrinsic(name, ptx):
        def typer(typingctx):
            def codegen(context, builder, sig, args):
                _asm(context, builder, ptx, "~{memory}", [], [], side_effect=True)
                return context.get_dummy_value()

            return types.void(), codegen

        typer.__name__ = name
        typer.__qualname__ = name
        return intrinsic(typer)

    def _unary_asm_intrinsic(name, ptx, arg, ret, constraints, side_effect=False):
        """An intrinsic of one `arg` value around one asm with one `ret` result (ex2, tanh.approx, bfind, redux)."""

        def typer(typingctx, x):
            def codegen(context, builder, sig, args):
                (v,) = _cast_all(context, builder, sig, args, [arg])
                return _asm(context, builder, ptx, constraints, [v], [ret], side_effect=side_effect)

            return ret(x), codegen

        typer.__name__ = name
        typer.__qualname__ = name
        return intrinsic(typer)

    cp_async_commit = _void_asm_intrinsic("cp_async_commit", "cp.async.commit_group;")
    cp_async_wait0 = _void_asm_intrinsic("cp_async_wait0", "cp.async.wait_group 0;")
    cp_async_wait1 = _void_asm_intrinsic("cp_async_wait1", "cp.async.wait_group 1;")
    fence_acq_rel_gpu = _void_asm_intrinsic("fence_acq_rel_gpu", "fence.acq_rel.gpu;")
    fence_proxy_async_smem = _void_asm_intrinsic("fence_proxy_async_smem", "fence.proxy.async.shared::cta;")
    cluster_sync = _void_asm_intrinsic("cluster_sync", "barrier.cluster.arrive.release; barrier.cluster.wait.acquire;")
    cluster_arrive_relaxed = _void_asm_intrinsic("cluster_arrive_relaxed", "barrier.cluster.arrive.relaxed;")
    cluster_wait = _void_asm_intrinsic("cluster_wait", "barrier.cluster.wait.acquire;")
    fence_mbar_init_cluster = _void_asm_intrinsic("fence_mbar_init_cluster", "fence.mbarrier_init.release.cluster;")
    griddep_wait = _void_asm_intrinsic("griddep_wait", "griddepcontrol.wait;")
    griddep_launch_dependents = _void_asm_intrinsic("griddep_launch_dependents", "griddepcontrol.launch_dependents;")

    # ---- conversions ------------------------------------------------------------------------------

    def _pack_codegen(kind):
        # cvt.rn.{kind}x2.f32 d, a, b puts a in the UPPER half: pass (hi, lo).
        ptx = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"

        def codegen(context, builder, sig, args):
            lo, hi = _cast_all(context, builder, sig, args, [_F32, _F32])
            return _asm(context, builder, ptx, "=r,f,f", [hi, lo], [_U32])

        return codegen

    @intrinsic
    def pack_f16x2(typingctx, lo, hi):
        return _U32(lo, hi), _pack_codegen("f16")

    @intrinsic
    def pack_bf16x2(typingctx, lo, hi):
        return _U32(lo, hi), _pack_codegen("bf16")

    ex2 = _unary_asm_intrinsic("ex2", "ex2.approx.ftz.f32 $0, $1;", _F32, _F32, "=f,f")
    ex2_poly = _unary_asm_intrinsic("ex2_poly", EX2_POLY_PTX, _F32, _F32, "=f,f")
    tanh_approx_f32 = _unary_asm_intrinsic("tanh_approx_f32", "tanh.approx.f32 $0, $1;", _F32, _F32, "=f,f")
    tanh_ex2_f32 = _unary_asm_intrinsic("tanh_ex2_f32", TANH_EX2_PTX, _F32, _F32, "=f,f")
    tanh_small_f32 = _unary_asm_intrinsic("tanh_small_f32", TANH_SMALL_PTX, _F32, _F32, "=f,f")
    tanh_tiny_f32 = _unary_asm_intrinsic("tanh_tiny_f32", TANH_TINY_PTX, _F32, _F32, "=f,f")

    @intrinsic
    def shfl_xor_f32(typingctx, x, lane_mask):
        def codegen(context, builder, sig, args):
            v, m = _cast_all(context, builder, sig, args, [_F32, _U32])
            ptx = "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;"
            return _asm(context, builder, ptx, "=f,f,r", [v, m], [_F32], side_effect=True)

        return _F32(x, lane_mask), codegen

    _I32 = types.int32

    @intrinsic
    def ballot(typingctx, pred):
        def codegen(context, builder, sig, args):
            (p,) = _cast_all(context, builder, sig, args, [_U32])
            ptx = "{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.ballot.b32 $0, p, 0xffffffff; }"
            return _asm(context, builder, ptx, "=r,r", [p], [_U32], side_effect=True)

        return _U32(pred), codegen

    @intrinsic
    def lowest_bit(typingctx, m):
        def codegen(context, builder, sig, args):
            (v,) = _cast_all(context, builder, sig, args, [_U32])
            ptx = "{ .reg .b32 r; brev.b32 r, $1; bfind.shiftamt.u32 $0, r; }"  # clz(brev(m)) = ctz(m)
            return _asm(context, builder, ptx, "=r,r", [v], [_I32])

        return _I32(m), codegen

    highest_bit = _unary_asm_intrinsic("highest_bit", "bfind.u32 $0, $1;", _U32, _I32, "=r,r")

    @intrinsic
    def div_u32(typingctx, a, b):
        def codegen(context, builder, sig, args):
            va, vb = _cast_all(context, builder, sig, args, [_U32, _U32])
            return _asm(context, builder, "div.u32 $0, $1, $2;", "=r,r,r", [va, vb], [_I32])

        return _I32(a, b), codegen
    warp_min = _unary_asm_intrinsic("warp_min", "redux.sync.min.s32 $0, $1, 0xffffffff;", _I32, _I32, "=r,r",
                                    side_effect=True)
    warp_max = _unary_asm_intrinsic("warp_max", "redux.sync.max.s32 $0, $1, 0xffffffff;", _I32, _I32, "=r,r",
                                    side_effect=True)
    warp_sum = _unary_asm_intrinsic("warp_sum", "redux.sync.add.s32 $0, $1, 0xffffffff;", _I32, _I32, "=r,r",
                                    side_effect=True)

    @intrinsic
    def global_timer(typingctx):
        """%globaltimer (ns), for measuring tools (benchmarks/timeline.py); a side effect, so never hoisted."""
        def codegen(context, builder, sig, args):
            return _asm(context, builder, "mov.u64 $0, %globaltimer;", "=l", [], [types.uint64], side_effect=True)

        return types.uint64(), codegen

    @intrinsic
    def clock64(typingctx):
        """%clock64: the SM's cycle counter, for measuring tools (benchmarks/timeline.py --phases: spans inside a
        block far below %globaltimer's 0.26 us steps); a side effect, so never hoisted or merged."""
        def codegen(context, builder, sig, args):
            return _asm(context, builder, "mov.u64 $0, %clock64;", "=l,~{memory}", [], [types.uint64],
                        side_effect=True)

        return types.uint64(), codegen

    @intrinsic
    def sm_id(typingctx):
        """%smid: the SM a block runs on (benchmarks/timeline.py)."""
        def codegen(context, builder, sig, args):
            return _asm(context, builder, "mov.u32 $0, %smid;", "=r", [], [_U32], side_effect=True)

        return _U32(), codegen

    @intrinsic
    def f16_to_f32(typingctx, bits):
        def codegen(context, builder, sig, args):
            (h,) = _cast_all(context, builder, sig, args, [_I16])
            return _asm(context, builder, "cvt.f32.f16 $0, $1;", "=f,h", [h], [_F32])

        return _F32(bits), codegen

    @intrinsic
    def bf16_to_f32(typingctx, bits):
        def codegen(context, builder, sig, args):
            (h,) = _cast_all(context, builder, sig, args, [_I16])
            ptx = "{ .reg .b32 w; cvt.u32.u16 w, $1; shl.b32 w, w, 16; mov.b32 $0, w; }"
            return _asm(context, builder, ptx, "=f,h", [h], [_F32])

        return _F32(bits), codegen

    @intrinsic
    def f32_to_f16(typingctx, x):
        def codegen(context, builder, sig, args):
            (v,) = _cast_all(context, builder, sig, args, [_F32])
            return _asm(context, builder, "cvt.rn.f16.f32 $0, $1;", "=h,f", [v], [_I16])

        return _I16(x), codegen

    @intrinsic
    def f32_to_bf16(typingctx, x):
        def codegen(context, builder, sig, args):
            (v,) = _cast_all(context, builder, sig, args, [_F32])
            return _asm(context, builder, "cvt.rn.bf16.f32 $0, $1;", "=h,f", [v], [_I16])

        return _I16(x), codegen


# --------------------------------------------------------------------------------------------------
# Warp specialization (issue 11, emit_fa3_ws.py): mbarriers, cp.async completion on an mbarrier, named barriers
# with a thread count, setmaxnreg. Shared addresses are 32-bit shared-window byte addresses (smem_base + offset,
# 8-byte aligned for an mbarrier), as for ldsm_x4 / cp_async16_s.
#     mbar_init(addr, count)             mbarrier.init: a phase completes after `count` arrivals (one thread, then a
#                                        barrier before any other thread uses it)
#     mbar_arrive(addr)                  mbarrier.arrive (release, CTA scope)
#     mbar_arrive_expect_tx(addr, tx)    mbarrier.arrive.expect_tx (for TMA; the emulation's copies are immediate)
#     mbar_try_wait(addr, parity)        -> uint32: 1 once the phase of that parity has completed (try_wait.parity:
#                                        the hardware suspends the thread a while before it answers 0)
#     mbar_wait(addr, parity)            try_wait.parity in a loop until it succeeds (the loop inside one asm;
#                                        its label is local to the asm's { } scope)
#     cp_async_mbar_arrive_noinc(addr)   cp.async.mbarrier.arrive.noinc: one arrival once every cp.async this thread
#                                        issued before it has landed (count it in mbar_init's count)
#     bar_sync(id, count), bar_arrive(id, count)
#                                        named barrier `id` (1..15; 0 is syncthreads') of `count` threads (a multiple
#                                        of 32): bar.sync waits, bar.arrive only counts
#     warp_uniform(x)                    -> int32: lane 0's x (shfl.sync.idx): a value ptxas knows is the same in
#                                        every lane, for warp-role branches around wgmma (a branch on threadIdx
#                                        itself is divergent to ptxas, which then serializes the wgmmas: C7518)
#     setmaxnreg_inc(n), setmaxnreg_dec(n)
#                                        factories -> f(): setmaxnreg.{inc,dec}.sync.aligned.u32 n for the executing
#                                        warpgroup (n a multiple of 8 in 24..256; the kernel needs launch bounds)
#     syncwarp()                         bar.warp.sync of the full warp (Numba's simulator has no syncwarp)
#     bulk_store(gaddr, saddr, nbytes)   cp.async.bulk.global.shared::cta.bulk_group: nbytes (a multiple of 16) from
#                                        the shared byte address saddr to the generic address gaddr (elem_addr), both
#                                        16-byte aligned; the shared side is read asynchronously, after a
#                                        fence.proxy.async of the threads that wrote it
#     bulk_reduce_add_f32(gaddr, saddr, nbytes)
#                                        cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32: bulk_store's
#                                        copy, but each f32 of the source added into the global f32 at its place
#                                        (the L2's reduction, atomic per element), committed and waited as it is
#     bulk_commit(), bulk_wait_read0()   cp.async.bulk.commit_group; cp.async.bulk.wait_group.read 0: this thread's
#                                        committed bulk copies have read their shared memory (which may then be
#                                        written again; the kernel must not exit before)
#     bulk_wait0()                       cp.async.bulk.wait_group 0: ... and their writes are done (visible): what
#                                        benchmarks/probe_bwd.py --drain stamps (the simulator's: bulk_wait_read0's)
#     tma_store_3d(map, c0, c1, c2, saddr)
#                                        cp.async.bulk.tensor.3d.global.shared::cta.bulk_group: the box at
#                                        coordinates (c0, c1, c2) (innermost first) of the tensor the map describes
#                                        (`map` the generic address of a 128-byte CUtensorMap in global memory:
#                                        tensor_maps.py) from the shared byte address saddr, laid out as the map's
#                                        swizzle lays it; rows past the tensor's bounds are not written. Committed
#                                        and waited for as bulk_store's copies
#     tma_load_4d(sdst, map, c0, c1, c2, c3, mbar)
#                                        cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes:
#                                        the box at (c0 .. c3) of the map's tensor into shared memory at sdst, laid
#                                        out as the map's swizzle lays it, elements past the tensor's bounds zero; its
#                                        bytes complete on the mbarrier at mbar (whose phase also waits for the bytes
#                                        an mbar_arrive_expect_tx announced)
#     tma_load_4d_hint(sdst, map, c0, c1, c2, c3, mbar, policy)
#                                        tma_load_4d with .L2::cache_hint: the lines it reads take the L2 eviction
#                                        priority of `policy` (a 64-bit cache policy: l2_evict_last / l2_evict_first)
#     tma_store_3d_hint(map, c0, c1, c2, saddr, policy)
#                                        tma_store_3d with .L2::cache_hint (its lines' eviction priority)
#     l2_evict_last(), l2_evict_first()  createpolicy.fractional.L2::evict_last / evict_first.b64 (fraction 1.0):
#                                        a cache policy for the hinted copies (the simulator: 0, no cache)
#     tensormap_acquire(map)             fence.proxy.tensormap::generic.acquire.gpu on the map's 128 bytes: the
#                                        tensor copies of this thread see the map as written before the launch
#     tensormap_prefetch(map)            prefetch.tensormap: the map's bytes start into the SM's descriptor cache
#                                        (a hint: no ordering; the simulator checks the address is a map)
# Emulation: an mbarrier is a phase counter and a pending count under a condition variable, a named barrier a
# generation counter; both live per block (keyed by the block's index and the address / id); waits block on the
# condition with a timeout so that an aborted launch (another thread's exception) or a deadlock ends.
# A bulk copy (a tensor copy too) is kept per thread with its source as it was at the issue, and done at the thread's bulk_wait_read0,
# which raises if the source changed in between (the GPU may read it at any time there: a race, such as a row
# restaged before the wait or a lane's row written after the copy's issue), if a copy was never committed, or if
# the thread returns with copies not waited for; syncwarp is the warp's exchange.
# --------------------------------------------------------------------------------------------------

__all__ += [
    "mbar_init",
    "mbar_arrive",
    "mbar_arrive_expect_tx",
    "mbar_try_wait",
    "mbar_wait",
    "cp_async_mbar_arrive_noinc",
    "bar_sync",
    "bar_arrive",
    "setmaxnreg_inc",
    "setmaxnreg_dec",
    "warp_uniform",
    "max_registers",
    "syncwarp",
    "bulk_store",
    "bulk_reduce_add_f32",
    "bulk_commit",
    "bulk_wait_read0",
    "bulk_wait0",
    "tma_store_3d",
    "tma_load_4d",
    "tma_load_4d_hint",
    "tma_store_3d_hint",
    "l2_evict_last",
    "l2_evict_first",
    "tensormap_acquire",
    "tensormap_prefetch",
    "sim_tensor_map",
    "SIM_MAP_MAGIC",
]


SIM_MAP_MAGIC = 0x4D5245574F4C4146  # "FALOWERM": the first word of a simulated tensor map (sim_tensor_map)


def _check_maxnreg(n: int) -> int:
    n = int(n)
    if n % 8 or not 24 <= n <= 256:
        raise ValueError(f"setmaxnreg: a multiple of 8 in [24, 256], got {n}")
    return n


if SIMULATOR:
    import functools as _functools
    import time as _time

    SYNC_TIMEOUT = float(os.environ.get("FALOWER_SIM_SYNC_TIMEOUT", "600"))  # seconds before a wait is a deadlock
    # A waiting thread is woken by the change it waits for (every arrival, completed phase and issued TMA load
    # notifies its barrier's condition); the timeout only rechecks the abort flag and the deadlock clock. At 0.05 s
    # a kernel's hundreds of waiting threads woke thousands of times a second to take the GIL from the one thread
    # that had work: pwg3-persist-causal (col_step_sim_cases.py) 10.8 s -> 7.2 s at 1 s, a third of it system time.
    WAIT_POLL = 1.0

    class _MBarrier:
        def __init__(self, count: int) -> None:
            self.count = int(count)
            self.pending = int(count)
            self.tx = 0  # the phase's bytes announced (expect_tx) and not yet completed (complete_tx)
            self.loads: list = []  # TMA loads issued on it and not landed: (shared memory, byte offset, bytes)
            self.phase = 0  # completed phases
            self.cond = threading.Condition()

        def _complete_if_done(self) -> None:
            if self.pending == 0 and self.tx == 0:
                self.phase += 1
                self.pending = self.count
                self.cond.notify_all()

        def arrive(self, tx: int = 0) -> None:
            with self.cond:
                self.tx += int(tx)
                self.pending -= 1
                if self.pending < 0:
                    raise RuntimeError("mbarrier: more arrivals than its count in one phase")
                self._complete_if_done()

        def complete_tx(self, nbytes: int) -> None:
            with self.cond:
                self.tx -= int(nbytes)
                self._complete_if_done()

        def land(self) -> None:
            """The TMA loads issued on this barrier land when a thread first waits on it (tma_load_4d): a reader that
            does not wait reads the stage's old bytes, as it might on the GPU."""
            with self.cond:
                loads, self.loads = self.loads, []
            for smem, at, data in loads:
                smem[at:at + len(data)] = data
                self.complete_tx(len(data))

        def done(self, parity: int) -> bool:
            return (self.phase & 1) != (int(parity) & 1)

    class _NamedBarrier:
        def __init__(self) -> None:
            self.arrived = 0
            self.generation = 0
            self.cond = threading.Condition()

        def arrive(self, count: int) -> int:
            with self.cond:
                gen = self.generation
                self.arrived += 1
                if self.arrived == int(count):
                    self.arrived = 0
                    self.generation += 1
                    self.cond.notify_all()
                return gen

    def _sync_objects() -> dict:
        th = threading.current_thread()
        mgr = th._manager
        with _warp_lock:
            store = getattr(mgr, "_falower_sync", None)
            if store is None:
                store = mgr._falower_sync = {}
        return store

    def _block_key(kind: str, ident) -> tuple:
        return (kind, tuple(threading.current_thread().blockIdx), int(ident))

    def _mbar(addr) -> _MBarrier:
        bar = _sync_objects().get(_block_key("mbar", addr))
        if bar is None:
            raise RuntimeError(f"mbarrier at shared byte {int(addr)} used before mbar_init")
        return bar

    def _wait_until(cond: threading.Condition, ready, what: str) -> None:
        th = threading.current_thread()
        start = _time.monotonic()
        with cond:
            while not ready():
                if getattr(th, "abort", False):
                    raise RuntimeError(f"abort flag set while waiting on {what}")
                if _time.monotonic() - start > SYNC_TIMEOUT:
                    raise RuntimeError(f"{what}: no progress in {SYNC_TIMEOUT:.0f} s (deadlock?)")
                cond.wait(WAIT_POLL)

    def mbar_init(addr, count):
        store = _sync_objects()
        with _warp_lock:
            store[_block_key("mbar", addr)] = _MBarrier(count)

    def mbar_arrive(addr):
        _mbar(addr).arrive()

    def mbar_arrive_expect_tx(addr, tx):
        _mbar(addr).arrive(tx)

    def mbar_try_wait(addr, parity):
        _mbar(addr).land()
        if _mbar(addr).done(parity):
            return np.uint32(1)
        _time.sleep(0)  # a polling caller must let the other simulated threads run
        return np.uint32(0)

    def mbar_wait(addr, parity):
        bar = _mbar(addr)
        _wait_until(bar.cond, lambda: (bar.land(), bar.done(parity))[1],  # the barrier's loads land at a wait
                    f"mbarrier at {int(addr)}, parity {int(parity)}")

    def cp_async_mbar_arrive_noinc(addr):
        _mbar(addr).arrive()  # the emulated cp.async copies synchronously: they have all landed

    def _named(ident) -> _NamedBarrier:
        store = _sync_objects()
        key = _block_key("bar", ident)
        bar = store.get(key)
        if bar is None:
            with _warp_lock:
                bar = store.setdefault(key, _NamedBarrier())
        return bar

    def bar_sync(ident, count):
        bar = _named(ident)
        gen = bar.arrive(count)
        _wait_until(bar.cond, lambda: bar.generation != gen, f"named barrier {int(ident)}")

    def bar_arrive(ident, count):
        _named(ident).arrive(count)

    def warp_uniform(x):
        lane, vals = _exchange(int(x))
        return np.int32(vals[0])

    def syncwarp():
        _exchange(None)

    def _bulk_left(th) -> None:
        if getattr(th, "_falower_bulk", None):
            raise RuntimeError("bulk_store: the thread returned with bulk copies not waited for (bulk_wait_read0): "
                               "their shared source may be gone before the copy reads it")

    def _bulk_issue(what: str, gaddr, saddr, nbytes, write) -> None:
        """A bulk copy of nbytes from shared saddr, kept with its source as it is now: write(gaddr, source) runs at
        the thread's bulk_wait_read0."""
        gaddr, saddr, n = int(gaddr), int(saddr), int(nbytes)
        if n % 16 or gaddr % 16 or saddr % 16:
            raise ValueError(f"{what}: 16-byte aligned addresses and size, got {gaddr:#x}, {saddr:#x}, {n}")
        source = _block_smem().view(np.uint8)[saddr:saddr + n].copy()  # what the copy may read from now on
        _bulk_pending().append([saddr, n, source, False, lambda src: write(gaddr, src)])

    def bulk_store(gaddr, saddr, nbytes):
        _bulk_issue("bulk_store", gaddr, saddr, nbytes, _write_global)

    def bulk_reduce_add_f32(gaddr, saddr, nbytes):
        _bulk_issue("bulk_reduce_add_f32", gaddr, saddr, nbytes, _add_global_f32)

    def _copy_target(what: str, gaddr: int, n: int, dtype=None):
        """(the array elem_addr was given that holds gaddr, gaddr's byte offset in it) for a copy of n bytes: a
        contiguous array (of `dtype` where given) that the copy stays inside."""
        with _warp_lock:
            base, a = next(((b, x) for b, x in _ADDRS.items() if b <= gaddr < b + max(x.nbytes, 1)), (None, None))
        if a is None:
            raise RuntimeError(f"{what}: {gaddr:#x} is not inside an array elem_addr was given")
        if not a.flags.c_contiguous or (dtype is not None and a.dtype != dtype) or gaddr + n > base + a.nbytes:
            kind = f"contiguous {np.dtype(dtype).name} array" if dtype is not None else "contiguous array"
            raise RuntimeError(f"{what} emulation: a {kind}, the copy inside it")
        return a, gaddr - base

    def _add_global_f32(gaddr: int, source: np.ndarray) -> None:
        a, at = _copy_target("bulk_reduce_add_f32", gaddr, len(source), np.float32)
        with _warp_lock:  # the adds of several threads' copies to one row
            a.reshape(-1)[at // 4:(at + len(source)) // 4] += source.view(np.float32)

    def _write_global(gaddr: int, source: np.ndarray) -> None:
        a, at = _copy_target("bulk_store", gaddr, len(source))
        a.reshape(-1).view(np.uint8)[at:at + len(source)] = source

    def _bulk_pending() -> list:
        th = threading.current_thread()
        pending = getattr(th, "_falower_bulk", None)
        if pending is None:
            pending = th._falower_bulk = []
            th._falower_exit_checks = [*getattr(th, "_falower_exit_checks", ()), _bulk_left]
        return pending

    _TENSOR_MAPS: dict = {}  # the simulator's tensor maps: key -> (array, dims, byte strides, box, swizzle)

    def sim_tensor_map(array, dims, strides, box, swizzle: int = 128) -> np.ndarray:
        """The simulator's stand-in for a CUtensorMap: 128 bytes holding SIM_MAP_MAGIC and a key to the
        description (a C-contiguous array; dims and box innermost first, in elements; `strides` the bytes between
        consecutive indices of dims 1 ..; `swizzle` 128 or 0 bytes), as tensor_maps.py makes it on the host."""
        a = np.asarray(array)
        if not a.flags.c_contiguous:
            raise ValueError("sim_tensor_map: a C-contiguous array")
        if swizzle not in (0, 128) or (swizzle and box[0] * 2 != 128):
            raise ValueError(f"sim_tensor_map: 16-bit boxes of 128-byte rows under the 128-byte swizzle, got "
                             f"box {tuple(box)}, swizzle {swizzle}")
        # what the driver's encode refuses (tensor_maps.encode_map), so a kernel the GPU could not run fails here too
        if any(int(st) <= 0 or int(st) % 16 for st in strides) or any(not 0 < int(b) <= 256 for b in box):
            raise ValueError(f"sim_tensor_map: byte strides must be positive multiples of 16 and a box's sides at "
                             f"most 256, got strides {tuple(strides)}, box {tuple(box)}")
        with _warp_lock:
            key = len(_TENSOR_MAPS) + 1
            _TENSOR_MAPS[key] = (a, tuple(int(d) for d in dims), tuple(int(s) for s in strides),
                                 tuple(int(b) for b in box), int(swizzle))
        m = np.zeros(16, np.uint64)
        m[0], m[1] = SIM_MAP_MAGIC, key
        return m.view(np.uint8)

    def _sim_map(maddr: int):
        with _warp_lock:
            base, a = next(((b, x) for b, x in _ADDRS.items() if b <= maddr < b + max(x.nbytes, 1)), (None, None))
        if a is None or maddr != base or a.nbytes < 16:
            raise RuntimeError(f"tma copy: the map address {maddr:#x} is not a simulated tensor map's (elem_addr of "
                               "sim_tensor_map's array)")
        words = np.ascontiguousarray(a).reshape(-1).view(np.uint8)[:16].view(np.uint64)
        if int(words[0]) != SIM_MAP_MAGIC or int(words[1]) not in _TENSOR_MAPS:
            raise RuntimeError("tma copy: the map's bytes are not a simulated tensor map (sim_tensor_map)")
        return _TENSOR_MAPS[int(words[1])]

    def tensormap_acquire(maddr):
        _sim_map(int(maddr))

    def tensormap_prefetch(maddr):
        _sim_map(int(maddr))

    def _tma_map(maddr, rank: int, saddr: int, what: str):
        """The simulated map at maddr, checked for `rank` and the shared box's alignment at saddr."""
        a, dims, strides, box, swizzle = _sim_map(int(maddr))
        if len(dims) != rank:
            raise RuntimeError(f"{what}: a map of rank {rank}, got {len(dims)}")
        if saddr % (1024 if swizzle else 128):
            raise ValueError(f"{what}: the shared box at {saddr:#x} is not {1024 if swizzle else 128}-byte aligned")
        return a, dims, strides, box, swizzle

    def _box_rows(dims, strides, box, coords, isz: int):
        """Each row r of a box (its rows running over dims 1 .., innermost first) with the (element, byte offset in
        the tensor) of its elements inside the tensor: none for a row outside it."""
        for r in range(int(np.prod(box[1:]))):
            idx, rest = [], r
            for d in range(1, len(dims)):
                idx.append(coords[d] + rest % box[d])
                rest //= box[d]
            if not all(0 <= i < n for i, n in zip(idx, dims[1:])):
                yield r, []
                continue
            base = sum(i * st for i, st in zip(idx, strides))
            yield r, [(e, (coords[0] + e) * isz + base) for e in range(box[0]) if 0 <= coords[0] + e < dims[0]]

    def _swizzle_row(row: np.ndarray, r: int, swizzle: int) -> np.ndarray:
        """A box row between its tensor order and its shared layout: under the 128-byte swizzle chunk k lies at chunk
        k ^ (r & 7) (the box 1024-byte aligned); the permutation is its own inverse."""
        if not swizzle:
            return row
        return row.reshape(-1, 16)[np.arange(len(row) // 16) ^ (r & 7)].reshape(-1)

    def tma_store_3d(maddr, c0, c1, c2, saddr):
        if min(int(c0), int(c1), int(c2)) < 0:  # the loads' zero fill takes negative coordinates, the stores do not
            raise RuntimeError(f"tma_store_3d at a negative coordinate {(int(c0), int(c1), int(c2))}: the H200 "
                               "raises CUDA_ERROR_ILLEGAL_INSTRUCTION there (2026-11-29)")
        saddr = int(saddr)
        a, dims, strides, box, swizzle = _tma_map(maddr, 3, saddr, "tma_store_3d")
        isz = a.itemsize
        row_bytes = box[0] * isz
        n = int(np.prod(box[1:])) * row_bytes
        source = _block_smem().view(np.uint8)[saddr:saddr + n].copy()

        def write(src: np.ndarray) -> None:
            raw = a.reshape(-1).view(np.uint8)
            for r, elems in _box_rows(dims, strides, box, (int(c0), int(c1), int(c2)), isz):  # outside: not written
                row = _swizzle_row(src[r * row_bytes:(r + 1) * row_bytes], r, swizzle)
                for e, at in elems:
                    raw[at:at + isz] = row[e * isz:(e + 1) * isz]

        _bulk_pending().append([saddr, n, source, False, write])

    def tma_load_4d(sdst, maddr, c0, c1, c2, c3, mbar):
        """The box is read from the tensor at the issue and lands, its bytes completing on the mbarrier, when a
        thread next waits on that barrier (`_MBarrier.land`)."""
        sdst = int(sdst)
        a, dims, strides, box, swizzle = _tma_map(maddr, 4, sdst, "tma_load_4d")
        raw = a.reshape(-1).view(np.uint8)
        isz = a.itemsize
        row_bytes = box[0] * isz
        data = np.empty(int(np.prod(box[1:])) * row_bytes, np.uint8)
        for r, elems in _box_rows(dims, strides, box, (int(c0), int(c1), int(c2), int(c3)), isz):
            row = np.zeros(row_bytes, np.uint8)  # elements outside the tensor: zeros
            for e, at in elems:
                row[e * isz:(e + 1) * isz] = raw[at:at + isz]
            data[r * row_bytes:(r + 1) * row_bytes] = _swizzle_row(row, r, swizzle)
        bar = _mbar(mbar)
        with bar.cond:
            bar.loads.append((_block_smem().view(np.uint8), sdst, data))
            # one waiter already asleep lands it (_MBarrier.land) now, not a poll later; its landing wakes the rest
            bar.cond.notify()

    def tma_load_4d_hint(sdst, maddr, c0, c1, c2, c3, mbar, policy):
        """tma_load_4d: the simulator has no L2 whose eviction the policy would order."""
        tma_load_4d(sdst, maddr, c0, c1, c2, c3, mbar)

    def tma_store_3d_hint(maddr, c0, c1, c2, saddr, policy):
        """tma_store_3d: the simulator has no L2 whose eviction the policy would order."""
        tma_store_3d(maddr, c0, c1, c2, saddr)

    def l2_evict_last():
        return np.uint64(0)

    def l2_evict_first():
        return np.uint64(0)

    def bulk_commit():
        for copy in getattr(threading.current_thread(), "_falower_bulk", None) or ():
            copy[3] = True

    def bulk_wait0():
        bulk_wait_read0()  # the emulation writes at the wait: read and written at once

    def bulk_wait_read0():
        pending = getattr(threading.current_thread(), "_falower_bulk", None)
        if not pending:
            return
        if not all(copy[3] for copy in pending):
            raise RuntimeError("bulk_wait_read0: a bulk copy was issued but not committed (bulk_commit)")
        slow_warp()  # a warp that is late to read lets the others run on to the staged rows
        smem = _block_smem().view(np.uint8)
        for saddr, n, source, _, write in pending:
            if not np.array_equal(smem[saddr:saddr + n], source):
                raise RuntimeError(f"bulk copy from shared byte {saddr}: its source changed between the copy's "
                                   "issue and its wait (a race: the GPU may read either)")
            write(source)
        pending.clear()

    @_functools.lru_cache(maxsize=None)
    def setmaxnreg_inc(n: int):
        _check_maxnreg(n)
        return lambda: None

    @_functools.lru_cache(maxsize=None)
    def setmaxnreg_dec(n: int):
        _check_maxnreg(n)
        return lambda: None

else:
    import functools as _functools

    def _addr_asm(name: str, ptx: str, nargs: int, ret=None, arg_types: tuple = ()):
        """An intrinsic of `nargs` u32 arguments (the first a shared address) around one asm; `ret` a Numba type
        for one "=r" result ($0; the arguments follow), else void. `arg_types`: the arguments' types instead (a
        64-bit integer, a generic address, goes in an "l" register; an f32 in an "f" one, an f64 in a "d")."""
        targets = list(arg_types) or [_U32] * nargs

        def typer(typingctx, *args):
            if len(args) != nargs:
                raise TypeError(f"{name} takes {nargs} arguments")
            sig = (ret or types.void)(*args)

            def codegen(context, builder, sig, llargs):
                vals = _cast_all(context, builder, sig, llargs, targets)
                ins = [("d" if t.bitwidth == 64 else "f") if isinstance(t, types.Float) else
                       "l" if t.bitwidth == 64 else "r" for t in targets]
                cons = ",".join((["=r"] if ret else []) + ins + ["~{memory}"])
                res = _asm(context, builder, ptx, cons, vals, [ret] if ret else [], side_effect=True)
                return res if ret else context.get_dummy_value()

            return sig, codegen

        # @intrinsic reads the typer's parameter list: one named parameter per argument
        params = ", ".join(f"a{i}" for i in range(nargs))
        ns = {"typer": typer}
        exec(f"def {name}(typingctx, {params}):\n    return typer(typingctx, {params})", ns)
        return intrinsic(ns[name])

    mbar_init = _addr_asm("mbar_init", "mbarrier.init.shared::cta.b64 [$0], $1;", 2)
    mbar_arrive = _addr_asm("mbar_arrive", "{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [$0]; }", 1)
    mbar_arrive_expect_tx = _addr_asm(
        "mbar_arrive_expect_tx", "{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1; }", 2)
    mbar_try_wait = _addr_asm(
        "mbar_try_wait",
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }", 2,
        ret=types.uint32)
    mbar_wait = _addr_asm(
        "mbar_wait",
        "{ .reg .pred p; FALOWER_MBAR_WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1; "
        "@!p bra FALOWER_MBAR_WAIT; }", 2)
    cp_async_mbar_arrive_noinc = _addr_asm(
        "cp_async_mbar_arrive_noinc", "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", 1)
    bar_sync = _addr_asm("bar_sync", "bar.sync $0, $1;", 2)
    mapa_shared = _addr_asm(  # the shared::cluster address of shared byte address $1 in the cluster's block $2
        "mapa_shared", "mapa.shared::cluster.u32 $0, $1, $2;", 2, ret=types.uint32)
    st_async_v4_u32 = _addr_asm(  # four words to the shared::cluster address $0, counted on the mbarrier at $5
        "st_async_v4_u32", "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [$0], {$1, $2, $3, $4}, [$5];",
        6)
    st_async_f32 = _addr_asm(  # an f32 to the shared::cluster address $0, counted on the mbarrier at $2
        "st_async_f32", "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [$0], $1, [$2];", 3,
        arg_types=(_U32, types.float32, _U32))
    mbar_wait_cluster = _addr_asm(
        "mbar_wait_cluster",
        "{ .reg .pred p; FALOWER_MBAR_WAITC: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$0], $1; "
        "@!p bra FALOWER_MBAR_WAITC; }", 2)
    syncwarp = _void_asm_intrinsic("syncwarp", "bar.warp.sync 0xffffffff;")
    bulk_commit = _void_asm_intrinsic("bulk_commit", "cp.async.bulk.commit_group;")
    bulk_wait_read0 = _void_asm_intrinsic("bulk_wait_read0", "cp.async.bulk.wait_group.read 0;")
    bulk_wait0 = _void_asm_intrinsic("bulk_wait0", "cp.async.bulk.wait_group 0;")
    bulk_store = _addr_asm(  # nbytes from the shared byte address $1 to the generic address $0 (async proxy)
        "bulk_store", "{ .reg .u64 ga; cvta.to.global.u64 ga, $0; cp.async.bulk.global.shared::cta.bulk_group [ga], "
        "[$1], $2; }", 3, arg_types=(types.uint64, _U32, _U32))
    bulk_reduce_add_f32 = _addr_asm(  # nbytes of f32 from shared $1 added into the generic address $0 (async proxy)
        "bulk_reduce_add_f32", "{ .reg .u64 ga; cvta.to.global.u64 ga, $0; cp.reduce.async.bulk.global.shared::cta."
        "bulk_group.add.f32 [ga], [$1], $2; }", 3, arg_types=(types.uint64, _U32, _U32))
    bar_arrive = _addr_asm("bar_arrive", "bar.arrive $0, $1;", 2)
    stsm_x4 = _addr_asm(  # ldsm_x4's inverse: four 8 x 8 matrices of 16-bit pairs, lane 8 m + r row r's address
        "stsm_x4", "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};", 5)
    tma_store_3d = _addr_asm(  # the box at ($1, $2, $3) of the map at the generic address $0, from shared $4
        "tma_store_3d", "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [$0, {$1, $2, $3}], [$4];", 5,
        arg_types=(types.uint64, types.int32, types.int32, types.int32, _U32))
    tma_load_4d = _addr_asm(  # the box at ($2 .. $5) of the map at $1 into shared $0, its bytes completing on $6
        "tma_load_4d", "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [$0], "
        "[$1, {$2, $3, $4, $5}], [$6];", 7,
        arg_types=(_U32, types.uint64, types.int32, types.int32, types.int32, types.int32, _U32))
    tma_load_4d_hint = _addr_asm(  # tma_load_4d whose lines take the L2 eviction priority of the policy $7
        "tma_load_4d_hint", "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".L2::cache_hint [$0], [$1, {$2, $3, $4, $5}], [$6], $7;", 8,
        arg_types=(_U32, types.uint64, types.int32, types.int32, types.int32, types.int32, _U32, types.uint64))

    tma_store_3d_hint = _addr_asm(  # tma_store_3d whose lines take the L2 eviction priority of the policy $5
        "tma_store_3d_hint", "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [$0, {$1, $2, "
        "$3}], [$4], $5;", 6, arg_types=(types.uint64, types.int32, types.int32, types.int32, _U32, types.uint64))

    def _policy(name: str, priority: str):
        @intrinsic
        def policy(typingctx):
            def codegen(context, builder, sig, args):
                return _asm(context, builder, f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;", "=l", [],
                            [types.uint64], side_effect=False)

            return types.uint64(), codegen

        policy.__name__ = name
        return policy

    l2_evict_last = _policy("l2_evict_last", "evict_last")
    l2_evict_first = _policy("l2_evict_first", "evict_first")
    tensormap_acquire = _addr_asm("tensormap_acquire", "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", 1,
                                  arg_types=(types.uint64,))
    tensormap_prefetch = _addr_asm("tensormap_prefetch", "prefetch.tensormap [$0];", 1, arg_types=(types.uint64,))

    def sim_tensor_map(array, dims, strides, box, swizzle: int = 128):
        raise RuntimeError("sim_tensor_map: the simulator's; on a GPU tensor_maps.py encodes a CUtensorMap")

    @intrinsic
    def warp_uniform(typingctx, x):
        def codegen(context, builder, sig, args):
            (v,) = _cast_all(context, builder, sig, args, [types.int32])
            return _asm(context, builder, "shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r", [v], [types.int32],
                        side_effect=True)

        return types.int32(x), codegen

    @_functools.lru_cache(maxsize=None)
    def setmaxnreg_inc(n: int):
        return _void_asm_intrinsic(f"setmaxnreg_inc{n}", f"setmaxnreg.inc.sync.aligned.u32 {_check_maxnreg(n)};")

    @_functools.lru_cache(maxsize=None)
    def setmaxnreg_dec(n: int):
        return _void_asm_intrinsic(f"setmaxnreg_dec{n}", f"setmaxnreg.dec.sync.aligned.u32 {_check_maxnreg(n)};")
