"""Data-dependent masks through mask.ranges in the CUDA simulator (run in a subprocess with
NUMBA_ENABLE_CUDASIM=1 by test_block_list_simulator.py). Prints one JSON line per case.

`list` cases: the block list the runtime makes (block_data.py: range tables, then tile_class_fn per tile in
the list kernel) against the exact classes (`Interpreter.block_classes`, a brute force over every (q, kv)
pair): a tile left out must be empty and a tile called full must be full (a ragged last kv tile, which the
kernel masks itself, only non-empty); on tiles inside both bounds the list's classes are the IR's own
`mask.classify` (intervals.classify over the same range tables). `fwd` cases: the forward kernel visiting
that list against the float64 reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.setswitchinterval(5e-4)

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "backend"))
from sim_script import example_graph  # noqa: E402
PIPELINE = "decompose-softmax,canonicalize,fuse,tile{{bq={bq},bk={bk}}},online-softmax{{exp2=true}},mask-tiles," \
           "canonicalize"


def graph(mask: str):
    from data_masks import MASKS

    if mask == "document":
        return example_graph("document")
    return MASKS[mask]()


def block_list_classes(c, inputs: list, env: dict, B: int, H: int, M: int, N: int, bq: int, bk: int):
    """The classes the block list gives (0 when a tile is not listed), whether each row is ascending, and how
    many rows skip an empty tile between two they visit."""
    kern = c.kernel(*inputs)
    assert kern.spec.block_mask == "list", kern.spec.block_mask
    caps = [inputs[c.lowered.args.index(v)] for v in c.analysis.captures]
    sizes = [int(env[d]) for d in c.analysis.runtime_dims]
    count, tiles = c.block_data(kern).block_list(caps + sizes, (B, H, M, N), inputs[0])
    nq, nk = -(-M // bq), -(-N // bk)
    got = np.zeros((B, H, nq, nk), dtype=np.int8)
    ascending = True
    holes = 0
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                row = tiles[b, h, i, :count[b, h, i]]
                ascending &= bool(np.all(np.diff(row >> 1) > 0))
                holes += int(np.any(np.diff(row >> 1) > 1))  # an empty tile between visited ones: skipped
                got[b, h, i, row >> 1] = np.where(row & 1, 1, 2)
    return got, ascending, holes


def run_list_case(mask: str, kind: str, M: int, N: int, bq: int = 32, bk: int = 16) -> dict:
    import falower as fl
    from falower.ir.interp import Interpreter
    from falower.ir.intervals import classify, minmax_table, range_tables
    from falower.passes.check import bind_dims, random_inputs

    g = graph(mask)
    B, H = 2, 2
    env = bind_dims(g, {"B": B, "H": H, "M": M, "N": N, "D": 16})
    inputs = random_inputs(g, env, seed=M * 100 + N, kind=kind)
    inputs = [x.astype(np.float16) if i < 3 else x for i, x in enumerate(inputs)]
    c = fl.compile(g, "numba-cuda", pipeline=PIPELINE.format(bq=bq, bk=bk), path="mma", num_warps=2)
    got, ascending, holes = block_list_classes(c, inputs, env, B, H, M, N, bq, bk)
    nq, nk = got.shape[2:]
    op = next(o for o in c.lowered.walk() if o.name == "mask.kv_range")
    spec = op.attrs["ranges"]
    by_arg = {a: x for a, x in zip(c.lowered.args, inputs)}
    op_caps = [by_arg[v] for v in op.operands[4:4 + len(op.operands) - 4 - len(spec)]]
    tables = [minmax_table(op_caps[ci], axis, gr) for ci, axis, gr in spec]
    it = Interpreter("f64")
    it.env_dims = env
    exact = it.block_classes(op.regions[0], op_caps + tables, B, H, nq, nk, bq, bk, M)
    ranges = range_tables(spec, op_caps + tables)
    ragged = np.zeros(nk, dtype=bool)
    ragged[-1] = N % bk != 0
    bad_empty = (got == 0) & (exact != 0)
    bad_full = (got == 2) & (exact != 2) & ~(ragged[None, None, None, :] & (exact != 0))
    inside = 0
    differ = 0
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                if (i + 1) * bq > M:
                    continue
                for j in range(nk):
                    if (j + 1) * bk > N:
                        continue
                    want = classify(op.regions[0], b, h, i * bq, i * bq + bq - 1, j * bk, j * bk + bk - 1,
                                    op_caps + tables, env, ranges)
                    inside += 1
                    differ += int(want != got[b, h, i, j])
    return {"id": f"list-{mask}-{kind}-{M}x{N}", "sound": not bool(bad_empty.any() or bad_full.any()),
            "ascending": ascending, "holes": holes, "inside": inside, "differ_from_ir": differ,
            "visited": int((got != 0).sum()), "exact_nonempty": int((exact != 0).sum()),
            "skipped": int((got == 0).sum()), "full": int((got == 2).sum())}


def run_fwd_case(mask: str, kind: str, M: int, N: int, path: str) -> dict:
    import falower as fl
    from falower.passes.check import Reference, bind_dims, random_inputs

    g = graph(mask)
    env = bind_dims(g, {"B": 2, "H": 2, "M": M, "N": N, "D": 16})
    inputs = [x.astype(np.float16) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
              for i, x in enumerate(random_inputs(g, env, seed=M * 100 + N, kind=kind))]
    ref = Reference.build(g, env, inputs=inputs)
    c = fl.compile(g, "numba-cuda", pipeline=PIPELINE.format(bq=32, bk=16), path=path,
                   num_warps=2 if path == "mma" else None)
    o, lse = c(*inputs)
    want_o, want_lse = ref.outputs["o"], ref.outputs["lse"]
    fin = np.isfinite(want_lse)
    got = np.asarray(o, dtype=np.float64)
    listed = c.kernel(*inputs).spec.block_mask == "list"
    holes = block_list_classes(c, inputs, env, 2, 2, M, N, 32, 16)[2] if listed else 0
    return {"id": f"fwd-{mask}-{kind}-{M}x{N}-{path}", "block_mask": c.kernel(*inputs).spec.block_mask,
            "holes": holes,
            "nan": bool(np.isnan(got).any() or np.isnan(lse).any()),
            "o_err": float(np.max(np.abs(got - want_o))),
            "lse_err": float(np.max(np.abs(lse[fin] - want_lse[fin]))) if fin.any() else 0.0,
            "lse_inf_ok": bool(np.array_equal(np.isneginf(lse), np.isneginf(want_lse))),
            "masked_rows": int((~fin).sum())}


def run_bwd_case(kind: str, M: int, N: int, path: str, dq: str) -> dict:
    """The document example's backward visiting its block lists (per kv tile the q tiles; dq=det: per q tile
    the kv tiles too) against the backward IR interpreted in float64 (bwd_sim_cases.run_case), 16 x 16 tiles;
    and how many (kv tile, q tile) pairs the kv-outer list leaves out, rows with a gap among them."""
    import falower as fl
    from bwd_sim_cases import BWD, DQ, FWD, run_case
    from falower.passes.check import bind_dims, random_inputs

    out = run_case("document", path, 16, M, N, dq, kind=kind)
    out["id"] = bwd_id((kind, M, N, path, dq))
    g = graph("document")
    env = bind_dims(g, {"B": 1, "H": 2, "M": M, "N": N, "D": 16})
    inputs = random_inputs(g, env, seed=1, kind=kind)  # run_case's ids (its seed, its kind)
    inputs = [x.astype(np.float16) if i < 3 else x for i, x in enumerate(inputs)]
    c = fl.compile(g, "numba-cuda", pipeline=FWD, backward=BWD.format(t=16, tk=16, dq=DQ[dq]), path=path)
    kern = c.backward_kernel(*inputs)
    caps = [inputs[3]] + [int(env[d]) for d in kern.spec.dims]
    lists = c.block_data(kern).lists(caps, (1, 2, M, N), inputs[0])
    nq, nk = -(-M // 16), -(-N // 16)
    count, tiles = lists["q_count"], lists["q_tiles"]
    out["skipped"] = int(2 * nq * nk - count.sum())
    out["holes"] = sum(int(np.any(np.diff(tiles[r * nq: r * nq + count[r]] >> 1) > 1)) for r in range(2 * nk))
    return out


def run_table_case(M: int, N: int, backward: bool = False) -> dict:
    """A mask the range analysis cannot bound (offsets[ids[q]] <= kv: a table read at an index read from data)
    keeps the dense block table; called twice with the same ids and offsets it is evaluated once, with offsets
    written in place once more, and the numbers are the reference's every time (row 0 and other rows fully
    masked: offsets past the last kv). With `backward`, two backward calls evaluate the backward's table once."""
    import falower as fl
    from falower.passes.check import Reference, bind_dims

    g = graph("nested")
    env = bind_dims(g, {"B": 1, "H": 1, "M": M, "N": N, "D": 16})
    rng = np.random.default_rng(M * 100 + N)
    q = rng.standard_normal((1, 1, M, 16)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, N, 16)).astype(np.float16) for _ in range(2))
    ids = rng.integers(0, N, size=N).astype(np.int32)
    offsets = rng.integers(0, N + 2, size=N).astype(np.int32)
    offsets[ids[0]] = N  # row 0 (and every row of its id) attends to nothing
    names = [a.name for a in g.args[3:]]
    tables = {"ids": ids, "offsets": offsets}
    inputs = [q, k, v] + [tables[n] for n in names]
    c = fl.compile(g, "numba-cuda", pipeline=PIPELINE.format(bq=32, bk=16), path="mma", num_warps=2,
                   backward=bwd_pipeline() if backward else None)
    kern = c.kernel(*inputs)
    errs, counts, masked = [], [], 0

    def run() -> None:
        nonlocal masked
        ref = Reference.build(g, env, inputs=[x.astype(np.float64) if i < 3 else x for i, x in enumerate(inputs)])
        o, lse = c(*inputs)
        want_o, want_lse = ref.outputs["o"], ref.outputs["lse"]
        fin = np.isfinite(want_lse)
        masked = max(masked, int((~fin).sum()))
        ok = bool(np.array_equal(np.isneginf(lse), ~fin)) and not np.isnan(o).any()
        err = float(np.max(np.abs(np.asarray(o, np.float64) - want_o)))
        lerr = float(np.max(np.abs(lse[fin] - want_lse[fin]))) if fin.any() else 0.0
        errs.append(err if ok and lerr <= 1e-3 else float("inf"))
        counts.append(kern.block_tables.evaluations)

    run()
    run()  # the same arrays: not evaluated again
    offsets[:] = np.where(np.arange(N) % 2 == 0, 0, N)  # in place: every other id keeps all, the rest nothing
    run()
    out = {"id": table_id((M, N, backward)), "block_mask": kern.spec.block_mask, "evaluations": counts,
           "errs": errs, "masked_rows": masked}
    if backward:
        o, lse = c(*inputs)
        do = np.random.default_rng(3).standard_normal(o.shape).astype(np.float16)
        bk = c.backward_kernel(*inputs)
        g1 = c.backward(q, k, v, o, lse, do, *inputs[3:])
        g2 = c.backward(q, k, v, o, lse, do, *inputs[3:])
        out["bwd_block_mask"] = bk.spec.block_mask
        out["bwd_evaluations"] = bk.block_tables.evaluations
        out["bwd_same"] = all(np.array_equal(np.asarray(a), np.asarray(b)) or name == "dq"
                              for name, a, b in zip(c.gradient_names(), g1, g2))
    return out


