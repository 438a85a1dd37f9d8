"""tile{ragged_q=first}: the q tiles end at row M, so the tile M leaves short is the first one (its rows before 0
load zeros and produce no output). Every pass still preserves the numbers at the sizes where tiles go wrong, the
dump reads back, the cost model counts the traffic of M rows and, under causal masks, less visited work; masks that
classify from captured tables (per q tile of rows i * bq) are refused with the precondition named."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import falower as fl
from falower.errors import PassError
from falower.ir import Func, interpret, parse_func, print_func
from falower.passes import NAMED_PIPELINES, PassManager, parse_pipeline, run_pipeline
from falower.passes.check import bind_dims, random_inputs
from falower.passes.cost import cost_of

ROOT = Path(__file__).resolve().parent.parent
FIRST = "decompose-softmax,canonicalize,fuse,tile{bq=32,bk=16,ragged_q=first},online-softmax{exp2=true},mask-tiles," \
        "canonicalize"
STATIC = ["plain", "causal", "alibi", "prefix_lm", "sliding_window", "softcap", "gqa", "naive_tensor_code",
          "relative_bias", "bias"]


def load(stem: str) -> Func:
    return next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, Func))


def wide(ragged: str) -> str:
    return NAMED_PIPELINES["fa2-fwd"].replace("tile{bq=128,bk=64}", f"tile{{bq=192,bk=128,ragged_q={ragged}}}")


FA1_FIRST = "decompose-softmax,canonicalize,fuse,tile{bq=32,bk=16,order=fa1,ragged_q=first},online-softmax,canonicalize"


@pytest.mark.parametrize("stem", STATIC)
@pytest.mark.parametrize("M, N", [(1, 1), (2, 93), (31, 17), (32, 32), (33, 65), (77, 93), (93, 77)])
@pytest.mark.parametrize("pipeline", [FIRST, FA1_FIRST], ids=["fa2", "fa1"])
def test_every_pass_preserves_numbers(stem: str, M: int, N: int, pipeline: str) -> None:
    """Sizes 1, 2, a tile minus one, a tile, a tile plus one, M != N both ways: the first tile is short (or whole
    at 32), its rows before 0 padding; both loop orders (fa1's online-softmax reads and writes O, l and m at the
    shifted q0)."""
    pm = PassManager(parse_pipeline(pipeline), check=True, shapes={"M": M, "N": N})
    pm.run(load(stem))
    assert [r.check for r in pm.records] == ["ok"] * len(pm.records), [(r.name, r.check) for r in pm.records]


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 200), N=st.integers(1, 200), bq=st.sampled_from([16, 32, 48, 64]))
def test_causal_matches_the_last_ragged_tiling(M: int, N: int, bq: int) -> None:
    """Either tiling gives the reference's O and LSE under causal (fully masked rows where M > N included)."""
    g = load("causal")
    env = bind_dims(g, {"B": 1, "H": 2, "M": M, "N": N, "D": 8})
    xs = random_inputs(g, env, seed=M * 7 + N)
    want = interpret(g, xs)
    for ragged in ("first", "last"):
        low = run_pipeline(g, FIRST.replace("bq=32", f"bq={bq}").replace("first", ragged))
        got = interpret(low, xs)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=2e-3, atol=2e-3)


def test_the_dump_names_the_pad_and_reads_back() -> None:
    text = print_func(run_pipeline(load("causal"), wide("first")))
    assert "%q_pad = const cdiv(M, 192)*192-M : i32" in text and "%q0 = sub %" in text
    assert print_func(parse_func(text)) == text


def test_cost_counts_m_rows_and_less_causal_work() -> None:
    """At M = N = 4k on 192 x 128 tiles causal visits 5.5% less work with the short tile first, plain the same;
    the bytes of Q and O moved are M rows either way."""
    dims = {"B": 1, "H": 1, "M": 4096, "N": 4096, "D": 64}
    for stem, ratio in (("causal", 0.9453), ("prefix_lm", 0.9453), ("plain", 1.0)):
        first, last = (cost_of(run_pipeline(load(stem), wide(r)), dims) for r in ("first", "last"))
        assert first.flops / last.flops == pytest.approx(ratio, abs=2e-4), stem
        assert first.elems_read["%q"] == last.elems_read["%q"] == 4096 * 64, stem  # Q read once: M rows
        assert first.elems_written == last.elems_written, stem


def test_masks_read_from_tables_are_refused() -> None:
    with pytest.raises(PassError, match=r"tile\{ragged_q=first\} starts its tiles elsewhere"):
        run_pipeline(load("document"), FIRST)


def test_a_bad_option_is_named() -> None:
    with pytest.raises(Exception, match="ragged_q must be one of last, first"):
        run_pipeline(load("causal"), FIRST.replace("ragged_q=first", "ragged_q=middle"))
