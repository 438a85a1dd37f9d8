"""The cost model (falower/passes/cost.py): the seeds' closed forms, exactly, at every level.

- seed 001: FA2 reads N*d + 2*Tr*N*d and writes N*d + N per batch-head; FA1 reads 2*N*d + 2*Tc*N*d and
  writes Tc*N*d + 2*Tc*N (compared term by term, per tensor);
- seed 004: the naive graph moves the [B,H,T,T] score matrices 7 times in and 5 times out;
- mask-tiles on causal visits Tr*(Tr+1)/2 tile pairs, fast at N = 16k;
- and the model agrees with an instrumented interpreter run on every example at ragged sizes.
"""

from __future__ import annotations

import io
import math
import runpy
import time
from pathlib import Path

import numpy as np
import pytest

import falower as fl
from falower.cli import main
from falower.ir.interp import Interpreter
from falower.passes import PASSES, PassManager, run_pipeline
from falower.passes.check import random_inputs
from falower.passes.cost import Cost, CostError, cost_header, cost_of, format_cost

EX = Path(__file__).resolve().parent.parent / "examples"
FA2 = "decompose-softmax,canonicalize,fuse,tile{{bq={bq},bk={bk}}},online-softmax,canonicalize"
FA1 = "decompose-softmax,canonicalize,fuse,tile{{bq={bq},bk={bk},order=fa1}},online-softmax,canonicalize"
MASKED = "decompose-softmax,canonicalize,fuse,tile{{bq={bq},bk={bk}}},online-softmax,mask-tiles,canonicalize"
needs_mask_tiles = pytest.mark.skipif("mask-tiles" not in PASSES, reason="the mask-tiles pass is not registered yet")


def causal():
    return fl.attention(mask_mod=lambda b, h, q, kv: q >= kv, name="causal")


def plain():
    return fl.attention(name="plain")


def lower(g, pipeline: str, bq: int = 64, bk: int = 64):
    return run_pipeline(g, pipeline.format(bq=bq, bk=bk))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------ seed 001
@pytest.mark.parametrize("n", [1024, 1000])  # a multiple of the tiles, and ragged last tiles
def test_fa2_io_matches_seed_001(n: int) -> None:
    B, H, d, bq = 2, 3, 64, 64
    c = cost_of(lower(plain(), FA2), dict(B=B, H=H, M=n, N=n, D=d))
    Tr = cdiv(n, bq)
    bh = B * H
    assert c.elems_read == {"%q": bh * n * d, "%k": bh * Tr * n * d, "%v": bh * Tr * n * d}
    assert c.elems_written == {"%o": bh * n * d, "%lse": bh * n}
    # seed: reads N*d + 2*Tr*N*d, writes N*d + N (per batch-head, elements)
    assert sum(c.elems_read.values()) == bh * (n * d + 2 * Tr * n * d)
    assert sum(c.elems_written.values()) == bh * (n * d + n)
    # bytes: q, k, v, o are f16, lse f32
    assert c.bytes_read == 2 * bh * (n * d + 2 * Tr * n * d)
    assert c.bytes_written == 2 * bh * n * d + 4 * bh * n


@pytest.mark.parametrize("n", [1024, 1000])
def test_fa1_io_matches_seed_001_term_by_term(n: int) -> None:
    B, H, d, bk = 1, 2, 64, 64
    c = cost_of(lower(plain(), FA1), dict(B=B, H=H, M=n, N=n, D=d))
    Tc = cdiv(n, bk)
    bh = B * H
    r, w = c.elems_read, c.elems_written
    # seed reads 2*N*d + 2*Tc*N*d: K and V once, Q and O once per kv tile
    assert r["%k"] == r["%v"] == bh * n * d
    assert r["%q"] == r["%O"] == bh * Tc * n * d
    # seed writes Tc*N*d + 2*Tc*N: O, l, m every step
    assert w["%O"] == bh * Tc * n * d
    assert w["%l"] == w["%m"] == bh * Tc * n
    # not in the seed: the re-reads of l and m, and the final o, lse outputs
    assert r["%l"] == r["%m"] == bh * Tc * n
    assert w["%o"] == bh * n * d and w["%lse"] == bh * n
    assert set(r) == {"%q", "%k", "%v", "%O", "%l", "%m"}
    assert set(w) == {"%O", "%l", "%m", "%o", "%lse"}
    # O, l, m are f32 in main memory
    assert c.writes["%O"] == 4 * w["%O"] and c.writes["%o"] == 2 * w["%o"]


