"""The backward's rewrites after autodiff: delta, recompute and tile-bwd (issue 8).

They are checked here on a joint function written by hand (tests/data/causal_joint.fl: causal attention
and its gradients, the softmax's gradient in autodiff's form), so they are tested independently of the
autodiff pass that produces such functions; tests/test_autodiff.py runs them on autodiff's output for every
example.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import falower as fl
from falower.errors import PassError
from falower.passes import PassManager, parse_pipeline
from falower.passes.check import CheckSuite, logsumexp_rows
from falower.passes.cost import cost_of

JOINT = Path(__file__).resolve().parent / "data" / "causal_joint.fl"
GRAPH = "decompose-softmax,canonicalize,delta,recompute,canonicalize"


def joint() -> fl.Func:
    return fl.parse_func(JOINT.read_text())


def inputs(M: int, N: int, B: int = 2, H: int = 3, D: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((B, H, M, D)) for _ in range(2))
    k, v = (rng.standard_normal((B, H, N, D)) for _ in range(2))
    return q, k, v, do


def saved(q, k, M, N):
    """O's partner for the backward: LSE of the causal scores (the forward's output)."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(np.arange(M)[:, None] >= np.arange(N)[None, :], s, -np.inf)
    return logsumexp_rows(s, 3)


# ----------------------------------------------------------------------------------------------- delta
def test_delta_turns_the_kv_row_sum_into_one_over_the_head_dim() -> None:
    before = fl.run_pipeline(joint(), "decompose-softmax,canonicalize")
    after = fl.run_pipeline(before, "delta")
    red = lambda f: sorted(str(op.operands[0].type) for op in f.body.ops if op.name == "reduce_sum")  # noqa: E731
    assert "f32[B,H,M,N]" in " ".join(red(before))  # rowsum(P * dP), and the softmax's own row sum
    assert red(after).count("f32[B,H,M,D]") == 1  # Delta = rowsum(dO * O)
    assert red(after).count("f32[B,H,M,N]") == 1  # only the forward's l = rowsum(e) is left
    q, k, v, do = inputs(7, 9)
    for a, b in zip(fl.interpret(before, [q, k, v, do]), fl.interpret(after, [q, k, v, do])):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_delta_says_what_backward_it_takes() -> None:
    """P used beside P @ V (here P * P summed into the output): inside fa2-bwd, after autodiff, delta once said 'run
    autodiff first'; it now says which attention the backward takes."""
    @fl.trace(q=fl.tensor("f16", "B,H,M,D"), k=fl.tensor("f16", "B,H,N,D"), v=fl.tensor("f16", "B,H,N,D"))
    def p_twice(q, k, v):
        p = fl.softmax(q @ k.mT * 0.25, dim=-1)
        return ((p * p) @ v).to("f16")

    with pytest.raises(PassError, match=r"^pass delta: .*one softmax whose P feeds one P @ V") as e:
        fl.lower(p_twice, "fa2-bwd")
    assert "run autodiff first" not in str(e.value)


def test_delta_refuses_a_graph_without_a_softmax_gradient() -> None:
    g = fl.attention(name="plain")
    with pytest.raises(PassError, match="pass delta: no softmax gradient under attention.*run autodiff first"):
        fl.run_pipeline(g, "delta")


# ------------------------------------------------------------------------------------------- recompute
def test_recompute_returns_the_fa2_backward_signature() -> None:
    bw = fl.run_pipeline(joint(), GRAPH)
    assert [a.name for a in bw.args] == ["q", "k", "v", "o", "lse", "do"]
    assert bw.result_names == ["dq", "dk", "dv"]
    assert str(bw.args[4].type) == "f32[B,H,M]"
    # P is recomputed from LSE; nothing of the forward's softmax statistics is left
    names = [op.name for op in bw.body.ops]
    assert "reduce_max" not in names and names.count("exp") == 1
    assert any(op.name == "unsqueeze" and op.operands[0] is bw.args[4] for op in bw.body.ops)


