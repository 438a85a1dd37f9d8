"""Hopper warpgroup MMA (wgmma) intrinsics for the Numba CUDA backend, and their Python emulations.

A sibling of `intrinsics.py` (which holds the mma.sync path): the same two-faced module. On a GPU each name is
a Numba `@intrinsic` whose code generation is one llvmlite `ir.InlineAsm`; numba-cuda builds for sm_90a on a
device of compute capability 9.0, which wgmma needs. Under `NUMBA_ENABLE_CUDASIM=1` the same names are Python
functions that follow the PTX layouts, so a kernel using them runs in the CUDA simulator (CI has no GPU).

A warpgroup is 4 consecutive warps (128 threads, the first warp's index a multiple of 4). In `m64nNk16`, warp
w of the warpgroup owns rows 16w .. 16w + 15 of A and D; inside a warp (lane, g = lane >> 2, t = lane & 3):
    D (f32, N/2 registers per thread):  d[4j + 0], d[4j + 1] = D[16w + g, 8j + 2t], D[16w + g, 8j + 2t + 1]
                                        d[4j + 2], d[4j + 3] = D[16w + g + 8, 8j + 2t], ...[.., 8j + 2t + 1]
    i.e. mma.sync's C fragment repeated along N: emit_fa2's score/softmax row helpers apply unchanged
    (one m16 fragment, N/8 n8 tiles).
    A from registers (4 x u32, two 16-bit values each, lower column in the low half): mma.sync's A fragment
                                        a0 = A[16w + g, 2t:2t+2], a1 = A[16w + g + 8, 2t:2t+2],
                                        a2 = A[16w + g, 2t+8:2t+10], a3 = A[16w + g + 8, 2t+8:2t+10]
    so the D registers of n8 tiles 2k and 2k + 1, packed to 16-bit pairs, are the A operand of k step k
    (FA2's register trick holds for wgmma: P never goes through shared memory).

Shared-memory operands are described by 64-bit matrix descriptors (PTX ISA, "Matrix Descriptor Format"):
bits 0-13 start address >> 4, 16-29 leading-dimension byte offset (LBO) >> 4, 32-45 stride-dimension byte
offset (SBO) >> 4, 49-51 base offset (0: atoms 1024-byte aligned), 62-63 swizzle (1 = 128 B, 2 = 64 B,
3 = 32 B, 0 = none). With a W-byte swizzle (W = 128 here), T = 8 16-bit elements per 16-byte chunk:
    K-major  (rows along M/N, K contiguous: Q and K tiles stored [rows, D]): element (mn, k) of one k16 step
             at  start + (mn % 8) * W + (mn // 8) * SBO + 2k;                    LBO unused (1)
    MN-major (M/N contiguous: V stored [kv rows, D] is the B operand of P V, N = D along a row):
             at  start + (mn % (W/2)) * 2 + (mn // (W/2)) * LBO + (k % 8) * W + (k // 8) * SBO
    and then the swizzle XORs address bits 4-6 with bits 7-9 (128 B; 64 B: bits 4-5 with 7-8; 32 B: 4 with 7)
    of the absolute shared address, which is why tiles sit at 1024-byte aligned addresses.
These are CUTLASS's canonical GMMA layouts (cute/atom/mma_traits_sm90_gmma.hpp, `make_gmma_desc`). One
storage serves all three attention operands: `[D // 64 column blocks][rows][64 elements]`, row r's 16-byte
chunk c at `r * 128 + ((c ^ (r & 7)) << 4)` inside its block (`swizzled_offset`). For a K-major operand, k step
s (16 columns) starts at `block(s // 4) + (s % 4) * 32` bytes (SBO = 1024); for the MN-major V, k step s (16 kv
rows) starts at `s * 2048` and the 64-column blocks are LBO = rows * 128 bytes apart.

Ordering (the emulation computes at issue time; on the GPU these are required):
    writes to shared memory by threads (st.shared, cp.async) -> `fence_proxy_async()` -> barrier -> wgmma
    register writes the wgmma reads (accumulators, A fragments) -> `wgmma_fence*` -> wgmma ... -> `wgmma_commit()`
    -> `wgmma_wait*` before reading D or overwriting the shared tiles the wgmmas read.

Public names (identical in both modes):
    wgmma_fence(), wgmma_commit(), wgmma_wait0(), wgmma_wait1()
    fence_proxy_async()                   generic-proxy shared writes visible to the async proxy (wgmma)
    wgmma_fence_regs(count)               -> f(acc, off): wgmma.fence with acc[off:off+count] passed through it,
                                          so the code that writes them cannot sink below the fence
    wgmma_wait_regs(pending, count)       -> f(acc, off): wgmma.wait_group `pending` with acc[off:off+count]
                                          passed through it, so reads of D cannot rise above the wait
    wgmma_ss(kind, n, trans_a=0, trans_b=0)
                                          -> f(acc, off, desc_a, desc_b, scale_d): acc[off:off+n/2] =
                                          A B (+ acc if scale_d), A [64,16] and B [16,n] from shared memory
    wgmma_rs(kind, n, trans_b=0)          -> f(acc, off, a0, a1, a2, a3, desc_b, scale_d): A from registers
    cp_async_wait(n)                      -> f(): cp.async.wait_group n
    rcp_approx(x)                         f32 -> f32, rcp.approx.ftz (an IEEE `1 / x` is rcp.rn, which ptxas
                                          expands to a subroutine call: calls serialize every wgmma)
    opaque_u32(x)                         x as uint32, through an empty asm the compilers cannot see into: an address
                                          made opaque once per loop iteration keeps the descriptors built from it
                                          inside the loop (LLVM hoists loop-invariant descriptors, 2 registers
                                          each: the backward's K / V / dS^T ones were 64 registers across its loop)
    desc_hi(lbo_bytes, sbo_bytes, swizzle=128)   host: the constant upper bits of a descriptor (int)
    make_desc(hi, addr)                   device: hi | start address (shared byte address: u32)
    desc_word(hi, addr), desc_at(hi, w)   device: make_desc's low word (u32), and the descriptor of word w =
                                          desc_word(hi, addr) + (offset >> 4): one add a k step
    swizzled_offset(r, c)                 device/host: byte offset of row r, 16-byte chunk c in a 128 B-swizzled
                                          [rows, 64] block
    kind is "f16" or "bf16"; n a multiple of 8 up to 256; trans_* = 1 means that operand is MN-major.
    The factories cache: the same arguments give the same function.
    SIMULATOR                             True when the emulations are in use (FALOWER_SIM_SLOW_WARP=seconds: warp 1
                                          of each warpgroup sleeps before each operand read: intrinsics.slow_warp)
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from . import intrinsics as _intr
from .intrinsics import SIMULATOR, device_function

__all__ = [
    "SIMULATOR",
    "wgmma_fence",
    "wgmma_commit",
    "wgmma_wait0",
    "wgmma_wait1",
    "fence_proxy_async",
    "wgmma_fence_regs",
    "wgmma_wait_regs",
    "wgmma_ss",
    "wgmma_rs",
    "cp_async_wait",
    "rcp_approx",
    "opaque_u32",
    "desc_hi",
    "make_desc",
    "desc_word",
    "desc_at",
    "swizzled_offset",
    "SWIZZLE_CODES",
]

KINDS = ("f16", "bf16")
SWIZZLE_CODES = {128: 1, 64: 2, 32: 3, 0: 0}  # swizzle bytes -> descriptor bits 62-63


def _check(kind: str, n: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"wgmma kind must be one of {KINDS}, got {kind!r}")
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma n must be a multiple of 8 in [8, 256], got {n}")


def desc_hi(lbo_bytes: int, sbo_bytes: int, swizzle: int = 128) -> int:
    """The constant part of a shared-memory matrix descriptor: LBO, SBO, swizzle (base offset 0)."""
    for name, v in (("lbo", lbo_bytes), ("sbo", sbo_bytes)):
        if v % 16 or not 0 <= v >> 4 < 1 << 14:
            raise ValueError(f"descriptor {name} must be a multiple of 16 below 256 KB, got {v}")
    return (SWIZZLE_CODES[swizzle] << 62) | ((sbo_bytes >> 4) << 32) | ((lbo_bytes >> 4) << 16)


@device_function
def make_desc(hi, addr):
    """Descriptor of the operand at shared byte address `addr` (< 256 KB) with the upper bits `hi`. In 32 bits:
    Numba's addresses are 64-bit sums, and a 64-bit shift and mask cost the uniform pipe ~7 instructions a
    descriptor; through the truncation LLVM computes the sum in 32 bits too."""
    return np.int64(hi) | np.int64((np.uint32(addr) >> np.uint32(4)) & np.uint32(0x3FFF))


@device_function
def desc_word(hi, addr):
    """The low 32 bits of make_desc(hi, addr): the start address field and hi's LBO. A tile's descriptors are
    this word plus (byte offset >> 4) each (`desc_at`), one 32-bit add a wgmma instead of a descriptor apiece."""
    return np.uint32((np.uint32(addr) >> np.uint32(4)) & np.uint32(0x3FFF)) | np.uint32(hi & 0xFFFFFFFF)



@device_function
def swizzled_offset(r, c):
    """Byte offset of row r, 16-byte chunk c (0..7) in a [rows, 64] 16-bit block with the 128-byte swizzle."""
    return r * 128 + ((c ^ (r & 7)) << 4)


# --------------------------------------------------------------------------------------------------
# Operand decoding shared by the emulations (also used by the tests as the layout's definition)
# --------------------------------------------------------------------------------------------------


def operand_addresses(desc: int, rows: int, major: str) -> np.ndarray:
    """Byte addresses [rows, 16] of the elements (mn, k) of one k16 step of the operand `desc` describes.

    major "k": K contiguous (the default, trans = 0); "mn": M/N contiguous (trans = 1)."""
    d = int(desc)
    start = (d & 0x3FFF) << 4
    lbo = ((d >> 16) & 0x3FFF) << 4
    sbo = ((d >> 32) & 0x3FFF) << 4
    if (d >> 49) & 7:
        raise NotImplementedError("descriptor base offset != 0 is not emulated")
    code = (d >> 62) & 3
    width = {1: 128, 2: 64, 3: 32, 0: 0}[code]
    mn = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    if width == 0:  # interleaved 8x8 core matrices (8 rows of 16 bytes each)
        if major == "k":
            addr = start + (mn % 8) * 16 + (mn // 8) * sbo + (k % 8) * 2 + (k // 8) * lbo
        else:
            addr = start + (mn % 8) * 2 + (mn // 8) * sbo + (k % 8) * 16 + (k // 8) * lbo
        return addr
    if major == "k":
        addr = start + (mn % 8) * width + (mn // 8) * sbo + k * 2
    else:
        atom = width // 2  # 16-bit elements per swizzle row
        addr = start + (mn % atom) * 2 + (mn // atom) * lbo + (k % 8) * width + (k // 8) * sbo
    bits = {128: 7, 64: 3, 32: 1}[width]
    return addr ^ (((addr >> 7) & bits) << 4)


def _to_float(words: np.ndarray, kind: str) -> np.ndarray:
    w = np.asarray(words).astype(np.uint16)
    if kind == "f16":
        return w.view(np.float16).astype(np.float64)
    return (w.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


if SIMULATOR:

    def _thread():
        tid = threading.current_thread().thread_id
        lane = tid % 32
        return lane, (tid // 32) % 4, lane >> 2, lane & 3

    def _read_operand(desc, rows, major, kind):
        # each thread's wgmma reads shared memory when it is issued, while on the GPU a warp's wait returns when its
        # own part of the warpgroup's product is done: FALOWER_SIM_SLOW_WARP lets the other warps run ahead
        _intr.slow_warp()
        smem = _intr._block_smem()
        index, lo, hi = _operand_index(int(desc), rows, major)
        if lo < 0 or hi >= smem.size * smem.itemsize:
            raise IndexError(f"wgmma operand outside shared memory: bytes {lo}..{hi}")
        if smem.itemsize != 2:
            raise TypeError("the emulation reads a 16-bit dynamic shared array (registered by smem_base)")
        return _to_float(smem[index], kind)

    @functools.lru_cache(maxsize=4096)
    def _operand_index(desc, rows, major):
        """operand_addresses as 16-bit element indices, with its lowest and highest byte: a block's threads and
        tiles reuse a few descriptors, which each thread decoded on every wgmma (a third of a case's time)."""
        addr = operand_addresses(desc, rows, major)
        index = addr // 2
        index.flags.writeable = False
        return index, int(addr.min()), int(addr.max())

    def _accumulate(acc, off, rows2x16, b_nx16, n, scale_d, t):
        vals = rows2x16 @ b_nx16.T  # [2, n] in float64
        cols = 8 * np.arange(n // 8)[:, None] + 2 * t + np.arange(2)[None, :]
        d = np.concatenate([vals[0][cols], vals[1][cols]], axis=1).reshape(-1).astype(np.float32)
        o = int(off)
        if int(scale_d):
            acc[o : o + n // 2] = (d + acc[o : o + n // 2].astype(np.float32)).astype(np.float32)
        else:
            acc[o : o + n // 2] = d

    @functools.lru_cache(maxsize=None)
    def wgmma_ss(kind: str, n: int, trans_a: int = 0, trans_b: int = 0):
        _check(kind, n)

        def wgmma_ss_emul(acc, off, desc_a, desc_b, scale_d):
            lane, w, g, t = _thread()
            A = _read_operand(desc_a, 64, "mn" if trans_a else "k", kind)
            B = _read_operand(desc_b, n, "mn" if trans_b else "k", kind)
            _accumulate(acc, off, A[[16 * w + g, 16 * w + g + 8]], B, n, scale_d, t)

        wgmma_ss_emul.__name__ = f"wgmma_ss_{kind}_n{n}_t{trans_a}{trans_b}"
        return wgmma_ss_emul

    @functools.lru_cache(maxsize=None)
    def wgmma_rs(kind: str, n: int, trans_b: int = 0):
        _check(kind, n)

        def wgmma_rs_emul(acc, off, a0, a1, a2, a3, desc_b, scale_d):
            # the warp's 16 rows of A, built once for its 32 lanes
            lane, A = _intr._exchange_once((a0, a1, a2, a3),
                                           lambda frags: _intr.frag_a_tile(_intr.frag_halves(frags, kind)))
            B = _read_operand(desc_b, n, "mn" if trans_b else "k", kind)
            g, t = lane >> 2, lane & 3
            _accumulate(acc, off, A[[g, g + 8]], B, n, scale_d, t)

        wgmma_rs_emul.__name__ = f"wgmma_rs_{kind}_n{n}_t{trans_b}"
        return wgmma_rs_emul

    def _noop():
        pass

    wgmma_fence = wgmma_commit = wgmma_wait0 = wgmma_wait1 = fence_proxy_async = _noop

    @functools.lru_cache(maxsize=None)
    def wgmma_fence_regs(count: int):
        def fence_regs(acc, off):
            pass

        return fence_regs

    @functools.lru_cache(maxsize=None)
    def wgmma_wait_regs(pending: int, count: int):
        def wait_regs(acc, off):
            pass

        return wait_regs

    @functools.lru_cache(maxsize=None)
    def cp_async_wait(n: int):
        return _noop

    def opaque_u32(x):
        return np.uint32(int(x) & 0xFFFFFFFF)

    def desc_at(hi, word):
        return np.int64((int(hi) & ~0xFFFFFFFF) | (int(word) & 0xFFFFFFFF))

    def rcp_approx(x):
        with np.errstate(divide="ignore"):
            return np.float32(np.float32(1.0) / np.float32(x))

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _F32 = types.float32
    _U32 = types.uint32
    _I64 = types.int64
    _I32 = types.int32

    def _acc_pointers(context, builder, arrty, arr, off, offty, count):
        """Pointers to arr[off], ..., arr[off + count - 1] of a 1-D float32 array (local: SROA makes them registers).

        One GEP each from the array's data pointer (as intrinsics.py's `lget`/`lset`): cgutils' generic item
        pointer spilled the array struct to a stack slot and loaded its data, shape and strides again for every
        element, ~8 LLVM instructions each, 64 elements a call: 2/3 of the wgmma kernel's LLVM IR, which NVVM
        then folded away (benchmarks/NOTES.md, "Compile time", lever 16)."""
        if not (isinstance(arrty, types.Array) and arrty.ndim == 1 and arrty.dtype == _F32):
            raise TypeError(f"wgmma accumulators must be a 1-D float32 array, got {arrty}")
        data = builder.extract_value(arr, context.data_model_manager[arrty].get_field_position("data"))
        base = context.cast(builder, off, offty, types.intp)
        return [builder.gep(data, [builder.add(base, ir.Constant(base.type, i))], inbounds=True) for i in range(count)]

    def _asm_through_regs(context, builder, ptrs, ptx, extra_cons, extra_vals):
        """One inline asm whose first len(ptrs) operands are the f32 registers at ptrs, read and written in
        place ("+f": outputs tied to inputs), then `extra_vals`; stores the results back."""
        R = len(ptrs)
        olds = [builder.load(p) for p in ptrs]
        cons = ",".join(["=f"] * R + [str(i) for i in range(R)] + list(extra_cons) + ["~{memory}"])
        ret_ll = ir.LiteralStructType([ir.FloatType()] * R)
        fnty = ir.FunctionType(ret_ll, [v.type for v in olds] + [v.type for v in extra_vals])
        res = builder.call(ir.InlineAsm(fnty, ptx, cons, side_effect=True), olds + list(extra_vals))
        for i, p in enumerate(ptrs):
            builder.store(builder.extract_value(res, i), p)

    def _void_asm(name: str, ptx: str):
        def typer(typingctx):
            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, ptx, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return types.void(), codegen

        typer.__name__ = typer.__qualname__ = name
        return intrinsic(typer)

    wgmma_fence = _void_asm("wgmma_fence", "wgmma.fence.sync.aligned;")
    wgmma_commit = _void_asm("wgmma_commit", "wgmma.commit_group.sync.aligned;")
    wgmma_wait0 = _void_asm("wgmma_wait0", "wgmma.wait_group.sync.aligned 0;")
    wgmma_wait1 = _void_asm("wgmma_wait1", "wgmma.wait_group.sync.aligned 1;")
    fence_proxy_async = _void_asm("fence_proxy_async", "fence.proxy.async.shared::cta;")

    @functools.lru_cache(maxsize=None)
    def cp_async_wait(n: int):
        return _void_asm(f"cp_async_wait{n}", f"cp.async.wait_group {int(n)};")

    @intrinsic
    def opaque_u32(typingctx, x):
        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], _U32)
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
            return builder.call(ir.InlineAsm(fnty, "mov.b32 $0, $1;", "=r,r", side_effect=True), [v])

        return _U32(x), codegen

    @intrinsic
    def desc_at(typingctx, hi, word):
        """make_desc(hi, addr + off) from word = desc_word(hi, addr) + (off >> 4): the address stays below 256 KB
        (all of shared memory), so the 14-bit field never carries into LBO (bit 16 on; bits 14-15 are zero). One
        mov.b64 of two 32-bit halves: as a Numba sum the word stayed 64-bit (a carry add a k step), and the or with
        hi a 64-bit op."""
        def codegen(context, builder, sig, args):
            h = context.cast(builder, args[0], sig.args[0], _I64)
            w = context.cast(builder, args[1], sig.args[1], _U32)
            top = builder.trunc(builder.lshr(h, ir.Constant(h.type, 32)), ir.IntType(32))
            fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(32), ir.IntType(32)])
            return builder.call(ir.InlineAsm(fnty, "mov.b64 $0, {$1, $2};", "=l,r,r"), [w, top])

        return _I64(hi, word), codegen

    @intrinsic
    def rcp_approx(typingctx, x):
        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], _F32)
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
            return builder.call(ir.InlineAsm(fnty, "rcp.approx.ftz.f32 $0, $1;", "=f,f"), [v])

        return _F32(x), codegen

    def _regs_intrinsic(name: str, ptx: str, count: int):
        def typer(typingctx, acc, off):
            def codegen(context, builder, sig, args):
                ptrs = _acc_pointers(context, builder, sig.args[0], args[0], args[1], sig.args[1], count)
                _asm_through_regs(context, builder, ptrs, ptx, [], [])
                return context.get_dummy_value()

            return types.void(acc, off), codegen

        typer.__name__ = typer.__qualname__ = name
        return intrinsic(typer)

    @functools.lru_cache(maxsize=None)
    def wgmma_fence_regs(count: int):
        return _regs_intrinsic(f"wgmma_fence_regs{count}", "wgmma.fence.sync.aligned;", count)

    @functools.lru_cache(maxsize=None)
    def wgmma_wait_regs(pending: int, count: int):
        return _regs_intrinsic(f"wgmma_wait{pending}_regs{count}", f"wgmma.wait_group.sync.aligned {int(pending)};",
                               count)

    def _dlist(R: int) -> str:
        return "{" + ",".join(f"${i}" for i in range(R)) + "}"

    @functools.lru_cache(maxsize=None)
    def wgmma_ss(kind: str, n: int, trans_a: int = 0, trans_b: int = 0):
        _check(kind, n)
        R = n // 2
        # operands: $0..$R-1 D (outputs), $R..$2R-1 the same registers in (tied), $2R desc A, $2R+1 desc B, $2R+2 scale
        ptx = (
            f"{{ .reg .pred p; setp.ne.b32 p, ${2 * R + 2}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {_dlist(R)}, ${2 * R}, ${2 * R + 1}, "
            f"p, 1, 1, {int(trans_a)}, {int(trans_b)}; }}"
        )

        def typer(typingctx, acc, off, desc_a, desc_b, scale_d):
            def codegen(context, builder, sig, args):
                ptrs = _acc_pointers(context, builder, sig.args[0], args[0], args[1], sig.args[1], R)
                da = context.cast(builder, args[2], sig.args[2], _I64)
                db = context.cast(builder, args[3], sig.args[3], _I64)
                sc = context.cast(builder, args[4], sig.args[4], _I32)
                _asm_through_regs(context, builder, ptrs, ptx, ["l", "l", "r"], [da, db, sc])
                return context.get_dummy_value()

            return types.void(acc, off, desc_a, desc_b, scale_d), codegen

        typer.__name__ = typer.__qualname__ = f"wgmma_ss_{kind}_n{n}_t{trans_a}{trans_b}"
        return intrinsic(typer)

    @functools.lru_cache(maxsize=None)
    def wgmma_rs(kind: str, n: int, trans_b: int = 0):
        _check(kind, n)
        R = n // 2
        # operands: D out, D in (tied), $2R..$2R+3 A fragments, $2R+4 desc B, $2R+5 scale
        a = ",".join(f"${2 * R + i}" for i in range(4))
        ptx = (
            f"{{ .reg .pred p; setp.ne.b32 p, ${2 * R + 5}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {_dlist(R)}, {{{a}}}, ${2 * R + 4}, "
            f"p, 1, 1, {int(trans_b)}; }}"
        )

        def typer(typingctx, acc, off, a0, a1, a2, a3, desc_b, scale_d):
            def codegen(context, builder, sig, args):
                ptrs = _acc_pointers(context, builder, sig.args[0], args[0], args[1], sig.args[1], R)
                avals = [context.cast(builder, v, t, _U32) for v, t in zip(args[2:6], sig.args[2:6])]
                db = context.cast(builder, args[6], sig.args[6], _I64)
                sc = context.cast(builder, args[7], sig.args[7], _I32)
                _asm_through_regs(context, builder, ptrs, ptx, ["r", "r", "r", "r", "l", "r"], avals + [db, sc])
                return context.get_dummy_value()

            return types.void(acc, off, a0, a1, a2, a3, desc_b, scale_d), codegen

        typer.__name__ = typer.__qualname__ = f"wgmma_rs_{kind}_n{n}_t{trans_b}"
        return intrinsic(typer)
