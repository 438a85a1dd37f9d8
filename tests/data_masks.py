"""Masks that read captured data, ported from FlexAttention's, attention-gym's and FlashAttention's suites.

Issue 7 found mask-tiles wrong on every one of these at ragged sizes (a last kv tile whose in-bounds entries
are all kept was classed full, and the full path dropped the bounds). They are shared by the interpreter
tests (tests/test_data_masks.py) and the GPU tests (tests/gpu/test_examples_gpu.py).
"""

from __future__ import annotations

from typing import Callable

import falower as fl
from falower.ir import Func

SIZES = [(1, 1), (17, 17), (67, 67), (130, 130), (130, 67), (17, 130)]


def _blocks() -> Func:
    ids = fl.capture("ids", "i32", "N")  # block ids, 32 positions each in the case
    return fl.attention(mask_mod=lambda b, h, q, kv: ids[q] == ids[kv], name="blocks")


def _doc_per_head() -> Func:
    doc = fl.capture("doc", "i32", "B,H,N")
    return fl.attention(mask_mod=lambda b, h, q, kv: (doc[b, h, q] == doc[b, h, kv]) & (doc[b, h, q] >= 0),
                        name="doc_per_head")


def _batch_offsets() -> Func:
    start = fl.capture("start", "i32", "B")  # left padding: the first real token of each batch row
    return fl.attention(mask_mod=lambda b, h, q, kv: (kv >= start[b]) & (q >= start[b]), name="batch_offsets")


def _causal_bidirectional_prefix() -> Func:
    nbi = fl.capture("nbi", "i32", "B")  # tokens at the start of each row that attend both ways
    return fl.attention(mask_mod=lambda b, h, q, kv: (q >= kv) | (kv < nbi[b]), name="causal_bidir_prefix")


def _global_and_window() -> Func:
    glob = fl.capture("glob", "bool", "N")
    return fl.attention(mask_mod=lambda b, h, q, kv: glob[q] | glob[kv] | ((q - kv < 16) & (kv - q < 16)),
                        name="global_window")


def _shared_prefix_documents() -> Func:
    doc = fl.capture("doc", "i32", "B,N")
    plen = fl.capture("plen", "i32", "B")
    return fl.attention(mask_mod=lambda b, h, q, kv: (kv < plen[b]) | (doc[b, q] == doc[b, kv]),
                        name="shared_prefix")


def _threshold_table() -> Func:
    thr = fl.capture("thr", "i32", "H")  # a per-head window read from a table
    return fl.attention(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < thr[h]), name="threshold")


def _dense_buffer() -> Func:
    keep = fl.capture("keep", "bool", "M,N")
    return fl.attention(mask_mod=lambda b, h, q, kv: keep[q, kv], name="dense")


def _nested_gather() -> Func:
    ids = fl.capture("ids", "i32", "N")
    offsets = fl.capture("offsets", "i32", "N")
    return fl.attention(mask_mod=lambda b, h, q, kv: offsets[ids[q]] <= kv, name="nested")


MASKS: dict[str, Callable[[], Func]] = {
    "blocks": _blocks, "doc_per_head": _doc_per_head, "batch_offsets": _batch_offsets,
    "causal_bidir_prefix": _causal_bidirectional_prefix, "global_window": _global_and_window,
    "shared_prefix": _shared_prefix_documents, "threshold": _threshold_table, "dense": _dense_buffer,
    "nested": _nested_gather,
}
