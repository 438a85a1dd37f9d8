"""The backward's main kernel on Hopper's wgmma (emit_fa3_bwd.py) on the GPU (marked gpu; needs compute capability
9.0): every example's gradients through `falower.compile(g, extra={"bwd_schedule": "wgmma"})` under
FlashAttention-2's gradient rule against float64 (tests/gpu/test_backward_gpu.py's rule, references and inputs),
at D = 64 and 128, f16 and bf16, N = 17 (one ragged tile), 1000 and 4096; the kernel that ran checked (wgmma,
the document mask's block lists included); its error no worse
than the mma.sync backward's on the same inputs; dq_split "k"; dQ by bulk reductions (dq_bulk); dK's GEMM after
dQ's (dk_after_dq); P under dP's GEMM (p_under_dp); the next tile's S^T and dP^T ahead (sdp_ahead); the two
consumer warpgroups out of lockstep (bwd_pingpong); torch autograd through it.

Run: python tests/gpu/test_wgmma_bwd_gpu.py -n 14 [-k ...]: the float64 references at N >= 1000 first, one process
each (test_backward_gpu's script form; the knob tests' N = 4096 references were recomputed in every worker that
needed one), then pytest with the given arguments (`--dist load` with -n); `python -m pytest -q -n 14 --dist load
-m gpu tests/gpu/test_wgmma_bwd_gpu.py` works too (without `--dist load`, pyproject's loadfile runs the file's tests
one at a time). FALOWER_WGMMA_BWD=1 python tests/gpu/test_backward_gpu.py runs the whole mma.sync backward suite on
wgmma."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import falower as fl  # noqa: E402
from falower.backends.numba_cuda.emit_fa3_bwd import knobs_in  # noqa: E402
from test_backward_gpu import (  # noqa: E402
    FLOOR,
    assert_gradient_rule,
    case_inputs,
    host64,
    precompile_then_pytest,
    reference,
    run_backward,
)
from test_examples_gpu import STEMS, graph, to_device  # noqa: E402

_COMPILED: dict = {}


def _hopper() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


def wgmma(stem: str, dtype: str, **extra):
    """The example compiled with the wgmma backward asked for (the forward is falower.compile's own choice)."""
    key = (stem, dtype, tuple(sorted(extra.items())))
    if key not in _COMPILED:
        _COMPILED[key] = fl.compile(graph(stem, dtype)[0], "numba-cuda", extra={"bwd_schedule": "wgmma", **extra})
    return _COMPILED[key]


def assert_ran_wgmma(c, dtype: str, D: int) -> None:
    kern = c._backward_kernel_and_dims_for(dtype, D)
    assert kern.wgmma_refused is None, kern.wgmma_refused  # every example, block lists included
    assert kern.spec.extra.get("bwd_schedule") == "wgmma" and "wgmma_ss" in kern.source


def grid() -> list[tuple]:
    cases = [(s, dt, D, N) for s in STEMS for dt in ("f16", "bf16") for D in (64, 128) for N in (17, 1000)]
    cases += [(s, dt, D, 4096) for s in ("plain", "causal", "alibi", "document")
              for dt, D in (("f16", 64), ("bf16", 128))]
    return cases


@pytest.mark.parametrize("stem,dtype,D,N", grid())
def test_wgmma_backward_error_rule(stem: str, dtype: str, D: int, N: int) -> None:
    _hopper()
    c = wgmma(stem, dtype)
    env, host, do = case_inputs(stem, dtype, D, N)
    *_, grads = run_backward(c, host, do, dtype)
    assert_ran_wgmma(c, dtype, D)
    assert_gradient_rule(c, grads, reference(stem, dtype, D, N))


@pytest.mark.parametrize("stem", ["plain", "causal", "alibi", "gqa", "relative_bias", "document"])
@pytest.mark.parametrize("dtype,D", [("f16", 64), ("f16", 128), ("bf16", 128)])
def test_wgmma_backward_no_worse_than_mma_sync(stem: str, dtype: str, D: int) -> None:
    """The same inputs through the mma.sync backward (asked for by extra) and the wgmma one: each gradient's error
    against float64 within 1.5x the mma.sync kernel's (plus the floor), and the two within 2x that of each other."""
    _hopper()
    N = 1000
    env, host, do = case_inputs(stem, dtype, D, N)
    ref = reference(stem, dtype, D, N)
    mma = wgmma(stem, dtype, bwd_schedule="mma")  # the automatic choice is wgmma on Hopper: ask for mma.sync
    *_, g_mma = run_backward(mma, host, do, dtype)
    c = wgmma(stem, dtype)
    *_, g_wg = run_backward(c, host, do, dtype)
    assert_ran_wgmma(c, dtype, D)
    assert mma._backward_kernel_and_dims_for(dtype, D).spec.extra.get("bwd_schedule") != "wgmma"
    for n, a, b in zip(c.gradient_names(), g_wg, g_mma):
        want = ref[f"ref_{n}"]
        floor = FLOOR * max(1.0, float(np.abs(want).max()))
        e_wg, e_mma = (float(np.abs(host64(x) - want).max()) for x in (a, b))
        assert e_wg <= 1.5 * e_mma + floor, f"{n}: wgmma {e_wg:.3g} vs mma.sync {e_mma:.3g}"
        assert float(np.abs(host64(a) - host64(b)).max()) <= 2 * (e_wg + e_mma) + floor, n


def assert_knob_case(stem: str, dtype: str, D: int, took, **extra) -> None:
    """The example's backward with `extra` asked for, at N = 1000 and 4096: the wgmma kernel ran, took(kernel) holds
    (the knob is in the kernel built), and its gradients keep the error rule."""
    _hopper()
    c = wgmma(stem, dtype, **extra)
    for N in (1000, 4096):
        env, host, do = case_inputs(stem, dtype, D, N)
        *_, grads = run_backward(c, host, do, dtype)
        assert_ran_wgmma(c, dtype, D)
        assert took(c._backward_kernel_and_dims_for(dtype, D)), extra
        assert_gradient_rule(c, grads, reference(stem, dtype, D, N))


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["causal", "alibi"])
def test_dq_split_k(stem: str, dtype: str, D: int) -> None:
    """spec.extra["dq_split"] = "k": dQ of each warpgroup's own kv rows (the A/B knob against the column split)."""
    assert_knob_case(stem, dtype, D, lambda k: k.spec.extra["dq_split"] == "k", dq_split="k")


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["causal", "alibi", "relative_bias"])
def test_dq_bulk(stem: str, dtype: str, D: int) -> None:
    """spec.extra["dq_bulk"]: dQ's rows staged in shared memory and added by bulk reductions (the A/B knob against
    the threads' vector reductions, the default)."""
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)["dq_bulk"], dq_bulk=True)


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["causal", "alibi", "relative_bias"])
def test_dk_after_dq(stem: str, dtype: str, D: int) -> None:
    """spec.extra["dk_after_dq"]: dK's GEMM issued after dQ's, in flight while dQ's reductions issue (the A/B knob
    against the default order)."""
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)["dk_after_dq"], dk_after_dq=True)


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["causal", "alibi", "relative_bias"])
def test_dq_alternate(stem: str, dtype: str, D: int) -> None:
    """spec.extra["dq_alternate"]: each q tile's whole dQ by one consumer warpgroup in turn, the other going on with no
    barrier at the loop's top (dS^T's barrier and DS_FREE guard dS^T; dk_after_dq's "auto" steps aside at D = 128)
    (the A/B knob against both warpgroups' column halves)."""
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)["dq_alternate"], dq_alternate=True)


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["causal", "alibi", "relative_bias"])
def test_dq_late(stem: str, dtype: str, D: int) -> None:
    """spec.extra["dq_late"]: dQ's reductions issued under the next tile's S^T / dP^T GEMMs, the last tile's after
    the loop (the A/B knob against the reductions at the tile's end)."""
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)["dq_late"], dq_late=True)


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["plain", "causal", "softcap"])
def test_stat_pairs(stem: str, dtype: str, D: int) -> None:
    """spec.extra["stat_pairs"]: a thread's column pair's LSE and Delta by one 8-byte shared load each (the A/B knob
    against the per-column loads, the default)."""
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)["stat_pairs"], stat_pairs=True)


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["causal", "gqa", "relative_bias"])
def test_kv_major(stem: str, dtype: str, D: int) -> None:
    """spec.extra["kv_major"] asked against its default: the grid (kv tiles, kv heads, batch) under causal's mask,
    (kv heads, batch, kv tiles) without one (the default runs in every other case)."""
    want = stem == "causal"
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)["kv_major"] == want, kv_major=want)


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["causal", "alibi", "gqa"])
def test_kv_group(stem: str, dtype: str, D: int) -> None:
    """spec.extra["kv_group"] = 3: the grid in groups of 3 kv heads, kv tile j of each then j + 1 (a group's places
    past the last head exit at once wherever 3 does not divide the heads)."""
    assert_knob_case(stem, dtype, D, lambda k: "kj = cuda.blockIdx.x // 3" in k.source, kv_group=3)


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
def test_list_ahead(dtype: str, D: int) -> None:
    """spec.extra["list_ahead"]: the document's block list read an entry a tile ahead (the A/B knob against the
    list read at the loop's top)."""
    assert_knob_case("document", dtype, D, lambda k: knobs_in(k.source)["list_ahead"], list_ahead=True)


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["causal", "gqa", "document"])
def test_dkdv_bulk(stem: str, dtype: str, D: int) -> None:
    """spec.extra["dkdv_bulk"] (default True): dK and dV staged in shared memory and stored by bulk copies a row a
    lane. The threads' direct stores (False) keep the error rule, and at N = 1000 (a ragged last kv tile) the
    default's dK and dV are bitwise theirs (the same accumulators, packed the same way)."""
    assert_knob_case(stem, dtype, D, lambda k: not knobs_in(k.source)["dkdv_bulk"], dkdv_bulk=False)
    env, host, do = case_inputs(stem, dtype, D, 1000)
    direct, bulk = (run_backward(wgmma(stem, dtype, **x), host, do, dtype)[-1] for x in ({"dkdv_bulk": False}, {}))
    assert knobs_in(wgmma(stem, dtype)._backward_kernel_and_dims_for(dtype, D).source)["dkdv_bulk"]
    for name, a, b in zip(("dk", "dv"), direct[1:3], bulk[1:3]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("knob", ["dkdv_stsm", "dkdv_tma", "dkdv_in_tile"])
@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["causal", "document", "sliding_window"])
def test_dkdv_staging(stem: str, dtype: str, D: int, knob: str) -> None:
    """dkdv_stsm (dK and dV staged by stmatrix), dkdv_tma (... into 16-row boxes stored by TMA tensor copies
    through dK's and dV's maps; rows past N not written) and dkdv_in_tile (those boxes staged and stored in the
    walk's last tile, in V's rows and the other Q / dO buffer): the error rule, and at N = 1000 (a ragged last kv
    tile) dK and dV bitwise the word-at-a-time staging's with a bulk copy a row (the same accumulators, packed the
    same way)."""
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)[knob], **{knob: True})
    env, host, do = case_inputs(stem, dtype, D, 1000)
    base, new = (run_backward(wgmma(stem, dtype, **x), host, do, dtype)[-1] for x in ({}, {knob: True}))
    for name, a, b in zip(("dk", "dv"), base[1:3], new[1:3]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["plain", "causal", "alibi", "relative_bias", "document", "gqa"])
