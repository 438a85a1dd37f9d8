"""attn_implementation="falower" in a random-init LlamaForCausalLM (4 layers, hidden 2048, 16 heads, 4 kv heads,
D = 128) on the GPU kernels, against the same model on SDPA: falower's fp16 logits' max error against an fp32
SDPA model is at most twice SDPA fp16's own plus a small floor, for a plain batch, a left-padded batch (2-D
attention mask; non-padded positions compared), decoding with a KV cache (the causal diagonal offset), a
sliding-window MistralForCausalLM and one bf16 case; a forward traces and compiles at most once for all its
layers. `python3 -m pytest -s -m gpu tests/gpu/test_transformers_gpu.py` also prints the forward's time with
falower and with SDPA (for BENCHMARKS.md)."""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import falower.integrations.transformers as fl_hf  # noqa: E402
from falower import torch_mods  # noqa: E402

B, N, VOCAB = 2, 512, 1024
DIMS = dict(vocab_size=VOCAB, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
            num_key_value_heads=4, head_dim=128, max_position_embeddings=8192)


def _model(kind: str = "llama", **extra):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**DIMS, **extra))
    else:
        model = LlamaForCausalLM(LlamaConfig(**DIMS, **extra))
    return model.to("cuda").eval()


@pytest.fixture(scope="module")
def models():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    fl_hf.register()
    ref = _model()
    ref.config._attn_implementation = "sdpa"
    return {"fp32": ref, "fp16": copy.deepcopy(ref).half()}


def _logits(model, impl: str, ids, **kw):
    model.config._attn_implementation = impl
    with torch.no_grad():
        out = model(ids, **kw).logits.float()
    torch.cuda.synchronize()
    return out


def _check(name: str, ref, low_sdpa, low_fl, keep=None, floor: float = 2e-3):
    """falower's max error against the fp32 reference at most 2x SDPA's in the same precision plus a floor
    relative to the logits' size (the FlashAttention criterion, on a model's logits)."""
    if keep is not None:
        ref, low_sdpa, low_fl = ref[keep], low_sdpa[keep], low_fl[keep]
    assert torch.isfinite(low_fl).all()
    err_fl = (low_fl - ref).abs().max().item()
    err_sdpa = (low_sdpa - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"\nRESULT {name}: max |logit| {scale:.3f}, falower err {err_fl:.3e}, SDPA err {err_sdpa:.3e}")
    assert err_fl <= 2 * err_sdpa + floor * scale, (err_fl, err_sdpa, scale)


def _ids(seed: int = 0, n: int = N):
    return torch.randint(0, VOCAB, (B, n), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))


def test_llama_fp16_matches_sdpa(models):
    ids = _ids()
    ref = _logits(models["fp32"], "sdpa", ids)
    low_sdpa = _logits(models["fp16"], "sdpa", ids)
    before = dict(torch_mods.stats)
    low_fl = _logits(models["fp16"], "falower", ids)
    first = dict(torch_mods.stats)
    assert first["traces"] - before["traces"] <= 1 and first["compiles"] - before["compiles"] <= 1  # 4 layers
    _logits(models["fp16"], "falower", ids)
    assert {k: torch_mods.stats[k] for k in ('traces', 'compiles')} == {k: first[k] for k in ('traces', 'compiles')}
    _check("llama fp16 causal", ref, low_sdpa, low_fl)


def test_llama_fp16_left_padding(models):
    ids = _ids(1)
    am = torch.ones(B, N, dtype=torch.long, device="cuda")
    am[1, :100] = 0
    keep = am.bool()
    ref = _logits(models["fp32"], "sdpa", ids, attention_mask=am)
    low_sdpa = _logits(models["fp16"], "sdpa", ids, attention_mask=am)
    low_fl = _logits(models["fp16"], "falower", ids, attention_mask=am)
    _check("llama fp16 left padding (2-D mask)", ref, low_sdpa, low_fl, keep)


def test_llama_fp16_decoding_with_cache(models):
    """Prefill N - 16 tokens, then 16 more against the cache: the queries are the last rows of the keys."""
    from transformers import DynamicCache

    ids = _ids(2)
    ref = _logits(models["fp32"], "sdpa", ids)[:, -16:]
    out = {}
    for impl in ("sdpa", "falower"):
        model = models["fp16"]
        model.config._attn_implementation = impl
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :-16], past_key_values=cache, use_cache=True)
            before = dict(torch_mods.stats)
            out[impl] = model(ids[:, -16:], past_key_values=cache, use_cache=True).logits.float()
    assert torch_mods.stats["traces"] - before["traces"] <= 1
    _check("llama fp16 decoding, 16 queries after 496 cached keys", ref, out["sdpa"], out["falower"])


def test_mistral_fp16_sliding_window(models):
    ref_model = _model("mistral", sliding_window=128)
    low = copy.deepcopy(ref_model).half()
    ids = _ids(3)
    ref = _logits(ref_model, "sdpa", ids)
    low_sdpa = _logits(low, "sdpa", ids)
    low_fl = _logits(low, "falower", ids)
    _check("mistral fp16 sliding window 128", ref, low_sdpa, low_fl)
    del ref_model, low


def test_llama_bf16_matches_sdpa(models):
    ids = _ids(4)
    low = copy.deepcopy(models["fp32"]).to(torch.bfloat16)
    ref = _logits(models["fp32"], "sdpa", ids)
    low_sdpa = _logits(low, "sdpa", ids)
    low_fl = _logits(low, "falower", ids)
    _check("llama bf16 causal", ref, low_sdpa, low_fl)
    del low


def _time_ms(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("b,n", [(2, 512), (2, 2048), (1, 8192)])
def test_forward_timing(models, b, n):
    """The fp16 model's forward (median of 10) with falower and with SDPA; printed, not asserted. Short
    sequences measure the host cost of an attention call (the kernel takes microseconds), N = 8192 the kernel."""
    model = models["fp16"]
    ids = _ids(5, n)[:b]
    res = {}
    for impl in ("sdpa", "falower"):
        model.config._attn_implementation = impl

        def fwd():
            with torch.no_grad():
                model(ids)

        res[impl] = _time_ms(fwd)
    print(f"\nRESULT timing fp16 Llama 4 layers, B={b}, N={n}: falower {res['falower']:.2f} ms, "
          f"SDPA {res['sdpa']:.2f} ms per forward")
