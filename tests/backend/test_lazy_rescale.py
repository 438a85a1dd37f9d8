"""online-softmax{lazy=T} from the IR to the kernels: the select the pass writes is what the backend reads.

fa2-fwd lowers with lazy=8; the backend takes T from the score function's `lazy_rescale` attribute only where
the kv loop holds the select (found by structure, since later passes may drop value names), and the
warp-specialized kernel alone branches around O's rescale (emit_fa2.skips_unit_rescale)."""

from __future__ import annotations

import dataclasses
import runpy
from pathlib import Path

import pytest

import falower as fl
from falower.errors import PassError
from falower.passes import NAMED_PIPELINES, run_pipeline

pytest.importorskip("numba")

from falower.backends.numba_cuda.emit_fa2 import emit_fa2_forward  # noqa: E402
from falower.backends.numba_cuda.from_ir import BackendError, analyse  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
STEMS = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))


def graph(stem: str) -> fl.Func:
    return next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FALOWER_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize("stem", STEMS)
def test_every_example_lowers_lazy_and_the_kernel_takes_the_select(stem):
    kern = fl.compile(graph(stem), "numba-cuda").specialize("f16", D=64)
    assert kern.spec.lazy_rescale == 8.0
    assert "m_old + np.float32(8.0) else m_old" in kern.source
    assert "if alpha == ONE:" not in kern.source  # the mma.sync kernel multiplies by one
    ws = dataclasses.replace(kern.spec, extra={"schedule": "wgmma-ws", "producer": "none"}, block_k=64)
    if ws.block_mask in ("none", "static"):
        assert "if alpha == ONE:" in emit_fa2_forward(ws)


def test_attribute_without_the_select_is_refused():
    low = run_pipeline(graph("causal"), NAMED_PIPELINES["fa2-fwd"].replace(",lazy=8", ""))
    for op in low.walk():
        if op.name == "fused":
            op.attrs["lazy_rescale"] = 8.0
    with pytest.raises(BackendError, match="no conditional max"):
        analyse(low)


@pytest.mark.parametrize("opts, why", [("lazy=-1", "finite number >= 0"), ("exp2=true,lazy=16", "past f16's largest"),
                                       ("lazy=11", "at most 10.4")])
def test_bad_thresholds_are_refused(opts, why):
    with pytest.raises(PassError, match=why):
        run_pipeline(graph("plain"), f"decompose-softmax,canonicalize,fuse,tile{{bq=8,bk=4}},online-softmax{{{opts}}}")


def test_the_fa1_order_refuses_lazy():
    with pytest.raises(PassError, match="FA2 order"):
        run_pipeline(graph("plain"), "decompose-softmax,canonicalize,fuse,tile{bq=8,bk=4,order=fa1},"
                                     "online-softmax{lazy=8}")
