"""The 3-D grids' block order (emit_fa2.grid_3d / emit_program_index): every (q tile, head, batch) exactly once,
and, in the order the hardware hands blocks out (x fastest), the heaviest q tiles of a batch's heads first under a
block mask, one (b, h)'s q tiles together without. The emitted lines are run as Python here, no GPU needed."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from falower.backends.numba_cuda.emit_fa2 import MAX_GRID_Y, _Code, emit_program_index, grid_3d, heads_first
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
