"""Index arithmetic taken along a row. Scores of the form s + w kv + r(q) by their column step (from_ir._kv_coef,
emit_fa2.col_step), and tables read at k kv + r(q) (a relative bias) by a row's index and constant offsets
(from_ir._row_gather, emit_fa2.row_gather): which scores qualify, that the parts the kernels compute (per element,
per row and tile) give the score, and what the emitted kernels compute where. The numbers are the simulator's
(test_col_step_simulator.py) and the GPU suite's (test_examples_gpu.py: ALiBi and the relative bias on every
kernel the automatic choice takes)."""

from __future__ import annotations

import functools
import math
import re
import runpy
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import falower as fl
from falower.backends.numba_cuda import emit_fa3, emit_fa3_ws
from falower.backends.numba_cuda import intrinsics as intr
from falower.backends.numba_cuda.emit_fa2 import (
    COL_STEP_MAX,
    col_step,
    emit_fa2_forward,
    row_gather,
    row_gather_shift,
)
from falower.backends.numba_cuda.from_ir import analyse, build_spec

ROOT = Path(__file__).resolve().parent.parent.parent
slopes = fl.capture("slopes", "f32", "H")


def _spec(g, extra=None, D=64):
    return build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": D}, "f16", "mma", None, extra)


def _example(stem: str):
    return next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))


def _mod(expr):
    return fl.attention(score_mod=lambda score, b, h, q_idx, kv_idx: expr(score, h, q_idx, kv_idx), name="m")


SCORES = {  # name: (score_mod, its column step a unit of w = slopes[h] (None: no step))
    "alibi": (lambda s, h, q, kv: s + slopes[h] * (kv - q), 1.0),
    "reversed": (lambda s, h, q, kv: s + slopes[h] * (q - kv), -1.0),
    "twice": (lambda s, h, q, kv: s + slopes[h] * (kv * 2 - q), 2.0),
    "half": (lambda s, h, q, kv: s + slopes[h] * ((kv - q + 3) * 0.5), 0.5),
    "product": (lambda s, h, q, kv: s + slopes[h] * (kv * q), None),
    "square": (lambda s, h, q, kv: s + slopes[h] * (kv * kv), None),
    "row only": (lambda s, h, q, kv: s + slopes[h] * q, None),  # nothing along the row: no step to take
    "tanh": (lambda s, h, q, kv: fl.tanh(s) + slopes[h] * (kv - q), None),  # x is not s plus a step
    # an i32 product that can wrap (kv - q) * 10^8: its first column wrapped, the steps would not (a review found
    # the kernel 1.28 off): no step
    "wraps": (lambda s, h, q, kv: s + slopes[h] * ((kv - q) * 100000000).to("f32"), None),
    "fits": (lambda s, h, q, kv: s + slopes[h] * ((kv - q) * 100).to("f32"), 100.0),  # (below 2^31 at 2^24 sizes)
}


@pytest.mark.parametrize("name", sorted(SCORES))
def test_which_scores_step(name):
    mod, step = SCORES[name]
    spec = _spec(_mod(mod))
    assert col_step(spec) == (step is not None), spec.device_source
    if step is None:
        return
    ns = _namespace(spec)
    sl = np.array([0.375, -1.25], np.float32)
    hz = ns["cta_fn"](0, 1, sl)
    w = float(sl[1]) * math.log2(math.e) / spec.score_scale
    assert float(ns["score_col_fn"](0, 1, sl, hz)) == pytest.approx(step * w, rel=1e-6)


@pytest.mark.parametrize("stem,step", [("alibi", True), ("plain", False), ("causal", False), ("softcap", False),
                                       ("bias", False), ("relative_bias", False), ("document", False)])
def test_the_examples(stem, step):
    assert col_step(_spec(_example(stem))) == step


def _namespace(spec) -> dict:
    ns = {"np": np, "math": math, "cuda": types.SimpleNamespace(fma=lambda a, b, c: a * b + c)}
    exec(spec.device_source, ns)
    return ns


@pytest.mark.parametrize("name", ["alibi", "twice", "half"])
def test_the_parts_sum_to_the_score(name):
    """x(s, q, kv) == (s + w (kv - kv0)) + x(0, q, kv0) for any first column kv0 of the thread: what score_row adds
    per element plus what softmax_row adds per row (f32 device functions, so to their rounding)."""
    spec = _spec(_mod(SCORES[name][0]))
    ns = _namespace(spec)
    sl = np.array([0.5, 1.5], np.float32)
    rng = np.random.default_rng(3)
    for _ in range(200):
        h = int(rng.integers(0, 2))
        hz = ns["cta_fn"](0, h, sl)
        s = np.float32(rng.standard_normal() * 10)
        q, kv0 = (int(x) for x in rng.integers(0, 5000, 2))
        o = int(rng.integers(0, 128))
        want = float(ns["score_raw_fn"](s, 0, h, q, kv0 + o, sl, hz))
        row = float(ns["score_raw_fn"](np.float32(0), 0, h, q, kv0, sl, hz))
        got = float(s) + float(ns["score_col_fn"](0, h, sl, hz)) * o + row
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want), abs(row)), (q, kv0, o, got, want)


