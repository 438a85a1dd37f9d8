"""tanh soft-capping of the scores (Gemma 2, Grok): cap * tanh(score / cap) keeps logits in (-cap, cap)."""

import falower as fl

CAP = 30.0


def softcap(score, b, h, q_idx, kv_idx):
    return CAP * fl.tanh(score / CAP)


graph = fl.attention(score_mod=softcap, name="softcap")
