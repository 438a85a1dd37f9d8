"""On the GPU: every example through falower.compile, FlashAttention's error rule (marked gpu).

max |kernel - ref64| <= 2 * max |naive attention in the same low precision - ref64| + 1e-5, where the
naive computation is the input graph interpreted with every float rounded to the input dtype, and ref64 the
input graph in float64 on the same (rounded) inputs. N = 1, 17, 128, 1000, 4096; D = 64, 128; fp16, bf16.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402
from falower.ir import Func, interpret  # noqa: E402
from falower.ir.interp import round_bf16  # noqa: E402
from falower.passes.check import Reference, bind_dims, random_inputs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
STEMS = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
COMPILED: dict = {}
# graphs the GPU tests build beside the examples (test_tanh_approx_gpu.py): the softcap with the hardware's tanh
TEST_GRAPHS = {"softcap_approx": lambda: fl.attention(
    score_mod=lambda s, b, h, q, kv: 30.0 * fl.tanh(s / 30.0, approx=True), name="softcap_approx")}


def graph(stem: str, dtype: str) -> Func:
    key = (stem, dtype)
    if key not in COMPILED:
        g = TEST_GRAPHS[stem]() if stem in TEST_GRAPHS else \
            next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, Func))
        if dtype != g.args[0].type.dtype:  # the examples are traced in f16; retrace the text for bf16
            text = fl.print_func(g).replace("f16[", f"{dtype}[").replace('"f16"', f'"{dtype}"')
            g = fl.parse_func(text)
        COMPILED[key] = (g, fl.compile(g, "numba-cuda"))
    return COMPILED[key]


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(np.float16) if dtype == "f16" else round_bf16(x.astype(np.float32))


@pytest.mark.parametrize("N", [1, 17, 128, 1000, 4096])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("stem", STEMS)
def test_example_error_rule(stem, dtype, D, N):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g, c = graph(stem, dtype)
    env = bind_dims(g, {"B": 1, "H": 2, "HKV": 1, "M": N, "N": N, "D": D})
    raw = random_inputs(g, env, seed=N + D)
    host = [rounded(x, dtype) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
            for i, x in enumerate(raw)]
    assert_error_rule(g, c, env, host, dtype)


WIDE: dict = {}


@pytest.mark.parametrize("N", [1000, 4096])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("stem", STEMS)
def test_example_error_rule_d64_wide_tiles(stem, dtype, N):
    """D = 64's 192-row tiles (three consumer warpgroups), which the grids above (B = 1, H = 2) no longer take:
    there the same kernel's 128-row tiles run (compiler._d64_tiling's "two"); `small_grid: False` keeps the
    192-row ones, as a large grid would take them."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g, _ = graph(stem, dtype)
    if (stem, dtype) not in WIDE:
        WIDE[stem, dtype] = fl.compile(g, "numba-cuda", extra={"small_grid": False})
    c = WIDE[stem, dtype]
    env = bind_dims(g, {"B": 1, "H": 2, "HKV": 1, "M": N, "N": N, "D": 64})
    if c._d64_tiling(dtype, "mma", env) != "wide":  # a block list, a narrow window: 128 x 64 (tested above)
        pytest.skip(f"{stem} does not take the 192-row tiles at N = {N}")
    assert c.specialize(dtype, **env).spec.block_q == 192
    raw = random_inputs(g, env, seed=N + 64)
    host = [rounded(x, dtype) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
            for i, x in enumerate(raw)]
    assert_error_rule(g, c, env, host, dtype)


def to_device(host: list, dtype: str) -> list:
    tdt = torch.float16 if dtype == "f16" else torch.bfloat16
    return [torch.from_numpy(np.asarray(x, dtype=np.float32)).to("cuda", tdt) if i < 3
            else torch.from_numpy(np.ascontiguousarray(x) if np.ndim(x) else np.asarray(x)).cuda()  # (0-d stays 0-d)
            for i, x in enumerate(host)]