def _kernels(g, extra=None, D=128):
    """The forward kernels' sources: mma.sync, emit_fa3 (128 rows a warpgroup) and the warp-specialized one."""
    x = extra or {}
    out = {"mma": emit_fa2_forward(_spec(g, x, D=D)),
           "fa3": emit_fa3.emit_fa3_forward(_spec(g, {"schedule": "wgmma", "wg_rows": 128, **x}, D=64)),
           "ws": emit_fa3_ws.emit_fa3_ws_forward(_spec(g, {"schedule": "wgmma-ws", "producer": "none", **x}, D=D))}
    return out


def _fn(src: str, name: str) -> str:
    start = src.index(f"def {name}(")
    return src[start:src.index("\n@", start) if "\n@" in src[start:] else len(src)]


FFMA = r"cuda\.fma\(cstep, np\.float32\(jj \* 8\), lget\(x, e(__\d+)?\)\)"  # score_row's step (names SSA'd)


@pytest.mark.parametrize("kernel", ["mma", "fa3", "ws"])
def test_the_kernels_take_the_step(kernel):
    """score_row: one FFMA an element by the column's offset, no score_raw_fn (its casts and distance); the row's
    offset in softmax_row's max (before the quad's shuffles) and exponent; every softmax_row call passes it
    (col_row_offset: 0 under a steep step, read from the item's col_steep, not tested again a row) at the thread's
    first column. A steep step sends every tile through the masked path (col_steep, once an item), whose rows take
    each element's exact score from the same flag (masked_score_row's `steep`), not the step read and tested again.
    (The warp-specialized kernel's default takes the step in S instead: col_mma, test_the_product_takes_the_step.)"""
    src = _kernels(_example("alibi"), {"col_mma": False})[kernel]
    score_row = _fn(src, "score_row")
    assert "score_raw_fn(" not in score_row and re.search(FFMA, score_row) and "if " not in score_row
    steep = f"abs(score_col_fn(b, h, cap_0_slopes, hz)) > np.float32({COL_STEP_MAX!r})"
    assert re.search(r"col_steep(__\d+)? = " + re.escape(steep), src)
    needs = re.findall(r"need_mask(?:__\d+)? = (.*)", src)
    assert needs and all(re.search(r"or col_steep(__\d+)?$", n) for n in needs), needs
    softmax = _fn(src, "softmax_row")
    assert softmax.startswith("def softmax_row(x, i, m_old, roff):")
    assert softmax.index("mx = mx + roff") < softmax.index("shfl_xor_f32(mx, 1)")
    assert "m_neg = cuda.fma(roff, " in softmax
    calls = [ln for ln in src.splitlines() if "softmax_row(" in ln and "def softmax_row" not in ln]
    assert calls and all(re.search(r"col_row_offset\(col_steep(__\d+)?, b, h, ", ln) and "kv0 + t2" in ln
                         for ln in calls), calls
    offset = _fn(src, "col_row_offset")
    assert offset.startswith("def col_row_offset(steep, b, h, q, kv") and "return ZERO if steep else" in offset
    assert "score_col_fn(" not in offset
    masked = _fn(src, "masked_score_row_in")
    assert re.match(r"def masked_score_row_in\(x, i, b, h, qi, kv, N, lo, hi, exact, steep, ", masked)
    assert "if steep:" in masked and "masked_score_fn(" in masked and "abs(" not in masked  # the item's flag
    assert all(re.search(r"masked_score_row\(.*, N, col_steep(__\d+)?, cap_0_slopes", ln)
               for ln in src.splitlines() if "masked_score_row(" in ln and "def " not in ln)
    rest = masked[masked.index("return\n"):]  # past the steep step's per-element path
    assert "score_raw_fn(" not in rest and "masked_col_score_fn(" in rest  # exact bounds, and mask_fn's path


def test_the_product_takes_the_step():
    """emit_fa3_ws.col_mma (the default at D = 64 and 128): S's wgmmas take one more k step from the item's A words
    and the warpgroup's K block, score_row adds nothing, partial tiles the mask and a zero step, and softmax_row's row
    offset is taken at the tile's first column (kv0)."""
    src = emit_fa3_ws.emit_fa3_ws_forward(_spec(_example("alibi"), {"schedule": "wgmma-ws", "producer": "none"}))
    qk = _fn(src, "qk_wgmma")
    assert qk.startswith("def qk_wgmma(sc, q_wg, dk, cx_w, cx_d):") and qk.count("WG_SX(sc, 0, cx_w, cx_w, ") == 1
    assert qk.index("WG_SX(") > qk.rindex("WG_S(") and qk.index("WG_SX(") < qk.index("wgmma_commit()")
    assert _fn(src, "score_row").split("\n")[1].strip() == "return"  # nothing to add
    masked = _fn(src, "masked_score_row_in")
    assert re.search(r"cstep(__\d+)? = ZERO", masked) and "score_col_fn(" not in masked  # the step is not read
    calls = [ln for ln in src.splitlines() if "softmax_row(" in ln and "def softmax_row" not in ln]
    assert calls and all(ln.rstrip().endswith("kv0, cap_0_slopes, hz))") for ln in calls), calls
    body = src[src.index("cx_s = sb + "):]
    assert body.index("fence_proxy_async()") < body.index("bar_sync(") < body.index("cx_d = desc_word(HI_QK, cx_s)")
    assert re.search(r"cx_w(__\d+)? = np\.uint32\(0\) if col_steep(__\d+)? else col_words\(score_col_fn\(", src)
    # the knob off: the FFMA; D = 128's default takes the product too
    src = emit_fa3_ws.emit_fa3_ws_forward(_spec(_example("alibi"), {"schedule": "wgmma-ws", "producer": "none"},
                                                D=128))
    assert "WG_SX(" in _fn(src, "qk_wgmma") and _fn(src, "score_row").split("\n")[1].strip() == "return"
    for x, D in (({"col_mma": False}, 64), ({"col_mma": False}, 128)):
        src = emit_fa3_ws.emit_fa3_ws_forward(_spec(_example("alibi"), {"schedule": "wgmma-ws", "producer": "none",
                                                                         **x}, D=D))
        assert "WG_SX" not in src and re.search(FFMA, _fn(src, "score_row"))


