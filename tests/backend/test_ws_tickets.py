"""The persistent kernel's tickets (emit_fa3_ws, item_order "dynamic"): a block's first item is its own, the
counter's draws the rest, and every item is drawn once (no GPU needed)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_split_kv_kernel import PWG, _spec  # noqa: E402

from falower.backends.numba_cuda import emit_fa3_ws  # noqa: E402


def test_a_blocks_first_item_is_its_own_and_the_counter_gives_the_rest():
    """emit_fa3_ws.own_first_item (item_order "dynamic"): block c's first ticket is c, each later one the counter's
    draw plus gridDim.x, so the tickets are every item once (0 .. gridDim.x - 1 by the blocks, the rest by the
    counter in order) and no block that starts early takes a late block's first item. extra own_first_item False
    draws every ticket from the counter."""
    spec = _spec("plain", 1)
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    assert emit_fa3_ws.own_first_item(spec)
    assert "tk_next = cuda.blockIdx.x  # the block's first item" in src
    assert "tk_next = cuda.atomic.add(work, 0, 1) + cuda.gridDim.x  # the next item's ticket" in src
    old = emit_fa3_ws.emit_fa3_ws_forward(_spec("plain", 1, {**PWG, "own_first_item": False}))
    assert "tk_next = cuda.blockIdx.x" not in old and "+ cuda.gridDim.x" not in old
    assert not emit_fa3_ws.own_first_item(_spec("plain", 1, {**PWG, "item_order": "grid"}))
    # the tickets of a launch of G blocks over T items, blocks drawing in any order: each item once
    for G, T in ((4, 3), (4, 4), (4, 11), (132, 128), (132, 2048)):
        rng, counter, tickets = random.Random(G * T), 0, []
        live = [[c] for c in range(G)]  # each block's tickets so far (its first, its own)
        while live:
            b = rng.choice(live)
            if b[-1] >= T:  # past the last item: the block is done
                tickets += b[:-1]
                live.remove(b)
                continue
            b.append(counter + G)
            counter += 1
        assert sorted(tickets) == list(range(T)), (G, T)
