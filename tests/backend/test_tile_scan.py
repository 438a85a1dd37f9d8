"""The first / last non-empty kv tile found by a ballot over 32 tiles at a time (emit_fa2.emit_tile_scan) equals
the serial scan's answer on every lane: counts of 1, 2, a chunk minus one / plus one, several chunks, none
non-empty, gaps inside the range, and random classes; and the wgmma kernels' scan (`uniform`: each lane's own
tiles, then one warp_min / warp_max) the same. The ballot and the bit intrinsics run as the simulator's
emulations; their PTX is checked by test_ptx's kernels (vote.sync.ballot in the masked forward)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulated import collect, spawn  # noqa: E402
from tile_scan_cases import CASES  # noqa: E402


@pytest.fixture(scope="module")
def results():
    return collect(spawn("tile_scan_cases.py"), timeout=600)


def test_every_case_ran(results):
    assert set(CASES) <= set(results) and {c + "-uniform" for c in CASES} <= set(results)
    assert len(results) == 2 * (len(CASES) + 6)


@pytest.mark.parametrize("cid", [c + u for c in sorted(CASES) + [f"random-{i}" for i in range(6)]
                                 for u in ("", "-uniform")])
def test_scan_matches_the_serial_scan(results, cid):
    base, uniform = cid.removesuffix("-uniform"), cid.endswith("-uniform")  # random ids also carry their count
    r = next(v for k, v in results.items() if k.endswith("-uniform") == uniform
             and (k.removesuffix("-uniform") == base or k.startswith(base + "-")))
    assert r["got"] == [r["want"]], r  # every lane the same answer, the serial one


@pytest.mark.parametrize("path, block_q", [("simt", 32), ("mma", 64)])
def test_forward_kernels_scan_by_ballot(path, block_q):
    from variants import make_spec

    from falower.backends.numba_cuda.emit_fa2 import emit_fa2_forward

    src = emit_fa2_forward(make_spec("causal", 64, "f16", path=path, block_q=block_q, block_k=16,
                                     num_warps=max(1, block_q // 16)))
    assert "live = ballot(" in src


def test_blocks_of_partial_warps_keep_the_serial_scan():
    """A ballot names all 32 lanes: a block of 16 threads (the SIMT dQ kernel, one thread a q row, block_q 16)
    would wait for lanes that do not exist (undefined on the GPU; the simulator's backward cases hung), so
    `warp_wide=False` keeps the serial scan (emit_fa2_bwd passes block_q % 32 == 0)."""
    from falower.backends.numba_cuda.emit_fa2 import _Code, emit_tile_scan

    c = _Code()
    emit_tile_scan(c, lambda j: f"cls[{j}]", "n", "first", "last", warp_wide=False)
    text = c.text()
    assert "ballot" not in text and "for jt in range(n):" in text
