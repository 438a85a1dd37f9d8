"""A call captured into a CUDA graph adds its kernels to the graph and nothing else (marked gpu): the state a captured
launch keeps of its own (the work counter, split-kv's arrival counts, tensor maps first made while capturing) is
written once at capture time outside the graph (graph_capture), not by a zeroing or put kernel on every replay.
Counted by the capture's own graph (cuStreamGetCaptureInfo, cuGraphGetNodes); every replay on new inputs equals
the eager call (the counters stay zeroed across replays)."""

from __future__ import annotations

import ctypes

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402

_LIB = ctypes.CDLL("libcuda.so.1") if torch.cuda.is_available() else None


def _nodes(stream) -> int:
    """The nodes of the graph `stream` is capturing."""
    status, ident, graph, deps, ndeps = (ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p(), ctypes.c_void_p(),
                                         ctypes.c_size_t())
    assert _LIB.cuStreamGetCaptureInfo_v2(ctypes.c_void_p(stream.cuda_stream), ctypes.byref(status),
                                          ctypes.byref(ident), ctypes.byref(graph), ctypes.byref(deps),
                                          ctypes.byref(ndeps)) == 0
    assert status.value == 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE
    count = ctypes.c_size_t(0)
    assert _LIB.cuGraphGetNodes(graph, None, ctypes.byref(count)) == 0
    return count.value


@pytest.fixture(scope="module")
def plain():
    return fl.compile(fl.attention(name="plain"))


# (B, H, M, N, D, the kernel's parts, whether they merge in a cluster): decoding in a cluster (the counter and the
# arrivals), decoding with the merge kernel (two kernels), a prefill grid on the persistent kernel (O's map)
CASES = [(1, 8, 1, 1024, 128, 8, True), (1, 8, 1, 8192, 128, 16, False), (4, 8, 1024, 1024, 128, 1, False),
         (1, 8, 1, 1000, 64, None, None)]  # (None: whatever the automatic choice takes at D = 64)


