"""block_data.py without a GPU: the torch form of mask.ranges equals the interpreter's, and block data is
remembered with the data it came from (same tensor and version: the same tables; an in-place write or a new
tensor: made anew). torch on the CPU stands for CUDA here: only the range tables are made (the backward's
spec, which has no block list)."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numba")

import falower as fl  # noqa: E402
from falower.backends.numba_cuda.block_data import BlockData, caller_count, range_table  # noqa: E402
from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec  # noqa: E402
from falower.ir.intervals import minmax_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("shape,axis,granule", [((2, 7), 1, 3), ((2, 3, 64), 2, 64), ((5,), 0, 1), ((3, 130), 1, 64),
                                                ((4, 2), 0, 4), ((1, 1), 1, 16)])
@pytest.mark.parametrize("dtype", ["i32", "bool", "f32"])
def test_torch_ranges_equal_the_interpreters(shape, axis, granule, dtype) -> None:
    rng = np.random.default_rng(sum(shape))
    x = rng.integers(-3, 5, size=shape)
    x = x > 0 if dtype == "bool" else x.astype(np.float32 if dtype == "f32" else np.int32)
    want_dtype = "i32" if dtype == "bool" else dtype
    got = range_table(torch.from_numpy(x), axis, granule, want_dtype)
    want = minmax_table(x, axis, granule)
    assert got.is_contiguous() and tuple(got.shape) == want.shape
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(range_table(x, axis, granule, want_dtype), want)  # the numpy form


def _document_spec():
    g = runpy.run_path(str(ROOT / "examples" / "document.py"))["graph"]
    return build_backward_spec(analyse_backward(fl.lower(g, "fa2-bwd")), {"D": 64}, "f16", "mma", None)


def test_block_data_is_remembered_with_its_tensor() -> None:
    spec = _document_spec()
    assert caller_count(spec) == 3  # doc_id, dim_M, dim_N; then the range table
    bd = BlockData(spec)
    doc = torch.sort(torch.randint(0, 4, (2, 200), dtype=torch.int32), dim=1).values
    q = torch.zeros(2, 1, 200, 64, dtype=torch.float16)
    sizes = (2, 1, 200, 200)
    (first,) = bd.derive([doc, 200, 200], sizes, q)
    np.testing.assert_array_equal(first.numpy(), minmax_table(doc.numpy(), 1, 64))
    (again,) = bd.derive([doc, 200, 200], sizes, q)
    assert again is first  # the same tensor, unchanged: made once (every layer, every step)
    doc[:, :10] = 7  # an in-place write bumps the version counter: new data
    (after,) = bd.derive([doc, 200, 200], sizes, q)
    assert after is not first
    np.testing.assert_array_equal(after.numpy(), minmax_table(doc.numpy(), 1, 64))
    other = doc.clone()  # equal contents, another tensor: made anew (never mistaken for a freed one)
    (third,) = bd.derive([other, 200, 200], sizes, q)
    assert third is not after
    np.testing.assert_array_equal(third.numpy(), after.numpy())
    host = doc.numpy()  # numpy has no version counter: made at every call
    (a,) = bd.derive([host, 200, 200], sizes, host)
    (b,) = bd.derive([host, 200, 200], sizes, host)
    assert a is not b


def test_flex_conversions_are_remembered_per_tensor_version() -> None:
    from falower.torch_mods import _converted

    ids = torch.arange(10)  # int64, as torch.randint gives: converted to the kernels' int32
    a = _converted(ids, ids.device, torch.int32)
    assert a.dtype == torch.int32 and _converted(ids, ids.device, torch.int32) is a
    ids += 1
    b = _converted(ids, ids.device, torch.int32)
    assert b is not a and int(b[0]) == 1
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    assert _converted(w, w.device, torch.float32) is not _converted(w, w.device, torch.float32)
