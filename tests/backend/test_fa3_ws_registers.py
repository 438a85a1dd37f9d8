"""Every emitted warp-specialized wgmma forward (emit_fa3_ws.py) can launch: its threads x its register cap fit the
SM's 65536 registers with warps allocated in groups of 4 (a 9-warp block is sized like 12 warps). 288 threads x 224
registers passed the plain product and failed every launch on the H100 (CUresult 701,
CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES); this reads the cap from the emitted source's decorators, so a new knob or
constant that would bring the 701 back fails here, on a CPU, without Numba compiling anything."""

from __future__ import annotations

import dataclasses
import itertools
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import make_spec  # noqa: E402

from falower.backends.numba_cuda import emit_fa3_ws  # noqa: E402


def _launchable(threads: int, regs: int) -> bool:
    """Written out here rather than taken from emit_fa3_ws: registers go to a warp in units of 256 (8 a thread),
    warps in groups of 4."""
    warps = (threads + 31) // 32
    warps = (warps + 3) // 4 * 4
    return warps * 32 * ((regs + 7) // 8 * 8) <= 65536


def _cap_of(source: str, threads: int) -> int:
    """The registers a thread ptxas may give the kernel: -maxrregcount from @max_registers, else what
    @launch_bounds(T, B) leaves (which must be the launched block size), else ptxas's 255."""
    m = re.search(r"^@max_registers\((\d+)\)", source, re.M)
    if m:
        return int(m.group(1))
    m = re.search(r"^@launch_bounds\((\d+), (\d+)\)", source, re.M)
    if m:
        t, b = int(m.group(1)), int(m.group(2))
        assert t == threads, (t, threads)
        warps = ((t + 31) // 32 + 3) // 4 * 4
        return min(255, 65536 // (warps * 32 * b) // 8 * 8)
    return 255


def test_rule():
    assert not _launchable(288, 224)  # the H100's 701
    assert _launchable(288, 168) and not _launchable(288, 176)
    assert _launchable(256, 255) and _launchable(384, 168)
    for t, r in itertools.product(range(32, 1025, 32), range(24, 256, 8)):
        assert emit_fa3_ws.registers_fit(t, r) == _launchable(t, r), (t, r)


def _specs():
    for variant, D, extra in itertools.product(
            ("plain", "causal", "bias"), (64, 128),
            [{"producer": p, "stages": s} for p in emit_fa3_ws.PRODUCERS for s in (2, 3)]):
        spec = make_spec(variant, D, "f16", path="mma", block_q=128, block_k=128, num_warps=8,
                         name=f"ws_regs_{variant}_{D}")
        spec = dataclasses.replace(spec, extra={"schedule": "wgmma-ws", **extra})
        try:
            emit_fa3_ws.validate_spec(spec)
        except ValueError:
            continue  # e.g. 3 stages past the shared memory
        yield spec


@pytest.mark.parametrize("spec", list(_specs()), ids=lambda s: f"{s.name}-{s.extra['producer']}-st{s.extra['stages']}")
def test_emitted_kernel_launchable(spec):
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    threads = emit_fa3_ws.threads_per_block(spec)
    cap = _cap_of(src, threads)
    assert _launchable(threads, cap), (threads, cap)
    assert cap == emit_fa3_ws.register_cap(spec), (cap, emit_fa3_ws.register_cap(spec))


def test_every_producer_covered():
    covered = {s.extra["producer"] for s in _specs()}
    assert covered == set(emit_fa3_ws.PRODUCERS), covered


@pytest.mark.parametrize("p, c", [(24, 240), (40, 232), (56, 224), (64, 216), (80, 208)])
def test_producer_regs_give_the_consumers_the_rest(p, c):
    """extra producer_regs = p: the consumers get the most the block's launch allocation leaves (384 threads x 168:
    128 p + 256 c <= 64512, c a multiple of 8), and the kernel says so in its setmaxnreg lines. A consumer's inc past
    what the producer's dec freed waits for ever: the H100 hung at (80, 216), sized against the SM's 65536."""
    spec = make_spec("plain", 128, "f16", path="mma", block_q=128, block_k=128, num_warps=8, name="ws_pr")
    spec = dataclasses.replace(spec, extra={"schedule": "wgmma-ws", "producer": "warpgroup", "producer_regs": p})
    assert emit_fa3_ws.registers(spec) == (p, c)
    assert 128 * p + 256 * c <= 384 * 168 < 128 * p + 256 * (c + 8)
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    assert f"setmaxnreg_dec({p})" in src and f"setmaxnreg_inc({c})" in src


@pytest.mark.parametrize("extra, what", [
    ({"regs": (80, 216)}, "allocated at launch"),
    ({"producer_regs": 200}, "producer down and the consumers up"),  # (200, 152): a dec that raises, an inc that lowers
    ({"regs": (40, 232), "producer_regs": 56}, "not both"),
])
def test_register_splits_setmaxnreg_cannot_make_are_refused(extra, what):
    spec = make_spec("plain", 128, "f16", path="mma", block_q=128, block_k=128, num_warps=8, name="ws_pr")
    spec = dataclasses.replace(spec, extra={"schedule": "wgmma-ws", "producer": "warpgroup", **extra})
    with pytest.raises(ValueError, match=what):
        emit_fa3_ws.emit_fa3_ws_forward(spec)


def _decode_spec(block_k: int, **extra):
    spec = make_spec("plain", 128, "f16", path="mma", block_q=64, block_k=block_k, num_warps=4, name="ws_bps")
    return dataclasses.replace(spec, extra={"schedule": "wgmma-ws", "producer": "warpgroup", "persistent": 264,
                                            "item_order": "dynamic", **extra})


def test_two_blocks_an_sm_halve_the_registers_and_the_shared_memory():
    """extra blocks_per_sm = 2 (decoding's 64 x 64 tiles at D = 128): launch bounds for two blocks, so a thread
    starts at 128 registers and the setmaxnreg split moves only the block's own half (a consumer's inc past it
    would wait for ever); the block's shared memory at most half the SM's."""
    spec = _decode_spec(64, blocks_per_sm=2)
    emit_fa3_ws.validate_spec(spec)
    src = emit_fa3_ws.emit_fa3_ws_forward(spec)
    threads = emit_fa3_ws.threads_per_block(spec)
    assert "@launch_bounds(256, 2)" in src
    assert _cap_of(src, threads) == emit_fa3_ws.register_cap(spec) == 128
    p, c = emit_fa3_ws.registers(spec)
    assert 128 * p + 128 * c <= threads * 128 < 128 * p + 128 * (c + 8)
    assert f"setmaxnreg_inc({c})" in src
    assert 2 * (emit_fa3_ws.smem_bytes(spec) + emit_fa3_ws.static_bytes(spec) + 1024) <= 228 * 1024
    one = _decode_spec(64)
    assert emit_fa3_ws.register_cap(one) == 255 and "@launch_bounds(256, 1)" in emit_fa3_ws.emit_fa3_ws_forward(one)


@pytest.mark.parametrize("block_k, extra, what", [
    (64, {"blocks_per_sm": 3}, "blocks_per_sm must be 1 or 2"),
    (64, {"blocks_per_sm": True}, "blocks_per_sm must be 1 or 2"),
    (128, {"blocks_per_sm": 2}, r"blocks_per_sm 2: the kernel's 16\d{4} bytes .* exceed 115712"),  # (64 x 128)
    (64, {"blocks_per_sm": 2, "producer": "none", "persistent": 0, "item_order": "grid"}, "needs producer"),
])
def test_two_blocks_an_sm_refused_where_they_cannot_run(block_k, extra, what):
    with pytest.raises(ValueError, match=what):
        emit_fa3_ws.validate_spec(_decode_spec(block_k, **extra))