@pytest.mark.parametrize("M,N", [(7, 9), (1, 1), (9, 3)])
def test_recompute_keeps_the_gradients(M: int, N: int) -> None:
    q, k, v, do = inputs(M, N)
    o, *grads = fl.interpret(joint(), [q, k, v, do])
    bw = fl.run_pipeline(joint(), GRAPH)
    for want, got in zip(grads, fl.interpret(bw, [q, k, v, o, saved(q, k, M, N), do])):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_recompute_refuses_a_graph_that_is_not_joint() -> None:
    with pytest.raises(PassError, match="pass recompute: no cotangent inputs.*run autodiff first"):
        fl.run_pipeline(fl.attention(name="plain"), "decompose-softmax,recompute")


def test_recompute_needs_the_decomposed_softmax() -> None:
    with pytest.raises(PassError, match="pass recompute: the forward still has a softmax op"):
        fl.run_pipeline(joint(), "recompute")


# -------------------------------------------------------------------------------------------- tile-bwd
@pytest.mark.parametrize("opts", ["bq=4,bk=8", "bq=3,bk=5,skip=false", "bq=4,bk=8,dq=atomic",
                                  "bq=8,bk=4,dq=atomic,skip=false"])
@pytest.mark.parametrize("M,N", [(1, 1), (2, 2), (7, 9), (8, 8), (9, 3), (3, 17)])
def test_tile_bwd_keeps_the_gradients(opts: str, M: int, N: int) -> None:
    q, k, v, do = inputs(M, N)
    o, *grads = fl.interpret(joint(), [q, k, v, do])
    tiled = fl.run_pipeline(joint(), f"{GRAPH},tile-bwd{{{opts}}},canonicalize")
    assert not any(op.name == "matmul" for op in tiled.walk())
    got = fl.interpret(tiled, [q, k, v, o, saved(q, k, M, N), do])
    for want, g in zip(grads, got):
        assert not np.isnan(g).any()
        np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("opts", ["dq=atomic", "dq=separate,deterministic=true"])
def test_tile_bwd_sums_a_captured_scalars_gradient(opts: str) -> None:
    """score * temp with a 0-d capture: autodiff sums its gradient over every axis; tile-bwd accumulates it
    per tile as a one-slot table (it refused such a sum before) and the numbers hold at the edge sizes."""
    temp = fl.capture("temp", "f32", ())
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s * temp, mask_mod=lambda b, h, q, kv: q >= kv, name="t")
    pm = PassManager(parse_pipeline(f"autodiff,{GRAPH},tile-bwd{{bq=16,bk=8,{opts}}},canonicalize"), check=True)
    tiled = pm.run(g)
    assert all(r.check == "ok" for r in pm.records), [r.check for r in pm.records]
    assert tiled.result_names[-1] == "dtemp" and tiled.results[-1].type.rank == 0
    assert any(op.name in ("tile.scatter_add", "scatter_add") for op in tiled.walk())


def test_tile_bwd_reads_like_fa2() -> None:
    """Delta first; kv tiles outer with dK, dV carried; q tiles inner recomputing P from LSE; dQ atomic."""
    tiled = fl.run_pipeline(joint(), f"{GRAPH},tile-bwd{{dq=atomic}},canonicalize")
    nests = [op for op in tiled.body.ops if op.name == "parallel_for"]
    assert [r.name for n in nests for r in n.results] == ["delta", "dk", "dv", "dq32"]
    kv = nests[1]
    assert [str(b) for b in kv.attrs["bounds"]] == ["B", "H", "cdiv(N, 64)"]
    assert kv.attrs["accumulators"] == 1
    inner = next(op for op in kv.regions[0].ops if op.name == "for")
    assert [a.name for a in inner.regions[0].args[1:]] == ["dv32_i", "dk32_i"]
    assert inner.operands[0].owner.name == "mask.q_range"  # only the q tiles that can see this kv tile
    walked = [op.name for op in inner.walk()]
    assert "tile.atomic_add" in walked and walked.count("exp") == 2  # full and partial tiles each recompute P


