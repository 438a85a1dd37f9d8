"""The warp-specialized wgmma forward (emit_fa3_ws.py, extra={"schedule": "wgmma-ws"}) on an sm_90 GPU (marked gpu):
plain and causal, D = 64 and 128, N = 1000 (ragged) and 4096, f16 and bf16, 2 and 3 stages, within FlashAttention's
error rule against float64 (tests/gpu/test_examples_gpu.py's `assert_error_rule`), through falower.compile with
128 x 128 tiles; the producer warp (288 threads, 168 registers), a producer warpgroup with setmaxnreg (384, its PTX
compiled whole-program by the driver) and no producer (extra producer "none", 256),
persistent or not (extra persistent), with half tiles or not (extra half_tiles); three consumer warpgroups (192-row
q tiles at D = 64); the relative bias's row pairs.

Run: python -m pytest -q -n 12 --dist load -m gpu tests/gpu/test_wgmma_ws_gpu.py (pyproject.toml's `--dist loadfile`
would send the whole file to one worker)"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import falower as fl  # noqa: E402
from falower.backends.numba_cuda import emit_fa3_ws  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_examples_gpu import assert_error_rule, graph, rounded  # noqa: E402

PIPELINE = "decompose-softmax,canonicalize,fuse,tile{{bq={bq},bk={bk}}},online-softmax{{exp2=true}},mask-tiles," \
           "canonicalize"
_COMPILED: dict = {}


def _hopper() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


def _compiled(causal: bool, dtype: str, bk: int, extra: dict, bq: int = 128):
    key = (causal, dtype, bq, bk, tuple(sorted(extra.items())))
    if key not in _COMPILED:
        g = fl.attention(mask_mod=(lambda b, h, q, kv: q >= kv) if causal else None, name="ws", dtype=dtype,
                         group_size=2)
        _COMPILED[key] = (g, fl.compile(g, pipeline=PIPELINE.format(bq=bq, bk=bk),
                                        extra={"schedule": "wgmma-ws", **extra}))
    return _COMPILED[key]


@pytest.mark.parametrize("N", [1000, 4096])
@pytest.mark.parametrize("causal, dtype, D, bk, extra", [
    (False, "f16", 128, 128, {}),
    (True, "f16", 128, 128, {}),
    (False, "bf16", 128, 128, {"stages": 3}),
    (True, "f16", 64, 128, {}),
    (False, "f16", 64, 64, {"stages": 3}),
    # no producer: 256 threads, warpgroup 0 loads K, warpgroup 1 V (3 stages by default)
    (False, "f16", 128, 128, {"producer": "none"}),
    (True, "f16", 128, 128, {"producer": "none"}),
    (True, "bf16", 64, 128, {"producer": "none", "stages": 2}),
    # persistent: 5 / 3 blocks walk the 64 (q tile, head, batch) items, the ring carried across items
    (True, "f16", 128, 128, {"producer": "none", "persistent": 5}),
    (False, "bf16", 64, 128, {"producer": "none", "persistent": 3, "stages": 2}),
    # half tiles (extra half_tiles, off by default): S as m64n64 halves and P V by the kept half, or P V only
    (True, "f16", 128, 128, {"producer": "none", "half_tiles": True}),
    (True, "bf16", 128, 128, {"producer": "none", "half_tiles": "pv"}),
    (True, "f16", 64, 128, {"producer": "none", "half_tiles": True}),
    # a producer warpgroup (40 registers) and consumers at 232 by setmaxnreg: the PTX goes to the driver, which
    # compiles it whole-program (runtime.whole_program_ptx; a linker's relocatable compile ignores setmaxnreg)
    (False, "f16", 128, 128, {"producer": "warpgroup"}),
    (True, "f16", 128, 128, {"producer": "warpgroup", "stages": 3}),
    (True, "bf16", 64, 128, {"producer": "warpgroup"}),
    # persistent with the producer warpgroup: the ring across items, each item's Q after the last one's last S;
    # O staged through a buffer of its own where it fits (2 stages), or stored from the fragments (False, 3 stages)
    (True, "f16", 128, 128, {"producer": "warpgroup", "producer_regs": 56, "persistent": 5, "staged_epilogue": False}),
    (False, "bf16", 64, 128, {"producer": "warpgroup", "persistent": 3}),
    # ... its default registers (120 / 192) and the launch's items heaviest first (item_order "cost")
    (True, "bf16", 128, 128, {"producer": "warpgroup", "persistent": 7, "item_order": "cost"}),
    # ... the items from a global counter (item_order "dynamic"; repeated calls and streams below)
    (True, "f16", 128, 128, {"producer": "warpgroup", "persistent": 11, "item_order": "dynamic"}),
    (False, "bf16", 64, 128, {"producer": "warpgroup", "persistent": 132, "item_order": "dynamic"}),
    # ... Q, K and V by TMA loads from one producer thread (tma_loads, the default under two Q buffers): GQA's kv
    # head and N = 1000's last tile (rows past N zeros) by the maps; and by the producer threads' 16-byte copies
    (True, "bf16", 128, 128, {"producer": "warpgroup", "persistent": 132, "item_order": "dynamic", "tma_loads": True}),
    (False, "f16", 128, 128, {"producer": "warpgroup", "persistent": 132, "item_order": "dynamic",
                              "tma_loads": False}),
    # ... each item's kv tiles from the last down (kv_reverse): causal's diagonal tile first; N = 1000's ragged tile
    (True, "f16", 128, 128, {"producer": "warpgroup", "persistent": 132, "item_order": "dynamic", "kv_reverse": True}),
    (False, "bf16", 128, 128, {"producer": "warpgroup", "persistent": 132, "item_order": "dynamic",
                               "kv_reverse": True}),
    # ... the last tile second (kv_reverse "second"): kv_last - 1, causal's diagonal, then down
    (True, "bf16", 128, 128, {"producer": "warpgroup", "persistent": 132, "item_order": "dynamic",
                              "kv_reverse": "second"}),
    # ... the kept epilogue's rows of O staged a word at a time, not by stmatrix (stmatrix_staging, on by default)
    (True, "f16", 128, 128, {"producer": "warpgroup", "persistent": 132, "item_order": "dynamic", "stmatrix": False}),
])
def test_ws_forward_error_rule(causal: bool, dtype: str, D: int, bk: int, extra: dict, N: int) -> None:
    _hopper()
    from falower.passes.check import bind_dims, random_inputs

    g, c = _compiled(causal, dtype, bk, extra)
    kern = c.specialize(dtype, D=D)
    assert kern.spec.extra["schedule"] == "wgmma-ws" and "mbar_wait" in kern.source
    assert ("row_hull(" in kern.source) == bool(extra.get("half_tiles"))  # the path under test
    assert emit_fa3_ws.kv_reverse(kern.spec) == bool(extra.get("kv_reverse"))
    assert emit_fa3_ws.stmatrix_staging(kern.spec) == ("stage_rows_stsm(" in kern.source)
    if extra.get("stmatrix") is False:
        assert emit_fa3_ws.tma_store(kern.spec) and "stage_rows_stsm(" not in kern.source
    B, H = (2, 4) if N <= 1000 else (1, 2)
    env = bind_dims(g, {"B": B, "H": H, "HKV": H // 2, "M": N, "N": N, "D": D})
    host = [rounded(x, dtype) for x in random_inputs(g, env, seed=N + D)]
    assert_error_rule(g, c, env, host, dtype)
    if extra.get("producer") == "warpgroup":  # the route under test: PTX loaded by the driver, not a linked cubin
        image = kern._direct_kernel("main").image(torch.cuda.get_device_capability())
        consumer_regs = emit_fa3_ws.registers(kern.spec)[1]  # 232, or what producer_regs leaves them
        assert image.cubin.endswith(b"\0")
        assert f"setmaxnreg.inc.sync.aligned.u32 {consumer_regs}".encode() in image.cubin


@pytest.mark.parametrize("N", [1, 193, 1000, 4096])
@pytest.mark.parametrize("causal, dtype, bk, extra", [
    (False, "f16", 128, {}),
    (True, "f16", 128, {}),
    (True, "bf16", 64, {"kv_reverse": True}),
    (False, "bf16", 128, {"producer_regs": 56}),
    (True, "f16", 128, {"ex2_poly": 8}),  # 8 of a row's exponentials on the FMA pipe
    (False, "bf16", 128, {"ex2_poly": emit_fa3_ws.AUTO_EX2_POLY_WIDE}),  # the automatic share beside tanh.approx
])
def test_three_consumer_warpgroups(causal: bool, dtype: str, bk: int, extra: dict, N: int) -> None:
    """192-row q tiles (emit_fa3_ws.consumer_wgs 3, D = 64): three consumer warpgroups in turns under FlashAttention's
    error rule, sizes of one row, a tile plus one, ragged and whole; the kernel that ran has the rotation and the
    consumers' registers it was built for."""
    _hopper()
    from falower.passes.check import bind_dims, random_inputs

    g, c = _compiled(causal, dtype, bk, {"producer": "warpgroup", "persistent": 132, "item_order": "dynamic",
                                         **extra}, bq=192)
    kern = c.specialize(dtype, D=64)
    assert kern.spec.block_q == 192 and emit_fa3_ws.consumer_wgs(kern.spec) == 3 and "pp_next = cw + 2" in kern.source
    B, H = (2, 4) if N <= 1000 else (1, 2)
    env = bind_dims(g, {"B": B, "H": H, "HKV": H // 2, "M": N, "N": N, "D": 64})
    host = [rounded(x, dtype) for x in random_inputs(g, env, seed=N + 64)]
    assert_error_rule(g, c, env, host, dtype)
    image = kern._direct_kernel("main").image(torch.cuda.get_device_capability())
    assert f"setmaxnreg.inc.sync.aligned.u32 {emit_fa3_ws.registers(kern.spec)[1]}".encode() in image.cubin


@pytest.mark.parametrize("N", [193, 1000, 4096])
@pytest.mark.parametrize("kind", ["sorted", "unsorted", "constant"])
@pytest.mark.parametrize("dtype, bk", [("f16", 128), ("bf16", 64)])
def test_three_consumer_warpgroups_block_list(dtype: str, bk: int, kind: str, N: int) -> None:
    """The document mask (a block list from the ids) on three consumer warpgroups (192-row q tiles, D = 64): sorted
    ids with a tail of padding, unsorted ones (lists with holes) and one document (every tile kept), under
    FlashAttention's error rule; ragged, whole and a tile plus one."""
    _hopper()
    from falower.passes.check import bind_dims, random_inputs

    g, _ = graph("document", dtype)
    c = fl.compile(g, pipeline=PIPELINE.format(bq=192, bk=bk),
                   extra={"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 132, "item_order": "dynamic"})
    kern = c.specialize(dtype, D=64)
    assert kern.spec.block_mask == "list" and emit_fa3_ws.consumer_wgs(kern.spec) == 3
    env = bind_dims(g, {"B": 2, "H": 3, "M": N, "N": N, "D": 64})
    host = [rounded(x, dtype) if i < 3 else x for i, x in enumerate(random_inputs(g, env, seed=N + bk, kind=kind))]
    assert_error_rule(g, c, env, host, dtype)


@pytest.mark.parametrize("blocks", [1, 5, 132])
def test_dynamic_item_order_repeats_on_streams(blocks: int) -> None:
    """item_order "dynamic" takes items from a counter its last block zeroes: call after call, on torch's default
    stream and on a second one (its own counter), every output is bitwise the grid-order kernel's (the same
    items, the same arithmetic; only which block takes which differs), and every counter is left at zero."""
    _hopper()
    extra = {"producer": "warpgroup", "persistent": blocks}
    _, ref = _compiled(True, "f16", 128, extra)
    _, dyn = _compiled(True, "f16", 128, {**extra, "item_order": "dynamic"})
    torch.manual_seed(blocks)
    q = torch.randn(2, 4, 1100, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 2, 1100, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    want = ref.forward(q, k, v)[0]
    side = torch.cuda.Stream()
    for i in range(4):
        with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
            got = dyn.forward(q, k, v)[0]
        torch.cuda.synchronize()
        assert torch.equal(got, want), (i, (got.float() - want.float()).abs().max().item())
    kern = dyn.specialize("f16", D=128)
    assert len(kern._work) == 2  # one counter for each stream
    assert all(w.tolist() == [0, 0] for w in kern._work.values())


PERSIST_PWG = {"producer": "warpgroup", "persistent": 132, "item_order": "dynamic"}


@pytest.mark.parametrize("M, N", [(1000, 1000), (1500, 700), (300, 4096)])
@pytest.mark.parametrize("dtype, D, extra", [
    ("f16", 128, {"gather_early": False}),
    ("bf16", 128, {}),
    ("f16", 64, {}),
    ("f16", 128, {**PERSIST_PWG, "row_slice": False}),
    ("f16", 128, PERSIST_PWG),
    ("bf16", 128, PERSIST_PWG),
    ("f16", 128, {**PERSIST_PWG, "slice_rows": False}),
    ("f16", 128, {**PERSIST_PWG, "slice_pairs": True}),  # the entries by pairs from the run and its shifted copy
    ("f16", 128, {**PERSIST_PWG, "slice_ahead": True}),
    ("f16", 128, {**PERSIST_PWG, "slice_ahead": True, "kv_reverse": True}),  # the next tile's run walking down
    ("f16", 64, {**PERSIST_PWG, "bq": 192}),  # three consumer warpgroups, each its own run (D = 64's default)
    ("bf16", 64, {**PERSIST_PWG, "bq": 192, "slice_ahead": True}),
    ("f16", 64, {**PERSIST_PWG, "bq": 192, "slice_pairs": True}),
])
def test_ws_relative_bias_row_pairs(dtype: str, D: int, extra: dict, M: int, N: int) -> None:
    """The relative bias on the no-producer ws kernel and on the persistent producer one (TMA loads), a thread's
    rows g and g + 8 sharing their table loads (emit_fa2.row_gather_shift), the entries read before the waits or
    after, or from each warpgroup's run of the table in shared memory (emit_fa3_ws.row_slice); M > N puts rows'
    indices outside the table (their pairs fall back to each row's own clamped path, or read the run's clamped
    entries); the run's loads from its row kept for the item (slice_rows), a tile ahead or not, or by the clamped
    index every tile; the run's entries by 4-byte loads (the default), or by pairs from it and its copy shifted by
    one (slice_pairs)."""
    _hopper()
    import runpy

    from falower.passes.check import bind_dims, random_inputs

    root = Path(__file__).resolve().parent.parent.parent
    g = next(v for v in runpy.run_path(str(root / "examples" / "relative_bias.py")).values()
             if isinstance(v, fl.Func))
    if dtype != "f16":
        g = fl.parse_func(fl.print_func(g).replace("f16[", f"{dtype}[").replace('"f16"', f'"{dtype}"'))
    extra = dict(extra)
    bq = extra.pop("bq", 128)  # q tile rows: 192 takes three consumer warpgroups
    c = fl.compile(g, pipeline=PIPELINE.format(bq=bq, bk=128),
                   extra={"schedule": "wgmma-ws", "producer": "none", **extra})
    kern = c.specialize(dtype, D=D)
    assert kern.spec.block_q == bq
    sliced = extra.get("producer") == "warpgroup" and extra.get("row_slice", True) is not False  # its default
    early = extra.get("gather_early", True) is not False and not sliced
    assert "score_row_pair" in kern.source and ("gl = score_pair_load(" in kern.source) == early
    pairs = sliced and extra.get("slice_pairs", False) is not False
    assert ("score_pair_slice(rsl" in kern.source) == (sliced and not pairs)
    assert ("score_pair_slice2(rsl_s" in kern.source) == pairs
    # the run's loads from its row kept for the item (slice_rows, the default), or by gather_slice_fn every tile
    assert ("slice_load(sl_a, " in kern.source) == (sliced and extra.get("slice_rows", True) is not False)
    env = bind_dims(g, {"B": 2, "H": 3, "M": M, "N": N, "D": D})
    host = [rounded(x, dtype) if i < 3 else x.astype(np.float32)
            for i, x in enumerate(random_inputs(g, env, seed=M + N + D))]
    assert_error_rule(g, c, env, host, dtype)
