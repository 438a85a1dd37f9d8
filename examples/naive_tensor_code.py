"""Attention written directly as tensor code, no helper: what a user would write before reaching for FA2."""

import falower as fl


@fl.trace(q=fl.tensor("f16", "B,H,M,D"), k=fl.tensor("f16", "B,H,N,D"), v=fl.tensor("f16", "B,H,N,D"),
          result_names=("o",))
def naive_tensor_code(q, k, v):
    p = fl.softmax(q @ k.mT * 0.125, dim=-1)  # 0.125 = 1/sqrt(64): written for head_dim 64
    return (p @ v).to("f16")
