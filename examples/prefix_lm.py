"""Prefix-LM: the first PREFIX positions are seen by every query (bidirectional prefix), the rest causally."""

import falower as fl

PREFIX = 32


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < PREFIX)


graph = fl.attention(mask_mod=prefix_lm, name="prefix_lm")