def test_the_compile_line_names_the_product():
    """The compile progress line says where ALiBi's column term rides in S (the kernel a call's sizes chose is
    visible as it builds): D = 64's warp-specialized kernel, not the knob's FFMA."""
    from falower.backends.numba_cuda.runtime import _label

    base = {"schedule": "wgmma-ws", "producer": "none"}
    assert _label(_spec(_example("alibi"), base), "forward").endswith("wgmma-ws, column term in S)")
    for spec in (_spec(_example("alibi"), {**base, "col_mma": False}), _spec(_example("causal"), base)):
        assert "column term" not in _label(spec, "forward")


@pytest.mark.parametrize("stem,extra", [("causal", {}), ("alibi", {"half_tiles": True})])
def test_the_product_asked_where_it_cannot_run(stem, extra):
    spec = _spec(_example(stem), {"schedule": "wgmma-ws", "producer": "none", "col_mma": True, **extra})
    with pytest.raises(ValueError, match="col_mma .*needs a score with a column step"):
        emit_fa3_ws.validate_spec(spec)


@pytest.mark.parametrize("D,bq,bk", [(128, 128, 128), (64, 128, 256), (64, 192, 128)])
def test_the_product_shares_its_block_where_one_each_would_not_fit(D, bq, bk):
    """At D = 128 on the persistent producer kernel's 128 x 128 tiles a block for each consumer warpgroup (2 x 16 KB)
    would take the room of its second Q buffer (and with it the TMA loads and stores): one block serves both there,
    written by all consumer threads under barrier 15 (emit_fa3_ws.col_shared); at D = 64's 192 x 128 a block each.
    The O buffer stays in both layouts."""
    extra = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 132, "item_order": "dynamic",
             "col_mma": True}
    spec = build_spec(analyse(fl.lower(_example("alibi"), "fa2-fwd")), {"D": D}, "f16", "mma", None, extra)
    spec = type(spec)(**{**spec.__dict__, "block_q": bq, "block_k": bk})
    shared = (D, bq, bk) != (64, 192, 128)
    assert emit_fa3_ws.col_mma(spec) and emit_fa3_ws.col_shared(spec) == shared
    lay = emit_fa3_ws._layout(spec)
    assert lay["o"] and lay["cx"] % 1024 == 0
    assert lay["bars"] - lay["cx"] == (1 if shared else bq // 64) * bk * 128
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    block = src[src.index("cx_s = sb + "):src.index("cx_d = desc_word(")]
    assert ("bar_sync(15, " in block) == shared and ("cw * " in block.splitlines()[0]) == (not shared)


def test_warp_skip_keeps_the_steep_step():
    """The mma.sync kernel's warp_skip sets need_mask again from its warp's class: with `or col_steep` too (without
    it a steep step's full tiles took score_row's FFMA with a zero row offset: O off by 4 in the simulator)."""
    src = emit_fa2_forward(_spec(_example("alibi"), {"warp_skip": True}))
    needs = re.findall(r"need_mask(?:__\d+)? = (.*)", src)
    assert len(needs) >= 2 and any("wcls" in n for n in needs), needs
    assert all(re.search(r"or col_steep(__\d+)?$", n) for n in needs), needs


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_the_a_words_hold_the_step(dtype):
    """col_words (the item's A fragment of the product's k step) as Python on the simulator's conversions: thread
    t = 0 holds the parts hi, mid (columns 0, 1), t = 1 lo (column 2), the others zero; hi + mid + lo is the step
    to f32's precision (f16's lo may lose bits below its subnormals, 2^-25: x 255 columns, 1e-5 in S), for steps
    from 1e-6 to COL_STEP_MAX of both signs."""
    spec = _spec(_example("alibi"), {"schedule": "wgmma-ws", "producer": "none"})
    spec = type(spec)(**{**spec.__dict__, "dtype": dtype}) if dtype != spec.dtype else spec
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    bits, to_f = ((intr._f32_to_f16_bits, intr._f16_bits_to_float) if dtype == "f16"
                  else (intr._f32_to_bf16_bits, intr._bf16_bits_to_float))
    pack = lambda lo, hi: np.uint32(bits(float(lo)) | (bits(float(hi)) << 16))  # noqa: E731
    ns = {"np": np, "ZERO": np.float32(0), f"pack_{dtype}x2": pack,
          f"{dtype}_to_f32": lambda b: np.float32(to_f(int(b)))}
    exec(_fn(src, "col_words"), ns)
    rng = np.random.default_rng(7)
    for cs in np.concatenate([rng.uniform(-1, 1, 200) * 10.0 ** rng.uniform(-6, np.log10(COL_STEP_MAX), 200),
                              [COL_STEP_MAX, -COL_STEP_MAX, 0.0]]).astype(np.float32):
        w0, w1 = int(ns["col_words"](cs, 0)), int(ns["col_words"](cs, 1))
        assert int(ns["col_words"](cs, 2)) == int(ns["col_words"](cs, 3)) == 0
        assert w1 >> 16 == 0  # column 3: zero
        parts = [to_f(w0 & 0xFFFF), to_f(w0 >> 16), to_f(w1 & 0xFFFF)]
        assert abs(sum(parts) - float(cs)) <= max(2.0 ** -25, abs(float(cs)) * 2.0 ** -24), (cs, parts)


def test_the_knob_keeps_the_per_element_score():
    """extra col_step = False (bench '-nocs'): score_raw_fn per element, softmax_row without a row offset."""
    src = emit_fa3_ws.emit_fa3_ws_forward(_spec(_example("alibi"), {"schedule": "wgmma-ws", "producer": "none",
                                                                     "col_step": False}, D=128))
    assert "score_raw_fn(" in _fn(src, "score_row") and "score_col_fn(" not in _fn(src, "score_row")
    assert _fn(src, "softmax_row").startswith("def softmax_row(x, i, m_old):")
    assert "masked_col_score_fn" not in src


rel = fl.capture("rel", "f32", ["H", "L"])
GATHERS = {  # name: (score_mod, row_gather taken)
    "q - kv": (lambda s, h, q, kv: s + rel[h, q - kv + 40], True),
    "kv - q": (lambda s, h, q, kv: s + rel[h, kv - q + 40], True),
    "2 kv": (lambda s, h, q, kv: s + rel[h, kv * 2 - q], False),  # a step of 2: no constant offsets of 1
    "kv in a lead index": (lambda s, h, q, kv: s + rel[kv, q], False),
    # rel[h, kv] reads only kv: score-licm computes it once per column, outside the score, so one gather is left
    "and a column's entry": (lambda s, h, q, kv: s + rel[h, q - kv + 40] * rel[h, kv], True),
    "two along a row": (lambda s, h, q, kv: s + rel[h, q - kv + 40] * rel[h, q + kv], False),
}


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_which_gathers_take_a_row_index(name):
    mod, taken = GATHERS[name]
    assert row_gather(_spec(_mod(mod))) == taken


ROW_PAIRS = {  # name: (score_mod, the shift of row q + 8's entries from row q's, in n8 tiles; None: no sharing)
    "q - kv": (lambda s, h, q, kv: s + rel[h, q - kv + 40], -1),
    "kv - q": (lambda s, h, q, kv: s + rel[h, kv - q + 40], -1),
    "q + kv": (lambda s, h, q, kv: s + rel[h, q + kv], 1),
    "-q - kv": (lambda s, h, q, kv: s + rel[h, 80 - q - kv], 1),
    "2 q - kv": (lambda s, h, q, kv: s + rel[h, q * 2 - kv + 40], None),  # row q + 8 is 16 columns away
    "q in a lead index": (lambda s, h, q, kv: s + rel[q, q - kv + 40], None),  # rows q, q + 8 read other rows
    "kv - row's table entry": (lambda s, h, q, kv: s + rel[h, kv - rel2[h, q]], None),  # not affine in q
}
rel2 = fl.capture("rel2", "i8", ["H", "M"])  # (i8: kv - its entry stays inside i32; an i32 table's entry can wrap it)


@pytest.mark.parametrize("name", sorted(ROW_PAIRS))
def test_which_row_pairs_share_their_loads(name):
    """from_ir._row_gather's shift: the last index a q + k kv + r' with a k = +-1, the leading ones the same down a
    column; the kernels' score_row_pair then shares all but one n8 tile's entries between rows g and g + 8."""
    mod, shift = ROW_PAIRS[name]
    spec = _spec(_mod(mod))
    assert row_gather(spec), spec.device_source
    assert row_gather_shift(spec) == shift, spec.device_source
    assert row_gather_shift(_spec(_mod(mod), {"row_pairs": False})) is None


def test_an_index_that_can_wrap_reads_no_row_gather():
    """kv - t[h, q] with an i32 table t can leave i32 (t = -2^31 + 5): the IR's index wraps per element, a row's
    base plus column offsets would not, so the row's entries are not read at offsets from one index (_kv_coef)."""
    t32 = fl.capture("t32", "i32", ["H", "M"])
    spec = _spec(_mod(lambda s, h, q, kv: s + rel[h, kv - t32[h, q]]))
    assert not row_gather(spec), spec.device_source


@pytest.mark.parametrize("kernel", ["mma", "fa3", "ws"])
def test_the_kernels_share_a_row_pairs_loads(kernel):
    """The relative bias: every unmasked score call is score_row_pair (rows g and g + 8 together), whose loads are
    2 NJ + 2 entries (34 at 128-column tiles, 18 at 64); with row_pairs off, score_row a row."""
    src = _kernels(_example("relative_bias"))[kernel]
    load = _fn(src, "score_pair_load")
    nj = 8  # 64-column tiles
    assert load.count("gather_elem_fn(gr,") == 2 * nj and load.count("gather_elem_fn(gr8,") == 2
    calls = [ln.strip() for ln in src.splitlines() if ln.strip().startswith(("score_row(sc", "score_row_pair"))]
    assert calls and all(c.startswith("score_row_pair") for c in calls), calls  # (the ws kernel's: _given)
    off = _kernels(_example("relative_bias"), {"row_pairs": False})[kernel]
    assert "def score_row_pair(" not in off and "score_row(sc" in off


def test_gather_early_reads_before_the_waits():
    """The ws kernel loads the tile's entries (score_pair_load) before it waits for K, and the unmasked path hands
    them to score_row_pair_given; extra gather_early = False reads them in score_row_pair, after the waits."""
    def ws(extra):
        return emit_fa3_ws.emit_fa3_ws_forward(_spec(_example("relative_bias"), {"schedule": "wgmma-ws",
                                                                                  "producer": "none", **extra}, D=128))
    src = ws({})
    load = src.index("gl = score_pair_load(")
    assert load < src.index("mbar_wait(bars", load) and "score_row_pair_given(sc, ofs_0, " in src
    assert src.index("score_row_pair_given(sc, ofs_0, ") > src.index("WAIT_S", load)
    late = ws({"gather_early": False})
    assert "gl = score_pair_load(" not in late and "score_row_pair(sc, ofs_0, " in late


@pytest.mark.parametrize("stem,taken", [("relative_bias", True), ("bias", False), ("alibi", False),
                                        ("document", False), ("softcap", False)])
def test_the_examples_gather(stem, taken):
    assert row_gather(_spec(_example(stem))) == taken


@pytest.mark.parametrize("name", ["q - kv", "kv - q"])
def test_a_rows_entries_are_the_gathers(name):
    """Where gather_row_fn says a row's columns kv .. kv + span index inside the table, score_gathered_fn of
    gather_elem_fn at offset o is score_raw_fn at column kv + o (the same entry, bit for bit); where it says they
    do not, one of them lies outside (the kernels then clamp per element)."""
    spec = _spec(_mod(GATHERS[name][0]))
    ns = _namespace(spec)
    L, span = 90, 9
    table = np.random.default_rng(1).standard_normal((2, L)).astype(np.float32)
    seen = {True: 0, False: 0}
    for q in range(0, 60, 3):
        for kv in range(0, 70, 5):
            gr = ns["gather_row_fn"](0, 1, q, kv, span, table)
            inside = [0 <= (q - (kv + o) + 40 if name == "q - kv" else kv + o - q + 40) < L for o in range(span + 1)]
            assert bool(gr[0]) == all(inside), (q, kv)
            seen[bool(gr[0])] += 1
            if not gr[0]:
                continue
            for o in range(span + 1):
                s = np.float32(0.5 * o - 1)
                g = ns["gather_elem_fn"](gr, o, table)
                assert ns["score_gathered_fn"](s, g, 0, 1, q, kv + o, table) == ns["score_raw_fn"](s, 0, 1, q, kv + o,
                                                                                                   table)
    assert seen[True] and seen[False]


@pytest.mark.parametrize("kernel", ["mma", "fa3", "ws"])
def test_the_kernels_read_a_row_by_offsets(kernel):
    """score_row: gather_row_fn once a row, then per element one gather_elem_fn at offset jj * 8 (+ 1) and
    score_gathered_fn, with the clamped per-element score_raw_fn only under `else`; the span is the row's last
    column offset."""
    src = _kernels(_example("relative_bias"))[kernel]
    score_row = _fn(src, "score_row")
    fast, slow = score_row.split("    else:", 1)
    assert "gather_row_fn(b, h, qi, kv, " in fast and "if gr[0]:" in fast
    assert "gather_row_fn(b, h, qi, kv, 57," in fast  # 64-column tiles: 8 n8 tiles, the last offset 8 * 7 + 1
    assert "gather_elem_fn(gr, jj * 8," in fast and "gather_elem_fn(gr, jj * 8 + 1," in fast
    assert "score_raw_fn(" not in fast and "score_raw_fn(" in slow


def test_the_row_gather_knob():
    src = emit_fa3_ws.emit_fa3_ws_forward(_spec(_example("relative_bias"), {"schedule": "wgmma-ws",
                                                                             "producer": "none", "row_gather": False},
                                                D=128))
    assert "gather_row_fn(" not in _fn(src, "score_row") and "score_raw_fn(" in _fn(src, "score_row")


@settings(max_examples=25, deadline=None)
@given(a=st.integers(-3, 3), bq=st.integers(-3, 3), c=st.integers(-50, 50), o=st.integers(0, 127),
       q=st.integers(0, 4000), kv0=st.integers(0, 4000))
def test_affine_scores_step_by_their_kv_coefficient(a, bq, c, o, q, kv0):
    """s + slope * (a kv - b q + c): a column step exactly where a != 0, of a * slope * log2(e) / c_exp, and the
    per-element and per-row parts sum to the score at any column (f32 device functions, to their rounding)."""
    spec = _spec(_mod(lambda s, h, qi, kv: s + slopes[h] * (kv * a - qi * bq + c)))
    assert col_step(spec) == (a != 0)
    if a == 0:
        return
    ns = _namespace(spec)
    sl = np.array([0.75, -0.3], np.float32)
    hz = ns["cta_fn"](0, 1, sl)
    step = float(ns["score_col_fn"](0, 1, sl, hz))
    assert step == pytest.approx(a * float(sl[1]) * math.log2(math.e) / spec.score_scale, rel=1e-6)
    s = np.float32(1.25)
    want = float(ns["score_raw_fn"](s, 0, 1, q, kv0 + o, sl, hz))
    row = float(ns["score_raw_fn"](np.float32(0), 0, 1, q, kv0, sl, hz))
    assert abs(float(s) + step * o + row - want) <= 1e-5 * max(1.0, abs(want), abs(row))


@functools.lru_cache(maxsize=None)
def _pair_namespace(mod, kernel="ws"):
    """The kernel's score_row, score_pair_load and score_row_pair_given, run as Python on numpy rows (lget / lset
    on an array), beside the device source's functions."""
    spec = _spec(_mod(mod), {"schedule": "wgmma-ws", "producer": "none"} if kernel == "ws" else None, D=128)
    src = emit_fa3_ws.emit_fa3_ws_forward(spec) if kernel == "ws" else emit_fa2_forward(spec)
    ns = _namespace(spec)
    ns.update(lget=lambda x, i: x[i], lset=lambda x, i, v: x.__setitem__(i, v),
              NEG_INF=np.float32(-np.inf), ZERO=np.float32(0))
    for name in ("score_row", "score_pair_load", "score_row_pair_given", "score_row_pair"):
        exec(_fn(src, name).replace("@device_function", ""), ns)
    return ns


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["q - kv", "kv - q", "q + kv", "-q - kv"]), q=st.integers(0, 120),
       kv=st.integers(0, 15).map(lambda t: 8 * t), t=st.integers(0, 3), L=st.integers(1, 200),
       seed=st.integers(0, 2 ** 16))