def test_tile_bwd_check_passes_on_the_edge_sizes() -> None:
    pm = PassManager(parse_pipeline(f"{GRAPH},tile-bwd{{bq=16,bk=8}},canonicalize"), check=True)
    pm.run(joint())
    assert all(r.check == "ok" for r in pm.records)
    sizes = {(c.env["M"], c.env["N"]) for c in pm.suite.cases}  # type: ignore[union-attr]
    assert {(15, 15), (16, 16), (17, 17), (7, 7), (9, 9), (1, 1)} <= sizes


def test_check_catches_a_backward_that_swaps_gradients() -> None:
    bw = fl.run_pipeline(joint(), f"{GRAPH},tile-bwd{{bq=16,bk=8}}")
    bw.attrs["result_names"] = ("dq", "dv", "dk")
    problems = CheckSuite.build(joint(), {}, tiles=[16, 8]).compare(bw)
    assert problems and "output dv: max error" in problems[0]


def test_tile_bwd_refuses_what_is_not_a_backward() -> None:
    with pytest.raises(PassError, match="pass tile-bwd: the graph has a softmax"):
        fl.run_pipeline(joint(), "tile-bwd")
    with pytest.raises(PassError, match="pass tile-bwd: no score product"):
        fl.run_pipeline(fl.trace(lambda x: x * 2.0, name="f", x=fl.tensor("f32", "N")), "tile-bwd")


def test_tile_bwd_names_a_score_that_reduces_the_scores() -> None:
    """A row sum inside the score: inside fa2-bwd (delta has run) tile-bwd said only 'run delta first'."""
    @fl.trace(q=fl.tensor("f16", "B,H,M,D"), k=fl.tensor("f16", "B,H,N,D"), v=fl.tensor("f16", "B,H,N,D"))
    def centred(q, k, v):
        s = q @ k.mT * 0.25
        return (fl.softmax(s - s.sum(dim=-1, keepdim=True) * 0.01, dim=-1) @ v).to("f16")

    with pytest.raises(PassError, match=r"^pass tile-bwd: a reduce_sum over .* a score function that reduces the "
                                        r"scores \(not elementwise\) has no tiled backward"):
        fl.lower(centred, "fa2-bwd")


def test_tile_bwd_refuses_keys_stored_d_by_n_in_words() -> None:
    """k stored [B, H, D, N] and the score written q @ k: the forward's fuse refuses it by name; tile-bwd took
    dO @ V^T for the score and failed on a tile's contraction dims (`D vs 128`). Now one line saying what is wrong."""
    from falower.ir import new_func
    from falower.ir.types import tensor

    f, b, (q, k, v) = new_func("kt", [("q", tensor("f16", "B", "H", "M", "D")), ("k", tensor("f16", "B", "H", "D", "N")),
                                      ("v", tensor("f16", "B", "H", "N", "D"))])
    b.ret(b.emit("matmul", b.emit("softmax", b.emit("matmul", q, k), axis=3), v))
    with pytest.raises(PassError, match=r"^pass tile-bwd: the score product reads %k as \[\.\.\., D, N\] \(q @ k\)"):
        fl.lower(f, "fa2-bwd")


