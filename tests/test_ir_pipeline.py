"""Pipeline strings: parsing with options, printing back, errors; the pass manager's checks and dumps."""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest

import falower as fl
from falower.errors import FalowerError, ParseError, PassError, VerifyError
from falower.ir import Func
from falower.passes import NAMED_PIPELINES, PASSES, Pass, PassManager, parse_pipeline
from falower.passes.pipeline import named


@dataclass(frozen=True)
class Knobs(Pass):
    """Test-only pass with one option of each kind; does nothing."""

    name = "test-knobs"
    summary = "test only"
    a: int = 0
    b: bool = False
    c: str = "x"
    f: float = 1.5

    def run(self, func: Func) -> Func:
        return func


@dataclass(frozen=True)
class BreakExp(Pass):
    """Test-only pass that changes the numbers: exp becomes exp2 (a pass with a bug)."""

    name = "test-break-exp"
    summary = "test only"

    def run(self, func: Func) -> Func:
        for op in func.walk():
            if op.name == "exp":
                op.name = "exp2"
        return func


@dataclass(frozen=True)
class BreakTypes(Pass):
    """Test-only pass that leaves ill-typed IR behind (the verifier must catch it after the pass)."""

    name = "test-break-types"
    summary = "test only"

    def run(self, func: Func) -> Func:
        for op in func.walk():
            if op.name == "matmul":
                op.results[0].type = op.results[0].type.with_dtype("f16")
                break
        return func


@pytest.fixture(autouse=True)
def test_passes():
    """Register the test passes for one test only, so they never leak into `falower passes`."""
    added = {p.name: p for p in (Knobs, BreakExp, BreakTypes)}
    PASSES.update(added)
    yield
    for n in added:
        PASSES.pop(n, None)
    NAMED_PIPELINES.pop("test-named", None)


def causal() -> Func:
    return fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")


@pytest.mark.parametrize("text", [
    "canonicalize",
    "decompose-softmax,canonicalize",
    "test-knobs{a=1,b=true}",
    "test-knobs{a=-3,b=false,c=hello,f=0.25}",
    "test-knobs{c=y},canonicalize,test-knobs",
    "test-knobs{a=0}",  # an explicitly written default prints back too
])
def test_round_trip(text: str) -> None:
    p = parse_pipeline(text)
    assert str(p) == text
    assert str(parse_pipeline(str(p))) == text


def test_options_are_typed() -> None:
    (k,) = parse_pipeline("test-knobs{a=7,b=1,c=abc,f=2}").passes
    assert k == Knobs(a=7, b=True, c="abc", f=2.0)
    assert isinstance(k.a, int) and isinstance(k.b, bool) and isinstance(k.f, float)


def test_whitespace_is_normalised() -> None:
    assert str(parse_pipeline(" test-knobs{ a = 2 , b=true } , canonicalize ")) == "test-knobs{a=2,b=true},canonicalize"


def test_options_print_in_the_order_written() -> None:
    assert str(parse_pipeline("test-knobs{b=true,a=1}")) == "test-knobs{b=true,a=1}"


def test_named_pipeline_expands() -> None:
    named("test-named", "decompose-softmax,test-knobs{a=2}")
    p = parse_pipeline("test-named,canonicalize")
    assert str(p) == "decompose-softmax,test-knobs{a=2},canonicalize"
    with pytest.raises(ParseError, match="takes no options"):
        parse_pipeline("test-named{a=1}")


@pytest.mark.parametrize("text, match", [
    ("nosuch", "unknown pass 'nosuch'"),
    ("canonicalize,nosuch", "unknown pass 'nosuch'"),
    ("test-knobs{zz=1}", "has no option 'zz'"),
    ("canonicalize{a=1}", "has no option 'a'"),
    ("test-knobs{a=x}", "option a of pass test-knobs must be an int"),
    ("test-knobs{a=1.5}", "must be an int"),
    ("test-knobs{b=yes}", "must be true or false"),
    ("test-knobs{f=fast}", "must be a number"),
    ("test-knobs{a}", "malformed option 'a'"),
    ("test-knobs{a=1,a=2}", "given twice"),
    ("canonicalize,", "trailing ','"),
    ("canonicalize, ", "trailing ','"),
    ("canonicalize;decompose-softmax", "malformed pipeline"),
    ("canonicalize{", "malformed pipeline"),
    ("test-knobs{a=1}}", "malformed pipeline"),
    (",canonicalize", "malformed pipeline"),
    ("", "empty pipeline"),
])
def test_errors(text: str, match: str) -> None:
    with pytest.raises(ParseError, match=match):
        parse_pipeline(text)


def test_passes_do_not_mutate_their_input() -> None:
    g = causal()
    before = fl.print_func(g)
    out = fl.run_pipeline(g, "decompose-softmax,canonicalize")
    assert fl.print_func(g) == before
    assert fl.print_func(out) != before


def test_registered_passes_are_documented() -> None:
    for name, cls in PASSES.items():
        if name.startswith("test-"):
            continue
        assert cls.summary, name
        assert cls.__doc__ and cls.__doc__.strip(), name


def test_check_catches_a_pass_that_changes_numbers() -> None:
    pm = PassManager(parse_pipeline("decompose-softmax,test-break-exp"), check=True)
    with pytest.raises(PassError, match="--check failed after pass test-break-exp: M=77,N=93: output o: max error"):
        pm.run(causal())
    assert [r.check for r in pm.records][0] == "ok"


def test_verifier_runs_after_every_pass() -> None:
    with pytest.raises(VerifyError, match="after pass test-break-types: verifier: 'matmul'"):
        fl.run_pipeline(causal(), "test-break-types")


def test_forbidden_op_after_decomposition() -> None:
    """decompose-softmax removes softmax: a later pass that reintroduces it fails verification."""

    @dataclass(frozen=True)
    class Reintroduce(Pass):
        name = "test-reintroduce"
        summary = "test only"

        def run(self, func: Func) -> Func:
            return fl.attention(name=func.name)

    PASSES[Reintroduce.name] = Reintroduce
    try:
        with pytest.raises(VerifyError, match="softmax is not legal at this level"):
            fl.run_pipeline(causal(), "decompose-softmax,test-reintroduce")
    finally:
        PASSES.pop(Reintroduce.name)


def test_print_after_options() -> None:
    g = causal()
    out = io.StringIO()
    PassManager(parse_pipeline("decompose-softmax,canonicalize,test-knobs"), print_after_all=True, out=out).run(g)
    text = out.getvalue()
    assert text.count("// ----- IR after") == 3
    assert "// ----- IR after canonicalize   [decompose-softmax, canonicalize] ----- //" in text

    out = io.StringIO()
    PassManager(parse_pipeline("decompose-softmax,canonicalize,test-knobs"), print_after=("canonicalize",), out=out).run(g)
    assert out.getvalue().count("// ----- IR after") == 1

    out = io.StringIO()
    pm = PassManager(parse_pipeline("decompose-softmax,test-knobs"), print_after_change=True, out=out)
    pm.run(g)
    assert out.getvalue().count("// ----- IR after") == 1
    assert [r.changed for r in pm.records] == [True, False]


def test_print_after_unknown_pass() -> None:
    with pytest.raises(FalowerError, match="no pass named fuse"):
        PassManager(parse_pipeline("canonicalize"), print_after=("fuse",))


def test_debug_level_1_reports_pass_times(capsys) -> None:
    PassManager(parse_pipeline("canonicalize"), debug=1).run(causal())
    assert "[falower] canonicalize:" in capsys.readouterr().err
