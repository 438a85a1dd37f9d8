"""ALiBi: a per-head linear penalty on distance, score + slope[h] * (kv_idx - q_idx), with causal masking.

The slopes are captured (one per head), so the same graph serves any head count.
"""

import falower as fl

slopes = fl.capture("slopes", "f32", "H")


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


graph = fl.attention(score_mod=alibi, mask_mod=causal, name="alibi")
