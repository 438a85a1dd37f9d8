"""graph_capture's banks: counters for captured launches are slices of one bank of zeros of the module's own memory
(allocated and zeroed once outside the capture, never from the capture's pool, whose blocks the graph may write),
each slice handed out once, on its own 128 bytes, to one thread at a time; tensor maps 128-byte slots of a bank of
their own; a new bank when one runs out, a large request its own zeros; the capture mode restored whatever happens.
torch and the driver are faked here; the GPU suite runs the real ones (tests/gpu/test_graph_capture_gpu.py)."""

from __future__ import annotations

import contextlib
import sys
import threading
import types

import pytest

from falower.backends.numba_cuda import graph_capture


class _Device:
    def __init__(self, spec, index=None):
        if isinstance(spec, _Device):
            spec, index = spec.type, spec.index
        kind, _, idx = str(spec).partition(":")
        self.type, self.index = kind, int(idx) if idx else index


@pytest.fixture
def fake_torch(monkeypatch):
    fake = types.ModuleType("torch")
    fake.device = _Device
    fake.cuda = types.SimpleNamespace(current_device=lambda: 0, device=lambda index: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "torch", fake)
    return fake


@pytest.fixture
def driver(monkeypatch, fake_torch):
    """The banks' allocations [(device, words, address)] and zeroings [(device, address, words)]."""
    monkeypatch.setattr(graph_capture, "_BANKS", {})
    log = types.SimpleNamespace(allocs=[], zeros=[])

    def alloc(index, words):
        ptr = (len(log.allocs) + 1) << 24
        log.allocs.append((index, words, ptr))
        return ptr

    monkeypatch.setattr(graph_capture, "_alloc", alloc)
    monkeypatch.setattr(graph_capture, "_zero", lambda index, ptr, words: log.zeros.append((index, ptr, words)))
    return log


def test_counters_are_distinct_slices_of_one_zeroed_bank(driver):
    got = [graph_capture.zeroed_int32(n, "cuda:0") for n in (2, 1, 2, 40, 2)]
    words = graph_capture.BANK_WORDS
    assert driver.allocs == [(0, words, 1 << 24)] and driver.zeros == [(0, 1 << 24, words)]  # once for all five
    assert [x.data_ptr() - (1 << 24) for x in got] == [0, 128, 256, 384, 640]  # 128-byte slots; 40 words take two
    assert [x.n for x in got] == [2, 1, 2, 40, 2]


def test_a_full_bank_is_replaced_and_devices_keep_their_own(driver):
    words = graph_capture.BANK_WORDS
    first = [graph_capture.zeroed_int32(words // 4, "cuda:0") for _ in range(4)]  # exactly full
    assert len(driver.allocs) == 1 and first[-1].data_ptr() - first[0].data_ptr() == 3 * (words // 4) * 4  # bytes
    fifth = graph_capture.zeroed_int32(2, "cuda:0")
    assert len(driver.allocs) == 2 and fifth.data_ptr() == driver.allocs[1][2]
    graph_capture.zeroed_int32(2, "cuda:1")
    graph_capture.zeroed_int32(2, "cuda")  # (the current device: 0's second bank)
    assert [a[:2] for a in driver.allocs] == [(0, words), (0, words), (1, words)] and len(driver.zeros) == 3


def test_no_words_is_refused(driver):
    with pytest.raises(ValueError, match="at least one word"):
        graph_capture.zeroed_int32(0, "cuda:0")


def test_a_large_request_gets_zeros_of_its_own(driver):
    n = graph_capture.BANK_WORDS // 4 + 1
    big = graph_capture.zeroed_int32(n, "cuda:0")
    assert driver.allocs == [(0, n, 1 << 24)] and driver.zeros == [(0, 1 << 24, n)] and big.n == n
    graph_capture.zeroed_int32(2, "cuda:0")  # the bank is still made for the small ones
    assert len(driver.allocs) == 2


def test_maps_take_128_byte_slots_of_a_bank_of_their_own(driver):
    counter = graph_capture.zeroed_int32(2, "cuda:0")
    slots = [graph_capture.map_slot("cuda:0") for _ in range(graph_capture.MAP_SLOTS + 1)]
    assert len(driver.zeros) == 1  # the counters' bank only: a map is written whole by its put
    assert driver.allocs[1][1] == graph_capture.MAP_SLOTS * graph_capture.MAP_WORDS
    assert counter.data_ptr() not in {s.data_ptr() for s in slots}
    assert [s.data_ptr() - slots[0].data_ptr() for s in slots[:3]] == [0, 128, 256]
    assert len(driver.allocs) == 3 and slots[-1].data_ptr() == driver.allocs[2][2]  # a second map bank


def test_threads_never_share_a_slice(driver):
    got, start = [], threading.Barrier(8)

    def take():
        start.wait()
        got.extend(graph_capture.zeroed_int32(2, "cuda:0").data_ptr() for _ in range(200))

    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between almost any two bytecodes: without the lock, slices repeat
    try:
        threads = [threading.Thread(target=take) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(was)
    assert len(got) == 1600 and len(set(got)) == 1600


class _Mode:
    """cuThreadExchangeStreamCaptureMode: swaps the thread's mode with the caller's, records each call."""

    def __init__(self, fail_on=()):
        self.thread_mode, self.calls, self.fail_on = 0, 0, fail_on

    def __call__(self, ref):
        self.calls += 1
        if self.calls in self.fail_on:
            return 999
        mode = ref._obj
        mode.value, self.thread_mode = self.thread_mode, mode.value
        return 0


def test_the_capture_mode_is_restored_when_the_work_fails(monkeypatch, fake_torch):
    mode = _Mode()
    monkeypatch.setattr(graph_capture, "_LIB", [{"mode": mode}])
    monkeypatch.setattr(graph_capture, "_context", lambda index: contextlib.nullcontext())
    seen = []

    def work():
        seen.append(mode.thread_mode)
        raise ValueError("the put failed")

    with pytest.raises(ValueError, match="the put failed"):  # the work's own error, not the restore's
        graph_capture._relaxed(0, work)
    assert seen == [graph_capture._RELAXED] and mode.thread_mode == 0 and mode.calls == 2
    assert graph_capture._relaxed(0, lambda: 7) == 7 and mode.thread_mode == 0


def test_a_failed_restore_is_reported(monkeypatch, fake_torch):
    monkeypatch.setattr(graph_capture, "_LIB", [{"mode": _Mode(fail_on=(2,))}])
    monkeypatch.setattr(graph_capture, "_context", lambda index: contextlib.nullcontext())
    with pytest.raises(graph_capture.CaptureWriteError, match="restoring the capture mode.*CUresult 999"):
        graph_capture._relaxed(0, lambda: None)
