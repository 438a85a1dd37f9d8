"""Numba CUDA backend: FA2 forward kernels emitted as Numba source (see spec.py for the contract).

    from falower.backends.numba_cuda import FA2ForwardSpec, FA2ForwardKernel, emit_fa2_forward
"""

from .emit_fa2 import (
    emit_block_mask,
    emit_fa2_forward,
    grid,
    recommended_schedule,
    smem_bytes,
    threads_per_block,
    validate_spec,
)
from .runtime import FA2ForwardKernel, cache_dir, load_source, ptx_of, resource_usage
from .spec import Capture, FA2ForwardSpec

__all__ = [
    "Capture",
    "FA2ForwardKernel",
    "FA2ForwardSpec",
    "cache_dir",
    "emit_block_mask",
    "emit_fa2_forward",
    "load_source",
    "grid",
    "ptx_of",
    "recommended_schedule",
    "threads_per_block",
    "resource_usage",
    "smem_bytes",
    "validate_spec",
]
