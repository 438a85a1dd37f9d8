"""_ForwardPlan.launch_into skips the tensor maps' and split-kv workspaces' lookups while their keys repeat
(map_memo, ws_memo). Without a GPU or torch: a plan's argument slots after each call of a sequence (addresses that
move one at a time, another stream, a capture, a map dropped from the cache) are the slots a plan with nothing
remembered writes for the same call, for the three ways O and LSE reach the call (the kernel's own epilogue, the
merge kernel, the merge in the kernel)."""

from __future__ import annotations

import sys
import types

import pytest

from falower.backends.numba_cuda import runtime


class Tensor:
    def __init__(self, ptr: int) -> None:
        self.ptr, self.dtype = ptr, "f16"

    def data_ptr(self) -> int:
        return self.ptr


class Maps:
    """TensorMaps' contract: a map per key, a new one (another address) once the cache has dropped maps, and one
    of its own for a capture."""

    def __init__(self) -> None:
        self.dropped, self.made, self.looked = 0, {}, 0

    def torch(self, ptr, device, geometry, capturing=None, stream=None, what="O"):
        self.looked += 1
        key = (ptr, stream, geometry, what, self.dropped, capturing, self.looked if capturing else 0)
        return self.made.setdefault(key, Tensor(10_000 + len(self.made)))

    def torch_o(self, o, capturing=None, stream=None):
        return self.torch(o.data_ptr(), None, "o", capturing, stream)


class Kernel:
    def __init__(self, arrivals: bool) -> None:
        self.maps, self.arrivals, self.ws, self.asked = Maps(), arrivals, {}, 0

    def split_workspaces(self, device, stream, shapes, dtype, lse_dtype, capturing=False):
        self.asked += 1
        key = (stream, self.asked if capturing else 0)
        return self.ws.setdefault(key, tuple(Tensor(50_000 + 10 * len(self.ws) + j)
                                             for j in range(3 if self.arrivals else 2)))


def _plan(mode: str, kern: Kernel) -> runtime._ForwardPlan:
    """A plan's launch state as __init__ leaves it, slots numbered by hand: q, k, v 0-2, O 3, LSE 4, O's map 5,
    Q's, K's, V's maps 6-8, the fused merge's O, LSE and counts 9-11; the merge kernel's buffer 0-3."""
    p = object.__new__(runtime._ForwardPlan)
    p.bufs = [types.SimpleNamespace(vals=[0] * 12)]
    p.slots, p.o_slot, p.lse_slot, p.omap_slot = [0, 1, 2], 3, 4, 5
    p.kv_maps = [(6 + i, i, ("g", i), name) for i, name in enumerate("QKV")]
    p.stream, p.dev_index, p.device, p.ask_capture = (lambda d: STREAM[0]), 0, "cuda:0", True
    p.kern, p.cap_slots, p.cap_scalars, p.work_slot, p.table_n, p.launches = kern, [], [], None, 0, []
    p.fused = mode == "fused"
    p.ws_shapes = None if mode == "plain" else ("shapes",)
    p.fused_slots = [9, 10, 11] if p.fused else []
    p.merge_buf = types.SimpleNamespace(vals=[0] * 4)
    p.merge_slots = [0, 1, 2, 3] if mode == "merge" else []
    p.map_memo, p.ws_memo = [None] * (len(p.kv_maps) + 1), None
    p._output_slots()  # (as __init__ ends)
    return p


STREAM = [7]


@pytest.mark.parametrize("mode", ["plain", "merge", "fused"])
def test_remembered_slots_are_the_slots_a_fresh_plan_writes(mode, monkeypatch):
    capturing = [False]
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_current_stream_capturing=lambda: capturing[0])))
    kern = Kernel(arrivals=mode == "fused")
    kept = _plan(mode, kern)
    q, k, v, q2, k2 = (100, 200, 300, 400, 500)
    steps = [((q, k, v), 7, False, False), ((q, k, v), 7, False, False), ((q2, k, v), 7, False, False),
             ((q2, k2, v), 7, False, False), ((q2, k2, v), 8, False, False), ((q2, k2, v), 7, True, False),
             ((q2, k2, v), 7, False, False), ((q, k, v), 7, False, True), ((q, k, v), 7, False, False)]
    lookups = []
    for n, (ptrs, stream, capture, drop) in enumerate(steps):
        STREAM[0], capturing[0] = stream, capture
        kern.maps.dropped += drop
        o, lse = Tensor(1000 + n), Tensor(2000 + n)  # a new O and LSE each call, as __call__ allocates them
        before = (kern.maps.looked, kern.asked)
        kept.launch_into(ptrs, (), o, lse)
        lookups.append((kern.maps.looked - before[0], kern.asked - before[1]))
        if capture:  # a capture's maps and workspaces are its own: every slot rewritten (the counts below)
            continue
        vals, merge = kept.bufs[0].vals, kept.merge_buf.vals
        out = {"plain": (vals, 3, 4), "merge": (merge, 2, 3), "fused": (vals, 9, 10)}[mode]
        assert (out[0][out[1]], out[0][out[2]]) == (o.ptr, lse.ptr), (mode, n)  # where the call's O and LSE go
        if mode != "plain":  # the kernel's parts into this stream's workspaces, which the merge reads
            ws = [t.ptr for t in kern.ws[stream, 0]]
            assert vals[3:5] == ws[:2] and (merge[:2] == ws[:2] if mode == "merge" else vals[11] == ws[2]), (mode, n)
        fresh = _plan(mode, kern)  # its slots start from the kept plan's, so a slot the kept plan left stale shows
        fresh.bufs[0].vals[:], fresh.merge_buf.vals[:] = kept.bufs[0].vals, kept.merge_buf.vals
        fresh.launch_into(ptrs, (), o, lse)
        assert kept.bufs[0].vals == fresh.bufs[0].vals and kept.merge_buf.vals == fresh.merge_buf.vals, (mode, n)
    ws = 0 if mode == "plain" else 1
    om = 1 if mode == "plain" else 0  # O's map follows each call's new O; split-kv's is the stream's workspace's
    assert lookups[1] == (om, 0)  # the same q, k, v again: no Q, K or V map looked up
    assert lookups[2] == (1 + om, 0) and lookups[3] == (1 + om, 0)  # a new Q, then a new K: its map alone
    assert lookups[4] == (4, ws)  # another stream: everything
    assert lookups[5] == (4, ws) and lookups[6] == (4, ws)  # a capture, and the eager call after it
    assert lookups[7] == (4, 0)  # a map dropped from the cache: every map again, not the workspaces
