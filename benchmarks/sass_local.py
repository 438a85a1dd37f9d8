"""The SASS of an example's forward kernel under a bench tile config, without a GPU: its PTX (Numba, as the runtime
builds it) compiled as a whole program by a CUDA toolkit's ptxas (as the driver compiles a setmaxnreg kernel) and
disassembled by nvdisasm (`pip download nvidia-cuda-nvdisasm`, or a toolkit's). Prints ptxas's registers and
spills and the opcode counts, and writes the PTX, cubin and SASS next to --out: what found the producer's 64-bit
index multiplies (benchmarks/NOTES.md, "The producer's copies") before the device did.

    python3 benchmarks/sass_local.py causal --config 128x128w8-wsg-p132-iod [--d 128] [--out /tmp/causal]
        [--nvdisasm PATH]

'auto' as the config takes the automatic choice with FALOWER_WGMMA=1 (the simulator's: one block an item).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def kernel_ptx(stem: str, config: str, D: int) -> str:
    import bench
    from falower.backends.numba_cuda.runtime import load_source, ptx_image, ptx_of

    c = bench.example_compiled(stem) if config == "auto" else bench.example_compiled_config(
        stem, bench.parse_config(config))
    k = c.specialize("f16", D=D, N=4096, M=4096)
    kern = getattr(load_source(k.source, k.spec.name), k.spec.name)
    return ptx_image(ptx_of(kern, k.argtypes(), (9, 0)), "sm_90a")[:-1].decode()  # as link_cubin hands it over


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stem")
    ap.add_argument("--config", default="auto")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--out", default="")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    if a.config == "auto":
        os.environ.setdefault("FALOWER_WGMMA", "1")
    from probe_setmaxnreg import ptxas_whole

    out = Path(a.out or f"/tmp/{a.stem}-{a.config}")
    ptx = kernel_ptx(a.stem, a.config, a.d)
    out.with_suffix(".ptx").write_text(ptx)
    usage = ptxas_whole(ptx, out.with_suffix(".cubin"))  # the toolkit's ptxas, at the PTX version it reads
    if "error" in usage:
        raise SystemExit(f"sass_local: {usage['error']} {usage.get('log', '')[-400:]}")
    print(f"{usage['registers']} registers, {usage['spill_stores']} bytes spill stores, warnings {usage['warnings']}")
    if not a.nvdisasm:
        raise SystemExit("sass_local: no nvdisasm (--nvdisasm PATH; pip download nvidia-cuda-nvdisasm)")
    sass = subprocess.run([a.nvdisasm, "-c", str(out.with_suffix(".cubin"))], capture_output=True, text=True,
                          check=True).stdout
    out.with_suffix(".sass").write_text(sass)
    ops = collections.Counter(m.group(1) for m in re.finditer(
        r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass))
    print(f"{sum(ops.values())} instructions; SASS in {out.with_suffix('.sass')}")
    print(", ".join(f"{op} {n}" for op, n in ops.most_common(a.top)))


if __name__ == "__main__":
    main()
