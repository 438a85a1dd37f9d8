"""tanh_small_f32 (intrinsics.py): tanh(y / (2 log2 e)) for |y| <= TANH_SMALL_Y by an odd polynomial on the FMA
pipe, and where the kernels take it (from_ir's SCORE_SMALL_S and score_raw_small_fn, emit_fa2.small_scores): a tile
whose scores all lie in range, checked by a max of |s| and a ballot. Its float32 steps (the simulator's version)
against float64 tanh, the PTX's constants, which scores qualify and what the kernels emit. The numbers through the
kernels: test_tanh_small_simulator.py and, on the GPU, test_examples_gpu.py's softcap."""

from __future__ import annotations

import re

import numpy as np
import pytest

import falower as fl
from falower.backends.numba_cuda import emit_fa3, emit_fa3_ws
from falower.backends.numba_cuda import intrinsics as I
from falower.backends.numba_cuda.emit_fa2 import emit_fa2_forward, small_scores, tiny_scores
from falower.backends.numba_cuda.from_ir import TWO_LOG2E, analyse, build_spec

rel = fl.capture("rel", "f32", ["H", "L"])


def steps(y):
    return np.array([I.tanh_small_steps(v) for v in np.asarray(y, np.float32)], dtype=np.float64)


def test_absolute_error_over_its_range():
    """|steps - tanh| <= 2**-22.5 over |y| <= TANH_SMALL_Y, below tanh_ex2's 2**-22, tiny |y| relatively exact."""
    y = np.concatenate([np.linspace(-I.TANH_SMALL_Y, I.TANH_SMALL_Y, 60001), np.logspace(-30, 0, 1001)])
    want = np.tanh(y.astype(np.float32).astype(np.float64) / TWO_LOG2E)
    got = steps(y)
    assert np.max(np.abs(got - want)) <= 2.0 ** -22.5
    tiny = np.logspace(-30, -3, 200)
    assert np.allclose(steps(tiny), np.tanh(tiny.astype(np.float32).astype(np.float64) / TWO_LOG2E), rtol=1e-6,
                       atol=0)
    assert I.tanh_small_steps(np.float32(0.0)) == 0.0 and np.isnan(I.tanh_small_steps(np.float32(np.nan)))


def test_the_range_is_the_same_in_from_ir():
    """from_ir keeps its own copy of the range (a warm process builds specs without importing intrinsics)."""
    from falower.backends.numba_cuda import from_ir

    assert from_ir.TANH_SMALL_Y == I.TANH_SMALL_Y


def test_ptx_is_the_steps():
    """The PTX's constants are TANH_SMALL_POLY's, highest first, and its operations one multiply, six FMAs, one
    multiply: nothing on MUFU."""
    consts = [float(np.array([int(h, 16)], dtype=np.uint32).view(np.float32)[0])
              for h in re.findall(r"0f([0-9A-F]{8})", I.TANH_SMALL_PTX)]
    assert consts == [float(np.float32(c)) for c in I.TANH_SMALL_POLY[::-1]]
    assert re.findall(r"\b(mul|fma|ex2|rcp|tanh)\.", I.TANH_SMALL_PTX) == ["mul"] + ["fma"] * 6 + ["mul"]


def test_tiny_absolute_error_and_ptx():
    """tanh_tiny's f32 steps within 2**-23.2 of tanh over |y| <= TANH_TINY_Y (a quarter of tanh_small's range),
    tiny |y| relatively exact, NaN kept; its PTX one multiply, two FMAs, one multiply with TANH_TINY_POLY's
    constants; from_ir's copy of the range the same."""
    from falower.backends.numba_cuda import from_ir

    assert I.TANH_TINY_Y == I.TANH_SMALL_Y / 4 and from_ir.TANH_TINY_Y == I.TANH_TINY_Y
    y = np.concatenate([np.linspace(-I.TANH_TINY_Y, I.TANH_TINY_Y, 60001), np.logspace(-30, np.log10(0.7), 1001)])
    want = np.tanh(y.astype(np.float32).astype(np.float64) / TWO_LOG2E)
    got = np.array([I.tanh_tiny_steps(v) for v in np.asarray(y, np.float32)], dtype=np.float64)
    assert np.max(np.abs(got - want)) <= 2.0 ** -23.2
    tiny = np.logspace(-30, -3, 200)
    assert np.allclose([I.tanh_tiny_steps(v) for v in tiny.astype(np.float32)],
                       np.tanh(tiny.astype(np.float32).astype(np.float64) / TWO_LOG2E), rtol=1e-6, atol=0)
    assert np.isnan(I.tanh_tiny_steps(np.float32(np.nan)))
    consts = [float(np.array([int(h, 16)], dtype=np.uint32).view(np.float32)[0])
              for h in re.findall(r"0f([0-9A-F]{8})", I.TANH_TINY_PTX)]
    assert consts == [float(np.float32(c)) for c in I.TANH_TINY_POLY[::-1]]
    assert re.findall(r"\b(mul|fma|ex2|rcp|tanh)\.", I.TANH_TINY_PTX) == ["mul", "fma", "fma", "mul"]


