"""The wgmma backward (emit_fa3_bwd.py): its kernels in the CUDA simulator against the IR in float64
(wgmma_bwd_sim_cases.py, two subprocesses: the simulator must be on before numba.cuda is imported; two cores on
CI); on the CPU, which specs it refuses (the runtime then builds mma.sync) and how it is asked for; its PTX for
sm_90a (no GPU: wgmma counts, no calls that would serialize them)."""

from __future__ import annotations

import dataclasses
import os
import re
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
from simulated import collect, spawn  # noqa: E402
from wgmma_bwd_sim_cases import CASES, DKDV_AS_DEFAULT, SAME_AS_DEFAULT, SLOW_WARP_CASES, SLOW_WARP_SECONDS  # noqa: E402

TOL = {"f16": 4e-3, "bf16": 3e-2}  # of max(1, max |g|): f16 / bf16 P and dS operands, outputs in the dtype
IDS = list(CASES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    halves = [IDS[0::2], IDS[1::2]]
    procs = [spawn("wgmma_bwd_sim_cases.py", tmp_path_factory.mktemp("kernels"), ids) for ids in halves]
    out = {}
    for p in procs:
        out.update(collect(p))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case_id", IDS)
def test_wgmma_backward_matches_the_ir(results, case_id):
    r = results.get(case_id)
    assert r is not None and "error" not in r, r
    assert r["wgmma"] and r["refused"] is None, r  # the wgmma kernel ran, not the mma.sync fallback
    assert set(r["grads"]) >= {"dq", "dk", "dv"}
    for name, g in r["grads"].items():
        assert g["shape_ok"] and not g["nan"], (name, g)
        assert g["err"] <= TOL[r["dtype"]] * max(1.0, g["scale"]), (name, g)
    assert r["masked_dq_zero"], r
    asked = CASES[case_id][10] if len(CASES[case_id]) > 10 else {}
    tiles = CASES[case_id][8:10]
    defaults = {"interior_split": True, "kv_major": r["block_mask"] == "none" and "bwd_batch_inner" not in asked,
                "exp_fold": True, "dkdv_bulk": True,
                "kv_group": r["block_mask"] == "static" and "kv_major" not in asked,
                "ws_loads": r["knobs"]["dq_ws"] and tiles == (64, 128),  # wherever dq_ws is, at 64 x 128
                # dK / dV's store as measured (dkdv_store_auto) unless either knob is set
                "dkdv_in_tile": r["dkdv_store_auto"] == "in_tile" and "dkdv_tma" not in asked,
                "dkdv_tma": r["dkdv_store_auto"] == "tma" and not asked.get("dkdv_in_tile"),
                "dk_after_dq": r["dk_after_dq_auto"],  # at D = 128 where measured (_dk_after_dq_auto)
                "p_under_dp": asked.get("dv_under_dp", False),
                "dq_alternate": r["dq_alternate_auto"]}  # at D = 64 where measured (_dq_alternate_auto)  # (dv_under_dp runs on p_under_dp's split)
    seen = {**r["knobs"], "exp_fold": r["exp_fold"], "kv_group": r["kv_group"], "bwd_persistent": r["bwd_persistent"],
            "grad_dist": r["grad_dist"], "bwd_batch_inner": r["bwd_batch_inner"]}
    for knob, on in seen.items():  # as asked ("auto": dq_ws's rule, on with ws_loads at 64 x 128), else the default
        want = asked.get(knob, defaults.get(knob, False))
        assert on == (tiles == (64, 128) if want == "auto" else bool(want)), (knob, r["knobs"], r["exp_fold"])
    if case_id.startswith("document"):  # a data mask: its kv tiles' block lists, walked on wgmma
        assert r["block_mask"] == "list", r
    if case_id.startswith(("alibi", "relative_bias", "bias")):
        assert len(r["grads"]) == 4  # the captured table's gradient comes out of the kernel too
    if case_id.startswith("two_tables"):
        assert set(r["grads"]) == {"dq", "dk", "dv", "db1", "db2"}  # each right in shape and value above
    tables = case_id.startswith(("bias", "two_tables")) and not case_id.startswith("bias_i8")  # (i8: no grid form)
    assert r["grad_v4"] == tables  # the bias tables' [..., q, kv] only
    assert r["read_v4"] == (tables and asked.get("read_v4", True) is not False)
    if case_id.startswith("bias4d"):  # a static mask's two branches
        assert r["block_mask"] == "static", r


@pytest.mark.slow
@pytest.mark.parametrize("case_id", list(SAME_AS_DEFAULT))
def test_a_knob_gives_the_defaults_gradients(results, case_id):
    """SAME_AS_DEFAULT's cases: the same call on the kernel without the knob (dkdv_in_tile off; dk_after_dq on, the D =
    128 default, against the order before it) gave bitwise the same dQ, dK and dV (the simulator adds dQ in one order:
    the GPU's tests compare dK and dV)."""
    r = results.get(case_id)
    assert r is not None and "error" not in r, r
    assert r["same_as_default"] == {"dq": True, "dk": True, "dv": True}, r["same_as_default"]
    for knob, v in SAME_AS_DEFAULT[case_id].items():
        assert r["default_knobs"][knob] is v and r["knobs"][knob] is not v, (knob, r["knobs"], r["default_knobs"])


@pytest.mark.slow
@pytest.mark.parametrize("case_id", list(DKDV_AS_DEFAULT))
def test_a_knob_gives_the_defaults_dk_dv(results, case_id):
    """DKDV_AS_DEFAULT's cases (bwd_pingpong): the same call on the kernel without the knob gave bitwise the same dK
    and dV (each warpgroup's products and tiles in the same order), and dQ within the error rule's tolerance of its
    dQ (dq_split "k": each warpgroup's partial added on its own, another order of additions)."""
    r = results.get(case_id)
    assert r is not None and "error" not in r, r
    assert r["same_as_default"] == {"dk": True, "dv": True}, r["same_as_default"]
    assert r["dq_vs_default"] <= TOL[r["dtype"]] * max(1.0, r["grads"]["dq"]["scale"]), r["dq_vs_default"]
    for knob, v in DKDV_AS_DEFAULT[case_id].items():
        assert r["default_knobs"][knob] is v and r["knobs"][knob] is not v, (knob, r["knobs"], r["default_knobs"])


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory):
    """SLOW_WARP_CASES run with warp 1 of each warpgroup slowed before each emulated shared-memory read
    (FALOWER_SIM_SLOW_WARP): a warpgroup that ran ahead of a barrier it needs would read stale rows there."""
    return collect(spawn("wgmma_bwd_sim_cases.py", tmp_path_factory.mktemp("slow"), list(SLOW_WARP_CASES),
                         {"FALOWER_SIM_SLOW_WARP": str(SLOW_WARP_SECONDS)}))


@pytest.mark.slow
@pytest.mark.parametrize("case_id", list(SLOW_WARP_CASES))
def test_slow_warp(slow_results, case_id):
    r = slow_results.get(case_id)
    assert r is not None and "error" not in r, r
    for name, g in r["grads"].items():
        assert g["shape_ok"] and not g["nan"], (name, g)
        assert g["err"] <= TOL[r["dtype"]] * max(1.0, g["scale"]), (name, g)
    if case_id in DKDV_AS_DEFAULT:
        assert r["same_as_default"] == {"dk": True, "dv": True}, r["same_as_default"]


# ------------------------------------------------------------------------------------ CPU: selection
def _spec(stem: str = "causal", D: int = 64, dtype: str = "f16", extra=None, pipeline: str = "fa2-bwd"):
    """The example's wgmma backward spec. dq_ws off unless `extra` says: the other knobs' tests read the kernel
    with the vector reductions; dq_ws's own tests ask for it, and test_dq_ws_by_default holds its default."""
    import falower as fl
    from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec

    g = next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.ir.Func))
    c = fl.compile(g, "numba-cuda", backward=pipeline)
    return build_backward_spec(analyse_backward(c.lowered_backward), {"D": D}, dtype, "mma", None,
                               {"bwd_schedule": "wgmma", "dq_ws": False, **(extra or {})})


def _ptxas_log(ptx: str, path, version: str = "8.5"):
    """ptxas -v's log for the kernel's PTX (written to `path` as sm_90a at PTX `version`; it must assemble), or None
    where no ptxas is on this machine: the PTX tests' check that no wgmma is serialized."""
    import shutil
    import subprocess

    if shutil.which("ptxas") is None:
        return None
    path.write_text(re.sub(r"^\.version \d+\.\d+", f".version {version}", ptx, flags=re.M)
                    .replace(".target sm_90\n", ".target sm_90a\n"))
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(path), "-o", str(path.with_suffix(".cubin"))],
                       capture_output=True, text=True)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-2000:]
    return log


@pytest.mark.parametrize("change, why", [
    (dict(head_dim=96), "head_dim"),
    (dict(block_q=128, block_k=64), "row groups"),
    (dict(dq="separate"), "deterministic"),
    (dict(deterministic=True), "deterministic"),
    (dict(block_mask="list"), "block lists"),
    (dict(extra={"bwd_schedule": "wgmma", "dq_split": "k"}, block_q=128), "dq_split"),
])
def test_refused_specs_fall_back_to_mma_sync(change, why):
    """A spec the wgmma kernel cannot build: a ValueError that says why, and `resolve` (what FA2BackwardKernel
    builds) gives the mma.sync spec instead of an error or wrong numbers."""
    from falower.backends.numba_cuda import emit_fa3_bwd

    spec = dataclasses.replace(_spec(), **change)
    with pytest.raises(ValueError, match=why):
        emit_fa3_bwd.validate_spec(spec)
    built, reason = emit_fa3_bwd.resolve(spec)
    assert why in reason and "bwd_schedule" not in built.extra and not emit_fa3_bwd.uses_wgmma(built)
    assert built.name != spec.name  # another kernel, another name


