"""On the GPU: the FA2 backward kernels (c.backward) of every example, FlashAttention-2's gradient rule.

For each gradient g of dq, dk, dv and the captured float tensors' gradients (dslopes, dbias, drel_bias):

    max |g_kernel - g_ref64| <= 3 * max |g_naive - g_ref64| + 1e-4 * max(1, max |g_ref64|)

g_ref64 is the input graph's joint forward + backward (`falower.grad`) interpreted in float64, g_naive the
same joint function interpreted naively in the input's low precision (every float rounded to f16 / bf16,
products accumulated in f32: `precision="low:<dtype>"`), both on the same rounded inputs and cotangent; the
kernel gets o and lse from the GPU forward. FlashAttention-2's test suite holds its backward to 3x (2x for
the forward); the floor (1e-4 of the gradient's size, below half an f16 ulp) covers gradients that the
naive computation gets exactly (N = 1: dq = dk = 0, dv = do).

A captured table's gradient (dslopes) sums dS over B, H, M and N, and two things make the naive baseline
alone unfair to it. (1) FA2's backward takes o in the low precision and forms Delta = rowsum(dO * O) from
it: that rounding error is the algorithm's, not the kernel's, and it adds up coherently over the sum (about
0.7% of dslopes in bf16 at N = 130, where the naive computation, which never forms Delta from O, is 5x
better). Its baseline is therefore the larger of the naive error and the error of FA2's backward itself,
computed in float64 from o rounded to the input dtype (the `recompute` level of fa2-bwd, whole tensors).
(2) Where the naive f16 sum overflows (NaN), the naive error is taken in the graph's own precision instead
(`native`: f32 where the graph says f32), which is what torch does with an f32 parameter. dq, dk and dv
keep FlashAttention-2's rule as it is.

Grid (about 6 minutes on an H100 with 16 cores, run as a script): every example at N = 1, 17, 128, 1000
with (f16, D=64) and (bf16, D=128); causal, alibi and document also at (f16, 128) and (bf16, 64) at N = 17,
1000, and at N = 4096 (B = 1, H = 2) with (f16, 64) and (bf16, 128). FALOWER_BWD_GRID=full runs every
example at N = 1, 17, 128, 1000, 4096 x D = 64, 128 x f16, bf16. Also: fully masked rows (document ids of
-1) get zero dq (and zero dk, dv on keys no one attends to); deterministic=True gives the same bits twice;
torch autograd through `c(q, k, v, slopes)` gives c.backward's gradients, also for q, k, v in a model's
(transposed) layout.

    python tests/gpu/test_backward_gpu.py [pytest args]   # compiles kernels and the N = 4096 float64
                                                          # references in parallel processes, then pytest
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import falower as fl  # noqa: E402
from falower.ir import interpret  # noqa: E402
from falower.passes import NAMED_PIPELINES, run_pipeline  # noqa: E402
from falower.passes.check import Reference, bind_dims, random_inputs  # noqa: E402
from test_examples_gpu import STEMS, graph, rounded, to_device  # noqa: E402

FLOOR = 1e-4  # of max(1, max |g_ref64|)
MAIN = [("f16", 64), ("bf16", 128)]
OTHER = [("f16", 128), ("bf16", 64)]
SUBSET = ["alibi", "causal", "document"]
DETERMINISTIC = ["alibi", "causal", "document", "relative_bias"]


def grid() -> list[tuple]:
    if os.environ.get("FALOWER_BWD_GRID") == "full":
        return [(s, dt, D, N) for s in STEMS for dt, D in MAIN + OTHER for N in (1, 17, 128, 1000, 4096)]
    cases = [(s, dt, D, N) for s in STEMS for dt, D in MAIN for N in (1, 17, 128, 1000)]
    cases += [(s, dt, D, N) for s in SUBSET for dt, D in OTHER for N in (17, 1000)]
    cases += [(s, dt, D, 4096) for s in SUBSET for dt, D in MAIN]
    return cases


# ---------------------------------------------------------------------------------------- cases
_JOINT: dict = {}
_DETERMINISTIC: dict = {}


def joint(stem: str, dtype: str):
    """The input graph's joint forward + backward function (falower.grad): the reference's definition."""
    if (stem, dtype) not in _JOINT:
        _JOINT[stem, dtype] = fl.grad(graph(stem, dtype)[0])
    return _JOINT[stem, dtype]


def fa2_backward_whole(stem: str, dtype: str):
    """fa2-bwd up to its tiling: the function FA2's backward computes (q, k, v, captures, o, lse, do in;
    gradients out, P recomputed from lse, Delta from o) on whole tensors, cheap to interpret at any N."""
    if ("whole", stem, dtype) not in _JOINT:
        pipeline = NAMED_PIPELINES["fa2-bwd"].split(",tile-bwd")[0]
        _JOINT["whole", stem, dtype] = run_pipeline(graph(stem, dtype)[0], pipeline)
    return _JOINT["whole", stem, dtype]


def deterministic(stem: str, dtype: str):
    if (stem, dtype) not in _DETERMINISTIC:
        _DETERMINISTIC[stem, dtype] = fl.compile(graph(stem, dtype)[0], "numba-cuda", deterministic=True)
    return _DETERMINISTIC[stem, dtype]


def case_inputs(stem: str, dtype: str, D: int, N: int, kind: str = "sorted") -> tuple[dict, list, np.ndarray]:
    """(sizes, host inputs rounded to `dtype` (float captures f32), cotangent do rounded to `dtype`)."""
    g = graph(stem, dtype)[0]
    env = bind_dims(g, {"B": 1, "H": 2, "HKV": 1, "M": N, "N": N, "D": D})
    seed = N + D + (1 if dtype == "bf16" else 0)
    raw = random_inputs(g, env, seed=seed, kind=kind)
    host = [rounded(x, dtype) if i < 3 else x.astype(np.float32) if x.dtype.kind == "f" else x
            for i, x in enumerate(raw)]
    for i, a in enumerate(g.args):
        if a.name == "slopes":  # ALiBi's own slopes, 2^(-8 (h + 1) / H): standard normal ones times distances
            H = host[i].shape[0]  # of thousands make scores no f16 computation resolves, a vacuous bound
            host[i] = (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)
    do = rounded(np.random.default_rng([seed, 7]).standard_normal(host[0].shape), dtype)
    return env, host, do


def _refs_dir() -> Path | None:
    d = os.environ.get("FALOWER_BWD_REFS")
    return Path(d) if d else None


def reference(stem: str, dtype: str, D: int, N: int, kind: str = "sorted") -> dict[str, np.ndarray]:
    """`ref_<g>`: the float64 gradients (and `ref_o`); `naive_<g>`: the naive low-precision computation's
    max error against them; `algo_<g>` for captured tables' gradients: FA2's backward's own error (see the
    module docstring). Read from FALOWER_BWD_REFS when the script's precompile step made them."""
    name = f"{stem}-{dtype}-D{D}-N{N}-{kind}.npz"
    d = _refs_dir()
    if d is not None and (d / name).exists():
        with np.load(d / name) as z:
            return dict(z)
    j = joint(stem, dtype)
    env, host, do = case_inputs(stem, dtype, D, N, kind)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # the naive f16 sums overflow at large N: see above
        ref = dict(zip(j.result_names, interpret(j, host + [do], precision="f64", dims=env)))
        low = dict(zip(j.result_names, interpret(j, host + [do], precision=f"low:{dtype}", dims=env)))
        native = None
        out = {}
        for n, want in ref.items():
            want = np.asarray(want, dtype=np.float64)
            out[f"ref_{n}"] = want
            err = np.max(np.abs(np.asarray(low[n], dtype=np.float64) - want)) if want.size else 0.0
            if not np.isfinite(err):
                if native is None:
                    native = dict(zip(j.result_names, interpret(j, host + [do], precision="native", dims=env)))
                err = np.max(np.abs(np.asarray(native[n], dtype=np.float64) - want))
            out[f"naive_{n}"] = np.float64(err)
        captured = [n for n in j.result_names if n not in ("o", "dq", "dk", "dv")]
        if captured:  # the algorithm's own error, from o rounded to the input dtype (see the docstring)
            fwd = Reference.build(graph(stem, dtype)[0], env, inputs=host)
            given = dict(zip([a.name for a in j.args], host + [do]))
            given.update(o=rounded(fwd.outputs["o"], dtype), lse=fwd.outputs["lse"])
            bwd = fa2_backward_whole(stem, dtype)
            algo = dict(zip(bwd.result_names, interpret(bwd, [given[a.name] for a in bwd.args], "f64", env)))
            for n in captured:
                out[f"algo_{n}"] = np.float64(np.max(np.abs(np.asarray(algo[n], np.float64) - out[f"ref_{n}"])))
    if d is not None:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.{os.getpid()}.npz"
        np.savez(tmp, **out)
        os.replace(tmp, d / name)
    return out


