"""Full tiles skip all mask arithmetic, in the generated kernel source (issue 12).

mask-tiles gives full tiles a score function without the mask; the kernels must keep that promise. For the
mma.sync and wgmma forwards (emit_fa2 / emit_fa3): the branch a full tile takes (`need_mask` false) calls
only functions that read neither the mask nor the kv bound, and compare nothing. For the backward
(emit_fa2_bwd): the full tiles' element function reads neither kv nor a captured table (the mask's inputs).
Source generation only: no compile, no GPU, fast.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import falower as fl
from falower.backends.numba_cuda.emit_fa2 import emit_fa2_forward
from falower.backends.numba_cuda.emit_fa3 import emit_fa3_forward
from falower.backends.numba_cuda.from_ir import analyse, build_spec
from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec
from falower.cli import select_graph

ROOT = Path(__file__).resolve().parent.parent.parent
MASKED = ["causal", "sliding_window", "document", "alibi", "prefix_lm"]


def _graph(stem: str) -> fl.Func:
    return select_graph(ROOT / "examples" / f"{stem}.py", None)


def _defs(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def _called(nodes) -> set[str]:
    out = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
                out.add(n.func.id)
    return out


def _reachable(defs: dict[str, ast.FunctionDef], nodes) -> list[ast.AST]:
    """The statements `nodes` and the bodies of every generated function they call, transitively."""
    seen: set[str] = set()
    todo = list(_called(nodes))
    out = list(nodes)
    while todo:
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.add(name)
        out.append(defs[name])
        todo += _called([defs[name]])
    return out


def _full_branches(kernel: ast.FunctionDef) -> list[list[ast.stmt]]:
    """The `else` of every `if need_mask:` in the kernel: what a full, in-bounds tile runs."""
    return [n.orelse for n in ast.walk(kernel)
            if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "need_mask"]


def _assert_no_mask(defs, branches, what: str) -> None:
    assert branches, f"{what}: no `if need_mask` branch found"
    for branch in branches:
        assert branch, f"{what}: empty full-tile branch"
        code = _reachable(defs, branch)
        called = _called(code)
        assert not called & {"mask_fn", "masked_score_fn", "masked_score_row", "tile_class_fn"}, (what, called)
        for node in code:
            for n in ast.walk(node):
                assert not isinstance(n, ast.Compare), f"{what}: a comparison on the full-tile path: {ast.unparse(n)}"
                assert not (isinstance(n, ast.Name) and n.id == "NEG_INF"), f"{what}: -inf on the full-tile path"


def _forward_spec(stem: str, D: int, extra=None):
    low = analyse(fl.lower(_graph(stem), "fa2-fwd"))
    return build_spec(low, {"D": D}, "f16", "mma", None, extra)


@pytest.mark.parametrize("stem", MASKED)
def test_fa2_full_tiles_have_no_mask_arithmetic(stem) -> None:
    spec = _forward_spec(stem, 64)
    assert spec.has_mask
    tree = ast.parse(emit_fa2_forward(spec))
    defs = _defs(tree)
    _assert_no_mask(defs, _full_branches(defs[spec.name]), f"emit_fa2 {stem}")
    # and the partial tiles do evaluate the mask (the test looks at the right branch)
    partial = [n.body for n in ast.walk(defs[spec.name]) if isinstance(n, ast.If)
               and isinstance(n.test, ast.Name) and n.test.id == "need_mask"]
    assert "mask_fn" in _called(_reachable(defs, partial[0]))


@pytest.mark.parametrize("stem", MASKED)
def test_fa3_full_tiles_have_no_mask_arithmetic(stem) -> None:
    spec = _forward_spec(stem, 128, {"schedule": "wgmma"})
    tree = ast.parse(emit_fa3_forward(spec))
    defs = _defs(tree)
    _assert_no_mask(defs, _full_branches(defs[spec.name]), f"emit_fa3 {stem}")


@pytest.mark.parametrize("stem", ["causal", "sliding_window", "document", "prefix_lm"])
def test_fa2_bwd_full_tiles_have_no_mask_arithmetic(stem) -> None:
    low = analyse_backward(fl.lower(_graph(stem), "fa2-bwd"))
    spec = build_backward_spec(low, {"D": 64}, "f16", "mma", None)
    defs = _defs(ast.parse(spec.device_source))
    assert "elem_full" in defs and "elem_partial" in defs

    def reads(fn: ast.FunctionDef) -> set[str]:
        return {n.id for stmt in fn.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}

    full, partial = reads(defs["elem_full"]), reads(defs["elem_partial"])
    assert "kv" not in full and not any(n.startswith("cap_") for n in full), (stem, sorted(full))
    assert "kv" in partial or any(n.startswith("cap_") for n in partial)  # the mask lives there


def test_alibi_score_function_reads_the_hoisted_values() -> None:
    """What score-licm moved reaches the kernel: slopes[h] in cta_fn, called once per program, and the
    per-element code is a subtraction, a multiply and an add (no load, no integer-to-float conversion)."""
    spec = _forward_spec("alibi", 64)
    src = spec.device_source
    defs = _defs(ast.parse(src))
    assert "cap_slopes[" in ast.unparse(defs["cta_fn"]) and "cap_slopes[" not in ast.unparse(defs["score_fn"])
    kernel = emit_fa2_forward(spec)
    assert kernel.count("hz = cta_fn(b, h") == 1  # once per program, before the kv loop
    body = ast.unparse(defs["score_fn"])
    assert body.count("np.int32(") == 2  # cast(kv), cast(q): per column and per row, hoisted by NVVM