def test_a_row_pair_is_its_two_rows(name, q, kv, t, L, seed):
    """score_row_pair_given(score_pair_load(...)) writes both rows exactly as score_row does a row at a time, for
    tables of any length L (rows inside it share their loads, a pair with a row outside falls back) and any q, the
    thread's first column kv + 2t: the shared entries are the same loads at the same indices."""
    ns = _pair_namespace(ROW_PAIRS[name][0])
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((2, L)).astype(np.float32)
    x0 = rng.standard_normal(32).astype(np.float32)  # a thread's two rows of a 64-column tile (8 n8 tiles)
    want = x0.copy()
    ns["score_row"](want, 0, 0, 1, q, kv + 2 * t, 300, table)
    ns["score_row"](want, 2, 0, 1, q + 8, kv + 2 * t, 300, table)
    got = x0.copy()
    ld = ns["score_pair_load"](0, 1, q, kv + 2 * t, table)
    ns["score_row_pair_given"](got, 0, 0, 1, q, kv + 2 * t, 300, table, ld)
    assert np.array_equal(got, want), (ld[0], got - want)


@pytest.mark.parametrize("name", sorted(n for n, (_, shift) in ROW_PAIRS.items() if shift is not None))
def test_a_warpgroups_run_of_the_table_holds_every_entry_its_rows_read(name):
    """emit_fa3_ws.row_slice: a warpgroup's 64 rows read a 128-column tile's entries from one run of the table,
    from il(q_wg, kv0) + slice_start; each thread's entries at its base plus score_pair_slice's constant offsets
    (emit_fa2.pair_slice_offsets). For every (a, k) sign pair and every thread, each entry lands on the run index of
    the element it is (row qi's column kv + o: a rw + k (t2 + o) - start; row qi + 8's own: a (rw + 8) + ...),
    inside the run's 64 + 127 entries and its SLICE_ENTRIES."""
    import dataclasses

    from falower.backends.numba_cuda.emit_fa2 import pair_slice_offsets, row_gather_step

    mod, shift = ROW_PAIRS[name]
    spec = dataclasses.replace(_spec(_mod(mod), D=128), block_q=128, block_k=128)
    k = row_gather_step(spec)
    a = shift * k
    assert "def gather_slice_fn(" in spec.device_source and k in (1, -1) and a in (1, -1)
    offs, lo = pair_slice_offsets(spec)
    start = emit_fa3_ws.slice_start(spec)
    nj = 16
    own8 = [m for m in range(nj) if not 0 <= m + shift < nj]
    want_rel = [(0, 8 * jj + u) for jj in range(nj) for u in (0, 1)] + [(8, 8 * m + u) for m in own8 for u in (0, 1)]
    assert len(offs) == len(want_rel) == 2 * nj + 2 and min(offs) == 0
    for warp in range(4):
        for g in range(8):
            for t2 in (0, 2, 4, 6):
                rw = warp * 16 + g
                base = a * rw + k * t2 + lo - start  # as the kernel computes it
                for off, (dr, o) in zip(offs, want_rel):
                    at = base + off
                    assert at == a * (rw + dr) + k * (t2 + o) - start, (warp, g, t2, dr, o)
                    assert 0 <= at < 64 + 127 <= emit_fa3_ws.SLICE_ENTRIES, at