@pytest.mark.parametrize("cap, D", [(30.0, 128), (50.0, 64), (30.0, 256)])
def test_tiny_folded_into_its_factor(cap, D):
    """The softcap's tanh_tiny takes its argument's factor K in its coefficients (tanh_polys.folded: s R'(s^2),
    R'_i = K^(2i+1) R_i): one multiply fewer. Its f32 steps within 2**-23 of tanh(s K / (2 log2 e)) over |s| <=
    SCORE_TINY_S; a factor whose powers would leave f32's range keeps tanh_tiny_f32 (s * K)."""
    from falower.backends.numba_cuda.tanh_polys import TANH_TINY_POLY, folded

    spec = _spec(lambda s, h, q, kv: cap * fl.tanh(s / cap), D=D)
    src = spec.device_source
    k = float(re.search(r"# tanh_tiny_f32\(s \* ([0-9.e+-]+)\)", src).group(1))
    fold = src[src.index("def tanh_tiny_folded_fn"):src.index("SCORE_TINY_S")]
    c = [np.float32(float(v)) for v in re.findall(r"np\.float32\(([0-9.e+-]+)\)", fold)]
    assert len(c) == 3 and "tanh_tiny_folded_fn(s)" in src[src.index("def score_raw_tiny_fn"):]
    c2, c1, c0 = c
    bound = tiny_scores(_spec(lambda s, h, q, kv: cap * fl.tanh(s / cap), D=D))
    x = np.linspace(-bound, bound, 100001).astype(np.float32)
    u = (x * x).astype(np.float32)
    q = (u.astype(np.float64) * c2 + c1).astype(np.float32)
    q = (q.astype(np.float64) * u + c0).astype(np.float32)
    got = (x * q).astype(np.float32).astype(np.float64)
    assert np.max(np.abs(got - np.tanh(x.astype(np.float64) * k / TWO_LOG2E))) <= 2.0 ** -23
    assert folded(TANH_TINY_POLY, 1e-30) is None and folded(TANH_TINY_POLY, 1e30) is None


def _spec(mod, extra=None, D=64):
    g = fl.attention(score_mod=lambda s, b, h, q, kv: mod(s, h, q, kv), name="m")
    return build_spec(analyse(fl.lower(g, "fa2-fwd")), {"D": D}, "f16", "mma", None, extra)


SCORES = {  # name: (score_mod, small path taken)
    "softcap": (lambda s, h, q, kv: 30.0 * fl.tanh(s / 30.0), True),
    "softcap 50": (lambda s, h, q, kv: 50.0 * fl.tanh(s / 50.0), True),
    "tanh of s": (lambda s, h, q, kv: fl.tanh(s), True),
    "tanh of s plus one": (lambda s, h, q, kv: fl.tanh(s + 1.0), False),  # its argument is not s times a constant
    "tanh of q": (lambda s, h, q, kv: s + fl.tanh(q * 0.01), False),
    "hardware tanh": (lambda s, h, q, kv: 30.0 * fl.tanh(s / 30.0, approx=True), False),
    "softcap and a relative bias": (lambda s, h, q, kv: 30.0 * fl.tanh(s / 30.0) + rel[h, q - kv + 40], False),
    "plain": (lambda s, h, q, kv: s, False),
}


