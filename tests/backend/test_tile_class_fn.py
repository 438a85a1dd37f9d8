"""The kernels' tile classifier (`from_ir._interval_fn`, emitted as tile_class_fn) run as Python against the IR's
(`intervals.classify`, which `mask.kv_range` and `mask.classify` define): where the kernel says full or empty the
IR must say the same, and for a floordiv / mod by one value (a size, a captured scalar, a literal) the kernel must
decide as many tiles as the IR does, not call every tile partial (a packed GQA window visited every kv tile)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import falower as fl
from falower.backends.numba_cuda.from_ir import _interval_fn
from falower.ir import intervals
from falower.passes.pack_gqa import pack_gqa

off = fl.capture("off", "i32", ())
chunk = fl.capture("chunk", "i32", ())
small = fl.capture("small", "i8", ())

GRAPHS = {
    # pack_gqa's q_idx = r % M under a decoding window with the cache's offset
    "packed-window": lambda: pack_gqa(fl.attention(
        group_size=4, name="gw", mask_mod=lambda b, h, q, kv: (q + off - kv >= 0) & (q + off - kv < 300)))[0],
    # pack_gqa's h = j G + r // M read by a head-dependent mask
    "packed-head": lambda: pack_gqa(fl.attention(
        group_size=4, name="gh", mask_mod=lambda b, h, q, kv: (q >= kv) | (h % 2 == 0)))[0],
    # chunked causal by a captured chunk length
    "chunked": lambda: fl.attention(name="ch", mask_mod=lambda b, h, q, kv: (q // chunk == kv // chunk) & (q >= kv)),
    # by arithmetic of an i8 scalar (a cast, a product: one value a tile too)
    "chunk_expr": lambda: fl.attention(name="ce", mask_mod=lambda b, h, q, kv: (q // (small * 2) == kv // (small * 2))
                                       & (q >= kv)),
    # by a literal
    "literal": lambda: fl.attention(name="li", mask_mod=lambda b, h, q, kv: (q % 128) >= (kv % 128)),
}


def _predicate(func):
    low = fl.lower(func, "fa2-fwd")
    return next(op for op in low.walk() if op.name == "mask.kv_range").regions[0]


def _kernel_classifier(pred, dims):
    names = [a.name or f"c{i}" for i, a in enumerate(pred.args[4:])]
    sizes = sorted({s for op in pred.ops if op.name == "const" and hasattr(op.attrs["value"], "symbols")
                    for s in op.attrs["value"].symbols()})
    sig = "".join(f", cap_{n}" for n in names) + "".join(f", dim_{s}" for s in sizes)
    src = "\n".join(_interval_fn(pred, {"D": 64}, sig))
    ns: dict = {}
    exec(src, ns)  # noqa: S102 - the emitted classifier is plain Python
    return ns["tile_class_fn"], [dims[s] for s in sizes], src


@pytest.mark.parametrize("name", list(GRAPHS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_tile_class_fn_agrees_with_intervals(name, data) -> None:
    pred = _predicate(GRAPHS[name]())
    dims = {"M": data.draw(st.integers(1, 9), "M"), "N": 4096, "HKV": 2, "B": 1, "D": 64}
    fn, size_args, src = _kernel_classifier(pred, dims)
    assert "return 1\n" != src.split(":\n", 1)[1].lstrip(), src  # the classifier was not given up on
    caps = ([data.draw(st.integers(0, 600), "off")] if name == "packed-window"
            else [data.draw(st.integers(1, 300), "chunk")] if name == "chunked"
            else [data.draw(st.integers(-3, 60), "small")] if name == "chunk_expr" else [])
    h = data.draw(st.integers(0, 7), "h")
    bq, bk = data.draw(st.sampled_from([(64, 128), (128, 128), (16, 16)]), "tiles")
    q0 = data.draw(st.integers(0, 40), "q tile") * bq
    k0 = data.draw(st.integers(0, 40), "kv tile") * bk
    want = intervals.classify(pred, 0, h, q0, q0 + bq - 1, k0, k0 + bk - 1, [np.int32(c) for c in caps], dims)
    got = fn(0, h, q0, q0 + bq - 1, k0, k0 + bk - 1, *[np.array([c], np.int32) for c in caps], *size_args)
    if name == "chunk_expr" and caps[0] <= 0:  # a divisor not positive: the kernel's whole tile partial, sound
        assert got in (want, intervals.PARTIAL), (name, caps, q0, k0, bq, bk)
    else:
        assert got == want, (name, dims["M"], caps, h, q0, k0, bq, bk)


def test_packed_window_classifier_skips_tiles() -> None:
    """The packed decoding window (M = 1, offset 5000, width 300, 128-wide kv tiles) keeps kv 4701 .. 5000: the
    kernel's classifier calls the tiles outside that empty, as the IR's kv range does."""
    pred = _predicate(GRAPHS["packed-window"]())
    fn, size_args, _ = _kernel_classifier(pred, {"M": 1, "N": 8192})
    cls = [fn(0, 0, 0, 3, k0, k0 + 127, np.array([5000], np.int32), *size_args) for k0 in range(0, 8192, 128)]
    live = [j for j, c in enumerate(cls) if c != intervals.EMPTY]
    assert live == list(range(4701 // 128, 5000 // 128 + 1))
    ir_range = intervals.kv_range(pred, 0, 0, 0, 64, 128, 8192, [np.int32(5000)], {"M": 1, "N": 8192})
    assert ir_range == (live[0], live[-1] + 1)