def test_grid_order_defaults():
    """The backward grid's order by mask: kv-major without one, kv tiles of 8 heads at a time under a static mask
    (unless kv_major is asked for, or kv_group 0), the old (kv heads, batch, kv tiles) order under block lists; a
    kv_group that is not an int >= 0 is refused by name."""
    from falower.backends.numba_cuda import emit_fa3_bwd as e

    causal, plain = _spec("causal"), _spec("plain")
    assert causal.block_mask == "static" and plain.block_mask == "none"
    assert e.kv_group(causal) == e.KV_GROUP_STATIC == 8 and not e.kv_major(causal)
    nk = -(-1000 // causal.block_k)
    assert e.grid(causal, 2, 12, 1000, 1000) == (8 * nk, 2, 2)  # 12 heads in 2 groups of 8: 4 places exit at once
    assert e.kv_group(plain) == 0 and e.kv_major(plain) and e.grid(plain, 2, 12, 1000, 1000) == (nk, 12, 2)
    for asked in ({"kv_major": True}, {"kv_major": False}, {"kv_group": 0}):
        spec = dataclasses.replace(causal, extra={**causal.extra, **asked})
        e.validate_spec(spec)
        assert e.kv_group(spec) == 0 and e.kv_major(spec) == asked.get("kv_major", False), asked
    assert e.kv_group(dataclasses.replace(causal, block_mask="list")) == 0
    inner = dataclasses.replace(causal, extra={**causal.extra, "bwd_batch_inner": True})  # over kv_group
    assert e.batch_inner(inner) and e.kv_group(inner) == 0 and e.grid(inner, 2, 12, 1000, 1000) == (2, nk, 12)
    assert not e.kv_major(dataclasses.replace(plain, extra={**plain.extra, "bwd_batch_inner": True}))
    for bad in (-1, 2.0, 0.0, "8", True, False, e.KV_GROUP_MAX + 1):
        with pytest.raises(ValueError, match="kv_group"):
            e.validate_spec(dataclasses.replace(causal, extra={**causal.extra, "kv_group": bad}))


def test_runtime_builds_mma_sync_for_a_refused_spec(tmp_path, monkeypatch):
    """FA2BackwardKernel of a refused wgmma spec (the deterministic pipeline): the mma.sync kernel, the reason
    kept. (Emitting needs no GPU.)"""
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from falower.backends.numba_cuda.runtime import FA2BackwardKernel

    kern = FA2BackwardKernel(_spec("alibi", pipeline="fa2-bwd-deterministic"))
    assert "deterministic" in kern.wgmma_refused
    assert "wgmma_ss" not in kern.source and "ldsm_x4" in kern.source
    ok = FA2BackwardKernel(_spec("alibi"))
    assert ok.wgmma_refused is None and "wgmma_ss" in ok.source
    assert (ok.threads, ok.smem) == (256, 83968)  # two warpgroups; K, V, 2 Q, 2 dO, dS^T, statistics, align


def test_asked_for_by_extra_or_environment(monkeypatch):
    from falower.backends.numba_cuda.emit_fa3_bwd import ENV, backward_extra

    assert backward_extra({}, {}) == {}
    assert backward_extra({}, {ENV: "1"}) == {"bwd_schedule": "wgmma"}
    assert backward_extra({"bwd_schedule": "mma"}, {ENV: "1"}) == {"bwd_schedule": "mma"}  # extra wins
    assert backward_extra({"schedule": "wgmma"}, {ENV: "0"}) == {"schedule": "wgmma"}  # the forward's knob only
    # by itself: Hopper, f16/bf16, D = 64 and 128 (measured faster); not other head dims, not other GPUs, not
    # without a GPU
    for args in (("f16", 128, (9, 0)), ("bf16", 128, (9, 0)), ("f16", 64, (9, 0)), ("bf16", 64, (9, 0))):
        assert backward_extra({}, {}, *args) == {"bwd_schedule": "wgmma"}, args
    for args in (("f16", 96, (9, 0)), ("f16", 128, (8, 0)), ("f16", 128, None), ("f32", 128, (9, 0))):
        assert backward_extra({}, {}, *args) == {}, args
    assert backward_extra({}, {ENV: "0"}, "f16", 128, (9, 0)) == {}
    import falower as fl

    monkeypatch.setenv(ENV, "1")  # through falower.compile: its backward spec asks for wgmma
    c = fl.compile(runpy.run_path(str(ROOT / "examples" / "causal.py"))["graph"], "numba-cuda")
    assert backward_extra(c.extra)["bwd_schedule"] == "wgmma"


def test_chosen_by_itself_on_hopper(monkeypatch, tmp_path):
    """falower.compile on an H100 (compute capability faked, nothing compiled): the backward's main kernel on
    wgmma at D = 128 and 64, on mma.sync where no Hopper GPU is seen."""
    import falower as fl
    from falower.backends.numba_cuda import runtime
    from falower.backends.numba_cuda.emit_fa3_bwd import ENV

    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(runtime, "_has_gpu", lambda: False)
    g = runpy.run_path(str(ROOT / "examples" / "causal.py"))["graph"]
    for cc, D, want in [((9, 0), 128, "wgmma"), ((9, 0), 64, "wgmma"), ((8, 0), 128, None), (None, 128, None)]:
        monkeypatch.setattr(runtime, "device_cc", lambda cc=cc: cc)
        kern = fl.compile(g, "numba-cuda")._backward_kernel_and_dims_for("f16", D)
        assert kern.spec.extra.get("bwd_schedule") == want, (cc, D, kern.spec.extra)
        assert ("wgmma_ss" in kern.source) == (want == "wgmma")


# ------------------------------------------------------------------------------------ PTX (no GPU)
@pytest.mark.slow
@pytest.mark.parametrize("stem, D", [("causal", 64), ("alibi", 128), ("bias", 128)])
def test_wgmma_backward_ptx(stem, D, tmp_path, monkeypatch):
    """wgmma count per q tile (S^T, dP^T: D/16 each at n = block_q; dV, dK: block_q/16 each at n = D; dQ: block_k/16
    at n = D / 2), no f64, and no calls or 64-bit divisions (ptxas serializes every wgmma of a function with a call:
    C7509)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("PTX checks need the real CUDA target")
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from falower.backends.numba_cuda.runtime import FA2BackwardKernel, resource_usage

    kern = FA2BackwardKernel(_spec(stem, D))
    assert kern.wgmma_refused is None
    ptx = kern.ptx((9, 0))
    counts = {n: ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16") for n in (32, 64, 128)}
    # 64 x 128 tiles: S^T, dP^T D/16 each at n64; dV, dK 4 each at n = D; dQ 8 at n = D / 2
    assert counts == ({32: 8, 64: 16, 128: 0} if D == 64 else {32: 0, 64: 24, 128: 8}), counts
    assert not re.search(r"\.f64\b", ptx)
    assert not re.search(r"\bcall\b|\brcp\.rn\b|\b(div|rem)\.[su]64\b", ptx)
    # dQ's partial sums by the threads' 16-byte vector reductions (the default: dq_bulk off)
    assert "red.global.add.v4.f32" in ptx and "cp.reduce.async.bulk" not in ptx
    try:
        usage = resource_usage(ptx.replace(".target sm_90\n", ".target sm_90a\n"), "sm_90a")
    except Exception as exc:
        pytest.skip(f"nvJitLink unavailable: {exc}")
    assert "C7509" not in usage["log"] and "serialized" not in usage["log"], usage["log"]


def _elem_functions(source: str) -> list[str]:
    return re.findall(r"^def elem_\w+\(.*?^    return [^\n]*", source, flags=re.M | re.S)


def test_grad_dist_recomputes_the_distances_for_the_gradient(tmp_path, monkeypatch):
    """spec.extra grad_dist: ALiBi's elementwise functions keep float(kv - q) for the score and give the slope's
    gradient term float(kv) - float(q), a second form LLVM does not merge with the first (the held distances were
    what ALiBi's consumers spilled); (q - kv) gets float(q) - float(kv); off by default, a bool."""
    import falower as fl
    from falower.backends.numba_cuda import emit_fa3_bwd
    from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec

    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    late = re.compile(r"^    (v\d+) = np\.float32\(np\.int32\((kv|q)\)\) - np\.float32\(np\.int32\((kv|q)\)\)$", re.M)
    default, asked = _spec("alibi", 128), _spec("alibi", 128, extra={"grad_dist": True})
    assert not any(late.search(f) for f in _elem_functions(default.device_source))
    for f in _elem_functions(asked.device_source):  # elem_full, elem_partial: the contribution reads the late name
        m = late.search(f)
        assert m and m.groups()[1:] == ("kv", "q"), f
        assert re.search(rf"= \(v\d+ \* {m.group(1)}\)\n    return v\d+, v\d+, v\d+, hk", f), f
        assert "np.float32(np.int32(v" in f  # the score's own distance, as before
    slopes = fl.capture("slopes", "f32", "H")
    g = fl.attention(score_mod=lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (q_idx - kv_idx), name="alibi_qk")
    low = analyse_backward(fl.compile(g, "numba-cuda").lowered_backward)
    spec = build_backward_spec(low, {"D": 64}, "f16", "mma", None, {"bwd_schedule": "wgmma", "grad_dist": True})
    assert [late.search(f).groups()[1:] for f in _elem_functions(spec.device_source)] == [("q", "kv")]
    plain = build_backward_spec(analyse_backward(fl.compile(fl.attention(name="p"), "numba-cuda").lowered_backward),
                                {"D": 64}, "f16", "mma", None, {"bwd_schedule": "wgmma", "grad_dist": True})
    assert not any(late.search(f) for f in _elem_functions(plain.device_source))  # no distance: nothing changes
    with pytest.raises(ValueError, match="grad_dist must be True or False"):
        emit_fa3_bwd.validate_spec(_spec("alibi", 64, extra={"grad_dist": 1}))


def test_dk_after_dq_when_asked(tmp_path, monkeypatch):
    """spec.extra dk_after_dq: dV's GEMM and dS^T's stores, the barrier, dQ's GEMM, then dK's from the kept packed
    registers; dQ's wait leaves one group (dK's) in flight over the reductions, waited after them. Asked False, dV
    and dK issue together and one wait covers every group before the reductions (its PTX: test_the_knobs_ptx)."""
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from falower.backends.numba_cuda import emit_fa3_bwd

    with pytest.raises(ValueError, match="dk_after_dq must be True, False or 'auto'"):
        emit_fa3_bwd.validate_spec(_spec("causal", 128, extra={"dk_after_dq": "yes"}))
    default = emit_fa3_bwd.emit_fa3_backward(_spec("causal", 128, extra={"dk_after_dq": False}))
    loop = default[default.index("WG_S(pacc"):]
    assert loop.index("WG_D(dkacc") < loop.index("cuda.syncthreads()  # dS^T") < loop.index("WG_Q(dqa")
    assert "WAIT_Q1" not in default
    spec = _spec("causal", 128, extra={"dk_after_dq": True})
    src = emit_fa3_bwd.emit_fa3_backward(spec)
    loop = src[src.index("WG_S(pacc"):]
    order = ["WG_D(dvacc", "cuda.syncthreads()  # dS^T", "WG_Q(dqa", "FENCE_D(dkacc", "WG_D(dkacc, 0, da0_0",
             "WG_D(dkacc, 0, da3_0", "WAIT_Q1(dqa, 0)", "dq_swap(dqa", "red_add_v4_f32(dq32", "WAIT_D(dkacc, 0)",
             "hc = hn"]
    at = [loop.index(x) for x in order]
    assert at == sorted(at), list(zip(order, at))
    assert loop.count("WG_D(dkacc") == 4 and "WAIT_Q1 = wgmma_wait_regs(1, 32)" in src


@pytest.mark.parametrize("stem, D, extra, want", [
    ("causal", 128, {}, True), ("plain", 128, {}, True), ("sliding_window", 128, {}, True),
    ("plain", 64, {}, False), ("causal", 64, {}, False),  # measured even at D = 64
    ("document", 128, {}, False), ("alibi", 128, {}, False), ("bias", 128, {}, False),  # not measured: off
    ("causal", 128, {"dkdv_in_tile": True}, False), ("causal", 128, {"sdp_ahead": "top"}, False),
    ("causal", 128, {"bwd_pingpong": True, "dq_split": "k", "dq_ws": True}, False),
    ("causal", 128, {"bwd_persistent": 132}, False), ("causal", 128, {"dk_after_dq": False}, False),
    ("alibi", 128, {"dk_after_dq": True}, True), ("plain", 64, {"dk_after_dq": True}, True),
])
def test_dk_after_dq_by_default_where_measured(stem, D, extra, want):
    """dk_after_dq's "auto" (the default): on at D = 128 over 64 x 128 tiles without a mask or with a static one
    and no captured table's gradient (measured 0.953 / 0.940 of the other order's time, plain / causal), off where
    it was not measured or a knob asked for refuses it; True or False asked is taken as asked. Where it is on, the
    dK / dV stores' rule leaves in_tile (which it refuses) and the kernel passes validate_spec."""
    from falower.backends.numba_cuda import emit_fa3_bwd as e

    sp = _spec(stem, D, extra=extra)
    assert e.dk_after_dq(sp) is want
    if want:
        assert not e.dkdv_in_tile(sp)
        e.validate_spec(sp)
        assert "WAIT_Q1(dqa, 0)" in e.emit_fa3_backward(sp)


@pytest.mark.parametrize("stem, D, extra, want", [
    ("causal", 64, {}, True), ("plain", 64, {}, True), ("sliding_window", 64, {}, True), ("prefix_lm", 64, {}, True),
    ("softcap", 64, {}, True), ("gqa", 64, {}, False),  # GQA measured slower with it (1.008)
    ("causal", 128, {}, False), ("plain", 128, {}, False),  # measured slower at D = 128 (its spills)
    ("document", 64, {}, False), ("alibi", 64, {}, False), ("bias", 64, {}, False),  # not measured: off
    ("causal", 64, {"dq_alternate": False}, False), ("causal", 64, {"dkdv_in_tile": True}, False),
    ("causal", 64, {"sdp_ahead": "top"}, False), ("causal", 64, {"bwd_pingpong": True, "dq_split": "k"}, False),
    ("causal", 64, {"bwd_persistent": 132}, False), ("causal", 64, {"dq_ws": False}, False),
    ("causal", 64, {"ws_loads": False}, False), ("causal", 64, {"dk_after_dq": True}, False),
    ("causal", 64, {"dq_bulk": True}, False), ("causal", 64, {"dq_split": "k"}, False),
    ("causal", 128, {"dq_alternate": True}, True),
])
def test_dq_alternate_by_default_where_measured(stem, D, extra, want):
    """dq_alternate's "auto" (the default): on at D = 64 over 64 x 128 tiles on dq_ws and ws_loads without a mask or
    with a static one, no captured table's gradient and no GQA group (measured 0.989 / 0.940 of the default's time
    before it, plain / causal; GQA 1.008), off at D = 128 (1.067) and where it was not measured or a knob asked for refuses it; True or
    False asked is taken as asked. Where it is on, the dK / dV stores' rule leaves in_tile (which it refuses) and the
    kernel passes validate_spec."""
    from falower.backends.numba_cuda import emit_fa3_bwd as e

    sp = _spec(stem, D, extra={"dq_ws": "auto", **extra})
    assert e.dq_alternate(sp) is want
    if want:
        assert not e.dkdv_in_tile(sp) and not e.dk_after_dq(sp)
        e.validate_spec(sp)
        assert e.knobs_in(e.emit_fa3_backward(sp))["dq_alternate"]


def test_dq_by_bulk_reductions_when_asked(tmp_path, monkeypatch):
    """spec.extra dq_bulk True: each warp's 16 rows of dQ staged in shared memory (16 rows of D / cs f32 and 16 bytes
    a warp) and added by one bulk reduction a row, issued under the next tile's first GEMMs, no vector reductions
    (its PTX: test_the_knobs_ptx).
    The default keeps the threads' vector reductions (measured faster)."""
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from falower.backends.numba_cuda import emit_fa3_bwd

    red, bulk = (_spec("causal", 128, extra=None if b is None else {"dq_bulk": b}) for b in (None, True))
    with pytest.raises(ValueError, match="dq_bulk must be True or False"):
        emit_fa3_bwd.validate_spec(_spec("causal", 128, extra={"dq_bulk": "true"}))
    src = emit_fa3_bwd.emit_fa3_backward(red)
    assert "red_add_v4_f32(dq32" in src and "bulk_reduce_add_f32(" not in src
    assert emit_fa3_bwd.smem_bytes(bulk) - emit_fa3_bwd.smem_bytes(red) == 8 * 16 * (64 * 4 + 16)
    src = emit_fa3_bwd.emit_fa3_backward(bulk)
    assert "red_add_v4_f32(dq32" not in src and "dqg = elem_addr(dq32" in src
    # the staging's order (the simulator's proxy fence does nothing, so only the text can hold it): the last tile's
    # reductions have read the rows, the warp agrees, the stores, the proxy fence, the warp agrees, the row kept
    stage = src[src.index("bulk_wait_read0()  # the last tile's reductions"):]
    order = ["bulk_wait_read0()", "syncwarp()", "sts_v4_f32(dqs_t", "fence_proxy_async()", "syncwarp()",
             "dqg = elem_addr(dq32"]
    at = [stage.index(order[0])]
    for x in order[1:]:
        at.append(stage.index(x, at[-1] + 1))
    assert at == sorted(at) and at[-1] < stage.index("hc = hn"), at
    # a row handed over under the next tile's first GEMMs (between their commit and wait), and the last after the loop
    assert src.count("bulk_reduce_add_f32(dqg") == 2
    loop = src[src.index("WG_S(pacc"):]
    assert loop.index("bulk_reduce_add_f32(dqg") < loop.index("WAIT_S(sacc, 0)")


def test_dkdv_by_bulk_copies_a_row(tmp_path, monkeypatch):
    """spec.extra dkdv_bulk (default True) with neither dkdv_tma nor dkdv_in_tile (the default where a captured
    table has a gradient, test_dkdv_store_auto's rule): after one barrier each warp stages its 16 rows of dK and of
    dV (2 D + 16 bytes apart: a 4-byte store's lanes in 32 banks) from the base of shared memory, and lane l copies
    staging row l (dK's rows 0-15, dV's 16-31) by one bulk copy; no direct store (its PTX: test_the_knobs_ptx).
    False keeps the threads' direct stores."""
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from falower.backends.numba_cuda import emit_fa3_bwd

    with pytest.raises(ValueError, match="dkdv_bulk must be True or False"):
        emit_fa3_bwd.validate_spec(_spec("causal", 128, extra={"dkdv_bulk": 1}))
    rows = {"dkdv_tma": False, "dkdv_in_tile": False}
    direct, bulk = (emit_fa3_bwd.emit_fa3_backward(_spec("causal", 128, extra=x)) for x in ({"dkdv_bulk": False}, rows))
    assert "store_pairs(dk" in direct and "bulk_store(" not in direct
    assert "store_pairs(dk" not in bulk and "store_pairs(dv" not in bulk
    # the epilogue's order (the simulator's proxy fence does nothing, so only the text can hold it): the GEMMs' waits,
    # the barrier, the staging, the proxy fence, the warp agrees, the copies, the wait for their reads at the end
    tail = bulk[bulk.index("WAIT_D(dkacc, 0)\n", bulk.index("while ")):]
    order = ["cuda.syncthreads()", "store_pairs(smem_w, dkv_w + 0, dkacc, ofs_0)",
             f"store_pairs(smem_w, dkv_w + {8 * 272 // 4}, dkacc, ofs_2)",
             f"store_pairs(smem_w, dkv_w + {16 * 272 // 4}, dvacc, ofs_0)",
             f"store_pairs(smem_w, dkv_w + {24 * 272 // 4}, dvacc, ofs_2)", "fence_proxy_async()", "syncwarp()",
             "bulk_store(dkv_g, dkv_s + lane * 272, 256)", "bulk_commit()", "bulk_wait_read0()"]
    at = [tail.index(order[0])]
    for x in order[1:]:
        at.append(tail.index(x, at[-1] + 1))
    assert at == sorted(at)
    assert "dkv_s = sb + 0 + warp * 8704" in tail
    assert "dkv_w = ((sbr + 0 + warp * 8704 + g * 272) >> 2) + (lane & 3)" in tail
    # the staging's 8 warps x 32 rows fit below the LSE / Delta rows (D = 64: 144-byte rows)
    for D in (64, 128):
        lay = emit_fa3_bwd._layout(_spec("causal", D))
        assert lay["STG"] == 0 and 8 * 32 * (2 * D + 16) <= lay["STG_END"] == lay["ST"]


def test_dkdv_by_tensor_stores_when_asked(tmp_path, monkeypatch):
    """spec.extra dkdv_tma: dK's and dV's tensor maps in the kernel's signature after the gradients' buffers (and in
    the main kernel's argument types), acquired once by each warp's lane 0; each warp stages its rows as D / 64 boxes
    a tensor from the aligned base (1024-byte aligned boxes, the swizzle's pattern) and lane 0 stores each by one
    tensor copy at (64 hb, the warp's first kv row, b * HK + hk), then every thread waits for their reads; not with a
    persistent kernel (its own staging region), which keeps a copy a row."""
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from numba import types

    from falower.backends.numba_cuda import emit_fa3_bwd
    from falower.backends.numba_cuda.runtime import FA2BackwardKernel

    for D in (64, 128):
        sp = _spec("causal", D, extra={"dkdv_tma": True})
        assert emit_fa3_bwd.dkdv_tma(sp)
        src = emit_fa3_bwd.emit_fa3_backward(sp)
        assert re.search(r"def \w+\(q, k, v, lse, do, delta, dq32, dk, dv, B, H, M, N, .*, dkmap, dvmap\b", src)
        assert src.count("tensormap_acquire(") == 2 and "bulk_store(" not in src
        nb = D // 64
        stores = re.findall(r"tma_store_3d\((d[kv])map_g, (\d+), dkv_q, dkv_bh, dkv_su \+ (\d+)\)", src)
        assert stores == [(t, str(64 * hb), str((i * nb + hb) * 2048)) for i, t in enumerate(("dk", "dv"))
                          for hb in range(nb)], stores
        tail = src[src.index("dkv_s = sb + 0 + warp * "):]
        assert f"dkv_s = sb + 0 + warp * {2 * nb * 2048}" in tail
        order = ["stage_rows_stsm_plain(dkv_s + 0, lane, dkacc", f"stage_rows_stsm_plain(dkv_s + {nb * 2048}, lane, dvacc",
                 "fence_proxy_async()", "syncwarp()", "tma_store_3d(", "bulk_commit()", "bulk_wait_read0()"]
        at = [tail.index(x) for x in order]
        assert at == sorted(at), at
        lay = emit_fa3_bwd._layout(sp)
        assert emit_fa3_bwd.threads(sp) // 32 * 2 * nb * 2048 <= lay["ST"]  # the boxes fit under the statistics
        argtypes = FA2BackwardKernel(sp).argtypes()
        plain = FA2BackwardKernel(_spec("causal", D, extra={"dkdv_tma": False, "dkdv_in_tile": False})).argtypes()
        ncap = len(sp.captures)  # the maps come before the captures (the sizes, here)
        assert len(argtypes) == len(plain) + 2
        assert argtypes[len(argtypes) - ncap - 2:len(argtypes) - ncap] == (types.Array(types.uint8, 1, "C"),) * 2
    assert not emit_fa3_bwd.dkdv_tma(_spec("causal", 128, extra={"dkdv_tma": True, "bwd_persistent": 4}))
    assert not emit_fa3_bwd.dkdv_tma(_spec("causal", 128, extra={"dkdv_tma": True, "dkdv_bulk": False}))


def test_dkdv_in_tile_when_asked(tmp_path, monkeypatch):
    """spec.extra dkdv_in_tile: dK's and dV's maps in the signature as dkdv_tma's (which it supersedes); in the loop,
    once dQ's GEMM is committed, a wait_group 1 for dV's and dK's group (unconditional: ptxas serialized every wgmma
    when the wait sat under the last tile's test, C7514), then in the walk's last tile only each warp's boxes staged
    by stmatrix, the proxy fence, lane 0's 2 D / 64 tensor stores and their commit, all before dQ's wait and
    hand-off; after the loop a walk of no tile stages its zeros the same way after a barrier, and every thread waits
    for the copies' reads before dq_ws's end. No barrier, word-at-a-time staging or row copy of the default's.
    Refused with the knobs that move the same GEMMs or stage elsewhere."""
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from falower.backends.numba_cuda import emit_fa3_bwd as e
    from falower.backends.numba_cuda.emit_fa2_bwd import DKDV_LINE
    from falower.backends.numba_cuda.runtime import FA2BackwardKernel

    for D in (64, 128):
        sp = _spec("causal", D, extra={"dq_ws": "auto", "dkdv_in_tile": True})
        e.validate_spec(sp)
        assert e.dkdv_in_tile(sp) and e.dkdv_maps(sp) and not e.dkdv_tma(sp) and e.ws_loads(sp)
        assert not e.dkdv_tma(_spec("causal", D, extra={"dkdv_in_tile": True, "dkdv_tma": True}))  # superseded
        src = e.emit_fa3_backward(sp)
        nb = D // 64
        assert re.search(r"def \w+\(q, k, v, lse, do, delta, dq32, dk, dv, B, H, M, N, .*, dkmap, dvmap\b", src)
        assert src.count("tensormap_acquire(") == 2 and "bulk_store(" not in src and "store_pairs(smem_w" not in src
        assert e.knobs_in(src)["dkdv_in_tile"] and e.knobs_in(src)["dkdv_bulk"] and not e.knobs_in(src)["dkdv_tma"]
        pre, rest = src.split("    while qc <= p_last:\n", 1)
        assert pre.rstrip().endswith("dkv_in_loop = qc <= p_last  # dkdv_in_tile: the walk's last tile stages dK "
                                     "and dV")
        loop, after = rest.split("    if tn == 0:", 1)
        order = ["WG_Q(dqa", "wgmma_commit()", "WAIT_D1(dvacc, 0)", "WAIT_D1(dkacc, 0)", "if not (qn <= p_last):",
                 DKDV_LINE, "stage_rows_stsm_plain(dk_s + 0, lane, dkacc, ofs_0, ofs_2)",
                 "stage_rows_stsm_plain(dv_s + 0, lane, dvacc, ofs_0, ofs_2)", "fence_proxy_async()  # dK's",
                 "syncwarp()", "if lane == 0:", "tma_store_3d(dkmap_g, 0, dkv_q, dkv_bh, dk_su + 0)",
                 f"tma_store_3d(dvmap_g, {64 * (nb - 1)}, dkv_q, dkv_bh, dv_su + {(nb - 1) * 128 * 128})",
                 "bulk_commit()", e.DKDV_ISSUED, "WAIT_Q(dqa, 0)", "bar_sync(DQ_FREE", "hc = hn"]
        at = [loop.index(order[0])]
        for x in order[1:]:
            at.append(loop.index(x, at[-1] + 1))
        last = loop.index("if not (qn <= p_last):")
        assert loop.index("WAIT_D1(dkacc, 0)") < last  # the wait before the test, every tile
        assert loop.count("tma_store_3d(") == 2 * nb and loop.count("stage_rows_stsm_plain(") == 2 * nb
        if nb == 2:
            assert "stage_rows_stsm_plain(dk_s + 2048, lane, dkacc, ofs_32, ofs_34)" in loop
        order = ["WAIT_D(dkacc, 0)", "if not dkv_in_loop:", "bar_sync(1, 256)  # every thread's K, V copies",
                 DKDV_LINE, "stage_rows_stsm_plain(dk_s__1 + 0", "fence_proxy_async()  # dK's", "tma_store_3d(",
                 "bulk_commit()", e.DKDV_ISSUED, "bulk_wait_read0()  # the copies have read", "# no more slabs"]
        at = [after.index(order[0])]
        for x in order[1:]:
            at.append(after.index(x, at[-1] + 1))
        argtypes = FA2BackwardKernel(sp).argtypes()
        rows = {"dq_ws": "auto", "dkdv_tma": False, "dkdv_in_tile": False}
        assert len(argtypes) == len(FA2BackwardKernel(_spec("causal", D, extra=rows)).argtypes()) + 2
    for bad, why in (({"dk_after_dq": True}, "dk_after_dq"), ({"sdp_ahead": "top"}, "sdp_ahead"),
                     ({"dq_bulk": True}, "dq_bulk"), ({"dq_late": True}, "dq_late"),
                     ({"bwd_persistent": 2}, "bwd_persistent"), ({"dkdv_bulk": False}, "dkdv_bulk False")):
        with pytest.raises(ValueError, match=f"dkdv_in_tile stages dK and dV .* not with {why}"):
            e.validate_spec(_spec("causal", 128, extra={"dkdv_in_tile": True, **bad}))
    with pytest.raises(ValueError, match="dkdv_in_tile must be True or False"):
        e.validate_spec(_spec("causal", 128, extra={"dkdv_in_tile": 1}))


@pytest.mark.parametrize("stem, D, want", [("plain", 128, ""), ("causal", 128, "tma"), ("plain", 64, ""),
                                           ("causal", 64, "in_tile"), ("document", 128, "tma"),
                                           ("sliding_window", 64, "in_tile"), ("relative_bias", 128, ""),
                                           ("alibi", 64, "")])
def test_dkdv_store_auto(stem, D, want):
    """How dK and dV leave by default, as measured (dkdv_store_auto): D >= 128 unmasked in the last tile, masked by
    tensor stores, but where dk_after_dq's default is on (plain D = 128) a row copy, since in_tile refuses it (the pair
    measured 0.953 of in_tile's time); D = 64 masked in the last tile, unmasked a row copy; a captured table with a
    gradient (ALiBi's slopes, a bias table) a row copy. The knobs follow it unless set, and either set says how they
    leave; dkdv_stsm asked keeps the row copies it stages (under the rule it had silently done nothing)."""
    from falower.backends.numba_cuda import emit_fa3_bwd as e

    sp = _spec(stem, D)
    assert e.dkdv_store_auto(sp) == want
    assert (e.dkdv_in_tile(sp), e.dkdv_tma(sp)) == (want == "in_tile", want == "tma")
    rows = _spec(stem, D, extra={"dkdv_tma": False})  # either knob set: the auto rule steps aside
    assert not e.dkdv_in_tile(rows) and not e.dkdv_tma(rows)
    assert e.dkdv_tma(_spec(stem, D, extra={"dkdv_tma": True}))
    stsm = _spec(stem, D, extra={"dkdv_stsm": True})  # stmatrix's staging is of the row copies: asked, they stay
    assert e.dkdv_store_auto(stsm) == "" and e.dkdv_stsm(stsm) and not e.dkdv_in_tile(stsm) and not e.dkdv_tma(stsm)
    assert "def stage_stsm(" in e.emit_fa3_backward(stsm)
    assert "dkdv_in_tile: " in e.emit_fa3_backward(sp) if want == "in_tile" else True


@pytest.mark.parametrize("D, bq, bk", [(64, 64, 64), (128, 64, 64), (64, 64, 128), (128, 64, 128), (64, 128, 128)])
def test_dkdv_in_tile_stages_where_nothing_reads(D, bq, bk):
    """dkdv_in_tile's boxes, from the emitted address expressions for every warp and either buffer: 1024-byte aligned
    (the 128-byte swizzle's pattern), pairwise disjoint, dV's in its own warpgroup's rows of V (only that
    warpgroup's dP^T reads them), dK's in the other buffer's Q or dO tile; none in K or dS^T (which the tile's dQ
    GEMM still reads while they are staged), the tile's own Q, dO, or the statistics and slabs after them; the
    tensor stores read the boxes staged."""
    from falower.backends.numba_cuda import emit_fa3_bwd as e

    sp = dataclasses.replace(_spec("causal", D, extra={"dkdv_in_tile": True}), block_q=bq, block_k=bk,
                             num_warps=bk // 16)
    e.validate_spec(sp)
    src = e.emit_fa3_backward(sp)
    lay = e._layout(sp)
    loop = src[src.index("if not (qn <= p_last):  # dkdv_in_tile"):src.index("hc = hn")]
    expr = {t: re.search(rf"^\s*{t}_s = (.*?)  #", loop, re.M).group(1) for t in ("dk", "dv")}
    staged = {t: [int(x) for x in re.findall(rf"stage_rows_stsm_plain\({t}_s \+ (\d+), lane, {t}acc", loop)]
              for t in ("dk", "dv")}
    stored = {t: [int(x) for x in re.findall(rf"tma_store_3d\({t}map_g, \d+, dkv_q, dkv_bh, {t}_su \+ (\d+)\)", loop)]
              for t in ("dk", "dv")}
    assert staged == stored and all(len(v) == D // 64 for v in staged.values()), (staged, stored)
    box, qt = e.DKDV_BOX, lay["qt"]
    for buf in (0, 1):
        boxes = []
        for warp in range(bk // 16):
            env = {"sb": 0, "warp": warp, "buf": buf}
            for t in ("dk", "dv"):
                base = eval(expr[t], {}, env)  # noqa: S307 (the kernel's own expression)
                for hb, off in enumerate(staged[t]):
                    a = base + off
                    assert a % 1024 == 0, (t, warp, hb, a)
                    if t == "dv":
                        rows = lay["V"] + hb * bk * 128 + (warp // 4) * 64 * 128
                        assert rows <= a and a + box <= rows + 64 * 128, (warp, hb, a)
                    else:
                        other = [lay[x] + (buf ^ 1) * qt for x in ("Q", "DO")]
                        assert any(o <= a and a + box <= o + qt for o in other), (warp, hb, a, other)
                    boxes.append(a)
        boxes.sort()
        assert all(b - a >= box for a, b in zip(boxes, boxes[1:])), boxes  # disjoint
        busy = [(0, lay["V"]), (lay["DS"], lay["total"]), (lay["Q"] + buf * qt, lay["Q"] + (buf + 1) * qt),
                (lay["DO"] + buf * qt, lay["DO"] + (buf + 1) * qt)]
        assert not any(lo < a + box and a < hi for a in boxes for lo, hi in busy), (buf, boxes, busy)


@pytest.mark.slow
def test_dkdv_in_tile_ptx(tmp_path, monkeypatch):
    """One PTX build (sm_90a, no GPU) of the causal D = 128 kernel as the default builds it (dq_ws, ws_loads) with
    dkdv_in_tile: 2 D / 64 tensor stores and 2 D / 16 stmatrix a path (the last tile's, the walk of no tile's), two
    `wait_group 1` (dV's and dK's registers), no row copy, the producer's one bulk reduction; ptxas (where this
    machine has one) serializes no wgmma: the wait under the last tile's test did (C7514)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("PTX checks need the real CUDA target")
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))

    from falower.backends.numba_cuda.runtime import FA2BackwardKernel

    ptx = FA2BackwardKernel(_spec("causal", 128, extra={"dq_ws": "auto", "dkdv_in_tile": True})).ptx((9, 0))
    assert ptx.count("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group") == 2 * 2 * 128 // 64
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == 2 * 2 * 128 // 16
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") == 2
    assert "cp.async.bulk.global.shared::cta.bulk_group" not in ptx  # no copy of a row
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 1
    log = _ptxas_log(ptx, tmp_path / "k.ptx")
    if log is None:  # no ptxas on this machine
        return
    assert "C7514" not in log and "C7515" not in log and "serialized" not in log, log[-2000:]


def _stmatrix_writes(helper: str, name: str, args) -> dict:
    """Run an emitted staging helper (`helper`'s text, function `name`) for the 32 lanes of a warp as Python, with
    stmatrix .x4 modelled: matrix m's row r goes to the address lane 8 m + r gives, its 4-byte word t from lane 4 r +
    t's word m. Each lane's fragment x holds ("x", lane, index) and the pack of two elements is their pair, so the
    result maps every 4-byte shared address to the (lane, index) pair stored there."""
    ns: dict = {"np": np, "lget": lambda x, i: x[i], "pack": lambda a, b: (a, b), "device_function": lambda f: f}
    calls: dict = {}
    exec(helper, ns)  # noqa: S102
    for lane in range(32):
        ns["stsm_x4"] = lambda at, *w, lane=lane: calls.setdefault(lane, []).append((int(at), w))
        ns[name](*args(lane, [("x", lane, i) for i in range(64)]))
    out = {}
    for k in range(len(calls[0])):  # instruction k of every lane
        for m in range(4):
            for r in range(8):
                at = calls[8 * m + r][k][0]
                for t in range(4):
                    out[at + 4 * t] = calls[4 * r + t][k][1][m]
    return out


@pytest.mark.parametrize("D", [64, 128])
def test_the_staging_helpers_put_each_element_in_its_place(D):
    """dkdv_stsm's stage_stsm (rows 2 D + 16 bytes apart) and dkdv_tma's stage_rows_stsm_plain (emit_fa3's O staging
    without 1 / l: D / 64 boxes of 16 rows x 128 bytes, 2048 apart, in the 128-byte swizzle: row R's chunk c at
    (c ^ (R & 7)) << 4), run as Python for a warp with stmatrix modelled: element (row R of the warp's 16, columns 8 dn + 2t, + 1), held by lane 4 (R % 8) + t
    at index 4 dn (+ 1) of offset ofs_0 = 0 (rows 0-7) or ofs_2 = 2 (rows 8-15), lands where the layout says, and
    every word is written once."""
    from falower.backends.numba_cuda import emit_fa3, emit_fa3_bwd
    from falower.backends.numba_cuda.emit_fa2 import _Code

    def helper(make) -> str:
        c = _Code()
        return "\n".join(c.helpers[make(c, D, "pack")][1:])  # its lines, without the decorator

    PK = 2 * D + 16
    rows = helper(emit_fa3_bwd._stage_stsm_helper)
    boxes = helper(lambda c, D, pack: emit_fa3.stage_rows_stsm_helper(c, D, pack, emit_fa3_bwd.DKDV_BOX, scaled=False))
    got_rows = _stmatrix_writes(rows, "stage_stsm", lambda lane, x: (((lane >> 3) & 1) * 8 * PK + (lane & 7) * PK
                                                                     + (lane >> 4) * 16, x, 0, 2))
    got_box = _stmatrix_writes(boxes, "stage_rows_stsm_plain", lambda lane, x: (0, lane, x, 0, 2))
    for got in (got_rows, got_box):
        assert len(got) == 16 * D * 2 // 4  # 16 rows of D 16-bit values, each 4-byte word once
    for R in range(16):
        for dn in range(D // 8):
            for t in range(4):
                lane, i = 4 * (R % 8) + t, 4 * dn + (2 if R >= 8 else 0)
                want = (("x", lane, i), ("x", lane, i + 1))
                assert got_rows[R * PK + 16 * dn + 4 * t] == want, (R, dn, t)
                box, c = divmod(dn, 8)
                assert got_box[box * 2048 + R * 128 + ((c ^ (R & 7)) << 4) + 4 * t] == want, (R, dn, t)


def test_the_persistent_backward_when_asked(tmp_path, monkeypatch):
    """spec.extra bwd_persistent = P: min(P, items) blocks of one dimension; dK / dV staged in a region of their own
    after everything else (the next item's loads never reach it); the item's coordinates from the walk, its step
    before kv_group's skip of a place past the heads, the thread's indices made per item, each thread's wait for its copies between the item's loads
    and its q loop; refused without dkdv_bulk, for a count that is not one, and where the region does not fit."""
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from falower.backends.numba_cuda import emit_fa3_bwd

    sp = _spec("causal", 128, extra={"bwd_persistent": 132})
    emit_fa3_bwd.validate_spec(sp)  # the default 64 x 128 tiles at D = 128
    assert emit_fa3_bwd.grid(sp, 4, 16, 4096, 4096) == (132, 1, 1)
    assert emit_fa3_bwd.grid(sp, 1, 1, 100, 200) == (16, 1, 1)  # min(P, items): 2 kv tiles x 8 places (7 past H)
    plain = _spec("causal", 128)
    lay, lay0 = emit_fa3_bwd._layout(sp), emit_fa3_bwd._layout(plain)
    assert lay["STG"] == lay0["total"] and lay["STG_END"] == lay["total"] == lay0["total"] + 8 * 32 * 272
    assert {k: lay[k] for k in lay0} == {**lay0, "STG": lay["STG"], "STG_END": lay["STG_END"], "total": lay["total"]}
    src = emit_fa3_bwd.emit_fa3_backward(sp)
    body = src[src.index("while it_z < B:"):]
    order = ["kj = it_x // 8", "it_step = ", "if hk >= HK:", "continue", "cp_async_wait0()  # K, V and the first",
             "bulk_wait_read0()  # the last item's", "while qc <= p_last:", f"dkv_s = sb + {lay['STG']} + warp",
             "bulk_store(dkv_g"]
    at = [body.index(order[0])]
    for x in order[1:]:
        at.append(body.index(x, at[-1] + 1))
    # the thread's indices made per item from an opaque threadIdx (LLVM would hoist what an item derives from them out
    # of the item loop: ptxas then spilled 364-456 bytes), never before the loop
    head = src[src.index(f"def {sp.name}("):src.index("while it_z < B:")]
    assert "cuda.threadIdx.x" not in head and "tid = np.int32(opaque_u32(cuda.threadIdx.x))" in body
    assert body.index("it_step = ") < body.index("tid = np.int32(opaque_u32(") < body.index("sb = opaque_u32(sb)")
    assert body.count("return") == 0 and src.rstrip().endswith("bulk_wait_read0()  # the last item's copies have "
                                                               "read the staging rows: shared memory may go")
    for bad, why in (({"bwd_persistent": 8, "dkdv_bulk": False}, "needs dkdv_bulk"),
                     ({"bwd_persistent": True}, "count of blocks"), ({"bwd_persistent": -1}, "count of blocks"),
                     ({"bwd_persistent": 8, "dq_bulk": True}, "over 227 KB")):
        with pytest.raises(ValueError, match=why):
            emit_fa3_bwd.validate_spec(_spec("causal", 128, extra=bad))


def test_reduced_gradients_are_held_across_tiles():
    """ALiBi's slope gradient: summed over the block's tiles and added where its index changes and after the walk
    (emit_fa2_bwd.held_grads), not once a tile, by the wgmma and the mma.sync kernels; '-bgt' (hold_grads False)
    keeps the per-tile form; kernels without a reduced gradient and the deterministic mode have none."""
    from falower.backends.numba_cuda import emit_fa3_bwd
    from falower.backends.numba_cuda.emit_fa2_bwd import held_grads

    held = emit_fa3_bwd.emit_fa3_backward(_spec("alibi"))
    assert held_grads(_spec("alibi")) and not held_grads(_spec("alibi", extra={"hold_grads": False}))
    assert not held_grads(_spec("causal")) and not held_grads(_spec("relative_bias"))  # per-element grads
    add = "cuda.atomic.add(grad_0, ghold0, gacc0)"
    walk_end = held.index("hc = hn")  # the walk's last statements
    assert held.count(add) == 2 and held.count("cuda.atomic.add(") == 2
    assert held.index("if gat0 != ghold0:") < held.index(add) < walk_end  # where the index changes
    assert held.index(add, walk_end) > walk_end  # what is held, after the walk
    per_tile = emit_fa3_bwd.emit_fa3_backward(_spec("alibi", extra={"hold_grads": False}))
    assert "ghold0" not in per_tile and "cuda.atomic.add(grad_0, min(max(gi0_0" in per_tile
    # the mma.sync kernel the same way (its deterministic mode sums per block in a fixed order instead)
    from falower.backends.numba_cuda.emit_fa2_bwd import emit_fa2_backward

    mma = emit_fa2_backward(dataclasses.replace(_spec("alibi"), extra={}))
    assert "wgmma" not in mma and mma.count(add) == 2 and "if gat0 != ghold0:" in mma
    det = _spec("alibi", pipeline="fa2-bwd-deterministic")
    assert not held_grads(det) and "ghold0" not in emit_fa2_backward(dataclasses.replace(det, extra={}))


def _rel_graph(index):
    """A relative-bias-like graph whose table index is index(q, kv, N) (the table is [H, 4N])."""
    import falower as fl
    from falower.ir import dim

    N = dim("N")
    tab = fl.capture("tab", "f32", ["H", N * 4])
    return fl.attention(score_mod=lambda s, b, h, q, kv: s + tab[h, index(q, kv, N)], name="relx")


@pytest.mark.parametrize("index, span", [
    (lambda q, kv, N: q - kv + (N - 1), (1, -1)),
    (lambda q, kv, N: kv - q + (N - 1), (-1, 1)),
    (lambda q, kv, N: 2 * (q - kv) + 2 * N, (2, -2)),
    (lambda q, kv, N: q + N, (1, 0)),
    (lambda q, kv, N: q * kv, None),
    (lambda q, kv, N: (q - kv) // 2 + N, None),
])
def test_a_gradients_index_span(index, span):
    """from_ir_bwd._index_span: the last index's coefficients in q and kv where it is a q + b kv + c; the wgmma
    backward then sums a thread's elements at the same entry before adding them (grouped_grads)."""
    import falower as fl
    from falower.backends.numba_cuda import emit_fa3_bwd
    from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec

    c = fl.compile(_rel_graph(index), "numba-cuda")
    spec = build_backward_spec(analyse_backward(c.lowered_backward), {"D": 64}, "f16", "mma", None,
                               {"bwd_schedule": "wgmma"})
    (g,) = spec.grads
    assert g.span == (span or ())
    groups = emit_fa3_bwd.grouped_grads(spec)
    if span is None:
        assert groups == {} and "gidx0_fn" not in spec.device_source
    else:
        assert groups == {0: span} and "def gidx0_fn(" in spec.device_source


@settings(max_examples=15, deadline=None)
@given(a=st.integers(-3, 3), b=st.integers(-3, 3), c=st.integers(0, 3))
def test_a_gradients_index_span_of_any_affine_form(a, b, c):
    """a q + b kv + c N: the span is (a, b), and none where the index is the same for the whole tile."""
    import falower as fl
    from falower.backends.numba_cuda.from_ir_bwd import analyse_backward

    c_ = fl.compile(_rel_graph(lambda q, kv, N: q * a + kv * b + N * c), "numba-cuda")
    ((*_, span, grid),) = analyse_backward(c_.lowered_backward).grads
    assert grid is False  # one index: never the grid form
    assert span == (() if (a, b) == (0, 0) else (a, b))


def test_grouped_gradients_in_the_kernel():
    """The relative bias at 64 x 128: a thread's 64 elements in 18 groups of one entry each (q - kv offsets 8 (jj -
    r) + e from the thread's base), summed in registers, one add a group; '-bgg' (grad_groups False) and the bias
    table (its q and kv both vary: no span) add per element."""
    import re

    from falower.backends.numba_cuda import emit_fa3_bwd

    spec = _spec("relative_bias", D=128)
    src = emit_fa3_bwd.emit_fa3_backward(spec)
    assert "gbase0 = gidx0_fn(b, h, hk, q0 + t2, kv0 + warp * 16 + g," in src
    inits = set(re.findall(r"(gd0_m?\d+) = ZERO", src))
    assert len(inits) == 18 and {"gd0_m8", "gd0_57"} <= inits  # offsets -8 .. 57: 8 (jj - r) + e, jj < 8, r < 2
    assert src.count("cuda.atomic.add(grad_0, ") == 18 and "cuda.atomic.add(grad_0, (min(max(gi0_0" in src
    off = emit_fa3_bwd.emit_fa3_backward(_spec("relative_bias", D=128, extra={"grad_groups": False}))
    assert "gbase0" not in off and "gd0_" not in off
    assert emit_fa3_bwd.grouped_grads(_spec("bias")) == {}


def _table_graph(index):
    """A bias-table-like graph whose [H, M, N] table is read at index(b, h, q, kv)."""
    import falower as fl

    tab = fl.capture("tab", "f32", "H,M,N")
    return fl.attention(score_mod=lambda s, b, h, q, kv: s + tab[index(b, h, q, kv)], name="tabx")


@pytest.mark.parametrize("index, grid", [
    (lambda b, h, q, kv: (h, q, kv), True),
    (lambda b, h, q, kv: (0, q, kv), True),  # a constant leading index is the tile's too
    (lambda b, h, q, kv: (h, kv, q), False),  # transposed: kv-consecutive entries are a row apart
    (lambda b, h, q, kv: (h, q, kv + 1), False),  # shifted: the 16-byte reductions would be misaligned
    (lambda b, h, q, kv: (h, q // 2, kv), False),
    (lambda b, h, q, kv: (h, q, q), False),
])
def test_a_gradients_grid_form(index, grid):
    """from_ir_bwd: GradSpec.grid where the last two indices are the element's q and kv themselves and the others
    the tile's; only then does the wgmma backward add four kv-consecutive entries by one 16-byte reduction."""
    import falower as fl
    from falower.backends.numba_cuda import emit_fa3_bwd
    from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec

    c = fl.compile(_table_graph(index), "numba-cuda")
    spec = build_backward_spec(analyse_backward(c.lowered_backward), {"D": 64}, "f16", "mma", None,
                               {"bwd_schedule": "wgmma"})
    (g,) = spec.grads
    assert g.grid is grid and not g.reduced
    assert emit_fa3_bwd.v4_grads(spec) == ([0] if grid else [])
    assert ("red_add_v4_f32(grad_0" in emit_fa3_bwd.emit_fa3_backward(spec)) is grid


def test_the_bias_tables_gradient_by_16_byte_reductions():
    """The bias table at 64 x 128: a 16-byte reduction a lane and n8 tile (8 a tile, where it added 32 elements one
    by one), behind one uniform test of the call's table (rows of a multiple of 4 words covering M x N, 16-byte
    aligned) whose other side adds per element, clamped; 'grad_v4' False keeps the per-element adds only. The
    simulator cases bias-* run both sides against the IR."""
    from falower.backends.numba_cuda import emit_fa3_bwd

    spec = _spec("bias", D=128)
    assert [g.grid for g in spec.grads] == [True] and emit_fa3_bwd.v4_grads(spec) == [0]
    src = emit_fa3_bwd.emit_fa3_backward(spec)
    assert "gvec0 = cap_0_bias.shape[2] % 4 == 0 and cap_0_bias.shape[2] >= N and cap_0_bias.shape[1] >= M" in src
    per_copy = spec.block_q // 8  # n8 tiles a tile, in each of the elementwise code's copies
    copies = src.count("red_add_v4_f32(grad_0, ") // per_copy
    assert copies >= 1 and src.count("red_add_v4_f32(grad_0, ") == copies * per_copy
    assert src.count("cuda.atomic.add(grad_0, ") == copies * per_copy * 4  # the fallback's four a tile
    off = emit_fa3_bwd.emit_fa3_backward(_spec("bias", D=128, extra={"grad_v4": False}))
    assert "red_add_v4_f32(grad_0" not in off and "gvec0" not in off
    assert off.count("cuda.atomic.add(grad_0, ") == copies * per_copy * 4


def test_the_bias_tables_reads_by_16_byte_loads():
    """from_ir_bwd: the bias table's read at [hk, q, kv] is a grid read (FA2BackwardSpec.grid_reads), the relative
    bias's (one index, q - kv) is not. read_v4 (the default, "early"): each n8 tile's entries by one 16-byte load a
    lane, all the tile's loads issued before the wait for S^T and dP^T, the transpose into elemg_all's tv0, behind
    the uniform test of the table (rvec0), the next tile's rows to L2; "late": each n8 tile's loads in the element
    code; read_v4 False: the element code gathers its own entry (elem_all). The simulator cases bias-* run both
    sides of rvec0."""
    import falower as fl
    from falower.backends.numba_cuda import emit_fa3_bwd

    spec = _spec("bias", D=128)
    assert spec.grid_reads == (("all", 0, 3),) and _spec("relative_bias").grid_reads == ()
    assert "def elemg_all(s, dp, lse, delta, b, h, hk, q, kv, interior, tv0, cap_bias," in spec.device_source
    n8 = spec.block_q // 8
    late = emit_fa3_bwd.emit_fa3_backward(_spec("bias", D=128, extra={"read_v4": "late"}))
    loads = len(re.findall(r"tl0\w*, tl1\w*, tl2\w*, tl3\w* = ldg_vec\(cap_0_bias, \(gl0_\w*\[0\], gq\w*, gkv\)\)",
                           late))
    calls = late.count("= elemg_all(")
    assert loads >= n8 and loads % n8 == 0 and calls == loads * 4 and "= elem_all(" not in late
    assert ("rvec0 = rows_aligned16(cap_0_bias) and cap_0_bias.shape[2] % 4 == 0 and cap_0_bias.shape[2] >= N and "
            "cap_0_bias.shape[1] >= M") in late
    assert len(re.findall(r"prefetch_l2\(cap_0_bias, \(gp_\w*\[0\], prow\w*, pkv\w*\)\)", late)) == 1
    for extra in ({}, {"read_v4": True}, {"read_v4": "early"}):  # the default, however asked for
        early = emit_fa3_bwd.emit_fa3_backward(_spec("bias", D=128, extra=extra))
        wait = early.index("WAIT_S(sacc, 0)")  # the tile's n8 loads once, before the wait for S^T and dP^T
        assert len(re.findall(r"= ldg_vec\(cap_0_bias,", early)) == n8
        assert all(m.start() < wait for m in re.finditer(r"= ldg_vec\(cap_0_bias,", early))
        assert early.count("= elemg_all(") == calls and "te0_7_3" in early[wait:]
        assert "rvec0 = rows_aligned16(cap_0_bias)" in early and "prefetch_l2(cap_0_bias" in early
    with pytest.raises(fl.FalowerError, match="read_v4"):  # falower.compile refuses a value it would misread
        fl.compile(fl.attention(), extra={"read_v4": "sometimes"})
    off = emit_fa3_bwd.emit_fa3_backward(_spec("bias", D=128, extra={"read_v4": False}))
    assert "ldg_vec(cap_" not in off and "= elemg_all(" not in off and "prefetch_l2(" not in off


@pytest.mark.slow
def test_the_knobs_ptx(tmp_path, monkeypatch):
    """One PTX build (sm_90a, no GPU) of the causal D = 128 kernel with dq_bulk, dk_after_dq, p_under_dp,
    dkdv_bulk and dkdv_tma on: dQ's two bulk reductions (the loop's and the last tile's) and no vector reduction;
    dK's and dV's boxes staged by D / 16 stmatrix each and stored by D / 64 TMA tensor stores each (their maps
    acquired once), no bulk copy of a row and no direct store; two `wait_group 1` (S^T alone, dQ before dK); the
    default's wgmma counts; no call; ptxas's log without serialization."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("PTX checks need the real CUDA target")
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from falower.backends.numba_cuda.runtime import FA2BackwardKernel, resource_usage

    ptx = FA2BackwardKernel(_spec("causal", 128, extra={"dq_bulk": True, "dk_after_dq": True,
                                                        "p_under_dp": True, "dkdv_bulk": True,
                                                        "dkdv_tma": True})).ptx((9, 0))
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2
    assert "cp.async.bulk.global.shared::cta.bulk_group" not in ptx  # no copy of a row (dkdv_tma's boxes instead)
    assert ptx.count("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group") == 2 * 128 // 64  # dK's and dV's boxes
    assert ptx.count("fence.proxy.tensormap::generic.acquire.gpu") == 2
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == 2 * 128 // 16  # their staging
    assert "st.global.b32" not in ptx and "st.global.u32" not in ptx  # no direct store of dK / dV
    assert "red.global.add" not in ptx
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") == 2
    counts = {n: ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16") for n in (64, 128)}
    assert counts == {64: 24, 128: 8}, counts
    assert not re.search(r"\bcall\b", ptx)
    try:
        usage = resource_usage(ptx.replace(".target sm_90\n", ".target sm_90a\n"), "sm_90a")
    except Exception as exc:
        pytest.skip(f"nvJitLink unavailable: {exc}")
    assert "C7509" not in usage["log"] and "serialized" not in usage["log"], usage["log"]


_DOC_SPECS: dict = {}


def _doc_spec(G: int, ahead: bool):
    """The document example's wgmma backward spec (block lists), its group size set to G (built once)."""
    if ahead not in _DOC_SPECS:
        _DOC_SPECS[ahead] = _spec("document", extra={"list_ahead": True} if ahead else None)
        assert _DOC_SPECS[ahead].block_mask == "list"
    return dataclasses.replace(_DOC_SPECS[ahead], group_size=G)


@settings(max_examples=60, deadline=None)
@given(G=st.integers(1, 4), nq=st.integers(1, 6), ahead=st.booleans(), data=st.data())
def test_the_list_walk_visits_the_list(G, nq, ahead, data):
    """The wgmma backward's walk over a kv tile's block list, its emitted lines run as Python: the (head of the
    group, q tile, class) pairs it visits are the list's entries in order, decoded from it * 2 + partial (it = head
    * nq + q tile) for any group size, any subset of pairs (none at all: q_n = 0), with the next entry read at the
    loop's top or a tile ahead (list_ahead); entries past the row's count hold garbage the walk must not use."""
    from falower.backends.numba_cuda import emit_fa3_bwd as e
    from falower.backends.numba_cuda.emit_fa2 import _Code
    from falower.backends.numba_cuda.emit_fa2_bwd import _list_args

    spec = _doc_spec(G, ahead)
    its = sorted(data.draw(st.sets(st.integers(0, G * nq - 1))))
    partial = [data.draw(st.booleans()) for _ in its]
    c = _Code()
    e._emit_pair_range(c, spec)
    c(f"while {e._more(spec, 'hc', 'qc')}:")
    with c.indent():
        c(f"seen.append((hc, qc, {e._class_expr(spec, 'hc', 'qc')}))")
        c("hn = hc")
        c("qn = qc")
        c("pn = pc")
        e._emit_step(c, spec, "hn", "qn")
        c("hc = hn")
        c("qc = qn")
        c("pc = pn")
    assert ("e_nx = " in c.text()) == ahead
    a = _list_args(spec)
    row = 3  # the (b, kv head, kv tile) row: b = 0, hk = 1 of HK = 2, kj = 1 of nk = 2
    count = np.zeros(8, np.int32)
    count[row] = len(its)
    tiles = np.full(8 * G * nq, 10**6 + 1, np.int32)  # garbage: an odd entry far past any pair
    tiles[row * G * nq: row * G * nq + len(its)] = [2 * it + int(p) for it, p in zip(its, partial)]
    seen: list = []
    env = {"b": 0, "hk": 1, "HK": 2, "nk": 2, "kj": 1, "nq": nq, a["q_count"]: count, a["q_tiles"]: tiles,
           "seen": seen}
    exec(compile(c.text(), "walk", "exec"), env)  # noqa: S102
    assert seen == [(it // nq, it % nq, 1 if p else 2) for it, p in zip(its, partial)]


def _slab_order(spec):
    """The test's own statement of dq_ws's accumulator order, `at(bh, m, d, M)`: tile m // block_q of (batch, head) bh
    (block_q x D f32 a tile), consumer warpgroup w's 64 x DC slab in it (w = row group + RG x column split, as the
    kernel numbers them), then the slab as the warpgroup's threads write it (emit_fa3_bwd._emit_dq_handoff):
    [n8 tile][thread][4], a thread's 4 in wgmma's m64nN accumulator order (rows g, g + 8; columns 2t, 2t + 1)."""
    from falower.backends.numba_cuda import emit_fa3_bwd

    D, BQ = spec.head_dim, spec.block_q
    RG, DC = BQ // 64, D // emit_fa3_bwd._col_splits(spec)

    def at(bh, m, d, M):
        nq = -(-M // BQ)
        r, cc = m % BQ, d % DC
        w = r // 64 + RG * (d // DC)
        rr = r % 64
        th = (rr // 16) * 32 + (rr % 8) * 4 + (cc % 8) // 2
        e = ((rr % 16) // 8) * 2 + cc % 2
        return (bh * nq + m // BQ) * BQ * D + w * 64 * DC + (cc // 8) * 512 + th * 4 + e
    return at


@pytest.mark.parametrize("D, bq, bk, alt", [(64, 64, 64, False), (64, 64, 128, False), (128, 64, 128, False),
                                            (64, 128, 128, False), (64, 64, 128, True), (128, 64, 128, True)])
def test_dq_ws_accumulator_order_is_a_permutation_of_whole_tiles(D, bq, bk, alt):
    """dq_ws's accumulator order (_slab_order) maps every (batch-head, row, column) of M = 130 rows one-to-one into the
    padded tiles' B H ceil(M / bq) bq D elements; each 16-byte group of a slab holds one thread's n8 tile (rows g and
    g + 8, columns 2t, 2t + 1, wgmma's accumulator order), and columns 2j, 2j + 1 lie side by side (the conversion
    reads them as a pair); the conversion's chunk decode is its inverse. Under dq_alternate (`alt`) a tile is one
    64 x D slab, whichever warpgroup wrote it."""
    from falower.backends.numba_cuda import emit_fa3_bwd

    spec = dataclasses.replace(_spec("causal", D, extra={"dq_ws": True, "dq_alternate": alt}), block_q=bq, block_k=bk,
                               num_warps=bk // 16)
    assert emit_fa3_bwd.dq_ws(spec) and emit_fa3_bwd.dq_alternate(spec) is alt
    assert emit_fa3_bwd._col_splits(spec) == (1 if alt else (bk // 64) // (bq // 64))
    at = _slab_order(spec)
    M, BH = 130, 3
    Mp = emit_fa3_bwd.dq_acc_rows(spec, M)
    assert Mp == -(-M // bq) * bq
    idx = np.array([[[at(bh, m, d, M) for d in range(D)] for m in range(Mp)] for bh in range(BH)])
    assert sorted(idx.ravel().tolist()) == list(range(BH * Mp * D))
    assert np.all(idx[:, :, 1::2] == idx[:, :, 0::2] + 1)
    # thread (warp 1, lane g 3 t 2) of the first slab: rows 16 + 3, + 8; columns 4, 5 of n8 tile 0, then n8 tile 1
    th = 32 + 3 * 4 + 2
    assert [idx[0, r, c] for r, c in ((19, 4), (19, 5), (27, 4), (27, 5))] == [th * 4 + e for e in range(4)]
    assert idx[0, 19, 12] == 512 + th * 4
    # the conversion's inverse (dq_ws_chunk): chunk p of a tile's slabs holds (r, col), (r, col + 1), (r + 8, col),
    # (r + 8, col + 1)
    scope: dict = {"device_function": lambda f: f}
    exec("\n".join(emit_fa3_bwd.dq_ws_chunk(spec)), scope)
    for p in range(bq * D // 4):
        r, col = scope["dqws_rc"](p)
        got = [idx[1, bq + rr, cc] for rr, cc in ((r, col), (r, col + 1), (r + 8, col), (r + 8, col + 1))]
        assert got == [(Mp + bq) * D + 4 * p + e for e in range(4)], (p, r, col)


def test_dq_ws_source(tmp_path, monkeypatch):
    """spec.extra dq_ws: a producer warpgroup after the consumers (threads + 128, the launch at 384 x 168 with
    setmaxnreg 24 / 240 at two consumer warpgroups), branching off before any load; the consumers' block barriers
    are named barriers of their own threads (no cuda.syncthreads left), their dQ goes to their slab (no vector
    reduction, no lane swap) between the slab's free and full barriers with the proxy fence before the arrive, and
    after the loop a 0 word ends the producer's walk. Refused with the dQ knobs it cannot take; the Delta kernel and
    the conversion read the slab order. Two slabs a warpgroup alternate by default (dq_ws_slabs). (The loads stay
    the consumers' here, ws_loads False: test_ws_loads_source reads them.)"""
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from falower.backends.numba_cuda import emit_fa2_bwd, emit_fa3_bwd

    spec = _spec("causal", 128, extra={"dq_ws": True, "ws_loads": False})
    assert emit_fa3_bwd.threads(spec) == 384 and emit_fa3_bwd.consumer_threads(spec) == 256
    src = emit_fa3_bwd.emit_fa3_backward(spec)
    assert "cuda.syncthreads()" not in src and "bar_sync(1, 256)" in src
    assert "red_add_v4_f32(dq32" not in src and "dq_swap(" not in src
    assert "@launch_bounds(384, 1)" in src and "setmaxnreg_dec(24)" in src and "setmaxnreg_inc(240)" in src
    producer = src.index("if tid >= 256:")
    assert producer < src.index("# K and V of this kv tile, once") and producer < src.index("SETMAXNREG_INC()")
    loop = src[re.search(r"WAIT_Q1?\(dqa, 0\)", src).start():src.index("hc = hn")]  # (dk_after_dq: WAIT_Q1)
    order = ["bar_sync(DQ_FREE + wg * 2 + dqs, 160)", "sts_v4_f32(dqw_t + 0,", "sts_v4_f32(dqw_t + 14336,",
             "= (b * H + h) * nq + qc + 1", "fence_proxy_async()", "bar_arrive(DQ_FULL + wg * 2 + dqs, 160)",
             "dqs ^= 1"]
    at = [loop.index(x) for x in order]
    assert at == sorted(at), list(zip(order, at))
    end = src[src.index("# no more slabs"):]
    order = ["bar_sync(DQ_FREE + wg * 2 + dqs, 160)", "dqs] = 0", "bar_arrive(DQ_FULL + wg * 2 + dqs, 160)",
             "bar_sync(DQ_FREE + wg * 2 + (dqs ^ 1), 160)"]
    at = [end.index(x) for x in order]
    assert at == sorted(at), list(zip(order, at))
    # two slabs a warpgroup by default (dq_ws_slabs), one when asked: its free barrier waited once at the end
    assert emit_fa3_bwd.smem_bytes(spec) - emit_fa3_bwd.smem_bytes(_spec("causal", 128)) == 2 * 2 * 64 * 64 * 4 + 16
    one_slab = _spec("causal", 128, extra={"dq_ws": True, "ws_loads": False, "dq_ws_slabs": 1})
    assert emit_fa3_bwd.smem_bytes(one_slab) - emit_fa3_bwd.smem_bytes(_spec("causal", 128)) == 2 * 64 * 64 * 4 + 16
    src1 = emit_fa3_bwd.emit_fa3_backward(one_slab)
    assert "dqs ^= 1" not in src1 and src1.count("bar_sync(DQ_FREE + wg * 1 + dqs, 160)") == 2
    with pytest.raises(ValueError, match="dq_ws_slabs must be 1 or 2"):
        emit_fa3_bwd.validate_spec(_spec("causal", 64, extra={"dq_ws": True, "dq_ws_slabs": 3}))
    one = emit_fa3_bwd.emit_fa3_backward(dataclasses.replace(spec, block_k=64, num_warps=4))
    assert "SETMAXNREG_INC()" not in one and "@launch_bounds" not in one  # 256 threads fit at 255 registers
    for bad in ({"dq_split": "k"}, {"dq_bulk": True}, {"dq_late": True}, {"bwd_persistent": 2}):
        with pytest.raises(ValueError, match="dq_ws hands dQ"):
            emit_fa3_bwd.validate_spec(_spec("causal", 64, extra={"dq_ws": True, **bad}))
    assert "zrow = (b * H + h) * mp + m" in emit_fa2_bwd.emit_delta(spec)  # zeroed as contiguous padded rows
    assert "r, col = dqws_rc(p)" in emit_fa2_bwd.emit_dq_convert(spec)  # converted a q tile a block
    assert emit_fa2_bwd.dq_convert_launch(spec, 2, 3, 130, 2 * 3 * 130 * 128) == ((2 * 3 * 3,), 256)
    plain = _spec("causal", 128)
    assert "dqws_rc" not in emit_fa2_bwd.emit_dq_convert(plain) and "zrow" not in emit_fa2_bwd.emit_delta(plain)
    # 8 elements a thread (16-byte loads and store)
    assert emit_fa2_bwd.dq_convert_launch(plain, 2, 3, 130, 2 * 3 * 130 * 128) == ((-(-2 * 3 * 130 * 16 // 128),), 128)


def test_dq_ws_by_default():
    """dq_ws "auto" (its default): on for the wgmma backward wherever ws_loads comes with it, block lists (the
    document) and a gradient held across tiles (ALiBi's slope) included; with ws_loads False, off under those two,
    where dq_ws alone measured slower; off with one consumer warpgroup (block_k = 64: not measured); True asks for it
    there too, False keeps the vector reductions; never in the deterministic mode; anything else is refused by name."""
    from falower.backends.numba_cuda import emit_fa3_bwd

    auto = {"dq_ws": "auto"}
    for stem in ("causal", "plain", "relative_bias", "document", "alibi"):
        assert emit_fa3_bwd.dq_ws(_spec(stem, 128, extra=auto)), stem
    for stem, on in (("causal", True), ("document", False), ("alibi", False)):  # without ws_loads
        assert emit_fa3_bwd.dq_ws(_spec(stem, 128, extra={**auto, "ws_loads": False})) is on, stem
    spec = _spec("causal", 128, extra=auto)
    assert emit_fa3_bwd.dq_ws(dataclasses.replace(spec, extra={"bwd_schedule": "wgmma"}))  # no key: "auto"
    listed = dataclasses.replace(spec, block_mask="list")
    assert emit_fa3_bwd.dq_ws(listed) and emit_fa3_bwd.ws_loads(listed)
    assert not emit_fa3_bwd.dq_ws(dataclasses.replace(listed, extra={**spec.extra, "ws_loads": False}))
    assert emit_fa3_bwd.dq_ws(dataclasses.replace(listed, extra={**spec.extra, "dq_ws": True, "ws_loads": False}))
    assert emit_fa3_bwd.dq_ws(_spec("alibi", 128, extra={"dq_ws": True}))
    assert not emit_fa3_bwd.dq_ws(_spec("causal", 128))  # _spec's False
    assert not emit_fa3_bwd.dq_ws(_spec("causal", 128, extra={**auto, "bwd_persistent": 2}))  # not with it: off
    one_wg = dataclasses.replace(spec, block_k=64, num_warps=4)  # one consumer warpgroup: not measured, so asked for
    asked = {**spec.extra, "dq_ws": True}
    assert not emit_fa3_bwd.dq_ws(one_wg) and emit_fa3_bwd.dq_ws(dataclasses.replace(one_wg, extra=asked))
    for off in (dict(dq="separate"), dict(deterministic=True)):  # the deterministic mode has no accumulator to hand
        assert not emit_fa3_bwd.dq_ws(dataclasses.replace(spec, extra=asked, **off)), off
    with pytest.raises(ValueError, match="dq_ws must be True, False or 'auto'"):
        emit_fa3_bwd.validate_spec(_spec("causal", 128, extra={"dq_ws": 1}))


@pytest.mark.parametrize("stem, D, tiles, extra", [("document", 128, None, {"ws_loads": False}),
                                                   ("alibi", 128, None, {"ws_loads": False}),
                                                   ("causal", 64, (64, 64), {})])
def test_dq_ws_slabs_asked_is_never_silently_ignored(stem, D, tiles, extra):
    """dq_ws_slabs sizes dq_ws's slabs: asked where dq_ws's "auto" would be off (block lists or a held gradient
    without ws_loads, one consumer warpgroup), it turns dq_ws on (as ws_loads True does) and the kernel built has
    that many slabs; beside dq_ws False or a knob dq_ws cannot run with, one line refuses it by name. It had built
    the vector reductions' kernel, the knob silently doing nothing."""
    from falower.backends.numba_cuda import emit_fa3_bwd as e

    def spec(more):
        sp = _spec(stem, D, extra={"dq_ws": "auto", **extra, **more})
        return sp if tiles is None else dataclasses.replace(sp, block_q=tiles[0], block_k=tiles[1],
                                                            num_warps=tiles[1] // 16)

    assert not e.dq_ws(spec({}))  # "auto" keeps the vector reductions here
    one = spec({"dq_ws_slabs": 1})
    assert e.dq_ws(one) and e.dq_ws_slabs(one) == 1
    src = e.emit_fa3_backward(one)
    assert e.knobs_in(src)["dq_ws"] and "dqs ^= 1" not in src
    assert e.smem_bytes(spec({"dq_ws_slabs": 2})) - e.smem_bytes(one) == (D // e._col_splits(one)) * 64 * 4 * (
        one.block_k // 64)
    for bad in ({"dq_ws": False}, {"dq_bulk": True}, {"dq_late": True}, {"dq_split": "k"}):
        with pytest.raises(ValueError, match="dq_ws_slabs sizes dq_ws's slabs: not with dq_ws False"):
            e.validate_spec(spec({"dq_ws_slabs": 1, **bad}))


def test_dq_ws_ptx(tmp_path, monkeypatch):
    """One PTX build (sm_90a, no GPU) of the causal D = 128 kernel with dq_ws (its default): 384 threads (.maxntid),
    the producer down to 24 registers and the consumers up to 240, one bulk reduction (the producer's), no vector
    reduction, named barriers only (no bar.sync 0); PTX the driver compiles as a whole program (a linker's
    relocatable compile would ignore setmaxnreg, C7504, and serialize the wgmmas at 168 registers)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("PTX checks need the real CUDA target")
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from falower.backends.numba_cuda.runtime import FA2BackwardKernel, whole_program_ptx

    ptx = FA2BackwardKernel(_spec("causal", 128, extra={"dq_ws": "auto"})).ptx((9, 0))
    assert ".maxntid 384" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32 24;" in ptx and "setmaxnreg.inc.sync.aligned.u32 240;" in ptx
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 1
    assert "red.global.add" not in ptx
    assert not re.search(r"bar(rier)?\.sync(\.aligned)? 0;", ptx)
    # the driver compiles it as a whole program (a linker's relocatable compile ignores setmaxnreg, C7504)
    assert whole_program_ptx([ptx])


def test_ws_loads_source(tmp_path, monkeypatch):
    """spec.extra ws_loads (with dq_ws): the mbarriers initialised by thread 0 before a barrier of all 384 threads
    and before the producer branch; at each tile's top the consumers wait for their tile's buffer (after the first)
    and fence before their barrier, then name the next tile and arrive on LD_REQ, with no cp.async of their own in
    the loop and no statistics kept in registers; the loader warps (producer warps 2 and 3) copy Q and dO into the
    buffer and arrive twice (copies, rows); a walk of no tile still ends the loaders. Refused with dq_ws False and
    with the knobs dq_ws cannot take; asked for with dq_ws "auto" it turns dq_ws on, at tiles where "auto" alone
    would not (one consumer warpgroup)."""
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))
    from falower.backends.numba_cuda import emit_fa3_bwd

    spec = _spec("causal", 128, extra={"dq_ws": True, "ws_loads": True})
    src = emit_fa3_bwd.emit_fa3_backward(spec)
    order = ["mbar_init(sb + ", "bar_sync(0, 384)", "if tid >= 256:", "ltid = tid - 320", "bar_sync(LD_REQ, 320)",
             "cp_async_mbar_arrive_noinc(", "mbar_arrive(sb + ", "SETMAXNREG_INC()"]
    at = [src.index(x) for x in order]
    assert at == sorted(at), list(zip(order, at))
    loop = src[src.index("    while qc <= p_last:"):src.index("    if tn == 0:")]
    order = ["if tn > 0:", "mbar_wait(sb + ", "fence_proxy_async()", "bar_sync(1, 256)", "smem_w[((sbr + ",
             "bar_arrive(LD_REQ, 320)", "WG_S(sacc"]
    at = [loop.index(x) for x in order]
    assert at == sorted(at), list(zip(order, at))
    assert "cp_async16" not in loop and "copy_rows_" not in loop and "nl = lse[" not in loop
    assert "tn += 1" in loop
    end = src[src.index("    if tn == 0:"):]
    assert end.index("= 0") < end.index("bar_arrive(LD_REQ, 320)")
    plain = emit_fa3_bwd.emit_fa3_backward(_spec("causal", 128, extra={"dq_ws": True, "ws_loads": False}))
    assert "LD_REQ" not in plain and "mbar_" not in plain.replace("import", "").split("@kernel_jit")[-1]
    with pytest.raises(ValueError, match="ws_loads takes two warps"):  # (_spec's dq_ws False)
        emit_fa3_bwd.validate_spec(_spec("causal", 128, extra={"ws_loads": True}))
    with pytest.raises(ValueError, match="ws_loads must be True, False or 'auto'"):
        emit_fa3_bwd.validate_spec(_spec("causal", 128, extra={"dq_ws": True, "ws_loads": 1}))
    for bad in ({"dq_split": "k"}, {"dq_bulk": True}, {"dq_late": True}, {"bwd_persistent": 2}):
        with pytest.raises(ValueError, match="ws_loads takes two warps"):
            emit_fa3_bwd.validate_spec(_spec("causal", 64, extra={"dq_ws": "auto", "ws_loads": True, **bad}))
    for stem in ("document", "alibi"):  # one consumer warpgroup: "auto" leaves dq_ws off, ws_loads turns it on
        one_wg = dataclasses.replace(_spec(stem, 128, extra={"dq_ws": "auto"}), block_k=64, num_warps=4)
        assert not emit_fa3_bwd.dq_ws(one_wg), stem
        asked = dataclasses.replace(one_wg, extra={**one_wg.extra, "ws_loads": True})
        assert emit_fa3_bwd.dq_ws(asked) and emit_fa3_bwd.ws_loads(asked), stem


def test_ws_loads_by_default():
    """ws_loads "auto" (its default): on wherever dq_ws runs at the tiles it was measured on (two consumer
    warpgroups over 64-row q tiles): plain and causal at D = 64 and 128, the document and ALiBi (which then take
    dq_ws); off with dq_ws False, at block_k = 64 or block_q = 128 unless asked for."""
    from falower.backends.numba_cuda import emit_fa3_bwd

    for stem, D in (("plain", 64), ("plain", 128), ("causal", 64), ("causal", 128), ("document", 128), ("alibi", 64)):
        spec = _spec(stem, D, extra={"dq_ws": "auto"})
        assert emit_fa3_bwd.ws_loads(spec), (stem, D)
        assert "bar_arrive(LD_REQ" in emit_fa3_bwd.emit_fa3_backward(spec), (stem, D)
    assert not emit_fa3_bwd.ws_loads(_spec("causal", 128))  # _spec's dq_ws False
    spec = _spec("causal", 64, extra={"dq_ws": True})
    for shape in (dict(block_k=64, num_warps=4), dict(block_q=128)):
        other = dataclasses.replace(spec, **shape)
        assert not emit_fa3_bwd.ws_loads(other), shape
        assert emit_fa3_bwd.ws_loads(dataclasses.replace(other, extra={**spec.extra, "ws_loads": True})), shape


@pytest.mark.parametrize("where", ["dq", "top"])
def test_sdp_ahead_source(where):
    """spec.extra sdp_ahead (off by default): the first tile's S^T and dP^T issued once before the loop, after a
    barrier of the consumers; in the loop none at the top, and the next tile's issued at the tile's end (every
    tile, the last one's too, so that ptxas sees one group in flight on every path into the loop's top): "dq"
    after dQ's GEMM is committed, with a wait_group 1 for dQ after it, "top" after dQ's wait (0) and hand-off;
    under ws_loads the next buffer's mbarrier waited (only where a next tile exists) before that issue and not at
    the loop's top; the last issue waited for after the loop. Refused with the knobs that move the same GEMMs."""
    from falower.backends.numba_cuda import emit_fa3_bwd

    assert emit_fa3_bwd.sdp_ahead(_spec("causal", 128)) == ""
    spec = _spec("causal", 128, extra={"dq_ws": True, "ws_loads": True, "sdp_ahead": where})
    emit_fa3_bwd.validate_spec(spec)
    src = emit_fa3_bwd.emit_fa3_backward(spec)
    loop_at = src.index("    while qc <= p_last:")
    pre, loop = src[:loop_at], src[loop_at:src.index("    if tn == 0:")]
    assert pre.count("WG_S(sacc") == 8 and pre.count("WG_S(pacc") == 8
    assert pre.rindex("bar_sync(1, 256)") < pre.index("WG_S(sacc")
    top = loop[:loop.index("WAIT_S(sacc, 0)")]
    assert "WG_S(" not in top and "if tn > 0:" not in top and "mbar_wait(" not in top
    end = loop[loop.index("WG_Q(dqa"):]
    assert end.count("WG_S(sacc") == 8 and end.count("WG_S(pacc") == 8
    first_s = end.index("WG_S(sacc")
    assert end.index("mbar_wait(sb + ") < first_s
    assert re.search(r"if qn <= p_last:  # sdp_ahead.*\n"
                     r"\s+mbar_wait\(sb \+ \d+ \+ \(buf \^ 1\) \* 8, \(tn >> 1\) & 1\)", end)
    assert "if qn <= p_last:  # sdp_ahead: the next tile's S^T" not in end  # the issue itself is unconditional
    if where == "dq":
        assert first_s < end.index("WAIT_QA(dqa, 0)") < end.index("bar_sync(DQ_FREE")
        assert "WAIT_Q(dqa, 0)" not in end
    else:
        assert end.index("WAIT_Q(dqa, 0)") < end.index("bar_arrive(DQ_FULL") < first_s < end.index("tn += 1")
    after = src[src.index("    if tn == 0:"):]
    assert after.index("WAIT_S(sacc, 0)") < after.index("WAIT_D(dvacc, 0)")
    own = emit_fa3_bwd.emit_fa3_backward(_spec("causal", 64, extra={"dq_ws": True, "ws_loads": False,
                                                                     "sdp_ahead": where}))
    assert "mbar_wait" not in own.split("@kernel_jit")[-1] and own.count("# sdp_ahead: the next tile's S^T") == 1
    for bad in ({"p_under_dp": True}, {"dk_after_dq": True}, {"dq_late": True}, {"dq_bulk": True},
                {"bwd_persistent": 2, "dkdv_bulk": True}):
        with pytest.raises(ValueError, match=f"sdp_ahead .* not with {next(iter(bad))}"):
            emit_fa3_bwd.validate_spec(_spec("causal", 64, extra={"sdp_ahead": where, **bad}))
    for value in (True, "yes", 1):
        with pytest.raises(ValueError, match="sdp_ahead must be False, 'dq' or 'top'"):
            emit_fa3_bwd.validate_spec(_spec("causal", 64, extra={"sdp_ahead": value}))


def test_sdp_ahead_ptx(tmp_path, monkeypatch):
    """sdp_ahead "top" at D = 64 and 128 on the default kernel (dq_ws, ws_loads), compiled whole by ptxas when one
    is on this machine: no wgmma serialized (a conditional issue made ptxas serialize every one, C7515) and 32 S^T /
    dP^T wgmmas (two issues of 16) where the default has 16."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("PTX checks need the real CUDA target")
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))

    from falower.backends.numba_cuda.runtime import FA2BackwardKernel

    for D in (64, 128):
        ptx = FA2BackwardKernel(_spec("plain", D, extra={"dq_ws": "auto", "sdp_ahead": "top"})).ptx((9, 0))
        # (the default without dq_alternate, which steps aside for sdp_ahead: its dQ GEMM is m64n64 at D = 64 too)
        base = FA2BackwardKernel(_spec("plain", D, extra={"dq_ws": "auto", "dq_alternate": False})).ptx((9, 0))
        n = lambda p: p.count("wgmma.mma_async.sync.aligned.m64n64k16.f32")  # noqa: E731 (S^T, dP^T: n = block_q)
        assert n(ptx) - n(base) == 2 * D // 16, (D, n(ptx), n(base))
        log = _ptxas_log(ptx, tmp_path / f"k{D}.ptx", version="8.0")
        if log is None:  # no ptxas on this machine
            continue
        assert "C7515" not in log and "serialized" not in log, log[-2000:]


@pytest.mark.parametrize("extra", [{}, {"kv_major": False}, {"bwd_persistent": 132},
                                   {"bwd_persistent": 132, "kv_major": False}])
def test_knobs_in_reads_kv_major_in_a_persistent_walk(extra):
    """knobs_in's kv_major is the order the kernel takes (kv_major(spec)), also where a persistent kernel's walk
    decodes its items (`kj = it_x`), not only the grid's x (it read False there before)."""
    from falower.backends.numba_cuda import emit_fa3_bwd as e

    sp = _spec("plain", 128, extra=extra)
    assert e.knobs_in(e.emit_fa3_backward(sp))["kv_major"] == e.kv_major(sp) == ("kv_major" not in extra)


def test_bwd_pingpong_source():
    """spec.extra bwd_pingpong (off by default; knobs_in reads it): dq_split "k" with dq_ws and ws_loads (64 x D
    slabs, one a warpgroup at D = 128, where two do not fit; both warpgroups' slabs added at the tile's start); in the
    loop no barrier of all consumers, each warpgroup's own at the top and before dQ's GEMM, its S^T / dP^T issued
    between a wait on its turn and an arrival on the other's (warpgroup 1 arriving once before the loop, warpgroup 0
    waiting once after it); dQ at D = 128 in two column halves of 64 (K's second 64-column block), one slab hand-off;
    dK / dV not staged in the tile (dkdv_in_tile refused; its "auto" then row copies or TMA). Refused: other
    tiles, dq_split 'n', sdp_ahead, dk_after_dq, dq_ws / ws_loads False, dkdv_in_tile, a value not a bool."""
    from falower.backends.numba_cuda import emit_fa3_bwd as e

    assert not e.bwd_pingpong(_spec("plain", 64, extra={"dq_ws": "auto"}))
    assert not e.knobs_in(e.emit_fa3_backward(_spec("plain", 64, extra={"dq_ws": "auto"})))["bwd_pingpong"]
    for D in (64, 128):
        for stem in ("plain", "causal"):
            sp = _spec(stem, D, extra={"dq_ws": "auto", "bwd_pingpong": True})
            e.validate_spec(sp)
            assert e.dq_split(sp) == "k" and e.dq_ws(sp) and e.ws_loads(sp) and not e.dkdv_in_tile(sp)
            assert e.dq_ws_slabs(sp) == (2 if D == 64 else 1) and e.smem_bytes(sp) <= e.SMEM_MAX
            src = e.emit_fa3_backward(sp)
            assert e.knobs_in(src)["bwd_pingpong"] and e.knobs_in(src)["dq_ws"] and e.knobs_in(src)["ws_loads"]
            pre, rest = src.split("\n    while qc ", 1)
            loop, after = rest.split("\n    if wg == 0:\n        bar_sync(PP_TURN, 256)", 1)
            assert re.search(r"bar_sync\(1, 256\)[^\n]*\n.*\n    if wg == 1:\n        bar_arrive\(PP_TURN, 256\)", pre)
            assert "bar_sync(1, " not in loop and "syncthreads" not in loop
            assert loop.count("bar_sync(PP_WG + wg, 128)") == 2
            at = [loop.index(x) for x in ("mbar_wait(", "bar_sync(PP_WG + wg, 128)", "bar_arrive(LD_REQ",
                                          "bar_sync(PP_TURN + wg, 256)", "WG_S(sacc", "WG_S(pacc", "wgmma_commit()",
                                          "bar_arrive(PP_TURN + (wg ^ 1), 256)", "WAIT_S(sacc")]
            assert at == sorted(at), at
            assert loop.index("store_dst_wg(") < loop.rindex("bar_sync(PP_WG + wg, 128)") < loop.index("WG_Q(")
            # dQ: this warpgroup's own dS^T rows and K rows, every column; the producer adds at the tile's start
            assert "ds_wg = sb + " + str(e._layout(sp)["DS"]) + " + wg * 8192" in src and "kt_wg = sb + 0 + wg * 8192" in src
            assert re.search(r"bulk_reduce_add_f32\(elem_addr\(dq32, \(\(pw_tile - 1\) \* \d+,\)\)", src)
            wgq = re.findall(r"WG_Q\(dqa, 0, desc_at\(HI_KV, w_ds \+ (\d+)\), desc_at\(HI_KV, w_kt \+ (\d+)\)", loop)
            if D == 64:
                assert wgq == [(str(128 * k), str(128 * k)) for k in range(4)] and 'wgmma_ss("f16", 64, 1, 1)' in src
            else:  # two halves: K's second 64-column block 128 x 128 bytes on (>> 4: 1024)
                assert wgq == [(str(128 * k), str(128 * k + 1024 * h)) for h in range(2) for k in range(4)], wgq
                assert 'WG_Q = wgmma_ss("f16", 64, 1, 1)' in src and loop.count("WAIT_Q(dqa, 0)") == 2
                assert loop.count("bar_sync(DQ_FREE") == 1 and loop.count("bar_arrive(DQ_FULL") == 1
                stores = re.findall(r"sts_v4_f32\(dqw_t \+ (\d+), lget\(dqa, ofs_(\d+)\)", loop)
                assert stores == [(str(2048 * (8 * h + j)), str(4 * j)) for h in range(2) for j in range(8)], stores
    sp = _spec("causal", 128, extra={"dq_ws": "auto", "bwd_pingpong": True})
    for bad, why in (({"dq_split": "n"}, "dq_split 'n'"), ({"sdp_ahead": "top"}, "sdp_ahead"),
                     ({"dk_after_dq": True}, "dk_after_dq"), ({"dq_ws": False}, "needs dq_ws and ws_loads"),
                     ({"ws_loads": False}, "needs dq_ws and ws_loads"), ({"dkdv_in_tile": True}, "bwd_pingpong"),
                     ({"bwd_persistent": 4}, "needs dq_ws and ws_loads")):
        with pytest.raises(ValueError, match=re.escape(why)):
            e.validate_spec(dataclasses.replace(sp, extra={**sp.extra, **bad}))
    sp64 = _spec("causal", 64, extra={"dq_ws": "auto", "bwd_pingpong": True})
    for tiles in (dict(block_q=128), dict(block_k=64, num_warps=4)):
        with pytest.raises(ValueError, match="block_q 64 and block_k 128 only"):
            e.validate_spec(dataclasses.replace(sp64, **tiles))
    with pytest.raises(ValueError, match="bwd_pingpong must be True or False"):
        e.validate_spec(dataclasses.replace(sp, extra={**sp.extra, "bwd_pingpong": 1}))
    built, reason = e.resolve(dataclasses.replace(sp, extra={**sp.extra, "sdp_ahead": "top"}))
    assert "bwd_pingpong" in reason and not e.uses_wgmma(built)


def test_bwd_pingpong_ptx(tmp_path, monkeypatch):
    """bwd_pingpong at D = 64 and 128 (plain, causal), compiled whole by ptxas when one is on this machine: no wgmma
    serialized (dQ's 64 x 128 f32 in one product made ptxas serialize every one at D = 128, C7512), and its wgmma
    counts: dQ m64n64 over the warpgroup's 64 kv rows (4 k steps; 2 halves at D = 128) where the default has
    m64n{D / 2} over 128 (8 k steps)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("PTX checks need the real CUDA target")
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))

    from falower.backends.numba_cuda.runtime import FA2BackwardKernel

    for stem, D in (("plain", 64), ("plain", 128), ("causal", 128)):
        ptx = FA2BackwardKernel(_spec(stem, D, extra={"dq_ws": "auto", "bwd_pingpong": True})).ptx((9, 0))
        counts = {n: ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16") for n in (32, 64, 128)}
        assert counts == ({32: 0, 64: 20, 128: 0} if D == 64 else {32: 0, 64: 24, 128: 8}), counts
        log = _ptxas_log(ptx, tmp_path / f"k{D}.ptx")  # (8.3: the TMA stores')
        if log is None:  # no ptxas on this machine
            continue
        assert "serialized" not in log, log[-2000:]


def test_dq_alternate_source():
    """spec.extra dq_alternate (the default at D = 64 only; knobs_in reads it): 64 x 128 tiles with dq_ws and ws_loads, one 64 x D
    slab a warpgroup (the default's shared memory); a barrier of all consumers before the loop and in it only dS^T's
    (none at its top); each tile's dQ warpgroup (wg == tn & 1) waits on DS_FREE (after the first tile) before its
    dS^T stores, issues dQ over both warpgroups' 128 kv rows and every column (two halves of 64 at D = 128), arrives
    on DS_FREE once dQ is waited for and hands the whole fragment to its slab; the other waits for its own GEMMs
    (dk_after_dq steps aside: dV and dK before dS^T's barrier on both); after the loop the next
    warpgroup in turn takes the last DS_FREE arrival; the producer adds each slab as the whole tile."""
    from falower.backends.numba_cuda import emit_fa3_bwd as e

    for D in (64, 128):
        default = _spec("causal", D, extra={"dq_ws": "auto"})  # (on at D = 64 by its "auto")
        assert e.dq_alternate(default) is (D == 64)
        assert e.knobs_in(e.emit_fa3_backward(default))["dq_alternate"] is (D == 64)
        for stem in ("plain", "causal"):
            sp = _spec(stem, D, extra={"dq_ws": "auto", "dq_alternate": True})
            e.validate_spec(sp)
            assert e.dq_split(sp) == "n" and e.dq_ws(sp) and e.ws_loads(sp) and e._col_splits(sp) == 1
            assert e.dq_ws_slabs(sp) == 1 and e._dq_ws_slab_bytes(sp) == 64 * D * 4
            assert e.smem_bytes(sp) == e.smem_bytes(_spec(stem, D, extra={"dq_ws": "auto"})) <= e.SMEM_MAX
            assert not e.dk_after_dq(sp) and not e.dkdv_in_tile(sp)
            src = e.emit_fa3_backward(sp)
            assert e.knobs_in(src)["dq_alternate"] and not e.knobs_in(src)["bwd_pingpong"]
            pre, rest = src.split("\n    while qc ", 1)
            loop, after = rest.split("\n    if tn > 0 and wg == (tn & 1):\n        bar_sync(DS_FREE, 256)", 1)
            assert pre.rstrip().splitlines()[-2].startswith("    bar_sync(1, 256)  # dq_alternate")
            assert loop.count("bar_sync(1, ") == 1 and "syncthreads" not in loop  # dS^T's barrier only
            top, dq_part = loop.split("\n        if dqwg:\n", 1)
            dq_branch, other = dq_part.split("\n        else:\n", 1)
            at = [top.index(x) for x in ("mbar_wait(", "dqwg = wg == (tn & 1)", "bar_arrive(LD_REQ", "WG_S(sacc",
                                         "WAIT_S(pacc", "if dqwg and tn > 0:\n            bar_sync(DS_FREE, 256)",
                                         "FENCE_D(dvacc", "store_dst_wg(", "cp_async_wait0()  # the next tile",
                                         "fence_proxy_async()  # they and dS^T", "bar_sync(1, 256)")]
            assert at == sorted(at), at
            assert "WG_Q(" not in top and top.count("WG_D(dkacc") == 4
            halves = D // 64
            wgq = re.findall(r"WG_Q\(dqa, 0, desc_at\(HI_KV, w_ds \+ (\d+)\), desc_at\(HI_KV, w_kt \+ (\d+)\)",
                             dq_branch)
            assert wgq == [(str(128 * k), str(128 * k + 1024 * h)) for h in range(halves) for k in range(8)], wgq
            assert 'WG_Q = wgmma_ss("f16", 64, 1, 1)' in src
            b = dq_branch
            assert b.index("WG_Q(") < b.index("WAIT_Q") and "bar_sync(" not in b.split("WG_Q(", 1)[0], b
            assert (b.rindex("WG_Q(") < b.rindex("WAIT_Q") < b.index("bar_arrive(DS_FREE, 256)")
                    < b.rindex("sts_v4_f32("))
            assert b.index("bar_sync(DQ_FREE") < b.index("sts_v4_f32(") and b.rindex("sts_v4_f32(") < b.index(
                "bar_arrive(DQ_FULL")
            stores = re.findall(r"sts_v4_f32\(dqw_t \+ (\d+), lget\(dqa, ofs_(\d+)\)", dq_branch)
            assert stores == [(str(2048 * (8 * h + j)), str(4 * j)) for h in range(halves) for j in range(8)], stores
            assert dq_branch.count("bar_sync(DQ_FREE") == 1 and dq_branch.count("bar_arrive(DQ_FULL") == 1
            other = other.split("\n        tn += 1", 1)[0]
            assert "WG_Q(" not in other and "DQ_FULL" not in other and "DS_FREE" not in other and "bar_" not in other
            assert "WAIT_D(dvacc, 0)" in other
            assert "WG_D(" not in dq_branch + other and "WAIT_Q1" not in src
            # the producer adds each slab as the tile's whole 64 x D, no warpgroup offset
            assert f"bulk_reduce_add_f32(elem_addr(dq32, ((pw_tile - 1) * {64 * D},)), pw_slab + ps * {64 * D * 4}, " \
                   f"{64 * D * 4})" in src
            # one named barrier after LD_REQ (DQ_FULL / DQ_FREE's 2 x 2 NS after the block's 1)
            assert re.findall(r"DS_(?:FULL|FREE) = (\d+)", src) == [str(3 + 4 * e.dq_ws_slabs(sp))]
            assert "bar_sync(DS_FREE" not in after and after.count("bar_arrive(DQ_FULL") == 1  # the 0 word


@pytest.mark.parametrize("bad, why", [
    ({"bwd_pingpong": True}, "not with bwd_pingpong"), ({"sdp_ahead": "top"}, "not with sdp_ahead"),
    ({"dq_bulk": True}, "not with dq_bulk"), ({"dq_late": True}, "not with dq_late"),
    ({"dkdv_in_tile": True}, "not with dkdv_in_tile"), ({"bwd_persistent": 4}, "not with bwd_persistent"),
    ({"dq_split": "k"}, "not with dq_split 'k'"), ({"dq_ws": False}, "needs dq_ws and ws_loads"),
    ({"ws_loads": False}, "needs dq_ws and ws_loads"), ({"block_q": 128}, "block_q 64 and block_k 128 only"),
    ({"block_k": 64, "num_warps": 4}, "block_q 64 and block_k 128 only"),
    ({"dk_after_dq": True}, "not with dk_after_dq")])
def test_dq_alternate_refuses(bad, why):
    """dq_alternate's refusals, each by one line naming why (resolve then builds mma.sync): other tiles, the knobs with
    their own dQ or barriers, dq_split 'k', a persistent kernel, dq_ws or ws_loads off; a value not a bool."""
    from falower.backends.numba_cuda import emit_fa3_bwd as e

    tiles = {k: v for k, v in bad.items() if k in ("block_q", "block_k", "num_warps")}
    for D in (64,) if "block_q" in tiles else (64, 128):  # (128 x 128 at D = 128: refused by its registers first)
        sp = _spec("causal", D, extra={"dq_ws": "auto", "dq_alternate": True})
        extra = {k: v for k, v in bad.items() if k not in tiles}
        wrong = dataclasses.replace(sp, extra={**sp.extra, **extra}, **tiles)
        with pytest.raises(ValueError, match=r"^wgmma backward: dq_alternate .*" + re.escape(why)):
            e.validate_spec(wrong)
        built, reason = e.resolve(wrong)
        assert "dq_alternate" in reason and not e.uses_wgmma(built)
    with pytest.raises(ValueError, match="dq_alternate must be True, False or 'auto'"):
        e.validate_spec(_spec("causal", 64, extra={"dq_ws": "auto", "dq_alternate": 1}))


def test_dq_alternate_ptx(tmp_path, monkeypatch):
    """dq_alternate at D = 64 (plain) and 128 (causal; dk_after_dq's "auto" steps aside), compiled whole by ptxas when
    one is on this machine: no wgmma serialized, and its wgmma counts: dQ m64n64 over all 128 kv rows (8 k steps; two
    column halves at D = 128) where the default has m64n{D / 2}."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("PTX checks need the real CUDA target")
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))

    from falower.backends.numba_cuda.runtime import FA2BackwardKernel

    for stem, D in (("plain", 64), ("causal", 128)):
        ptx = FA2BackwardKernel(_spec(stem, D, extra={"dq_ws": "auto", "dq_alternate": True})).ptx((9, 0))
        counts = {n: ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16") for n in (32, 64, 128)}
        assert counts == ({32: 0, 64: 24, 128: 0} if D == 64 else {32: 0, 64: 32, 128: 8}), counts
        log = _ptxas_log(ptx, tmp_path / f"k{D}.ptx")
        if log is None:  # no ptxas on this machine
            continue
        assert "serialized" not in log, log[-2000:]
