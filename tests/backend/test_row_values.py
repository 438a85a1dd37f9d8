"""The backward's row values, computed once a row where a kernel reads the row's statistics instead of in every
element (from_ir_bwd):
  lse_row_fn    the guarded LSE times log2(e), `0 if lse == -inf else lse log2 e` (_lse_row_fn);
  delta_row_fn  -Delta c, where dS = P (dP - Delta) c (times a softcap's derivative, and its constants folded into c)
                is written P fma(dP, c, -Delta c) (_scaled_difference; not where a captured table's gradient reads
                dP - Delta or P (dP - Delta)).

The element functions then take their values for `lse` and `delta`. Three things must hold, or a kernel is
silently wrong:
  * elem(s, dp, lse_row_fn(lse), delta_row_fn(delta), ...) is the per-element form's elem(s, dp, lse, delta, ...)
    bit for bit where c is a power of 2 (D = 64) and no other constant folds into it, to f32 roundings elsewhere,
    fully masked rows (LSE -inf) included;
  * no element function still computes from the LSE or Delta themselves;
  * every read of the LSE and Delta in every backward kernel (wgmma with and without its loader warps, persistent,
    mma.sync, the deterministic and SIMT dQ kernels) goes through the row function.
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")
import falower as fl  # noqa: E402
from falower.backends.numba_cuda import emit_fa2_bwd, emit_fa3_bwd  # noqa: E402
from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
NO_CAPTURES = ["plain", "causal", "prefix_lm", "sliding_window", "gqa", "softcap", "naive_tensor_code"]
NO_DELTA_ROW = {"alibi": "the slope's gradient reads P (dP - Delta)", "bias": "the table's gradient reads it",
                "relative_bias": "the table's gradient reads it"}
ROUNDED = {"softcap": "its cap and 1 / (cap sqrt(D)) folded into one c: the products round differently"}
_LOWERED: dict = {}


def _spec(stem: str, D: int = 64, pipeline: str = "fa2-bwd", path: str = "mma", dtype: str = "f16", **extra):
    if (stem, pipeline) not in _LOWERED:
        g = next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values()
                 if isinstance(v, fl.ir.Func))
        _LOWERED[stem, pipeline] = analyse_backward(fl.compile(g, "numba-cuda", backward=pipeline).lowered_backward)
    return build_backward_spec(_LOWERED[stem, pipeline], {"D": D}, dtype, path, None, extra)


class _Cuda:
    @staticmethod
    def fma(a, b, c):  # the f32 product is exact in f64: one rounding, as the FFMA
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _run(text: str) -> dict:
    ns = {"np": np, "LOG2E": np.float32(1.4426950408889634), "cuda": _Cuda,
          "ex2": lambda x: np.float32(np.exp2(np.float32(x))),
          "tanh_ex2_f32": lambda y: np.float32(1 - 2 / (1 + np.exp2(np.float64(y))))}
    with np.errstate(invalid="ignore", over="ignore"):  # -inf + -inf and the like, as the GPU computes them
        exec(text, ns)  # noqa: S102 - our own emitted code
    return ns


def _functions(source: str) -> dict[str, str]:
    """name -> text of each top-level def in a device source."""
    return {m.group(1): m.group(0) for m in re.finditer(r"^def (\w+)\(.*?(?=^def |\Z)", source, re.M | re.S)}


@pytest.mark.parametrize("stem", EXAMPLES)
def test_every_example_reads_the_lse_once_a_row(stem):
    """lse_row_fn is there, once; no element function compares the LSE with -inf or scales it: each reads its
    `lse` parameter only negated, into the exponential's FMA."""
    spec = _spec(stem)
    fns = _functions(spec.device_source)
    assert "lse_row_fn" in fns and spec.device_source.count("def lse_row_fn(") == 1, stem
    assert "-np.inf" in fns["lse_row_fn"] and "LOG2E" in fns["lse_row_fn"]
    elems = {n: t for n, t in fns.items() if n.startswith("elem")}
    assert elems, stem
    for name, text in elems.items():
        body = text.split("\n", 1)[1]
        uses = re.findall(r"[^\n]*\blse\b[^\n]*", body)
        assert uses and all(re.fullmatch(r"    v\d+ = -lse", u) for u in uses), (stem, name, uses)


