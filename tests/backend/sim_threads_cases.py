"""The simulator's block manager after falower's intrinsics module is imported (sim_threads; run by
test_sim_threads.py with NUMBA_ENABLE_CUDASIM=1): barriers among the threads still running, the block-wide
votes, and a thread's exception raised by the launch. Prints one JSON line per case."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402 - the simulator: this script runs with NUMBA_ENABLE_CUDASIM=1
from sim_script import run_main  # noqa: E402

import falower.backends.numba_cuda.intrinsics  # noqa: E402,F401 - installs the block manager
from falower.backends.numba_cuda import sim_threads  # noqa: E402


@cuda.jit
def early_exit(out, rounds):
    """Threads 40.. return first; the others take `rounds` barriers, each round reading what every other thread
    wrote in the round before (a barrier that let one through early reads a stale round)."""
    buf = cuda.shared.array(64, np.int32)
    t = cuda.threadIdx.x
    if t >= 40:
        return
    for r in range(rounds):
        buf[t] = r * 100 + t
        cuda.syncthreads()
        s = 0
        for i in range(40):
            s += buf[i]
        cuda.syncthreads()
        if s != 40 * r * 100 + 780:
            out[cuda.blockIdx.x, t] += 1


@cuda.jit
def votes(out):
    t = cuda.threadIdx.x
    out[0, t] = cuda.syncthreads_count(t % 3 == 0)
    out[1, t] = cuda.syncthreads_and(t < 1000)
    out[2, t] = cuda.syncthreads_or(t == 17)
    out[3, t] = cuda.syncthreads_and(t != 5)


@cuda.jit
def raises(out):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    if t == 7 and cuda.blockIdx.x == 1:
        out[999999] = 1.0  # out of bounds: an IndexError in the simulator
    cuda.syncthreads()
    out[t] = t


from falower.backends.numba_cuda.intrinsics import (  # noqa: E402
    bulk_commit, bulk_store, bulk_wait_read0, elem_addr, lds_v4_u32, ldg_vec, stg_vec, mbar_arrive_expect_tx, mbar_init, mbar_try_wait,
    sim_tensor_map, smem_base, sts_u32, syncwarp, tensormap_acquire, tma_load_4d, tma_store_3d)


BULK_MODES = {"bulk": 0, "bulk-late": 1, "bulk-uncommitted": 2, "bulk-left": 3, "bulk-early": 4}


@cuda.jit
def bulk(out, mode):
    """A warp stages 64 words, lane 0 bulk-copies them to out[4:68] (16-byte aligned) and waits for the copy's
    read (mode 0). Wrong kernels: the warp writes the staging again before that wait (1), the copy is not committed
    (2), lane 0 returns without the wait (3), lane 0 issues before the other lanes have staged (4: no warp sync)."""
    sm = cuda.shared.array(64, np.uint32)
    sb = smem_base(sm)
    t = cuda.threadIdx.x
    sts_u32(sb + 8 * t, 1000)
    sts_u32(sb + 8 * t + 4, 1000)
    syncwarp()
    if mode != 4 or t > 0:
        sts_u32(sb + 8 * t, t + 1)
        sts_u32(sb + 8 * t + 4, t + 101)
    if mode != 4:
        syncwarp()
    if t == 0:
        bulk_store(elem_addr(out, (4,)), sb, 256)
        if mode != 2:
            bulk_commit()
    if mode == 4:
        if t == 0:
            sts_u32(sb, 1)
            sts_u32(sb + 4, 101)
        syncwarp()
    if mode == 1:
        syncwarp()
        sts_u32(sb + 8 * t, 0)
        syncwarp()
    if mode != 3:
        bulk_wait_read0()
    syncwarp()
    sts_u32(sb + 8 * t + 4, 0)  # after the wait: no effect on out


TMA_MODES = {"tma": 0, "tma-late": 1, "tma-unaligned": 2, "tma-not-a-map": 3}
TMA_SHAPE = (2, 20, 64)  # O's (slices, rows, columns) of 16-bit values, as tensor_maps.o_map_geometry lays O


@cuda.jit
def tma(omap, other, mode):
    """A warp stages a box of 16 rows x 64 16-bit values (value r * 64 + e + 1 at row r, column e) in the 128-byte
    swizzle (16-byte chunk c of row r at chunk c ^ (r & 7)) and lane 0 stores it by tma_store_3d at row 8 of slice
    0: rows 8-19 land, the box's last 4 rows lie past the slice's 20 (not written: slice 1 keeps its values).
    Wrong kernels: the box restaged before the wait (1), a shared address not 1024-byte aligned (2), a plain
    array's address as the map (3)."""
    sm = cuda.shared.array(1536, np.uint32)
    sb = (smem_base(sm) + np.uint32(1023)) & np.uint32(0xFFFFFC00)
    t = cuda.threadIdx.x
    for i in range(16):  # lane t: row t // 2, chunks 4 (t % 2) .. + 3, two 16-bit values a word
        r = t // 2
        c = (t % 2) * 4 + i // 4
        e = c * 8 + (i % 4) * 2
        sts_u32(sb + r * 128 + ((c ^ (r & 7)) << 4) + (i % 4) * 4, (r * 64 + e + 1) | ((r * 64 + e + 2) << 16))
    syncwarp()
    if t == 0:
        m = elem_addr(other, (0,)) if mode == 3 else elem_addr(omap, (0,))
        tensormap_acquire(m)
        tma_store_3d(m, 0, 8, 0, sb + 16 if mode == 2 else sb)
        bulk_commit()
    if mode == 1:
        syncwarp()  # after lane 0's issue
        sts_u32(sb, 0)
    bulk_wait_read0()