@pytest.mark.parametrize("name", sorted(n for n, (_, shift) in ROW_PAIRS.items() if shift is not None))
def test_a_threads_pairs_of_entries_are_aligned_in_the_copy_it_reads(name):
    """emit_fa3_ws.slice_pairs: each buffer holds the run and, from SLICE_SHIFTED + 1 on, the run again; a thread
    whose pairs start at an odd entry of the run reads the copy. For every sign pair, both buffers of three
    warpgroups and every thread, the kernel's own code (its slice_read lines and score_pair_slice2, as Python on
    a host array) reads only 8-byte aligned pairs inside the buffer and returns score_pair_slice's entries from the
    run, in its order; and each of a warp's 17 loads finds every bank holding at most one word its lanes read (one
    wavefront: the copy's pairs in other banks than the run's, SLICE_SHIFTED; at 261 they met in 8 banks)."""
    import dataclasses

    mod, _ = ROW_PAIRS[name]
    extra = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 132, "item_order": "dynamic",
             "slice_pairs": True}
    spec = dataclasses.replace(_spec(_mod(mod), extra, D=128), block_q=128, block_k=128)
    assert emit_fa3_ws.slice_pairs(spec)
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    stride = emit_fa3_ws.slice_stride(spec)
    assert stride % 2 == 0 and stride >= emit_fa3_ws.SLICE_SHIFTED + 1 + emit_fa3_ws.SLICE_ENTRIES
    lines = [ln.strip() for ln in src.splitlines()]
    at = next(i for i, ln in enumerate(lines) if ln.startswith("sl_b = sla + "))
    read = [re.sub(r"__\d+", "", ln.split("  #")[0]) for ln in lines[at:at + 3]]
    assert read[2] == "gl = score_pair_slice2(rsl_s + np.uint32(sl_b * 4))", read
    ns = _namespace(spec)
    seen = []

    def lds_v2_f32(sa):
        assert sa % 8 == 0, sa
        seen.append(int(sa) // 4)
        return rsl[int(sa) // 4], rsl[int(sa) // 4 + 1]

    ns["lds_v2_f32"] = lds_v2_f32
    exec(_fn(src, "score_pair_slice2").replace("@device_function", ""), ns)
    exec(_fn(src, "score_pair_slice").replace("@device_function", ""), ns)
    rng = np.random.default_rng(1)
    rsl = np.full(3 * 2 * stride, np.nan, np.float32)
    for buf in range(3 * 2):
        run = rng.standard_normal(emit_fa3_ws.SLICE_ENTRIES).astype(np.float32)
        rsl[buf * stride:buf * stride + len(run)] = run  # the kernel's stores: the run, and its copy
        rsl[buf * stride + emit_fa3_ws.SLICE_SHIFTED + 1:][:len(run)] = run
    for buf in range(3 * 2):
        for warp in range(4):
            words = [{} for _ in range(17)]  # load i: bank -> the words the warp's lanes read there
            for g in range(8):
                for t2 in (0, 2, 4, 6):
                    env = {"sla": buf * stride, "warp": warp, "g": g, "t2": t2, "rsl_s": np.uint32(0), "np": np,
                           "rsl": rsl}
                    seen.clear()
                    for ln in read:
                        exec(ln, ns, env)
                    want = ns["score_pair_slice"](rsl, read_base(read[0], env, ns))
                    assert len(seen) == 17 and all(buf * stride <= e and e + 1 < (buf + 1) * stride for e in seen)
                    got = env["gl"]
                    assert got[0] and not np.isnan(np.array(got[1:])).any() and got == want, (buf, warp, g, t2)
                    for i, e in enumerate(seen):
                        for w in (e, e + 1):
                            words[i].setdefault(w % 32, set()).add(w)
            assert all(len(ws) == 1 for banks in words for ws in banks.values()), (buf, warp, words)


def read_base(line: str, env: dict, ns: dict) -> int:
    """The thread's least entry in the run (slice_read's base, `sl_b = ...` before the copy's shift)."""
    return eval(line.split(" = ", 1)[1], ns, dict(env))


def _host_addresses(ns: dict) -> None:
    """elem_addr and ldg_f32_a on host arrays (as the simulator's: an array's address is its data's own)."""
    import ctypes

    ns["elem_addr"] = lambda a, idx: np.uint64(a.__array_interface__["data"][0]
                                               + sum(int(i) * st for i, st in zip(idx, a.strides)))
    ns["ldg_f32_a"] = lambda at: np.float32(ctypes.c_float.from_address(int(at)).value)


@functools.lru_cache(maxsize=None)
def _slice_kernel(name: str):
    """The persistent producer kernel's spec for ROW_PAIRS[name] at its defaults (row_slice, slice_rows) and its
    device functions as Python (slice_load from the kernel's source), built once a name."""
    import dataclasses

    mod, _ = ROW_PAIRS[name]
    extra = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 132, "item_order": "dynamic"}
    spec = dataclasses.replace(_spec(_mod(mod), extra, D=128), block_q=128, block_k=128)
    assert emit_fa3_ws.slice_rows(spec)
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    assert "sv0, sv1 = slice_load(sl_a, sl_e + " in src and "gather_slice_fn(" not in src.split("def fa2_")[1]
    ns = _namespace(spec)
    _host_addresses(ns)
    exec(_fn(src, "slice_load").replace("@device_function", ""), ns)
    return spec, ns


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["q - kv", "kv - q", "q + kv", "-q - kv"]), q_wg=st.integers(0, 260),
       tile=st.integers(0, 3), L=st.integers(1, 300), ctid=st.integers(0, 127), view=st.sampled_from(["c", "t"]),
       h=st.sampled_from([0, 1, 5]), seed=st.integers(0, 2 ** 16))
