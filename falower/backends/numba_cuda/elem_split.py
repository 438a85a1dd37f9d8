"""Split the backward's per-element function elem_<branch>(s, dp, lse, delta, ...) -> (p, ds) into a P part that
reads only the score and a dS part that reads P, dP and Delta, so that a kernel can compute P while dP's GEMM is
still in flight (FlashAttention-3 runs its exponentials under the dP GEMM; emit_fa3_bwd's extra "p_under_dp").

The split is made on the emitted text (from_ir_bwd writes the function as straight-line assignments `vN = expr`):
  P part   the lines P needs;
  dS part  the lines dS needs that P does not, plus any P-part line they read whose own inputs never include the
           raw score s (index and mask arithmetic, recomputed); P itself is passed in.
It is refused (None) where dS would need a value of the score other than P (a softcap's derivative reads s or
tanh(s)), where the function has more outputs than (p, ds) (captured tables' gradients), or where its text is
not of that form: the kernel then keeps the fused function.
"""

from __future__ import annotations

import re
from typing import Optional

_ASSIGN = re.compile(r"^    (v\d+) = (.*)$")
_VAR = re.compile(r"\bv\d+\b")
_HEAD = "(s, dp, lse, delta, b, h, hk, q, kv, interior"


def _function(source: str, name: str) -> Optional[tuple[str, list[tuple[str, str]], list[str]]]:
    """(the parameter tail after `interior`, the body's assignments, the returned names) of `def name(...)`."""
    lines = source.split("\n")
    head = f"def {name}{_HEAD}"
    start = next((i for i, ln in enumerate(lines) if ln.startswith(head)), None)
    if start is None:
        return None
    tail = lines[start][len(head):]
    if not tail.endswith("):"):
        return None
    body: list[tuple[str, str]] = []
    for ln in lines[start + 1:]:
        m = _ASSIGN.match(ln)
        if m:
            body.append((m.group(1), m.group(2)))
            continue
        if ln.startswith("    return "):
            return tail[:-2], body, [x.strip() for x in ln[len("    return "):].split(",") if x.strip()]
        return None
    return None


def _cone(body: list[tuple[str, str]], roots: set[str]) -> set[str]:
    """The assigned names `roots` read, directly or through other assignments."""
    need, defs = set(roots), dict(body)
    for target, expr in reversed(body):
        if target in need:
            need |= set(_VAR.findall(expr))
    return need & set(defs)


def _reads_score(body: list[tuple[str, str]], names: set[str]) -> bool:
    return any(re.search(r"\bs\b", expr) for target, expr in body if target in names)


def split_elem(source: str, branch: str) -> Optional[str]:
    """Source of `elemp_<branch>(s, lse, b, h, hk, q, kv, interior, *rest) -> p` and
    `elemds_<branch>(p, dp, delta, lse, b, h, hk, q, kv, interior, *rest) -> ds` (each a device function), from
    elem_<branch> in `source`; None where the split is refused (module docstring)."""
    found = _function(source, f"elem_{branch}")
    if found is None:
        return None
    tail, body, outs = found
    if len(outs) != 2 or not all(_VAR.fullmatch(x) for x in outs):
        return None
    p, ds = outs
    p_cone = _cone(body, {p})
    ds_cone = _cone(body, {ds})
    if ds in p_cone or p not in p_cone:
        return None
    ds_only = ds_cone - p_cone
    if _reads_score(body, ds_only):
        return None
    shared = {v for t, e in body if t in ds_only for v in _VAR.findall(e)} & p_cone - {p}
    again = _cone(body, shared)  # P-part values dS reads: recomputed, if the score is not among their inputs
    if _reads_score(body, again):
        return None
    p_lines = [f"    {t} = {e}" for t, e in body if t in p_cone]
    as_p = re.compile(rf"\b{p}\b")
    ds_lines = [f"    {t} = {as_p.sub('p', e)}" for t, e in body if t in ds_only | again]
    return "\n".join([
        "@device_function",
        f"def elemp_{branch}(s, lse, b, h, hk, q, kv, interior{tail}):",
        *p_lines,
        f"    return {p}",
        "",
        "",
        "@device_function",
        f"def elemds_{branch}(p, dp, delta, lse, b, h, hk, q, kv, interior{tail}):",
        *ds_lines,
        f"    return {ds}",
    ])
