"""Tile products take their operands as the kernels' tensor cores do (`operand_dtype`): P and dS, computed in f32,
are rounded to the inputs' f16 / bf16 for P @ V, dS @ K, dS^T @ Q and P^T @ dO. The native interpreter rounds them
(so a dS past f16's 65504 is inf in the IR as in the kernels: tests/backend/test_special_values_simulator.py), f64
keeps the exact product (the reference the passes are checked against), and the verifier refuses a product of an f32
and an f16 tile that does not say which."""

from __future__ import annotations

import numpy as np
import pytest

import falower as fl
from falower.errors import FalowerError
from falower.ir.interp import Interpreter, round_bf16
from falower.ir.verifier import verify

CAUSAL = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")


def _product(dtype: str, attr: str = "") -> str:
    """A func whose one op is a tile product (a parallel_for of one iteration, where tile ops are legal)."""
    return (f"func @t(%a: f32[2,3], %b: {dtype}[3,2]) -> (c: f32[2,2]) {{\n"
            f"  %c = parallel_for (%i) in (1) : f32[2,2] {{\n"
            f"    %at = tile.load %a[%i : 2, :] : f32[2,3]\n"
            f"    %bt = tile.load %b[%i : 3, :] : {dtype}[3,2]\n"
            f"    %p = tile.matmul %at, %bt{attr} : f32[2,2]\n"
            f"    tile.yield %p into [%i : 2, :]\n  }}\n  return %c\n}}\n")


