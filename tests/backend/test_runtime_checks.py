"""The runtime refuses bad inputs with a one-line error before anything is launched (no GPU needed)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import make_spec  # noqa: E402

from falower.backends.numba_cuda import FA2ForwardKernel, emit_fa2_forward  # noqa: E402
from falower.backends.numba_cuda.runtime import load_source  # noqa: E402


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))


@pytest.fixture
def kern():
    return FA2ForwardKernel(make_spec("plain", 64, "f16", group_size=2, name="check_plain"))


def arrays(B=1, H=4, M=8, N=8, D=64, Hk=2, dtype=np.float16):
    return (np.zeros((B, H, M, D), dtype), np.zeros((B, Hk, N, D), dtype), np.zeros((B, Hk, N, D), dtype))


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda q, k, v: (q.astype(np.float32), k, v), TypeError, "dtype"),
        (lambda q, k, v: (q[0], k, v), ValueError, "4-D"),
        (lambda q, k, v: (q, k, np.zeros((1, 2, 4, 64), np.float16)), ValueError, "shapes differ"),
        (lambda q, k, v: arrays(D=32), ValueError, "head dim"),
        (lambda q, k, v: (np.zeros((1, 3, 8, 64), np.float16), k, v), ValueError, "group_size"),
        (lambda q, k, v: (q.transpose(0, 1, 3, 2), k, v), ValueError, "last dimension of q must be contiguous"),
        (lambda q, k, v: ([[1.0]], k, v), TypeError, "expected"),
    ],
)
def test_bad_inputs(kern, mutate, exc, words):
    q, k, v = mutate(*arrays())
    with pytest.raises(exc, match=words) as info:
        kern(q, k, v)
    assert "\n" not in str(info.value)


def test_capture_count():
    kern = FA2ForwardKernel(make_spec("bias", 64, "f16", name="check_bias"))
    q, k, v = arrays(H=2, Hk=2)
    with pytest.raises(ValueError, match="captured"):
        kern(q, k, v)


def test_source_is_cached_by_hash(tmp_path):
    spec = make_spec("causal", 64, "f16", name="check_cache")
    src = emit_fa2_forward(spec)
    m1 = load_source(src, spec.name)
    m2 = load_source(src, spec.name)
    assert m1 is m2
    files = [p.name for p in Path(os.environ["FALOWER_CACHE_DIR"]).glob("check_cache_*.py")]
    assert len(files) == 1
    assert compile(src, "kernel", "exec")


def test_print_kernel(capsys, kern):
    kern.print_kernel()
    assert "def check_plain(" in capsys.readouterr().out


def test_spec_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        emit_fa2_forward(make_spec("plain", 40, "f16", name="bad_d"))
    with pytest.raises(ValueError, match="block_q"):
        emit_fa2_forward(make_spec("plain", 64, "f16", block_q=48, num_warps=4, name="bad_bq"))


def test_a_capture_of_another_dtype_is_converted_or_refused_by_name():
    """numpy captures of another dtype than the spec's are converted to it (the kernels read the declared element
    size: an f64 table read as f32 gave wrong numbers); a bf16 capture must be 16-bit words (numpy has no bf16 to
    convert to): an f32 array for it is refused by name, before anything is launched."""
    import dataclasses

    from falower.backends.numba_cuda.runtime import _one_element_captures
    from falower.backends.numba_cuda.spec import Capture

    spec = make_spec("bias", 64, "f16", name="check_bias_dtype")
    table = np.zeros((1, 8, 8), np.float64)
    (got,) = _one_element_captures(spec, (table,), "numpy", None)
    assert got.dtype == np.float32 and got.shape == (1, 8, 8)
    (same,) = _one_element_captures(spec, (table.astype(np.float32),), "numpy", None)
    assert same.dtype == np.float32
    bf = FA2ForwardKernel(dataclasses.replace(spec, name="check_bias_bf16", captures=(Capture("bias", "bf16", 3),)))
    q, k, v = arrays(H=2, Hk=2)
    with pytest.raises(TypeError, match="capture bias has dtype float32, the graph declares bf16") as info:
        bf(q, k, v, np.zeros((1, 8, 8), np.float32))
    assert "\n" not in str(info.value)
