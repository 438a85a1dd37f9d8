"""falower.integrations.transformers on CPU (falower's reference backend): the mask step against transformers'
own dense mask (`masking_utils.sdpa_mask`) for causal, sliding-window and bidirectional patterns with
padding, KV-cache offsets and StaticCache's tensor offsets; the attention function against SDPA on strided
GQA views; whole tiny Llama and Mistral models against their SDPA logits (padded batches, prefill + decoding
with dynamic and static caches, generate), with the trace/compile counts. Skipped without torch and
transformers (CI has neither); tests/gpu/test_transformers_gpu.py runs a larger Llama on the GPU kernels."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import falower.integrations.transformers as fl_hf  # noqa: E402
from falower import FalowerError, torch_mods  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

B = 3


def _padding(total: int, kind: str) -> torch.Tensor:
    am = torch.ones(B, total, dtype=torch.bool)
    if kind == "left":
        am[1, :5] = False
        am[2, :total] = False  # a row with no valid key at all
    elif kind == "right":
        am[0, total - 4:] = False
    elif kind == "holes":
        am[1, 2:4] = False
        am[2, 7] = False
    return am


PATTERNS = {
    "causal": (lambda: mu.causal_mask_function, None, ("causal",)),
    "sliding": (lambda: mu.sliding_window_causal_mask_function(4), 4, ("causal", "sliding(4)")),
    "bidirectional": (lambda: mu.bidirectional_mask_function, None, ()),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("padding", ["none", "left", "right", "holes"])
@pytest.mark.parametrize("sizes", [(13, 13, 0, 0), (3, 16, 13, 0), (1, 16, 15, 0), (13, 10, 3, 3)],
                         ids=["prefill", "chunk", "decode", "kv_offset"])
def test_mask_matches_transformers(pattern, padding, sizes):
    """The FalowerMask, evaluated densely through its own mask_mod, is transformers' sdpa mask."""
    L, S, q_off, kv_off = sizes
    make, window, kinds = PATTERNS[pattern]
    am = None if padding == "none" else _padding(kv_off + S, padding)
    kw = dict(batch_size=B, q_length=L, kv_length=S, q_offset=q_off, kv_offset=kv_off, mask_function=make(),
              attention_mask=am)
    m = fl_hf.falower_mask(local_size=window, **kw)
    ref = mu.sdpa_mask(allow_is_causal_skip=False, **kw)
    ref = torch.ones(B, L, S, dtype=torch.bool) if ref is None else ref[:, 0].expand(B, L, S)
    assert torch.equal(m.dense(), ref)
    # recognised patterns never take the dense fallback: the captured data is per row, not per element
    want = list(kinds)
    if kinds and q_off != kv_off:
        want.append("offset")
    if padding in ("left", "right"):
        want.append("padding")
    if padding == "holes":
        want.append("padding-table")
    assert m.kind == ("+".join(want) or "none")
    assert (m.block_mask is None) == (m.kind == "none")


def test_static_cache_tensor_offset_and_unknown_patterns():
    """StaticCache hands q_offset as a tensor; an overlay transformers builds (packed sequences here) is not a
    pattern falower knows and goes through the dense fallback, still equal to transformers' mask."""
    am = _padding(16, "left")
    m = fl_hf.falower_mask(B, 3, 16, torch.tensor(10), 0, mu.causal_mask_function, am)
    ref = mu.sdpa_mask(batch_size=B, q_length=3, kv_length=16, q_offset=10, mask_function=mu.causal_mask_function,
                       attention_mask=am, allow_is_causal_skip=False)
    assert m.kind == "causal+offset+padding" and m.diag.dtype == torch.int32 and m.diag.dim() == 0
    assert torch.equal(m.dense(), ref[:, 0])
    packed = torch.tensor([[0] * 6 + [1] * 7] * B)
    fn = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(packed))
    m = fl_hf.falower_mask(B, 13, 13, 0, 0, fn, None)
    ref = mu.sdpa_mask(batch_size=B, q_length=13, kv_length=13, mask_function=fn, allow_is_causal_skip=False)
    assert m.kind == "dense" and torch.equal(m.dense(), ref[:, 0])


def test_key_ranges():
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    start, end = fl_hf.key_ranges(valid)
    assert start.tolist() == [2, 0, 0, 0] and end.tolist() == [5, 3, 0, 5] and start.dtype == torch.int32
    assert fl_hf.key_ranges(torch.tensor([[1, 0, 1]], dtype=torch.bool)) is None


# ------------------------------------------------------------------------------- the attention function
class _Module(torch.nn.Module):
    is_causal = True
    training = False


