"""falower.flex_attention / create_block_mask with score_mods and mask_mods written in torch (FlexAttention's
documentation and attention-gym), on CPU tensors through the reference backend: outputs and LSE against a
float64 torch math reference of the same mods, gradients against torch autograd of that reference, the graph
cache (a warm call neither traces nor compiles), refusals, and FlexAttention's mask helpers. Skipped without
torch (CI has none); tests/gpu/test_flex_api_gpu.py compares with torch's flex_attention on the GPU."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.nn.attention.flex_attention")

import falower as fl  # noqa: E402
from falower import torch_mods  # noqa: E402
from flex_mods import causal, index_grids, make_cases, math_reference  # noqa: E402

B, H, D = 1, 2, 16
CASES = {c.name: c for c in make_cases(B, H, 33, "cpu")}


def _qkv(N: int, group: int = 1, dtype=torch.float32, seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H // group, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H // group, N, D, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))


def _run(case, q, k, v, **kw):
    bm = fl.create_block_mask(case.mask_mod, B, H, q.shape[2], k.shape[2], device="cpu") if case.mask_mod else None
    return fl.flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=case.group > 1, **kw)


@pytest.mark.parametrize("name", sorted(CASES))
def test_mods_match_math_reference(name):
    case = CASES[name]
    q, k, v = _qkv(case.N, case.group)
    o, lse = _run(case, q, k, v, return_lse=True)
    ref_o, ref_lse = math_reference(q.double(), k.double(), v.double(), case.score_mod, case.mask_mod,
                                    group=case.group)
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), ref_o, atol=2e-5, rtol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=2e-5, rtol=1e-5)


def test_output_alone_and_explicit_scale():
    case = CASES["alibi"]
    q, k, v = _qkv(33)
    o = _run(case, q, k, v, scale=0.3)
    assert torch.is_tensor(o)
    ref, _ = math_reference(q.double(), k.double(), v.double(), case.score_mod, case.mask_mod, scale=0.3)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)


def test_float64_inputs():
    case = CASES["softcap"]
    q, k, v = _qkv(33, dtype=torch.float64)
    o, lse = _run(case, q, k, v, return_lse=True)
    ref, ref_lse = math_reference(q, k, v, case.score_mod, case.mask_mod)
    assert o.dtype == torch.float64
    # f64 end to end: the interpreter once multiplied f64 matrices in float32 (errors ~2e-7 here)
    torch.testing.assert_close(o, ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-6)  # the LSE is f32, as torch's


@pytest.mark.parametrize("name", ["alibi", "relative_bias", "document", "softcap", "gqa_causal"])
def test_gradients_match_torch_autograd(name):
    case = CASES[name]
    q, k, v = _qkv(case.N, case.group, requires_grad=True)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    o = _run(case, q, k, v)
    (o.double() * do).sum().backward()
    ref, _ = math_reference(qd, kd, vd, case.score_mod, case.mask_mod, group=case.group)
    (ref * do).sum().backward()
    for got, want in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=5e-5, rtol=1e-4)


def test_gradient_of_a_captured_bias_table():
    N = 17
    rel = torch.randn(H, 2 * N - 1, dtype=torch.float32, requires_grad=True)
    rel64 = rel.detach().double().requires_grad_()

    def make(table):
        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + N - 1]
        return relative_bias

    q, k, v = _qkv(N, requires_grad=True)
    o = fl.flex_attention(q, k, v, score_mod=make(rel))
    o.double().square().sum().backward()
    qd, kd, vd = (t.detach().double() for t in (q, k, v))
    ref, _ = math_reference(qd, kd, vd, make(rel64))
    ref.square().sum().backward()
    torch.testing.assert_close(rel.grad.double(), rel64.grad, atol=5e-5, rtol=1e-4)


def test_gradient_of_a_captured_0d_temperature():
    """A learnable scalar read by broadcasting (its gradient sums over every element, a one-slot table in the
    tiled backward); f64 so that the comparison is exact to rounding."""
    N = 19
    temp = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    temp64 = temp.detach().clone().requires_grad_()
    q, k, v = _qkv(N, dtype=torch.float64, requires_grad=True)
    o = fl.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * temp, block_mask=fl.create_block_mask(
        causal, None, None, N, N, device="cpu"))
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (o * do).sum().backward()
    qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = math_reference(qd, kd, vd, lambda s, b, h, qi, ki: s * temp64, causal)
    (ref * do).sum().backward()
    assert temp.grad is not None and temp.grad.shape == ()
    torch.testing.assert_close(temp.grad, temp64.grad, atol=1e-12, rtol=1e-12)
    for got, want in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------------------ caching
def test_warm_calls_do_not_trace_or_compile():
    torch_mods.clear_cache()
    case = CASES["softcap"]
    q, k, v = _qkv(33)
    bm = fl.create_block_mask(case.mask_mod, None, None, 33, 33, device="cpu")
    before = dict(torch_mods.stats)
    o1 = fl.flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)
    assert torch_mods.stats["traces"] == before["traces"] + 1
    assert torch_mods.stats["compiles"] == before["compiles"] + 1
    for _ in range(3):  # the same mods and block mask, as in every layer and step
        o2 = fl.flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)
    assert torch_mods.stats["traces"] == before["traces"] + 1
    assert torch_mods.stats["compiles"] == before["compiles"] + 1
    assert torch.equal(o1, o2)
    # other sizes, same graph (the graph's dims are symbolic): no trace either
    q2, k2, v2 = _qkv(20)
    bm2 = fl.create_block_mask(case.mask_mod, None, None, 20, 20, device="cpu")
    fl.flex_attention(q2, k2, v2, score_mod=case.score_mod, block_mask=bm2)
    assert torch_mods.stats["traces"] == before["traces"] + 1
    # another dtype or scale is another graph
    fl.flex_attention(q.double(), k.double(), v.double(), score_mod=case.score_mod, block_mask=bm)
    fl.flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, scale=0.5)
    assert torch_mods.stats["traces"] == before["traces"] + 3


def test_new_closure_over_new_tensors_reuses_the_graph_with_the_new_data():
    """A mod made again for each batch (new document ids, same shapes) traces once; each call reads its own
    tensors."""
    torch_mods.clear_cache()
    N = 24

    def doc_mask_for(doc_ids):
        def doc_mask(b, h, q_idx, kv_idx):
            return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)
        return doc_mask

    q, k, v = _qkv(N)
    before = torch_mods.stats["traces"]
    for lengths in ([4, 20], [10, 10, 4], [24]):
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        mask_mod = doc_mask_for(ids)
        bm = fl.create_block_mask(mask_mod, 1, 1, N, N, device="cpu")
        o = fl.flex_attention(q, k, v, block_mask=bm)
        ref, _ = math_reference(q.double(), k.double(), v.double(), None, mask_mod)
        torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)
    assert torch_mods.stats["traces"] == before + 1
    # a table of another shape is another graph
    ids = torch.zeros(N + 1, dtype=torch.int64)
    fl.flex_attention(q, k, v, block_mask=fl.create_block_mask(doc_mask_for(ids), 1, 1, N, N, device="cpu"))
    assert torch_mods.stats["traces"] == before + 2


def test_python_values_closed_over_are_part_of_the_key():
    torch_mods.clear_cache()

    def softcap(cap):
        def mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / cap) * cap
        return mod

    q, k, v = _qkv(9)
    for cap in (2.0, 30.0):
        o = fl.flex_attention(q, k, v, score_mod=softcap(cap))
        ref, _ = math_reference(q.double(), k.double(), v.double(), softcap(cap))
        torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)


def test_captured_tensors_are_named_after_their_variables():
    torch_mods.clear_cache()
    case = CASES["relative_bias"]
    q, k, v = _qkv(33)
    fl.flex_attention(q, k, v, score_mod=case.score_mod)
    (entry,) = torch_mods._CACHE.values()
    names = [a.name for a in entry.compiled.func.args]
    assert names == ["q", "k", "v", "rel_bias"]
    assert str(entry.compiled.func.args[3].type) == "f32[2,65]"


def test_int64_tables_are_captured_as_i32():
    torch_mods.clear_cache()
    case = CASES["document"]
    q, k, v = _qkv(33)
    _run(case, q, k, v)
    (entry,) = torch_mods._CACHE.values()
    types = {a.name: str(a.type) for a in entry.compiled.func.args[3:]}
    assert types == {"document_id": "i32[33]", "offsets": "i32[5]"}


# ------------------------------------------------------------------------------------------ refusals
def test_unknown_torch_op_is_refused_by_name():
    def mod(score, b, h, q_idx, kv_idx):
        return torch.cumsum(score, dim=-1)

    q, k, v = _qkv(9)
    with pytest.raises(fl.FalowerError, match=r"torch\.cumsum has no falower equivalent"):
        fl.flex_attention(q, k, v, score_mod=mod)

    def softplus(score, b, h, q_idx, kv_idx):
        return torch.nn.functional.softplus(score)

    with pytest.raises(fl.FalowerError, match=r"softplus"):
        fl.flex_attention(q, k, v, score_mod=softplus)


def test_python_if_on_a_traced_value_says_to_use_torch_where():
    def mod(score, b, h, q_idx, kv_idx):
        if score > 0:
            return score
        return score * 2

    q, k, v = _qkv(9)
    with pytest.raises(fl.FalowerError, match=r"torch\.where"):
        fl.flex_attention(q, k, v, score_mod=mod)

    def mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx and kv_idx >= 0

    with pytest.raises(fl.FalowerError, match=r"torch\.where"):
        fl.flex_attention(q, k, v, block_mask=fl.create_block_mask(mask, 1, 1, 9, 9, device="cpu"))


def test_shape_errors():
    q, k, v = _qkv(9)
    with pytest.raises(fl.ShapeError, match="enable_gqa"):
        fl.flex_attention(q, k[:, :1], v[:, :1])
    bm = fl.create_block_mask(causal, 1, 1, 8, 9, device="cpu")
    with pytest.raises(fl.ShapeError, match="Q_LEN"):
        fl.flex_attention(q, k, v, block_mask=bm)


# ---------------------------------------------------------------------------------- mask helpers
def test_and_or_noop_masks():
    N = 21
    q, k, v = _qkv(N)

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 3

    def even(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 0

    for mask_mod in (fl.and_masks(causal, window), fl.or_masks(window, even), fl.noop_mask,
                     fl.and_masks(), fl.or_masks(causal), torch_mods.and_masks(causal, even),
                     torch_mods.or_masks(window, causal), torch_mods.noop_mask):
        bm = fl.create_block_mask(mask_mod, None, None, N, N, device="cpu")
        o = fl.flex_attention(q, k, v, block_mask=bm)
        ref, _ = math_reference(q.double(), k.double(), v.double(), None, mask_mod)
        torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)


def test_noop_mask_equals_no_mask():
    q, k, v = _qkv(13)
    a = fl.flex_attention(q, k, v, block_mask=fl.create_block_mask(fl.noop_mask, None, None, 13, 13, device="cpu"))
    b = fl.flex_attention(q, k, v)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_floor_division_and_remainder_follow_torch_on_negatives():
    """`(q - kv) // 4` and `% 4` on negative distances: floor semantics, as torch."""
    def mod(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return score + (d // 4).float() * 0.1 + (d % 3) * 0.2 + torch.div(d, 5, rounding_mode="floor") * 0.05

    q, k, v = _qkv(17)
    o = fl.flex_attention(q, k, v, score_mod=mod)
    ref, _ = math_reference(q.double(), k.double(), v.double(), mod)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)


def test_relu_keeps_an_integer_distance_integer():
    """torch.relu(q - kv) is an integer tensor (falower's made it f32, and `% 3` was then refused as float %)."""
    def mod(score, b, h, q_idx, kv_idx):
        d = torch.relu(q_idx - kv_idx) + torch.nn.functional.relu(kv_idx - q_idx)
        return score + (d % 3) * 0.2 + (d // 5).float() * 0.1

    q, k, v = _qkv(17)
    o = fl.flex_attention(q, k, v, score_mod=mod)
    ref, _ = math_reference(q.double(), k.double(), v.double(), mod)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)


def test_torch_mods_also_trace_through_fl_attention():
    """A torch-written mod with no closed-over tensors goes straight into falower.attention."""
    g = fl.attention(score_mod=CASES["softcap"].score_mod, mask_mod=causal, name="softcap_torch", dtype="f32")
    assert "tanh" in fl.print_func(g)


def test_import_falower_does_not_import_torch():
    code = "import sys, falower; falower.attention; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_index_grids_helper():
    b, h, qi, ki = index_grids(2, 3, 4, 5, "cpu")
    assert (b + h + qi + ki).shape == (2, 3, 4, 5)
    assert math.isclose(float(ki.max()), 4.0)


def test_mods_as_module_methods_and_over_globals():
    """A score_mod that is an nn.Module's method reading self.<tensor>, and one reading a module-level
    tensor: both captured, cached, and fed the current tensors."""
    torch_mods.clear_cache()

    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.randn(H, 9, 9) * 0.3)

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return score + self.bias[h, q_idx, kv_idx]

    m = Biased()
    q, k, v = _qkv(9)
    before = torch_mods.stats["traces"]
    for _ in range(2):
        with torch.no_grad():
            m.bias.add_(0.1)
            o = fl.flex_attention(q, k, v, score_mod=m.score_mod)
            ref, _ = math_reference(q.double(), k.double(), v.double(), m.score_mod)
        torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)
    assert torch_mods.stats["traces"] == before + 1
    o = fl.flex_attention(q, k, v, score_mod=_global_bias_mod)
    ref, _ = math_reference(q.double(), k.double(), v.double(), _global_bias_mod)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)


