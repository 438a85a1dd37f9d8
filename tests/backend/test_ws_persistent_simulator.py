"""The persistent warp-specialized forward (emit_fa3_ws.py, extra "persistent"): blocks that walk several work
items, with the ring's stages, the Q barrier's parity and the loader running ahead across items (the consumers
loading, or a producer warpgroup: PERSIST_CASES "ws-pwg-*"), in the CUDA
simulator against the float64 reference (ws_sim_cases.py's PERSIST_CASES and the document example through
falower.compile, COMPILED_CASES: a block list with an item that visits nothing, walked by the producer
warpgroup). Their own subprocess, beside test_fa3_ws_simulator's.

And the warp-specialized forward with warp 1 of each warpgroup slowed (FALOWER_SIM_SLOW_WARP, wgmma.py): the
emulated threads otherwise run near lockstep, while on the GPU a warp's wgmma wait returns when its own part of the
warpgroup's product is done. A kernel that rewrites shared memory another warp's part still reads (the producer
warpgroup's Q buffer released before its O's copies have read it; the staged epilogue's rows at D = 128, o_err 0.29;
the producer-less persistent kernel's next Q rows, o_err 1.16 without its barrier, a case cut for CI time on
2026-11-29: that kernel is a default nowhere) reads wrong numbers here every time (ws_sim_cases.py's
SLOW_WARP_CASES; the warp sleeps 0.2 s a read: at 0.05 s, or on one head, the released buffer's race passed unseen,
2026-11-28). Its subprocess runs beside the persistent cases' (this module's one fixture): asleep most of its ~115
s, it cost a worker that long on its own (a module of its own until 2026-12-01)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import assert_forward_close, collect, spawn  # noqa: E402
from ws_sim_cases import COMPILED_CASES, PERSIST_CASES, SLOW_WARP_CASES, SLOW_WARP_SECONDS  # noqa: E402


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """(the persistent cases' results, the slowed warp's), their two subprocesses at once: the first on this
    worker's core, the second (mostly asleep) on the next."""
    persist = spawn("ws_sim_cases.py", tmp_path_factory.mktemp("kernels"), [*PERSIST_CASES, *COMPILED_CASES])
    slow = spawn("ws_sim_cases.py", tmp_path_factory.mktemp("slow"), [*SLOW_WARP_CASES],
                 {"FALOWER_SIM_SLOW_WARP": str(SLOW_WARP_SECONDS)})
    return collect(persist), collect(slow)


@pytest.fixture(scope="module")
def results(both):
    return both[0]


@pytest.mark.parametrize("case", sorted(SLOW_WARP_CASES))
def test_slow_warp_simulator(both, case):
    assert_forward_close(both[1].get(case))


@pytest.mark.parametrize("case", sorted(PERSIST_CASES) + sorted(COMPILED_CASES))
def test_persistent_simulator(results, case):
    r = results.get(case)
    assert_forward_close(r)
    if "work_left" in r:  # item_order "dynamic": every launch leaves the counter as it found it
        assert r["work_left"] == [0, 0], r
    if "poisoned" in r:  # the poisoned head's O is not finite; the others (checked above) inherit none of it
        assert r["poisoned"], r
    if case in PERSIST_CASES:  # the kv tiles from the last down where asked (emit_fa3_ws.kv_reverse)
        assert r["kv_reverse"] == bool(PERSIST_CASES[case][-1].get("kv_reverse")), r
        assert r["ragged_first"] == bool(PERSIST_CASES[case][-1].get("ragged_q_first")), r
        # the block's own first item sent at its entry where asked (emit_fa3_ws.early_first_item)
        assert r["early_first"] == bool(PERSIST_CASES[case][-1].get("early_first_item")), r
    if case in COMPILED_CASES:
        assert r["block_mask"] == "list" and r["persistent"] == COMPILED_CASES[case][2], r
        assert r["producer"] == COMPILED_CASES[case][3], r
        # the producer warpgroup hands each item's list head over beside its ticket (list_head_shared)
        assert r["list_head"] == (r["producer"] == "warpgroup"), r
        assert r["lse_inf_ok"] and r["masked_rows"] >= 2, r  # the padding rows: O = 0, LSE = -inf


