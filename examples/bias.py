"""An additive bias tensor: score + bias[h, q_idx, kv_idx], the bias captured as an extra graph input.

A [B, H, M, N] bias works the same way with `fl.capture("bias", "f32", "B,H,M,N")` and `bias[b, h, q_idx, kv_idx]`.
"""

import falower as fl

bias = fl.capture("bias", "f32", "H,M,N")


def add_bias(score, b, h, q_idx, kv_idx):
    return score + bias[h, q_idx, kv_idx]


graph = fl.attention(score_mod=add_bias, name="bias")
