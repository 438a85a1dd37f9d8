"""Property test: random integer index expressions (the arithmetic of mask_mods and score_mods: q, kv, h and
constants under + - * // % & | ^ << >> ** 2 ** 3 abs, unary -, min / max, comparisons and bools used as 0 / 1) mean what the
same Python means. Each is traced, interpreted, and compared with Python evaluating the same function on Python
ints, element by element; then used as a mask (`expr % 3 != 0`) through fa2-fwd with --check. The expressions stay
where Python and the IR agree by definition: divisors are nonzero constants of both signs, shift counts 0-7,
magnitudes far below i32's (the IR's wrap, // 0 and shifts past the bits are tested elsewhere)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import falower as fl
from falower.ir import interpret
from falower.passes import PassManager, parse_pipeline

M, N, H = 7, 9, 2


def _fl(fn, py):
    """fl.maximum / minimum where an operand is traced, Python's on two constants."""
    return lambda a, b: py(a, b) if isinstance(a, int) and isinstance(b, int) else fn(a, b)


MAXIMUM, MINIMUM = _fl(fl.maximum, max), _fl(fl.minimum, min)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

leaf = st.one_of(st.sampled_from(["q", "kv", "h"]), st.integers(min_value=-9, max_value=9))
divisor = st.sampled_from([-5, -3, -2, -1, 1, 2, 3, 7])


def _node(sub):
    return st.one_of(
        st.tuples(st.sampled_from(["+", "-", "*", "&", "|", "^", "min", "max", "lt", "ge", "eq"]), sub, sub),
        st.tuples(st.sampled_from(["//", "%"]), sub, divisor),
        st.tuples(st.sampled_from(["<<", ">>"]), sub, st.integers(min_value=0, max_value=7)),
        st.tuples(st.sampled_from(["neg", "abs", "boolmul", "square", "cube"]), sub),
    )


expr = st.recursive(leaf, _node, max_leaves=6)


def evaluate(e, q, kv, h, maximum, minimum):
    """e on q, kv, h (Python ints or traced tensors alike: only operators both take)."""
    if isinstance(e, str):
        return {"q": q, "kv": kv, "h": h}[e]
    if isinstance(e, int):
        return e
    op, *args = e
    x = evaluate(args[0], q, kv, h, maximum, minimum)
    if op == "neg":
        return -x
    if op == "abs":
        return abs(x)
    if op == "boolmul":  # a bool used as 0 / 1
        return (x >= 0) * 3 - x
    if op in ("square", "cube"):  # an integer to a constant power stays an integer
        return x ** (2 if op == "square" else 3)
    y = args[1] if op in ("//", "%", "<<", ">>") else evaluate(args[1], q, kv, h, maximum, minimum)
    return {"+": lambda: x + y, "-": lambda: x - y, "*": lambda: x * y, "&": lambda: x & y, "|": lambda: x | y,
            "^": lambda: x ^ y, "min": lambda: minimum(x, y), "max": lambda: maximum(x, y),
            "lt": lambda: (x < y) * 1, "ge": lambda: (x >= y) * 1, "eq": lambda: (x == y) * 1,
            "//": lambda: x // y, "%": lambda: x % y, "<<": lambda: x << y, ">>": lambda: x >> y}[op]()


def _small(e) -> bool:
    """Every intermediate of e stays far inside i32 on the grid (Python's ints do not wrap)."""
    def walk(t, q, kv, h):
        v = evaluate(t, q, kv, h, max, min)
        if abs(v) > 2 ** 28:
            raise OverflowError
        if isinstance(t, tuple):
            for a in t[1:]:
                if isinstance(a, (tuple, str)):
                    walk(a, q, kv, h)
        return v
    try:
        for q in range(M):
            for kv in range(N):
                for h in range(H):
                    walk(e, q, kv, h)
    except OverflowError:
        return False
    return True


@SETTINGS
@given(e=expr)
def test_an_integer_expression_means_what_the_python_means(e) -> None:
    if not _small(e):
        return
    g = fl.trace(lambda q, kv, h: evaluate(e, q, kv, h, MAXIMUM, MINIMUM) * 1 + q * 0 + kv * 0 + h * 0,
                 name="ix", q=fl.tensor("i32", [1, M, 1]), kv=fl.tensor("i32", [1, 1, N]),
                 h=fl.tensor("i32", [H, 1, 1]))
    qs = np.arange(M, dtype=np.int32).reshape(1, M, 1)
    ks = np.arange(N, dtype=np.int32).reshape(1, 1, N)
    hs = np.arange(H, dtype=np.int32).reshape(H, 1, 1)
    (got,) = interpret(g, [qs, ks, hs])
    want = np.array([[[evaluate(e, q, kv, h, max, min) for kv in range(N)] for q in range(M)] for h in range(H)])
    np.testing.assert_array_equal(np.asarray(got, np.int64), want, err_msg=repr(e))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(e=expr)
def test_an_integer_expression_as_a_mask_survives_fa2_fwd(e) -> None:
    if not _small(e):
        return
    g = fl.attention(mask_mod=lambda b, h, q, kv: (evaluate(e, q, kv, h, MAXIMUM, MINIMUM) + q * 0) % 3 != 0,
                     name="imask")
    pm = PassManager(parse_pipeline("fa2-fwd"), check=True, shapes={"B": 1, "H": H, "M": 23, "N": 19, "D": 4})
    pm.run(g)
    assert all(r.check == "ok" for r in pm.records), [(r.name, r.check) for r in pm.records]