def test_dq_ws(stem: str, dtype: str, D: int) -> None:
    """spec.extra["dq_ws"]: dQ's slabs added by a producer warpgroup's bulk reductions into the accumulator in slab
    order (setmaxnreg 24 / 240 at two consumer warpgroups), the loads the consumers' own (ws_loads False; with it,
    the default, test_ws_loads): the error rule (dQ read back through the conversion), and at N = 1000 (a ragged
    last q tile, the accumulator padded to whole tiles) dK and dV bitwise the vector reductions' kernel's (dq_ws
    False: the consumers compute them the same way)."""
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)["dq_ws"] and not knobs_in(k.source)["ws_loads"],
                     dq_ws=True, ws_loads=False)
    env, host, do = case_inputs(stem, dtype, D, 1000)
    base, new = (run_backward(wgmma(stem, dtype, **x), host, do, dtype)[-1]
                 for x in ({"dq_ws": False}, {"dq_ws": True, "ws_loads": False}))
    for name, a, b in zip(("dk", "dv"), base[1:3], new[1:3]):
        assert torch.equal(a, b), name
    assert (base[0] - new[0]).abs().max().item() <= 1e-2 * base[0].abs().max().item() + 1e-3, "dq"


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["plain", "causal", "gqa", "document", "sliding_window", "alibi"])
def test_ws_loads(stem: str, dtype: str, D: int) -> None:
    """spec.extra["ws_loads"] (with dq_ws): the next q tile's Q, dO, LSE and Delta loaded by two producer warps on
    the consumers' request, waited for on the buffer's mbarrier: the error rule, and at N = 1000 dK and dV bitwise
    dq_ws's without it (the same data in the same buffers; dQ's adds across kv blocks come in any order: dQ by the
    error rule only)."""
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)["ws_loads"], dq_ws=True, ws_loads=True)
    env, host, do = case_inputs(stem, dtype, D, 1000)
    base, new = (run_backward(wgmma(stem, dtype, **x), host, do, dtype)[-1]
                 for x in ({"dq_ws": True, "ws_loads": False}, {"dq_ws": True, "ws_loads": True}))
    for name, a, b in zip(("dk", "dv"), base[1:3], new[1:3]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["causal", "gqa", "document", "sliding_window"])
