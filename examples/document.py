"""Document (jagged) masking: sequences packed into one batch row attend only within their document.

`doc_id[b, i]` is the document of position i; -1 marks padding tokens, which attend to nothing (fully masked
rows: their output is 0). One table serves queries and keys (self-attention, M == N); `--check` draws sorted
ids with a tail of -1. A gather clamps its indices, so M != N still runs.
"""

import falower as fl

doc_id = fl.capture("doc_id", "i32", "B,N")


def same_document(b, h, q_idx, kv_idx):
    return (doc_id[b, q_idx] == doc_id[b, kv_idx]) & (doc_id[b, q_idx] >= 0)


graph = fl.attention(mask_mod=same_document, name="document")
