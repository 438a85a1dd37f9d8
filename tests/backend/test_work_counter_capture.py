"""FA2ForwardKernel.work_counter, the `work` array of the kernel that draws its items from a counter (the D = 128
default on Hopper): one per (device, stream) for eager launches, and a fresh one for every launch captured into a
CUDA graph, kept alive with the kernel (two graphs captured on torch's one capture stream may be replayed at once on
two streams; sharing a counter, their blocks would take each other's tickets and skip items). torch is faked here:
the GPU suite runs the real one."""

from __future__ import annotations

import sys
import types

import pytest

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
    fake_torch.capturing = False
    assert FA2ForwardKernel.work_counter(k, "torch", "cuda:0", 7) is eager  # eager launches: the stream's again