@pytest.mark.parametrize("name", sorted(SCORES))
def test_which_scores_take_the_polynomial(name):
    mod, taken = SCORES[name]
    spec = _spec(mod)
    assert (small_scores(spec) is not None) == taken, spec.device_source
    assert small_scores(_spec(mod, {"tanh_small": False})) is None
    assert (tiny_scores(spec) is not None) == taken and tiny_scores(_spec(mod, {"tanh_small": False})) is None
    assert tiny_scores(_spec(mod, {"tanh_tiny": False})) is None


@pytest.mark.parametrize("D", [64, 128])
def test_the_bound_keeps_every_argument_in_range(D):
    """SCORE_SMALL_S for the softcap is TANH_SMALL_Y over the argument's factor scale / 30 * 2 log2(e), a hair
    under, so that f32's s * K at |s| = SCORE_SMALL_S stays in range."""
    bound = small_scores(_spec(SCORES["softcap"][0], D=D))
    k = np.float32(float(np.float32(D ** -0.5 / 30.0)) * TWO_LOG2E)
    assert abs(np.float32(bound) * k) <= I.TANH_SMALL_Y
    assert bound == pytest.approx(I.TANH_SMALL_Y / float(k), rel=1e-5)
    tiny = tiny_scores(_spec(SCORES["softcap"][0], D=D))
    assert abs(np.float32(tiny) * k) <= I.TANH_TINY_Y and tiny == pytest.approx(I.TANH_TINY_Y / float(k), rel=1e-5)


@pytest.mark.parametrize("kernel", ["mma", "fa3", "ws"])
def test_the_kernels_branch_on_a_ballot(kernel):
    """Every unmasked score call sits under `if ballot(not (sbig <= SCORE_TINY_S)) == 0:` with score_row_tiny on
    the true side, `elif ballot(not (sbig <= SCORE_SMALL_S)) == 0:` with score_row_small, and score_row (tanh_ex2)
    on the false side, sbig the rows' max |s| (a NaN votes out of range); without tanh_tiny the same with the first
    branch gone; the masked path keeps tanh_ex2."""
    mod = SCORES["softcap"][0]
    src = {"mma": lambda x: emit_fa2_forward(_spec(mod, x, D=128)),
           "fa3": lambda x: emit_fa3.emit_fa3_forward(_spec(mod, {"schedule": "wgmma", "wg_rows": 128, **x})),
           "ws": lambda x: emit_fa3_ws.emit_fa3_ws_forward(_spec(mod, {"schedule": "wgmma-ws", "producer": "none",
                                                                        **x}, D=128))}[kernel]
    on = src({})
    lines = [ln.strip() for ln in on.splitlines()]
    checks = [i for i, ln in enumerate(lines) if ln.startswith("if ballot(not (sbig <= SCORE_TINY_S)) == 0:")]
    assert checks
    for i in checks:
        assert lines[i - 1].startswith("sbig = ") and "score_absmax(" in lines[i - 1]
        assert lines[i + 1].startswith("score_row_tiny(sc")
        j = next(k for k in range(i + 1, i + 6) if lines[k].startswith("elif "))
        assert lines[j].startswith("elif ballot(not (sbig <= SCORE_SMALL_S)) == 0:") and lines[j + 1].startswith(
            "score_row_small(sc")
        assert "else:" in lines[j + 1:j + 8] and any(ln.startswith("score_row(sc") for ln in lines[j + 1:j + 9])
    assert "tanh_tiny_folded_fn(s)" in on and "tanh_small_f32((s * " in on and "tanh_ex2_f32((s * " in on
    two = src({"tanh_tiny": False})
    lines = [ln.strip() for ln in two.splitlines()]
    checks = [i for i, ln in enumerate(lines) if ln.startswith("if ballot(not (sbig <= SCORE_SMALL_S)) == 0:")]
    assert checks and "score_row_tiny(sc" not in two and "SCORE_TINY_S)" not in two
    for i in checks:
        assert lines[i - 1].startswith("sbig = ") and lines[i + 1].startswith("score_row_small(sc")
        assert "else:" in lines[i + 1:i + 8] and any(ln.startswith("score_row(sc") for ln in lines[i + 1:i + 9])
    off = src({"tanh_small": False})
    assert "score_row_small(sc" not in off and "SCORE_SMALL_S)" not in off and "score_row_tiny(sc" not in off


