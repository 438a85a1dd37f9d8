"""On the GPU (marked gpu): the document mask through fa2-fwd / fa2-bwd's default data=ranges path (range
tables, the forward's block list, made once per document-id tensor) against a float64 reference, with
FlashAttention's error rule; the block data is made once and reused across calls; and the forward's speed
against the same kernels' plain attention over the kept entries (printed; the bench compares with Flex).
The backward visits block lists too (issue 12: per kv tile the q tiles, and the deterministic dQ kernel's per
q tile kv tiles): both backward pipelines against float64 autograd, the device's lists equal to the list
kernel's row code run on the host, made once per tensor and anew after an in-place write, and the backward's
time over the lists against the range-table scan they replace (printed). A mask the range analysis cannot
bound evaluates its dense block table once per distinct data.

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


def compiled(**kw):
    """The document example compiled (kw: falower.compile's, e.g. deterministic=True or extra={...})."""
    key = ("doc", tuple(sorted((k, repr(v)) for k, v in kw.items())))
    if key not in COMPILED:
        g = runpy.run_path(str(ROOT / "examples" / "document.py"))["graph"]
        COMPILED[key] = fl.compile(g, "numba-cuda", **kw)
    return COMPILED[key]


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
    elif kind == "many":  # documents of one token, then padding: runs up, one down, no value back
        ids = torch.arange(N, device="cuda").expand(B, N).clone()
        ids[:, N - N // 16:] = -1
    else:  # "padding": every row fully masked
        ids = torch.full((B, N), -1, device="cuda")
    return ids.to(torch.int32).contiguous()


@pytest.mark.parametrize("kind", ["sorted", "unsorted", "constant", "distinct", "padding", "many"])
@pytest.mark.parametrize("N", [1, 2, 127, 128, 129, 4096])
def test_run_and_range_tables_on_the_device_are_the_hosts(kind, N):
    """block_data.run_table of a CUDA tensor equals run_table_host, and range_table intervals.minmax_table: int32
    along its last axis and its first (the table kernels, launched directly), int64 (torch's ops). "many" at
    N = 4096: 3841 runs, up and one down, no value back: their values listed in global memory (past RUN_VALUES)."""
    from falower.backends.numba_cuda.block_data import range_table, run_table, run_table_host
    from falower.ir.intervals import minmax_table

    ids = doc_ids(kind, 3, N, torch.Generator(device="cuda").manual_seed(N))
    host = ids.cpu().numpy()
    for x, axis in ((ids, 1), (ids.t().contiguous(), 0), (ids.long(), 1)):
        got = run_table(x, axis).cpu().numpy()
        want = run_table_host(x.cpu().numpy(), axis)
        assert (got == want).all(), (kind, N, axis, x.dtype)
        for g in (1, 64, 128):
            got = range_table(x, axis, g, "i32").cpu().numpy()
            assert (got == minmax_table(x.cpu().numpy(), axis, g)).all(), (kind, N, axis, x.dtype, g)
    assert (run_table_host(host, 1)[..., 0] >= 0).all() or kind == "unsorted"
    if kind == "many" and N == 4096:
        from falower.backends.numba_cuda.block_data import RUN_VALUES

        assert len(set(host[0].tolist())) > RUN_VALUES


def reference(q, k, v, doc):
    keep = ((doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0))[:, None]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~keep, -math.inf)
    rows = keep.expand(-1, q.shape[1], -1, -1).any(-1)
    lse = torch.logsumexp(s, dim=-1)
    # fully masked rows: O = 0 (and no NaN through softmax's backward)
    p = torch.softmax(s.masked_fill(~rows[..., None], 0.0), dim=-1) * rows[..., None]
    return p.to(q.dtype) @ v, lse, rows


def assert_forward_right(o, lse, q, k, v, doc) -> None:
    """O within twice naive f16 attention's error of the float64 reference on the rows that keep anything, LSE
    within 1e-3 there, and O = 0, LSE = -inf on fully masked rows."""
    ref_o, ref_lse, rows = reference(q.double(), k.double(), v.double(), doc)
    naive_o, _, _ = reference(q, k, v, doc)
    err = (o.double() - ref_o)[rows].abs().max().item() if rows.any() else 0.0
    naive_err = (naive_o.double() - ref_o)[rows].abs().max().item() if rows.any() else 0.0
    assert err <= 2 * naive_err + 1e-5, (err, naive_err)
    if rows.any():
        assert (lse.double() - ref_lse)[rows].abs().max().item() < 1e-3
    assert torch.isneginf(lse[~rows]).all() and (o[~rows] == 0).all()


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
    assert_forward_right(o, lse, q, k, v, doc)
    # backward against autograd of the float64 reference
    ql, kl, vl = (x.double().requires_grad_(True) for x in (q, k, v))
    ro, _, _ = reference(ql, kl, vl, doc)
    ro.backward(do.double())
    dq, dk, dv = c.backward(q, k, v, o, lse, do, doc)[:3]
    for name, got, want in (("dq", dq, ql.grad), ("dk", dk, kl.grad), ("dv", dv, vl.grad)):
        scale = want.abs().max().item() + 1e-6
        assert not torch.isnan(got).any(), name
        assert (got.double() - want).abs().max().item() <= 2e-2 * scale + 1e-3, name


PERSIST_PWG = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 5, "item_order": "dynamic"}