def test_bwd_persistent(stem: str, dtype: str, D: int) -> None:
    """spec.extra["bwd_persistent"]: 3 blocks walking the grid's items (B = 1, H = 2: 16-256 items, so each block
    walks many, real and skipped), the next item's loads under the last one's dK / dV copies: the error rule, and at
    N = 1000 dK and dV bitwise the one-block-an-item kernel's (each kv tile's q tiles summed in the same order)."""
    assert_knob_case(stem, dtype, D, lambda k: "while it_z < " in k.source, bwd_persistent=3)
    env, host, do = case_inputs(stem, dtype, D, 1000)
    one, pers = (run_backward(wgmma(stem, dtype, **x), host, do, dtype)[-1] for x in ({}, {"bwd_persistent": 3}))
    for name, a, b in zip(("dk", "dv"), one[1:3], pers[1:3]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("where", ["dq", "top"])
@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["plain", "causal", "document", "gqa", "alibi"])
def test_sdp_ahead(stem: str, dtype: str, D: int, where: str) -> None:
    """spec.extra["sdp_ahead"]: the next q tile's S^T and dP^T issued at this tile's end (beside dQ's GEMM, or
    after its hand-off), on the default's loader warps: the error rule, and at N = 1000 dK and dV bitwise the
    default's (the same products of the same buffers; dQ's adds come in any order: dQ by the error rule only)."""
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)["sdp_ahead"], sdp_ahead=where)
    env, host, do = case_inputs(stem, dtype, D, 1000)
    base, new = (run_backward(wgmma(stem, dtype, **x), host, do, dtype)[-1] for x in ({}, {"sdp_ahead": where}))
    for name, a, b in zip(("dk", "dv"), base[1:3], new[1:3]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dk_after", [False, True])
@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["plain", "causal", "sliding_window"])
def test_p_under_dp(stem: str, dtype: str, D: int, dk_after: bool) -> None:
    """spec.extra["p_under_dp"] (alone and with dk_after_dq): P from the split elementwise function while dP^T's
    GEMM is in flight (the A/B knob against the fused function after both waits)."""
    assert_knob_case(stem, dtype, D, lambda k: {n: knobs_in(k.source)[n] for n in ("dq_bulk", "dk_after_dq",
                                                                                     "p_under_dp")}
                     == {"dq_bulk": False, "dk_after_dq": dk_after, "p_under_dp": True},
                     p_under_dp=True, dk_after_dq=dk_after)


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["plain", "causal", "prefix_lm"])
def test_dv_under_dp(stem: str, dtype: str, D: int) -> None:
    """spec.extra["dv_under_dp"]: dV's GEMM issued from P^T before dP^T's wait, on p_under_dp's split (dk_after_dq
    as its rule says: on at D = 128, where the dS^T stores commit no group), the error rule; at N = 1000 dK and dV
    bitwise the fused order's (the same products of the same values; dQ's adds come in any order)."""
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)["dv_under_dp"] and knobs_in(k.source)["p_under_dp"],
                     dv_under_dp=True)
    env, host, do = case_inputs(stem, dtype, D, 1000)
    base, new = (run_backward(wgmma(stem, dtype, **x), host, do, dtype)[-1] for x in ({}, {"dv_under_dp": True}))
    for name, a, b in zip(("dk", "dv"), base[1:3], new[1:3]):
        assert torch.equal(a, b), name


def test_torch_autograd_runs_the_wgmma_backward() -> None:
    """loss.backward() through c(q, k, v, slopes) runs the wgmma backward: its gradients, each on its own input."""
    _hopper()
    c = wgmma("alibi", "f16")
    env, host, do_host = case_inputs("alibi", "f16", 64, 1000)
    xs = [x.detach().clone().requires_grad_(True) if x.is_floating_point() else x for x in to_device(host, "f16")]
    do = torch.from_numpy(np.asarray(do_host, dtype=np.float32)).to("cuda", torch.float16)
    o, lse = c(*xs)
    (o.float() * do.float()).sum().backward()
    assert_ran_wgmma(c, "f16", 64)
    assert_gradient_rule(c, tuple(x.grad for x in xs), reference("alibi", "f16", 64, 1000))


# ------------------------------------------------------------------------------ references first (script)
def _params(fn) -> list[dict]:
    """The product of a test's parametrize marks, one dict of argument values a case."""
    out: list[dict] = [{}]
    for m in getattr(fn, "pytestmark", []):
        if m.name == "parametrize":
            names = [n.strip() for n in m.args[0].split(",")]
            rows = [v if len(names) > 1 else (v,) for v in m.args[1]]
            out = [{**o, **dict(zip(names, v))} for o in out for v in rows]
    return out


def reference_jobs() -> list[tuple]:
    """(stem, dtype, D, N) of every float64 reference at N >= 1000 the tests read: a case's own N, else 1000 for
    the comparison with mma.sync and 1000 and 4096 for a knob's (assert_knob_case)."""
    jobs = {("document", dt, D, N) for dt, D in (("f16", 64), ("bf16", 128)) for N in (1000, 4096)}  # list_ahead
    for name, fn in globals().items():
        if name.startswith("test_"):
            for p in _params(fn):
                if {"stem", "dtype", "D"} <= p.keys():
                    ns = (p["N"],) if "N" in p else (1000,) if "no_worse" in name else (1000, 4096)
                    jobs |= {(p["stem"], p["dtype"], p["D"], n) for n in ns if n >= 1000}
    return sorted(jobs)


@pytest.mark.parametrize("dtype,D", [("f16", 64), ("bf16", 128)])
@pytest.mark.parametrize("stem", ["plain", "causal", "document", "gqa", "alibi", "sliding_window"])
def test_bwd_pingpong(stem: str, dtype: str, D: int) -> None:
    """spec.extra["bwd_pingpong"]: the two consumer warpgroups out of lockstep (dQ by each one's own kv rows through
    its own slab, per-warpgroup barriers, S^T / dP^T issued in turns): the error rule, and at N = 1000 dK and dV
    bitwise the default's (each warpgroup's products in the same order; dQ's adds come in another order: dQ by the
    error rule only)."""
    assert_knob_case(stem, dtype, D, lambda k: knobs_in(k.source)["bwd_pingpong"], bwd_pingpong=True)
    env, host, do = case_inputs(stem, dtype, D, 1000)
    base, new = (run_backward(wgmma(stem, dtype, **x), host, do, dtype)[-1] for x in ({}, {"bwd_pingpong": True}))
    for name, a, b in zip(("dk", "dv"), base[1:3], new[1:3]):
        assert torch.equal(a, b), name


if __name__ == "__main__":  # the references ("ref" jobs of test_backward_gpu's script), then pytest
    sys.exit(precompile_then_pytest([("ref", *j) for j in reference_jobs()], "references", __file__, sys.argv[1:],
                                    ("-p", "no:benchmark"), one_thread=True))