# ------------------------------------------------------------------------------------------------ cost
def test_cost_of_the_fa2_backward_is_its_closed_form() -> None:
    """Non-causal-sized work (skip=false), dq=atomic: 5 products of 2*B*H*M*N*D FLOPs (the forward has 2);
    q and dO read once per kv tile, LSE and Delta too; k, v, O read once; dQ's f32 tile read and written
    once per tile pair; dK, dV, dQ written once."""
    B, H, M, N, D, bq, bk = 1, 2, 256, 256, 64, 64, 64
    tiled = fl.run_pipeline(joint(), f"{GRAPH},tile-bwd{{bq={bq},bk={bk},dq=atomic,skip=false}},canonicalize")
    c = cost_of(tiled, dict(B=B, H=H, M=M, N=N, D=D))
    mm = 2 * B * H * M * N * D
    assert 5 * mm <= c.flops <= 5 * mm + 40 * B * H * M * N  # + the elementwise work on score tiles
    Tc = N // bk
    r, w = c.elems_read, c.elems_written
    assert r["%q"] == Tc * B * H * M * D
    assert r["%do"] == (Tc + 1) * B * H * M * D  # + once for Delta
    assert r["%k"] == r["%v"] == B * H * N * D and r["%o"] == B * H * M * D
    assert r["%lse"] == r["%delta"] == Tc * B * H * M
    assert r["%dq32_acc"] == w["%dq32_acc"] == Tc * B * H * M * D
    assert w["%dk"] == w["%dv"] == B * H * N * D and w["%dq"] == B * H * M * D


def test_cost_recompute_saves_the_score_matrices() -> None:
    dims = dict(B=1, H=8, M=1024, N=1024, D=64)
    naive = cost_of(fl.run_pipeline(joint(), "decompose-softmax,canonicalize"), dims)
    tiled = cost_of(fl.run_pipeline(joint(), f"{GRAPH},tile-bwd,canonicalize"), dims)
    mn = dims["B"] * dims["H"] * dims["M"] * dims["N"]
    assert naive.bytes_read > 10 * mn * 4  # every [B,H,M,N] intermediate goes through memory
    assert max(tiled.reads.values()) < mn * 2  # no tensor moves even half a score matrix's bytes
    assert tiled.bytes_total * 8 < naive.bytes_total


# ------------------------------------------------------------------------- accumulators (the IR's atomics)
ACC = """func @rowsum(%x: f32[H,N]) -> (y: f32[H]) {
  %y = parallel_for (%h, %j) accumulate(%acc) in (H, cdiv(N, 4)) : f32[H] {
    %c = const 4 : i32
    %j0 = mul %j, %c : i32
    %t = tile.load %x[%h, %j0 : 4] : f32[4]
    tile.scatter_add %acc, %t, %h
    tile.yield
  }
  return %y
}
"""


def test_accumulators_print_parse_and_sum_every_iteration() -> None:
    f = fl.parse_func(ACC)
    assert fl.print_func(f) == ACC
    x = np.arange(14.0).reshape(2, 7)  # a ragged last tile: its padding adds zeros
    (y,) = fl.interpret(f, [x])
    np.testing.assert_array_equal(y, x.sum(axis=1))


def test_atomic_adds_only_into_an_accumulator() -> None:
    bad = ACC.replace("tile.scatter_add %acc, %t, %h", "tile.scatter_add %x, %t, %h, %j0")
    with pytest.raises(fl.VerifyError, match="adds into an accumulator argument of an enclosing parallel_for"):
        fl.verify(fl.parse_func(bad))
    wrong_type = ACC.replace("accumulate(%acc) in (H, cdiv(N, 4)) : f32[H]", "accumulate(%acc) in (H, cdiv(N, 4)) : f16[H]")
    with pytest.raises(fl.FalowerError):
        fl.verify(fl.parse_func(wrong_type.replace("(y: f32[H])", "(y: f16[H])")))


# ------------------------------------------------------------------------- a float table read only by the mask
THR = fl.capture("thr", "f32", "B,N")
THRESHOLD = fl.attention(mask_mod=lambda b, h, q, kv: THR[b, kv] > 0.0, name="thrmask")