def test_grid_and_validation():
    """A persistent grid has min(blocks, items) blocks; the schedule refuses what it cannot carry across items."""
    import dataclasses

    from variants import make_spec

    from falower.backends.numba_cuda import emit_fa2, emit_fa3_ws

    spec = make_spec("causal", 128, "f16", path="mma", block_q=128, block_k=128, num_warps=8)
    ws = dataclasses.replace(spec, extra={"schedule": "wgmma-ws", "producer": "none", "persistent": 132})
    assert emit_fa2.grid(ws, 4, 16, 4096, 4096) == (132, 1, 1)
    assert emit_fa2.grid(ws, 1, 2, 200, 200) == (4, 1, 1)  # 2 q tiles x 2 heads: one block an item
    emit_fa3_ws.validate_spec(dataclasses.replace(spec, extra={"schedule": "wgmma-ws", "producer": "warpgroup",
                                                               "persistent": 4}))
    for extra, what in (({"producer": "warp", "persistent": 4}, "producer 'none' or 'warpgroup'"),
                        ({"producer": "none", "persistent": -1}, "persistent must be"),
                        ({"producer": "none", "persistent": 4, "item_order": "dynamic"}, "needs persistent and"),
                        ({"producer": "warpgroup", "item_order": "dynamic"}, "needs persistent and"),
                        ({"producer": "warpgroup", "item_order": "cost"}, "orders a persistent kernel's items"),
                        ({"producer": "warpgroup", "persistent": 4, "item_order": "x"}, "item_order must be")):
        with pytest.raises(ValueError, match=what):
            emit_fa3_ws.validate_spec(dataclasses.replace(spec, extra={"schedule": "wgmma-ws", **extra}))


def test_the_persistent_producer_stages_o_apart_where_it_fits():
    """The persistent kernel with a producer warpgroup stages O through a buffer of its own (the Q tile is being
    refilled for the next item) where it fits beside the ring under 227 KB, and stores from the fragments where it
    does not (D = 128 with 3 stages) or where asked (staged_epilogue False); the kernel's source says which."""
    import dataclasses

    from variants import make_spec

    from falower.backends.numba_cuda import emit_fa3_ws

    base = make_spec("causal", 128, "f16", path="mma", block_q=128, block_k=128, num_warps=8)

    def spec(D=128, **extra):
        s = make_spec("causal", D, "f16", path="mma", block_q=128, block_k=128, num_warps=8) if D != 128 else base
        return dataclasses.replace(s, extra={"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 8,
                                             "item_order": "dynamic", **extra})

    for s, staged in ((spec(), True), (spec(stages=3), False), (spec(staged_epilogue=False), False),
                      (spec(64, stages=4), True)):
        lay = emit_fa3_ws._layout(s)
        assert emit_fa3_ws.staged_epilogue(s) is staged and (lay["o"] > 0) is staged
        assert emit_fa3_ws.smem_bytes(s) <= emit_fa3_ws.SMEM_LIMIT
        if staged:  # after the ring, before the barriers, two warpgroups' 64 rows of D (bulk_store by a copy a row:
            # each row 16 bytes more, a warpgroup's tile rounded up to 1024 bytes; by TMA tensor copies none more)
            row = 2 * s.head_dim + (16 if emit_fa3_ws.bulk_store(s) and not emit_fa3_ws.tma_store(s) else 0)
            assert lay["qwg"] == -(-64 * row // 1024) * 1024 and lay["o"] + 2 * lay["qwg"] == lay["bars"]
        src = emit_fa3_ws.emit_fa3_ws_forward(s)
        staging = re.search(r"stage_row(_z)?(_box)?\(|stage_rows_stsm\(", src)  # a word at a time, or by stmatrix
        assert ("o_wg = sb + " in src) is staged and bool(staging) is staged