def _sdpa_reference(q, k, v, allowed, scale, softcap=None):
    """float64 attention of q [B, H, L, D], k/v [B, HKV, S, D] under allowed [B, L, S]; rows with no key: 0."""
    g = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(g, 1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed[:, None], -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


def _projections(L, S, H=4, HKV=2, D=16, seed=0):
    """q [B, H, L, D] and k, v [B, HKV, S, D] as transposed views of [B, N, H, D] projections, as in a model."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, H * D, generator=g).view(B, L, H, D).transpose(1, 2)
    k = torch.randn(B, S, HKV * D, generator=g).view(B, S, HKV, D).transpose(1, 2)
    v = torch.randn(B, S, HKV * D, generator=g).view(B, S, HKV, D).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("sizes", [(13, 13, 0), (4, 17, 13)], ids=["prefill", "decode"])
def test_attention_matches_reference(sizes, softcap):
    L, S, q_off = sizes
    q, k, v = _projections(L, S)
    assert not q.is_contiguous()
    m = fl_hf.falower_mask(B, L, S, q_off, 0, mu.sliding_window_causal_mask_function(6), _padding(S, "left"),
                           local_size=6)
    out, weights = fl_hf.falower_attention_forward(_Module(), q, k, v, m, scaling=0.3, softcap=softcap)
    assert weights is None and out.shape == (B, L, 4, 16) and out.is_contiguous()
    ref = _sdpa_reference(q, k, v, m.dense(), 0.3, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_attention_without_mask_step_and_4d_masks():
    """A module used on its own (attention_mask None: causal with the queries as the last keys), a prepared
    boolean 4-D mask and an additive float one give SDPA's answer."""
    L, S = 5, 12
    q, k, v = _projections(L, S)
    causal = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
    allowed = causal.expand(B, L, S).clone()
    allowed[0, :, :3] = False
    ref = _sdpa_reference(q, k, v, causal.expand(B, L, S), 0.25)
    out, _ = fl_hf.falower_attention_forward(_Module(), q, k, v, None, scaling=0.25)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    ref = _sdpa_reference(q, k, v, allowed, 0.25)
    out, _ = fl_hf.falower_attention_forward(_Module(), q, k, v, allowed[:, None], scaling=0.25)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]
    out, _ = fl_hf.falower_attention_forward(_Module(), q, k, v, additive, scaling=0.25)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_refusals():
    q, k, v = _projections(4, 4)
    m = fl_hf.falower_mask(B, 4, 4)
    with pytest.raises(FalowerError, match="dropout"):
        fl_hf.falower_attention_forward(_Module(), q, k, v, m, dropout=0.1)
    with pytest.raises(FalowerError, match="sinks"):
        fl_hf.falower_attention_forward(_Module(), q, k, v, m, s_aux=torch.zeros(4))
    with pytest.raises(FalowerError, match="made for batch"):
        fl_hf.falower_attention_forward(_Module(), q, k, v, fl_hf.falower_mask(B, 4, 5))


# ---------------------------------------------------------------------------------------- whole models
def _counts(stats=None) -> tuple:
    """Traces and compiles so far (torch_mods.stats may count more, such as walks of new mod objects)."""
    stats = torch_mods.stats if stats is None else stats
    return stats["traces"], stats["compiles"]


def _tiny(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    kw = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=6, **kw)).eval()
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_model_logits_match_sdpa(kind):
    from transformers import DynamicCache, StaticCache

    fl_hf.register()
    model = _tiny(kind)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 21, dtype=torch.long)
    am[1, :5] = 0  # left padding
    keep = am.bool()
    with torch.no_grad():
        model.config._attn_implementation = "sdpa"
        ref = model(ids, attention_mask=am).logits
        model.config._attn_implementation = "falower"
        before = dict(torch_mods.stats)
        out = model(ids, attention_mask=am).logits
        after_first = dict(torch_mods.stats)
        again = model(ids, attention_mask=am).logits
        assert _counts() == _counts(after_first)  # a second forward neither traces nor compiles
        assert after_first["traces"] - before["traces"] <= 1  # three layers, at most one trace
        torch.testing.assert_close(out[keep], ref[keep], atol=1e-5, rtol=1e-5)
        assert torch.equal(out, again)
        for cache in (DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=32)):
            parts = [model(ids[:, :a], attention_mask=am[:, :a], past_key_values=cache, use_cache=True).logits
                     if a == 17 else
                     model(ids[:, a - n:a], attention_mask=am[:, :a], past_key_values=cache, use_cache=True).logits
                     for a, n in ((17, 17), (20, 3), (21, 1))]
            torch.testing.assert_close(torch.cat(parts, 1)[keep], ref[keep], atol=1e-5, rtol=1e-5)
        cached = dict(torch_mods.stats)
        assert cached["traces"] - after_first["traces"] <= 1  # the offset kind, once for every step and cache
    gen = {}
    for impl in ("falower", "sdpa"):
        model.config._attn_implementation = impl
        gen[impl] = model.generate(ids, attention_mask=am, max_new_tokens=4, do_sample=False)
    assert torch.equal(gen["falower"], gen["sdpa"])


def test_attn_implementation_by_name():
    from transformers import LlamaConfig, LlamaForCausalLM

    fl_hf.register()
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="falower")
    assert model.config._attn_implementation == "falower"
    with torch.no_grad():
        model.eval()(torch.randint(0, 32, (1, 7)))
