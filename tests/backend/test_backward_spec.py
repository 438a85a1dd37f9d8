"""The IR side of the backward kernels (no GPU, no simulator): what the kernels are emitted from, and refusals."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytest.importorskip("numba")

import falower as fl  # noqa: E402
from falower.backends.numba_cuda.from_ir import BackendError  # noqa: E402
from falower.backends.numba_cuda.from_ir_bwd import analyse_backward, build_backward_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent


def graph(stem: str):
    return next(v for v in runpy.run_path(str(ROOT / "examples" / f"{stem}.py")).values() if isinstance(v, fl.Func))


def spec(stem: str, pipeline: str = "fa2-bwd", D: int = 64):
    low = analyse_backward(fl.lower(graph(stem), pipeline))
    return build_backward_spec(low, {"D": D}, "f16", "mma", None)


def test_alibi_elementwise_code_comes_from_autodiff():
    """P, dS and the slope's gradient per element are the IR's ops: the scale 1/sqrt(64) in dS, the distance
    (kv - q) multiplying dS for dslopes, reduced over the tile then added at the head's slope."""
    s = spec("alibi")
    assert s.branches == ("full", "partial") and s.block_mask == "static"
    assert [(g.name, g.reduced, g.n_index) for g in s.grads] == [("dslopes", True, 1)]
    src = s.device_source
    full = src[src.index("def elem_full"):src.index("def elem_partial")]
    assert "ex2(" in full and "(dp - delta)" in full and "np.float32(0.125)" in full
    assert "(kv - q)" in full and "cap_slopes[" in full
    assert "def tile_class_fn(b, h, q_lo, q_hi, kv_lo, kv_hi, cap_slopes, dim_M, dim_N)" in src


def test_relative_bias_gradient_is_added_per_element():
    s = spec("relative_bias")
    assert s.branches == ("all",) and s.block_mask == "none"
    assert [(g.name, g.reduced, g.n_index) for g in s.grads] == [("drel_bias", False, 2)]


def test_document_mask_classifies_tiles_from_range_tables():
    """fa2-bwd (tile-bwd's default data=ranges): the document ids' per-granule min / max is a derived capture
    after the sizes, and tile_class_fn bounds doc_id[b, q] and doc_id[b, kv] from it; the kv-outer kernel
    visits the q tiles of each kv tile from a list made from those classes (block_mask "list")."""
    s = spec("document")
    assert s.block_mask == "list"
    assert [c.derived for c in s.captures[3:]] == [("ranges", 0, 1, 64), ("q_count",), ("q_tiles",)]
    assert s.captures[3].ndim == 3
    src = s.device_source
    assert ("def tile_class_fn(b, h, q_lo, q_hi, kv_lo, kv_hi, cap_doc_id, dim_M, dim_N, rng_doc_id_ranges_1_64, "
            "blk_q_count, blk_q_tiles)") in src
    assert "rng_doc_id_ranges_1_64[i0_lo_p0, i0_lo_g0, 0]" in src


def test_document_backward_kernels_walk_their_lists():
    """The kv-outer kernel (both paths) reads its next (head, q tile) from q_tiles, no tile_class_fn call; the
    deterministic dQ kernel walks its kv tiles from kv_tiles; extra bwd_block_list=False keeps the scan."""
    from falower.backends.numba_cuda.emit_fa2_bwd import emit_dq_kernel, emit_fa2_backward

    for path in ("mma", "simt"):
        low = analyse_backward(fl.lower(graph("document"), "fa2-bwd"))
        s = build_backward_spec(low, {"D": 64}, "f16" if path == "mma" else "f32", path, None)
        body = emit_fa2_backward(s).split("def " + s.name + "(")[1]
        assert "cap_5_q_tiles[" in body and "tile_class_fn(" not in body, path
    det = spec("document", "fa2-bwd-deterministic")
    assert [c.derived[0] for c in det.captures[4:]] == ["q_count", "q_tiles", "kv_count", "kv_tiles"]
    dq = emit_dq_kernel(det).split("def " + det.name + "_dqk(")[1]
    assert "cap_7_kv_tiles[" in dq and "tile_class_q_fn(" not in dq
    low = analyse_backward(fl.lower(graph("document"), "fa2-bwd"))
    scan = build_backward_spec(low, {"D": 64}, "f16", "mma", None, {"bwd_block_list": False})
    assert scan.block_mask == "static" and scan.captures[-1].derived[0] == "ranges"
    assert "tile_class_fn(" in emit_fa2_backward(scan).split("def " + scan.name + "(")[1]


