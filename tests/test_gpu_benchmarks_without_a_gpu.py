"""The benchmarks that run kernels through torch on a GPU refuse a machine without torch in one line naming what is
missing (benchmarks/gpu_required.py), after their arguments are parsed (so --help works anywhere), rather than dying
in a traceback of their first torch call."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# torch made unimportable whether or not it is installed, then the script run as `python3 benchmarks/<script>`
RUN = ("import runpy, sys; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1].rsplit('/', 1)[0]); "
       "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("script, args", [("bench.py", ["--fwd", "--n", "1024"]), ("call_overhead.py", ["--decode"]),
                                          ("split_parts.py", ["--set", "twos"]), ("timeline.py", ["plain"]),
                                          ("run_variant.py", ["plain"]), ("probe_bwd.py", []),
                                          ("probe_wgmma.py", []), ("probe_block_data.py", [])])
def test_a_gpu_benchmark_without_torch_says_so_in_one_line(script, args):
    path = str(ROOT / "benchmarks" / script)
    out = subprocess.run([sys.executable, "-c", RUN, path, *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: needs torch and a CUDA GPU"), out.stderr[-2000:]
    if script == "bench.py":  # (its check follows the arguments' own: --help and their errors work anywhere)
        helped = subprocess.run([sys.executable, "-c", RUN, path, "--help"], capture_output=True, text=True,
                                cwd=ROOT, timeout=120)
        assert helped.returncode == 0 and "usage" in helped.stdout, helped.stderr[-2000:]


@pytest.mark.parametrize("script", ["probe_cluster.py", "probe_tma.py"])
def test_a_driver_probe_without_the_driver_says_so_in_one_line(script):
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("the CUDA driver loads here: the probe would run")
    except OSError:
        pass
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"{script}: needs a CUDA GPU and its "
                                                                           "driver"), out.stderr[-2000:]
