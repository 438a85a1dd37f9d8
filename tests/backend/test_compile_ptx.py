"""PTX of the kernels falower.compile builds from every example, for sm_90, without a GPU: the tensor-core
instructions are there, and neither f64 arithmetic nor local memory crept in through a score function."""

from __future__ import annotations

import os
import re
import runpy
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba.cuda")
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("PTX checks need the real CUDA target, not the simulator", allow_module_level=True)

import falower as fl  # noqa: E402
from falower.ir import Func  # noqa: E402
from falower.passes.check import bind_dims, random_inputs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
STEMS = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("stem", STEMS)
def test_example_mma_ptx(stem):
    g = next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, Func))
    env = bind_dims(g, {"B": 1, "H": 2, "HKV": 1, "M": 128, "N": 128, "D": 64})
    inputs = [x.astype(np.float16) if i < 3 else x for i, x in enumerate(random_inputs(g, env))]
    kern = fl.compile(g, "numba-cuda", path="mma").kernel(*inputs)  # builds, does not launch
    ptx = kern.ptx(cc=(9, 0))
    assert re.search(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16", ptx)
    assert not re.search(r"\.f64\b", ptx), "f64 arithmetic in the kernel"
    assert not re.search(r"\b(ld|st)\.local\b", ptx), "local memory in the kernel"


@pytest.mark.slow
def test_frontend_maths_and_captured_scalars_compile_to_ptx():
    """round, floor, ceil, sign, rsqrt, log1p, expm1 and a 0-d captured window lower to PTX without f64
    arithmetic (float32 maths throughout) and without local memory. (sin, cos and tan come from libdevice's
    float32 functions, whose reduction of huge arguments (|x| > 1e5) takes a double-precision slow path; the
    simulator and GPU tests check their numbers.)"""
    window = fl.capture("window", "i32", "")
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + fl.round(s * 2.0) * 0.01 + fl.floor(s) * 0.01
                     + fl.ceil(s) * 0.01 + fl.sign(q - kv) * 0.1 + fl.rsqrt(abs(s) + 1.0) + fl.log1p(abs(s))
                     - fl.expm1(s * 0.01),
                     mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < window), name="idioms")
    env = bind_dims(g, {"B": 1, "H": 2, "M": 128, "N": 128, "D": 64})
    inputs = [x.astype(np.float16) for x in random_inputs(g, env)[:3]] + [np.array(64, dtype=np.int32)]
    ptx = fl.compile(g, "numba-cuda", path="mma").kernel(*inputs).ptx(cc=(9, 0))
    assert re.search(r"\bmma\.sync\.aligned\.m16n8k16", ptx)
    assert not re.search(r"\.f64\b", ptx), "f64 arithmetic in the kernel"
    assert not re.search(r"\b(ld|st)\.local\b", ptx), "local memory in the kernel"
