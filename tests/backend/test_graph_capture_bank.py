"""graph_capture.zeroed_int32's bank: counters for captured launches are slices of one bank of zeros written outside
the capture once (the wait for that write paid once a bank, not once a captured call), each slice handed out once,
on its own 128 bytes; a new bank when one runs out, a large request its own zeros. torch is faked here (the bank a
numpy array); the GPU suite runs the real one (tests/gpu/test_graph_capture_gpu.py)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from falower.backends.numba_cuda import graph_capture


class _Device:
    def __init__(self, spec, index=None):
        if isinstance(spec, _Device):
            spec, index = spec.type, spec.index
        kind, _, idx = str(spec).partition(":")
        self.type, self.index = kind, int(idx) if idx else index


@pytest.fixture
def made(monkeypatch):
    fake = types.ModuleType("torch")
    fake.device = _Device
    fake.cuda = types.SimpleNamespace(current_device=lambda: 0)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(graph_capture, "_BANKS", {})
    banks = []

    def zeroed_now(n, device):
        banks.append((n, _Device(device).index))
        return np.zeros(n, np.int32)

    monkeypatch.setattr(graph_capture, "_zeroed_now", zeroed_now)
    return banks


def test_counters_are_distinct_slices_of_one_bank(made):
    got = [graph_capture.zeroed_int32(n, "cuda:0") for n in (2, 1, 2, 40, 2)]
    assert made == [(graph_capture.BANK_WORDS, 0)]  # one write outside the capture for all five
    base = got[0].base
    starts = [x.__array_interface__["data"][0] - base.__array_interface__["data"][0] for x in got]
    assert all(x.base is base for x in got) and [len(x) for x in got] == [2, 1, 2, 40, 2]
    assert starts == [0, 128, 256, 384, 640]  # 128-byte slots; 40 words take two
    for x in got:
        assert not x.any()


def test_a_full_bank_is_replaced_and_devices_keep_their_own(made):
    words = graph_capture.BANK_WORDS
    first = graph_capture.zeroed_int32(words // 4, "cuda:0")
    for _ in range(3):
        graph_capture.zeroed_int32(words // 4, "cuda:0")
    assert len(made) == 1
    fifth = graph_capture.zeroed_int32(2, "cuda:0")  # the bank is full: a new one
    assert len(made) == 2 and fifth.base is not first.base
    graph_capture.zeroed_int32(2, "cuda:1")
    graph_capture.zeroed_int32(2, "cuda")  # (the current device: 0's bank)
    assert made[2:] == [(words, 1)]


def test_a_large_request_gets_zeros_of_its_own(made):
    big = graph_capture.zeroed_int32(graph_capture.BANK_WORDS // 4 + 1, "cuda:0")
    assert made == [(graph_capture.BANK_WORDS // 4 + 1, 0)] and big.base is None
