"""Every example: golden dumps (traced and lowered), print/parse round trips, and per-pass numerical checks.

Regenerate the golden files with `FALOWER_UPDATE_GOLDEN=1 python -m pytest tests/test_examples.py`
and review the diff: the printer is the spec of how IR looks.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import falower as fl
from falower.cli import select_graph
from falower.ir import interpret, parse_func, print_func
from falower.passes import PassManager, parse_pipeline
from falower.passes.check import Reference

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
GOLDEN = Path(__file__).resolve().parent / "golden"
PIPELINE = "decompose-softmax,canonicalize"
UPDATE = os.environ.get("FALOWER_UPDATE_GOLDEN") == "1"
VARIANTS = ["alibi", "bias", "causal", "document", "gqa", "naive_tensor_code", "plain", "prefix_lm",
            "relative_bias", "sliding_window", "softcap"]


def example(stem: str) -> fl.Func:
    return select_graph(ROOT / "examples" / f"{stem}.py", None)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"missing golden file {path}; run with FALOWER_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{name} differs from its golden dump (FALOWER_UPDATE_GOLDEN=1 regenerates)"


def test_every_variant_has_an_example() -> None:
    assert [p.stem for p in EXAMPLES] == VARIANTS


@pytest.mark.parametrize("stem", VARIANTS)
def test_example_defines_one_graph_named_after_its_file(stem: str) -> None:
    g = example(stem)
    assert g.name == stem
    assert g.result_names == ["o"]
    fl.verify(g)


@pytest.mark.parametrize("stem", VARIANTS)
def test_golden_traced(stem: str) -> None:
    check_golden(f"{stem}.traced.fl", print_func(example(stem)))


@pytest.mark.parametrize("stem", VARIANTS)
def test_golden_lowered(stem: str) -> None:
    lowered = fl.run_pipeline(example(stem), PIPELINE)
    text = print_func(lowered)
    assert "softmax" not in text.replace("decompose-softmax", "")
    check_golden(f"{stem}.lowered.fl", text)


@pytest.mark.parametrize("stem", VARIANTS)
@pytest.mark.parametrize("level", ["traced", "lowered"])
def test_print_parse_round_trip(stem: str, level: str) -> None:
    g = example(stem)
    if level == "lowered":
        g = fl.run_pipeline(g, PIPELINE)
    text = print_func(g)
    again = parse_func(text)
    fl.verify(again)
    assert print_func(again) == text


@pytest.mark.parametrize("stem", VARIANTS)
def test_parsed_dump_computes_the_same_numbers(stem: str) -> None:
    """The parser rebuilds semantics, not only text: the reparsed graph gives bit-identical outputs."""
    g = example(stem)
    again = parse_func(print_func(g))
    ref = Reference.build(g, {"B": 1, "H": 2, "HKV": 1, "M": 9, "N": 11, "D": 4})
    a = interpret(g, ref.inputs, "native", ref.env)
    b = interpret(again, ref.inputs, "native", ref.env)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.skipif("fa2-fwd" not in fl.passes.NAMED_PIPELINES, reason="fa2-fwd is not registered")
@pytest.mark.parametrize("stem", VARIANTS)
def test_fa2_dump_round_trips_and_computes_the_same(stem: str) -> None:
    """The tiled, online-softmax, mask-classified level prints, parses back and means the same."""
    lowered = fl.run_pipeline(example(stem), "fa2-fwd")
    text = print_func(lowered)
    again = parse_func(text)
    fl.verify(again)
    assert print_func(again) == text
    ref = Reference.build(lowered, {"B": 1, "H": 2, "HKV": 1, "M": 70, "N": 75, "D": 4})
    for x, y in zip(interpret(lowered, ref.inputs, "native", ref.env), interpret(again, ref.inputs, "native", ref.env)):
        np.testing.assert_array_equal(x, y)


SHAPES = [None, {"B": 1, "H": 2, "HKV": 1, "M": 70, "N": 70, "D": 8}, {"B": 1, "H": 1, "HKV": 1, "M": 1, "N": 3, "D": 4}]


@pytest.mark.parametrize("stem", VARIANTS)
@pytest.mark.parametrize("shapes", SHAPES, ids=["default", "square", "tiny"])
def test_each_pass_preserves_numbers(stem: str, shapes) -> None:
    pm = PassManager(parse_pipeline(PIPELINE), check=True, shapes=shapes)
    pm.run(example(stem))
    assert [r.name for r in pm.records] == ["decompose-softmax", "canonicalize"]
    assert [r.check for r in pm.records] == ["ok", "ok"]
    assert pm.records[0].changed


@pytest.mark.skipif("fa2-fwd" not in fl.passes.NAMED_PIPELINES, reason="fa2-fwd is not registered")
@pytest.mark.parametrize("stem", VARIANTS)
@pytest.mark.parametrize("shapes", SHAPES, ids=["default", "square", "tiny"])
def test_each_fa2_pass_preserves_numbers(stem: str, shapes) -> None:
    pm = PassManager(parse_pipeline("fa2-fwd"), check=True, shapes=shapes)
    pm.run(example(stem))
    assert len(pm.records) == len(parse_pipeline("fa2-fwd"))
    assert all(r.check == "ok" for r in pm.records)


def test_document_example_has_fully_masked_rows_that_give_zero() -> None:
    """--check's int tables end in -1 (padding): those query rows see no key and must output exactly 0."""
    g = example("document")
    ref = Reference.build(g, {"B": 2, "H": 1, "M": 20, "N": 20, "D": 4})
    doc = ref.inputs[3]
    padded = doc < 0
    assert padded.any() and (~padded).any()
    for graph in (g, fl.run_pipeline(g, PIPELINE)):
        (o,) = interpret(graph, ref.inputs, "native", ref.env)
        assert not np.isnan(o).any()
        for b in range(2):
            rows = np.nonzero(padded[b])[0]
            assert np.all(o[b, :, rows, :] == 0)
            live = np.nonzero(~padded[b])[0]
            assert np.abs(o[b, :, live, :]).max() > 0


def test_gqa_heads_share_kv() -> None:
    """Query heads 0..3 share kv head 0: with identical queries those four heads give identical outputs."""
    g = example("gqa")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 8, 5, 4)).astype(np.float16)
    q[:, 0:4] = q[:, 0:1]
    k = rng.standard_normal((1, 2, 6, 4)).astype(np.float16)
    v = rng.standard_normal((1, 2, 6, 4)).astype(np.float16)
    (o,) = interpret(g, [q, k, v])
    for h in range(1, 4):
        np.testing.assert_array_equal(o[:, h], o[:, 0])
    assert not np.allclose(o[:, 4], o[:, 0])


def test_causal_example_matches_numpy_attention() -> None:
    """The traced graph means what attention means: compare with a direct numpy float64 computation."""
    g = example("causal")
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 7, 4)) for _ in range(3))
    (o,) = interpret(g, [q, k, v])
    s = q @ np.swapaxes(k, -1, -2) / 2.0
    s = np.where(np.tril(np.ones((7, 7), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(o, p @ v, rtol=1e-12, atol=1e-12)