_GLOBAL_BIAS = torch.linspace(-1, 1, 9)


def _global_bias_mod(score, b, h, q_idx, kv_idx):
    return score + _GLOBAL_BIAS[kv_idx]


# ------------------------------------------------------------------------------------ warm-call cache keys
def _check_mod(q, k, v, mod):
    o = fl.flex_attention(q, k, v, score_mod=mod)
    ref, _ = math_reference(q.double(), k.double(), v.double(), mod)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)


def test_warm_calls_do_not_walk_the_mods():
    """A warm call checks the reads the first call's walk recorded; it walks, traces and compiles nothing,
    for a closure, a bound method made anew at each access, and a block mask."""
    torch_mods.clear_cache()
    table = torch.randn(9) * 0.3

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.randn(9) * 0.3)

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return score + self.bias[q_idx]

    m = M()
    q, k, v = _qkv(9)
    bm = fl.create_block_mask(causal, None, None, 9, 9, device="cpu")
    for f in (mod, m.score_mod):
        fl.flex_attention(q, k, v, score_mod=f, block_mask=bm)
    before = dict(torch_mods.stats)
    with torch.no_grad():
        for _ in range(3):
            fl.flex_attention(q, k, v, score_mod=mod, block_mask=bm)
            fl.flex_attention(q, k, v, score_mod=m.score_mod, block_mask=bm)
    assert torch_mods.stats == before


