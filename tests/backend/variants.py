"""Hand-written device sources and float64 references for the backend tests and the benchmark."""

from __future__ import annotations

import math

import numpy as np

from falower.backends.numba_cuda.spec import Capture, FA2ForwardSpec

LOG2E = 1.4426950408889634


def plain_source(scale: float) -> str:
    return f"""
SCALE_LOG2E = np.float32({scale * LOG2E!r})

def score_fn(s, b, h, q, kv):
    return s * SCALE_LOG2E
"""


def causal_source(scale: float) -> str:
    # Bottom-right aligned? No: top-left (q >= kv), like torch is_causal for M == N.
    return plain_source(scale) + """
def mask_fn(b, h, q, kv):
    return q >= kv

def tile_class_fn(b, h, q_lo, q_hi, kv_lo, kv_hi):
    if kv_lo > q_hi:
        return 0
    if kv_hi <= q_lo:
        return 2
    return 1
"""


def bias_source(scale: float) -> str:
    # A captured [H, M, N] f32 bias table; indices are clamped (padded positions may ask for them).
    return f"""
SCALE_LOG2E = np.float32({scale * LOG2E!r})
LOG2E_F = np.float32({LOG2E!r})

def score_fn(s, b, h, q, kv, bias):
    qq = min(q, bias.shape[1] - 1)
    kk = min(kv, bias.shape[2] - 1)
    return s * SCALE_LOG2E + bias[h, qq, kk] * LOG2E_F
"""


def document_source(scale: float) -> str:
    # Data-dependent mask: a query sees keys of the same document, causally; doc id < 0 marks padding
    # queries that see nothing (fully masked rows). doc: i32 [B, max(M, N)].
    return plain_source(scale).replace("def score_fn(s, b, h, q, kv):", "def score_fn(s, b, h, q, kv, doc):") + """
def mask_fn(b, h, q, kv, doc):
    qq = min(q, doc.shape[1] - 1)
    kk = min(kv, doc.shape[1] - 1)
    return doc[b, qq] >= 0 and doc[b, qq] == doc[b, kk] and q >= kv
"""


def make_spec(variant: str, D: int, dtype: str = "f16", path: str = "mma", block_q: int = 64,
              block_k: int = 64, num_warps: int = 4, group_size: int = 1, name: str | None = None,
              ) -> FA2ForwardSpec:
    scale = 1.0 / math.sqrt(D)
    kw: dict = {}
    if variant == "plain":
        src = plain_source(scale)
    elif variant == "causal":
        src = causal_source(scale)
        kw = dict(has_mask=True, block_mask="static")
    elif variant == "bias":
        src = bias_source(scale)
        kw = dict(captures=(Capture("bias", "f32", 3),))
    elif variant == "document":
        src = document_source(scale)
        kw = dict(has_mask=True, block_mask="table", captures=(Capture("doc", "i32", 2),))
    else:
        raise ValueError(variant)
    return FA2ForwardSpec(
        name=name or f"fa2_{variant}_{path}_{dtype}_d{D}_g{group_size}_{block_q}x{block_k}w{num_warps}",
        head_dim=D, dtype=dtype, path=path, block_q=block_q, block_k=block_k, num_warps=num_warps,
        group_size=group_size, device_source=src, **kw)


def reference(q, k, v, variant: str, captures=(), group_size: int = 1):
    """float64 attention: returns (o, lse) with O = 0 and LSE = -inf on fully masked rows."""
    q = np.asarray(q, dtype=np.float64)
    k = np.repeat(np.asarray(k, dtype=np.float64), group_size, axis=1)
    v = np.repeat(np.asarray(v, dtype=np.float64), group_size, axis=1)
    B, H, M, D = q.shape
    N = k.shape[2]
    s = np.einsum("bhmd,bhnd->bhmn", q, k) / math.sqrt(D)
    keep = np.ones((B, H, M, N), dtype=bool)
    if variant == "causal":
        keep &= (np.arange(M)[:, None] >= np.arange(N)[None, :])[None, None]
    elif variant == "bias":
        s = s + np.asarray(captures[0], dtype=np.float64)[None]
    elif variant == "document":
        doc = np.asarray(captures[0])
        dq, dk = doc[:, :M], doc[:, :N]
        keep &= (dq[:, None, :, None] == dk[:, None, None, :]) & (dq[:, None, :, None] >= 0)
        keep &= (np.arange(M)[:, None] >= np.arange(N)[None, :])[None, None]
    s = np.where(keep, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    empty = ~np.isfinite(mx)
    mx = np.where(empty, 0.0, mx)
    p = np.exp(s - mx)
    l = p.sum(axis=-1, keepdims=True)
    o = np.where(l > 0, np.einsum("bhmn,bhnd->bhmd", p, v) / np.where(l > 0, l, 1.0), 0.0)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + mx[..., 0], -np.inf)
    return o, lse


def bf16_bits(x) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def as_float(x, dtype: str) -> np.ndarray:
    """The values a kernel input or output holds, as float64 (bf16 arrives as uint16 bits)."""
    x = np.asarray(x)
    return bf16_values(x).astype(np.float64) if dtype == "bf16" else x.astype(np.float64)


def random_inputs(rng, dtype: str, B: int, H: int, M: int, N: int, D: int, group_size: int = 1):
    """q, k, v as the kernel takes them on the host: float16 / float32 arrays, or bf16 bit patterns."""
    shapes = [(B, H, M, D), (B, H // group_size, N, D), (B, H // group_size, N, D)]
    out = []
    for shp in shapes:
        x = rng.standard_normal(shp).astype(np.float32)
        out.append(bf16_bits(x) if dtype == "bf16" else x.astype(np.float16 if dtype == "f16" else np.float32))
    return out


def random_captures(rng, variant: str, B: int, H: int, M: int, N: int):
    if variant == "bias":
        return (rng.standard_normal((H, M, N)).astype(np.float32),)
    if variant == "document":
        L = max(M, N)
        doc = np.sort(rng.integers(0, 3, size=(B, L))).astype(np.int32)
        doc[:, 3] = -1  # a padding query: its row is fully masked
        doc[0, M - 1] = -1
        return (doc,)
    return ()
