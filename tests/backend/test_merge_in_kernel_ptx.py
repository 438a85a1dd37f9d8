"""split-kv's merges inside the decoding kernel (emit_fa3_ws.cluster_merge, fused_merge), compiled for Numba's real
CUDA target with no GPU: the simulator runs their arithmetic but not the CUDA target's typing (a local array whose
length was not a constant passed the simulator and failed to compile on the GPU), and the PTX shows where the
merge's loads are: every part's LSE and 16 bytes of O issued before the shares' first division, so a merge waits for
the other parts' memory once (lse_merge._merged_chunk)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

import falower as fl

pytestmark = pytest.mark.slow


@pytest.fixture
def hopper_with_clusters(monkeypatch, tmp_path):
    """A Hopper of 132 SMs that holds the H200's clusters (66 of 2, 30 of 4, 15 of 8), no GPU, kernels cached in a
    temporary directory."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("PTX needs the real CUDA target")
    from falower.backends.numba_cuda import runtime

    monkeypatch.setattr(runtime, "device_cc", lambda: (9, 0))
    monkeypatch.setattr(runtime, "device_sm_count", lambda: 132)
    monkeypatch.setattr(runtime, "_has_gpu", lambda: False)
    monkeypatch.setattr(runtime, "device_clusters_held", lambda width: {2: 66, 4: 30, 8: 15}[width])
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))


def _ptx(dtype: str, extra, B: int, N: int, D: int, M: int = 1):
    """(the kernel's spec, its PTX lines) for plain attention at H = 8."""
    from falower.backends.numba_cuda.runtime import load_source, ptx_of

    c = fl.compile(fl.attention(name="plain", dtype=dtype), extra=extra)
    kern = c.specialize(dtype, B=B, H=8, M=M, N=N, D=D)
    spec = kern.spec
    ptx = ptx_of(getattr(load_source(kern.source, spec.name), spec.name), kern.argtypes(), (9, 0))
    return spec, (ptx if isinstance(ptx, str) else ptx.decode()).splitlines()


@pytest.mark.parametrize("merge, B, N, D, dtype, parts", [("cluster", 2, 1024, 128, "bf16", 4),
                                                           ("fused", 1, 8192, 128, "f16", 16)])
def test_the_merge_in_the_kernel_compiles_with_every_load_first(hopper_with_clusters, merge, B, N, D, dtype, parts):
    from falower.backends.numba_cuda.emit_fa3_ws import cluster_merge, cluster_push, fused_merge

    spec, lines = _ptx(dtype, {"fused_merge": True} if merge == "fused" else {"cluster_push": False}, B, N, D)
    assert spec.kv_parts == parts and cluster_merge(spec) == (merge == "cluster") and fused_merge(spec), spec.extra
    assert not cluster_push(spec)
    ptx = "\n".join(lines)
    load = "ld.shared::cluster" if merge == "cluster" else "ld.global.cg"
    at = [i for i, ln in enumerate(lines) if load in ln]
    assert len(at) == 2 * parts, (len(at), parts)  # each part's LSE and its 16 bytes of O
    first_div = next(i for i in range(at[0], len(lines)) if "div.rn.f32" in lines[i])
    assert at[-1] < first_div, (at, first_div)
    assert not re.search(r"\b(ld|st)\.local\b", ptx)
    np.testing.assert_equal(sum("v4.u32" in lines[i] for i in at), parts)


@pytest.mark.parametrize("B, N, D, M, parts", [(2, 1024, 64, 1, 4), (2, 2048, 128, 64, 4)])
def test_the_pushed_merge_compiles_one_way(hopper_with_clusters, B, N, D, M, parts):
    """cluster_push, the automatic cluster kernels' form: no read of another block's shared memory; one st.async of
    16 bytes for each 128 chunks a warpgroup stages, and one of its LSE; the cluster's barrier split (one relaxed
    arrival, a wait in the producer and in the consumers, no other cluster barrier); the merge's every part's LSE and
    16 bytes of O read from this block's own shared memory, after the barrier of the pushes, before the first
    division."""
    from falower.backends.numba_cuda.emit_fa3_ws import cluster_push

    spec, lines = _ptx("f16", None, B, N, D, M)
    assert spec.kv_parts == parts and cluster_push(spec), spec.extra
    ptx = "\n".join(lines)
    assert "ld.shared::cluster" not in ptx and "barrier.cluster.arrive.release" not in ptx
    assert ptx.count("barrier.cluster.arrive.relaxed") == 1 and ptx.count("barrier.cluster.wait") == 2
    assert ptx.count("fence.mbarrier_init.release.cluster") == 1
    pushes = [ln for ln in lines if "st.async" in ln]
    assert sum(".v4.b32" in ln for ln in pushes) == 8 * D // 128 and sum(".f32" in ln for ln in pushes) == 8 * D // 128
    waited = next(i for i, ln in enumerate(lines) if "try_wait.parity.acquire.cluster" in ln)
    first_div = next(i for i in range(waited, len(lines)) if "div.rn.f32" in lines[i])
    reads = [i for i in range(waited, first_div) if re.search(r"ld\.shared\.(v4\.u32|f32)", lines[i])]
    assert len(reads) == 2 * parts, (len(reads), parts)
    assert not re.search(r"\b(ld|st)\.local\b", ptx)
