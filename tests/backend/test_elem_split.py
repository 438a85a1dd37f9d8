"""elem_split.split_elem: the backward's per-element function split into a P part (the score only) and a dS part (P,
dP, Delta), which p_under_dp's kernel runs on either side of dP^T's wait. The two parts, run one after the other as
plain Python on the emitted text, give the fused function's (p, ds) bit for bit over random elements, masked rows
and tiles on the bounds included; the split is refused where dS reads the score other than through P (the
softcap) and where the function has a captured table's gradient (ALiBi); the emitter waits for S^T alone, runs the
P part, then waits for dP^T."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")
import falower as fl  # noqa: E402
from falower.backends.numba_cuda import emit_fa3_bwd  # noqa: E402
from falower.backends.numba_cuda.elem_split import split_elem  # noqa: E402
from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
SPLIT = ["plain", "causal", "prefix_lm", "sliding_window", "gqa"]
_SPECS: dict = {}


def _spec(stem: str, D: int = 64, **extra):
    key = (stem, D, tuple(sorted(extra.items())))
    if key not in _SPECS:
        g = next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values()
                 if isinstance(v, fl.ir.Func))
        c = fl.compile(g, "numba-cuda")
        _SPECS[key] = build_backward_spec(analyse_backward(c.lowered_backward), {"D": D}, "f16", "mma", None,
                                          {"bwd_schedule": "wgmma", **extra})
    return _SPECS[key]


class _Cuda:
    """cuda.fma as the emitted text calls it (the exponential's folded argument): the f32 product is exact in f64."""

    @staticmethod
    def fma(a, b, c):
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _run(text: str) -> dict:
    """The device functions' text run as Python (ex2 as 2 ** x in f32)."""
    ns = {"np": np, "device_function": lambda f: f, "LOG2E": np.float32(1.4426950408889634),
          "ex2": lambda x: np.float32(np.exp2(np.float32(x))), "cuda": _Cuda}
    exec(text, ns)  # noqa: S102 - our own emitted code
    return ns


@pytest.mark.parametrize("stem", SPLIT)
def test_the_parts_give_the_fused_values(stem):
    spec = _spec(stem)
    fused = _run(spec.device_source)
    for branch in spec.branches:
        split = split_elem(spec.device_source, branch)
        assert split is not None, (stem, branch)
        parts = _run(spec.device_source + "\n\n" + split)
        rng = np.random.default_rng(len(stem))
        for _ in range(300):
            s, dp, delta = (np.float32(x) for x in rng.normal(0, 4, 3))
            lse = np.float32(-np.inf) if rng.random() < 0.1 else np.float32(rng.normal(0, 4))  # a fully masked row
            q, kv = (int(x) for x in rng.integers(0, 80, 2))
            interior = bool(rng.random() < 0.5)
            rest = (0, 0, 0, q, kv, interior, 64, 70)  # b, h, hk, q, kv, interior, M, N
            want = fused[f"elem_{branch}"](s, dp, lse, delta, *rest)
            p = parts[f"elemp_{branch}"](s, lse, *rest)
            ds = parts[f"elemds_{branch}"](p, dp, delta, lse, *rest)
            np.testing.assert_array_equal(np.array([p, ds], np.float32), np.array(want, np.float32))


@given(st.sampled_from(SPLIT), st.floats(-50, 50, width=32), st.floats(-50, 50, width=32),
       st.floats(-50, 50, width=32), st.integers(0, 200), st.integers(0, 200), st.booleans())
@settings(max_examples=100, deadline=None)
def test_the_parts_give_the_fused_values_anywhere(stem, s, dp, delta, q, kv, interior):
    spec = _spec(stem)
    ns = _run(spec.device_source + "".join("\n\n" + split_elem(spec.device_source, b) for b in spec.branches))
    for branch in spec.branches:
        rest = (0, 0, 0, q, kv, interior, 130, 100)
        want = ns[f"elem_{branch}"](*(np.float32(x) for x in (s, dp, 1.5, delta)), *rest)
        p = ns[f"elemp_{branch}"](np.float32(s), np.float32(1.5), *rest)
        got = (p, ns[f"elemds_{branch}"](p, np.float32(dp), np.float32(delta), np.float32(1.5), *rest))
        np.testing.assert_array_equal(np.array(got, np.float32), np.array(want, np.float32))


@pytest.mark.parametrize("stem, why", [("softcap", "dS reads the score"), ("alibi", "a captured table's gradient")])
def test_refused(stem, why):
    spec = _spec(stem)
    assert all(split_elem(spec.device_source, b) is None for b in spec.branches), why
    asked = _spec(stem, p_under_dp=True)
    assert not emit_fa3_bwd.p_under_dp(asked)
    assert "WAIT_S1" not in emit_fa3_bwd.emit_fa3_backward(asked)  # the fused function, both waits first


_HAND = """@device_function
def elem_x(s, dp, lse, delta, b, h, hk, q, kv, interior, dim_M):
    v1 = (q >= kv)
    v2 = (s * np.float32(0.5))
    v3 = (v2 if v1 else np.float32(-np.inf))
    v4 = ex2(v3 - lse)
    v10 = (dp - delta)
    v11 = (v4 * v10)
    v12 = (v11 if v1 else np.float32(0.0))
    v13 = ({extra})
    return v4,  v13
"""


def test_a_mask_value_read_by_ds_is_recomputed():
    """dS re-masks by v1 (q >= kv, no score among its inputs): accepted, v1 recomputed in the dS part, and the
    parts match the fused function; v10 is not taken for v1 (names as whole words); a return with extra spaces."""
    text = _HAND.format(extra="v12 * np.float32(0.5)")
    split = split_elem(text, "x")
    assert split is not None
    ds_part = split[split.index("def elemds_x"):]
    assert "    v1 = (q >= kv)" in ds_part and "v2 =" not in ds_part and "v4" not in ds_part.split("return")[0]
    ns = _run(text + "\n\n" + split)
    for q, kv in ((3, 1), (1, 3)):
        rest = (0, 0, 0, q, kv, True, 9)
        want = ns["elem_x"](np.float32(1.25), np.float32(0.5), np.float32(0.25), np.float32(0.125), *rest)
        p = ns["elemp_x"](np.float32(1.25), np.float32(0.25), *rest)
        got = (p, ns["elemds_x"](p, np.float32(0.5), np.float32(0.125), np.float32(0.25), *rest))
        np.testing.assert_array_equal(np.array(got, np.float32), np.array(want, np.float32))


@pytest.mark.parametrize("extra", ["v12 * v2", "v12 * s", "v12 * v3"])
def test_a_score_value_read_by_ds_is_refused(extra):
    """dS reading the score other than through P (the scaled score v2, s itself, the masked score v3): refused."""
    assert split_elem(_HAND.format(extra=extra), "x") is None


def test_split_refuses_text_of_another_form():
    spec = _spec("plain")
    assert split_elem(spec.device_source, "missing") is None
    at = spec.device_source.index(f"def elem_{spec.branches[0]}(")  # its own return, not lse_row_fn's
    odd = spec.device_source[:at] + spec.device_source[at:].replace("    return ", "    x = 1\n    return ", 1)
    assert split_elem(odd, spec.branches[0]) is None


def test_the_kernel_waits_for_s_alone_then_dp(tmp_path, monkeypatch):
    """p_under_dp: S^T's group committed by itself, wait_group 1 before the P part, dP^T's wait between the parts
    (in both branches' order for causal); a non-bool is refused (its PTX: test_wgmma_bwd_simulator's
    test_the_knobs_ptx)."""
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))

    with pytest.raises(ValueError, match="p_under_dp must be True or False"):
        emit_fa3_bwd.validate_spec(_spec("causal", 128, p_under_dp="yes"))
    spec = _spec("causal", 128, p_under_dp=True)
    assert emit_fa3_bwd.p_under_dp(spec)
    src = emit_fa3_bwd.emit_fa3_backward(spec)
    loop = src[src.index("WG_S(sacc, 0, desc_at(HI_KM, w_k + 0)"):]
    order = ["wgmma_commit()  # S^T's group", "WG_S(pacc", "wgmma_commit()", "WAIT_S1(sacc, 0)", "elemsp_full(",
             "elemsp_partial(", "WAIT_S(pacc, 0)", "elemsd_full(", "elemsd_partial(", "FENCE_D(dvacc"]
    at = [loop.index(order[0])]
    for x in order[1:]:  # each after the one before
        at.append(loop.index(x, at[-1] + 1))
    assert loop.index("WAIT_S1(sacc, 0)") > loop.index("WG_S(pacc, 0, desc_at(HI_KM, w_v + 1030)")
    assert "elems_full(" not in loop and "WAIT_S(sacc, 0)" not in loop
    assert "WAIT_S(sacc, 0)" in emit_fa3_bwd.emit_fa3_backward(_spec("causal", 128))