@pytest.mark.parametrize("stem", EXAMPLES)
@pytest.mark.parametrize("pipeline", ["fa2-bwd", "fa2-bwd-deterministic"])
def test_delta_row_where_ds_allows_it(stem, pipeline):
    """delta_row_fn where dS is P (dP - Delta) c alone: each element function reads `delta` only in
    fma(dP, c, delta); where a gradient or a derivative reads dP - Delta (NO_DELTA_ROW), no delta_row_fn and
    the difference in the element code."""
    for D in (64, 128):
        fns = _functions(_spec(stem, D, pipeline).device_source)
        elems = {n: t.split("\n", 1)[1] for n, t in fns.items() if n.startswith("elem")}
        if stem in NO_DELTA_ROW:
            assert "delta_row_fn" not in fns, NO_DELTA_ROW[stem]
            assert any("(dp - delta)" in t for t in elems.values())
            continue
        row = re.fullmatch(r"    return -\(delta \* np\.float32\(([0-9.e-]+)\)\)\n*", fns["delta_row_fn"].split("\n", 1)[1])
        assert row, fns["delta_row_fn"]
        c = re.escape(row.group(1))  # the scale (1 / sqrt(D), or the example's own), the same in every function
        for name, body in elems.items():
            uses = re.findall(r"[^\n]*\bdelta\b[^\n]*", body)
            assert len(uses) == 1 and re.fullmatch(rf"    v\d+ = cuda\.fma\(dp, np\.float32\({c}\), delta\)",
                                                   uses[0]), (stem, D, name, uses)


def test_the_knobs_off_keep_the_element_form():
    """extra lse_per_row / delta_per_row False: no lse_row_fn / delta_row_fn, the guard and the difference back in the
    element code, and the kernels read the LSE and Delta as they are (what probe_bwd's `norowlse` and `norowdelta`
    time against the default); each knob alone."""
    spec = _spec("causal", lse_per_row=False, delta_per_row=False)
    assert "lse_row_fn" not in spec.device_source and "delta_row_fn" not in spec.device_source
    assert "(lse == np.float32(-np.inf))" in _functions(spec.device_source)["elem_partial"]
    assert "(dp - delta)" in _functions(spec.device_source)["elem_partial"]
    src = emit_fa3_bwd.emit_fa3_backward(_spec("causal", lse_per_row=False, delta_per_row=False, bwd_schedule="wgmma"))
    assert "lse_row_fn" not in src and "lse[qh + qq]" in src
    assert "delta_row_fn" not in src and "delta[qh + qq]" in src
    only_delta = _spec("causal", lse_per_row=False)
    assert "lse_row_fn" not in only_delta.device_source and "delta_row_fn" in only_delta.device_source


def _rows(ns: dict, lse, delta):
    """(lse, delta) as the element functions of `ns` take them."""
    return (ns["lse_row_fn"](lse) if "lse_row_fn" in ns else lse,
            ns["delta_row_fn"](delta) if "delta_row_fn" in ns else delta)


def _call(fn, s, dp, lse, delta, q, kv, interior, M, N):
    """An element function called with its own dims' values (dim_M, dim_N; the others' names say which)."""
    code = fn.__code__
    dims = {"dim_M": M, "dim_N": N}
    with np.errstate(over="ignore", invalid="ignore"):  # ex2 of large arguments, -inf + -inf: as the GPU has them
        return fn(s, dp, lse, delta, 0, 0, 0, q, kv, interior,
                  *(dims[n] for n in code.co_varnames[10:code.co_argcount]))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("stem", NO_CAPTURES)
def test_the_row_values_give_the_element_forms_numbers(stem, D):
    """elem(s, dp, lse_row_fn(lse), delta_row_fn(delta), ...) against the element form's elem(s, dp, lse, delta,
    ...) over random elements: fully masked rows (LSE -inf), large and tiny LSEs, elements on and off the bounds
    and the mask. Bit for bit at D = 64 (c = 1/8: dP c and Delta c exact); at D = 128 within an f32 rounding or
    two of the element form (P (dP - Delta) c rounds three times, P fma(dP, c, -Delta c) three times too, but with Delta c rounded before
    the difference)."""
    new, old = (_run(_spec(stem, D, lse_per_row=r, delta_per_row=r).device_source) for r in (True, False))
    rng = np.random.default_rng(7)
    branches = [n for n in old if n.startswith("elem")]
    assert branches and all(n in new for n in branches)
    for _ in range(200):
        s, dp, delta = (np.float32(x) for x in rng.normal(0, 6, 3))
        lse = [np.float32(-np.inf), np.float32(rng.normal(0, 8)), np.float32(1e30), np.float32(-3e-8)][
            int(rng.integers(0, 4))]
        q, kv = (int(x) for x in rng.integers(0, 80, 2))
        interior = bool(rng.random() < 0.5)
        for n in branches:
            want = np.array(_call(old[n], s, dp, lse, delta, q, kv, interior, 64, 70), np.float32)
            got = np.array(_call(new[n], s, dp, *_rows(new, lse, delta), q, kv, interior, 64, 70), np.float32)
            if D == 64 and stem not in ROUNDED:
                np.testing.assert_array_equal(got, want, err_msg=n)
            else:  # P bit for bit; dS to a few f32 roundings of its terms (dP c and Delta c, before they cancel)
                np.testing.assert_array_equal(got[0], want[0], err_msg=n)
                bound = 8 * 2.0 ** -24 * abs(float(want[0])) * (abs(float(dp)) + abs(float(delta))) * 0.125
                assert abs(float(got[1]) - float(want[1])) <= bound + 1e-38, (n, got, want, bound)


