"""The shape of the emitted forward kernels that drives a cold compile (benchmarks/NOTES.md, "Compile time").

Numba's front end costs time per IR statement and per block of each function it compiles, and a device function
costs once however often it is called; so the kernels keep repeated work in helpers compiled once, the helpers
loop over their n8 tiles (NVVM unrolls them) instead of writing every element out, and no call passes more
than 30 arguments (CPython then builds a list, which Numba types as a chain of tuple concatenations: ~0.4 s for
one 34-argument call). Checked on the emitted source's syntax tree: no GPU and no Numba compile needed."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import make_spec  # noqa: E402

from falower.backends.numba_cuda.emit_fa2 import emit_fa2_forward  # noqa: E402

# (schedule, D, block_q, block_k, num_warps) -> at most this many statements in the kernel function and in any helper
KERNELS = {
    "mma-d64": (None, 64, 128, 64, 4),
    "mma-d128": (None, 128, 128, 64, 4),
    "wgmma-d128": ({"schedule": "wgmma", "overlap": True}, 128, 128, 128, 8),
    "wgmma-d64": ({"schedule": "wgmma", "overlap": False}, 64, 128, 64, 8),
    # the warp-specialized forward an H100 picks at D = 128 (emit_fa3_ws.py, no producer warp)
    "ws-d128": ({"schedule": "wgmma-ws", "producer": "none"}, 128, 128, 128, 8),
}
MAX_KERNEL_STMTS = {"mma-d64": 240, "mma-d128": 250, "wgmma-d128": 180, "wgmma-d64": 160,
                    "ws-d128": 240}  # 2026-11-23: 195, 209, 146, 130, 201 (324 before round 5)
MAX_KERNEL_IFS = 14  # the tile range, the next tile, need_mask, the prologue, the epilogue: no branch per row
# the ws kernel's own: the four ring loads (two in the prologue, each K or V by warpgroup, and one for each
# warpgroup in the loop, each with its stage wrap), have_prev around the P V issue and the V release; each ring
# load's choice of a tile inside N (kept row addresses) or the ragged one (2026-11-24: +3, measured on the H100
# in that form; moved into a helper, ptxas spilled more in the bias kernel, 64 -> 88 bytes, unmeasured there)
MAX_KERNEL_IFS_OF = {"ws-d128": 29}  # 2026-11-23: 25, then 26
MAX_HELPER_STMTS = 24  # per-element work is a loop over n8 tiles, not 32-64 statements written out


def _module(name: str) -> ast.Module:
    extra, D, bq, bk, nw = KERNELS[name]
    spec = make_spec("causal", D, "f16", path="mma", block_q=bq, block_k=bk, num_warps=nw, name=f"shape_{D}")
    if extra:
        spec = dataclasses.replace(spec, extra=extra)
    return ast.parse(emit_fa2_forward(spec))


def _functions(mod: ast.Module) -> tuple[ast.FunctionDef, list[ast.FunctionDef]]:
    fns = [n for n in mod.body if isinstance(n, ast.FunctionDef)]
    is_kernel = lambda f: any(isinstance(d, ast.Name) and d.id == "kernel_jit" for d in f.decorator_list)  # noqa: E731
    (kernel,) = [f for f in fns if is_kernel(f)]
    return kernel, [f for f in fns if not is_kernel(f)]


def _count(fn: ast.AST, kind: type) -> int:
    return sum(isinstance(n, kind) for n in ast.walk(fn)) - isinstance(fn, kind)


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_and_helpers_stay_small(name: str) -> None:
    kernel, helpers = _functions(_module(name))
    assert _count(kernel, ast.stmt) <= MAX_KERNEL_STMTS[name], _count(kernel, ast.stmt)
    assert _count(kernel, ast.If) <= MAX_KERNEL_IFS_OF.get(name, MAX_KERNEL_IFS), _count(kernel, ast.If)
    generated = [h for h in helpers if h.name not in ("score_fn", "mask_fn", "tile_class_fn", "masked_score_fn")]
    assert generated, "the kernel's repeated work is in helpers"
    for h in generated:
        assert _count(h, ast.stmt) <= MAX_HELPER_STMTS, (h.name, _count(h, ast.stmt))


@pytest.mark.parametrize("name", list(KERNELS))
def test_no_call_with_more_than_30_arguments(name: str) -> None:
    for node in ast.walk(_module(name)):
        if isinstance(node, ast.Call):
            assert len(node.args) + len(node.keywords) <= 30, ast.unparse(node)[:120]


def test_wgmma_kernel_shares_its_helpers() -> None:
    """One load helper for the Q, K and V tiles (prologue and loop), one P V helper for the loop and the last
    tile (overlap), one P packing helper: each compiled once."""
    kernel, helpers = _functions(_module("wgmma-d128"))
    calls = [n.func.id for n in ast.walk(kernel) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    names = {h.name for h in helpers}
    loads = [c for c in calls if c.startswith("load_swz_rows_")]
    assert len(loads) == 5 and len(set(loads)) == 1 and loads[0] in names, loads
    assert calls.count("pv_wgmma") == 2 and "pv_wgmma" in names
    assert calls.count("pack_pa") == 1 and "pack_pa" in names
    assert "cp_async16_s" not in calls and "WG_O" not in calls


def test_ws_kernel_shares_its_helpers() -> None:
    """The warp-specialized kernel (compile time round 5): emit_fa3's P V and P packing helpers, S = Q K^T as one
    helper, each ring load's address arithmetic and row loads in one helper (six sites), the next visited tile of a
    static block mask in one helper (the consumer's loop and the four loader steps): nothing written out."""
    kernel, helpers = _functions(_module("ws-d128"))
    calls = [n.func.id for n in ast.walk(kernel) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    names = {h.name for h in helpers}
    assert calls.count("pv_wgmma") == 2 and "pv_wgmma" in names
    assert calls.count("pack_pa") == 1 and "pack_pa" in names
    assert calls.count("qk_wgmma") == 1 and "qk_wgmma" in names
    assert calls.count("ring_tile") == 6 and "ring_tile" in names
    assert calls.count("next_tile") == 5 and "next_tile" in names  # causal: a static block mask
    assert [c for c in calls if c.startswith("load_swz_rows_")] == ["load_swz_rows_8x8"]  # Q; K, V in ring_tile
    assert calls.count("tile_class_fn") == 2  # the tile range and need_mask; the next tile's in next_tile
    assert "cp_async16_s" not in calls and "WG_O" not in calls and "WG_S" not in calls


@pytest.mark.parametrize("name", ["mma-d64", "mma-d128"])
def test_mma_kernel_writes_out_no_fragments(name: str) -> None:
    """mma.sync (compile time round 5): P packed into a constant-indexed uint32 array once per m16 fragment and read
    by the P V row helper, the epilogue's arithmetic in two helpers, and at D = 128 (Q in shared memory) the Q
    fragments' ldmatrix inside the S row helper: the kernel unpacks no 4-tuples (~13 Numba IR statements each)."""
    kernel, helpers = _functions(_module(name))
    calls = [n.func.id for n in ast.walk(kernel) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    names = {h.name for h in helpers}
    assert _count(kernel, ast.stmt) <= 190, _count(kernel, ast.stmt)  # 2026-11-23: 180 / 178 (195 / 209 before)
    assert calls.count("pack_p_row") == 2 and calls.count("pv_acc_prow") == 4 and "pack_p" not in calls
    assert calls.count("row_total") == 4 and calls.count("row_lse") == 4
    assert {"pack_p_row", "pv_acc_prow", "row_total", "row_lse"} <= names
    tuples = [n for n in ast.walk(kernel) if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Tuple)
              and len(n.targets[0].elts) == 4]
    if name == "mma-d128":
        assert "ldsm_x4" not in calls and calls.count("qk_set_qrow") == 1 and calls.count("qk_acc_qrow") == 7
        assert not tuples, ast.unparse(tuples[0])
    else:  # Q in registers: its 8 fragments loaded once, before the loop
        assert calls.count("ldsm_x4") == 8 and len(tuples) == 8