LOAD_SHAPE = (2, 3, 20, 64)  # K's (batch, heads, rows, columns) of 16-bit values


@cuda.jit
def tma_load(kmap, dump, ready):
    """Thread 0 announces 2048 bytes on an mbarrier of count 1 and loads the box of rows 8-23 of head 2, batch 1 by
    tma_load_4d (rows 20-23 past the tensor: zeros); ready[0] records whether the barrier's phase was done after the
    announce alone (it must not be: the bytes are not in), ready[1] after the copy, ready[2] the box's first word
    read between the copy's issue and any wait (the stage's old 0xDEAD: the simulator lands a load at a wait). The warp dumps the box as it lies
    (128-byte swizzled)."""
    sm = cuda.shared.array(1024, np.uint32)
    sb = (smem_base(sm) + np.uint32(1023)) & np.uint32(0xFFFFFC00)
    bar = sb + np.uint32(2048)
    t = cuda.threadIdx.x
    if t == 0:
        m = elem_addr(kmap, (0,))
        tensormap_acquire(m)
        mbar_init(bar, 1)
        sts_u32(sb, 0xDEAD)  # the stage's old bytes
        mbar_arrive_expect_tx(bar, 2048)
        ready[0] = mbar_try_wait(bar, 0)
        tma_load_4d(sb, m, 0, 8, 2, 1, bar)
        w0, w1, w2, w3 = lds_v4_u32(sb)  # read before any wait: the box need not have landed
        ready[2] = w0
        ready[1] = mbar_try_wait(bar, 0)
    syncwarp()
    for i in range(4):
        w0, w1, w2, w3 = lds_v4_u32(sb + np.uint32(16 * (t + 32 * i)))
        dump[4 * (t + 32 * i)] = w0
        dump[4 * (t + 32 * i) + 1] = w1
        dump[4 * (t + 32 * i) + 2] = w2
        dump[4 * (t + 32 * i) + 3] = w3


