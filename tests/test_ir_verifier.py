"""One test per verifier rule: broken IR (edited text, or built by hand where the parser would refuse it)
must fail with a message that names the op and marks its line in the printed context with `>`.
"""

from __future__ import annotations

from typing import Callable, Optional

import pytest

from falower.errors import VerifyError
from falower.ir import Block, Func, Op, Value, parse_func, print_func, verify
from falower.ir.builder import Builder
from falower.ir.types import scalar, tensor

GRAPH = """func @g(%x: f32[M,N], %y: f32[M,N], %i: i32[M,N], %c: bool) -> (out0: f32[M,N]) {
  %0 = add %x, %y : f32[M,N]
  %1 = fused %0, %y : f32[M,N] {
  ^(%a: f32[M,N], %b: f32[M,N]):
    %2 = mul %a, %b : f32[M,N]
    yield %2
  }
  %3 = if %c : f32[M,N] {
    yield %1
  } else {
    yield %0
  }
  return %3
}
"""

TILE = """func @t(%q: f32[M,8]) -> (out0: f32[M,8]) {
  %o = parallel_for (%i) in (cdiv(M, 16)) : f32[M,8] {
    %c16 = const 16 : i32
    %q0 = mul %i, %c16 : i32
    %t = tile.load %q[%q0 : 16, :] : f32[16,8]
    %z = const 0 : i32
    %cls = mask.classify %z, %z, %q0, %z {bk = 16, bq = 16} : i32 {
    ^(%b: i32, %h: i32, %qq: i32, %kv: i32):
      %p = ge %qq, %kv : bool
      yield %p
    }
    %n = const 4 : i32
    %acc = for %k = %z to %n iter_args(%a = %t) : f32[16,8] {
      %a2 = add %a, %a : f32[16,8]
      yield %a2
    }
    tile.yield %acc into [%q0 : 16, :]
  }
  return %o
}
"""


def edit(base: str, old: str, new: str) -> Func:
    assert old in base, old
    return parse_func(base.replace(old, new, 1))


def expect(func: Func, op: Optional[str], match: str, forbidden: tuple[str, ...] = (), marked_line: bool = True) -> str:
    """verify() fails; the first line names `op` and has `match`; the context marks the op's line."""
    with pytest.raises(VerifyError) as info:
        verify(func, forbidden)
    msg = str(info.value)
    first, _, context = msg.partition("\n")
    assert match in first, msg
    if op is not None:
        assert f"'{op}'" in first, msg
    if op is not None and marked_line:
        marked = [line for line in context.split("\n") if line.startswith(">")]
        assert len(marked) == 1, msg
        assert f" {op}" in marked[0] or marked[0].lstrip("> ").startswith(op), msg
    return msg


def op_named(func: Func, name: str) -> Op:
    return next(op for op in func.walk() if op.name == name)


# ------------------------------------------------------------------------------------ the bases are valid
@pytest.mark.parametrize("text", [GRAPH, TILE])
def test_bases_verify(text: str) -> None:
    f = parse_func(text)
    verify(f)
    assert print_func(f) == text


# -------------------------------------------------------------------------------------- SSA and scoping
def test_undefined_operand() -> None:
    f = parse_func(GRAPH)
    ghost = Value(tensor("f32", "M", "N"), "ghost")
    op_named(f, "add").operands[1] = ghost
    msg = expect(f, "add", "operand ghost: f32[M,N] is used before it is defined")
    assert "%<undefined ghost>" in msg


def test_use_before_def() -> None:
    f = parse_func(GRAPH)
    ops = f.body.ops
    ops[0], ops[1] = ops[1], ops[0]  # the fused op now uses %0 before the add defines it
    expect(f, "fused", "is used before it is defined")


def test_isolated_region_uses_outer_value() -> None:
    f = edit(GRAPH, "%2 = mul %a, %b", "%2 = mul %a, %x")
    expect(f, "mul", "is defined in an enclosing region, but this region is isolated")


def test_isolated_mask_predicate_uses_outer_value() -> None:
    f = edit(TILE, "%p = ge %qq, %kv", "%p = ge %q0, %kv")
    expect(f, "ge", "this region is isolated")