@given(st.sampled_from(["plain", "causal", "softcap"]), st.floats(-80, 80, width=32), st.floats(-80, 80, width=32),
       st.one_of(st.just(float("-inf")), st.floats(-1e6, 1e6, width=32)), st.floats(-80, 80, width=32),
       st.integers(0, 140), st.integers(0, 140), st.booleans())
@settings(max_examples=150, deadline=None)
@example("plain", 0.0, 0.0, -2.0, 1.401298464324817e-45, 0, 0, False)  # -Delta c underflows to 0 (found by hypothesis)
@example("plain", 50.0, 1.1754943508222875e-38, float("-inf"), 1.401298464324817e-45, 0, 0, False)  # dP c subnormal
@example("softcap", 0.0, 0.0, -84.0, 4.0, 0, 0, False)  # the element form's * cap overflows first
def test_the_row_values_anywhere(stem, s, dp, lse, delta, q, kv, interior):
    new, old = (_run(_spec(stem, lse_per_row=r, delta_per_row=r).device_source) for r in (True, False))
    s, dp, lse, delta = np.float32(s), np.float32(dp), np.float32(lse), np.float32(delta)
    for n in [n for n in old if n.startswith("elem")]:  # a list: a warning adds to the functions' globals
        want = np.array(_call(old[n], s, dp, lse, delta, q, kv, interior, 130, 100), np.float32)
        got = np.array(_call(new[n], s, dp, *_rows(new, lse, delta), q, kv, interior, 130, 100), np.float32)
        if np.array_equal(got, want, equal_nan=True):
            continue
        np.testing.assert_array_equal(got[0], want[0], err_msg=n)  # P: bit for bit always
        if not np.isfinite(want[0]):  # P overflowed (an LSE far under the row's scores, which no forward gives):
            continue  # inf times a difference that one form rounds to 0 and the other does not
        if stem in ROUNDED and not np.isfinite(want[1]) and np.isfinite(want[0]):
            assert abs(float(got[1])) > 1e30 or got[1] == want[1], (n, got, want)  # the element form's * cap overflowed
            continue
        p, g, w = abs(float(want[0])), float(got[1]), float(want[1])
        # fma(dP, c, -Delta c) rounds once to f32, where dP c or Delta c below f32's normal range (2^-126) lose
        # their low bits first (each by at most half the least subnormal, 2^-150), which P then multiplies
        terms = (abs(float(dp)) * 0.125, abs(float(delta)) * 0.125, abs(float(dp) - float(delta)) * 0.125)
        under = p * 2.0 ** -148 + 2.0 ** -149 if min(terms) < 2.0 ** -126 else 0.0
        if abs(w) < 2.0 ** -125:  # dS itself subnormal (the element form's P (dP - Delta) before its c, too)
            under += 2.0 ** -146
        if stem in ROUNDED:  # the cap folded into c: a few f32 roundings of the terms before they cancel
            bound = 8 * 2.0 ** -24 * p * (abs(float(dp)) + abs(float(delta))) * 0.125
        else:
            bound = 2 * 2.0 ** -24 * abs(w) if under else 0.0  # bit for bit unless a term underflowed
        assert abs(g - w) <= bound + under, (n, got, want, bound, under)


def _kernel_sources():
    """(what, its device source, kernel source) of every backward kernel family that reads the LSE and Delta."""
    wg = {"bwd_schedule": "wgmma"}
    for what, spec, emit in [
            ("wgmma", _spec("causal", **wg), emit_fa3_bwd.emit_fa3_backward),
            ("wgmma D 128, no delta_row_fn", _spec("alibi", 128, **wg), emit_fa3_bwd.emit_fa3_backward),
            ("wgmma without loader warps", _spec("causal", **wg, ws_loads=False, dq_ws=False),
             emit_fa3_bwd.emit_fa3_backward),
            ("wgmma persistent", _spec("document", **wg, bwd_persistent=132), emit_fa3_bwd.emit_fa3_backward),
            ("wgmma p_under_dp", _spec("causal", **wg, p_under_dp=True), emit_fa3_bwd.emit_fa3_backward),
            ("mma.sync", _spec("causal", bwd_schedule="mma"), emit_fa2_bwd.emit_fa2_backward),
            ("deterministic main", _spec("causal", pipeline="fa2-bwd-deterministic", bwd_schedule="mma"),
             emit_fa2_bwd.emit_fa2_backward),
            ("deterministic dQ", _spec("causal", pipeline="fa2-bwd-deterministic", bwd_schedule="mma"),
             emit_fa2_bwd.emit_dq_kernel),
            ("SIMT main", _spec("causal", pipeline="fa2-bwd-deterministic", path="simt", dtype="f32"),
             emit_fa2_bwd.emit_fa2_backward),
            ("SIMT dQ", _spec("causal", pipeline="fa2-bwd-deterministic", path="simt", dtype="f32"),
             emit_fa2_bwd.emit_dq_kernel)]:
        yield what, spec.device_source, emit(spec)