@pytest.mark.parametrize("pipeline", ["fa2-bwd", "fa2-bwd-deterministic"])
@pytest.mark.parametrize("M,N", [(1, 1), (65, 130), (129, 64)])
def test_a_mask_tables_gradient_is_zero_through_the_backward(pipeline: str, M: int, N: int) -> None:
    """A float table read only by the mask has autodiff's constant-zero gradient: recompute keeps it as a gradient
    (not a second forward output) and tile-bwd makes it outside the nests; dq, dk, dv are the joint's, also for a
    batch row whose every key is masked."""
    rng = np.random.default_rng(M + N)
    q, k, v, do = (rng.standard_normal((2, 2, n, 8)) for n in (M, N, N, M))
    thr = rng.standard_normal((2, N))
    thr[0] = -1.0  # batch row 0: every key masked
    want = fl.interpret(fl.grad(THRESHOLD), [q, k, v, thr, do])[1:]
    o, lse = fl.interpret(fl.lower(THRESHOLD, "fa2-fwd"), [q, k, v, thr])
    low = fl.lower(THRESHOLD, pipeline)
    assert tuple(low.result_names) == ("dq", "dk", "dv", "dthr")
    got = fl.interpret(low, [q, k, v, thr, o, lse, do])
    for name, a, b in zip(low.result_names, got, want):
        np.testing.assert_allclose(a, b, atol=1e-12, err_msg=name)
    assert not np.any(got[3])


def test_the_kernels_gradients_get_the_constant_ones_back() -> None:
    """The numba-cuda call returns dq, dk, dv and each scattered table's gradient; a constant gradient of the
    backward function goes back in its place, made like its input."""
    from falower.compiler import _with_constant_gradients

    bwd = fl.lower(THRESHOLD, "fa2-bwd")
    thr = np.ones((2, 5), np.float32)
    got = _with_constant_gradients(bwd, ("dq", "dk", "dv"), {"thr": thr})
    assert got[:3] == ("dq", "dk", "dv")
    assert got[3].shape == (2, 5) and got[3].dtype == np.float32 and not got[3].any()
    plain = fl.lower(fl.attention(), "fa2-bwd")
    assert _with_constant_gradients(plain, ("dq", "dk", "dv"), {}) == ("dq", "dk", "dv")


def test_the_reference_backend_returns_the_mask_tables_zero_gradient() -> None:
    c = fl.compile(THRESHOLD, "reference")
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 2, 9, 8)).astype(np.float16) for _ in range(4))
    thr = rng.standard_normal((1, 9)).astype(np.float32)
    o, lse = c.forward(q, k, v, thr)
    grads = c.backward(q, k, v, o, lse, do, thr)
    assert c.gradient_names() == ["dq", "dk", "dv", "dthr"] and not np.any(grads[3])


@pytest.mark.parametrize("taken", ["lse", "o"])
def test_recompute_refuses_an_input_named_like_its_own(taken: str) -> None:
    """The backward adds the forward's output and lse as inputs: a captured table of either name once made the
    reference backward blame the user's arrays ('input %lse must have rank 1')."""
    t = fl.capture(taken, "f32", "H")
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + t[h], name="named")
    with pytest.raises(PassError, match=f"an input is named %{taken}"):
        fl.lower(g, "fa2-bwd")


def test_floor_of_a_masked_score_keeps_the_guard(tmp_path, capsys) -> None:
    """floor(-inf) is -inf: autodiff listed floor, ceil and round as finite at a mask's -inf, skipped the guard, and
    the captured scalar's gradient was 0 * -inf = NaN (`--check failed after pass autodiff: gradient dtemp has
    NaN`). A review helper's graph; --check now passes through autodiff."""
    from falower.cli import main

    src = tmp_path / "floor_temp.py"
    src.write_text('import falower as fl\n'
                   'temp = fl.capture("temp", "f32", "")\n'
                   'def sm(s, b, h, q, kv):\n'
                   '    return fl.floor(fl.where(kv <= q, s, float("-inf")) * 4.0) * temp.exp()\n'
                   'graph = fl.attention(score_mod=sm, name="floor_temp")\n')
    for op in ("floor", "ceil", "round"):
        src.write_text(src.read_text().replace("fl.floor(", f"fl.{op}(").replace("fl.ceil(", f"fl.{op}(")
                       .replace("fl.round(", f"fl.{op}("))
        code = main(["opt", str(src), "-p", "autodiff,canonicalize", "--check"])
        out, err = capsys.readouterr()
        assert code == 0 and "NaN" not in err, (op, err)