def assert_error_rule(g: Func, c, env: dict, host: list, dtype: str) -> list:
    """FlashAttention's rule: the kernel's O within twice the error of naive attention in the same low
    precision (both against float64), LSE within 1e-3 with -inf exactly where rows are fully masked.
    Returns the device inputs it ran."""
    ref = Reference.build(g, env, inputs=host)
    naive = interpret(g, host, precision=f"low:{dtype}")[0].astype(np.float64)
    dev = to_device(host, dtype)
    o, lse = c(*dev)
    torch.cuda.synchronize()
    o = o.float().cpu().numpy().astype(np.float64)
    lse = lse.cpu().numpy()
    want, want_lse = ref.outputs["o"], ref.outputs["lse"]
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    err = np.max(np.abs(o - want))
    naive_err = np.max(np.abs(naive - want))
    assert err <= 2 * naive_err + 1e-5, f"kernel error {err:.3g} > 2 x naive {naive_err:.3g}"
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    if fin.any():
        assert np.max(np.abs(lse[fin] - want_lse[fin])) <= 1e-3
    return dev


# ------------------------------------------------------------------ masks that read captured data (issue 7)
sys.path.insert(0, str(ROOT / "tests"))
from data_masks import MASKS, SIZES  # noqa: E402

DATA_CONFIGS = [("f16", 64), ("bf16", 128)]


def data_graph(mask: str, dtype: str) -> tuple:
    key = (f"data:{mask}", dtype)
    if key not in COMPILED:
        g = MASKS[mask]()
        if dtype != "f16":
            text = fl.print_func(g).replace("f16[", f"{dtype}[").replace('"f16"', f'"{dtype}"')
            g = fl.parse_func(text)
        COMPILED[key] = (g, fl.compile(g, "numba-cuda"))
    return COMPILED[key]


@pytest.mark.parametrize("kind", ["sorted", "unsorted", "constant", "nothing", "blocks"])
@pytest.mark.parametrize("M,N", SIZES)
@pytest.mark.parametrize("dtype,D", DATA_CONFIGS)
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_data_mask_error_rule(mask, dtype, D, M, N, kind):
    """Each data mask of issue 7 at ragged sizes and adversarial data: the kernel within FlashAttention's
    rule of the float64 reference, and its block table equal to the IR's mask.block_table (a dense table), or
    its block list sound against the mask at every pair (masks classified from range tables, issue 12)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g, c = data_graph(mask, dtype)
    env = bind_dims(g, {"B": 2, "H": 2, "M": M, "N": N, "D": D})
    raw = random_inputs(g, env, seed=M * 1000 + N, kind=kind)
    host = [rounded(x, dtype) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
            for i, x in enumerate(raw)]
    dev = assert_error_rule(g, c, env, host, dtype)
    # the kernel's tile classes are the IR's
    caps = [dev[c.lowered.args.index(v)] for v in c.analysis.captures] + \
        [int(env[d]) for d in c.analysis.runtime_dims]
    kern = c.kernel(*dev)
    it = fl.ir.interp.Interpreter("f64")
    it.env_dims = dict(env)
    low = c.lowered_of(kern)  # the IR the kernel came from (its tiles: the wgmma kernel's may differ)
    if kern.spec.block_mask == "list":  # classified from range tables: sound against every pair's mask
        assert_block_list_sound(c, kern, low, it, dev, host, env, M, N)
        return
    if kern.spec.block_mask != "table":  # tiles classified in the kernel from range tables (data=ranges): no
        return  # table to compare; the error rule above is the check (the simulator suites test the classes)
    got = kern.block_table(dev[0], dev[1], dev[2], *caps)
    op = next(x for x in low.walk() if x.name == "mask.block_table")
    (table,) = it.op(op, {a: x for a, x in zip(low.args, host)})
    assert np.array_equal(got, table)


def assert_block_list_sound(c, kern, low, it, dev, host, env, M: int, N: int) -> None:
    """The kernel's block list (made on the device from the range tables) never skips a tile with a kept pair
    and never calls a tile full that has a masked pair (a ragged last kv tile is never full): the IR's exact
    classes of every tile (the mask at every pair) against the list's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
    from block_list_cases import block_list_classes

    from falower.ir.intervals import minmax_table

    B, H = (int(n) for n in dev[0].shape[:2])
    bq, bk = kern.spec.block_q, kern.spec.block_k
    got, _, _ = block_list_classes(c, dev, env, B, H, M, N, bq, bk)
    op = next(o for o in low.walk() if o.name == "mask.kv_range")
    spec = op.attrs["ranges"]
    by_arg = {a: x for a, x in zip(low.args, host)}
    op_caps = [by_arg[v] for v in op.operands[4:4 + len(op.operands) - 4 - len(spec)]]
    tables = [minmax_table(op_caps[ci], axis, gr) for ci, axis, gr in spec]
    nq, nk = got.shape[2:]
    exact = it.block_classes(op.regions[0], op_caps + tables, B, H, nq, nk, bq, bk, M)
    ragged = np.zeros(nk, dtype=bool)
    ragged[-1] = N % bk != 0
    assert not ((got == 0) & (exact != 0)).any(), "a tile with a kept pair is not in the list"
    assert not ((got == 2) & (exact != 2) & ~(ragged[None, None, None, :] & (exact != 0))).any(), \
        "a tile with a masked pair is listed as full"


