"""ssa_rename: straight-line re-definitions get unique names; loop-carried and branch-merged names keep theirs,
and the program computes the same values."""

from __future__ import annotations

import ast
from collections import Counter

from falower.backends.numba_cuda.ssa_names import ssa_rename

SRC = '''
def f(n, x):
    t = x + 1  # comment kept
    t = t * 2
    acc = 0
    i = 0
    while i < n:
        y = t + i
        y += 3
        acc += y
        if y > 5:
            z = 1
        else:
            z = 2
        acc = acc + z
        i += 1
    t, u = t + acc, t - acc
    return t, u
'''


def _assigned(src: str) -> Counter:
    cnt: Counter = Counter()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            cnt[node.id] += 1
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            cnt[node.target.id] += 1
    return cnt


def test_rename_keeps_values_and_comments():
    out = ssa_rename(SRC)
    assert "# comment kept" in out
    ns0: dict = {}
    ns1: dict = {}
    exec(SRC, ns0)
    exec(out, ns1)
    for n in range(4):
        for x in (-3, 0, 7):
            assert ns0["f"](n, x) == ns1["f"](n, x)
    multi = {k for k, v in _assigned(out).items() if v > 1}
    # acc and i are loop-carried, z merges two branches; t and y are straight-line re-definitions
    assert multi == {"acc", "i", "z"}, out


def test_generated_forward_kernel_has_few_reassigned_names():
    import falower as fl
    from falower.backends.numba_cuda.emit_fa2 import emit_fa2_forward
    from falower.backends.numba_cuda.from_ir import build_spec

    c = fl.compile(fl.attention(mask_mod=lambda b, h, q, k: q >= k, name="causal", head_dim=128))
    spec = build_spec(c.analysis, {"D": 128}, "f16", "mma", c.num_warps, c.extra)
    src = emit_fa2_forward(spec)
    tree = ast.parse(src)
    kern = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == spec.name)
    multi = {k for k, v in _assigned(ast.unparse(kern)).items() if v > 1}
    # loop control, the tile range and the online-softmax row statistics (m, l: 2 per m16 fragment)
    assert len(multi) <= 16, sorted(multi)
