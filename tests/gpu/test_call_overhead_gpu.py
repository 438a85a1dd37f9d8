"""Cheap calls on the GPU (issue 10, item 3): the direct launcher gives the Numba path's bits, a warm call
synchronises nothing (torch's sync debug mode set to error), a 0-d captured tensor changes the result
without a recompile or a read-back, and a falower call captured in a CUDA graph replays equal to eager.
Two kernels are compiled (causal D = 64 forward and backward) plus a flex forward with a 0-d capture."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402
from falower import torch_mods  # noqa: E402
from falower.compiler import _signature  # noqa: E402

B, H, N, D = 2, 4, 200, 64  # ragged against the tiles


@pytest.fixture(scope="module")
def causal():
    return fl.compile(fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal"))


def _qkv(seed=0, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, generator=g).requires_grad_(requires_grad)
                 for _ in range(3))


def _numba_forward(kern, *inputs):
    launch, finish = kern.prepare(*inputs, _wrap=False)
    launch()
    return finish()


def test_direct_launch_equals_the_numba_path(causal):
    q, k, v = _qkv()
    o1, lse1 = causal(q, k, v)
    call = causal._calls[_signature((q, k, v))]
    assert call.plan is not None  # the direct path applies
    o2, lse2 = _numba_forward(call.kernel, q, k, v, *call.dims)
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    do = torch.randn_like(o1)
    g1 = causal.backward(q, k, v, o1, lse1, do)
    call = causal._bwd_calls[_signature((q, k, v, o1, lse1, do))]
    assert call.plan is not None
    launch, finish = call.kernel.prepare(q, k, v, o1, lse1, do, *call.dims)
    launch()
    g2 = finish()
    for a, b in zip(g1[1:], g2[1:]):  # dk, dv: no atomics, the same bits
        assert torch.equal(a, b)
    torch.testing.assert_close(g1[0], g2[0], atol=2e-3, rtol=0)  # dq: atomic adds in another order
    # strided views (a model's [B, N, H, D] projections) through the direct path too
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    o3, _ = causal(qt, k, v)
    assert torch.equal(o3, o1)


@pytest.mark.parametrize("n, d", [(N, D), (1024, 64), (1024, 128)])  # emit_fa3's kernel; the persistent one
def test_relaunch_is_the_call_and_keeps_its_output(causal, n, d):
    """The bare kernel the benchmark times (FA2ForwardKernel.relaunch): the call's bits, into the same O each
    launch, even after other calls of the same plan have moved its argument buffer to their own outputs (the
    persistent kernel's work counter and tensor maps included: D = 64's small-grid tiles and D = 128's)."""
    def qkv(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return tuple(torch.randn(B, H, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))

    q, k, v = qkv(3)
    o1, lse1 = causal(q, k, v)
    call = causal._calls[_signature((q, k, v))]
    assert call.plan is not None
    assert bool(call.kernel.spec.extra.get("persistent")) == (n == 1024)
    launch, finish = call.kernel.relaunch(q, k, v, *call.dims)
    o2, lse2 = finish()
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    o2.zero_()
    lse2.zero_()
    causal(*qkv(4))  # the plan's buffer now points at another call's tensors
    launch()
    o3, lse3 = finish()
    assert o3.data_ptr() == o2.data_ptr()
    assert torch.equal(o3, o1) and torch.equal(lse3, lse1)


def test_a_warm_call_does_not_synchronise(causal):
    q, k, v = _qkv(requires_grad=True)
    slope = torch.tensor(-0.05, device="cuda")
    bm = fl.create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, N, N, device="cuda")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slope * (kv_idx - q_idx)

    def step():
        o, _ = causal(q, k, v)
        o.sum().backward()
        with torch.no_grad():
            causal(q, k, v)
            fl.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)

    step()  # cold: builds plans
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_a_0d_capture_changes_value_without_recompiling_or_syncing():
    torch_mods.clear_cache()
    q, k, v = _qkv(1)
    slope = torch.tensor(-0.05, device="cuda")
    bm = fl.create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, N, N, device="cuda")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slope * (kv_idx - q_idx)

    def reference(s):
        qi = torch.arange(N, device="cuda")
        rel = (qi[None, :] - qi[:, None]).double()
        scores = (q.double() @ k.double().transpose(-1, -2)) / D ** 0.5 + s * rel
        scores = scores.masked_fill(rel > 0, float("-inf"))
        return torch.softmax(scores, -1) @ v.double()

    o1 = fl.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    before = dict(torch_mods.stats)
    torch.cuda.set_sync_debug_mode("error")
    try:
        slope.fill_(-0.5)
        o2 = fl.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch_mods.stats == before  # no walk, trace or compile
    torch.testing.assert_close(o1.double(), reference(-0.05), atol=2e-3, rtol=0)
    torch.testing.assert_close(o2.double(), reference(-0.5), atol=2e-3, rtol=0)
    # the same compiled graph given a Python number for the 0-d capture, then another 0-d tensor: one kernel
    compiled = next(iter(torch_mods._CACHE.values())).compiled
    torch.testing.assert_close(compiled(q, k, v, -0.25)[0].double(), reference(-0.25), atol=2e-3, rtol=0)
    torch.testing.assert_close(compiled(q, k, v, torch.tensor(-0.1, device="cuda"))[0].double(), reference(-0.1),
                               atol=2e-3, rtol=0)
    assert len(compiled._kernels) == 1


