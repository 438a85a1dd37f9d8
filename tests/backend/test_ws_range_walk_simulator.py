"""The warp-specialized forward walking its kv range (emit_fa2.walks_range): under a static mask with row bounds
the kernel visits every tile of [kv_first, kv_last] and takes a tile's class from where it lies, with no
tile_class_fn in the kv loop. Run through falower.compile in the CUDA simulator against the float64 reference
(ws_sim_cases.py's WALK_CASES: causal on the persistent kernel, with and without the producer warpgroup, whose
producer scans each item's range and hands it over (emit_fa3_ws.range_shared), a window on it, with the producer
storing O by bulk copies (bulk_store) and without, a window one block an item, and a mask with empty tiles inside its range); and the
emitted source, which says where tile_class_fn is still evaluated."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import FORWARD_O_TOL, collect, spawn  # noqa: E402
from ws_sim_cases import WALK_CASES  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collect(spawn("ws_sim_cases.py", tmp_path_factory.mktemp("kernels"), [*WALK_CASES]))


@pytest.mark.parametrize("case", sorted(WALK_CASES))
def test_walking_the_range_matches_the_reference(results, case):
    r = results.get(case)
    assert r is not None and "error" not in r, r
    assert r["walks"], r  # the kernel took the path under test
    extra = WALK_CASES[case][-1]
    pwg = extra.get("producer") == "warpgroup"  # the persistent producer kernel's own paths
    assert r["range_shared"] == r["q_double"] == pwg and r["bulk_store"] == (pwg and extra.get("bulk_store", True)), r
    assert r["kv_reverse"] == bool(extra.get("kv_reverse")), r  # (the tiles from the last down)
    assert not r["nan"], r
    assert r["o_err"] <= FORWARD_O_TOL[r["dtype"]] and r["lse_err"] <= 1e-3, r
    assert r["lse_inf_ok"], r  # rows that see nothing (the gaps mask: none here) keep LSE = -inf


def _ws_source(example: str) -> str:
    import falower as fl

    g = runpy.run_path(str(HERE.parents[1] / "examples" / f"{example}.py"))["graph"]
    c = fl.compile(g, "numba-cuda", extra={"schedule": "wgmma-ws", "producer": "none"})
    return c.specialize("f16", D=128).source


@pytest.mark.parametrize("example", ["causal", "sliding_window", "prefix_lm"])
def test_the_kv_loop_does_not_classify_tiles(example):
    """tile_class_fn runs in the scan before the loop only: the next tile is j + 1, a tile's class where it lies."""
    src = _ws_source(example)
    body = src.split("while j <= kv_last:", 1)[1]
    assert "kf_first" in src and "warp_sum(" in src
    assert "tile_class_fn(" not in body and "next_tile(" not in src
    assert "jn = j + 1" in body and "(2 if kf_first <= j and j <= kf_last else 1)" in body


@pytest.mark.parametrize("persistent", [False, True])
def test_class32_is_one_unsigned_compare_against_the_items_full_tiles(persistent):
    """class32 (off by default): need_mask compares j - kf_first, in 32 bits, with kf_n, the item's full tiles
    inside N (set once an item, beside kf_first / kf_last: after the scan, or where the producer's range is handed
    over); the kv loop keeps no 64-bit class nor the N bound. The simulator's walk-causal-c32 cases hold its
    numbers, the ragged last tile full by the mask among them."""
    import falower as fl

    g = runpy.run_path(str(HERE.parents[1] / "examples" / "causal.py"))["graph"]
    form = {"producer": "warpgroup", "persistent": 132, "item_order": "dynamic"} if persistent else \
        {"producer": "none"}
    src = fl.compile(g, "numba-cuda", extra={"schedule": "wgmma-ws", **form, "class32": True}).specialize(
        "f16", D=128).source
    loops = src.split("while j <= kv_last")
    consumer = loops[-1]
    need = re.findall(r"need_mask(?:__\d+)? = (.*)", consumer)
    assert need and all(re.fullmatch(r"np\.uint32\(np\.int32\(j\) - np\.int32\(kf_first(__\d+)?\)\) >= "
                                     r"np\.uint32\(kf_n(__\d+)?\)", n) for n in need), need
    bk = re.search(r"kv0(?:__\d+)? = j \* (\d+)", consumer).group(1)
    sets = re.findall(rf"kf_n(?:__\d+)? = np\.int32\(max\(min\(kf_last(?:__\d+)?, N // {bk} - 1\) - kf_first", src)
    assert sets and not re.search(r"kf_n(__\d+)? = ", consumer), sets  # once an item, not in the kv loop
    default = fl.compile(g, "numba-cuda", extra={"schedule": "wgmma-ws", **form}).specialize("f16", D=128).source
    assert "kf_n" not in default and "(2 if kf_first" in default


def test_masks_without_row_bounds_keep_the_search():
    """A static mask that is not one interval a row (kv in two disjoint bands) keeps the search and the
    classification in the loop (an empty tile inside its range is skipped, not walked)."""
    import falower as fl

    def bands(b, h, q_idx, kv_idx):
        return (kv_idx < 64) | ((kv_idx >= 512) & (kv_idx <= q_idx))

    c = fl.compile(fl.attention(mask_mod=bands, name="bands"), "numba-cuda",
                   extra={"schedule": "wgmma-ws", "producer": "none"})
    src = c.specialize("f16", D=128).source
    assert "kf_first" not in src and "next_tile(" in src
