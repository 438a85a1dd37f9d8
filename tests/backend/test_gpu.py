"""On a GPU: FlashAttention's error rule for the tensor-core kernels (marked gpu; skipped elsewhere).

max |kernel - ref64| <= 2 * max |naive attention in the same low precision - ref64| + 1e-5,
over N = 1, 17, 128, 1000, 4096; D = 64, 128; fp16, bf16; plain, causal (static block mask) and a
data-dependent document mask (table) with fully masked rows.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import make_spec  # noqa: E402

KERNELS: dict = {}


def kernel(variant, D, dtype):
    from falower.backends.numba_cuda import FA2ForwardKernel

    key = (variant, D, dtype)
    if key not in KERNELS:
        # the benchmark's schedule: 128 query rows, 4 warps of two m16 fragments each
        KERNELS[key] = FA2ForwardKernel(make_spec(variant, D, dtype, block_q=128, block_k=64, num_warps=4,
                                                  name=f"gpu_{variant}_{dtype}_{D}"))
    return KERNELS[key]


def keep_mask(variant, M, N, doc, device):
    if variant == "plain":
        return None
    causal = torch.ones(M, N, dtype=torch.bool, device=device).tril()
    if variant == "causal":
        return causal[None, None]
    dq, dk = doc[:, :M], doc[:, :N]
    same = (dq[:, :, None] == dk[:, None, :]) & (dq[:, :, None] >= 0)
    return (same & causal[None])[:, None]


def attention(q, k, v, keep, dtype):
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, dim=-1).to(dtype) @ v


@pytest.mark.parametrize("variant", ["plain", "causal", "document"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("N", [1, 17, 128, 1000, 4096])
def test_fa_error_rule(variant, dtype, D, N):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tdt = torch.float16 if dtype == "f16" else torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(N * 7 + D)
    B, H = 2, 2
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=tdt, generator=g) for _ in range(3))
    caps = ()
    doc = None
    if variant == "document":
        doc = torch.sort(torch.randint(0, 4, (B, N), device="cuda", generator=g), dim=1).values.int()
        if N > 3:
            doc[:, 2] = -1  # padding queries: fully masked rows
        caps = (doc,)
    kern = kernel(variant, D, dtype)
    o, lse = kern(q, k, v, *caps)
    torch.cuda.synchronize()
    keep = keep_mask(variant, N, N, doc, q.device)
    ref = attention(q.double(), k.double(), v.double(), keep, torch.float64)
    naive = attention(q, k, v, keep, tdt)
    rows = torch.ones(B, H, N, dtype=torch.bool, device="cuda") if keep is None else keep.expand(B, H, N, N).any(-1)
    assert not torch.isnan(o).any()
    err = (o.double() - ref)[rows].abs().max().item()
    naive_err = (naive.double() - ref)[rows].abs().max().item()
    assert err <= 2 * naive_err + 1e-5, (err, naive_err)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    ref_lse = torch.logsumexp(s, dim=-1)
    assert (lse.double() - ref_lse)[rows].abs().max().item() < 1e-3
    if not rows.all():
        assert torch.isneginf(lse[~rows]).all()
        assert (o[~rows] == 0).all()


@pytest.mark.parametrize("D", [64, 128])
def test_gqa_and_array_kinds(D):
    """GQA through torch tensors, numba device arrays and numpy agree."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from numba import cuda

    from falower.backends.numba_cuda import FA2ForwardKernel

    kern = FA2ForwardKernel(make_spec("plain", D, "f16", group_size=2, name=f"gpu_gqa_{D}"))
    q = torch.randn(1, 4, 300, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 2, 257, D, device="cuda", dtype=torch.float16) for _ in range(2))
    o, lse = kern(q, k, v)
    ref = attention(q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), None,
                    torch.float64)
    assert (o.double() - ref).abs().max().item() < 2e-3
    o2, lse2 = kern(cuda.as_cuda_array(q), cuda.as_cuda_array(k), cuda.as_cuda_array(v))
    assert (torch.as_tensor(o2, device="cuda") == o).all()
    o3, lse3 = kern(q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy())
    assert (torch.from_numpy(o3).cuda() == o).all()
    with pytest.raises(ValueError, match="contiguous"):
        kern(q.transpose(1, 2), k, v)


@pytest.mark.parametrize("D", [64, 128])
def test_deterministic(D):
    """Same inputs, same bits: a difference between runs would be a race in the cp.async pipeline."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    q, k, v = (torch.randn(2, 8, 2048, D, device="cuda", dtype=torch.float16) for _ in range(3))
    kern = kernel("causal", D, "f16")
    o1, l1 = kern(q, k, v)
    for _ in range(3):
        o2, l2 = kern(q, k, v)
        assert torch.equal(o1, o2) and torch.equal(l1, l2)


def _compile_one(key) -> str:
    variant, D, dtype = key
    tdt = torch.float16 if dtype == "f16" else torch.bfloat16
    q = torch.randn(1, 2, 8, D, device="cuda", dtype=tdt)
    caps = (torch.zeros(1, 8, dtype=torch.int32, device="cuda"),) if variant == "document" else ()
    kernel(variant, D, dtype)(q, q, q, *caps)
    torch.cuda.synchronize()
    return str(key)


if __name__ == "__main__":
    # Fill Numba's disk cache for this file's kernels in parallel processes, so that pytest afterwards
    # loads instead of compiling one kernel after another: python tests/backend/test_gpu.py
    import concurrent.futures
    import multiprocessing
    import time

    keys = [(v, D, dt) for v in ("plain", "causal", "document") for D in (64, 128) for dt in ("f16", "bf16")]
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(len(keys), mp_context=multiprocessing.get_context("spawn")) as ex:
        print(list(ex.map(_compile_one, keys)))
    print(f"precompiled {len(keys)} kernels in {time.time() - t0:.1f}s")
