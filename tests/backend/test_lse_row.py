"""lse_row_fn: the backward's guarded LSE times log2(e) (`0 if lse == -inf else lse log2 e`), a value of the q row
alone, computed once a row where a kernel reads the LSE instead of in every element (from_ir_bwd._lse_row_fn).

The element functions then take its value for `lse`. Three things must hold, or a kernel is silently wrong:
  * elem(s, dp, lse_row_fn(lse), ...) is the per-element form's elem(s, dp, lse, ...) bit for bit, fully masked
    rows (LSE -inf) included;
  * no element function still computes from the LSE itself;
  * every read of the LSE in every backward kernel (wgmma with and without its loader warps, persistent, mma.sync,
    the deterministic dQ kernel) goes through lse_row_fn.
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")
import falower as fl  # noqa: E402
from falower.backends.numba_cuda import emit_fa2_bwd, emit_fa3_bwd  # noqa: E402
from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
NO_CAPTURES = ["plain", "causal", "prefix_lm", "sliding_window", "gqa", "softcap", "naive_tensor_code"]
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


def test_row_lse_false_keeps_the_element_form():
    """extra row_lse False: no lse_row_fn, the guard back in the element code, and the kernels read the LSE as it
    is (what probe_bwd's `norowlse` times against the default)."""
    spec = _spec("causal", row_lse=False)
    assert "lse_row_fn" not in spec.device_source
    assert "(lse == np.float32(-np.inf))" in _functions(spec.device_source)["elem_partial"]
    src = emit_fa3_bwd.emit_fa3_backward(_spec("causal", row_lse=False, bwd_schedule="wgmma"))
    assert "lse_row_fn" not in src and "lse[qh + qq]" in src


def _call(fn, s, dp, lse, delta, q, kv, interior, M, N):
    """An element function called with its own dims' values (dim_M, dim_N; the others' names say which)."""
    code = fn.__code__
    dims = {"dim_M": M, "dim_N": N}
    return fn(s, dp, lse, delta, 0, 0, 0, q, kv, interior,
              *(dims[n] for n in code.co_varnames[10:code.co_argcount]))


@pytest.mark.parametrize("stem", NO_CAPTURES)
def test_the_row_value_gives_the_element_forms_numbers(stem):
    """elem(s, dp, lse_row_fn(lse), ...) against row_lse False's elem(s, dp, lse, ...), bit for bit, over random
    elements: fully masked rows (LSE -inf), large and tiny LSEs, elements on and off the bounds and the mask."""
    new, old = (_run(_spec(stem, row_lse=r).device_source) for r in (True, False))
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
            want = _call(old[n], s, dp, lse, delta, q, kv, interior, 64, 70)
            got = _call(new[n], s, dp, new["lse_row_fn"](lse), delta, q, kv, interior, 64, 70)
            np.testing.assert_array_equal(np.array(got, np.float32), np.array(want, np.float32), err_msg=n)


@given(st.sampled_from(["plain", "causal", "softcap"]), st.floats(-80, 80, width=32), st.floats(-80, 80, width=32),
       st.one_of(st.just(float("-inf")), st.floats(-1e6, 1e6, width=32)), st.integers(0, 140),
       st.integers(0, 140), st.booleans())
@settings(max_examples=150, deadline=None)
def test_the_row_value_anywhere(stem, s, dp, lse, q, kv, interior):
    new, old = (_run(_spec(stem, row_lse=r).device_source) for r in (True, False))
    s, dp, lse = np.float32(s), np.float32(dp), np.float32(lse)
    for n in (n for n in old if n.startswith("elem")):
        want = _call(old[n], s, dp, lse, np.float32(0.5), q, kv, interior, 130, 100)
        got = _call(new[n], s, dp, new["lse_row_fn"](lse), np.float32(0.5), q, kv, interior, 130, 100)
        np.testing.assert_array_equal(np.array(got, np.float32), np.array(want, np.float32), err_msg=n)


def _kernel_sources():
    """(what, source) of every backward kernel family that reads the LSE."""
    wg = {"bwd_schedule": "wgmma"}
    yield "wgmma", emit_fa3_bwd.emit_fa3_backward(_spec("causal", **wg))
    yield "wgmma D 128", emit_fa3_bwd.emit_fa3_backward(_spec("alibi", 128, **wg))
    yield "wgmma without loader warps", emit_fa3_bwd.emit_fa3_backward(
        _spec("causal", **wg, ws_loads=False, dq_ws=False))
    yield "wgmma persistent", emit_fa3_bwd.emit_fa3_backward(_spec("document", **wg, bwd_persistent=132))
    yield "wgmma p_under_dp", emit_fa3_bwd.emit_fa3_backward(_spec("causal", **wg, p_under_dp=True))
    yield "mma.sync", emit_fa2_bwd.emit_fa2_backward(_spec("causal", bwd_schedule="mma"))
    det = _spec("causal", pipeline="fa2-bwd-deterministic", bwd_schedule="mma")
    yield "deterministic main", emit_fa2_bwd.emit_fa2_backward(det)
    yield "deterministic dQ", emit_fa2_bwd.emit_dq_kernel(det)
    simt = _spec("causal", pipeline="fa2-bwd-deterministic", path="simt", dtype="f32")
    yield "SIMT main", emit_fa2_bwd.emit_fa2_backward(simt)
    yield "SIMT dQ", emit_fa2_bwd.emit_dq_kernel(simt)


def test_every_kernel_reads_the_lse_through_the_row_function():
    """No kernel passes a raw LSE to an element function that expects lse_row_fn's value: every `lse[...]` load
    in every backward kernel's source is lse_row_fn's argument."""
    seen = 0
    for what, src in _kernel_sources():
        loads = re.findall(r"(.{0,12})\blse\[", src)
        assert loads, what
        assert all(x.endswith("lse_row_fn(") for x in loads), (what, loads)
        seen += len(loads)
    assert seen >= 8