def test_fa1_moves_more_than_fa2_same_flops() -> None:
    dims = dict(B=1, H=1, M=2048, N=2048, D=64)
    fa1, fa2 = cost_of(lower(plain(), FA1), dims), cost_of(lower(plain(), FA2), dims)
    assert fa1.bytes_written > 10 * fa2.bytes_written
    assert fa1.bytes_read > fa2.bytes_read
    assert fa1.executions["tile.matmul"] == fa2.executions["tile.matmul"] == 2 * 32 * 32


# ------------------------------------------------------------------------------------------ seed 004
def naive_graph():
    @fl.trace(q=fl.tensor("f32", "B,H,T,D"), k=fl.tensor("f32", "B,H,T,D"), v=fl.tensor("f32", "B,H,T,D"))
    def naive(q, k, v):
        s = q @ k.mT
        s = s / math.sqrt(64)
        p = fl.softmax(s, dim=-1)
        return p @ v

    return naive


def test_naive_graph_traffic_matches_seed_004() -> None:
    """Seed 004 counts 6 reads and 5 writes of [B,H,T,T] matrices in steps (1)-(7); P @ V reads P once more.

    Our decomposition has the same score-sized traffic: S (matmul) w; S/sqrt(d) r,w; reduce_max r;
    sub r,w; exp r,w; reduce_sum r; div r,w; matmul P@V r. It differs only in [B,H,T,1] vectors: the
    m_safe / l_safe guards (`where(m == -inf, 0, m)`) add small kernels the seed does not have.
    """
    B, H, T, d = 2, 3, 100, 64
    f = run_pipeline(naive_graph(), "decompose-softmax,canonicalize")
    c = cost_of(f, dict(B=B, H=H, T=T, D=d))
    full = B * H * T * T
    reads = sum(n // full for n in c.elems_read.values() if n % full == 0 and n >= full)
    writes = sum(n // full for n in c.elems_written.values() if n % full == 0 and n >= full)
    assert (reads, writes) == (7, 5)
    assert sum(c.elems_read.values()) == 7 * full + 3 * B * H * T * d + 8 * B * H * T
    # the guards: eq and where read m (and l) and the bool, write a bool and the guarded vector
    assert c.elems_written["%m_safe"] == c.elems_written["%l_safe"] == B * H * T
    # FLOPs: two matmuls, and 1 per element of every score-sized elementwise op / reduction input
    mm = 2 * 2 * B * H * T * T * d
    assert c.flops == mm + 6 * full + 4 * B * H * T


def test_graph_level_softmax_is_one_kernel() -> None:
    dims = dict(B=1, H=2, T=50, D=64)
    c = cost_of(naive_graph(), dims)
    full = 2 * 50 * 50
    assert c.elems_written["%3"] == full and c.elems_read["%3"] == full  # softmax writes P once, P @ V reads it
    assert c.elems_read["%2"] == full  # softmax reads the scaled scores once
    assert c.flops == 2 * 2 * full * 64 + 5 * full + full  # two matmuls, softmax 5/elem, the scale division


# ------------------------------------------------------------------------------------- eager rules
def test_broadcast_operands_count_at_their_own_size_and_consts_are_free() -> None:
    @fl.trace(x=fl.tensor("f16", "B,H,M,N"), r=fl.tensor("f32", "B,H,M,1"))
    def g(x, r):
        return (x.to("f32") - r) * 2.0

    c = cost_of(g, dict(B=2, H=3, M=5, N=7))
    full, row = 2 * 3 * 5 * 7, 2 * 3 * 5
    assert c.elems_read["%x"] == full and c.reads["%x"] == 2 * full
    assert c.elems_read["%r"] == row and c.reads["%r"] == 4 * row
    assert c.flops == 3 * full  # cast, sub, mul; the constant 2.0 costs nothing
    assert c.bytes_written == 3 * 4 * full


def test_dtype_sizes() -> None:
    from falower.ir.types import DTYPES
    from falower.passes.cost import DTYPE_BYTES

    assert set(DTYPE_BYTES) == set(DTYPES)

    @fl.trace(x=fl.tensor("bf16", "N"), y=fl.tensor("i8", "N"), z=fl.tensor("i32", "N"))
    def g(x, y, z):
        return x.to("f32") + (y.to("i32") + z).to("f32")

    c = cost_of(g, dict(N=10))
    assert (c.reads["%x"], c.reads["%y"], c.reads["%z"]) == (20, 10, 40)  # bf16 is 2 bytes, not numpy's 4


def test_fused_reads_operands_and_writes_its_result_once() -> None:
    f = run_pipeline(causal(), "decompose-softmax,canonicalize,fuse")
    B, H, M, N, D = 1, 2, 40, 48, 16
    c = cost_of(f, dict(B=B, H=H, M=M, N=N, D=D))
    full = B * H * M * N
    assert c.elems_written["%x"] == full
    # the fused score function reads S only; q_idx/kv_idx are iotas, generated in the kernel
    assert c.elems_read["%0"] == full and "%q_idx" not in c.elems_read
    assert c.executions["fused"] == 1


# ------------------------------------------------------------------------------- tile skipping
@needs_mask_tiles
@pytest.mark.parametrize("n", [1024, 640])
def test_causal_mask_tiles_visits_half_the_tiles(n: int) -> None:
    B, H, d = 1, 2, 64
    f = lower(causal(), MASKED)
    c = cost_of(f, dict(B=B, H=H, M=n, N=n, D=d))
    Tr = n // 64
    visited = Tr * (Tr + 1) // 2
    assert c.executions["tile.matmul"] == B * H * 2 * visited
    assert c.elems_read["%k"] == c.elems_read["%v"] == B * H * visited * 64 * d
    full = cost_of(lower(causal(), FA2), dict(B=B, H=H, M=n, N=n, D=d))
    assert full.executions["tile.matmul"] == B * H * 2 * Tr * Tr
    # about (Tr + 1) / (2 Tr) of the FLOPs: the per-q-tile epilogue is not halved (more), the full tiles skip the
    # mask's elementwise work that the unskipped graph does on every tile (less; the model classifies `kv < N` with
    # N's size, so only the diagonal tiles count it)
    ratio = c.flops / full.flops
    assert (Tr + 1) / (2 * Tr) * 0.98 < ratio < (Tr + 1) / (2 * Tr)


@needs_mask_tiles
def test_causal_mask_tiles_is_fast_at_16k() -> None:
    f = lower(causal(), MASKED)
    t0 = time.perf_counter()
    c = cost_of(f, dict(B=4, H=16, M=16384, N=16384, D=128))
    elapsed = time.perf_counter() - t0
    Tr = 256
    assert c.executions["tile.matmul"] == 4 * 16 * Tr * (Tr + 1)
    assert elapsed < 20, f"cost_of took {elapsed:.1f} s"


@needs_mask_tiles
def test_data_dependent_mask_is_an_upper_bound() -> None:
    g = runpy.run_path(str(EX / "document.py"))["graph"]
    f = lower(g, MASKED.replace("mask-tiles", "mask-tiles{{data=table}}"))  # the dense table's costs
    B, H, M, N, d = 2, 2, 200, 200, 16
    c = cost_of(f, dict(B=B, H=H, M=M, N=N, D=d))
    nq = nk = cdiv(200, 64)
    # the table: written once by mask.block_table, one i8 read per visited (q, kv) pair
    assert c.elems_written["%block_class"] == B * H * nq * nk
    assert c.elems_read["%block_class"] == B * H * nq * nk
    # without the data every in-bounds tile counts as visited and partial
    assert c.executions["tile.matmul"] == B * H * nq * nk * 2


@needs_mask_tiles
def test_data_dependent_mask_is_exact_given_the_data() -> None:
    g = runpy.run_path(str(EX / "document.py"))["graph"]
    f = lower(g, MASKED, bq=16, bk=16)
    dims = dict(B=2, H=2, M=96, N=96, D=8)
    ids = np.repeat(np.array([[0, 1, 2], [0, 0, 1]]), [40, 40, 16], axis=1)  # per row: documents of 40, 40, 16
    ids[1, 80:] = -1  # padding: attends to nothing
    inputs = random_inputs(f, dims)[:3] + [ids.astype(np.int32)]
    it = CountingInterpreter()
    it.run(f, inputs, dims)
    exact = cost_of(f, dims, data={"doc_id": ids})
    bound = cost_of(f, dims)
    assert exact.executions["tile.matmul"] == it.matmuls
    assert exact.elems_read["%k"] + exact.elems_read["%v"] + exact.elems_read["%q"] == it.loaded - it.table_reads
    assert exact.executions["tile.matmul"] < bound.executions["tile.matmul"] == 2 * 2 * 2 * 6 * 6


# -------------------------------------------------------------- agreement with the interpreter
class CountingInterpreter(Interpreter):
    """The reference interpreter, counting main-memory elements moved by tile.load / tile.insert / yields."""

    def __init__(self) -> None:
        super().__init__("f64")
        self.loaded = 0
        self.table_reads = 0
        self.matmuls = 0

    def op_tile_load(self, op, x, env):
        src = op.operands[0].type
        if any(not d.is_const for d in src.shape) and not src.shape[0].is_const:
            s, _, _ = self._slices(x[0].shape, op.attrs["slice"], x[1:])
            self.loaded += x[0][s].size
            self.table_reads += x[0][s].size if src.dtype == "i8" else 0
        return super().op_tile_load(op, x, env)

    def op_tile_matmul(self, op, x, env):
        self.matmuls += 1
        return super().op_tile_matmul(op, x, env)


EXAMPLES = sorted(p.stem for p in EX.glob("*.py"))


@needs_mask_tiles
@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("pipeline", [FA2, FA1, MASKED], ids=["fa2", "fa1", "mask-tiles"])
def test_model_agrees_with_interpreter(name: str, pipeline: str) -> None:
    g = next(v for v in runpy.run_path(str(EX / f"{name}.py")).values() if isinstance(v, fl.ir.Func))
    f = lower(g, pipeline, bq=16, bk=16)
    dims = dict(B=1, H=2, HKV=1, M=37, N=45, D=8)
    env = {k: v for k, v in dims.items() if any(k in d.symbols() for a in f.args for d in a.type.shape)}
    it = CountingInterpreter()
    it.run(f, random_inputs(f, env), env)
    c = cost_of(f, it.env_dims)
    loaded = sum(n for k, n in c.elems_read.items() if k != "%block_class")
    if name == "document":  # data-dependent: the model is an upper bound
        assert it.matmuls <= c.executions["tile.matmul"]
    else:
        assert c.executions.get("tile.matmul", 0) == it.matmuls
        gathers = sum(n for k, n in c.elems_read.items() if k not in ("%q", "%k", "%v", "%O", "%l", "%m"))
        assert loaded - gathers == it.loaded


# ---------------------------------------------------------------------------- headers, errors, CLI
def test_format_cost() -> None:
    c = Cost(flops=2_150_000_000, bytes_read=1_050_000, bytes_written=260_000)
    assert format_cost(c) == "cost: 2.15 GFLOP, read 1.05 MB, written 0.26 MB"


def test_cost_header_in_dumps() -> None:
    out = io.StringIO()
    PassManager(FA2.format(bq=64, bk=64), print_after_all=True, out=out,
                header_extra=cost_header(dict(B=1, H=1, M=1024, N=1024, D=64))).run(plain())
    text = out.getvalue()
    headers = [ln for ln in text.splitlines() if ln.startswith("// cost:")]
    assert len(headers) == 6
    assert headers[-1] == "// " + format_cost(cost_of(lower(plain(), FA2), dict(B=1, H=1, M=1024, N=1024, D=64)))


def test_cost_header_never_fails_the_dump() -> None:
    hook = cost_header(dict(B=1, H=1))  # M, N, D missing
    assert hook(plain(), None, 0).startswith("cost: n/a (no size given for dimension")


def test_unknown_loop_bound_is_a_clear_error() -> None:
    from falower.ir import parse_func

    f = parse_func("""func @g(%x: f32[M,D], %n: i32) -> (o: f32[M,D]) {
  %o = parallel_for (%i) in (1) : f32[M,D] {
    %0 = const 0 : i32
    %1 = const 0.0 : f32[16,D]
    %a = for %j = %0 to %n iter_args(%acc = %1) : f32[16,D] {
      %t = tile.load %x[%0 : 16, :] : f32[16,D]
      %s = add %acc, %t : f32[16,D]
      yield %s
    }
    tile.yield %a into [%0 : 16, :]
  }
  return %o
}
""")
    with pytest.raises(CostError, match="trip count"):
        cost_of(f, dict(M=32, D=4))


def test_cli_cost_table(capsys) -> None:
    code = main(["cost", str(EX / "causal.py"), "-p", FA2.format(bq=64, bk=64),
                 "--shapes", "B=1,H=1,M=1024,N=1024,D=64"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0] == "# @causal at B=1,H=1,M=1024,N=1024,D=64"
    assert lines[1].split() == ["pass", "GFLOP", "MB", "read", "MB", "written"]
    rows = [ln.split() for ln in lines[2:]]
    assert [r[0] for r in rows] == ["(input)", "decompose-softmax", "canonicalize", "fuse", "tile{bq=64,bk=64}",
                                    "online-softmax", "canonicalize"]
    c = cost_of(lower(causal(), FA2), dict(B=1, H=1, M=1024, N=1024, D=64))
    assert float(rows[-1][1]) == pytest.approx(c.flops / 1e9, abs=0.01)
    assert float(rows[-1][2]) == pytest.approx(c.bytes_read / 1e6, abs=0.01)
    assert float(rows[-1][3]) == pytest.approx(c.bytes_written / 1e6, abs=0.01)
    assert float(rows[0][2]) > 4 * float(rows[-1][2])  # the eager graph moves far more than FA2


def test_cli_cost_per_tensor_and_errors(capsys) -> None:
    code = main(["cost", str(EX / "plain.py"), "-p", FA1.format(bq=64, bk=64), "--shapes", "M=256,N=256,D=64,B=1,H=1",
                 "--per-tensor"])
    out, err = capsys.readouterr()
    assert code == 0, err
    tensors = {ln.split()[0] for ln in out.splitlines() if ln.startswith("  %")}
    assert tensors == {"%q", "%k", "%v", "%O", "%l", "%m", "%o", "%lse"}
    code = main(["cost", str(EX / "document.py"), "-p", MASKED.replace("mask-tiles", "mask-tiles{{data=table}}")
                 .format(bq=64, bk=64), "--shapes", "M=256,N=256"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "# from mask-tiles{data=table} on: a data-dependent mask (mask.block_table)" in out
    code = main(["cost", str(EX / "plain.py"), "-p", "fuse", "--shapes", "Q=3"])
    _, err = capsys.readouterr()
    assert code == 1 and "falower: error: --shapes: Q is not a dimension" in err