# ------------------------------------------------------------ the frontend's newer idioms on the GPU (issue 7)
def idiom_graph(which: str) -> tuple:
    key = (f"idiom:{which}", "f16")
    if key not in COMPILED:
        if which == "maths":
            g = fl.attention(score_mod=lambda s, b, h, q, kv: s + fl.sin(q * 0.1) * fl.cos(kv * 0.2)
                             + fl.round(s * 2.0) * 0.01 + fl.floor(s) * 0.01 + fl.sign(q - kv) * 0.1
                             + fl.rsqrt(abs(s) + 1.0) + fl.log1p(abs(s)) - fl.expm1(s * 0.01)
                             + fl.tan(s * 0.01) + 2.0 ** -(h + 1) * (kv - q), name="maths")
        elif which == "i8":  # i8 wraps: q cast to i8 in a table's index and a mask, an i8 table in the score
            bias = fl.capture("bias", "f32", "H,M,N")
            t8 = fl.capture("t8", "i8", "M,N")
            g = fl.attention(score_mod=lambda s, b, h, q, kv: s + bias[h, q.to("i8"), kv]
                             + (t8[q, kv] + 100).to("f32") * 0.01,
                             mask_mod=lambda b, h, q, kv: (q.to("i8") >= 0) & ((q.to("i8") + 100) > 0) | (kv < 8),
                             name="bias_i8")
        elif which == "i32":  # i32 wraps (value_ranges.py): kv * 2^25 in the score, kv + w in the mask; a float cast
            # saturating to i8 (f16-representable: the naive low:f16 reference of the rule holds no 1e12); integers
            # divided by 0 at kv = 5 (0, as numpy's); floor by libdevice
            window = fl.capture("window", "i32", "")
            g = fl.attention(score_mod=lambda s, b, h, q, kv: s + ((kv * 33554432) // 65536).to("f32") * 2.0 ** -15
                             + (s * 100.0).to("i8").to("f32") * 0.01  # (// 2^16: below f16's 65504)
                             + (q // (kv - 5) + q % (kv - 5)).to("f32") * 0.01 + fl.floor(s * 1e4) * 1e-5,
                             mask_mod=lambda b, h, q, kv: kv + window >= q, name="i32_wraps")
        else:
            window = fl.capture("window", "i32", "")
            g = fl.attention(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv < window), name="captured_window")
        COMPILED[key] = (g, fl.compile(g, "numba-cuda"))
    return COMPILED[key]


IDIOM_WINDOWS = {"maths": [None], "i8": [None], "window": [1, 7, 300], "i32": [2 ** 31 - 1, 5]}


@pytest.mark.parametrize("N", [17, 128, 1000])
@pytest.mark.parametrize("which", ["maths", "window", "i8", "i32"])
def test_idioms_error_rule(which, N):
    """The idioms against the float64 reference by FlashAttention's error rule; i8 and i32 where their arithmetic
    wraps (rows past 127, kv past 63, kv + 2^31 - 1) and an i8 table read on the GPU (its direct launch's types)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g, c = idiom_graph(which)
    env = bind_dims(g, {"B": 1, "H": 2, "M": N, "N": N, "D": 64})
    raw = random_inputs(g, env, seed=N)
    host = [rounded(x, "f16") for x in raw[:3]]
    dev = [torch.from_numpy(np.asarray(x, dtype=np.float32)).to("cuda", torch.float16) for x in host]
    tables = [np.asarray(x, np.float32) if np.asarray(x).dtype.kind == "f" else np.asarray(x) for x in raw[3:]] \
        if which == "i8" else []
    built = None
    for w in IDIOM_WINDOWS[which]:  # one kernel for every window size
        extra = tables if w is None else [np.array(w, dtype=np.int32)]
        ref = Reference.build(g, env, inputs=host + extra)
        naive = interpret(g, host + extra, precision="low:f16")[0].astype(np.float64)
        o, lse = c(*dev, *[torch.from_numpy(np.array(x)).to("cuda") for x in extra])  # (0-d stays 0-d)
        torch.cuda.synchronize()
        o = o.float().cpu().numpy().astype(np.float64)
        err, naive_err = np.max(np.abs(o - ref.outputs["o"])), np.max(np.abs(naive - ref.outputs["o"]))
        assert err <= 2 * naive_err + 1e-5, f"window {w}: kernel error {err:.3g} > 2 x naive {naive_err:.3g}"
        built = built or dict(c._kernels)
    # the window's value builds no kernel (the compiled object is shared by the sizes N, which may each take their
    # own tiles at D = 64: compiler._d64_tiling)
    assert c._kernels == built


def alibi_spec(dtype: str, D: int, col_mma: bool, slopes: list, seed: int):
    """examples/alibi.py at N = 4096 (B = 1, H = 2) with `extra={"col_mma": col_mma}` and these slopes, held to the
    error rule; returns the spec of the kernel that ran."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g, _ = graph("alibi", dtype)
    c = fl.compile(g, "numba-cuda", extra={"col_mma": col_mma, "small_grid": False})  # D = 64: 192 rows at B H = 2
    env = bind_dims(g, {"B": 1, "H": 2, "M": 4096, "N": 4096, "D": D})
    raw = random_inputs(g, env, seed=seed)
    host = [rounded(x, dtype) for x in raw[:3]] + [np.array(slopes, np.float32)]
    dev = assert_error_rule(g, c, env, host, dtype)
    return c.kernel(*dev).spec


@pytest.mark.parametrize("slopes", ["mild", "steep"])
@pytest.mark.parametrize("col_mma", [True, False])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_alibi_column_term(dtype, col_mma, slopes):
    """ALiBi at D = 64, N = 4096, on D = 64's automatic kernel (three consumer warpgroups, 192 x 128 tiles): its
    column term in S = Q K^T (emit_fa3_ws.col_mma, the default there) or by FFMA; slopes mild (ALiBi's own range)
    or steep (|w| / scale = 160 and 264, past emit_fa2.COL_STEP_MAX: each element's exact score, no product term;
    positive under causal, so LSE stays small enough for its 1e-3)."""
    from falower.backends.numba_cuda.emit_fa3_ws import col_mma as takes_product

    spec = alibi_spec(dtype, 64, col_mma, [0.5, -2.0 ** -4] if slopes == "mild" else [20.0, 33.0], 11)
    assert spec.block_q == 192 and takes_product(spec) == col_mma


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_alibi_column_term_shared_block_d128(dtype):
    """col_mma at D = 128 (the default there too): the persistent kernel's 128 x 128 tiles take one K block for both
    consumer warpgroups (emit_fa3_ws.col_shared), written under barrier 15, beside both Q buffers."""
    from falower.backends.numba_cuda.emit_fa3_ws import col_mma as takes_product
    from falower.backends.numba_cuda.emit_fa3_ws import col_shared, q_double

    spec = alibi_spec(dtype, 128, True, [0.5, -2.0 ** -4], 13)
    assert takes_product(spec) and col_shared(spec) and q_double(spec)


@pytest.mark.parametrize("D", [64, 128])
def test_bias_table_by_pairs_on_the_batch_inner_grid(D):
    """bias[h, q, kv] (no batch axis): three batch rows on the grid that runs the batch innermost
    (spec.batch_inner), the table read two columns a load (score_pair_fn) at an even N; then the same values at
    an address 4 bytes past an 8-byte boundary, where `pairs_aligned` sends the kernel down the per-element path:
    the same numbers out (the same arithmetic on the same values; NVVM may contract the two paths apart by an ulp)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g, c = graph("bias", "f16")
    env = bind_dims(g, {"B": 3, "H": 2, "HKV": 1, "M": 300, "N": 266, "D": D})
    host = [rounded(x, "f16") if i < 3 else x.astype(np.float32) for i, x in enumerate(random_inputs(g, env, seed=D))]
    dev = assert_error_rule(g, c, env, host, "f16")
    spec = c.kernel(*dev).spec
    assert spec.batch_inner and "def score_pair_fn(" in spec.device_source
    o1, l1 = c(*dev)
    buf = torch.empty(dev[3].numel() + 2, dtype=torch.float32, device="cuda")
    start = 1 if buf.data_ptr() % 8 == 0 else 0
    off = buf[start:start + dev[3].numel()].view(dev[3].shape)
    off.copy_(dev[3])
    assert off.data_ptr() % 8 == 4
    o2, l2 = c(*dev[:3], off)
    torch.cuda.synchronize()
    assert (o1.float() - o2.float()).abs().max().item() <= 2e-3
    assert (l1 - l2).abs().max().item() <= 1e-5


def _compile_one(job) -> str:
    """Build and launch one specialisation on tiny inputs: fills Numba's disk cache for pytest."""
    stem, dtype, D, N = job
    if stem.startswith("idiom:"):
        g, c = idiom_graph(stem[6:])
        env = bind_dims(g, {"B": 1, "H": 2, "M": N, "N": N, "D": D})
        raw = random_inputs(g, env)
        dev = [torch.from_numpy(np.asarray(x, dtype=np.float32)).to("cuda", torch.float16) for x in raw[:3]]
        c(*dev, *([4] if len(raw) > 3 else []))
        torch.cuda.synchronize()
        return f"{stem} D={D}"
    g, c = data_graph(stem[5:], dtype) if stem.startswith("data:") else graph(stem, dtype)
    env = bind_dims(g, {"B": 1, "H": 2, "HKV": 1, "M": N, "N": N, "D": D})
    host = [rounded(x, dtype) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
            for i, x in enumerate(random_inputs(g, env))]
    tdt = torch.float16 if dtype == "f16" else torch.bfloat16
    dev = [torch.from_numpy(np.asarray(x, dtype=np.float32)).to("cuda", tdt) if i < 3
           else torch.from_numpy(np.ascontiguousarray(x)).cuda() for i, x in enumerate(host)]
    c(*dev)
    torch.cuda.synchronize()
    return f"{stem} {dtype} D={D} N={N}"


def precompile_jobs() -> list[tuple]:
    jobs = []
    for stem in STEMS:
        g, c = graph(stem, "f16")
        for dtype in ("f16", "bf16"):
            for D in (64, 128):
                jobs.append((stem, dtype, D, 17))  # sizes other than D are run-time arguments
    jobs += [(f"data:{m}", dtype, D, 17) for m in sorted(MASKS) for dtype, D in DATA_CONFIGS]
    jobs += [(f"idiom:{w}", "f16", 64, 17) for w in ("maths", "window")]
    return jobs


if __name__ == "__main__":
    # python tests/gpu/test_examples_gpu.py: compile every kernel the tests need in parallel processes,
    # so pytest afterwards loads them from Numba's disk cache instead of compiling one after another.
    import concurrent.futures
    import multiprocessing
    import os
    import time

    jobs = precompile_jobs()
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 4),
                                                mp_context=multiprocessing.get_context("spawn")) as ex:
        done = list(ex.map(_compile_one, jobs))
    print(f"precompiled {len(done)} kernels in {time.time() - t0:.1f}s", flush=True)
