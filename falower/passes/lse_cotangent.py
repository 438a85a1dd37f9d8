"""The LSE's cotangent in FA2's backward: a loss that reads the forward's LSE (a z-loss, an attention sink) adds
dLSE_i * P_ij to the score's gradient, which is Delta moved by dLSE.

With LSE_i = log sum_j exp(X_ij), dLSE_i / dX_ij = P_ij, so the softmax rule's dX = P * (dP - Delta) becomes

    dX_ij = P_ij (dP_ij - Delta_i) + dLSE_i P_ij = P_ij (dP_ij - (Delta_i - dLSE_i))

Nothing else of the backward changes: `with_lse_cotangent` takes the fa2-bwd IR and returns it with one more
argument, `dlse` (the LSE's shape), subtracted from Delta where Delta is made; the kernels subtract it from their
Delta buffer after Delta's kernel (FlexAttention differentiates through its returned LSE; FlashAttention's LSE is
not differentiable). Requires the tiled fa2-bwd IR (Delta's parallel_for named `delta`, an `lse` argument).
Before / after (Delta's tile, abridged):

    %delta_1 = reduce_sum %do_o {axis = 1} : f32[64,1]
    tile.yield %delta_1 into [%b, %h, %q0 : 64, :]
    =>
    %delta_1 = reduce_sum %do_o {axis = 1} : f32[64,1]
    %dlse_t = tile.load %dlse[%b, %h, %q0 : 64] : f32[64]
    %3 = unsqueeze %dlse_t {axis = 1} : f32[64,1]
    %delta_moved = sub %delta_1, %3 : f32[64,1]
    tile.yield %delta_moved into [%b, %h, %q0 : 64, :]
"""

from __future__ import annotations

from typing import Any, Optional

from ..errors import FalowerError, ShapeError
from ..ir.builder import Builder
from ..ir.core import Func, Value, clone_func
from ..ir.dims import Const


def with_lse_cotangent(func: Func) -> Func:
    """`func` (the fa2-bwd IR: Delta's parallel_for named `delta` and an `lse` argument) with an argument `dlse`
    subtracted from each Delta tile before it is stored."""
    out = clone_func(func)
    par = next((op for op in out.body.ops if op.name == "parallel_for" and len(op.results) == 1
                and op.results[0].name == "delta"), None)
    lse = next((a for a in out.args if a.name == "lse"), None)
    if par is None or lse is None or lse_cotangent_arg(out) is not None:
        raise FalowerError(f"an LSE cotangent needs the fa2-bwd IR (Delta's parallel_for and an lse argument, no "
                           f"dlse yet); @{func.name} has "
                           f"{'no Delta' if par is None else 'no lse' if lse is None else 'its LSE cotangent already'}")
    dlse = out.body.add_arg(lse.type, "dlse")
    body = par.regions[0]
    term = body.ops.pop()
    (spec,) = term.attrs["slices"]
    tile = term.operands[0]
    if spec[-1] != ":" or tile.type.shape[-1] != Const(1) or len(spec) != lse.type.rank + 1:
        raise FalowerError(f"an LSE cotangent: Delta's tiles are {tile.type} stored at {spec}, not rows of the LSE's "
                           f"{lse.type} with a last axis of 1")
    b = Builder(body)
    rows = list(term.operands[1:])
    index: list = []
    for s in spec[:-1]:
        index.append(rows.pop(0) if s == "i" else (rows.pop(0), s) if isinstance(s, int) else ":")
    d = b.emit("unsqueeze", b.tile_load(dlse, index, name_hint="dlse_t"), axis=tile.type.rank - 1)
    moved = b.emit("sub", tile, d, name_hint="delta_moved")
    term.operands[0] = moved
    body.append(term)
    return out


def lse_cotangent_arg(func: Func) -> Optional[Value]:
    """The backward function's LSE cotangent argument: `d<name>` for a graph that returns its LSE as `name`
    (raise_lse.py: autodiff adds it), or with_lse_cotangent's `dlse`; None when it takes none."""
    want = "d" + str(func.attrs.get("lse_result", "lse"))
    return next((a for a in func.args if a.name == want), None)


def check_dlse(dlse: Any, lse: Any) -> None:
    """The LSE's cotangent a caller passes: a float array of the LSE's shape (B, H, M), on the LSE's device."""
    if dlse is None:
        return
    if not hasattr(dlse, "shape") or not hasattr(dlse, "dtype"):
        raise ShapeError(f"dlse must be an array of lse's shape {tuple(lse.shape)}, got {type(dlse).__name__}")
    if tuple(int(n) for n in dlse.shape) != tuple(int(n) for n in lse.shape):
        raise ShapeError(f"dlse must have lse's shape {tuple(lse.shape)}, got {tuple(dlse.shape)}")
    if not str(dlse.dtype).replace("torch.", "").startswith(("float", "bfloat")):
        raise ShapeError(f"dlse must hold floats, got {dlse.dtype}")
    if type(dlse).__module__.startswith("torch") and type(lse).__module__.startswith("torch") \
            and dlse.device != lse.device:
        raise ShapeError(f"dlse is on {dlse.device}, lse on {lse.device}")
