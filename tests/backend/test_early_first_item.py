"""The block's own first item sent at its entry (emit_fa3_ws.early_first_item): producer thread 0, right after the
barriers' init, acquires the maps and sends the item's Q and its first K / V tiles before the block's barrier, and
the producer's loop skips exactly those. The simulator runs the form (test_ws_persistent_simulator's cases assert
it was taken); here its place in the emitted kernel and where it is refused. Faked Hopper."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

import falower as fl  # noqa: E402
from falower.backends.numba_cuda import runtime  # noqa: E402
from falower.backends.numba_cuda.emit_fa3_ws import early_first_item, stages  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_script import example_graph  # noqa: E402


@pytest.fixture
def hopper(hopper, monkeypatch):
    """conftest's faked Hopper, holding the H200's clusters (66 of 2, 30 of 4, 15 of 8)."""
    monkeypatch.setattr(runtime, "device_clusters_held", lambda w: {2: 66, 4: 30, 8: 15}[w])


def _kernel(stem: str, extra=None, **dims):
    c = fl.compile(example_graph(stem), extra=extra)
    return c.specialize("f16", **dims)


# decoding in a cluster of 4, decoding's 16 parts on the merge kernel, a small prefill grid, a full one, a softcap
# and the relative bias (score mods without a mask), D = 64 on three consumer warpgroups (192-row tiles)
SHAPES = [("plain", dict(B=2, H=8, M=1, N=1024, D=128)), ("plain", dict(B=1, H=8, M=1, N=8192, D=128)),
          ("plain", dict(B=1, H=8, M=1024, N=1024, D=64)), ("plain", dict(B=4, H=16, M=4096, N=4096, D=128)),
          ("softcap", dict(B=4, H=8, M=1, N=1024, D=128)), ("relative_bias", dict(B=4, H=16, M=4096, N=4096, D=128)),
          ("plain", dict(B=4, H=16, M=4096, N=4096, D=64))]


@pytest.mark.parametrize("name,dims", SHAPES, ids=[f"{n}-{d['M']}x{d['N']}-d{d['D']}-b{d['B']}" for n, d in SHAPES])
def test_the_first_item_goes_out_before_the_block_barrier(hopper, name, dims):
    kern = _kernel(name, extra={"early_first_item": True}, **dims)
    src = kern.source
    assert early_first_item(kern.spec), kern.spec.extra
    body = src[src.index("early = 0"):]
    sync = body.index("cuda.syncthreads()  # the barriers are initialised")
    entry, rest = body[:sync], body[sync:]
    # in thread 0's branch: the last barrier's init, the proxy fence, the three acquires, the item, Q, the K / V tiles
    last_init = entry.rindex("mbar_init(")
    fence = entry.index("fence_proxy_async_smem()")
    acq = [entry.index(f"tensormap_acquire({x}map_g)") for x in "qkv"]
    own = entry.index("it_x = cuda.blockIdx.x")
    q = entry.index("tma_load_4d(q_buf + 0, qmap_g")
    loop = re.search(r"while j <= (\w+) and early < (\d+):", entry)
    assert last_init < fence < acq[0] < acq[1] < acq[2] < own < q < loop.start()
    assert int(loop.group(2)) == stages(kern.spec)
    assert entry.count("mbar_arrive_expect_tx(") == 3 and "mbar_wait(" not in entry  # Q, K, V; every stage free
    # the producer's loop: no acquire, Q only past the first item, a K / V tile only past the ones sent
    assert not re.search(r"tensormap_acquire\([qkv]map_g\)", rest)
    assert re.search(r"if tid == 0:  # Q by TMA.*\n\s+if pq != 0:", rest)
    assert re.search(r"if early > 0:  # this tile went out at entry.*\n\s+early -= 1\n\s+else:\n\s+mbar_wait\(", rest)


@pytest.mark.parametrize("name,extra,why", [("causal", {"early_first_item": True}, "a mask"),
                                            ("document", {"early_first_item": True}, "a block list"),
                                            ("plain", None, "off by default"),
                                            ("plain", {"early_first_item": True, "own_first_item": False}, "tickets"),
                                            ("plain", {"early_first_item": True, "map_prefetch": True}, "prefetched")])
def test_the_first_item_stays_in_the_loop_where_it_is_refused(hopper, name, extra, why):
    """A mask (its tiles skipped or its range scanned and handed over), the knob not asked for (the default: measured
    no faster), every ticket from the counter, or the maps prefetched: the loop sends every item, and the acquires
    are the producer's."""
    kern = _kernel(name, extra=extra, B=1, H=8, M=1024, N=1024, D=128)
    assert not early_first_item(kern.spec), why
    src = kern.source
    assert "fence_proxy_async_smem()" not in src and "early" not in src.replace("early_loads", "")
    assert src.index("tensormap_acquire(qmap_g)") > src.index("cuda.syncthreads()  # the barriers are initialised")


def test_one_consumer_warpgroup_may_keep_the_launch_registers(hopper):
    """setmaxnreg off (extra setmaxnreg False) drops both warpgroups' setmaxnreg where one consumer warpgroup and
    one block an SM already give every thread the most registers; elsewhere (two consumer warpgroups, two blocks an
    SM) the knob is refused by the kernel's need and setmaxnreg stays."""
    from falower.backends.numba_cuda.emit_fa3_ws import uses_setmaxnreg

    dec = _kernel("plain", extra={"setmaxnreg": False}, B=2, H=8, M=1, N=1024, D=128)
    assert dec.spec.block_q == 64 and not uses_setmaxnreg(dec.spec)
    assert "SETMAXNREG" not in dec.source and "ctid = tid - 128" in dec.source
    on = _kernel("plain", B=2, H=8, M=1, N=1024, D=128)
    assert uses_setmaxnreg(on.spec) and "SETMAXNREG_INC()" in on.source and "SETMAXNREG_DEC()" in on.source
    pre = _kernel("plain", extra={"setmaxnreg": False}, B=4, H=16, M=4096, N=4096, D=128)
    assert pre.spec.block_q == 128 and uses_setmaxnreg(pre.spec) and "SETMAXNREG_INC()" in pre.source


def test_the_producer_alone_may_give_registers_back(hopper):
    """setmaxnreg "dec": the producer's dec stays, the consumers' inc goes, on decoding's one consumer warpgroup
    only (two consumer warpgroups need the registers the dec frees)."""
    from falower.backends.numba_cuda.emit_fa3_ws import consumers_raise_registers

    dec = _kernel("plain", extra={"setmaxnreg": "dec"}, B=2, H=8, M=1, N=1024, D=128)
    assert not consumers_raise_registers(dec.spec)
    assert "SETMAXNREG_DEC()" in dec.source and "SETMAXNREG_INC()" not in dec.source
    pre = _kernel("plain", extra={"setmaxnreg": "dec"}, B=4, H=16, M=4096, N=4096, D=128)
    assert consumers_raise_registers(pre.spec) and "SETMAXNREG_INC()" in pre.source