def test_a_changed_closure_constant_traces_again():
    """`nonlocal` rebinding a Python constant the mod closes over: the same function object, another graph."""
    torch_mods.clear_cache()
    cap = 2.0

    def mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    def set_cap(x):
        nonlocal cap
        cap = x

    q, k, v = _qkv(9)
    _check_mod(q, k, v, mod)
    before = torch_mods.stats["traces"]
    set_cap(30.0)
    _check_mod(q, k, v, mod)
    assert torch_mods.stats["traces"] == before + 1
    _check_mod(q, k, v, mod)  # warm again
    assert torch_mods.stats["traces"] == before + 1
    set_cap(2.0)  # back to the first graph: found in the graph cache, not traced
    _check_mod(q, k, v, mod)
    assert torch_mods.stats["traces"] == before + 1


_WINDOW = 3


def _window_mod(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx - kv_idx < _WINDOW, score, score - 1.0)


def test_a_changed_global_constant_traces_again():
    global _WINDOW
    torch_mods.clear_cache()
    q, k, v = _qkv(9)
    try:
        _check_mod(q, k, v, _window_mod)
        before = torch_mods.stats["traces"]
        _WINDOW = 5
        _check_mod(q, k, v, _window_mod)
        assert torch_mods.stats["traces"] == before + 1
    finally:
        _WINDOW = 3