def test_document_mask_reads_the_block_table_with_data_table():
    s = spec("document", fl.passes.NAMED_PIPELINES["fa2-bwd"].replace("}", ",data=table}", 1))
    assert s.block_mask == "table" and "def mask_fn(b, h, q, kv, cap_doc_id, dim_M, dim_N)" in s.device_source


def test_gqa_group_and_deterministic_dq_nest():
    s = spec("gqa", "fa2-bwd-deterministic")
    assert s.group_size == 4 and s.dq == "separate" and s.q_branches == ("all",)
    assert "def elemq_all(" in s.device_source


def test_deterministic_stages_per_element_table_gradients():
    """deterministic=true: a table read at per-element indices is staged in shared memory and added in a fixed
    order (no atomics); the reduced ALiBi slope goes through the warps' partial sums."""
    from falower.backends.numba_cuda.emit_fa2_bwd import _staged, emit_fa2_backward

    s = spec("relative_bias", "fa2-bwd-deterministic")
    assert s.deterministic and _staged(s) == [0]
    body = emit_fa2_backward(s).split("@kernel_jit", 1)[1]  # the kernel, not the module's imports
    assert "cuda.atomic.add" not in body and "red_add" not in body and "ga - 1" in body
    assert _staged(spec("alibi", "fa2-bwd-deterministic")) == []


def test_backward_needs_the_fa2_bwd_ir():
    with pytest.raises(BackendError, match="needs the fa2-bwd IR|needs arguments"):
        analyse_backward(fl.lower(graph("causal"), "fa2-fwd"))


def test_a_table_read_at_two_index_forms_is_refused_by_name():
    """bias[h, q, kv] + bias[h, kv, q]: the table's gradient is the sum of two scatters' accumulators, which the
    kernels do not take; the refusal says so in one line (it once said the gradient was not a result), and the
    reference backend runs the graph."""
    bias = fl.capture("bias", "f32", "H,M,N")
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + bias[h, q, kv] + bias[h, kv, q], name="two_forms")
    with pytest.raises(BackendError, match=r"^numba-cuda backend: .* sum of several .*bias\[h, kv, q\].*reference") as e:
        analyse_backward(fl.compile(g, "numba-cuda").lowered_backward)
    assert "\n" not in str(e.value)
    assert fl.compile(g, "reference").gradient_names() == ["dq", "dk", "dv", "dbias"]


def test_a_half_precision_tables_gradient_and_a_table_read_twice_are_refused_by_name():
    """A bf16 table's gradient (the IR casts the f32 sum to bf16) was refused with the two-index-forms text; now it
    says the kernels add in f32. cap[h] * tanh(s / cap[h]) reads one table twice: the sum-of-scatters text names it."""
    t = fl.capture("t", "bf16", "H,N")
    g = fl.attention(score_mod=lambda s, b, h, q, kv: s + t[h, kv], name="bf_table")
    with pytest.raises(BackendError, match=r"^numba-cuda backend: gradient dt is of a bf16 captured table: .*f32"):
        analyse_backward(fl.compile(g, "numba-cuda").lowered_backward)
    cap = fl.capture("cap", "f32", "H")
    g2 = fl.attention(score_mod=lambda s, b, h, q, kv: cap[h] * fl.tanh(s / cap[h]), name="softcap_h")
    with pytest.raises(BackendError, match=r"^numba-cuda backend: .* sum of several .*cap\[h\] twice"):
        analyse_backward(fl.compile(g2, "numba-cuda").lowered_backward)