def test_value_of_inner_region_not_visible_outside() -> None:
    f = parse_func(GRAPH)
    inner = op_named(f, "mul").results[0]
    op_named(f, "if").regions[1].ops[0].operands[0] = inner
    expect(f, "yield", "is used before it is defined (or is not visible here)")


# ------------------------------------------------------------------------------------------ terminators
def test_missing_terminator() -> None:
    f = parse_func(GRAPH)
    f.body.ops.pop()  # the body now ends in the `if`
    expect(f, "if", "the last op of a region must be a terminator (yield, tile.yield or return)")


def test_loop_body_without_yield() -> None:
    """Regions are checked before their op, so a body without yield is reported at its last op."""
    f = edit(TILE, "      yield %a2\n", "")
    expect(f, "add", "the last op of a region must be a terminator")


def test_empty_region() -> None:
    f = edit(GRAPH, "  } else {\n    yield %0\n", "  } else {\n")
    expect(f, "if", "a region must end in a terminator")


def test_empty_func_body() -> None:
    f = Func("empty", Block())
    expect(f, None, "a region must end in a terminator")


def test_terminator_not_last() -> None:
    f = parse_func(GRAPH)
    ret = f.body.ops[-1]
    early = Op("return", [f.args[0]], [])
    early.parent = f.body
    f.body.ops.insert(1, early)
    assert ret.name == "return"
    expect(f, "return", "a terminator must be the last op of its region")


def test_yield_outside_of_a_region() -> None:
    f = parse_func(GRAPH)
    f.body.ops[-1].name = "yield"
    expect(f, "yield", "yield cannot end a func body, which ends in return")


def test_return_in_nested_region() -> None:
    f = edit(TILE, "      yield %a2", "      return %a2")
    expect(f, "return", "return cannot end a for region, which ends in yield")


def test_tile_yield_outside_parallel_for() -> None:
    f = edit(TILE, "      yield %a2", "      tile.yield %a2 into [%k : 16, :]")
    expect(f, "tile.yield", "tile.yield cannot end a for region, which ends in yield")


def test_result_names_count() -> None:
    f = parse_func(GRAPH)
    f.attrs["result_names"] = ("o", "lse")
    expect(f, "return", "2 result names for 1 results")


# -------------------------------------------------------------------------------------- types and shapes
def test_unknown_op() -> None:
    f = parse_func(GRAPH)
    op_named(f, "add").name = "frobnicate"
    expect(f, "frobnicate", "unknown op 'frobnicate'")


def test_wrong_result_type() -> None:
    f = edit(GRAPH, "%0 = add %x, %y : f32[M,N]", "%0 = add %x, %y : f16[M,N]")
    expect(f, "add", "result type is f16[M,N] but the operands give f32[M,N]")


def test_dtype_mismatch() -> None:
    f = edit(GRAPH, "%0 = add %x, %y : f32[M,N]", "%0 = add %x, %i : f32[M,N]")
    expect(f, "add", "operand dtypes differ: f32[M,N], i32[M,N] (insert a cast)")


def test_dtype_not_allowed() -> None:
    f = edit(GRAPH, "%0 = add %x, %y : f32[M,N]", "%0 = exp %i : i32[M,N]")
    expect(f, "exp", "operand dtype i32 is not one of f16, bf16, f32, f64")


def test_shapes_do_not_broadcast() -> None:
    f = edit(GRAPH.replace("%y: f32[M,N]", "%y: f32[N,M]"), "%0 = add %x, %y : f32[M,N]",
             "%0 = add %x, %x : f32[M,N]\n  %9 = add %x, %y : f32[M,N]")
    expect(f, "add", "operand shapes do not broadcast: f32[M,N], f32[N,M]")


def test_wrong_number_of_regions() -> None:
    f = edit(GRAPH, "%0 = add %x, %y : f32[M,N]", "%0 = add %x, %y : f32[M,N] {\n  ^():\n    yield %x\n  }")
    expect(f, "add", "has 1 regions, expected 0")


def test_const_has_one_result() -> None:
    f = parse_func(GRAPH)
    bad = Op("const", [], [scalar("f32"), scalar("f32")], {"value": 1.0})
    bad.parent = f.body
    f.body.ops.insert(0, bad)
    expect(f, "const", "has one result")


