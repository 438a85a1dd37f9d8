"""The LSE merge: attention over a key set from its parts' normalized outputs and log-sum-exps.

Split the keys of a row into parts p (kv ranges of one device, or of one work item). Each part's attention gives
its normalized output O_p = sum_j exp(x_j - lse_p) v_j and lse_p = log sum_j exp(x_j) over its own keys. Over
all keys, lse = log sum_p exp(lse_p), and

    O = sum_p exp(lse_p - lse) O_p

(seed 000's online-softmax step, taken between whole parts instead of kv tiles; FlashDecoding's split-kv
combine and ring attention's merge are this formula). It is written with the max taken out first, so no
exponent is positive:

    m = max_p lse_p, m' = 0 where m = -inf else m;  w_p = exp(lse_p - m');  s = sum_p w_p
    lse = m' + log s;  O = sum_p (w_p / s') O_p,  s' = 1 where s = 0 else s

A part that saw no key (lse_p = -inf, O_p = 0: a fully masked row, or an empty kv range) gets weight 0. A row
no part saw keeps lse = -inf and O = 0, as the unsplit attention gives it. Written once, as IR, so that the
split-kv pass and a context-parallel merge (parts on several GPUs) build the same ops and the interpreter checks
both the same way.
"""

from __future__ import annotations

import math

from .builder import Builder, new_func
from .core import Func, Value
from .dims import Const, DimLike, dim
from .types import TensorType


def build_lse_merge(b: Builder, o_parts: Value, lse_parts: Value, axis: int = 0) -> tuple[Value, Value]:
    """(O, LSE) merged over `axis` of o_parts [..., M, D] and lse_parts [..., M] (the parts' axis, the same
    position in both), in f32; the merged values lose that axis."""
    ot, lt = o_parts.type, lse_parts.type
    if ot.rank != lt.rank + 1 or ot.shape[:-1] != lt.shape or not 0 <= axis < lt.rank:
        raise ValueError(f"lse merge: O parts {ot} must be the LSE parts {lt} with one more (last) axis, the "
                         f"parts' axis {axis} in both")
    if ot.dtype not in ("f32", "f64") or lt.dtype != ot.dtype:
        raise ValueError(f"lse merge: the parts must be f32 (or f64) in both, got O {ot.dtype}, LSE {lt.dtype}")
    ft = TensorType(lt.dtype, ())
    m = b.emit("reduce_max", lse_parts, axis=axis, name_hint="lse_max")
    none = b.emit("eq", m, b.const(-math.inf, ft))
    m_safe = b.emit("where", none, b.const(0.0, ft), m, name_hint="lse_max_safe")
    w = b.emit("exp", b.emit("sub", lse_parts, m_safe), name_hint="part_weight")
    s = b.emit("reduce_sum", w, axis=axis, name_hint="weight_sum")
    lse = b.emit("add", m_safe, b.emit("log", s), name_hint="lse_merged")
    s_safe = b.emit("where", b.emit("eq", s, b.const(0.0, ft)), b.const(1.0, ft), s)
    a = b.emit("unsqueeze", b.emit("div", w, s_safe), axis=lt.rank, name_hint="part_share")
    o = b.emit("reduce_sum", b.emit("mul", o_parts, a), axis=axis, name_hint="o_merged")
    return b.emit("squeeze", o, axis=axis, name_hint="o"), b.emit("squeeze", lse, axis=axis, name_hint="lse")


def lse_merge_func(parts: DimLike = "P", dtype: str = "f16") -> Func:
    """@lse_merge(%o_parts: f32[P,B,H,M,D], %lse_parts: f32[P,B,H,M]) -> (o: <dtype>[B,H,M,D], lse: f32[B,H,M]):
    the merge as a function of its own (what a context-parallel step runs after gathering the parts)."""
    P = dim(parts)
    if isinstance(P, Const) and P.value < 1:
        raise ValueError(f"lse merge: parts must be at least 1, got {P.value}")
    shape = tuple(dim(n) for n in ("B", "H", "M"))
    func, b, (o_parts, lse_parts) = new_func("lse_merge", [
        ("o_parts", TensorType("f32", (P, *shape, dim("D")))), ("lse_parts", TensorType("f32", (P, *shape)))])
    o, lse = build_lse_merge(b, o_parts, lse_parts)
    b.ret(b.cast(o, dtype) if dtype != "f32" else o, lse)
    func.attrs["result_names"] = ("o", "lse")
    return func


__all__ = ["build_lse_merge", "lse_merge_func"]