@pytest.mark.parametrize("kind", ["sorted", "unsorted", "constant", "distinct", "padding"])
@pytest.mark.parametrize("N", [1, 130, 1000, 2048])
def test_document_forward_on_the_persistent_producer_kernel(kind, N):
    """The block list on the persistent kernel whose producer warpgroup walks each item's list as it loads (5
    blocks take the items from the counter, so each walks many items, some of them empty: all padding)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    gen = torch.Generator(device="cuda").manual_seed(N + 1)
    B, H, D = 2, 4, 128
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    doc = doc_ids(kind, B, N, gen)
    c = compiled(extra=PERSIST_PWG)
    spec = c.kernel(q, k, v, doc).spec
    assert spec.block_mask == "list" and spec.extra.get("producer") == "warpgroup" and spec.extra["persistent"] == 5
    for _ in range(2):  # the counter left at zero for the next call
        assert_forward_right(*c.forward(q, k, v, doc), q, k, v, doc)


def _sorted_case(seed: int):
    """q, k, v, dO and sorted document ids (the benchmark's, with padding) at B = 2, H = 4, N = 1024, D = 128."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(2, 4, 1024, 128, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
    return q, k, v, do, doc_ids("sorted", 2, 1024, gen)


@pytest.mark.parametrize("kind", ["sorted", "unsorted", "padding"])
def test_block_lists_by_either_launch(monkeypatch, kind):
    """The block data made by the direct launches (the list kernels through cuLaunchKernel, the run and range
    tables by their kernels: the default) equals what Numba's dispatcher and torch's ops make
    (FALOWER_DIRECT_LAUNCH=0, also what a capture the direct launch does not take goes through), for the forward's
    kernel and the backward's."""
    from falower.backends.numba_cuda.block_data import BlockData

    q, k, v, _, doc = _sorted_case(7)
    if kind != "sorted":
        doc = doc_ids(kind, doc.shape[0], doc.shape[1], torch.Generator(device="cuda").manual_seed(8))
    B, H, N = doc.shape[0], q.shape[1], doc.shape[1]
    c = compiled()
    for kern, sizes in ((c.kernel(q, k, v, doc), c.runtime_sizes(*c._kernel_and_dims((q, k, v, doc)))),
                        (c.backward_kernel(q, k, v, doc), None)):
        if sizes is None:
            sizes = [int({"M": N, "N": N}[d.removeprefix("dim_")]) for d in kern.spec.dims]
        direct = BlockData(kern.spec).lists([doc, *sizes], (B, H, N, N), q)
        monkeypatch.setenv("FALOWER_DIRECT_LAUNCH", "0")
        numba = BlockData(kern.spec).lists([doc, *sizes], (B, H, N, N), q)
        monkeypatch.delenv("FALOWER_DIRECT_LAUNCH")
        assert direct.keys() == numba.keys() and direct
        _same_lists(kern.spec, direct, numba, (B, H, N, N))


def test_block_data_is_made_once_per_tensor():
    q, k, v, _, doc = _sorted_case(0)
    B, H, N = doc.shape[0], q.shape[1], doc.shape[1]
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


def _grads_close(got, want, name):
    scale = want.abs().max().item() + 1e-6
    assert not torch.isnan(got).any(), name
    assert (got.double() - want).abs().max().item() <= 2e-2 * scale + 1e-3, name


def _backward_lists(c, q, k, v, doc):
    """(kernel, the lists the runtime made on the device, the list kernel's row code run on the host)."""
    import numpy as np

    from falower.backends.numba_cuda.block_data import host_block_lists, list_layout
    from falower.ir.intervals import minmax_table

    kern = c.backward_kernel(q, k, v, doc)
    B, H, N = doc.shape[0], q.shape[1], doc.shape[1]
    dims = [int({"M": q.shape[2], "N": k.shape[2]}[d]) for d in kern.spec.dims]
    got = c.block_data(kern).lists([doc, *dims], (B, H, q.shape[2], k.shape[2]), q)
    host_doc = doc.cpu().numpy()
    ranges = [minmax_table(host_doc, c_.derived[2], c_.derived[3]).astype(np.int32)
              for c_ in kern.spec.captures if c_.derived[:1] == ("ranges",)]
    want = host_block_lists(kern.spec, [host_doc, *dims, *ranges], (B, H, q.shape[2], k.shape[2]))
    return kern, got, dict(zip([t for t, _ in list_layout(kern.spec, (B, H, q.shape[2], k.shape[2]))], want))


def _same_lists(spec, got, want, sizes):
    """Counts equal, and each row's listed entries (the rest of a row is not written on the device)."""
    import numpy as np

    B, H, M, N = sizes
    nq, nk = -(-M // spec.block_q), -(-N // spec.block_k)
    for count, tiles, width in (("q_count", "q_tiles", nq * spec.group_size), ("kv_count", "kv_tiles", nk)):
        if count not in want:
            continue
        np.testing.assert_array_equal(got[count], want[count])
        for r, n in enumerate(want[count]):
            np.testing.assert_array_equal(got[tiles][r * width: r * width + n], want[tiles][r * width: r * width + n])


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kind", ["sorted", "unsorted", "constant", "distinct", "padding"])
@pytest.mark.parametrize("N", [1, 63, 130, 1000, 2048])
def test_document_backward_over_block_lists(kind, N, deterministic):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(N + 7)
    B, H, D = 2, 4, 128
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
    doc = doc_ids(kind, B, N, gen)
    c = compiled(deterministic=deterministic)
    o, lse = c.forward(q, k, v, doc)
    kern, got, want = _backward_lists(c, q, k, v, doc)
    assert kern.spec.block_mask == "list"
    assert ("kv_count" in got) == deterministic  # the q-outer dQ kernel's list: deterministic mode only
    _same_lists(kern.spec, got, want, (B, H, N, N))
    ql, kl, vl = (x.double().requires_grad_(True) for x in (q, k, v))
    ro, _, _ = reference(ql, kl, vl, doc)
    ro.backward(do.double())
    grads = c.backward(q, k, v, o, lse, do, doc)[:3]
    for name, g, want_g in zip(("dq", "dk", "dv"), grads, (ql.grad, kl.grad, vl.grad)):
        _grads_close(g, want_g, name)
    if deterministic:  # no atomics: the same bits again
        assert all(torch.equal(a, b) for a, b in zip(grads, c.backward(q, k, v, o, lse, do, doc)[:3]))


def test_block_data_made_once_across_autograd_steps():
    """Training steps through torch autograd (`c(q, k, v, doc)` with q, k, v requiring grad, then `.backward`):
    the forward's and the backward's block data are made at the first step and reused by the next, not made again
    because autograd handed the kernels another alias of the same document ids (before: 57 TFLOP/s against 194
    by c.forward / c.backward, H200, bench.py "f+b autograd"); an in-place write still makes them anew."""
    q, k, v, do, doc = _sorted_case(2)
    N = doc.shape[1]
    c = fl.compile(runpy.run_path(str(ROOT / "examples" / "document.py"))["graph"], "numba-cuda")  # empty caches

    def step():
        ql, kl, vl = (x.clone().requires_grad_(True) for x in (q, k, v))
        c(ql, kl, vl, doc)[0].backward(do)
        return ql.grad, kl.grad, vl.grad

    first = step()
    bds = [c.block_data(c.kernel(q, k, v, doc)), c.block_data(c.backward_kernel(q, k, v, doc))]
    made = [{key: val for key, (_, val) in bd._cache.items()} for bd in bds]
    assert all(len(m) == 1 for m in made), [len(m) for m in made]
    again = step()
    for bd, m in zip(bds, made):  # the same entries, the very same tensors: nothing made again
        assert bd._cache.keys() == m.keys() and all(bd._cache[key][1] is m[key] for key in m)
    for a, b in zip(first, again):
        assert (a.float() - b.float()).abs().max().item() <= 1e-2 * max(1.0, a.float().abs().max().item())
    doc[:, N // 3: N // 2] = 5  # in place: new data, new block data, and the new mask's gradients
    got = step()
    assert all(len(bd._cache) == 2 for bd in bds)
    o, lse = c.forward(q, k, v, doc)
    want = c.backward(q, k, v, o, lse, do, doc)[:3]  # the direct calls (checked against float64 elsewhere)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert (a.float() - b.float()).abs().max().item() <= 1e-2 * max(1.0, b.float().abs().max().item()), name


def test_backward_block_lists_made_once_per_tensor():
    q, k, v, do, doc = _sorted_case(1)
    B, H, N = doc.shape[0], q.shape[1], doc.shape[1]
    c = compiled()
    o, lse = c.forward(q, k, v, doc)
    c.backward(q, k, v, o, lse, do, doc)
    bd = c.block_data(c.backward_kernel(q, k, v, doc))
    made = {key: val for key, (_, val) in bd._cache.items()}
    c.backward(q, k, v, o, lse, do, doc)
    assert bd._cache.keys() == made.keys() and all(bd._cache[key][1] is made[key] for key in made)  # made once
    doc[:, N // 3: N // 2] = 5  # in place: new lists, and the gradients of the new mask
    o, lse = c.forward(q, k, v, doc)
    dq, dk, dv = c.backward(q, k, v, o, lse, do, doc)[:3]
    assert any(key not in made for key in bd._cache)  # made anew for the new version
    ql, kl, vl = (x.double().requires_grad_(True) for x in (q, k, v))
    ro, _, _ = reference(ql, kl, vl, doc)
    ro.backward(do.double())
    for name, g, want_g in (("dq", dq, ql.grad), ("dk", dk, kl.grad), ("dv", dv, vl.grad)):
        _grads_close(g, want_g, name)
    kern, got, want = _backward_lists(c, q, k, v, doc)
    _same_lists(kern.spec, got, want, (B, H, N, N))
    nq = -(-N // kern.spec.block_q)
    assert (got["q_count"] < nq).any()  # sorted ids: a kv tile visits only the q tiles of its documents


def test_document_backward_speed_lists_against_scan():
    """Printed, not asserted: ms of the document backward (8 documents a row, 1/16 padding; B = 4, H = 16,
    N = 4096, D = 128) over its block lists and scanning the range tables (extra bwd_block_list=False), and of
    plain attention's backward."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import runpy as _r

    B, H, N, D = 4, 16, 4096, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
    doc = doc_ids("sorted", B, N, gen)
    c, scan = compiled(), compiled(extra={"bwd_block_list": False})
    assert scan.backward_kernel(q, k, v, doc).spec.block_mask == "static"
    plain = fl.compile(_r.run_path(str(ROOT / "examples" / "plain.py"))["graph"], "numba-cuda")
    o, lse = c.forward(q, k, v, doc)
    po, plse = plain.forward(q, k, v)

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

    a = c.backward(q, k, v, o, lse, do, doc)
    b = scan.backward(q, k, v, o, lse, do, doc)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])  # dK, dV: the same tiles in the same order
    keep = ((doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)).float().mean().item()
    t_list = ms(lambda: c.backward(q, k, v, o, lse, do, doc))
    t_scan = ms(lambda: scan.backward(q, k, v, o, lse, do, doc))
    t_plain = ms(lambda: plain.backward(q, k, v, po, plse, do))
    flops = 2.5 * 4 * B * H * N * N * D
    print(f"\ndocument backward: lists {t_list:.3f} ms, scan {t_scan:.3f} ms (scan/lists {t_scan / t_list:.2f}), "
          f"plain {t_plain:.3f} ms, density {keep:.3f}; TFLOP/s over kept entries: lists "
          f"{flops * keep / t_list / 1e9:.0f}, scan {flops * keep / t_scan / 1e9:.0f}, plain {flops / t_plain / 1e9:.0f}")


def test_dense_block_table_once_per_data():
    """offsets[ids[q]] <= kv: a table read at an index read from data, which the range analysis cannot bound:
    the dense block table is evaluated once for calls with the same tensors (forward and backward each),
    again after an in-place write, and the numbers follow the data."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ids_t = fl.capture("ids", "i32", "N")
    offsets_t = fl.capture("offsets", "i32", "N")
    g = fl.attention(mask_mod=lambda b, h, q, kv: offsets_t[ids_t[q]] <= kv, name="nested_gpu")
    c = fl.compile(g, "numba-cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    B, H, N, D = 2, 4, 1000, 64
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
    ids = torch.randint(0, N, (N,), device="cuda", generator=gen, dtype=torch.int32)
    offsets = torch.randint(0, N + 2, (N,), device="cuda", generator=gen, dtype=torch.int32)
    offsets[ids[0]] = N  # rows of that id attend to nothing
    fwd = c.kernel(q, k, v, ids, offsets)
    assert fwd.spec.block_mask == "table"

    def ref(qq, kk, vv):
        keep = (offsets[ids.long()][:, None] <= torch.arange(N, device="cuda")[None, :])
        s = (qq @ kk.transpose(-1, -2)) / math.sqrt(D)
        s = s.masked_fill(~keep, -math.inf)
        rows = keep.any(-1)
        p = torch.softmax(s.masked_fill(~rows[:, None], 0.0), dim=-1) * rows[:, None]
        return p.to(qq.dtype) @ vv, rows

    for step in range(3):
        o, lse = c.forward(q, k, v, ids, offsets)
        o2, lse2 = c.forward(q, k, v, ids, offsets)
        assert torch.equal(o, o2)
        assert fwd.block_tables.evaluations == step + 1  # once for the two calls with this data
        want, rows = ref(q.double(), k.double(), v.double())
        assert (o.double() - want).abs().max().item() < 2e-2
        assert (o[..., ~rows, :] == 0).all() and torch.isneginf(lse[..., ~rows]).all()
        ql, kl, vl = (x.double().requires_grad_(True) for x in (q, k, v))
        ref(ql, kl, vl)[0].backward(do.double())
        bwd = c.backward_kernel(q, k, v, ids, offsets)
        for _ in range(2):
            grads = c.backward(q, k, v, o, lse, do, ids, offsets)[:3]
        assert bwd.spec.block_mask == "table" and bwd.block_tables.evaluations == step + 1
        for name, g_, w in zip(("dq", "dk", "dv"), grads, (ql.grad, kl.grad, vl.grad)):
            _grads_close(g_, w, name)
        offsets[: N // 4] = offsets[: N // 4].flip(0) + step  # in place: new data
