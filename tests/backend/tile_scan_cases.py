"""The forward's scan for the first and last non-empty kv tile (emit_fa2.emit_tile_scan: one tile a lane, one
ballot per 32 tiles), run as emitted in a one-warp kernel under the CUDA simulator (test_tile_scan.py starts it
with NUMBA_ENABLE_CUDASIM=1). Prints one JSON line per case: the scan's first / last as every lane saw them."""

from __future__ import annotations

import json
import sys

import numpy as np


def scan_kernel(uniform: bool = False):
    """The scan by ballot, or (`uniform`, the wgmma kernels') by each lane's own tiles and one warp_min / warp_max."""
    from falower.backends.numba_cuda.emit_fa2 import _Code, emit_tile_scan
    from falower.backends.numba_cuda.intrinsics import (  # noqa: F401 (the source's)
        ballot, highest_bit, lowest_bit, warp_max, warp_min)
    from numba import cuda  # noqa: F401

    c = _Code()
    c("def scan(cls, out, n):")
    with c.indent():
        emit_tile_scan(c, lambda j: f"cls[{j}]", "n", "kv_first", "kv_last", uniform=uniform)
        c("out[cuda.threadIdx.x, 0] = kv_first")
        c("out[cuda.threadIdx.x, 1] = kv_last")
    scope = dict(globals(), cuda=cuda, ballot=ballot, lowest_bit=lowest_bit, highest_bit=highest_bit,
                 warp_min=warp_min, warp_max=warp_max)
    exec(c.text(), scope)
    return cuda.jit(scope["scan"])


CASES = {  # id -> tile classes (0 empty, 1 partial, 2 full)
    "one-full": [2],
    "one-empty": [0],
    "two-last": [0, 1],
    "all-empty-33": [0] * 33,
    "tile-31-of-31": [0] * 30 + [1],
    "first-32-of-33": [0] * 32 + [2],
    "across-chunks-65": [0] * 5 + [2] * 50 + [1] + [0] * 9,
    "only-64-of-65": [0] * 64 + [1],
    "ends-100": [1] + [0] * 98 + [2],
    "gaps-70": [0, 0, 1, 0, 2, 0] + [0] * 60 + [0, 2, 0, 0],
}


def main(ids: list[str]) -> None:
    kerns = {"": scan_kernel(), "-uniform": scan_kernel(uniform=True)}
    rng = np.random.default_rng(0)
    cases = dict(CASES)
    for i in range(6):  # random classes over random counts
        n = int(rng.integers(1, 130))
        cases[f"random-{i}-{n}"] = [int(x) for x in rng.choice(3, n, p=[0.6, 0.2, 0.2])]
    for cid, cls in cases.items():
        if ids and cid not in ids:
            continue
        arr = np.array(cls, np.int32)
        live = [j for j, x in enumerate(cls) if x != 0]
        want = [live[0], live[-1]] if live else [len(cls), -1]
        for suffix, kern in kerns.items():
            out = np.zeros((32, 2), np.int64)
            kern[1, 32](arr, out, len(cls))
            print(json.dumps({"id": cid + suffix, "got": sorted({tuple(int(v) for v in r) for r in out}),
                              "want": want}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
