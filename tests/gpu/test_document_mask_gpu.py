"""On the GPU (marked gpu): the document mask through fa2-fwd / fa2-bwd's default data=ranges path (range
tables, the forward's block list, made once per document-id tensor) against a float64 reference, with
FlashAttention's error rule; the block data is made once and reused across calls; and the forward's speed
against the same kernels' plain attention over the kept entries (printed; the bench compares with Flex).

    python -m pytest -q -s tests/gpu/test_document_mask_gpu.py
"""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
COMPILED: dict = {}


def compiled():
    if "doc" not in COMPILED:
        g = runpy.run_path(str(ROOT / "examples" / "document.py"))["graph"]
        COMPILED["doc"] = fl.compile(g, "numba-cuda")
    return COMPILED["doc"]


def doc_ids(kind: str, B: int, N: int, gen) -> "torch.Tensor":
    if kind == "sorted":  # documents of random lengths, the last 1/16 padding (the benchmark's)
        ids = torch.sort(torch.randint(0, 8, (B, N), generator=gen, device="cuda"), dim=-1).values
        ids[:, N - N // 16:] = -1
    elif kind == "unsorted":
        ids = torch.randint(-1, 4, (B, N), generator=gen, device="cuda")
    elif kind == "constant":
        ids = torch.zeros(B, N, dtype=torch.int64, device="cuda")
    elif kind == "distinct":
        ids = torch.arange(N, device="cuda").expand(B, N).clone()
    else:  # "padding": every row fully masked
        ids = torch.full((B, N), -1, device="cuda")
    return ids.to(torch.int32).contiguous()


def reference(q, k, v, doc):
    keep = ((doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0))[:, None]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~keep, -math.inf)
    rows = keep.expand(-1, q.shape[1], -1, -1).any(-1)
    lse = torch.logsumexp(s, dim=-1)
    # fully masked rows: O = 0 (and no NaN through softmax's backward)
    p = torch.softmax(s.masked_fill(~rows[..., None], 0.0), dim=-1) * rows[..., None]
    return p.to(q.dtype) @ v, lse, rows


@pytest.mark.parametrize("kind", ["sorted", "unsorted", "constant", "distinct", "padding"])
@pytest.mark.parametrize("N", [1, 63, 130, 1000, 2048])
def test_document_forward_and_backward(kind, N):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(N)
    B, H, D = 2, 4, 128
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
    doc = doc_ids(kind, B, N, gen)
    c = compiled()
    o, lse = c.forward(q, k, v, doc)
    assert c.kernel(q, k, v, doc).spec.block_mask == "list"
    ref_o, ref_lse, rows = reference(q.double(), k.double(), v.double(), doc)
    naive_o, _, _ = reference(q, k, v, doc)
    err = (o.double() - ref_o)[rows].abs().max().item() if rows.any() else 0.0
    naive_err = (naive_o.double() - ref_o)[rows].abs().max().item() if rows.any() else 0.0
    assert err <= 2 * naive_err + 1e-5, (err, naive_err)
    if rows.any():
        assert (lse.double() - ref_lse)[rows].abs().max().item() < 1e-3
    assert torch.isneginf(lse[~rows]).all() and (o[~rows] == 0).all()
    # backward against autograd of the float64 reference
    ql, kl, vl = (x.double().requires_grad_(True) for x in (q, k, v))
    ro, _, _ = reference(ql, kl, vl, doc)
    ro.backward(do.double())
    dq, dk, dv = c.backward(q, k, v, o, lse, do, doc)[:3]
    for name, got, want in (("dq", dq, ql.grad), ("dk", dk, kl.grad), ("dv", dv, vl.grad)):
        scale = want.abs().max().item() + 1e-6
        assert not torch.isnan(got).any(), name
        assert (got.double() - want).abs().max().item() <= 2e-2 * scale + 1e-3, name


def test_block_data_is_made_once_per_tensor():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, H, N, D = 2, 4, 1024, 128
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    doc = doc_ids("sorted", B, N, gen)
    c = compiled()
    o1, _ = c.forward(q, k, v, doc)
    bd = c.block_data(c.kernel(q, k, v, doc))
    made = dict(bd._cache)
    o2, _ = c.forward(q, k, v, doc)
    assert bd._cache.keys() == made.keys() and all(bd._cache[key][1] is made[key][1] for key in made)
    assert torch.equal(o1, o2)
    doc[:, : N // 2] = 0  # in place: new data, new block data, new numbers
    o3, _ = c.forward(q, k, v, doc)
    ref, _, _ = reference(q.double(), k.double(), v.double(), doc)
    assert (o3.double() - ref).abs().max().item() < 2e-2
    assert not c.analysis.runtime_dims  # the document mask's only capture is doc_id
    count, _ = bd.block_list([doc], (B, H, N, N), q)
    nk = -(-N // c.analysis.block_k)  # sorted ids: each q tile visits only the kv tiles of its documents
    assert (count <= nk).all() and (count < nk).any()


def test_document_forward_speed_against_plain():
    """Printed, not asserted: ms of the document mask (8 documents a row, 1/16 padding) and of plain
    attention, at the benchmark's shape; the document mask keeps about 1/8 of the entries."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import runpy as _r

    B, H, N, D = 4, 16, 4096, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    doc = doc_ids("sorted", B, N, gen)
    plain = fl.compile(_r.run_path(str(ROOT / "examples" / "plain.py"))["graph"], "numba-cuda")
    c = compiled()

    def ms(fn):
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20

    keep = ((doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)).float().mean().item()
    t_doc = ms(lambda: c.forward(q, k, v, doc))
    t_plain = ms(lambda: plain.forward(q, k, v))
    print(f"\ndocument mask: {t_doc:.3f} ms, plain: {t_plain:.3f} ms, density {keep:.3f}, "
          f"document TFLOP/s over kept entries {4 * B * H * N * N * D * keep / t_doc / 1e9:.0f}, "
          f"plain {4 * B * H * N * N * D / t_plain / 1e9:.0f}")