def bwd_pipeline() -> str:
    from bwd_sim_cases import BWD, DQ

    return BWD.format(t=16, tk=16, dq=DQ["atomic"])


# sizes around the tiles (32 x 16): 1, 2, tile - 1, tile, tile + 1, M != N both ways
SIZES = [(1, 1), (2, 2), (31, 15), (32, 16), (33, 17), (40, 9), (9, 40), (65, 65)]
# ascending, unsorted, constant, every id -1 (fully masked rows), all distinct ids (positions), descending
KINDS = ["sorted", "unsorted", "constant", "nothing", "positions", "descending"]
LIST_CASES = [("document", k, m, n) for k in KINDS for m, n in SIZES]
LIST_CASES += [(mask, k, 65, 65) for mask in ("doc_per_head", "shared_prefix", "global_window", "blocks")
               for k in ("sorted", "unsorted", "blocks")]  # 65 x 65
FWD_CASES = [("document", "sorted", 40, 37, "mma"), ("document", "sorted", 9, 40, "mma"), ("document", "unsorted", 40, 37, "mma"),
             ("document", "nothing", 17, 33, "mma"), ("document", "positions", 33, 17, "simt"),
             ("doc_per_head", "blocks", 40, 37, "simt"), ("global_window", "unsorted", 40, 37, "mma"),
             ("threshold", "positions", 40, 37, "mma"),  # thr[h]: range tables, in-kernel scan (static)
             # the mma kernel reads its list one entry ahead: lists of one entry, of every tile (constant ids,
             # a ragged last tile), and long ones with gaps (sorted 65 x 65: up to 5 entries a row)
             ("document", "sorted", 1, 1, "mma"), ("document", "constant", 33, 17, "mma"),
             ("document", "sorted", 65, 65, "mma")]


