"""split-kv on the numba-cuda backend in the CUDA simulator (split_kv_sim_cases.py): the persistent warp-specialized
kernel with a part index in its work items and the LSE merge after it, through falower.compile on the split-kv IR,
against the float64 reference of the unsplit graph. Cases: shares of one kv tile and empty parts (more parts than
tiles), rows no key sees, ALiBi's column term and kv order, the relative bias's runs of the table, three consumer
warpgroups with the short q tile first, GQA at D = 128, two batches on three blocks, one consumer warpgroup on
decoding's 64-row q tiles (plain, ALiBi, the relative bias; causal on four of them, a small prefill grid's), their
q tiles' last parts merging in the kernel (extra fused_merge) and not, a kernel asked to merge in a cluster (run
without it: Numba launches no clusters). A share that visits a tile twice moves LSE by
up to log 2, one that skips a tile moves O: both far past the tolerances."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import assert_forward_close, collect, spawn  # noqa: E402
from split_kv_sim_cases import CASES  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect(spawn("split_kv_sim_cases.py", tmp_path_factory.mktemp("kernels")))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_split_kernel_and_its_merge_match_the_reference(results, case):
    r = results.get(case)
    assert_forward_close(r)
    stem, M, N, D, (bq, bk), P, dt, ragged, *more = CASES[case]
    assert r["kv_parts"] == P and r["shares"], r  # the kernel took the parts (and shares its range by them)
    assert r["ragged_first"] == (ragged == "first"), r
    asked = more[0] if more else {}
    assert r["fused"] == bool(asked.get("fused_merge") or asked.get("cluster_merge")), r  # in the kernel where asked
    assert r["cluster"] == (P if asked.get("cluster_merge") else 0), r  # (run without it: the simulator has none)
    assert r["stages"] == asked.get("stages", 2), r  # the ring the case asked for
    assert r["blocks_per_sm"] == asked.get("blocks_per_sm", 1), r  # two blocks an SM where asked (decoding's tiles)
    assert r["lse_inf_ok"], r  # rows no key sees: LSE -inf (and O 0, in o_err) after the merge
    if case == "window-p2-unseen-rows":  # rows q >= N + 47 see no key (keys q - 47 .. q), in both heads
        assert r["masked_rows"] == 2 * (M - (N + 47)), r
