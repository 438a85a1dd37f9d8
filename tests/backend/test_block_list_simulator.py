"""Data-dependent masks classified from mask.ranges, in the CUDA simulator (no GPU): the block list the
runtime makes is sound against a brute force over every (q, kv) pair and equal to the IR's mask.classify on
tiles inside the bounds, at sizes around the tiles and on every kind of ids (sorted, unsorted, constant, all
distinct, all padding); the forward kernel visiting it gives the reference's numbers; the backward visiting
its own lists gives the backward IR's gradients; a mask the range analysis cannot bound evaluates its dense
block table once per distinct data; the run table kernel equals the host's. Cases run in two subprocesses (the simulator must be on before
numba.cuda is imported): block_list_cases.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import collect, spawn  # noqa: E402
from block_list_cases import (BWD_CASES, FWD_CASES, LIST_CASES, RUN_CASES, TABLE_CASES, bwd_id, fwd_id,  # noqa: E402
                              list_id, run_id, table_id)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Two processes (two cores on CI): the forward's list and kernel cases; the backward's and the table's."""
    first = [list_id(c) for c in LIST_CASES] + [fwd_id(c) for c in FWD_CASES]
    second = [bwd_id(c) for c in BWD_CASES] + [table_id(c) for c in TABLE_CASES] + [run_id(*c) for c in RUN_CASES]
    procs = [spawn("block_list_cases.py", tmp_path_factory.mktemp("kernels"), ids) for ids in (first, second)]
    out: dict = {}
    for p in procs:
        out.update(collect(p))
    return out


@pytest.mark.parametrize("case_id", [list_id(c) for c in LIST_CASES])
def test_block_list_is_sound_and_the_irs(results, case_id):
    r = results[case_id]
    assert "error" not in r, r.get("where", r.get("error"))
    assert r["sound"], r  # no non-empty tile left out, no tile called full that is not
    assert r["ascending"], r
    assert r["differ_from_ir"] == 0, r  # the kernel's classes are mask.classify's


def test_sorted_document_ids_skip_tiles(results):
    """Sorted ids at 65 x 65: the list leaves tiles out (what makes a document mask cheap), and some row
    skips an empty tile between two it visits somewhere in the cases (the list, not a [first, last] range)."""
    r = results["list-document-sorted-65x65"]
    assert r["skipped"] > 0 and r["visited"] >= r["exact_nonempty"]
    assert any(x.get("holes", 0) > 0 for x in results.values())
    assert results["fwd-document-sorted-9x40-mma"]["holes"] > 0  # the forward walks a list with a gap


@pytest.mark.parametrize("case_id", [fwd_id(c) for c in FWD_CASES])
def test_forward_over_the_block_list(results, case_id):
    r = results[case_id]
    assert "error" not in r, r.get("where", r.get("error"))
    assert r["block_mask"] == ("static" if "threshold" in case_id else "list")
    assert not r["nan"], r
    assert r["o_err"] <= 4e-3, r
    assert r["lse_err"] <= 1e-4, r
    assert r["lse_inf_ok"], r
    if "nothing" in case_id:
        assert r["masked_rows"] > 0


@pytest.mark.parametrize("case_id", [bwd_id(c) for c in BWD_CASES])
def test_backward_over_the_block_lists(results, case_id):
    """The document backward visiting its lists (per kv tile the q tiles; dq=det: per q tile the kv tiles too)
    gives the backward IR's gradients (float64 interpreter) on ragged sizes and every kind of ids."""
    r = results[case_id]
    assert "error" not in r, r.get("where", r.get("error"))
    assert r["block_mask"] == "list", r
    for name, g in r["grads"].items():
        assert g["shape_ok"] and not g["nan"], (name, g)
        assert g["err"] <= 4e-3 * max(1.0, g["scale"]), (name, g)
    assert r["masked_dq_zero"], r
    if "nothing" in case_id:
        assert r["masked_rows"] == 2 * 20 and r["skipped"] > 0  # all padding: nothing visited, gradients zero
    if "-det" in case_id:
        assert r["same_bits"], r
    if "sorted" in case_id and "unsorted" not in case_id:
        assert r["skipped"] > 0 and r["holes"] > 0  # the list leaves tiles out, with gaps inside a row


@pytest.mark.parametrize("case_id", [table_id(c) for c in TABLE_CASES])
def test_dense_block_table_once_per_data(results, case_id):
    """A mask the range analysis cannot bound: the dense table is evaluated once for two calls with the same
    data and again after an in-place write, the numbers the reference's each time (fully masked rows too)."""
    r = results[case_id]
    assert "error" not in r, r.get("where", r.get("error"))
    assert r["block_mask"] == "table", r
    assert r["evaluations"] == [1, 1, 2], r
    assert all(e <= 4e-3 for e in r["errs"]), r
    assert r["masked_rows"] > 0, r
    if case_id.endswith("-bwd"):
        assert r["bwd_block_mask"] == "table" and r["bwd_evaluations"] == 1 and r["bwd_same"], r


@pytest.mark.parametrize("n,rcap", RUN_CASES)
def test_the_run_table_kernel_is_the_host_table(results, n, rcap):
    """block_data.RUN_TABLE_SOURCE (what a torch call's new ids run) equals run_table_host on every kind of ids,
    at lengths around its 128 threads: sorted documents then padding, a document coming back, constant, all
    distinct, descending, random, two runs; the kinds whose values come back are the inexact ones (-1). With its
    list of runs' values cut to 4 (rcap), the slices with more runs list them in global memory. (The simulator's
    threads do not interleave inside thread 0's scans, so the barrier after them is guarded on the GPU only.) The range table
    kernel (the least and greatest id of each granule) equals intervals.minmax_table at granules 1, 5, 64, 128."""
    r = results[run_id(n, rcap)]
    assert "error" not in r, r.get("where", r.get("error"))
    assert not any(r["differ"].values()), r
    assert not any(r["ranges_differ"].values()), r  # the range table kernel's, granules 1 to 128
    if n > 100:
        assert not r["exact"]["unsorted"] and not r["exact"]["random"] and r["exact"]["sorted"], r
