"""Static shared arrays in the CUDA simulator, with the allocation race made wide (run by
test_simulator_shared_arrays.py with NUMBA_ENABLE_CUDASIM=1). Prints one JSON line per mode:
`numba` (numba-cuda's simulator as shipped) and `falower` (after falower's intrinsics module is imported)."""

from __future__ import annotations

import json
import sys
import time

import numpy
from numba import cuda  # the simulator: this script runs with NUMBA_ENABLE_CUDASIM=1


class _SlowEmpty:
    """numpy with an `empty` that sleeps first: the gap between the simulator's check for an existing array and
    its insert of a new one grows from a few bytecodes to 2 ms, so every thread of a block falls into it."""

    def __getattr__(self, name):
        return getattr(numpy, name)

    @staticmethod
    def empty(*args, **kwargs):
        time.sleep(0.002)
        return numpy.empty(*args, **kwargs)


@cuda.jit
def kernel(out):
    a = cuda.shared.array(32, numpy.float32)
    b = cuda.shared.array(32, numpy.float32)
    t = cuda.threadIdx.x
    a[t] = t
    b[t] = 100 * t
    cuda.syncthreads()
    s = 0.0
    for i in range(32):
        s += a[i] + b[i]
    out[cuda.blockIdx.x, t] = s


def run(mode: str, launches: int = 4) -> dict:
    from numba.cuda.simulator import kernelapi

    if mode == "falower":
        from falower.backends.numba_cuda import intrinsics

        intrinsics.np = _SlowEmpty()
    kernelapi.np = _SlowEmpty()

    want = 101 * 31 * 32 / 2  # every thread sees all 32 threads' writes to both arrays
    bad = 0
    for _ in range(launches):
        out = numpy.zeros((2, 32), numpy.float32)
        kernel[2, 32](out)
        bad += int(numpy.count_nonzero(out != want))
    return {"id": mode, "wrong_sums": bad, "threads": launches * 64}


if __name__ == "__main__":
    for mode in sys.argv[1:]:
        print(json.dumps(run(mode)), flush=True)
