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
from falower.backends.numba_cuda.from_ir import BackendError, analyse, build_spec  # noqa: E402

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
    with pytest.raises(BackendError, match="the score function says exp2=True, lazy_rescale=8 where the kv loop's "
                                           "online softmax is exp2=True, lazy=0"):
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


@pytest.mark.parametrize("T", [0.5, 8.0])
@pytest.mark.parametrize("stem", ["causal", "document", "softcap"])
def test_lazy_lowering_keeps_the_numbers(stem, T):
    """The interpreter before and after online-softmax{lazy=T} on random inputs whose scores span far more than T
    (q scaled by 20: the max moves past m_i + T on later tiles and stays on others), small tiles, M != N."""
    import numpy as np

    from falower.ir import interpret
    from falower.passes.check import bind_dims, random_inputs

    g = graph(stem)
    low = run_pipeline(g, "decompose-softmax,canonicalize,fuse,tile{bq=8,bk=4},"
                          f"online-softmax{{exp2=true,lazy={T}}},mask-tiles,score-licm,canonicalize")
    env = bind_dims(g, {"B": 2, "H": 2, "M": 37, "N": 29, "D": 8})
    x = random_inputs(g, env, seed=11)
    x[0] = x[0] * 20
    for want, got in zip(interpret(g, x, dims=env), interpret(low, x, dims=env)):
        fin = np.isfinite(want)
        assert np.array_equal(fin, np.isfinite(got))
        scale = max(1.0, np.max(np.abs(want[fin]), initial=0.0))
        assert np.max(np.abs(got[fin] - want[fin]), initial=0.0) <= 1e-9 * scale


def test_a_score_selecting_on_a_given_condition_is_not_the_lazy_select():
    """The lazy select's search met the score's own `where` on a condition the fused region receives (its owner a
    Block, not an op) and raised AttributeError: `where(h % 2 == 0, s, s * 0.5)` failed to compile at all."""
    g = fl.attention(score_mod=lambda s, b, h, q, kv: fl.where(h % 2 == 0, s, s * 0.5), name="half_heads")
    spec = build_spec(analyse(run_pipeline(g, NAMED_PIPELINES["fa2-fwd"])), {"D": 64}, "f16", "mma", None)
    score = spec.device_source.split("def score_fn(")[1].split("\n\n")[0]
    assert "if hz[0] else" in score, score  # the select stays the score's, on the head's condition (per CTA)
    assert "% 2" in spec.device_source.split("def cta_fn(")[1].split("\n\n")[0]
    assert f"def {spec.name}(" in emit_fa2_forward(spec)