def test_a_runs_loads_from_its_kept_row_are_the_gathers(name, q_wg, tile, L, ctid, view, h, seed):
    """emit_fa3_ws.slice_rows: a thread's two entries of a tile's run, from the row address slice_row_fn keeps for
    the item plus the tile's column step (k kv0) and clamped into the row by slice_load, are gather_slice_fn's
    (its clamped two-dimensional index) for every sign pair, warpgroup row, tile, thread and table length (short
    tables clamp on both sides) and head (h = 5 past the table's two rows: the lead index clamped once for the item),
    in a contiguous table and a transposed view (any last-axis stride)."""
    from falower.backends.numba_cuda.emit_fa2 import row_gather_signs

    spec, ns = _slice_kernel(name)
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((2, L)).astype(np.float32)
    if view == "t":
        table = np.ascontiguousarray(table.T).T  # strides (4, 8): the last axis 8 bytes apart
    k = row_gather_signs(spec)[1]
    e = emit_fa3_ws.slice_start(spec) + ctid
    sl_a, sl_i, sl_n, sl_s = ns["slice_row_fn"](0, h, q_wg, 0, table)
    kv0 = 128 * tile
    got = ns["slice_load"](sl_a, np.int32(sl_i + e) + k * kv0, sl_n, sl_s)
    want = (ns["gather_slice_fn"](0, h, q_wg, kv0, e, table), ns["gather_slice_fn"](0, h, q_wg, kv0, e + 128, table))
    assert got == want, (got, want)


