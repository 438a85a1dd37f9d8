"""Skip tests marked `gpu` where no CUDA GPU is visible, so the suite runs unchanged on CPU-only CI.

Detection avoids importing numba.cuda (slow, and absent without the `cuda` extra): a GPU is assumed when
`nvidia-smi -L` lists one. FALOWER_GPU=1 / FALOWER_GPU=0 overrides the probe.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest


@functools.lru_cache(maxsize=1)
def cuda_gpu_available() -> bool:
    forced = os.environ.get("FALOWER_GPU")
    if forced is not None:
        return forced not in ("", "0", "false", "no")
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or cuda_gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found; FALOWER_GPU=1 forces these tests)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def hopper(monkeypatch):
    """A Hopper GPU of 132 SMs faked for falower.compile's automatic choices (compute capability and SM count),
    with no GPU to compile for: the kernels' sources and choices, not their launches. (A test file may define its
    own `hopper`, which takes precedence there.)"""
    from falower.backends.numba_cuda import runtime

    monkeypatch.setattr(runtime, "device_cc", lambda: (9, 0))
    monkeypatch.setattr(runtime, "device_sm_count", lambda: 132)
    monkeypatch.setattr(runtime, "_has_gpu", lambda: False)