def test_cuda_graph_capture_and_replay_equal_eager(causal):
    static = list(_qkv(2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            causal(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go, glse = causal(*static)
    for seed, x in enumerate(static):
        x.copy_(_qkv(10 + seed)[0])
    graph.replay()
    eo, else_ = causal(*static)
    torch.cuda.synchronize()
    assert torch.equal(go, eo) and torch.equal(glse, else_)


def test_two_graphs_of_the_counter_kernel_replay_at_once(causal):
    """At D = 128 on Hopper the forward draws its items from a counter (the persistent kernel). Two graphs captured
    on torch's one capture stream, replayed at once on two streams, each equal to eager: each captured launch has a
    counter of its own (FA2ForwardKernel.work_counter); sharing one, the graphs' blocks would take each other's
    tickets and leave rows unwritten."""
    from falower.backends.numba_cuda.emit_fa2 import uses_work_counter

    def qkv(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.randn(4, 8, 1024, 128, device="cuda", dtype=torch.float16, generator=g) for _ in range(3)]

    ins = [qkv(1), qkv(2)]
    if not uses_work_counter(causal.kernel(*ins[0]).spec):
        pytest.skip("this GPU's automatic choice does not take the counter kernel (not Hopper)")
    for x in ins:  # warm: compiled, planned
        causal(*x)
    torch.cuda.synchronize()
    graphs, outs = [], []
    for x in ins:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(causal(*x))
        graphs.append(g)
    want = [causal(*x) for x in ins]
    streams = [torch.cuda.Stream() for _ in graphs]
    for _ in range(5):
        for g, s in zip(graphs, streams):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                g.replay()
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        for (go, glse), (eo, else_) in zip(outs, want):
            assert torch.equal(go, eo) and torch.equal(glse, else_)


@pytest.mark.parametrize("b, m, n, d", [(2, 1, 1024, 128), (1, 1, 8192, 128), (2, 256, 512, 128),
                                        (2, 1024, 1024, 128)])
def test_a_plans_remembered_arguments_follow_the_tensors_and_streams(b, m, n, d):
    """A warm call skips the tensor maps' and split-kv workspaces' lookups where its addresses and stream are the
    last call's (_ForwardPlan.map_memo, ws_memo). Calls that change Q, K or V one at a time, run on another stream,
    or capture a graph between eager calls each give their own inputs' attention. The shapes: decoding's parts
    merged in a cluster (B = 2, N = 1k) and by the merge kernel (16 parts), a small prefill grid in parts, and the
    persistent kernel with O's map (tma_store)."""
    c = fl.compile(fl.attention(name="plain"))
    g = torch.Generator(device="cuda").manual_seed(b + m + n + d)

    def qkv():
        return (torch.randn(b, 8, m, d, device="cuda", dtype=torch.float16, generator=g),
                *(torch.randn(b, 8, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2)))

    def check(out, q, k, v):
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        torch.testing.assert_close(out[0].float(), ref, atol=3e-3, rtol=0)

    x, y = qkv(), qkv()
    for q, k, v in (x, y, (x[0], y[1], y[2]), (x[0], x[1], y[2]), (y[0].clone(), x[1], y[2]), x):
        check(c(q, k, v), q, k, v)
    plan = c._calls[_signature(x)].plan
    assert plan is not None and plan.kv_maps and (m > 1 or plan.ws_shapes is not None)
    maps, looked = plan.kern.maps, []
    real = maps.torch
    maps.torch = lambda ptr, *a, **kw: (looked.append(ptr), real(ptr, *a, **kw))[1]  # (counts Q's, K's, V's, O's)
    try:
        c(*x)  # the last call's addresses and stream: Q's, K's and V's maps not looked up
        assert not set(looked) & {t.data_ptr() for t in x}, looked
        c(y[0], x[1], x[2])  # a new Q: its map alone
        assert y[0].data_ptr() in looked and not set(looked) & {x[1].data_ptr(), x[2].data_ptr()}, looked
    finally:
        del maps.torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = c(*y)
    torch.cuda.current_stream().wait_stream(side)
    check(out, *y)
    check(c(*x), *x)
    static = [t.clone() for t in y]
    with torch.cuda.stream(side):
        c(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go, _ = c(*static)
    check(c(*x), *x)  # eager between the capture and its replay
    graph.replay()
    torch.cuda.synchronize()
    check((go,), *y)
    check(c(*y), *y)
