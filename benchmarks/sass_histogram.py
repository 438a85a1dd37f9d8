"""Opcode histograms of compiled kernels' SASS (cuobjdump -sass), to compare the instructions falower's kernels
issue with FlexAttention's (Triton's cubins) where ncu says we issue more of them.

    python3 benchmarks/sass_histogram.py --falower plain --triton 'flex_attention' [--top 30]

--falower NAME: every falower cubin in the kernel cache (FALOWER_CACHE_DIR/cubin/*.bin, cubin_cache.py) whose
kernel name contains NAME; --triton NAME: every cubin in Triton's cache or torch inductor's whose file name
contains NAME. Prints
per kernel the total, then the most frequent opcodes side by side (the opcode without its modifiers' suffixes
after the first dot: FFMA, MUFU.EX2, HMMA...). Static counts (instructions in the binary), not executed ones:
the loop body dominates both.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def sass_ops(cubin: bytes) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)?)", out):
        ops[m.group(1)] += 1
    return ops


def falower_cubins(name: str) -> list[tuple[str, bytes]]:
    from falower.backends.numba_cuda import cubin_cache

    out = []
    for p in sorted(cubin_cache.directory().glob("*.bin")):
        img = cubin_cache.loads(p.stem, p.read_bytes())
        if img is not None and name in img.name:
            if img.cubin[:4] != b"\x7fELF":  # PTX the driver compiles at load (runtime.whole_program_ptx)
                print(f"sass_histogram: {img.name} is kept as PTX (the driver compiles it): no SASS to count",
                      file=sys.stderr)
                continue
            out.append((img.name, img.cubin))
    return out


def triton_cubins(name: str) -> list[tuple[str, bytes]]:
    """Triton's cubins: its own cache (TRITON_CACHE_DIR, ~/.triton/cache) and torch inductor's, where
    FlexAttention's kernels land (/tmp/torchinductor_<user>/triton: on the H100 ~/.triton/cache did not exist)."""
    import glob
    import os

    roots = [Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))]
    roots += [Path(p) for p in glob.glob("/tmp/torchinductor_*")]
    found = {}
    for root in roots:
        for p in sorted(root.rglob("*.cubin")) if root.exists() else []:
            if name in p.name:
                found.setdefault(p.stem, p.read_bytes())
    return sorted(found.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--falower", default="")
    ap.add_argument("--triton", default="")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    kernels = (falower_cubins(args.falower) if args.falower else []) + (
        triton_cubins(args.triton) if args.triton else [])
    if not kernels:
        sys.exit("sass_histogram: no cubin matched")
    hists = [(n, sass_ops(c)) for n, c in kernels]
    for n, h in hists:
        print(f"{n}: {sum(h.values())} instructions")
    total = collections.Counter()
    for _, h in hists:
        total.update(h)
    names = [n[:18] for n, _ in hists]
    print("| opcode | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for op, _ in total.most_common(args.top):
        print(f"| {op} | " + " | ".join(str(h.get(op, 0)) for _, h in hists) + " |")


if __name__ == "__main__":
    main()
