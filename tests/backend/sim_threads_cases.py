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
    bulk_commit, bulk_store, bulk_wait_read0, elem_addr, smem_base, sts_u32, syncwarp)


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
    raise KeyError(cid)


if __name__ == "__main__":
    run_main(sys.argv[1:] or ["early-exit", "votes", "raises", *BULK_MODES], run_case)
