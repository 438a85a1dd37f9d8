"""tensor_maps.py without a GPU: O's map geometry, the map writer's PTX, and the cache's keep-and-drop rule (the
driver's encode and the writes run in tests/gpu/test_tensor_maps_gpu.py)."""

from __future__ import annotations

import re

import pytest

from falower.backends.numba_cuda import tensor_maps


def test_o_is_a_rank_3_map_whose_box_stops_at_its_slice():
    dims, strides, box = tensor_maps.o_map_geometry(BH=6, M=200, D=128)
    assert dims == (128, 200, 6)  # innermost first: a box's rows past M are outside, not the next slice's
    assert strides == (256, 256 * 200) and all(s % 16 == 0 for s in strides)
    assert box == (64, 16, 1) and box[0] * 2 == 128  # the 128-byte swizzle's span


def test_k_and_v_are_rank_4_maps_over_their_views_strides():
    """A [B, N, Hk, D] projection viewed as [B, Hk, N, D]: element strides (N Hk D, D, Hk D) as the kernels take
    them, in bytes, innermost first after D."""
    dims, strides, box = tensor_maps.qkv_map_geometry(2, 4, 300, 128, (300 * 4 * 128, 128, 4 * 128), 128)
    assert dims == (128, 300, 4, 2) and strides == (2 * 4 * 128, 2 * 128, 2 * 300 * 4 * 128)
    assert box == (64, 128, 1, 1)


def test_a_dimension_of_one_index_takes_a_dense_stride():
    """A broadcast view's zero stride on a dimension of one index (torch's expand, numpy's broadcast_to) never moves:
    the map takes the dense stride there, which the driver accepts, and keeps the real ones elsewhere."""
    dims, strides, _ = tensor_maps.qkv_map_geometry(1, 1, 300, 64, (0, 0, 64), 128)
    assert dims == (64, 300, 1, 1) and strides == (128, 128 * 300, 128 * 300)
    _, strides, _ = tensor_maps.qkv_map_geometry(2, 3, 1, 64, (1000, 64, 0), 64)
    assert strides == (128, 128, 2000)


def test_the_writer_stores_its_16_words():
    ptx = tensor_maps._put_words_ptx((9, 0)).decode()
    assert ptx.endswith("\0") and ".target sm_90\n" in ptx
    assert ptx.count(".param .u64 w") == 16
    offsets = [int(x) for x in re.findall(r"st\.global\.u64 \[%a\+(\d+)\]", ptx)]
    assert offsets == list(range(0, 128, 8))


def test_the_cache_keeps_the_recent_maps_and_drops_the_oldest():
    maps = tensor_maps.TensorMaps("f16")
    made = []

    def make(k):
        made.append(k)
        return f"map{k}"

    for k in range(tensor_maps.KEEP):
        assert maps._get(("k", k), lambda k=k: make(k)) == f"map{k}"
    assert maps.dropped == 0
    maps._get(("k", 0), lambda: make("again"))  # used again: now the most recent
    maps._get(("k", "new"), lambda: make("new"))  # one more: the least recent (1) is dropped
    assert made[-1] == "new" and "again" not in made
    maps._get(("k", 1), lambda: make("1 again"))
    assert made[-1] == "1 again" and len(maps._maps) == tensor_maps.KEEP
    assert maps.dropped == 2  # (a plan that kept a map's address without the map looks it up again: map_memo)


def test_an_encode_asks_for_a_16_bit_type_and_16_byte_strides():
    with pytest.raises(ValueError, match="f16 or bf16"):
        tensor_maps.encode_o_map(0, 1, 1, 64, "f32")
    with pytest.raises(tensor_maps.TensorMapError, match="multiples of 16"):  # before the driver is asked
        tensor_maps.encode_map(0, tensor_maps.qkv_map_geometry(1, 1, 10, 64, (640, 640, 60), 128), "f16", "K")
