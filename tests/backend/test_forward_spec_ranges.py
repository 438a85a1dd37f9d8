"""The IR side of the forward kernel for masks that read captured tables (no GPU, no simulator): which tile
iteration from_ir.py picks from fa2-fwd's mask.ranges, and the derived captures it declares."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

import falower as fl  # noqa: E402
from falower.backends.numba_cuda.from_ir import analyse, build_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from data_masks import MASKS  # noqa: E402


def spec(g, pipeline: str = "fa2-fwd"):
    return build_spec(analyse(fl.lower(g, pipeline)), {"D": 64}, "f16", "mma", None)


def test_document_ids_get_range_tables_and_a_block_list():
    s = spec(runpy.run_path(str(ROOT / "examples" / "document.py"))["graph"])
    assert s.block_mask == "list"
    assert [c.derived for c in s.captures] == [(), ("ranges", 0, 1, 64), ("runs", 0, 1), ("kv_count",), ("kv_tiles",)]
    assert "rng_doc_id_runs_1[" in s.device_source  # the row bounds of partial tiles (row_bounds.py)
    assert "rng_doc_id_ranges_1_64[i0_lo_p0, i0_lo_g0, 0]" in s.device_source


def test_tables_read_at_one_point_per_tile_keep_the_in_kernel_scan():
    """thr[h]: its range table (granule 1) is its values; the kernel scans, no list kernel per new data."""
    s = spec(MASKS["threshold"]())
    assert s.block_mask == "static" and [c.derived for c in s.captures][-1] == ("ranges", 0, 0, 1)


def test_masks_the_ranges_cannot_bound_keep_the_dense_table():
    s = spec(MASKS["nested"]())
    assert s.block_mask == "table" and not any(c.derived for c in s.captures)


def test_data_table_keeps_the_dense_table():
    g = runpy.run_path(str(ROOT / "examples" / "document.py"))["graph"]
    s = spec(g, fl.passes.NAMED_PIPELINES["fa2-fwd"].replace("mask-tiles", "mask-tiles{data=table}"))
    assert s.block_mask == "table" and not any(c.derived for c in s.captures)
