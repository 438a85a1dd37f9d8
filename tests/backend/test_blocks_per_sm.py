"""Two blocks an SM on decoding's 64-row tiles (extra blocks_per_sm 2, emit_fa3_ws.blocks_per_sm) and decoding's kv
tile width (extra decode_block_k), chosen by falower.compile on a faked Hopper: the knobs reach the kernels they
are for and no other, and values they cannot take are refused by name at compile, not sent to another kernel."""

from __future__ import annotations

import pytest

import falower as fl
from falower.backends.numba_cuda import emit_fa3_ws
from falower.errors import FalowerError


def _spec(c, **env):
    return c.specialize("f16", **{"B": 1, "H": 8, "D": 128, **env}).spec


@pytest.mark.parametrize("extra, what", [
    ({"blocks_per_sm": 4}, "blocks_per_sm must be 1 or 2 or 3, got 4"),
    ({"blocks_per_sm": "2"}, "blocks_per_sm must be 1 or 2 or 3, got '2'"),
    ({"blocks_per_sm": True}, "blocks_per_sm must be"),
    ({"decode_block_k": 96}, "decode_block_k must be 64 or 128, got 96"),
])
def test_values_outside_the_knobs_choices_are_refused_at_compile(extra, what):
    with pytest.raises(FalowerError, match=what):
        fl.compile(fl.attention(name="bps_bad"), extra=extra)


def test_decodings_tiles_take_two_blocks_and_prefill_keeps_one(hopper):
    c = fl.compile(fl.attention(name="bps"), extra={"blocks_per_sm": 2})
    dec = _spec(c, M=1, N=1024)
    assert (dec.block_q, dec.block_k) == (64, 64) and emit_fa3_ws.blocks_per_sm(dec) == 2
    assert int(dec.extra["persistent"]) == 264  # two blocks on each of the 132 SMs
    assert "@launch_bounds(256, 2)" in c.specialize("f16", B=1, H=8, D=128, M=1, N=1024).source
    pre = _spec(c, M=4096, N=4096)  # the persistent kernel's 128-row tiles, one block an SM, as without the knob
    base = _spec(fl.compile(fl.attention(name="bps_base")), M=4096, N=4096)
    assert (pre.block_q, pre.block_k, pre.extra["schedule"]) == (base.block_q, base.block_k, base.extra["schedule"])
    assert int(pre.extra["persistent"]) == int(base.extra["persistent"]) == 132
    assert emit_fa3_ws.blocks_per_sm(pre) == 1


def test_decode_block_k_sets_decodings_tile_width_only(hopper):
    c = fl.compile(fl.attention(name="dbk"), extra={"decode_block_k": 64})
    assert _spec(c, M=1, N=1024).block_k == 64
    assert _spec(c, M=4096, N=4096).block_k == 128


def test_two_blocks_with_wide_tiles_at_d128_are_refused_by_name(hopper):
    c = fl.compile(fl.attention(name="bps_wide"), extra={"blocks_per_sm": 2, "decode_block_k": 128})
    with pytest.raises(FalowerError, match="blocks_per_sm 2 with decode_block_k 128 at D = 128"):
        _spec(c, M=1, N=1024)


@pytest.mark.parametrize("n", [512, 1024])
def test_split_kv_parts_are_counted_on_the_tiles_decode_block_k_sets(hopper, n):
    """split-kv's part count takes the kv tiles the kernel runs: N keys in 64-wide tiles are as many tiles as 2N in
    the default 128-wide ones, so they get the same parts (they were counted as N / 128 tiles before)."""
    narrow = _spec(fl.compile(fl.attention(name="dbk_parts"), extra={"decode_block_k": 64}), M=1, N=n)
    wide = _spec(fl.compile(fl.attention(name="dbk_parts_base")), M=1, N=2 * n)
    assert (narrow.block_k, wide.block_k) == (64, 128)
    assert narrow.kv_parts == wide.kv_parts > 1