def run_backward(c, host: list, do_host: np.ndarray, dtype: str) -> tuple:
    """The GPU forward then c.backward on the same inputs: (device inputs, o, lse, do, gradients)."""
    dev = to_device(host, dtype)
    tdt = torch.float16 if dtype == "f16" else torch.bfloat16
    do = torch.from_numpy(np.asarray(do_host, dtype=np.float32)).to("cuda", tdt)
    o, lse = c.forward(*dev)
    grads = c.backward(dev[0], dev[1], dev[2], o, lse, do, *dev[3:])
    torch.cuda.synchronize()
    return dev, o, lse, do, grads


def host64(x) -> np.ndarray:
    if torch.is_tensor(x):
        return x.detach().double().cpu().numpy()
    if hasattr(x, "copy_to_host"):
        x = x.copy_to_host()
    return np.asarray(x, dtype=np.float64)


def assert_gradient_rule(c, grads: tuple, ref: dict) -> None:
    """Every gradient c.backward returned, against the float64 reference under FlashAttention-2's rule."""
    names = c.gradient_names()
    assert len(grads) == len(names), (names, len(grads))
    report = []
    for n, g in zip(names, grads):
        got, want = host64(g), ref[f"ref_{n}"]
        assert got.shape == want.shape, f"{n}: shape {got.shape}, want {want.shape}"
        assert not np.isnan(got).any(), f"{n} has NaN"
        err = float(np.max(np.abs(got - want))) if want.size else 0.0
        naive = max(float(ref[f"naive_{n}"]), float(ref.get(f"algo_{n}", 0.0)))
        bound = 3 * naive + FLOOR * max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
        report.append(f"{n}: {err:.3g} (naive {naive:.3g}, bound {bound:.3g})")
        assert err <= bound, f"{n}: kernel error {err:.3g} > 3 x naive {naive:.3g} + floor; " + "; ".join(report)


def needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("stem,dtype,D,N", grid())
def test_backward_error_rule(stem: str, dtype: str, D: int, N: int) -> None:
    needs_cuda()
    g, c = graph(stem, dtype)
    env, host, do = case_inputs(stem, dtype, D, N)
    ref = reference(stem, dtype, D, N)
    *_, grads = run_backward(c, host, do, dtype)
    assert_gradient_rule(c, grads, ref)


@pytest.mark.parametrize("N", [128, 1000, 4096])
@pytest.mark.parametrize("kind", ["sorted", "nothing"])
def test_fully_masked_rows_get_zero_gradients(kind: str, N: int) -> None:
    """Document ids of -1 (padding): those queries attend to nothing (lse = -inf, o = 0) and those keys are
    attended by no one, so dq is 0 on those rows and dk, dv on those keys, exactly, and nothing is NaN."""
    needs_cuda()
    if kind == "nothing" and N == 4096:
        pytest.skip("one size of all-padding is enough")
    g, c = graph("document", "f16")
    env, host, do = case_inputs("document", "f16", 64, N, kind)
    dev, o, lse, _, grads = run_backward(c, host, do, "f16")
    dq, dk, dv = (host64(x) for x in grads[:3])
    pad = np.asarray(host[3]) < 0  # [B, N]
    assert pad.any()
    assert np.isneginf(host64(lse)[:, :, pad[0]]).all()
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not np.isnan(x).any(), name
        assert np.all(x[:, :, pad[0], :] == 0), f"{name} is not 0 on padding rows"
    if kind == "sorted" and N <= 1000:
        assert_gradient_rule(c, grads, reference("document", "f16", 64, N, kind))


@pytest.mark.parametrize("stem", DETERMINISTIC)
def test_deterministic_backward_is_bitwise_reproducible(stem: str) -> None:
    """compile(..., deterministic=True): no atomics, so two runs give the same bits (and the rule holds)."""
    needs_cuda()
    c = deterministic(stem, "f16")
    env, host, do_host = case_inputs(stem, "f16", 64, 1000)
    dev, o, lse, do, first = run_backward(c, host, do_host, "f16")
    again = c.backward(dev[0], dev[1], dev[2], o, lse, do, *dev[3:])
    torch.cuda.synchronize()
    for n, a, b in zip(c.gradient_names(), first, again):
        assert torch.equal(a, b) if torch.is_tensor(a) else np.array_equal(host64(a), host64(b)), n
    assert_gradient_rule(c, first, reference(stem, "f16", 64, 1000))


