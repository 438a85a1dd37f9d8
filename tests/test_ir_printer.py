"""The printer is the spec of how IR looks; the parser reads every dump back."""

from __future__ import annotations

import math

import pytest

import falower as fl
from falower.errors import ParseError
from falower.ir import new_func, parse_func, parse_funcs, print_func
from falower.ir.printer import print_module
from falower.ir.types import scalar, tensor


def test_names_come_from_hints_deduplicated_then_numbers() -> None:
    f, b, (x,) = new_func("n", [("x", tensor("f32", "N"))])
    a = b.emit("exp", x, name_hint="e")
    c = b.emit("exp", a, name_hint="e")
    d = b.emit("neg", c)
    b.ret(d)
    assert print_func(f) == (
        "func @n(%x: f32[N]) -> (out0: f32[N]) {\n"
        "  %e = exp %x : f32[N]\n"
        "  %e_1 = exp %e : f32[N]\n"
        "  %0 = neg %e_1 : f32[N]\n"
        "  return %0\n"
        "}\n")


def test_printing_is_deterministic_and_does_not_depend_on_object_identity() -> None:
    g1 = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="c")
    g2 = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="c")
    assert print_func(g1) == print_func(g2)
    assert print_func(g1) == print_func(g1)


@pytest.mark.parametrize("value, type_, text", [
    (-math.inf, "f32", "const -inf : f32"),
    (math.inf, "f32", "const inf : f32"),
    (math.nan, "f32", "const nan : f32"),
    (0.1, "f32", "const 0.1 : f32"),
    (1e-30, "f64", "const 1e-30 : f64"),
    (-2.5, "f16", "const -2.5 : f16"),
    (7, "i32", "const 7 : i32"),
    (-7, "i32", "const -7 : i32"),
    (True, "bool", "const true : bool"),
    (False, "bool", "const false : bool"),  # a value, not a flag: building it must keep it
])
def test_constants_print_and_parse(value, type_, text) -> None:
    f, b, () = new_func("c", [])
    b.ret(b.const(value, scalar(type_)))
    out = print_func(f)
    assert f"  %0 = {text}\n" in out
    again = parse_func(out)
    assert print_func(again) == out
    v = again.body.ops[0].attrs["value"]
    assert (math.isnan(v) and math.isnan(value)) if isinstance(value, float) and math.isnan(value) else v == value


def test_attributes_sorted_flags_bare_strings_escaped() -> None:
    f, b, (x,) = new_func("a", [("x", tensor("f32", "N"))])
    op = b.op("neg", [x], [x.type], {"zeta": 1, "alpha": True, "note": 'say "hi"\n', "dims": (1, "M")})
    b.ret(op.result)
    text = print_func(f)
    assert '%0 = neg %x {alpha, dims = [1, "M"], note = "say \\"hi\\"\\n", zeta = 1} : f32[N]' in text
    assert print_func(parse_func(text)) == text


def test_result_names_and_func_attrs_round_trip() -> None:
    text = ('func @f(%x: f32[N]) -> (o: f32[N], lse: f32[N]) {stage = "fwd"} {\n'
            "  %0 = neg %x : f32[N]\n"
            "  return %0, %x\n"
            "}\n")
    f = parse_func(text)
    assert f.result_names == ["o", "lse"]
    assert print_func(f) == text


def test_several_funcs_in_one_dump() -> None:
    a, b = fl.attention(name="a"), fl.attention(name="b")
    funcs = parse_funcs(print_module([a, b]))
    assert [f.name for f in funcs] == ["a", "b"]
    with pytest.raises(ParseError, match="expected one func, found 2"):
        parse_func(print_module([a, b]))


def test_comments_are_ignored() -> None:
    g = fl.attention(name="plain")
    text = print_func(g, "// ----- IR after nothing ----- //")
    assert text.startswith("// -----")
    assert print_func(parse_func(text)) == print_func(g)


GOOD = """func @f(%x: f32[N]) -> (out0: f32[N]) {
  %0 = neg %x : f32[N]
  return %0
}
"""


@pytest.mark.parametrize("old, new, match", [
    ("neg %x", "frob %x", "unknown op 'frob'"),
    ("neg %x", "neg %y", "use of undefined value %y"),
    ("%0 = neg", "%x = neg", "%x is defined twice"),
    ("%0 = neg", "%0, %1 = neg", "neg has 1 results but 2 names are given"),
    ("f32[N]) ->", "f8[N]) ->", "unknown dtype"),
    ("(out0: f32[N])", "(out0: f16[N])", "signature says (f16[N]) but return gives (f32[N])"),
    ("  return %0\n", "", "does not end in return"),
    ("f32[N]) ->", "f32[N+]) ->", "expected a dimension"),
    ("%0 = neg %x", "%0 = neg %x $", "unexpected character '$'"),
    ("}\n", "", "missing '}'"),
])
def test_parse_errors(old, new, match) -> None:
    assert old in GOOD
    with pytest.raises(ParseError, match=match.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]").replace("+", r"\+").replace("$", r"\$")):
        parse_func(GOOD.replace(old, new, 1))


def test_empty_input() -> None:
    with pytest.raises(ParseError, match="no func"):
        parse_funcs("// nothing here\n")
