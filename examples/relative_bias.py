"""A learned relative-position bias (T5/Swin style): score + rel_bias[h, q_idx - kv_idx + (N - 1)].

The table has one entry per head and relative distance, -(N-1)..(N-1). When M > N the index can leave the
table; gathers clamp, which is the usual "distance buckets saturate" behaviour.
"""

import falower as fl
from falower.ir import dim

N = dim("N")
rel_bias = fl.capture("rel_bias", "f32", ["H", N * 2 - 1])


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + rel_bias[h, q_idx - kv_idx + (N - 1)]


graph = fl.attention(score_mod=relative_bias, name="relative_bias")