def _leaves(dev: list) -> list:
    return [x.detach().clone().requires_grad_(True) if x.is_floating_point() else x for x in dev]


def assert_same_gradients(names: list, got: list, want: list) -> None:
    """Gradients of two runs of the default (dq=atomic) backward: dk and dv are each written by one block,
    the same bits every run; dq and captured tables' gradients are sums of f32 atomic adds, whose order
    varies, so they may differ in their last bits (1e-3 relative to the gradient's size covers that)."""
    for n, a, b in zip(names, got, want):
        a, b = a.float(), b.float()
        if n in ("dk", "dv"):
            assert torch.equal(a, b), n
        else:
            assert (a - b).abs().max().item() <= 1e-3 * max(1.0, b.abs().max().item()), n


@pytest.mark.parametrize("mode", ["atomic", "deterministic"])
def test_torch_autograd_is_backward(mode: str) -> None:
    """loss.backward() through c(q, k, v, slopes) runs c.backward on the forward's o and lse: the same
    gradients (the same bits with deterministic=True; up to the order of dQ's atomic adds otherwise), each
    on its own input, in its dtype, within the rule."""
    needs_cuda()
    c = graph("alibi", "f16")[1] if mode == "atomic" else deterministic("alibi", "f16")
    env, host, do_host = case_inputs("alibi", "f16", 64, 1000)
    xs = _leaves(to_device(host, "f16"))
    do = torch.from_numpy(np.asarray(do_host, dtype=np.float32)).to("cuda", torch.float16)
    o, lse = c(*xs)
    assert o.requires_grad and lse.requires_grad  # (lse: FlexAttention's is differentiable too)
    lse = lse.detach()
    (o.float() * do.float()).sum().backward()
    grads = [x.grad for x in xs]
    assert [g.dtype for g in grads] == [torch.float16] * 3 + [torch.float32]
    want = c.backward(*(x.detach() for x in xs[:3]), o.detach(), lse, do, xs[3].detach())
    if mode == "deterministic":
        for n, a, b in zip(c.gradient_names(), grads, want):
            assert torch.equal(a, b.to(a.dtype)), n
    assert_same_gradients(c.gradient_names(), grads, list(want))
    assert_gradient_rule(c, tuple(grads), reference("alibi", "f16", 64, 1000))


def test_autograd_takes_a_models_layout() -> None:
    """q, k, v as a model makes them, [B, N, H, D] transposed to [B, H, N, D] (not contiguous): the same
    output and gradients as from contiguous inputs."""
    needs_cuda()
    c = graph("causal", "f16")[1]
    env, host, do_host = case_inputs("causal", "f16", 64, 1000)
    base = to_device(host, "f16")
    do = torch.from_numpy(np.asarray(do_host, dtype=np.float32)).to("cuda", torch.float16)
    strided = _leaves([x.transpose(1, 2).contiguous() for x in base])  # [B, N, H, D] leaves
    plain = _leaves(base)
    o1, _ = c(*(x.transpose(1, 2) for x in strided))
    o1.backward(do)
    o2, _ = c(*plain)
    o2.backward(do)
    assert torch.equal(o1, o2)
    assert_same_gradients(["dq", "dk", "dv"], [a.grad.transpose(1, 2) for a in strided], [b.grad for b in plain])


# ------------------------------------------------------------------------------ precompile (script)
def _job(job: tuple) -> str:
    """One unit of the script's parallel warm-up: build and launch one kernel on tiny inputs (fills Numba's
    disk cache for pytest), or compute one float64 reference (written under FALOWER_BWD_REFS)."""
    import time

    t0 = time.time()
    what, stem, dtype, D, *rest = job
    try:
        if what == "ref":
            reference(stem, dtype, D, *rest)
        elif what == "fwd":
            from test_examples_gpu import _compile_one

            _compile_one((stem, dtype, D, 17))
        else:
            c = deterministic(stem, dtype) if what == "bwd-det" else graph(stem, dtype)[1]
            env, host, do_host = case_inputs(stem, dtype, D, 17)
            dev = to_device(host, dtype)
            do = torch.from_numpy(np.asarray(do_host, dtype=np.float32)).to("cuda", dev[0].dtype)
            o = dev[0].clone()  # the forward is another job: any o and lse of the right kind compile
            lse = torch.zeros(dev[0].shape[:3], dtype=torch.float32, device="cuda")
            c.backward(dev[0], dev[1], dev[2], o, lse, do, *dev[3:])
            torch.cuda.synchronize()
    except Exception as e:  # pytest reports it properly; the warm-up goes on
        return f"FAILED {job}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return f"{job} {time.time() - t0:.1f}s"


