"""P cast to the inputs' dtype before P @ V (torch code: `softmax(s).to(q.dtype) @ v`; fuse refused it, 'the softmax
result must feed a matmul P @ V', and delta found no dV = P^T dO) is taken into the product as its operand_dtype
(passes/raise_operand_cast.py): the form lowers through fa2-fwd and fa2-bwd with every pass checked, and the raised
graph computes exactly what the written one does, at native precision (both round P) and at f64 (neither)."""

from __future__ import annotations

import numpy as np
import pytest

import falower as fl
from falower.ir import interpret
from falower.passes import PassManager, parse_pipeline
from falower.passes.raise_operand_cast import raise_operand_cast

SHAPES = {"B": 1, "H": 2, "M": 37, "N": 45, "D": 16}


def _graph(dtype: str, cast_to: str) -> fl.Func:
    qkv = {n: fl.tensor(dtype, f"B,H,{'M' if n == 'q' else 'N'},D") for n in "qkv"}

    def castp(q, k, v):
        s = q @ k.mT * 0.25
        return (fl.softmax(s, dim=-1).to(cast_to) @ v).to(dtype)

    return fl.trace(castp, name="castp", result_names=("o",), **qkv)


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa2-bwd"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_p_cast_before_the_product_lowers_and_keeps_its_numbers(dtype: str, pipeline: str) -> None:
    pm = PassManager(parse_pipeline(pipeline), check=True, shapes=SHAPES)
    pm.run(_graph(dtype, dtype))
    assert all(r.check == "ok" for r in pm.records), [(r.name, r.check) for r in pm.records]


@pytest.mark.parametrize("precision", ["native", "f64"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_the_raise_is_exact(dtype: str, precision: str) -> None:
    g = _graph(dtype, dtype)
    raised = fl.parse_func(fl.print_func(g))
    assert raise_operand_cast(raised)
    pv = [op for op in raised.walk() if op.name == "matmul" and not op.attrs.get("transpose_b")]
    assert len(pv) == 1 and pv[0].attrs["operand_dtype"] == dtype and pv[0].operands[0].owner.name == "softmax"
    r = np.random.default_rng(1)
    np_dt = np.float16 if dtype == "f16" else np.float32
    q = r.standard_normal((1, 2, 37, 16)).astype(np_dt)
    k, v = (r.standard_normal((1, 2, 45, 16)).astype(np_dt) for _ in range(2))
    if dtype == "bf16":
        from falower.ir.interp import round_bf16

        q, k, v = (round_bf16(x) for x in (q, k, v))
    (want,) = interpret(g, [q, k, v], precision)
    (got,) = interpret(raised, [q, k, v], precision)
    np.testing.assert_array_equal(got, want)


def test_other_casts_stay() -> None:
    """A cast to another dtype than V's, or of a value that is not f32, is not the tensor cores' rounding."""
    g = _graph("f16", "bf16")  # P in bf16 times an f16 V: not the kernels' product
    assert not raise_operand_cast(fl.parse_func(fl.print_func(g)))
    x = fl.tensor("f64", "M,N")
    y = fl.tensor("f16", "N,D")
    h = fl.trace(lambda x, y: x.to("f16") @ y, name="f64_cast", x=x, y=y)
    assert not raise_operand_cast(h)


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa2-bwd"])
def test_the_lowered_ir_is_the_uncast_forms(pipeline: str) -> None:
    """Once raised, every later pass sees the graph written without the cast: the same lowered IR, op for op."""
    uncast = _graph("f16", "f32")  # .to("f32") of an f32 softmax: no cast at all
    assert "cast %3" not in fl.print_func(uncast)
    want = fl.print_func(fl.lower(uncast, pipeline))
    assert fl.print_func(fl.lower(_graph("f16", "f16"), pipeline)) == want


@pytest.mark.parametrize("pipeline", ["fa2-fwd", "fa2-bwd"])
def test_a_cast_before_a_product_normalized_after_it_checks(pipeline: str) -> None:
    """(e.to(f16) @ v) / sum(e): --check's reference raised the softmax without the cast first, found no softmax
    and could not supply the backward's LSE (a review's find); it now raises what the pipelines raise."""
    def after(q, k, v):
        s = q @ k.mT * 0.25
        e = fl.exp(s - s.amax(dim=-1, keepdim=True))
        return ((e.to("f16") @ v) / e.sum(-1, keepdim=True)).to("f16")

    qkv = {n: fl.tensor("f16", f"B,H,{'M' if n == 'q' else 'N'},D") for n in "qkv"}
    pm = PassManager(parse_pipeline(pipeline), check=True, shapes=SHAPES)
    pm.run(fl.trace(after, name="after_cast", result_names=("o",), **qkv))
    assert all(r.check == "ok" for r in pm.records), [(r.name, r.check) for r in pm.records]