def test_bad_constant() -> None:
    f = edit(GRAPH, "%0 = add %x, %y : f32[M,N]", "%9 = const true : f32\n  %0 = add %x, %y : f32[M,N]")
    expect(f, "const", "a bool constant must have type bool")


# ---------------------------------------------------------------------------------------- level legality
def test_forbidden_op_after_a_pass() -> None:
    f = edit(GRAPH, "%0 = add %x, %y : f32[M,N]", "%0 = softmax %x {axis = 1} : f32[M,N]")
    verify(f)
    expect(f, "softmax", "softmax is not legal at this level (an earlier pass lowered it away)",
           forbidden=("softmax",))


def test_graph_op_inside_a_loop() -> None:
    f = edit(TILE, "%a2 = add %a, %a : f32[16,8]", "%a2 = softmax %a {axis = 1} : f32[16,8]")
    expect(f, "softmax", "softmax works on whole tensors and is not legal inside a loop")


def test_tile_op_outside_parallel_for() -> None:
    f = edit(GRAPH, "%0 = add %x, %y : f32[M,N]",
             "%z = const 0 : i32\n  %9 = tile.load %x[%z : 16, :] : f32[16,N]\n  %0 = add %x, %y : f32[M,N]")
    expect(f, "tile.load", "tile.load is a tile op and is only legal inside a parallel_for")


def test_non_elementwise_op_in_fused_region() -> None:
    f = edit(GRAPH, "%2 = mul %a, %b : f32[M,N]", "%9 = reduce_max %a {axis = 1} : f32[M,1]\n    %2 = mul %9, %b : f32[M,N]")
    expect(f, "reduce_max", "reduce_max is not elementwise and cannot be inside a fused region")


# --------------------------------------------------------------------------------------- fused regions
def test_fused_region_arguments_match_operands() -> None:
    f = edit(GRAPH, "^(%a: f32[M,N], %b: f32[M,N])", "^(%a: f32[M,N], %b: f32[M,1])")
    expect(f, "fused", "region arguments must match the operands one to one")


def test_fused_yield_matches_results() -> None:
    f = edit(GRAPH, "%1 = fused %0, %y : f32[M,N]", "%1 = fused %0, %y : f16[M,N]")
    expect(f, "yield", "yields (f32[M,N]) but a fused region needs (f16[M,N])")


def test_fused_roles_count() -> None:
    f = edit(GRAPH, "%1 = fused %0, %y : f32[M,N]", '%1 = fused %0, %y {roles = ["s"]} : f32[M,N]')
    expect(f, "fused", "1 roles for 2 operands")


# ------------------------------------------------------------------------------------------- for loops
def test_for_yield_mismatch() -> None:
    f = edit(TILE, "      yield %a2", "      %a3 = cast %a2 {to = \"f16\"} : f16[16,8]\n      yield %a3")
    expect(f, "yield", "yields (f16[16,8]) but a for body needs (f32[16,8])")


def test_for_results_match_iter_args() -> None:
    f = edit(TILE.replace("tile.yield %acc", "tile.yield %t"), "iter_args(%a = %t) : f32[16,8]",
             "iter_args(%a = %t) : f16[16,8]")
    expect(f, "for", "results must have the iter_args' types")


def test_for_bounds_are_i32() -> None:
    f = edit(TILE, "%n = const 4 : i32", "%n = const 4 : i8")
    expect(f, "for", "loop bounds must be i32 scalars")


def test_for_needs_bounds() -> None:
    f = parse_func(TILE)
    op_named(f, "for").operands = []
    msg = expect(f, "for", "needs lower and upper bounds")
    assert "(IR could not be printed)" not in msg  # a malformed loop prints in the generic form


def test_for_block_arguments() -> None:
    f = parse_func(TILE)
    op_named(f, "for").regions[0].add_arg(scalar("f32"), "extra")
    expect(f, "for", "block arguments must be the i32 induction variable and one per iter_arg")