@pytest.mark.parametrize("D", [64, 128])
def test_dv_under_dp_issues_dv_from_p_before_dps_wait(D):
    """dv_under_dp (on p_under_dp's split, which it asks for): after the P part, dV's k steps from P^T's packed
    registers and their own group, then `wait_group 1` for dP^T with dV in flight, the dS part, and dS's packing
    with no second dV GEMM; at D = 128 (dk_after_dq's default: dK's GEMM after dQ's) the dS^T stores commit no empty
    group (ptxas fills one with a dummy HGMMA). Where the split does not take (the softcap), the fused order stays;
    a non-bool and sdp_ahead beside it are refused (the simulator's -dve cases: its gradients bitwise the fused
    order's)."""
    spec = _spec("causal", D, dv_under_dp=True)
    assert emit_fa3_bwd.p_under_dp(spec) and emit_fa3_bwd.dv_under_dp(spec)
    src = emit_fa3_bwd.emit_fa3_backward(spec)
    assert emit_fa3_bwd.knobs_in(src)["dv_under_dp"] and emit_fa3_bwd.knobs_in(src)["p_under_dp"]
    loop = src[src.index("WAIT_S1(sacc, 0)"):]
    order = ["elemsp_full(", "elemsp_partial(", "FENCE_D(dvacc, 0)", "pa0, pa1, pa2, pa3 = pack_p(sacc, ofs_0)",
             "WG_D(dvacc, 0, pa0", "wgmma_commit()  # dV's group", "WAIT_P1(pacc, 0)", "elemsd_full(",
             "elemsd_partial(", "= pack_d(pacc, ofs_0)"]
    at = [loop.index(order[0])]
    for x in order[1:]:  # each after the one before
        at.append(loop.index(x, at[-1] + 1))
    assert loop.count("WG_D(dvacc") == 64 // 16 and "pack_pd(" not in loop and "WAIT_S(pacc, 0)" not in loop
    tail = loop[loop.index("WAIT_P1(pacc, 0)"):loop.index("cp_async_wait0()")]
    assert ("wgmma_commit()" in tail) == (D == 64) and ("WG_D(dkacc" in tail) == (D == 64)
    fused = emit_fa3_bwd.emit_fa3_backward(_spec("softcap", D, dv_under_dp=True))
    assert "WAIT_P1" not in fused and not emit_fa3_bwd.knobs_in(fused)["dv_under_dp"]
    with pytest.raises(ValueError, match="dv_under_dp must be True or False"):
        emit_fa3_bwd.validate_spec(_spec("causal", D, dv_under_dp="yes"))
    with pytest.raises(ValueError, match="sdp_ahead .* not with dv_under_dp"):
        emit_fa3_bwd.validate_spec(_spec("causal", D, dv_under_dp=True, sdp_ahead="top", dk_after_dq=False))