def test_row_slice_is_the_persistent_producer_kernels_default_and_only_its():
    rel_g = _example("relative_bias")
    pwg = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 132, "item_order": "dynamic"}
    import dataclasses

    def spec(extra):
        return dataclasses.replace(_spec(rel_g, extra, D=128), block_q=128, block_k=128)

    off = spec({**pwg, "row_slice": False})
    assert not emit_fa3_ws.row_slice(off) and "gl = score_pair_load(" in emit_fa3_ws.emit_fa3_ws_forward(off)
    on = spec(pwg)
    assert emit_fa3_ws.row_slice(on) and emit_fa3_ws.static_bytes(on) - emit_fa3_ws.static_bytes(off) == \
        emit_fa3_ws.slice_bytes(on) == 2 * 2 * emit_fa3_ws.slice_stride(on) * 4
    src = emit_fa3_ws.emit_fa3_ws_forward(on)
    # the entries one at a time (the default), or by pairs from the run and its shifted copy (slice_pairs)
    assert not emit_fa3_ws.slice_pairs(on) and "gl = score_pair_slice(rsl, " in src and "gl = score_pair_load(" \
        not in src and emit_fa3_ws.slice_stride(on) == emit_fa3_ws.SLICE_ENTRIES
    pairs = spec({**pwg, "slice_pairs": True})
    two = emit_fa3_ws.emit_fa3_ws_forward(pairs)
    assert emit_fa3_ws.slice_pairs(pairs) and "gl = score_pair_slice2(rsl_s + " in two and "alignment=8)" in two
    assert "gl = score_pair_slice(rsl, " not in two and not emit_fa3_ws.slice_pairs(spec({**pwg, "row_slice": False,
                                                                                      "slice_pairs": True}))
    # the run's loads from the row kept for the item (slice_rows, the default), or by the clamped index every tile
    assert emit_fa3_ws.slice_rows(on) and not emit_fa3_ws.slice_ahead(on) and "sv0, sv1 = slice_load(" in src
    old = emit_fa3_ws.emit_fa3_ws_forward(spec({**pwg, "slice_rows": False}))
    assert "sv0 = gather_slice_fn(" in old and "slice_load(" not in old
    assert "score_prefetch_fn(" not in src.split("def fa2_")[1]  # the run's loads are the kernel's own
    assert not emit_fa3_ws.row_slice(spec({"schedule": "wgmma-ws", "producer": "none"}))
    assert not emit_fa3_ws.row_slice(spec({**pwg, "gather_early": False}))