def run_case(cid: str) -> dict:
    from numba.cuda.simulator import kernel as simk

    installed = simk.BlockManager.run is sim_threads._run_block
    if cid == "early-exit":
        out = np.zeros((3, 64), np.int32)
        early_exit[3, 64](out, 20)
        return {"id": cid, "installed": installed, "stale_reads": int(out.sum())}
    if cid == "votes":
        out = np.zeros((4, 96), np.int32)
        votes[1, 96](out)
        return {"id": cid, "installed": installed, "rows": [sorted(set(row.tolist())) for row in out]}
    if cid == "raises":
        out = np.zeros(64, np.float32)
        t0 = time.time()
        try:
            raises[2, 64](out)
            msg = None
        except IndexError as e:
            msg = str(e)
        return {"id": cid, "installed": installed, "message": msg, "seconds": time.time() - t0}
    if cid in BULK_MODES:
        out = np.zeros(68, np.uint32)
        try:
            bulk[1, 32](out, BULK_MODES[cid])
            msg = None
        except RuntimeError as e:
            msg = str(e)
        bad = None
        try:
            bulk_store(elem_addr(out, (0,)), 0, 24)  # not a multiple of 16 bytes
        except ValueError as e:
            bad = str(e)
        return {"id": cid, "installed": installed, "out": out.tolist(), "raised": msg, "misaligned": bad}
    if cid in TMA_MODES:
        from numba import cuda as _cuda

        out = _cuda.to_device(np.full(TMA_SHAPE, 0xBEEF, np.uint16))  # the device array the kernel writes
        S, R, C = TMA_SHAPE
        m = sim_tensor_map(np.asarray(out), (C, R, S), (2 * C, 2 * C * R), (64, 16, 1))
        try:
            tma[1, 32](m, np.zeros(16, np.uint8), TMA_MODES[cid])
            msg = None
        except (RuntimeError, ValueError) as e:
            msg = str(e)
        return {"id": cid, "installed": installed, "out": np.asarray(out).tolist(), "raised": msg}
    if cid == "tma-load":
        from numba import cuda as _cuda

        Bn, Hn, R, C = LOAD_SHAPE
        k = np.arange(Bn * Hn * R * C, dtype=np.uint16).reshape(LOAD_SHAPE)
        kd = _cuda.to_device(k)
        m = sim_tensor_map(np.asarray(kd), (C, R, Hn, Bn), (2 * C, 2 * C * R, 2 * C * R * Hn), (64, 16, 1, 1))
        dump = np.zeros(512, np.uint32)
        ready = np.zeros(3, np.uint32)
        tma_load[1, 32](m, dump, ready)
        return {"id": cid, "installed": installed, "dump": dump.view(np.uint16).tolist(), "ready": ready.tolist(),
                "k": k[1, 2].tolist()}
    if cid == "vec":  # ldg_vec / stg_vec (the LSE merge's accesses) on a 16-byte aligned window of a buffer
        buf = np.zeros(64, np.int16)
        first = (-buf.__array_interface__["data"][0] % 16) // 2
        a = buf[first:first + 32]
        a[:] = np.arange(32, dtype=np.int16)
        got = [int(x) for x in ldg_vec(a, 8)]
        stg_vec(a, 16, tuple(np.int16(-i) for i in range(8)))
        f = np.zeros(12, np.float32)
        ff = f[(-f.__array_interface__["data"][0] % 16) // 4:][:8]
        stg_vec(ff, 4, (np.float32(1.5), np.float32(2.5)))
        refused = []
        for arr, at, vals in ((a, 4, None), (a, 28, None), (a, -8, None), (ff, 1, (np.float32(0), np.float32(0)))):
            try:
                ldg_vec(arr, at) if vals is None else stg_vec(arr, at, vals)
                refused.append(None)
            except ValueError as e:
                refused.append(str(e))
        return {"id": cid, "installed": installed, "loaded": got, "stored": a[16:24].tolist(),
                "stored_f32": ff[4:8].tolist(), "refused": refused}
    raise KeyError(cid)


if __name__ == "__main__":
    run_main(sys.argv[1:] or ["early-exit", "votes", "raises", *BULK_MODES, *TMA_MODES, "tma-load", "vec"], run_case)
