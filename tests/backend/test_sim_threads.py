"""The simulator's barriers (falower/backends/numba_cuda/sim_threads.py): the hand-over barrier as plain threads,
and the block manager it replaces numba-cuda's with, in the simulator (sim_threads_cases.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from falower.backends.numba_cuda.sim_threads import HandOverBarrier

HERE = Path(__file__).resolve().parent


def _run(threads, seconds: float = 30):
    """Start the threads (daemons: one stuck at a broken barrier must not hold the test process) and join them
    within `seconds` in all."""
    import time

    for t in threads:
        t.daemon = True
        t.start()
    end = time.monotonic() + seconds
    for t in threads:
        t.join(timeout=max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread is stuck at the barrier"


def _until(cond, seconds: float = 30) -> None:
    import time

    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, "the threads never reached the barrier"
        time.sleep(0.001)


def test_no_thread_passes_before_all_arrive():
    """32 threads, 200 rounds: each writes its slot, waits, and reads every slot of the round; a barrier that let a
    thread through early (or woke one twice) shows a slot from the round before."""
    n, rounds = 32, 200
    bar = HandOverBarrier(n)
    slots = [[-1] * n, [-1] * n]
    stale = []

    def lane(i):
        for r in range(rounds):
            slots[r & 1][i] = r
            bar.wait()
            if any(v != r for v in slots[r & 1]):
                stale.append((i, r))

    _run([threading.Thread(target=lane, args=(i,)) for i in range(n)])
    assert stale == []


def test_a_party_that_leaves_no_longer_counts():
    """4 parties; one leaves while the others wait (a simulated thread that returned): they pass, and the next
    round needs only the three."""
    bar = HandOverBarrier(4)
    passed = []

    def waiter(i):
        bar.wait()
        bar.wait()
        passed.append(i)

    threads = [threading.Thread(target=waiter, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    _until(lambda: bar._arrived == 3)
    bar.leave()
    _run([])
    for t in threads:
        t.join(timeout=30)
    assert sorted(passed) == [0, 1, 2]


def test_abort_raises_in_every_waiter():
    bar = HandOverBarrier(3)
    errors = []

    def waiter():
        try:
            bar.wait()
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=waiter, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    _until(lambda: bar._arrived == 2)
    bar.abort()
    for t in threads:
        t.join(timeout=30)
    assert len(errors) == 2 and all("abort" in e for e in errors)
    with pytest.raises(RuntimeError, match="abort"):
        bar.wait()


@pytest.fixture(scope="module")
def sim():
    pytest.importorskip("numba")
    sys.path.insert(0, str(HERE))
    from simulated import collect, spawn

    return collect(spawn("sim_threads_cases.py"), timeout=300)


def test_simulator_block_manager_is_installed(sim):
    assert all(r.get("installed") for r in sim.values()), sim


def test_simulator_barrier_waits_for_the_live_threads_only(sim):
    """Threads 40-63 return before the first barrier; the other 40 take 40 barriers and read every round right."""
    r = sim["early-exit"]
    assert "error" not in r, r
    assert r["stale_reads"] == 0, r


def test_simulator_block_votes(sim):
    r = sim["votes"]
    assert "error" not in r, r
    assert r["rows"] == [[32], [1], [1], [0]], r


def test_simulator_exception_is_raised_by_the_launch(sim):
    """Thread 7 of block 1 indexes out of bounds between two barriers: the launch raises its IndexError, named by
    the thread and block, and does not wait on the threads it stopped."""
    r = sim["raises"]
    assert "error" not in r, r
    assert r["message"] is not None and "tid=[7, 0, 0]" in r["message"] and "ctaid=[1, 0, 0]" in r["message"], r
    assert r["seconds"] < 60, r


def test_simulator_bulk_copy_lands_at_the_wait(sim):
    """intrinsics.bulk_store in the simulator: the copy lands at the thread's bulk_wait_read0 with its source as
    issued; sizes and addresses not multiples of 16 bytes are refused."""
    r = sim["bulk"]
    assert "error" not in r and r["raised"] is None, r
    assert r["out"] == [0] * 4 + [x for t in range(32) for x in (t + 1, t + 101)], r
    assert r["misaligned"] and "16-byte" in r["misaligned"], r


@pytest.mark.parametrize("case, what", [("bulk-late", "changed between the copy's issue and its wait"),
                                        ("bulk-early", "changed between the copy's issue and its wait"),
                                        ("bulk-uncommitted", "not committed"),
                                        ("bulk-left", "returned with bulk copies not waited for")])
def test_simulator_bulk_copy_races_raise(sim, case, what):
    """A staged row written again before the wait, a lane's row written after the copy's issue (no warp sync), a
    copy never committed, a thread that returns with its copy pending: each raises from the launch, where the GPU
    would give whatever it read; nothing lands."""
    r = sim[case]
    assert "error" not in r, r
    assert r["raised"] and what in r["raised"], r
    assert r["out"] == [0] * 68, r


def test_simulator_tma_store_writes_the_box_inside_the_tensor(sim):
    """intrinsics.tma_store_3d in the simulator (O's stores under emit_fa3_ws.tma_store): a box staged in the
    128-byte swizzle lands unswizzled at the wait, rows 8-19 of slice 0; the box's rows past the slice's 20 are not
    written (they would be slice 1's first rows), nor is anything else."""
    r = sim["tma"]
    assert "error" not in r and r["raised"] is None, r
    out = np.array(r["out"], dtype=np.int64)
    want = np.full((2, 20, 64), 0xBEEF)
    want[0, 8:20] = np.arange(12)[:, None] * 64 + np.arange(64)[None, :] + 1
    assert np.array_equal(out, want), np.argwhere(out != want)[:5]


@pytest.mark.parametrize("case, what", [("tma-late", "changed between the copy's issue and its wait"),
                                        ("tma-unaligned", "1024-byte aligned"),
                                        ("tma-not-a-map", "not a simulated tensor map")])
def test_simulator_tma_store_errors_raise(sim, case, what):
    """A box restaged before the copy's wait, a box not on the swizzle's 1024-byte alignment, an address that is not
    a map's: each raises from the launch, and nothing lands."""
    r = sim[case]
    assert "error" not in r, r
    assert r["raised"] and what in r["raised"], r
    assert all(x == 0xBEEF for plane in r["out"] for row in plane for x in row), r


def test_simulator_tma_load_lands_swizzled_with_zeros_past_the_tensor(sim):
    """intrinsics.tma_load_4d in the simulator (K and V under emit_fa3_ws.tma_loads): the box of rows 8-23 of
    head 2, batch 1 lands in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r & 7)), its rows past the
    tensor's 20 as zeros; the mbarrier's phase waits for the announced bytes, not only for the arrival; the box
    lands at a wait on its barrier, so a thread reading the stage before waiting reads its old bytes."""
    r = sim["tma-load"]
    assert "error" not in r, r
    assert r["ready"] == [0, 1, 0xDEAD], r  # a read before any wait sees the old bytes: an early reader is caught
    k = np.array(r["k"], dtype=np.int64)
    want = np.zeros((16, 64), np.int64)
    want[:12] = k[8:20]
    got = np.array(r["dump"], dtype=np.int64).reshape(16, 8, 8)
    unswizzled = np.stack([got[i][np.arange(8) ^ (i & 7)] for i in range(16)]).reshape(16, 64)
    assert np.array_equal(unswizzled, want)


def test_simulator_vector_global_accesses_are_checked(sim):
    """intrinsics.ldg_vec / stg_vec in the simulator (the LSE merge's 16-byte loads and 8- or 16-byte stores): the
    elements at the index, and the accesses the GPU would fault on refused: a 16-byte load 8 bytes off alignment,
    one running past the array's end, one at a negative index, an 8-byte store 4 bytes off alignment."""
    r = sim["vec"]
    assert "error" not in r, r
    assert r["loaded"] == list(range(8, 16)) and r["stored"] == [-i for i in range(8)], r
    assert r["stored_f32"] == [1.5, 2.5, 0.0, 0.0], r
    assert len(r["refused"]) == 4 and all(m and "misaligned" in m for m in r["refused"]), r
