"""Data-dependent masks classified from mask.ranges, in the CUDA simulator (no GPU): the block list the
runtime makes is sound against a brute force over every (q, kv) pair and equal to the IR's mask.classify on
tiles inside the bounds, at sizes around the tiles and on every kind of ids (sorted, unsorted, constant, all
distinct, all padding); the forward kernel visiting it gives the reference's numbers. Cases run in one
subprocess (the simulator must be on before numba.cuda is imported): block_list_cases.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import run_cases  # noqa: E402
from block_list_cases import FWD_CASES, LIST_CASES, fwd_id, list_id  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases("block_list_cases.py", tmp_path_factory.mktemp("kernels"))


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
