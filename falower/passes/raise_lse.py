"""The LSE as a second result: a graph that returns its softmax's log-sum-exp beside O, made the result fa2-fwd
produces anyway.

FlashAttention's forward keeps LSE = m + log(l) per query row for the backward; users who need it (a z-loss, an
attention sink, a context-parallel merge) write it beside the attention:

    s = q @ k.mT * c
    lse = (s.amax(-1, keepdim=True) + fl.log(fl.exp(s - s.amax(-1, keepdim=True)).sum(-1, keepdim=True))).squeeze(-1)
    return fl.softmax(s, dim=-1) @ v, lse

`raise_lse_result` finds such a last result: the LSE of the one softmax's input along its axis (m + log(sum(exp(x - m)))
with m its row max, guarded or not, or log(sum(exp(x))), squeezed on that axis anywhere in the expression), removes it
from the results and records its name in the function's attrs, `lse_result`. The passes then lower O alone (fuse,
tile and online-softmax take one output), and online-softmax names its LSE output after it; autodiff gives the joint
function the cotangent `d<name>` and the softmax rule its term (passes/lse_cotangent.py has the math).

The same numbers wherever a row has a finite score; a row that is -inf everywhere has LSE -inf, where the form
without the max's guard gives NaN (as raise_softmax's rows give 0 for the written form's NaN).
"""

from __future__ import annotations

import math
from typing import Optional

from ..errors import PassError
from ..ir.core import Func, Value
from ..ir.types import TensorType
from .attention import _is
from .raise_softmax import _unguarded
from .rewrite import dce


def _peel(v: Value, axis: int) -> Value:
    """v without a squeeze of the softmax's axis (keepdim=False, `.squeeze(-1)`): the row value it holds."""
    sq = _is(v, "squeeze")
    return sq.operands[0] if sq is not None and sq.attrs["axis"] == axis else v


def _is_row_max(v: Value, x: Value, axis: int) -> bool:
    m = _is(_unguarded(_peel(v, axis), -math.inf, 0.0), "reduce_max")
    return m is not None and m.operands[0] is x and m.attrs["axis"] == axis


def _log_sum_exp_arg(v: Value, axis: int) -> Optional[Value]:
    """a where v = log(sum(exp(a), axis)) (squeezed before or after the log), else None."""
    lg = _is(_peel(v, axis), "log")
    rs = _is(_peel(lg.operands[0], axis), "reduce_sum") if lg is not None else None
    ex = _is(rs.operands[0], "exp") if rs is not None and rs.attrs["axis"] == axis else None
    return ex.operands[0] if ex is not None else None


def is_lse_of(v: Value, x: Value, axis: int) -> bool:
    """Whether v is the log-sum-exp of x along `axis` in one of the written forms (module docstring)."""
    if _log_sum_exp_arg(v, axis) is x:
        return True
    add = _is(_peel(v, axis), "add")
    if add is None:
        return False
    for m, ls in (add.operands, add.operands[::-1]):
        arg = _log_sum_exp_arg(ls, axis)
        sub = _is(arg, "sub") if arg is not None else None
        if sub is not None and sub.operands[0] is x and _is_row_max(m, x, axis) and _is_row_max(sub.operands[1], x, axis):
            return True
    return False


def raise_lse_result(func: Func) -> Optional[str]:
    """Remove a last result that is the LSE of the graph's one softmax (module docstring) and record its name as
    `lse_result`; returns the name, or None when there is none. A result of that form kept [.., 1] on the softmax's
    axis, returned before O, or returned twice, is refused saying so (fa2-fwd returns the LSE once, last, squeezed)."""
    if len(func.results) < 2 or "lse_result" in func.attrs:
        return None
    sms = [op for op in func.body.ops if op.name == "softmax"]
    if len(sms) != 1:
        return None
    x, axis = sms[0].operands[0], sms[0].attrs["axis"]
    names = func.result_names
    found = [i for i, r in enumerate(func.results) if is_lse_of(r, x, axis)]
    if not found:
        return None
    if len(found) > 1:  # fa2-fwd has one LSE output; taking the last left the others for fuse to refuse as "not O"
        raise PassError(f"@{func.name} returns its softmax's LSE {len(found)} times "
                        f"({', '.join(names[i] for i in found)}): return it once, last (fa2-fwd returns (O, LSE))")
    i = found[-1]
    r = func.results[i]
    want = TensorType(x.type.dtype, x.type.shape[:axis] + x.type.shape[axis + 1:])
    if r.type != want:
        raise PassError(f"the result {names[i]} of @{func.name} is the softmax's LSE as {r.type}: return it as {want} "
                        f"(squeezed on the softmax's axis: `.squeeze(-1)` or keepdim=False), as fa2-fwd returns it")
    if i != len(func.results) - 1:
        raise PassError(f"the result {names[i]} of @{func.name} is the softmax's LSE: return it last, after the "
                        "attention's output (fa2-fwd returns (O, LSE))")
    ret = func.body.terminator
    assert ret is not None
    ret.operands = list(ret.operands[:i])
    if "result_names" in func.attrs:
        func.attrs["result_names"] = tuple(names[:i])
    func.attrs["lse_result"] = names[i]
    dce(func)
    return names[i]

