"""Masks whose tile classifier divides by one value (marked gpu): a chunked causal mask by a captured chunk length,
and a mask by a literal modulus. The kernels' tile_class_fn (from_ir._interval_fn) now bounds a floordiv / mod by
such a value, as the IR's intervals do, where it called every tile partial: tiles it calls empty are skipped and
full ones take no mask, so a wrong bound is a wrong number. FlashAttention's error rule at tile edges (chunks of 1,
a tile less and more than one, the whole row) and M != N."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import falower as fl  # noqa: E402
from falower.passes.check import bind_dims, random_inputs  # noqa: E402
from test_examples_gpu import assert_error_rule, rounded  # noqa: E402

CHUNK = fl.capture("chunk", "i32", ())
GRAPHS = {
    "chunked": fl.attention(name="chunked", mask_mod=lambda b, h, q, kv: (q // CHUNK == kv // CHUNK) & (q >= kv)),
    "mod_literal": fl.attention(name="mod_literal", mask_mod=lambda b, h, q, kv: (q % 96) >= (kv % 96)),
}
COMPILED: dict = {}


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("chunk", [1, 63, 129, 1000])
@pytest.mark.parametrize("M, N", [(1000, 1000), (300, 1000)])
def test_chunked_causal_by_a_captured_chunk(chunk, D, M, N):
    if "chunked" not in COMPILED:
        COMPILED["chunked"] = fl.compile(GRAPHS["chunked"], "numba-cuda")
    g, c = GRAPHS["chunked"], COMPILED["chunked"]
    env = bind_dims(g, {"B": 1, "H": 3, "M": M, "N": N, "D": D})
    host = [rounded(x, "f16") for x in random_inputs(g, env, seed=chunk + D)[:3]] + [np.array(chunk, np.int32)]
    assert_error_rule(g, c, env, host, "f16")


@pytest.mark.parametrize("D", [64, 128])
def test_a_mask_by_a_literal_modulus(D):
    g = GRAPHS["mod_literal"]
    c = COMPILED.setdefault("mod_literal", fl.compile(g, "numba-cuda"))
    env = bind_dims(g, {"B": 1, "H": 2, "M": 700, "N": 900, "D": D})
    assert_error_rule(g, c, env, [rounded(x, "f16") for x in random_inputs(g, env, seed=D)], "f16")
