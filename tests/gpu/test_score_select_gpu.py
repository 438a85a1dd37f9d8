"""A score that selects on a condition of its own (marked gpu): `where(h % 2 == 0, s, s / 2)` failed to compile (the
lazy select's search read a region argument's owner as an op, now online_softmax.lazy_max_threshold), and a GQA score that selects on
the query row (`s + where(q >= kv, 0, -inf)`) is the score's, so falower.compile leaves it unpacked
(pack_gqa.score_reads_query_index). FlashAttention's error rule, M != N."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import falower as fl  # noqa: E402
from falower.passes.check import bind_dims, random_inputs  # noqa: E402
from test_examples_gpu import assert_error_rule, rounded  # noqa: E402

GRAPHS = {
    "half_heads": fl.attention(name="half_heads", score_mod=lambda s, b, h, q, kv: fl.where(h % 2 == 0, s, s * 0.5)),
    "row_select_gqa": fl.attention(name="row_select_gqa", group_size=4,
                                   score_mod=lambda s, b, h, q, kv: s + fl.where(q >= kv, 0.0, float("-inf"))),
}
COMPILED: dict = {}


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name, M, N", [("half_heads", 300, 1000), ("row_select_gqa", 1, 3000),
                                        ("row_select_gqa", 200, 200)])
def test_a_score_with_its_own_select(name, M, N, D):
    g = GRAPHS[name]
    c = COMPILED.setdefault(name, fl.compile(g, "numba-cuda"))
    env = bind_dims(g, {"B": 2, "H": 4, "HKV": 2, "M": M, "N": N, "D": D})
    if name == "row_select_gqa":
        assert c.packed_for(env) is None
    assert_error_rule(g, c, env, [rounded(x, "f16") for x in random_inputs(g, env, seed=M + D)], "f16")
