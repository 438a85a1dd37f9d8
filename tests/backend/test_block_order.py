"""The 3-D grids' block order (emit_fa2.grid_3d / emit_program_index): every (q tile, head, batch) exactly once,
and, in the order the hardware hands blocks out (x fastest), the heaviest q tiles of a batch's heads first under a
block mask, one (b, h)'s q tiles together without. A persistent kernel's walk of its items (emit_persistent_start /
_next / _index, item_order "grid" or "cost") likewise. The emitted lines are run as Python here, no GPU needed."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from falower.backends.numba_cuda.emit_fa2 import (
    MAX_GRID_Y,
    _Code,
    emit_persistent_index,
    emit_persistent_next,
    emit_persistent_start,
    emit_program_index,
    grid_3d,
    heads_first,
    item_order,
)
from tests.backend.variants import make_spec


def _spec(variant: str, **extra):
    spec = make_spec(variant, 64)
    spec.extra.update(extra)
    return spec


def _dispatch(spec, nq: int, B: int, H: int) -> list[tuple[int, int, int]]:
    """(qt, h, b) of every block in the order the grid's blocks go out (x fastest, then y, then z)."""
    c = _Code()
    emit_program_index(c, spec)
    code = compile(c.text(), "<program index>", "exec")
    gx, gy, gz = grid_3d(spec, nq, B, H)
    out = []
    for z in range(gz):
        for y in range(gy):
            for x in range(gx):
                env = {"nq": nq, "cuda": SimpleNamespace(blockIdx=SimpleNamespace(x=x, y=y, z=z))}
                exec(code, env)
                out.append((env["qt"], env["h"], env["b"]))
    return out


@pytest.mark.parametrize("variant,heads", [("causal", True), ("plain", False)])
@pytest.mark.parametrize("batch_inner", [False, True])
@pytest.mark.parametrize("nq,B,H", [(1, 1, 1), (5, 2, 3), (2, 3, 1), (7, 1, 4)])
def test_every_block_once_in_order(variant, heads, batch_inner, nq, B, H) -> None:
    spec = dataclasses.replace(_spec(variant), batch_inner=batch_inner)
    assert heads_first(spec) is heads
    seen = _dispatch(spec, nq, B, H)
    assert sorted(seen) == sorted((qt, h, b) for qt in range(nq) for h in range(H) for b in range(B))
    outer = [s[1] if batch_inner else s[2] for s in seen]  # the slowest index: one group each
    assert outer == sorted(outer)
    for g in set(outer):
        qts = [s[0] for s in seen if (s[1] if batch_inner else s[2]) == g]
        if heads:  # heaviest first across the group: every q tile of every head before the next lighter one
            assert qts == sorted(qts, reverse=True)
        else:  # one (b, h) at a time, its q tiles heaviest first
            inner = [s[2] if batch_inner else s[1] for s in seen if (s[1] if batch_inner else s[2]) == g]
            assert inner == sorted(inner)
            assert all(qts[i:i + nq] == list(range(nq - 1, -1, -1)) for i in range(0, len(qts), nq))


def test_head_group_one_keeps_the_old_order_under_a_mask() -> None:
    """`-hg1` on a bench config: the same-call comparison with the order before heads-first."""
    spec = _spec("causal", head_group=1)
    assert not heads_first(spec)
    assert grid_3d(spec, 6, 2, 3) == (6, 3, 2)


def test_too_many_q_tiles_for_the_grid_is_a_clear_error() -> None:
    spec = _spec("causal")
    with pytest.raises(ValueError, match="grid's y limit"):
        grid_3d(spec, MAX_GRID_Y + 1, 1, 1)
    assert grid_3d(spec, MAX_GRID_Y, 1, 1) == (1, MAX_GRID_Y, 1)


def _walks(spec, blocks: int, nq: int, B: int, H: int) -> list[list[tuple[int, int, int]]]:
    """Per block of a persistent launch, the (qt, h, b) of the items it takes, in its order."""
    c = _Code()
    emit_persistent_start(c, spec)
    c("while True:")
    with c.indent():
        emit_persistent_index(c, spec)
        c("if not it_ok:")
        with c.indent():
            c("break")
        c("walk.append((qt, h, b))")
        emit_persistent_next(c, spec)
    code = compile(c.text(), "<persistent walk>", "exec")
    out = []
    for x in range(blocks):
        env = {"nq": nq, "B": B, "H": H, "walk": [], "min": min, "div_u32": lambda a, n: a // n,
               "cuda": SimpleNamespace(blockIdx=SimpleNamespace(x=x), gridDim=SimpleNamespace(x=blocks))}
        exec(code, env)
        out.append(env["walk"])
    return out


