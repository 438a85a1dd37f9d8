"""A partial tile's row under exact row bounds (row_bounds.py) in masked_score_row_in: its kept elements as a word of
bits (emit_fa2.keep_word) must drop exactly the elements outside [lo, hi) and past N, as the two compares did. The
helper as Python (its device functions are plain code), on every bound a thread's row can see, for the tile widths
the kernels take (64, 128 and 176 columns: 32-bit and 64-bit words) and for 256 (the compares, no word)."""

from __future__ import annotations

import functools
import runpy
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import falower as fl
from falower.backends.numba_cuda.emit_fa2 import _Code, emit_fragment_helpers, keep_word
from falower.backends.numba_cuda.from_ir import analyse, build_spec

ROOT = Path(__file__).resolve().parent.parent.parent
NEG_INF = np.float32(-np.inf)


def _masked_row_source(bk: int, extra: Optional[dict] = None) -> str:
    """masked_score_row_in's source as examples/causal.py's forward spec emits it for block_k = bk."""
    g = next(v for v in runpy.run_path(str(ROOT / "examples" / "causal.py")).values() if isinstance(v, fl.Func))
    spec = build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": 64}, "f16", "mma", None, extra)
    c = _Code()
    emit_fragment_helpers(c, spec, bk // 8, 8, "mma_f16", "pack_f16x2")
    src = c.text()
    start = src.index("def masked_score_row_in(")
    return src[start:src.index("\n@", start)]


@functools.lru_cache(maxsize=None)
def _helper(bk: int):
    body = _masked_row_source(bk)
    ns = {"np": np, "NEG_INF": NEG_INF, "lget": lambda x, i: x[i],
          "lset": lambda x, i, v: x.__setitem__(i, v)}
    exec(body, ns)
    return ns["masked_score_row_in"], body


@pytest.mark.parametrize("bk,word", [(64, "np.uint32"), (128, "np.uint32"), (176, "np.uint64"), (256, "")])
def test_the_word_is_the_compares(bk, word):
    fn, body = _helper(bk)
    assert keep_word(bk // 8) == word and (("keep = " in body) == bool(word))
    NJ = bk // 8
    t2 = 4  # the thread's first column in the tile (lane & 3 = 2)
    kv = 1000 + t2
    for lo in [*range(kv - 3, kv + 20), *range(kv + 20, kv + 8 * NJ + 3, 5)]:
        for hi in list(range(lo - 2, lo + 20)) + [lo + 8 * NJ, kv + 8 * NJ + 5]:
            for N in (kv + 8 * NJ + 9, kv + 8 * NJ // 2 + 3):
                x = np.arange(4 * NJ, dtype=np.float32) + 1
                fn(x, 0, 0, 0, 0, kv, N, lo, hi, True)
                for jj in range(NJ):
                    for u in (0, 1):
                        col = kv + 8 * jj + u
                        keep = lo <= col < min(hi, N)
                        got = x[4 * jj + u]
                        assert (got == 4 * jj + u + 1) if keep else got == NEG_INF, (bk, lo, hi, N, jj, u)


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(-300, 300), width=st.integers(-5, 400), t=st.integers(0, 3))
def test_any_bounds(lo, width, t):
    fn, _ = _helper(128)
    kv = 2 * t
    x = np.ones(64, np.float32)
    fn(x, 0, 0, 0, 0, kv, 10 ** 6, lo, lo + width, True)
    for jj in range(16):
        for u in (0, 1):
            keep = lo <= kv + 8 * jj + u < lo + width
            assert (x[4 * jj + u] == 1) == keep


def test_the_knob_keeps_the_compares():
    """extra keep_bits = False (bench '-nokb'): the two compares an element, no word."""
    for extra, word in (({}, True), ({"keep_bits": False}, False)):
        body = _masked_row_source(128, extra)
        assert ("keep = np.uint32(" in body) == word and ("(c0 >= lo_r) & (c0 < hi_r)" in body) == (not word)
