"""The LSE merge on the GPU: falower.ir.lse_merge's formula as one small kernel, 16 bytes of a row a thread.

What a split-kv forward runs after its parts, and what a context-parallel forward runs after gathering each rank's
O and LSE: `lse_merge(o_parts, lse_parts)` takes o_parts [P, ..., M, D] (f32) and lse_parts [P, ..., M] (f32,
natural log, -inf where a part saw no key) and returns O [..., M, D] (f32, or `out_dtype`) and LSE [..., M]. The
arithmetic is the IR's, in its order (max, the weights exp(lse_p - m), their sum, each part's share w_p / s, the
shares' sum of O): tests/backend/test_lse_merge_simulator.py holds it to the interpreter's lse_merge_func.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import numpy as np
from numba import cuda

THREADS = 128  # a block's threads; each takes `vec` consecutive elements of one row (merge_vec), a row's D / vec


def merge_vec(D: int, part_bytes: int) -> int:
    """Elements a thread merges: one 16-byte load a part (4 f32, 8 16-bit words) where D is a multiple of that,
    else 1. The arrays must then start 16-byte aligned (the callers' check): every row and chunk offset is."""
    vec = 16 // part_bytes
    return vec if D % vec == 0 else 1


def merge_grid(rows: int, D: int, vec: int) -> tuple[int, int]:
    """(blocks, threads) of a merge over `rows` rows of D elements, `vec` a thread."""
    return -(-(rows * (D // vec)) // THREADS), THREADS


@functools.lru_cache(maxsize=None)
def _identity() -> Any:
    @cuda.jit(device=True)
    def same(x):
        return x

    return same


def _sixteen_bit(dtype: str, who: str) -> tuple[Any, Any, Any]:
    """(widen to f32, narrow from f32, pack two f32) of the 16-bit `dtype` (f16 / bf16); else `who` refuses it."""
    from .intrinsics import bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, pack_bf16x2, pack_f16x2

    if dtype not in ("f16", "bf16"):
        raise ValueError(f"{who}: dtype must be f16 or bf16, got {dtype!r}")
    return (f16_to_f32, f32_to_f16, pack_f16x2) if dtype == "f16" else (bf16_to_f32, f32_to_bf16, pack_bf16x2)


@functools.lru_cache(maxsize=None)
def _plain_load() -> Any:
    @cuda.jit(device=True)
    def load(arr, i):
        return arr[i]

    return load


@functools.lru_cache(maxsize=None)
def _shares(parts: int, load_lse: Any) -> Any:
    """`shares(lse_parts, rows, row, a)`: a[p] = w_p / s' for row `row` of lse_parts [parts, rows] (read through
    `load_lse(arr, index)`), w_p = exp(lse_p - m'), m' the parts' max LSE or 0 where every part is -inf, s' their sum
    or 1 where it is 0; returns the row's LSE, m' + log s (-inf where s is 0). The IR's order (lse_merge_func)."""
    neg_inf = np.float32(-math.inf)

    @cuda.jit(device=True)
    def shares(lse_parts, rows, row, a):
        m = neg_inf
        for p in range(parts):
            a[p] = load_lse(lse_parts, p * rows + row)
            m = max(m, a[p])
        m_safe = np.float32(0.0) if m == neg_inf else m
        s = np.float32(0.0)
        for p in range(parts):
            a[p] = math.exp(a[p] - m_safe)
            s += a[p]
        s_safe = np.float32(1.0) if s == 0 else s  # NaN stays NaN (a NaN or +inf part), as the IR's merge
        for p in range(parts):
            a[p] = a[p] / s_safe
        return neg_inf if s == 0 else m_safe + math.log(s)

    return shares


@functools.lru_cache(maxsize=None)
def _merge(parts: int, vec: int, load: Any, store: Any, programmatic: bool = False) -> Any:
    """`merge(o_parts, lse_parts, o, lse, rows, D)` on flat arrays: o_parts [parts, rows, D] (each element through
    `load` to f32), lse_parts [parts, rows] f32, o [rows, D] (each through `store` from f32), lse [rows] f32. Each
    row's shares (`_shares`), then its O as their weighted sum. A thread takes `vec` consecutive elements of a row:
    with vec > 1 one 16-byte load a part and one store (ldg_vec / stg_vec), every part's load independent of the
    shares, so a thread waits for memory about once. Each thread computes its row's shares itself (parts exps; the
    LSE loads are one transaction for the row's threads). Launch with merge_grid(rows, D, vec). `programmatic`: the
    kernel may be launched to depend programmatically on the kernel that wrote the parts (runtime._launcher), so it
    waits for it first (griddep_wait: sm_90, split-kv's merge only; `falower.lse_merge` runs on any CUDA GPU)."""
    from .intrinsics import griddep_wait, ldg_vec, stg_vec

    shares = _shares(parts, _plain_load())

    if vec == 1:
        @cuda.jit(device=True)
        def accumulate(o_parts, a, acc, base, step):
            for p in range(parts):
                acc[0] += a[p] * load(o_parts[base + p * step])

        @cuda.jit(device=True)
        def put(o, at, acc):
            o[at] = store(acc[0])
    else:
        @cuda.jit(device=True)
        def accumulate(o_parts, a, acc, base, step):
            for p in range(parts):
                x = ldg_vec(o_parts, base + p * step)
                for j in range(vec):
                    acc[j] += a[p] * load(x[j])

        if vec == 8:
            @cuda.jit(device=True)
            def put(o, at, acc):
                stg_vec(o, at, (store(acc[0]), store(acc[1]), store(acc[2]), store(acc[3]), store(acc[4]),
                                store(acc[5]), store(acc[6]), store(acc[7])))
        else:
            @cuda.jit(device=True)
            def put(o, at, acc):
                stg_vec(o, at, (store(acc[0]), store(acc[1]), store(acc[2]), store(acc[3])))

    @cuda.jit
    def merge(o_parts, lse_parts, o, lse, rows, D):
        if programmatic:
            griddep_wait()  # launched while split-kv's kernel runs (programmatic): its parts complete first
        per_row = D // vec
        t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        row = t // per_row
        chunk = t - row * per_row
        if row < rows:
            a = cuda.local.array(parts, np.float32)
            row_lse = shares(lse_parts, rows, row, a)
            acc = cuda.local.array(vec, np.float32)
            for j in range(vec):
                acc[j] = np.float32(0.0)
            accumulate(o_parts, a, acc, row * D + chunk * vec, rows * D)
            put(o, row * D + chunk * vec, acc)
            if chunk == 0:
                lse[row] = row_lse

    return merge


@functools.lru_cache(maxsize=None)
def _merged_chunk(parts: int, dtype: str, load_words: Any, load_lse: Any) -> Any:
    """`merged(src, base, step, lses, lse_rows, lse_row, o, lse, row, at, first)`: the in-kernel merges' one unit
    (fused_merge_unit, cluster_merge_unit, pushed_merge_unit), which differ only in where a part's words and LSE
    are. It loads each part p's 16 bytes of O, `load_words(src, base, step, p)` (4 words of 8 elements), into a
    local array, then the shares (`_shares` over `load_lse(lses, p * lse_rows + lse_row)`), then writes o's 16 bytes
    at its 4-byte word `at` (words of two 16-bit `dtype` halves) = the sum over parts p, in order, of a[p] times part
    p's 8 elements, and lse[row] where `first`. The O loads go before the shares' loads and arithmetic, so every
    part's words and LSE are in flight at once: one round trip to the other blocks' memory, not two."""
    from .intrinsics import stg_vec

    widen, _, pack = _sixteen_bit(dtype, "the merge in the kernel")
    shares = _shares(parts, load_lse)
    words = 4 * parts  # (a constant: a local array's length must be one for Numba's CUDA target)

    @cuda.jit(device=True)
    def loads(src, base, step, wd):
        for p in range(parts):
            w = load_words(src, base, step, p)
            for j in range(4):
                wd[4 * p + j] = np.uint32(w[j])

    @cuda.jit(device=True)
    def weighted(wd, a, o, at):
        acc = cuda.local.array(8, np.float32)
        for j in range(8):
            acc[j] = np.float32(0.0)
        for p in range(parts):
            for j in range(4):
                acc[2 * j] += a[p] * widen(np.uint16(wd[4 * p + j] & np.uint32(0xFFFF)))
                acc[2 * j + 1] += a[p] * widen(np.uint16(wd[4 * p + j] >> np.uint32(16)))
        stg_vec(o, at, (np.int32(pack(acc[0], acc[1])), np.int32(pack(acc[2], acc[3])),
                        np.int32(pack(acc[4], acc[5])), np.int32(pack(acc[6], acc[7]))))

    @cuda.jit(device=True)
    def merged(src, base, step, lses, lse_rows, lse_row, o, lse, row, at, first):
        wd = cuda.local.array(words, np.uint32)
        loads(src, base, step, wd)
        a = cuda.local.array(parts, np.float32)
        row_lse = shares(lses, lse_rows, lse_row, a)
        weighted(wd, a, o, at)
        if first:
            lse[row] = row_lse

    return merged


@functools.lru_cache(maxsize=None)
def fused_merge_unit(parts: int, dtype: str) -> Any:
    """The merge split-kv's kernel runs itself in the last part of a q tile to finish (emit_fa3_ws.fused_merge):
    `unit(o_parts, lse_parts, o, lse, rows, D, row, chunk)` merges 8 elements, chunk `chunk` of row `row`, the arrays
    the kernel's own (o_parts and o as 4-byte words of two 16-bit `dtype` halves: [parts, rows, D / 2] and
    [rows, D / 2]; lse_parts [parts, rows], lse [rows]; D a multiple of 8, the arrays 16-byte aligned); chunk 0
    writes the row's LSE. The arithmetic is `_merge`'s (`_shares`, then each part's weighted O in order); the parts'
    reads by ld.global.cg (the other parts' SMs wrote them: never a stale L1 line)."""
    from .intrinsics import ldg_cg_f32, ldg_cg_vec

    @cuda.jit(device=True)
    def load_words(o_parts, base, step, p):
        return ldg_cg_vec(o_parts, base + p * step)

    merged = _merged_chunk(parts, dtype, load_words, ldg_cg_f32)

    @cuda.jit(device=True)
    def unit(o_parts, lse_parts, o, lse, rows, D, row, chunk):
        half_d = D // 2
        at = row * half_d + chunk * 4  # part p's chunk at word at + p rows D / 2
        merged(o_parts, at, rows * half_d, lse_parts, rows, row, o, lse, row, at, chunk == 0)

    return unit


@functools.lru_cache(maxsize=None)
def cluster_merge_unit(parts: int, dtype: str) -> Any:
    """The merge a cluster's blocks run over their shared memory (emit_fa3_ws.cluster_merge): `unit(lse_addr,
    o_addr, o, lse, D, row, chunk)` merges 8 elements, chunk `chunk` of row `row` of the call's O (4-byte words of
    two 16-bit `dtype` halves, [rows, D / 2]) and LSE, from each rank p's f32 LSE of the row at shared byte address
    lse_addr and its 16 staged bytes of O at o_addr (the same addresses in every block of the cluster, read by
    mapa and ld.shared::cluster); chunk 0 writes the row's LSE. The arithmetic is fused_merge_unit's
    (`_merged_chunk`)."""
    from .intrinsics import ld_cluster_f32, ld_cluster_v4_u32, mapa_shared

    @cuda.jit(device=True)
    def load_lse(addr, p):
        return ld_cluster_f32(mapa_shared(addr, p))

    @cuda.jit(device=True)
    def load_words(o, addr, step, p):  # (o and step unused: rank p's words are at addr in its shared memory)
        return ld_cluster_v4_u32(mapa_shared(addr, p))

    merged = _merged_chunk(parts, dtype, load_words, load_lse)

    @cuda.jit(device=True)
    def unit(lse_addr, o_addr, o, lse, D, row, chunk):
        # (rank p's LSE at index p: load_lse(lse_addr, p))
        merged(o, o_addr, 0, lse_addr, 1, 0, o, lse, row, row * (D // 2) + chunk * 4, chunk == 0)

    return unit


@functools.lru_cache(maxsize=None)
def pushed_merge_unit(parts: int, dtype: str) -> Any:
    """The merge a cluster's blocks run once the other parts pushed their rows into them (emit_fa3_ws.cluster_push):
    `unit(lses, lse_rows, lse_row, o_addr, o_step, o, lse, D, row, chunk)` merges 8 elements, chunk `chunk` of row
    `row` of the call's O (4-byte words of two 16-bit `dtype` halves, [rows, D / 2]) and LSE, from part p's f32 LSE
    at lses[p * lse_rows + lse_row] (a shared array) and its 16 bytes of O at the shared byte address o_addr + p *
    o_step, all in this block's own shared memory. The arithmetic is cluster_merge_unit's (`_merged_chunk`)."""
    from .intrinsics import lds_v4_u32

    @cuda.jit(device=True)
    def load_words(src, addr, step, p):  # (src unused: part p's words are at addr + p step here)
        return lds_v4_u32(addr + p * step)

    merged = _merged_chunk(parts, dtype, load_words, _plain_load())

    @cuda.jit(device=True)
    def unit(lses, lse_rows, lse_row, o_addr, o_step, o, lse, D, row, chunk):
        merged(o, o_addr, o_step, lses, lse_rows, lse_row, o, lse, row, row * (D // 2) + chunk * 4, chunk == 0)

    return unit


@functools.lru_cache(maxsize=None)
def merge_kernel(parts: int, out_dtype: str, vec: int = 1) -> Any:
    """The jitted kernel for `parts` f32 parts (`_merge`'s arguments), O stored as `out_dtype` (f32, or f16 / bf16
    as 16-bit words), `vec` elements a thread (merge_vec(D, 4))."""
    from .intrinsics import f32_to_bf16, f32_to_f16

    store = _identity() if out_dtype == "f32" else f32_to_f16 if out_dtype == "f16" else f32_to_bf16
    return _merge(parts, vec, _identity(), store)


@functools.lru_cache(maxsize=None)
def split_merge_kernel(parts: int, dtype: str, vec: int = 1) -> Any:
    """The merge a split-kv forward runs after its kernel (runtime.FA2ForwardKernel, spec.kv_parts = `parts`):
    `_merge`'s kernel with o_parts and o the 16-bit words of `dtype` (f16 / bf16: the parts as the kernel's
    epilogue stored them, split-kv{part_dtype=...}), widened to f32 first as the IR's cast does; `vec` elements a
    thread (merge_vec(D, 2); the runtime's workspaces and O are 16-byte aligned)."""
    widen, narrow, _ = _sixteen_bit(dtype, "split_merge_kernel")
    return _merge(parts, vec, widen, narrow, programmatic=True)


def lse_merge(o_parts: Any, lse_parts: Any, out_dtype: Optional[str] = None) -> tuple[Any, Any]:
    """(O, LSE) of the parts (see the module docstring). numpy inputs give numpy outputs (through the device, or the
    simulator); torch CUDA tensors give torch tensors on their device. `out_dtype`: "f32" (default), "f16" or
    "bf16"."""
    out_dtype = out_dtype or "f32"
    if out_dtype not in ("f32", "f16", "bf16"):
        raise ValueError(f"lse_merge: out_dtype must be f32, f16 or bf16, got {out_dtype!r}")
    oshape, lshape = tuple(int(n) for n in o_parts.shape), tuple(int(n) for n in lse_parts.shape)
    if len(oshape) < 3 or oshape[:-1] != lshape:
        raise ValueError(f"lse_merge: o_parts {oshape} must be lse_parts {lshape} with one more (last) axis, and "
                         "both at least [P, M]")
    P, D, rows = oshape[0], oshape[-1], int(np.prod(lshape[1:]))
    if P == 0 or D == 0:
        raise ValueError(f"lse_merge: o_parts {oshape} has no parts or an empty last axis (D)")
    torch_in = type(o_parts).__module__.startswith("torch")
    if torch_in:
        import torch

        if o_parts.dtype != torch.float32 or lse_parts.dtype != torch.float32:
            raise ValueError(f"lse_merge: the parts must be f32, got O {o_parts.dtype}, LSE {lse_parts.dtype}")
        dev = o_parts.device
        o_flat = o_parts.detach().contiguous().view(-1)
        o_in = cuda.as_cuda_array(o_flat)
        l_in = cuda.as_cuda_array(lse_parts.detach().contiguous().view(-1))
        tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[out_dtype]
        o_t = torch.empty(oshape[1:], dtype=tdt, device=dev)
        l_t = torch.empty(lshape[1:], dtype=torch.float32, device=dev)
        o_out = cuda.as_cuda_array(o_t.view(-1) if out_dtype == "f32" else o_t.view(torch.int16).view(-1))
        l_out = cuda.as_cuda_array(l_t.view(-1))
    else:
        o_np, l_np = np.asarray(o_parts), np.asarray(lse_parts)
        if o_np.dtype != np.float32 or l_np.dtype != np.float32:
            raise ValueError(f"lse_merge: the parts must be f32, got O {o_np.dtype}, LSE {l_np.dtype}")
        o_in = cuda.to_device(np.ascontiguousarray(o_np).reshape(-1))
        l_in = cuda.to_device(np.ascontiguousarray(l_np).reshape(-1))
        o_out = cuda.device_array(rows * D, dtype=np.float32 if out_dtype == "f32" else np.int16)
        l_out = cuda.device_array(rows, dtype=np.float32)
    if rows:
        vec = merge_vec(D, 4)
        if torch_in and o_flat.data_ptr() & 15:  # a view at an odd offset: scalar accesses
            vec = 1
        merge_kernel(P, out_dtype, vec)[merge_grid(rows, D, vec)](o_in, l_in, o_out, l_out, rows, D)
    if torch_in:
        return o_t, l_t
    o = o_out.copy_to_host()
    if out_dtype == "f16":
        o = o.view(np.float16)
    elif out_dtype == "bf16":  # numpy has no bf16: the words widened to f32
        o = (o.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return o.reshape(oshape[1:]), l_out.copy_to_host().reshape(lshape[1:])


__all__ = ["cluster_merge_unit", "fused_merge_unit", "lse_merge", "merge_grid", "merge_kernel", "merge_vec",
           "pushed_merge_unit", "split_merge_kernel"]