@pytest.mark.parametrize("variant", ["causal", "plain"])
@pytest.mark.parametrize("order", ["grid", "cost"])
@pytest.mark.parametrize("batch_inner", [False, True])
@pytest.mark.parametrize("carry", ["div", "sub"])
@pytest.mark.parametrize("blocks,nq,B,H", [(1, 1, 1, 1), (3, 2, 2, 2), (5, 7, 1, 4), (132, 32, 4, 16),
                                           (7, 3, 2, 1), (16, 2, 1, 2),
                                           (132, 3, 2, 2), (132, 1, 8, 1)])
def test_persistent_walk_takes_every_item_once(variant, order, batch_inner, carry, blocks, nq, B, H) -> None:
    """Every item once, with the carry by division and by subtractions first (item_carry: (132, 3, ...) and
    (132, 1, ...) pass CARRY_DIV_EXTENTS extents, so "sub" divides there too)."""
    spec = dataclasses.replace(_spec(variant, item_order=order, item_carry=carry), batch_inner=batch_inner)
    walks = _walks(spec, blocks, nq, B, H)
    taken = [it for w in walks for it in w]
    assert sorted(taken) == sorted((qt, h, b) for qt in range(nq) for h in range(H) for b in range(B))


def test_cost_order_balances_causal_items() -> None:
    """Causal at N = 4k (32 q tiles of 128 rows, q tile t visits t + 1 kv tiles), B = 4, H = 16 on 132 blocks: the
    grid order's serpentine rounds drift against the cost cycle of 16 heads x 32 q tiles and leave the busiest
    block far above the mean; item_order "cost" (every item heaviest first) keeps it within two items' work of
    the least. Both orders take the same items: only the balance differs."""
    def busiest(order: str) -> tuple[int, int]:
        walks = _walks(_spec("causal", item_order=order), 132, 32, 4, 16)
        work = [sum(qt + 1 for qt, _, _ in w) for w in walks]
        return max(work), min(work)

    mean = 4 * 16 * sum(range(1, 33)) / 132
    grid_max, _ = busiest("grid")
    cost_max, cost_min = busiest("cost")
    assert grid_max > 1.1 * mean
    assert cost_max < 1.02 * mean and cost_max - cost_min <= 2 * 32


def test_unknown_item_order_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="item_order must be one of"):
        item_order(_spec("causal", item_order="random"))


def test_item_carry_subtracts_on_the_relative_bias_row_slice_kernel_only(hopper) -> None:
    """item_carry "auto": the relative bias's persistent D = 128 kernel (row_slice, 128-row q tiles) subtracts
    first, the others (its D = 64 kernel too) divide; a caller's "div" or "sub" decides (a value outside them is
    refused by name)."""
    import falower as fl
    from falower.backends.numba_cuda.emit_fa2 import CARRY_DIV_EXTENTS
    from falower.errors import FalowerError
    from tests.backend.sim_script import example_graph

    def source(stem: str, D: int = 128, **extra) -> str:
        c = fl.compile(example_graph(stem), extra=extra or None)
        return c.specialize("f16", D=D, N=4096, M=4096).source

    sub = f"if it_x >= {CARRY_DIV_EXTENTS} * ("  # (x's extent: q tiles, or heads under item_order "cost")
    rb = source("relative_bias")
    assert "row_slice" in rb and sub in rb and "while it_x >= nq:" in rb
    for stem in ("plain", "causal", "document"):
        src = source(stem)
        assert "div_u32(it_x, " in src and sub not in src and "while it_x >= " not in src, stem
    rb64 = source("relative_bias", D=64)
    assert "row_slice" in rb64 and sub not in rb64
    assert sub not in source("relative_bias", item_carry="div")
    assert sub in source("plain", item_carry="sub")
    with pytest.raises(FalowerError, match="item_carry"):
        source("plain", item_carry="loop")