def precompile_jobs() -> list[tuple]:
    cases = grid()
    kernels = sorted({(stem, dtype, D) for stem, dtype, D, _ in cases})
    jobs = [("ref", stem, dtype, D, N) for stem, dtype, D, N in cases if N >= 4096]
    jobs += [("bwd", *k) for k in kernels]
    jobs += [("bwd-det", stem, "f16", 64) for stem in DETERMINISTIC]
    jobs += [("fwd", *k) for k in kernels]
    return jobs


def precompile_then_pytest(jobs: list[tuple], what: str, file: str, args: list[str], pytest_opts: tuple = (),
                           one_thread: bool = False) -> int:
    """The script form of a GPU test file: `_job` over `jobs` in a process pool (kernels into Numba's disk cache,
    references into FALOWER_BWD_REFS), then pytest on `file` with `args`; its exit status. `one_thread`: one BLAS
    thread a process, here and in pytest's workers. With xdist's `-n`, `--dist load` (xdist_args.spread_args)."""
    import concurrent.futures
    import multiprocessing
    import subprocess
    import tempfile
    import time

    os.environ.setdefault("FALOWER_BWD_REFS", tempfile.mkdtemp(prefix="falower-bwd-refs-"))
    if one_thread:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 4),
                                                mp_context=multiprocessing.get_context("spawn")) as ex:
        for line in ex.map(_job, jobs):
            if line.startswith("FAILED"):
                print(line, flush=True)
    print(f"{len(jobs)} {what} in {time.time() - t0:.1f}s", flush=True)
    from xdist_args import spread_args

    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *spread_args(args), *pytest_opts, file,
                            *args])


if __name__ == "__main__":
    sys.exit(precompile_then_pytest(precompile_jobs(), "kernels and references precompiled", __file__,
                                    sys.argv[1:]))


@pytest.mark.parametrize("N", [17, 1000])
def test_a_mask_tables_gradient_is_zero(N: int) -> None:
    """A float table read only by the mask (`thr[b, kv] > 0`, batch row 0 masked whole): torch autograd gives
    thr a zero gradient and q, k, v torch's own masked attention's gradients (f32 reference, f16 tolerance);
    c.backward returns dthr in its place after the kernels' dq, dk, dv."""
    needs_cuda()
    thr_t = fl.capture("thr", "f32", "B,N")
    c = fl.compile(fl.attention(mask_mod=lambda b, h, q, kv: thr_t[b, kv] > 0.0, name="thrmask"), "numba-cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 2, N, 64, device="cuda", generator=gen).half() for _ in range(4))
    thr = torch.randn(2, N, device="cuda", generator=gen)
    thr[0] = -1.0
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, thr)]
    o, lse = c(*xs)
    o.backward(do)
    ref = [x.float().clone().requires_grad_(True) for x in (q, k, v)]
    s = (ref[0] @ ref[1].transpose(-1, -2)) / 8.0
    s = s.masked_fill(~(thr > 0)[:, None, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1))  # fully masked rows: 0, as falower defines them
    (p @ ref[2]).backward(do.float())
    for name, a, b in zip(("dq", "dk", "dv"), xs[:3], ref):
        err = (a.grad.float() - b.grad).abs().max().item()
        assert err <= 2e-2 * max(1.0, b.grad.abs().max().item()), (name, err)
    assert xs[3].grad is not None and not xs[3].grad.any()
    grads = c.backward(q, k, v, o.detach(), lse, do, thr)
    assert c.gradient_names() == ["dq", "dk", "dv", "dthr"] and len(grads) == 4
    assert grads[3].shape == thr.shape and not grads[3].any()


def test_dims_named_otherwise() -> None:
    """The causal example with its batch dim named Z and its kv length L: the same kernels' numbers as the example's
    (the passes once wrote B and N into the loops whatever the graph called them)."""
    import re

    needs_cuda()
    g0, c0 = graph("causal", "f16")
    c = fl.compile(fl.parse_func(re.sub(r"\bB\b", "Z", re.sub(r"\bN\b", "L", fl.print_func(g0)))), "numba-cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 2, 1000, 64, device="cuda", generator=gen).half() for _ in range(4))
    o, lse = c(q, k, v)
    o0, lse0 = c0(q, k, v)
    assert torch.equal(o, o0) and torch.equal(lse, lse0)
    got, want = c.backward(q, k, v, o, lse, do), c0.backward(q, k, v, o0, lse0, do)
    assert_same_gradients(["dq", "dk", "dv"], list(got), list(want))


def _default_kernels_against_the_ir(g, sizes: dict) -> tuple[dict, bool]:
    """The default deterministic kernels' gradients against the backward function's IR in float64 ({name: err,
    scale, nan, shape_ok}) and whether a second run gave the same bits."""
    from falower.ir.interp import Interpreter

    env = bind_dims(g, sizes)
    inputs = [x.astype(np.float16) if i < 3 else x.astype(np.float32) for i, x in enumerate(random_inputs(g, env, seed=2))]
    c = fl.compile(g, "numba-cuda", deterministic=True)
    o, lse = (host64(x) for x in c.forward(*inputs))
    o, lse = o.astype(np.float16), lse.astype(np.float32)
    do = np.random.default_rng(7).standard_normal(o.shape).astype(np.float16)
    got = c.backward(inputs[0], inputs[1], inputs[2], o, lse, do, *inputs[3:])
    again = c.backward(inputs[0], inputs[1], inputs[2], o, lse, do, *inputs[3:])
    same = all(np.array_equal(host64(a), host64(b)) for a, b in zip(got, again))
    f = c.lowered_backward
    by = {a.name: x for a, x in zip(g.args, inputs)}
    by.update(o=o, lse=lse, do=do)
    want = Interpreter("f64").run(f, [by[a.name] for a in f.args])
    grads = {}
    for name, a, b in zip(c.gradient_names(), got, want):
        a, b = host64(a), np.asarray(b, np.float64)
        grads[name] = {"err": float(np.max(np.abs(a - b))), "scale": float(np.max(np.abs(b))),
                       "nan": bool(np.isnan(a).any()), "shape_ok": a.shape == b.shape}
    return grads, same


def _assert_close_to_the_ir(grads: dict, names: set, same: bool) -> None:
    assert set(grads) == names, grads
    for name, e in grads.items():
        assert e["shape_ok"] and not e["nan"], (name, e)
        assert e["err"] <= 4e-3 * max(1.0, e["scale"]), (name, e)
    assert same


@pytest.mark.parametrize("where", ["mma-16x16-20x19", "default-300x257"])
def test_two_tables_deterministic_gradients_by_name(where: str) -> None:
    """Two captured tables of different ranks whose gradients the IR adds in the other order than the function
    returns them (bwd_sim_cases' two_tables): the deterministic backward on the GPU gives each its own gradient,
    against the backward function's IR in float64, and the same bits twice (the simulator's case once swapped them,
    or read b1's indices in b2; the first size is the simulator case's tiles, the second the default kernels')."""
    needs_cuda()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
    from bwd_sim_cases import _two_tables, run_case

    if where.startswith("mma"):
        r = run_case("two_tables", "mma", 16, 20, 19, "det")
        grads, same = r["grads"], r["same_bits"]
    else:
        grads, same = _default_kernels_against_the_ir(_two_tables(), {"B": 2, "H": 3, "HKV": 3, "M": 300, "N": 257,
                                                                      "D": 64})
    _assert_close_to_the_ir(grads, {"dq", "dk", "dv", "db1", "db2"}, same)


@pytest.mark.parametrize("kind", ["div", "sub", "exp", "idx"])
@pytest.mark.parametrize("D", [64, 128])
def test_a_learned_temperatures_gradient_from_the_kernels(kind: str, D: int) -> None:
    """A 0-d temperature read through div, sub or exp (`s / t`, `s - t`, `s * exp(t)`; tile-bwd refused them
    before this session): the default deterministic kernels' dq, dk, dv, dtemp against the IR in float64."""
    needs_cuda()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
    from bwd_sim_cases import EXTRA_GRAPHS

    grads, same = _default_kernels_against_the_ir(EXTRA_GRAPHS[f"temp_{kind}"](),
                                                  {"B": 2, "H": 3, "HKV": 3, "M": 300, "N": 257, "D": D})
    _assert_close_to_the_ir(grads, {"dq", "dk", "dv", "dtemp"}, same)


@pytest.mark.parametrize("direct", ["1", "0"])
def test_the_lse_cotangent_on_a_side_stream(direct: str, monkeypatch) -> None:
    """c.backward(..., dlse=) on a non-default torch stream, by the direct launches (FALOWER_DIRECT_LAUNCH=1: the
    subtraction on the launches' stream) and by Numba's path (0: Delta's kernel on stream 0, so the subtraction
    there too; on the side stream nothing ordered it after Delta's kernel, a review's find): the gradients of the
    IR with Delta - dlse (passes/lse_cotangent.py) in float64, within FA2's rule."""
    needs_cuda()
    from falower.ir.interp import Interpreter
    from falower.passes.lse_cotangent import with_lse_cotangent

    monkeypatch.setenv("FALOWER_DIRECT_LAUNCH", direct)
    c = fl.compile(graph("causal", "f16")[0], "numba-cuda")
    env, host, do_host = case_inputs("causal", "f16", 64, 1000)
    dev = to_device(host, "f16")
    do = torch.from_numpy(np.asarray(do_host, dtype=np.float32)).to("cuda", torch.float16)
    o, lse = c(*dev)
    dlse = torch.randn(lse.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        grads = [g.double().cpu().numpy() for g in c.backward(*dev[:3], o, lse, do, dlse=dlse)]
    torch.cuda.synchronize()
    f = with_lse_cotangent(c.lowered_backward)
    by = dict(q=host[0], k=host[1], v=host[2], o=o.cpu().numpy(), lse=lse.cpu().numpy(), do=do_host,
              dlse=dlse.cpu().numpy())
    want = Interpreter("f64").run(f, [by[a.name] for a in f.args])
    for name, a, b in zip(c.gradient_names(), grads, want):
        b = np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-2 * max(1.0, np.max(np.abs(b))), name


@pytest.mark.parametrize("D,M,N", [(64, 1000, 1000), (128, 300, 257)])
def test_a_graph_returning_its_lse_differentiates_it(D: int, M: int, N: int) -> None:
    """fl.attention(return_lse=True) (passes/raise_lse.py: fa2-bwd takes the LSE's cotangent itself): a loss reading
    o and the lse, through torch autograd and the default kernels, against float64 torch autograd of the same
    causal attention, within 3x the error of the same computation in f16 torch (FA2's rule); and moved by the lse's
    term (the gradients without it differ)."""
    needs_cuda()
    g = fl.attention(mask_mod=lambda b, h, q, kv: q >= kv + 3, return_lse=True, name="returned")
    c = fl.compile(g, "numba-cuda")
    assert c.lowered.result_names == ["o", "lse"]
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(2, 3, n, D, device="cuda", generator=gen, dtype=torch.float16) for n in (M, N, N))
    do = torch.randn(2, 3, M, D, device="cuda", generator=gen, dtype=torch.float16)
    dlse = torch.randn(2, 3, M, device="cuda", generator=gen)

    def torch_attention(q, k, v):
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        keep = torch.arange(M, device="cuda")[:, None] >= torch.arange(N, device="cuda")[None, :] + 3
        s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.nan_to_num(torch.exp(s - lse[..., None]))  # rows 0-2: no key, P = 0
        return p @ v, lse

    def grads(fn, dtype, with_lse=True):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o, lse = fn(*xs)
        loss = (o.to(dtype) * do.to(dtype)).sum()
        if with_lse:
            loss = loss + (torch.where(lse.isinf(), 0.0, lse).to(dtype) * dlse.to(dtype)).sum()
        loss.backward()
        return [x.grad.double() for x in xs]

    got = grads(c, torch.float16)
    want = grads(torch_attention, torch.float64)
    low = grads(torch_attention, torch.float16)
    plain = grads(c, torch.float16, with_lse=False)
    for name, a, b, f, p in zip("qkv", got, want, low, plain):
        err, ref_err = (a - b).abs().max().item(), (f - b).abs().max().item()
        assert err <= 3 * ref_err + 2e-3, (name, err, ref_err)
        if name != "v":  # dV = P^T dO does not read the lse's term
            assert (p - b).abs().max().item() > 10 * err, name