def test_a_rebound_closed_over_tensor_is_read_and_a_new_shape_traces_again():
    torch_mods.clear_cache()
    table = torch.randn(9) * 0.3

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]

    def rebind(t):
        nonlocal table
        table = t

    q, k, v = _qkv(9)
    _check_mod(q, k, v, mod)
    before = dict(torch_mods.stats)
    rebind(torch.randn(9) * 0.3)  # same shape and dtype: the same graph, fed the new tensor
    _check_mod(q, k, v, mod)
    assert torch_mods.stats["traces"] == before["traces"]
    rebind(torch.randn(12) * 0.3)  # another shape: traced again
    _check_mod(q, k, v, mod)
    assert torch_mods.stats["traces"] == before["traces"] + 1
    rebind(torch.randn(12, dtype=torch.float64))  # another dtype: traced again
    _check_mod(q, k, v, mod)
    assert torch_mods.stats["traces"] == before["traces"] + 2


def test_deps_check_is_what_the_walk_read():
    """_deps_leaves gives the tensors in the walk's order while the reads hold, None when one changes."""
    a, b = torch.zeros(3), torch.ones(4)
    scale = 2

    def f(score, bb, h, q_idx, kv_idx):
        return score * scale + a[q_idx] + b[kv_idx]

    key = torch_mods._mod_key(f)
    leaves = torch_mods._deps_leaves(key.deps)
    assert [x is y for x, y in zip(leaves, key.leaves)] == [True, True] and len(leaves) == 2
    f.__defaults__ = (1,)
    assert torch_mods._deps_leaves(key.deps) is None


def test_transposed_views_reach_the_compiled_call_without_a_copy(monkeypatch):
    """[B, N, H, D] projections viewed as [B, H, N, D] (what transformers passes) go to the kernels as they are:
    strides are kernel arguments; only a last dimension that is not contiguous is copied."""
    case = CASES["causal"]
    q, k, v = _qkv(33)
    want = _run(case, q, k, v)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous() and qt.stride(-1) == 1
    seen = []
    original = fl.CompiledAttention.__call__

    def spy(self, *inputs):
        seen.append(inputs[:3])
        return original(self, *inputs)

    monkeypatch.setattr(fl.CompiledAttention, "__call__", spy)
    got = _run(case, qt, kt, vt)
    assert all(a is b for a, b in zip(seen[-1], (qt, kt, vt)))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    qs = torch.as_strided(q.repeat_interleave(2, dim=-1), q.shape, (q.shape[1] * 33 * 32, 33 * 32, 32, 2))
    _run(case, qs, k, v)
    assert seen[-1][0] is not qs and seen[-1][0].is_contiguous()  # a strided last dim is copied
