"""The forms of attention users write, taken as the ops the passes match: one entry for every pass that starts a
pipeline (decompose-softmax, autodiff) and for --check's reference, so the three take the same forms.

In order: P cast before P @ V into the product's operand_dtype (raise_operand_cast.py), a constant factor on q or k
onto the score product (raise_scale.py), a softmax written by hand into the op (raise_softmax.py), its LSE returned
as a last result taken out of the results and named in the attrs (raise_lse.py).
"""

from __future__ import annotations

from ..ir.core import Func
from .raise_operand_cast import raise_operand_cast
from .raise_scale import raise_scale
from .raise_lse import raise_lse_result
from .raise_softmax import raise_softmax


def raise_written_forms(func: Func, guarded: bool = True, scale: bool = True) -> bool:
    """Every form above raised in `func`; `guarded` as raise_softmax's (autodiff: False), `scale` False leaves factors
    on q and k where they are (autodiff differentiates them as written). True if anything changed."""
    changed = raise_operand_cast(func)
    if scale:
        changed = raise_scale(func) or changed
    changed = raise_softmax(func, guarded=guarded) or changed
    return raise_lse_result(func) is not None or changed
