"""The one-line refusal of a benchmark that runs kernels on a GPU through torch, where this machine cannot: torch
is not installed (it is not a CI dependency: it lives on the GPU machine), or torch sees no CUDA device. Without it
such a script died in a traceback of its first `import torch` or `torch.cuda` call."""

from __future__ import annotations

import ctypes
import os


def require_gpu(script: str, simulator_ok: bool = False) -> None:
    """Exit with "<script>: needs ..." (status 1) unless torch imports and sees a CUDA device; `simulator_ok`: the
    CUDA simulator (NUMBA_ENABLE_CUDASIM=1) stands in for the device where the script runs there (tiny shapes)."""
    try:
        import torch
    except ImportError:
        raise SystemExit(f"{script}: needs torch and a CUDA GPU; torch is not installed here (falower and its "
                         "tests do not need it; pip install torch on a machine with the GPU)") from None
    if simulator_ok and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU; torch {torch.__version__} sees none here")


def require_driver(script: str) -> None:
    """Exit with "<script>: needs ..." (status 1) unless the CUDA driver's library loads (the probes that talk to
    the driver through ctypes, without torch)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise SystemExit(f"{script}: needs a CUDA GPU and its driver; libcuda.so.1 does not load here ({e})") from None
