"""Three consumer warpgroups in the warp-specialized forward (emit_fa3_ws at block_q 192, FlashAttention-3's D = 64
tile): the source's turn rotation and barrier ids, the block's threads, registers and shared memory, and what the
first form refuses. The simulator runs it (ws_sim_cases.py's ws3-* cases in test_ws_persistent_simulator, and the
three-warpgroup ring, ring-3wg, in test_fa3_ws_simulator)."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import make_spec  # noqa: E402

from falower.backends.numba_cuda import emit_fa3_ws  # noqa: E402

PERSIST = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 132, "item_order": "dynamic"}


def spec(variant: str = "causal", D: int = 64, bq: int = 192, bk: int = 128, **extra):
    s = make_spec(variant, D, "f16", path="mma", block_q=bq, block_k=bk, num_warps=8)
    return dataclasses.replace(s, extra={**PERSIST, **extra})


def test_three_warpgroups_take_turns_in_rotation():
    """0 -> 1 -> 2 -> 0 through barriers 1-3 (the last warpgroup primes warpgroup 0's), with no run-time %; the
    staged epilogue's barriers move past the turns' to 7 + cw; two warpgroups keep 2 - cw and 5 + cw."""
    src = emit_fa3_ws.emit_fa3_ws_forward(spec())
    assert re.search(r"if cw == 2:\n\s+bar_arrive\(1, 256\)", src)
    assert "pp_next = cw + 2 if cw < 2 else 1" in src and "bar_arrive(pp_next, 256)" in src
    assert "bar_sync(1 + cw, 256)" in src and "2 - cw" not in src and "%" not in src.split("pp_next =", 1)[1][:40]
    assert "bar_sync(7 + cw, 128)" in src and "bar_sync(5 + cw" not in src
    two = emit_fa3_ws.emit_fa3_ws_forward(spec(bq=128))
    assert "pp_next" not in two and "bar_arrive(2 - cw, 256)" in two and "bar_sync(5 + cw, 128)" in two
    assert re.search(r"if cw == 1:\n\s+bar_arrive\(1, 256\)", two)


@pytest.mark.parametrize("variant", ["plain", "causal"])
def test_resources(variant: str):
    """512 threads (a producer warpgroup and three consumers); registers split 32 / 160 (FlashAttention-3's;
    24 x 128 + 160 x 384 fits 65,536), the kept epilogue's arrays a third larger than two warpgroups', the whole
    block under the SM's shared memory, and the Q buffers 192 rows."""
    s = spec(variant)
    emit_fa3_ws.validate_spec(s)
    assert emit_fa3_ws.threads_per_block(s) == 512 and emit_fa3_ws.consumer_wgs(s) == 3
    p, c = emit_fa3_ws.registers(s)
    assert (p, c) == (32, 160) and 128 * p + 384 * c <= emit_fa3_ws.REGISTER_FILE
    assert emit_fa3_ws.registers(spec(variant, producer_regs=56)) == (56, 152)
    two = spec(variant, bq=128)
    assert emit_fa3_ws.registers(two) == (56, 224)  # two warpgroups: unchanged
    assert emit_fa3_ws.kept_bytes(s) == 3 * emit_fa3_ws.kept_bytes(two) // 2
    assert emit_fa3_ws.smem_bytes(s) + emit_fa3_ws.static_bytes(s) <= emit_fa3_ws.SMEM_LIMIT
    lay = emit_fa3_ws._layout(s)
    assert lay["kv"] == 3 * lay["qwg"]  # a Q buffer: three warpgroups' 64 rows
    src = emit_fa3_ws.emit_fa3_ws_forward(s)
    assert f"ep_f = cuda.shared.array({emit_fa3_ws.kept_f32(s)}, np.float32)" in src
    assert "mbar_arrive_expect_tx(q_bar, 24576)" in src  # 192 rows x 64 columns x 2 bytes of Q an item
    assert [int(r) for r in re.findall(r"tma_load_4d\(q_buf \+ \d+, qmap_g, 0, q_lo \+ (\d+),", src)] == [0, 64, 128]


@pytest.mark.parametrize("change, missing", [
    ({"D": 128}, "D = 64"),
    ({"persistent": None}, "a persistent kernel"),
    ({"producer": "none"}, "a producer warpgroup"),
    ({"tma_loads": False}, "TMA loads"),
])
def test_what_three_warpgroups_refuse(change: dict, missing: str):
    """One line that names every condition the spec misses (the first form: D = 64, the persistent producer
    warpgroup with TMA loads, no mask or a static one)."""
    change = dict(change)
    D = change.pop("D", 64)
    extra = {**PERSIST, **change}
    extra = {k: v for k, v in extra.items() if v is not None}
    if "persistent" not in extra:
        extra.pop("item_order")
    s = dataclasses.replace(make_spec("causal", D, "f16", path="mma", block_q=192, block_k=128, num_warps=8),
                            extra=extra)
    with pytest.raises(ValueError, match=f"three consumer warpgroups \\(block_q 192\\) need .*{missing}"):
        emit_fa3_ws.validate_spec(s)


def test_other_row_counts_are_refused():
    with pytest.raises(ValueError, match="block_q must be 64, 128 or 192"):
        emit_fa3_ws.validate_spec(spec(bq=256))


def test_wide_kv_tiles_are_refused():
    """192 x 256: S alone would take 128 of the consumers' 160 registers (ptxas stops with C7602), so it is refused
    here rather than by the driver on the GPU; 192 x 64 and 192 x 128 are taken."""
    for bk in (64, 128):
        emit_fa3_ws.validate_spec(spec(bk=bk))
    with pytest.raises(ValueError, match=r"need block_k <= 128 \(got 256\)"):
        emit_fa3_ws.validate_spec(spec(bk=256))


def test_a_relative_bias_takes_its_runs_of_the_table():
    """The relative bias at 192 rows: each of the three consumer warpgroups copies its own run of the table into
    shared memory (row_slice: three pairs of buffers, its barrier 10 + cw, clear of the epilogue's 7-9), so neither
    the early gathers nor the L2 prefetch three warpgroups refuse is issued; without the runs it is refused by name.
    The simulator runs it (col_step_sim_cases.py's pwg3-persist-relbias-slice)."""
    import runpy

    import falower as fl
    from falower.backends.numba_cuda.from_ir import analyse, build_spec

    root = Path(__file__).resolve().parents[2]
    g = next(v for v in runpy.run_path(str(root / "examples" / "relative_bias.py")).values()
             if isinstance(v, fl.Func))
    base = build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": 64}, "f16", "mma", None, PERSIST)

    def rel(bq: int = 192, **extra):
        return dataclasses.replace(base, block_q=bq, block_k=128, extra={**PERSIST, **extra})

    s = rel()
    emit_fa3_ws.validate_spec(s)
    assert emit_fa3_ws.row_slice(s) and emit_fa3_ws.slice_bytes(s) == 3 * 2 * emit_fa3_ws.SLICE_ENTRIES * 4
    src = emit_fa3_ws.emit_fa3_ws_forward(s)
    assert "bar_sync(10 + cw, 128)" in src and "rsl = cuda.shared.array(1536," in src
    assert "pf_kv" not in src
    assert "gl = score_pair_load(" not in src and "gl = score_pair_slice(rsl, " in src
    pairs = rel(slice_pairs=True)  # a buffer: the run and its copy shifted by one (slice_pairs)
    stride = emit_fa3_ws.slice_stride(pairs)
    assert emit_fa3_ws.slice_bytes(pairs) == 3 * 2 * stride * 4 and stride > 2 * 256
    two = emit_fa3_ws.emit_fa3_ws_forward(pairs)
    assert f"rsl = cuda.shared.array({3 * 2 * stride}," in two and "gl = score_pair_slice2(rsl_s + " in two
    assert emit_fa3_ws.slice_barrier(rel(bq=128)) == 9
    with pytest.raises(ValueError, match="need no table prefetch, no early gathers"):
        emit_fa3_ws.validate_spec(rel(row_slice=False))