# ---------------------------------------------------------------------------------------------- if
def test_if_branches_mismatch() -> None:
    f = edit(GRAPH, "  } else {\n    yield %0\n", "  } else {\n    %9 = cast %0 {to = \"f16\"} : f16[M,N]\n    yield %9\n")
    expect(f, "yield", "yields (f16[M,N]) but the else-branch needs (f32[M,N])")


def test_if_condition_is_bool_scalar() -> None:
    f = edit(GRAPH.replace("%c: bool", "%c: bool[M]"), "%3 = if %c", "%3 = if %c")
    expect(f, "if", "the condition must be a bool scalar")


def test_if_branches_take_no_arguments() -> None:
    f = parse_func(GRAPH)
    op_named(f, "if").regions[0].add_arg(scalar("i32"), "j")
    expect(f, "if", "the then-branch takes no arguments")


# -------------------------------------------------------------------------------------- parallel_for
def test_parallel_for_slice_mismatch() -> None:
    f = edit(TILE, "tile.yield %acc into [%q0 : 16, :]", "tile.yield %acc into [%q0 : 32, :]")
    expect(f, "tile.yield", "tile f32[16,8] does not fit slice f32[32,8] of result f32[M,8]")


def test_parallel_for_slice_rank() -> None:
    f = edit(TILE, "tile.yield %acc into [%q0 : 16, :]", "tile.yield %acc into [%q0 : 16]")
    expect(f, "tile.yield", "slice has 1 entries for a rank-2 tensor")


def test_parallel_for_yields_one_tile_per_result() -> None:
    f = edit(TILE, "tile.yield %acc into [%q0 : 16, :]", "tile.yield %acc into [%q0 : 16, :], %t into [%q0 : 16, :]")
    expect(f, "tile.yield", "yields 2 tiles for 1 results")


def test_parallel_for_body_ends_in_tile_yield() -> None:
    f = edit(TILE, "tile.yield %acc into [%q0 : 16, :]", "yield %acc")
    expect(f, "yield", "yield cannot end a parallel_for region, which ends in tile.yield")


def test_parallel_for_one_induction_variable_per_bound() -> None:
    f = edit(TILE, "parallel_for (%i) in (cdiv(M, 16))", "parallel_for (%i) in (cdiv(M, 16), 2)")
    expect(f, "parallel_for", "needs one i32 induction variable per bound")


def test_parallel_for_takes_no_operands() -> None:
    f = parse_func(TILE)
    op_named(f, "parallel_for").operands = [f.args[0]]
    expect(f, "parallel_for", "takes no operands")


def test_tile_load_offsets_are_i32_scalars() -> None:
    f = edit(TILE, "%t = tile.load %q[%q0 : 16, :]", "%t = tile.load %q[%c16 : 16, :]")
    verify(f)  # sanity: the edit alone is fine
    g = edit(TILE, "%c16 = const 16 : i32", "%c16 = const 16 : i32\n    %f = const 1.0 : f32")
    op_named(g, "tile.load").operands[1] = op_named(g, "const").parent.ops[1].results[0]
    expect(g, "tile.load", "slice offsets are i32 scalars, got f32")


# --------------------------------------------------------------------------------------------- masks
def test_mask_classify_operands() -> None:
    f = edit(TILE, "%cls = mask.classify %z, %z, %q0, %z", "%cls = mask.classify %z, %z, %q0")
    expect(f, "mask.classify", "operands are b, h, q0, k0 (i32 scalars) then the captured tensors")


def test_mask_classify_result() -> None:
    f = edit(TILE, "{bk = 16, bq = 16} : i32 {", "{bk = 16, bq = 16} : i8 {")
    expect(f, "mask.classify", "gives one i32 class")


def test_mask_predicate_arguments() -> None:
    expect(edit(TILE.replace("%p = ge %qq, %kv", "%p = ge %qq, %h"), "^(%b: i32, %h: i32, %qq: i32, %kv: i32)",
                "^(%b: i32, %h: i32, %qq: i32)"),
           "mask.classify", "the predicate takes i32 scalars (b, h, q, kv) then the captured tensors")


def test_mask_captured_tensors_match_arguments() -> None:
    f = edit(TILE, "%cls = mask.classify %z, %z, %q0, %z {", "%cls = mask.classify %z, %z, %q0, %z, %q {")
    expect(f, "mask.classify", "captured tensor operands must match the predicate's arguments")


