"""The direct launcher's argument packing (runtime.ArgLayout / ArgBuffer), checked against the parameters
Numba's compiler gives a kernel in PTX (no GPU needed): one 8-byte slot per PTX parameter, in order, an
array as 5 + 2N of them, scalars as their C types. tests/gpu/test_call_overhead_gpu.py launches with it."""

from __future__ import annotations

import ctypes
import re
import struct

import numpy as np
import pytest

pytest.importorskip("numba")

from falower.backends.numba_cuda.runtime import ArgBuffer, ArgLayout, pack_scalar, ptx_of  # noqa: E402

_PTX_BYTES = {"u64": 8, "b64": 8, "s64": 8, "f64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4, "u16": 2, "b16": 2,
              "f16": 2, "u8": 1, "b8": 1, "s8": 1}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))


def _entry_params(ptx: str) -> list[int]:
    entry = ptx[ptx.index(".entry"):]
    entry = entry[:entry.index(")")]
    return [_PTX_BYTES[t] for t in re.findall(r"\.param\s+\.(\w+)", entry)]


def _slot_sizes(layout: ArgLayout) -> list[int]:
    sizes: list[int] = []
    for nd, item in zip(layout.ndim, layout.itemsize):
        sizes += [8] * (5 + 2 * nd) if nd >= 0 else [item]
    return sizes


def test_layout_is_numbas_kernel_abi():
    from numba import cuda, types

    def k(a, n, b, x, f, flag, h):
        if flag:
            a[0] = b[0, 0] + f + n + x + h

    argtypes = (types.Array(types.float32, 1, "C"), types.int64, types.Array(types.float32, 2, "C"), types.int32,
                types.float32, types.boolean, types.float16)
    layout = ArgLayout(argtypes)
    assert layout.first == [0, 7, 8, 17, 18, 19, 20] and layout.nslots == 21
    assert _entry_params(ptx_of(cuda.jit(k), argtypes)) == _slot_sizes(layout)


def test_a_generated_kernels_layout_matches_its_ptx():
    """The block-mask kernel of the document example (a 2-d captured table, int64 sizes)."""
    import falower as fl

    doc_id = fl.capture("doc_id", "i32", "B,N")
    graph = fl.attention(mask_mod=lambda b, h, q, kv: (doc_id[b, q] == doc_id[b, kv]) & (doc_id[b, q] >= 0),
                         name="document")
    c = fl.compile(graph, path="mma", pipeline=fl.passes.NAMED_PIPELINES["fa2-fwd"].replace("mask-tiles",
                                                                                           "mask-tiles{data=table}"))
    kern = c.specialize("f16", D=64)
    argtypes = kern.mask_argtypes()
    assert _entry_params(ptx_of(kern._mask_kernel, argtypes)) == _slot_sizes(ArgLayout(argtypes))


def test_array_slots_are_c_contiguous_in_bytes():
    from numba import types

    layout = ArgLayout((types.int64, types.Array(types.int16, 3, "C")))
    slots = layout.array_slots(1, (2, 3, 5))
    f = layout.first[1]
    # meminfo, parent, nitems, itemsize, (data), shape, strides in bytes
    assert [slots[f + i] for i in (0, 1, 2, 3)] == [0, 0, 30, 2]
    assert [slots[f + 5 + i] for i in range(3)] == [2, 3, 5]
    assert [slots[f + 8 + i] for i in range(3)] == [30, 10, 2]
    assert layout.data_slot(1) == f + 4 and f + 4 not in slots
    with pytest.raises(ValueError, match="3-d array"):
        layout.array_slots(1, (6,))
    with pytest.raises(TypeError, match="scalar"):
        layout.array_slots(0, (1,))


def test_scalars_pack_as_their_c_types():
    assert pack_scalar("int", -1, 4) == 0xFFFFFFFF  # the low 4 bytes of the slot are int32 -1
    assert pack_scalar("int", -1, 8) == -1
    for v in (1 << 32, -(1 << 31) - 1):  # past both int32 and uint32: refused, not wrapped
        with pytest.raises(ValueError, match="does not fit the kernel's 32-bit"):
            pack_scalar("int", v, 4)
    assert pack_scalar("f32", 1.5, 4) == struct.unpack("<I", struct.pack("<f", 1.5))[0]
    assert pack_scalar("f64", -2.0, 8) == struct.unpack("<q", struct.pack("<d", -2.0))[0]
    assert pack_scalar("f16", 1.0, 2) == 0x3C00
    assert pack_scalar("bool", True, 1) == 1


def test_buffer_points_at_its_slots():
    from numba import types

    layout = ArgLayout((types.Array(types.float32, 1, "C"), types.int32))
    buf = ArgBuffer(layout)
    slot = buf.array(0, (10,), ptr=0x1000)
    buf.scalar(1, -3)
    params = (ctypes.c_void_p * layout.nslots).from_address(buf.address)
    read = [ctypes.c_int64.from_address(params[i]).value for i in range(layout.nslots)]
    assert read == [0, 0, 10, 4, 0x1000, 10, 4, 0xFFFFFFFD]
    assert slot == 4
    assert np.all(np.diff([params[i] for i in range(layout.nslots)]) == 8)


def test_emitted_source_is_read_back_from_the_cache(monkeypatch):
    from falower.backends.numba_cuda import runtime

    calls = []

    def emit(spec):
        calls.append(spec)
        return f"# source of {spec}\n"

    assert runtime.emit_cached(emit, "spec-a", "forward") == "# source of spec-a\n"
    assert runtime.emit_cached(emit, "spec-a", "forward") == "# source of spec-a\n"
    assert runtime.emit_cached(emit, "spec-b", "forward") == "# source of spec-b\n"
    assert runtime.emit_cached(emit, "spec-a", "delta") == "# source of spec-a\n"
    assert calls == ["spec-a", "spec-b", "spec-a"]  # the second spec-a forward came from disk