# the backward over its lists (16 x 16 tiles): ragged sizes, ids unsorted, constant, all distinct, all padding,
# and sorted ones whose lists have gaps; both paths, both ways of making dQ
BWD_CASES = [("unsorted", 40, 37, "mma", "atomic"), ("constant", 33, 17, "mma", "det"),
             ("positions", 17, 33, "simt", "atomic"), ("nothing", 20, 19, "mma", "det"),
             ("sorted", 65, 50, "mma", "atomic")]
# the dense block table, once per distinct data: sizes 1, 2, tile - 1, tile + 1, M != N both ways (32 x 16)
TABLE_CASES = [(1, 1, False), (2, 2, False), (31, 15, False), (33, 17, True), (40, 9, False), (9, 40, False)]


def run_ids(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """One slice of ids of `kind`, n long."""
    if kind == "sorted":  # documents in order, then padding (-1): runs up, then one down, no value back
        return np.concatenate([np.sort(rng.integers(0, max(n // 7, 1), n - n // 5)), np.full(n // 5, -1)])
    if kind == "unsorted":  # a document comes back after another
        return np.resize(np.repeat([0, 1, 0, 2], max(n // 9, 1)), n)
    if kind == "constant":
        return np.full(n, 5)
    if kind == "distinct":
        return np.arange(n)
    if kind == "descending":
        return np.arange(n)[::-1] // 3
    if kind == "random":  # many short runs of few values: values come back unless n is tiny
        return rng.integers(0, 3, n)
    return np.sort(rng.integers(0, 2, n))[::-1]  # "two": two runs, down


RUN_KINDS = ["sorted", "unsorted", "constant", "distinct", "descending", "random", "two"]
RUN_SIZES = [1, 2, 127, 129, 300]  # around the kernel's 128 threads: one entry a thread, two, three
RUN_CASES = [(n, 0) for n in RUN_SIZES] + [(300, 4)]  # (n, rcap): and a list of 4 runs, most slices past it


def run_id(n: int, rcap: int = 0) -> str:
    return f"runs-{n}" + (f"-rcap{rcap}" if rcap else "")


def run_runs_case(n: int, rcap: int = 0) -> dict:
    """The run table kernel (block_data.RUN_TABLE_SOURCE, a slice a block) over one slice of each RUN_KINDS at
    length n, against block_data.run_table_host: equal everywhere. rcap: the runs its shared list holds, made
    small so that the slices with more list them in global memory."""
    from falower.backends.numba_cuda.block_data import RUN_TABLE_SOURCE, RUN_THREADS, RUN_VALUES, run_table_host
    from falower.backends.numba_cuda.runtime import load_source
    from falower.ir.intervals import minmax_table

    rng = np.random.default_rng(n)
    x = np.stack([run_ids(k, n, rng) for k in RUN_KINDS]).astype(np.int32)
    out = np.full(x.size * 2, -7, dtype=np.int32)
    source = RUN_TABLE_SOURCE.replace(f"RCAP = {RUN_VALUES}\n", f"RCAP = {rcap}\n") if rcap else RUN_TABLE_SOURCE
    assert not rcap or source != RUN_TABLE_SOURCE
    mod = load_source(source, "run_table")
    vg = np.full(x.size, -9, dtype=np.int32)  # the run values' scratch past rcap runs
    mod.run_table_kernel[len(RUN_KINDS), RUN_THREADS](x.ravel(), out, vg, n)
    got, want = out.reshape(*x.shape, 2), run_table_host(x, 1)
    ranges = {}  # the range table kernel (a granule a thread) against intervals.minmax_table, granules 1 .. 128
    for g in (1, 5, 64, 128):
        ng = -(-n // g)
        cells = len(RUN_KINDS) * ng
        table = np.full(cells * 2, -7, dtype=np.int32)
        mod.range_table_kernel[-(-cells // RUN_THREADS), RUN_THREADS](x.ravel(), table, n, g, cells)
        ranges[g] = int((table.reshape(len(RUN_KINDS), ng, 2) != minmax_table(x, 1, g)).sum())
    return {"id": run_id(n, rcap), "ranges_differ": ranges,
            "differ": {k: int((got[i] != want[i]).any(-1).sum()) for i, k in enumerate(RUN_KINDS)},
            "exact": {k: bool(want[i, 0, 0] >= 0) for i, k in enumerate(RUN_KINDS)}}


def bwd_id(case: tuple) -> str:
    kind, M, N, path, dq = case
    return f"bwd-document-{kind}-{M}x{N}-{path}-{dq}"


def table_id(case: tuple) -> str:
    M, N, backward = case
    return f"table-nested-{M}x{N}" + ("-bwd" if backward else "")


def list_id(case: tuple) -> str:
    mask, kind, M, N = case
    return f"list-{mask}-{kind}-{M}x{N}"


def fwd_id(case: tuple) -> str:
    mask, kind, M, N, path = case
    return f"fwd-{mask}-{kind}-{M}x{N}-{path}"


if __name__ == "__main__":
    wanted = sys.argv[1:]
    jobs = [(list_id(c), run_list_case, c) for c in LIST_CASES] + [(fwd_id(c), run_fwd_case, c) for c in FWD_CASES]
    jobs += [(bwd_id(c), run_bwd_case, c) for c in BWD_CASES] + [(table_id(c), run_table_case, c) for c in TABLE_CASES]
    jobs += [(run_id(*c), run_runs_case, c) for c in RUN_CASES]
    for cid, run, args in jobs:
        if wanted and cid not in wanted:
            continue
        try:
            print(json.dumps(run(*args)), flush=True)
        except Exception as e:  # report, the test fails on it
            import traceback

            print(json.dumps({"id": cid, "error": f"{type(e).__name__}: {e}",
                              "where": traceback.format_exc()[-1500:]}), flush=True)