def test_every_kernel_reads_the_rows_through_the_row_functions():
    """No kernel passes a raw LSE or Delta to an element function that expects a row function's value: where the
    device source has the row function, every `lse[...]` (`delta[...]`) load in the kernel's source is its
    argument; where it has none (ALiBi's Delta), none is."""
    seen = 0
    for what, device, src in _kernel_sources():
        for stat in ("lse", "delta"):
            loads = re.findall(rf"(.{{0,14}})\b{stat}\[", src)
            assert loads, (what, stat)
            wrapped = [x.endswith(f"{stat}_row_fn(") for x in loads]
            assert all(wrapped) if f"def {stat}_row_fn(" in device else not any(wrapped), (what, stat, loads)
            seen += sum(wrapped)
    assert seen >= 15


# ------------------------------------------------------------------ hand-edited IR: each refusal falls back
def _lowered(stem: str):
    g = next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.ir.Func))
    return analyse_backward(fl.compile(g, "numba-cuda").lowered_backward)


def _const_before(op, value: float):
    """A new f32 scalar constant, inserted just before `op` in its block."""
    from falower.ir.core import Op
    from falower.ir.types import TensorType

    c = Op("const", [], [TensorType("f32", ())], {"value": value})
    blk = op.parent
    blk.ops.insert(blk.ops.index(op), c)
    c.parent = blk
    return c.results[0]


def _source(low, D: int = 64):
    return build_backward_spec(low, {"D": D}, "f16", "mma", None, {"bwd_schedule": "wgmma"}).device_source


def _edits():
    """(what, the lowered backward edited so that a row function must not be used, which one must go)."""
    low = _lowered("alibi")  # a gradient contribution that reads the raw LSE: neither row function then
    for br in low.branches:
        for sc in br.scatters if hasattr(br, "scatters") else ():
            sc.operands[1] = br.lse
    yield "a scatter reads the LSE", low, ("lse_row_fn", "delta_row_fn")
    low = _lowered("causal")  # the mask's select with a non-zero constant arm: dS is not (P y) c there
    br = next(b for b in low.branches if b.name == "partial")
    sel = br.ds.owner.operands[0].owner
    assert sel.name == "where"
    sel.operands[2] = _const_before(sel, 1.0)
    yield "a select's other arm is 1", low, ("delta_row_fn",)
    low = _lowered("plain")  # c / chain: the chain as the divisor
    ds = low.branches[0].ds.owner
    assert ds.name == "div"
    ds.operands[:] = [ds.operands[1], ds.operands[0]]
    yield "the chain is the divisor", low, ("delta_row_fn",)
    low = _lowered("causal")  # the branches' scales differ: one -Delta c cannot serve both
    br = next(b for b in low.branches if b.name == "full")
    ds = br.ds.owner
    ds.operands[1] = _const_before(ds, 3.0)
    yield "the branches' scales differ", low, ("delta_row_fn",)
    low = _lowered("causal")  # the select's condition reads the chain
    br = next(b for b in low.branches if b.name == "partial")
    sel = br.ds.owner.operands[0].owner
    from falower.ir.core import Op
    from falower.ir.types import TensorType

    chained = sel.operands[1]
    cond = Op("gt", [chained, _const_before(sel, 0.0)], [TensorType("bool", chained.type.shape)])
    sel.parent.ops.insert(sel.parent.ops.index(sel), cond)
    cond.parent = sel.parent
    sel.operands[0] = cond.results[0]
    yield "the select's condition reads the chain", low, ("delta_row_fn",)


@pytest.mark.parametrize("case", range(5))
def test_an_edited_graph_falls_back(case):
    """Graphs autodiff does not make, edited by hand: each refusal of _row_lse / _scaled_difference / _elem_fns
    leaves its row function out (the element code computing from the LSE or Delta itself), and the kernel then
    reads the raw statistic; the element functions still run as Python."""
    what, low, gone = list(_edits())[case]
    src = _source(low)
    for fn in gone:
        assert f"def {fn}(" not in src, what
    assert "lse_unrowed" not in src and "delta_unrowed" not in src, what
    if "delta_row_fn" in gone:
        assert any(re.search(r"\(dp - delta\)", t) for n, t in _functions(src).items() if n.startswith("elem")), what
    _run(src)  # defines every function

