"""Symbolic dimensions: printing, parsing, simplification on construction, evaluation and solve_dims."""

from __future__ import annotations

import pytest

from falower.errors import ParseError, ShapeError
from falower.ir.dims import BinDim, Const, Sym, cdiv, dim, dmax, dmin, parse_dim, solve_dims
from falower.ir.types import TensorType, broadcast_shapes, tensor

M, N, D = Sym("M"), Sym("N"), Sym("D")


@pytest.mark.parametrize("d, text", [
    (N * 2 - 1, "N*2-1"),
    (cdiv(M, 64), "cdiv(M, 64)"),
    (M - (N - 1), "M-(N-1)"),
    ((M + N) * 2, "(M+N)*2"),
    (M * 2 + N, "M*2+N"),
    (dmin(M, N * 4), "min(M, N*4)"),
    (M // 16, "fdiv(M, 16)"),
    (M - N - D, "M-N-D"),
    (M - (N - D), "M-(N-D)"),
])
def test_print(d, text) -> None:
    assert str(d) == text


@pytest.mark.parametrize("text", ["N*2-1", "cdiv(M, 64)", "M-(N-1)", "(M+N)*2", "max(cdiv(M, 64)*64, N)",
                                  "fdiv(M, 16)", "M-N-D", "HKV*4", "0-N"])
def test_parse_print_round_trip(text) -> None:
    d = parse_dim(text)
    assert str(d) == text
    assert parse_dim(str(d)) == d


@pytest.mark.parametrize("built, simple", [
    (M + 0, M),
    (0 + M, M),
    (M - 0, M),
    (M * 1, M),
    (M * 0, Const(0)),
    (M - M, Const(0)),
    (cdiv(M, 1), M),
    (dmax(N, N), N),
    (dim(3) * 4 + 1, Const(13)),
    (cdiv(100, 64), Const(2)),
    (M + (-3), M - 3),
    (2 * N, N * 2),
    ((M * 4) // 4, M),  # the kv heads of a GQA gradient: (HKV*4) // 4
    (cdiv(N * 2, 2), N),
])
def test_simplification_on_construction(built, simple) -> None:
    assert built == simple
    assert str(built) == str(simple)


def test_equal_dims_built_twice_compare_equal() -> None:
    assert cdiv(M, 64) == cdiv(dim("M"), 64)
    assert hash(cdiv(M, 64)) == hash(parse_dim("cdiv(M, 64)"))
    assert cdiv(M, 64) != cdiv(M, 128)


@pytest.mark.parametrize("text, env, value", [
    ("cdiv(M, 64)", {"M": 129}, 3),
    ("fdiv(M, 64)", {"M": 129}, 2),
    ("N*2-1", {"N": 10}, 19),
    ("min(M, 5)+max(M, 5)", {"M": 3}, 8),
    ("M-(N-1)", {"M": 4, "N": 10}, -5),
])
def test_eval(text, env, value) -> None:
    assert parse_dim(text).eval(env) == value


def test_eval_missing_symbol_names_it() -> None:
    with pytest.raises(ShapeError, match="dimension M"):
        cdiv(M, 64).eval({})


@pytest.mark.parametrize("text", ["", "M+", "(M", "M)", "cdiv(M)", "M $ N", "2 N"])
def test_parse_errors(text) -> None:
    with pytest.raises(ParseError):
        parse_dim(text)


def test_division_by_zero_is_a_shape_error() -> None:
    with pytest.raises(ShapeError):
        cdiv(4, 0)


def test_solve_dims_binds_symbols_and_multiples() -> None:
    env = solve_dims([(Sym("B"), 2), (Sym("HKV") * 4, 8), (N * 2 - 1, 19), (N, 10)], {})
    assert env == {"B": 2, "HKV": 2, "N": 10}


def test_solve_dims_mismatch() -> None:
    with pytest.raises(ShapeError, match="dimension N = 10 but the input has size 11"):
        solve_dims([(N, 10), (N, 11)], {})


def test_solve_dims_given_size_conflicts_with_input() -> None:
    with pytest.raises(ShapeError, match="but the input has size 5"):
        solve_dims([(M, 5)], {"M": 4})


def test_solve_dims_not_a_multiple() -> None:
    with pytest.raises(ShapeError, match="not a multiple of 4"):
        solve_dims([(Sym("HKV") * 4, 6)], {})


def test_solve_dims_cannot_infer() -> None:
    with pytest.raises(ShapeError, match="cannot infer dimension N"):
        solve_dims([(N * 2 - 1, 19)], {})


def test_types_print_and_broadcast() -> None:
    t = tensor("f16", "B", "H", M, 64)
    assert str(t) == "f16[B,H,M,64]"
    assert str(TensorType("f32", ())) == "f32"
    assert tensor("f32", 64, 32).static_shape() == (64, 32)
    assert t.static_shape() is None
    assert broadcast_shapes((Const(1), M, Const(1)), (Sym("B"), Const(1), N)) == (Sym("B"), M, N)
    assert broadcast_shapes((M,), (N,)) is None


def test_unknown_dtype() -> None:
    with pytest.raises(ShapeError, match="unknown dtype"):
        tensor("f8", M)


def test_bindim_structure() -> None:
    d = parse_dim("cdiv(M, 64)")
    assert isinstance(d, BinDim) and d.op == "cdiv" and d.lhs == M and d.rhs == Const(64)
    assert d.symbols() == {"M"}
