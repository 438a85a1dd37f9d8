"""score_mods and mask_mods written the way FlexAttention's documentation and attention-gym write them (torch
operations, closed-over torch tensors), shared by tests/test_flex_api.py (CPU, reference backend) and
tests/gpu/test_flex_api_gpu.py (CUDA, against torch's flex_attention). Each case is built for a device and
sizes, and carries the mods and a float64 torch math reference of the same mods."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks


@dataclass
class Case:
    name: str
    score_mod: Optional[Callable]
    mask_mod: Optional[Callable]
    N: int = 33            # sequence length (q and kv)
    group: int = 1         # GQA group (query heads per kv head)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make_cases(B: int, H: int, N: int, device: str) -> list[Case]:
    g = torch.Generator().manual_seed(1234)
    cases = [Case("causal", None, causal, N)]

    # ALiBi, FlexAttention's blog: per-head slopes closed over as a tensor
    slopes = torch.exp2(-torch.arange(1, H + 1, dtype=torch.float32) * 8.0 / H).to(device)

    def alibi(score, b, h, q_idx, kv_idx):
        bias = slopes[h] * (kv_idx - q_idx)
        return score + bias

    cases.append(Case("alibi", alibi, causal, N))

    # ALiBi, attention-gym's generate_alibi_bias: the slope computed from h with torch.exp2
    def alibi_gym(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / H))
        return score + (kv_idx - q_idx) * scale

    cases.append(Case("alibi_gym", alibi_gym, None, N))

    # tanh soft-capping (Gemma 2, attention-gym's generate_tanh_softcap)
    soft_cap = 5.0

    def tanh_softcap(score, b, h, q_idx, kv_idx):
        score = score / soft_cap
        score = torch.tanh(score)
        return score * soft_cap

    cases.append(Case("softcap", tanh_softcap, causal, N))

    # sliding window (attention-gym: and_masks of causal and a window)
    window = 8

    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window

    cases.append(Case("sliding_window", None, and_masks(causal, sliding_window), N))

    # prefix LM (or_masks of a prefix and causal), the prefix length per batch as a tensor
    prefix_lengths = torch.randint(1, N, (B,), generator=g).to(device)

    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx < prefix_lengths[b]

    cases.append(Case("prefix_lm", None, or_masks(prefix_mask, causal), N))

    # document masking, attention-gym's generate_doc_mask_mod: int64 offsets and document ids
    lengths = torch.tensor([5, 11, 1, N - 17])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
    document_id = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)

    def generate_doc_mask_mod(mask_mod, offsets):
        def doc_mask_mod(b, h, q_idx, kv_idx):
            same_doc = document_id[q_idx] == document_id[kv_idx]
            q_logical = q_idx - offsets[document_id[q_idx]]
            kv_logical = kv_idx - offsets[document_id[kv_idx]]
            inner_mask = mask_mod(b, h, q_logical, kv_logical)
            return same_doc & inner_mask
        return doc_mask_mod

    cases.append(Case("document", None, generate_doc_mask_mod(causal, offsets), N))

    # relative position bias: a learned table per head and distance
    rel_bias = (torch.randn(H, 2 * N - 1, generator=g) * 0.5).to(device)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + rel_bias[h, q_idx - kv_idx + N - 1]

    cases.append(Case("relative_bias", relative_bias, None, N))

    # FlexAttention's docs: relative positional score_mod, and a full [H, N, N] bias table
    def relative_positional(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx)

    cases.append(Case("relative_positional", relative_positional, None, N))
    bias = (torch.randn(B, H, N, N, generator=g) * 0.5).to(device)

    def bias_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx]

    cases.append(Case("bias", bias_mod, None, N))

    # NATTEN-style 2-D neighbourhood attention (attention-gym), on a W x Hgt grid of tokens
    W, Hgt, K_W, K_H = 6, 6, 3, 3

    def get_x_y(idx):
        return idx // W, idx % W

    def natten_mask(b, h, q_idx, kv_idx):
        q_x, q_y = get_x_y(q_idx)
        kv_x, kv_y = get_x_y(kv_idx)
        kernel_x = q_x.clamp(K_W // 2, (W - 1) - K_W // 2)
        kernel_y = q_y.clamp(K_H // 2, (Hgt - 1) - K_H // 2)
        hori_mask = (kernel_x - kv_x).abs() <= K_W // 2
        vert_mask = (kernel_y - kv_y).abs() <= K_H // 2
        return hori_mask & vert_mask

    cases.append(Case("natten", None, natten_mask, W * Hgt))

    # sin/cos-based score mods, a 0-d scalar tensor, torch.where with a Python scalar, clamp, minimum, sigmoid
    temperature = torch.tensor(0.75).to(device)

    def sin_mod(score, b, h, q_idx, kv_idx):
        return score * temperature + torch.sin((q_idx - kv_idx).float() * 0.3) + torch.cos(h * 0.5)

    cases.append(Case("sin", sin_mod, causal, N))

    def mixed(score, b, h, q_idx, kv_idx):
        far = torch.abs(q_idx - kv_idx) > 4
        s = torch.where(far, score - 1.0, score)
        s = torch.clamp(s, min=-3.0, max=3.0) + torch.sigmoid(s) * 0.5
        return torch.minimum(s, torch.maximum(s * 0.5, torch.full_like(s, -1.0))) + torch.log1p(torch.exp(-s.abs()))

    cases.append(Case("mixed", mixed, noop_mask, N))

    # grouped-query attention with a causal mask
    cases.append(Case("gqa_causal", alibi_gym, causal, N, group=2))
    return cases


def index_grids(B: int, H: int, M: int, N: int, device) -> tuple:
    """b, h, q_idx, kv_idx as broadcasting int32 tensors: a mod applied to them gives its whole [B, H, M, N]."""
    def ar(n, axis):
        shape = [1, 1, 1, 1]
        shape[axis] = n
        return torch.arange(n, dtype=torch.int32, device=device).reshape(shape)
    return ar(B, 0), ar(H, 1), ar(M, 2), ar(N, 3)


def math_reference(q, k, v, score_mod=None, mask_mod=None, scale=None, group=1):
    """softmax(score_mod(q k^T * scale) masked by mask_mod) v in the inputs' dtype (float64 for a reference),
    with torch ops on whole tensors: the mods run on broadcasting index grids. Returns (out, lse); fully
    masked rows give 0 and lse -inf."""
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    B, H, M, D = q.shape
    N = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q @ k.mT) * scale
    b, h, qi, ki = index_grids(B, H, M, N, q.device)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki).to(q.dtype)
    if mask_mod is not None:
        keep = mask_mod(b, h, qi, ki).expand(B, H, M, N)
        s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse
