"""FA2ForwardKernel.work_counter, the `work` array of the kernel that draws its items from a counter (the D = 128
default on Hopper): one per (device, stream) for eager launches, and a fresh one for every launch captured into a
CUDA graph, kept alive with the kernel (two graphs captured on torch's one capture stream may be replayed at once on
two streams; sharing a counter, their blocks would take each other's tickets and skip items), zeroed once outside
the graph (graph_capture.zeroed_int32: torch.zeros would put a zeroing kernel in the graph, run on every replay).
torch is faked here: the GPU suite runs the real one (tests/gpu/test_graph_capture_gpu.py counts the graph's
nodes)."""

from __future__ import annotations

import sys
import types

import pytest

from falower.backends.numba_cuda import graph_capture
from falower.backends.numba_cuda.runtime import FA2ForwardKernel


class _FakeTorch(types.ModuleType):
    int32 = "int32"

    def __init__(self):
        super().__init__("torch")
        self.capturing = False
        self.made = []
        self.cuda = types.SimpleNamespace(is_current_stream_capturing=lambda: self.capturing)

    def zeros(self, n, dtype=None, device=None):
        buf = {"n": n, "dtype": dtype, "device": device, "id": len(self.made)}
        self.made.append(buf)
        return buf


@pytest.fixture
def fake_torch(monkeypatch):
    t = _FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", t)
    outside = []  # the counters zeroed outside a capture

    def zeroed(n, device):
        outside.append({"n": n, "dtype": "int32", "device": device, "outside": True})
        return outside[-1]

    monkeypatch.setattr(graph_capture, "zeroed_int32", zeroed)
    t.outside = outside
    return t


def _holder():
    return types.SimpleNamespace(_work={}, _captured=[])


def test_eager_launches_share_one_counter_a_stream(fake_torch):
    k = _holder()
    a = FA2ForwardKernel.work_counter(k, "torch", "cuda:0", 7)
    assert FA2ForwardKernel.work_counter(k, "torch", "cuda:0", 7) is a
    b = FA2ForwardKernel.work_counter(k, "torch", "cuda:0", 8)
    assert b is not a and a["n"] == 2 and a["dtype"] == "int32" and len(fake_torch.made) == 2
    assert FA2ForwardKernel.work_counter(k, "torch", "cuda:1", 7) not in (a, b)


def test_each_captured_launch_gets_its_own_counter_kept_alive(fake_torch):
    k = _holder()
    eager = FA2ForwardKernel.work_counter(k, "torch", "cuda:0", 7)
    fake_torch.capturing = True
    g1 = FA2ForwardKernel.work_counter(k, "torch", "cuda:0", 7)
    g2 = FA2ForwardKernel.work_counter(k, "torch", "cuda:0", 7)
    assert len({id(eager), id(g1), id(g2)}) == 3
    assert k._captured == [g1, g2] and eager not in k._captured
    assert fake_torch.outside == [g1, g2] and fake_torch.made == [eager]  # no torch.zeros while capturing
    fake_torch.capturing = False
    assert FA2ForwardKernel.work_counter(k, "torch", "cuda:0", 7) is eager  # eager launches: the stream's again