def test_a_nan_votes_out_of_range():
    """A thread whose rows hold a NaN (row g) and large scores (row g + 8) must not send row g + 8 through a
    polynomial: its vote (not sbig <= bound) is out of range whichever row's max comes first. Run as Python on
    the ws kernel's emitted branch: the path taken is score_row, whose tanh of 1000 is 1, not the polynomial's."""
    import math
    import types

    spec = _spec(SCORES["softcap"][0], {"schedule": "wgmma-ws", "producer": "none"}, D=128)
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    taken = []
    ns = {"np": np, "math": math, "cuda": types.SimpleNamespace(fma=lambda a, b, c: a * b + c),
          "ballot": lambda p: int(bool(p)), "lget": lambda x, i: x[i], "lset": lambda x, i, v: x.__setitem__(i, v)}
    exec(spec.device_source, ns)
    start = src.index("def score_absmax(")
    exec(src[start:src.index("\n@", start)], ns)
    for name in ("score_row_tiny", "score_row_small", "score_row"):
        ns[name] = (lambda n: lambda *a: taken.append(n))(name)
    lines = [ln.strip() for ln in src.splitlines()]
    i = next(k for k, ln in enumerate(lines) if ln.startswith("if ballot(not (sbig <= SCORE_TINY_S))"))
    branch = "\n".join([lines[i - 1], lines[i], "    " + lines[i + 1], "    " + lines[i + 2]] +
                        [ln if ln.startswith(("elif", "else")) else "    " + ln for ln in lines[i + 3:i + 9]])
    n = spec.block_k // 2
    for first in (True, False):  # the NaN's row first or second in sbig's max
        sc = np.full(2 * n, 1000.0, np.float32)
        sc[np.arange(2 * n) % 4 < 2 if first else np.arange(2 * n) % 4 >= 2] = np.nan
        taken.clear()
        exec(branch, {**ns, "sc": sc, "ofs_0": 0, "ofs_2": 2, "b": 0, "h": 0, "q_lo": 0, "warp": 0, "g": 0, "kv0": 0,
                      "t2": 0, "N": 128, "b__1": 0, "h__1": 0, "q_lo__1": 0})
        assert taken and set(taken) == {"score_row"}, (first, taken, branch)


def test_score_row_small_is_score_row_in_range():
    """The ws kernel's score_row_small and score_row, run as Python on a thread's rows (the simulator's steps of
    both tanhs): within 2^-21 of each other for scores up to SCORE_SMALL_S, and score_absmax is the rows' max |s|."""
    import math
    import types

    spec = _spec(SCORES["softcap"][0], {"schedule": "wgmma-ws", "producer": "none"}, D=128)
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    ns = {"np": np, "math": math, "cuda": types.SimpleNamespace(fma=lambda a, b, c: a * b + c),
          "tanh_ex2_f32": I.tanh_ex2_steps, "tanh_small_f32": I.tanh_small_steps, "tanh_tiny_f32": I.tanh_tiny_steps,
          "lget": lambda x, i: x[i], "lset": lambda x, i, v: x.__setitem__(i, v)}
    exec(spec.device_source, ns)
    for name in ("score_row", "score_row_small", "score_row_tiny", "score_absmax"):
        start = src.index(f"def {name}(")
        exec(src[start:src.index("\n@", start)], ns)
    bound = small_scores(spec)
    rng = np.random.default_rng(0)
    n = spec.block_k // 2  # a thread's two rows: block_k / 8 n8 tiles of 2 x 2 elements
    assert tiny_scores(spec) == pytest.approx(bound / 4, rel=1e-6)
    for scale in (1.0, 0.3, 0.25, 1.0 / 64):
        x = (rng.uniform(-1, 1, n) * bound * scale).astype(np.float32)
        a, b = x.copy(), x.copy()
        ns["score_row"](a, 0, 0, 0, 5, 0, 128)
        ns["score_row_small"](b, 0, 0, 0, 5, 0, 128)
        assert np.max(np.abs(a.astype(np.float64) - b)) <= 2.0 ** -21
        if scale * bound <= tiny_scores(spec):  # tanh_tiny's range: |s| up to a quarter of tanh_small's
            c = x.copy()
            ns["score_row_tiny"](c, 0, 0, 0, 5, 0, 128)
            assert np.max(np.abs(a.astype(np.float64) - c)) <= 2.0 ** -21
        assert max(ns["score_absmax"](x, 0), ns["score_absmax"](x, 2)) == np.max(np.abs(x))