def test_the_pipelines_mark_every_mixed_product() -> None:
    fwd = fl.print_func(fl.lower(CAUSAL, "fa2-fwd"))
    assert '%pv = tile.matmul %p, %vt {operand_dtype = "f16"}' in fwd
    bwd = fl.print_func(fl.lower(CAUSAL, "fa2-bwd"))
    products = [ln for ln in bwd.splitlines() if "tile.matmul" in ln]
    # S = Q K^T takes f16 tiles as they are; dV (P^T with dO's f32 cast), dP, dK and dQ name f16
    assert sum('operand_dtype = "f16"' in ln for ln in products) == 2 * 4, products
    assert all("operand_dtype" not in ln for ln in products if "%q_t" in ln and "%k_t" in ln and "transpose_b" in ln)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_native_rounds_the_operands_and_f64_does_not(dtype: str) -> None:
    f = fl.parse_func(_product(dtype, f' {{operand_dtype = "{dtype}"}}'))
    a = np.full((2, 3), 1.0 / 3.0, np.float32)
    a[1, 0] = 70000.0  # past f16's range: inf in f16, finite in bf16
    b = np.ones((3, 2), np.float16 if dtype == "f16" else np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # f16's inf, on purpose
        (native,) = Interpreter("native").run(f, [a, b])
    (exact,) = Interpreter("f64").run(f, [a, b])
    third = float(np.float16(1 / 3)) if dtype == "f16" else float(round_bf16(np.float32(1 / 3)))
    assert native[0, 0] == np.float32(3 * third) != exact[0, 0]
    assert exact[0, 0] == pytest.approx(1.0, abs=1e-7)
    assert np.isinf(native[1, 0]) if dtype == "f16" else np.isfinite(native[1, 0])
    assert np.isfinite(exact[1, 0])


def test_a_mixed_product_must_say_its_operand_dtype() -> None:
    with pytest.raises(FalowerError, match=r'takes its operands in f16 on the tensor cores: say operand_dtype = "f16"'):
        verify(fl.parse_func(_product("f16")))
    with pytest.raises(FalowerError, match=r"takes its operands in f16 .*found 'bf16'"):
        verify(fl.parse_func(_product("f16", ' {operand_dtype = "bf16"}')))
    with pytest.raises(FalowerError, match=r'operand_dtype must be "f16" or "bf16", got \'f32\''):
        verify(fl.parse_func(_product("f32", ' {operand_dtype = "f32"}')))
    verify(fl.parse_func(_product("f32")))  # f32 x f32: nothing to round


def test_a_hand_edited_dump_without_it_is_refused_in_one_line(tmp_path, capsys) -> None:
    from falower.cli import main

    text = fl.print_func(fl.lower(CAUSAL, "fa2-fwd")).replace(' {operand_dtype = "f16"}', "")
    path = tmp_path / "edited.fl"
    path.write_text(text)
    assert main(["opt", str(path), "--pipeline", "canonicalize"]) != 0
    err = capsys.readouterr().err.strip().splitlines()  # the verifier's line, then the IR around the op
    assert 'say operand_dtype = "f16"' in err[0] and ">         %pv = tile.matmul %p, %vt : f32[128,D]" in err, err


def test_a_mixed_score_product_lowers_through_the_forward() -> None:
    """q in f32 with k, v in f16 (or q cast to f16 before the product): tile's S = Q K^T was built without
    operand_dtype and the verifier then refused the pass's own product (a review's find)."""
    qkv = dict(q=fl.tensor("f32", "B,H,M,D"), k=fl.tensor("f16", "B,H,N,D"), v=fl.tensor("f16", "B,H,N,D"))
    for name, fn in (("mixed", lambda q, k, v: (fl.softmax(q @ k.mT * 0.25, dim=-1) @ v).to("f16")),
                     ("qcast", lambda q, k, v: (fl.softmax(q.to("f16") @ k.mT * 0.25, dim=-1) @ v).to("f16"))):
        g = fl.trace(fn, name=name, result_names=("o",), **qkv)
        text = fl.print_func(fl.lower(g, "fa2-fwd"))
        assert '%s = tile.matmul %qt, %kt {operand_dtype = "f16", transpose_b}' in text, text
        fl.lower(g, "fa2-bwd")


@pytest.mark.parametrize("a, b, od, words", [
    ("f32", "f16", "bf16", "takes its operands in f16 on the tensor cores: .*found 'bf16'"),  # f16 V to bf16
    ("f16", "f16", "bf16", 'operand_dtype = "bf16" on an operand of f16'),
    ("f64", "f16", "f16", 'operand_dtype = "f16" on an operand of f64'),
])
def test_an_operand_dtype_that_is_no_tensor_core_product_is_refused(a: str, b: str, od: str, words: str) -> None:
    text = _product(b, f' {{operand_dtype = "{od}"}}').replace("%a: f32[2,3]", f"%a: {a}[2,3]") \
        .replace(": f32[2,3]\n", f": {a}[2,3]\n")
    if a == "f64":
        text = text.replace(": f32[2,2]", ": f64[2,2]").replace("-> (c: f32[2,2])", "-> (c: f64[2,2])")
    with pytest.raises(FalowerError, match=words):
        verify(fl.parse_func(text))


def test_a_graph_product_says_operand_dtype_only_where_it_mixes_f32_with_f16() -> None:
    """The tile passes derive their products' operand_dtype from the tiles: a graph product's other than that (f32
    V said to round to f16, an f16 V to bf16) would have been dropped with no word (a review's find)."""
    def graph(vdtype: str, od: str) -> str:
        return (f"func @g(%p: f32[M,N], %v: {vdtype}[N,D]) -> (o: f32[M,D]) {{\n"
                f"  %o = matmul %p, %v {{operand_dtype = \"{od}\"}} : f32[M,D]\n  return %o\n}}\n")
    verify(fl.parse_func(graph("f16", "f16")))
    with pytest.raises(FalowerError, match=r'operand_dtype = "f16" on a product of f32\[M,N\] and f32\[N,D\]'):
        verify(fl.parse_func(graph("f32", "f16")))
    with pytest.raises(FalowerError, match=r'operand_dtype = "bf16" on a product of f32\[M,N\] and f16\[N,D\]'):
        verify(fl.parse_func(graph("f16", "bf16")))
