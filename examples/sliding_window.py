"""Causal sliding-window attention (Mistral-style): query i sees keys i-47..i.

A window of 48 with 64-wide tiles leaves tiles that are partly inside the band, so both the full-tile and
the per-element mask paths get exercised.
"""

import falower as fl

WINDOW = 48


def sliding_window(b, h, q_idx, kv_idx):
    dist = q_idx - kv_idx
    return (dist >= 0) & (dist < WINDOW)


graph = fl.attention(mask_mod=sliding_window, name="sliding_window")
