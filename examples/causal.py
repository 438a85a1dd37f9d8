"""Causal attention: query i sees keys 0..i (top-left aligned, like torch's is_causal when M == N)."""

import falower as fl


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


graph = fl.attention(mask_mod=causal_mask, name="causal")