def test_slice_in_s_stores_the_run_in_the_shadow_of_s():
    """slice_in_s: on each path from S's issue to its wait (P V beside it or not) the run is stored and the
    warpgroup synced before the wait; the 34 entries are read after it, once (held across the wait they spilled).
    Off by default, and nothing without row_slice."""
    import dataclasses
    pwg = {"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 132, "item_order": "dynamic"}

    def spec(extra):
        return dataclasses.replace(_spec(_example("relative_bias"), {**pwg, **extra}, D=64), block_q=192,
                                   block_k=128)

    assert not emit_fa3_ws.slice_in_s(spec({})) and not emit_fa3_ws.slice_in_s(spec({"row_slice": False,
                                                                                     "slice_in_s": True}))
    src = emit_fa3_ws.emit_fa3_ws_forward(spec({"slice_in_s": True}))
    loop = src[src.index("qk_wgmma(sc, q_wg, desc_word(HI_QK, k_base)"):]
    waits = [loop.index("WAIT_S1(sc, 0)"), loop.index("WAIT_S(sc, 0)")]
    stores = [m.start() for m in re.finditer(r"rsl\[np\.uint32\(sla(__\d+)? \+ \(ctid & 127\)\)\] = sv0", loop)]
    syncs = [m.start() for m in re.finditer(r"bar_sync\(10 \+ cw, 128\)", loop)]
    assert len(stores) == len(syncs) == 2 and stores[0] < syncs[0] < waits[0] < stores[1] < syncs[1] < waits[1]
    reads = [m.start() for m in re.finditer(r"gl = score_pair_slice2?\(rsl(_s \+ |, )", loop)]
    assert len(reads) == 1 and reads[0] > max(waits)
    default = emit_fa3_ws.emit_fa3_ws_forward(spec({}))
    body = default[default.index("qk_wgmma(sc, q_wg, desc_word(HI_QK, k_base)"):]
    assert body.index("bar_sync(10 + cw, 128)") > body.index("WAIT_S(sc, 0)")  # the default: after S's wait