def test_mask_predicate_yields_bool() -> None:
    f = edit(TILE, "%p = ge %qq, %kv : bool\n      yield %p", "%p = add %qq, %kv : i32\n      yield %p")
    expect(f, "yield", "yields (i32) but a mask predicate needs (bool)")


def test_mask_needs_tile_sizes() -> None:
    f = edit(TILE, "{bk = 16, bq = 16}", "{bk = 16}")
    expect(f, "mask.classify", "needs a positive int attribute bq")


def test_mask_kv_range_results() -> None:
    f = edit(TILE, "%cls = mask.classify %z, %z, %q0, %z {bk = 16, bq = 16} : i32 {",
             "%cls = mask.kv_range %z, %z, %q0, %z {bk = 16, bq = 16} : i32 {")
    expect(f, "mask.kv_range", "gives the i32 first and past-last kv tile")


def test_mask_block_table_result() -> None:
    text = """func @m(%x: f32[M]) -> (out0: f32[M]) {
  %t = mask.block_table {bk = 16, bq = 16} : i32[B,H,4,4] {
  ^(%b: i32, %h: i32, %q: i32, %kv: i32):
    %p = ge %q, %kv : bool
    yield %p
  }
  return %x
}
"""
    expect(parse_func(text), "mask.block_table", "gives one i8 table [B, H, q tiles, kv tiles]")
    verify(parse_func(text.replace("i32[B,H,4,4]", "i8[B,H,4,4]")))


# ------------------------------------------------------------------------------------- builder errors
def test_builder_refuses_ill_typed_ops() -> None:
    blk = Block([tensor("f32", "M"), tensor("i32", "M")], ["x", "i"])
    b = Builder(blk)
    with pytest.raises(VerifyError, match="add: operand dtypes differ"):
        b.emit("add", *blk.args)


# ---------------------------------------------------------------------- the adjoints' ops (autodiff)
ADJOINTS = """func @a(%t: f32[H,N], %u: f32[1,H,M,N], %h: i32[1,H,1,1], %i: i32[1,1,M,N], %k: f32[B,H*4,N]) -> (out0: f32[H,N], out1: f32[B,H,N], out2: f32[1,H,M,N,1]) {
  %0 = scatter_add %t, %u, %h, %i : f32[H,N]
  %1 = group_sum %k {axis = 1, size = 4} : f32[B,H,N]
  %2 = unsqueeze %u {axis = 4} : f32[1,H,M,N,1]
  return %0, %1, %2
}
"""


def test_adjoint_ops_verify_and_round_trip() -> None:
    f = parse_func(ADJOINTS)
    verify(f)
    assert print_func(f) == ADJOINTS


@pytest.mark.parametrize("edits, op, match", [
    ([("scatter_add %t, %u, %h, %i", "scatter_add %t, %u, %h")], "scatter_add", "has rank 2 but 1 indices are given"),
    ([("scatter_add %t, %u, %h, %i", "scatter_add %t, %u, %h, %u")], "scatter_add", "index must be an integer"),
    ([("scatter_add %t, %u, %h, %i", "scatter_add %h, %h, %h, %i")], "scatter_add", "the table must be a float tensor"),
    ([("scatter_add %t, %u, %h, %i", "scatter_add %t, %k, %h, %i")], "scatter_add", "do not broadcast"),
    ([("%k: f32[B,H*4,N]", "%k: f32[B,H*4,6]"), ("{axis = 1, size = 4}", "{axis = 2, size = 4}")], "group_sum",
     "axis 2 of f32[B,H*4,6] is not a multiple of 4"),
    ([("{axis = 1, size = 4}", "{axis = 3, size = 4}")], "group_sum", "axis 3 out of range"),
    ([("{axis = 1, size = 4}", "{axis = 1, size = 0}")], "group_sum", "size must be a positive int"),
    ([("unsqueeze %u {axis = 4}", "unsqueeze %u {axis = 5}")], "unsqueeze", "axis 5 out of range"),
])
def test_adjoint_op_errors(edits: list[tuple[str, str]], op: str, match: str) -> None:
    text = ADJOINTS
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    expect(parse_func(text), op, match)
