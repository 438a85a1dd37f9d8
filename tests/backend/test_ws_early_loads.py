"""emit_fa3_ws.early_loads: which of the ring's first S - 1 tiles each warpgroup loads before waiting for its Q rows
(the rest right after). The default emits the kernel as it was; each split puts exactly its loads on each side of
the wait, for the right warpgroup; a malformed knob is refused in one line. The simulator runs a split kernel
(ws_sim_cases.py, "ws-none-causal-f16-d64-early10")."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import make_spec  # noqa: E402

from falower.backends.numba_cuda import emit_fa3_ws  # noqa: E402


def _source(extra: dict) -> str:
    spec = make_spec("causal", 128, "f16", path="mma", block_q=128, block_k=128, num_warps=8, name="ws_early")
    spec = dataclasses.replace(spec, extra={"schedule": "wgmma-ws", "producer": "none", **extra})
    return emit_fa3_ws.emit_fa3_ws_forward(spec)


def _loads_around_q_wait(src: str) -> tuple[list[str], list[str]]:
    """The ring loads of the prologue before and after the wait for Q, each as "both", "k" or "v": read off the
    arrays each load block copies (ring_tile's), not off its comment."""
    prologue = src[:src.index("while j <= kv_last:")]
    before, after = prologue.split("# this warpgroup's Q has landed")

    def kinds(part: str) -> list[str]:
        blocks = part.split("if lj <= kv_last:")[1:]
        out = []
        for blk in blocks:
            blk = blk[:blk.index("cp_async_mbar_arrive_noinc(l_full")]
            arrays = set(re.findall(r"ring_tile\(l_dst\w*, (k|v), ", blk))
            out.append({frozenset("kv"): "both", frozenset("k"): "k", frozenset("v"): "v"}[frozenset(arrays)])
        return out
    return kinds(before), kinds(after)


def test_default_is_the_kernel_as_it_was():
    assert _source({}) == _source({"early_loads": "22"})
    assert _loads_around_q_wait(_source({})) == (["both", "both"], [])


@pytest.mark.parametrize("text, before, after", [
    ("11", ["both"], ["both"]),
    ("10", ["k"], ["v", "both"]),
    ("21", ["both", "k"], ["v"]),
    ("01", ["v"], ["k", "both"]),
    ("00", [], ["both", "both"]),
    (1, ["v"], ["k", "both"]),  # bench.py's '-el01' parses to the int 1
    (0, [], ["both", "both"]),
])
def test_split(text, before, after):
    assert _loads_around_q_wait(_source({"early_loads": text})) == (before, after)


@pytest.mark.parametrize("text", ["3", "33", "1x", "222", ""])
def test_refused(text):
    with pytest.raises(ValueError, match="early_loads is two digits"):
        _source({"early_loads": text})


@pytest.mark.parametrize("extra", [{"persistent": 4}, {"producer": "warpgroup"}, {"producer": "warp"}])
def test_a_split_is_refused_where_others_load(extra):
    """A persistent kernel issues the ring's first tiles with the next item's Q and a producer issues them all:
    a split there would leave loads out (a persistent kernel with "01" never loaded K_0 and hung in the
    simulator). Without the knob every kernel is accepted."""
    _source(extra)
    with pytest.raises(ValueError, match="early_loads splits"):
        _source({"early_loads": "01", **extra})
