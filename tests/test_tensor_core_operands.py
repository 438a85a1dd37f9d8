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