@pytest.mark.parametrize("B, H, M, N, D, parts, cluster", CASES)
def test_a_captured_call_adds_only_its_kernels(plain, B, H, M, N, D, parts, cluster):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU (the persistent kernel's counter, tensor maps and clusters)")
    from falower.backends.numba_cuda.emit_fa2 import cluster_parts

    kern = plain.specialize("f16", B=B, H=H, M=M, N=N, D=D)
    split, merged_in_cluster = kern.spec.kv_parts, bool(cluster_parts(kern.spec))
    if parts is not None:
        assert (split, merged_in_cluster) == (parts, cluster)

    def inputs(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.randn(B, H, n, D, device="cuda", dtype=torch.float16, generator=g) for n in (M, N, N)]

    static = inputs(0)
    plain(*inputs(1))  # compiled and planned, but on other tensors: Q's, K's and V's maps are made while capturing
    torch.cuda.synchronize()
    launches = len(kern.plan(*static, ()).launches)
    graph, outs = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        stream = torch.cuda.current_stream()
        for _ in range(3):
            before = _nodes(stream)
            outs.append(plain(*static))
            assert _nodes(stream) - before == launches
    assert launches == (1 if split == 1 or merged_in_cluster else 2)  # the merge kernel after the parts
    for seed in range(2, 5):
        for x, y in zip(static, inputs(seed)):
            x.copy_(y)
        graph.replay()
        eo, else_ = plain(*static)
        torch.cuda.synchronize()
        for go, glse in outs:
            assert torch.equal(go, eo) and torch.equal(glse, else_)


def test_captures_on_more_streams_than_torchs_pool_holds(plain):
    """torch hands out its pooled streams in turn (32 a device and priority), so a capture stream made late is one
    made early again: the side stream the writes go on is the driver's own, never a capture stream (it was a pooled
    one first, and the 33rd capture synchronised its own capturing stream: CUresult 900, the capture lost)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU (the persistent kernel's counter)")
    q = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    want = plain(q, k, v)
    for _ in range(40):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            got = plain(q, k, v)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_captured_backward_replays_as_the_eager_one():
    """The backward captured before its tensors were ever seen (their tensor maps written outside the capture),
    replayed on new inputs: equal to the eager backward on them within the atomics' order (dQ's adds)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU (the wgmma backward's tensor maps)")
    causal = fl.compile(fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal"))

    def inputs(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.float16, generator=g) for _ in range(4)]

    warm = inputs(0)
    causal.backward(*warm[:3], *causal(*warm[:3]), warm[3])  # compiled and planned on other tensors
    static = inputs(1)
    o, lse = causal(*static[:3])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = causal.backward(*static[:3], o, lse, static[3])
    for seed in (2, 3):
        for x, y in zip(static, inputs(seed)):
            x.copy_(y)
        o2, lse2 = causal(*static[:3])
        o.copy_(o2)
        lse.copy_(lse2)
        graph.replay()
        want = causal.backward(*static[:3], o, lse, static[3])
        torch.cuda.synchronize()
        for got, ref in zip(grads, want):
            torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("B, M, N", [(1, 1, 1024), (4, 1024, 1024)])
def test_the_written_once_state_is_not_in_memory_the_graph_writes(monkeypatch, plain, B, M, N):
    """Blocks freed while capturing go back to the capture's pool, and torch may hand them out again in the same
    capture (or in a graph sharing its pool), so the graph writes them on every replay. The counters and maps
    written once live in graph_capture's own memory: a capture that fills and frees blocks of the bank's and a
    map's sizes before each call, and a second graph in the first's pool doing the same, replay equal to eager time
    after time (a counter or map in such a block would be overwritten by the fills: items skipped, rows left
    unwritten, or a TMA fault)."""
    from falower.backends.numba_cuda import graph_capture

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU (the persistent kernel's counter and tensor maps)")
    monkeypatch.setattr(graph_capture, "_BANKS", {})  # banks made inside this test's captures (old ones live on)

    def inputs(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.randn(B, 8, n, 128, device="cuda", dtype=torch.float16, generator=g) for n in (M, N, N)]

    plain(*inputs(0))
    torch.cuda.synchronize()
    static = [inputs(1), inputs(2)]
    graphs, outs = [], []
    for x in static:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=graphs[0].pool() if graphs else None):
            for _ in range(2):
                for words in (1 << 16, 128, 2):
                    t = torch.full((words,), 7, dtype=torch.int32, device="cuda")
                    del t
                outs.append(plain(*x))
        graphs.append(g)
    segments = [(x["address"], x["address"] + x["total_size"]) for x in torch.cuda.memory_snapshot()]
    banks = [base for base, _ in graph_capture._BANKS.values()]
    assert banks and not any(lo <= base < hi for base in banks for lo, hi in segments)  # none of torch's memory
    for _ in range(4):
        for g in graphs:
            g.replay()
        want = [plain(*x) for x in static]
        torch.cuda.synchronize()
        for (go, glse), (eo, else_) in zip(outs, [w for w in want for _ in range(2)]):
            assert torch.equal(go, eo) and torch.equal(glse, else_)


def test_a_captured_document_mask_follows_its_ids_updated_in_place():
    """A mask read from captured data (the document's ids: range tables and block lists made from them) captured
    into a graph is made inside the graph (block_data.BlockData.derive): each replay reads the ids as they are then.
    Remembered from an eager call with the same tensor, the graph would keep that call's lists after the ids were
    written in place. And a mask the range analysis cannot bound (its dense block table) the same, in the graph."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU")
    doc = fl.capture("doc", "i32", "B,N")
    document = fl.compile(fl.attention(mask_mod=lambda b, h, q, kv: doc[b, q] == doc[b, kv], name="doc_graph"))
    ids_t, offsets_t = fl.capture("ids", "i32", "N"), fl.capture("offsets", "i32", "N")
    nested = fl.compile(fl.attention(mask_mod=lambda b, h, q, kv: offsets_t[ids_t[q]] <= kv, name="nested_graph"))
    g = torch.Generator(device="cuda").manual_seed(5)
    B, H, N, D = 2, 4, 1000, 128
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))

    def new_doc():
        return torch.sort(torch.randint(0, 6, (B, N), generator=g, device="cuda"), dim=-1).values.to(torch.int32)

    def new_nested():
        return (torch.randint(0, N, (N,), device="cuda", generator=g, dtype=torch.int32),
                torch.randint(0, N + 2, (N,), device="cuda", generator=g, dtype=torch.int32))

    for call, caps in ((document, [new_doc()]), (nested, list(new_nested()))):
        call(q, k, v, *caps)  # remembered: the block data of these tensors as they are now
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            go, glse = call(q, k, v, *caps)
        for _ in range(3):
            for x, y in zip(caps, [new_doc()] if call is document else new_nested()):
                x.copy_(y)  # in place: the graph's tensors, new data
            graph.replay()
            eo, else_ = call(q, k, v, *caps)
            torch.cuda.synchronize()
            assert torch.equal(go, eo) and torch.equal(glse, else_)
