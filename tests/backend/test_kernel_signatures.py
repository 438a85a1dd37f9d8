"""Every emitted kernel takes as many parameters as the Numba signature its direct launch compiles it for.

The signatures (`argtypes`, `kernel_argtypes`) are written beside the emitters, not derived from them; a
parameter dropped on one side only is a `Signature mismatch` at the first GPU compile, which CI cannot run."""

from __future__ import annotations

import ast
import runpy
from pathlib import Path

import pytest

pytest.importorskip("numba")

import falower as fl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
STEMS = sorted(p.stem for p in (ROOT / "examples").glob("*.py")
               if any(isinstance(v, fl.Func) for v in runpy.run_path(str(p)).values()))


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))


def graph(stem: str) -> fl.Func:
    return next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))


def n_params(source: str, name: str) -> int:
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name)
    return len(fn.args.args)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("stem", STEMS)
def test_forward_kernels_match_their_signatures(stem, D):
    kern = fl.compile(graph(stem), "numba-cuda").specialize("f16", D=D)
    assert n_params(kern.source, kern.spec.name) == len(kern.argtypes()), kern.spec.name
    if kern.mask_source is not None:
        assert n_params(kern.mask_source, kern.spec.name + "_block_mask") == len(kern.mask_argtypes())


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("stem", STEMS)
def test_backward_kernels_match_their_signatures(stem, deterministic):
    c = fl.compile(graph(stem), "numba-cuda", deterministic=deterministic)
    kern = c._backward_kernel_and_dims_for("f16", 64)
    name = kern.spec.name
    defs = {"main": (kern.source, name), "delta": (kern.delta_source, name + "_delta"),
            "dq": (kern.dq_source, name + ("_dq" if kern.spec.dq == "atomic" else "_dqk")),
            "parts": (kern.parts_source, name + "_parts"), "mask": (kern.mask_source, name + "_block_mask")}
    for which in kern._kernel_names():
        source, fn = defs[which]
        assert n_params(source, fn) == len(kern.kernel_argtypes(which)), (which, name)


@pytest.mark.parametrize("stem", ["causal", "plain", "alibi"])
def test_dynamic_item_order_takes_its_counter(stem):
    """item_order "dynamic" adds `work` (int32 [2]) after the sizes and strides, before the captures, on both
    sides: the emitted kernel and the Numba signature of its direct launch."""
    from numba import types

    kern = fl.compile(graph(stem), "numba-cuda",
                      extra={"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 132,
                             "item_order": "dynamic"}).specialize("f16", D=128)
    params = [a.arg for a in next(n for n in ast.walk(ast.parse(kern.source))
                                  if isinstance(n, ast.FunctionDef) and n.name == kern.spec.name).args.args]
    assert len(params) == len(kern.argtypes())
    assert params[18] == "work" and kern.argtypes()[18] == types.Array(types.int32, 1, "C")
