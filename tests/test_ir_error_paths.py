"""Bad input to the parser, the verifier and the interpreter: each is refused with one line naming what is
wrong (a FalowerError), never a bare Python exception and never silently wrong numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import falower as fl
from falower.cli import main
from falower.errors import FalowerError, ParseError, ShapeError, VerifyError
from falower.ir import Interpreter, interpret, parse_func, parse_funcs, print_func, verify
from falower.ir.dims import parse_dim


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# --------------------------------------------------------------------------------------------- parser
def test_a_func_whose_body_is_only_return_round_trips() -> None:
    f = fl.trace(lambda x: x, name="ident", x=fl.tensor("f32", "N"))
    text = print_func(f)
    assert text == "func @ident(%x: f32[N]) -> (out0: f32[N]) {\n  return %x\n}\n"
    assert print_func(parse_func(text)) == text


@pytest.mark.parametrize("text", [
    "func @g() -> () {\n  return\n}\n",
    'func @g(%x: f32[N]) -> (out0: f32[N]) {stage = "fwd"} {\n  return %x\n}\n',
    "func @g(%a: i32, %b: i32) -> () {\n  for %i = %a to %b iter_args() {\n    yield\n  }\n  return\n}\n",
    "func @g(%a: i32, %b: i32) -> () {flag} {\n  for %i = %a to %b iter_args() {unroll} {\n    yield\n  }\n"
    "  return\n}\n",
])
def test_blocks_that_start_like_an_attribute_dict_round_trip(text: str) -> None:
    assert print_func(parse_func(text)) == text


def test_a_bad_string_escape_is_a_parse_error() -> None:
    text = 'func @f(%x: f32[N]) -> (out0: f32[N]) {\n  %0 = neg %x {a = "\\q"} : f32[N]\n  return %0\n}\n'
    with pytest.raises(ParseError) as e:
        parse_func(text)
    assert "line 2" in one_line(e) and "escape" in one_line(e)


def test_a_fractional_tile_size_is_a_parse_error() -> None:
    text = ("func @f(%x: f32[N], %i: i32) -> (out0: f32[4]) {\n  %0 = tile.load %x[%i : 1.5] : f32[4]\n"
            "  return %0\n}\n")
    with pytest.raises(ParseError) as e:
        parse_func(text)
    assert "line 2" in one_line(e) and "1.5" in one_line(e)


@pytest.mark.parametrize("what, dim_text", [
    ("parentheses", "(" * 5000 + "N" + ")" * 5000),
    ("minus signs", "-" * 5000 + "N"),
    ("calls", "cdiv(" * 3000 + "N" + ", 2)" * 3000),
])
def test_a_deeply_nested_dim_is_a_parse_error(what: str, dim_text: str) -> None:
    text = f"func @f(%x: f32[{dim_text}]) -> (out0: f32[N]) {{\n  return %x\n}}\n"
    with pytest.raises(ParseError) as e:
        parse_func(text)
    assert "line 1" in one_line(e) and "nested" in one_line(e)
    with pytest.raises(ParseError, match="nested"):
        parse_dim(dim_text)


def test_deeply_nested_lists_and_regions_are_parse_errors() -> None:
    lists = "[" * 5000 + "]" * 5000
    text = f"func @f(%x: f32[N]) -> (out0: f32[N]) {{\n  %0 = neg %x {{a = {lists}}} : f32[N]\n  return %0\n}}\n"
    with pytest.raises(ParseError) as e:
        parse_func(text)
    assert "line 2" in one_line(e) and "nested" in one_line(e)
    n = 3000
    body = "  %r = if %c : f32 {\n" * n + "yield %x\n" + "} else {\n yield %x\n}\n" * n
    text = f"func @f(%c: bool, %x: f32) -> (out0: f32) {{\n{body}  return %r\n}}\n"
    with pytest.raises(ParseError) as e:
        parse_func(text)
    assert "nested" in one_line(e)


def test_an_integer_too_long_to_convert_is_a_parse_error() -> None:
    text = f"func @f(%x: f32[{'9' * 5000}]) -> (out0: f32[N]) {{\n  return %x\n}}\n"
    with pytest.raises(ParseError) as e:
        parse_func(text)
    assert "line 1" in one_line(e) and "too long" in one_line(e)


@pytest.mark.parametrize("text", [b"func @f() -> () {\n  return\n}\n", None, 3])
def test_ir_text_that_is_not_a_str_is_a_parse_error(text) -> None:
    for parse in (parse_func, parse_funcs):
        with pytest.raises(ParseError) as e:
            parse(text)
        assert "must be a str" in one_line(e) and type(text).__name__ in one_line(e)


def test_two_funcs_with_one_name_are_refused() -> None:
    one = "func @f(%x: f32[N]) -> (out0: f32[N]) {\n  return %x\n}\n"
    with pytest.raises(ParseError) as e:
        parse_funcs(one + one)
    assert "@f" in one_line(e) and "line 4" in one_line(e)
    assert [f.name for f in parse_funcs(one + one.replace("@f", "@g"))] == ["f", "g"]


# ------------------------------------------------------------------------------------------- verifier
@pytest.mark.parametrize("text, names", [
    ("func @f(%x: f32[-3]) -> (out0: f32[-3]) {\n  %0 = exp %x : f32[-3]\n  return %0\n}\n", "%x"),
    ("func @f(%x: f32[N]) -> (out0: f32[N]) {\n  %i = iota {axis = 0} : i32[-1,N]\n  return %x\n}\n", "%i"),
    ("func @f(%x: f32[N]) -> (out0: f32[N]) {\n  %0 = const 1.0 : f32[cdiv(N, 0)]\n  return %x\n}\n",
     "divides by zero"),
    ("func @f(%x: f32[N]) -> (out0: f32[fdiv(N,0)]) {\n  %0 = const 1.0 : f32[fdiv(N,0)]\n  return %0\n}\n",
     "divides by zero"),
])
def test_the_verifier_refuses_dims_that_can_never_be_sizes(text: str, names: str) -> None:
    f = parse_func(text)
    with pytest.raises(VerifyError) as e:
        verify(f)
    first = str(e.value).splitlines()[0]
    assert names in first
    assert "negative" in first or "divides by zero" in first


def test_the_verifier_refuses_a_negative_parallel_for_bound() -> None:
    text = ("func @f(%x: f32[B,D]) -> (o: f32[B,D]) {\n  %o = parallel_for (%b) in (-2) : f32[B,D] {\n"
            "    %t = tile.load %x[%b, :] : f32[D]\n    tile.yield %t into [%b, :]\n  }\n  return %o\n}\n")
    with pytest.raises(VerifyError, match="bound -2: a bound cannot be negative"):
        verify(parse_func(text))


# ---------------------------------------------------------------------------------------- interpreter
def test_a_dim_that_evaluates_negative_is_a_shape_error() -> None:
    f = parse_func("func @f(%x: f32[N]) -> (out0: f32[N-100]) {\n  %0 = const 1.0 : f32[N-100]\n  return %0\n}\n")
    verify(f)  # N may be large enough: only a run can tell
    with pytest.raises(ShapeError) as e:
        interpret(f, [np.zeros(7)])
    msg = one_line(e)
    assert "const" in msg and "N-100 = -93" in msg and "N=7" in msg


def test_a_dim_that_divides_by_zero_at_run_time_is_a_shape_error() -> None:
    f = parse_func("func @f(%x: f32[N]) -> (out0: f32[cdiv(N, 0)]) {\n  %0 = const 1.0 : f32[cdiv(N, 0)]\n"
                   "  return %0\n}\n")  # not verified: the interpreter stands on its own
    with pytest.raises(ShapeError) as e:
        interpret(f, [np.zeros(7)])
    assert "const" in one_line(e) and "cdiv(N, 0) divides by zero" in one_line(e)


def test_a_reduce_max_over_an_empty_axis_is_a_shape_error() -> None:
    f = parse_func("func @f(%x: f32[N]) -> (out0: f32[1]) {\n  %0 = const 1.0 : f32[N-N]\n"
                   "  %1 = reduce_max %0 {axis = 0} : f32[1]\n  return %1\n}\n")
    with pytest.raises(ShapeError) as e:
        interpret(f, [np.zeros(3)])
    assert "reduce_max" in one_line(e)


OOB = """func @f(%x: f32[B,D], %y: f32[N,D]) -> (o: f32[B,D]) {
  %o = parallel_for (%b) in (N) : f32[B,D] {
    %t = tile.load %LOAD[%b, :] : f32[D]
    tile.yield %t into [%b, :]
  }
  return %o
}
"""


@pytest.mark.parametrize("load, names", [("x", "tile.load"), ("y", "tile.yield into result 0")])
def test_a_tile_index_out_of_range_names_the_op(load: str, names: str) -> None:
    f = parse_func(OOB.replace("LOAD", load))
    verify(f)
    with pytest.raises(ShapeError) as e:
        interpret(f, [np.zeros((2, 4)), np.zeros((3, 4))])
    assert names in one_line(e) and "index 2" in one_line(e)


def test_a_tile_index_out_of_range_is_one_cli_error_line(tmp_path: Path, capsys) -> None:
    p = tmp_path / "oob.fl"
    p.write_text(OOB.replace("LOAD", "x"))
    code = main(["run", str(p), "--shapes", "B=2,N=3,D=4"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.startswith("falower: error:")] == \
        [ln for ln in err.splitlines() if ln.strip()], err
    assert "tile.load" in err


CAUSAL = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")
DOC_ID = fl.capture("doc_id", "i32", "B,N")
DOC = fl.attention(mask_mod=lambda b, h, q, kv: DOC_ID[b, q] == DOC_ID[b, kv], name="doc")


def qkv(dtype=np.float16, n: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(dtype) for s in [(1, 2, 5, 8), (1, 2, n, 8), (1, 2, n, 8)]]


def ids(values, dtype=np.int32) -> np.ndarray:
    return np.asarray([values], dtype=dtype)


@pytest.mark.parametrize("label, change, expected", [
    ("uint16 bits", lambda q: (q.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16), "raw bits"),
    ("strings", lambda q: q.astype(str), "float"),
    ("complex", lambda q: q.astype(np.complex64), "float"),
    ("ints", lambda q: q.astype(np.int32), "float"),
    ("bools", lambda q: q > 0, "float"),
    ("objects", lambda q: q.astype(object), "float"),
])
def test_a_float_input_refuses_values_that_are_not_floats(label: str, change, expected: str) -> None:
    q, k, v = qkv()
    for graph in (CAUSAL, fl.attention(mask_mod=lambda b, h, qi, kv: qi >= kv, name="c", dtype="bf16")):
        with pytest.raises(ShapeError) as e:
            interpret(graph, [change(q), k, v], "native")
        assert "%q" in one_line(e) and expected in one_line(e), label


@pytest.mark.parametrize("label, table, expected", [
    ("floats", ids([0.2, 0.9, 1.5, 1.7, 2.0], np.float32), "integer"),
    ("int64 past i32", ids([0, 0, 1, 1, 2 ** 32], np.int64), "outside -2147483648..2147483647"),
    ("uint64 past i32", ids([0, 0, 1, 1, 2 ** 33], np.uint64), "outside"),
    ("bools", ids([0, 0, 1, 1, 0], bool), "integer"),
])
def test_an_int_input_refuses_values_that_do_not_fit(label: str, table, expected: str) -> None:
    with pytest.raises(ShapeError) as e:
        interpret(DOC, [*qkv(), table])
    assert "%doc_id" in one_line(e) and expected in one_line(e), label


def test_inputs_that_fit_are_still_accepted() -> None:
    want = interpret(DOC, [*qkv(), ids([0, 0, 1, 1, 2])])
    for dt in (np.float16, np.float32, np.float64):
        for idt in (np.int8, np.int16, np.int32, np.int64, np.uint8):
            got = interpret(DOC, [*qkv(dt), ids([0, 0, 1, 1, 2], idt)])
            np.testing.assert_allclose(got[0], want[0], atol=2e-3)
    bf = fl.attention(mask_mod=lambda b, h, qi, kv: qi >= kv, name="c", dtype="bf16")
    for dt in (np.float16, np.float32, np.float64):
        interpret(bf, qkv(dt), "native")
    # Python scalars and bool tables
    f = parse_func("func @f(%x: f32, %n: i32, %m: bool[N]) -> (out0: f32) {\n  return %x\n}\n")
    assert float(interpret(f, [2, 3, np.array([True, False])])[0]) == 2.0
    assert float(interpret(f, [2.5, np.int64(7), [True]])[0]) == 2.5
    with pytest.raises(ShapeError, match="%n"):
        interpret(f, [2.5, 2 ** 40, [True]])
    with pytest.raises(ShapeError, match="%m .*bool"):
        interpret(f, [2.5, 1, [1, 0]])


def test_the_reference_backend_refuses_wrong_dtypes() -> None:
    c = fl.compile(DOC, backend="reference")
    with pytest.raises(ShapeError, match="%doc_id"):
        c(*qkv(), ids([0, 0, 1, 1, 2 ** 32], np.int64))


@pytest.mark.parametrize("sizes, dim_name", [((0, 5), "M"), ((5, 0), "N")])
def test_a_zero_size_dimension_is_a_shape_error(sizes: tuple[int, int], dim_name: str) -> None:
    m, n = sizes
    q, k, v = qkv(n=max(n, 1))
    q, k, v = q[:, :, :m], k[:, :, :n], v[:, :, :n]
    with pytest.raises(ShapeError) as e:
        interpret(CAUSAL, [q, k, v])
    assert f"dimension {dim_name}" in one_line(e) and "positive" in one_line(e)
    with pytest.raises(ShapeError, match="dimension M = 0"):
        interpret(CAUSAL, qkv(), "f64", {"M": 0})


def test_an_unknown_precision_is_a_falower_error_and_a_value_error() -> None:
    for catch in (FalowerError, ValueError):
        with pytest.raises(catch) as e:
            Interpreter(precision="f32")
        assert "'f32'" in one_line(e)


def test_interpret_names_a_graph_or_inputs_of_the_wrong_kind() -> None:
    """A str for the graph (once an AttributeError) or for the inputs."""
    import falower as fl

    with pytest.raises(fl.FalowerError, match="the graph must be a falower Func, got str"):
        fl.interpret("causal", [])
    with pytest.raises(fl.FalowerError, match="the inputs must be a list of arrays, got str"):
        fl.interpret(fl.attention(), "qkv")


def test_interpret_names_inputs_given_one_by_one() -> None:
    """interpret(func, q, k, v): k taken as the precision (once numpy's "truth value of an array is ambiguous"), or
    one array for the list of inputs (once a count of its rows)."""
    import numpy as np

    import falower as fl

    q = k = v = np.zeros((1, 1, 4, 16), np.float16)
    with pytest.raises(fl.FalowerError, match=r"precision must be a str .* got ndarray: pass the inputs as one list"):
        fl.interpret(fl.attention(), q, k, v)
    with pytest.raises(fl.FalowerError, match="the inputs must be a list of arrays, got ndarray"):
        fl.interpret(fl.attention(), q)
    assert fl.interpret(fl.attention(), [q, k, v])[0].shape == (1, 1, 4, 16)
